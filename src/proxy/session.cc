#include "proxy/session.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "keyguard/commands/command_table.h"
#include "keyguard/hygiene/detectors.h"
#include "keyguard/policy/key_pattern.h"
#include "keyguard/resp/encoder.h"
#include "proxy/async_read.h"
#include "proxy/size_probe.h"

namespace keyguard::proxy {
namespace {

using commands::EqualsIgnoreCase;
using Kind = Pending::Kind;

constexpr std::string_view kUpstreamUnavailable = "-ERR keyguard: upstream unavailable\r\n";
constexpr std::string_view kDesynced =
    "-ERR keyguard: the server's transaction state differs from keyguard's; the connection is closed\r\n";

constexpr std::string_view kExecAbort = "-EXECABORT Transaction discarded because of previous errors.\r\n";
constexpr std::string_view kDiscard = "*1\r\n$7\r\nDISCARD\r\n";
constexpr std::string_view kPing = "*1\r\n$4\r\nPING\r\n";
constexpr std::string_view kClientId = "*2\r\n$6\r\nCLIENT\r\n$2\r\nID\r\n";

// Keeps one tenant's detector state and cached sizes apart from another's: the fingerprint of its
// prefix (of "" without a tenant: hygiene::kFnvBasis), the seed of every key hash.
uint64_t DetectorScope(const tenant::Tenant* t) {
  return hygiene::Fingerprint(t != nullptr ? std::string_view(t->prefix) : std::string_view());
}

// Rewritten commands at least this long are spliced rather than re-encoded.
constexpr size_t kSpliceMinBytes = 1024;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Appends to a gather list, extending the last buffer when the bytes are adjacent in memory
// (consecutive frames of one read), so a batch is one writev of few buffers.
void AppendBuffer(std::vector<asio::const_buffer>* gather, const char* data, size_t len) {
  if (!gather->empty()) {
    asio::const_buffer& last = gather->back();
    if (static_cast<const char*>(last.data()) + last.size() == data) {
      last = asio::const_buffer(last.data(), last.size() + len);
      return;
    }
  }
  gather->emplace_back(data, len);
}

std::string CommandNameOf(commands::CommandId id) {
  const std::string_view n = commands::CommandName(id);
  return std::string(n.data(), n.size());
}

}  // namespace

Session::Session(Worker& worker, Socket client)
    : worker_(worker),
      client_(std::move(client)),
      upstream_(worker.io),
      client_out_(client_, &worker.shard->client_bytes_sent),
      upstream_out_(upstream_, &worker.shard->upstream_bytes_sent),
      client_buf_(static_cast<size_t>(worker.config.read_buffer_size)),
      upstream_buf_(static_cast<size_t>(worker.config.read_buffer_size)),
      request_framer_(worker.config.limits),
      reply_framer_(worker.config.limits),
      queue_event_(worker.io),
      id_(hygiene::NewConnectionId()),
      detectors_(worker.config.hygiene, worker.hygiene, sink_, id_),
      pipeline_(worker.stages, detectors_) {
  worker_.shard->client_connections.Add(1);
  worker_.shard->client_connections_total.Add();
  worker_.session_count.fetch_add(1, std::memory_order_relaxed);
}

Session::~Session() {
  if (upstream_client_id_ != 0) worker_.connections->Set(upstream_client_id_, nullptr);
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
  client_.non_blocking(true, ec);
  client_.set_option(tcp::no_delay(true), ec);
  const tcp::endpoint peer = client_.remote_endpoint(ec);
  if (!ec) client_address_ = absl::StrCat(peer.address().to_string(), ":", peer.port());

  // Connect upstream (and the TLS handshake), bounded by the connect timeout.
  ec = co_await upstream_.Connect(worker_.upstream, worker_.upstream_tls.get(), worker_.upstream_host,
                                  std::chrono::milliseconds(worker_.config.upstream_connect_timeout_ms));
  if (closed_) co_return;
  if (ec) {
    worker_.shard->CountUpstreamError(upstream_.tls_failure().empty() ? metrics::UpstreamError::kConnect
                                                                      : metrics::UpstreamError::kTls);
    upstream_.Close();
    if (worker_.upstream_failed) worker_.upstream_failed();
  } else {
    upstream_ready_ = true;
    worker_.shard->upstream_connections.Add(1);
    SendUpstreamAuth(/*send_now=*/true);
    // The server's id of this connection, for the registry of the tenants' connections.
    if (worker_.connections != nullptr) SendInternal(kClientId, commands::Known().client, /*send_now=*/true);
    asio::co_spawn(
        worker_.io, [self]() { return self->UpstreamPump(); }, asio::detached);
  }
  if (worker_.config.tenancy != nullptr) BindTenant(worker_.config.tenancy->static_tenant());
  co_await ClientPump();
}

// ---------------------------------------------------------------------------------------------
// Client -> upstream

awaitable<void> Session::ClientPump() {
  auto self = shared_from_this();
  const size_t max_out = static_cast<size_t>(worker_.config.max_output_buffer);
  const size_t max_pending = static_cast<size_t>(worker_.config.max_pending_commands);
  size_t hint = 0;
  while (!closed_ && !stop_reading_) {
    // Backpressure: a slow upstream or a client that does not read its replies stops our reads.
    while (!closed_ && upstream_out_.backlog() > max_out) co_await upstream_out_.WaitBelow(max_out / 2);
    while (!closed_ && (queue_.size() >= max_pending || holding_)) {
      queue_waiter_ = true;
      queue_event_.expires_at(Timer::time_point::max());
      error_code ignored;
      co_await queue_event_.async_wait(AwaitEc(ignored));
    }
    if (closed_) break;
    if (resume_) {
      // A walk ended: the commands read while it ran are next.
      resume_ = false;
      ProcessClientBytes(&hint);
      // Draining: what was read before is served, nothing more is read.
      if (drain_after_walk_ && !holding_) stop_reading_ = true;
      continue;
    }
    client_buf_.Prepare(hint);
    error_code ec;
    const size_t n = co_await AsyncReadSome(client_, client_buf_.free_space(), AwaitEc(ec));
    if (closed_) break;
    if (ec) {
      // The client went away (or reset): nothing is left to deliver to it.
      Close();
      co_return;
    }
    client_buf_.Commit(n);
    worker_.shard->client_bytes_received.Add(n);
    ProcessClientBytes(&hint);
  }
  if (closed_ || closing_) co_return;
  // Stopped reading (protocol error, QUIT, upstream gone, draining): wait for every pending reply,
  // then deliver and close.
  while (!closed_ && !queue_.empty()) {
    queue_waiter_ = true;
    queue_event_.expires_at(Timer::time_point::max());
    error_code ignored;
    co_await queue_event_.async_wait(AwaitEc(ignored));
  }
  if (!closed_ && !closing_) co_await FlushAndClose();
}

void Session::ProcessClientBytes(size_t* hint) {
  *hint = 0;
  worker_.stages.Refresh();
  forward_.clear();
  const char* base = client_buf_.data();
  const size_t len = client_buf_.size();
  size_t pos = 0;
  const int64_t now = NowNs();
  while (!stop_reading_ && !holding_) {
    const resp::Status st = request_framer_.Next(base + pos, len - pos);
    if (st == resp::Status::kNeedMore) {
      *hint = request_framer_.hint();
      break;
    }
    if (st == resp::Status::kProtocolError) {
      // As Redis: the error is the reply after every earlier one, then the connection closes.
      worker_.shard->client_protocol_errors.Add();
      std::string text;
      resp::AppendError(&text, request_framer_.error());
      Reply(std::move(text), commands::kUnknownCommand, /*close_after=*/true);
      stop_reading_ = true;
      break;
    }
    const size_t n = request_framer_.consumed();
    const auto args = request_framer_.args();
    if (!args.empty()) HandleCommand(args, base + pos, n, now);
    pos += n;
  }
  if (!forward_.empty()) upstream_out_.Send(forward_);
  forward_.clear();
  scratch_.Reset();
  client_buf_.Consume(pos);
}

void Session::ForwardRaw(const char* data, size_t len) { AppendBuffer(&forward_, data, len); }

bool Session::Splice(const char* raw, size_t raw_len, std::span<const std::string_view> args,
                     std::span<const std::string_view> out, std::string_view* bytes) {
  // Only a multibulk request whose arguments are views into its own bytes, with as many
  // arguments as before (a rewrite that adds some changes the *N header: Encode does that).
  if (out.size() != args.size() || raw_len == 0 || raw[0] != '*') return false;
  const char* end = raw + raw_len;
  size_t changed_bytes = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].data() < raw || args[i].data() + args[i].size() + 2 > end) return false;
    if (out[i].data() != args[i].data() || out[i].size() != args[i].size()) {
      changed_bytes += out[i].size() + resp::kBulkOverhead;
    }
  }
  // A small command is copied whole into the scratch chunk, so consecutive rewritten commands sit
  // next to each other and go out as one buffer; a big one goes out as the client's bytes with
  // only the changed arguments from the chunk (values are never copied).
  const bool copy = raw_len < kSpliceMinBytes;
  const char* pos = raw;
  // A copy is written in place, in one reservation for the bound; a big command's changed
  // arguments each get their own (chunks never move, so the pieces stay valid).
  char* const first = copy ? scratch_.Reserve(changed_bytes + raw_len) : nullptr;
  char* w = first;
  for (size_t i = 0; i < args.size(); ++i) {
    if (out[i].data() == args[i].data() && out[i].size() == args[i].size()) continue;
    // The client's "$<len>\r\n" header ends two bytes before the argument; find its '$'.
    const char* header = args[i].data() - 2;
    while (header > pos && *header != '$') --header;
    if (*header != '$') {
      splice_.clear();  // nothing reserved was committed
      return false;
    }
    if (copy) {
      std::memcpy(w, pos, static_cast<size_t>(header - pos));
      w = resp::WriteBulk(w + (header - pos), out[i]);
    } else {
      splice_.emplace_back(pos, static_cast<size_t>(header - pos));
      char* const bulk = scratch_.Reserve(out[i].size() + resp::kBulkOverhead);
      const size_t n = static_cast<size_t>(resp::WriteBulk(bulk, out[i]) - bulk);
      scratch_.Commit(n);
      splice_.emplace_back(bulk, n);
    }
    pos = args[i].data() + args[i].size() + 2;
  }
  if (!copy) {
    splice_.emplace_back(pos, static_cast<size_t>(end - pos));
    return true;
  }
  std::memcpy(w, pos, static_cast<size_t>(end - pos));
  w += end - pos;
  scratch_.Commit(static_cast<size_t>(w - first));
  *bytes = std::string_view(first, static_cast<size_t>(w - first));
  return true;
}

