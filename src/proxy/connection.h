// One client connection and its upstream connection (1:1) as keyguard sees them, without sockets:
// client bytes in -> bytes for the upstream and for the client out; upstream bytes in -> the same.
// What the transport must do besides writing them (stop reading, arm the walk timer, close once
// the owed replies are out) is read from accessors after each call. Session (session.h) carries it
// over two sockets; tests/unit/connection_test.cc drives it with bytes.
//
// A client command: RequestFramer -> HandleCommand -> CommandPipeline::Run (pipeline.h) -> the
// client's bytes (or a splice of them, or a re-encoding) into output().upstream, and an entry in
// the ReplyQueue. An upstream frame: ReplyFramer -> ConnectionState::Classify -> the head entry's
// reply (tenant rewrite, hygiene and hot-key hooks, metrics) into output().client, and keyguard's
// own replies in their place.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "keyguard/hygiene/hot_keys.h"
#include "keyguard/hygiene/traffic.h"
#include "keyguard/metrics/registry.h"
#include "keyguard/resp/framer.h"
#include "keyguard/tenant/rewrite.h"
#include "keyguard/tenant/walk.h"
#include "proxy/cluster_map.h"
#include "proxy/connection_state.h"
#include "proxy/pinning.h"
#include "proxy/pipeline.h"
#include "proxy/refusal.h"
#include "proxy/reply_queue.h"
#include "proxy/scratch.h"

namespace keyguard::proxy {

// Redis Cluster upstream: where one command of Connection::Output goes.
inline constexpr int32_t kAnyNode = -1;    // no key: any primary
inline constexpr int32_t kEveryNode = -2;  // every primary, the replies merged
inline constexpr int32_t kCrossSlot = -3;  // keys in different slots (Connection::SlotOf)
inline constexpr int32_t kFirstNode = -4;  // the first primary (where keyless pins go: PUBLISH)
struct Route {
  uint32_t bytes = 0;                            // the command's bytes in Output::upstream (after the previous route's)
  int32_t slot = kAnyNode;                       // its keys' slot, or kAnyNode / kEveryNode
  cluster::Merge merge = cluster::Merge::kNone;  // kEveryNode: how the replies become one
  bool scan = false;                             // SCAN: the cursor names the node
  // A multi-key command split by slot (MGET, MSET, DEL, UNLINK, EXISTS, TOUCH): 1 on its first
  // part, 2 on the others (their replies merge into the one the client gets, by `merge`);
  // kMget's `positions` are the places of the part's keys in the client's command.
  uint8_t split = 0;
  std::span<const uint32_t> positions;
  bool read = false;  // a read-only command (a replica may serve it: cluster.read_from)
  // A script's (EVAL, FCALL): its error reply's text may be any the script chose, so a
  // redirection in it is not the node's word on the map (ClusterClient::OnLinkFrame).
  bool scripted = false;
  // keyguard could not tell its keys (a module's command; slot is kAnyNode): a redirection names
  // their slot.
  bool keys_untold = false;
};

// What a Connection asks of the transport that carries it, while a call runs.
class ConnectionHost {
 public:
  // Whether the client hung up with nothing unread (asked while a DBSIZE/RANDOMKEY walk runs, when
  // the client's socket is not read).
  virtual bool ClientGone() = 0;
  // A hygiene finding, complete (key, pattern, command, client, action): count it and log it.
  virtual void Report(hygiene::Finding f) = 0;
  // A detector queued a key for the size probe.
  virtual void WakeProbe() = 0;
  // keyguard's encoded upstream AUTH as a new (or RESET) upstream connection sends it now: the
  // password file's current secret (empty: none). Valid until the next call (the Connection
  // copies it).
  virtual std::string_view UpstreamAuth() = 0;

 protected:
  ~ConnectionHost() = default;
};

// What one worker's connections share (used from that worker's thread only); it outlives them.
struct ConnectionShared {
  StageShared& stages;  // settings, the metric shard, the tenant connection registry
  hygiene::WorkerDetectors& hygiene;
  hygiene::HotKeys& hot;
  // Tenancy: each tenant's budget of key-walk steps on this worker.
  std::unordered_map<const tenant::Tenant*, tenant::StepBudget>& walk_budget;
  // A Redis Cluster upstream: the worker's slot map (nullptr without one).
  const std::shared_ptr<cluster::SlotMap>* cluster_map = nullptr;
};

class Connection {
 public:
  Connection(const ConnectionShared& shared, ConnectionHost& host);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // The bytes a call produced, in order for each side. The views point into the caller's bytes,
  // the rewritten commands and keyguard's own replies: valid until the next call into this object.
  struct Output {
    std::vector<std::string_view> upstream;
    std::vector<std::string_view> client;
    // The commands in `upstream`. On a shared upstream connection each is answered by exactly one
    // reply frame (nothing that answers otherwise goes there: it pins).
    uint32_t commands = 0;
    // Redis Cluster upstream (set_cluster): where each of the commands goes, in order.
    std::vector<Route> routes;
  };
  const Output& output() const { return out_; }

