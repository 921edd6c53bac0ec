// Writes to one socket in order. Send() writes straight from the caller's buffers with one
// non-blocking writev when the socket takes it (the common case: zero copies, no suspension);
// only what the socket does not take is copied and written in the background. Over TLS the
// same, with one SSL_write of the pieces (Stream::TryTlsWrite) in place of the writev. Callers apply
// backpressure by waiting for the backlog to shrink before reading more from the other side.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keyguard/metrics/registry.h"
#include "proxy/asio.h"
#include "proxy/stream.h"

namespace keyguard::proxy {

class Outbox {
 public:
  // `owner` is kept alive while a background write runs; `on_error` runs once if a write fails.
  Outbox(Socket& socket, metrics::Counter* bytes_sent);
  // Writes to `stream` (plain TCP or TLS).
  Outbox(Stream& stream, metrics::Counter* bytes_sent);

  void set_owner(std::weak_ptr<void> owner) { owner_ = std::move(owner); }
  // Writes to `stream` from now on; only while nothing is queued or being written.
  void Bind(Stream& stream) {
    socket_ = &stream.socket();
    stream_ = &stream;
    failed_ = false;
  }
  void set_on_error(std::function<void(error_code)> f) { on_error_ = std::move(f); }

  // Queues `pieces` for writing, in order after everything sent before (one writev of them when
  // the socket takes it). Returns false once the socket has failed (the bytes are dropped).
  bool Send(std::span<const std::string_view> pieces);
  bool Send(std::string_view bytes) { return Send(std::span<const std::string_view>(&bytes, 1)); }

  // Bytes accepted by Send() but not yet written to the socket.
  size_t backlog() const { return pending_.size() + writing_.size() - written_; }
  // Bytes written to the socket so far.
  uint64_t sent() const { return sent_; }
  bool failed() const { return failed_; }

  // Waits until backlog() <= limit, or the socket failed, or Wake() was called.
  awaitable<void> WaitBelow(size_t limit);
  // Wakes every waiter (used when the session closes).
  void Wake() { event_.cancel(); }

 private:
  void StartDrain();
  awaitable<void> Drain(std::shared_ptr<void> keep_alive);
  void Fail(error_code ec);

  Socket* socket_;
  Stream* stream_ = nullptr;  // nullptr: *socket_ itself
  metrics::Counter* bytes_sent_;
  std::weak_ptr<void> owner_;
  std::function<void(error_code)> on_error_;
  std::string pending_;  // accepted, not yet handed to a write
  std::string writing_;  // owned by the write in flight
  size_t written_ = 0;
  uint64_t sent_ = 0;
  bool draining_ = false;
  bool failed_ = false;
  int waiters_ = 0;
  Timer event_;
};

}  // namespace keyguard::proxy
