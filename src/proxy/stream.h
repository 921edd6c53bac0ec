// A connection keyguard makes to a Redis server, or one its listener accepted from a client:
// plain TCP, or TLS over it.
//
// The plaintext path stays what it was: reads go through AsyncReadSome (the drained-socket fast
// path), and Outbox writes straight to the socket with TryWrite; the only added cost is one
// predictable branch per read and per write. With TLS, the Stream owns an OpenSSL connection on
// the socket itself (SSL_set_fd, read-ahead on): SSL_read and SSL_write run on the non-blocking
// socket and, when OpenSSL wants the socket readable or writable, the coroutine waits for it
// (one read and one write may be in flight at once, as with the socket), as haproxy does.
// asio::ssl::stream's engine cost about 4,000 more instructions a command at pipeline depth 1
// (ERR_clear_error before every call, copies through a BIO pair), which made keyguard cost more
// CPU than haproxy on the same TLS hop. The error queue is cleared after a failure instead, so
// it is empty before each call as SSL_get_error needs.
#pragma once

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "proxy/asio.h"
#include "proxy/async_read.h"
#include "proxy/tls.h"

namespace keyguard::proxy {

// What a socket holds, seen without reading it (a non-blocking MSG_PEEK): bytes, nothing yet, the
// peer's close (a FIN queued), or an error (a reset).
enum class Peeked : uint8_t { kData, kNothing, kClosed, kError };
Peeked Peek(Socket& socket);

class Stream {
 public:
  explicit Stream(asio::io_context& io) : socket_(io) {}
  // A connection the listener accepted.
  explicit Stream(Socket accepted) : socket_(std::move(accepted)) {}
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // The TCP layer (endpoints, options, peeking); reading and writing go through the calls below.
  Socket& socket() { return socket_; }
  bool tls() const { return ssl_ != nullptr; }
  // Whether the peer hung up and left nothing unread behind: plain TCP, its close (a FIN with no
  // byte before it) or a reset; TLS, the same once what is unread is only TLS alerts (a
  // close_notify) and OpenSSL holds no record it has not handed on. Bytes that may be a command
  // mean the peer is not gone.
  bool PeerGone();
  // Whether the peer shut its sending side (a FIN, read or not, whatever came before it), or the
  // connection failed: it sends nothing more. (A half-close is a hang-up, as the server takes it.)
  bool HungUp();
  // Whether a connection nothing is owed on (an idle one of a pool) is still usable: plain TCP,
  // nothing to read; TLS, nothing but post-handshake messages (session tickets), which this
  // processes (no read may be in flight). A close (close_notify or not), a reset or bytes nobody
  // asked for: not usable.
  bool IdleAndOpen();

  // Connects to `to` within `timeout` and sets the options of a proxy connection (non-blocking,
  // TCP_NODELAY, keep-alive); with `tls`, then completes a TLS handshake with the server `host`
  // (the name verified: tls->NameFor(host)). Returns the error, if any: after a TLS failure
  // (here, or a TLS alert on a later read), tls_failure() says why ("certificate verify failed:
  // ...").
  awaitable<error_code> Connect(tcp::endpoint to, TlsClient* tls, const std::string& host,
                                std::chrono::milliseconds timeout);
  const std::string& tls_failure() const { return tls_failure_; }
  // The server's side of a TLS handshake on an accepted connection, within `timeout`; afterwards
  // PeerNames() are those of the client's verified certificate (none without one).
  awaitable<error_code> Accept(TlsClient& tls, std::chrono::milliseconds timeout);
  std::vector<std::string> PeerNames() const { return PeerCertificateNames(ssl_); }

