// Session with shared upstream connections (upstream_connections: shared): the client pump that
// submits to a link, pinning, and the replies and failures a link hands back. The dedicated
// transport is session.cc.
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
  std::unique_ptr<Stream> stream = worker_.pins->Take();
  const bool fresh = stream == nullptr;
  if (fresh) {
    stream = std::make_unique<Stream>(worker_.io);
    const error_code ec =
        co_await stream->Connect(worker_.upstream, worker_.upstream_tls.get(), worker_.upstream_host,
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
  upstream_out_.Bind(*upstream_);
  pin_reason_ = conn_.OnPinned(fresh);  // keyguard's AUTH (a fresh connection) and CLIENT ID (tenancy)
  pinned_at_ns_ = NowNs();
  worker_.shard->upstream_pins[static_cast<size_t>(pin_reason_)].Add();
  Flush();
  asio::co_spawn(
      worker_.io, [self]() { return self->UpstreamPump(); }, asio::detached);
}

void Session::Unpin() {
  ObservePin();
  conn_.OnUnpinned();
  worker_.pins->Return(std::move(upstream_));
  upstream_ = std::make_unique<Stream>(worker_.io);  // not connected: written to only once pinned again
  upstream_out_.Bind(*upstream_);
  NotifyQueue();
}

void Session::ObservePin() {
  const auto ns = static_cast<uint64_t>(NowNs() - pinned_at_ns_);
  worker_.shard->pin_duration[static_cast<size_t>(pin_reason_)].Observe(metrics::kLatencyBuckets,
                                                                        static_cast<double>(ns) * 1e-9, ns);
}

void Session::BeginLinkReplies() {
  link_now_ns_ = NowNs();
  if (!closed_) conn_.BeginUpstream();
}

void Session::OnLinkFrame(std::string_view frame, const resp::ReplyFramer& f) {
  if (!closed_ && link_ok_) link_ok_ = conn_.OnSharedFrame(frame, f, link_now_ns_);
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
    if (!closing_) {
      auto self = shared_from_this();
      asio::co_spawn(
          worker_.io, [self]() { return self->FlushAndClose(); }, asio::detached);
    }
    return false;
  }
  // Draining, QUIT or a protocol error: once the last reply is out, the connection closes.
  if ((worker_.draining || conn_.stop_reading()) && conn_.idle() && !closing_) {
    auto self = shared_from_this();
    asio::co_spawn(
        worker_.io, [self]() { return self->FlushAndClose(); }, asio::detached);
  }
  return client_out_.backlog() > static_cast<size_t>(worker_.config.max_output_buffer);
}

awaitable<void> Session::WaitForClient() {
  auto self = shared_from_this();
  const size_t low = static_cast<size_t>(worker_.config.max_output_buffer) / 2;
  // The other clients of the link wait meanwhile: one that reads nothing for a second is cut off.
  while (!closed_ && !client_out_.failed() && client_out_.backlog() > low) {
    const size_t before = client_out_.backlog();
    auto expired = std::make_shared<bool>(false);
    Timer timer(worker_.io, std::chrono::seconds(1));
    std::weak_ptr<Session> weak = self;
    timer.async_wait([weak, expired](error_code e) {
      if (e) return;
      *expired = true;
      if (auto s = weak.lock()) s->client_out_.Wake();
    });
    co_await client_out_.WaitBelow(low);
    timer.cancel();
    if (*expired && client_out_.backlog() >= before) {
      EventLine("warn", "slow_client_closed")
          .Int("unsent_bytes", static_cast<int64_t>(client_out_.backlog()))
          .Write(stderr);
      Close();
    }
  }
}

void Session::OnLinkFailed(metrics::UpstreamError /*reason: counted by the link*/) {
  if (closed_) return;
  const std::string owed = conn_.OnSharedFailed();
  if (!owed.empty()) client_out_.Send(owed);
  NotifyQueue();
}

}  // namespace keyguard::proxy
