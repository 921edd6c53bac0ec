// What every session on one worker thread shares: the io_context, the settings, the metric shard.
// Everything here is used from that worker's thread only (the atomics are read by the server).
#pragma once

#include <atomic>
#include <memory>
#include <unordered_set>
#include <vector>

#include "keyguard/config/config.h"
#include "keyguard/metrics/registry.h"
#include "proxy/asio.h"

namespace keyguard::proxy {

class Session;

struct Worker {
  Worker(const config::ProxyConfig& c, metrics::WorkerShard* s, tcp::endpoint up)
      : io(1), config(c), shard(s), upstream(up), deny(commands::CommandCount(), false) {
    for (const std::string& name : c.deny_commands) deny[commands::LookupCommand(name)] = true;
  }

  asio::io_context io;
  const config::ProxyConfig& config;
  metrics::WorkerShard* shard;
  tcp::endpoint upstream;
  std::vector<bool> deny;  // by command id
  std::unordered_set<std::shared_ptr<Session>> sessions;
  std::atomic<int> session_count{0};
  bool draining = false;
  int64_t warn_second = 0;  // rate limit of key-policy warn lines
  int warn_count = 0;
};

}  // namespace keyguard::proxy
