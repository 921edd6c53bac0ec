// Framer cases, each replayed at fragment sizes {all, 100, 10, 2, 1}; between feeds the
// unconsumed tail is moved to fresh memory, as a session's buffer compaction would.
#include "keyguard/resp/framer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "keyguard/resp/encoder.h"
#include "keyguard/resp/value.h"

namespace keyguard::resp {
namespace {

constexpr size_t kFragmentSizes[] = {0, 100, 10, 2, 1};  // 0 = everything at once

struct RequestResult {
  std::vector<std::vector<std::string>> commands;
  std::vector<size_t> sizes;
  std::string error;  // set when a protocol error ended the stream
  bool operator==(const RequestResult&) const = default;
};

RequestResult FeedRequests(std::string_view input, size_t fragment, const Limits& limits = Limits()) {
  RequestFramer framer(limits);
  RequestResult out;
  std::string buf;
  size_t off = 0;
  while (off < input.size()) {
    const size_t n = fragment == 0 ? input.size() : std::min(fragment, input.size() - off);
    buf.append(input.substr(off, n));
    off += n;
    size_t start = 0;
    for (;;) {
      const Status st = framer.Next(buf.data() + start, buf.size() - start);
      if (st == Status::kOk) {
        std::vector<std::string> args;
        for (std::string_view a : framer.args()) args.emplace_back(a);
        out.commands.push_back(std::move(args));
        out.sizes.push_back(framer.consumed());
        start += framer.consumed();
        continue;
      }
      if (st == Status::kProtocolError) {
        out.error = framer.error();
        return out;
      }
      break;
    }
    // After consuming, move the tail to new memory, as a session's compaction would: the framer
    // must not keep pointers into old bytes. (Appends may also reallocate.)
    if (start > 0) buf = std::string(buf.substr(start));
  }
  return out;
}

struct ReplyResult {
  std::vector<std::string> frames;  // the bytes of each frame
  std::vector<char> types;
  std::vector<std::vector<std::string>> heads;
  std::string error;
  bool operator==(const ReplyResult&) const = default;
};

ReplyResult FeedReplies(std::string_view input, size_t fragment, const Limits& limits = Limits()) {
  ReplyFramer framer(limits);
  ReplyResult out;
  std::string buf;
  size_t off = 0;
  while (off < input.size()) {
    const size_t n = fragment == 0 ? input.size() : std::min(fragment, input.size() - off);
    buf.append(input.substr(off, n));
    off += n;
    size_t start = 0;
    for (;;) {
      const Status st = framer.Next(buf.data() + start, buf.size() - start);
      if (st == Status::kOk) {
        out.frames.emplace_back(buf.substr(start, framer.consumed()));
        out.types.push_back(framer.type());
        std::vector<std::string> head;
        for (const auto& s : framer.head()) head.push_back(std::string(1, s.type) + std::string(s.text));
        out.heads.push_back(std::move(head));
        start += framer.consumed();
        continue;
      }
      if (st == Status::kProtocolError) {
        out.error = framer.error();
        return out;
      }
      break;
    }
    if (start > 0) buf = std::string(buf.substr(start));
  }
  return out;
}

struct RequestCase {
  std::string name;
  std::string input;
  std::vector<std::vector<std::string>> commands;
  std::string error;
};

// `*n` MSET-like frame: "MSET" then n-1 arguments "a0", "a1", ...
std::vector<std::string> ManyArgsCommand(int n) {
  std::vector<std::string> args = {"MSET"};
  for (int i = 1; i < n; ++i) args.push_back("a" + std::to_string(i));
  return args;
}

std::string ManyArgs(int n) {
  std::string out;
  std::vector<std::string_view> views;
  const std::vector<std::string> args = ManyArgsCommand(n);
  for (const std::string& a : args) views.push_back(a);
  AppendCommand(&out, views);
  return out;
}

class RequestFramerTest : public ::testing::TestWithParam<RequestCase> {};

TEST_P(RequestFramerTest, SameResultAtEveryFragmentSize) {
  const RequestCase& c = GetParam();
  for (size_t frag : kFragmentSizes) {
    SCOPED_TRACE("fragment size " + std::to_string(frag));
    const RequestResult r = FeedRequests(c.input, frag);
    EXPECT_EQ(r.commands, c.commands);
    EXPECT_EQ(r.error, c.error);
  }
}

// Errors are the exact texts redis-server 7.0 sends for the same bytes (checked against the real
// server in tests/integration/test_protocol.py).
INSTANTIATE_TEST_SUITE_P(
    Cases, RequestFramerTest,
    ::testing::Values(
        RequestCase{"simple", "*1\r\n$4\r\nPING\r\n", {{"PING"}}, ""},
        RequestCase{"pipeline",
                    "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n",
                    {{"SET", "k", "v"}, {"GET", "k"}},
                    ""},
        RequestCase{"binary",
                    std::string("*2\r\n$4\r\nECHO\r\n$5\r\na\r\n\0b\r\n", 25),
                    {{"ECHO", std::string("a\r\n\0b", 5)}},
                    ""},
        RequestCase{"empty_arg", "*2\r\n$4\r\nECHO\r\n$0\r\n\r\n", {{"ECHO", ""}}, ""},
        RequestCase{"empty_multibulk_ignored", "*0\r\n*-1\r\n*1\r\n$4\r\nPING\r\n", {{}, {}, {"PING"}}, ""},
        RequestCase{"terminator_not_checked", "*1\r\n$4\r\nPINGxx*1\r\n$4\r\nPING\r\n", {{"PING"}, {"PING"}}, ""},
        RequestCase{"inline", "PING\r\nSET a  b\nGET a\r\n", {{"PING"}, {"SET", "a", "b"}, {"GET", "a"}}, ""},
        RequestCase{"inline_blank_lines", "\r\n\n  \r\nPING\n", {{}, {}, {}, {"PING"}}, ""},
        RequestCase{"inline_quotes",
                    "SET \"a b\" 'c d'\r\nECHO \"x\\x41\\n\"\r\n",
                    {{"SET", "a b", "c d"}, {"ECHO", "xA\n"}},
                    ""},
        RequestCase{"inline_unbalanced", "SET \"a b\r\n", {}, "ERR Protocol error: unbalanced quotes in request"},
        RequestCase{"inline_quote_then_text", "SET 'a'b c\r\n", {}, "ERR Protocol error: unbalanced quotes in request"},
        RequestCase{"bad_count", "*abc\r\n", {}, "ERR Protocol error: invalid multibulk length"},
        RequestCase{"count_leading_zero", "*01\r\n", {}, "ERR Protocol error: invalid multibulk length"},
        RequestCase{"count_too_big", "*3000000000\r\n", {}, "ERR Protocol error: invalid multibulk length"},
        RequestCase{"expected_dollar", "*2\r\n$3\r\nGET\r\nx\r\n", {}, "ERR Protocol error: expected '$', got 'x'"},
        RequestCase{"ok_then_error", "PING\r\n*1\r\n+x\r\n", {{"PING"}}, "ERR Protocol error: expected '$', got '+'"},
        RequestCase{"negative_bulk", "*1\r\n$-5\r\n", {}, "ERR Protocol error: invalid bulk length"},
        RequestCase{"bad_bulk", "*1\r\n$abc\r\n", {}, "ERR Protocol error: invalid bulk length"},
        RequestCase{"bulk_too_big", "*1\r\n$600000000\r\n", {}, "ERR Protocol error: invalid bulk length"},
        // Frames the fast path hands over to the general loop part-way: a length it does not
        // parse (leading zero), more arguments than it takes, a bulk past its digit limit.
        RequestCase{
            "bulk_leading_zero", "*2\r\n$3\r\nGET\r\n$01\r\nk\r\n", {}, "ERR Protocol error: invalid bulk length"},
        RequestCase{"many_args", ManyArgs(70), {ManyArgsCommand(70)}, ""},
        RequestCase{"long_length_line",
                    "*2\r\n$4\r\nECHO\r\n$00000000000000000001\r\nx\r\n",
                    {},
                    "ERR Protocol error: invalid bulk length"},
        RequestCase{"then_inline", "*2\r\n$4\r\nECHO\r\n$1\r\nx\r\nPING\r\n", {{"ECHO", "x"}, {"PING"}}, ""},
        RequestCase{"inline_too_big", std::string(70000, 'x'), {}, "ERR Protocol error: too big inline request"},
        // A line longer than the limit is refused also when its end is there (the server would
        // refuse it whenever it reads past the limit before the end).
        RequestCase{"inline_line_too_big",
                    "PING\r\nECHO " + std::string(70000, 'x') + "\r\nPING\r\n",
                    {{"PING"}},
                    "ERR Protocol error: too big inline request"},
        RequestCase{"inline_line_at_the_limit",
                    "ECHO " + std::string(64 * 1024 - 5, 'x') + "\nPING\r\n",
                    {{"ECHO", std::string(64 * 1024 - 5, 'x')}, {"PING"}},
                    ""},
        // The server finds the end of an inline line with strchr: a NUL before it hides it, and
        // nothing on the connection runs again (until the limit is passed: the error).
        RequestCase{"inline_nul_hides_the_end", std::string("PING\r\nPING a\0b\r\nPING\r\n", 22), {{"PING"}}, ""},
        RequestCase{"inline_nul_then_too_big",
                    std::string("PING a\0b\r\n", 10) + std::string(70000, 'x') + "\r\n",
                    {},
                    "ERR Protocol error: too big inline request"},
        RequestCase{
            "mbulk_count_too_big", "*" + std::string(70000, '1'), {}, "ERR Protocol error: too big mbulk count string"},
        RequestCase{"bulk_count_too_big",
                    "*1\r\n$" + std::string(70000, '1'),
                    {},
                    "ERR Protocol error: too big bulk count string"}),
    [](const auto& info) { return info.param.name; });

TEST(RequestFramer, HintAsksForTheWholeBulkAtOnce) {
  RequestFramer f;
  const std::string head = "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1000000\r\n";
  EXPECT_EQ(f.Next(head.data(), head.size()), Status::kNeedMore);
  EXPECT_EQ(f.hint(), head.size() + 1000000 + 2);
}

TEST(RequestFramer, ConfiguredLimitsApply) {
  Limits limits;
  limits.max_bulk_len = 10;
  limits.max_multibulk_len = 2;
  EXPECT_EQ(FeedRequests("*1\r\n$11\r\n", 0, limits).error, "ERR Protocol error: invalid bulk length");
  EXPECT_EQ(FeedRequests("*3\r\n", 0, limits).error, "ERR Protocol error: invalid multibulk length");
  // The same limits on frames that arrive whole (the fast path).
  EXPECT_EQ(FeedRequests("*1\r\n$11\r\nhello world\r\n", 0, limits).error, "ERR Protocol error: invalid bulk length");
  EXPECT_EQ(FeedRequests("*3\r\n$1\r\na\r\n$1\r\nb\r\n$1\r\nc\r\n", 0, limits).error,
            "ERR Protocol error: invalid multibulk length");
  EXPECT_EQ(FeedRequests("*2\r\n$3\r\nGET\r\n$10\r\n0123456789\r\n", 0, limits).commands,
            (std::vector<std::vector<std::string>>{{"GET", "0123456789"}}));
  limits.max_inline_len = 100;
  EXPECT_EQ(FeedRequests(std::string(101, 'a'), 0, limits).error, "ERR Protocol error: too big inline request");
}

TEST(ParseRedisInt, MirrorsString2ll) {
  int64_t v;
  EXPECT_TRUE(ParseRedisInt("0", &v));
  EXPECT_EQ(v, 0);
  EXPECT_TRUE(ParseRedisInt("-1", &v));
  EXPECT_EQ(v, -1);
  EXPECT_TRUE(ParseRedisInt("9223372036854775807", &v));
  EXPECT_TRUE(ParseRedisInt("-9223372036854775808", &v));
  EXPECT_EQ(v, INT64_MIN);
  for (const char* bad : {"", "-", "+1", "01", "-0", " 1", "1 ", "9223372036854775808", "1a"}) {
    EXPECT_FALSE(ParseRedisInt(bad, &v)) << bad;
  }
}

struct ReplyCase {
  std::string name;
  std::string input;
  std::vector<char> types;
  std::vector<std::vector<std::string>> heads;
};

class ReplyFramerTest : public ::testing::TestWithParam<ReplyCase> {};

TEST_P(ReplyFramerTest, SameFramesAtEveryFragmentSize) {
  const ReplyCase& c = GetParam();
  for (size_t frag : kFragmentSizes) {
    SCOPED_TRACE("fragment size " + std::to_string(frag));
    const ReplyResult r = FeedReplies(c.input, frag);
    EXPECT_EQ(r.error, "");
    EXPECT_EQ(r.types, c.types);
    EXPECT_EQ(r.heads, c.heads);
    std::string joined;
    for (const auto& f : r.frames) {
      joined += f;
      EXPECT_TRUE(ParseValue(f).has_value()) << f;
    }
    EXPECT_EQ(joined, c.input);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ReplyFramerTest,
    ::testing::Values(
        ReplyCase{"resp2_scalars",
                  "+OK\r\n-ERR bad\r\n:42\r\n:-7\r\n$3\r\nfoo\r\n$-1\r\n$0\r\n\r\n",
                  {'+', '-', ':', ':', '$', '$', '$'},
                  {{"+OK"}, {"-ERR bad"}, {":42"}, {":-7"}, {"$foo"}, {"_"}, {"$"}}},
        ReplyCase{"resp2_arrays", "*2\r\n$1\r\na\r\n*1\r\n:1\r\n*-1\r\n*0\r\n", {'*', '*', '*'}, {{"$a"}, {"_"}, {}}},
        ReplyCase{"pubsub_message",
                  "*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$5\r\nhello\r\n",
                  {'*'},
                  {{"$message", "$ch", "$hello"}}},
        ReplyCase{"resp3_types",
                  "_\r\n,3.14\r\n#t\r\n(12345678901234567890\r\n!5\r\nERR x\r\n=8\r\ntxt:abcd\r\n",
                  {'_', ',', '#', '(', '!', '='},
                  {{"_"}, {",3.14"}, {"#t"}, {"(12345678901234567890"}, {"!ERR x"}, {"=txt:abcd"}}},
        ReplyCase{"resp3_aggregates",
                  "%2\r\n+a\r\n:1\r\n+b\r\n*1\r\n:2\r\n~2\r\n+x\r\n+y\r\n",
                  {'%', '~'},
                  {{"+a", ":1", "+b"}, {"+x", "+y"}}},
        ReplyCase{"push",
                  ">3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$1\r\nm\r\n>2\r\n$10\r\ninvalidate\r\n*1\r\n$1\r\nk\r\n",
                  {'>', '>'},
                  {{"$message", "$c", "$m"}, {"$invalidate"}}},
        ReplyCase{"attribute_belongs_to_next_value",
                  "|1\r\n+ttl\r\n:3\r\n$2\r\nhi\r\n*2\r\n|1\r\n+a\r\n+b\r\n:1\r\n:2\r\n",
                  {'$', '*'},
                  {{"$hi"}, {":1", ":2"}}},
        ReplyCase{"nested", "*2\r\n*2\r\n$1\r\na\r\n*1\r\n$1\r\nb\r\n$1\r\nc\r\n", {'*'}, {{}}},
        ReplyCase{"crlf_in_bulk", "$4\r\n\r\n\r\n\r\n+x\r\n", {'$', '+'}, {{"$\r\n\r\n"}, {"+x"}}}),
    [](const auto& info) { return info.param.name; });

TEST(ReplyFramer, RejectsMalformedReplies) {
  for (const char* bad :
       {"?x\r\n", ":abc\r\n", "$-2\r\n", "*-2\r\n", "#x\r\n", "_x\r\n", "%-1\r\n", "!-1\r\n", "=-1\r\n"}) {
    EXPECT_NE(FeedReplies(bad, 0).error, "") << bad;
  }
}

// A reply nested `depth` aggregates deep, cycling through every aggregate type: arrays, maps
// (the nesting as a value with a pair after it, and as a key), sets, pushes, and an attribute
// whose value holds the rest of the nesting, so that levels still have elements to come when the
// innermost one ends.
std::string DeepReply(int depth) {
  struct Level {
    const char* open;
    const char* close;
  };
  static constexpr Level kLevels[] = {
      {"*1\r\n", ""},       {"%2\r\n+k\r\n", "+k2\r\n:2\r\n"}, {"~2\r\n:7\r\n", ""},
      {">1\r\n", ""},       {"|1\r\n+a\r\n", "$1\r\nx\r\n"},   {"*3\r\n:1\r\n", "$-1\r\n"},
      {"%1\r\n", ":1\r\n"},
  };
  constexpr int kKinds = sizeof(kLevels) / sizeof(kLevels[0]);
  std::string out;
  for (int i = 0; i < depth; ++i) out += kLevels[i % kKinds].open;
  out += "_\r\n";
  for (int i = depth - 1; i >= 0; --i) out += kLevels[i % kKinds].close;
  return out;
}

// Replies are the server's: a Lua script returning a recursive table makes Redis nest until its
// Lua stack runs out (7995 levels in 7.0), and the framer must pass that, and deeper, whole.
TEST(ReplyFramer, DeepRepliesPassWhole) {
  struct Case {
    int depth;
    std::vector<size_t> fragments;
  };
  for (const Case& c : {Case{1000, {0, 100, 10, 2, 1}}, Case{10000, {0, 100, 10, 2, 1}}, Case{100000, {0, 100, 1}}}) {
    const std::string deep = DeepReply(c.depth);
    for (size_t frag : c.fragments) {
      SCOPED_TRACE("depth " + std::to_string(c.depth) + ", fragment size " + std::to_string(frag));
      const ReplyResult r = FeedReplies(deep + "+PONG\r\n", frag);
      EXPECT_EQ(r.error, "");
      ASSERT_EQ(r.frames.size(), 2u);
      EXPECT_EQ(r.frames[0].size(), deep.size());
      EXPECT_TRUE(r.frames[0] == deep);  // (not EXPECT_EQ: a failure would print megabytes)
      EXPECT_EQ(r.frames[1], "+PONG\r\n");
      EXPECT_EQ(r.types, (std::vector<char>{'*', '+'}));
    }
  }
}

TEST(ReplyFramer, MillionLevelsDeep) {
  std::string deep;
  for (int i = 0; i < 1000000; ++i) deep += i % 2 == 0 ? "*1\r\n" : "%1\r\n:1\r\n";
  deep += ":1\r\n";
  ReplyFramer f;
  ASSERT_EQ(f.Next(deep.data(), deep.size() - 1), Status::kNeedMore);
  ASSERT_EQ(f.Next(deep.data(), deep.size()), Status::kOk);
  EXPECT_EQ(f.consumed(), deep.size());
  // The framer is usable for the next frame.
  const std::string next = "*2\r\n:1\r\n*1\r\n+a\r\n";
  ASSERT_EQ(f.Next(next.data(), next.size()), Status::kOk);
  EXPECT_EQ(f.consumed(), next.size());
}

// The fast path (a whole scalar at the frame start) and the general one describe a frame alike.
TEST(ReplyFramer, FastAndGeneralPathsAgree) {
  for (const std::string frame : {"+OK\r\n", "-ERR x\r\n", "$3\r\nfoo\r\n", "$-1\r\n", "$0\r\n\r\n"}) {
    SCOPED_TRACE(frame);
    ReplyFramer whole;
    ASSERT_EQ(whole.Next(frame.data(), frame.size()), Status::kOk);
    ReplyFramer split;  // fed a byte short first: the frame then ends on the general path
    ASSERT_EQ(split.Next(frame.data(), frame.size() - 1), Status::kNeedMore);
    ASSERT_EQ(split.Next(frame.data(), frame.size()), Status::kOk);
    for (const ReplyFramer* f : {&whole, &split}) {
      EXPECT_EQ(f->consumed(), frame.size());
      EXPECT_EQ(f->type(), frame[0]);
      EXPECT_EQ(f->size(), frame == "$-1\r\n" ? -1 : 0);
      ASSERT_EQ(f->head().size(), 1u);
    }
    EXPECT_EQ(whole.head()[0].type, split.head()[0].type);
    EXPECT_EQ(whole.head()[0].text, split.head()[0].text);
    EXPECT_EQ(whole.head()[0].text.data(), split.head()[0].text.data());
  }
}

// ParseValue parses the levels a reply rewrite looks at and keeps deeper aggregates as the bytes
// they came as: no recursion without bound, and the value encodes back to the same bytes.
TEST(ParseValue, DeepValuesKeepTheirBytesBelowTheParsedLevels) {
  for (int depth : {1000, 10000, 1000000}) {
    SCOPED_TRACE("depth " + std::to_string(depth));
    const std::string frame = DeepReply(depth);
    const std::optional<Value> v = ParseValue(frame);
    ASSERT_TRUE(v.has_value());
    std::string out;
    AppendValue(&out, *v);
    EXPECT_TRUE(out == frame);
    // Follow the nesting (the one element that is an aggregate, or an attribute's) down to where
    // ParseValue stopped.
    int parsed = 0;
    const Value* at = &*v;
    while (!at->unparsed) {
      const Value* next = nullptr;
      for (const auto* list : {&at->attributes, &at->elements}) {
        for (const Value& e : *list) {
          if (e.unparsed || !e.elements.empty() || !e.attributes.empty()) next = &e;
        }
      }
      ASSERT_NE(next, nullptr) << "parsed " << parsed;
      at = next;
      ++parsed;
    }
    EXPECT_EQ(parsed, kMaxParseDepth);
  }
}

TEST(ReplyFramer, LargeBulkHint) {
  ReplyFramer f;
  const std::string head = "$10000000\r\nabc";
  EXPECT_EQ(f.Next(head.data(), head.size()), Status::kNeedMore);
  EXPECT_EQ(f.hint(), 11 + 10000000 + 2u);
}

TEST(ReplyFramer, LongArrayFedByteByByteIsLinear) {
  // 200k elements fed one byte at a time: a framer that re-scanned from the frame start on
  // every call would take minutes here.
  std::string input = "*200000\r\n";
  for (int i = 0; i < 200000; ++i) input += ":1\r\n";
  const ReplyResult r = FeedReplies(input, 1);
  ASSERT_EQ(r.frames.size(), 1u);
  EXPECT_EQ(r.frames[0].size(), input.size());
}

TEST(SplitInlineArgs, MatchesSdssplitargs) {
  std::vector<std::string> out;
  ASSERT_TRUE(SplitInlineArgs("  set   \"a\\tb\"  'it\\'s'  \"\"  ", &out));
  EXPECT_EQ(out, (std::vector<std::string>{"set", "a\tb", "it's", ""}));
  out.clear();
  ASSERT_TRUE(SplitInlineArgs(std::string_view("a\0b c", 5), &out));
  EXPECT_EQ(out, (std::vector<std::string>{"a"}));  // a NUL ends the line, as in C
  out.clear();
  EXPECT_FALSE(SplitInlineArgs("\"abc", &out));
  EXPECT_FALSE(SplitInlineArgs("'abc", &out));
  EXPECT_FALSE(SplitInlineArgs("\"a\"b", &out));
}

}  // namespace
}  // namespace keyguard::resp
