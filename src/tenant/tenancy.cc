#include "keyguard/tenant/tenancy.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "keyguard/common/field_error.h"
#include "keyguard/config/v1/config.pb.h"

namespace keyguard::tenant {
namespace {

namespace v1 = keyguard::config::v1;

absl::Status CheckPrefix(const std::string& prefix, const std::string& field) {
  if (prefix.empty()) return FieldError(field, "must not be empty");
  for (char c : prefix) {
    if (c == '{' || c == '}') {
      return FieldError(field,
                        "must not contain braces: a key's {hash tag} must stay its own so keys that "
                        "share a cluster slot keep sharing it");
    }
    if (static_cast<unsigned char>(c) < 0x20 || c == ' ')
      return FieldError(field, "must not contain spaces or control bytes");
  }
  return absl::OkStatus();
}

std::string DefaultName(const std::string& prefix) {
  std::string n = prefix;
  while (!n.empty() && n.back() == ':') n.pop_back();
  return n.empty() ? prefix : n;
}

bool ParseHexDigest(std::string_view hex, Digest* out) {
  if (hex.size() != 64) return false;
  for (size_t i = 0; i < 32; ++i) {
    int v = 0;
    for (int j = 0; j < 2; ++j) {
      const char c = absl::ascii_tolower(hex[i * 2 + j]);
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return false;
      v = v * 16 + d;
    }
    (*out)[i] = static_cast<uint8_t>(v);
  }
  return true;
}

}  // namespace

std::string Hex(const uint8_t* data, size_t len) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(len * 2, '0');
  for (size_t i = 0; i < len; ++i) {
    s[i * 2] = kDigits[data[i] >> 4];
    s[i * 2 + 1] = kDigits[data[i] & 15];
  }
  return s;
}

Digest Sha256(std::string_view data) {
  Digest d{};
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), d.data(), &len, EVP_sha256(), nullptr);
  return d;
}

std::string Sha1Hex(std::string_view data) {
  uint8_t d[20];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), d, &len, EVP_sha1(), nullptr);
  return Hex(d, sizeof d);
}

std::string GlobEscape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

size_t KeyspaceHeadLength(std::string_view channel) {
  constexpr std::string_view kHead = "__keyspace@";
  if (channel.substr(0, kHead.size()) != kHead) return 0;
  const size_t end = channel.find("__:", kHead.size());
  return end == std::string_view::npos ? 0 : end + 3;
}

size_t LiteralKeyspaceHead(std::string_view pattern) {
  constexpr std::string_view kHead = "__keyspace@";
  if (!pattern.starts_with(kHead)) return 0;
  size_t i = kHead.size();
  while (i < pattern.size() && pattern[i] >= '0' && pattern[i] <= '9') ++i;
  if (i == kHead.size() || pattern.substr(i, 3) != "__:") return 0;
  return i + 3;
}

bool GlobMayMatchPrefix(std::string_view pattern, std::string_view prefix) {
  size_t p = 0;
  for (const char c : prefix) {
    if (p >= pattern.size()) return false;  // the match ends before the prefix does
    switch (pattern[p]) {
      case '*':
      case '[': return true;
      case '?': ++p; break;
      case '\\':
        if (p + 1 < pattern.size()) ++p;  // an escaped character; a trailing '\\' is itself
        [[fallthrough]];
      default:
        if (pattern[p] != c) return false;
        ++p;
    }
  }
  return true;
}

ChannelKind ClassifyChannel(std::string_view channel) {
  if (KeyspaceHeadLength(channel) != 0) return ChannelKind::kKeyspace;
  if (channel.substr(0, 11) == "__keyevent@") return ChannelKind::kKeyevent;
  if (channel == "__redis__:invalidate") return ChannelKind::kInvalidate;
  return ChannelKind::kOrdinary;
}