  // "address:port" of the client, for findings and warn lines.
  void set_client_address(std::string address) { client_address_ = std::move(address); }

  // The upstream connection is up: keyguard's AUTH (when configured) and CLIENT ID (with tenancy)
  // go ahead of every client command.
  void OnUpstreamConnected();
  // The upstream connection is closed (or never came up): it is unregistered and counted gone.
  void OnUpstreamClosed();
  bool upstream_ready() const { return upstream_ready_; }

  // Frames and handles the client's commands in `data` until it needs more bytes, stops reading
  // or holds the rest behind a walk. Returns the bytes consumed (the caller drops them after
  // writing the output); `*hint` is the framer's size hint for the next read (0: none).
  size_t OnClientBytes(const char* data, size_t len, int64_t now_ns, size_t* hint);
  // Frames the upstream's replies in `data` and turns each into the client's bytes. Returns the
  // bytes consumed; `*ok` false when the upstream must be dropped (see read_error()).
  size_t OnUpstreamBytes(const char* data, size_t len, int64_t now_ns, size_t* hint, bool* ok);
  // A shared upstream connection's frames for this client, framed by the link (its framer `f`
  // holds the frame's facts): BeginUpstream, OnSharedFrame for each (false: as OnUpstreamBytes's
  // `*ok` false), EndUpstream; the output is then that of one OnUpstreamBytes call.
  void BeginUpstream();
  bool OnSharedFrame(std::string_view frame, const resp::ReplyFramer& f, int64_t now);
  // Whether a shared connection's frame since the last call found no command of this client
  // waiting (dropped): the link must fail.
  bool TakeLinkDesync() { return std::exchange(link_desync_, false); }
  // A RESP3 push the link handed over in the run (SharedLink's OnLinkPush): the client's when its
  // first pending command is DEBUG (PROTOCOL push), else dropped.
  bool OnSharedPush(std::string_view frame, const resp::ReplyFramer& f, int64_t now);
  void EndUpstream();
  // Why OnUpstreamBytes said the upstream must go: its AUTH was refused, or a protocol error.
  metrics::UpstreamError read_error() const {
    return upstream_auth_failed_ ? metrics::UpstreamError::kAuth
           : upstream_refused_   ? metrics::UpstreamError::kRefused
                                 : metrics::UpstreamError::kProtocol;
  }

  // What becomes of the client when the upstream fails.
  enum class AfterFailure : uint8_t {
    kNone,      // the upstream was not up: nothing changes
    kContinue,  // keyguard's own AUTH was refused before the client asked anything: the client's
                // next command gets the error, then the connection closes
    kClose,     // `*owed` is what the client is owed; nothing more is read; close once it is out
  };
  // The upstream failed for `reason` (counted, unless it closed after QUIT). Unless kNone, it is
  // unregistered and counted gone as by OnUpstreamClosed, and the caller closes its socket.
  AfterFailure OnUpstreamFailed(metrics::UpstreamError reason, std::string* owed);

  // Tenancy: a walk step waits for the tenant's rate. The nanoseconds until OnWalkTimer is due,
  // once (0: no timer wanted).
  int64_t TakeWalkWait() {
    const int64_t w = walk_wait_ns_;
    walk_wait_ns_ = 0;
    return w;
  }
  // The walk timer fired: the step goes out when the walk still runs.
  void OnWalkTimer(int64_t now_ns);

