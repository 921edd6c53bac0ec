#include "keyguard/proxy/server.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "admin/admin_server.h"
#include "keyguard/commands/command_table.h"
#include "keyguard/hygiene/detectors.h"
#include "keyguard/hygiene/hot_keys.h"
#include "keyguard/policy/key_pattern.h"
#include "keyguard/resp/framer.h"
#include "proxy/sentinel.h"
#include "proxy/cluster_client.h"
#include "proxy/cluster_watch.h"
#include "proxy/control_link.h"
#include "proxy/session.h"
#include "proxy/session_pump.h"
#include "proxy/size_probe.h"
#include "proxy/worker.h"

namespace keyguard::proxy {
namespace {

awaitable<void> Accept(Worker& worker, Acceptor& acceptor) {
  for (;;) {
    error_code ec;
    Socket socket = co_await acceptor.async_accept(AwaitEc(ec));
    if (ec) {
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) co_return;
      // Out of descriptors or a connection reset before accept: keep serving the others.
      Timer pause(worker.io, std::chrono::milliseconds(10));
      co_await pause.async_wait(AwaitEc(ec));
      continue;
    }
    if (worker.draining) continue;  // the socket closes as it goes out of scope
    auto session = std::make_shared<Session>(worker, std::move(socket));
    worker.sessions.insert(session);
    session->Start();
  }
}

// Each tick publishes the worker's hot and big keys (and closes the interval when it is due).
void TickHotKeys(Worker& w, std::chrono::milliseconds period) {
  w.hot.Tick(NowNs());
  w.hot_timer.expires_after(period);
  w.hot_timer.async_wait([&w, period](error_code ec) {
    if (!ec) TickHotKeys(w, period);
  });
}

// Each second: upstream connections that owe replies and have been silent are asked whether the
// server closed them (Session::CheckUpstream), and clients that are not read whether they hung up
// (Session::ClientHungUp).
void TickLiveness(Worker& w) {
  const int64_t now = NowNs();
  std::vector<std::shared_ptr<Session>> hung_up;  // (closing one takes it out of w.sessions)
  for (const auto& s : w.sessions) {
    s->CheckUpstream(now);
    if (s->ClientHungUp(now)) hung_up.push_back(s);
  }
  for (const auto& s : hung_up) s->CloseHungUp();
  w.ForEachLink([now](SharedLink& link) { link.CheckLiveness(now); });
  if (w.cluster != nullptr) {
    for (const auto& [addr, link] : w.cluster->links) link->CheckLiveness(now);
  }
  w.liveness_timer.expires_after(std::chrono::seconds(1));
  w.liveness_timer.async_wait([&w](error_code ec) {
    if (!ec) TickLiveness(w);
  });
}

// Runs `ask` on the control io_context before anything else runs there, and returns its answer.
template <typename T>
absl::StatusOr<T> AskNow(asio::io_context& control, awaitable<absl::StatusOr<T>> ask) {
  absl::StatusOr<T> answer = absl::UnknownError("not asked");
  asio::co_spawn(
      control, [&]() -> awaitable<void> { answer = co_await std::move(ask); }, asio::detached);
  control.run();
  control.restart();
  return answer;
}

absl::StatusOr<tcp::endpoint> Resolve(asio::io_context& io, const config::HostPort& hp, const char* what) {
  tcp::resolver resolver(io);
  error_code ec;
  auto results = resolver.resolve(hp.host, std::to_string(hp.port), ec);
  if (ec || results.empty()) {
    return absl::UnavailableError(absl::StrCat(what, ": cannot resolve '", hp.host, "': ", ec.message()));
  }
  return results.begin()->endpoint();
}

// Asks the upstream for COMMAND INFO (over TLS when it is TLS, with keyguard's own credentials)
// and adds the commands the built-in table lacks. Any failure leaves the built-in table as it is.
awaitable<absl::StatusOr<int>> ExtendCommandTable(asio::io_context& io, const std::string& host, uint16_t port,
                                                  TlsClient* tls, std::chrono::milliseconds timeout, std::string user,
                                                  std::string password) {
  ControlLink link(io);
  if (auto s = co_await link.Open(host, port, tls, timeout, user, password); !s.ok()) co_return s;
  // (Arguments built before the co_await: GCC 12 miscompiles a braced list of literals in one.)
  const std::vector<std::string_view> ask = {"COMMAND", "INFO"};
  auto r = co_await link.Call(ask, timeout);
  if (!r.ok()) co_return r.status();
  co_return commands::ExtendFromCommandInfo(r->frame);
}

// keyguard_*_tls_handshakes_total{resumed} and keyguard_*_tls_reloads_total of `tls`.
void AddTlsMetrics(metrics::Registry& registry, std::shared_ptr<TlsClient> tls, metrics::FamilyId handshakes_id,
                   metrics::FamilyId reloads_id) {
  registry.AddCollector([tls, handshakes_id, reloads_id](metrics::TextWriter& w) {
    const metrics::Family& handshakes = metrics::Of(handshakes_id);
    w.Header(handshakes);
    w.Sample(handshakes, {"false"}, tls->handshakes(false));
    w.Sample(handshakes, {"true"}, tls->handshakes(true));
    w.Header(metrics::Of(reloads_id));
    w.Sample(metrics::Of(reloads_id), {}, tls->rebuilds());
  });
}

}  // namespace

