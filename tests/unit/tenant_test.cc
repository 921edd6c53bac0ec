// Tenant prefixing without sockets: requests in, replies out.
#include <gtest/gtest.h>

#include "absl/strings/match.h"

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "keyguard/commands/command_table.h"
#include "keyguard/config/v1/config.pb.h"
#include "keyguard/resp/encoder.h"
#include "keyguard/tenant/rewrite.h"
#include "keyguard/tenant/tenancy.h"
#include "keyguard/tenant/walk.h"

namespace keyguard::tenant {
namespace {

namespace v1 = keyguard::config::v1;

std::shared_ptr<const Tenancy> Make(v1::Tenancy p) {
  auto t = Tenancy::Compile(p, {});
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : nullptr;
}

class TenantTest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::Tenancy p;
    p.set_prefix("tenant:a:");
    p.add_allowed_scripts(Sha1Hex("return 1"));
    p.add_migrate_targets("10.0.0.9:6379");
    tenancy_ = Make(p);
    rewriter_ = std::make_unique<RequestRewriter>(*tenancy_);
  }
  // The rewritten request joined with spaces, or "REFUSE: <message>".
  std::string Req(std::vector<std::string> words, ReplyRewrite* reply = nullptr) {
    std::vector<std::string_view> args(words.begin(), words.end());
    const commands::CommandId id = commands::LookupCommand(args[0]);
    const commands::CommandSpec* spec = commands::ResolveSpec(id, args);
    std::vector<commands::KeyRef> keys;
    const bool ok = spec != nullptr && commands::FindKeys(*spec, args, &keys);
    std::vector<std::string_view> out;
    RequestResult r = rewriter_->Rewrite(*tenancy_->static_tenant(), id, spec, args, keys, ok, &out);
    if (reply != nullptr) *reply = r.reply;
    if (r.kind == RequestResult::Kind::kRefuse) return "REFUSE: " + r.message;
    if (r.walk != Walk::kNone) return absl::StrCat("WALK ", static_cast<int>(r.walk));
    const auto& used = r.modified ? out : args;
    std::string s;
    for (std::string_view a : used) s += (s.empty() ? "" : " ") + std::string(a);
    return s;
  }
  std::string Rep(ReplyRewrite kind, std::string frame, std::vector<uint8_t> exec = {}) {
    std::string out;
    return Shown(RewriteReply(*tenancy_, *tenancy_->static_tenant(), kind, exec, frame, &out), frame, out);
  }
  std::string Push(std::string frame) {
    std::string out;
    return Shown(RewritePush(*tenancy_, *tenancy_->static_tenant(), frame, &out), frame, out);
  }
  // What the client gets: the frame, its replacement, or "DROP".
  static std::string Shown(ReplyAction a, const std::string& frame, const std::string& out) {
    return a == ReplyAction::kPass ? frame : a == ReplyAction::kReplace ? out : "DROP";
  }
  std::shared_ptr<const Tenancy> tenancy_;
  std::unique_ptr<RequestRewriter> rewriter_;
};

TEST_F(TenantTest, KeysGetThePrefix) {
  EXPECT_EQ(Req({"SET", "k", "v"}), "SET tenant:a:k v");
  EXPECT_EQ(Req({"MSET", "a", "1", "b", "2"}), "MSET tenant:a:a 1 tenant:a:b 2");
  EXPECT_EQ(Req({"EVAL", "return 1", "2", "x", "y", "argv"}), "EVAL return 1 2 tenant:a:x tenant:a:y argv");
  EXPECT_EQ(Req({"XREAD", "COUNT", "1", "STREAMS", "s1", "s2", "0", "0"}),
            "XREAD COUNT 1 STREAMS tenant:a:s1 tenant:a:s2 0 0");
  EXPECT_EQ(Req({"GEORADIUS", "g", "0", "0", "1", "km", "STORE", "dst"}),
            "GEORADIUS tenant:a:g 0 0 1 km STORE tenant:a:dst");
  EXPECT_EQ(Req({"OBJECT", "ENCODING", "k"}), "OBJECT ENCODING tenant:a:k");
  EXPECT_EQ(Req({"DEBUG", "OBJECT", "k"}), "DEBUG OBJECT tenant:a:k");
  EXPECT_EQ(Req({"WATCH", "a", "b"}), "WATCH tenant:a:a tenant:a:b");
  EXPECT_EQ(Req({"COPY", "a", "b", "REPLACE"}), "COPY tenant:a:a tenant:a:b REPLACE");
  EXPECT_EQ(Req({"MIGRATE", "10.0.0.9", "6379", "", "0", "100", "KEYS", "a", "b"}),
            "MIGRATE 10.0.0.9 6379  0 100 KEYS tenant:a:a tenant:a:b");
  EXPECT_EQ(Req({"GET", "{user1}:x"}), "GET tenant:a:{user1}:x");  // the hash tag stays the first one
}

