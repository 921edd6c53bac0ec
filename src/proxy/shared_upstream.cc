#include "proxy/shared_upstream.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "keyguard/common/json_line.h"
#include "proxy/clock.h"
#include "proxy/worker.h"

namespace keyguard::proxy {

awaitable<bool> ConnectUpstream(Worker& worker, Stream& stream, std::string* tls_failure, const UpstreamAddress* to,
                                std::string* refused) {
  metrics::WorkerShard& shard = *worker.shard;
  const bool node = to != nullptr && to->endpoint.has_value();
  error_code ec = co_await stream.Connect(node ? *to->endpoint : worker.upstream, worker.upstream_tls.get(),
                                          node ? to->host : worker.upstream_host,
                                          std::chrono::milliseconds(worker.config.upstream_connect_timeout_ms));
  if (tls_failure != nullptr) *tls_failure = stream.tls_failure();
  if (ec) {
    shard.CountUpstreamError(stream.tls_failure().empty() ? metrics::UpstreamError::kConnect
                                                          : metrics::UpstreamError::kTls);
    if (worker.upstream_failed) worker.upstream_failed();
    if (node && worker.cluster != nullptr && worker.cluster->refresh) worker.cluster->refresh();
    co_return false;
  }
  // keyguard's AUTH (the password file's current secret), READONLY for a replica serving reads,
  // and their replies.
  const std::shared_ptr<const std::string> current = worker.upstream_credentials->Current();
  const bool readonly = node && to->readonly;
  const bool resp3 = to != nullptr && to->resp3;
  if (current->empty() && !readonly && !resp3) co_return true;
  std::string hello = *current;
  if (readonly) hello += "*1\r\n$8\r\nREADONLY\r\n";
  if (resp3) hello += "*2\r\n$5\r\nHELLO\r\n$1\r\n3\r\n";
  int owed = (current->empty() ? 0 : 1) + (readonly ? 1 : 0) + (resp3 ? 1 : 0);
  // A server that takes the connection but does not answer (frozen, or a balancer in front of a
  // dead one) fails the attempt within the connect timeout too.
  const StreamDeadline deadline(stream, std::chrono::milliseconds(worker.config.upstream_connect_timeout_ms));
  Outbox out(stream, &shard.upstream_bytes_sent);
  out.Send(std::string_view(hello));
  while (out.backlog() != 0 && !out.failed()) co_await out.WaitBelow(0);
  ReadBuffer buf(512);
  resp::ReplyFramer framer;
  for (;;) {
    buf.Prepare(framer.hint());
    const size_t n = co_await stream.ReadSome(buf.free_space(), ec);
    if (ec || out.failed()) {
      shard.CountUpstreamError(deadline.timed_out() ? metrics::UpstreamError::kConnect
                                                    : metrics::UpstreamError::kReset);
      co_return false;
    }
    buf.Commit(n);
    shard.upstream_bytes_received.Add(n);
    for (;;) {
      const resp::Status st = framer.Next(buf.data(), buf.size());
      if (st == resp::Status::kNeedMore) break;
      if (st == resp::Status::kOk && (framer.type() == '+' || framer.type() == '%')) {  // (HELLO 3: a map)
        buf.Consume(framer.consumed());
        if (--owed == 0) co_return true;
        continue;
      }
      const std::string_view error = st == resp::Status::kOk && !framer.head().empty()
                                         ? framer.head()[0].text
                                         : std::string_view("protocol error");
      if (resp3 && owed == 1) {
        // keyguard's HELLO 3 (the last thing it asked): a server without RESP3, or one that
        // refuses keyguard's user the command.
        EventLine("error", "upstream_hello_failed").Str("error", error).Write(stderr);
        if (refused != nullptr)
          *refused = absl::StrCat("upstream refused HELLO 3: ", absl::string_view(error.data(), error.size()));
        shard.CountUpstreamError(metrics::UpstreamError::kProtocol);
        co_return false;
      }
      EventLine("error", "upstream_auth_failed").Str("error", error).Write(stderr);
      shard.CountUpstreamError(metrics::UpstreamError::kAuth);
      co_return false;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// PinPool

PinPool::~PinPool() { Stop(); }

void PinPool::Stop(bool for_good) {
  if (for_good) stopped_ = true;
  ++generation_;
  for (auto& s : idle_) s->Close();
  worker_.shard->CountUpstream(metrics::UpstreamKind::kIdle, -static_cast<int64_t>(idle_.size()));
  idle_.clear();
}

std::unique_ptr<Stream> PinPool::Take() {
  std::unique_ptr<Stream> found;
  while (found == nullptr && !idle_.empty()) {
    std::unique_ptr<Stream> s = std::move(idle_.back());
    idle_.pop_back();
    worker_.shard->CountUpstream(metrics::UpstreamKind::kIdle, -1);
    // Closed by the server while idle (a timeout, a restart)? An idle connection has nothing to
    // read; over TLS, session tickets may wait, and a close_notify after them.
    if (s->IdleAndOpen()) found = std::move(s);
  }
  Fill();
  return found;
}

void PinPool::Return(std::unique_ptr<Stream> stream) {
  if (stopped_ || static_cast<int>(idle_.size()) >= worker_.config.pinned_idle_connections) {
    stream->Close();
    return;
  }
  idle_.push_back(std::move(stream));
  worker_.shard->CountUpstream(metrics::UpstreamKind::kIdle, 1);
}

void PinPool::Fill() {
  while (!stopped_ && static_cast<int>(idle_.size()) + connecting_ < worker_.config.pinned_idle_connections) {
    ++connecting_;
    asio::co_spawn(worker_.io, Connect(), asio::detached);
  }
}

awaitable<void> PinPool::Connect() {
  auto stream = std::make_unique<Stream>(worker_.io);
  const uint64_t generation = generation_;
  const bool ok = co_await ConnectUpstream(worker_, *stream, nullptr, &to_);
  --connecting_;
  // A failed connect is not retried here: the next Take() tries again. One begun before the
  // upstream moved went to the old one.
  if (ok && generation == generation_) Return(std::move(stream));
}

// ---------------------------------------------------------------------------------------------
// SharedLink

void Worker::AddLink(bool resp3, bool start) {
  links.push_back(std::make_shared<SharedLink>(*this, resp3));
  write_links.push_back(std::make_shared<SharedLink>(*this, resp3));
  links.back()->set_partner(write_links.back().get());
  if (start) {
    links.back()->Start();
    write_links.back()->Start();
  }
}

SharedLink* PickResp3Link(Worker& worker) {
  const size_t n = static_cast<size_t>(worker.config.shared_connections);
  if (worker.links.size() == n) {
    for (size_t i = 0; i < n; ++i) worker.AddLink(/*resp3=*/true, /*start=*/true);
  }
  return worker.links[n + worker.next_link3++ % n].get();
}

PinPool& Resp3Pins(Worker& worker) {
  if (worker.pins3 == nullptr) worker.pins3 = std::make_unique<PinPool>(worker, /*resp3=*/true);
  return *worker.pins3;
}

SharedLink::SharedLink(Worker& worker, bool resp3)
    : worker_(worker),
      buf_(static_cast<size_t>(worker.config.read_buffer_size)),
      framer_(worker.config.limits),
      backoff_(worker.io) {
  to_.resp3 = resp3;
}

SharedLink::SharedLink(Worker& worker, tcp::endpoint node, std::string host, bool readonly, bool resp3)
    : SharedLink(worker, resp3) {
  to_.endpoint = node;
  to_.host = std::move(host);
  to_.readonly = readonly;
  node_commands_ = &worker.shard->cluster_node_commands.Get({address()});
  node_errors_ = &worker.shard->cluster_node_errors.Get({address()});
}

void SharedLink::Start() {
  auto self = shared_from_this();
  asio::co_spawn(
      worker_.io, [self]() { return self->Run(); }, asio::detached);
}

void SharedLink::Stop() {
  stopped_ = true;
  backoff_.cancel();
  WakeWaiters();
  if (conn_ != nullptr) conn_->stream.Close();
}

awaitable<void> SharedLink::Run() {
  auto self = shared_from_this();
  auto delay = std::chrono::milliseconds(50);
  while (!stopped_) {
    if (co_await Open()) {
      delay = std::chrono::milliseconds(50);
      const metrics::UpstreamError reason = co_await Pump();
      Fail(reason);
    }
    if (stopped_) break;
    // Connect again, backing off while the upstream stays away.
    backoff_.expires_after(delay);
    error_code ignored;
    co_await backoff_.async_wait(AwaitEc(ignored));
    delay = std::min(delay * 2, std::chrono::milliseconds(2000));
  }
}

awaitable<void> SharedLink::WaitForConnect() {
  if (up_ || stopped_) co_return;
  auto self = shared_from_this();
  Timer limit(worker_.io, std::chrono::milliseconds(worker_.config.upstream_connect_timeout_ms));
  waiters_.push_back(&limit);
  error_code ignored;
  co_await limit.async_wait(AwaitEc(ignored));
  std::erase(waiters_, &limit);
}

void SharedLink::WakeWaiters() {
  for (Timer* t : waiters_) t->cancel();
}

awaitable<bool> SharedLink::Open() {
  conn_ = std::make_shared<Conn>(worker_.io, &worker_.shard->upstream_bytes_sent);
  std::string tls, refused;
  const bool ok = co_await ConnectUpstream(worker_, conn_->stream, &tls, &to_, &refused);
  failure_ = !tls.empty() ? "upstream TLS: " + tls : refused;
  if (!ok || stopped_) {
    WakeWaiters();  // (they get the error)
    co_return false;
  }
  conn_->out.set_owner(conn_);
  Stream* stream = &conn_->stream;
  conn_->out.set_on_error([stream](error_code) {
    // The read that is in flight fails too: Pump returns and Run fails the link.
    stream->Close();
  });
  buf_ = ReadBuffer(static_cast<size_t>(worker_.config.read_buffer_size));
  framer_.Reset();
  up_ = true;
  worker_.shard->CountUpstream(metrics::UpstreamKind::kShared, 1);
  WakeWaiters();  // (they resume after this turn: the link is up)
  co_return true;
}

awaitable<metrics::UpstreamError> SharedLink::Pump() {
  size_t hint = 0;
  eof_ = false;
  last_read_ns_ = NowNs();
  for (;;) {
    buf_.Prepare(hint);
    error_code ec;
    const size_t n = co_await conn_->stream.ReadSome(buf_.free_space(), ec);
    if (ec) {
      co_return ec == asio::error::eof || eof_ ? metrics::UpstreamError::kClosed
      : conn_->stream.tls_failure().empty()    ? metrics::UpstreamError::kReset
                                               : metrics::UpstreamError::kTls;
    }
    buf_.Commit(n);
    worker_.shard->upstream_bytes_received.Add(n);
    last_read_ns_ = NowNs();
    slow_.clear();
    if (!Deliver(&hint, &slow_)) [[unlikely]] {
      slow_.clear();  // (each holds its session, which holds what holds this link)
      co_return metrics::UpstreamError::kProtocol;
    }
    if (!slow_.empty()) [[unlikely]] {
      // Clients whose output is over its bound: the replies after theirs wait until they read, as
      // on connections of their own (the others' are delivered already). One window for all of
      // them: a client that wrote nothing by its end is cut off, however many there are.
      const auto deadline = std::chrono::steady_clock::now() + kSlowClientWindow;
      std::vector<Slow> slow = std::move(slow_);
      waiting_for_clients_ = true;  // (nothing is read meanwhile: not the server's silence)
      for (Slow& s : slow) co_await s.client->WaitForClient(s.progress, deadline);
      waiting_for_clients_ = false;
      last_read_ns_ = NowNs();
    }
  }
}

bool SharedLink::Deliver(size_t* hint, std::vector<Slow>* slow) {
  const char* data = buf_.data();
  const size_t len = buf_.size();
  size_t pos = 0;
  LinkClient* run_client = nullptr;
  bool ok = true;
  auto end_run = [&]() {
    if (run_client != nullptr && run_client->EndLinkReplies()) {
      slow->push_back(Slow{run_client, run_client->Hold(), run_client->ClientProgress()});
    }
  };
  *hint = 0;
  while (pos < len) {
    const resp::Status st = framer_.Next(data + pos, len - pos);
    if (st == resp::Status::kNeedMore) {
      *hint = framer_.hint();
      break;
    }
    // A RESP3 push (a RESP3 link: DEBUG PROTOCOL push, say) answers no command: it goes to the
    // client whose command is at the head, whose connection takes it as out of band.
    const bool push = framer_.type() == '>';
    if (st == resp::Status::kProtocolError) [[unlikely]] {
      ok = false;
      break;
    }
    if (owed_.empty() && !push) [[unlikely]] {
      Desync("a reply with no command in flight");
      ok = false;
      break;
    }
    const size_t n = framer_.consumed();
    if (owed_.empty()) [[unlikely]] {
      pos += n;  // a push nobody can take
      continue;
    }
    // (A client that went away in a run is nullptr from its next frame on: Forget.)
    if (owed_.front().client != run_client) {
      end_run();
      run_client = owed_.front().client;
      if (run_client != nullptr) run_client->BeginLinkReplies(this);
    }
    if (push) [[unlikely]] {
      if (run_client != nullptr) run_client->OnLinkPush(std::string_view(data + pos, n), framer_);
      pos += n;
      continue;
    }
    if (run_client != nullptr && !run_client->OnLinkFrame(std::string_view(data + pos, n), framer_)) [[unlikely]] {
      Desync("a reply for a client with no command waiting");
      pos += n;
      ok = false;
      break;
    }
    pos += n;
    if (--owed_.front().frames == 0) owed_.pop_front();
  }
  end_run();
  buf_.Consume(pos);
  return ok;
}

void SharedLink::Desync(std::string_view what) {
  // The invariant of a shared connection: each command on it is answered by exactly one frame,
  // in order. A frame beyond that (a server's extra one, a miscount of keyguard's) shifts every
  // reply after it onto the wrong command: the link fails (reason protocol), its commands in
  // flight get an error, and no reply after it is delivered.
  worker_.shard->shared_link_desyncs.Add();
  EventLine("error", "shared_link_desync")
      .Str("what", what)
      .Int("commands_in_flight", static_cast<int64_t>(InFlight()))
      .Str("node", address())
      .Write(stderr);
}

bool SharedLink::Submit(LinkClient* client, std::span<const std::string_view> pieces, uint32_t commands) {
  if (!up_) return false;
  for (std::string_view p : pieces) batch_.append(p.data(), p.size());
  batch_commands_ += commands;
  if (node_commands_ != nullptr) node_commands_->Add(commands);
  if (owed_.empty()) owed_since_ns_ = NowNs();
  if (!owed_.empty() && owed_.back().client == client) {
    owed_.back().frames += commands;
  } else {
    owed_.push_back(Owed{client, commands});
  }
  if (!flush_posted_) {
    // Written once the event loop has run every client that is ready now: one write for all.
    flush_posted_ = true;
    asio::post(worker_.io, [this]() { Flush(); });
  }
  return true;
}

void SharedLink::Flush() {
  flush_posted_ = false;
  if (batch_.empty()) return;
  if (up_) {
    worker_.shard->shared_writes.Add();
    worker_.shard->shared_commands.Add(batch_commands_);
    conn_->out.Send(batch_);
  }
  batch_.clear();
  batch_commands_ = 0;
}

void SharedLink::CheckLiveness(int64_t now_ns) {
  if (!up_ || owed_.empty() || eof_ || now_ns - last_read_ns_ < 1'000'000'000) return;
  const int64_t bound_ns = int64_t{worker_.config.shared_reply_timeout_ms} * 1'000'000;
  const int64_t silent_ns = now_ns - std::max(last_read_ns_, owed_since_ns_);
  if (bound_ns > 0 && !waiting_for_clients_ && silent_ns >= bound_ns) [[unlikely]] {
    // A reply owed and nothing read for the bound (a command the server holds: one keyguard could
    // not tell blocks, a paused or hung server): the link closes, so no client's command holds
    // the others' any longer; the commands in flight fail, the server drops what it held.
    EventLine("warn", "shared_upstream_reply_timeout")
        .Int("waited_ms", silent_ns / 1'000'000)
        .Int("commands_in_flight", static_cast<int64_t>(InFlight()))
        .Str("node", address())
        .Write(stderr);
    Fail(metrics::UpstreamError::kTimeout);
    return;
  }
  // A cluster node silent for a second with commands in flight may be failing over: the map is
  // asked for (a new one closes this link when the node is no longer a primary).
  if (to_.endpoint.has_value() && worker_.cluster != nullptr && worker_.cluster->refresh) worker_.cluster->refresh();
  if (Peek(conn_->stream.socket()) == Peeked::kClosed) {
    eof_ = true;
    error_code ignored;
    conn_->stream.socket().cancel(ignored);  // the pending read completes, as at the end of the stream
  }
}

void SharedLink::Forget(LinkClient* client) {
  for (Owed& o : owed_.entries()) {
    if (o.client == client) o.client = nullptr;
  }
}

awaitable<void> SharedLink::WaitBelow(size_t limit) {
  if (conn_ != nullptr && up_) co_await conn_->out.WaitBelow(limit);
}

void SharedLink::Fail(metrics::UpstreamError reason) {
  if (!up_) return;
  up_ = false;
  worker_.shard->CountUpstream(metrics::UpstreamKind::kShared, -1);
  if (!retired_) {  // (a retired link's close is keyguard's own)
    worker_.shard->CountUpstreamError(reason);
    if (node_errors_ != nullptr) node_errors_->Add();
    EventLine("warn", "shared_upstream_failed")
        .Str("reason", metrics::kUpstreamErrorNames[static_cast<size_t>(reason)])
        .Str("node", address())
        .Write(stderr);
  }
  conn_->stream.Close();
  conn_->out.Wake();
  // Each client with commands in flight is told once.
  std::vector<LinkClient*> clients;
  for (const Owed& o : owed_.entries()) {
    if (o.client != nullptr) clients.push_back(o.client);
  }
  std::sort(clients.begin(), clients.end());
  clients.erase(std::unique(clients.begin(), clients.end()), clients.end());
  owed_.clear();
  batch_.clear();
  batch_commands_ = 0;
  for (LinkClient* c : clients) c->OnLinkFailed(this, reason);
}

}  // namespace keyguard::proxy
