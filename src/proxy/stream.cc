#include "proxy/stream.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>

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
  if (tls_ == nullptr) {
    const Peeked p = Peek(socket_);
    return p == Peeked::kClosed || p == Peeked::kError;
  }
  // A TLS peer's close usually comes as a close_notify alert and then the FIN: a peek sees the
  // alert, so the FIN is asked of poll (POLLRDHUP is set while bytes are still unread).
  pollfd pfd{socket_.native_handle(), POLLIN | POLLRDHUP, 0};
  if (::poll(&pfd, 1, 0) != 1) return false;
  if ((pfd.revents & (POLLERR | POLLHUP)) != 0) return true;
  if ((pfd.revents & POLLRDHUP) == 0 || SSL_has_pending(tls_->native_handle()) == 1) return false;
  unsigned char unread[512];
  const ssize_t n = ::recv(socket_.native_handle(), unread, sizeof unread, MSG_PEEK | MSG_DONTWAIT);
  if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
  // Whole alert records only, ending where the peeked bytes end. TLS 1.2 labels them (type 21);
  // TLS 1.3 encrypts them as application data (23) of 2 bytes + the inner type + a 16-byte tag,
  // shorter than any record that carries a command of 3 bytes or more.
  const bool tls13 = SSL_version(tls_->native_handle()) == TLS1_3_VERSION;
  ssize_t at = 0;
  while (at + 5 <= n) {
    const size_t length = (static_cast<size_t>(unread[at + 3]) << 8) | unread[at + 4];
    if (unread[at] != 21 && !(tls13 && unread[at] == 23 && length <= 19)) break;
    at += static_cast<ssize_t>(5 + length);
  }
  return at == n;
}

namespace {

// Closes the stream's socket if `timeout` passes before Done(). Its state is shared: a timer that
// fired just as the work completed must not touch a later connection.
class Deadline {
 public:
  Deadline(Stream& stream, std::chrono::milliseconds timeout)
      : timer_(stream.socket().get_executor()), state_(std::make_shared<int>(kRunning)) {
    timer_.expires_after(timeout);
    timer_.async_wait([&stream, state = state_](error_code e) {
      if (!e && *state == kRunning) {
        *state = kTimedOut;
        stream.Close();
      }
    });
  }
  bool timed_out() const { return *state_ == kTimedOut; }
  void Done() {
    if (*state_ == kRunning) *state_ = kDone;
    timer_.cancel();
  }

 private:
  enum { kRunning, kDone, kTimedOut };
  Timer timer_;
  std::shared_ptr<int> state_;
};

}  // namespace

awaitable<error_code> Stream::Connect(tcp::endpoint to, TlsClient* tls, const std::string& host,
                                      std::chrono::milliseconds timeout) {
  Deadline deadline(*this, timeout);  // connecting and the handshake
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
    context_ = tls->Current();
    tls_ = std::make_unique<asio::ssl::stream<Socket&>>(socket_, context_->context());
    context_->Prepare(tls_->native_handle(), tls->NameFor(host),
                      absl::StrCat(to.address().to_string(), ":", to.port()));
    co_await tls_->async_handshake(asio::ssl::stream_base::client, AwaitEc(ec));
    if (ec) {
      tls_failure_ = deadline.timed_out() ? "handshake timed out" : TlsFailure(tls_->native_handle(), ec);
    } else {
      tls->CountHandshake(SSL_session_reused(tls_->native_handle()) == 1);
    }
  }
  if (deadline.timed_out() && !ec) ec = asio::error::timed_out;
  deadline.Done();
  co_return ec;
}

awaitable<error_code> Stream::Accept(TlsClient& tls, std::chrono::milliseconds timeout) {
  Deadline deadline(*this, timeout);
  context_ = tls.Current();
  tls_ = std::make_unique<asio::ssl::stream<Socket&>>(socket_, context_->context());
  error_code ec;
  co_await tls_->async_handshake(asio::ssl::stream_base::server, AwaitEc(ec));
  if (ec) {
    tls_failure_ = deadline.timed_out() ? "handshake timed out" : TlsFailure(tls_->native_handle(), ec);
    tls.CountFailure();
  } else {
    tls.CountHandshake(SSL_session_reused(tls_->native_handle()) == 1);
  }
  deadline.Done();
  co_return ec;
}

awaitable<size_t> Stream::TlsReadSome(asio::mutable_buffer buffer, error_code& ec) {
  const size_t n = co_await tls_->async_read_some(buffer, AwaitEc(ec));
  // A server that closes without close_notify (Redis does) has still ended the stream.
  if (ec == asio::ssl::error::stream_truncated) {
    ec = asio::error::eof;
  } else if (ec.category() == asio::error::get_ssl_category()) {
    // The server refused something after the handshake (TLS 1.3 checks the client's
    // certificate then: "tlsv13 alert certificate required").
    tls_failure_ = TlsFailure(nullptr, ec);
  }
  co_return n;
}

}  // namespace keyguard::proxy