// Plain commands (Rewrite's fast path) get the general path's answers: keys prefixed, nothing
// modified without keys, @admin/@dangerous refused, a name holding a NUL refused.
TEST_F(TenantTest, PlainCommandsAnswerAsTheGeneralPath) {
  EXPECT_EQ(Req({"PING"}), "PING");
  EXPECT_EQ(Req({"GET", "k"}), "GET tenant:a:k");
  EXPECT_EQ(Req({"HSET", "h", "f", "v", "g", "w"}), "HSET tenant:a:h f v g w");
  EXPECT_EQ(Req({"BGSAVE"}), "REFUSE: ERR keyguard: command 'BGSAVE' is not allowed for tenants");
  EXPECT_EQ(Req({std::string("GET\0", 4), "k"}),
            "REFUSE: ERR keyguard: a command or subcommand name holding a NUL byte is not allowed for tenants");
  EXPECT_EQ(Req({"OBJECT", std::string("ENCODING\0", 9), "k"}),
            "REFUSE: ERR keyguard: a command or subcommand name holding a NUL byte is not allowed for tenants");
}

TEST_F(TenantTest, SortPatternsAndStore) {
  EXPECT_EQ(Req({"SORT", "l", "BY", "w_*", "GET", "#", "GET", "o_*->f", "LIMIT", "0", "5", "STORE", "d"}),
            "SORT tenant:a:l BY tenant:a:w_* GET # GET tenant:a:o_*->f LIMIT 0 5 STORE tenant:a:d");
}

TEST_F(TenantTest, PatternsAreConfined) {
  ReplyRewrite r;
  EXPECT_EQ(Req({"KEYS", "user:*"}, &r), "KEYS tenant:a:user:*");
  EXPECT_EQ(r, ReplyRewrite::kKeyArray);
  EXPECT_EQ(Req({"SCAN", "0"}, &r), "SCAN 0 MATCH tenant:a:*");
  EXPECT_EQ(r, ReplyRewrite::kScan);
  EXPECT_EQ(Req({"SCAN", "0", "MATCH", "u*", "COUNT", "10"}), "SCAN 0 MATCH tenant:a:u* COUNT 10");
  EXPECT_EQ(Req({"HSCAN", "h", "0", "MATCH", "f*"}), "HSCAN tenant:a:h 0 MATCH f*");
  EXPECT_EQ(Req({"CLIENT", "TRACKING", "on", "BCAST"}), "CLIENT TRACKING on BCAST PREFIX tenant:a:");
  EXPECT_EQ(Req({"CLIENT", "TRACKING", "on", "BCAST", "PREFIX", "u:"}), "CLIENT TRACKING on BCAST PREFIX tenant:a:u:");
}

TEST_F(TenantTest, GlobCharactersInThePrefixAreEscaped) {
  v1::Tenancy p;
  p.set_prefix("t*[1]:");
  auto t = Make(p);
  RequestRewriter rw(*t);
  std::vector<std::string_view> args = {"KEYS", "*"}, out;
  rw.Rewrite(*t->static_tenant(), commands::LookupCommand("keys"), &commands::Spec(commands::LookupCommand("keys")),
             args, {}, true, &out);
  EXPECT_EQ(out[1], "t\\*\\[1\\]:*");
  // SORT puts the element at the pattern's first '*', which would be the prefix's.
  auto sort = [&](std::vector<std::string_view> a) {
    const commands::CommandId id = commands::LookupCommand(a[0]);
    std::vector<commands::KeyRef> keys;
    const bool ok = commands::FindKeys(*commands::ResolveSpec(id, a), a, &keys);
    return rw.Rewrite(*t->static_tenant(), id, commands::ResolveSpec(id, a), a, keys, ok, &out).kind;
  };
  EXPECT_EQ(sort({"SORT", "l", "GET", "x"}), RequestResult::Kind::kRefuse);
  EXPECT_EQ(sort({"SORT_RO", "l", "BY", "nosort"}), RequestResult::Kind::kRefuse);
  EXPECT_EQ(sort({"SORT", "l", "ALPHA", "GET", "#", "STORE", "d"}), RequestResult::Kind::kForward);
}