std::string_view Session::Encode(std::span<const std::string_view> args) {
  // Encoded commands of a batch share the scratch chunks, which never move while forward_ points
  // into them.
  char* const start = scratch_.Reserve(resp::CommandBound(args));
  const size_t n = static_cast<size_t>(resp::WriteCommand(start, args) - start);
  scratch_.Commit(n);
  return std::string_view(start, n);
}

void Session::HandleCommand(std::span<const std::string_view> args, const char* raw, size_t raw_len, int64_t now) {
  CommandContext c;
  c.id = commands::LookupCommand(args[0]);
  c.args = args;
  // Whether this command's reply is suppressed by CLIENT REPLY OFF/SKIP or a replication stream.
  c.mode = state_.TakeReplyMode();
  c.tenant = tenant_;
  c.state = &state_;
  c.queue = &queue_;
  c.upstream_ready = upstream_ready_;
  c.client = client_address_;
  if (tenant_commands_ != nullptr) {
    tenant_commands_->Add();
    tenant_received_->Add(raw_len);
  }
  const Verdict& v = pipeline_.Run(c);
  switch (v.action) {
    case Verdict::Action::kForward: break;
    case Verdict::Action::kRefuse: Refuse(c, v.reason, v.message); return;
    case Verdict::Action::kLogin: Login(c, v, now); return;
    case Verdict::Action::kUnavailable:
      worker_.shard->CountCommand(c.id, metrics::Outcome::kFailed);
      Reply(UpstreamUnavailable(), c.id, /*close_after=*/true);
      stop_reading_ = true;
      return;
    case Verdict::Action::kWalk:
      pipeline_.Release();
      StartWalk(v.walk, c.id, now);
      return;
  }
  std::string_view bytes(raw, raw_len);
  splice_.clear();
  if (v.modified && !Splice(raw, raw_len, args, v.args, &bytes)) {
    // The command goes upstream re-encoded; everything but the rewritten arguments is unchanged.
    bytes = Encode(v.args);
  }
  Pending p;
  p.rewrite = v.rewrite;
  p.command = c.id;
  p.start_ns = now;
  p.reply_check = v.reply_check;
  pipeline_.Release();
  const bool hot = worker_.config.hygiene.enabled &&
                   hygiene::HotKeyRequest(worker_.hot, c.id, args, TenantName(), raw_len, &p.request_bytes);
  if (p.reply_check != 0 || hot) queue_.AttachKey(&p, args[1]);
  const ConnectionState::Effects e = state_.OnForward(c.id, args, c.mode, tenant_ != nullptr, &p);
  if (e.stop_reading) stop_reading_ = true;
  if (e.ping_first) ForwardRaw(kPing.data(), kPing.size());
  if (e.logout && worker_.config.tenancy != nullptr && worker_.config.tenancy->requires_auth()) {
    // keyguard's own upstream credentials are sent again right after the RESET (below).
    BindTenant(nullptr);
  }
  if (e.send_discard) {
    bytes = kDiscard;
    splice_.clear();
  }
  if (!splice_.empty()) {
    for (const asio::const_buffer& b : splice_) ForwardRaw(static_cast<const char*>(b.data()), b.size());
  } else {
    ForwardRaw(bytes.data(), bytes.size());
  }
  if (e.silent) {
    worker_.shard->CountCommand(c.id, metrics::Outcome::kNoReply);
    return;
  }
  const bool reset = p.kind == Kind::kReset;
  queue_.Push(std::move(p));
  if (reset) SendUpstreamAuth(/*send_now=*/false);
}

