// A read buffer that holds unparsed bytes contiguously, grows once to a framer's length hint,
// grows geometrically otherwise, and shrinks back to its default size when it empties.
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>

#include "proxy/asio.h"

namespace keyguard::proxy {

class ReadBuffer {
 public:
  explicit ReadBuffer(size_t default_capacity)
      : default_cap_(default_capacity), min_free_(std::max<size_t>(default_capacity / 4, 512)) {}

  const char* data() const { return data_.get() + begin_; }
  size_t size() const { return end_ - begin_; }
  size_t capacity() const { return cap_; }

  // Makes room to read: at least `min_free_` free bytes, and room for `hint` bytes from data()
  // (a framer's hint for a large bulk), so a big frame needs one allocation.
  void Prepare(size_t hint) {
    const size_t len = size();
    if (len == 0) {
      begin_ = end_ = 0;
      if (cap_ > default_cap_ && hint <= default_cap_) Reallocate(default_cap_);
    }
    if (!data_) Reallocate(default_cap_);
    const size_t need = std::max(hint, len + min_free_);
    if (need > cap_) {
      Reallocate(std::max(need, std::min(cap_ * 2, need + (cap_ < (64u << 20) ? cap_ : (64u << 20)))));
    } else if (begin_ + need > cap_) {
      std::memmove(data_.get(), data_.get() + begin_, len);
      begin_ = 0;
      end_ = len;
    }
  }
  asio::mutable_buffer free_space() { return asio::buffer(data_.get() + end_, cap_ - end_); }
  void Commit(size_t n) { end_ += n; }
  void Consume(size_t n) {
    begin_ += n;
    if (begin_ == end_) begin_ = end_ = 0;
  }

 private:
  void Reallocate(size_t cap) {
    std::unique_ptr<char[]> fresh(new char[cap]);
    const size_t len = size();
    if (len) std::memcpy(fresh.get(), data_.get() + begin_, len);
    data_ = std::move(fresh);
    cap_ = cap;
    begin_ = 0;
    end_ = len;
  }

  size_t default_cap_;
  size_t min_free_;
  std::unique_ptr<char[]> data_;
  size_t cap_ = 0;
  size_t begin_ = 0;
  size_t end_ = 0;
};

}  // namespace keyguard::proxy
