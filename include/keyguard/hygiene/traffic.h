// The hygiene detectors as traffic sees them: what one command (and its reply) on one connection
// shows, turned into findings through a sink. Sans-io: the proxy session feeds it the client's
// arguments and the arguments going upstream; tests feed it directly.
//
// State lives at three levels: per process (SharedDetectors: the read-modify-write and attribute
// trackers and expiry clustering, which must see every connection whichever worker accepted it),
// per worker (WorkerDetectors: the size cache and the sizing probe's queue) and per connection
// (ConnectionDetectors: writes without a TTL waiting for an EXPIRE), all bounded. Every key is
// hashed with the connection's scope (its tenant), so one tenant's activity never shows in
// another's findings.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keyguard/commands/command_table.h"
#include "keyguard/commands/traits.h"
#include "keyguard/hygiene/detectors.h"
#include "keyguard/hygiene/hot_keys.h"
#include "keyguard/hygiene/sizes.h"

namespace keyguard::hygiene {

// SizeCache for every worker: 16 shards by key hash, a lock each; empty() is one relaxed load, so
// a process that has seen no big key takes no lock. Get copies the entry out.
class SharedSizeCache {
 public:
  static constexpr size_t kShards = 16;
  // Settings::size_cache_keys is divided among the shards.
  explicit SharedSizeCache(const Settings& s);
  void Put(uint64_t key, KeySize size);
  std::optional<KeySize> Get(uint64_t key, int64_t now_ms);
  void Erase(uint64_t key);
  bool empty() const { return count_.load(std::memory_order_relaxed) == 0; }
  bool IsBig(const KeySize& s) const { return shards_[0]->cache.IsBig(s); }

 private:
  struct Shard {
    explicit Shard(const Settings& s) : cache(s, kShards) {}
    std::mutex mu;
    SizeCache cache;
  };
  std::array<std::unique_ptr<Shard>, kShards> shards_;
  std::atomic<int64_t> count_{0};
};

// What the detectors may do with a command, from its traits alone (SharedDetectors::plans):
// decided once per command id, so that a command with nothing to check before it is forwarded
// (GET, INCR, HSET without ttl_patterns, ...) costs one lookup (ConnectionDetectors::Quick).
enum Plan : uint8_t {
  kPlanCheck = 3,                // the ReplyCheck for its reply: none, kStringRead or kCollectionRead
  kPlanWrite = 1 << 2,           // a string write (Traits::value_pos, pairs)
  kPlanRole = 1 << 3,            // KEYS, FLUSHALL/FLUSHDB, DEL, UNLINK
  kPlanTtl = 1 << 4,             // gives a TTL (ttl_unit), or may among its options (options_from)
  kPlanTtlPattern = 1 << 5,      // should have one (needs_ttl, creates): only with ttl_patterns
  kPlanProbe = 1 << 6,           // its reply does not show the key's size: only with the probe
  kPlanCollectionRead = 1 << 7,  // reads a collection whole: only when whole_collection_read rejects
};

// What every connection of the process shares, whichever worker accepted it: a read-modify-write
// race between two connections is seen the same when the kernel put them on different workers.
// Sharded by the fingerprint of the key (of its parent, of its pattern); each shard has its own
// lock, held only for its tracker's bounded in-memory work, so workers meet only on one shard.
// The common commands take no lock: plain values while no serialized key is tracked, and keys
// whose last segment is an id.
class SharedDetectors {
 public:
  static constexpr size_t kShards = 16;
  // Settings::tracked_keys (and ExpiryClusters::kPatterns) are divided among the shards.
  explicit SharedDetectors(const Settings& s);