TEST_F(TenantTest, ChannelsAndNotifications) {
  EXPECT_EQ(Req({"SUBSCRIBE", "news", "__keyspace@0__:k", "__keyevent@0__:set"}),
            "SUBSCRIBE tenant:a:news __keyspace@0__:tenant:a:k __keyevent@0__:set");
  EXPECT_EQ(Req({"PSUBSCRIBE", "n*", "__keyspace@0__:*"}), "PSUBSCRIBE tenant:a:n* __keyspace@0__:tenant:a:*");
  EXPECT_EQ(Req({"PUBLISH", "__keyevent@0__:set", "tenant:b:x"}), "PUBLISH tenant:a:__keyevent@0__:set tenant:b:x");
  EXPECT_EQ(Req({"PUBSUB", "CHANNELS"}), "PUBSUB CHANNELS tenant:a:*");
  EXPECT_EQ(Req({"PUBSUB", "NUMSUB", "c"}), "PUBSUB NUMSUB tenant:a:c");
}

// #12 break 4: the prefix went in after the first "__:" of a keyspace pattern, inside a class in
// `__keyspace@[^__:]*` (which then matched every tenant's keyspace channels), and after a '*' that
// can run into any key in `__keyspace@*__:*`.
TEST_F(TenantTest, PatternsThatCannotBeProvenConfinedAreRefused) {
  for (const char* p : {"__keyspace@[^__:]*", "__keyspace@*__:*", "__keyspace@?__:*", "__keyspace@0_[_]:*",
                        "__keyspace@__:*", "__keyspace@"}) {
    EXPECT_EQ(Req({"PSUBSCRIBE", p}).substr(0, 54), "REFUSE: ERR keyguard: this pattern may match other ten") << p;
    EXPECT_EQ(Req({"PUBSUB", "CHANNELS", p}).substr(0, 7), "REFUSE:") << p;
  }
  EXPECT_EQ(Req({"PSUBSCRIBE", "__keyspace@12__:u[:]*"}), "PSUBSCRIBE __keyspace@12__:tenant:a:u[:]*");
  EXPECT_EQ(Req({"PUBSUB", "CHANNELS", "[_]_keyspace@0__:*"}), "PUBSUB CHANNELS tenant:a:[_]_keyspace@0__:*");
  EXPECT_EQ(LiteralKeyspaceHead("__keyspace@0__:k"), 15u);
  EXPECT_EQ(LiteralKeyspaceHead("__keyspace@*__:k"), 0u);
  EXPECT_TRUE(GlobMayMatchPrefix("__key*", "__keyspace@"));
  EXPECT_TRUE(GlobMayMatchPrefix("[_]_keyspace@0__:*", "__keyspace@"));
  EXPECT_TRUE(GlobMayMatchPrefix("?_keyspace@", "__keyspace@"));
  EXPECT_TRUE(GlobMayMatchPrefix("\\_\\_keyspace@x", "__keyspace@"));
  EXPECT_FALSE(GlobMayMatchPrefix("news*", "__keyspace@"));
  EXPECT_FALSE(GlobMayMatchPrefix("__keyevent@*", "__keyspace@"));
  EXPECT_FALSE(GlobMayMatchPrefix("__keys", "__keyspace@"));  // matches only shorter strings
  // Shared channels: a pattern that may reach keyspace channels is refused, others pass as they are.
  v1::Tenancy p;
  p.set_prefix("tenant:s:");
  p.set_channels(v1::SHARED);
  auto t = Make(p);
  RequestRewriter rw(*t);
  auto run = [&](std::vector<std::string_view> a) {
    std::vector<std::string_view> out;
    const commands::CommandId id = commands::LookupCommand(a[0]);
    return rw.Rewrite(*t->static_tenant(), id, commands::ResolveSpec(id, a), a, {}, true, &out).kind;
  };
  EXPECT_EQ(run({"PSUBSCRIBE", "*"}), RequestResult::Kind::kRefuse);
  EXPECT_EQ(run({"PSUBSCRIBE", "__k?yspace@0__:x"}), RequestResult::Kind::kRefuse);
  EXPECT_EQ(run({"PSUBSCRIBE", "news.*"}), RequestResult::Kind::kForward);
  EXPECT_EQ(run({"PSUBSCRIBE", "__keyevent@0__:*"}), RequestResult::Kind::kForward);
}

