// The traffic detectors without a proxy: commands and replies in, findings, refusals and
// rewritten arguments out. The sink records what a session would count and log.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "keyguard/hygiene/traffic.h"

namespace keyguard::hygiene {
namespace {

class RecordingSink : public FindingSink {
 public:
  void Stamp(Finding* f, std::string_view key, commands::CommandId id) override {
    f->key = std::string(key);
    f->command = std::string(commands::CommandName(id));
    f->action = settings->action(f->kind);
    f->tenant = tenant;
  }
  void Report(Finding f) override { findings.push_back(std::move(f)); }
  void WakeProbe() override { ++wakes; }

  const Settings* settings = nullptr;
  std::string tenant;
  std::vector<Finding> findings;
  int wakes = 0;
};

class TrafficTest : public ::testing::Test {
 protected:
  TrafficTest() { sink_.settings = &settings_; }

  // One command: the client's words, and (optionally) what earlier stages made of them.
  struct Result {
    uint8_t check;
    std::string refusal;
    std::vector<std::string> upstream;  // the arguments after the detectors
  };
  Result Send(ConnectionDetectors& d, const std::string& line, const std::string& staged = "", bool watching = false,
              bool tenant = false) {
    words_ = absl::StrSplit(line, ' ');
    staged_ = absl::StrSplit(staged.empty() ? line : staged, ' ');
    args_.assign(words_.begin(), words_.end());
    staged_args_.assign(staged_.begin(), staged_.end());
    ArgEditor edit;
    edit.Reset(staged_args_);
    Result r;
    r.check = d.OnRequest(commands::LookupCommand(args_[0]), args_, edit, watching, tenant, &r.refusal);
    for (std::string_view a : edit.args()) r.upstream.emplace_back(a);
    return r;
  }
  ConnectionDetectors Connection(uint64_t id) { return ConnectionDetectors(settings_, worker_, sink_, id); }
  std::vector<Kind> Kinds() const {
    std::vector<Kind> out;
    for (const Finding& f : sink_.findings) out.push_back(f.kind);
    return out;
  }

