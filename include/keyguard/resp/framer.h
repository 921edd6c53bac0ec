// Incremental, zero-copy RESP framers: one for what clients send (multibulk and inline commands,
// parsed exactly as Redis parses them) and one for what servers send (every RESP2 and RESP3 type).
//
// Both are sans-io state machines. The caller owns the bytes: it calls Next() with the buffered,
// not yet consumed bytes, always starting at the first byte of the frame being parsed. When Next()
// returns kNeedMore the framer remembers how far it got (as offsets from the frame start), so
// feeding the same frame again after more bytes arrived costs only the new bytes, even if the
// caller moved the buffer in between. Views handed out point into the caller's bytes and are valid
// until the next call to Next() or until the caller moves or frees those bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <memory>
#include <vector>

namespace keyguard::resp {

// Protocol limits. Defaults are Redis's own (proto-max-bulk-len, PROTO_INLINE_MAX_SIZE, INT_MAX
// multibulk length for an authenticated client). Replies nest without limit: they are the
// server's, and Redis nests as deep as a Lua script's table does (a recursive one: until Lua's
// stack runs out, 7995 levels in Redis 7.0).
struct Limits {
  int64_t max_bulk_len = 512LL * 1024 * 1024;  // bytes in one bulk string
  int64_t max_multibulk_len = 2147483647;      // elements in one multibulk request or aggregate
  size_t max_inline_len = 64 * 1024;           // bytes of an inline request or a count line
};

enum class Status { kOk, kNeedMore, kProtocolError };

// Parses the commands a client sends, as Redis's processMultibulkBuffer/processInlineBuffer do:
// a frame starting with '*' is a multibulk command, anything else an inline (telnet) command.
class RequestFramer {
 public:
  explicit RequestFramer(const Limits& limits = Limits()) : limits_(limits) {}

  // Parses at most one command from data[0, len). On kOk, consumed() is the size of the command
  // and args() its arguments; an empty args() means a command Redis ignores (`*0`, `*-1`, an empty
  // inline line), which must produce no reply. On kNeedMore, hint() is the number of bytes from
  // data that the frame needs at least (0 when not yet known). On kProtocolError, error() is the
  // reply Redis sends for the same bytes, without the leading '-' and trailing CRLF.
  Status Next(const char* data, size_t len);

  size_t consumed() const { return consumed_; }
  std::span<const std::string_view> args() const { return {args_.data(), arg_count_}; }
  bool is_inline() const { return is_inline_; }
  size_t hint() const { return hint_; }
  const std::string& error() const { return error_; }

  // Forgets a partially parsed frame.
  void Reset();

 private:
  Status Fail(std::string text);
  Status Park(const char* data, Status status);
  // Next() for what its fast path does not take: any frame, whole or not.
  Status NextSlow(const char* data, size_t len);
  Status ParseInline(const char* data, size_t len);
  void PushArg(std::string_view a) {
    if (arg_count_ == args_.size()) args_.emplace_back();
    args_[arg_count_++] = a;
  }

  // Frames of at most this many arguments that arrived whole take Next()'s fast path.
  static constexpr int64_t kFastArgs = 64;

  Limits limits_;
  // State of the frame in progress; offsets are relative to the frame start.
  bool in_frame_ = false;
  size_t pos_ = 0;
  size_t scan_ = 0;              // where the search for the current line's end resumes (0 = fresh)
  bool inline_unended_ = false;  // a NUL came before the inline line's newline: it never ends
  int64_t remaining_ = 0;        // arguments still to read
  int64_t bulk_len_ = -1;        // length of the argument whose header was read, or -1
  // (offset, length) of each argument of a frame left incomplete by the last call.
  std::vector<std::pair<size_t, size_t>> offsets_;
  // Result of the last call.
  size_t consumed_ = 0;
  size_t hint_ = 0;
  bool is_inline_ = false;
  // The arguments are args_[0, arg_count_): args_ only grows, so the fast path writes into it
  // without a capacity check per argument.
  std::vector<std::string_view> args_;
  size_t arg_count_ = 0;
  std::vector<std::string> inline_store_;  // unescaped inline arguments
  std::string error_;
};

// Parses what a server sends: + - : $ * and the RESP3 types _ , # ! = ( % ~ | >. An attribute
// (`|`) belongs to the value that follows it, so a frame is the attribute plus that value.
// Aggregates nest to any depth without recursion: the framer keeps one small count per open
// level (1 byte for an aggregate with fewer than 64 elements left, at most 5), inline for the
// first 64 bytes and on the heap past them; a heap part over 4 KiB is freed once the frame ends.
class ReplyFramer {
 public:
  explicit ReplyFramer(const Limits& limits = Limits()) : limits_(limits) {}
  ReplyFramer(const ReplyFramer&) = delete;  // outer_ may point into the object itself
  ReplyFramer& operator=(const ReplyFramer&) = delete;