TEST_F(TenantTest, EscapesAreRefusedOrEmulated) {
  for (auto words : std::vector<std::vector<std::string>>{{"SWAPDB", "0", "1"},
                                                          {"MOVE", "k", "1"},
                                                          {"SELECT", "1"},
                                                          {"COPY", "a", "b", "DB", "1"},
                                                          {"MIGRATE", "evil", "6379", "k", "0", "100"},
                                                          {"MONITOR"},
                                                          {"CLIENT", "LIST"},
                                                          {"CLIENT", "KILL", "ID", "1"},
                                                          {"CONFIG", "GET", "*"},
                                                          {"DEBUG", "SLEEP", "0"},
                                                          {"SLOWLOG", "GET"},
                                                          {"ACL", "LIST"},
                                                          {"MODULE", "LIST"},
                                                          {"SCRIPT", "FLUSH"},
                                                          {"FUNCTION", "LIST"},
                                                          {"CLUSTER", "INFO"},
                                                          {"SHUTDOWN"},
                                                          {"REPLICAOF", "no", "one"},
                                                          {"EVAL", "return redis.call('keys','*')", "0"},
                                                          {"EVALSHA", "0000000000000000000000000000000000000000", "0"},
                                                          {"FCALL", "f", "0"},
                                                          {"PUBSUB", "NUMPAT"},
                                                          {"NOSUCHCOMMAND", "x"},
                                                          {"GET"},
                                                          {"MEMORY", "STATS"}}) {
    EXPECT_EQ(Req(words).substr(0, 8), "REFUSE: ") << words[0];
  }
  EXPECT_EQ(Req({"SELECT", "0"}), "SELECT 0");
  EXPECT_EQ(Req({"EVAL", "return 1", "0"}), "EVAL return 1 0");  // on the allow-list
  EXPECT_EQ(Req({"CLIENT", "SETNAME", "x"}), "CLIENT SETNAME x");
  // SCRIPT EXISTS asks the server only about allow-listed scripts ("" names none: 0).
  const std::string sha = Sha1Hex("return 1");
  EXPECT_EQ(Req({"SCRIPT", "EXISTS", "ff", absl::AsciiStrToUpper(sha), sha}),
            "SCRIPT EXISTS  " + absl::AsciiStrToUpper(sha) + " " + sha);
  EXPECT_EQ(Req({"MEMORY", "USAGE", "k"}), "MEMORY USAGE tenant:a:k");
  // FLUSH*, DBSIZE and RANDOMKEY are walks over the tenant's keys in steps (the session runs them).
  EXPECT_EQ(Req({"FLUSHDB"}), "WALK 1");
  EXPECT_EQ(Req({"FLUSHALL", "ASYNC"}), "WALK 1");
  EXPECT_EQ(Req({"DBSIZE"}), "WALK 2");
  EXPECT_EQ(Req({"RANDOMKEY"}), "WALK 3");
  EXPECT_EQ(Req({"FLUSHALL", "sync"}), "WALK 1");
  // With the server's own argument errors.
  EXPECT_EQ(Req({"DBSIZE", "x"}), "REFUSE: ERR wrong number of arguments for 'dbsize' command");
  EXPECT_EQ(Req({"RANDOMKEY", "y"}), "REFUSE: ERR wrong number of arguments for 'randomkey' command");
  EXPECT_EQ(Req({"FLUSHALL", "bogus"}), "REFUSE: ERR syntax error");
  EXPECT_EQ(Req({"FLUSHDB", "ASYNC", "x"}), "REFUSE: ERR syntax error");
  // One step: an EVAL of the walk script over the tenant's escaped glob, from a cursor.
  const std::string step = WalkStep(*tenancy_->static_tenant(), Walk::kDbsize, "1234", 7, 500);
  EXPECT_TRUE(absl::StartsWith(step, "*9\r\n$4\r\nEVAL\r\n")) << step;
  EXPECT_TRUE(absl::EndsWith(step,
                             "$1\r\n0\r\n$6\r\ndbsize\r\n$10\r\ntenant:a:*\r\n$9\r\ntenant:a:\r\n"
                             "$4\r\n1234\r\n$3\r\n500\r\n$1\r\n7\r\n"))
      << step;
  EXPECT_EQ(Req({"GET"}), "REFUSE: ERR wrong number of arguments for 'get' command");
  // A key count that does not fit goes to the server for its own error, every possible key
  // prefixed and the counts (and the timeout before them) as they came.
  EXPECT_EQ(Req({"ZUNIONSTORE", "d", "3", "a", "x"}), "ZUNIONSTORE tenant:a:d 3 tenant:a:a tenant:a:x");
  EXPECT_EQ(Req({"SINTERCARD", "0", "k"}), "SINTERCARD 0 tenant:a:k");
  EXPECT_EQ(Req({"BLMPOP", "1", "9", "a", "LEFT"}), "BLMPOP 1 9 tenant:a:a tenant:a:LEFT");
  EXPECT_EQ(Req({"LMPOP", "0", "LEFT"}), "LMPOP 0 tenant:a:LEFT");
}

