#include "proxy/outbox.h"

#include <cstddef>
#include <iterator>

namespace keyguard::proxy {

Outbox::Outbox(Socket& socket, metrics::Counter* bytes_sent)
    : socket_(&socket), bytes_sent_(bytes_sent), event_(socket.get_executor()) {}

Outbox::Outbox(Stream& stream, metrics::Counter* bytes_sent)
    : socket_(&stream.socket()), stream_(&stream), bytes_sent_(bytes_sent), event_(stream.socket().get_executor()) {}

namespace {

// The pieces as an Asio ConstBufferSequence, without copying the list.
class Pieces {
 public:
  class const_iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = asio::const_buffer;
    using difference_type = std::ptrdiff_t;
    using pointer = const asio::const_buffer*;
    using reference = asio::const_buffer;
    explicit const_iterator(const std::string_view* p) : p_(p) {}
    asio::const_buffer operator*() const { return asio::const_buffer(p_->data(), p_->size()); }
    const_iterator& operator++() {
      ++p_;
      return *this;
    }
    const_iterator operator++(int) { return const_iterator(p_++); }
    bool operator==(const const_iterator& o) const { return p_ == o.p_; }
    bool operator!=(const const_iterator& o) const { return p_ != o.p_; }

   private:
    const std::string_view* p_;
  };
  explicit Pieces(std::span<const std::string_view> pieces) : pieces_(pieces) {}
  const_iterator begin() const { return const_iterator(pieces_.data()); }
  const_iterator end() const { return const_iterator(pieces_.data() + pieces_.size()); }

 private:
  std::span<const std::string_view> pieces_;
};

}  // namespace

bool Outbox::Send(std::span<const std::string_view> pieces) {
  if (failed_) return false;
  if (pieces.empty()) return true;
  size_t skip = 0;
  if (!draining_ && pending_.empty()) {
    error_code ec;
    skip = stream_ == nullptr || stream_->can_write_now()
               ? socket_->write_some(Pieces(pieces), ec)  // the socket is non-blocking
               : stream_->TryTlsWrite(pieces, ec);
    if (ec && ec != asio::error::would_block && ec != asio::error::try_again) {
      Fail(ec);
      return false;
    }
    // (A write that would block wrote nothing, or, over TLS, the bytes it returns.)
    bytes_sent_->Add(skip);
    sent_ += skip;
  }
  bool queued = false;
  for (std::string_view b : pieces) {
    if (skip >= b.size()) {
      skip -= b.size();
      continue;
    }
    pending_.append(b.data() + skip, b.size() - skip);
    skip = 0;
    queued = true;
  }
  if (queued) StartDrain();
  return true;
}

void Outbox::StartDrain() {
  if (draining_ || failed_) return;
  draining_ = true;
  asio::co_spawn(socket_->get_executor(), Drain(owner_.lock()), asio::detached);
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
                                          : co_await socket_->async_write_some(rest, AwaitEc(ec));
      if (ec) {
        Fail(ec);
        break;
      }
      written_ += n;
      sent_ += n;
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
