#include "proxy/session.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>

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

// A key as error texts show it: printable ASCII as it is, any other byte (and the quote and the
// backslash) as \xNN, at most 64 bytes of the key, then its size: an error line stays short and
// one line whatever the key.
std::string KeyInError(std::string_view key) {
  constexpr size_t kShown = 64;
  std::string out;
  for (size_t i = 0; i < key.size() && i < kShown; ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
  if (key.size() > kShown) absl::StrAppend(&out, "... (", key.size(), " bytes)");
  return out;
}

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

// MONITOR lines look like `+1700000000.123456 [0 127.0.0.1:5555] "get" "k"`.
bool IsMonitorLine(std::string_view line) {
  if (line.empty() || line[0] < '0' || line[0] > '9') return false;
  const size_t sp = line.find(' ');
  return sp != std::string_view::npos && sp + 1 < line.size() && line[sp + 1] == '[' &&
         line.substr(0, sp).find('.') != std::string_view::npos;
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

Session::Session(Worker& worker, tcp::socket client)
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
      id_(worker.next_session_id++),
      detectors_(worker.config.hygiene, worker.hygiene, sink_, id_) {
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

  // Connect upstream, bounded by the connect timeout.
  asio::steady_timer timer(worker_.io);
  timer.expires_after(std::chrono::milliseconds(worker_.config.upstream_connect_timeout_ms));
  std::weak_ptr<Session> weak = self;
  timer.async_wait([weak](error_code e) {
    if (auto s = weak.lock(); s && !e) {
      error_code ignored;
      s->upstream_.close(ignored);
    }
  });
  co_await upstream_.async_connect(worker_.upstream, AwaitEc(ec));
  timer.cancel();
  if (closed_) co_return;
  if (ec || !upstream_.is_open()) {
    worker_.shard->CountUpstreamError(metrics::UpstreamError::kConnect);
    error_code ignored;
    upstream_.close(ignored);
  } else {
    upstream_ready_ = true;
    upstream_.non_blocking(true, ec);
    upstream_.set_option(tcp::no_delay(true), ec);
    upstream_.set_option(asio::socket_base::keep_alive(true), ec);
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
      queue_event_.expires_at(asio::steady_timer::time_point::max());
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
    queue_event_.expires_at(asio::steady_timer::time_point::max());
    error_code ignored;
    co_await queue_event_.async_wait(AwaitEc(ignored));
  }
  if (!closed_ && !closing_) co_await FlushAndClose();
}

void Session::ProcessClientBytes(size_t* hint) {
  *hint = 0;
  worker_.Refresh();
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
  // Keep the first chunk's memory for the next batch.
  if (scratch_.size() > 1) scratch_.resize(1);
  if (!scratch_.empty()) scratch_.front().clear();
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
    // "$<len>\r\n" and the closing "\r\n" fit in 32 bytes.
    if (out[i].data() != args[i].data() || out[i].size() != args[i].size()) changed_bytes += out[i].size() + 32;
  }
  // A small command is copied whole into the scratch chunk, so consecutive rewritten commands sit
  // next to each other and go out as one buffer; a big one goes out as the client's bytes with
  // only the changed arguments from the chunk (values are never copied).
  const bool copy = raw_len < kSpliceMinBytes;
  const size_t need = changed_bytes + (copy ? raw_len : 0);
  if (scratch_.empty() || scratch_.back().capacity() - scratch_.back().size() < need) {
    scratch_.emplace_back().reserve(std::max<size_t>(need, 64 * 1024));
  }
  std::string& chunk = scratch_.back();
  const size_t first = chunk.size();
  const char* pos = raw;
  auto keep = [&](const char* from, const char* to) {
    if (copy) {
      chunk.append(from, static_cast<size_t>(to - from));
    } else {
      splice_.emplace_back(from, static_cast<size_t>(to - from));
    }
  };
  for (size_t i = 0; i < args.size(); ++i) {
    if (out[i].data() == args[i].data() && out[i].size() == args[i].size()) continue;
    // The client's "$<len>\r\n" header ends two bytes before the argument; find its '$'.
    const char* header = args[i].data() - 2;
    while (header > pos && *header != '$') --header;
    if (*header != '$') {
      chunk.resize(first);
      splice_.clear();
      return false;
    }
    keep(pos, header);
    const size_t start = chunk.size();
    resp::AppendBulk(&chunk, out[i]);
    if (!copy) splice_.emplace_back(chunk.data() + start, chunk.size() - start);
    pos = args[i].data() + args[i].size() + 2;
  }
  keep(pos, end);
  if (copy) *bytes = std::string_view(chunk.data() + first, chunk.size() - first);
  return true;
}

std::string_view Session::Encode(std::span<const std::string_view> args) {
  // Encoded commands of a batch share chunks that never reallocate while forward_ points into
  // them: a chunk is only appended to within its reserved capacity.
  size_t bound = 24;
  for (std::string_view a : args) bound += a.size() + 24;
  if (scratch_.empty() || scratch_.back().capacity() - scratch_.back().size() < bound) {
    scratch_.emplace_back().reserve(std::max<size_t>(bound, 64 * 1024));
  }
  std::string& chunk = scratch_.back();
  const size_t start = chunk.size();
  resp::AppendCommand(&chunk, args);
  return std::string_view(chunk.data() + start, chunk.size() - start);
}

void Session::HandleCommand(std::span<const std::string_view> args, const char* raw, size_t raw_len, int64_t now) {
  const commands::KnownCommands& known = commands::Known();
  const commands::CommandId id = commands::LookupCommand(args[0]);
  const bool subscribe = id == known.subscribe || id == known.psubscribe || id == known.ssubscribe ||
                         id == known.unsubscribe || id == known.punsubscribe || id == known.sunsubscribe;
  // Whether this command's reply is suppressed by CLIENT REPLY OFF/SKIP or a replication stream.
  const ConnectionState::ReplyMode mode = state_.TakeReplyMode();
  const bool skipped = mode.skipped;
  const bool silent = mode.silent;

  const tenant::Tenancy* tenancy = worker_.config.tenancy.get();
  if (tenancy != nullptr) {
    if (tenant_commands_ != nullptr) {
      tenant_commands_->Add();
      tenant_received_->Add(raw_len);
    }
    if (id == known.auth || id == known.hello) {
      HandleAuth(id, args, skipped, silent, now);
      return;
    }
    static const uint32_t kNoAuth = commands::CommandFlagMask("no_auth");
    if (tenant_ == nullptr && (commands::Spec(id).flags & kNoAuth) == 0) {
      Refuse(id, Refusal::kNoAuth, "NOAUTH Authentication required.", skipped, silent);
      return;
    }
    // keyguard tells RESP2 pub/sub messages from replies by the confirmations it reads in step
    // with its commands. Inside MULTI, and under CLIENT REPLY OFF/SKIP, Redis sends those out of
    // step, and a message of any tenant's keys would then pass as some command's reply.
    if (tenant_ != nullptr && subscribe && (state_.in_multi() || silent)) {
      Refuse(id, Refusal::kTenant,
             absl::StrCat("ERR keyguard: ", absl::AsciiStrToUpper(std::string(args[0])),
                          " inside MULTI or under CLIENT REPLY OFF/SKIP is not allowed for tenants"),
             skipped, silent);
      return;
    }
    if (tenant_ != nullptr && state_.in_multi() && id == known.client && args.size() > 1 &&
        EqualsIgnoreCase(args[1], "reply")) {
      Refuse(id, Refusal::kTenant, "ERR keyguard: CLIENT REPLY inside MULTI is not allowed for tenants", skipped,
             silent);
      return;
    }
    // A RESP2 server refuses CLIENT REPLY while the connection is subscribed, but keyguard
    // follows OFF/SKIP when it forwards them: its replies would fall out of step with the
    // server's, and a reply (INFO's keyspace) would pass with another command's filter. Whether
    // the subscription holds when the server gets there is not known here, so fail closed.
    if (tenant_ != nullptr && id == known.client && args.size() > 1 && EqualsIgnoreCase(args[1], "reply") &&
        MayBeSubscribed()) {
      Refuse(id, Refusal::kTenant, "ERR keyguard: CLIENT REPLY on a subscribed connection is not allowed for tenants",
             skipped, silent);
      return;
    }
  }
  if (!upstream_ready_) {
    worker_.shard->CountCommand(id, metrics::Outcome::kFailed);
    Reply(std::string(kUpstreamUnavailable), id, /*close_after=*/true);
    stop_reading_ = true;
    return;
  }
  if (id == commands::kUnknownCommand && worker_.live->reject_unknown_commands) {
    Refuse(id, Refusal::kUnknownCommand, absl::StrCat("ERR keyguard: unknown command '", std::string(args[0]), "'"),
           skipped, silent);
    return;
  }
  if (worker_.deny[id]) {
    Refuse(
        id, Refusal::kDenyList,
        absl::StrCat("ERR keyguard: command '", absl::AsciiStrToUpper(std::string(args[0])), "' is not allowed here"),
        skipped, silent);
    return;
  }
  std::string_view bytes(raw, raw_len);
  uint8_t rewrite = 0;
  const bool check_policy = !worker_.live->key_policy->empty();
  std::span<const std::string_view> out = args;
  bool modified = false;
  tenant::Walk walk = tenant::Walk::kNone;
  if (check_policy || tenant_ != nullptr) {
    const commands::CommandSpec* spec = commands::ResolveSpec(id, args);
    key_refs_.clear();
    const bool keys_ok = spec != nullptr && commands::FindKeys(*spec, args, &key_refs_);
    if (check_policy) {
      std::string refusal;
      if (!ApplyScriptPolicy(args, id, &refusal)) {
        Refuse(id, Refusal::kKeyPolicy, std::move(refusal), skipped, silent);
        return;
      }
    }
    if (check_policy && !key_refs_.empty()) {
      std::string refusal;
      if (!ApplyKeyPolicy(args, id, *spec, &modified, &refusal)) {
        Refuse(id, Refusal::kKeyPolicy, std::move(refusal), skipped, silent);
        return;
      }
      if (modified) out = cmd_args_;
    }
    if (tenant_ != nullptr) {
      const tenant::RequestResult r =
          worker_.rewriter->Rewrite(*tenant_, id, spec, out, key_refs_, keys_ok, &tenant_args_);
      if (r.kind == tenant::RequestResult::Kind::kRefuse) {
        Refuse(id, Refusal::kTenant, r.message, skipped, silent);
        return;
      }
      if (r.modified) {
        out = tenant_args_;
        modified = true;
      }
      rewrite = static_cast<uint8_t>(r.reply);
      walk = r.walk;
      if (walk != tenant::Walk::kNone && (state_.in_multi() || silent)) {
        // A walk takes several round trips: it cannot be queued in a transaction, and under
        // CLIENT REPLY OFF/SKIP the server would not answer its steps.
        Refuse(id, Refusal::kTenant,
               absl::StrCat("ERR keyguard: ", absl::AsciiStrToUpper(std::string(args[0])),
                            " inside MULTI or under CLIENT REPLY OFF/SKIP is not allowed for tenants (keyguard walks "
                            "the tenant's keys in steps)"),
               skipped, silent);
        return;
      }
    }
  }
  uint8_t reply_check = 0;
  if (worker_.config.hygiene.enabled) {
    // The detectors look at the client's own names (args); their rewrites apply on top of what
    // the policy and the tenant stage made (out): positions are the same.
    edit_.Reset(out);
    std::string refusal;
    reply_check = detectors_.OnRequest(id, args, edit_, state_.watching(), tenant_ != nullptr, &refusal);
    if (!refusal.empty()) {
      policy_owned_.clear();
      edit_.Release();
      Refuse(id, Refusal::kHygiene, std::move(refusal), skipped, silent);
      return;
    }
    if (edit_.modified()) {
      out = edit_.args();
      modified = true;
    }
  }
  if (walk != tenant::Walk::kNone) {
    if (!policy_owned_.empty()) policy_owned_.clear();
    edit_.Release();
    StartWalk(walk, id, now);
    return;
  }
  splice_.clear();
  if (modified && !Splice(raw, raw_len, args, out, &bytes)) {
    // The command goes upstream re-encoded; everything but the rewritten arguments is unchanged.
    bytes = Encode(out);
  }
  if (!policy_owned_.empty()) policy_owned_.clear();
  edit_.Release();

  Pending p;
  p.rewrite = rewrite;
  p.command = id;
  p.start_ns = now;
  p.reply_check = reply_check;
  const bool hot = worker_.config.hygiene.enabled && HotKeysRequest(id, args, raw_len, &p);
  if (reply_check != 0 || hot) queue_.AttachKey(&p, args[1]);
  const ConnectionState::Effects e = state_.OnForward(id, args, mode, tenant_ != nullptr, &p);
  if (e.stop_reading) stop_reading_ = true;
  if (e.ping_first) ForwardRaw(kPing.data(), kPing.size());
  if (e.logout && tenancy != nullptr && tenancy->requires_auth()) {
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
    worker_.shard->CountCommand(id, metrics::Outcome::kNoReply);
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
  const std::string label = absl::StrCat("tenant=\"", t->name, "\"");
  tenant_commands_ = &shard.tenant_commands.Get(label);
  tenant_received_ = &shard.tenant_received_bytes.Get(label);
  tenant_sent_ = &shard.tenant_sent_bytes.Get(label);
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

void Session::HandleAuth(commands::CommandId id, std::span<const std::string_view> args, bool skipped, bool silent,
                         int64_t now) {
  const tenant::Tenancy& tenancy = *worker_.config.tenancy;
  const bool hello = id == commands::Known().hello;
  if (state_.in_multi()) {
    Refuse(id, Refusal::kTenant, "ERR keyguard: AUTH and HELLO are not allowed inside MULTI", skipped, silent);
    return;
  }
  if (hello && silent) {
    // keyguard must read HELLO's reply to know the protocol, and with it what is a push.
    Refuse(id, Refusal::kTenant, "ERR keyguard: HELLO under CLIENT REPLY OFF/SKIP is not allowed", skipped, silent);
    return;
  }
  std::string_view user, password;
  bool has_auth = false;
  std::vector<std::string_view> forward;  // HELLO as it goes upstream: without AUTH
  if (!hello) {
    if (args.size() == 2) {
      user = "default";
      password = args[1];
    } else if (args.size() == 3) {
      user = args[1];
      password = args[2];
    } else {
      Refuse(id, Refusal::kTenant, "ERR wrong number of arguments for 'auth' command", skipped, silent);
      return;
    }
    has_auth = true;
  } else {
    forward.assign(args.begin(), args.begin() + std::min<size_t>(args.size(), 2));
    for (size_t i = 2; i < args.size(); ++i) {
      if (EqualsIgnoreCase(args[i], "auth") && i + 2 < args.size()) {
        user = args[i + 1];
        password = args[i + 2];
        has_auth = true;
        i += 2;
      } else {
        forward.push_back(args[i]);
      }
    }
  }
  if (has_auth) {
    const tenant::User* u = nullptr;
    if (!tenancy.requires_auth()) {
      // Static tenancy: clients need no password, as with Redis's passwordless default user.
      if (!hello && args.size() == 2) {
        Refuse(id, Refusal::kAuth,
               "ERR AUTH <password> called without any password configured for the default user. Are you sure "
               "your configuration is correct?",
               skipped, silent);
        return;
      }
      if (user != "default") {
        Refuse(id, Refusal::kAuth, "WRONGPASS invalid username-password pair or user is disabled.", skipped, silent);
        return;
      }
    } else {
      u = tenancy.Authenticate(user, password);
      if (u == nullptr) {
        Refuse(id, Refusal::kAuth, "WRONGPASS invalid username-password pair or user is disabled.", skipped, silent);
        return;
      }
      BindTenant(u->tenant);
    }
  }
  if (!hello) {
    worker_.shard->CountCommand(id, metrics::Outcome::kOk);
    if (skipped) ForwardRaw(kPing.data(), kPing.size());  // the upstream still owes the skip
    if (!silent) Reply("+OK\r\n", id, false);
    return;
  }
  if (tenant_ == nullptr) {
    Refuse(id, Refusal::kNoAuth,
           "NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> AUTH "
           "<user> <pass> option can be used to authenticate the client and select the RESP protocol version at the "
           "same time",
           skipped, silent);
    return;
  }
  const std::string_view encoded = Encode(forward);
  ForwardRaw(encoded.data(), encoded.size());
  if (silent) {
    worker_.shard->CountCommand(id, metrics::Outcome::kNoReply);
    return;
  }
  Pending p;
  p.kind = Kind::kHello;
  p.command = id;
  p.start_ns = now;
  p.hello_version = HelloVersion(args);
  queue_.Push(std::move(p));
}

void Session::Refuse(commands::CommandId id, Refusal reason, std::string message, bool skipped, bool silent) {
  worker_.shard->CountCommand(id, metrics::Outcome::kRejected);
  const size_t r = static_cast<size_t>(reason);
  worker_.rejected[r]->Add();
  if (tenant_ != nullptr) {
    // Resolved once per tenant binding and reason (a label string and a map lookup).
    metrics::Counter*& c = tenant_rejected_[r];
    if (c == nullptr) {
      c = &worker_.shard->tenant_rejected.Get(
          absl::StrCat("tenant=\"", tenant_->name, "\",reason=\"", RefusalName(reason), "\""));
    }
    c->Add();
  }
  state_.OnRefused();  // Redis fails EXEC after a refused queued command
  // Redis still owes one skipped reply from CLIENT REPLY SKIP; without this PING it would
  // swallow the reply of the next command we forward.
  if (skipped) ForwardRaw(kPing.data(), kPing.size());
  if (silent) return;
  std::string text;
  resp::AppendError(&text, message);
  Reply(std::move(text), id, false);
}

bool Session::ApplyScriptPolicy(std::span<const std::string_view> args, commands::CommandId id, std::string* refusal) {
  enum : uint8_t { kNone, kEval, kEvalSha, kFcall, kScript, kFunction };
  static const std::vector<uint8_t> kScriptKind = [] {
    std::vector<uint8_t> t(commands::CommandCount(), kNone);
    for (auto [name, kind] : {std::pair{"eval", kEval}, std::pair{"evalsha", kEvalSha}, std::pair{"fcall", kFcall},
                              std::pair{"script", kScript}, std::pair{"function", kFunction}}) {
      const commands::CommandId c = commands::LookupCommand(name);
      if (c < t.size()) t[c] = kind;
    }
    return t;
  }();
  const uint8_t kind = id < kScriptKind.size() ? kScriptKind[id] : kNone;
  if (kind == kNone || args.size() < 2) return true;
  const policy::KeyPolicy& policy = *worker_.live->key_policy;
  auto script = [&](std::string_view sha) {
    return policy.ScriptReviewed(sha) ? std::string() : "script " + std::string(sha);
  };
  std::string unreviewed;  // what the refusal names
  switch (kind) {
    case kEval: unreviewed = script(tenant::Sha1Hex(args[1])); break;
    case kEvalSha: unreviewed = script(absl::AsciiStrToLower(std::string(args[1]))); break;
    case kFcall:
      if (!policy.FunctionReviewed(args[1])) unreviewed = absl::StrCat("function '", KeyInError(args[1]), "'");
      break;
    case kScript:
      if (args.size() == 3 && EqualsIgnoreCase(args[1], "load")) unreviewed = script(tenant::Sha1Hex(args[2]));
      break;
    case kFunction:
      if (args.size() >= 3 && EqualsIgnoreCase(args[1], "load")) {
        unreviewed = script(tenant::Sha1Hex(args.back()));  // the library code comes last
      } else if (EqualsIgnoreCase(args[1], "restore")) {
        unreviewed = "FUNCTION RESTORE (a dump cannot be reviewed)";
      }
      break;
  }
  if (unreviewed.empty()) return true;
  const policy::Rule& rule = policy.scripts_rule();
  const policy::Action action = rule.action == policy::Action::kReject || rule.action == policy::Action::kWarn
                                    ? rule.action
                                    : policy::Action::kObserve;  // nothing to rewrite
  worker_.shard->key_violations
      .Get(absl::StrCat("rule=\"scripts\",action=\"", policy::ActionName(action), "\",key_pattern=\"\""))
      .Add();
  if (action == policy::Action::kWarn) Warn(policy::Violation{&rule, ""}, unreviewed, id);
  if (action != policy::Action::kReject) return true;
  *refusal =
      absl::StrCat("ERR keyguard: ", unreviewed,
                   " is not reviewed (key_policy.scripts): a script may write key names the key policy never sees");
  return false;
}

bool Session::ApplyKeyPolicy(std::span<const std::string_view> args, commands::CommandId id,
                             const commands::CommandSpec& spec, bool* modified, std::string* refusal) {
  const policy::KeyPolicy& policy = *worker_.live->key_policy;
  metrics::WorkerShard& shard = *worker_.shard;
  const policy::Violation* reject = nullptr;
  std::string reject_key, reject_rules, reject_suggestion;
  std::vector<std::pair<uint32_t, std::string>> rewrites;
  for (const commands::KeyRef& ref : key_refs_) {
    const std::string_view key = args[ref.pos];
    violations_.clear();
    policy.Check(key, id, spec, &violations_);
    if (violations_.empty()) continue;
    const std::string& pattern = shard.PatternLabel(policy::KeyPattern(key), policy.max_key_patterns());
    // Rules judge the names a command creates: reading, expiring, deleting or renaming away an
    // existing bad name is observed, never refused.
    const bool creates = policy::MayCreateKey(ref.flags, spec);
    bool rewritten = false;
    for (const policy::Violation& v : violations_) {
      const policy::Action action =
          v.rule->action == policy::Action::kReject && !creates ? policy::Action::kObserve : v.rule->action;
      shard.key_violations
          .Get(absl::StrCat("rule=\"", v.rule->name, "\",action=\"", policy::ActionName(action), "\",key_pattern=\"",
                            pattern, "\""))
          .Add();
      switch (action) {
        case policy::Action::kWarn: Warn(v, key, id); break;
        case policy::Action::kReject:
          // The refusal names every rule the first refused key breaks, and a suggestion only
          // when the suggested name itself passes every rule.
          if (reject == nullptr) {
            reject = &v;
            reject_key.assign(key.data(), key.size());
          }
          if (key == reject_key) {
            absl::StrAppend(&reject_rules, reject_rules.empty() ? "" : ", ", "'", v.rule->name, "'");
            if (reject_suggestion.empty() && !v.suggestion.empty()) {
              std::vector<policy::Violation> again;
              policy.Check(v.suggestion, id, spec, &again);
              if (again.empty()) reject_suggestion = v.suggestion;
            }
          }
          break;
        case policy::Action::kRewrite:
          if (!rewritten && !v.suggestion.empty()) {
            rewritten = true;
            rewrites.emplace_back(ref.pos, v.suggestion);
            shard.keys_rewritten.Get(absl::StrCat("rule=\"", v.rule->name, "\"")).Add();
          }
          break;
        case policy::Action::kObserve: break;
      }
    }
    if (reject != nullptr) break;
  }
  if (reject != nullptr) {
    *refusal = absl::StrCat("ERR keyguard: key '", KeyInError(reject_key), "' violates rule",
                            reject_rules.find(',') == std::string::npos ? " " : "s ", reject_rules);
    if (!reject_suggestion.empty()) absl::StrAppend(refusal, ": use ", KeyInError(reject_suggestion));
    return false;
  }
  if (!rewrites.empty()) {
    cmd_args_.assign(args.begin(), args.end());
    for (auto& [pos, key] : rewrites) cmd_args_[pos] = policy_owned_.emplace_back(std::move(key));
    *modified = true;
  }
  return true;
}

void Session::Warn(const policy::Violation& v, std::string_view key, commands::CommandId id) {
  // At most kWarnBurst lines per second per worker, so a misbehaving app cannot flood the log.
  constexpr int kWarnBurst = 20;
  const int64_t second = NowNs() / 1000000000;
  if (second != worker_.warn_second) {
    worker_.warn_second = second;
    worker_.warn_count = 0;
  }
  if (++worker_.warn_count > kWarnBurst) return;
  EventLine line("warn", "key_violation");
  line.Str("rule", v.rule->name).Str("key", key).Str("command", commands::CommandName(id));
  if (!v.suggestion.empty()) line.Str("suggestion", v.suggestion);
  line.Str("client", client_address_).Str("client_name", state_.client_name()).Write(stderr);
}

void ReportFinding(Worker& worker, hygiene::Finding f) {
  metrics::WorkerShard& shard = *worker.shard;
  const char* kind = hygiene::KindName(f.kind);
  shard.findings.Get(absl::StrCat("kind=\"", kind, "\",key_pattern=\"", f.key_pattern, "\"")).Add();
  shard.hygiene_actions.Get(absl::StrCat("kind=\"", kind, "\",action=\"", hygiene::ActionName(f.action), "\"")).Add();
  if (f.kind == hygiene::Kind::kBigStringWrite || f.kind == hygiene::Kind::kBigStringRead ||
      f.kind == hygiene::Kind::kWholeCollectionRead || f.kind == hygiene::Kind::kBigKeyAccess ||
      f.kind == hygiene::Kind::kDelBigKey || f.kind == hygiene::Kind::kExpireBigKey) {
    shard.bigkey_access
        .Get(absl::StrCat("kind=\"", kind, "\",command=\"", f.command, "\",key_pattern=\"", f.key_pattern, "\""))
        .Add();
  }
  if (worker.findings != nullptr) worker.findings->Add(f);
}

void Session::Sink::Stamp(hygiene::Finding* f, std::string_view key, commands::CommandId id) {
  Worker& worker = session.worker_;
  const hygiene::Settings& settings = worker.config.hygiene;
  f->action = settings.action(f->kind);
  f->key = hygiene::ShownKey(key, settings.finding_keys);
  f->key_pattern = worker.shard->PatternLabel(policy::KeyPattern(key), worker.live->key_policy->max_key_patterns());
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
  walk_ = WalkState{walk, id, 0, 0, "0", {}};
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
  const std::string& request = NextWalkRequest();
  ForwardRaw(request.data(), request.size());  // sent with this batch
}

bool Session::WaitForWalkToken() {
  // The tenant's steps on this worker share a budget: a walk over many keys takes its time
  // rather than the server's.
  const uint32_t rate = worker_.config.tenancy->walk_steps_per_second;
  if (rate == 0) return false;
  Worker::WalkBudget& b = worker_.walk_budget[tenant_];
  const int64_t now = NowNs();
  if (b.at_ns == 0) b.tokens = rate;
  b.tokens = std::min<double>(rate, b.tokens + static_cast<double>(now - b.at_ns) * rate / 1e9);
  b.at_ns = now;
  if (b.tokens >= 1) {
    b.tokens -= 1;
    return false;
  }
  const auto wait = std::chrono::nanoseconds(static_cast<int64_t>((1 - b.tokens) * 1e9 / rate) + 1);
  if (walk_timer_ == nullptr) walk_timer_ = std::make_unique<asio::steady_timer>(worker_.io);
  walk_timer_->expires_after(wait);
  std::weak_ptr<Session> weak = shared_from_this();
  walk_timer_->async_wait([weak](error_code e) {
    // The walk's entry need not be at the head yet (a first step waits behind earlier commands).
    if (auto s = weak.lock(); s && !e && !s->closed_ && s->upstream_ready_ && s->walk_.walk != tenant::Walk::kNone) {
      s->SendWalkStep();
    }
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
  upstream_out_.Send(NextWalkRequest());
}

const std::string& Session::NextWalkRequest() {
  walk_.request =
      tenant::WalkStep(*tenant_, walk_.walk, walk_.cursor, walk_.step, worker_.config.tenancy->walk_step_keys);
  return walk_.request;
}

void Session::ContinueWalk(char type, std::span<const resp::ReplyFramer::Scalar> head, int64_t now) {
  if (type == '-' || type == '!') {
    // The server refused a step (OOM, a script timeout, ...): the command fails with its error.
    std::string text;
    resp::AppendError(&text, head.empty() ? std::string_view("ERR keyguard: walk step failed") : head[0].text);
    FinishWalk(std::move(text), true, now);
    return;
  }
  int64_t seen = 0;
  if (type != '*' || head.size() < 3 || !resp::ParseRedisInt(head[1].text, &seen) || seen < 0) {
    FinishWalk("-ERR keyguard: unexpected reply to a key walk step\r\n", true, now);
    return;
  }
  walk_.total += static_cast<uint64_t>(seen);
  ++walk_.step;
  walk_.cursor.assign(head[0].text.data(), head[0].text.size());
  const std::string_view found = head[2].text;
  const std::string_view prefix =
      reply_tenant_ != nullptr ? std::string_view(reply_tenant_->prefix) : std::string_view();
  if (walk_.walk == tenant::Walk::kRandomkey && !found.empty()) {
    std::string text;
    resp::AppendBulk(&text, found.starts_with(prefix) ? found.substr(prefix.size()) : found);
    FinishWalk(std::move(text), false, now);
    return;
  }
  if (walk_.cursor != "0") {
    if (walk_.walk != tenant::Walk::kFlush && ClientGone()) {
      // DBSIZE/RANDOMKEY for a client that hung up and sent nothing after it: the answer has
      // nobody to go to (while a walk runs the client's socket is not read, so its close is
      // otherwise noticed only when the walk ends: a tenant could leave walks running).
      FinishWalk("-ERR keyguard: the client closed the connection\r\n", true, now);
      return;
    }
    SendWalkStep();
    return;
  }
  switch (walk_.walk) {
    case tenant::Walk::kDbsize: FinishWalk(absl::StrCat(":", walk_.total, "\r\n"), false, now); break;
    case tenant::Walk::kRandomkey: FinishWalk(state_.protocol() == 3 ? "_\r\n" : "$-1\r\n", false, now); break;
    default: FinishWalk("+OK\r\n", false, now); break;
  }
}

void Session::FinishWalk(std::string reply, bool error, int64_t now) {
  const Pending& p = queue_.front();
  AppendOut(held_.emplace_back(std::move(reply)));
  worker_.shard->CountCommand(p.command, error ? metrics::Outcome::kError : metrics::Outcome::kOk);
  worker_.shard->ObserveLatency(p.command, static_cast<uint64_t>(now - p.start_ns));
  queue_.Pop();
  walk_ = WalkState{};
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
    const size_t n = co_await AsyncReadSome(upstream_, upstream_buf_.free_space(), AwaitEc(ec));
    if (closed_) break;
    if (ec) {
      FailUpstream(ec == asio::error::eof ? metrics::UpstreamError::kClosed : metrics::UpstreamError::kReset);
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

bool Session::MayBeSubscribed() const {
  return state_.subscribed() ||
         std::any_of(queue_.begin(), queue_.end(), [](const Pending& p) { return p.kind == Kind::kSubscribe; });
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

    // Subscribe confirmations: pushes in RESP3, arrays in RESP2.
    if ((type == '>' || (type == '*' && state_.protocol() == 2)) && front != nullptr && head.size() >= 2 &&
        state_.IsConfirmationFor(*front, kind)) {
      DeliverPush(frame);
      state_.TrackConfirmation(kind, head[1].text);
      if (front->expected < 0) {
        front->expected = std::max<int64_t>(1, static_cast<int64_t>(state_.subscriptions(front->confirm / 2)) + 1);
      }
      if (--front->expected == 0) CompleteHead(type, 0, {}, 0, now);
      continue;
    }
    // Out-of-band: RESP3 pushes, RESP2 pub/sub messages, MONITOR lines.
    if (type == '>') {
      if (head.size() >= 2) state_.TrackConfirmation(kind, head[1].text);
      DeliverPush(frame);
      continue;
    }
    if (type == '*' && state_.protocol() == 2 && head.size() >= 2 && state_.subscribed() &&
        (EqualsIgnoreCase(kind, "message") || EqualsIgnoreCase(kind, "pmessage") ||
         EqualsIgnoreCase(kind, "smessage"))) {
      DeliverPush(frame);
      continue;
    }
    if (state_.monitor() && type == '+' && IsMonitorLine(kind)) {
      AppendOut(frame);
      continue;
    }
    if (front == nullptr) {
      // A reply nobody waits for; pass it on rather than drop it (a tenant never sees one: it
      // could name anything), and count it.
      worker_.shard->unexpected_replies.Add();
      if (worker_.config.tenancy == nullptr) AppendOut(frame);
      continue;
    }
    if (front->kind == Kind::kInternal && front->command == commands::Known().client) {
      // keyguard's own CLIENT ID. Should the server refuse it (an ACL on keyguard's user), no
      // connection can name this one in a REDIRECT.
      int64_t client_id = 0;
      if (type == ':' && resp::ParseRedisInt(kind, &client_id) && client_id != 0 && upstream_ready_) {
        upstream_client_id_ = client_id;
        if (tenant_ != nullptr) worker_.connections->Set(client_id, tenant_);
      }
      queue_.Pop();
      DeliverLocalsAtHead();
      continue;
    }
    if (front->kind == Kind::kInternal) {
      // keyguard's own upstream AUTH: an error means the upstream refuses keyguard's credentials.
      if (type == '-' || type == '!') {
        EventLine("error", "upstream_auth_failed").Str("error", kind).Write(stderr);
        upstream_auth_failed_ = true;
        ok = false;
        break;
      }
      queue_.Pop();
      DeliverLocalsAtHead();
      continue;
    }
    if (reply_tenant_ != nullptr && front->expect != Pending::Expect::kAny && !AsExpected(front->expect, type, kind)) {
      // The server's transaction state is not the one the reply filter follows (a command the
      // server refused as keyguard did not foresee): no reply may pass unfiltered, so none passes.
      EventLine("error", "transaction_state_differs").Str("command", commands::Spec(front->command).name).Write(stderr);
      worker_.shard->unexpected_replies.Add();
      desynced_ = true;
      ok = false;
      break;
    }
    if (front->kind == Kind::kWalk) {
      ContinueWalk(type, head, now);
      continue;
    }
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
  if (frame_len > 0 && p.kind != Kind::kExecAbort) {
    const bool aggregate = reply_type == '*' || reply_type == '%' || reply_type == '~';
    worker_.shard->ObserveReply(p.command, frame_len, aggregate ? size : -1);
  }
  if (p.keyed && worker_.hot.enabled()) HotKeysReply(p, reply_type, size, bulk, frame_len);
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
  AbortPending(kUpstreamUnavailable);
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
  error_code ignored;
  upstream_.close(ignored);
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
  auto limit = std::make_shared<asio::steady_timer>(worker_.io, std::chrono::seconds(30));
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
  client_.shutdown(tcp::socket::shutdown_both, ignored);
  client_.close(ignored);
  CloseUpstream();
  queue_event_.cancel();
  client_out_.Wake();
  upstream_out_.Wake();
  worker_.sessions.erase(self);
}

}  // namespace keyguard::proxy
