// The replies a client is owed, in the order it sent the commands: one entry per command that
// expects a reply, including replies keyguard makes itself. Sans-io: the session feeds it and
// drains it; tests drive it directly.
#pragma once

#include <cstdint>
#include <cstddef>
#include <cstring>
#include <deque>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keyguard/commands/command_table.h"
#include "keyguard/common/views.h"

namespace keyguard::proxy {

// A pending entry's fixed-size fields (Pending resets them in place, see ReplyQueue::Stage).
struct PendingFields {
  enum class Kind : uint8_t {
    kForward,            // plain command: one reply
    kLocal,              // keyguard's own reply in `text`
    kSubscribe,          // (p|s)(un)subscribe: one confirmation per channel
    kHello,              // switches RESP2/RESP3 when it succeeds
    kMonitor,            // +OK starts the MONITOR stream
    kReset,              // +RESET ends subscribe mode, MONITOR and RESP3
    kExecAbort,          // EXEC of a transaction keyguard poisoned: DISCARD was sent, reply is EXECABORT
    kInternal,           // keyguard's own command (upstream AUTH, CLIENT ID): the reply is not the client's
    kReplicationStream,  // SYNC/PSYNC: from its reply on, upstream bytes are a stream passed as they are
    kWalk,               // a tenant's FLUSH*/DBSIZE/RANDOMKEY: replies are walk steps; the session answers
  };
  Kind kind = Kind::kForward;
  commands::CommandId command = commands::kUnknownCommand;
  bool close_after = false;  // kLocal: close the connection once this reply is delivered
  bool hidden = false;       // the reply is read, not delivered (RESET after CLIENT REPLY SKIP)
  uint8_t confirm = 0;       // kSubscribe: index into kConfirmNames
  int8_t hello_version = 0;  // kHello: 2, 3 or 0 (unchanged)
  int64_t expected = 1;      // kSubscribe: confirmations still due, -1 = all channels of a kind
  int64_t start_ns = 0;
  uint8_t reply_check = 0;  // hygiene: what to look at in the reply (see session.cc)
  uint32_t key_len = 0;     // with `keyed`: the key, in the queue's key arena
  uint64_t key_off = 0;
  bool keyed = false;          // the key (args[1]) is in the key arena, for reply_check or hot keys
  bool hot = false;            // hot keys: the reply goes to HotKeyReply
  bool renamed = false;        // the reply's key names go back to the client's (ReplyQueue::RenamesOf)
  uint32_t request_bytes = 0;  // hot keys: the request's bytes; 0 when the command is not tracked
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
  uint8_t rewrite = 0;  // tenancy: tenant::ReplyRewrite of the reply
};

// A command waiting for its reply, or a reply keyguard made.
struct Pending : PendingFields {
  std::vector<uint8_t> exec_rewrites;  // tenancy, EXEC: the rewrite of each queued command
  std::string text;                    // kLocal: the reply
  // Back to a new entry's values, keeping the buffers' capacity.
  void Reset() {
    static_cast<PendingFields&>(*this) = PendingFields{};
    exec_rewrites.clear();
    text.clear();
  }
};

// Whether a reply (its type byte and first line) is what `expect` allows. Inline: every reply
// of a tenant is checked.
inline bool AsExpected(Pending::Expect expect, char type, std::string_view line) {
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

// The key names a command's reply carries that the key policy renamed: (new name, the client's).
struct Renames {
  uint8_t shape = 0;  // tenant::ReplyRewrite kFirstKey or kStreams
  std::vector<std::pair<std::string, std::string>> names;
};

class ReplyQueue {
 public:
  class const_iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = Pending;
    using difference_type = std::ptrdiff_t;
    using pointer = const Pending*;
    using reference = const Pending&;
    const_iterator() = default;
    const_iterator(const ReplyQueue* q, size_t i) : q_(q), i_(i) {}
    const Pending& operator*() const { return q_->At(i_); }
    const Pending* operator->() const { return &q_->At(i_); }
    const_iterator& operator++() {
      ++i_;
      return *this;
    }
    const_iterator operator++(int) {
      const_iterator old = *this;
      ++i_;
      return old;
    }
    bool operator==(const const_iterator& o) const { return i_ == o.i_; }

   private:
    const ReplyQueue* q_ = nullptr;
    size_t i_ = 0;
  };

  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  Pending& front() { return ring_[head_]; }
  const Pending& front() const { return ring_[head_]; }
  const_iterator begin() const { return const_iterator(this, 0); }
  const_iterator end() const { return const_iterator(this, size_); }

  // Entries live in a ring of slots that grows to the deepest pipeline seen and is reused: no
  // allocation per command once the ring fits.
  Pending& Push(Pending&& p) {
    Pending& slot = Append();
    slot = std::move(p);
    return slot;
  }
  // The common case without a move: the slot the next entry goes in, reset to a new entry's
  // values. Fill it, then Commit() it, or leave it uncommitted (nothing is queued); nothing else
  // may be pushed in between.
  Pending& Stage() {
    if (size_ == ring_.size()) Grow();
    Pending& slot = ring_[(head_ + size_) & (ring_.size() - 1)];
    slot.Reset();
    return slot;
  }
  void Commit() { ++size_; }
  // Ends the head entry. An empty queue holds no keys (a long one drops its consumed keys when
  // the next key is attached: AttachKey). Inlined: it runs for every reply.
  [[gnu::always_inline]] void Pop() {
    if (front().renamed) renames_.pop_front();
    head_ = (head_ + 1) & (ring_.size() - 1);
    if (--size_ == 0) ClearKeys();
  }
  // keyguard's own reply, in its place after every earlier reply. False when nothing is pending:
  // then nothing was queued and the caller sends `text` at once.
  bool QueueLocal(std::string& text, commands::CommandId id, bool close_after);
  // Whether the head entry is a reply keyguard made, due now.
  bool LocalAtHead() const { return size_ != 0 && front().kind == Pending::Kind::kLocal; }
  // Ends the head entry (LocalAtHead) and returns its text.
  std::string TakeLocal() {
    std::string text = std::move(front().text);
    Pop();
    return text;
  }
  // Whether an entry waits for a reply the client sees (keyguard's own AUTH does not count).
  bool ClientWaiting() const;
  // Ends every entry: returns what the client is owed in their place (keyguard's replies as
  // they are, `error` for each command), and appends the commands that failed to `failed`.
  std::string Abort(std::string_view error, std::vector<commands::CommandId>* failed);
  void Clear() {
    head_ = size_ = 0;
    ClearKeys();
    renames_.clear();
  }

  // The names the reply of the next entry pushed with `renamed` carries that were renamed ((new,
  // the client's) pairs, copied). UnstageRenames takes them back when no entry follows.
  void StageRenames(uint8_t shape, std::span<const std::pair<std::string_view, std::string_view>> names) {
    Renames& r = renames_.emplace_back();
    r.shape = shape;
    for (const auto& [to, from] : names) r.names.emplace_back(to, from);
  }
  void UnstageRenames() { renames_.pop_back(); }
  // The head entry's renames (front().renamed).
  const Renames& HeadRenames() const { return renames_.front(); }

  // The command's first key, kept for its reply (hygiene, hot keys): `p` must be the entry about
  // to be pushed, and keys are attached in push order. Past kTrimBytes, the keys of entries no
  // longer pending are dropped first.
  void AttachKey(Pending* p, std::string_view key) {
    if (key_bytes_ >= kTrimBytes) TrimKeys();
    p->keyed = true;
    p->key_off = key_arena_base_ + key_bytes_;
    p->key_len = static_cast<uint32_t>(key.size());
    if (key_bytes_ + key.size() > key_arena_.size()) GrowKeys(key.size());
    CopyBytes(key_arena_.data() + key_bytes_, key.data(), key.size());
    key_bytes_ += key.size();
  }
  std::string_view KeyOf(const Pending& p) const {
    return std::string_view(key_arena_.data() + (p.key_off - key_arena_base_), p.key_len);
  }
  size_t key_arena_bytes() const { return key_bytes_; }
  // Slots the ring holds (tests: it grows to the deepest queue, and no further).
  size_t capacity() const { return ring_.size(); }

 private:
  static constexpr size_t kTrimBytes = 64 * 1024;  // the arena is trimmed past this size

  // The i-th pending entry (0 is the head).
  const Pending& At(size_t i) const { return ring_[(head_ + i) & (ring_.size() - 1)]; }
  // A slot after the last entry, counted as pending; it holds whatever its last entry left.
  Pending& Append() {
    if (size_ == ring_.size()) Grow();
    Pending& slot = ring_[(head_ + size_) & (ring_.size() - 1)];
    ++size_;
    return slot;
  }
  void Grow();
  void TrimKeys();
  // Room in the arena for `more` bytes after the ones in use.
  void GrowKeys(size_t more);
  void ClearKeys() {
    key_arena_base_ += key_bytes_;
    key_bytes_ = 0;
  }

  std::vector<Pending> ring_;  // a power of two in size (or empty), entries from head_ on
  size_t head_ = 0;
  size_t size_ = 0;
  // Keys of pending entries, appended in request order; offsets are absolute (key_arena_base_ +
  // position), so the consumed front can be dropped without touching the entries.
  // Its first key_bytes_ bytes are in use; it only grows (GrowKeys), so that a key is one copy.
  std::string key_arena_;
  size_t key_bytes_ = 0;
  uint64_t key_arena_base_ = 0;
  std::deque<Renames> renames_;  // of the entries with `renamed`, in queue order
};

}  // namespace keyguard::proxy