  // RmwTracker's, in the key's shard.
  void OnRead(std::string_view key, uint64_t connection, std::string_view value, int64_t now_ms, uint64_t scope);
  void OnWrite(std::string_view key, uint64_t connection, std::string_view value, bool watched, int64_t now_ms,
               std::vector<RmwTracker::Result>* out, uint64_t scope);
  // No serialized key tracked anywhere: writes cannot find anything.
  bool rmw_idle() const { return rmw_tracked_.load(std::memory_order_relaxed) == 0; }
  // AttributeTracker's, in the shard of the key's parent (`parent_name`, as ParentOf found it).
  bool OnAttributeWrite(std::string_view key, std::string_view parent_name, std::string* parent,
                        std::vector<std::string>* attributes, uint64_t scope);
  // ExpiryClusters::Add, in the pattern's shard.
  int64_t AddExpiry(uint64_t pattern, int64_t second, int64_t now_ms);
  // What the detectors may do with a command: its Plan bits, and for a string write of one value
  // that nothing may follow (SET k v, SETNX, GETSET, APPEND, SETRANGE: no TTL argument, no other
  // role) the value's position, with kWriteReplaces when it replaces the whole value (0: none).
  struct CommandPlan {
    uint8_t plan;
    uint8_t write;
  };
  static constexpr uint8_t kWriteReplaces = 0x80;
  // The plans by command id, for every id a CommandId can hold: those of the command table as it
  // was when this was made; a later id gets every Plan bit (the full path).
  const CommandPlan* plans() const { return plans_->data(); }

 private:
  struct Shard {
    explicit Shard(const Settings& s)
        : rmw(s, kShards), attributes(s, kShards), expiries(s, ExpiryClusters::kPatterns / kShards) {}
    std::mutex mu;
    RmwTracker rmw;
    AttributeTracker attributes;
    ExpiryClusters expiries;
  };
  Shard& ShardOf(uint64_t hash) { return *shards_[hash % kShards]; }

  std::array<std::unique_ptr<Shard>, kShards> shards_;
  std::atomic<int64_t> rmw_tracked_{0};  // keys in every shard's RmwTracker
  // By command id, every id a CommandId can hold: no bounds check.
  std::unique_ptr<std::array<CommandPlan, size_t{1} << (8 * sizeof(commands::CommandId))>> plans_;

 public:
  SharedSizeCache sizes;  // key sizes seen lately, by any connection
};

// A connection id unique in the process (the trackers tell connections apart by it).
uint64_t NewConnectionId();

// What a worker's connections share: the process's SharedDetectors and the worker's own state.
struct WorkerDetectors {
  // `shared`: the process's, which outlives this (nullptr: one of its own, for a single worker).
  explicit WorkerDetectors(const Settings& s, SharedDetectors* shared = nullptr)
      : own_(shared == nullptr ? std::make_unique<SharedDetectors>(s) : nullptr),
        shared(shared != nullptr ? *shared : *own_),
        sizes(this->shared.sizes),
        probe_queue(s) {}

 private:
  std::unique_ptr<SharedDetectors> own_;

 public:
  SharedDetectors& shared;                          // read-modify-write, attributes, expiry clustering
  SharedSizeCache& sizes;                           // key sizes seen lately (shared.sizes)
  ProbeQueue probe_queue;                           // keys waiting for the sizing probe
  std::minstd_rand random{std::random_device{}()};  // TTL jitter
};

// The arguments of one command as the stages rewrite them: the stage input until the first edit,
// then a copy; the strings the edits made are owned here until the command is encoded.
class ArgEditor {
 public:
  void Reset(std::span<const std::string_view> base) {
    base_ = base;
    modified_ = false;
  }
  // The arguments to edit in place (copied from the input on the first call).
  std::vector<std::string_view>& Edit() {
    if (!modified_) {
      args_.assign(base_.begin(), base_.end());
      modified_ = true;
    }
    return args_;
  }
  // Keeps `s` alive until Release: the view may be stored in Edit()'s arguments.
  std::string_view Own(std::string s) { return owned_.emplace_back(std::move(s)); }
  bool modified() const { return modified_; }
  std::span<const std::string_view> input() const { return base_; }
  std::span<const std::string_view> args() const {
    return modified_ ? std::span<const std::string_view>(args_) : base_;
  }
  // The command has been encoded: the owned strings may go.
  void Release() {
    if (!owned_.empty()) owned_.clear();
  }

