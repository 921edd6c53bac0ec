// The slot map of a Redis Cluster upstream (redis-cluster://H1:P1,H2:P2): asked of the seeds and
// then of the known primaries (CLUSTER SLOTS), on the control thread. Start() keeps it fresh: a
// refresh every few seconds, and one soon after Refresh() (a worker saw MOVED, or could not reach a
// node). A changed map goes to `on_change` (the workers adopt it).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "keyguard/config/config.h"
#include "proxy/asio.h"
#include "proxy/cluster_map.h"
#include "proxy/credentials.h"
#include "proxy/tls.h"

namespace keyguard::proxy {

// Where to connect to node `n`: its address (as announced, or as ClusterWatch resolved its name),
// or nullopt for a name ClusterWatch could not resolve.
inline std::optional<tcp::endpoint> NodeEndpoint(const cluster::Node& n) {
  error_code ec;
  const auto ip = asio::ip::make_address(n.address(), ec);
  if (ec) return std::nullopt;
  return tcp::endpoint(ip, n.port);
}

class ClusterWatch {
 public:
  using OnChange = std::function<void(std::shared_ptr<const cluster::SlotMap>)>;
  ClusterWatch(asio::io_context& io, const config::ProxyConfig& config, TlsClient* tls,
               UpstreamCredentials* credentials);

  // Asks the known primaries, then the seeds, until one answers with a map; an error says what
  // each answered.
  awaitable<absl::StatusOr<std::shared_ptr<const cluster::SlotMap>>> Resolve();
  // Keeps the map fresh from `first` on; `on_change` runs on the io_context's thread.
  void Start(std::shared_ptr<const cluster::SlotMap> first, OnChange on_change);
  // Asks for a refresh soon; any thread. The first poke of a wait wakes it (a post to io_).
  void Refresh() {
    refresh_.store(true);
    if (!poke_.exchange(true)) asio::post(io_, [this] { wake_.cancel(); });
  }
  std::shared_ptr<const cluster::SlotMap> current() const;
  uint64_t refreshes() const { return refreshes_.load(std::memory_order_relaxed); }
  uint64_t changes() const { return changes_.load(std::memory_order_relaxed); }

 private:
  awaitable<absl::StatusOr<std::shared_ptr<const cluster::SlotMap>>> Ask(const config::HostPort& node);
  awaitable<void> Poll();

  asio::io_context& io_;
  const config::ProxyConfig& config_;
  TlsClient* tls_;
  UpstreamCredentials* credentials_;
  OnChange on_change_;
  mutable std::mutex mu_;
  std::shared_ptr<const cluster::SlotMap> current_;
  std::atomic<bool> refresh_{false};
  std::atomic<bool> poke_{false};  // a refresh is asked for (Poll clears it when it starts one)
  Timer wake_{io_};                // Poll's wait for kPollEvery, cancelled by Refresh
  std::atomic<uint64_t> refreshes_{0};
  std::atomic<uint64_t> changes_{0};
};

}  // namespace keyguard::proxy
