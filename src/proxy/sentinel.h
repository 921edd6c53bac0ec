// The primary of a Sentinel group (upstream redis-sentinel://MASTER@H1:P1,...): found by asking
// the Sentinels, checked with ROLE, and followed across failovers.
//
// Resolve() asks each Sentinel in turn (SENTINEL GET-MASTER-ADDR-BY-NAME) and keeps the first
// answer whose server says ROLE master. Start() then follows the group on the control thread:
// one connection subscribed to +switch-master on a Sentinel (the next one in the list when it
// fails), a re-check every second-or-so, and a re-check soon after Recheck() (a worker failed to
// connect to the primary). When the primary moved, `on_change` gets the new one: the workers send
// new client connections there and close their open sessions once their replies are delivered.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "keyguard/config/config.h"
#include "proxy/asio.h"
#include "proxy/stream.h"
#include "proxy/credentials.h"
#include "proxy/tls.h"

namespace keyguard::proxy {

struct Primary {
  std::string host;  // as the Sentinels announce it (usually an IP address)
  uint16_t port = 0;
  tcp::endpoint endpoint;
  std::string ToString() const { return config::HostPort{host, port}.ToString(); }
};

class SentinelWatch {
 public:
  using OnChange = std::function<void(const Primary&)>;
  // `tls`: the upstream's TLS (rediss-sentinel://), also used with the Sentinels; may be nullptr.
  // `credentials`: keyguard's upstream password for the ROLE check (it may rotate).
  SentinelWatch(asio::io_context& io, const config::ProxyConfig& config, TlsClient* tls,
                UpstreamCredentials* credentials);

  // Finds the primary now; an error says what each Sentinel answered.
  awaitable<absl::StatusOr<Primary>> Resolve();
  // Follows the group from `first` on; `on_change` runs on the io_context's thread.
  void Start(Primary first, OnChange on_change);
  // Asks for a re-check soon; any thread.
  void Recheck();
  // The primary now (any thread).
  Primary current() const;
  uint64_t failovers() const { return failovers_.load(std::memory_order_relaxed); }

 private:
  awaitable<void> Follow();
  awaitable<void> Poll();
  void Adopt(const Primary& p);
  awaitable<absl::StatusOr<Primary>> Ask(const config::HostPort& sentinel);
  awaitable<absl::Status> Verify(const Primary& p);

  asio::io_context& io_;
  const config::ProxyConfig& config_;
  TlsClient* tls_;
  UpstreamCredentials* credentials_;
  UpstreamCredentials sentinel_auth_;  // sentinel.user and sentinel.password_file, which may rotate
  OnChange on_change_;
  mutable std::mutex mu_;
  Primary current_;
  std::atomic<uint64_t> failovers_{0};
  std::atomic<bool> recheck_{false};
  Timer poll_timer_;
};

}  // namespace keyguard::proxy