absl::Status RunServer(const config::ProxyConfig& config, const std::string& config_path) {
  metrics::Registry registry;
  config::ConfigStore store(std::make_shared<config::ProxyConfig>(config), config_path);
  registry.AddCollector([&store](metrics::TextWriter& w) {
    using metrics::FamilyId, metrics::Of;
    for (auto [id, value] : {std::pair{FamilyId::kConfigReloads, store.reloads()},
                             std::pair{FamilyId::kConfigReloadFailures, store.failures()},
                             std::pair{FamilyId::kConfigVersion, store.version()}}) {
      w.Header(Of(id));
      w.Sample(Of(id), {}, value);
    }
  });
  asio::io_context control(1);
  // Signals are caught from here on (Asio keeps one that comes before its handler waits): a
  // SIGTERM during start-up drains a keyguard that has barely started rather than killing it.
  asio::signal_set signals(control, SIGTERM, SIGINT);
  asio::signal_set hup(control, SIGHUP);

  std::shared_ptr<TlsClient> upstream_tls;
  if (config.upstream.tls) {
    auto tls = TlsClient::Create(config.upstream_tls, "upstream_tls");
    if (!tls.ok()) return tls.status();
    upstream_tls = *std::move(tls);
    AddTlsMetrics(registry, upstream_tls, metrics::FamilyId::kUpstreamTlsHandshakes,
                  metrics::FamilyId::kUpstreamTlsReloads);
  }
  std::shared_ptr<TlsClient> listen_tls;
  if (config.ListenTls()) {
    auto tls = TlsClient::Create(config.listen_tls, "listen_tls", TlsSide::kServer);
    if (!tls.ok()) return tls.status();
    listen_tls = *std::move(tls);
    AddTlsMetrics(registry, listen_tls, metrics::FamilyId::kClientTlsHandshakes, metrics::FamilyId::kClientTlsReloads);
    registry.AddCollector([listen_tls](metrics::TextWriter& w) {
      const metrics::Family& failures = metrics::Of(metrics::FamilyId::kClientTlsFailures);
      w.Header(failures);
      w.Sample(failures, {}, listen_tls->failures());
    });
  }
  auto credentials = std::make_shared<UpstreamCredentials>(config);
  registry.AddCollector([credentials](metrics::TextWriter& w) {
    const metrics::Family& reloads = metrics::Of(metrics::FamilyId::kUpstreamAuthReloads);
    w.Header(reloads);
    w.Sample(reloads, {}, credentials->reloads());
  });
  absl::StatusOr<tcp::endpoint> upstream = absl::UnknownError("");
  std::string upstream_host = config.upstream.address.host;
  std::unique_ptr<SentinelWatch> sentinel;
  std::unique_ptr<ClusterWatch> cluster_watch;
  std::shared_ptr<const cluster::SlotMap> first_map;
  Primary first_primary;
  if (config.upstream.kind == config::Upstream::Kind::kSentinel) {
    // Ask the Sentinels now (control's first run; nothing else waits on it yet).
    sentinel = std::make_unique<SentinelWatch>(control, config, upstream_tls.get(), credentials.get());
    auto found = AskNow(control, sentinel->Resolve());
    if (!found.ok()) return absl::UnavailableError(absl::StrCat("upstream: ", found.status().message()));
    first_primary = *found;
    upstream = found->endpoint;
    upstream_host = found->host;
    registry.AddCollector([s = sentinel.get()](metrics::TextWriter& w) {
      using metrics::FamilyId, metrics::Of;
      w.Header(Of(FamilyId::kUpstreamFailovers));
      w.Sample(Of(FamilyId::kUpstreamFailovers), {}, s->failovers());
    });
  } else if (config.upstream.kind == config::Upstream::Kind::kCluster) {
    // Ask the seeds for the slot map now; its first primary stands for "the upstream" where one
    // server is asked (the command table, the admin's /readyz).
    cluster_watch = std::make_unique<ClusterWatch>(control, config, upstream_tls.get(), credentials.get());
    auto found = AskNow(control, cluster_watch->Resolve());
    if (!found.ok()) return absl::UnavailableError(absl::StrCat("upstream: ", found.status().message()));
    first_map = *found;
    const cluster::Node& n = first_map->primaries.front();
    upstream = Resolve(control, config::HostPort{n.host, n.port}, "upstream");
    upstream_host = n.host;
    registry.AddCollector([w = cluster_watch.get()](metrics::TextWriter& tw) {
      using metrics::FamilyId, metrics::Of;
      tw.Header(Of(FamilyId::kClusterMapRefreshes));
      tw.Sample(Of(FamilyId::kClusterMapRefreshes), {}, w->refreshes());
      tw.Header(Of(FamilyId::kClusterMapChanges));
      tw.Sample(Of(FamilyId::kClusterMapChanges), {}, w->changes());
      tw.Header(Of(FamilyId::kClusterPrimaries));
      auto m = w->current();
      tw.Sample(Of(FamilyId::kClusterPrimaries), {}, m != nullptr ? m->primaries.size() : 0);
    });
  } else {
    upstream = Resolve(control, config.upstream.address, "upstream");
  }
  if (!upstream.ok()) return upstream.status();
  auto listen = Resolve(control, config.listen, "listen");
  if (!listen.ok()) return listen.status();

  // Module commands and those of newer servers: learn them before the metric shards are sized.
  const size_t builtin = commands::CommandCount();
  auto added = AskNow(control, ExtendCommandTable(control, upstream_host, upstream->port(), upstream_tls.get(),
                                                  std::chrono::milliseconds(config.upstream_connect_timeout_ms + 3000),
                                                  config.UpstreamUser(), credentials->Password()));
  if (added.ok()) {
    EventLine("info", "command_table")
        .Int("builtin", static_cast<int64_t>(builtin - 1))
        .Int("added_from_upstream", static_cast<int64_t>(*added))
        .Write(stdout);
  } else {
    EventLine("warn", "command_table")
        .Int("builtin", static_cast<int64_t>(builtin - 1))
        .Int("added_from_upstream", 0)
        .Str("error", absl::StrCat("upstream COMMAND INFO unavailable: ", added.status().message()))
        .Write(stdout);
  }

  int nthreads = config.threads > 0 ? config.threads : static_cast<int>(std::thread::hardware_concurrency());
  if (nthreads <= 0) nthreads = 1;

  hygiene::FindingLog findings(config.hygiene.findings_kept, config.hygiene.findings_file);
  if (!findings.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hygiene.findings_file: cannot open ", config.hygiene.findings_file, " for appending"));
  }
  hygiene::HotKeysBoard hot_keys(config.hygiene, &policy::KeyPattern);
  registry.AddCollector([&hot_keys](metrics::TextWriter& w) { hot_keys.AppendMetrics(w); });
  tenant::Connections connections;  // declared before the workers: their sessions unregister here
  // The detectors' state every worker's connections share (a race across workers is a race).
  hygiene::SharedDetectors shared_detectors(config.hygiene);
  std::vector<std::unique_ptr<Worker>> workers;
  std::vector<std::unique_ptr<Acceptor>> acceptors;
  tcp::endpoint bound = *listen;
  for (int i = 0; i < nthreads; ++i) {
    workers.push_back(std::make_unique<Worker>(config, store, registry.AddShard(), *upstream,
                                               config.tenancy != nullptr ? &connections : nullptr, &shared_detectors));
    workers.back()->findings = &findings;
    workers.back()->upstream_tls = upstream_tls;
    workers.back()->listen_tls = listen_tls;
    workers.back()->upstream_credentials = credentials;
    workers.back()->upstream_host = upstream_host;
    if (sentinel != nullptr) workers.back()->upstream_failed = [s = sentinel.get()] { s->Recheck(); };
    if (config.hygiene.enabled && config.hygiene.probe) {
      workers.back()->probe = std::make_shared<SizeProbe>(*workers.back());
    }
    workers.back()->hot.Attach(&hot_keys, hot_keys.AddWorker());
    if (cluster_watch != nullptr) {
      workers.back()->cluster = std::make_shared<ClusterState>();
      workers.back()->cluster->refresh = [w = cluster_watch.get()] { w->Refresh(); };
    } else if (config.shared_upstream) {
      for (int j = 0; j < config.shared_connections; ++j) workers.back()->AddLink(/*resp3=*/false, /*start=*/false);
      workers.back()->pins = std::make_unique<PinPool>(*workers.back());
    }
    auto acceptor = std::make_unique<Acceptor>(workers.back()->io);
    error_code ec;
    acceptor->open(bound.protocol(), ec);
    if (!ec) acceptor->set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) {
      int one = 1;
      if (setsockopt(acceptor->native_handle(), SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)) != 0) {
        ec = error_code(errno, boost::system::system_category());
      }
    }
    if (!ec) acceptor->bind(bound, ec);
    if (!ec) acceptor->listen(asio::socket_base::max_listen_connections, ec);
    if (ec)
      return absl::UnavailableError(
          absl::StrCat("listen: cannot listen on ", config.listen.ToString(), ": ", ec.message()));
    bound = acceptor->local_endpoint();  // port 0: the others join the port the first one got
    acceptors.push_back(std::move(acceptor));
  }

  std::atomic<bool> draining{false};
  admin::AdminServer admin(control, registry, config, store, findings, hot_keys, *upstream, upstream_tls.get(),
                           sentinel.get(), draining, cluster_watch.get());
  if (auto s = admin.Listen(); !s.ok()) return s;

  const auto address = [](const tcp::endpoint& e) {
    return config::HostPort{e.address().to_string(), e.port()}.ToString();
  };
  EventLine("info", "listening")
      .Str("version", KEYGUARD_VERSION)
      .Str("listen", address(bound))
      .Str("upstream", config.upstream.ToString())
      .Str("admin", absl::StrCat("http://", address(admin.endpoint()), "/metrics"))
      .Int("worker_threads", static_cast<int64_t>(nthreads))
      .Write(stdout);

  for (int i = 0; i < nthreads; ++i) {
    asio::co_spawn(workers[i]->io, Accept(*workers[i], *acceptors[i]), asio::detached);
    if (workers[i]->probe != nullptr) workers[i]->probe->Start();
    workers[i]->ForEachLink([](SharedLink& link) { link.Start(); });
    if (workers[i]->cluster != nullptr) AdoptClusterMap(*workers[i], first_map);
    TickLiveness(*workers[i]);
    if (workers[i]->pins != nullptr) workers[i]->pins->Fill();
    if (workers[i]->hot.enabled()) {
      TickHotKeys(*workers[i],
                  std::chrono::milliseconds(std::min<int64_t>(1000, config.hygiene.hot_keys_interval_s * 1000)));
    }
  }
  if (sentinel != nullptr) {
    // A new primary: new sessions go there; open ones close once their replies are delivered
    // (their clients reconnect, as after a direct failover).
    sentinel->Start(first_primary, [&workers](const Primary& p) {
      for (auto& w : workers) {
        Worker* worker = w.get();
        asio::post(worker->io, [worker, p] {
          worker->upstream = p.endpoint;
          worker->upstream_host = p.host;
          std::vector<std::shared_ptr<Session>> sessions(worker->sessions.begin(), worker->sessions.end());
          for (auto& s : sessions) s->Drain();
          // Shared connections connect again, to the new primary (what was in flight fails).
          worker->ForEachLink([](SharedLink& link) { link.Restart(); });
          if (worker->pins != nullptr) worker->pins->Stop(/*for_good=*/false);
          if (worker->pins3 != nullptr) worker->pins3->Stop(/*for_good=*/false);
        });
      }
    });
  }
  if (cluster_watch != nullptr) {
    // A new slot map (resharding, failover): each worker routes by it from its next command.
    cluster_watch->Start(first_map, [&workers](std::shared_ptr<const cluster::SlotMap> m) {
      for (auto& w : workers) {
        Worker* worker = w.get();
        asio::post(worker->io, [worker, m] { AdoptClusterMap(*worker, m); });
      }
    });
  }
  std::vector<std::thread> threads;
  for (auto& w : workers) {
    threads.emplace_back([&io = w->io] {
      auto guard = asio::make_work_guard(io);
      io.run();
    });
  }

  // SIGTERM/SIGINT: stop accepting, let sessions finish their pending replies, then stop.
  Timer drain_timer(control);
  std::chrono::steady_clock::time_point deadline;
  std::function<void()> poll = [&] {
    int open = 0;
    for (auto& w : workers) open += w->session_count.load(std::memory_order_relaxed);
    if (open == 0 || std::chrono::steady_clock::now() >= deadline) {
      for (auto& w : workers) w->io.stop();
      control.stop();
      return;
    }
    drain_timer.expires_after(std::chrono::milliseconds(20));
    drain_timer.async_wait([&](error_code) { poll(); });
  };
  signals.async_wait([&](error_code ec, int signo) {
    if (ec) return;
    EventLine("info", "draining")
        .Int("signal", signo)
        .Int("drain_timeout_ms", static_cast<int64_t>(config.drain_timeout_ms))
        .Write(stdout);
    draining = true;
    registry.draining().Add(1);
    deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(config.drain_timeout_ms);
    for (size_t i = 0; i < workers.size(); ++i) {
      Worker* w = workers[i].get();
      Acceptor* a = acceptors[i].get();
      asio::post(w->io, [w, a] {
        w->draining = true;
        error_code ignored;
        a->close(ignored);
        std::vector<std::shared_ptr<Session>> sessions(w->sessions.begin(), w->sessions.end());
        for (auto& s : sessions) s->Drain();
      });
    }
    poll();
  });

  // Reload on SIGHUP, and when the file changes (a ConfigMap update).
  std::function<void()> wait_hup = [&] {
    hup.async_wait([&](error_code ec, int) {
      if (ec) return;
      (void)store.Reload("SIGHUP");
      wait_hup();
    });
  };
  wait_hup();
  Timer file_timer(control);
  std::function<void()> poll_file = [&] {
    file_timer.expires_after(std::chrono::seconds(1));
    file_timer.async_wait([&](error_code ec) {
      if (ec) return;
      store.PollFile();
      poll_file();
    });
  };
  if (!config_path.empty()) poll_file();

  control.run();
  for (auto& w : workers) w->io.stop();
  for (auto& t : threads) t.join();
  // Close what is still open past the deadline, and let the coroutines see it and end while
  // their io_context still exists.
  for (auto& w : workers) {
    std::vector<std::shared_ptr<Session>> sessions(w->sessions.begin(), w->sessions.end());
    for (auto& s : sessions) s->Close();
    sessions.clear();
    if (w->probe != nullptr) w->probe->Stop();
    w->ForEachLink([](SharedLink& link) { link.Stop(); });
    if (w->cluster != nullptr) {
      for (auto& [addr, link] : w->cluster->links) link->Stop();
    }
    if (w->pins != nullptr) w->pins->Stop();
    if (w->pins3 != nullptr) w->pins3->Stop();
    w->io.restart();
    w->io.poll();
  }
  EventLine("info", "stopped").Write(stdout);
  return absl::OkStatus();
}

}  // namespace keyguard::proxy
