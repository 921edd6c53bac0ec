// What a Redis connection is in, as keyguard follows it from the commands it forwards and the
// replies it reads: the protocol (RESP2/3), MULTI and WATCH, CLIENT REPLY OFF/SKIP, MONITOR,
// subscriptions, a replication stream, QUIT. Sans-io: the session asks it before forwarding a
// command and tells it about replies; tests drive it with commands and replies directly.
//
// Where Redis decides by what it accepted (an arity error changes nothing, a refused queued
// command aborts EXEC), so does this state: the reply filter for tenants depends on it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "keyguard/commands/command_table.h"
#include "keyguard/commands/traits.h"
#include "keyguard/resp/framer.h"
#include "keyguard/tenant/rewrite.h"
#include "proxy/reply_queue.h"

namespace keyguard::proxy {

// The confirmation kinds of the subscribe family, in pairs: subscribe/unsubscribe for channels,
// patterns and shard channels. An index into this table is Pending::confirm.
inline constexpr std::string_view kConfirmNames[] = {"subscribe",    "unsubscribe", "psubscribe",
                                                     "punsubscribe", "ssubscribe",  "sunsubscribe"};
// The index of `kind` in kConfirmNames (any case), or -1.
int ConfirmIndex(std::string_view kind);
// Redis's arity rule for a (sub)command spec's `arity`: exactly that many arguments when
// positive, at least its absolute value when negative (the name counts).
inline bool ArityAllows(int arity, size_t argc) {
  const auto n = static_cast<int>(argc);
  return arity > 0 ? n == arity : n >= -arity;
}
// Redis's arity check, which comes before anything else the server does with a command.
inline bool ArityOk(commands::CommandId id, size_t argc) { return ArityAllows(commands::Spec(id).arity, argc); }
// Whether the server queues a command with these arguments inside MULTI as they are, judged by
// what keyguard knows (the server's state aside: ACL, memory, loading): false for an unknown
// subcommand (`CONFIG NOSUCH`), a subcommand of a wrong count (`OBJECT ENCODING`), a command or
// subcommand flagged no_multi (SAVE, SHUTDOWN: "not allowed inside a transaction"), and DEBUG
// and MODULE, which the server refuses unless its config enables them. (The command's own arity
// is ArityOk's.)
bool QueuedAsIs(commands::CommandId id, std::span<const std::string_view> args);
// HELLO's protocol argument: 2 or 3, or 0 when it names none (or a bad one).
int8_t HelloVersion(std::span<const std::string_view> args);

// What one upstream frame is to the connection: the reply of the command at the head of the
// queue, or something that must not take its place.
enum class FrameRole : uint8_t {
  kConfirmation,  // a (un)subscribe confirmation of the head command (delivered as it is)
  kPush,          // out of band: a RESP3 push, a RESP2 pub/sub message, a MONITOR line
  kUnexpected,    // nothing waits for a reply
  kInternal,      // the reply to keyguard's own command (its upstream AUTH, CLIENT ID)
  kDesync,        // filtered replies: not what the head's expectation allows (the server's
                  // transaction state differs from keyguard's)
  kWalkStep,      // a step of a tenant's key walk
  kReply,         // the head command's reply
};

// MONITOR lines look like `+1700000000.123456 [0 127.0.0.1:5555] "get" "k"`.
bool IsMonitorLine(std::string_view line);

class ConnectionState {
 public:
  // How CLIENT REPLY (and a replication stream) bear on the next command.
  struct ReplyMode {
    bool skipped = false;  // CLIENT REPLY SKIP is spent on this command
    bool silent = false;   // no reply is shown: OFF, SKIP, or after SYNC/PSYNC
  };
  // Call once per command, first: consumes a pending SKIP. After SYNC/PSYNC the server treats
  // the connection as a replica and answers nothing (REPLCONF ACK): whatever keyguard would say
  // (a refusal) would corrupt the stream.
  ReplyMode TakeReplyMode() {
    ReplyMode m{skip_next_reply_, reply_off_ || skip_next_reply_ || replication_stream_};
    skip_next_reply_ = false;
    return m;
  }

  // keyguard answered the command in place (a refusal): inside MULTI the server would not have
  // queued it, so EXEC must abort.
  void OnRefused() {
    if (in_multi_) multi_aborted_ = true;
  }

  // What forwarding one command does beyond sending it.
  struct Effects {
    bool silent = false;        // no reply will come for it
    bool stop_reading = false;  // QUIT: Redis reads nothing after it
    bool ping_first = false;    // RESET under SKIP: a PING goes first and takes the skip
    bool send_discard = false;  // EXEC of a poisoned transaction: DISCARD goes in its place
    bool logout = false;        // RESET: the client is logged out
  };
  // Command `id` with `args` is about to go upstream with reply mode `mode`: fills `p` (kind,
  // expectation, subscribe and HELLO fields; for a tenant, the EXEC's per-command rewrites from
  // `p->rewrite` of each queued command) and moves the state as the server will.
  Effects OnForward(commands::CommandId id, std::span<const std::string_view> args, ReplyMode mode, bool tenant,
                    Pending* p) {
    Effects e;
    e.silent = mode.silent;
    if (tenant) p->expect = Pending::Expect::kNotQueued;
    if (commands::TraitsOf(id).connection != commands::ConnectionRole::kNone) {
      return OnStateCommand(id, args, mode, tenant, p, e);
    }
    // The common case: a command that changes no connection state.
    if (in_multi_) Queued(tenant, p);
    return e;
  }

