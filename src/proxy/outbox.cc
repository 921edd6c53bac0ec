#include "proxy/outbox.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>

namespace keyguard::proxy {
namespace {

bool WouldBlock(int e) { return e == EAGAIN || e == EWOULDBLOCK; }

}  // namespace

Outbox::Outbox(asio::io_context& io, metrics::Counter* bytes_sent)
    : io_(io), bytes_sent_(bytes_sent), event_(io) {}

bool Outbox::Send(const std::vector<asio::const_buffer>& buffers) {
  if (failed_) return false;
  if (buffers.empty()) return true;
  size_t skip = 0;
  if (!draining_ && pending_.empty()) {
    constexpr size_t kMaxIov = 64;
    iovec iov[kMaxIov];
    const size_t count = buffers.size() < kMaxIov ? buffers.size() : kMaxIov;
    for (size_t i = 0; i < count; ++i) {
      iov[i].iov_base = const_cast<void*>(buffers[i].data());
      iov[i].iov_len = buffers[i].size();
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = count;
    ssize_t n;
    do {
      n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
      if (!WouldBlock(errno)) {
        Fail(error_code(errno, boost::system::system_category()));
        return false;
      }
      writable_->Clear();
      n = 0;
    }
    skip = static_cast<size_t>(n);
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
  asio::co_spawn(io_, Drain(owner_.lock()), asio::detached);
}

awaitable<void> Outbox::Drain(std::shared_ptr<void> keep_alive) {
  while (!pending_.empty() && !failed_) {
    writing_.swap(pending_);
    pending_.clear();
    written_ = 0;
    while (written_ < writing_.size() && !failed_) {
      const ssize_t n = ::send(fd_, writing_.data() + written_, writing_.size() - written_, MSG_NOSIGNAL);
      if (n > 0) {
        written_ += static_cast<size_t>(n);
        bytes_sent_->Add(static_cast<uint64_t>(n));
        event_.cancel();  // progress: let waiters re-check the backlog
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && WouldBlock(errno)) {
        writable_->Clear();
        const error_code ec = co_await writable_->Wait();
        if (ec) Fail(ec);
        continue;
      }
      Fail(error_code(n < 0 ? errno : EPIPE, boost::system::system_category()));
    }
    writing_.clear();
    written_ = 0;
    if (writing_.capacity() > (1u << 20)) std::string().swap(writing_);
  }
  if (pending_.empty() && pending_.capacity() > (1u << 20)) std::string().swap(pending_);
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
    if (waiters_++ == 0) event_.expires_at(asio::steady_timer::time_point::max());
    error_code ec;
    co_await event_.async_wait(AwaitEc(ec));
    --waiters_;
  }
}

}  // namespace keyguard::proxy