  // A scalar element of the top-level aggregate (or the top-level value itself).
  struct Scalar {
    char type = 0;
    std::string_view text;  // the payload of a bulk, or the line of a simple type
  };

  Status Next(const char* data, size_t len);

  size_t consumed() const { return consumed_; }
  size_t hint() const { return hint_; }
  const std::string& error() const { return error_; }
  // The type byte of the frame's value (after any attribute), e.g. '*', '>' or '+'.
  char type() const { return top_type_; }
  // Element count of a top-level aggregate (pairs for a map), -1 for a null.
  int64_t size() const { return top_size_; }
  // The first up-to-kHeadElements scalar elements of a top-level aggregate, in order; an
  // aggregate element ends the list. For a scalar frame, head()[0] is the value itself.
  static constexpr int kHeadElements = 3;
  std::span<const Scalar> head() const { return {head_, static_cast<size_t>(head_count_)}; }

  void Reset();

 private:
  Status Fail(std::string text);
  // Next() for what its fast path does not take: any frame, whole or not.
  Status NextSlow(const char* data, size_t len);
  // Opens an aggregate (or attribute) of `elements` elements inside the current one.
  void Open(int64_t elements, bool attribute);
  void GrowOuter();
  // Counts one element of the innermost aggregate; returns true when the whole frame is complete.
  bool ElementDone();
  // ElementDone() for an element that ends the innermost aggregate: closes it, and the levels
  // around it that end with it.
  bool CloseLevels();
  void RecordScalar(char type, size_t off, size_t len);

  Limits limits_;
  bool in_frame_ = false;
  size_t pos_ = 0;
  size_t scan_pos_ = 0;  // where the search for the current line's CRLF resumes
  int64_t pending_bulk_ = -1;
  char pending_type_ = 0;
  // Open aggregates: how many, and of the innermost one the elements still to come (pairs count
  // twice) and whether it is an attribute. The enclosing ones are saved in `outer_` as
  // (remaining << 1 | attribute), 7 bits a byte, least significant group first with bit 7 set, so
  // that the last number can be read back from the end. `outer_` is `outer_inline_` until it
  // needs more, then `outer_heap_`.
  static constexpr size_t kOuterInline = 64;
  static constexpr size_t kOuterKept = 4096;  // heap bytes kept from one frame to the next
  size_t depth_ = 0;
  int64_t remaining_ = 0;
  bool attribute_ = false;
  uint8_t* outer_ = outer_inline_;
  size_t outer_size_ = 0;
  size_t outer_capacity_ = kOuterInline;
  uint8_t outer_inline_[kOuterInline];
  std::unique_ptr<uint8_t[]> outer_heap_;
  size_t consumed_ = 0;
  size_t hint_ = 0;
  char top_type_ = 0;
  int64_t top_size_ = 0;
  std::pair<size_t, size_t> head_off_[kHeadElements];
  char head_types_[kHeadElements];
  Scalar head_[kHeadElements];
  int head_count_ = 0;
  bool head_closed_ = false;
  std::string error_;
};

// Redis's string2ll: strict decimal, no '+', no leading zeros, no spaces, fits in int64.
bool ParseRedisInt(std::string_view s, int64_t* out);

// Redis's sdssplitargs: splits an inline command line into arguments, handling "..." (with \n \r
// \t \b \a \\ \" and \xHH escapes) and '...' (with \'). Returns false on unbalanced quotes.
bool SplitInlineArgs(std::string_view line, std::vector<std::string>* out);

}  // namespace keyguard::resp
