// Session with shared upstream connections (upstream_connections: shared): the client pump that
// submits to a link, pinning, and the replies and failures a link hands back. The dedicated
// transport is session.cc.
#include <linux/sockios.h>
#include <sys/ioctl.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "keyguard/common/json_line.h"
#include "proxy/session_pump.h"

namespace keyguard::proxy {

template awaitable<void> Session::ClientPump<true>();

// ---------------------------------------------------------------------------------------------
// Shared upstream connections

awaitable<void> Session::Pin() {
  auto self = shared_from_this();
  // A cluster's client is pinned to the node of its command's slot (a new connection each time).
  std::optional<UpstreamAddress> node;
  if (cluster_ != nullptr) {
    conn_.LookAheadForPin(client_buf_.data(), client_buf_.size());  // the command that waits is first there
    node = ClusterNodeAddress(worker_, conn_.pin_slot());
  }
  std::unique_ptr<Stream> stream = cluster_ == nullptr ? Pins().Take() : nullptr;
  const bool fresh = stream == nullptr;
  if (fresh) {
    stream = std::make_unique<Stream>(worker_.io);
    const bool known = node.has_value() && node->endpoint.has_value();
    const error_code ec =
        cluster_ != nullptr && !known
            ? asio::error::host_unreachable
            : co_await stream->Connect(known ? *node->endpoint : worker_.upstream, worker_.upstream_tls.get(),
                                       known ? node->host : worker_.upstream_host,
                                       std::chrono::milliseconds(worker_.config.upstream_connect_timeout_ms));
    if (closed_) co_return;
    if (ec) {
      // As a dedicated connection that cannot connect: the command gets the error (nothing is
      // pending before it), then the connection closes.
      const std::string& tls = stream->tls_failure();
      worker_.shard->CountUpstreamError(tls.empty() ? metrics::UpstreamError::kConnect : metrics::UpstreamError::kTls);
      if (worker_.upstream_failed) worker_.upstream_failed();
      client_out_.Send(tls.empty() ? std::string("-ERR keyguard: upstream unavailable\r\n")
                                   : absl::StrCat("-ERR keyguard: upstream TLS: ", tls, "\r\n"));
      conn_.StopReading();
      co_await FlushAndClose();
      co_return;
    }
  }
  upstream_ = std::move(stream);
  upstream_eof_ = false;
  upstream_out_.Bind(*upstream_);
  pin_reason_ = conn_.OnPinned(fresh);  // keyguard's AUTH (a fresh connection) and CLIENT ID (tenancy)
  pinned_at_ns_ = NowNs();
  worker_.shard->upstream_pins[static_cast<size_t>(pin_reason_)].Add();
  Flush();
  asio::co_spawn(
      worker_.io, [self]() { return self->UpstreamPump(); }, asio::detached);
}

awaitable<void> Session::SwitchLink() {
  auto self = shared_from_this();
  const bool resp3 = conn_.protocol_wanted() == 3;
  // The link of that protocol the HELLO goes to: one of the worker's, or a cluster's first
  // primary's (each node's are made as they are needed; commands wait for a connect). It must come
  // up: else the HELLO fails, and the client stays where it is.
  SharedLink* next = cluster_ != nullptr ? ClusterNodeLink(worker_, 0, resp3)
                     : resp3             ? PickResp3Link(worker_)
                                         : worker_.PickLink();
  bool up = false;
  if (next != nullptr) up = co_await WaitForLanes(next);  // (not in a && : GCC 12 and co_await)
  if (closed_) co_return;
  if (!up) {
    conn_.OnSwitchFailed(next == nullptr || next->failure().empty()
                             ? std::string("-ERR keyguard: upstream unavailable\r\n")
                             : absl::StrCat("-ERR keyguard: ", next->failure(), "\r\n"));
    co_return;
  }
  if (cluster_ != nullptr) {
    cluster_->set_resp3(resp3);
  } else {
    link_ = next;
  }
  conn_.OnLinkSwitched();
}

awaitable<bool> Session::WaitForLanes(SharedLink* link) {
  auto self = shared_from_this();
  if (!link->up()) co_await link->WaitForConnect();
  if (closed_) co_return false;
  SharedLink* write_lane = link->partner();
  if (write_lane != nullptr && !write_lane->up()) co_await write_lane->WaitForConnect();
  co_return link->up() && (write_lane == nullptr || write_lane->up());
}

void Session::Unpin() {
  ObservePin();
  conn_.OnUnpinned();
  if (cluster_ != nullptr) {
    upstream_->Close();  // (a cluster's pins are not pooled)
  } else {
    Pins().Return(std::move(upstream_));
  }
  upstream_ = std::make_unique<Stream>(worker_.io);  // not connected: written to only once pinned again
  upstream_out_.Bind(*upstream_);
  NotifyQueue();
}

void Session::ObservePin() {
  const auto ns = static_cast<uint64_t>(NowNs() - pinned_at_ns_);
  worker_.shard->pin_duration[static_cast<size_t>(pin_reason_)].Observe(metrics::kLatencyBuckets,
                                                                        static_cast<double>(ns) * 1e-9, ns);
}

void Session::BeginLinkReplies(SharedLink* /*from*/) {
  link_now_ns_ = NowNs();
  if (!closed_) conn_.BeginUpstream();
}

bool Session::OnLinkFrame(std::string_view frame, const resp::ReplyFramer& f) {
  if (!closed_ && link_ok_) link_ok_ = conn_.OnSharedFrame(frame, f, link_now_ns_);
  return !conn_.TakeLinkDesync();
}

void Session::OnLinkPush(std::string_view frame, const resp::ReplyFramer& f) {
  if (!closed_ && link_ok_) link_ok_ = conn_.OnSharedPush(frame, f, link_now_ns_);
}

bool Session::EndLinkReplies() {
  if (closed_) return false;
  conn_.EndUpstream();
  FlushAs<true>();
  NotifyQueue();
  if (!link_ok_ && !closing_) {
    // A reply the tenant filter cannot place: this client's connection closes, the link stays.
    std::string owed = conn_.OnSharedFailed();
    if (!owed.empty()) client_out_.Send(owed);
    conn_.StopReading();
    StartFlushAndClose();
    return false;
  }
  // Draining, QUIT or a protocol error: once the last reply is out, the connection closes.
  if ((worker_.draining || conn_.stop_reading()) && conn_.idle()) StartFlushAndClose();
  const size_t bound = static_cast<size_t>(worker_.config.max_output_buffer);
  if (client_out_.backlog() <= bound) [[likely]] {
    return false;
  }
  // Over its bound: a watchdog cuts the client off if it takes nothing from its socket within
  // limits.slow_client_grace_ms, and looks again after each such window in which it took something, until it
  // is below its bound. The link does not wait for it meanwhile, whether it reads or not: which of
  // the two it is cannot be told at once (the kernel takes a first receive window's worth, and
  // acknowledges it late, from a client that never reads), and a wait of a window for each client
  // misjudged as reading was linear in their number (10 s for ten). Past 16 times its bound its
  // replies are not buffered further: the link waits for it (a client that reads, however slowly,
  // is waited for; one that took nothing in kSlowClientWindow is cut off). The watchdog is armed
  // then too: a client that stops reading once the link reads on is still cut off.
  if (!watchdog_armed_) {
    watchdog_armed_ = true;
    ArmWatchdog(ClientProgress());
  }
  return client_out_.backlog() > 16 * bound;
}

void Session::ArmWatchdog(uint64_t progress) {
  auto timer = std::make_shared<Timer>(worker_.io, std::chrono::milliseconds(worker_.config.slow_client_grace_ms));
  std::weak_ptr<Session> weak = shared_from_this();
  timer->async_wait([weak, timer, progress](error_code e) {
    auto s = weak.lock();
    if (s == nullptr || e || s->closed_) return;
    if (s->client_out_.backlog() <= static_cast<size_t>(s->worker_.config.max_output_buffer)) {
      s->watchdog_armed_ = false;  // it caught up
      return;
    }
    // Still over its bound: cut off when it took nothing in the window (its socket's receive
    // buffer full, nothing read), else look again after another.
    const uint64_t now = s->ClientProgress();
    if (now == progress) {
      s->CutOff();
    } else {
      s->ArmWatchdog(now);
    }
  });
}

uint64_t Session::ClientProgress() {
  int queued = 0;
  if (::ioctl(client_.socket().native_handle(), SIOCOUTQ, &queued) != 0) queued = 0;
  return client_out_.sent() - static_cast<uint64_t>(queued);
}

void Session::CutOff() {
  EventLine("warn", "slow_client_closed")
      .Int("unsent_bytes", static_cast<int64_t>(client_out_.backlog()))
      .Write(stderr);
  Close();
}

awaitable<void> Session::WaitForClient(uint64_t progress, std::chrono::steady_clock::time_point deadline) {
  auto self = shared_from_this();
  // Until it is a bound below the 16 times its bound that made the link wait (the others wait a
  // bound's worth of its reading at a time, not more). The other clients of the link wait
  // meanwhile: one that takes nothing in a window is cut off; one that reads, however slowly, is
  // waited for.
  const size_t low = 15 * static_cast<size_t>(worker_.config.max_output_buffer);
  while (!closed_ && !client_out_.failed() && client_out_.backlog() > low) {
    if (std::chrono::steady_clock::now() >= deadline) {
      if (ClientProgress() == progress) {
        CutOff();
        co_return;
      }
      progress = ClientProgress();
      deadline = std::chrono::steady_clock::now() + kSlowClientWindow;
    }
    Timer timer(worker_.io);
    timer.expires_at(deadline);
    std::weak_ptr<Session> weak = self;
    timer.async_wait([weak](error_code e) {
      if (auto s = weak.lock(); s && !e) s->client_out_.Wake();
    });
    co_await client_out_.WaitBelow(low);
    timer.cancel();
  }
}

void Session::OnLinkFailed(SharedLink* /*from*/, metrics::UpstreamError /*reason: counted by the link*/) {
  if (closed_) return;
  const std::string owed = conn_.OnSharedFailed();
  if (!owed.empty()) client_out_.Send(owed);
  NotifyQueue();
}

}  // namespace keyguard::proxy
