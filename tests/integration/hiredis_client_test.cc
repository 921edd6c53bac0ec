// Through keyguard with hiredis against a real redis-server: 10k pipelined commands with exact
// replies, binary-safe keys and values, a 64 MB value, and two tenants. The test starts both
// servers itself.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <string>
#include <thread>
#include <vector>

namespace {

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

pid_t Spawn(std::vector<std::string> argv) {
  pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  return pid;
}

// Waits for the port to accept, up to a bound no loaded machine reaches (a passing run returns as
// soon as the process listens).
bool WaitForPort(int port) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    redisContext* c = redisConnect("127.0.0.1", port);
    const bool ok = c != nullptr && c->err == 0;
    if (c) redisFree(c);
    if (ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return false;
}

class HiredisThroughKeyguard : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    redis_port_ = FreePort();
    redis_ = Spawn({"redis-server", "--port", std::to_string(redis_port_), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--logfile", "/dev/null"});
    ASSERT_TRUE(WaitForPort(redis_port_));
    kg_port_ = FreePort();
    const int admin = FreePort();
    keyguard_ = Spawn({KEYGUARD_BIN, "--listen", "127.0.0.1:" + std::to_string(kg_port_), "--upstream",
                       "127.0.0.1:" + std::to_string(redis_port_), "--admin", "127.0.0.1:" + std::to_string(admin),
                       "--threads", "2"});
    ASSERT_TRUE(WaitForPort(kg_port_));
  }
  static void TearDownTestSuite() {
    for (pid_t p : {keyguard_, redis_}) {
      if (p > 0) {
        kill(p, SIGTERM);
        waitpid(p, nullptr, 0);
      }
    }
  }
  void SetUp() override {
    c_ = redisConnect("127.0.0.1", kg_port_);
    ASSERT_TRUE(c_ != nullptr && c_->err == 0);
    Expect(redisCommand(c_, "FLUSHALL"), "OK");
  }
  void TearDown() override {
    if (c_) redisFree(c_);
  }
  static void Expect(void* r, const std::string& status) {
    auto* reply = static_cast<redisReply*>(r);
    ASSERT_NE(reply, nullptr);
    EXPECT_EQ(reply->type, REDIS_REPLY_STATUS);
    EXPECT_EQ(std::string(reply->str, reply->len), status);
    freeReplyObject(reply);
  }

  static inline int redis_port_, kg_port_;
  static inline pid_t redis_ = -1, keyguard_ = -1;
  redisContext* c_ = nullptr;
};

TEST_F(HiredisThroughKeyguard, TenThousandPipelinedCommandsExactReplies) {
  constexpr int kN = 10000;
  for (int i = 0; i < kN; ++i) {
    switch (i % 4) {
      case 0: redisAppendCommand(c_, "SET key:%d value-%d", i, i); break;
      case 1: redisAppendCommand(c_, "GET key:%d", i - 1); break;
      case 2: redisAppendCommand(c_, "INCR counter"); break;
      case 3: redisAppendCommand(c_, "GET nosuchkey"); break;
    }
  }
  int incr = 0;
  for (int i = 0; i < kN; ++i) {
    void* r = nullptr;
    ASSERT_EQ(redisGetReply(c_, &r), REDIS_OK) << i;
    auto* reply = static_cast<redisReply*>(r);
    switch (i % 4) {
      case 0:
        ASSERT_EQ(reply->type, REDIS_REPLY_STATUS);
        ASSERT_STREQ(reply->str, "OK");
        break;
      case 1:
        ASSERT_EQ(reply->type, REDIS_REPLY_STRING);
        ASSERT_EQ(std::string(reply->str, reply->len), "value-" + std::to_string(i - 1));
        break;
      case 2:
        ASSERT_EQ(reply->type, REDIS_REPLY_INTEGER);
        ASSERT_EQ(reply->integer, ++incr);
        break;
      case 3: ASSERT_EQ(reply->type, REDIS_REPLY_NIL); break;
    }
    freeReplyObject(reply);
  }
}

TEST_F(HiredisThroughKeyguard, BinarySafeKeysAndValues) {
  std::string key("k\0\r\n\xff", 5);
  std::string value;
  for (int i = 0; i < 256; ++i) value.push_back(static_cast<char>(i));
  value += "\r\n*1\r\n$4\r\nPING\r\n";  // protocol bytes inside a value stay data
  Expect(redisCommand(c_, "SET %b %b", key.data(), key.size(), value.data(), value.size()), "OK");
  auto* r = static_cast<redisReply*>(redisCommand(c_, "GET %b", key.data(), key.size()));
  ASSERT_EQ(r->type, REDIS_REPLY_STRING);
  EXPECT_EQ(std::string(r->str, r->len), value);
  freeReplyObject(r);
  r = static_cast<redisReply*>(redisCommand(c_, "KEYS *"));
  ASSERT_EQ(r->type, REDIS_REPLY_ARRAY);
  ASSERT_EQ(r->elements, 1u);
  EXPECT_EQ(std::string(r->element[0]->str, r->element[0]->len), key);
  freeReplyObject(r);
}

TEST_F(HiredisThroughKeyguard, SixtyFourMegabyteValue) {
  std::string value(64 << 20, '\0');
  for (size_t i = 0; i < value.size(); ++i) value[i] = static_cast<char>((i * 2654435761u) >> 24);
  Expect(redisCommand(c_, "SET big %b", value.data(), value.size()), "OK");
  auto* r = static_cast<redisReply*>(redisCommand(c_, "STRLEN big"));
  EXPECT_EQ(r->integer, 64 << 20);
  freeReplyObject(r);
  r = static_cast<redisReply*>(redisCommand(c_, "GET big"));
  ASSERT_EQ(r->type, REDIS_REPLY_STRING);
  ASSERT_EQ(r->len, value.size());
  EXPECT_TRUE(std::string_view(r->str, r->len) == value);
  freeReplyObject(r);
}

}  // namespace

