#include "admin/admin_server.h"

#include "proxy/stream.h"

#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "keyguard/common/views.h"

namespace keyguard::admin {
namespace beast = boost::beast;
namespace http = beast::http;
namespace {

// `n` of a query string (`/debug/hotkeys?n=50`): 1..10000, default 20.
size_t TopN(std::string_view target) {
  const size_t q = target.find('?');
  if (q == std::string_view::npos) return 20;
  std::string_view query = target.substr(q + 1);
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view param = query.substr(0, amp);
    uint64_t n = 0;
    if (param.substr(0, 2) == "n=" && absl::SimpleAtoi(AsAbsl(param.substr(2)), &n)) {
      return std::clamp<uint64_t>(n, 1, 10000);
    }
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  return 20;
}

}  // namespace

AdminServer::AdminServer(asio::io_context& io, const metrics::Registry& registry, const config::ProxyConfig& config,
                         const config::ConfigStore& store, const hygiene::FindingLog& findings,
                         const hygiene::HotKeysBoard& hot_keys, tcp::endpoint upstream, proxy::TlsClient* upstream_tls,
                         const proxy::SentinelWatch* sentinel, const std::atomic<bool>& draining,
                         const proxy::ClusterWatch* cluster)
    : io_(io),
      registry_(registry),
      config_(config),
      store_(store),
      findings_(findings),
      hot_keys_(hot_keys),
      upstream_(upstream),
      upstream_tls_(upstream_tls),
      sentinel_(sentinel),
      draining_(draining),
      cluster_(cluster),
      acceptor_(io) {}

absl::Status AdminServer::Listen() {
  tcp::resolver resolver(io_);
  error_code ec;
  auto results = resolver.resolve(config_.admin.host, std::to_string(config_.admin.port), ec);
  if (ec || results.empty())
    return absl::UnavailableError(absl::StrCat("admin: cannot resolve ", config_.admin.ToString()));
  const tcp::endpoint ep = results.begin()->endpoint();
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    return absl::UnavailableError(
        absl::StrCat("admin: cannot listen on ", config_.admin.ToString(), ": ", ec.message()));
  endpoint_ = acceptor_.local_endpoint();
  asio::co_spawn(io_, Accept(), asio::detached);
  return absl::OkStatus();
}

awaitable<void> AdminServer::Accept() {
  for (;;) {
    error_code ec;
    Socket socket = co_await acceptor_.async_accept(AwaitEc(ec));
    if (ec) {
      if (!acceptor_.is_open()) co_return;
      continue;
    }
    asio::co_spawn(io_, Serve(std::move(socket)), asio::detached);
  }
}

awaitable<std::string> AdminServer::ProbeUpstream() {
  if (cluster_ != nullptr) co_return co_await ProbeCluster();
  const proxy::Primary primary = sentinel_ != nullptr ? sentinel_->current() : proxy::Primary();
  co_return co_await Probe(sentinel_ != nullptr ? primary.endpoint : upstream_,
                           sentinel_ != nullptr ? primary.host : config_.upstream.address.host);
}

awaitable<std::string> AdminServer::ProbeCluster() {
  const auto map = cluster_->current();
  if (map == nullptr) co_return "no slot map yet";
  size_t unserved = 0;
  for (uint16_t o : map->owner) unserved += o == proxy::cluster::SlotMap::kNoOwner;
  if (unserved != 0) co_return absl::StrCat(unserved, " slots have no primary");
  std::string why;
  for (const proxy::cluster::Node& n : map->primaries) {
    const auto at = proxy::NodeEndpoint(n);
    if (!at.has_value()) continue;
    why = co_await Probe(*at, n.host);
    if (why.empty()) co_return "";  // a primary answers (the others fail over by themselves)
  }
  co_return absl::StrCat("no primary answers (", why, ")");
}

awaitable<std::string> AdminServer::Probe(tcp::endpoint at, const std::string& host) {
  proxy::Stream s(io_);
  error_code ec = co_await s.Connect(at, upstream_tls_, host, std::chrono::seconds(1));
  if (!s.tls_failure().empty()) co_return absl::StrCat("TLS: ", s.tls_failure());
  bool ok = false;
  if (!ec) {
    // `done`: a timer that fires as the reply arrives must not touch `s` after this returns.
    auto done = std::make_shared<bool>(false);
    Timer timer(io_, std::chrono::seconds(1));
    timer.async_wait([&s, done](error_code e) {
      if (!e && !*done) s.Close();
    });
    size_t n = co_await s.WriteSome(asio::buffer("*1\r\n$4\r\nPING\r\n", 14), ec);
    char reply[64];
    if (!ec && n == 14) n = co_await s.ReadSome(asio::buffer(reply), ec);
    ok = !ec && n > 0 && (reply[0] == '+' || reply[0] == '-');
    *done = true;
    timer.cancel();
  }
  s.Close();
  co_return ok ? "" : "unreachable";
}

awaitable<void> AdminServer::Serve(Socket socket) {
  beast::flat_buffer buffer;
  for (;;) {
    http::request<http::string_body> req;
    error_code ec;
    co_await http::async_read(socket, buffer, req, AwaitEc(ec));
    if (ec) co_return;
    http::response<http::string_body> res{http::status::ok, req.version()};
    res.set(http::field::server, "keyguard");
    res.set(http::field::content_type, "text/plain; charset=utf-8");
    const std::string_view target(req.target().data(), req.target().size());
    const std::string_view path = target.substr(0, target.find('?'));
    if (req.method() != http::verb::get && req.method() != http::verb::head) {
      res.result(http::status::method_not_allowed);
      res.body() = "only GET\n";
    } else if (path == "/metrics") {
      res.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
      res.body() = registry_.Render();
    } else if (path == "/debug/findings") {
      res.set(http::field::content_type, "application/json");
      res.body() = findings_.RecentJson();
    } else if (path == "/debug/hotkeys" || path == "/debug/bigkeys") {
      res.set(http::field::content_type, "application/json");
      const size_t n = TopN(target);
      res.body() = path == "/debug/hotkeys" ? hot_keys_.HotKeysJson(n) : hot_keys_.BigKeysJson(n);
    } else if (path == "/config") {
      res.body() = store_.Describe();
    } else if (path == "/healthz") {
      res.body() = "ok\n";
    } else if (path == "/readyz") {
      if (draining_.load()) {
        res.result(http::status::service_unavailable);
        res.body() = "draining\n";
      } else if (const std::string why = co_await ProbeUpstream(); !why.empty()) {
        res.result(http::status::service_unavailable);
        res.body() =
            absl::StrCat("upstream ", config_.upstream.ToString(), why == "unreachable" ? " " : ": ", why, "\n");
      } else {
        res.body() = "ready\n";
      }
    } else {
      res.result(http::status::not_found);
      res.body() =
          "not found; try /metrics, /healthz, /readyz, /config, /debug/findings, /debug/hotkeys, /debug/bigkeys\n";
    }
    res.keep_alive(req.keep_alive());
    res.prepare_payload();
    co_await http::async_write(socket, res, AwaitEc(ec));
    if (ec || !req.keep_alive()) break;
  }
  error_code ignored;
  socket.shutdown(Socket::shutdown_send, ignored);
}

}  // namespace keyguard::admin