void Session::BindTenant(const tenant::Tenant* t) {
  tenant_ = t;
  tenant_rejected_.fill(nullptr);
  if (upstream_client_id_ != 0) worker_.connections->Set(upstream_client_id_, t);
  const uint64_t scope = DetectorScope(t);
  detectors_.set_scope(scope);
  if (t != nullptr) {
    reply_tenant_ = t;  // RESET's nullptr takes effect with its reply
    reply_scope_ = scope;
  }
  if (t == nullptr) {
    tenant_commands_ = tenant_received_ = tenant_sent_ = nullptr;
    return;
  }
  metrics::WorkerShard& shard = *worker_.shard;
  tenant_commands_ = &shard.tenant_commands.Get({t->name});
  tenant_received_ = &shard.tenant_received_bytes.Get({t->name});
  tenant_sent_ = &shard.tenant_sent_bytes.Get({t->name});
}

void Session::SendUpstreamAuth(bool send_now) {
  if (worker_.upstream_auth.empty() || !upstream_ready_) return;
  SendInternal(worker_.upstream_auth, commands::Known().auth, send_now);
}

void Session::SendInternal(std::string_view command, commands::CommandId id, bool send_now) {
  ForwardRaw(command.data(), command.size());
  Pending p;
  p.kind = Kind::kInternal;
  p.command = id;
  queue_.Push(std::move(p));
  // At connect time nothing else is batched: send it now, ahead of every client command.
  if (send_now) {
    upstream_out_.Send(forward_);
    forward_.clear();
  }
}

