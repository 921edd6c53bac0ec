#include "proxy/reply_queue.h"

#include <algorithm>

namespace keyguard::proxy {

bool ReplyQueue::QueueLocal(std::string& text, commands::CommandId id, bool close_after) {
  if (empty()) return false;
  Pending& p = Append();
  p = Pending{};
  p.kind = Pending::Kind::kLocal;
  p.command = id;
  p.close_after = close_after;
  p.text = std::move(text);
  return true;
}

bool ReplyQueue::ClientWaiting() const {
  return std::any_of(begin(), end(), [](const Pending& p) { return p.kind != Pending::Kind::kInternal; });
}

std::string ReplyQueue::Abort(std::string_view error, std::vector<commands::CommandId>* failed) {
  std::string out;
  for (size_t i = 0; i < size_; ++i) {
    const Pending& p = At(i);
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

void ReplyQueue::Grow() {
  std::vector<Pending> ring(ring_.empty() ? 16 : 2 * ring_.size());
  for (size_t i = 0; i < size_; ++i) ring[i] = std::move(ring_[(head_ + i) & (ring_.size() - 1)]);
  ring_ = std::move(ring);
  head_ = 0;
}

void ReplyQueue::GrowKeys(size_t more) { key_arena_.resize(std::max(key_bytes_ + more, 2 * key_arena_.size())); }

void ReplyQueue::TrimKeys() {
  if (empty()) {
    ClearKeys();
    return;
  }
  // Keys are appended in queue order: the first pending entry with a key holds the oldest one.
  for (const Pending& q : *this) {
    if (!q.keyed) continue;
    const size_t consumed = static_cast<size_t>(q.key_off - key_arena_base_);
    if (consumed > key_bytes_ / 2) {
      std::memmove(key_arena_.data(), key_arena_.data() + consumed, key_bytes_ - consumed);
      key_bytes_ -= consumed;
      key_arena_base_ = q.key_off;
    }
    return;
  }
  ClearKeys();  // no pending entry holds a key
}

}  // namespace keyguard::proxy