  // Shared upstream connections (upstream_connections: shared). The transport carries the output
  // to a shared connection, and hands back the reply frames of this client's commands, whole, in
  // order. A command a shared connection cannot serve exactly (pinning.h) stops OnClientBytes
  // before it, unread: the transport waits until nothing is pending (every earlier command
  // answered, so none overtakes another), gives the client an upstream connection of its own and
  // calls OnPinned, then OnClientBytes again.
  void set_multiplexed() {
    multiplexed_ = true;
    pin_classes_ = PinClasses();
    pin_check_ = true;
    upstream_ready_ = false;
  }
  bool multiplexed() const { return multiplexed_; }
  // A Redis Cluster upstream (after set_multiplexed): each command's route goes in the output
  // (slot, any node, every node), multi-key commands across slots get CROSSSLOT, and keyguard
  // answers CLUSTER SLOTS/SHARDS/NODES/INFO/MYID/KEYSLOT as a one-node cluster at `host:port`
  // (where the client reached keyguard), CLIENT SETNAME/GETNAME/SETINFO and READONLY/READWRITE.
  void set_cluster(std::string host, uint16_t port) {
    cluster_ = true;
    cluster_host_ = std::move(host);
    cluster_port_ = port;
  }
  // The slot the client waits to be pinned for (its node serves the pinned connection): the
  // pinning command's first key, or for MULTI the first keyed command queued after it; kAnyNode.
  int32_t pin_slot() const { return pin_slot_; }
  // A cluster's client waits to be pinned for a command without keys (MULTI): `data` holds it and
  // what the client sent after it; the first keyed command among those (up to EXEC) names the slot.
  void LookAheadForPin(const char* data, size_t len) {
    if (cluster_ && pin_slot_ == kAnyNode) pin_slot_ = LookAheadSlot(data, len);
  }
  bool pinned() const { return pinned_; }
  // Why the client waits to be pinned (kNone: it does not).
  PinReason pin_wanted() const { return pin_wanted_; }
  // Whether the shared connection is up (read before each OnClientBytes while not pinned).
  void set_shared_ready(bool up) { upstream_ready_ = up; }
  // Shared connections in lanes (not a cluster's): a command a server under CLIENT PAUSE WRITE
  // holds, or a script (WriteLaneClasses, LaneWrites), goes to the write lane's connection, any
  // other to the read lane's, so that a paused write holds no other client's read. A client moves
  // from one to the other when nothing is pending; a write behind reads of the same call (nothing
  // pending before it) takes them along to the write lane; behind reads sent earlier it waits for
  // them (reply_wait); a read behind writes goes behind them (as a direct client's waits behind
  // its own paused write).
  void set_lanes() { lane_classes_ = WriteLaneClasses(shared_.stages.config.tenancy != nullptr); }
  // The lane of the client's commands (true: write), read at each flush.
  bool write_lane() const { return write_lane_; }
  // The client has a connection of its own now: `fresh` (just made: keyguard's AUTH goes first)
  // or from the idle pool (authenticated). Returns the reason it was pinned for.
  PinReason OnPinned(bool fresh);
  // Whether its own connection can go back to the pool: pinned for a transaction or a blocking
  // command that ended, nothing pending, and nothing since that pins for good.
  bool CanUnpin() const {
    return pinned_ && !sticky_ && queue_.empty() && !holding_ && !resume_ && !state_.in_multi() && !state_.watching() &&
           !stop_reading_;
  }
  // The client is back on the shared connection (its own went to the pool, or closed).
  void OnUnpinned();
  // A `HELLO 2` or `HELLO 3` (no AUTH, no SETNAME) that would change the protocol of the client's
  // shared connection waits unread (pin_wanted() is kHello): the transport moves the client to a
  // shared connection of that protocol once nothing is pending, then calls OnLinkSwitched, and
  // the HELLO goes there (its reply is the server's). 0: the client waits for no such move.
  int protocol_wanted() const { return protocol_wanted_; }
  void OnLinkSwitched() {
    link_protocol_ = protocol_wanted_;
    protocol_wanted_ = 0;
    pin_wanted_ = PinReason::kNone;
  }
  // The links of that protocol did not come up: the HELLO is answered `error` (a whole RESP
  // error), and the client stays where it is.
  void OnSwitchFailed(std::string error) {
    protocol_wanted_ = 0;
    pin_wanted_ = PinReason::kNone;
    switch_failure_ = std::move(error);
  }
  // The protocol of the shared connections the client is on (a connection pinned for it speaks
  // it too: keyguard's HELLO 3 goes first; such a connection is not pooled again).
  int link_protocol() const { return link_protocol_; }
  // The protocol of keyguard's own answer to the command being handled: on a shared connection,
  // its protocol (a HELLO pipelined before the command moved the client already, before its
  // reply came); else the connection's, as its replies set it.
  int ReplyProtocol() const { return multiplexed_ && !pinned_ ? link_protocol_ : state_.protocol(); }
  // The shared connection failed: every command in flight on it gets the error (returned, in order
  // with keyguard's own replies); the client stays connected.
  std::string OnSharedFailed();

