#include "proxy/session.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "keyguard/commands/command_table.h"
#include "keyguard/hygiene/detectors.h"
#include "keyguard/policy/key_pattern.h"
#include "keyguard/resp/encoder.h"
#include "proxy/size_probe.h"

namespace keyguard::proxy {
namespace {

using commands::EqualsIgnoreCase;
using Kind = Pending::Kind;

constexpr std::string_view kConfirmNames[] = {"subscribe",  "unsubscribe",  "psubscribe",
                                              "punsubscribe", "ssubscribe", "sunsubscribe"};
constexpr std::string_view kUpstreamUnavailable = "-ERR keyguard: upstream unavailable\r\n";
constexpr std::string_view kDesynced =
    "-ERR keyguard: the server's transaction state differs from keyguard's; the connection is closed\r\n";

constexpr std::string_view kExecAbort = "-EXECABORT Transaction discarded because of previous errors.\r\n";
constexpr std::string_view kDiscard = "*1\r\n$7\r\nDISCARD\r\n";
constexpr std::string_view kPing = "*1\r\n$4\r\nPING\r\n";

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

// Whether `reply` (its type and first line) is what `expect` allows.
bool AsExpected(Pending::Expect expect, char type, std::string_view line) {
  const bool error = type == '-' || type == '!';
  const bool queued = type == '+' && line == "QUEUED";
  switch (expect) {
    case Pending::Expect::kAny: return true;
    case Pending::Expect::kQueued: return queued || error;
    case Pending::Expect::kNotQueued: return !queued;
    case Pending::Expect::kMultiOk: return !error;
    case Pending::Expect::kExecInMulti: return !(error && line.starts_with("ERR EXEC without MULTI"));
    case Pending::Expect::kExecOutside: return error;
  }
  return false;
}
// Rewritten commands at least this long are spliced rather than re-encoded.
constexpr size_t kSpliceMinBytes = 1024;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int ConfirmIndex(std::string_view kind) {
  for (int i = 0; i < 6; ++i) {
    if (EqualsIgnoreCase(kind, kConfirmNames[i])) return i;
  }
  return -1;
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
      id_(worker.next_session_id++) {
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
  asio::co_spawn(worker_.io, [self]() { return self->Run(); }, asio::detached);
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
    asio::co_spawn(worker_.io, [self]() { return self->UpstreamPump(); }, asio::detached);
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
    while (!closed_ && queue_.size() >= max_pending) {
      queue_waiter_ = true;
      queue_event_.expires_at(asio::steady_timer::time_point::max());
      error_code ignored;
      co_await queue_event_.async_wait(AwaitEc(ignored));
    }
    if (closed_) break;
    client_buf_.Prepare(hint);
    error_code ec;
    const size_t n = co_await client_.async_read_some(client_buf_.free_space(), AwaitEc(ec));
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
  while (!stop_reading_) {
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
  // Redis's arity check, which comes before anything else the server does with a command; only
  // asked for the commands that change connection state (below), off the common path.
  auto arity_ok = [&] {
    const int arity = commands::Spec(id).arity;
    const auto argc = static_cast<int>(args.size());
    return arity > 0 ? argc == arity : argc >= -arity;
  };
  // By command id: the commands whose effect on connection state keyguard follows.
  static const std::vector<uint8_t> kChangesState = [&known] {
    std::vector<uint8_t> t(commands::CommandCount(), 0);
    for (commands::CommandId c : {known.reset, known.multi, known.exec, known.discard, known.watch, known.unwatch,
                                  known.hello, known.monitor, known.client, known.sync, known.psync, known.subscribe,
                                  known.psubscribe, known.ssubscribe, known.unsubscribe, known.punsubscribe,
                                  known.sunsubscribe}) {
      if (c < t.size()) t[c] = 1;
    }
    return t;
  }();
  const bool changes_state = id < kChangesState.size() && kChangesState[id] != 0;

  // Whether this command's reply is suppressed by CLIENT REPLY OFF/SKIP. After SYNC/PSYNC the
  // server treats the connection as a replica and answers nothing (REPLCONF ACK): whatever
  // keyguard would say (a refusal) would corrupt the stream, so it says nothing either.
  const bool skipped = skip_next_reply_;
  bool silent = reply_off_ || skipped || replication_stream_;
  skip_next_reply_ = false;

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
      Refuse(id, "noauth", "NOAUTH Authentication required.", skipped, silent);
      return;
    }
    // keyguard tells RESP2 pub/sub messages from replies by the confirmations it reads in step
    // with its commands. Inside MULTI, and under CLIENT REPLY OFF/SKIP, Redis sends those out of
    // step, and a message of any tenant's keys would then pass as some command's reply.
    if (tenant_ != nullptr && subscribe && (in_multi_ || silent)) {
      Refuse(id, "tenant",
             absl::StrCat("ERR keyguard: ", absl::AsciiStrToUpper(std::string(args[0])),
                          " inside MULTI or under CLIENT REPLY OFF/SKIP is not allowed for tenants"),
             skipped, silent);
      return;
    }
    if (tenant_ != nullptr && in_multi_ && id == known.client && args.size() > 1 && EqualsIgnoreCase(args[1], "reply")) {
      Refuse(id, "tenant", "ERR keyguard: CLIENT REPLY inside MULTI is not allowed for tenants", skipped, silent);
      return;
    }
    // A RESP2 server refuses CLIENT REPLY while the connection is subscribed, but keyguard
    // follows OFF/SKIP when it forwards them: its replies would fall out of step with the
    // server's, and a reply (INFO's keyspace) would pass with another command's filter. Whether
    // the subscription holds when the server gets there is not known here, so fail closed.
    if (tenant_ != nullptr && id == known.client && args.size() > 1 && EqualsIgnoreCase(args[1], "reply") &&
        MayBeSubscribed()) {
      Refuse(id, "tenant", "ERR keyguard: CLIENT REPLY on a subscribed connection is not allowed for tenants", skipped,
             silent);
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
    Refuse(id, "unknown_command", absl::StrCat("ERR keyguard: unknown command '", std::string(args[0]), "'"), skipped,
           silent);
    return;
  }
  if (worker_.deny[id]) {
    Refuse(id, "deny_list",
           absl::StrCat("ERR keyguard: command '", absl::AsciiStrToUpper(std::string(args[0])), "' is not allowed here"),
           skipped, silent);
    return;
  }
  std::string_view bytes(raw, raw_len);
  uint8_t rewrite = 0;
  const bool check_policy = !worker_.live->key_policy->empty();
  std::span<const std::string_view> out = args;
  bool modified = false;
  if (check_policy || tenant_ != nullptr) {
    const commands::CommandSpec* spec = commands::ResolveSpec(id, args);
    key_refs_.clear();
    const bool keys_ok = spec != nullptr && commands::FindKeys(*spec, args, &key_refs_);
    if (check_policy) {
      std::string refusal;
      if (!ApplyScriptPolicy(args, id, &refusal)) {
        Refuse(id, "key_policy", std::move(refusal), skipped, silent);
        return;
      }
    }
    if (check_policy && !key_refs_.empty()) {
      std::string refusal;
      if (!ApplyKeyPolicy(args, id, *spec, &modified, &refusal)) {
        Refuse(id, "key_policy", std::move(refusal), skipped, silent);
        return;
      }
      if (modified) out = cmd_args_;
    }
    if (tenant_ != nullptr) {
      const tenant::RequestResult r = worker_.rewriter->Rewrite(*tenant_, id, spec, out, key_refs_, keys_ok, &tenant_args_);
      if (r.kind == tenant::RequestResult::Kind::kRefuse) {
        Refuse(id, "tenant", r.message, skipped, silent);
        return;
      }
      if (r.modified) {
        out = tenant_args_;
        modified = true;
      }
      rewrite = static_cast<uint8_t>(r.reply);
    }
  }
  uint8_t reply_check = 0;
  if (worker_.config.hygiene.enabled) {
    // The detectors look at the client's own names (args); their rewrites apply on top of what
    // the policy and the tenant stage made (out): positions are the same.
    verdict_ = Verdict{};
    verdict_out_ = out;
    if (!pending_ttl_.empty()) FlushPendingTtl(false);
    reply_check = DetectRequest(id, args);
    if (!verdict_.refusal.empty()) {
      policy_owned_.clear();
      Refuse(id, "hygiene", std::move(verdict_.refusal), skipped, silent);
      return;
    }
    if (verdict_.modified) {
      out = hygiene_args_;
      modified = true;
    }
  }
  splice_.clear();
  if (modified && !Splice(raw, raw_len, args, out, &bytes)) {
    // The command goes upstream re-encoded; everything but the rewritten arguments is unchanged.
    bytes = Encode(out);
  }
  if (!policy_owned_.empty()) policy_owned_.clear();

  Pending p;
  p.rewrite = rewrite;
  if (tenant_ != nullptr) p.expect = Pending::Expect::kNotQueued;
  p.command = id;
  p.start_ns = now;
  p.reply_check = reply_check;
  const bool hot = worker_.config.hygiene.enabled && HotKeysRequest(id, args, raw_len, &p);
  if (reply_check != 0 || hot) {
    p.keyed = true;
    p.key_off = key_arena_base_ + key_arena_.size();
    p.key_len = static_cast<uint32_t>(args[1].size());
    key_arena_.append(args[1].data(), args[1].size());
  }
  if (id == known.quit) {
    stop_reading_ = true;  // Redis reads nothing after QUIT (also inside MULTI: QUIT is not queued)
    quit_sent_ = true;
  } else if (changes_state && !arity_ok()) {
    // The server answers with an arity error and changes no state (inside MULTI the command is
    // not queued, and EXEC will abort): `MULTI x` starts no transaction. A refused EXEC is the
    // exception: the server answers -EXECABORT and discards the transaction (execCommandAbort).
    if (id == known.exec) {
      in_multi_ = multi_aborted_ = false;
      watching_ = false;
      multi_rewrites_.clear();
    }
  } else if (id == known.reset) {
    // RESET is not queued by MULTI either: it discards the transaction and every mode.
    p.kind = Kind::kReset;
    if (skipped) {
      // Redis would skip RESET's reply, which tells keyguard the server has reset: a PING takes
      // the skip, and the +RESET is read but not shown.
      ForwardRaw(kPing.data(), kPing.size());
      p.hidden = true;
    }
    reply_off_ = false;
    silent = false;
    in_multi_ = multi_aborted_ = false;
    watching_ = false;
    multi_rewrites_.clear();
    // RESET logs the connection out: the client must authenticate again, and keyguard's own
    // upstream credentials are sent again right after it.
    if (tenancy != nullptr && tenancy->requires_auth()) BindTenant(nullptr);
  } else if (id == known.multi) {
    // A nested MULTI is an error that keeps the transaction: what was queued stays queued.
    if (!in_multi_) {
      multi_rewrites_.clear();
      p.expect = Pending::Expect::kMultiOk;
    }
    in_multi_ = true;
  } else if (id == known.watch) {
    watching_ = true;
  } else if (id == known.unwatch && !in_multi_) {
    // Inside MULTI, UNWATCH is queued like any command (below).
    watching_ = false;
  } else if (id == known.exec) {
    p.expect = in_multi_ ? Pending::Expect::kExecInMulti : Pending::Expect::kExecOutside;
    watching_ = false;
    if (in_multi_ && multi_aborted_) {
      p.kind = Kind::kExecAbort;
      bytes = kDiscard;
      splice_.clear();
    }
    if (tenant_ != nullptr && in_multi_) {
      // Every EXEC of a tenant is checked element by element, also when no queued command needed
      // a rewrite: its reply must hold exactly the commands keyguard saw queued, or none passes.
      p.rewrite = static_cast<uint8_t>(tenant::ReplyRewrite::kExec);
      p.exec_rewrites = multi_rewrites_;
    }
    multi_rewrites_.clear();
    in_multi_ = multi_aborted_ = false;
  } else if (id == known.discard) {
    in_multi_ = multi_aborted_ = false;
    watching_ = false;
    multi_rewrites_.clear();
  } else if (in_multi_) {
    // Queued inside MULTI: the reply is +QUEUED whatever the command; effects come with EXEC,
    // whose reply carries this command's reply at this index.
    if (tenant_ != nullptr) multi_rewrites_.push_back(p.rewrite);
    p.rewrite = 0;
    p.expect = Pending::Expect::kQueued;
  } else if (subscribe) {
    const bool unsub = id == known.unsubscribe || id == known.punsubscribe || id == known.sunsubscribe;
    if (args.size() > 1 || unsub) {
      p.kind = Kind::kSubscribe;
      p.confirm = static_cast<uint8_t>(ConfirmIndex(args[0]));
      p.expected = args.size() > 1 ? static_cast<int64_t>(args.size() - 1) : -1;
    }
  } else if (id == known.hello) {
    p.kind = Kind::kHello;
    int64_t v = 0;
    if (args.size() > 1 && resp::ParseRedisInt(args[1], &v) && (v == 2 || v == 3)) p.hello_version = static_cast<int8_t>(v);
  } else if (id == known.monitor) {
    p.kind = Kind::kMonitor;
  } else if ((id == known.sync || id == known.psync) && !silent) {
    // The server answers with newline keep-alives, then $<len>\r\n<RDB> without a CRLF (or a
    // diskless EOF-marked payload), then commands that answer no request, for the connection's
    // life: no reply framing fits, so from this reply on the upstream side is a byte tunnel.
    p.kind = Kind::kReplicationStream;
    replication_stream_ = true;
  } else if (id == known.client && args.size() == 3 && EqualsIgnoreCase(args[1], "setname")) {
    client_name_.assign(args[2].data(), args[2].size());
  } else if (id == known.client && args.size() == 3 && EqualsIgnoreCase(args[1], "reply")) {
    if (EqualsIgnoreCase(args[2], "off")) {
      reply_off_ = true;
      silent = true;
    } else if (EqualsIgnoreCase(args[2], "skip")) {
      silent = true;
      skip_next_reply_ = !reply_off_;
    } else if (EqualsIgnoreCase(args[2], "on")) {
      reply_off_ = false;
      silent = false;
    }
  }

  if (!splice_.empty()) {
    for (const asio::const_buffer& b : splice_) ForwardRaw(static_cast<const char*>(b.data()), b.size());
  } else {
    ForwardRaw(bytes.data(), bytes.size());
  }
  if (silent) {
    worker_.shard->CountCommand(id, metrics::Outcome::kNoReply);
    return;
  }
  const bool reset = p.kind == Kind::kReset;
  queue_.push_back(std::move(p));
  if (reset) SendUpstreamAuth(/*send_now=*/false);
}

void Session::BindTenant(const tenant::Tenant* t) {
  tenant_ = t;
  detector_scope_ = DetectorScope(t);
  if (t != nullptr) reply_tenant_ = t;  // RESET's nullptr takes effect with its reply
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
  ForwardRaw(worker_.upstream_auth.data(), worker_.upstream_auth.size());
  Pending p;
  p.kind = Kind::kInternal;
  p.command = commands::Known().auth;
  queue_.push_back(std::move(p));
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
  if (in_multi_) {
    Refuse(id, "tenant", "ERR keyguard: AUTH and HELLO are not allowed inside MULTI", skipped, silent);
    return;
  }
  if (hello && silent) {
    // keyguard must read HELLO's reply to know the protocol, and with it what is a push.
    Refuse(id, "tenant", "ERR keyguard: HELLO under CLIENT REPLY OFF/SKIP is not allowed", skipped, silent);
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
      Refuse(id, "tenant", "ERR wrong number of arguments for 'auth' command", skipped, silent);
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
        Refuse(id, "auth",
               "ERR AUTH <password> called without any password configured for the default user. Are you sure "
               "your configuration is correct?",
               skipped, silent);
        return;
      }
      if (user != "default") {
        Refuse(id, "auth", "WRONGPASS invalid username-password pair or user is disabled.", skipped, silent);
        return;
      }
    } else {
      u = tenancy.Authenticate(user, password);
      if (u == nullptr) {
        Refuse(id, "auth", "WRONGPASS invalid username-password pair or user is disabled.", skipped, silent);
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
    Refuse(id, "noauth",
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
  int64_t v = 0;
  if (args.size() > 1 && resp::ParseRedisInt(args[1], &v) && (v == 2 || v == 3)) p.hello_version = static_cast<int8_t>(v);
  queue_.push_back(std::move(p));
}

void Session::Refuse(commands::CommandId id, const char* reason, std::string message, bool skipped, bool silent) {
  worker_.shard->CountCommand(id, metrics::Outcome::kRejected);
  worker_.shard->commands_rejected.Get(absl::StrCat("reason=\"", reason, "\"")).Add();
  if (tenant_ != nullptr) {
    worker_.shard->tenant_rejected.Get(absl::StrCat("tenant=\"", tenant_->name, "\",reason=\"", reason, "\"")).Add();
  }
  if (in_multi_) multi_aborted_ = true;  // Redis fails EXEC after a refused queued command
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
    case kEval:
      unreviewed = script(tenant::Sha1Hex(args[1]));
      break;
    case kEvalSha:
      unreviewed = script(absl::AsciiStrToLower(std::string(args[1])));
      break;
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
  *refusal = absl::StrCat("ERR keyguard: ", unreviewed,
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
          .Get(absl::StrCat("rule=\"", v.rule->name, "\",action=\"", policy::ActionName(action),
                            "\",key_pattern=\"", pattern, "\""))
          .Add();
      switch (action) {
        case policy::Action::kWarn:
          Warn(v, key, id);
          break;
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
        case policy::Action::kObserve:
          break;
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
  std::string line = absl::StrCat("{\"level\":\"warn\",\"event\":\"key_violation\",\"rule\":\"", hygiene::JsonEscape(v.rule->name),
                                  "\",\"key\":\"", hygiene::JsonEscape(key), "\",\"command\":\"", CommandNameOf(id), "\"");
  if (!v.suggestion.empty()) absl::StrAppend(&line, ",\"suggestion\":\"", hygiene::JsonEscape(v.suggestion), "\"");
  absl::StrAppend(&line, ",\"client\":\"", hygiene::JsonEscape(client_address_), "\",\"client_name\":\"", hygiene::JsonEscape(client_name_),
                  "\"}\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

namespace {

// How the hygiene detectors look at a command.
enum ReplyCheck : uint8_t { kNoCheck = 0, kStringRead = 1, kCollectionRead = 2 };
// How a TTL argument counts: relative seconds or milliseconds, or an absolute Unix time.
enum TtlUnit : uint8_t { kNoTtl, kSeconds, kMillis, kUnixSeconds, kUnixMillis };

struct HygieneInfo {
  int8_t value_pos = 0;      // position of the value of a string write (0: none)
  bool pairs = false;        // MSET-style key value pairs from position 1
  bool rmw_write = false;    // a write that replaces a serialized value
  uint8_t reply = kNoCheck;
  bool keys = false;
  bool flush = false;
  bool field_value_pairs = false;  // a RESP2 reply alternates fields and values (HGETALL)
  const char* suggestion = "";
  bool del = false;          // DEL: frees its keys in one blocking step
  bool unlink = false;       // UNLINK: the keys are gone
  int8_t ttl_pos = 0;        // EXPIRE family, SETEX, PSETEX: the TTL argument
  uint8_t ttl_unit = kNoTtl;
  int8_t options_from = 0;   // SET, GETEX: EX/PX/EXAT/PXAT/KEEPTTL among the arguments from here
  bool needs_ttl = false;    // creates a string value: cache and session patterns want a TTL
  bool probe = false;        // the reply does not show the key's size
  const char* type = "";     // the type a collection read shows
};

const std::vector<HygieneInfo>& HygieneTable() {
  static const std::vector<HygieneInfo> table = [] {
    std::vector<HygieneInfo> t(commands::CommandCount());
    auto at = [&](const char* name) -> HygieneInfo& { return t[commands::LookupCommand(name)]; };
    for (const char* n : {"set", "setnx", "getset"}) at(n) = HygieneInfo{2, false, true};
    for (const char* n : {"setex", "psetex"}) at(n) = HygieneInfo{3, false, true};
    at("append") = HygieneInfo{2, false, false};
    at("setrange") = HygieneInfo{3, false, false};
    for (const char* n : {"mset", "msetnx"}) at(n) = HygieneInfo{0, true, true};
    for (const char* n : {"set", "setnx", "getset", "mset", "msetnx"}) at(n).needs_ttl = true;
    at("set").options_from = 3;
    at("getex").options_from = 2;
    at("setex").ttl_pos = 2;
    at("setex").ttl_unit = kSeconds;
    at("psetex").ttl_pos = 2;
    at("psetex").ttl_unit = kMillis;
    at("expire").ttl_pos = at("pexpire").ttl_pos = at("expireat").ttl_pos = at("pexpireat").ttl_pos = 2;
    at("expire").ttl_unit = kSeconds;
    at("pexpire").ttl_unit = kMillis;
    at("expireat").ttl_unit = kUnixSeconds;
    at("pexpireat").ttl_unit = kUnixMillis;
    for (const char* n : {"get", "getex", "getdel"}) at(n).reply = kStringRead;
    for (const char* n : {"hgetall", "hkeys", "hvals"}) {
      at(n).reply = kCollectionRead;
      at(n).type = "hash";
      at(n).suggestion = "read it in pages with HSCAN, or only the fields you need with HMGET";
    }
    at("hgetall").field_value_pairs = true;
    for (const char* n : {"smembers", "sinter", "sunion", "sdiff"}) {
      at(n).reply = kCollectionRead;
      at(n).type = "set";
      at(n).suggestion = "read it in pages with SSCAN";
    }
    at("lrange").reply = kCollectionRead;
    at("lrange").type = "list";
    at("lrange").suggestion = "read it in windows: LRANGE key start start+N";
    for (const char* n : {"zrange", "zrevrange", "zrangebyscore", "zrevrangebyscore", "zrangebylex", "zrevrangebylex"}) {
      at(n).reply = kCollectionRead;
      at(n).type = "zset";
      at(n).suggestion = "read it in pages with ZSCAN or ZRANGE windows with LIMIT";
    }
    for (const char* n : {"xrange", "xrevrange"}) {
      at(n).reply = kCollectionRead;
      at(n).type = "stream";
      at(n).suggestion = "read it in pages with XRANGE ... COUNT N";
    }
    at("keys").keys = true;
    at("flushall").flush = true;
    at("flushdb").flush = true;
    at("del").del = true;
    at("unlink").unlink = true;
    // Replies that do not show how big the key is.
    for (const char* n : {"hget", "hmget", "hexists", "hincrby", "hincrbyfloat", "hstrlen", "sismember", "smismember",
                          "zscore", "zmscore", "zrank", "zrevrank", "zincrby", "lindex", "lset", "expire", "pexpire",
                          "expireat", "pexpireat", "persist", "getrange", "setrange"}) {
      at(n).probe = true;
    }
    return t;
  }();
  return table;
}

}  // namespace

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

hygiene::Finding Session::NewFinding(hygiene::Kind kind, std::string_view key, commands::CommandId id) {
  const hygiene::Settings& settings = worker_.config.hygiene;
  hygiene::Finding f{kind};
  f.action = settings.action(kind);
  f.key = hygiene::ShownKey(key, settings.finding_keys);
  f.key_pattern = worker_.shard->PatternLabel(policy::KeyPattern(key), worker_.live->key_policy->max_key_patterns());
  f.command = CommandNameOf(id);
  f.client = client_address_;
  f.client_name = client_name_;
  if (tenant_ != nullptr) f.tenant = tenant_->name;
  return f;
}

void Session::Emit(hygiene::Finding f, std::string_view key, commands::CommandId id) {
  hygiene::Finding full = NewFinding(f.kind, key, id);
  full.format = std::move(f.format);
  full.suggestion = std::move(f.suggestion);
  full.bytes = f.bytes;
  full.elements = f.elements;
  full.fields_changed = f.fields_changed;
  full.fields_total = f.fields_total;
  full.keys = f.keys;
  full.ttl_s = f.ttl_s;
  // Callers mark the findings they rewrote; a rewrite rule whose command could not be rewritten
  // (MSET cannot carry a TTL) warns.
  if (full.action == hygiene::Action::kRewrite && f.action != hygiene::Action::kRewrite) {
    full.action = hygiene::Action::kWarn;
  }
  if (full.action == hygiene::Action::kReject && hygiene::CanReject(full.kind) && verdict_.refusal.empty()) {
    verdict_.refusal = absl::StrCat("ERR keyguard: ", hygiene::KindName(full.kind), ": ", full.suggestion);
  }
  ReportFinding(worker_, std::move(full));
}

std::vector<std::string_view>& Session::HygieneArgs() {
  if (!verdict_.modified) {
    hygiene_args_.assign(verdict_out_.begin(), verdict_out_.end());
    verdict_.modified = true;
  }
  return hygiene_args_;
}

void Session::RememberSize(std::string_view key, std::string_view type, int64_t bytes, int64_t elements) {
  hygiene::KeySize s;
  s.type.assign(type.data(), type.size());
  s.bytes = bytes;
  s.elements = elements;
  s.at_ms = hygiene::UnixMs();
  worker_.sizes.Put(SizeKey(key), std::move(s));
}

uint64_t Session::SizeKey(std::string_view key) const { return hygiene::Fingerprint(key, detector_scope_); }

void Session::FlushPendingTtl(bool all) {
  const int64_t now_ms = hygiene::UnixMs();
  while (!pending_ttl_.empty() && (all || pending_ttl_.front().deadline_ms <= now_ms)) {
    PendingTtl t = std::move(pending_ttl_.front());
    pending_ttl_.pop_front();
    const hygiene::TtlPattern& pattern = worker_.config.hygiene.ttl_patterns[t.pattern];
    hygiene::Finding f{hygiene::Kind::kMissingTtl};
    f.suggestion = absl::StrCat(pattern.session ? "session" : "cache", " key (", pattern.glob,
                                ") written without a TTL: give it one (SET ... EX seconds), or it stays until evicted");
    Emit(std::move(f), t.key, t.command);
  }
}

uint8_t Session::DetectRequest(commands::CommandId id, std::span<const std::string_view> args) {
  const auto& table = HygieneTable();
  if (id >= table.size()) return kNoCheck;
  const HygieneInfo& info = table[id];
  const hygiene::Settings& settings = worker_.config.hygiene;
  hygiene::SizeCache& sizes = worker_.sizes;
  auto write = [&](std::string_view key, std::string_view value) {
    const bool big = value.size() >= settings.big_string_bytes;
    if (big) {
      hygiene::Finding f{hygiene::Kind::kBigStringWrite};
      f.bytes = static_cast<int64_t>(value.size());
      f.suggestion = value.size() >= settings.huge_string_bytes
                         ? "huge value: split it (a Hash or several keys) or keep it outside Redis"
                         : "big value: store the parts you update separately (a Hash), or compress it";
      Emit(std::move(f), key, id);
      RememberSize(key, "string", static_cast<int64_t>(value.size()), -1);
    } else if (!sizes.empty()) {
      sizes.Erase(SizeKey(key));
    }
    if (!info.rmw_write) return;
    if (value.size() < 256 && hygiene::DetectFormat(value) == hygiene::Format::kNone) {
      std::string parent;
      std::vector<std::string> names;
      if (worker_.attributes.OnWrite(key, -1, &parent, &names, detector_scope_)) {
        hygiene::Finding f{hygiene::Kind::kHashCandidate};
        f.elements = static_cast<int64_t>(names.size());
        f.suggestion = absl::StrCat("one attribute per key: keep them in one Hash, HSET ", parent);
        for (const std::string& n : names) absl::StrAppend(&f.suggestion, " ", n, " ...");
        Emit(std::move(f), parent, id);
      }
    }
    if (worker_.rmw.idle()) return;
    std::vector<hygiene::RmwTracker::Result> results;
    worker_.rmw.OnWrite(key, id_, value, watching_, hygiene::UnixMs(), &results, detector_scope_);
    for (const auto& r : results) {
      hygiene::Finding f{r.kind};
      f.format = hygiene::FormatName(r.format);
      f.fields_changed = r.fields_changed;
      f.fields_total = r.fields_total;
      if (r.kind == hygiene::Kind::kSerializedRmw) {
        f.suggestion = r.fields_total >= 0
                           ? absl::StrCat("changed ", r.fields_changed, " of ", r.fields_total,
                                          " fields: store it as a Hash and update fields with HSET / HINCRBY, or use "
                                          "JSON.SET on a path for nested data")
                           : "store it as a Hash and update fields with HSET / HINCRBY, or use JSON.SET on a path";
      } else {
        f.suggestion = "another connection wrote this key between this connection's read and write: use WATCH/MULTI, "
                       "a Lua script, or field updates on a Hash";
      }
      Emit(std::move(f), key, id);
    }
  };
  if (info.value_pos > 0 && args.size() > static_cast<size_t>(info.value_pos)) {
    write(args[1], args[info.value_pos]);
  } else if (info.pairs) {
    for (size_t i = 1; i + 1 < args.size(); i += 2) write(args[i], args[i + 1]);
  } else if (info.keys && args.size() > 1) {
    hygiene::Finding f{hygiene::Kind::kKeysCommand};
    f.suggestion = "KEYS blocks the server while it walks every key: use SCAN with MATCH and COUNT";
    Emit(std::move(f), args[1], id);
  } else if (info.flush) {
    bool async = false;
    for (size_t i = 1; i < args.size(); ++i) async |= EqualsIgnoreCase(args[i], "async");
    if (!async) {
      hygiene::Finding f{hygiene::Kind::kFlushWithoutAsync};
      f.suggestion = absl::StrCat(absl::AsciiStrToUpper(CommandNameOf(id)), " ASYNC frees memory in the background");
      // Under tenancy the flush is an emulation over the tenant's keys, not this command.
      if (settings.action(f.kind) == hygiene::Action::kRewrite && tenant_ == nullptr && args.size() == 1) {
        HygieneArgs().push_back("ASYNC");
        f.action = hygiene::Action::kRewrite;
      }
      Emit(std::move(f), "", id);
    }
  } else if (info.del) {
    if (!sizes.empty()) {
      const int64_t now_ms = hygiene::UnixMs();
      bool rewritten = false;
      for (size_t i = 1; i < args.size(); ++i) {
        const uint64_t h = SizeKey(args[i]);
        const hygiene::KeySize* s = sizes.Get(h, now_ms);
        if (s != nullptr && sizes.IsBig(*s)) {
          hygiene::Finding f{hygiene::Kind::kDelBigKey};
          f.bytes = s->bytes >= 0 ? s->bytes : s->memory;
          f.elements = s->elements;
          f.suggestion = "DEL frees a big key in one blocking step: use UNLINK, which frees it in the background";
          if (settings.action(f.kind) == hygiene::Action::kRewrite && !rewritten) {
            HygieneArgs()[0] = "UNLINK";
            rewritten = true;
          }
          if (rewritten) f.action = hygiene::Action::kRewrite;
          Emit(std::move(f), args[i], id);
        }
        sizes.Erase(h);
      }
    }
  } else if (info.unlink) {
    if (!sizes.empty()) {
      for (size_t i = 1; i < args.size(); ++i) sizes.Erase(SizeKey(args[i]));
    }
  }
  if (info.ttl_pos > 0 || info.options_from > 0 || info.needs_ttl) DetectTtl(id, args);
  if (args.size() > 1) {
    if (info.reply == kCollectionRead && settings.action(hygiene::Kind::kWholeCollectionRead) == hygiene::Action::kReject &&
        !sizes.empty()) {
      // A read known in advance to return a big collection can be refused before it runs.
      const hygiene::KeySize* s = sizes.Get(SizeKey(args[1]), hygiene::UnixMs());
      if (s != nullptr && s->elements >= settings.big_collection_elements) {
        hygiene::Finding f{hygiene::Kind::kWholeCollectionRead};
        f.elements = s->elements;
        f.suggestion = info.suggestion;
        Emit(std::move(f), args[1], id);
      }
    }
    if (info.probe && settings.probe && worker_.probe != nullptr &&
        worker_.probe_queue.size() < hygiene::ProbeQueue::kCapacity) {
      const uint64_t h = SizeKey(args[1]);
      if (sizes.Get(h, hygiene::UnixMs()) == nullptr) {
        hygiene::ProbeRequest r;
        r.hash = h;
        // The name the server stores: after the key policy's rewrite and the tenant prefix.
        r.upstream_key = std::string(verdict_out_[1]);
        r.finding = NewFinding(hygiene::Kind::kBigKeyAccess, args[1], id);
        if (worker_.probe_queue.Push(std::move(r))) worker_.probe->Wake();
      }
    }
  }
  return args.size() > 1 ? info.reply : kNoCheck;
}

void Session::DetectTtl(commands::CommandId id, std::span<const std::string_view> args) {
  const HygieneInfo& info = HygieneTable()[id];
  const hygiene::Settings& settings = worker_.config.hygiene;
  if (args.size() < 2) return;
  // Where the TTL is and how it counts.
  int ttl_arg = -1;
  uint8_t unit = kNoTtl;
  bool keepttl = false;
  if (info.ttl_pos > 0 && args.size() > static_cast<size_t>(info.ttl_pos)) {
    ttl_arg = info.ttl_pos;
    unit = info.ttl_unit;
  } else if (info.options_from > 0) {
    for (size_t i = static_cast<size_t>(info.options_from); i < args.size(); ++i) {
      const std::string_view o = args[i];
      const uint8_t u = EqualsIgnoreCase(o, "ex")     ? kSeconds
                        : EqualsIgnoreCase(o, "px")   ? kMillis
                        : EqualsIgnoreCase(o, "exat") ? kUnixSeconds
                        : EqualsIgnoreCase(o, "pxat") ? kUnixMillis
                                                      : kNoTtl;
      if (u != kNoTtl && i + 1 < args.size()) {
        ttl_arg = static_cast<int>(i + 1);
        unit = u;
        ++i;
      } else if (EqualsIgnoreCase(o, "keepttl") || EqualsIgnoreCase(o, "persist")) {
        keepttl = true;
      }
    }
  }
  int64_t value = 0;
  if (ttl_arg > 0 && resp::ParseRedisInt(args[ttl_arg], &value) && value > 0) {
    const int64_t now_ms = hygiene::UnixMs();
    const int64_t at_s = unit == kSeconds       ? now_ms / 1000 + value
                         : unit == kMillis      ? (now_ms + value) / 1000
                         : unit == kUnixSeconds ? value
                                                : value / 1000;
    const int64_t ttl_s = at_s - now_ms / 1000;
    // A TTL given right after a write without one (on this connection) is what missing_ttl waits for.
    if (!pending_ttl_.empty()) {
      std::erase_if(pending_ttl_, [&](const PendingTtl& t) { return t.key == args[1]; });
    }
    if (const int64_t n = worker_.expiries.Add(at_s, detector_scope_); n > 0) {
      hygiene::Finding f{hygiene::Kind::kExpiryClustering};
      f.keys = n;
      f.ttl_s = ttl_s;
      f.suggestion = absl::StrCat(n, " keys expire in the same second: add random jitter to their TTLs so the server "
                                     "does not expire them all at once");
      Emit(std::move(f), args[1], id);
    }
    if (settings.action(hygiene::Kind::kExpiryClustering) == hygiene::Action::kRewrite &&
        (unit == kSeconds || unit == kMillis)) {
      // Spread relative TTLs: never shorter than asked, up to jitter_percent longer.
      const int64_t extra = value * settings.jitter_percent / 100;
      if (extra > 0) {
        const int64_t jittered = value + static_cast<int64_t>(worker_.random() % static_cast<uint64_t>(extra + 1));
        HygieneArgs()[ttl_arg] = policy_owned_.emplace_back(absl::StrCat(jittered));
      }
    }
    // EXPIRE (or SET ... EX) on a big key: when it expires, the server frees it in one step.
    const hygiene::KeySize* s = worker_.sizes.empty() ? nullptr : worker_.sizes.Get(SizeKey(args[1]), now_ms);
    const int64_t bytes = info.value_pos > 0 && args.size() > static_cast<size_t>(info.value_pos)
                              ? static_cast<int64_t>(args[info.value_pos].size())
                              : -1;
    if ((s != nullptr && worker_.sizes.IsBig(*s)) || (bytes >= 0 && static_cast<size_t>(bytes) >= settings.big_string_bytes)) {
      hygiene::Finding f{hygiene::Kind::kExpireBigKey};
      f.bytes = bytes >= 0 ? bytes : (s->bytes >= 0 ? s->bytes : s->memory);
      if (s != nullptr && bytes < 0) f.elements = s->elements;
      f.ttl_s = ttl_s;
      f.suggestion = "a big key with a TTL is freed in one blocking step when it expires: delete it with UNLINK instead, "
                     "or enable lazyfree-lazy-expire";
      Emit(std::move(f), args[1], id);
    }
    return;
  }
  if (!info.needs_ttl || keepttl || settings.ttl_patterns.empty()) return;
  // A string written without a TTL: cache and session patterns must have one.
  auto check = [&](std::string_view key, bool can_rewrite) {
    for (size_t i = 0; i < settings.ttl_patterns.size(); ++i) {
      const hygiene::TtlPattern& pattern = settings.ttl_patterns[i];
      if (!hygiene::GlobMatch(pattern.glob, key)) continue;
      const hygiene::Action action = settings.action(hygiene::Kind::kMissingTtl);
      if (action == hygiene::Action::kRewrite && can_rewrite) {
        auto& out = HygieneArgs();
        out.push_back("EX");
        out.push_back(policy_owned_.emplace_back(absl::StrCat(pattern.default_ttl_s)));
        hygiene::Finding f{hygiene::Kind::kMissingTtl};
        f.action = hygiene::Action::kRewrite;
        f.ttl_s = pattern.default_ttl_s;
        f.suggestion = absl::StrCat(pattern.session ? "session" : "cache", " key (", pattern.glob,
                                    ") written without a TTL: keyguard added EX ", pattern.default_ttl_s);
        Emit(std::move(f), key, id);
      } else if (action == hygiene::Action::kReject) {
        hygiene::Finding f{hygiene::Kind::kMissingTtl};
        f.suggestion = absl::StrCat(pattern.session ? "session" : "cache", " key (", pattern.glob,
                                    ") needs a TTL: SET key value EX seconds");
        Emit(std::move(f), key, id);
      } else {
        // Wait a moment: a following EXPIRE on this connection gives the key its TTL.
        if (pending_ttl_.size() >= kMaxPendingTtl) FlushPendingTtlFront();
        pending_ttl_.push_back(PendingTtl{std::string(key), hygiene::UnixMs() + settings.missing_ttl_window_ms,
                                          static_cast<uint32_t>(i), id});
      }
      return;
    }
  };
  if (info.pairs) {
    for (size_t i = 1; i + 1 < args.size(); i += 2) check(args[i], false);
  } else {
    check(args[1], EqualsIgnoreCase(args[0], "set"));
  }
}

void Session::FlushPendingTtlFront() {
  pending_ttl_.front().deadline_ms = 0;  // the oldest goes now: the list is bounded
  FlushPendingTtl(false);
}

void Session::DetectReply(const Pending& p, char type, int64_t size, std::string_view bulk) {
  const hygiene::Settings& settings = worker_.config.hygiene;
  const std::string_view key(key_arena_.data() + (p.key_off - key_arena_base_), p.key_len);
  if (p.reply_check == kStringRead && type == '$') {
    if (bulk.size() >= settings.big_string_bytes) {
      hygiene::Finding f{hygiene::Kind::kBigStringRead};
      f.bytes = static_cast<int64_t>(bulk.size());
      f.suggestion = "big value read whole: read the part you need (GETRANGE, or a Hash with HGET)";
      Emit(std::move(f), key, p.command);
      RememberSize(key, "string", static_cast<int64_t>(bulk.size()), -1);
    }
    if (!worker_.rmw.idle() || hygiene::DetectFormat(bulk) != hygiene::Format::kNone) {
      worker_.rmw.OnRead(key, id_, bulk, hygiene::UnixMs(), DetectorScope(reply_tenant_));
    }
  } else if (p.reply_check == kCollectionRead && (type == '*' || type == '%' || type == '~')) {
    const HygieneInfo& info = HygieneTable()[p.command];
    const bool pairs = type == '*' && info.field_value_pairs;
    const int64_t members = pairs ? size / 2 : size;
    if (members >= settings.big_collection_elements) {
      hygiene::Finding f{hygiene::Kind::kWholeCollectionRead};
      f.elements = members;
      f.suggestion = info.suggestion;
      Emit(std::move(f), key, p.command);
      RememberSize(key, info.type, -1, members);
    }
  }
}

void Session::Reply(std::string text, commands::CommandId id, bool close_after) {
  if (queue_.empty()) {
    // Nothing is pending before it: deliver now.
    client_out_.Send(text);
    return;
  }
  Pending p;
  p.kind = Kind::kLocal;
  p.command = id;
  p.close_after = close_after;
  p.text = std::move(text);
  queue_.push_back(std::move(p));
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
    const size_t n = co_await upstream_.async_read_some(upstream_buf_.free_space(), AwaitEc(ec));
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
    if (worker_.draining && queue_.empty() && !closing_) {
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
    case tenant::ReplyAction::kPass:
      AppendOut(frame);
      break;
    case tenant::ReplyAction::kReplace:
      held_.push_back(std::move(out));
      AppendOut(held_.back());
      break;
    case tenant::ReplyAction::kDrop:
      break;
  }
}

bool Session::MayBeSubscribed() const {
  for (const auto& set : subscriptions_) {
    if (!set.empty()) return true;
  }
  return std::any_of(queue_.begin(), queue_.end(), [](const Pending& p) { return p.kind == Kind::kSubscribe; });
}

bool Session::IsConfirmationFor(const Pending& p, std::string_view kind) const {
  return p.kind == Kind::kSubscribe && EqualsIgnoreCase(kind, kConfirmNames[p.confirm]);
}

void Session::TrackConfirmation(std::string_view kind, std::string_view channel) {
  const int i = ConfirmIndex(kind);
  if (i < 0) return;
  auto& set = subscriptions_[i / 2];
  if (i % 2 == 0) {
    set.emplace(channel);
  } else {
    set.erase(std::string(channel));
  }
}

bool Session::ProcessUpstreamBytes(size_t* hint) {
  *hint = 0;
  deliver_.clear();
  held_.clear();
  const char* base = upstream_buf_.data();
  const size_t len = upstream_buf_.size();
  size_t pos = 0;
  const int64_t now = NowNs();
  bool ok = true;
  for (;;) {
    if (replication_stream_) {  // one predictable branch per frame on every other connection
      if (!replication_tunnel_ && !queue_.empty() && queue_.front().kind == Kind::kReplicationStream) {
        worker_.shard->CountCommand(queue_.front().command, metrics::Outcome::kOk);
        queue_.pop_front();
        replication_tunnel_ = true;
      }
      if (replication_tunnel_) {
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
    if ((type == '>' || (type == '*' && protocol_ == 2)) && front != nullptr && head.size() >= 2 &&
        IsConfirmationFor(*front, kind)) {
      DeliverPush(frame);
      TrackConfirmation(kind, head[1].text);
      if (front->expected < 0) {
        front->expected = std::max<int64_t>(1, static_cast<int64_t>(subscriptions_[front->confirm / 2].size()) + 1);
      }
      if (--front->expected == 0) CompleteHead(type, 0, {}, 0, now);
      continue;
    }
    // Out-of-band: RESP3 pushes, RESP2 pub/sub messages, MONITOR lines.
    if (type == '>') {
      if (head.size() >= 2 && ConfirmIndex(kind) >= 0) TrackConfirmation(kind, head[1].text);
      DeliverPush(frame);
      continue;
    }
    if (type == '*' && protocol_ == 2 && head.size() >= 2 &&
        (!subscriptions_[0].empty() || !subscriptions_[1].empty() || !subscriptions_[2].empty()) &&
        (EqualsIgnoreCase(kind, "message") || EqualsIgnoreCase(kind, "pmessage") || EqualsIgnoreCase(kind, "smessage"))) {
      DeliverPush(frame);
      continue;
    }
    if (monitor_ && type == '+' && IsMonitorLine(kind)) {
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
    if (front->kind == Kind::kInternal) {
      // keyguard's own upstream AUTH: an error means the upstream refuses keyguard's credentials.
      if (type == '-' || type == '!') {
        std::fprintf(stderr, "{\"level\":\"error\",\"event\":\"upstream_auth_failed\",\"error\":\"%s\"}\n",
                     hygiene::JsonEscape(kind).c_str());
        upstream_auth_failed_ = true;
        ok = false;
        break;
      }
      queue_.pop_front();
      DeliverLocalsAtHead();
      continue;
    }
    if (reply_tenant_ != nullptr && front->expect != Pending::Expect::kAny && !AsExpected(front->expect, type, kind)) {
      // The server's transaction state is not the one the reply filter follows (a command the
      // server refused as keyguard did not foresee): no reply may pass unfiltered, so none passes.
      std::fprintf(stderr, "{\"level\":\"error\",\"event\":\"transaction_state_differs\",\"command\":\"%s\"}\n",
                   hygiene::JsonEscape(commands::Spec(front->command).name).c_str());
      worker_.shard->unexpected_replies.Add();
      desynced_ = true;
      ok = false;
      break;
    }
    if (front->hidden) {
      // The client asked not to see it.
    } else if (front->kind == Kind::kExecAbort) {
      AppendOut(kExecAbort);
    } else if (reply_tenant_ != nullptr && (front->rewrite != 0 || type == '-' || type == '!')) {
      std::string out;
      switch (tenant::RewriteReply(*worker_.config.tenancy, *reply_tenant_, static_cast<tenant::ReplyRewrite>(front->rewrite),
                                   front->exec_rewrites, frame, &out)) {
        case tenant::ReplyAction::kPass:
          AppendOut(frame);
          break;
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
  if (p.reply_check != 0 && !error) DetectReply(p, reply_type, size, bulk);
  if (frame_len > 0 && p.kind != Kind::kExecAbort) {
    const bool aggregate = reply_type == '*' || reply_type == '%' || reply_type == '~';
    worker_.shard->ObserveReply(p.command, frame_len, aggregate ? size : -1);
  }
  if (p.keyed && worker_.hot.enabled()) HotKeysReply(p, reply_type, size, bulk, frame_len);
  switch (p.kind) {
    case Kind::kHello:
      if (!error && p.hello_version != 0) protocol_ = p.hello_version;
      break;
    case Kind::kMonitor:
      if (!error) monitor_ = true;
      break;
    case Kind::kReset:
      if (!error) {
        protocol_ = 2;
        monitor_ = false;
        for (auto& s : subscriptions_) s.clear();
        reply_tenant_ = tenant_;  // nullptr, unless the client authenticated again after RESET
      }
      break;
    default:
      break;
  }
  const bool exec_abort = p.kind == Kind::kExecAbort;
  worker_.shard->CountCommand(p.command, (error || exec_abort) ? metrics::Outcome::kError : metrics::Outcome::kOk);
  worker_.shard->ObserveLatency(p.command, static_cast<uint64_t>(now - p.start_ns));
  queue_.pop_front();
  DeliverLocalsAtHead();
  if (!key_arena_.empty()) TrimKeyArena();
}

void Session::TrimKeyArena() {
  if (queue_.empty()) {
    key_arena_base_ += key_arena_.size();
    key_arena_.clear();
    return;
  }
  if (key_arena_.size() < 64 * 1024) return;
  // Keys are appended in queue order: the first pending entry with a key holds the oldest one.
  for (const Pending& q : queue_) {
    if (!q.keyed) continue;
    const size_t consumed = static_cast<size_t>(q.key_off - key_arena_base_);
    if (consumed > key_arena_.size() / 2) {
      key_arena_.erase(0, consumed);
      key_arena_base_ = q.key_off;
    }
    return;
  }
}

void Session::DeliverLocalsAtHead() {
  while (!queue_.empty() && queue_.front().kind == Kind::kLocal) {
    held_.push_back(std::move(queue_.front().text));
    AppendOut(held_.back());
    queue_.pop_front();
  }
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
  if (!(quit_sent_ && reason == metrics::UpstreamError::kClosed)) worker_.shard->CountUpstreamError(reason);
  const bool client_waiting =
      std::any_of(queue_.begin(), queue_.end(), [](const Pending& p) { return p.kind != Kind::kInternal; });
  if (reason == metrics::UpstreamError::kAuth && !client_waiting) {
    // The upstream refused keyguard's own credentials before the client asked anything: as when
    // the upstream is down at connect, the client's next command gets the error, then the
    // connection closes (rather than a close with nothing said).
    CloseUpstream();
    queue_.clear();
    NotifyQueue();
    return;
  }
  AbortPending(kUpstreamUnavailable);
}

void Session::CloseUpstream() {
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
  std::string out;
  for (Pending& p : queue_) {
    if (p.kind == Kind::kLocal) {
      out += p.text;
    } else if (p.kind != Kind::kInternal) {
      worker_.shard->CountCommand(p.command, metrics::Outcome::kFailed);
      out += error;
    }
  }
  queue_.clear();
  if (!out.empty()) client_out_.Send(out);
  stop_reading_ = true;
  NotifyQueue();
  if (!closing_) {
    auto self = shared_from_this();
    asio::co_spawn(worker_.io, [self]() { return self->FlushAndClose(); }, asio::detached);
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
  stop_reading_ = true;  // commands already read are still served
  if (queue_.empty() && !closing_) {
    auto self = shared_from_this();
    asio::co_spawn(worker_.io, [self]() { return self->FlushAndClose(); }, asio::detached);
  }
  // Otherwise UpstreamPump closes once the last pending reply is delivered.
}

void Session::Close() {
  if (closed_) return;
  auto self = shared_from_this();
  closed_ = true;
  if (!pending_ttl_.empty()) FlushPendingTtl(true);  // no EXPIRE can follow any more
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