TEST_F(TenantTest, RepliesLoseThePrefix) {
  EXPECT_EQ(Rep(ReplyRewrite::kKeyArray, "*3\r\n$10\r\ntenant:a:x\r\n$10\r\ntenant:b:y\r\n$11\r\ntenant:a:yy\r\n"),
            "*2\r\n$1\r\nx\r\n$2\r\nyy\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kScan, "*2\r\n$1\r\n0\r\n*1\r\n$10\r\ntenant:a:x\r\n"),
            "*2\r\n$1\r\n0\r\n*1\r\n$1\r\nx\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kFirstKey, "*2\r\n$10\r\ntenant:a:l\r\n$1\r\nv\r\n"), "*2\r\n$1\r\nl\r\n$1\r\nv\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kFirstKey, "*-1\r\n"), "*-1\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kBulkKey, "$10\r\ntenant:a:k\r\n"), "$1\r\nk\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kBulkKey, "$-1\r\n"), "$-1\r\n");
  // CLIENT TRACKINGINFO: prefixes lose the tenant's; one without it is never shown.
  EXPECT_EQ(Rep(ReplyRewrite::kTrackingInfo,
                "*6\r\n$5\r\nflags\r\n*2\r\n$2\r\non\r\n$5\r\nbcast\r\n$8\r\nredirect\r\n"
                ":0\r\n$8\r\nprefixes\r\n*3\r\n$9\r\ntenant:a:\r\n$10\r\ntenant:a:u\r\n$2\r\nxx\r\n"),
            "*6\r\n$5\r\nflags\r\n*2\r\n$2\r\non\r\n$5\r\nbcast\r\n$8\r\nredirect\r\n:0\r\n$8\r\nprefixes\r\n*2\r\n"
            "$0\r\n\r\n$1\r\nu\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kTrackingInfo, "%1\r\n$8\r\nprefixes\r\n*1\r\n$10\r\ntenant:b:u\r\n"),
            "%1\r\n$8\r\nprefixes\r\n*0\r\n");
  // XREAD: RESP2 array of [key, entries], RESP3 map.
  EXPECT_EQ(Rep(ReplyRewrite::kStreams, "*1\r\n*2\r\n$10\r\ntenant:a:s\r\n*0\r\n"), "*1\r\n*2\r\n$1\r\ns\r\n*0\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kStreams, "%1\r\n$10\r\ntenant:a:s\r\n*0\r\n"), "%1\r\n$1\r\ns\r\n*0\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kNone, "-NOGROUP No such key 'tenant:a:s' or consumer group 'g'\r\n"),
            "-NOGROUP No such key 's' or consumer group 'g'\r\n");
  // An EXEC reply with another count than the commands keyguard saw queued is not passed.
  EXPECT_EQ(Rep(ReplyRewrite::kExec, "*2\r\n+OK\r\n$9\r\ndb0:keys=\r\n", {0}),
            "-ERR keyguard: the reply could not be confined to the tenant\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kExec, "*-1\r\n", {0, 1}), "*-1\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kExec, "*3\r\n+OK\r\n*1\r\n$10\r\ntenant:a:k\r\n-ERR tenant:a:z\r\n", {0, 1, 0}),
            "*3\r\n+OK\r\n*1\r\n$1\r\nk\r\n-ERR z\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kInfo, "$41\r\n# Server\r\nv:1\r\n\r\n# Keyspace\r\ndb0:keys=3\r\n\r\n"),
            "$15\r\n# Server\r\nv:1\r\n\r\n");
  // Only sections that describe the server itself stay: what moves with other tenants' traffic goes.
  EXPECT_EQ(Rep(ReplyRewrite::kInfo,
                "$130\r\n# Server\r\nv:1\r\n\r\n# Clients\r\nblocked_clients:1\r\n\r\n"
                "# Stats\r\nkeyspace_hits:9\r\n\r\n# Commandstats\r\ncmdstat_get:calls=9\r\n\r\n"
                "# Cluster\r\nc:0\r\n"),
            "$31\r\n# Server\r\nv:1\r\n\r\n# Cluster\r\nc:0\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kInfo, "$26\r\n# Stats\r\nkeyspace_hits:9\r\n\r\n"), "$0\r\n\r\n");
  EXPECT_EQ(Rep(ReplyRewrite::kChannelCounts, "*4\r\n$10\r\ntenant:a:c\r\n:1\r\n$10\r\ntenant:b:c\r\n:1\r\n"),
            "*2\r\n$1\r\nc\r\n:1\r\n");
}

// A reply nested deeper than ParseValue parses (an EVAL's, inside EXEC) is kept byte for byte
// while the replies around it are rewritten.
TEST_F(TenantTest, DeepRepliesInsideExecKeepTheirBytes) {
  for (int depth : {1000, 1000000}) {
    std::string deep;
    for (int i = 0; i < depth; ++i) deep += "*1\r\n";
    deep += "-ERR reached lua stack limit\r\n";
    const std::string out = Rep(ReplyRewrite::kExec, "*2\r\n" + deep + "*1\r\n$10\r\ntenant:a:k\r\n", {0, 1});
    EXPECT_TRUE(out == "*2\r\n" + deep + "*1\r\n$1\r\nk\r\n") << depth << ": " << out.substr(0, 100);
  }
}

