// The bytes of rewritten commands, while a batch's gather list points at them: chunks that never
// move (a chunk is only written within its capacity; a new one starts when it is full) and are
// reused by the next batch. Raw memory: nothing is zero-filled or copied twice.
#pragma once

#include <algorithm>
#include <cstddef>
#include <deque>
#include <memory>

namespace keyguard::proxy {

class Scratch {
 public:
  // Room for `n` bytes at the end of the current chunk (a new chunk when it has not).
  char* Reserve(size_t n) {
    if (chunks_.empty() || chunks_.back().cap - chunks_.back().size < n) {
      Chunk& c = chunks_.emplace_back();
      c.cap = std::max<size_t>(n, kChunk);
      c.data.reset(new char[c.cap]);  // not zero-filled: every byte is written before it is read
    }
    Chunk& c = chunks_.back();
    return c.data.get() + c.size;
  }
  // The first `n` bytes written at Reserve's pointer are kept until Reset.
  void Commit(size_t n) { chunks_.back().size += n; }
  // The batch was sent: keeps the first chunk's memory for the next one.
  void Reset() {
    if (chunks_.size() > 1) chunks_.resize(1);
    if (!chunks_.empty()) chunks_.front().size = 0;
  }

 private:
  static constexpr size_t kChunk = 64 * 1024;
  struct Chunk {
    std::unique_ptr<char[]> data;
    size_t size = 0;
    size_t cap = 0;
  };
  std::deque<Chunk> chunks_;
};

}  // namespace keyguard::proxy