  // Whether client bytes are no longer read (protocol error, QUIT, upstream gone, draining).
  bool stop_reading() const { return stop_reading_; }
  void StopReading() { stop_reading_ = true; }
  // A walk runs: later commands wait unread in the client's buffer.
  bool holding() const { return holding_; }
  // A command waits, unread, for every pending reply, and the transport reads on after them: a
  // cluster client's command for another node's slot, at the end of a pin that ends once its
  // pending replies are in (NeedsPin); a write behind reads on the read lane (set_lanes).
  bool reply_wait() const { return reply_wait_; }
  void EndReplyWait() { reply_wait_ = false; }
  // A walk ended: the commands read meanwhile are next (the next OnClientBytes).
  bool resume() const { return resume_; }
  // Nothing is pending and no command waits behind a walk.
  bool idle() const { return queue_.empty() && !holding_ && !resume_; }
  size_t pending() const { return queue_.size(); }
  // Whether the oldest command owed a reply may block on the server for as long as it likes (a
  // blocking command, WAIT, XREAD): a client that hung up is not waited for behind it.
  bool HeadMayBlock() const;

  // Why the upstream is unavailable, when more is known than that ("upstream TLS: <reason>"): the
  // error replies say it.
  void set_upstream_failure(std::string why) { upstream_failure_ = std::move(why); }
  // Whether a reply since the last call was READONLY (a replica: the primary may have moved).
  bool TakeReadOnlySeen() { return std::exchange(readonly_seen_, false); }
  // Whether a reply since the last call may be the server's last before it closes the connection
  // (an error, or a reply to CLIENT, ACL, EXEC, DEBUG, SHUTDOWN: CLIENT KILL of itself, its
  // user deleted, a protocol error): the transport looks for the close at once, as the end of the
  // stream that came with the reply raises no event of its own (async_read.h).
  bool TakeCloseMayFollow() { return std::exchange(close_may_follow_, false); }
  // A cluster's MOVED or ASK a reply on the client's own (pinned) connection carried since the
  // last call ("" for none): the transport corrects its slot map.
  std::string TakeRedirectSeen() { return std::exchange(redirect_seen_, std::string()); }
  // Whether the redirection TakeRedirectSeen returns answered a script (EVAL, FCALL, ...).
  bool redirect_scripted() const { return redirect_scripted_; }

  // The connection closes: nothing can follow what the detectors are waiting for.
  void OnClose();

  const ConnectionState& state() const { return state_; }
  const tenant::Tenant* tenant() const { return tenant_; }
  // Tenancy by identity: the client's verified certificate names tenant `t` (listen_tls), as AUTH
  // would; a RESET comes back to it rather than to no tenant.
  void LogInByCertificate(const tenant::Tenant* t) {
    certificate_tenant_ = t;
    BindTenant(t);
  }

 private:
  // Where detectors_ report: findings stamped with this client (who and where), then the host.
  struct Sink final : hygiene::FindingSink {
    explicit Sink(Connection& c) : connection(c) {}
    void Stamp(hygiene::Finding* f, std::string_view key, commands::CommandId id) override;
    void Report(hygiene::Finding f) override { connection.host_.Report(std::move(f)); }
    void WakeProbe() override { connection.host_.WakeProbe(); }
    Connection& connection;
  };

  // Starts a call: the previous call's output has been written.
  [[gnu::always_inline]] void BeginCall() {
    out_.upstream.clear();
    out_.client.clear();
    out_.commands = 0;
    if (cluster_) [[unlikely]]
      ClearRoutes();
    if (!held_.empty()) ClearHeld();
  }
  // Out of line: the deque's clear would put its register saves on every call's path.
  [[gnu::noinline]] void ClearHeld();
  // Counts the replies in the output as the tenant's sent bytes.
  void CountSent();