TEST_F(TenantTest, PushesAreConfined) {
  EXPECT_EQ(Push("*3\r\n$7\r\nmessage\r\n$13\r\ntenant:a:news\r\n$2\r\nhi\r\n"),
            "*3\r\n$7\r\nmessage\r\n$4\r\nnews\r\n$2\r\nhi\r\n");
  EXPECT_EQ(Push("*3\r\n$7\r\nmessage\r\n$13\r\ntenant:b:news\r\n$2\r\nhi\r\n"), "DROP");
  EXPECT_EQ(Push(">4\r\n$8\r\npmessage\r\n$25\r\n__keyspace@0__:tenant:a:*\r\n$25\r\n__keyspace@0__:tenant:a:k\r\n$"
                 "3\r\nset\r\n"),
            ">4\r\n$8\r\npmessage\r\n$16\r\n__keyspace@0__:*\r\n$16\r\n__keyspace@0__:k\r\n$3\r\nset\r\n");
  EXPECT_EQ(Push("*3\r\n$7\r\nmessage\r\n$25\r\n__keyspace@0__:tenant:b:k\r\n$3\r\nset\r\n"), "DROP");
  EXPECT_EQ(Push("*3\r\n$7\r\nmessage\r\n$18\r\n__keyevent@0__:set\r\n$10\r\ntenant:a:k\r\n"),
            "*3\r\n$7\r\nmessage\r\n$18\r\n__keyevent@0__:set\r\n$1\r\nk\r\n");
  EXPECT_EQ(Push("*3\r\n$7\r\nmessage\r\n$18\r\n__keyevent@0__:set\r\n$10\r\ntenant:b:k\r\n"), "DROP");
  EXPECT_EQ(Push(">2\r\n$10\r\ninvalidate\r\n*2\r\n$10\r\ntenant:a:k\r\n$10\r\ntenant:b:k\r\n"),
            ">2\r\n$10\r\ninvalidate\r\n*1\r\n$1\r\nk\r\n");
  EXPECT_EQ(Push(">2\r\n$10\r\ninvalidate\r\n*1\r\n$10\r\ntenant:b:k\r\n"), "DROP");
  EXPECT_EQ(Push(">2\r\n$10\r\ninvalidate\r\n_\r\n"), ">2\r\n$10\r\ninvalidate\r\n_\r\n");
  EXPECT_EQ(Push("*3\r\n$7\r\nmessage\r\n$20\r\n__redis__:invalidate\r\n*1\r\n$10\r\ntenant:b:k\r\n"), "DROP");
  EXPECT_EQ(Push("*3\r\n$9\r\nsubscribe\r\n$13\r\ntenant:a:news\r\n:1\r\n"),
            "*3\r\n$9\r\nsubscribe\r\n$4\r\nnews\r\n:1\r\n");
}

TEST_F(TenantTest, ModuleCommandsNeedCompleteKeySpecs) {
  // Two module commands as a pre-7.0 COMMAND INFO describes them: one with its key at 1, one
  // (like FT.SEARCH) with none, whose reach keyguard cannot see.
  std::string info;
  resp::AppendArrayHeader(&info, 2);
  for (auto [name, first] : {std::pair{"tmod.set", 1}, std::pair{"tmod.search", 0}}) {
    resp::AppendArrayHeader(&info, 6);
    resp::AppendBulk(&info, name);
    resp::AppendInteger(&info, -2);
    resp::AppendArrayHeader(&info, 0);
    resp::AppendInteger(&info, first);
    resp::AppendInteger(&info, first);
    resp::AppendInteger(&info, first);
  }
  ASSERT_TRUE(commands::ExtendFromCommandInfo(info).ok());
  rewriter_ = std::make_unique<RequestRewriter>(*tenancy_);
  EXPECT_EQ(Req({"TMOD.SET", "k", "v"}), "TMOD.SET tenant:a:k v");
  EXPECT_EQ(
      Req({"TMOD.SEARCH", "idx", "*"}),
      "REFUSE: ERR keyguard: command 'TMOD.SEARCH' does not declare all its keys, so it cannot be confined to the "
      "tenant");
}

