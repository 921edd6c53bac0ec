// The proxy's settings: parsed from YAML once, validated with field paths in every message, then
// kept as a plain immutable struct (the hot path never looks at YAML).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "keyguard/hygiene/detectors.h"
#include "keyguard/policy/key_policy.h"
#include "keyguard/resp/framer.h"
#include "keyguard/tenant/tenancy.h"

namespace keyguard::config {
namespace v1 {
class Config;
}

struct HostPort {
  std::string host;
  uint16_t port = 0;
  std::string ToString() const;
};

// Parses "HOST:PORT" or "[v6]:PORT"; `field` names the setting in error messages.
absl::StatusOr<HostPort> ParseHostPort(std::string_view text, std::string_view field);

// Where keyguard forwards to: one server, or the primary of a Sentinel group; over TLS or not.
struct Upstream {
  enum class Kind { kDirect, kSentinel, kCluster };
  Kind kind = Kind::kDirect;
  bool tls = false;                     // rediss:// or rediss-sentinel://
  HostPort address{"127.0.0.1", 6379};  // kDirect: the server
  std::string user;                     // redis://USER@HOST:PORT: the ACL user keyguard AUTHs as
  std::string master;                   // kSentinel: the master name the Sentinels know
  std::vector<HostPort> sentinels;      // kSentinel: every Sentinel, in the order given
  std::vector<HostPort> seeds;          // kCluster: the nodes asked for the slot map, in order
  // The canonical URL ("HOST:PORT" stays as written): no secret is ever part of it.
  std::string ToString() const;
};

// Parses "HOST:PORT", "redis://[USER@]HOST:PORT", "rediss://[USER@]HOST:PORT",
// "redis-sentinel://MASTER@H1:P1,H2:P2" or "rediss-sentinel://...". A password in the URL is
// refused (it belongs in upstream_auth.password_file); `field` names the setting in errors.
absl::StatusOr<Upstream> ParseUpstream(std::string_view text, std::string_view field);

// TLS settings of a connection keyguard makes (the upstream's, the Sentinels'), or of its listener
// (listen_tls: cert_file is keyguard's own, the CAs are those of client certificates).
struct TlsSettings {
  std::string ca_file;               // PEM bundle of trusted CAs; with ca_dir empty too: the system store
  std::string ca_dir;                // a c_rehash'ed directory of CAs
  std::string cert_file;             // client certificate (PEM, chain allowed) for mTLS; with key_file
  std::string key_file;              // its private key (PEM)
  std::string server_name;           // SNI and the name the certificate must match; empty: the host
  bool verify = true;                // verify the chain and the name; off only for tests
  std::string min_version = "1.2";   // "1.2" or "1.3"
  std::string ciphers;               // TLS 1.2 cipher list (OpenSSL syntax); empty: OpenSSL's
  std::string ciphersuites;          // TLS 1.3 cipher suites; empty: OpenSSL's
  bool require_client_cert = false;  // listener only: refuse clients without a verified certificate
  // Whether any field differs from the defaults (set without a TLS upstream is an error).
  bool customized() const;
};

// Credentials keyguard uses with the Sentinels of a redis-sentinel:// upstream.
struct SentinelSettings {
  std::string user;      // ACL user; empty: one-argument AUTH
  std::string password;  // read from password_file; empty: no AUTH
  std::string password_file;
};

struct ProxyConfig {
  HostPort listen{"127.0.0.1", 6380};
  Upstream upstream;
  TlsSettings upstream_tls;         // used when upstream.tls
  SentinelSettings sentinel;        // used when upstream.kind is kSentinel
  bool read_from_replicas = false;  // cluster.read_from: REPLICA_PREFERRED (a cluster upstream)
  TlsSettings listen_tls;           // TLS on the listener when its cert_file is set
  bool ListenTls() const { return !listen_tls.cert_file.empty(); }
  HostPort admin{"127.0.0.1", 9121};
  int threads = 0;  // worker threads; 0 = one per hardware thread
  int upstream_connect_timeout_ms = 2000;
  // Shared upstream connections (upstream_connections: shared): each worker's pipelined
  // connections, and the connected ones it keeps idle for pinned clients. false: dedicated.
  bool shared_upstream = false;
  int shared_connections = 1;
  int pinned_idle_connections = 2;
  int shared_reply_timeout_ms = 30000;     // a shared connection owing a reply, silent this long, closes (0: never)
  int drain_timeout_ms = 10000;            // after SIGTERM, how long in-flight replies may take
  std::vector<std::string> deny_commands;  // lowercase command names refused with an error
  resp::Limits limits;
  int64_t max_pending_commands = 10000;  // per connection: stop reading the client beyond this
  int64_t max_output_buffer = 1 << 20;   // per direction: stop reading the other side beyond this
  int64_t read_buffer_size = 16 * 1024;  // initial read buffer per direction
  // Shared upstream connections: a client over max_output_buffer that takes nothing from its
  // socket for this long is closed.
  int64_t slow_client_grace_ms = 10000;
  hygiene::Settings hygiene;
  // Commands the table does not know: forwarded (and counted) or refused.
  bool reject_unknown_commands = false;
  // Key-name rules; without a config every built-in rule observes.
  std::shared_ptr<const policy::KeyPolicy> key_policy = policy::KeyPolicy::Default();
  // Tenant prefixes; nullptr when tenancy is off. Fixed at start-up.
  std::shared_ptr<const tenant::Tenancy> tenancy;
  // keyguard's own credentials for the upstream.
  tenant::UpstreamAuth upstream_auth;
  // The ACL user keyguard AUTHs as: the URL's (redis://USER@) or upstream_auth.user.
  const std::string& UpstreamUser() const { return upstream.user.empty() ? upstream_auth.user : upstream.user; }
};

// Parses a YAML document against the schema in proto/keyguard/config/v1/config.proto; unknown
// keys, wrong types and invalid values are errors naming the field path.
absl::StatusOr<ProxyConfig> ParseConfig(std::string_view yaml);
absl::StatusOr<ProxyConfig> LoadConfigFile(const std::string& path);
// Turns the schema message into settings, checking ranges and compiling the key policy.
absl::StatusOr<ProxyConfig> Compile(const v1::Config& proto);
// Checks cross-field constraints; returns the first problem with its field path.
absl::Status Validate(const ProxyConfig& config);
// The part of Validate about the upstream and its TLS, Sentinel and user settings.
absl::Status ValidateUpstream(const ProxyConfig& config);

}  // namespace keyguard::config