  // Client side.
  void HandleCommand(commands::CommandId id, std::span<const std::string_view> args, const char* raw, size_t raw_len,
                     int64_t now);
  // Shared upstream: whether command `id` must wait to be pinned (pin_wanted_ set).
  [[gnu::noinline]] bool NeedsPin(commands::CommandId id, std::span<const std::string_view> args);
  // A cluster's MULTI that no command has pinned yet (in the client's state, answered +OK here),
  // and the EXEC or DISCARD of such a transaction if nothing joined it. False: the command goes.
  bool AnswerDeferredMulti(const CommandContext& c, bool aborted);
  // A keyless command first in a deferred MULTI, read alone: held (hold_next_) rather than pinned.
  [[gnu::noinline]] bool HoldsInTransaction(commands::CommandId id, std::span<const std::string_view> args,
                                            size_t raw_len, const char* rest, size_t rest_len);
  void HoldInTransaction(const CommandContext& c, std::string_view bytes, const Pending& staged, bool silent,
                         bool renamed);
  void SendHeldInTransaction(int64_t now);
  void DropHeldInTransaction(metrics::Outcome outcome);
  // A Redis Cluster upstream: the route of the command of `v` (route_), or keyguard answers it
  // (false: nothing is forwarded).
  bool RouteCluster(const CommandContext& c, const Verdict& v);
  // The route of a command by the slot of its keys (CROSSSLOT, a split, or refused on a pinned
  // connection of another node).
  bool RouteByKeys(const CommandContext& c, std::span<const std::string_view> args);
  // The slot of the keys of `args` (stored under `prefix`): kAnyNode when it has none, -3 when they
  // are in different slots.
  int32_t SlotOf(commands::CommandId id, std::span<const std::string_view> args, std::string_view prefix = {});
  // The same for the client's own arguments, before the pipeline: on the names the server will
  // store (the tenant's prefix).
  int32_t StoredSlotOf(commands::CommandId id, std::span<const std::string_view> args);
  // CLIENT SETNAME/GETNAME/SETINFO, READONLY, READWRITE, ASKING: keyguard answers them (a shared
  // connection per node cannot carry the client's name or mode); WAIT, WAITAOF: refused.
  bool ClusterAnswers(commands::CommandId id, std::span<const std::string_view> args) const;
  // CLIENT ID, INFO, LIST, TRACKINGINFO, GETREDIR: a cluster client without a connection of its
  // own gets keyguard's shared connection's answer rather than a pin to one node.
  static bool ClientQuery(std::span<const std::string_view> args);
  // CLIENT TRACKING with a REDIRECT option (refused with a cluster: RouteCluster).
  static bool TrackingRedirect(std::span<const std::string_view> args);
  // SUBSCRIBE or PSUBSCRIBE of a keyspace notification channel (`__keyspace@...`,
  // `__keyevent@...`; a pattern that names them, not one that starts with a wildcard) through a
  // cluster of several primaries: each notifies of its own keys only, and a subscription is on
  // one node, so it is refused (RouteCluster), with no pin made (NeedsPin). `args`: the client's.
  bool RefusedKeyspaceSubscription(commands::CommandId id, std::span<const std::string_view> args) const;
  // An @scripting command (EVAL, FCALL, ...): its error text may be any the script chose.
  static bool Scripted(commands::CommandId id);
  // CLIENT SETNAME/GETNAME of a client on a shared connection: answered (true), or not (false:
  // forwarded).
  bool AnswerClientName(const CommandContext& c, std::span<const std::string_view> args);
  // A command on shared connections (CLIENT, or any with a cluster): false when keyguard
  // answered it (CLIENT SETNAME/GETNAME) or refused it (the pipeline released), else where it
  // goes is set (RouteCluster). Out of line: the dedicated path stays one branch.
  [[gnu::noinline]] bool RouteShared(const CommandContext& c, const Verdict& v);
  // MULTI: the slot of the first keyed command among those queued after it in `data` (up to EXEC).
  // (`ends`: set when the transaction's EXEC or DISCARD comes before any keyed command.)
  int32_t LookAheadSlot(const char* data, size_t len, bool* ends = nullptr);
  // A command of `bytes` ended in the output: its route (route_). Out of line, as ClearRoutes and
  // ForwardRouted: the dedicated and shared paths keep only a test of cluster_ per command
  // (bench/instructions.sh).
  [[gnu::noinline]] void EndRoute(size_t bytes);
  [[gnu::noinline]] void ClearRoutes();
  // The client's command (`bytes`, or splice_, or split_) with its route; route_ is then reset
  // (keyguard's own commands go to any node).
  [[gnu::noinline]] void ForwardRouted(std::string_view bytes);
  // A multi-key command whose keys are in several slots: one command per slot (split_), each with
  // its route. False when `id` is not one keyguard splits.
  bool SplitBySlot(commands::CommandId id, std::span<const std::string_view> args);
  void ForwardSplit();
  // QUIT on a shared connection: keyguard answers, the shared connection stays.
  void QuitLocally(const CommandContext& c);
  void ForwardRaw(std::string_view bytes);
  // A whole command (one reply) for the upstream.
  [[gnu::always_inline]] void ForwardCommand(std::string_view bytes) {
    ForwardRaw(bytes);
    ++out_.commands;
  }
  // Encodes a rewritten command into the batch's scratch chunks (valid until the next call).
  std::string_view Encode(std::span<const std::string_view> args);
  // A rewritten command from the client's own bytes with only the changed arguments encoded
  // anew: a small one copied into the scratch chunk (`*bytes`), a big one as pieces in splice_
  // (its values never copied). False when `out` cannot be spliced (another arity, an inline
  // command) and Encode must re-encode it.
  bool Splice(const char* raw, size_t raw_len, std::span<const std::string_view> args,
              std::span<const std::string_view> out, std::string_view* bytes);
  // AUTH or HELLO accepted (tenancy): keyguard answers AUTH; HELLO goes upstream without AUTH.
  void Login(const CommandContext& c, const Verdict& v, int64_t now);
  void BindTenant(const tenant::Tenant* t);
  // Queues keyguard's upstream AUTH (when configured).
  void SendUpstreamAuth();
  // Queues keyguard's own `command` (encoded; its reply is not the client's), `id` telling
  // OnUpstreamBytes what the reply is for.
  void SendInternal(std::string_view command, commands::CommandId id);
  // Before the command of `v` goes: sends keyguard's own command ahead of it (a Verdict's prelude)
  // under the client's reply mode, and keeps the names its reply must give back.
  void ForwardExtras(const Verdict& v, ConnectionState::ReplyMode mode);
  // The reply `frame` of the head entry `p` as the client sees it: confined to the tenant, without
  // keyguard's own EXEC elements, with renamed keys under the client's names (kept in held_).
  std::string_view RewrittenReply(const Pending& p, char type, std::string_view frame);
  // (UN)SUBSCRIBE of keyspace channels the key policy renamed (CommandPipeline::KeyspaceChannels):
  // the pairs (new channel, the client's), kept for the connection's life (an UNSUBSCRIBE and a
  // SUBSCRIBE of the channel in flight at once both find them; at most kMaxRenamedSubscriptions),
  // and the pushes that name a new channel (message, subscribe, unsubscribe) named back in `out`
  // (true when it did).
  void KeepRenamedChannels(std::span<const std::pair<std::string_view, std::string_view>> pairs);
  [[gnu::noinline]] bool RenameChannels(std::string_view frame, std::string* out);
  // PSUBSCRIBE of keyspace patterns the pipeline replaced (CommandPipeline::KeyspacePatterns):
  // the pairs (the server's pattern, the client's), kept for the connection's life (RenamePatterns).
  void KeepRenamedPatterns(std::span<const std::pair<std::string_view, std::string_view>> pairs);
  // The reply of keyguard's own command (Kind::kInternal: its AUTH, CLIENT ID, a legacy-key move,
  // a PING): counted and acted on, never the client's. False when the connection cannot go on.
  [[gnu::noinline]] bool OnInternalReply(const Pending& front, char type, std::string_view kind, int64_t now);
  // keyguard's own answer `reply` (a whole RESP frame, or "" for none) to the client's command `c`,
  // in its place: the one path for every reply keyguard makes itself, in every mode. Counted by
  // `outcome`; not shown when the client's reply mode suppresses it (c.mode.silent). When the
  // command took a CLIENT REPLY SKIP, the server still owes that skip on the client's own
  // connection: a PING spends it there, or the server would skip the reply of the next command
  // forwarded and every later reply would answer the command before it (another tenant's INFO
  // for a PING). `close_after`: the connection closes once the answer is out.
  void Answer(const CommandContext& c, std::string reply, metrics::Outcome outcome, bool close_after = false);
  // Answers a refused command in its place (Answer), counts it by `reason`, keeps MULTI semantics.
  void Refuse(const CommandContext& c, Refusal reason, std::string_view message);
  // The command the client was pinned for was refused: the pin ends (no longer sticky) once a PING
  // sent after it is answered, rather than when the client closes. A refused command that made a
  // pin sticky leaves it as it was.
  void EndRefusedPin();
  // keyguard's own reply, after every reply still pending.
  void Reply(std::string text, commands::CommandId id, bool close_after);
  // The tenant's name for the hot-key hooks ("" without one).
  std::string_view TenantName() const {
    return tenant_ != nullptr ? std::string_view(tenant_->name) : std::string_view();
  }

