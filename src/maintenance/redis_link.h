// Blocking Redis connections for the maintenance commands (audit, migrate): pipelined batches
// over a socket of their own (plain TCP or TLS through the proxy's TlsClient), replies parsed by
// hiredis's redisReader; the upstream reached as the proxy reaches it (TLS, AUTH, a Sentinel
// group's primary, a cluster's primaries); and a pacer that holds a command rate. Not for the
// proxy's data path.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "keyguard/config/config.h"

typedef struct ssl_st SSL;

struct redisReader;

namespace keyguard::proxy {
class TlsClient;
class TlsContext;
}  // namespace keyguard::proxy

namespace keyguard::maintenance {

// One reply, owned (copied out of hiredis's reply tree).
struct Reply {
  enum class Kind : uint8_t { kNil, kInteger, kString, kStatus, kError, kArray };
  Kind kind = Kind::kNil;
  int64_t integer = 0;
  std::string str;  // string, status or error text
  std::vector<Reply> elements;

  bool is_error() const { return kind == Kind::kError; }
  bool is_nil() const { return kind == Kind::kNil; }
};

using Command = std::vector<std::string>;

// How a link reaches its server: over TLS or not, and the AUTH it sends first.
struct LinkOptions {
  std::shared_ptr<proxy::TlsClient> tls;            // nullptr: plain TCP
  std::string user;                                 // empty: one-argument AUTH
  std::string password;                             // empty: no AUTH
  std::chrono::milliseconds connect_timeout{5000};  // connecting and the TLS handshake
  std::chrono::milliseconds io_timeout{60000};      // one read or write; longer is a stuck server
};

// A Redis Cluster's primaries and which one owns each slot.
struct ClusterLayout {
  static constexpr uint16_t kNoOwner = 0xFFFF;
  std::vector<config::HostPort> primaries;
  std::vector<uint16_t> owner = std::vector<uint16_t>(16384, kNoOwner);  // index into primaries
};

class RedisLink {
 public:
  // Connects to `where` (TLS when options.tls: the name verified is tls->NameFor(host)), AUTHs
  // when options.password is set, then SELECTs `db`. Errors start with `where`, e.g.
  // "127.0.0.1:6390: TLS: certificate verify failed: self-signed certificate in certificate chain".
  static absl::StatusOr<std::unique_ptr<RedisLink>> Connect(const config::HostPort& where, const LinkOptions& options,
                                                            int db = 0);
  ~RedisLink();
  RedisLink(const RedisLink&) = delete;
  RedisLink& operator=(const RedisLink&) = delete;

  // Sends every command in one write and reads one reply per command, in order. A Redis error
  // is a reply (Kind::kError); only I/O and protocol failures are a non-ok status.
  absl::StatusOr<std::vector<Reply>> Pipeline(const std::vector<Command>& commands);
  absl::StatusOr<Reply> Call(const Command& command);
  // The server's HOST:PORT (for a Sentinel group: the primary's).
  const std::string& address() const { return address_; }

 private:
  friend class UpstreamLinks;
  // Connect, with errors starting with `name` ("upstream rediss://HOST:PORT" for the upstream).
  static absl::StatusOr<std::unique_ptr<RedisLink>> Open(const config::HostPort& where, const LinkOptions& options,
                                                         int db, std::string name);
  RedisLink(std::string address, std::string where, int fd);
  absl::Status SetTimeouts(std::chrono::milliseconds timeout);
  absl::Status Handshake(proxy::TlsClient& tls, const std::string& host);
  // After the handshake: waits up to `timeout` for the server's first TLS records and reads them
  // (session tickets; an alert is the error). Nothing within `timeout` is no error.
  absl::Status AwaitServer(std::chrono::milliseconds timeout);
  // Writes all of `data`; reads at least one byte into `buf`. Errors start with where_.
  absl::Status WriteAll(const std::string& data);
  absl::StatusOr<size_t> ReadSome(char* buf, size_t size);
  // The error of the TLS call that returned `rc`; `timed_out` is the text for a timeout.
  absl::Status TlsError(int rc, std::string_view timed_out);

