#include "proxy/session.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "keyguard/common/json_line.h"
#include "keyguard/hygiene/detectors.h"
#include "proxy/async_read.h"
#include "proxy/session_pump.h"
#include "proxy/size_probe.h"

namespace keyguard::proxy {
namespace {

// A client that has not finished its TLS handshake by then is closed.
constexpr std::chrono::seconds kTlsHandshakeTimeout(10);

ConnectionShared SharedOf(Worker& w) {
  return ConnectionShared{w.stages, w.hygiene, w.hot, w.walk_budget, w.cluster != nullptr ? &w.cluster->map : nullptr};
}

}  // namespace

Session::Session(Worker& worker, Socket client)
    : worker_(worker),
      client_(std::move(client)),
      upstream_(std::make_unique<Stream>(worker.io)),
      client_out_(client_, &worker.shard->client_bytes_sent),
      upstream_out_(*upstream_, &worker.shard->upstream_bytes_sent),
      client_buf_(static_cast<size_t>(worker.config.read_buffer_size)),
      upstream_buf_(static_cast<size_t>(worker.config.read_buffer_size)),
      conn_(SharedOf(worker), *this),
      queue_event_(worker.io) {
  worker_.shard->client_connections.Add(1);
  worker_.shard->client_connections_total.Add();
  worker_.session_count.fetch_add(1, std::memory_order_relaxed);
}

Session::~Session() {
  worker_.shard->client_connections.Add(-1);
  worker_.session_count.fetch_sub(1, std::memory_order_relaxed);
}

void Session::Start() {
  auto self = shared_from_this();
  client_out_.set_owner(self);
  upstream_out_.set_owner(self);
  std::weak_ptr<Session> weak = self;
  client_out_.set_on_error([weak](error_code) {
    if (auto s = weak.lock()) s->Close();
  });
  upstream_out_.set_on_error([weak](error_code) {
    if (auto s = weak.lock()) s->FailUpstream(metrics::UpstreamError::kReset);
  });
  asio::co_spawn(
      worker_.io, [self]() { return self->Run(); }, asio::detached);
}

awaitable<void> Session::Run() {
  auto self = shared_from_this();
  error_code ec;
  client_.socket().non_blocking(true, ec);
  client_.socket().set_option(tcp::no_delay(true), ec);
  const tcp::endpoint peer = client_.socket().remote_endpoint(ec);
  if (!ec) conn_.set_client_address(absl::StrCat(peer.address().to_string(), ":", peer.port()));
  if (worker_.listen_tls != nullptr && !co_await AcceptTls()) co_return;

  if (worker_.cluster != nullptr) {
    // A Redis Cluster: each command goes to its slot's node (ClusterClient), until pinned.
    conn_.set_multiplexed();
    const tcp::endpoint local = client_.socket().local_endpoint(ec);
    conn_.set_cluster(ec ? std::string("127.0.0.1") : local.address().to_string(), ec ? 0 : local.port());
    cluster_ = std::make_unique<ClusterClient>(worker_, static_cast<LinkClient&>(*this));
    std::weak_ptr<Session> weak = self;
    cluster_->set_on_overflow([weak, &io = worker_.io]() {
      asio::post(io, [weak]() {
        if (auto s = weak.lock(); s != nullptr && !s->closed_) s->CutOff();
      });
    });
    co_await ClientPump<true>();
    co_return;
  }
  if (!worker_.links.empty()) {
    // Shared upstream connections: the client's commands go to one of the worker's links (all of
    // them to the same one, so they stay in order) until it is pinned.
    conn_.set_multiplexed();
    link_ = worker_.PickLink();
    if (link_->partner() != nullptr) conn_.set_lanes();
    co_await WaitForLanes(link_);
    if (closed_) co_return;
    co_await ClientPump<true>();
    co_return;
  }

  // Connect upstream (and the TLS handshake), bounded by the connect timeout.
  ec = co_await upstream_->Connect(worker_.upstream, worker_.upstream_tls.get(), worker_.upstream_host,
                                   std::chrono::milliseconds(worker_.config.upstream_connect_timeout_ms));
  if (closed_) co_return;
  if (ec) {
    const bool tls = !upstream_->tls_failure().empty();
    worker_.shard->CountUpstreamError(tls ? metrics::UpstreamError::kTls : metrics::UpstreamError::kConnect);
    if (tls) conn_.set_upstream_failure(absl::StrCat("upstream TLS: ", upstream_->tls_failure()));
    upstream_->Close();
    if (worker_.upstream_failed) worker_.upstream_failed();
  } else {
    conn_.OnUpstreamConnected();  // keyguard's AUTH and CLIENT ID, ahead of every client command
    Flush();
    asio::co_spawn(
        worker_.io, [self]() { return self->UpstreamPump(); }, asio::detached);
  }
  co_await ClientPump<false>();
}

awaitable<bool> Session::AcceptTls() {
  const error_code ec = co_await client_.Accept(*worker_.listen_tls, kTlsHandshakeTimeout);
  if (closed_) co_return false;
  if (ec) {
    // Not a TLS client, or no trusted certificate where one is required: nothing to answer.
    Close();
    co_return false;
  }
  const tenant::Tenancy* tenancy = worker_.config.tenancy.get();
  if (tenancy != nullptr && tenancy->has_cert_names()) {
    if (const tenant::User* user = tenancy->ForCertificate(client_.PeerNames()); user != nullptr) {
      conn_.LogInByCertificate(user->tenant);
    }
  }
  co_return true;
}

// ---------------------------------------------------------------------------------------------
// Client -> upstream

// ClientPump, ProcessClientBytes and FlushAs: session_pump.h (ClientPump<true> in session_shared.cc).
template awaitable<void> Session::ClientPump<false>();

void Session::Flush() {
  if (multiplexed()) {
    FlushAs<true>();
  } else {
    FlushAs<false>();
  }
}

void Session::ArmWalkTimer(int64_t wait_ns) {
  if (walk_timer_ == nullptr) walk_timer_ = std::make_unique<Timer>(worker_.io);
  walk_timer_->expires_after(std::chrono::nanoseconds(wait_ns));
  std::weak_ptr<Session> weak = shared_from_this();
  walk_timer_->async_wait([weak](error_code e) {
    if (auto s = weak.lock(); s && !e && !s->closed_) {
      s->conn_.OnWalkTimer(NowNs());
      s->Flush();
    }
  });
}

bool Session::ClientGone() {
  if (client_buf_.size() != 0) return false;  // commands held behind the walk are still served
  return client_.PeerGone();
}

void ReportFinding(Worker& worker, hygiene::Finding f) {
  metrics::WorkerShard& shard = *worker.shard;
  const char* kind = hygiene::KindName(f.kind);
  shard.findings.Get({kind, f.key_pattern}).Add();
  worker.HygieneActions(f.kind, f.action).Add();
  if (f.kind == hygiene::Kind::kBigStringWrite || f.kind == hygiene::Kind::kBigStringRead ||
      f.kind == hygiene::Kind::kWholeCollectionRead || f.kind == hygiene::Kind::kBigKeyAccess ||
      f.kind == hygiene::Kind::kDelBigKey || f.kind == hygiene::Kind::kExpireBigKey) {
    shard.bigkey_access.Get({kind, f.command, f.key_pattern}).Add();
  }
  if (worker.findings != nullptr) worker.findings->Add(f);
}

void Session::Report(hygiene::Finding f) { ReportFinding(worker_, std::move(f)); }

std::string_view Session::UpstreamAuth() {
  // A rotated password file's new secret: a connection made (or pinned, or RESET) after the
  // rotation authenticates with what the server takes now.
  upstream_auth_ = worker_.upstream_credentials->Current();
  return *upstream_auth_;
}

void Session::WakeProbe() {
  if (worker_.probe != nullptr) worker_.probe->Wake();
}

// ---------------------------------------------------------------------------------------------
// Upstream -> client

awaitable<void> Session::UpstreamPump() {
  auto self = shared_from_this();
  upstream_read_ns_ = NowNs();
  last_reply_may_close_ = false;
  const size_t max_out = static_cast<size_t>(worker_.config.max_output_buffer);
  size_t hint = 0;
  while (!closed_) {
    while (!closed_ && client_out_.backlog() > max_out) co_await client_out_.WaitBelow(max_out / 2);
    if (closed_) break;
    upstream_buf_.Prepare(hint);
    error_code ec;
    const size_t n = co_await upstream_->ReadSome(upstream_buf_.free_space(), ec);
    if (closed_) break;
    if (ec) {
      if (upstream_eof_) ec = asio::error::eof;  // CheckUpstream saw the close (and cancelled the read)
      if (!upstream_->tls_failure().empty()) {
        conn_.set_upstream_failure(absl::StrCat("upstream TLS: ", upstream_->tls_failure()));
      }
      // (After a reply the server may close after, and nothing since: as below, the close is all
      // the client sees of what it pipelined behind it, however late the end of the stream came.)
      FailUpstream(ec == asio::error::eof             ? metrics::UpstreamError::kClosed
                   : upstream_->tls_failure().empty() ? metrics::UpstreamError::kReset
                                                      : metrics::UpstreamError::kTls,
                   /*tell_client=*/!last_reply_may_close_);
      co_return;
    }
    upstream_buf_.Commit(n);
    worker_.shard->upstream_bytes_received.Add(n);
    bool ok = true;
    upstream_read_ns_ = NowNs();
    const size_t used =
        conn_.OnUpstreamBytes(upstream_buf_.data(), upstream_buf_.size(), upstream_read_ns_, &hint, &ok);
    FlushAs<false>();  // dedicated, or pinned: what goes upstream goes to upstream_
    upstream_buf_.Consume(used);
    NotifyQueue();
    // A write refused by a replica: the primary may have moved (Sentinel: ask again).
    if (conn_.TakeReadOnlySeen() && worker_.upstream_failed) worker_.upstream_failed();
    if (cluster_ != nullptr) [[unlikely]] {
      // A pinned connection got MOVED (passed on: it is the client's own connection): the next pin
      // of that slot goes to the node named, and the map is asked for again.
      if (const std::string moved = conn_.TakeRedirectSeen(); !moved.empty()) {
        if (auto r = cluster::ParseRedirect(moved); r.has_value() && !r->ask && !conn_.redirect_scripted()) {
          worker_.shard->cluster_redirects[0].Add();
          OnClusterMoved(worker_, *r);
        }
        if (worker_.cluster->refresh) worker_.cluster->refresh();
      }
    }
    if (!ok) {
      FailUpstream(conn_.read_error());
      co_return;
    }
    last_reply_may_close_ = conn_.TakeCloseMayFollow() && upstream_buf_.size() == 0;
    if (last_reply_may_close_ && upstream_->PeerGone()) [[unlikely]] {
      // The server closed after its reply (CLIENT KILL of this connection, ...): the client gets
      // the reply, then the close, as direct; commands it pipelined after it never ran, and get no
      // reply (direct, the close is all it sees of them).
      FailUpstream(metrics::UpstreamError::kClosed, /*tell_client=*/false);
      co_return;
    }
    if (multiplexed() && conn_.CanUnpin() && upstream_buf_.size() == 0 && upstream_out_.backlog() == 0) {
      // The transaction or blocking command ended: back to the shared connection.
      Unpin();
      co_return;
    }
    if (worker_.draining && conn_.idle() && !closing_) {
      co_await FlushAndClose();
      co_return;
    }
  }
}

void Session::NotifyQueue() {
  if (queue_waiter_) {
    queue_waiter_ = false;
    queue_event_.cancel();
  }
}

void Session::FailUpstream(metrics::UpstreamError reason, bool tell_client) {
  if (closed_) return;
  std::string owed;
  const Connection::AfterFailure after = conn_.OnUpstreamFailed(reason, &owed);
  if (after == Connection::AfterFailure::kNone) return;
  CloseUpstream();
  if (!owed.empty() && (tell_client || after != Connection::AfterFailure::kClose)) client_out_.Send(owed);
  NotifyQueue();
  if (after == Connection::AfterFailure::kClose) StartFlushAndClose();
}

void Session::CloseUpstream() {
  conn_.OnUpstreamClosed();
  upstream_->Close();
}

// ---------------------------------------------------------------------------------------------
// Lifecycle

awaitable<void> Session::FlushAndClose() {
  auto self = shared_from_this();
  if (closing_ || closed_) co_return;
  closing_ = true;
  // A client that never reads must not keep the session forever.
  auto limit = std::make_shared<Timer>(worker_.io, std::chrono::seconds(30));
  std::weak_ptr<Session> weak = self;
  limit->async_wait([weak, limit](error_code e) {
    if (auto s = weak.lock(); s && !e) s->Close();
  });
  while (!closed_ && client_out_.backlog() > 0 && !client_out_.failed()) co_await client_out_.WaitBelow(0);
  limit->cancel();
  Close();
}

void Session::CheckUpstream(int64_t now_ns) {
  if (closed_ || conn_.pending() == 0 || on_link() || !conn_.upstream_ready() || upstream_eof_) return;
  if (now_ns - upstream_read_ns_ < 1'000'000'000) return;
  if (Peek(upstream_->socket()) == Peeked::kClosed) {
    upstream_eof_ = true;
    error_code ignored;
    upstream_->socket().cancel(ignored);  // the pending read completes, as at the end of the stream
  }
}

void Session::WaitingForUpstream() {
  if (waiting_since_ns_ == 0) waiting_since_ns_ = NowNs();
}

bool Session::ClientHungUp(int64_t now_ns) {
  // Only behind a command that may block: any other reply comes (a slow script, a big reply, a
  // busy server), and the server delivers it to a client that half-closed.
  if (closed_ || waiting_since_ns_ == 0 || !conn_.HeadMayBlock()) return false;
  const int64_t last = std::max({waiting_since_ns_, upstream_read_ns_, link_now_ns_});
  return now_ns - last >= 1'000'000'000 && client_.HungUp();
}

void Session::CloseHungUp() {
  if (closed_) return;
  EventLine("info", "client_hung_up_while_waiting")
      .Int("owed_replies", static_cast<int64_t>(conn_.pending()))
      .Write(stderr);
  Close();
}

void Session::StartFlushAndClose() {
  if (closing_) return;
  auto self = shared_from_this();
  asio::co_spawn(
      worker_.io, [self]() { return self->FlushAndClose(); }, asio::detached);
}

void Session::Drain() {
  if (conn_.holding() || conn_.resume()) {
    // Commands read behind a walk are still to be served: ClientPump stops reading after them.
    drain_after_walk_ = true;
    return;
  }
  conn_.StopReading();  // commands already read are still served
  if (conn_.pending() == 0) StartFlushAndClose();
  // Otherwise the last pending reply closes it (UpstreamPump, or EndLinkReplies on a shared link).
}

void Session::Close() {
  if (closed_) return;
  auto self = shared_from_this();
  closed_ = true;
  conn_.OnClose();
  error_code ignored;
  client_.socket().shutdown(Socket::shutdown_both, ignored);
  client_.Close();
  if (link_ != nullptr) {
    link_->Forget(this);
    if (link_->partner() != nullptr) link_->partner()->Forget(this);
  }
  if (cluster_ != nullptr) cluster_->Detach();
  if (multiplexed() && conn_.pinned()) ObservePin();
  CloseUpstream();
  queue_event_.cancel();
  client_out_.Wake();
  upstream_out_.Wake();
  worker_.sessions.erase(self);
}

}  // namespace keyguard::proxy