  // Reads at least one byte into `buffer`, completing as Socket::async_read_some does (the end
  // of a TLS stream, close_notify or not, is eof). `ec` must outlive the co_await.
  awaitable<size_t> ReadSome(asio::mutable_buffer buffer, error_code& ec) {
    if (ssl_ == nullptr) return AsyncReadSome(socket_, buffer, AwaitEc(ec));
    return TlsReadSome(buffer, ec);
  }
  // ReadSome's TLS half, for a caller that reads a plain socket() with AsyncReadSome itself (the
  // client's pump: with a second caller of ReadSome, GCC inlines neither call's read initiation,
  // +40 to +140 instructions a read at pipeline depth 1).
  awaitable<size_t> TlsReadSome(asio::mutable_buffer buffer, error_code& ec);
  // Whether socket().write_some may write the caller's bytes as they are (non-blocking): plain
  // TCP only; TLS bytes go through TryTlsWrite or WriteSome, which encrypt them.
  bool can_write_now() const { return ssl_ == nullptr; }
  // TLS, with no write in flight: encrypts `pieces` as one record and writes what the socket
  // takes now. Returns the bytes written; `ec` is would_block when the rest must wait (it is to
  // be offered again, the same bytes, with WriteSome), or the error.
  size_t TryTlsWrite(std::span<const std::string_view> pieces, error_code& ec);
  // Writes at least one byte of `buffer`, waiting for the socket as needed.
  awaitable<size_t> WriteSome(asio::const_buffer buffer, error_code& ec) {
    if (ssl_ == nullptr) return socket_.async_write_some(buffer, AwaitEc(ec));
    return TlsWriteSome(buffer, ec);
  }

  // Closes the socket: whatever is in flight completes with an error.
  void Close() {
    error_code ignored;
    socket_.close(ignored);
  }

 private:
  // Makes the OpenSSL connection on the socket, from the current context of `tls`.
  void StartTls(TlsClient& tls);
  // The handshake's client or server side, waiting for the socket as OpenSSL asks.
  awaitable<void> TlsHandshake(error_code& ec);
  awaitable<size_t> TlsWriteSome(asio::const_buffer buffer, error_code& ec);
  // After an OpenSSL call that returned `ret` (<= 0): waits for the socket when OpenSSL wants it
  // and returns true (call again), or sets `ec` (eof for the end of the stream, close_notify or
  // not; an error otherwise, with the queue cleared) and returns false.
  awaitable<bool> TlsWait(int ret, error_code& ec);
  // Whether the socket is still open; else sets `ec` as a closed socket's read or write does. The
  // SSL keeps the descriptor's number, which a connection made since Close() may have taken
  // (on any thread): no OpenSSL call may follow a Close(), neither a read or write resumed by a
  // wait that completed just before it (a reset wakes both at once; the first to run closes) nor
  // a Send to a stream closed while its owner still takes commands (SharedLink::Stop).
  bool StillOpen(error_code& ec) {
    if (socket_.is_open()) [[likely]] {
      return true;
    }
    ec = asio::error::bad_descriptor;
    return false;
  }

  Socket socket_;
  std::shared_ptr<TlsContext> context_;  // kept while the connection lives (a reload makes a new one)
  SSL* ssl_ = nullptr;                   // owned
  bool tls_drained_ = false;             // the last SSL_read emptied the socket and OpenSSL's buffer
  std::string gather_;                   // TryTlsWrite's pieces, made one
  std::string tls_failure_;
};

// Closes the stream's socket if `timeout` passes before Done(). Its state is shared: a timer that
// fired just as the work completed must not touch a later connection.
class StreamDeadline {
 public:
  StreamDeadline(Stream& stream, std::chrono::milliseconds timeout)
      : timer_(stream.socket().get_executor()), state_(std::make_shared<int>(kRunning)) {
    timer_.expires_after(timeout);
    timer_.async_wait([&stream, state = state_](error_code e) {
      if (!e && *state == kRunning) {
        *state = kTimedOut;
        stream.Close();
      }
    });
  }
  StreamDeadline(const StreamDeadline&) = delete;
  StreamDeadline& operator=(const StreamDeadline&) = delete;
  ~StreamDeadline() { Done(); }
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

}  // namespace keyguard::proxy