TEST_F(TenantTest, TrackingRedirectNamesOnlyTheTenantsConnections) {
  const std::string refused =
      "REFUSE: ERR keyguard: CLIENT TRACKING REDIRECT may only name a connection of the same tenant";
  EXPECT_EQ(Req({"CLIENT", "TRACKING", "on", "REDIRECT", "7"}), refused);  // no registry: none is known
  Connections connections;
  Tenant other{"b", "tenant:b:", "tenant:b:"};
  connections.Set(7, tenancy_->static_tenant());
  connections.Set(8, &other);
  rewriter_ = std::make_unique<RequestRewriter>(*tenancy_, &connections);
  EXPECT_EQ(Req({"CLIENT", "TRACKING", "on", "REDIRECT", "7"}), "CLIENT TRACKING on REDIRECT 7");
  EXPECT_EQ(Req({"CLIENT", "TRACKING", "on", std::string("redirect\0", 9), "8"}),
            refused);  // a NUL ends the word for Redis
  EXPECT_EQ(Req({"CLIENT", "TRACKING", "off", "REDIRECT", "7", "REDIRECT", "9"}), refused);
  EXPECT_EQ(Req({"CLIENT", "TRACKING", "on", "REDIRECT", "x"}), "CLIENT TRACKING on REDIRECT x");  // the server's error
  connections.Set(7, nullptr);
  EXPECT_EQ(connections.size(), 1u);
  EXPECT_EQ(Req({"CLIENT", "TRACKING", "on", "REDIRECT", "7"}), refused);
}

TEST(TenancyConfigTest, Validation) {
  v1::Tenancy p;
  auto* a = p.add_users();
  a->set_name("alice");
  a->set_password("alice-secret");
  a->set_prefix("tenant:a:");
  auto* b = p.add_users();
  b->set_name("bob");
  b->set_password_sha256(Hex(Sha256("bob-secret").data(), 32));
  b->set_prefix("tenant:b:");
  auto t = Tenancy::Compile(p, {});
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_NE((*t)->Authenticate("alice", "alice-secret"), nullptr);
  EXPECT_EQ((*t)->Authenticate("alice", "alice-secret")->tenant->name, "tenant:a");
  EXPECT_EQ((*t)->Authenticate("alice", "bob-secret"), nullptr);
  EXPECT_EQ((*t)->Authenticate("bob", "bob-secret")->tenant->prefix, "tenant:b:");
  EXPECT_EQ((*t)->Authenticate("carol", "x"), nullptr);

  b->set_prefix("tenant:a:b:");
  EXPECT_EQ(Tenancy::Compile(p, {}).status().message(),
            "tenancy: prefix 'tenant:a:' begins prefix 'tenant:a:b:': tenant 'tenant:a' would see tenant "
            "'tenant:a:b''s keys");
  b->set_prefix("{t}:");
  EXPECT_EQ(Tenancy::Compile(p, {}).status().message().substr(0, 37), "tenancy.users[1].prefix: must not con");
  b->set_prefix("tenant:b:");
  b->set_password_sha256("abc");
  EXPECT_EQ(Tenancy::Compile(p, {}).status().message(),
            "tenancy.users[1].password_sha256: must be 64 hex digits (sha256sum of the password)");
  p.set_prefix("x:");
  EXPECT_FALSE(Tenancy::Compile(p, {}).ok());
}

TEST(TenancyConfigTest, CertificateNamesLogInWithoutAPassword) {
  v1::Tenancy p;
  auto* a = p.add_users();
  a->set_name("alice");
  a->set_prefix("tenant:a:");
  EXPECT_EQ(Tenancy::Compile(p, {}).status().message(),
            "tenancy.users[0].password_sha256: a user needs a password (password_sha256 or password) or cert_names");
  a->add_cert_names("alice.example");
  a->add_cert_names("spiffe://prod/alice");
  auto* b = p.add_users();
  b->set_name("bob");
  b->set_password("bob-secret");
  b->set_prefix("tenant:b:");
  b->add_cert_names("bob.example");
  auto t = Tenancy::Compile(p, {});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE((*t)->has_cert_names());
  ASSERT_NE((*t)->ForCertificate({"pod-7", "spiffe://prod/alice"}), nullptr);
  EXPECT_EQ((*t)->ForCertificate({"pod-7", "spiffe://prod/alice"})->name, "alice");
  EXPECT_EQ((*t)->ForCertificate({"bob.example"})->tenant->prefix, "tenant:b:");
  EXPECT_EQ((*t)->ForCertificate({"carol.example", "alice.example.org"}), nullptr);
  EXPECT_EQ((*t)->ForCertificate({}), nullptr);
  // A certificate-only user cannot AUTH, not even with an empty password; bob still can.
  EXPECT_EQ((*t)->Authenticate("alice", ""), nullptr);
  EXPECT_NE((*t)->Authenticate("bob", "bob-secret"), nullptr);

  b->add_cert_names("alice.example");
  EXPECT_EQ(Tenancy::Compile(p, {}).status().message(),
            "tenancy.users[1].cert_names[1]: 'alice.example' already names user 'alice'");
  b->set_cert_names(1, "");
  EXPECT_EQ(Tenancy::Compile(p, {}).status().message(), "tenancy.users[1].cert_names[1]: must not be empty");
}

