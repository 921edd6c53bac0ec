// One client connection and its own upstream connection (1:1), on one worker thread.
//
// Two coroutines move bytes: ClientPump frames client commands and forwards them upstream,
// UpstreamPump frames replies and forwards them to the client. The ReplyQueue (queue_) holds one
// entry per command that expects a reply, in request order, including replies keyguard makes
// itself, so every client sees its replies in the order it sent the commands. Out-of-band frames
// (pub/sub messages, RESP3 pushes, MONITOR lines) pass through without taking an entry.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "keyguard/hygiene/serialized.h"
#include "keyguard/resp/framer.h"
#include "keyguard/tenant/rewrite.h"
#include "proxy/asio.h"
#include "proxy/outbox.h"
#include "proxy/read_buffer.h"
#include "proxy/worker.h"

namespace keyguard::proxy {

// A command waiting for its reply, or a reply keyguard made.
struct Pending {
  enum class Kind : uint8_t {
    kForward,    // plain command: one reply
    kLocal,      // keyguard's own reply in `text`
    kSubscribe,  // (p|s)(un)subscribe: one confirmation per channel
    kHello,      // switches RESP2/RESP3 when it succeeds
    kMonitor,    // +OK starts the MONITOR stream
    kReset,      // +RESET ends subscribe mode, MONITOR and RESP3
    kExecAbort,  // EXEC of a transaction keyguard poisoned: DISCARD was sent, reply is EXECABORT
    kInternal,   // keyguard's own command (upstream AUTH): the reply is not the client's
    kReplicationStream,  // SYNC/PSYNC: from its reply on, upstream bytes are a stream passed as they are
  };
  Kind kind = Kind::kForward;
  commands::CommandId command = commands::kUnknownCommand;
  bool close_after = false;   // kLocal: close the connection once this reply is delivered
  bool hidden = false;        // the reply is read, not delivered (RESET after CLIENT REPLY SKIP)
  uint8_t confirm = 0;        // kSubscribe: index into kConfirmNames
  int8_t hello_version = 0;   // kHello: 2, 3 or 0 (unchanged)
  int64_t expected = 1;       // kSubscribe: confirmations still due, -1 = all channels of a kind
  int64_t start_ns = 0;
  uint8_t reply_check = 0;    // hygiene: what to look at in the reply (see session.cc)
  uint32_t key_len = 0;       // with reply_check: the key, in the session's key arena
  uint64_t key_off = 0;
  bool keyed = false;         // the key (args[1]) is in the key arena, for reply_check or hot keys
  uint32_t request_bytes = 0; // hot keys: the request's bytes; 0 when the command is not tracked
  // Tenancy: what the reply must be if the server's transaction state is the one keyguard
  // filters replies by; anything else means the two differ, and the connection is closed.
  enum class Expect : uint8_t {
    kAny,
    kQueued,       // queued inside MULTI: +QUEUED or an error (then EXEC aborts)
    kNotQueued,    // outside MULTI: anything but +QUEUED
    kMultiOk,      // the MULTI that starts a transaction: not an error
    kExecInMulti,  // EXEC inside MULTI: not "EXEC without MULTI"
    kExecOutside,  // EXEC outside MULTI: an error
  };
  Expect expect = Expect::kAny;
  uint8_t rewrite = 0;        // tenancy: tenant::ReplyRewrite of the reply
  std::vector<uint8_t> exec_rewrites;  // tenancy, EXEC: the rewrite of each queued command
  std::string text;           // kLocal: the reply
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Worker& worker, tcp::socket client);
  ~Session();

  // Connects upstream and starts both pumps.
  void Start();
  // Stop gracefully: close once no reply is pending.
  void Drain();
  // Close both connections now.
  void Close();

 private:
  awaitable<void> Run();
  awaitable<void> ClientPump();
  awaitable<void> UpstreamPump();
  awaitable<void> FlushAndClose();

