#include "proxy/connection.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "keyguard/commands/command_table.h"
#include "keyguard/common/json_line.h"
#include "keyguard/hygiene/detectors.h"
#include "keyguard/policy/key_pattern.h"
#include "keyguard/resp/encoder.h"
#include "keyguard/resp/value.h"

namespace keyguard::proxy {
namespace {

using Kind = Pending::Kind;

constexpr std::string_view kUpstreamUnavailable = "-ERR keyguard: upstream unavailable\r\n";
constexpr std::string_view kDesynced =
    "-ERR keyguard: the server's transaction state differs from keyguard's; the connection is closed\r\n";

constexpr std::string_view kExecAbort = "-EXECABORT Transaction discarded because of previous errors.\r\n";
constexpr std::string_view kDiscard = "*1\r\n$7\r\nDISCARD\r\n";
constexpr std::string_view kPing = "*1\r\n$4\r\nPING\r\n";
constexpr std::string_view kMulti = "*1\r\n$5\r\nMULTI\r\n";
constexpr std::string_view kHello3 = "*2\r\n$5\r\nHELLO\r\n$1\r\n3\r\n";
// A walk step for a cluster node that is gone: the error the walk ends with.
constexpr std::string_view kWalkNodeGone =
    "*3\r\n$4\r\nEVAL\r\n$88\r\nreturn redis.error_reply('ERR keyguard: the cluster changed during the walk; try "
    "again')\r\n$1\r\n0\r\n";
commands::CommandId PingId() {
  static const commands::CommandId id = commands::LookupCommand("ping");
  return id;
}
constexpr std::string_view kClientId = "*2\r\n$6\r\nCLIENT\r\n$2\r\nID\r\n";

// The commands whose success may close the connection after the reply (Connection::TakeCloseMayFollow).
bool MayClose(commands::CommandId id) {
  static const std::vector<bool> table = [] {
    std::vector<bool> t(commands::CommandCount(), false);
    const commands::KnownCommands& k = commands::Known();
    for (commands::CommandId c :
         {k.client, k.exec, k.debug, commands::LookupCommand("acl"), commands::LookupCommand("shutdown")}) {
      if (c != commands::kUnknownCommand) t[c] = true;
    }
    return t;
  }();
  return id < table.size() && table[id];
}
constexpr std::string_view kClientReplySkip = "*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$4\r\nSKIP\r\n";

// Keeps one tenant's detector state and cached sizes apart from another's: the fingerprint of its
// prefix (of "" without a tenant: hygiene::kFnvBasis), the seed of every key hash.
uint64_t DetectorScope(const tenant::Tenant* t) {
  return hygiene::Fingerprint(t != nullptr ? std::string_view(t->prefix) : std::string_view());
}

// Rewritten commands at least this long are spliced rather than re-encoded.
constexpr size_t kSpliceMinBytes = 1024;

// A gather list full to its capacity grows out of line, so that appending (for every command and
// every reply) needs no register saves.
[[gnu::noinline]] void GrowAndAppend(std::vector<std::string_view>* gather, std::string_view bytes) {
  gather->push_back(bytes);
}

// Appends to a gather list, extending the last piece when the bytes are adjacent in memory
// (consecutive frames of one read), so a batch is one writev of few buffers.
inline void AppendPiece(std::vector<std::string_view>* gather, std::string_view bytes) {
  if (!gather->empty()) {
    std::string_view& last = gather->back();
    if (last.data() + last.size() == bytes.data()) {
      last = std::string_view(last.data(), last.size() + bytes.size());
      return;
    }
  }
  if (gather->size() == gather->capacity()) {
    GrowAndAppend(gather, bytes);
    return;
  }
  gather->push_back(bytes);
}

std::string CommandNameOf(commands::CommandId id) {
  const std::string_view n = commands::CommandName(id);
  return std::string(n.data(), n.size());
}

}  // namespace

Connection::Connection(const ConnectionShared& shared, ConnectionHost& host)
    : shared_(shared),
      host_(host),
      shard_(*shared.stages.shard),
      request_framer_(shared.stages.config.limits),
      reply_framer_(shared.stages.config.limits),
      id_(hygiene::NewConnectionId()),
      detectors_(shared.stages.config.hygiene, shared.hygiene, sink_, id_),
      pipeline_(shared.stages, detectors_) {
  if (shared_.stages.config.tenancy != nullptr) BindTenant(shared_.stages.config.tenancy->static_tenant());
}

Connection::~Connection() {
  if (upstream_client_id_ != 0) shared_.stages.connections->Set(upstream_client_id_, nullptr);
}

void Connection::ClearHeld() { held_.clear(); }

void Connection::CountSent() {
  if (tenant_sent_ == nullptr || out_.client.empty()) return;
  size_t bytes = 0;
  for (std::string_view b : out_.client) bytes += b.size();
  tenant_sent_->Add(bytes);
}

void Connection::OnUpstreamConnected() {
  BeginCall();
  upstream_ready_ = true;
  CountUpstream(1);
  SendUpstreamAuth();
  // The server's id of this connection, for the registry of the tenants' connections.
  if (shared_.stages.connections != nullptr) SendInternal(kClientId, commands::Known().client);
}

void Connection::OnUpstreamClosed() {
  if (upstream_client_id_ != 0) {
    shared_.stages.connections->Set(upstream_client_id_, nullptr);
    upstream_client_id_ = 0;
  }
  if (owns_upstream_) CountUpstream(-1);
  upstream_ready_ = false;
}

void Connection::OnClose() {
  if (detectors_.has_pending_ttl()) detectors_.FlushPendingTtl(true);  // no EXPIRE can follow any more
}

// ---------------------------------------------------------------------------------------------
// Client -> upstream

size_t Connection::OnClientBytes(const char* data, size_t len, int64_t now, size_t* hint) {
  BeginCall();
  *hint = 0;
  resume_ = false;
  scratch_.Reset();  // the previous batch was written
  shared_.stages.Refresh();
  size_t pos = 0;
  lane_free_ = queue_.empty();
  while (!stop_reading_ && !holding_) {
    const resp::Status st = request_framer_.Next(data + pos, len - pos);
    if (st == resp::Status::kNeedMore) {
      *hint = request_framer_.hint();
      break;
    }
    if (st == resp::Status::kProtocolError) {
      // As Redis: the error is the reply after every earlier one, then the connection closes.
      shard_.client_protocol_errors.Add();
      std::string text;
      resp::AppendError(&text, request_framer_.error());
      Reply(std::move(text), commands::kUnknownCommand, /*close_after=*/true);
      stop_reading_ = true;
      break;
    }
    const size_t n = request_framer_.consumed();
    const auto args = request_framer_.args();
    if (!args.empty()) {
      const commands::CommandId id = commands::LookupCommand(args[0]);
      // Shared upstream: a command that needs a connection of the client's own is left unread.
      if (pin_check_ && (pin_classes_[id] != 0 || multi_deferred_ || (cluster_ && pinned_))) [[unlikely]] {
        if (multi_deferred_ && !pinned_ && HoldsInTransaction(id, args, n, data + pos + n, len - pos - n)) {
          // Answered +QUEUED by HandleCommand (unless refused), sent once the transaction has its node.
          HandleCommand(id, args, data + pos, n, now);
          hold_next_ = false;
          pos += n;
          continue;
        }
        if (NeedsPin(id, args)) break;
        if (hello_answered_) {  // (NeedsPin answered a HELLO whose move failed)
          hello_answered_ = false;
          pos += n;
          continue;
        }
      }
      if (lane_classes_ != nullptr && !pinned_ && (lane_classes_[id] != 0) != write_lane_) [[unlikely]] {
        // Maybe the other lane (set_lanes). Nothing pending: nothing of the client's is on either.
        // A write behind reads of this call, with nothing pending before it: the call's commands
        // are all still unsent, and go to the write lane with it (one batch, flushed to one
        // lane's connection). Behind earlier reads it waits for them.
        if (const bool w = LaneWrites(lane_classes_, id, args); w != write_lane_) {
          if (queue_.empty() || (w && lane_free_)) {
            write_lane_ = w;
          } else if (w) {
            reply_wait_ = true;
            break;
          }
        }
      }
      HandleCommand(id, args, data + pos, n, now);
    }
    pos += n;
  }
  return pos;
}

void Connection::ForwardRaw(std::string_view bytes) { AppendPiece(&out_.upstream, bytes); }

bool Connection::Splice(const char* raw, size_t raw_len, std::span<const std::string_view> args,
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

std::string_view Connection::Encode(std::span<const std::string_view> args) {
  // Encoded commands of a batch share the scratch chunks, which never move while the output
  // points into them.
  char* const start = scratch_.Reserve(resp::CommandBound(args));
  const size_t n = static_cast<size_t>(resp::WriteCommand(start, args) - start);
  scratch_.Commit(n);
  return std::string_view(start, n);
}

bool Connection::HeadMayBlock() const {
  if (queue_.empty()) return false;
  static const uint32_t kBlocking = commands::CommandFlagMask("blocking");
  static const commands::CommandId kMayBlock[] = {commands::LookupCommand("wait"), commands::LookupCommand("waitaof"),
                                                  commands::LookupCommand("xread"),
                                                  commands::LookupCommand("xreadgroup")};
  const commands::CommandId id = queue_.front().command;
  if (id == commands::kUnknownCommand) return false;
  if ((commands::Spec(id).flags & kBlocking) != 0) return true;
  return std::find(std::begin(kMayBlock), std::end(kMayBlock), id) != std::end(kMayBlock);
}

bool Connection::NeedsPin(commands::CommandId id, std::span<const std::string_view> args) {
  if (multi_deferred_ && !pinned_) [[unlikely]] {
    // The first command after a MULTI keyguard answered: the transaction goes to the node of this
    // command's slot, or of the first keyed command sent along with it (Session::Pin looks ahead).
    // An EXEC or DISCARD of the empty transaction, and QUIT, need no node (HandleCommand).
    // An EXEC of a transaction of keyless commands (held: HoldsInTransaction) goes to any node.
    const commands::KnownCommands& k = commands::Known();
    if (id == k.exec && args.size() == 1 && held_in_multi_.empty()) return false;
    if ((id == k.discard && args.size() == 1) || id == k.quit) return false;
    pin_wanted_ = PinReason::kTransaction;
    pin_slot_ = kAnyNode;
    return true;
  }
  if (cluster_ && pinned_ && !sticky_ && !state_.in_multi() && !state_.watching() && queue_.ClientWaiting() &&
      shared_.cluster_map != nullptr && *shared_.cluster_map != nullptr) [[unlikely]] {
    // The pin ends once what is pending is answered (the transaction's EXEC, a blocking
    // command's reply): a command for another node's slot, pipelined behind it, waits for that
    // (unread) rather than be refused on this node's connection. Not behind keyguard's own
    // commands of a fresh pin (a tenant's CLIENT ID): the command it was made for would wait for
    // the pin to end and pin again, for ever (a tenant's cross-slot BLPOP pinned 24,000 times in
    // 5 s, unanswered); it is that command, refused here (CROSSSLOT) or served.
    const int32_t slot = StoredSlotOf(id, args);
    if (slot == kCrossSlot || (slot >= 0 && (*shared_.cluster_map)->owner[static_cast<size_t>(slot)] != pinned_node_)) {
      reply_wait_ = true;  // (keys in several slots: split, which only an unpinned client is)
      return true;
    }
  }
  if (id == commands::Known().hello && shared_.stages.config.tenancy == nullptr && args.size() <= 2) {
    // HELLO: answered by the shared connection, whose protocol is the client's. `HELLO 2|3` that
    // changes it moves the client to the other set first. (AUTH or SETNAME pin, as a bad
    // version does: the server's NOPROTO then comes from a connection of the client's own.)
    const int8_t v = args.size() == 1 ? link_protocol_ : HelloVersion(args);
    if (v == link_protocol_ || shared_.stages.access[id] != 0) return false;  // (denied: refused in place)
    if (!switch_failure_.empty() && v != 0 && !pinned_) {
      // The shared connections of that protocol are down (or the server refuses their HELLO 3):
      // the HELLO fails, and the client stays with its protocol.
      CommandContext c;
      c.id = id;
      c.mode = state_.TakeReplyMode();
      Answer(c, std::exchange(switch_failure_, std::string()), metrics::Outcome::kError);
      hello_answered_ = true;
      return false;
    }
    if (v != 0 && !pinned_) {
      protocol_wanted_ = v;
      pin_wanted_ = PinReason::kHello;
      return true;
    }
    if (v != 0) {
      // Pinned: the client's own connection changes protocol, and stays with it (its shared set
      // speaks the other one).
      if (!sticky_) pin_undo_ = kPinMadeSticky;
      sticky_ = true;
      pin_check_ = false;
      return false;
    }
  }
  const PinReason r = PinFor(id, args, shared_.stages.config.tenancy != nullptr);
  if (cluster_ && r == PinReason::kClient) [[unlikely]] {
    // A query (CLIENT ID, INFO, ...) sets nothing: unpinned, the first primary's shared connection
    // answers it, keyguard's (RouteCluster); pinned, its own connection, and the pin ends as it
    // would have. (A tenant's is pinned: a shared connection's CLIENT INFO names the last command
    // another tenant ran.) A TRACKING REDIRECT is refused (RouteCluster), with no pin made, a
    // tenant's too (ids are counted per node).
    const bool tenancy = shared_.stages.config.tenancy != nullptr;
    if (ClientQuery(args) && (pinned_ || !tenancy)) return false;
    if (TrackingRedirect(args)) return false;
  }
  if (r == PinReason::kPubSub && RefusedKeyspaceSubscription(id, args)) [[unlikely]] {
    return false;  // refused (RouteCluster)
  }
  if (r == PinReason::kNone) {
    if (pinned_ && id == client_id_ && args.size() >= 2 && !commands::EqualsIgnoreCase(args[1], "getname"))
        [[unlikely]] {
      // CLIENT SETNAME/SETINFO on a pinned connection go to it and name it: it is not in a new
      // connection's state any more, so it is closed with the client rather than pooled.
      if (!sticky_) pin_undo_ = kPinMadeSticky;
      sticky_ = true;
      pin_check_ = false;
    }
    return false;
  }
  if (cluster_ && ClusterAnswers(id, args)) return false;  // keyguard answers it
  // WAIT, WAITAOF: a connection pinned for them carried none of the client's writes (the access
  // stage refuses them on a shared connection).
  static const commands::CommandId kWait = commands::LookupCommand("wait");
  static const commands::CommandId kWaitAof = commands::LookupCommand("waitaof");
  if (!pinned_ && id != commands::kUnknownCommand && (id == kWait || id == kWaitAof)) return false;
  if (pinned_) {
    // Already on a connection of its own: state that lasts keeps it there for good (unless
    // keyguard refuses the command: EndRefusedPin).
    if (!PinEnds(r)) {
      if (!sticky_) pin_undo_ = kPinMadeSticky;
      sticky_ = true;
      pin_check_ = false;
    }
    return false;
  }
  // Tenancy, before AUTH: everything but AUTH, HELLO and QUIT is refused (NOAUTH), so only HELLO
  // needs a connection; a client without credentials never holds one of the server's.
  if (tenant_ == nullptr && shared_.stages.config.tenancy != nullptr && id != commands::Known().hello) return false;
  if (cluster_ && id == commands::Known().multi && args.size() == 1) {
    // (`MULTI x` goes to the server, whose arity error starts no transaction.)
    defer_multi_ = true;  // answered by HandleCommand (AnswerDeferredMulti); the next command pins
    return false;
  }
  pin_wanted_ = r;
  if (cluster_) {
    // The node of its keys (MULTI: see LookAheadForPin).
    const int32_t slot = StoredSlotOf(id, args);
    pin_slot_ = slot >= 0 ? slot : kAnyNode;
  }
  return true;
}

PinReason Connection::OnPinned(bool fresh) {
  BeginCall();
  const PinReason r = pin_wanted_;
  pin_wanted_ = PinReason::kNone;
  pinned_ = true;
  if (cluster_ && shared_.cluster_map != nullptr && *shared_.cluster_map != nullptr) {
    const cluster::SlotMap& m = **shared_.cluster_map;
    pinned_node_ = pin_slot_ >= 0 ? m.owner[static_cast<size_t>(pin_slot_)] : uint16_t{0};
  }
  sticky_ = !PinEnds(r);
  pin_check_ = !sticky_;
  pin_undo_ = kPinFresh;
  upstream_ready_ = true;
  CountUpstream(1);
  if (fresh) SendUpstreamAuth();
  if (shared_.stages.connections != nullptr) SendInternal(kClientId, commands::Known().client);
  // A client on RESP3 shared connections: its own connection speaks RESP3 too (one from the RESP3
  // pool does already).
  if (fresh && link_protocol_ == 3) SendInternal(kHello3, commands::Known().hello);
  if (multi_deferred_) {
    // The MULTI keyguard answered goes first; a refusal of the command that pinned the client
    // does not end this pin (the transaction goes on).
    // Nothing more goes before its +OK: a command the server ran outside a transaction (MULTI
    // refused: keyguard's user may not run it) could not be undone.
    multi_deferred_ = false;
    SendInternal(kMulti, commands::Known().multi);
    pin_undo_ = kPinSettled;
    holding_ = true;
  }
  return r;
}

void Connection::OnUnpinned() {
  OnUpstreamClosed();  // unregistered, counted gone
  DropHeldInTransaction(metrics::Outcome::kFailed);
  pinned_ = sticky_ = false;
  pin_undo_ = kPinSettled;
  pin_slot_ = kAnyNode;
  pinned_node_ = cluster::SlotMap::kNoOwner;
  pin_check_ = true;
}

void Connection::CountUpstream(int n) {
  owns_upstream_ = n > 0;
  shard_.CountUpstream(multiplexed_ ? metrics::UpstreamKind::kPinned : metrics::UpstreamKind::kDedicated, n);
}

std::string Connection::OnSharedFailed() {
  std::string owed = FailPending(desynced_ ? std::string(kDesynced) : UpstreamUnavailable());
  if (walk_.active() || holding_) {
    // The walk's step was in flight: its command got the error.
    walk_.Finish();
    holding_ = false;
    resume_ = true;
  }
  upstream_ready_ = false;
  return owed;
}

bool Connection::RouteShared(const CommandContext& c, const Verdict& v) {
  if ((!pinned_ && c.id == client_id_ && AnswerClientName(c, v.args)) || (cluster_ && !RouteCluster(c, v))) {
    pipeline_.Release();
    return false;
  }
  return true;
}

bool Connection::AnswerClientName(const CommandContext& c, std::span<const std::string_view> args) {
  // A shared connection has no name of the client's: keyguard keeps it (findings and log lines
  // carry it) and answers as the server would. A connection pinned later does not carry it (its
  // CLIENT LIST shows none).
  const bool get = args.size() == 2 && commands::EqualsIgnoreCase(args[1], "getname");
  const bool set = args.size() == 3 && commands::EqualsIgnoreCase(args[1], "setname");
  if (!get && !set) return false;  // SETINFO, or a wrong arity: the server answers
  std::string reply;
  if (get) {
    if (const std::string& name = state_.client_name(); name.empty()) {
      if (ReplyProtocol() == 3) {
        reply = "_\r\n";
      } else {
        resp::AppendNullBulk(&reply);
      }
    } else {
      resp::AppendBulk(&reply, name);
    }
  } else if (std::any_of(args[2].begin(), args[2].end(), [](char ch) {
               return static_cast<unsigned char>(ch) < '!' || static_cast<unsigned char>(ch) > '~';
             })) {
    // The server's rule and words (CLIENT LIST is split at spaces).
    reply = "-ERR Client names cannot contain spaces, newlines or special characters.\r\n";
  } else {
    state_.set_client_name(args[2]);
    reply = "+OK\r\n";
  }
  const metrics::Outcome outcome = reply[0] == '-' ? metrics::Outcome::kError : metrics::Outcome::kOk;
  Answer(c, std::move(reply), outcome);
  return true;
}

void Connection::QuitLocally(const CommandContext& c) { Answer(c, "+OK\r\n", metrics::Outcome::kOk, true); }

void Connection::HandleCommand(commands::CommandId id, std::span<const std::string_view> args, const char* raw,
                               size_t raw_len, int64_t now) {
  CommandContext c;
  c.id = id;
  c.args = args;
  // Whether this command's reply is suppressed by CLIENT REPLY OFF/SKIP or a replication stream.
  c.mode = state_.TakeReplyMode();
  c.tenant = tenant_;
  c.state = &state_;
  c.queue = &queue_;
  c.upstream_ready = upstream_ready_;
  c.own_upstream = !multiplexed_ || pinned_;
  c.client = client_address_;
  if (tenant_commands_ != nullptr) {
    tenant_commands_->Add();
    tenant_received_->Add(raw_len);
  }
  const Verdict& v = pipeline_.Run(c);
  switch (v.action) {
    case Verdict::Action::kForward:
      // (RouteShared releases the pipeline when it answers: one Release call site here keeps
      // the dedicated path's inlining.)
      if (multiplexed_) [[unlikely]] {
        pin_undo_ = kPinSettled;
        if ((cluster_ || c.id == client_id_) && !RouteShared(c, v)) return;
      }
      break;
    case Verdict::Action::kRefuse: Refuse(c, v.reason, v.message); return;
    case Verdict::Action::kLogin:
      pin_undo_ = kPinSettled;
      Login(c, v, now);
      return;
    case Verdict::Action::kUnavailable:
      pin_undo_ = kPinSettled;
      shard_.CountCommand(c.id, metrics::Outcome::kFailed);
      // A shared connection comes back by itself: the client stays for its next command.
      Reply(UpstreamUnavailable(), c.id, /*close_after=*/!multiplexed_);
      if (!multiplexed_) stop_reading_ = true;
      return;
    case Verdict::Action::kWalk:
      pin_undo_ = kPinSettled;
      pipeline_.Release();
      if (cluster_ && pinned_ && shared_.cluster_map != nullptr && *shared_.cluster_map != nullptr &&
          (*shared_.cluster_map)->primaries.size() > 1) {
        // A pinned connection reaches one node: the walk would count, or flush, that node's keys only.
        Refuse(c, Refusal::kCluster,
               "ERR keyguard: a tenant's DBSIZE, FLUSHDB, FLUSHALL and RANDOMKEY are not served on a connection "
               "pinned to one cluster node (in a transaction, after HELLO, SUBSCRIBE, ...)");
        return;
      }
      StartWalk(v.walk, c.id, now);
      return;
  }
  std::string_view bytes(raw, raw_len);
  splice_.clear();
  // Nothing but multibulk goes upstream: an inline command is re-encoded too (on a shared
  // connection the server would frame its line among other clients' commands, by rules of its own).
  if ((v.modified || raw[0] != '*') && !Splice(raw, raw_len, args, v.args, &bytes)) {
    // The command goes upstream re-encoded; everything but the rewritten arguments is unchanged.
    bytes = Encode(v.args);
  }
  if (!v.prelude.empty() || !v.renamed.empty()) [[unlikely]] {
    ForwardExtras(v, c.mode);
  }
  // The entry is filled in its queue slot and committed once it is known to expect a reply.
  Pending& p = queue_.Stage();
  p.rewrite = v.rewrite;
  p.command = c.id;
  p.start_ns = now;
  p.reply_check = v.reply_check;
  pipeline_.Release();
  p.hot = shared_.stages.config.hygiene.enabled && shared_.hot.Sample() &&
          hygiene::HotKeyRequest(shared_.hot, c.id, args, TenantName(), raw_len, &p.request_bytes);
  if (p.reply_check != 0 || p.hot) queue_.AttachKey(&p, args[1]);
  const ConnectionState::Effects e = state_.OnForward(c.id, args, c.mode, tenant_ != nullptr, &p);
  if (e.stop_reading) [[unlikely]] {
    stop_reading_ = true;
    if (multiplexed_ && !pinned_) {
      QuitLocally(c);
      return;
    }
  }
  if (e.ping_first) ForwardCommand(kPing);
  if (e.logout && shared_.stages.config.tenancy != nullptr && shared_.stages.config.tenancy->requires_auth()) {
    // keyguard's own upstream credentials are sent again right after the RESET (below).
    BindTenant(certificate_tenant_);
  }
  if (e.send_discard) {
    bytes = kDiscard;
    splice_.clear();
  }
  if (cluster_) [[unlikely]] {
    if ((defer_multi_ || multi_deferred_) && !pinned_) [[unlikely]] {
      if (hold_next_) {
        HoldInTransaction(c, bytes, p, e.silent, !v.renamed.empty());
        return;
      }
      if (AnswerDeferredMulti(c, p.kind == Kind::kExecAbort)) return;
    }
    ForwardRouted(bytes);
  } else if (!splice_.empty()) {
    for (std::string_view b : splice_) ForwardRaw(b);
    ++out_.commands;
  } else {
    ForwardCommand(bytes);
  }
  if (e.silent) {
    if (!v.renamed.empty()) queue_.UnstageRenames();
    shard_.CountCommand(c.id, metrics::Outcome::kNoReply);
    return;
  }
  const bool reset = p.kind == Kind::kReset;
  p.renamed = !v.renamed.empty();
  queue_.Commit();
  if (reset) SendUpstreamAuth();
}

bool Connection::HoldsInTransaction(commands::CommandId id, std::span<const std::string_view> args, size_t raw_len,
                                    const char* rest, size_t rest_len) {
  // A keyless command first in a transaction, with no keyed command nor EXEC after it in what was read:
  // its node is not known yet (a client that waits for each +QUEUED sends the keyed one later).
  // keyguard answers +QUEUED and keeps it, to send on the pin of the first keyed command, or of
  // EXEC, right after the MULTI (OnInternalReply). Only a command the server queues as it is:
  // known, of a valid arity, one the server queues (QueuedAsIs: else its error, `unknown
  // subcommand`, a wrong count, no_multi, is the client's to see as it queues), not one that
  // pins for a reason of its own; and a bounded number and size (past them, the pin goes where
  // the look-ahead finds, as for a pipelined transaction; the size is the client's, and a
  // tenant's rewrite of the last one held may add its prefix past it).
  // Not while the cluster is unavailable: the command's error would not fail the transaction (it
  // pins, and fails, as before).
  const commands::KnownCommands& k = commands::Known();
  if (id == commands::kUnknownCommand || pin_classes_[id] != 0 || id == k.exec || id == k.discard || id == k.multi ||
      id == k.quit || !upstream_ready_ || !ArityOk(id, args.size()) || held_in_multi_.size() >= kMaxHeldInMulti ||
      held_in_multi_bytes_ + raw_len > kMaxHeldInMultiBytes || !QueuedAsIs(id, args)) {
    return false;
  }
  if (tenant_ != nullptr) {
    // A tenant's DBSIZE, FLUSH* and RANDOMKEY walk the keyspace: not queued as they are (on a pin,
    // as before).
    using commands::TenantHandling;
    const TenantHandling t = commands::TraitsOf(id).tenant;
    if (t == TenantHandling::kFlush || t == TenantHandling::kDbsize || t == TenantHandling::kRandomkey) return false;
  }
  // (The whole transaction read, keyless: it goes to the first primary as it is.)
  bool ends = false;
  if (StoredSlotOf(id, args) != kAnyNode || LookAheadSlot(rest, rest_len, &ends) != kAnyNode || ends) return false;
  hold_next_ = true;
  return true;
}

void Connection::HoldInTransaction(const CommandContext& c, std::string_view bytes, const Pending& staged, bool silent,
                                   bool renamed) {
  // The state has taken it as queued (OnForward); its reply is keyguard's +QUEUED, and the
  // server's, once it is sent, is read and not shown (counted then, with the server's outcome).
  // (Renamed names in a queued command's reply: its reply is +QUEUED, nothing to rename.)
  if (renamed) queue_.UnstageRenames();
  // What goes upstream: the rewritten command, spliced into the client's bytes (a tenant's
  // prefix) when it was, else `bytes`.
  std::string held;
  if (splice_.empty()) {
    held.assign(bytes);
  } else {
    for (std::string_view piece : splice_) held.append(piece);
  }
  held_in_multi_bytes_ += held.size();
  held_in_multi_.push_back(HeldCommand{c.id, staged.expect, std::move(held)});
  // (Not Answer: it is counted once sent, with the server's outcome; and unpinned, no skip is owed.)
  if (!silent) Reply("+QUEUED\r\n", c.id, false);
}

void Connection::SendHeldInTransaction(int64_t now) {
  for (HeldCommand& h : held_in_multi_) {
    ForwardCommand(held_.emplace_back(std::move(h.bytes)));  // (a view until the batch is written)
    Pending p;
    p.command = h.id;
    p.hidden = true;
    p.expect = h.expect;
    p.start_ns = now;  // (its latency: the server's queuing, not the client's pause before the keyed command)
    queue_.Push(std::move(p));
  }
  held_in_multi_.clear();
  held_in_multi_bytes_ = 0;
}

void Connection::DropHeldInTransaction(metrics::Outcome outcome) {
  // Counted as if sent: DISCARD's (the server's +QUEUED would have come), or failed.
  for (const HeldCommand& h : held_in_multi_) shard_.CountCommand(h.id, outcome);
  held_in_multi_.clear();
  held_in_multi_bytes_ = 0;
}

bool Connection::AnswerDeferredMulti(const CommandContext& c, bool aborted) {
  // The state has taken the command (OnForward); the entry staged for it is not committed, as no
  // reply of the server's is the client's. MULTI: the server gets it right before the command
  // that pins the client (OnPinned), whose node this one cannot know yet. EXEC or DISCARD of the
  // transaction no command joined: its answer, and nothing was sent (EXEC of one whose only
  // commands keyguard refused, `aborted`: EXECABORT, as the server answers).
  const commands::KnownCommands& k = commands::Known();
  const commands::CommandId id = c.id;
  const bool multi = defer_multi_ && id == k.multi;
  defer_multi_ = false;  // (set for this command, or for a MULTI keyguard refused)
  std::string_view reply;
  if (multi) {
    multi_deferred_ = true;
    reply = "+OK\r\n";
  } else if (multi_deferred_ && (id == k.exec || id == k.discard) && c.args.size() == 1) {
    multi_deferred_ = false;
    DropHeldInTransaction(metrics::Outcome::kOk);  // (DISCARD: an EXEC of held commands is pinned)
    reply = id == k.discard ? std::string_view("+OK\r\n") : aborted ? kExecAbort : std::string_view("*0\r\n");
  } else {
    return false;
  }
  Answer(c, std::string(reply),
         c.mode.silent         ? metrics::Outcome::kNoReply
         : reply == kExecAbort ? metrics::Outcome::kError
                               : metrics::Outcome::kOk);
  return true;
}

void Connection::ForwardExtras(const Verdict& v, ConnectionState::ReplyMode mode) {
  // A reply that names renamed keys: the names are kept (queued for the entry pushed next) before
  // the pipeline releases them.
  if (!v.renamed.empty()) {
    queue_.StageRenames(v.renamed_shape, v.renamed);
    if (v.renamed_shape == static_cast<uint8_t>(tenant::ReplyRewrite::kChannelArray)) KeepRenamedChannels(v.renamed);
    if (v.renamed_shape == kRenamedPatterns) KeepRenamedPatterns(v.renamed);
  }
  if (v.prelude.empty()) return;
  // keyguard's own command goes first, encoded while the views it takes are valid.
  const std::string_view prelude = Encode(v.prelude);
  ForwardCommand(prelude);
  if (cluster_) EndRoute(prelude.size());  // (its keys' slot is the command's, by the route taken)
  if (mode.silent) {
    // No reply comes for it: under CLIENT REPLY OFF none does; under SKIP it took the skip, and
    // the client's command, which comes next, must not answer either.
    if (mode.skipped) ForwardCommand(kClientReplySkip);
    return;
  }
  Pending p;
  p.command = commands::Known().eval;
  state_.OnOwn(tenant_ != nullptr, &p);
  queue_.Push(std::move(p));
}

void Connection::BindTenant(const tenant::Tenant* t) {
  tenant_ = t;
  tenant_rejected_.fill(nullptr);
  if (upstream_client_id_ != 0) shared_.stages.connections->Set(upstream_client_id_, t);
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
  tenant_commands_ = &shard_.tenant_commands.Get({t->name});
  tenant_received_ = &shard_.tenant_received_bytes.Get({t->name});
  tenant_sent_ = &shard_.tenant_sent_bytes.Get({t->name});
}

void Connection::SendUpstreamAuth() {
  if (!upstream_ready_) return;
  const std::string_view auth = host_.UpstreamAuth();
  if (auth.empty()) return;
  // Copied into the batch's arena: the next call (a second RESET in the batch) may free it.
  char* copy = scratch_.Reserve(auth.size());
  std::memcpy(copy, auth.data(), auth.size());
  scratch_.Commit(auth.size());
  SendInternal(std::string_view(copy, auth.size()), commands::Known().auth);
}

void Connection::SendInternal(std::string_view command, commands::CommandId id) {
  ForwardCommand(command);
  Pending p;
  p.kind = Kind::kInternal;
  p.command = id;
  queue_.Push(std::move(p));
}

void Connection::Login(const CommandContext& c, const Verdict& v, int64_t now) {
  if (v.bind) BindTenant(v.login);
  if (c.id != commands::Known().hello) {
    Answer(c, "+OK\r\n", metrics::Outcome::kOk);
    return;
  }
  // HELLO goes upstream without its AUTH (keyguard's credentials are the connection's).
  ForwardCommand(Encode(v.args));
  if (c.mode.silent) {
    shard_.CountCommand(c.id, metrics::Outcome::kNoReply);
    return;
  }
  Pending p;
  p.kind = Kind::kHello;
  p.command = c.id;
  p.start_ns = now;
  p.hello_version = HelloVersion(c.args);
  queue_.Push(std::move(p));
}

void Connection::Answer(const CommandContext& c, std::string reply, metrics::Outcome outcome, bool close_after) {
  shard_.CountCommand(c.id, outcome);
  // (A shared connection never has a reply mode: CLIENT REPLY pins.)
  if (c.mode.skipped && (!multiplexed_ || pinned_)) ForwardCommand(kPing);
  if (!c.mode.silent) Reply(std::move(reply), c.id, close_after);
}

void Connection::Refuse(const CommandContext& c, Refusal reason, std::string_view message) {
  const size_t r = static_cast<size_t>(reason);
  shared_.stages.rejected[r]->Add();
  if (tenant_ != nullptr) {
    // Resolved once per tenant binding and reason.
    metrics::Counter*& counter = tenant_rejected_[r];
    if (counter == nullptr) counter = &shard_.tenant_rejected.Get({tenant_->name, RefusalName(reason)});
    counter->Add();
  }
  state_.OnRefused();  // Redis fails EXEC after a refused queued command
  std::string text;
  if (!c.mode.silent) resp::AppendError(&text, message);
  Answer(c, std::move(text), metrics::Outcome::kRejected);
  if (c.mode.silent) return;
  if (pin_undo_ != kPinSettled) [[unlikely]]
    EndRefusedPin();
}

void Connection::EndRefusedPin() {
  const uint8_t undo = std::exchange(pin_undo_, kPinSettled);
  if (!pinned_) return;
  // Nothing the refused command would have started exists on the server.
  sticky_ = false;
  pin_check_ = true;
  if (undo == kPinFresh) {
    // The connection is in the state it was pinned in: it goes back to the pool once the PING's
    // reply empties the queue (a pin ends on a reply).
    SendInternal(kPing, PingId());
  }
}

void Connection::Sink::Stamp(hygiene::Finding* f, std::string_view key, commands::CommandId id) {
  const StageShared& stages = connection.shared_.stages;
  const hygiene::Settings& settings = stages.config.hygiene;
  f->action = settings.action(f->kind);
  f->key = hygiene::ShownKey(key, settings.finding_keys);
  f->key_pattern = stages.shard->PatternLabel(policy::KeyPattern(key), stages.live->key_policy->max_key_patterns());
  f->command = CommandNameOf(id);
  f->client = connection.client_address_;
  f->client_name = connection.state_.client_name();
  if (connection.tenant_ != nullptr) f->tenant = connection.tenant_->name;
}

void Connection::Reply(std::string text, commands::CommandId id, bool close_after) {
  if (queue_.QueueLocal(text, id, close_after)) return;
  // Nothing is pending before it: it goes out with this call's output (counted as a reply
  // delivered in a batch is).
  if (tenant_sent_ != nullptr) tenant_sent_->Add(text.size());
  AppendOut(held_.emplace_back(std::move(text)));
}

// ---------------------------------------------------------------------------------------------
// Tenancy: key walks

void Connection::StartWalk(tenant::Walk walk, commands::CommandId id, int64_t now) {
  // With a cluster, every primary in turn: those of the map as the walk starts, by address (a new
  // map may order them otherwise).
  walk_nodes_.clear();
  if (cluster_ && shared_.cluster_map != nullptr && *shared_.cluster_map != nullptr) {
    walk_nodes_ = (*shared_.cluster_map)->primaries;
  }
  walk_.Start(walk, static_cast<uint32_t>(std::max<size_t>(1, walk_nodes_.size())));
  Pending p;
  p.kind = Kind::kWalk;
  p.command = id;
  p.start_ns = now;
  p.expect = Pending::Expect::kNotQueued;
  queue_.Push(std::move(p));
  holding_ = true;
  // The first step takes a token like every other: a pipeline of walks of one step each stays
  // within the tenant's rate.
  if (WaitForWalkToken(now)) return;  // the timer sends it, after this batch
  ForwardWalkStep();                  // with this batch
}

void Connection::ForwardWalkStep() {
  const std::string& step = walk_.NextRequest(*tenant_, shared_.stages.config.tenancy->walk_step_keys);
  if (!cluster_) [[likely]] {
    ForwardCommand(step);
    return;
  }
  // To the walk's node, by a slot it owns now. A node no longer a primary with slots (removed,
  // failed over, emptied by a reshard) cannot be walked on: the walk fails, rather than answer for
  // part of the keys or scan another node with its cursor.
  route_ = Route{};
  int32_t slot = -1;
  if (shared_.cluster_map != nullptr && *shared_.cluster_map != nullptr && walk_.node() < walk_nodes_.size()) {
    const cluster::SlotMap& m = **shared_.cluster_map;
    const auto node = std::find(m.primaries.begin(), m.primaries.end(), walk_nodes_[walk_.node()]);
    if (node != m.primaries.end()) {
      const auto owned = std::find(m.owner.begin(), m.owner.end(), static_cast<uint16_t>(node - m.primaries.begin()));
      if (owned != m.owner.end()) slot = static_cast<int32_t>(owned - m.owner.begin());
    }
  }
  std::string_view bytes = step;
  if (slot < 0) {
    bytes = kWalkNodeGone;  // any node answers it with the error
  } else {
    route_.slot = slot;
  }
  ForwardCommand(bytes);
  EndRoute(bytes.size());
  route_ = Route{};
}

bool Connection::WaitForWalkToken(int64_t now) {
  // The tenant's steps on this worker share a budget: a walk over many keys takes its time
  // rather than the server's.
  const int64_t wait = shared_.walk_budget[tenant_].Take(shared_.stages.config.tenancy->walk_steps_per_second, now);
  if (wait == 0) return false;
  walk_wait_ns_ = wait;
  return true;
}

void Connection::OnWalkTimer(int64_t now) {
  BeginCall();
  // The walk's entry need not be at the head yet (a first step waits behind earlier commands).
  if (upstream_ready_ && walk_.active()) SendWalkStep(now);
}

void Connection::SendWalkStep(int64_t now) {
  if (WaitForWalkToken(now)) return;
  ForwardWalkStep();
}

void Connection::ContinueWalk(char type, std::span<const resp::ReplyFramer::Scalar> head, int64_t now) {
  const std::string_view prefix =
      reply_tenant_ != nullptr ? std::string_view(reply_tenant_->prefix) : std::string_view();
  tenant::KeyWalk::Step step = walk_.OnReply(type, head, prefix, state_.protocol());
  if (step.done) {
    FinishWalk(std::move(step.reply), step.error, now);
  } else if (walk_.walk() != tenant::Walk::kFlush && host_.ClientGone()) {
    // DBSIZE/RANDOMKEY for a client that hung up and sent nothing after it: the answer has
    // nobody to go to (while a walk runs the client's socket is not read, so its close is
    // otherwise noticed only when the walk ends: a tenant could leave walks running).
    FinishWalk("-ERR keyguard: the client closed the connection\r\n", true, now);
  } else {
    SendWalkStep(now);
  }
}

void Connection::FinishWalk(std::string reply, bool error, int64_t now) {
  const Pending& p = queue_.front();
  AppendOut(held_.emplace_back(std::move(reply)));
  shard_.CountCommand(p.command, error ? metrics::Outcome::kError : metrics::Outcome::kOk);
  shard_.ObserveLatency(p.command, static_cast<uint64_t>(now - p.start_ns));
  queue_.Pop();
  walk_.Finish();
  holding_ = false;
  resume_ = true;  // the commands read meanwhile are next
  DeliverLocalsAtHead();
}

// ---------------------------------------------------------------------------------------------
// Upstream -> client

void Connection::AppendOut(std::string_view bytes) { AppendPiece(&out_.client, bytes); }

void Connection::DeliverPush(std::string_view frame) {
  std::string out;
  if (shared_.stages.config.tenancy != nullptr) {
    if (reply_tenant_ == nullptr) return;  // logged out: nobody it may be shown to
    switch (tenant::RewritePush(*shared_.stages.config.tenancy, *reply_tenant_, frame, &out)) {
      case tenant::ReplyAction::kPass: break;
      case tenant::ReplyAction::kReplace: frame = held_.emplace_back(std::move(out)); break;
      case tenant::ReplyAction::kDrop: return;
    }
  }
  // A tracking invalidation names the old names of renamed keys too (reversible rewrite rules).
  if (InvalidateOldNames(*shared_.stages.live->key_policy, frame, &out) == tenant::ReplyAction::kReplace) {
    frame = held_.emplace_back(std::move(out));
  }
  if (!channels_renamed_.empty() && RenameChannels(frame, &out)) [[unlikely]] {
    frame = held_.emplace_back(std::move(out));
  }
  if (!pipeline_.patterns_renamed().empty()) [[unlikely]] {
    switch (RenamePatterns(*shared_.stages.live->key_policy, &pipeline_.patterns_renamed(), frame, &out)) {
      case tenant::ReplyAction::kPass: break;
      case tenant::ReplyAction::kReplace: frame = held_.emplace_back(std::move(out)); break;
      case tenant::ReplyAction::kDrop: return;
    }
  }
  AppendOut(frame);
}

void Connection::KeepRenamedPatterns(std::span<const std::pair<std::string_view, std::string_view>> pairs) {
  // A PSUBSCRIBE never confirmed (discarded in MULTI, refused by the server's ACL) leaves its
  // pair; the pipeline maps no more patterns once kMaxRenamedSubscriptions are kept.
  auto& kept = pipeline_.patterns_renamed();
  for (const auto& [to, from] : pairs) {
    const bool known = std::any_of(kept.begin(), kept.end(), [&](const auto& p) { return p.first == to; });
    if (!known) kept.emplace_back(to, from);
  }
}

void Connection::KeepRenamedChannels(std::span<const std::pair<std::string_view, std::string_view>> pairs) {
  // A SUBSCRIBE that is never confirmed (discarded in MULTI, refused by the server's ACL) leaves
  // its pair: at most kMaxRenamedSubscriptions are kept, and beyond them messages name the new channel.
  for (const auto& [to, from] : pairs) {
    if (channels_renamed_.size() >= kMaxRenamedSubscriptions) break;
    const bool known = std::any_of(channels_renamed_.begin(), channels_renamed_.end(),
                                   [&](const auto& p) { return p.first == to && p.second == from; });
    if (!known) channels_renamed_.emplace_back(to, from);
  }
}

bool Connection::RenameChannels(std::string_view frame, std::string* out) {
  std::optional<resp::Value> v = resp::ParseValue(frame);
  if (!v || (v->type != '*' && v->type != '>') || v->elements.size() < 2) return false;
  auto& e = v->elements;
  if (!IsWord(e[0], "unsubscribe") && !IsWord(e[0], "message") && !IsWord(e[0], "subscribe")) return false;
  if (e[1].null) return false;
  auto it = std::find_if(channels_renamed_.begin(), channels_renamed_.end(),
                         [&](const auto& p) { return p.first == e[1].text; });
  if (it == channels_renamed_.end()) return false;
  std::string client_name = it->second;
  e[1].text = client_name;
  out->clear();
  resp::AppendValue(out, *v);
  return true;
}

size_t Connection::OnUpstreamBytes(const char* data, size_t len, int64_t now, size_t* hint, bool* ok_out) {
  BeginCall();
  *hint = 0;
  size_t pos = 0;
  bool ok = true;
  for (;;) {
    if (state_.replication_stream()) {  // one predictable branch per frame on every other connection
      if (!state_.tunnel() && !queue_.empty() && queue_.front().kind == Kind::kReplicationStream) {
        shard_.CountCommand(queue_.front().command, metrics::Outcome::kOk);
        queue_.Pop();
        state_.StartTunnel();
      }
      if (state_.tunnel()) {
        AppendOut(std::string_view(data + pos, len - pos));
        pos = len;
        break;
      }
    }
    const resp::Status st = reply_framer_.Next(data + pos, len - pos);
    if (st == resp::Status::kNeedMore) {
      *hint = reply_framer_.hint();
      break;
    }
    if (st == resp::Status::kProtocolError) {
      ok = false;
      break;
    }
    const size_t n = reply_framer_.consumed();
    const std::string_view frame(data + pos, n);
    pos += n;
    if (!OnFrame(frame, reply_framer_, now)) {
      ok = false;
      break;
    }
  }
  EndUpstream();
  *ok_out = ok;
  return pos;
}

void Connection::BeginUpstream() { BeginCall(); }

bool Connection::OnSharedFrame(std::string_view frame, const resp::ReplyFramer& f, int64_t now) {
  return OnFrame(frame, f, now);
}

bool Connection::OnSharedPush(std::string_view frame, const resp::ReplyFramer& f, int64_t now) {
  // DEBUG PROTOCOL push's is the client's; any other (a CLIENT TRACKING REDIRECT someone aimed
  // at the shared connection) is nobody's.
  if (queue_.empty() || queue_.front().command != commands::Known().debug) return true;
  return OnFrame(frame, f, now);
}

void Connection::EndUpstream() {
  DeliverLocalsAtHead();
  CountSent();
}

bool Connection::OnInternalReply(const Pending& front, char type, std::string_view kind, int64_t now) {
  if (front.command == commands::Known().client) {
    // keyguard's own CLIENT ID. Should the server refuse it (an ACL on keyguard's user), no
    // connection can name this one in a REDIRECT.
    int64_t client_id = 0;
    if (type == ':' && resp::ParseRedisInt(kind, &client_id) && client_id != 0 && upstream_ready_) {
      upstream_client_id_ = client_id;
      if (tenant_ != nullptr) shared_.stages.connections->Set(client_id, tenant_);
    }
  } else if (front.command == commands::Known().eval) {
    // The move of legacy keys (a prelude): the number it moved, or +QUEUED in a transaction.
    int64_t moved = 0;
    if (type == ':' && resp::ParseRedisInt(kind, &moved)) {
      shard_.legacy_keys_moved.Add(static_cast<uint64_t>(moved));
      shared_.stages.moves_refused = false;
    } else if ((type == '-' || type == '!') && !kind.starts_with("NOAUTH")) {
      // (NOAUTH: the client's own command gets the same answer; nothing about the move.)
      shard_.legacy_move_errors.Add();
      // Only a refusal of EVAL itself lasts (keyguard's user may not run it); BUSY, LOADING,
      // READONLY or OOM pass, and the next move tries again.
      if (kind.starts_with("NOPERM")) shared_.stages.moves_refused = true;
      if (!move_error_logged_) {  // once per connection: the metric counts the rest
        move_error_logged_ = true;
        EventLine("error", "legacy_move_failed").Str("error", kind).Write(stderr);
      }
    }
  } else if (front.command == commands::Known().multi) {
    // The MULTI keyguard answered (AnswerDeferredMulti): the client's commands wait for it; the
    // keyless ones it answered +QUEUED for (HoldInTransaction) go first.
    holding_ = false;
    resume_ = true;
    if (type != '-' && type != '!') {
      queue_.Pop();
      SendHeldInTransaction(now);
      DeliverLocalsAtHead();
      return true;
    } else {
      DropHeldInTransaction(metrics::Outcome::kFailed);
      // Nothing of the transaction was sent; the client, told +OK, is told why it ends.
      EventLine("error", "upstream_multi_failed").Str("error", kind).Write(stderr);
      queue_.Pop();
      AppendOut(held_.emplace_back(absl::StrCat("-ERR keyguard: the upstream refused the transaction's MULTI (",
                                                absl::string_view(kind.data(), kind.size()),
                                                "); the connection is closed\r\n")));
      stop_reading_ = true;
      upstream_failure_ = "upstream refused MULTI";
      upstream_refused_ = true;  // (not a protocol error: counted as refused)
      return false;
    }
  } else if (front.command == commands::Known().hello) {
    // keyguard's HELLO 3 on a connection pinned for a RESP3 client (OnPinned): refused, the
    // connection cannot answer the client in its protocol.
    if (type == '-' || type == '!') {
      EventLine("error", "upstream_hello_failed").Str("error", kind).Write(stderr);
      upstream_failure_ = absl::StrCat("upstream refused HELLO 3: ", absl::string_view(kind.data(), kind.size()));
      upstream_refused_ = true;
      return false;
    }
  } else if (front.command == PingId()) {
    // The PING after a refused pin (EndRefusedPin): any answer ends it; an error (LOADING,
    // MASTERDOWN) is not keyguard's AUTH being refused.
  } else if (type == '-' || type == '!') {
    // keyguard's own upstream AUTH: an error means the upstream refuses keyguard's credentials.
    // The clients' commands get the server's answer (a rotated secret keyguard does not have yet).
    EventLine("error", "upstream_auth_failed").Str("error", kind).Write(stderr);
    upstream_failure_ = absl::StrCat("upstream refused keyguard's AUTH: ", absl::string_view(kind.data(), kind.size()));
    upstream_auth_failed_ = true;
    return false;
  }
  queue_.Pop();
  DeliverLocalsAtHead();
  return true;
}

bool Connection::OnFrame(std::string_view frame, const resp::ReplyFramer& f, int64_t now) {
  const char type = f.type();
  const auto head = f.head();
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
      return true;
    case FrameRole::kPush:
      if (type == '>' && head.size() >= 2) state_.TrackConfirmation(kind, head[1].text);
      if (type == '+') {
        AppendOut(frame);  // a MONITOR line
      } else {
        DeliverPush(frame);
      }
      return true;
    case FrameRole::kUnexpected:
      if (multiplexed_ && !pinned_) [[unlikely]] {
        // A shared connection's frame for this client, which has no command waiting: the link's
        // count of its commands is not the client's, so the frames after it are not the clients'
        // they would go to. Passed to no one: the link fails (SharedLink::Desync).
        link_desync_ = true;
        return true;
      }
      // A reply nobody waits for; pass it on rather than drop it (a tenant never sees one: it
      // could name anything), and count it.
      shard_.unexpected_replies.Add();
      if (shared_.stages.config.tenancy == nullptr) AppendOut(frame);
      return true;
    case FrameRole::kInternal: return OnInternalReply(*front, type, kind, now);
    case FrameRole::kDesync:
      // The server's transaction state is not the one the reply filter follows (a command the
      // server refused as keyguard did not foresee): no reply may pass unfiltered, so none passes.
      EventLine("error", "transaction_state_differs").Str("command", commands::Spec(front->command).name).Write(stderr);
      shard_.unexpected_replies.Add();
      desynced_ = true;
      return false;
    case FrameRole::kWalkStep: ContinueWalk(type, head, now); return true;
    case FrameRole::kReply: break;
  }
  if (front->hidden) {
    // The client asked not to see it.
  } else if (front->kind == Kind::kExecAbort) {
    AppendOut(kExecAbort);
  } else if (front->rewrite == 0 && !front->renamed && (reply_tenant_ == nullptr || (type != '-' && type != '!'))) {
    AppendOut(frame);
  } else {
    AppendOut(RewrittenReply(*front, type, frame));
  }
  if (front->kind == Kind::kSubscribe) {
    // Not a confirmation (an error such as NOAUTH): the command is over.
    front->expected = 0;
  }
  CompleteHead(type, f.size(), head.empty() ? std::string_view() : head[0].text, frame.size(), now);
  return true;
}

std::string_view Connection::RewrittenReply(const Pending& p, char type, std::string_view frame) {
  std::string_view reply = frame;
  std::string out;
  auto replace = [&](tenant::ReplyAction action) {
    // kDrop never comes for a command's reply.
    if (action != tenant::ReplyAction::kPass) reply = held_.emplace_back(std::move(out));
  };
  constexpr auto kOwn = static_cast<uint8_t>(tenant::ReplyRewrite::kOwn);
  if (static_cast<tenant::ReplyRewrite>(p.rewrite) == tenant::ReplyRewrite::kExec &&
      std::find(p.exec_rewrites.begin(), p.exec_rewrites.end(), kOwn) != p.exec_rewrites.end()) {
    // The legacy-key moves keyguard queued in the transaction: counted as outside one.
    const tenant::OwnResults own = tenant::OwnElementResults(p.exec_rewrites, frame);
    if (own.moved > 0) shard_.legacy_keys_moved.Add(static_cast<uint64_t>(own.moved));
    if (own.errors > 0) shard_.legacy_move_errors.Add(static_cast<uint64_t>(own.errors));
  }
  if (reply_tenant_ != nullptr && (p.rewrite != 0 || type == '-' || type == '!')) {
    replace(tenant::RewriteReply(*shared_.stages.config.tenancy, *reply_tenant_,
                                 static_cast<tenant::ReplyRewrite>(p.rewrite), p.exec_rewrites, frame, &out));
  } else if (reply_tenant_ == nullptr && p.rewrite != 0) {
    // EXEC of a transaction keyguard queued its own command in: that element goes.
    replace(tenant::DropOwnElements(p.exec_rewrites, frame, &out));
  }
  if (p.renamed) {
    const Renames& r = queue_.HeadRenames();
    const auto shape = static_cast<tenant::ReplyRewrite>(r.shape);
    if (shape == tenant::ReplyRewrite::kKeyArray || shape == tenant::ReplyRewrite::kScan) {
      // KEYS or SCAN of a pattern that may name old names (CommandPipeline::OldNamePatterns).
      if (type != '-' && type != '!') {
        replace(OldNamesMatching(*shared_.stages.live->key_policy, r.shape, r.names.front().first, reply, &out));
      }
    } else {
      replace(tenant::RenameKeys(shape, r.names, reply, &out));
    }
  }
  return reply;
}

void Connection::CompleteHead(char reply_type, int64_t size, std::string_view bulk, size_t frame_len, int64_t now) {
  Pending& p = queue_.front();
  const bool error = reply_type == '-' || reply_type == '!';
  // The detectors' and hot keys' hooks: only a command whose request asked for its reply kept its key.
  if (p.keyed) {
    const std::string_view key = queue_.KeyOf(p);
    if (p.reply_check != 0 && !error) {
      detectors_.OnReply(p.command, p.reply_check, key, reply_type, size, bulk, reply_scope_);
    }
    if (p.hot) {
      hygiene::HotKeyReply(shared_.hot, p.command, TenantName(), key, p.request_bytes, reply_type, size, bulk,
                           frame_len);
    }
  }
  // A write refused by a replica: the primary may have moved (the transport asks Sentinel again).
  if (error && bulk.starts_with("READONLY")) readonly_seen_ = true;
  if (error || MayClose(p.command)) [[unlikely]]
    close_may_follow_ = true;
  // A cluster's redirection on a pinned connection (the client sees it): keyguard's map is wrong.
  // A script's error may read as one (redis.error_reply("MOVED ...")): no node's word on the map,
  // it only has the map asked for again.
  if (error && cluster_ && (bulk.starts_with("MOVED ") || bulk.starts_with("ASK "))) [[unlikely]] {
    redirect_seen_.assign(bulk.data(), bulk.size());
    // (An unknown command's too: a module's may answer any text.)
    redirect_scripted_ = p.command == commands::kUnknownCommand || Scripted(p.command);
  }
  if (frame_len > 0 && p.kind != Kind::kExecAbort) {
    const bool aggregate = reply_type == '*' || reply_type == '%' || reply_type == '~';
    shard_.ObserveReply(p.command, frame_len, aggregate ? size : -1);
  }
  if (state_.OnReply(p, error)) {
    reply_tenant_ = tenant_;  // RESET: nullptr, unless the client authenticated again
    reply_scope_ = DetectorScope(reply_tenant_);
  }
  const bool exec_abort = p.kind == Kind::kExecAbort;
  shard_.CountCommand(p.command, (error || exec_abort) ? metrics::Outcome::kError : metrics::Outcome::kOk);
  shard_.ObserveLatency(p.command, static_cast<uint64_t>(now - p.start_ns));
  queue_.Pop();
  DeliverLocalsAtHead();
}

void Connection::DeliverLocals() {
  while (queue_.LocalAtHead()) AppendOut(held_.emplace_back(queue_.TakeLocal()));
}

Connection::AfterFailure Connection::OnUpstreamFailed(metrics::UpstreamError reason, std::string* owed) {
  if (!upstream_ready_) return AfterFailure::kNone;
  if (desynced_) {
    AbortPending(kDesynced, owed);
    return AfterFailure::kClose;
  }
  if (!(state_.quit_sent() && reason == metrics::UpstreamError::kClosed)) shard_.CountUpstreamError(reason);
  if (holding_ && !walk_.active()) {
    // A MULTI keyguard answered was on its way (OnPinned): the client's transaction cannot start.
    AbortPending(UpstreamUnavailable(), owed);
    owed->append(UpstreamUnavailable());
    return AfterFailure::kClose;
  }
  if ((reason == metrics::UpstreamError::kAuth || reason == metrics::UpstreamError::kTls) && !queue_.ClientWaiting()) {
    // The upstream refused keyguard's own credentials, or its TLS (TLS 1.3 refuses a client
    // certificate after the handshake), before the client asked anything: as when the upstream
    // is down at connect, the client's next command gets the error, then the connection closes
    // (rather than a close with nothing said).
    OnUpstreamClosed();
    queue_.Clear();
    return AfterFailure::kContinue;
  }
  AbortPending(UpstreamUnavailable(), owed);
  return AfterFailure::kClose;
}

std::string Connection::UpstreamUnavailable() const {
  if (upstream_failure_.empty()) return std::string(kUpstreamUnavailable);
  return absl::StrCat("-ERR keyguard: ", upstream_failure_, "\r\n");
}

void Connection::AbortPending(std::string_view error, std::string* owed) {
  OnUpstreamClosed();
  *owed = FailPending(error);
  stop_reading_ = true;
}

std::string Connection::FailPending(std::string_view error) {
  // Every command still waiting gets an error, in order with keyguard's own replies.
  std::vector<commands::CommandId> failed;
  std::string owed = queue_.Abort(error, &failed);
  for (commands::CommandId id : failed) shard_.CountCommand(id, metrics::Outcome::kFailed);
  return owed;
}

}  // namespace keyguard::proxy
