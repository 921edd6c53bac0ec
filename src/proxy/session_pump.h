// Session's client pump and flush, for both ways the upstream is reached (kShared: a shared link
// unless pinned). Included by session.cc (the dedicated instantiation) and session_shared.cc (the
// shared one), so that each translation unit inlines what its own pump runs: the dedicated pump
// costs what it did before shared connections existed (bench/instructions.sh).
#pragma once

#include "proxy/async_read.h"
#include "proxy/clock.h"
#include "proxy/session.h"

namespace keyguard::proxy {

// kShared: the client's commands go to a shared link unless it is pinned. The dedicated pump has
// none of its checks (bench/instructions.sh: the same instructions per command as before shared
// connections were added).
template <bool kShared>
awaitable<void> Session::ClientPump() {
  auto self = shared_from_this();
  const size_t max_out = static_cast<size_t>(worker_.config.max_output_buffer);
  const size_t max_pending = static_cast<size_t>(worker_.config.max_pending_commands);
  size_t hint = 0;
  while (!closed_ && !conn_.stop_reading()) {
    // Backpressure: a slow upstream or a client that does not read its replies stops our reads.
    // (While the pump waits, the client is not read: CheckClient looks whether it hung up.)
    if (kShared && on_link()) {
      if (cluster_ != nullptr) {
        while (!closed_ && on_link() && cluster_->backlog() > max_out) {
          WaitingForUpstream();
          co_await cluster_->WaitBelow(max_out / 2);
        }
      } else {
        while (!closed_ && on_link() && lane_link()->backlog() > max_out) {
          WaitingForUpstream();
          co_await lane_link()->WaitBelow(max_out / 2);
        }
      }
    } else {
      while (!closed_ && upstream_out_.backlog() > max_out) {
        WaitingForUpstream();
        co_await upstream_out_.WaitBelow(max_out / 2);
      }
    }
    // A command that pins waits until every earlier one is answered.
    while (!closed_ &&
           (conn_.pending() >= max_pending || conn_.holding() ||
            (kShared && (conn_.pin_wanted() != PinReason::kNone || conn_.reply_wait()) && conn_.pending() != 0))) {
      WaitingForUpstream();
      queue_waiter_ = true;
      queue_event_.expires_at(Timer::time_point::max());
      error_code ignored;
      co_await queue_event_.async_wait(AwaitEc(ignored));
    }
    if (closed_) break;
    if (kShared && conn_.pin_wanted() != PinReason::kNone) {
      WaitingForUpstream();
      if (conn_.protocol_wanted() != 0) {
        co_await SwitchLink();  // HELLO 2|3: the shared connections of that protocol
      } else {
        co_await Pin();
      }
      if (closed_ || closing_) co_return;
      ProcessClientBytes<kShared>(&hint);  // the command that waited, and those after it
      continue;
    }
    if (kShared && conn_.reply_wait()) {
      // The pin ended with the last pending reply (UpstreamPump unpinned), or lasts after all:
      // the command that waited, and those after it (refused on a pin that lasts, as before).
      conn_.EndReplyWait();
      ProcessClientBytes<kShared>(&hint);
      continue;
    }
    if (conn_.resume()) {
      // A walk ended: the commands read while it ran are next.
      ProcessClientBytes<kShared>(&hint);
      // Draining: what was read before is served, nothing more is read.
      if (drain_after_walk_ && !conn_.holding()) conn_.StopReading();
      continue;
    }
    waiting_since_ns_ = 0;  // reading: a hang-up ends the read
    client_buf_.Prepare(hint);
    error_code ec;
    // Plain TCP reads the socket here, as before the client end was a Stream (see TlsReadSome). Not
    // a conditional expression: GCC 12 destroys its awaitable twice in a coroutine.
    size_t n;
    if (client_.tls()) {
      n = co_await client_.TlsReadSome(client_buf_.free_space(), ec);
    } else {
      n = co_await AsyncReadSome(client_.socket(), client_buf_.free_space(), AwaitEc(ec));
    }
    if (closed_) break;
    if (ec) {
      // The client went away (or reset): nothing is left to deliver to it.
      Close();
      co_return;
    }
    client_buf_.Commit(n);
    worker_.shard->client_bytes_received.Add(n);
    ProcessClientBytes<kShared>(&hint);
  }
  if (closed_ || closing_) co_return;
  // Stopped reading (protocol error, QUIT, upstream gone, draining): wait for every pending reply,
  // then deliver and close.
  while (!closed_ && conn_.pending() != 0) {
    WaitingForUpstream();
    queue_waiter_ = true;
    queue_event_.expires_at(Timer::time_point::max());
    error_code ignored;
    co_await queue_event_.async_wait(AwaitEc(ignored));
  }
  if (!closed_ && !closing_) co_await FlushAndClose();
}

template <bool kShared>
void Session::ProcessClientBytes(size_t* hint) {
  if (kShared && !conn_.pinned()) {
    if (cluster_ != nullptr) {
      conn_.set_shared_ready(cluster_->ready());
    } else {
      // The lane the call begins on (a command for the other one, whose connection is down, fails
      // as one whose connection failed meanwhile).
      SharedLink* lane = lane_link();
      conn_.set_shared_ready(lane->up());
      if (!lane->up()) conn_.set_upstream_failure(lane->failure());  // the TLS reason, if that is why
    }
  }
  const size_t used = conn_.OnClientBytes(client_buf_.data(), client_buf_.size(), NowNs(), hint);
  FlushAs<kShared>();
  client_buf_.Consume(used);
}

template <bool kShared>
void Session::FlushAs() {
  const Connection::Output& out = conn_.output();
  // The client's side first: should the upstream write fail at once, the errors owed for the
  // forwarded commands come after keyguard's replies to earlier ones.
  if (!out.client.empty()) client_out_.Send(out.client);
  if (!out.upstream.empty()) {
    if (!kShared || conn_.pinned()) {
      upstream_out_.Send(out.upstream);
    } else if (cluster_ != nullptr) {
      cluster_->Submit(out.upstream, out.routes);
    } else if (SharedLink* link = lane_link(); !link->Submit(this, out.upstream, out.commands)) [[unlikely]] {
      // The link failed since this batch began: its commands fail as those in flight do.
      OnLinkFailed(link, metrics::UpstreamError::kClosed);
    }
  }
  if (const int64_t wait = conn_.TakeWalkWait(); wait != 0) ArmWalkTimer(wait);
}

// Each pump is instantiated in its own file.
extern template awaitable<void> Session::ClientPump<false>();
extern template awaitable<void> Session::ClientPump<true>();

}  // namespace keyguard::proxy
