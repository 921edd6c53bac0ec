#include "keyguard/common/field_error.h"
#include "keyguard/config/config.h"

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "keyguard/commands/command_table.h"
#include "config/yaml_proto.h"
#include "keyguard/config/v1/config.pb.h"
#include "yaml-cpp/yaml.h"

namespace keyguard::config {
namespace {

namespace v1 = keyguard::config::v1;

absl::Status CompileHygiene(const v1::Hygiene& h, hygiene::Settings* out) {
  // Rules: the fields of HygieneRules are named after the finding kinds.
  const auto* desc = h.rules().GetDescriptor();
  const auto* refl = h.rules().GetReflection();
  for (size_t k = 0; k < hygiene::kKindCount; ++k) {
    const auto kind = static_cast<hygiene::Kind>(k);
    const auto* field = desc->FindFieldByName(hygiene::KindName(kind));
    if (field == nullptr || !refl->HasField(h.rules(), field)) continue;
    const auto& rule = static_cast<const v1::HygieneRule&>(refl->GetMessage(h.rules(), field));
    const std::string path = absl::StrCat("hygiene.rules.", hygiene::KindName(kind), ".action");
    hygiene::Action a = hygiene::Action::kWarn;
    switch (rule.action()) {
      case v1::OBSERVE: a = hygiene::Action::kObserve; break;
      case v1::REWRITE: a = hygiene::Action::kRewrite; break;
      case v1::REJECT: a = hygiene::Action::kReject; break;
      default: break;
    }
    if (a == hygiene::Action::kRewrite && !hygiene::CanRewrite(kind)) {
      return FieldError(path,
                        "this rule has no rewrite (only del_big_key, flush_without_async, missing_ttl and "
                        "expiry_clustering do)");
    }
    if (a == hygiene::Action::kReject && !hygiene::CanReject(kind)) {
      return FieldError(path,
                        "this finding is only known from the reply, after the command ran: it cannot be rejected");
    }
    out->actions[k] = a;
  }
  switch (h.finding_keys()) {
    case v1::HASHED: out->finding_keys = hygiene::KeyMode::kHashed; break;
    case v1::REDACTED: out->finding_keys = hygiene::KeyMode::kRedacted; break;
    default: break;
  }
  out->findings_file = h.findings_file();
  for (int i = 0; i < h.ttl_patterns_size(); ++i) {
    const v1::TtlPattern& t = h.ttl_patterns(i);
    const std::string path = absl::StrCat("hygiene.ttl_patterns[", i, "]");
    if (t.pattern().empty()) return FieldError(path + ".pattern", "must not be empty");
    out->ttl_patterns.push_back({t.pattern(), t.kind() == v1::SESSION, static_cast<int64_t>(t.default_ttl_s())});
  }
  if (out->action(hygiene::Kind::kMissingTtl) == hygiene::Action::kRewrite) {
    for (size_t i = 0; i < out->ttl_patterns.size(); ++i) {
      if (out->ttl_patterns[i].default_ttl_s <= 0) {
        return FieldError(absl::StrCat("hygiene.ttl_patterns[", i, "].default_ttl_s"),
                          "must be set (> 0) when hygiene.rules.missing_ttl.action is rewrite");
      }
    }
  }
  if (h.has_missing_ttl_window_ms()) out->missing_ttl_window_ms = static_cast<int64_t>(h.missing_ttl_window_ms());
  if (h.has_expiry_cluster_keys()) {
    if (h.expiry_cluster_keys() < 2) return FieldError("hygiene.expiry_cluster_keys", "must be at least 2");
    out->expiry_cluster_keys = static_cast<int64_t>(h.expiry_cluster_keys());
  }
  if (h.has_expiry_cluster_window_ms()) {
    if (h.expiry_cluster_window_ms() < 1000)
      return FieldError("hygiene.expiry_cluster_window_ms", "must be at least 1000");
    out->expiry_cluster_window_ms = static_cast<int64_t>(h.expiry_cluster_window_ms());
  }
  if (h.has_jitter_percent()) {
    if (h.jitter_percent() < 1 || h.jitter_percent() > 100)
      return FieldError("hygiene.jitter_percent", "must be between 1 and 100");
    out->jitter_percent = static_cast<int>(h.jitter_percent());
  }
  if (h.has_probe()) out->probe = h.probe();
  if (h.has_probe_keys_per_second()) {
    if (h.probe_keys_per_second() < 1 || h.probe_keys_per_second() > 10000) {
      return FieldError("hygiene.probe_keys_per_second", "must be between 1 and 10000");
    }
    out->probe_keys_per_second = static_cast<int>(h.probe_keys_per_second());
  }
  if (h.has_size_cache_keys()) {
    if (h.size_cache_keys() < 1 || h.size_cache_keys() > 10000000) {
      return FieldError("hygiene.size_cache_keys", "must be between 1 and 10000000");
    }
    out->size_cache_keys = h.size_cache_keys();
  }
  if (h.has_size_cache_ttl_ms()) out->size_cache_ttl_ms = static_cast<int64_t>(h.size_cache_ttl_ms());
  return absl::OkStatus();
}

absl::Status CompileTls(const v1::Tls& t, const std::string& path, TlsSettings* out) {
  out->ca_file = t.ca_file();
  out->ca_dir = t.ca_dir();
  out->cert_file = t.cert_file();
  out->key_file = t.key_file();
  out->server_name = t.server_name();
  if (t.has_verify()) out->verify = t.verify();
  if (!t.min_version().empty()) {
    if (t.min_version() != "1.2" && t.min_version() != "1.3") {
      return FieldError(path + ".min_version", absl::StrCat("'", t.min_version(), "' is not \"1.2\" or \"1.3\""));
    }
    out->min_version = t.min_version();
  }
  out->ciphers = t.ciphers();
  out->ciphersuites = t.ciphersuites();
  if (out->cert_file.empty() != out->key_file.empty()) {
    return FieldError(path + (out->cert_file.empty() ? ".cert_file" : ".key_file"),
                      "cert_file and key_file go together (a certificate needs its key)");
  }
  return absl::OkStatus();
}

absl::Status CompileListenTls(const v1::ListenTls& t, TlsSettings* out) {
  if (t.ByteSizeLong() == 0) return absl::OkStatus();
  v1::Tls common;
  common.set_ca_file(t.ca_file());
  common.set_ca_dir(t.ca_dir());
  common.set_cert_file(t.cert_file());
  common.set_key_file(t.key_file());
  common.set_min_version(t.min_version());
  common.set_ciphers(t.ciphers());
  common.set_ciphersuites(t.ciphersuites());
  if (auto s = CompileTls(common, "listen_tls", out); !s.ok()) return s;
  if (out->cert_file.empty()) return FieldError("listen_tls.cert_file", "required (keyguard's certificate)");
  out->require_client_cert = t.require_client_cert();
  if (out->require_client_cert && out->ca_file.empty() && out->ca_dir.empty()) {
    return FieldError("listen_tls.require_client_cert", "needs ca_file or ca_dir (the CAs of client certificates)");
  }
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
  v1::Config proto;
  if (auto s = YamlTextToProto(yaml, &proto); !s.ok()) return s;
  return Compile(proto);
}

absl::StatusOr<ProxyConfig> Compile(const v1::Config& p) {
  ProxyConfig c;
  struct Address {
    const std::string& text;
    const char* field;
    HostPort* target;
  };
  for (const Address& a : {Address{p.listen(), "listen", &c.listen}, Address{p.admin(), "admin", &c.admin}}) {
    if (a.text.empty()) continue;
    auto hp = ParseHostPort(a.text, a.field);
    if (!hp.ok()) return hp.status();
    *a.target = *hp;
  }
  if (!p.upstream().empty()) {
    auto u = ParseUpstream(p.upstream(), "upstream");
    if (!u.ok()) return u.status();
    c.upstream = *std::move(u);
  }
  if (auto s = CompileTls(p.upstream_tls(), "upstream_tls", &c.upstream_tls); !s.ok()) return s;
  if (auto s = CompileListenTls(p.listen_tls(), &c.listen_tls); !s.ok()) return s;
  c.sentinel.user = p.sentinel().user();
  if (const std::string& path = p.sentinel().password_file(); !path.empty()) {
    auto text = ReadConfigText(path);
    if (!text.ok()) return FieldError("sentinel.password_file", text.status().message());
    std::string password = *std::move(text);
    while (!password.empty() && (password.back() == '\n' || password.back() == '\r')) password.pop_back();
    if (password.empty()) return FieldError("sentinel.password_file", absl::StrCat(path, " is empty"));
    c.sentinel.password = std::move(password);
    c.sentinel.password_file = path;
  }
  if (!c.sentinel.user.empty() && c.sentinel.password.empty()) {
    return FieldError("sentinel.user", "given without sentinel.password_file");
  }
  auto range = [](const char* field, int64_t v, int64_t lo, int64_t hi) -> absl::Status {
    if (v < lo || v > hi) return FieldError(field, absl::StrCat("must be between ", lo, " and ", hi));
    return absl::OkStatus();
  };
  if (p.has_threads()) {
    if (auto s = range("threads", p.threads(), 0, 256); !s.ok()) return s;
    c.threads = static_cast<int>(p.threads());
  }
  if (p.has_upstream_connect_timeout_ms()) {
    if (auto s = range("upstream_connect_timeout_ms", p.upstream_connect_timeout_ms(), 1, 600000); !s.ok()) return s;
    c.upstream_connect_timeout_ms = static_cast<int>(p.upstream_connect_timeout_ms());
  }
  c.shared_upstream = p.upstream_connections() == v1::Config::SHARED;
  c.read_from_replicas = p.cluster().read_from() == v1::Cluster::REPLICA_PREFERRED;
  if (c.read_from_replicas && c.upstream.kind != Upstream::Kind::kCluster && !p.upstream().empty()) {
    return FieldError("cluster.read_from", "is for a redis-cluster:// upstream");
  }
  if (c.upstream.kind == Upstream::Kind::kCluster) {
    if (p.upstream_connections() == v1::Config::DEDICATED) {
      return FieldError("upstream_connections", "a Redis Cluster upstream is always served with shared connections");
    }
    c.shared_upstream = true;
  }
  if (p.has_shared_connections()) {
    if (auto s = range("shared_connections", p.shared_connections(), 1, 64); !s.ok()) return s;
    c.shared_connections = static_cast<int>(p.shared_connections());
  }
  if (p.has_shared_reply_timeout_ms()) {
    if (auto s = range("shared_reply_timeout_ms", p.shared_reply_timeout_ms(), 0, 86400000); !s.ok()) return s;
    c.shared_reply_timeout_ms = static_cast<int>(p.shared_reply_timeout_ms());
  }
  if (p.has_pinned_idle_connections()) {
    if (auto s = range("pinned_idle_connections", p.pinned_idle_connections(), 0, 1024); !s.ok()) return s;
    c.pinned_idle_connections = static_cast<int>(p.pinned_idle_connections());
  }
  if (p.has_drain_timeout_ms()) {
    if (auto s = range("drain_timeout_ms", p.drain_timeout_ms(), 0, 3600000); !s.ok()) return s;
    c.drain_timeout_ms = static_cast<int>(p.drain_timeout_ms());
  }
  for (int i = 0; i < p.deny_commands_size(); ++i) {
    const std::string field = absl::StrCat("deny_commands[", i, "]");
    const std::string name = absl::AsciiStrToLower(p.deny_commands(i));
    if (commands::LookupCommand(name) == commands::kUnknownCommand) {
      return FieldError(field, absl::StrCat("'", p.deny_commands(i), "' is not a Redis command"));
    }
    c.deny_commands.push_back(name);
  }
  const v1::Limits& l = p.limits();
  if (l.has_max_bulk_len()) {
    if (auto s = range("limits.max_bulk_len", l.max_bulk_len(), 1, int64_t{1} << 40); !s.ok()) return s;
    c.limits.max_bulk_len = l.max_bulk_len();
  }
  if (l.has_max_multibulk_len()) {
    if (auto s = range("limits.max_multibulk_len", l.max_multibulk_len(), 1, 2147483647); !s.ok()) return s;
    c.limits.max_multibulk_len = l.max_multibulk_len();
  }
  if (l.has_max_inline_len()) {
    if (auto s = range("limits.max_inline_len", l.max_inline_len(), 16, int64_t{1} << 30); !s.ok()) return s;
    c.limits.max_inline_len = static_cast<size_t>(l.max_inline_len());
  }
  // limits.max_depth is accepted and ignored: replies nest as deep as the server sends them.
  if (l.has_max_pending_commands()) {
    if (auto s = range("limits.max_pending_commands", l.max_pending_commands(), 1, int64_t{1} << 30); !s.ok()) return s;
    c.max_pending_commands = l.max_pending_commands();
  }
  if (l.has_max_output_buffer()) {
    if (auto s = range("limits.max_output_buffer", l.max_output_buffer(), 4096, int64_t{1} << 40); !s.ok()) return s;
    c.max_output_buffer = l.max_output_buffer();
  }
  if (l.has_read_buffer_size()) {
    if (auto s = range("limits.read_buffer_size", l.read_buffer_size(), 512, 64 << 20); !s.ok()) return s;
    c.read_buffer_size = l.read_buffer_size();
  }
  if (l.has_slow_client_grace_ms()) {
    if (auto s = range("limits.slow_client_grace_ms", l.slow_client_grace_ms(), 100, 86400000); !s.ok()) return s;
    c.slow_client_grace_ms = l.slow_client_grace_ms();
  }
  c.reject_unknown_commands = p.unknown_commands() == v1::REJECT_UNKNOWN;
  const v1::Hygiene& h = p.hygiene();
  if (h.has_enabled()) c.hygiene.enabled = h.enabled();
  if (h.has_big_string_bytes()) c.hygiene.big_string_bytes = h.big_string_bytes();
  if (h.has_huge_string_bytes()) c.hygiene.huge_string_bytes = h.huge_string_bytes();
  if (h.has_big_collection_elements())
    c.hygiene.big_collection_elements = static_cast<int64_t>(h.big_collection_elements());
  if (h.has_rmw_window_ms()) c.hygiene.rmw_window_ms = static_cast<int64_t>(h.rmw_window_ms());
  if (h.has_tracked_keys()) {
    if (auto s = range("hygiene.tracked_keys", static_cast<int64_t>(h.tracked_keys()), 1, 10000000); !s.ok()) return s;
    c.hygiene.tracked_keys = h.tracked_keys();
  }
  if (h.has_findings_kept()) {
    if (auto s = range("hygiene.findings_kept", static_cast<int64_t>(h.findings_kept()), 1, 1000000); !s.ok()) return s;
    c.hygiene.findings_kept = h.findings_kept();
  }
  if (h.has_hot_keys_interval_s()) {
    if (auto s = range("hygiene.hot_keys_interval_s", static_cast<int64_t>(h.hot_keys_interval_s()), 1, 86400); !s.ok())
      return s;
    c.hygiene.hot_keys_interval_s = static_cast<int64_t>(h.hot_keys_interval_s());
  }
  if (h.has_hot_keys_capacity()) {
    if (auto s = range("hygiene.hot_keys_capacity", static_cast<int64_t>(h.hot_keys_capacity()), 0, 65536); !s.ok())
      return s;
    c.hygiene.hot_keys_capacity = h.hot_keys_capacity();
  }
  if (h.has_hot_keys_sample()) {
    if (auto s = range("hygiene.hot_keys_sample", static_cast<int64_t>(h.hot_keys_sample()), 1, 1024); !s.ok())
      return s;
    c.hygiene.hot_keys_sample = static_cast<uint32_t>(h.hot_keys_sample());
  }
  if (auto s = CompileHygiene(h, &c.hygiene); !s.ok()) return s;
  auto policy = policy::KeyPolicy::Compile(p.key_policy());
  if (!policy.ok()) return policy.status();
  c.key_policy = *std::move(policy);
  std::vector<v1::TenantUser> file_users;
  if (const std::string& path = p.tenancy().users_file(); !path.empty()) {
    auto text = ReadConfigText(path);
    if (!text.ok()) return FieldError("tenancy.users_file", text.status().message());
    v1::TenantUsers users;
    if (auto s = YamlTextToProto(*text, &users); !s.ok()) {
      return FieldError("tenancy.users_file", absl::StrCat(path, ": ", s.message()));
    }
    file_users.assign(users.users().begin(), users.users().end());
  }
  auto tenancy = tenant::Tenancy::Compile(p.tenancy(), file_users);
  if (!tenancy.ok()) return tenancy.status();
  c.tenancy = *std::move(tenancy);
  // Read here, like users_file, so a FIFO, a directory or /dev/zero is refused, not read forever.
  std::string password_text;
  if (const std::string& path = p.upstream_auth().password_file(); !path.empty()) {
    auto text = ReadConfigText(path);
    if (!text.ok()) return FieldError("upstream_auth.password_file", text.status().message());
    password_text = *std::move(text);
  }
  auto auth = tenant::CompileUpstreamAuth(p.upstream_auth(), password_text);
  if (!auth.ok()) return auth.status();
  c.upstream_auth = *std::move(auth);
  // A file without `upstream:` may get it from --upstream: main() checks the upstream then.
  if (p.upstream().empty()) {
    ProxyConfig plain = c;
    plain.upstream_tls = TlsSettings();
    plain.sentinel = SentinelSettings();
    if (auto s = Validate(plain); !s.ok()) return s;
  } else if (auto s = Validate(c); !s.ok()) {
    return s;
  }
  return c;
}

absl::StatusOr<ProxyConfig> LoadConfigFile(const std::string& path) {
  auto text = ReadConfigText(path);
  if (!text.ok()) return text.status();
  auto c = ParseConfig(*text);
  if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

absl::Status Validate(const ProxyConfig& c) {
  if (c.listen.port == c.admin.port && c.listen.port != 0 && c.listen.host == c.admin.host) {
    return FieldError("admin", "must differ from listen");
  }
  if (c.tenancy != nullptr && c.tenancy->has_cert_names() &&
      (!c.ListenTls() || (c.listen_tls.ca_file.empty() && c.listen_tls.ca_dir.empty()))) {
    return FieldError("tenancy.users",
                      "cert_names need listen_tls with ca_file or ca_dir (to verify the certificates)");
  }
  return ValidateUpstream(c);
}

absl::Status ValidateUpstream(const ProxyConfig& c) {
  if (!c.upstream.tls && c.upstream_tls.customized()) {
    return FieldError("upstream_tls", absl::StrCat("set, but upstream '", c.upstream.ToString(),
                                                   "' is not TLS (rediss:// or rediss-sentinel://)"));
  }
  if (c.upstream.kind != Upstream::Kind::kSentinel && (!c.sentinel.user.empty() || !c.sentinel.password.empty())) {
    return FieldError("sentinel", absl::StrCat("set, but upstream '", c.upstream.ToString(),
                                               "' is not a Sentinel group (redis-sentinel://)"));
  }
  if (!c.upstream.user.empty()) {
    if (!c.upstream_auth.user.empty() && c.upstream_auth.user != c.upstream.user) {
      return FieldError("upstream_auth.user", absl::StrCat("'", c.upstream_auth.user, "' differs from the user '",
                                                           c.upstream.user, "' in upstream"));
    }
    if (c.upstream_auth.password.empty()) {
      return FieldError("upstream", absl::StrCat("names user '", c.upstream.user,
                                                 "' but no password is set: upstream_auth.password_file"));
    }
  }
  return absl::OkStatus();
}

}  // namespace keyguard::config
