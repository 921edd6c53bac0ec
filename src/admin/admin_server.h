// The admin HTTP endpoint (Boost.Beast): /healthz, /readyz, /metrics, /config, /debug/findings,
// /debug/hotkeys, /debug/bigkeys.
#pragma once

#include <atomic>

#include "absl/status/status.h"
#include "keyguard/config/config.h"
#include "keyguard/config/config_store.h"
#include "keyguard/hygiene/hot_keys.h"
#include "keyguard/metrics/registry.h"
#include "proxy/asio.h"
#include "proxy/cluster_watch.h"
#include "proxy/sentinel.h"
#include "proxy/tls.h"

namespace keyguard::admin {

class AdminServer {
 public:
  // Serves on `io` (its own thread); `upstream` is probed by /readyz (over TLS with
  // `upstream_tls`, which may be nullptr), or the primary `sentinel` follows (when not nullptr), or
  // the primaries of `cluster`'s slot map (when not nullptr); `draining` turns /readyz off.
  AdminServer(asio::io_context& io, const metrics::Registry& registry, const config::ProxyConfig& config,
              const config::ConfigStore& store, const hygiene::FindingLog& findings,
              const hygiene::HotKeysBoard& hot_keys, tcp::endpoint upstream, proxy::TlsClient* upstream_tls,
              const proxy::SentinelWatch* sentinel, const std::atomic<bool>& draining,
              const proxy::ClusterWatch* cluster = nullptr);

  // Binds and starts accepting.
  absl::Status Listen();
  tcp::endpoint endpoint() const { return endpoint_; }

 private:
  awaitable<void> Accept();
  awaitable<void> Serve(Socket socket);
  // Connects to the upstream (TLS handshake included) and sends PING; any RESP reply (even
  // -NOAUTH) means reachable. Returns "" when it is, else why not ("unreachable", "TLS: ...").
  awaitable<std::string> ProbeUpstream();
  awaitable<std::string> Probe(tcp::endpoint at, const std::string& host);
  // A cluster: ready when every slot has a primary and one of them answers; else why not.
  awaitable<std::string> ProbeCluster();

  asio::io_context& io_;
  const metrics::Registry& registry_;
  const config::ProxyConfig& config_;
  const config::ConfigStore& store_;
  const hygiene::FindingLog& findings_;
  const hygiene::HotKeysBoard& hot_keys_;
  tcp::endpoint upstream_;
  proxy::TlsClient* upstream_tls_;
  const proxy::SentinelWatch* sentinel_;
  const std::atomic<bool>& draining_;
  const proxy::ClusterWatch* cluster_;
  Acceptor acceptor_;
  tcp::endpoint endpoint_;
};

}  // namespace keyguard::admin