  // Client side.
  void ProcessClientBytes(size_t* hint);
  void HandleCommand(std::span<const std::string_view> args, const char* raw, size_t raw_len, int64_t now);
  void ForwardRaw(const char* data, size_t len);
  // Encodes a rewritten command into the batch's scratch chunks; the view lives until the batch
  // has been handed to the upstream outbox.
  std::string_view Encode(std::span<const std::string_view> args);
  // A rewritten command from the client's own bytes with only the changed arguments encoded
  // anew: a small one copied into the scratch chunk (`*bytes`), a big one as pieces in splice_
  // (its values never copied). False when `out` cannot be spliced (another arity, an inline
  // command) and Encode must re-encode it.
  bool Splice(const char* raw, size_t raw_len, std::span<const std::string_view> args,
              std::span<const std::string_view> out, std::string_view* bytes);
  // key_policy.scripts: false (with the refusal) when a script or function nobody reviewed is to
  // be run or loaded and the action is reject; counts (and with warn logs) it otherwise.
  bool ApplyScriptPolicy(std::span<const std::string_view> args, commands::CommandId id, std::string* refusal);
  // Applies the key policy to the keys in key_refs_. Returns false with the error text in
  // `refusal` when the command is
  // refused; with a rewrite, sets `*modified` and leaves the new arguments in cmd_args_.
  bool ApplyKeyPolicy(std::span<const std::string_view> args, commands::CommandId id, const commands::CommandSpec& spec,
                      bool* modified, std::string* refusal);
  // Tenancy: AUTH and HELLO are answered (and authenticated) by keyguard.
  void HandleAuth(commands::CommandId id, std::span<const std::string_view> args, bool skipped, bool silent, int64_t now);
  void BindTenant(const tenant::Tenant* t);
  // Queues keyguard's upstream AUTH (when configured); `send_now` outside a client batch.
  void SendUpstreamAuth(bool send_now);
  // Delivers an out-of-band frame (pub/sub message, push), confined to the tenant.
  void DeliverPush(std::string_view frame);
  // Answers a refused command in its place, counts it by `reason`, keeps MULTI and CLIENT REPLY
  // SKIP semantics.
  void Refuse(commands::CommandId id, const char* reason, std::string message, bool skipped, bool silent);
  void Warn(const policy::Violation& v, std::string_view key, commands::CommandId id);
  // Hygiene: request-side checks; returns what the reply should be checked for.
  // Findings with action reject leave the refusal in verdict_; rewrites go to HygieneArgs().
  uint8_t DetectRequest(commands::CommandId id, std::span<const std::string_view> args);
  void DetectTtl(commands::CommandId id, std::span<const std::string_view> args);
  void DetectReply(const Pending& p, char type, int64_t size, std::string_view bulk);
  // A finding about `key` (the client's name) from this client, with its rule's action.
  hygiene::Finding NewFinding(hygiene::Kind kind, std::string_view key, commands::CommandId id);
  void Emit(hygiene::Finding f, std::string_view key, commands::CommandId id);
  // The arguments going upstream, as a vector the detectors may rewrite (copied once).
  std::vector<std::string_view>& HygieneArgs();
  // The size cache's key for a client key name (the tenant's prefix included).
  uint64_t SizeKey(std::string_view key) const;
  // A big key's size as a write or a reply showed it (-1: not that kind of size).
  void RememberSize(std::string_view key, std::string_view type, int64_t bytes, int64_t elements);
  // missing_ttl findings whose window passed (all of them when the connection ends).
  void FlushPendingTtl(bool all);
  void FlushPendingTtlFront();
  void TrimKeyArena();
  // Hot and big keys (session_hot_keys.cc): counts string write sizes, and returns true when the
  // reply needs the command's first key (args[1]): an access to count (sampled; p->request_bytes
  // set) or a size to read from the reply. HotKeysReply runs for every reply with a key.
  bool HotKeysRequest(commands::CommandId id, std::span<const std::string_view> args, size_t raw_len, Pending* p);
  void HotKeysReply(const Pending& p, char type, int64_t size, std::string_view bulk, size_t frame_len);
  void Reply(std::string text, commands::CommandId id, bool close_after);

  // Upstream side.
  bool ProcessUpstreamBytes(size_t* hint);
  void DeliverLocalsAtHead();
  // `frame_len`: the reply frame's bytes (0 for subscribe confirmations: not measured).
  void CompleteHead(char reply_type, int64_t size, std::string_view bulk, size_t frame_len, int64_t now);
  bool IsConfirmationFor(const Pending& p, std::string_view kind) const;
  // Whether the connection has, or may have by the time the server reads the next command, a
  // subscription: a tracked channel or a (un)subscribe still waiting for its confirmations.
  bool MayBeSubscribed() const;
  void TrackConfirmation(std::string_view kind, std::string_view channel);
  void FailUpstream(metrics::UpstreamError reason);
  // Closes the upstream connection (and counts it gone, if it was up).
  void CloseUpstream();
  // Every command still waiting gets `error`, and the connection closes once it is delivered.
  void AbortPending(std::string_view error);
  void NotifyQueue();
  void AppendOut(std::string_view bytes);