  // Tenancy: FLUSH*/DBSIZE/RANDOMKEY as a walk over the tenant's keys in steps. While it runs no
  // later command is processed (they wait in the client buffer), so its answer keeps its place.
  void StartWalk(tenant::Walk walk, commands::CommandId id, int64_t now);
  // A step's reply (the kWalk entry at the head): the next step, or the answer.
  void ContinueWalk(char type, std::span<const resp::ReplyFramer::Scalar> head, int64_t now);
  // The walk's next step upstream (with a cluster, routed to the walk's node).
  void ForwardWalkStep();
  void SendWalkStep(int64_t now);
  // Takes one of the tenant's step tokens on this worker; without one, asks for the walk timer
  // (TakeWalkWait) and returns true.
  bool WaitForWalkToken(int64_t now);
  void FinishWalk(std::string reply, bool error, int64_t now);

  // Upstream side.
  // Delivers an out-of-band frame (pub/sub message, push), confined to the tenant.
  void DeliverPush(std::string_view frame);
  // keyguard's own replies due now (at the head of the queue) go out; the check inline, as it
  // runs after every reply.
  void DeliverLocalsAtHead() {
    if (queue_.LocalAtHead()) DeliverLocals();
  }
  [[gnu::noinline]] void DeliverLocals();
  // One reply frame (`f` framed it): to the client, or what it is to keyguard. false when the
  // upstream must go (read_error()).
  [[gnu::always_inline]] inline bool OnFrame(std::string_view frame, const resp::ReplyFramer& f, int64_t now);
  // `frame_len`: the reply frame's bytes (0 for subscribe confirmations: not measured).
  void CompleteHead(char reply_type, int64_t size, std::string_view bulk, size_t frame_len, int64_t now);
  void AppendOut(std::string_view bytes);
  // Every command still waiting gets `error` (in `*owed`); nothing more is read.
  void AbortPending(std::string_view error, std::string* owed);
  // What the client is owed when every pending command fails with `error` (counted failed).
  std::string FailPending(std::string_view error);