namespace {

// Two tenants of examples/tenants.yaml, through hiredis: each sees its own keys as if it had the
// server to itself, and the server holds them under the tenants' prefixes.
class HiredisTenants : public ::testing::Test {
 protected:
  void SetUp() override {
    redis_port_ = FreePort();
    redis_ = Spawn({"redis-server", "--port", std::to_string(redis_port_), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--logfile", "/dev/null"});
    ASSERT_TRUE(WaitForPort(redis_port_));
    kg_port_ = FreePort();
    const int admin = FreePort();
    keyguard_ =
        Spawn({KEYGUARD_BIN, "--config", std::string(KEYGUARD_SOURCE_DIR) + "/examples/tenants.yaml", "--listen",
               "127.0.0.1:" + std::to_string(kg_port_), "--upstream", "127.0.0.1:" + std::to_string(redis_port_),
               "--admin", "127.0.0.1:" + std::to_string(admin), "--threads", "1"});
    ASSERT_TRUE(WaitForPort(kg_port_));
  }
  void TearDown() override {
    for (pid_t p : {keyguard_, redis_}) {
      if (p > 0) {
        kill(p, SIGTERM);
        waitpid(p, nullptr, 0);
      }
    }
  }
  static std::string Str(redisContext* c, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    auto* r = static_cast<redisReply*>(redisvCommand(c, fmt, ap));
    va_end(ap);
    std::string s = r == nullptr                     ? "<io error>"
                    : r->type == REDIS_REPLY_NIL     ? "<nil>"
                    : r->type == REDIS_REPLY_INTEGER ? std::to_string(r->integer)
                    : r->type == REDIS_REPLY_ARRAY   ? "<array>"
                                                     : std::string(r->str, r->len);
    if (r != nullptr && r->type == REDIS_REPLY_ARRAY) {
      s = "[";
      for (size_t i = 0; i < r->elements; ++i) {
        const redisReply* e = r->element[i];
        s += (i ? "," : "") + (e->type == REDIS_REPLY_ARRAY ? std::string("<array>") : std::string(e->str, e->len));
      }
      s += "]";
    }
    if (r != nullptr) freeReplyObject(r);
    return s;
  }
  int redis_port_ = 0, kg_port_ = 0;
  pid_t redis_ = -1, keyguard_ = -1;
};

TEST_F(HiredisTenants, EachSeesOnlyItsOwnKeys) {
  redisContext* alice = redisConnect("127.0.0.1", kg_port_);
  redisContext* bob = redisConnect("127.0.0.1", kg_port_);
  redisContext* direct = redisConnect("127.0.0.1", redis_port_);
  ASSERT_TRUE(alice && !alice->err && bob && !bob->err && direct && !direct->err);
  EXPECT_EQ(Str(alice, "GET k"), "NOAUTH Authentication required.");
  EXPECT_EQ(Str(alice, "AUTH alice wrong"), "WRONGPASS invalid username-password pair or user is disabled.");
  EXPECT_EQ(Str(alice, "AUTH alice alice-secret"), "OK");
  EXPECT_EQ(Str(bob, "AUTH bob bob-secret"), "OK");
  EXPECT_EQ(Str(alice, "SET %s %s", "k", "from alice"), "OK");
  EXPECT_EQ(Str(bob, "GET k"), "<nil>");
  EXPECT_EQ(Str(bob, "RPUSH q job"), "1");
  EXPECT_EQ(Str(alice, "KEYS *"), "[k]");
  EXPECT_EQ(Str(bob, "BLPOP q 1"), "[q,job]");
  EXPECT_EQ(Str(alice, "GET k"), "from alice");
  EXPECT_EQ(Str(bob, "SWAPDB 0 1"), "ERR keyguard: command 'SWAPDB' is not allowed for tenants");
  EXPECT_EQ(Str(direct, "KEYS *"), "[tenant:a:k]");
  redisFree(alice);
  redisFree(bob);
  redisFree(direct);
}

}  // namespace
