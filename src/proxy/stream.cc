#include "proxy/stream.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <climits>

#include <openssl/err.h>
#include <openssl/ssl.h>

#include "absl/strings/str_cat.h"

namespace keyguard::proxy {

Peeked Peek(Socket& socket) {
  char c;
  const ssize_t n = ::recv(socket.native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return Peeked::kData;
  if (n == 0) return Peeked::kClosed;
  return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? Peeked::kNothing : Peeked::kError;
}

bool Stream::PeerGone() {
  if (ssl_ == nullptr) {
    const Peeked p = Peek(socket_);
    return p == Peeked::kClosed || p == Peeked::kError;
  }
  // A TLS peer's close usually comes as a close_notify alert and then the FIN: a peek sees the
  // alert, so the FIN is asked of poll (POLLRDHUP is set while bytes are still unread).
  pollfd pfd{socket_.native_handle(), POLLIN | POLLRDHUP, 0};
  if (::poll(&pfd, 1, 0) != 1) return false;
  if ((pfd.revents & (POLLERR | POLLHUP)) != 0) return true;
  if ((pfd.revents & POLLRDHUP) == 0 || SSL_has_pending(ssl_) == 1) return false;
  unsigned char unread[512];
  const ssize_t n = ::recv(socket_.native_handle(), unread, sizeof unread, MSG_PEEK | MSG_DONTWAIT);
  if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
  // Whole alert records only, ending where the peeked bytes end. TLS 1.2 labels them (type 21);
  // TLS 1.3 encrypts them as application data (23) of 2 bytes + the inner type + a 16-byte tag,
  // shorter than any record that carries a command of 3 bytes or more.
  const bool tls13 = SSL_version(ssl_) == TLS1_3_VERSION;
  ssize_t at = 0;
  while (at + 5 <= n) {
    const size_t length = (static_cast<size_t>(unread[at + 3]) << 8) | unread[at + 4];
    if (unread[at] != 21 && !(tls13 && unread[at] == 23 && length <= 19)) break;
    at += static_cast<ssize_t>(5 + length);
  }
  return at == n;
}

bool Stream::HungUp() {
  if (!socket_.is_open()) return true;
  pollfd pfd{socket_.native_handle(), POLLRDHUP, 0};
  return ::poll(&pfd, 1, 0) == 1 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

bool Stream::IdleAndOpen() {
  if (ssl_ == nullptr) return Peek(socket_) == Peeked::kNothing;
  // A peek at the socket cannot tell: the tickets are unread, and a close_notify after them.
  if (!socket_.is_open()) return false;
  char c;
  const int n = SSL_peek(ssl_, &c, 1);
  if (n <= 0 && SSL_get_error(ssl_, n) == SSL_ERROR_WANT_READ) return true;
  ERR_clear_error();  // SSL_get_error needs the queue empty before the next call
  return false;
}

Stream::~Stream() {
  if (ssl_ == nullptr) return;
  // A connection that ends without a TLS error ended well (a peer that closes without close_notify,
  // keyguard closes at the socket): OpenSSL would otherwise mark its session not resumable.
  if (tls_failure_.empty()) SSL_set_shutdown(ssl_, SSL_SENT_SHUTDOWN | SSL_RECEIVED_SHUTDOWN);
  SSL_free(ssl_);  // the socket BIO does not close the socket
}

void Stream::StartTls(TlsClient& tls) {
  error_code ignored;
  socket_.non_blocking(true, ignored);  // OpenSSL's reads and writes must not block the thread
  context_ = tls.Current();
  ssl_ = SSL_new(context_->context().native_handle());
  SSL_set_fd(ssl_, socket_.native_handle());
  SSL_set_mode(ssl_, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_set_read_ahead(ssl_, 1);  // one recv for as much as the socket holds, not a header then a body
}

namespace {

// The error_code for an OpenSSL call on `ssl` that failed with SSL_get_error's `error` (not a
// WANT_*), `ret` and `saved_errno`: eof for the end of the stream (close_notify, or a peer that
// closed without it, as a killed server does), the system error, or the oldest error queued (asio's ssl
// category names its reason). Clears the queue.
error_code TlsError(int ret, int error, int saved_errno) {
  error_code ec;
  const unsigned long queued = ERR_peek_error();
  if (error == SSL_ERROR_ZERO_RETURN || (error == SSL_ERROR_SYSCALL && queued == 0 && (ret == 0 || saved_errno == 0)) ||
      (error == SSL_ERROR_SSL && ERR_GET_REASON(queued) == SSL_R_UNEXPECTED_EOF_WHILE_READING)) {
    ec = asio::error::eof;
  } else if (error == SSL_ERROR_SYSCALL && queued == 0) {
    ec = error_code(saved_errno, asio::error::get_system_category());
  } else {
    ec = error_code(static_cast<int>(ERR_get_error()), asio::error::get_ssl_category());
  }
  ERR_clear_error();
  return ec;
}

}  // namespace

awaitable<bool> Stream::TlsWait(int ret, error_code& ec) {
  const int saved_errno = errno;
  const int error = SSL_get_error(ssl_, ret);
  if (error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) {
    co_await socket_.async_wait(error == SSL_ERROR_WANT_READ ? Socket::wait_read : Socket::wait_write, AwaitEc(ec));
    co_return !ec && StillOpen(ec);
  }
  ec = TlsError(ret, error, saved_errno);
  co_return false;
}

size_t Stream::TryTlsWrite(std::span<const std::string_view> pieces, error_code& ec) {
  if (!StillOpen(ec)) return 0;
  std::string_view bytes = pieces.front();
  if (pieces.size() > 1) {
    // One record for all of them (a record each would cost a seal and a send each).
    gather_.clear();
    for (std::string_view p : pieces) gather_.append(p);
    bytes = gather_;
  }
  size_t written = 0;
  while (written < bytes.size()) {
    const int size = static_cast<int>(std::min<size_t>(bytes.size() - written, INT_MAX));
    const int n = SSL_write(ssl_, bytes.data() + written, size);
    if (n > 0) {
      written += static_cast<size_t>(n);
      continue;
    }
    const int saved_errno = errno;
    const int error = SSL_get_error(ssl_, n);
    // OpenSSL may hold a record of the rest, half sent: the rest is offered again, from the
    // caller's copy (SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER), by WriteSome.
    ec = error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE ? error_code(asio::error::would_block)
                                                                       : TlsError(n, error, saved_errno);
    break;
  }
  if (gather_.capacity() > (1u << 20)) std::string().swap(gather_);
  return written;
}

awaitable<void> Stream::TlsHandshake(error_code& ec) {
  ERR_clear_error();  // SSL_get_error needs an empty queue; other OpenSSL calls may have left one
  for (;;) {
    const int ret = SSL_do_handshake(ssl_);
    if (ret == 1 || !co_await TlsWait(ret, ec)) co_return;
  }
}

awaitable<error_code> Stream::Connect(tcp::endpoint to, TlsClient* tls, const std::string& host,
                                      std::chrono::milliseconds timeout) {
  StreamDeadline deadline(*this, timeout);  // connecting and the handshake
  error_code ec;
  co_await socket_.async_connect(to, AwaitEc(ec));
  if (!ec && !socket_.is_open()) ec = asio::error::timed_out;
  if (!ec) {
    error_code ignored;
    socket_.non_blocking(true, ignored);
    socket_.set_option(tcp::no_delay(true), ignored);
    socket_.set_option(asio::socket_base::keep_alive(true), ignored);
  }
  if (!ec && tls != nullptr) {
    StartTls(*tls);
    context_->Prepare(ssl_, tls->NameFor(host), absl::StrCat(to.address().to_string(), ":", to.port()));
    SSL_set_connect_state(ssl_);
    co_await TlsHandshake(ec);
    if (ec) {
      tls_failure_ = deadline.timed_out() ? "handshake timed out" : TlsFailure(ssl_, ec);
    } else {
      tls->CountHandshake(SSL_session_reused(ssl_) == 1);
    }
  }
  if (deadline.timed_out() && !ec) ec = asio::error::timed_out;
  deadline.Done();
  co_return ec;
}

awaitable<error_code> Stream::Accept(TlsClient& tls, std::chrono::milliseconds timeout) {
  StreamDeadline deadline(*this, timeout);
  StartTls(tls);
  SSL_set_accept_state(ssl_);
  error_code ec;
  co_await TlsHandshake(ec);
  if (ec) {
    tls_failure_ = deadline.timed_out() ? "handshake timed out" : TlsFailure(ssl_, ec);
    tls.CountFailure();
  } else {
    tls.CountHandshake(SSL_session_reused(ssl_) == 1);
  }
  deadline.Done();
  co_return ec;
}

awaitable<size_t> Stream::TlsReadSome(asio::mutable_buffer buffer, error_code& ec) {
  const int size = static_cast<int>(std::min<size_t>(buffer.size(), INT_MAX));
  if (!StillOpen(ec)) co_return 0;
  if (tls_drained_) {
    // As AsyncReadSome: after a short read the socket is most likely empty; wait before the recv.
    co_await socket_.async_wait(Socket::wait_read, AwaitEc(ec));
    if (ec || !StillOpen(ec)) co_return 0;
  }
  for (;;) {
    const int n = SSL_read(ssl_, buffer.data(), size);
    if (n > 0) {
      tls_drained_ = n < size && SSL_has_pending(ssl_) == 0;
      co_return static_cast<size_t>(n);
    }
    if (!co_await TlsWait(n, ec)) break;
  }
  tls_drained_ = false;
  if (ec.category() == asio::error::get_ssl_category()) {
    // The peer refused something after the handshake (TLS 1.3 checks the client's
    // certificate then: "tlsv13 alert certificate required").
    tls_failure_ = TlsFailure(nullptr, ec);
  }
  co_return 0;
}

awaitable<size_t> Stream::TlsWriteSome(asio::const_buffer buffer, error_code& ec) {
  const int size = static_cast<int>(std::min<size_t>(buffer.size(), INT_MAX));
  if (!StillOpen(ec)) co_return 0;
  for (;;) {
    const int n = SSL_write(ssl_, buffer.data(), size);
    if (n > 0) co_return static_cast<size_t>(n);
    if (!co_await TlsWait(n, ec)) co_return 0;
  }
}

}  // namespace keyguard::proxy