void Session::Login(const CommandContext& c, const Verdict& v, int64_t now) {
  if (v.bind) BindTenant(v.login);
  if (c.id != commands::Known().hello) {
    worker_.shard->CountCommand(c.id, metrics::Outcome::kOk);
    if (c.mode.skipped) ForwardRaw(kPing.data(), kPing.size());  // the upstream still owes the skip
    if (!c.mode.silent) Reply("+OK\r\n", c.id, false);
    return;
  }
  // HELLO goes upstream without its AUTH (keyguard's credentials are the connection's).
  const std::string_view encoded = Encode(v.args);
  ForwardRaw(encoded.data(), encoded.size());
  if (c.mode.silent) {
    worker_.shard->CountCommand(c.id, metrics::Outcome::kNoReply);
    return;
  }
  Pending p;
  p.kind = Kind::kHello;
  p.command = c.id;
  p.start_ns = now;
  p.hello_version = HelloVersion(c.args);
  queue_.Push(std::move(p));
}

void Session::Refuse(const CommandContext& c, Refusal reason, std::string_view message) {
  const commands::CommandId id = c.id;
  worker_.shard->CountCommand(id, metrics::Outcome::kRejected);
  const size_t r = static_cast<size_t>(reason);
  worker_.stages.rejected[r]->Add();
  if (tenant_ != nullptr) {
    // Resolved once per tenant binding and reason.
    metrics::Counter*& c = tenant_rejected_[r];
    if (c == nullptr) c = &worker_.shard->tenant_rejected.Get({tenant_->name, RefusalName(reason)});
    c->Add();
  }
  state_.OnRefused();  // Redis fails EXEC after a refused queued command
  // Redis still owes one skipped reply from CLIENT REPLY SKIP; without this PING it would
  // swallow the reply of the next command we forward.
  if (c.mode.skipped) ForwardRaw(kPing.data(), kPing.size());
  if (c.mode.silent) return;
  std::string text;
  resp::AppendError(&text, message);
  Reply(std::move(text), id, false);
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

void Session::Sink::Stamp(hygiene::Finding* f, std::string_view key, commands::CommandId id) {
  Worker& worker = session.worker_;
  const hygiene::Settings& settings = worker.config.hygiene;
  f->action = settings.action(f->kind);
  f->key = hygiene::ShownKey(key, settings.finding_keys);
  f->key_pattern =
      worker.shard->PatternLabel(policy::KeyPattern(key), worker.stages.live->key_policy->max_key_patterns());
  f->command = CommandNameOf(id);
  f->client = session.client_address_;
  f->client_name = session.state_.client_name();
  if (session.tenant_ != nullptr) f->tenant = session.tenant_->name;
}

void Session::Sink::Report(hygiene::Finding f) { ReportFinding(session.worker_, std::move(f)); }

void Session::Sink::WakeProbe() {
  if (session.worker_.probe != nullptr) session.worker_.probe->Wake();
}

void Session::Reply(std::string text, commands::CommandId id, bool close_after) {
  if (queue_.QueueLocal(text, id, close_after)) return;
  // Nothing is pending before it: deliver now (counted as a reply delivered in a batch is).
  if (tenant_sent_ != nullptr) tenant_sent_->Add(text.size());
  client_out_.Send(text);
}

void Session::StartWalk(tenant::Walk walk, commands::CommandId id, int64_t now) {
  walk_.Start(walk);
  Pending p;
  p.kind = Kind::kWalk;
  p.command = id;
  p.start_ns = now;
  p.expect = Pending::Expect::kNotQueued;
  queue_.Push(std::move(p));
  holding_ = true;
  // The first step takes a token like every other: a pipeline of walks of one step each stays
  // within the tenant's rate.
  if (WaitForWalkToken()) return;  // the timer sends it, after this batch
  const std::string& request = walk_.NextRequest(*tenant_, worker_.config.tenancy->walk_step_keys);
  ForwardRaw(request.data(), request.size());  // sent with this batch
}

bool Session::WaitForWalkToken() {
  // The tenant's steps on this worker share a budget: a walk over many keys takes its time
  // rather than the server's.
  const int64_t wait = worker_.walk_budget[tenant_].Take(worker_.config.tenancy->walk_steps_per_second, NowNs());
  if (wait == 0) return false;
  if (walk_timer_ == nullptr) walk_timer_ = std::make_unique<Timer>(worker_.io);
  walk_timer_->expires_after(std::chrono::nanoseconds(wait));
  std::weak_ptr<Session> weak = shared_from_this();
  walk_timer_->async_wait([weak](error_code e) {
    // The walk's entry need not be at the head yet (a first step waits behind earlier commands).
    if (auto s = weak.lock(); s && !e && !s->closed_ && s->upstream_ready_ && s->walk_.active()) s->SendWalkStep();
  });
  return true;
}

bool Session::ClientGone() {
  if (client_buf_.size() != 0) return false;  // commands held behind the walk are still served
  char c;
  const ssize_t n = ::recv(client_.native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

void Session::SendWalkStep() {
  if (WaitForWalkToken()) return;
  upstream_out_.Send(walk_.NextRequest(*tenant_, worker_.config.tenancy->walk_step_keys));
}

void Session::ContinueWalk(char type, std::span<const resp::ReplyFramer::Scalar> head, int64_t now) {
  const std::string_view prefix =
      reply_tenant_ != nullptr ? std::string_view(reply_tenant_->prefix) : std::string_view();
  tenant::KeyWalk::Step step = walk_.OnReply(type, head, prefix, state_.protocol());
  if (step.done) {
    FinishWalk(std::move(step.reply), step.error, now);
  } else if (walk_.walk() != tenant::Walk::kFlush && ClientGone()) {
    // DBSIZE/RANDOMKEY for a client that hung up and sent nothing after it: the answer has
    // nobody to go to (while a walk runs the client's socket is not read, so its close is
    // otherwise noticed only when the walk ends: a tenant could leave walks running).
    FinishWalk("-ERR keyguard: the client closed the connection\r\n", true, now);
  } else {
    SendWalkStep();
  }
}

void Session::FinishWalk(std::string reply, bool error, int64_t now) {
  const Pending& p = queue_.front();
  AppendOut(held_.emplace_back(std::move(reply)));
  worker_.shard->CountCommand(p.command, error ? metrics::Outcome::kError : metrics::Outcome::kOk);
  worker_.shard->ObserveLatency(p.command, static_cast<uint64_t>(now - p.start_ns));
  queue_.Pop();
  walk_.Finish();
  holding_ = false;
  resume_ = true;  // ClientPump processes what was read meanwhile (NotifyQueue wakes it)
  DeliverLocalsAtHead();
}

// ---------------------------------------------------------------------------------------------
// Upstream -> client

awaitable<void> Session::UpstreamPump() {
  auto self = shared_from_this();
  const size_t max_out = static_cast<size_t>(worker_.config.max_output_buffer);
  size_t hint = 0;
  while (!closed_) {
    while (!closed_ && client_out_.backlog() > max_out) co_await client_out_.WaitBelow(max_out / 2);
    if (closed_) break;
    upstream_buf_.Prepare(hint);
    error_code ec;
    const size_t n = co_await upstream_.ReadSome(upstream_buf_.free_space(), ec);
    if (closed_) break;
    if (ec) {
      FailUpstream(ec == asio::error::eof            ? metrics::UpstreamError::kClosed
                   : upstream_.tls_failure().empty() ? metrics::UpstreamError::kReset
                                                     : metrics::UpstreamError::kTls);
      co_return;
    }
    upstream_buf_.Commit(n);
    worker_.shard->upstream_bytes_received.Add(n);
    if (!ProcessUpstreamBytes(&hint)) {
      FailUpstream(upstream_auth_failed_ ? metrics::UpstreamError::kAuth : metrics::UpstreamError::kProtocol);
      co_return;
    }
    if (worker_.draining && queue_.empty() && !closing_ && !holding_ && !resume_) {
      co_await FlushAndClose();
      co_return;
    }
  }
}

void Session::AppendOut(std::string_view bytes) { AppendBuffer(&deliver_, bytes.data(), bytes.size()); }

void Session::DeliverPush(std::string_view frame) {
  if (worker_.config.tenancy == nullptr) {
    AppendOut(frame);
    return;
  }
  if (reply_tenant_ == nullptr) return;  // logged out: nobody it may be shown to
  std::string out;
  switch (tenant::RewritePush(*worker_.config.tenancy, *reply_tenant_, frame, &out)) {
    case tenant::ReplyAction::kPass: AppendOut(frame); break;
    case tenant::ReplyAction::kReplace:
      held_.push_back(std::move(out));
      AppendOut(held_.back());
      break;
    case tenant::ReplyAction::kDrop: break;
  }
}

bool Session::ProcessUpstreamBytes(size_t* hint) {
  *hint = 0;
  deliver_.clear();
  if (!held_.empty()) held_.clear();
  const char* base = upstream_buf_.data();
  const size_t len = upstream_buf_.size();
  size_t pos = 0;
  const int64_t now = NowNs();
  bool ok = true;
  for (;;) {
    if (state_.replication_stream()) {  // one predictable branch per frame on every other connection
      if (!state_.tunnel() && !queue_.empty() && queue_.front().kind == Kind::kReplicationStream) {
        worker_.shard->CountCommand(queue_.front().command, metrics::Outcome::kOk);
        queue_.Pop();
        state_.StartTunnel();
      }
      if (state_.tunnel()) {
        AppendOut(std::string_view(base + pos, len - pos));
        pos = len;
        break;
      }
    }
    const resp::Status st = reply_framer_.Next(base + pos, len - pos);
    if (st == resp::Status::kNeedMore) {
      *hint = reply_framer_.hint();
      break;
    }
    if (st == resp::Status::kProtocolError) {
      ok = false;
      break;
    }
    const size_t n = reply_framer_.consumed();
    const std::string_view frame(base + pos, n);
    pos += n;
    const char type = reply_framer_.type();
    const auto head = reply_framer_.head();
    const std::string_view kind = head.empty() ? std::string_view() : head[0].text;
    Pending* front = queue_.empty() ? nullptr : &queue_.front();
    switch (state_.Classify(front, type, head, reply_tenant_ != nullptr)) {
      case FrameRole::kConfirmation:
        DeliverPush(frame);
        state_.TrackConfirmation(kind, head[1].text);
        if (front->expected < 0) {
          front->expected = std::max<int64_t>(1, static_cast<int64_t>(state_.subscriptions(front->confirm / 2)) + 1);
        }
        if (--front->expected == 0) CompleteHead(type, 0, {}, 0, now);
        continue;
      case FrameRole::kPush:
        if (type == '>' && head.size() >= 2) state_.TrackConfirmation(kind, head[1].text);
        if (type == '+') {
          AppendOut(frame);  // a MONITOR line
        } else {
          DeliverPush(frame);
        }
        continue;
      case FrameRole::kUnexpected:
        // A reply nobody waits for; pass it on rather than drop it (a tenant never sees one: it
        // could name anything), and count it.
        worker_.shard->unexpected_replies.Add();
        if (worker_.config.tenancy == nullptr) AppendOut(frame);
        continue;
      case FrameRole::kInternal:
        if (front->command == commands::Known().client) {
          // keyguard's own CLIENT ID. Should the server refuse it (an ACL on keyguard's user), no
          // connection can name this one in a REDIRECT.
          int64_t client_id = 0;
          if (type == ':' && resp::ParseRedisInt(kind, &client_id) && client_id != 0 && upstream_ready_) {
            upstream_client_id_ = client_id;
            if (tenant_ != nullptr) worker_.connections->Set(client_id, tenant_);
          }
        } else if (type == '-' || type == '!') {
          // keyguard's own upstream AUTH: an error means the upstream refuses keyguard's credentials.
          EventLine("error", "upstream_auth_failed").Str("error", kind).Write(stderr);
          upstream_auth_failed_ = true;
          ok = false;
          break;
        }
        queue_.Pop();
        DeliverLocalsAtHead();
        continue;
      case FrameRole::kDesync:
        // The server's transaction state is not the one the reply filter follows (a command the
        // server refused as keyguard did not foresee): no reply may pass unfiltered, so none passes.
        EventLine("error", "transaction_state_differs")
            .Str("command", commands::Spec(front->command).name)
            .Write(stderr);
        worker_.shard->unexpected_replies.Add();
        desynced_ = true;
        ok = false;
        break;
      case FrameRole::kWalkStep: ContinueWalk(type, head, now); continue;
      case FrameRole::kReply: break;
    }
    if (!ok) break;
    if (front->hidden) {
      // The client asked not to see it.
    } else if (front->kind == Kind::kExecAbort) {
      AppendOut(kExecAbort);
    } else if (reply_tenant_ != nullptr && (front->rewrite != 0 || type == '-' || type == '!')) {
      std::string out;
      switch (tenant::RewriteReply(*worker_.config.tenancy, *reply_tenant_,
                                   static_cast<tenant::ReplyRewrite>(front->rewrite), front->exec_rewrites, frame,
                                   &out)) {
        case tenant::ReplyAction::kPass: AppendOut(frame); break;
        case tenant::ReplyAction::kReplace:
        case tenant::ReplyAction::kDrop:  // never for a command's reply
          held_.push_back(std::move(out));
          AppendOut(held_.back());
          break;
      }
    } else {
      AppendOut(frame);
    }
    if (front->kind == Kind::kSubscribe) {
      // Not a confirmation (an error such as NOAUTH): the command is over.
      front->expected = 0;
    }
    CompleteHead(type, reply_framer_.size(), head.empty() ? std::string_view() : head[0].text, n, now);
  }
  DeliverLocalsAtHead();
  if (!deliver_.empty()) {
    if (tenant_sent_ != nullptr) {
      size_t bytes = 0;
      for (const auto& b : deliver_) bytes += b.size();
      tenant_sent_->Add(bytes);
    }
    client_out_.Send(deliver_);
  }
  deliver_.clear();
  upstream_buf_.Consume(pos);
  NotifyQueue();
  return ok;
}

void Session::CompleteHead(char reply_type, int64_t size, std::string_view bulk, size_t frame_len, int64_t now) {
  Pending& p = queue_.front();
  const bool error = reply_type == '-' || reply_type == '!';
  if (p.reply_check != 0 && !error) {
    detectors_.OnReply(p.command, p.reply_check, queue_.KeyOf(p), reply_type, size, bulk, reply_scope_);
  }
  // A write refused by a replica: the primary may have moved (Sentinel: ask again).
  if (error && worker_.upstream_failed && bulk.starts_with("READONLY")) worker_.upstream_failed();
  if (frame_len > 0 && p.kind != Kind::kExecAbort) {
    const bool aggregate = reply_type == '*' || reply_type == '%' || reply_type == '~';
    worker_.shard->ObserveReply(p.command, frame_len, aggregate ? size : -1);
  }
  if (p.keyed && worker_.hot.enabled()) {
    hygiene::HotKeyReply(worker_.hot, p.command, TenantName(), queue_.KeyOf(p), p.request_bytes, reply_type, size, bulk,
                         frame_len);
  }
  if (state_.OnReply(p, error)) {
    reply_tenant_ = tenant_;  // RESET: nullptr, unless the client authenticated again
    reply_scope_ = DetectorScope(reply_tenant_);
  }
  const bool exec_abort = p.kind == Kind::kExecAbort;
  worker_.shard->CountCommand(p.command, (error || exec_abort) ? metrics::Outcome::kError : metrics::Outcome::kOk);
  worker_.shard->ObserveLatency(p.command, static_cast<uint64_t>(now - p.start_ns));
  queue_.Pop();
  DeliverLocalsAtHead();
}

void Session::DeliverLocalsAtHead() {
  while (queue_.LocalAtHead()) AppendOut(held_.emplace_back(queue_.TakeLocal()));
}

void Session::NotifyQueue() {
  if (queue_waiter_) {
    queue_waiter_ = false;
    queue_event_.cancel();
  }
}

void Session::FailUpstream(metrics::UpstreamError reason) {
  if (closed_ || !upstream_ready_) return;
  if (desynced_) {
    AbortPending(kDesynced);
    return;
  }
  if (!(state_.quit_sent() && reason == metrics::UpstreamError::kClosed)) worker_.shard->CountUpstreamError(reason);
  if (reason == metrics::UpstreamError::kAuth && !queue_.ClientWaiting()) {
    // The upstream refused keyguard's own credentials before the client asked anything: as when
    // the upstream is down at connect, the client's next command gets the error, then the
    // connection closes (rather than a close with nothing said).
    CloseUpstream();
    queue_.Clear();
    NotifyQueue();
    return;
  }
  AbortPending(UpstreamUnavailable());
}

std::string Session::UpstreamUnavailable() const {
  if (upstream_.tls_failure().empty()) return std::string(kUpstreamUnavailable);
  return absl::StrCat("-ERR keyguard: upstream TLS: ", upstream_.tls_failure(), "\r\n");
}

void Session::CloseUpstream() {
  if (upstream_client_id_ != 0) {
    worker_.connections->Set(upstream_client_id_, nullptr);
    upstream_client_id_ = 0;
  }
  if (upstream_ready_) {
    upstream_ready_ = false;
    worker_.shard->upstream_connections.Add(-1);
  }
  upstream_.Close();
}

void Session::AbortPending(std::string_view error) {
  CloseUpstream();
  // Every command still waiting gets an error, in order with keyguard's own replies.
  std::vector<commands::CommandId> failed;
  const std::string out = queue_.Abort(error, &failed);
  for (commands::CommandId id : failed) worker_.shard->CountCommand(id, metrics::Outcome::kFailed);
  if (!out.empty()) client_out_.Send(out);
  stop_reading_ = true;
  NotifyQueue();
  if (!closing_) {
    auto self = shared_from_this();
    asio::co_spawn(
        worker_.io, [self]() { return self->FlushAndClose(); }, asio::detached);
  }
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

void Session::Drain() {
  if (holding_ || resume_) {
    // Commands read behind a walk are still to be served: ClientPump stops reading after them.
    drain_after_walk_ = true;
    return;
  }
  stop_reading_ = true;  // commands already read are still served
  if (queue_.empty() && !closing_) {
    auto self = shared_from_this();
    asio::co_spawn(
        worker_.io, [self]() { return self->FlushAndClose(); }, asio::detached);
  }
  // Otherwise UpstreamPump closes once the last pending reply is delivered.
}

void Session::Close() {
  if (closed_) return;
  auto self = shared_from_this();
  closed_ = true;
  if (detectors_.has_pending_ttl()) detectors_.FlushPendingTtl(true);  // no EXPIRE can follow any more
  error_code ignored;
  client_.shutdown(Socket::shutdown_both, ignored);
  client_.close(ignored);
  CloseUpstream();
  queue_event_.cancel();
  client_out_.Wake();
  upstream_out_.Wake();
  worker_.sessions.erase(self);
}

}  // namespace keyguard::proxy