  Settings settings_;
  WorkerDetectors worker_{settings_};
  RecordingSink sink_;
  std::vector<std::string> words_, staged_;
  std::vector<std::string_view> args_, staged_args_;
};

TEST_F(TrafficTest, BigStringWriteIsReportedAndARejectRuleRefusesIt) {
  settings_.big_string_bytes = 16;
  auto c = Connection(1);
  Result r = Send(c, "SET k " + std::string(20, 'x'));
  EXPECT_EQ(Kinds(), std::vector<Kind>{Kind::kBigStringWrite});
  EXPECT_EQ(sink_.findings[0].bytes, 20);
  EXPECT_EQ(sink_.findings[0].key, "k");
  EXPECT_EQ(r.refusal, "");
  settings_.actions[static_cast<size_t>(Kind::kBigStringWrite)] = Action::kReject;
  r = Send(c, "SET k " + std::string(20, 'x'));
  EXPECT_EQ(
      r.refusal,
      "ERR keyguard: big_string_write: big value: store the parts you update separately (a Hash), or compress it");
  EXPECT_EQ(Send(c, "SET k small").refusal, "");
}

TEST_F(TrafficTest, RewritesEditTheStagedArgumentsNotTheClients) {
  settings_.actions[static_cast<size_t>(Kind::kFlushWithoutAsync)] = Action::kRewrite;
  auto c = Connection(1);
  EXPECT_EQ(Send(c, "FLUSHALL").upstream, (std::vector<std::string>{"FLUSHALL", "ASYNC"}));
  EXPECT_EQ(sink_.findings.back().action, Action::kRewrite);
  EXPECT_EQ(Send(c, "FLUSHALL ASYNC").upstream, (std::vector<std::string>{"FLUSHALL", "ASYNC"}));
  EXPECT_EQ(sink_.findings.size(), 1u);
  // A tenant's FLUSHALL is an emulation keyguard runs: not rewritten, only reported (as warn).
  EXPECT_EQ(Send(c, "FLUSHALL", "", false, /*tenant=*/true).upstream, (std::vector<std::string>{"FLUSHALL"}));
  EXPECT_EQ(sink_.findings.back().action, Action::kWarn);

  // DEL of a key known to be big becomes UNLINK, on the server's name.
  settings_.big_string_bytes = 16;
  settings_.actions[static_cast<size_t>(Kind::kDelBigKey)] = Action::kRewrite;
  Send(c, "SET big " + std::string(20, 'x'));
  Result del = Send(c, "DEL big other", "DEL t:big t:other");
  EXPECT_EQ(del.upstream, (std::vector<std::string>{"UNLINK", "t:big", "t:other"}));
  EXPECT_EQ(sink_.findings.back().kind, Kind::kDelBigKey);
  EXPECT_EQ(sink_.findings.back().key, "big");                                       // findings name the client's key
  EXPECT_EQ(Send(c, "DEL big").upstream, (std::vector<std::string>{"DEL", "big"}));  // the size was forgotten
}

TEST_F(TrafficTest, MissingTtlWaitsForAnExpireOrAddsTheDefault) {
  settings_.ttl_patterns.push_back(TtlPattern{"cache:*", false, 300});
  settings_.missing_ttl_window_ms = 60000;
  auto c = Connection(1);
  Send(c, "SET cache:a v");
  Send(c, "EXPIRE cache:a 100");
  Send(c, "SET cache:b v");
  EXPECT_TRUE(c.has_pending_ttl());
  EXPECT_TRUE(sink_.findings.empty());
  c.FlushPendingTtl(/*all=*/true);  // the connection ended without an EXPIRE for cache:b
  ASSERT_EQ(Kinds(), std::vector<Kind>{Kind::kMissingTtl});
  EXPECT_EQ(sink_.findings[0].key, "cache:b");
  settings_.actions[static_cast<size_t>(Kind::kMissingTtl)] = Action::kRewrite;
  EXPECT_EQ(Send(c, "SET cache:c v").upstream, (std::vector<std::string>{"SET", "cache:c", "v", "EX", "300"}));
  EXPECT_EQ(Send(c, "SET other v").upstream, (std::vector<std::string>{"SET", "other", "v"}));
}

TEST_F(TrafficTest, MissingTtlCoversCollectionsTheWriteCreated) {
  settings_.ttl_patterns.push_back(TtlPattern{"cache:*", false, 300});
  settings_.missing_ttl_window_ms = 60000;
  auto c = Connection(1);
  // The reply says whether the write created the key: (id, check, key, integer reply).
  auto reply = [&](const std::string& line, int64_t n) {
    Result r = Send(c, line);
    std::vector<std::string> w = absl::StrSplit(line, ' ');
    const std::string text = std::to_string(n);  // an integer reply's line
    if (r.check != kNoReplyCheck) c.OnReply(commands::LookupCommand(w[0]), r.check, w[1], ':', -1, text, kFnvBasis);
    return r.check;
  };
  EXPECT_EQ(reply("HSET cache:h1 f v g w", 2), kCollectionWrite);  // created, and never given a TTL
  reply("HSET cache:h1 f x", 0);                                   // a later write: one entry per key
  reply("HSET cache:h2 f v", 1);
  Send(c, "EXPIRE cache:h2 60");      // created and given a TTL
  reply("HSET cache:h3 f v g w", 1);  // one field was there: the key existed, with whatever TTL
  reply("RPUSH cache:l1 a b", 2);     // a new list
  reply("RPUSH cache:l2 a b", 7);     // an old one
  EXPECT_EQ(reply("ZADD cache:z1 NX 1 a 2 b", 2), kCollectionWrite);
  EXPECT_EQ(reply("ZADD cache:z2 XX 1 a", 0), kNoReplyCheck) << "XX never creates";
  EXPECT_EQ(reply("ZADD cache:z3 CH 1 a", 1), kNoReplyCheck) << "CH: the reply does not say";
  EXPECT_EQ(reply("XADD cache:s1 NOMKSTREAM * f v", 0), kNoReplyCheck);
  EXPECT_EQ(reply("XADD cache:s2 * f v", 0), kNoReplyCheck);  // uncounted: pending without a reply
  EXPECT_EQ(reply("SADD other:s a", 1), kNoReplyCheck) << "not a ttl pattern";
  EXPECT_TRUE(sink_.findings.empty());
  c.FlushPendingTtl(/*all=*/true);
  std::vector<std::string> keys;
  for (const Finding& f : sink_.findings) keys.push_back(f.key);
  EXPECT_EQ(keys, (std::vector<std::string>{"cache:h1", "cache:l1", "cache:z1", "cache:s2"}));
  EXPECT_EQ(Kinds(), std::vector<Kind>(4, Kind::kMissingTtl));
  EXPECT_NE(sink_.findings[0].suggestion.find("created without a TTL: EXPIRE it right after the write"),
            std::string::npos);
  // No rule can refuse or rewrite a collection write for its TTL: it reports a warn.
  sink_.findings.clear();
  settings_.actions[static_cast<size_t>(Kind::kMissingTtl)] = Action::kReject;
  EXPECT_EQ(Send(c, "SADD cache:s3 a").refusal, "");
  Send(c, "SADD cache:s4 a");  // its reply is an error (WRONGTYPE): the detectors never see it
  c.OnReply(commands::LookupCommand("sadd"), kCollectionWrite, "cache:s3", ':', -1, "1", kFnvBasis);
  c.FlushPendingTtl(true);
  ASSERT_EQ(Kinds(), std::vector<Kind>{Kind::kMissingTtl});
  EXPECT_EQ(sink_.findings[0].action, Action::kWarn);
}

TEST_F(TrafficTest, JitterOnlyLengthensTtlsRelativeOrAbsolute) {
  settings_.actions[static_cast<size_t>(Kind::kExpiryClustering)] = Action::kRewrite;
  settings_.jitter_percent = 50;
  auto c = Connection(1);
  for (int i = 0; i < 50; ++i) {
    Result r = Send(c, "EXPIRE k 100");
    int64_t ttl = std::stoll(r.upstream[2]);
    EXPECT_GE(ttl, 100);
    EXPECT_LE(ttl, 150);
  }
  // Absolute expiries move by a share of the time left until them, never sooner.
  const int64_t now_s = UnixMs() / 1000;
  for (int i = 0; i < 20; ++i) {
    const int64_t at = std::stoll(Send(c, "EXPIREAT k " + std::to_string(now_s + 1000)).upstream[2]);
    EXPECT_GE(at, now_s + 1000);
    EXPECT_LE(at, now_s + 1000 + 501);
    const int64_t pat = std::stoll(Send(c, "SET k v PXAT " + std::to_string(now_s * 1000 + 100000)).upstream[4]);
    EXPECT_GE(pat, now_s * 1000 + 100000);
    EXPECT_LE(pat, now_s * 1000 + 100000 + 51000);
  }
  EXPECT_EQ(Send(c, "EXPIREAT k 1000").upstream[2], "1000");  // in the past: deletes now, unchanged
  // The largest values a client may send: no overflow (UBSan in CI), and never jittered into a
  // value the server would refuse (found by the tenant fuzzer under UBSan).
  for (const char* cmd : {"EXPIRE", "PEXPIRE", "EXPIREAT", "PEXPIREAT", "SETEX", "PSETEX"}) {
    const std::string line = std::string(cmd) + " k 9223372036854775807" + (cmd[1] == 'S' || cmd[0] == 'S' ? " v" : "");
    EXPECT_EQ(Send(c, line).upstream[2], "9223372036854775807") << line;
  }
  EXPECT_EQ(Send(c, "SET k v EX 9223372036854775807").upstream[4], "9223372036854775807");
  EXPECT_EQ(Send(c, "SET k v PX 9223372036854775806").upstream[4], "9223372036854775806");
}

TEST_F(TrafficTest, SerializedReadModifyWriteAcrossConnectionsOfOneScopeOnly) {
  auto a = Connection(1), b = Connection(2);
  const std::string json = R"({"name":"ada","age":36,"city":"Paris"})";
  const commands::CommandId get = commands::LookupCommand("get");
  EXPECT_EQ(Send(a, "GET user:1").check, kStringRead);
  a.OnReply(get, kStringRead, "user:1", '$', static_cast<int64_t>(json.size()), json, kFnvBasis);
  Send(a, R"(SET user:1 {"name":"ada","age":37,"city":"Paris"})");
  EXPECT_EQ(Kinds(), std::vector<Kind>{Kind::kSerializedRmw});
  EXPECT_EQ(sink_.findings[0].fields_changed, 1);
  EXPECT_EQ(sink_.findings[0].fields_total, 3);
  sink_.findings.clear();
  // Another tenant's connection reads and writes the same client name: its own scope, no finding
  // about the first tenant's key.
  b.set_scope(Fingerprint("tenant:b:"));
  b.OnReply(get, kStringRead, "user:2", '$', static_cast<int64_t>(json.size()), json, Fingerprint("tenant:b:"));
  a.OnReply(get, kStringRead, "user:2", '$', static_cast<int64_t>(json.size()), json, kFnvBasis);
  Send(b, R"(SET user:2 {"name":"ada","age":38,"city":"Paris"})");
  ASSERT_EQ(Kinds(), std::vector<Kind>{Kind::kSerializedRmw});  // b's own read, not a's: no lost update
}

// Two workers of one process: connections the kernel put on different workers still race on one
// key, and each worker's detectors see the other's reads and writes (SharedDetectors).
TEST_F(TrafficTest, ARaceAcrossWorkersIsSeenLikeOneOnASingleWorker) {
  SharedDetectors shared(settings_);
  WorkerDetectors w1(settings_, &shared), w2(settings_, &shared);
  ConnectionDetectors a(settings_, w1, sink_, NewConnectionId()), b(settings_, w2, sink_, NewConnectionId());
  const std::string json = R"({"name":"ada","age":36})";
  const commands::CommandId get = commands::LookupCommand("get");
  a.OnReply(get, kStringRead, "user:1", '$', static_cast<int64_t>(json.size()), json, kFnvBasis);
  b.OnReply(get, kStringRead, "user:1", '$', static_cast<int64_t>(json.size()), json, kFnvBasis);
  Send(b, R"(SET user:1 {"name":"ada","age":37})");
  EXPECT_EQ(Kinds(), std::vector<Kind>{Kind::kSerializedRmw});
  Send(a, R"(SET user:1 {"name":"bob","age":36})");  // a's copy was overtaken by b's write
  EXPECT_EQ(Kinds(), (std::vector<Kind>{Kind::kSerializedRmw, Kind::kSerializedRmw, Kind::kLostUpdateRisk}));
  sink_.findings.clear();
  // One attribute per key, one attribute from each of three workers' connections.
  WorkerDetectors w3(settings_, &shared);
  ConnectionDetectors c(settings_, w3, sink_, NewConnectionId());
  Send(a, "SET user:7:name ada");
  Send(b, "SET user:7:age 36");
  EXPECT_TRUE(sink_.findings.empty());
  Send(c, "SET user:7:city Paris");
  ASSERT_EQ(Kinds(), std::vector<Kind>{Kind::kHashCandidate});
  EXPECT_EQ(sink_.findings[0].key, "user:7");
  // Workers with their own state (no SharedDetectors given) do not see each other: the old gap.
  sink_.findings.clear();
  WorkerDetectors alone1(settings_), alone2(settings_);
  ConnectionDetectors d(settings_, alone1, sink_, NewConnectionId()), e(settings_, alone2, sink_, NewConnectionId());
  d.OnReply(get, kStringRead, "user:2", '$', static_cast<int64_t>(json.size()), json, kFnvBasis);
  Send(e, R"(SET user:2 {"name":"ada","age":37})");
  EXPECT_TRUE(sink_.findings.empty());
}

TEST(SharedDetectorsTest, TrackedKeysAreBoundedAcrossTheShardsAndIdleAgainWhenDone) {
  Settings settings;
  settings.tracked_keys = 160;  // 10 per shard
  SharedDetectors shared(settings);
  EXPECT_TRUE(shared.rmw_idle());
  const std::string json = R"({"a":1})";
  for (int i = 0; i < 10000; ++i) shared.OnRead("k" + std::to_string(i), 1, json, 0, kFnvBasis);
  EXPECT_FALSE(shared.rmw_idle());
  std::vector<RmwTracker::Result> out;
  size_t written = 0;
  for (int i = 0; i < 10000; ++i) {
    out.clear();
    shared.OnWrite("k" + std::to_string(i), 1, json, false, 0, &out, kFnvBasis);
    written += out.size();
  }
  EXPECT_LE(written, 160u) << "at most tracked_keys keys were remembered";
  EXPECT_GE(written, 100u);
  EXPECT_TRUE(shared.rmw_idle()) << "every remembered key was written by its reader";
}

TEST_F(TrafficTest, TheProbeAsksTheServersNameAndTheFindingIsStamped) {
  auto c = Connection(1);
  EXPECT_EQ(Send(c, "HGET user:1 name", "HGET tenant:a:user:1 name").check, kNoReplyCheck);
  EXPECT_EQ(sink_.wakes, 1);
  std::deque<ProbeRequest> out;
  worker_.probe_queue.Take(UnixMs() + 1000000, 10, &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].upstream_key, "tenant:a:user:1");
  EXPECT_EQ(out[0].finding.kind, Kind::kBigKeyAccess);
  EXPECT_EQ(out[0].finding.key, "user:1");
  EXPECT_EQ(out[0].finding.command, "hget");
  EXPECT_EQ(out[0].hash, c.SizeKey("user:1"));
  settings_.probe = false;
  Send(c, "HGET user:2 name");
  EXPECT_EQ(sink_.wakes, 1);
}

TEST_F(TrafficTest, WholeCollectionReadsFromTheReply) {
  settings_.big_collection_elements = 10;
  auto c = Connection(1);
  const commands::CommandId hgetall = commands::LookupCommand("hgetall");
  EXPECT_EQ(Send(c, "HGETALL h").check, kCollectionRead);
  c.OnReply(hgetall, kCollectionRead, "h", '*', 18, "", kFnvBasis);  // RESP2: 9 field-value pairs
  EXPECT_TRUE(sink_.findings.empty());
  c.OnReply(hgetall, kCollectionRead, "h", '%', 10, "", kFnvBasis);  // RESP3 map: 10 members
  ASSERT_EQ(Kinds(), std::vector<Kind>{Kind::kWholeCollectionRead});
  EXPECT_EQ(sink_.findings[0].elements, 10);
  // Known big now: a reject rule refuses the next one before it runs.
  settings_.actions[static_cast<size_t>(Kind::kWholeCollectionRead)] = Action::kReject;
  EXPECT_NE(Send(c, "HGETALL h").refusal, "");
}

}  // namespace
}  // namespace keyguard::hygiene
