#include "keyguard/config/config.h"

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "keyguard/commands/command_table.h"
#include "yaml-cpp/yaml.h"

namespace keyguard::config {
namespace {

absl::Status FieldError(absl::string_view path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

absl::Status CheckKeys(const YAML::Node& node, absl::string_view path, const std::set<std::string>& allowed) {
  if (!node.IsMap()) return FieldError(path.empty() ? "(top level)" : path, "expected a mapping");
  for (const auto& kv : node) {
    const std::string key = kv.first.as<std::string>();
    if (!allowed.count(key)) {
      return FieldError(absl::StrCat(path, path.empty() ? "" : ".", key),
                        absl::StrCat("unknown field (known: ", absl::StrJoin(allowed, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status GetInt(const YAML::Node& parent, const std::string& key, absl::string_view path, int64_t min,
                    int64_t max, int64_t* out) {
  const YAML::Node n = parent[key];
  if (!n) return absl::OkStatus();
  const std::string field = absl::StrCat(path, path.empty() ? "" : ".", key);
  int64_t v;
  if (!n.IsScalar() || !absl::SimpleAtoi(n.Scalar(), &v)) return FieldError(field, "expected an integer");
  if (v < min || v > max) return FieldError(field, absl::StrCat("must be between ", min, " and ", max));
  *out = v;
  return absl::OkStatus();
}

absl::Status GetAddress(const YAML::Node& parent, const std::string& key, HostPort* out) {
  const YAML::Node n = parent[key];
  if (!n) return absl::OkStatus();
  if (!n.IsScalar()) return FieldError(key, "expected HOST:PORT");
  auto hp = ParseHostPort(n.Scalar(), key);
  if (!hp.ok()) return hp.status();
  *out = *hp;
  return absl::OkStatus();
}

}  // namespace

std::string HostPort::ToString() const {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

absl::StatusOr<HostPort> ParseHostPort(std::string_view text_in, std::string_view field_in) {
  const absl::string_view text(text_in.data(), text_in.size());
  const absl::string_view field(field_in.data(), field_in.size());
  HostPort hp;
  absl::string_view host, port;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return FieldError(field, absl::StrCat("'", text, "' is not [IPv6]:PORT"));
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) return FieldError(field, absl::StrCat("'", text, "' is not HOST:PORT"));
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  uint32_t p;
  if (host.empty() || !absl::SimpleAtoi(port, &p) || p > 65535) {
    return FieldError(field, absl::StrCat("'", text, "' is not HOST:PORT with a port in 0..65535"));
  }
  hp.host = std::string(host);
  hp.port = static_cast<uint16_t>(p);
  return hp;
}

absl::StatusOr<ProxyConfig> ParseConfig(std::string_view yaml) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("line ", e.mark.line + 1, ", column ", e.mark.column + 1, ": ", e.msg));
  }
  ProxyConfig c;
  if (root.IsNull()) return c;
  if (auto s = CheckKeys(root, "", {"listen", "upstream", "admin", "threads", "upstream_connect_timeout_ms",
                                    "drain_timeout_ms", "deny_commands", "limits"});
      !s.ok()) {
    return s;
  }
  for (const char* key : {"listen", "upstream", "admin"}) {
    HostPort* target = std::string(key) == "listen" ? &c.listen : std::string(key) == "upstream" ? &c.upstream : &c.admin;
    if (auto s = GetAddress(root, key, target); !s.ok()) return s;
  }
  int64_t v = c.threads;
  if (auto s = GetInt(root, "threads", "", 0, 256, &v); !s.ok()) return s;
  c.threads = static_cast<int>(v);
  v = c.upstream_connect_timeout_ms;
  if (auto s = GetInt(root, "upstream_connect_timeout_ms", "", 1, 600000, &v); !s.ok()) return s;
  c.upstream_connect_timeout_ms = static_cast<int>(v);
  v = c.drain_timeout_ms;
  if (auto s = GetInt(root, "drain_timeout_ms", "", 0, 3600000, &v); !s.ok()) return s;
  c.drain_timeout_ms = static_cast<int>(v);

  if (const YAML::Node deny = root["deny_commands"]) {
    if (!deny.IsSequence()) return FieldError("deny_commands", "expected a list of command names");
    for (size_t i = 0; i < deny.size(); ++i) {
      const std::string field = absl::StrCat("deny_commands[", i, "]");
      if (!deny[i].IsScalar() || deny[i].Scalar().empty()) return FieldError(field, "expected a command name");
      const std::string name = absl::AsciiStrToLower(deny[i].Scalar());
      if (commands::LookupCommand(name) == commands::kUnknownCommand) {
        return FieldError(field, absl::StrCat("'", deny[i].Scalar(), "' is not a Redis command"));
      }
      c.deny_commands.push_back(name);
    }
  }
  if (const YAML::Node limits = root["limits"]) {
    if (auto s = CheckKeys(limits, "limits", {"max_bulk_len", "max_multibulk_len", "max_inline_len", "max_depth",
                                              "max_pending_commands", "max_output_buffer", "read_buffer_size"});
        !s.ok()) {
      return s;
    }
    if (auto s = GetInt(limits, "max_bulk_len", "limits", 1, int64_t{1} << 40, &c.limits.max_bulk_len); !s.ok()) return s;
    if (auto s = GetInt(limits, "max_multibulk_len", "limits", 1, 2147483647, &c.limits.max_multibulk_len); !s.ok()) return s;
    v = static_cast<int64_t>(c.limits.max_inline_len);
    if (auto s = GetInt(limits, "max_inline_len", "limits", 16, int64_t{1} << 30, &v); !s.ok()) return s;
    c.limits.max_inline_len = static_cast<size_t>(v);
    v = c.limits.max_depth;
    if (auto s = GetInt(limits, "max_depth", "limits", 1, 4096, &v); !s.ok()) return s;
    c.limits.max_depth = static_cast<int>(v);
    if (auto s = GetInt(limits, "max_pending_commands", "limits", 1, int64_t{1} << 30, &c.max_pending_commands); !s.ok()) return s;
    if (auto s = GetInt(limits, "max_output_buffer", "limits", 4096, int64_t{1} << 40, &c.max_output_buffer); !s.ok()) return s;
    if (auto s = GetInt(limits, "read_buffer_size", "limits", 512, 64 << 20, &c.read_buffer_size); !s.ok()) return s;
  }
  if (auto s = Validate(c); !s.ok()) return s;
  return c;
}

absl::StatusOr<ProxyConfig> LoadConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = ParseConfig(ss.str());
  if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

absl::Status Validate(const ProxyConfig& c) {
  if (c.listen.port == c.admin.port && c.listen.port != 0 && c.listen.host == c.admin.host) {
    return FieldError("admin", "must differ from listen");
  }
  return absl::OkStatus();
}

}  // namespace keyguard::config