 private:
  std::span<const std::string_view> base_;
  std::vector<std::string_view> args_;
  std::deque<std::string> owned_;
  bool modified_ = false;
};

// Where findings go. The proxy stamps who and where (client, tenant, key pattern, command name,
// the rule's action) and counts and logs them.
class FindingSink {
 public:
  virtual ~FindingSink() = default;
  // Fills `f`'s key, key pattern, command, client, tenant and action for `key` (the client's
  // name) under command `id`.
  virtual void Stamp(Finding* f, std::string_view key, commands::CommandId id) = 0;
  // A stamped finding.
  virtual void Report(Finding f) = 0;
  // The sizing probe has work queued.
  virtual void WakeProbe() = 0;
};

// What the detectors look for in a command's reply (Pending::reply_check).
// kCollectionWrite: a collection write to a key that needs a TTL, whose reply says whether it
// created the key.
enum ReplyCheck : uint8_t { kNoReplyCheck = 0, kStringRead = 1, kCollectionRead = 2, kCollectionWrite = 3 };

class ConnectionDetectors {
 public:
  // `connection`: a per-worker id for the trackers (which connection read and wrote a key).
  ConnectionDetectors(const Settings& settings, WorkerDetectors& worker, FindingSink& sink, uint64_t connection)
      : settings_(settings), w_(worker), sink_(sink), connection_(connection), plans_(worker.shared.plans()) {}

  // The scope of every key hash: the tenant's fingerprint (kFnvBasis without one).
  void set_scope(uint64_t scope) { scope_ = scope; }
  uint64_t SizeKey(std::string_view key) const { return Fingerprint(key, scope_); }

  // One command before it is forwarded. `args` are the client's own names; `edit` holds what
  // the earlier stages made of them (the server's names, for the sizing probe) and takes the
  // detectors' rewrites. Returns what to look for in the reply; `*refusal` is set when a finding
  // whose rule rejects fired (the command must not be forwarded).
  uint8_t OnRequest(commands::CommandId id, std::span<const std::string_view> args, ArgEditor& edit, bool watching,
                    bool tenant, std::string* refusal);
  // OnRequest in one lookup, for a command that has nothing to check before it is forwarded
  // under the settings (most commands): returns true with what OnRequest would return in
  // `*check`; false when OnRequest must run. A string write of one value with nothing after it
  // (SET k v, SETNX, GETSET, APPEND) passes when it shows nothing (QuickWrite). Reads the
  // settings on every call, like OnRequest.
  bool Quick(commands::CommandId id, std::span<const std::string_view> args, uint8_t* check) const {
    const SharedDetectors::CommandPlan p = plans_[id];
    const uint8_t plan = p.plan;
    if (!pending_ttl_.empty()) return false;
    // Nothing to check before it goes, whatever the settings (GET, INCR): one test.
    if ((plan & ~kPlanCheck) == 0) {
      *check = args.size() > 1 ? plan & kPlanCheck : kNoReplyCheck;
      return true;
    }
    if ((plan & kPlanRole) != 0) return false;
    if ((plan & (kPlanWrite | kPlanTtl)) != 0 && !QuickWrite(p.write, args)) return false;
    if ((plan & kPlanTtlPattern) != 0 && !settings_.ttl_patterns.empty()) return false;
    if ((plan & kPlanProbe) != 0 && settings_.probe) return false;
    if ((plan & kPlanCollectionRead) != 0 && settings_.action(Kind::kWholeCollectionRead) == Action::kReject) {
      return false;
    }
    *check = args.size() > 1 ? plan & kPlanCheck : kNoReplyCheck;
    return true;
  }
  // The reply (not an error) to a command OnRequest asked to see: `key` is its first key (the
  // client's name), `scope` the scope of the connection when the reply arrived.
  void OnReply(commands::CommandId id, uint8_t check, std::string_view key, char type, int64_t size,
               std::string_view bulk, uint64_t scope) {
    // The common read: a small value that is no serialized object, while no such key is tracked.
    if (check == kStringRead && (type != '$' || (bulk.size() < settings_.big_string_bytes && w_.shared.rmw_idle() &&
                                                 DetectFormat(bulk) == Format::kNone))) {
      return;
    }
    OnReplyFull(id, check, key, type, size, bulk, scope);
  }
  // Writes without a TTL whose window for an EXPIRE passed (all of them when the connection ends).
  void FlushPendingTtl(bool all);
  bool has_pending_ttl() const { return !pending_ttl_.empty(); }

