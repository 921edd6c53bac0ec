#include "maintenance/redis_link.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <tuple>
#include <utility>  // before Asio (proxy/tls.h): GCC 12 + Boost 1.74

#include <hiredis/hiredis.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "keyguard/resp/encoder.h"
#include "proxy/tls.h"

namespace keyguard::maintenance {
namespace {

Reply Convert(const redisReply* r) {
  Reply out;
  switch (r->type) {
    case REDIS_REPLY_INTEGER:
      out.kind = Reply::Kind::kInteger;
      out.integer = r->integer;
      break;
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS:
    case REDIS_REPLY_ERROR:
      out.kind = r->type == REDIS_REPLY_STRING   ? Reply::Kind::kString
                 : r->type == REDIS_REPLY_STATUS ? Reply::Kind::kStatus
                                                 : Reply::Kind::kError;
      out.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_ARRAY:
      out.kind = Reply::Kind::kArray;
      out.elements.reserve(r->elements);
      for (size_t i = 0; i < r->elements; ++i) out.elements.push_back(Convert(r->element[i]));
      break;
    default: break;  // nil
  }
  return out;
}

std::string Seconds(std::chrono::milliseconds t) {
  return t.count() % 1000 == 0 ? absl::StrCat(t.count() / 1000, " s") : absl::StrCat(t.count(), " ms");
}

// A blocking TCP socket connected to `where` within `timeout` (each address getaddrinfo gives,
// in turn), with TCP_NODELAY and keep-alive; or what failed.
absl::StatusOr<int> ConnectSocket(const config::HostPort& where, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(where.port);
  if (const int rc = getaddrinfo(where.host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve: ", gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owned(found, &freeaddrinfo);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string error = "no address";
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    int err = connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    while (err == EINPROGRESS || err == EINTR) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      pollfd p{fd, POLLOUT, 0};
      const int n = left > 0 ? poll(&p, 1, static_cast<int>(left)) : 0;
      if (n == 0) {
        err = ETIMEDOUT;
      } else if (n < 0) {
        err = errno;  // EINTR: poll again for the time left
      } else {
        socklen_t len = sizeof err;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      }
    }
    if (err != 0) {
      error = err == ETIMEDOUT ? absl::StrCat("no connection in ", Seconds(timeout)) : std::strerror(err);
      close(fd);
      continue;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    const int on = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
    return fd;
  }
  return absl::UnavailableError(error);
}

std::string SentinelError(const config::HostPort& sentinel, absl::string_view message) {
  return absl::StrCat("Sentinel ", sentinel.ToString(), ": ", message);
}

}  // namespace

RedisLink::RedisLink(std::string address, std::string where, int fd)
    : address_(std::move(address)), where_(std::move(where)), fd_(fd), reader_(redisReaderCreate()) {}

RedisLink::~RedisLink() {
  if (ssl_ != nullptr) {
    if (SSL_is_init_finished(ssl_)) SSL_shutdown(ssl_);  // close_notify, without waiting for the server's
    SSL_free(ssl_);
  }
  close(fd_);
  redisReaderFree(reader_);
}

absl::StatusOr<std::unique_ptr<RedisLink>> RedisLink::Connect(const config::HostPort& where, const LinkOptions& options,
                                                              int db) {
  return Open(where, options, db, where.ToString());
}

absl::StatusOr<std::unique_ptr<RedisLink>> RedisLink::Open(const config::HostPort& where, const LinkOptions& options,
                                                           int db, std::string name) {
  std::unique_ptr<RedisLink> link;
  for (int attempt = 1;; ++attempt) {
    auto fd = ConnectSocket(where, options.connect_timeout);
    if (!fd.ok()) return absl::UnavailableError(absl::StrCat(name, ": ", fd.status().message()));
    link.reset(new RedisLink(where.ToString(), name, *fd));
    link->io_timeout_ = options.io_timeout;
    if (options.tls == nullptr) break;
    // The handshake gets the connect timeout: a server that takes no TLS answers nothing.
    if (auto s = link->SetTimeouts(options.connect_timeout); !s.ok()) return s;
    if (auto s = link->Handshake(*options.tls, where.host); !s.ok()) return s;
    if (attempt > 1) {
      if (auto s = link->AwaitServer(options.connect_timeout); !s.ok()) return s;
    }
    if (auto s = link->SetTimeouts(options.io_timeout); !s.ok()) return s;
    // Under TLS 1.3 a server refuses a client certificate after the handshake, with an alert and a
    // close: read here, as a connection error (any reply will do, NOAUTH too). The PING may cross
    // that close, and the server's kernel answers it with a reset that can discard the alert
    // before it is read; then once more, this time waiting for the server's first words (session
    // tickets, or the alert) before sending anything.
    auto r = link->Call({"PING"});
    if (r.ok()) break;
    if (attempt > 1 || !link->closed_) return r.status();
  }
  if (auto s = link->SetTimeouts(options.io_timeout); !s.ok()) return s;
  if (!options.password.empty()) {
    Command auth = {"AUTH"};
    if (!options.user.empty()) auth.push_back(options.user);
    auth.push_back(options.password);
    auto r = link->Call(auth);
    if (!r.ok()) return r.status();
    if (r->is_error()) return absl::PermissionDeniedError(absl::StrCat(link->where_, ": AUTH: ", r->str));
  }
  if (db != 0) {
    auto r = link->Call({"SELECT", absl::StrCat(db)});
    if (!r.ok()) return r.status();
    if (r->is_error()) return absl::InvalidArgumentError(absl::StrCat(link->where_, ": SELECT ", db, ": ", r->str));
  }
  return link;
}

absl::Status RedisLink::AwaitServer(std::chrono::milliseconds timeout) {
  pollfd p{fd_, POLLIN, 0};
  int n;
  do {
    n = poll(&p, 1, static_cast<int>(timeout.count()));
  } while (n < 0 && errno == EINTR);
  if (n <= 0) return absl::OkStatus();  // nothing said: nothing against us either
  const int flags = fcntl(fd_, F_GETFL);
  fcntl(fd_, F_SETFL, flags | O_NONBLOCK);
  char c;
  ERR_clear_error();
  errno = 0;
  const int rc = SSL_peek(ssl_, &c, 1);
  const int e = rc > 0 ? SSL_ERROR_NONE : SSL_get_error(ssl_, rc);
  absl::Status status = absl::OkStatus();
  if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
    ERR_clear_error();  // only tickets so far
  } else if (e != SSL_ERROR_NONE) {
    status = TlsError(rc, "handshake timed out");
  }
  fcntl(fd_, F_SETFL, flags);
  return status;
}

absl::Status RedisLink::SetTimeouts(std::chrono::milliseconds timeout) {
  const timeval tv{static_cast<time_t>(timeout.count() / 1000),
                   static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  if (setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
      setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0) {
    return absl::InternalError(absl::StrCat(where_, ": setsockopt: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status RedisLink::Handshake(proxy::TlsClient& tls, const std::string& host) {
  // The proxy's context: the same CAs, client certificate, versions and ciphers; Prepare() sets
  // SNI and the name to verify as for the proxy's own upstream connections.
  context_ = tls.Current();
  ERR_clear_error();
  ssl_ = SSL_new(context_->context().native_handle());
  if (ssl_ == nullptr || SSL_set_fd(ssl_, fd_) != 1) {
    return absl::InternalError(absl::StrCat(where_, ": TLS: cannot make a connection"));
  }
  context_->Prepare(ssl_, tls.NameFor(host), address_);
  // A blocking socket: a read that meets only a post-handshake message (a session ticket) reads on.
  SSL_set_mode(ssl_, SSL_MODE_AUTO_RETRY);
  for (;;) {
    ERR_clear_error();
    errno = 0;
    const int rc = SSL_connect(ssl_);
    if (rc == 1) break;
    if (errno == EINTR) continue;  // a signal (SIGINT asks the walk to stop, not the handshake)
    return TlsError(rc, "handshake timed out");
  }
  tls.CountHandshake(SSL_session_reused(ssl_) == 1);
  return absl::OkStatus();
}

absl::Status RedisLink::TlsError(int rc, std::string_view timed_out) {
  const int saved_errno = errno;
  const int e = SSL_get_error(ssl_, rc);
  std::string why;
  if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
    // A blocking socket wants more only when SO_RCVTIMEO/SO_SNDTIMEO ran out.
    why = std::string(timed_out);
  } else if (e == SSL_ERROR_SSL) {
    // As the proxy words it: the verification error, else OpenSSL's reason.
    const boost::system::error_code ec(static_cast<int>(ERR_peek_error()), boost::asio::error::get_ssl_category());
    why = absl::StrCat("TLS: ", proxy::TlsFailure(ssl_, ec));
  } else if (e == SSL_ERROR_SYSCALL && (saved_errno == EAGAIN || saved_errno == EWOULDBLOCK)) {
    why = std::string(timed_out);
  } else if (e == SSL_ERROR_SYSCALL && saved_errno != 0) {
    closed_ = saved_errno == ECONNRESET || saved_errno == EPIPE;
    why = std::strerror(saved_errno);
  } else {
    closed_ = true;
    why = "the server closed the connection";
  }
  ERR_clear_error();
  return absl::UnavailableError(absl::StrCat(where_, ": ", why));
}

absl::Status RedisLink::WriteAll(const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const size_t n = std::min<size_t>(data.size() - sent, INT_MAX);
    errno = 0;
    if (ssl_ != nullptr) {
      ERR_clear_error();
      const int rc = SSL_write(ssl_, data.data() + sent, static_cast<int>(n));
      if (rc > 0) {
        sent += static_cast<size_t>(rc);
        continue;
      }
      if (errno == EINTR) continue;  // the same bytes again, as SSL_write wants
      return TlsError(rc, absl::StrCat("no progress writing in ", Seconds(io_timeout_)));
    }
    const ssize_t rc = send(fd_, data.data() + sent, n, MSG_NOSIGNAL);
    if (rc >= 0) {
      sent += static_cast<size_t>(rc);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return absl::UnavailableError(absl::StrCat(where_, ": no progress writing in ", Seconds(io_timeout_)));
    }
    return absl::UnavailableError(absl::StrCat(where_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> RedisLink::ReadSome(char* buf, size_t size) {
  const size_t n = std::min<size_t>(size, INT_MAX);
  for (;;) {
    errno = 0;
    if (ssl_ != nullptr) {
      ERR_clear_error();
      const int rc = SSL_read(ssl_, buf, static_cast<int>(n));
      if (rc > 0) return static_cast<size_t>(rc);
      if (errno == EINTR) continue;
      return TlsError(rc, absl::StrCat("no reply in ", Seconds(io_timeout_)));
    }
    const ssize_t rc = recv(fd_, buf, n, 0);
    if (rc > 0) return static_cast<size_t>(rc);
    if (rc == 0) return absl::UnavailableError(absl::StrCat(where_, ": the server closed the connection"));
    if (errno == EINTR) continue;  // SIGINT/SIGTERM: the batch finishes first
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return absl::UnavailableError(absl::StrCat(where_, ": no reply in ", Seconds(io_timeout_)));
    }
    return absl::UnavailableError(absl::StrCat(where_, ": ", std::strerror(errno)));
  }
}

absl::StatusOr<std::vector<Reply>> RedisLink::Pipeline(const std::vector<Command>& commands) {
  std::string out;
  std::vector<std::string_view> args;
  for (const Command& cmd : commands) {
    args.assign(cmd.begin(), cmd.end());
    resp::AppendCommand(&out, args);
  }
  if (auto s = WriteAll(out); !s.ok()) return s;
  std::vector<Reply> replies;
  replies.reserve(commands.size());
  char chunk[64 * 1024];
  while (replies.size() < commands.size()) {
    void* raw = nullptr;
    if (redisReaderGetReply(reader_, &raw) != REDIS_OK) {
      return absl::DataLossError(absl::StrCat(where_, ": protocol error: ", reader_->errstr));
    }
    if (raw != nullptr) {
      replies.push_back(Convert(static_cast<redisReply*>(raw)));
      freeReplyObject(raw);
      continue;
    }
    auto n = ReadSome(chunk, sizeof chunk);
    if (!n.ok()) return n.status();
    if (redisReaderFeed(reader_, chunk, *n) != REDIS_OK) {
      return absl::DataLossError(absl::StrCat(where_, ": protocol error: ", reader_->errstr));
    }
  }
  return replies;
}

absl::StatusOr<Reply> RedisLink::Call(const Command& command) {
  auto r = Pipeline({command});
  if (!r.ok()) return r.status();
  return std::move((*r)[0]);
}

std::optional<config::HostPort> PrimaryFromSentinel(const Reply& reply) {
  if (reply.kind != Reply::Kind::kArray || reply.elements.size() != 2) return std::nullopt;
  const Reply& host = reply.elements[0];
  const Reply& port = reply.elements[1];
  uint32_t number = 0;
  if (host.kind != Reply::Kind::kString || host.str.empty() || port.kind != Reply::Kind::kString ||
      !absl::SimpleAtoi(port.str, &number) || number == 0 || number > 65535) {
    return std::nullopt;
  }
  return config::HostPort{host.str, static_cast<uint16_t>(number)};
}

ClusterLayout LayoutFromSlots(const Reply& slots, const std::string& seed_host) {
  ClusterLayout layout;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::vector<config::HostPort> owners;
  for (const Reply& r : slots.elements) {
    if (r.elements.size() < 3 || r.elements[2].elements.size() < 2) continue;
    const Reply& node = r.elements[2];
    owners.push_back(config::HostPort{node.elements[0].str.empty() ? seed_host : node.elements[0].str,
                                      static_cast<uint16_t>(node.elements[1].integer)});
    ranges.emplace_back(r.elements[0].integer, r.elements[1].integer);
    const config::HostPort& hp = owners.back();
    const bool known = std::any_of(layout.primaries.begin(), layout.primaries.end(),
                                   [&](const config::HostPort& p) { return p.host == hp.host && p.port == hp.port; });
    if (!known) layout.primaries.push_back(hp);
  }
  std::sort(layout.primaries.begin(), layout.primaries.end(), [](const config::HostPort& a, const config::HostPort& b) {
    return std::tie(a.host, a.port) < std::tie(b.host, b.port);
  });
  for (size_t i = 0; i < owners.size(); ++i) {
    const auto at = std::find_if(layout.primaries.begin(), layout.primaries.end(), [&](const config::HostPort& p) {
      return p.host == owners[i].host && p.port == owners[i].port;
    });
    const auto index = static_cast<uint16_t>(at - layout.primaries.begin());
    for (int64_t slot = std::max<int64_t>(ranges[i].first, 0); slot <= ranges[i].second && slot < 16384; ++slot) {
      layout.owner[static_cast<size_t>(slot)] = index;
    }
  }
  return layout;
}

absl::StatusOr<UpstreamLinks> UpstreamLinks::Create(const config::ProxyConfig& config) {
  // $REDISCLI_AUTH, when set, is the password (a URL's user needs one: checked as the proxy does).
  config::ProxyConfig effective = config;
  if (const char* password = std::getenv("REDISCLI_AUTH"); password != nullptr && *password != '\0') {
    effective.upstream_auth.password = password;
  }
  // The proxy's config with --upstream at one of the group's servers (a replica, say): the
  // Sentinel credentials are just not used.
  if (effective.upstream.kind != config::Upstream::Kind::kSentinel) effective.sentinel = config::SentinelSettings();
  if (auto s = config::ValidateUpstream(effective); !s.ok()) return s;
  UpstreamLinks u;
  u.upstream_ = config.upstream;
  if (config.upstream.tls) {
    auto tls = proxy::TlsClient::Create(config.upstream_tls, "upstream_tls");
    if (!tls.ok()) return tls.status();
    u.server_.tls = *tls;
    u.sentinel_.tls = *tls;  // the proxy reaches a rediss-sentinel:// group's Sentinels with them too
  }
  u.server_.user = effective.UpstreamUser();
  u.server_.password = effective.upstream_auth.password;
  u.sentinel_.user = config.sentinel.user;
  u.sentinel_.password = config.sentinel.password;
  return u;
}

absl::StatusOr<std::unique_ptr<RedisLink>> UpstreamLinks::Connect(int db) {
  switch (upstream_.kind) {
    case config::Upstream::Kind::kDirect:
      return RedisLink::Open(upstream_.address, server_, db, absl::StrCat("upstream ", upstream_.ToString()));
    case config::Upstream::Kind::kSentinel: return SentinelPrimary(db);
    case config::Upstream::Kind::kCluster: break;
  }
  return absl::UnimplementedError(
      absl::StrCat("upstream ", upstream_.ToString(), ": a Redis Cluster has no one server to connect to"));
}

absl::StatusOr<std::unique_ptr<RedisLink>> UpstreamLinks::ConnectNode(const config::HostPort& node, int db) {
  return RedisLink::Connect(node, server_, db);
}

absl::StatusOr<std::unique_ptr<RedisLink>> UpstreamLinks::SentinelPrimary(int db) {
  std::vector<std::string> errors;
  for (const config::HostPort& s : upstream_.sentinels) {
    auto sentinel = RedisLink::Open(s, sentinel_, 0, absl::StrCat("Sentinel ", s.ToString()));
    if (!sentinel.ok()) {
      errors.emplace_back(sentinel.status().message());
      continue;
    }
    auto answer = (*sentinel)->Call({"SENTINEL", "GET-MASTER-ADDR-BY-NAME", upstream_.master});
    if (!answer.ok()) {
      errors.emplace_back(answer.status().message());
      continue;
    }
    const std::optional<config::HostPort> primary = PrimaryFromSentinel(*answer);
    if (!primary.has_value()) {
      errors.push_back(SentinelError(
          s, answer->is_error() ? answer->str : absl::StrCat("does not know master '", upstream_.master, "'")));
      continue;
    }
    // The server there must say it is the master (a Sentinel may not have seen a failover yet).
    auto link = RedisLink::Open(*primary, server_, db, absl::StrCat("primary ", primary->ToString()));
    if (!link.ok()) {
      errors.push_back(SentinelError(s, absl::StrCat("names ", link.status().message())));
      continue;
    }
    auto role = (*link)->Call({"ROLE"});
    if (!role.ok()) {
      errors.push_back(SentinelError(s, absl::StrCat("names ", role.status().message())));
      continue;
    }
    if (role->kind != Reply::Kind::kArray || role->elements.empty() || role->elements[0].str != "master") {
      const std::string said = role->is_error()         ? role->str
                               : role->elements.empty() ? std::string("?")
                                                        : role->elements[0].str;
      errors.push_back(
          SentinelError(s, absl::StrCat("names ", primary->ToString(), ", whose ROLE is ", said, ", not master")));
      continue;
    }
    // Later errors name the group and the primary.
    (*link)->where_ = absl::StrCat("upstream ", upstream_.ToString(), ": primary ", primary->ToString());
    return link;
  }
  return absl::UnavailableError(absl::StrCat("upstream ", upstream_.ToString(),
                                             ": no Sentinel gave a verified master: ", absl::StrJoin(errors, "; ")));
}

absl::StatusOr<ClusterLayout> UpstreamLinks::ClusterSlots() {
  std::vector<std::string> errors;
  for (const config::HostPort& seed : upstream_.seeds) {
    auto link = RedisLink::Connect(seed, server_, 0);
    if (!link.ok()) {
      errors.emplace_back(link.status().message());
      continue;
    }
    auto slots = (*link)->Call({"CLUSTER", "SLOTS"});
    if (!slots.ok()) {
      errors.emplace_back(slots.status().message());
      continue;
    }
    if (slots->kind != Reply::Kind::kArray) {
      errors.push_back(absl::StrCat(seed.ToString(), ": CLUSTER SLOTS: ", slots->is_error() ? slots->str : "no map"));
      continue;
    }
    ClusterLayout layout = LayoutFromSlots(*slots, seed.host);
    if (!layout.primaries.empty()) return layout;
    errors.push_back(absl::StrCat(seed.ToString(), ": no slot is served"));
  }
  return absl::UnavailableError(absl::StrCat("upstream ", upstream_.ToString(), ": ", absl::StrJoin(errors, "; ")));
}

std::string LayoutTag(const std::vector<config::HostPort>& primaries) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (const config::HostPort& p : primaries) {
    for (char ch : absl::StrCat(p.ToString(), ",")) h = (h ^ static_cast<uint8_t>(ch)) * 16777619u;
  }
  return absl::StrFormat("%08x", h);
}

std::pair<std::string, std::string> SplitCursor(const std::string& cursor) {
  const size_t dash = cursor.find('-');
  if (dash == std::string::npos) return {cursor, ""};
  return {cursor.substr(0, dash), cursor.substr(dash + 1)};
}

std::string StaleCursor(const std::string& number, const std::string& tag,
                        const std::vector<config::HostPort>& primaries) {
  if (number == "0") return "";
  if (tag.empty()) return "--cursor: not a cursor of this cluster (no NUMBER-TAG)";
  if (tag != LayoutTag(primaries)) {
    return "--cursor: the cluster's primaries changed since this cursor was printed (a failover, or a node added or "
           "removed): resuming could skip keys; run again without --cursor";
  }
  return "";
}

void Pacer::Before(size_t n) {
  if (per_second_ != 0) {
    // The batch may start when the commands already sent fit the cap: sent / rate seconds in.
    const auto due = start_ + std::chrono::microseconds(sent_ * 1000000 / per_second_);
    std::this_thread::sleep_until(due);
  }
  sent_ += n;
}

}  // namespace keyguard::maintenance
