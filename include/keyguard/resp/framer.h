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
#include <vector>

namespace keyguard::resp {

// Protocol limits. Defaults are Redis's own (proto-max-bulk-len, PROTO_INLINE_MAX_SIZE, INT_MAX
// multibulk length for an authenticated client).
struct Limits {
  int64_t max_bulk_len = 512LL * 1024 * 1024;  // bytes in one bulk string
  int64_t max_multibulk_len = 2147483647;      // elements in one multibulk request or aggregate
  size_t max_inline_len = 64 * 1024;           // bytes of an inline request or a count line
  int max_depth = 128;                         // nesting of aggregates in a reply
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
  std::span<const std::string_view> args() const { return args_; }
  bool is_inline() const { return is_inline_; }
  size_t hint() const { return hint_; }
  const std::string& error() const { return error_; }

  // Forgets a partially parsed frame.
  void Reset();

 private:
  Status Fail(std::string text);
  Status Park(const char* data, Status status);
  Status ParseInline(const char* data, size_t len);

  Limits limits_;
  // State of the frame in progress; offsets are relative to the frame start.
  bool in_frame_ = false;
  size_t pos_ = 0;
  size_t scan_ = 0;         // where the search for the current line's end resumes (0 = fresh)
  int64_t remaining_ = 0;   // arguments still to read
  int64_t bulk_len_ = -1;   // length of the argument whose header was read, or -1
  // (offset, length) of each argument of a frame left incomplete by the last call.
  std::vector<std::pair<size_t, size_t>> offsets_;
  // Result of the last call.
  size_t consumed_ = 0;
  size_t hint_ = 0;
  bool is_inline_ = false;
  std::vector<std::string_view> args_;
  std::vector<std::string> inline_store_;  // unescaped inline arguments
  std::string error_;
};

// Parses what a server sends: + - : $ * and the RESP3 types _ , # ! = ( % ~ | >. An attribute
// (`|`) belongs to the value that follows it, so a frame is the attribute plus that value.
class ReplyFramer {
 public:
  explicit ReplyFramer(const Limits& limits = Limits()) : limits_(limits) {}

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
  struct Level {
    int64_t remaining;
    int64_t index;  // elements seen so far at this level
    bool attribute;
  };
  Status Fail(std::string text);
  // Returns true when the whole frame is complete.
  bool ElementDone();
  void RecordScalar(char type, size_t off, size_t len);

  Limits limits_;
  bool in_frame_ = false;
  size_t pos_ = 0;
  size_t scan_pos_ = 0;     // where the search for the current line's CRLF resumes
  int64_t pending_bulk_ = -1;
  char pending_type_ = 0;
  std::vector<Level> stack_;
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
