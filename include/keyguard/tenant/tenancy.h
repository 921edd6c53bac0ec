// Tenancy: who the tenants are, how a client becomes one, and the name mapping every stage of
// the per-command path shares (keys, glob patterns, pub/sub channels, keyspace notifications).
//
// A tenant owns every key that starts with its prefix and nothing else. Requests get the prefix
// (src/tenant/request.cc), replies lose it (src/tenant/reply.cc); a reply key without the prefix
// is never shown to the tenant. Prefixes hold no braces, so a key's `{hash tag}` stays the first
// tag of the prefixed key and keys that shared a Redis Cluster slot still share one.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"

namespace keyguard::config::v1 {
class Tenancy;
class TenantUser;
class UpstreamAuth;
}  // namespace keyguard::config::v1

namespace keyguard::tenant {

struct Tenant {
  std::string name;         // metric label
  std::string prefix;       // "tenant:a:"
  std::string glob_prefix;  // the prefix with glob characters escaped, for MATCH and PSUBSCRIBE
};

using Digest = std::array<uint8_t, 32>;

struct User {
  std::string name;
  Digest password_sha256{};
  bool has_password = true;             // false: a certificate-only user, AUTH as it fails
  std::vector<std::string> cert_names;  // client certificate CNs/SANs that log in as this user
  const Tenant* tenant = nullptr;
};

enum class Emulation : uint8_t { kEmulate, kRefuse };
enum class ChannelMode : uint8_t { kPrefix, kShared };

// The compiled `tenancy` config. Immutable; tenants and users live as long as it does.
class Tenancy {
 public:
  // `file_users` are the users read from `users_file` (the config loader reads the file).
  static absl::StatusOr<std::shared_ptr<const Tenancy>> Compile(const config::v1::Tenancy& proto,
                                                                const std::vector<config::v1::TenantUser>& file_users);

  // The tenant of every client (static tenancy), or nullptr when clients must authenticate.
  const Tenant* static_tenant() const { return static_tenant_; }
  bool requires_auth() const { return !users_.empty(); }
  // The user whose name and password match, or nullptr. Compares digests in constant time.
  const User* Authenticate(std::string_view user, std::string_view password) const;
  // The user a verified client certificate logs in as: the first whose cert_names holds one of
  // `names` (the certificate's subject CN and subjectAltNames), or nullptr.
  const User* ForCertificate(const std::vector<std::string>& names) const;
  // Whether any user has cert_names.
  bool has_cert_names() const;
  const std::vector<std::unique_ptr<Tenant>>& tenants() const { return tenants_; }
  const std::vector<User>& users() const { return users_; }

  ChannelMode channels = ChannelMode::kPrefix;
  Emulation flush = Emulation::kEmulate;
  Emulation dbsize = Emulation::kEmulate;
  Emulation randomkey = Emulation::kEmulate;
  uint32_t walk_step_keys = 1000;                      // keys one walk step SCANs
  uint32_t walk_steps_per_second = 250;                // per tenant and worker; 0: no cap
  absl::flat_hash_set<std::string> allowed_scripts;    // lowercase hex SHA1
  absl::flat_hash_set<std::string> allowed_functions;  // as given
  std::vector<std::string> migrate_targets;            // "host:port"

 private:
  std::vector<std::unique_ptr<Tenant>> tenants_;
  std::vector<User> users_;
  const Tenant* static_tenant_ = nullptr;
};

// Credentials for keyguard's own upstream connections.
struct UpstreamAuth {
  std::string user;           // empty: AUTH <password>
  std::string password;       // empty: no AUTH
  std::string password_file;  // where password was read from (read again for new connections), or empty
};
// `password_file_text` is the text of proto.password_file when that is set (the config loader
// reads it, with the same checks as the config file itself); one trailing newline is dropped.
absl::StatusOr<UpstreamAuth> CompileUpstreamAuth(const config::v1::UpstreamAuth& proto,
                                                 std::string_view password_file_text = "");

Digest Sha256(std::string_view data);
std::string Sha1Hex(std::string_view data);
std::string Hex(const uint8_t* data, size_t len);
// Escapes the glob characters * ? [ ] \ with a backslash, as Redis's stringmatchlen reads them.
std::string GlobEscape(std::string_view text);

// Where a pub/sub channel name leads, as the tenant and the server see it.
//   keyspace:  __keyspace@<db>__:<key>   the key part carries the prefix
//   keyevent:  __keyevent@<db>__:<event> shared; the message payload is a key with the prefix
//   invalidate: __redis__:invalidate      shared; the payload is an array of keys (RESP2 tracking)
//   ordinary:  prefixed in ChannelMode::kPrefix, shared in kShared
enum class ChannelKind : uint8_t { kOrdinary, kKeyspace, kKeyevent, kInvalidate };
ChannelKind ClassifyChannel(std::string_view channel);
// Length of "__keyspace@<db>__:" at the start of `channel`, 0 when it has none.
size_t KeyspaceHeadLength(std::string_view channel);
// For a glob pattern: the length of a literal "__keyspace@<digits>__:" head, 0 when the pattern
// has none (no head, or one with glob characters, whose matches need not start with it).
size_t LiteralKeyspaceHead(std::string_view pattern);
// Whether some string matched by `pattern` (as Redis's stringmatchlen matches) may start with
// `prefix`; a character class counts as possibly matching.
bool GlobMayMatchPrefix(std::string_view pattern, std::string_view prefix);

}  // namespace keyguard::tenant