  const ConnectionShared shared_;
  ConnectionHost& host_;
  metrics::WorkerShard& shard_;
  resp::RequestFramer request_framer_;
  resp::ReplyFramer reply_framer_;
  ReplyQueue queue_;
  ConnectionState state_;

  // A call's output and what it points into (reused).
  Output out_;
  std::string upstream_failure_;  // set_upstream_failure
  bool readonly_seen_ = false;
  bool close_may_follow_ = false;
  bool link_desync_ = false;
  std::string redirect_seen_;
  bool redirect_scripted_ = false;
  bool move_error_logged_ = false;  // legacy_move_failed is logged once per connection
  // The error reply for an upstream that is gone.
  std::string UpstreamUnavailable() const;
  std::deque<std::string> held_;          // keyguard's replies, and rewritten replies
  Scratch scratch_;                       // the bytes of rewritten commands
  std::vector<std::string_view> splice_;  // the pieces of the current command, when spliced
  std::string client_address_;
  uint64_t id_ = 0;  // per worker, for the hygiene trackers
  Sink sink_{*this};
  hygiene::ConnectionDetectors detectors_;
  CommandPipeline pipeline_;  // what becomes of each command, before anything is sent

  // Tenancy: the tenant of this client (nullptr: none yet, or tenancy off).
  const tenant::Tenant* tenant_ = nullptr;
  const tenant::Tenant* certificate_tenant_ = nullptr;  // the tenant of the client's certificate
  // The tenant replies and pushes are confined to. RESET logs the client out at once, but what
  // the server sends until its +RESET is still the old tenant's; nullptr drops every push.
  const tenant::Tenant* reply_tenant_ = nullptr;
  uint64_t reply_scope_ = hygiene::kFnvBasis;  // DetectorScope(reply_tenant_), for the detectors
  metrics::Counter* tenant_commands_ = nullptr;
  metrics::Counter* tenant_received_ = nullptr;
  metrics::Counter* tenant_sent_ = nullptr;
  std::array<metrics::Counter*, kRefusalCount> tenant_rejected_{};  // by Refusal, resolved on first use
  bool upstream_auth_failed_ = false;
  bool upstream_refused_ = false;  // the server refused keyguard's MULTI or HELLO 3 for the client
  bool desynced_ = false;          // a reply showed the server's transaction state differs from keyguard's
  // The server's CLIENT ID of the upstream connection, once known (0 before, and after it closed);
  // registered in the connection registry with tenant_.
  int64_t upstream_client_id_ = 0;