absl::StatusOr<std::shared_ptr<const Tenancy>> Tenancy::Compile(const v1::Tenancy& p,
                                                                const std::vector<v1::TenantUser>& file_users) {
  auto t = std::make_shared<Tenancy>();
  std::vector<std::pair<const v1::TenantUser*, std::string>> users;  // with field paths
  for (int i = 0; i < p.users_size(); ++i) users.emplace_back(&p.users(i), absl::StrCat("tenancy.users[", i, "]"));
  for (size_t i = 0; i < file_users.size(); ++i) {
    users.emplace_back(&file_users[i], absl::StrCat("tenancy.users_file: users[", i, "]"));
  }
  if (!p.prefix().empty() && !users.empty()) {
    return FieldError("tenancy.prefix", "static tenancy and users exclude each other: set one of them");
  }
  if (p.prefix().empty() && users.empty()) {
    if (!p.name().empty()) return FieldError("tenancy.name", "needs tenancy.prefix");
    return std::shared_ptr<const Tenancy>();  // tenancy off
  }
  auto tenant_for = [&](const std::string& prefix, const std::string& name) -> Tenant* {
    for (auto& existing : t->tenants_) {
      if (existing->prefix == prefix) return existing.get();
    }
    auto n = std::make_unique<Tenant>();
    n->prefix = prefix;
    n->glob_prefix = GlobEscape(prefix);
    n->name = name.empty() ? DefaultName(prefix) : name;
    t->tenants_.push_back(std::move(n));
    return t->tenants_.back().get();
  };
  if (!p.prefix().empty()) {
    if (auto s = CheckPrefix(p.prefix(), "tenancy.prefix"); !s.ok()) return s;
    t->static_tenant_ = tenant_for(p.prefix(), p.name());
  }
  for (const auto& [u, path] : users) {
    if (u->name().empty()) return FieldError(path + ".name", "must not be empty");
    for (const User& other : t->users_) {
      if (other.name == u->name())
        return FieldError(path + ".name", absl::StrCat("user '", u->name(), "' is listed twice"));
    }
    if (auto s = CheckPrefix(u->prefix(), path + ".prefix"); !s.ok()) return s;
    User user;
    user.name = u->name();
    if (!u->password_sha256().empty()) {
      if (!u->password().empty()) return FieldError(path + ".password", "set password or password_sha256, not both");
      if (!ParseHexDigest(u->password_sha256(), &user.password_sha256)) {
        return FieldError(path + ".password_sha256", "must be 64 hex digits (sha256sum of the password)");
      }
    } else if (!u->password().empty()) {
      user.password_sha256 = Sha256(u->password());
    } else if (u->cert_names_size() > 0) {
      user.has_password = false;
    } else {
      return FieldError(path + ".password_sha256",
                        "a user needs a password (password_sha256 or password) or cert_names");
    }
    for (int i = 0; i < u->cert_names_size(); ++i) {
      const std::string& n = u->cert_names(i);
      const std::string field = absl::StrCat(path, ".cert_names[", i, "]");
      if (n.empty()) return FieldError(field, "must not be empty");
      for (const User& other : t->users_) {
        if (absl::c_linear_search(other.cert_names, n)) {
          return FieldError(field, absl::StrCat("'", n, "' already names user '", other.name, "'"));
        }
      }
      user.cert_names.push_back(n);
    }
    user.tenant = tenant_for(u->prefix(), u->tenant());
    if (!u->tenant().empty() && user.tenant->name != u->tenant()) {
      return FieldError(path + ".tenant",
                        absl::StrCat("prefix '", u->prefix(), "' already belongs to tenant '", user.tenant->name, "'"));
    }
    t->users_.push_back(std::move(user));
  }
  // One tenant's prefix must not begin another's: "tenant:a:" would see every key of "tenant:a:b:".
  for (const auto& a : t->tenants_) {
    for (const auto& b : t->tenants_) {
      if (a != b && b->prefix.size() >= a->prefix.size() && b->prefix.compare(0, a->prefix.size(), a->prefix) == 0) {
        return FieldError("tenancy", absl::StrCat("prefix '", a->prefix, "' begins prefix '", b->prefix, "': tenant '",
                                                  a->name, "' would see tenant '", b->name, "''s keys"));
      }
    }
    for (const auto& b : t->tenants_) {
      if (a != b && a->name == b->name)
        return FieldError("tenancy", absl::StrCat("two prefixes share tenant name '", a->name, "'"));
    }
  }
  t->channels = p.channels() == v1::SHARED ? ChannelMode::kShared : ChannelMode::kPrefix;
  t->flush = p.flush() == v1::REFUSE ? Emulation::kRefuse : Emulation::kEmulate;
  t->dbsize = p.dbsize() == v1::REFUSE ? Emulation::kRefuse : Emulation::kEmulate;
  t->randomkey = p.randomkey() == v1::REFUSE ? Emulation::kRefuse : Emulation::kEmulate;
  if (p.has_walk_step_keys()) {
    if (p.walk_step_keys() == 0 || p.walk_step_keys() > 100000) {
      return FieldError("tenancy.walk_step_keys", "must be between 1 and 100000");
    }
    t->walk_step_keys = p.walk_step_keys();
  }
  if (p.has_walk_steps_per_second()) t->walk_steps_per_second = p.walk_steps_per_second();
  for (int i = 0; i < p.allowed_scripts_size(); ++i) {
    const std::string sha = absl::AsciiStrToLower(p.allowed_scripts(i));
    bool hex = sha.size() == 40;
    for (char c : sha) hex = hex && absl::ascii_isxdigit(c);
    if (!hex) return FieldError(absl::StrCat("tenancy.allowed_scripts[", i, "]"), "must be a 40-digit hex SHA1");
    t->allowed_scripts.insert(sha);
  }
  for (const std::string& f : p.allowed_functions()) t->allowed_functions.insert(f);
  for (const std::string& m : p.migrate_targets()) t->migrate_targets.push_back(m);
  return std::shared_ptr<const Tenancy>(std::move(t));
}

const User* Tenancy::Authenticate(std::string_view user, std::string_view password) const {
  const Digest d = Sha256(password);
  for (const User& u : users_) {
    if (u.name == user) {
      return u.has_password && CRYPTO_memcmp(d.data(), u.password_sha256.data(), d.size()) == 0 ? &u : nullptr;
    }
  }
  return nullptr;
}

const User* Tenancy::ForCertificate(const std::vector<std::string>& names) const {
  for (const User& u : users_) {
    for (const std::string& n : names) {
      if (absl::c_linear_search(u.cert_names, n)) return &u;
    }
  }
  return nullptr;
}

bool Tenancy::has_cert_names() const {
  return absl::c_any_of(users_, [](const User& u) { return !u.cert_names.empty(); });
}

absl::StatusOr<UpstreamAuth> CompileUpstreamAuth(const v1::UpstreamAuth& p, std::string_view password_file_text) {
  UpstreamAuth a;
  a.user = p.user();
  if (!p.password().empty() && !p.password_file().empty()) {
    return FieldError("upstream_auth.password_file", "set password or password_file, not both");
  }
  a.password = p.password();
  if (!p.password_file().empty()) {
    a.password = std::string(password_file_text);
    a.password_file = p.password_file();
    while (!a.password.empty() && (a.password.back() == '\n' || a.password.back() == '\r')) a.password.pop_back();
    if (a.password.empty())
      return FieldError("upstream_auth.password_file", absl::StrCat(p.password_file(), " is empty"));
  }
  if (a.password.empty() && !a.user.empty())
    return FieldError("upstream_auth.password", "user given without a password");
  return a;
}

}  // namespace keyguard::tenant
