// What every session on one worker thread shares: the io_context, the settings, the metric shard.
// Everything here is used from that worker's thread only (the atomics are read by the server).
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "keyguard/config/config.h"
#include "keyguard/config/config_store.h"
#include "keyguard/hygiene/sizes.h"
#include "keyguard/hygiene/traffic.h"
#include "keyguard/hygiene/hot_keys.h"
#include "keyguard/metrics/registry.h"
#include "keyguard/resp/encoder.h"
#include "keyguard/tenant/connections.h"
#include "keyguard/tenant/rewrite.h"
#include "proxy/asio.h"
#include "proxy/refusal.h"

namespace keyguard::proxy {

class Session;
class SizeProbe;

struct Worker {
  // `conns`: the process-wide registry of tenant connections (with tenancy; it outlives the worker).
  Worker(const config::ProxyConfig& c, config::ConfigStore& st, metrics::WorkerShard* s, tcp::endpoint up,
         tenant::Connections* conns = nullptr)
      : io(BOOST_ASIO_CONCURRENCY_HINT_UNSAFE_IO), config(c), store(st), shard(s), upstream(up), connections(conns) {
    Refresh();
    for (size_t r = 0; r < kRefusalCount; ++r) {
      rejected[r] =
          &shard->commands_rejected.Get(std::string("reason=\"") + RefusalName(static_cast<Refusal>(r)) + "\"");
    }
    if (config.tenancy != nullptr) rewriter = std::make_unique<tenant::RequestRewriter>(*config.tenancy, connections);
    if (!config.upstream_auth.password.empty()) {
      std::vector<std::string_view> auth = {"AUTH"};
      if (!config.upstream_auth.user.empty()) auth.push_back(config.upstream_auth.user);
      auth.push_back(config.upstream_auth.password);
      resp::AppendCommand(&upstream_auth, auth);
    }
  }

  // Takes the live snapshot when the store has a new version: one relaxed load per batch.
  void Refresh() {
    const uint64_t v = store.version();
    if (v == live_version) return;
    live = store.Current();
    live_version = v;
    deny.assign(commands::CommandCount(), false);
    for (const std::string& name : live->deny_commands) deny[commands::LookupCommand(name)] = true;
  }

  // Sockets and timers of a worker are used from its thread only, so the reactor's per-socket
  // locks are off (UNSAFE_IO); the scheduler's lock stays, as the control thread posts the drain
  // to this io_context and stops it.
  asio::io_context io;
  const config::ProxyConfig& config;  // settings fixed at start-up
  config::ConfigStore& store;
  std::shared_ptr<const config::ProxyConfig> live;  // reloadable settings (key policy, deny list)
  uint64_t live_version = 0;
  metrics::WorkerShard* shard;
  std::array<metrics::Counter*, kRefusalCount> rejected{};  // keyguard_commands_rejected_total by reason
  tcp::endpoint upstream;
  std::vector<bool> deny;  // by command id, from `live`
  std::unordered_set<std::shared_ptr<Session>> sessions;
  std::atomic<int> session_count{0};
  bool draining = false;
  hygiene::WorkerDetectors hygiene{config.hygiene};  // the detectors' state shared by this worker's sessions
  hygiene::FindingLog* findings = nullptr;
  hygiene::HotKeys hot{config.hygiene};  // hot and big keys; published on hot_timer's ticks
  asio::steady_timer hot_timer{io};
  uint64_t next_session_id = 1;
  int64_t warn_second = 0;  // rate limit of key-policy warn lines
  int warn_count = 0;
  std::shared_ptr<SizeProbe> probe;                   // with hygiene.probe
  tenant::Connections* connections;                   // with tenancy: which tenant each upstream connection serves
  std::unique_ptr<tenant::RequestRewriter> rewriter;  // with tenancy
  std::string upstream_auth;                          // the encoded AUTH for each upstream connection, or empty
  // Tenancy: each tenant's budget of key-walk steps on this worker (a token bucket of
  // walk_steps_per_second, up to one second's worth).
  struct WalkBudget {
    double tokens = 0;
    int64_t at_ns = 0;
  };
  std::unordered_map<const tenant::Tenant*, WalkBudget> walk_budget;
};

// Counts a finding (keyguard_findings_total, keyguard_bigkey_access_total) and hands it to the
// finding log. `f` is complete: key, pattern, command, client and action filled.
void ReportFinding(Worker& worker, hygiene::Finding f);

}  // namespace keyguard::proxy
