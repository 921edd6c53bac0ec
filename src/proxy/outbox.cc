#include "proxy/outbox.h"

namespace keyguard::proxy {

Outbox::Outbox(Socket& socket, metrics::Counter* bytes_sent)
    : socket_(socket), bytes_sent_(bytes_sent), event_(socket.get_executor()) {}

Outbox::Outbox(Stream& stream, metrics::Counter* bytes_sent)
    : socket_(stream.socket()), stream_(&stream), bytes_sent_(bytes_sent), event_(stream.socket().get_executor()) {}

bool Outbox::Send(const std::vector<asio::const_buffer>& buffers) {
  if (failed_) return false;
  if (buffers.empty()) return true;
  size_t skip = 0;
  if (!draining_ && pending_.empty() && (stream_ == nullptr || stream_->can_write_now())) {
    error_code ec;
    skip = socket_.write_some(buffers, ec);  // the socket is non-blocking
    if (ec && ec != asio::error::would_block && ec != asio::error::try_again) {
      Fail(ec);
      return false;
    }
    if (ec) skip = 0;
    bytes_sent_->Add(skip);
  }
  bool queued = false;
  for (const asio::const_buffer& b : buffers) {
    if (skip >= b.size()) {
      skip -= b.size();
      continue;
    }
    pending_.append(static_cast<const char*>(b.data()) + skip, b.size() - skip);
    skip = 0;
    queued = true;
  }
  if (queued) StartDrain();
  return true;
}

bool Outbox::Send(std::string_view bytes) {
  return Send(std::vector<asio::const_buffer>{asio::buffer(bytes.data(), bytes.size())});
}

void Outbox::StartDrain() {
  if (draining_ || failed_) return;
  draining_ = true;
  asio::co_spawn(socket_.get_executor(), Drain(owner_.lock()), asio::detached);
}

awaitable<void> Outbox::Drain(std::shared_ptr<void> keep_alive) {
  while (!pending_.empty() && !failed_) {
    writing_.swap(pending_);
    pending_.clear();
    written_ = 0;
    while (written_ < writing_.size()) {
      error_code ec;
      const auto rest = asio::buffer(writing_.data() + written_, writing_.size() - written_);
      const size_t n = stream_ != nullptr ? co_await stream_->WriteSome(rest, ec)
                                          : co_await socket_.async_write_some(rest, AwaitEc(ec));
      if (ec) {
        Fail(ec);
        break;
      }
      written_ += n;
      bytes_sent_->Add(n);
      event_.cancel();  // progress: let waiters re-check the backlog
    }
    writing_.clear();
    written_ = 0;
    if (writing_.capacity() > (1u << 20)) std::string().swap(writing_);
  }
  if (pending_.capacity() > (1u << 20) && pending_.empty()) std::string().swap(pending_);
  draining_ = false;
  event_.cancel();
}

void Outbox::Fail(error_code ec) {
  if (failed_) return;
  failed_ = true;
  pending_.clear();
  event_.cancel();
  if (on_error_) on_error_(ec);
}

awaitable<void> Outbox::WaitBelow(size_t limit) {
  if (!failed_ && backlog() > limit) {
    // Re-arming the timer cancels current waiters, so only the first waiter arms it.
    if (waiters_++ == 0) event_.expires_at(Timer::time_point::max());
    error_code ec;
    co_await event_.async_wait(AwaitEc(ec));
    --waiters_;
  }
}

}  // namespace keyguard::proxy