// A walk's replies as the server sends them: [cursor, keys seen, a key found or ""].
KeyWalk::Step StepReply(KeyWalk& w, std::string_view cursor, std::string_view seen, std::string_view found,
                        int protocol = 2) {
  const resp::ReplyFramer::Scalar head[] = {{'$', cursor}, {':', seen}, {'$', found}};
  return w.OnReply('*', head, "tenant:a:", protocol);
}

TEST_F(TenantTest, KeyWalkSendsStepsFromTheLastCursorAndAnswersOnceTheCursorIsZero) {
  const Tenant& t = *tenancy_->static_tenant();
  KeyWalk w;
  EXPECT_FALSE(w.active());
  w.Start(Walk::kDbsize);
  EXPECT_EQ(w.NextRequest(t, 100), WalkStep(t, Walk::kDbsize, "0", 0, 100));
  KeyWalk::Step s = StepReply(w, "17", "100", "");
  EXPECT_FALSE(s.done);
  EXPECT_EQ(w.NextRequest(t, 100), WalkStep(t, Walk::kDbsize, "17", 1, 100));
  s = StepReply(w, "0", "42", "");
  EXPECT_TRUE(s.done);
  EXPECT_FALSE(s.error);
  EXPECT_EQ(s.reply, ":142\r\n");
  w.Finish();
  EXPECT_FALSE(w.active());

  w.Start(Walk::kRandomkey);  // a key found ends the walk, without the tenant's prefix
  s = StepReply(w, "5", "3", "tenant:a:user:1");
  EXPECT_TRUE(s.done);
  EXPECT_EQ(s.reply, "$6\r\nuser:1\r\n");
  w.Start(Walk::kRandomkey);  // none at all: the protocol's null
  EXPECT_EQ(StepReply(w, "0", "0", "", 2).reply, "$-1\r\n");
  w.Start(Walk::kRandomkey);
  EXPECT_EQ(StepReply(w, "0", "0", "", 3).reply, "_\r\n");
  w.Start(Walk::kFlush);
  EXPECT_EQ(StepReply(w, "0", "9", "").reply, "+OK\r\n");

  w.Start(Walk::kDbsize);  // a refused step fails the command with the server's error
  const resp::ReplyFramer::Scalar oom[] = {{'-', "OOM command not allowed"}};
  s = w.OnReply('-', oom, "tenant:a:", 2);
  EXPECT_TRUE(s.done && s.error);
  EXPECT_EQ(s.reply, "-OOM command not allowed\r\n");
  w.Start(Walk::kDbsize);
  s = StepReply(w, "0", "-1", "");
  EXPECT_TRUE(s.done && s.error);
  EXPECT_EQ(s.reply, "-ERR keyguard: unexpected reply to a key walk step\r\n");

  // A cluster's primaries one after the other, each from cursor 0; the count is the sum.
  w.Start(Walk::kDbsize, 3);
  EXPECT_EQ(w.node(), 0u);
  EXPECT_FALSE(StepReply(w, "0", "5", "").done);
  EXPECT_EQ(w.node(), 1u);
  EXPECT_EQ(w.NextRequest(t, 100), WalkStep(t, Walk::kDbsize, "0", 1, 100));
  EXPECT_FALSE(StepReply(w, "8", "2", "").done);
  EXPECT_EQ(w.node(), 1u);
  EXPECT_FALSE(StepReply(w, "0", "1", "").done);
  EXPECT_EQ(w.node(), 2u);
  s = StepReply(w, "0", "4", "");
  EXPECT_TRUE(s.done);
  EXPECT_EQ(s.reply, ":12\r\n");
  w.Start(Walk::kRandomkey, 2);  // a key found on the first node ends it there
  s = StepReply(w, "3", "1", "tenant:a:k");
  EXPECT_TRUE(s.done);
  EXPECT_EQ(s.reply, "$1\r\nk\r\n");
}

TEST(StepBudgetTest, HoldsOneSecondsWorthAndSaysHowLongUntilTheNext) {
  StepBudget b;
  const int64_t t0 = 1'000'000'000;
  for (int i = 0; i < 4; ++i) EXPECT_EQ(b.Take(4, t0), 0) << i;  // a full bucket: 4 steps at once
  const int64_t wait = b.Take(4, t0);
  EXPECT_EQ(wait, 250'000'001);  // a quarter second, rounded up
  EXPECT_GT(b.Take(4, t0 + wait / 2), 0);
  EXPECT_EQ(b.Take(4, t0 + wait), 0);
  EXPECT_EQ(b.Take(0, t0), 0) << "0: no limit";
}

}  // namespace
}  // namespace keyguard::tenant
