// One connection for keyguard's own questions on the control thread (Sentinel, cluster slot map):
// connect (TLS included), AUTH, ask, read one frame with a timeout.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "keyguard/config/config.h"
#include "keyguard/resp/encoder.h"
#include "keyguard/resp/framer.h"
#include "proxy/asio.h"
#include "proxy/stream.h"
#include "proxy/tls.h"

namespace keyguard::proxy {

// A top-level reply: its type, element count and first scalars (enough for what is asked here).
struct Reply {
  char type = 0;
  int64_t size = 0;
  std::vector<std::string> head;
  std::string frame;  // all of its bytes
};

// One connection for keyguard's own questions to a Sentinel or a server.
class ControlLink {
 public:
  explicit ControlLink(asio::io_context& io) : io_(io), stream_(io) {}
  ~ControlLink() { stream_.Close(); }

  // Resolves, connects (TLS included) and AUTHs when `password` is set.
  awaitable<absl::Status> Open(const std::string& host, uint16_t port, TlsClient* tls,
                               std::chrono::milliseconds timeout, const std::string& user,
                               const std::string& password) {
    const std::string where = config::HostPort{host, port}.ToString();
    asio::ip::basic_resolver<tcp, Executor> resolver(io_);
    error_code ec;
    auto results = co_await resolver.async_resolve(host, std::to_string(port), AwaitEc(ec));
    if (ec || results.empty()) co_return absl::UnavailableError(absl::StrCat(where, ": cannot resolve"));
    endpoint_ = results.begin()->endpoint();
    ec = co_await stream_.Connect(endpoint_, tls, host, timeout);
    if (ec) {
      co_return absl::UnavailableError(
          absl::StrCat(where, ": ", stream_.tls_failure().empty() ? ec.message() : "TLS: " + stream_.tls_failure()));
    }
    if (!password.empty()) {
      std::vector<std::string_view> auth = {"AUTH"};
      if (!user.empty()) auth.push_back(user);
      auth.push_back(password);
      auto r = co_await Call(auth, timeout);
      if (!r.ok()) co_return r.status();
      if (r->type != '+') co_return absl::PermissionDeniedError(absl::StrCat(where, ": AUTH refused"));
    }
    co_return absl::OkStatus();
  }

  awaitable<absl::StatusOr<Reply>> Call(std::vector<std::string_view> args, std::chrono::milliseconds timeout) {
    std::string out;
    resp::AppendCommand(&out, args);
    error_code ec;
    size_t sent = 0;
    while (!ec && sent < out.size())
      sent += co_await stream_.WriteSome(asio::buffer(out.data() + sent, out.size() - sent), ec);
    if (ec) co_return absl::UnavailableError(absl::StrCat(Where(), ": ", ec.message()));
    co_return co_await Read(timeout);
  }

  // The next frame; with a timeout, the connection closes when none comes in time.
  awaitable<absl::StatusOr<Reply>> Read(std::optional<std::chrono::milliseconds> timeout) {
    enum { kRunning, kDone, kTimedOut };
    auto state = std::make_shared<int>(kRunning);
    Timer timer(io_);
    if (timeout) {
      timer.expires_after(*timeout);
      timer.async_wait([this, state](error_code e) {
        if (!e && *state == kRunning) {
          *state = kTimedOut;
          stream_.Close();
        }
      });
    }
    absl::StatusOr<Reply> result = absl::UnavailableError("");
    for (;;) {
      if (!buf_.empty()) {
        const resp::Status st = framer_.Next(buf_.data(), buf_.size());
        if (st == resp::Status::kOk) {
          Reply r;
          r.type = framer_.type();
          r.size = framer_.size();
          for (const auto& s : framer_.head()) r.head.emplace_back(s.text);
          r.frame.assign(buf_.data(), framer_.consumed());
          buf_.erase(0, framer_.consumed());
          result = std::move(r);
          break;
        }
        if (st == resp::Status::kProtocolError) {
          result = absl::DataLossError(absl::StrCat(Where(), ": protocol error: ", framer_.error()));
          break;
        }
      }
      char chunk[4096];
      error_code ec;
      const size_t n = co_await stream_.ReadSome(asio::buffer(chunk), ec);
      if (ec) {
        result = absl::UnavailableError(
            absl::StrCat(Where(), ": ", *state == kTimedOut ? std::string("no reply in time") : ec.message()));
        break;
      }
      buf_.append(chunk, n);
    }
    if (*state == kRunning) *state = kDone;
    timer.cancel();
    co_return result;
  }

  std::string Where() const { return absl::StrCat(endpoint_.address().to_string(), ":", endpoint_.port()); }

 private:
  asio::io_context& io_;
  Stream stream_;
  tcp::endpoint endpoint_;
  std::string buf_;
  resp::ReplyFramer framer_;
};

}  // namespace keyguard::proxy