  Worker& worker_;
  tcp::socket client_;
  tcp::socket upstream_;
  Outbox client_out_;
  Outbox upstream_out_;
  ReadBuffer client_buf_;
  ReadBuffer upstream_buf_;
  resp::RequestFramer request_framer_;
  resp::ReplyFramer reply_framer_;
  std::deque<Pending> queue_;
  asio::steady_timer queue_event_;
  bool queue_waiter_ = false;

  // Batch scratch, reused.
  std::vector<asio::const_buffer> forward_;  // client bytes going upstream
  std::vector<asio::const_buffer> deliver_;  // reply bytes going to the client
  std::deque<std::string> held_;             // local replies referenced by deliver_ until sent
  std::deque<std::string> scratch_;          // chunks of rewritten commands forward_ points into until sent
  std::vector<asio::const_buffer> splice_;   // the pieces of the current command, when spliced
  std::vector<commands::KeyRef> key_refs_;
  std::vector<std::string_view> cmd_args_;     // arguments after the key policy's rewrites
  std::vector<std::string_view> tenant_args_;  // arguments after tenant prefixing
  std::deque<std::string> policy_owned_;       // rewritten keys cmd_args_ points to
  std::string rewritten_;                      // a reply rewritten for the tenant
  std::vector<std::string_view> hygiene_args_; // arguments after the detectors' rewrites
  struct Verdict {
    std::string refusal;  // a finding whose rule rejects: the error text
    bool modified = false;
  };
  Verdict verdict_;
  std::span<const std::string_view> verdict_out_;  // the arguments before the detectors
  // Writes without a TTL to cache/session patterns, waiting for an EXPIRE on this connection.
  struct PendingTtl {
    std::string key;
    int64_t deadline_ms;
    uint32_t pattern;
    commands::CommandId command;
  };
  static constexpr size_t kMaxPendingTtl = 64;
  std::deque<PendingTtl> pending_ttl_;
  std::vector<policy::Violation> violations_;
  std::string client_address_;
  std::string client_name_;
  uint64_t id_ = 0;        // per worker, for the hygiene trackers
  // Keys of pending commands whose replies the detectors look at, appended in request order;
  // offsets are absolute (key_arena_base_ + position), so the consumed front can be dropped.
  std::string key_arena_;
  uint64_t key_arena_base_ = 0;
  bool watching_ = false;  // WATCH is active

  // Tenancy: the tenant of this client (nullptr: none yet, or tenancy off).
  const tenant::Tenant* tenant_ = nullptr;
  // The tenant replies and pushes are confined to. RESET logs the client out at once, but what
  // the server sends until its +RESET is still the old tenant's; nullptr drops every push.
  const tenant::Tenant* reply_tenant_ = nullptr;
  std::vector<uint8_t> multi_rewrites_;  // reply rewrites of the commands queued in MULTI
  metrics::Counter* tenant_commands_ = nullptr;
  metrics::Counter* tenant_received_ = nullptr;
  metrics::Counter* tenant_sent_ = nullptr;
  bool upstream_auth_failed_ = false;
  bool desynced_ = false;  // a reply showed the server's transaction state differs from keyguard's
  // The tenant's share of detector state and size cache: DetectorScope(tenant_).
  uint64_t detector_scope_ = hygiene::kFnvBasis;

  // Connection state as the client and the server see it.
  int protocol_ = 2;
  bool monitor_ = false;
  bool in_multi_ = false;
  bool multi_aborted_ = false;
  bool reply_off_ = false;
  bool skip_next_reply_ = false;
  bool quit_sent_ = false;
  bool replication_stream_ = false;  // SYNC/PSYNC was sent: nothing after it gets a reply
  bool replication_tunnel_ = false;  // its reply has begun: upstream bytes pass as they are
  absl::flat_hash_set<std::string> subscriptions_[3];  // channels, patterns, shard channels

  bool upstream_ready_ = false;
  bool stop_reading_ = false;
  bool closing_ = false;
  bool closed_ = false;
};

}  // namespace keyguard::proxy