  std::string address_;
  std::string where_;  // what errors start with
  int fd_;
  std::chrono::milliseconds io_timeout_{0};
  std::shared_ptr<proxy::TlsContext> context_;  // kept while the connection lives
  SSL* ssl_ = nullptr;                          // owned; nullptr: plain TCP
  bool closed_ = false;                         // TLS: the server closed or reset the connection
  redisReader* reader_;                         // owned
};

// The upstream of audit and migrate, reached as the proxy reaches it: TLS with upstream_tls for
// rediss://, rediss-sentinel:// (the Sentinels too) and rediss-cluster://; AUTH as the user of the
// URL or upstream_auth.user, with $REDISCLI_AUTH (as redis-cli) or else upstream_auth's password;
// the Sentinels with sentinel.user and sentinel.password_file.
class UpstreamLinks {
 public:
  // Checks the upstream against its settings (as the proxy does) and loads the TLS files; errors
  // name the field ("upstream_tls.ca_file: ...").
  static absl::StatusOr<UpstreamLinks> Create(const config::ProxyConfig& config);

  // The server: a direct upstream's address, or the primary a Sentinel names (asked in order,
  // SENTINEL GET-MASTER-ADDR-BY-NAME, kept when its ROLE is master). SELECTs `db`. Errors start
  // with "upstream <url>: ". Not for a cluster (ClusterPrimaries, then ConnectNode).
  absl::StatusOr<std::unique_ptr<RedisLink>> Connect(int db);
  // One node of the upstream (a cluster primary), with its TLS and AUTH.
  absl::StatusOr<std::unique_ptr<RedisLink>> ConnectNode(const config::HostPort& node, int db);
  // A Redis Cluster upstream (redis-cluster://, rediss-cluster://): its primaries and which owns
  // each slot, from the first seed that answers CLUSTER SLOTS.
  absl::StatusOr<ClusterLayout> ClusterSlots();

 private:
  absl::StatusOr<std::unique_ptr<RedisLink>> SentinelPrimary(int db);

  config::Upstream upstream_;
  LinkOptions server_;    // the server, a cluster's nodes, a Sentinel group's primary
  LinkOptions sentinel_;  // the Sentinels
};

// The primary in a Sentinel's answer to SENTINEL GET-MASTER-ADDR-BY-NAME ([host, port]), or
// nullopt for anything else (nil: the Sentinel does not know the master).
std::optional<config::HostPort> PrimaryFromSentinel(const Reply& reply);
// The primaries in a CLUSTER SLOTS reply, each once, in the order of their addresses (host, then
// port: as keyguard's SCAN cursor numbers them, and stable across a reshard), and each slot's
// owner; an empty host is `seed_host` (the node answered with its own address unknown).
ClusterLayout LayoutFromSlots(const Reply& slots, const std::string& seed_host);

// A cluster's resume cursor is NUMBER-TAG: NUMBER numbers the node as keyguard's SCAN does (an
// index into the primaries in address order), TAG is 8 hex digits of a hash of those primaries'
// addresses, so that a cursor printed before a failover or a node added or removed is refused
// rather than resumed at another node (skipping keys).
std::string LayoutTag(const std::vector<config::HostPort>& primaries);
// `cursor` split into the number and the tag ("" without one).
std::pair<std::string, std::string> SplitCursor(const std::string& cursor);
// Why a cluster resume cursor (tag `tag`, node `node`) cannot be resumed against `primaries`;
// "" when it can. "0" (from the start) always can.
std::string StaleCursor(const std::string& number, const std::string& tag,
                        const std::vector<config::HostPort>& primaries);

// Spaces out commands so that on average at most `per_second` are sent per second (0: no cap).
class Pacer {
 public:
  explicit Pacer(uint32_t per_second) : per_second_(per_second), start_(std::chrono::steady_clock::now()) {}
  // Call before sending `n` commands: sleeps until sending them keeps the average under the cap.
  void Before(size_t n);

 private:
  uint32_t per_second_;
  std::chrono::steady_clock::time_point start_;
  uint64_t sent_ = 0;
};

}  // namespace keyguard::maintenance