 private:
  // Whether a string write of one value (`write`: SharedDetectors::CommandPlan::write) has
  // nothing after its value and shows nothing: small, no size known for any key, and no hash
  // candidate (the last segment of its name is an id) or serialized key to follow.
  bool QuickWrite(uint8_t write, std::span<const std::string_view> args) const {
    const size_t pos = write & ~SharedDetectors::kWriteReplaces;
    if (pos == 0 || args.size() != pos + 1) return false;
    const std::string_view value = args[pos];
    if (value.size() >= settings_.big_string_bytes || !w_.sizes.empty()) return false;
    if ((write & SharedDetectors::kWriteReplaces) == 0) return true;
    std::string_view parent;
    if (value.size() < 256 && DetectFormat(value) == Format::kNone && AttributeTracker::ParentOf(args[1], &parent)) {
      return false;
    }
    return w_.shared.rmw_idle();
  }
  void OnReplyFull(commands::CommandId id, uint8_t check, std::string_view key, char type, int64_t size,
                   std::string_view bulk, uint64_t scope);
  // `can_act`: false when the command is not the one in hand (or cannot carry the fix): a reject
  // or rewrite rule then reports a warn.
  void Emit(Finding f, std::string_view key, commands::CommandId id, bool can_act = true);
  // A collection write without a TTL to a key of a ttl pattern: waits for an EXPIRE, and for its
  // reply to say whether it created the key. Returns true when the reply is needed.
  bool PendCollectionTtl(commands::CommandId id, std::span<const std::string_view> args, commands::CreatesKey creates);
  void DetectTtl(commands::CommandId id, std::span<const std::string_view> args, ArgEditor& edit);
  void RememberSize(std::string_view key, std::string_view type, int64_t bytes, int64_t elements);
  void FlushPendingTtlFront();
  // The index of the first ttl pattern `key` matches, or -1.
  int TtlPatternOf(std::string_view key) const;
  // Waits for an EXPIRE of `key` on this connection, within missing_ttl_window_ms (the list is
  // bounded: the oldest entry is reported early when it is full).
  void PendTtl(std::string_view key, int pattern, commands::CommandId id, bool collection, int64_t expect);

