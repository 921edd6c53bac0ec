// A blocking Redis connection for the maintenance commands (audit, migrate): pipelined batches
// over hiredis, and a pacer that holds a command rate. Not for the proxy's data path.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "keyguard/config/config.h"

struct redisContext;

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

class RedisLink {
 public:
  // Connects (and AUTHs with $REDISCLI_AUTH when set, as redis-cli does), then SELECTs `db`.
  static absl::StatusOr<std::unique_ptr<RedisLink>> Connect(const config::HostPort& where, int db = 0);
  // The same for a configured upstream: plain TCP only (a TLS or Sentinel upstream is an error).
  static absl::StatusOr<std::unique_ptr<RedisLink>> Connect(const config::Upstream& upstream, int db = 0);
  // A Redis Cluster upstream (redis-cluster://): its primaries, in the order of their first slot
  // (as keyguard's SCAN cursor numbers them), from the first seed that answers CLUSTER SLOTS.
  static absl::StatusOr<std::vector<config::HostPort>> ClusterPrimaries(const config::Upstream& upstream);
  ~RedisLink();
  RedisLink(const RedisLink&) = delete;
  RedisLink& operator=(const RedisLink&) = delete;

  // Sends every command in one write and reads one reply per command, in order. A Redis error
  // is a reply (Kind::kError); only I/O and protocol failures are a non-ok status.
  absl::StatusOr<std::vector<Reply>> Pipeline(const std::vector<Command>& commands);
  absl::StatusOr<Reply> Call(const Command& command);

 private:
  explicit RedisLink(redisContext* c) : c_(c) {}
  redisContext* c_;
};

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
