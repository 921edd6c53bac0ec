#include "keyguard/resp/encoder.h"

#include <gtest/gtest.h>

#include <vector>

#include "keyguard/resp/framer.h"

namespace keyguard::resp {
namespace {

using namespace std::string_literals;

TEST(Encoder, Replies) {
  std::string out;
  AppendError(&out, "ERR keyguard: bad\r\nthing");
  AppendSimple(&out, "OK");
  AppendInteger(&out, -12);
  AppendBulk(&out, std::string_view("a\0b", 3));
  AppendNullBulk(&out);
  AppendArrayHeader(&out, 2);
  EXPECT_EQ(out, "-ERR keyguard: bad  thing\r\n+OK\r\n:-12\r\n$3\r\na\0b\r\n$-1\r\n*2\r\n"s);
}

TEST(Encoder, CommandRoundTripsThroughTheFramer) {
  std::string out;
  const std::vector<std::string_view> args = {"SET", "user:1", std::string_view("\r\n\0", 3)};
  AppendCommand(&out, args);
  EXPECT_EQ(out, "*3\r\n$3\r\nSET\r\n$6\r\nuser:1\r\n$3\r\n\r\n\0\r\n"s);
  RequestFramer f;
  ASSERT_EQ(f.Next(out.data(), out.size()), Status::kOk);
  EXPECT_EQ(f.consumed(), out.size());
  ASSERT_EQ(f.args().size(), 3u);
  EXPECT_EQ(f.args()[2], args[2]);
}

// WriteBulk writes what AppendBulk appends, within value.size() + kBulkOverhead bytes.
TEST(Encoder, WriteBulkMatchesAppendBulk) {
  for (const std::string& value : {""s, "k"s, "tenant:bench:key:000000012345"s, std::string(12345, 'x'), "a\0\r\n"s}) {
    std::string appended;
    AppendBulk(&appended, value);
    std::string buf(value.size() + kBulkOverhead, '#');
    char* end = WriteBulk(buf.data(), value);
    ASSERT_LE(end, buf.data() + buf.size());
    EXPECT_EQ(std::string(buf.data(), end), appended);
  }
}

TEST(Encoder, WriteCommandWritesWhatAppendCommandAppendsWithinItsBound) {
  const std::string big(12345, 'v');
  for (const std::vector<std::string_view>& args :
       {std::vector<std::string_view>{"PING"}, std::vector<std::string_view>{"SET", "k", big},
        std::vector<std::string_view>{"MSET", "", "", std::string_view("\0", 1), "x"}}) {
    std::string appended;
    AppendCommand(&appended, args);
    std::string buf(CommandBound(args), '#');
    const size_t n = static_cast<size_t>(WriteCommand(buf.data(), args) - buf.data());
    EXPECT_EQ(buf.substr(0, n), appended);
    EXPECT_LE(n, CommandBound(args));
  }
}

}  // namespace
}  // namespace keyguard::resp