  const Settings& settings_;
  WorkerDetectors& w_;
  FindingSink& sink_;
  uint64_t connection_;
  const SharedDetectors::CommandPlan* plans_;  // w_.shared's, by command id
  uint64_t scope_ = kFnvBasis;
  std::string* refusal_ = nullptr;  // during OnRequest: where a rejecting finding's text goes
  // Writes without a TTL to cache/session patterns, waiting for an EXPIRE on this connection.
  struct PendingTtl {
    std::string key;
    int64_t deadline_ms;
    uint32_t pattern;
    commands::CommandId command;
    bool collection = false;  // a collection write: no rule can refuse or rewrite it
    int64_t expect = -1;      // a collection write's reply that shows it created the key (-1: known)
  };
  static constexpr size_t kMaxPendingTtl = 64;
  std::deque<PendingTtl> pending_ttl_;
};

// Hot and big keys as traffic shows them (HotKeys, one per worker). The key counted is the
// command's first key when the command traits say it is args[1] (GET, SET, HGETALL, INCR, ...: no
// FindKeys on the hot path), as the client named it (before tenant prefixing or key-policy
// rewrites), with `tenant` ("" without tenancy) reported beside it.
//
// One command HotKeys::Sample chose (about one in Settings::hot_keys_sample; the caller asks, so
// that every other command costs only that), before it is forwarded: a command with a first key
// records the sizes its string writes show, sets `*request_bytes` to `request_len` (capped), and
// returns true: its reply must come to HotKeyReply with args[1], to count the access and read the
// size the reply shows. The largest keys therefore see the sampled commands, as the sketches do
// (every command with hot_keys_sample: 1).
//
// Inline: sizes that could enter the largest keys go to HotKeySize.
inline bool HotKeyRequest(HotKeys& hot, commands::CommandId id, std::span<const std::string_view> args,
                          std::string_view tenant, size_t request_len, uint32_t* request_bytes);
// The reply (an error too) to a command HotKeyRequest asked to see: `key` is its args[1],
// `request_bytes` what HotKeyRequest left there; the reply's `type` (its RESP type byte), `size`
// (an aggregate's length), `bulk` (a bulk string's or an integer's text) and `frame_len` (its bytes).
inline void HotKeyReply(HotKeys& hot, commands::CommandId id, std::string_view tenant, std::string_view key,
                        uint32_t request_bytes, char type, int64_t size, std::string_view bulk, size_t frame_len);

// A size seen for `key` (collection members when `elements`, else string bytes) that the largest
// keys admit.
void HotKeySize(HotKeys& hot, commands::CommandId id, std::string_view tenant, std::string_view key, bool elements,
                uint64_t size);
// HotKeyRequest's string writes of several values (MSET).
void HotKeyPairs(HotKeys& hot, commands::CommandId id, std::span<const std::string_view> args, std::string_view tenant);
// HotKeyReply's integer and aggregate replies (STRLEN, HLEN, HGETALL, ...).
void HotKeyReplySize(HotKeys& hot, commands::CommandId id, std::string_view tenant, std::string_view key, char type,
                     int64_t size, std::string_view bulk);

inline bool HotKeyRequest(HotKeys& hot, commands::CommandId id, std::span<const std::string_view> args,
                          std::string_view tenant, size_t request_len, uint32_t* request_bytes) {
  if (args.size() < 2) return false;
  const commands::Traits& info = commands::TraitsOf(id);
  if (!info.first_key) return false;
  if (info.sized_write) {
    if (info.value_pos > 0 && args.size() > static_cast<size_t>(info.value_pos)) {
      const std::string_view value = args[info.value_pos];
      if (!value.empty() && hot.Admits(false, value.size())) HotKeySize(hot, id, tenant, args[1], false, value.size());
    } else if (info.pairs) {
      HotKeyPairs(hot, id, args, tenant);
    }
  }
  *request_bytes = static_cast<uint32_t>(std::min<size_t>(request_len, UINT32_MAX));
  return true;
}

inline void HotKeyReply(HotKeys& hot, commands::CommandId id, std::string_view tenant, std::string_view key,
                        uint32_t request_bytes, char type, int64_t size, std::string_view bulk, size_t frame_len) {
  if (request_bytes != 0) {
    hot.Access(absl::string_view(tenant.data(), tenant.size()), absl::string_view(key.data(), key.size()),
               request_bytes + frame_len);
  }
  switch (commands::TraitsOf(id).reply) {
    case commands::ReplyShows::kValue:
      if (type == '$' && !bulk.empty() && hot.Admits(false, bulk.size())) {
        HotKeySize(hot, id, tenant, key, false, bulk.size());
      }
      return;
    case commands::ReplyShows::kNothing:
    case commands::ReplyShows::kComputedMembers: return;  // the set operations: not one key's size
    case commands::ReplyShows::kLength:
    case commands::ReplyShows::kCount:
    case commands::ReplyShows::kMembers: HotKeyReplySize(hot, id, tenant, key, type, size, bulk); return;
  }
}

}  // namespace keyguard::hygiene
