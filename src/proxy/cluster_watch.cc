#include "proxy/cluster_watch.h"

#include <chrono>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "keyguard/common/json_line.h"
#include "keyguard/common/views.h"
#include "proxy/control_link.h"

namespace keyguard::proxy {
namespace {

constexpr auto kPollEvery = std::chrono::seconds(5);
constexpr auto kRefreshGap = std::chrono::milliseconds(100);

}  // namespace

ClusterWatch::ClusterWatch(asio::io_context& io, const config::ProxyConfig& config, TlsClient* tls,
                           UpstreamCredentials* credentials)
    : io_(io), config_(config), tls_(tls), credentials_(credentials) {}

std::shared_ptr<const cluster::SlotMap> ClusterWatch::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

awaitable<absl::StatusOr<std::shared_ptr<const cluster::SlotMap>>> ClusterWatch::Ask(const config::HostPort& node) {
  const auto timeout = std::chrono::milliseconds(config_.upstream_connect_timeout_ms);
  ControlLink link(io_);
  if (auto s =
          co_await link.Open(node.host, node.port, tls_, timeout, config_.UpstreamUser(), credentials_->Password());
      !s.ok()) {
    co_return s;
  }
  const std::vector<std::string_view> slots = {"CLUSTER", "SLOTS"};
  auto r = co_await link.Call(slots, timeout);
  if (!r.ok()) co_return r.status();
  // Primaries that serve no slot yet (a node just added, its first slot being imported: an ASK
  // names it). CLUSTER SHARDS is Redis 7.0's; an older server's error leaves them out.
  const std::vector<std::string_view> shards = {"CLUSTER", "SHARDS"};
  std::vector<cluster::Node> slotless;
  auto s = co_await link.Call(shards, timeout);
  if (!s.ok()) co_return s.status();
  if (s->type == '*') slotless = cluster::SlotlessPrimaries(s->frame, node.host, tls_ != nullptr);
  auto m = cluster::ParseClusterSlots(r->frame, node.host, slotless);
  if (!m.ok()) co_return absl::Status(m.status().code(), absl::StrCat(node.ToString(), ": ", m.status().message()));
  // Nodes announced by name (cluster-announce-hostname): their addresses, resolved here so that
  // the workers never resolve (a name that does not resolve leaves the node unusable, logged).
  asio::ip::basic_resolver<tcp, Executor> resolver(io_);
  auto resolve = [&](cluster::Node& n) -> awaitable<void> {
    error_code ec;
    (void)asio::ip::make_address(n.host, ec);
    if (!ec) co_return;
    auto found = co_await resolver.async_resolve(n.host, std::to_string(n.port), AwaitEc(ec));
    if (!ec && !found.empty()) {
      n.ip = found.begin()->endpoint().address().to_string();
    } else {
      EventLine("warn", "cluster_node_unresolved").Str("node", n.ToString()).Str("error", ec.message()).Write(stderr);
    }
  };
  for (cluster::Node& n : m->primaries) co_await resolve(n);
  for (auto& list : m->replicas) {
    for (cluster::Node& n : list) co_await resolve(n);
  }
  for (cluster::Node& n : m->slotless) co_await resolve(n);
  co_return std::make_shared<const cluster::SlotMap>(*std::move(m));
}

awaitable<absl::StatusOr<std::shared_ptr<const cluster::SlotMap>>> ClusterWatch::Resolve() {
  // The primaries known now first (the seeds may be gone), then the seeds.
  std::vector<config::HostPort> ask;
  if (auto known = current(); known != nullptr) {
    for (const cluster::Node& n : known->primaries) ask.push_back(config::HostPort{n.host, n.port});
  }
  for (const config::HostPort& s : config_.upstream.seeds) ask.push_back(s);
  std::vector<std::string> errors;
  for (const config::HostPort& node : ask) {
    auto m = co_await Ask(node);
    if (m.ok()) co_return m;
    errors.emplace_back(m.status().message());
  }
  co_return absl::UnavailableError(absl::StrCat("no cluster node gave a slot map: ", absl::StrJoin(errors, "; ")));
}

void ClusterWatch::Start(std::shared_ptr<const cluster::SlotMap> first, OnChange on_change) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = std::move(first);
  }
  on_change_ = std::move(on_change);
  asio::co_spawn(io_, Poll(), asio::detached);
}

awaitable<void> ClusterWatch::Poll() {
  for (;;) {
    // Every kPollEvery, or as soon as Refresh() asks (its post cancels the wait; a poke that came
    // while the last refresh ran is seen here, and no wait starts).
    if (!poke_.load()) {
      wake_.expires_after(kPollEvery);
      error_code ignored;
      co_await wake_.async_wait(AwaitEc(ignored));
    }
    poke_.store(false);
    refresh_.store(false);
    auto m = co_await Resolve();
    refreshes_.fetch_add(1, std::memory_order_relaxed);
    if (!m.ok()) {
      EventLine("warn", "cluster_refresh_failed").Str("error", AsStd(m.status().message())).Write(stderr);
    } else if (auto old = current(); old == nullptr || !(*m)->SameAs(*old)) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        current_ = *m;
      }
      changes_.fetch_add(1, std::memory_order_relaxed);
      EventLine("info", "cluster_map_changed")
          .Int("primaries", static_cast<int64_t>((*m)->primaries.size()))
          .Write(stderr);
      if (on_change_) on_change_(*m);
    }
    Timer gap(io_, kRefreshGap);
    error_code ignored;
    co_await gap.async_wait(AwaitEc(ignored));
  }
}

}  // namespace keyguard::proxy