  // The walk in progress (holding_: later commands wait until it ends; resume_: process them).
  tenant::KeyWalk walk_;
  std::vector<cluster::Node> walk_nodes_;  // with a cluster: the primaries the walk goes through
  bool keys_untold_ = false;               // SlotOf could not tell the command's keys (RouteByKeys)
  int64_t walk_wait_ns_ = 0;
  bool holding_ = false;
  bool resume_ = false;
  bool reply_wait_ = false;                // see reply_wait()
  const uint8_t* lane_classes_ = nullptr;  // set_lanes
  bool write_lane_ = false;
  bool lane_free_ = false;  // nothing was pending when this OnClientBytes began

  bool upstream_ready_ = false;
  bool stop_reading_ = false;

  // Shared upstream connections.
  bool multiplexed_ = false;
  const commands::CommandId client_id_ = commands::Known().client;
  bool pin_check_ = false;                // multiplexed_, and not pinned for good: each command is looked at
  const uint8_t* pin_classes_ = nullptr;  // PinClasses()
  bool pinned_ = false;
  bool sticky_ = false;  // pinned until the client closes
  // A cluster's MULTI is answered by keyguard (defer_multi_: NeedsPin saw it, HandleCommand answers
  // it: AnswerDeferredMulti) and sent when the next command pins the client (multi_deferred_): the
  // transaction's node is that of the first keyed command, also when the client waits for MULTI's
  // +OK before sending it.
  bool defer_multi_ = false;
  bool multi_deferred_ = false;
  // Keyless commands of a deferred MULTI, read before any keyed one (HoldsInTransaction): keyguard
  // answered +QUEUED; they go right after the MULTI's +OK on the transaction's pin, their replies
  // read and not shown. At most kMaxHeldInMulti commands of kMaxHeldInMultiBytes in all (past
  // that the transaction pins where the look-ahead finds: the first keyed command read with it,
  // else the first primary).
  struct HeldCommand {
    commands::CommandId id;
    Pending::Expect expect;
    std::string bytes;
  };
  static constexpr size_t kMaxHeldInMulti = 64;
  static constexpr size_t kMaxHeldInMultiBytes = 64 * 1024;
  std::vector<HeldCommand> held_in_multi_;
  size_t held_in_multi_bytes_ = 0;
  bool hold_next_ = false;  // HoldsInTransaction said so: HandleCommand holds the command
  // What a refusal of the command being handled undoes (EndRefusedPin): kPinFresh, pinned for it
  // and nothing of the client's handled since; kPinMadeSticky, already pinned, and it made the pin
  // last (SUBSCRIBE inside MULTI). Cleared as any other verdict is handled.
  enum : uint8_t { kPinSettled, kPinFresh, kPinMadeSticky };
  uint8_t pin_undo_ = kPinSettled;
  std::vector<std::pair<std::string, std::string>> channels_renamed_;  // RenameChannels
  bool owns_upstream_ = false;  // a connection of its own is up (counted in the gauges)
  // The gauges of upstream connections, by kind: +1 when one of its own comes up, -1 when it goes.
  void CountUpstream(int n);
  PinReason pin_wanted_ = PinReason::kNone;
  // The protocol of the shared connections the client's commands go to (a set per protocol), and
  // the one a `HELLO 2|3` waiting unread asks for (0: none; pin_wanted_ is kHello meanwhile).
  int8_t link_protocol_ = 2;
  int8_t protocol_wanted_ = 0;
  std::string switch_failure_;   // OnSwitchFailed's error, for the HELLO waiting unread
  bool hello_answered_ = false;  // NeedsPin answered it: OnClientBytes goes past it

  // A Redis Cluster upstream.
  bool cluster_ = false;
  std::string cluster_host_;
  uint16_t cluster_port_ = 0;
  Route route_;  // of the command being forwarded (internal ones: any node)
  int32_t pin_slot_ = kAnyNode;
  uint16_t pinned_node_ = cluster::SlotMap::kNoOwner;  // the node of the pinned connection
  std::vector<commands::KeyRef> cluster_keys_;         // reused by SlotOf
  struct SplitPart {
    std::string_view command;  // encoded in scratch_
    int32_t slot;
    std::span<const uint32_t> positions;
  };
  std::vector<SplitPart> split_;                  // of the command being forwarded
  std::deque<std::vector<uint32_t>> split_keys_;  // the parts' positions, for this call
};

}  // namespace keyguard::proxy
