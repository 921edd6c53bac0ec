#include "keyguard/resp/framer.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace keyguard::resp {
namespace {

// Reads a non-negative decimal terminated by '\r' starting at p (p < end). Returns the position
// of the '\r', or nullptr when the fast path does not apply (sign, leading zero, other bytes, no
// '\r' in reach, too many digits); callers then take the exact slow path.
inline const char* FastDigits(const char* p, const char* end, int64_t* out) {
  const char* start = p;
  const char* limit = end - p > 18 ? p + 18 : end;  // 18 digits always fit in int64
  int64_t v = 0;
  while (p < limit && static_cast<unsigned>(*p - '0') <= 9) {
    v = v * 10 + (*p - '0');
    ++p;
  }
  const size_t n = p - start;
  if (p >= end || *p != '\r' || n == 0 || (n > 1 && *start == '0')) return nullptr;
  *out = v;
  return p;
}

// FastDigits with the lengths most arguments have (one to three digits) read without a loop. The
// same answer as FastDigits for any input.
inline const char* ShortDigits(const char* p, const char* end, int64_t* out) {
  if (end - p >= 4) {
    const unsigned d0 = static_cast<unsigned>(p[0] - '0');
    if (d0 <= 9) {
      if (p[1] == '\r') {
        *out = d0;
        return p + 1;
      }
      const unsigned d1 = static_cast<unsigned>(p[1] - '0');
      if (d0 != 0 && d1 <= 9) {
        if (p[2] == '\r') {
          *out = d0 * 10 + d1;
          return p + 2;
        }
        const unsigned d2 = static_cast<unsigned>(p[2] - '0');
        if (d2 <= 9 && p[3] == '\r') {
          *out = d0 * 100 + d1 * 10 + d2;
          return p + 3;
        }
      }
    }
  }
  return FastDigits(p, end, out);
}

}  // namespace

