#include "proxy/sentinel.h"

#include "proxy/control_link.h"

#include <chrono>
#include <cstdio>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "keyguard/common/json_line.h"
#include "keyguard/common/views.h"
#include "keyguard/resp/encoder.h"
#include "keyguard/resp/framer.h"

namespace keyguard::proxy {
namespace {

constexpr auto kPollEvery = std::chrono::seconds(1);
constexpr auto kRecheckGap = std::chrono::milliseconds(100);

}  // namespace

SentinelWatch::SentinelWatch(asio::io_context& io, const config::ProxyConfig& config, TlsClient* tls,
                             UpstreamCredentials* credentials)
    : io_(io),
      config_(config),
      tls_(tls),
      credentials_(credentials),
      sentinel_auth_("sentinel_auth", config.sentinel.user, config.sentinel.password, config.sentinel.password_file),
      poll_timer_(io) {}

Primary SentinelWatch::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

awaitable<absl::StatusOr<Primary>> SentinelWatch::Ask(const config::HostPort& sentinel) {
  const auto timeout = std::chrono::milliseconds(config_.upstream_connect_timeout_ms);
  ControlLink link(io_);
  const std::string password = sentinel_auth_.Password();
  if (auto s = co_await link.Open(sentinel.host, sentinel.port, tls_, timeout, config_.sentinel.user, password);
      !s.ok()) {
    co_return s;
  }
  // (Arguments built before the co_await: GCC 12 miscompiles a braced list of literals in one.)
  const std::vector<std::string_view> ask = {"SENTINEL", "GET-MASTER-ADDR-BY-NAME", config_.upstream.master};
  auto r = co_await link.Call(ask, timeout);
  if (!r.ok()) co_return r.status();
  uint32_t port = 0;
  if (r->type != '*' || r->size != 2 || r->head.size() != 2 || !absl::SimpleAtoi(r->head[1], &port) || port > 65535) {
    co_return absl::NotFoundError(
        absl::StrCat(sentinel.ToString(), ": does not know master '", config_.upstream.master, "'"));
  }
  Primary p;
  p.host = r->head[0];
  p.port = static_cast<uint16_t>(port);
  co_return p;
}

awaitable<absl::Status> SentinelWatch::Verify(const Primary& p) {
  const auto timeout = std::chrono::milliseconds(config_.upstream_connect_timeout_ms);
  ControlLink link(io_);
  if (auto s = co_await link.Open(p.host, p.port, tls_, timeout, config_.UpstreamUser(), credentials_->Password());
      !s.ok()) {
    co_return s;
  }
  const std::vector<std::string_view> role = {"ROLE"};
  auto r = co_await link.Call(role, timeout);
  if (!r.ok()) co_return r.status();
  if (r->type != '*' || r->head.empty() || r->head[0] != "master") {
    co_return absl::FailedPreconditionError(
        absl::StrCat(p.ToString(), ": ROLE is ", r->head.empty() ? "?" : r->head[0], ", not master"));
  }
  co_return absl::OkStatus();
}

awaitable<absl::StatusOr<Primary>> SentinelWatch::Resolve() {
  std::vector<std::string> errors;
  for (const config::HostPort& s : config_.upstream.sentinels) {
    auto p = co_await Ask(s);
    if (!p.ok()) {
      errors.push_back(std::string(p.status().message()));
      continue;
    }
    // The address must resolve for the workers, and the server there must be the master.
    asio::ip::basic_resolver<tcp, Executor> resolver(io_);
    error_code ec;
    auto results = co_await resolver.async_resolve(p->host, std::to_string(p->port), AwaitEc(ec));
    if (ec || results.empty()) {
      errors.push_back(absl::StrCat(s.ToString(), " names ", p->ToString(), ", which does not resolve"));
      continue;
    }
    p->endpoint = results.begin()->endpoint();
    if (auto v = co_await Verify(*p); !v.ok()) {
      errors.push_back(absl::StrCat(s.ToString(), " names ", std::string(v.message())));
      continue;
    }
    co_return p;
  }
  co_return absl::UnavailableError(absl::StrCat("no Sentinel of ", config_.upstream.ToString(),
                                                " gave a verified master: ", absl::StrJoin(errors, "; ")));
}

void SentinelWatch::Start(Primary first, OnChange on_change) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = std::move(first);
  }
  on_change_ = std::move(on_change);
  asio::co_spawn(io_, Follow(), asio::detached);
  asio::co_spawn(io_, Poll(), asio::detached);
}

void SentinelWatch::Recheck() {
  if (recheck_.exchange(true)) return;
  asio::post(io_, [this] { poll_timer_.cancel(); });
}

void SentinelWatch::Adopt(const Primary& p) {
  Primary old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (p.endpoint == current_.endpoint) return;
    old = current_;
    current_ = p;
  }
  failovers_.fetch_add(1, std::memory_order_relaxed);
  EventLine("warn", "upstream_failover")
      .Str("master", config_.upstream.master)
      .Str("from", old.ToString())
      .Str("to", p.ToString())
      .Write(stderr);
  if (on_change_) on_change_(p);
}

awaitable<void> SentinelWatch::Follow() {
  // Subscribed to +switch-master on one Sentinel at a time; on any failure, the next one.
  for (size_t i = 0;; i = (i + 1) % config_.upstream.sentinels.size()) {
    const config::HostPort& s = config_.upstream.sentinels[i];
    const auto timeout = std::chrono::milliseconds(config_.upstream_connect_timeout_ms);
    ControlLink link(io_);
    const std::string password = sentinel_auth_.Password();
    absl::Status status = co_await link.Open(s.host, s.port, tls_, timeout, config_.sentinel.user, password);
    if (status.ok()) {
      const std::vector<std::string_view> subscribe = {"SUBSCRIBE", "+switch-master"};
      auto r = co_await link.Call(subscribe, timeout);
      status = r.status();
      while (status.ok()) {
        auto m = co_await link.Read(std::nullopt);
        if (!m.ok()) {
          status = m.status();
          break;
        }
        // "message", "+switch-master", "<master> <old ip> <old port> <new ip> <new port>"
        if (m->head.size() < 3 || m->head[0] != "message") continue;
        const std::vector<std::string> f = absl::StrSplit(m->head[2], ' ');
        if (f.size() == 5 && f[0] == config_.upstream.master) Recheck();
      }
    }
    EventLine("warn", "sentinel_subscription_lost")
        .Str("sentinel", s.ToString())
        .Str("error", AsStd(status.message()))
        .Write(stderr);
    Timer pause(io_, std::chrono::milliseconds(500));
    error_code ignored;
    co_await pause.async_wait(AwaitEc(ignored));
  }
}

awaitable<void> SentinelWatch::Poll() {
  for (;;) {
    if (!recheck_.load()) {
      poll_timer_.expires_after(kPollEvery);
      error_code ignored;
      co_await poll_timer_.async_wait(AwaitEc(ignored));
    }
    recheck_.store(false);
    auto p = co_await Resolve();
    if (p.ok()) {
      Adopt(*p);
    } else {
      EventLine("warn", "sentinel_recheck_failed").Str("error", AsStd(p.status().message())).Write(stderr);
    }
    Timer gap(io_, kRecheckGap);
    error_code ignored;
    co_await gap.async_wait(AwaitEc(ignored));
  }
}

}  // namespace keyguard::proxy
