#include "proxy/reply_queue.h"

#include <algorithm>

namespace keyguard::proxy {

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

bool ReplyQueue::QueueLocal(std::string& text, commands::CommandId id, bool close_after) {
  if (q_.empty()) return false;
  Pending& p = q_.emplace_back();
  p.kind = Pending::Kind::kLocal;
  p.command = id;
  p.close_after = close_after;
  p.text = std::move(text);
  return true;
}

bool ReplyQueue::ClientWaiting() const {
  return std::any_of(q_.begin(), q_.end(), [](const Pending& p) { return p.kind != Pending::Kind::kInternal; });
}

std::string ReplyQueue::Abort(std::string_view error, std::vector<commands::CommandId>* failed) {
  std::string out;
  for (Pending& p : q_) {
    if (p.kind == Pending::Kind::kLocal) {
      out += p.text;
    } else if (p.kind != Pending::Kind::kInternal) {
      failed->push_back(p.command);
      out += error;
    }
  }
  Clear();
  return out;
}

void ReplyQueue::AttachKey(Pending* p, std::string_view key) {
  p->keyed = true;
  p->key_off = key_arena_base_ + key_arena_.size();
  p->key_len = static_cast<uint32_t>(key.size());
  key_arena_.append(key.data(), key.size());
}

void ReplyQueue::TrimKeys() {
  if (q_.empty()) {
    ClearKeys();
    return;
  }
  if (key_arena_.size() < 64 * 1024) return;
  // Keys are appended in queue order: the first pending entry with a key holds the oldest one.
  for (const Pending& q : q_) {
    if (!q.keyed) continue;
    const size_t consumed = static_cast<size_t>(q.key_off - key_arena_base_);
    if (consumed > key_arena_.size() / 2) {
      key_arena_.erase(0, consumed);
      key_arena_base_ = q.key_off;
    }
    return;
  }
}

}  // namespace keyguard::proxy