bool ParseRedisInt(std::string_view s, int64_t* out) {
  // Mirrors Redis's string2ll (util.c) so that we accept and refuse the same count lines.
  const char* p = s.data();
  size_t plen = s.size();
  if (plen == 0 || plen > 20) return false;
  if (plen == 1 && p[0] == '0') {
    *out = 0;
    return true;
  }
  bool negative = false;
  size_t i = 0;
  if (p[0] == '-') {
    negative = true;
    ++i;
    if (i == plen) return false;
  }
  uint64_t v;
  if (p[i] >= '1' && p[i] <= '9') {
    v = p[i] - '0';
    ++i;
  } else {
    return false;
  }
  for (; i < plen; ++i) {
    if (p[i] < '0' || p[i] > '9') return false;
    if (v > std::numeric_limits<uint64_t>::max() / 10) return false;
    v *= 10;
    const uint64_t d = p[i] - '0';
    if (v > std::numeric_limits<uint64_t>::max() - d) return false;
    v += d;
  }
  if (negative) {
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) + 1) return false;
    *out = static_cast<int64_t>(0 - v);
  } else {
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(v);
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// RequestFramer

void RequestFramer::Reset() {
  in_frame_ = false;
  inline_unended_ = false;
  scan_ = 0;
  pos_ = 0;
  remaining_ = 0;
  bulk_len_ = -1;
  offsets_.clear();
}

Status RequestFramer::Fail(std::string text) {
  error_ = std::move(text);
  Reset();
  return Status::kProtocolError;
}

Status RequestFramer::Park(const char* data, Status status) {
  // The frame is incomplete: keep its arguments as offsets, since the caller may move the bytes
  // before the next call.
  offsets_.clear();
  for (std::string_view a : args()) offsets_.emplace_back(static_cast<size_t>(a.data() - data), a.size());
  arg_count_ = 0;
  return status;
}

Status RequestFramer::Next(const char* data, size_t len) {
  // Fast path: a frame of at most kFastArgs arguments that arrived whole (nearly every command)
  // is cut on locals, with no member written per argument. Anything else (an incomplete frame, a
  // length the short digit parse does not take, a protocol error) goes to NextSlow from the frame
  // start: same result, same errors.
  if (!in_frame_ && scan_ == 0 && len >= 4 && data[0] == '*') {
    const char* end = data + len;
    int64_t count;
    const char* cr = ShortDigits(data + 1, end, &count);
    if (cr != nullptr && end - cr >= 2 && count > 0 && count <= kFastArgs && count <= limits_.max_multibulk_len) {
      if (args_.size() < static_cast<size_t>(count)) args_.resize(kFastArgs);
      std::string_view* out = args_.data();
      const char* p = cr + 2;
      int64_t taken = 0;
      while (taken < count) {
        // The shortest argument is "$0\r\n\r\n"; "$<len>\r\n<payload>\r\n" must be here whole.
        if (end - p < 6 || *p != '$') break;
        int64_t blen;
        const char* bcr = ShortDigits(p + 1, end, &blen);
        if (bcr == nullptr || blen > limits_.max_bulk_len || end - bcr < blen + 4) break;
        out[taken++] = std::string_view(bcr + 2, static_cast<size_t>(blen));
        p = bcr + 4 + blen;
      }
      if (taken == count) {
        hint_ = 0;
        is_inline_ = false;
        arg_count_ = static_cast<size_t>(count);
        consumed_ = p - data;
        return Status::kOk;
      }
    }
  }
  return NextSlow(data, len);
}

Status RequestFramer::NextSlow(const char* data, size_t len) {
  hint_ = 0;
  if (in_frame_) {
    arg_count_ = 0;
    for (const auto& [off, n] : offsets_) PushArg(std::string_view(data + off, n));
  } else {
    arg_count_ = 0;
    consumed_ = 0;
    if (len == 0) return Status::kNeedMore;
    if (data[0] != '*') return ParseInline(data, len);
    is_inline_ = false;
    // Count line: Redis looks for '\r' and needs one more byte after it.
    const char* end = data + len;
    int64_t count;
    const char* cr = scan_ == 0 ? FastDigits(data + 1, end, &count) : nullptr;
    if (cr == nullptr) {
      // Resume the search where the last call stopped, so a count line trickling in byte by
      // byte costs linear time.
      const size_t from = scan_ > 1 ? scan_ : 1;
      cr = static_cast<const char*>(memchr(data + from, '\r', len - from));
      if (cr == nullptr) {
        if (len > limits_.max_inline_len) return Fail("ERR Protocol error: too big mbulk count string");
        scan_ = len;
        return Status::kNeedMore;
      }
      if (!ParseRedisInt(std::string_view(data + 1, cr - data - 1), &count)) {
        if (cr + 2 > end) return Status::kNeedMore;
        return Fail("ERR Protocol error: invalid multibulk length");
      }
    }
    if (cr + 2 > end) return Status::kNeedMore;
    scan_ = 0;
    if (count > limits_.max_multibulk_len || count > std::numeric_limits<int32_t>::max()) {
      return Fail("ERR Protocol error: invalid multibulk length");
    }
    pos_ = cr + 2 - data;
    if (count <= 0) {
      consumed_ = pos_;
      pos_ = 0;
      return Status::kOk;
    }
    in_frame_ = true;
    remaining_ = count;
    bulk_len_ = -1;
  }

  const char* end = data + len;
  while (remaining_ > 0) {
    if (bulk_len_ < 0) {
      const char* p = data + pos_;
      if (p >= end) return Park(data, Status::kNeedMore);
      int64_t blen;
      const char* cr = (*p == '$' && scan_ == 0) ? FastDigits(p + 1, end, &blen) : nullptr;
      if (cr == nullptr) {
        const char* from = scan_ > pos_ ? data + scan_ : p;
        cr = static_cast<const char*>(memchr(from, '\r', end - from));
        if (cr == nullptr) {
          if (static_cast<size_t>(end - p) > limits_.max_inline_len) {
            return Fail("ERR Protocol error: too big bulk count string");
          }
          scan_ = len;
          return Park(data, Status::kNeedMore);
        }
        if (cr + 2 > end) return Park(data, Status::kNeedMore);
        if (*p != '$') return Fail(absl::StrCat("ERR Protocol error: expected '$', got '", std::string(p, 1), "'"));
        if (!ParseRedisInt(std::string_view(p + 1, cr - p - 1), &blen) || blen < 0) {
          return Fail("ERR Protocol error: invalid bulk length");
        }
      }
      if (cr + 2 > end) return Park(data, Status::kNeedMore);
      scan_ = 0;
      if (blen > limits_.max_bulk_len) return Fail("ERR Protocol error: invalid bulk length");
      bulk_len_ = blen;
      pos_ = cr + 2 - data;
    }
    // Redis skips the two bytes after the payload without looking at them; so do we.
    const size_t need = pos_ + static_cast<size_t>(bulk_len_) + 2;
    if (need > len) {
      hint_ = need;
      return Park(data, Status::kNeedMore);
    }
    PushArg(std::string_view(data + pos_, static_cast<size_t>(bulk_len_)));
    pos_ = need;
    bulk_len_ = -1;
    --remaining_;
  }
  consumed_ = pos_;
  Reset();
  return Status::kOk;
}

Status RequestFramer::ParseInline(const char* data, size_t len) {
  is_inline_ = true;
  // Redis finds the end of the line with strchr (processInlineBuffer): a NUL byte before the
  // newline hides it, and the server waits for an end it never finds until what it holds of the
  // request passes PROTO_INLINE_MAX_SIZE. keyguard frames it the same way (it used to see a
  // command there, which the server never runs).
  const char* nl = nullptr;
  if (!inline_unended_) {
    const char* from = data + scan_;
    nl = static_cast<const char*>(memchr(from, '\n', len - scan_));
    if (memchr(from, '\0', static_cast<size_t>((nl != nullptr ? nl : data + len) - from)) != nullptr) {
      inline_unended_ = true;
      nl = nullptr;
    }
  }
  if (nl == nullptr) {
    if (len > limits_.max_inline_len) return Fail("ERR Protocol error: too big inline request");
    scan_ = len;
    return Status::kNeedMore;
  }
  // The server refuses a request that passes the limit before its end is read, which for a line
  // longer than the limit depends on how its bytes arrive: keyguard refuses every such line.
  if (static_cast<size_t>(nl - data) > limits_.max_inline_len) {
    return Fail("ERR Protocol error: too big inline request");
  }
  scan_ = 0;
  size_t line_len = nl - data;
  if (line_len > 0 && data[line_len - 1] == '\r') --line_len;
  inline_store_.clear();
  if (!SplitInlineArgs(std::string_view(data, line_len), &inline_store_)) {
    return Fail("ERR Protocol error: unbalanced quotes in request");
  }
  for (const std::string& s : inline_store_) PushArg(s);
  consumed_ = nl - data + 1;
  return Status::kOk;
}

// ---------------------------------------------------------------------------------------------
// ReplyFramer

void ReplyFramer::Reset() {
  in_frame_ = false;
  pos_ = 0;
  scan_pos_ = 0;
  pending_bulk_ = -1;
  depth_ = 0;
  outer_size_ = 0;
  if (outer_capacity_ > kOuterKept) {
    outer_heap_.reset();
    outer_ = outer_inline_;
    outer_capacity_ = kOuterInline;
  }
}

Status ReplyFramer::Fail(std::string text) {
  error_ = std::move(text);
  Reset();
  return Status::kProtocolError;
}

void ReplyFramer::RecordScalar(char type, size_t off, size_t len) {
  if (head_closed_) return;
  if (depth_ == 0) {
    // The top-level value is a scalar.
    head_types_[0] = type;
    head_off_[0] = {off, len};
    head_count_ = 1;
    head_closed_ = true;
    return;
  }
  if (depth_ == 1 && !attribute_ && head_count_ < kHeadElements) {
    head_types_[head_count_] = type;
    head_off_[head_count_] = {off, len};
    ++head_count_;
  }
}

void ReplyFramer::GrowOuter() {
  auto bigger = std::make_unique<uint8_t[]>(outer_capacity_ * 2);
  std::memcpy(bigger.get(), outer_, outer_size_);
  outer_heap_ = std::move(bigger);
  outer_ = outer_heap_.get();
  outer_capacity_ *= 2;
}

inline void ReplyFramer::Open(int64_t elements, bool attribute) {
  if (depth_ > 0) {
    // Save the enclosing level: 5 bytes at most with Redis's limits (a count below 2^33 and the
    // attribute bit), 10 for any uint64.
    if (outer_capacity_ - outer_size_ < 10) GrowOuter();
    uint64_t v = static_cast<uint64_t>(remaining_) << 1 | (attribute_ ? 1 : 0);
    uint8_t* out = outer_ + outer_size_;
    *out++ = static_cast<uint8_t>(0x80 | (v & 0x7f));
    while ((v >>= 7) != 0) *out++ = static_cast<uint8_t>(v & 0x7f);
    outer_size_ = out - outer_;
  }
  ++depth_;
  remaining_ = elements;
  attribute_ = attribute;
}

inline bool ReplyFramer::ElementDone() {
  if (depth_ == 0) return true;
  if (--remaining_ > 0) return false;
  return CloseLevels();
}

bool ReplyFramer::CloseLevels() {
  // On locals: the loop may close many levels, and members would be stored on every one.
  size_t depth = depth_;
  int64_t remaining;
  bool attribute = attribute_;
  const uint8_t* in = outer_ + outer_size_;
  bool done;
  for (;;) {
    const bool closed_attribute = attribute;
    if (--depth == 0) {
      done = !closed_attribute;  // a top-level attribute: the value it annotates follows
      remaining = 0;
      break;
    }
    // Back to the enclosing level: read its count from the end of `outer_`.
    uint8_t b = *--in;
    uint64_t v = b & 0x7f;
    while ((b & 0x80) == 0) {
      b = *--in;
      v = v << 7 | (b & 0x7f);
    }
    remaining = static_cast<int64_t>(v >> 1);
    attribute = (v & 1) != 0;
    // A finished attribute is not an element of its parent: the value it annotates follows.
    if (closed_attribute || --remaining > 0) {
      done = false;
      break;
    }
  }
  depth_ = depth;
  remaining_ = remaining;
  attribute_ = attribute;
  outer_size_ = in - outer_;
  return done;
}

Status ReplyFramer::Next(const char* data, size_t len) {
  if (!in_frame_ && len == 0) {
    // The end of a batch: no frame starts, so the next batch's first reply may take the fast path.
    hint_ = 0;
    return Status::kNeedMore;
  }
  if (!in_frame_ && len >= 4) {
    // Fast path for the replies most commands get: a whole simple string, error or bulk. The rest
    // is NextSlow's, from the frame start.
    const char t = data[0];
    if (t == '+' || t == '-') {
      // Most are short (+OK, +PONG, +QUEUED): a plain loop beats a call to memchr.
      const char* cr = nullptr;
      const size_t near = len < 32 ? len : 32;
      for (size_t i = 1; i < near; ++i) {
        if (data[i] == '\r') {
          cr = data + i;
          break;
        }
      }
      if (cr == nullptr && near < len) cr = static_cast<const char*>(memchr(data + near, '\r', len - near));
      if (cr != nullptr && cr + 1 < data + len && cr[1] == '\n') {
        hint_ = 0;
        top_type_ = t;
        top_size_ = 0;
        head_count_ = 1;
        head_[0] = Scalar{t, std::string_view(data + 1, cr - data - 1)};
        consumed_ = cr + 2 - data;
        return Status::kOk;
      }
    } else if (t == '$') {
      int64_t n;
      const char* cr = ShortDigits(data + 1, data + len, &n);
      if (cr != nullptr && n <= limits_.max_bulk_len && cr + 1 < data + len && cr[1] == '\n') {
        const size_t total = (cr + 2 - data) + static_cast<size_t>(n) + 2;
        if (total <= len) {
          hint_ = 0;
          top_type_ = '$';
          top_size_ = 0;
          head_count_ = 1;
          head_[0] = Scalar{'$', std::string_view(cr + 2, static_cast<size_t>(n))};
          consumed_ = total;
          return Status::kOk;
        }
      } else if (data[1] == '-' && data[2] == '1' && data[3] == '\r' && len >= 5 && data[4] == '\n') {
        // A null bulk (GET of a missing key), as NextSlow records it.
        hint_ = 0;
        top_type_ = '$';
        top_size_ = -1;
        head_count_ = 1;
        head_[0] = Scalar{'_', std::string_view(data + 1, 0)};
        consumed_ = 5;
        return Status::kOk;
      }
    }
  }
  return NextSlow(data, len);
}

Status ReplyFramer::NextSlow(const char* data, size_t len) {
  hint_ = 0;
  if (!in_frame_) {
    consumed_ = 0;
    top_type_ = 0;
    top_size_ = 0;
    head_count_ = 0;
    head_closed_ = false;
    in_frame_ = true;
  }
  const char* end = data + len;
  for (;;) {
    if (pending_bulk_ >= 0) {
      const size_t need = pos_ + static_cast<size_t>(pending_bulk_) + 2;
      if (need > len) {
        hint_ = need;
        return Status::kNeedMore;
      }
      RecordScalar(pending_type_, pos_, static_cast<size_t>(pending_bulk_));
      pos_ = need;
      pending_bulk_ = -1;
      if (ElementDone()) break;
      continue;
    }
    const char* p = data + pos_;
    if (p >= end) return Status::kNeedMore;
    // Find the CRLF ending this line, resuming where the last search stopped.
    const char* cr;
    int64_t number = 0;
    bool have_number = false;
    const char t = *p;
    if ((t == '$' || t == '*' || t == ':') && (cr = FastDigits(p + 1, end, &number)) != nullptr && cr + 1 < end &&
        cr[1] == '\n') {
      have_number = true;
    } else {
      const char* s = data + (scan_pos_ > pos_ ? scan_pos_ : pos_ + 1);
      for (;;) {
        cr = s < end ? static_cast<const char*>(memchr(s, '\r', end - s)) : nullptr;
        if (cr == nullptr) {
          if (static_cast<size_t>(end - p) > static_cast<size_t>(limits_.max_bulk_len)) {
            return Fail("line too long");
          }
          scan_pos_ = len;
          return Status::kNeedMore;
        }
        if (cr + 1 >= end) {
          scan_pos_ = cr - data;
          return Status::kNeedMore;
        }
        if (cr[1] == '\n') break;
        s = cr + 1;
      }
    }
    scan_pos_ = 0;
    const std::string_view line(p + 1, cr - p - 1);
    const size_t line_off = pos_ + 1;
    pos_ = cr + 2 - data;
    if (depth_ == 0 && t != '|') top_type_ = t;
    switch (t) {
      case '+':
      case '-':
      case '(':
      case ',': RecordScalar(t, line_off, line.size()); break;
      case ':':
        if (!have_number && !ParseRedisInt(line, &number)) return Fail("invalid integer");
        RecordScalar(t, line_off, line.size());
        break;
      case '_':
        if (!line.empty()) return Fail("invalid null");
        RecordScalar(t, line_off, 0);
        break;
      case '#':
        if (line != "t" && line != "f") return Fail("invalid boolean");
        RecordScalar(t, line_off, line.size());
        break;
      case '$':
      case '!':
      case '=': {
        if (!have_number && !ParseRedisInt(line, &number)) return Fail("invalid bulk length");
        if (number == -1 && t == '$') {
          if (depth_ == 0) top_size_ = -1;
          RecordScalar('_', line_off, 0);
          break;
        }
        if (number < 0 || number > limits_.max_bulk_len) return Fail("invalid bulk length");
        pending_bulk_ = number;
        pending_type_ = t;
        continue;
      }
      case '*':
      case '~':
      case '%':
      case '>':
      case '|': {
        if (!have_number && !ParseRedisInt(line, &number)) return Fail("invalid multibulk length");
        if (number == -1 && t == '*') {
          if (depth_ == 0) top_size_ = -1;
          RecordScalar('_', line_off, 0);
          break;
        }
        if (number < 0 || number > limits_.max_multibulk_len) return Fail("invalid multibulk length");
        if (t != '|' && depth_ == 1 && !attribute_) head_closed_ = true;
        if (depth_ == 0 && t != '|') top_size_ = number;
        const int64_t elements = (t == '%' || t == '|') ? number * 2 : number;
        if (elements > 0) {
          Open(elements, t == '|');
          continue;
        }
        if (t == '|') continue;  // an empty attribute: the annotated value follows
        if (depth_ == 0) head_closed_ = true;
        break;
      }
      default: return Fail(absl::StrCat("unexpected type byte 0x", absl::Hex(static_cast<unsigned char>(t))));
    }
    if (ElementDone()) break;
  }
  consumed_ = pos_;
  for (int i = 0; i < head_count_; ++i) {
    head_[i] = Scalar{head_types_[i], std::string_view(data + head_off_[i].first, head_off_[i].second)};
  }
  Reset();
  return Status::kOk;
}

}  // namespace keyguard::resp