  // keyguard's own command (a legacy-key move) goes upstream, with `p` its entry, ahead of the
  // client's next command. Inside MULTI it is queued too, and its element leaves EXEC's reply.
  void OnOwn(bool tenant, Pending* p) {
    p->kind = Pending::Kind::kInternal;
    if (!in_multi_) return;
    if (!tenant && !own_queued_) multi_rewrites_.assign(queued_, 0);
    own_queued_ = true;
    multi_rewrites_.push_back(static_cast<uint8_t>(tenant::ReplyRewrite::kOwn));
    ++queued_;
    p->expect = Pending::Expect::kQueued;
  }

  // The reply to `p` arrived: HELLO, MONITOR and RESET take effect if it is not an error.
  // Returns true when a RESET took effect.
  bool OnReply(const Pending& p, bool error) {
    if (error || p.kind == Pending::Kind::kForward) return false;
    return OnModeReply(p);
  }

  // The role of a frame of `type` whose top-level scalars are `head`, with `front` the head of
  // the queue (nullptr: none). `filtered`: replies are confined to a tenant, so a reply that does
  // not fit the head's expectation is kDesync rather than passed on.
  FrameRole Classify(const Pending* front, char type, std::span<const resp::ReplyFramer::Scalar> head,
                     bool filtered) const {
    // The common case, one test per fact: a plain command's reply that cannot be a push, a
    // confirmation or a MONITOR line, and is what its expectation allows (only +QUEUED breaks
    // kNotQueued).
    if (front != nullptr && front->kind == Pending::Kind::kForward && type != '>' && type != '*' &&
        (type != '+' || !monitor_)) {
      const Pending::Expect e = front->expect;
      if (!filtered || e == Pending::Expect::kAny ||
          (e == Pending::Expect::kNotQueued && (type != '+' || head.empty() || head[0].text != "QUEUED"))) {
        return FrameRole::kReply;
      }
    }
    return ClassifyOther(front, type, head, filtered);
  }

  // Subscribe confirmations: `kind` is the first element of a confirmation.
  bool IsConfirmationFor(const Pending& p, std::string_view kind) const;
  void TrackConfirmation(std::string_view kind, std::string_view channel);
  // Channels (0), patterns (1) or shard channels (2) subscribed to.
  size_t subscriptions(int set) const { return subscriptions_[set].size(); }
  bool subscribed() const {
    return !subscriptions_[0].empty() || !subscriptions_[1].empty() || !subscriptions_[2].empty();
  }

  // SYNC/PSYNC was forwarded; once its reply begins, upstream bytes are a tunnel.
  bool replication_stream() const { return replication_stream_; }
  bool tunnel() const { return tunnel_; }
  void StartTunnel() { tunnel_ = true; }

  int protocol() const { return protocol_; }
  bool monitor() const { return monitor_; }
  bool in_multi() const { return in_multi_; }
  bool watching() const { return watching_; }
  bool quit_sent() const { return quit_sent_; }
  const std::string& client_name() const { return client_name_; }
  // CLIENT SETNAME answered by keyguard (a cluster upstream): findings and log lines name it.
  void set_client_name(std::string_view name) { client_name_.assign(name.data(), name.size()); }

 private:
  FrameRole ClassifyOther(const Pending* front, char type, std::span<const resp::ReplyFramer::Scalar> head,
                          bool filtered) const;
  Effects OnStateCommand(commands::CommandId id, std::span<const std::string_view> args, ReplyMode mode, bool tenant,
                         Pending* p, Effects e);
  bool OnModeReply(const Pending& p);
  // Queued inside MULTI: the reply is +QUEUED whatever the command; its effects come with EXEC,
  // whose reply carries this command's reply at this index.
  void Queued(bool tenant, Pending* p) {
    ++queued_;
    if (tenant || own_queued_) multi_rewrites_.push_back(p->rewrite);
    p->rewrite = 0;
    p->expect = Pending::Expect::kQueued;
  }
  void EndTransaction() {
    in_multi_ = multi_aborted_ = own_queued_ = false;
    queued_ = 0;
    watching_ = false;
    multi_rewrites_.clear();
  }

  int protocol_ = 2;
  bool monitor_ = false;
  bool in_multi_ = false;
  bool multi_aborted_ = false;
  bool watching_ = false;
  bool reply_off_ = false;
  bool skip_next_reply_ = false;
  bool quit_sent_ = false;
  bool replication_stream_ = false;
  bool tunnel_ = false;
  // Tenancy, or keyguard's own commands queued: the reply rewrite of each command queued in MULTI.
  std::vector<uint8_t> multi_rewrites_;
  uint32_t queued_ = 0;      // commands queued in this MULTI
  bool own_queued_ = false;  // keyguard queued its own command in this MULTI
  absl::flat_hash_set<std::string> subscriptions_[3];
  std::string client_name_;
};

}  // namespace keyguard::proxy
