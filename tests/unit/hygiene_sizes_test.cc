// TTL, size and probe bookkeeping of the detectors, and the finding's wire shape.
#include <gtest/gtest.h>

#include <google/protobuf/util/json_util.h>

#include "keyguard/events/v1/finding.pb.h"
#include "keyguard/hygiene/detectors.h"
#include "keyguard/hygiene/sizes.h"

namespace keyguard::hygiene {
namespace {

TEST(GlobMatch, RedisGlobs) {
  struct Case {
    const char* pattern;
    const char* text;
    bool match;
  } cases[] = {
      {"cache:*", "cache:1", true},
      {"cache:*", "cache:", true},
      {"cache:*", "session:1", false},
      {"*:profile", "user:1:profile", true},
      {"user:?", "user:1", true},
      {"user:?", "user:12", false},
      {"h[ae]llo", "hello", true},
      {"h[^e]llo", "hello", false},
      {"h[a-c]llo", "hbllo", true},
      {"a\\*b", "a*b", true},
      {"a\\*b", "axb", false},
      {"*", "", false},  // (KEYS * and SCAN's MATCH * match every key by a rule of their own)
      // Redis's own reading, as a redis-server 7.0 PSUBSCRIBE matched each:
      {"a[3-]", "a5", true},  // 3 to ']'
      {"a[3-]", "a-", false},
      {"a[5", "a5", true},  // an unterminated class ends the pattern
      {"a[5", "a", false},
      {"a[", "a", false},
      {"a\\", "a\\", true},
      {"a[\\]]", "a]", true},
      {"a[^]", "ab", true},
      {"[]a]", "]", false},
      {"[]a]", "a", false},
      {"*b", "b", true},
      {"a**b", "ab", true},
      {"h[z-a]llo", "hello", true},  // a reversed range
      {"a*b*c", "axxbyyc", true},
      {"a*b*c", "axxbyy", false},
      {"", "", true},
  };
  for (const Case& c : cases) EXPECT_EQ(GlobMatch(c.pattern, c.text), c.match) << c.pattern << " " << c.text;
}

TEST(SizeCache, BoundedAndExpiring) {
  Settings s;
  s.size_cache_keys = 3;
  s.size_cache_ttl_ms = 1000;
  SizeCache cache(s);
  for (uint64_t k = 0; k < 10; ++k) cache.Put(k, KeySize{"string", 100, -1, -1, 0});
  EXPECT_EQ(cache.size(), 3u);
  cache.Put(42, KeySize{"hash", -1, 6000, -1, 5000});
  ASSERT_NE(cache.Get(42, 5500), nullptr);
  EXPECT_TRUE(cache.IsBig(*cache.Get(42, 5500)));
  EXPECT_EQ(cache.Get(42, 6001), nullptr);  // older than the TTL
  EXPECT_FALSE(cache.IsBig(KeySize{"string", 10, -1, -1, 0}));
  EXPECT_TRUE(cache.IsBig(KeySize{"string", 10240, -1, -1, 0}));
}

TEST(ProbeQueue, DedupesBoundsAndRateLimits) {
  Settings s;
  s.probe_keys_per_second = 10;
  ProbeQueue q(s);
  for (uint64_t k = 0; k < 30; ++k) EXPECT_TRUE(q.Push(ProbeRequest{k, "k", Finding{Kind::kBigKeyAccess}}));
  EXPECT_FALSE(q.Push(ProbeRequest{3, "k", Finding{Kind::kBigKeyAccess}}));  // already waiting
  std::deque<ProbeRequest> out;
  EXPECT_EQ(q.Take(100000, 100, &out), 10u);  // a full second's worth of tokens
  EXPECT_EQ(q.Take(100000, 100, &out), 0u);
  EXPECT_EQ(q.Take(100500, 100, &out), 5u);                                 // half a second later
  EXPECT_TRUE(q.Push(ProbeRequest{3, "k", Finding{Kind::kBigKeyAccess}}));  // taken, so it may come again
  for (uint64_t k = 100; k < 100 + ProbeQueue::kCapacity; ++k)
    q.Push(ProbeRequest{k, "k", Finding{Kind::kBigKeyAccess}});
  EXPECT_EQ(q.size(), ProbeQueue::kCapacity);
  EXPECT_GT(q.dropped(), 0u);
}

TEST(ExpiryClusters, APatternWhoseWritesMostlyShareASecondIsClusteredOncePerWindow) {
  Settings s;
  s.expiry_cluster_keys = 5;
  s.expiry_cluster_window_ms = 60000;
  ExpiryClusters c(s);
  const uint64_t tok = PatternFingerprint("tok:1", kFnvBasis);
  EXPECT_EQ(tok, PatternFingerprint("tok:98765", kFnvBasis));  // digit runs fold
  EXPECT_NE(tok, PatternFingerprint("tokx:1", kFnvBasis));
  // A batch with one expiry second: the fifth key makes the finding, once.
  std::vector<int64_t> hits;
  for (int i = 0; i < 12; ++i) {
    if (int64_t n = c.Add(tok, 1700000000, 1000 + i)) hits.push_back(n);
  }
  EXPECT_EQ(hits, std::vector<int64_t>{5});
  // The next window counts afresh.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(c.Add(tok, 1700000100, 100000), 0);
  EXPECT_EQ(c.Add(tok, 1700000100, 100000), 5);
  // A pattern written steadily with one TTL spreads its expiries: never clustered, whatever the
  // volume (each second gets a few keys, far from half of them).
  const uint64_t steady = PatternFingerprint("cache:1", kFnvBasis);
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(c.Add(steady, 1700000000 + i / 3, 1000 + i * 50), 0) << i;
  // Jittered TTLs: a thousand keys over many seconds, none of them holding half.
  const uint64_t jittered = PatternFingerprint("j:1", kFnvBasis);
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(c.Add(jittered, 1700000000 + (i * 7919) % 360, 5000), 0) << i;
  // Enough keys in one second but not most of the pattern's writes: not clustered.
  const uint64_t mixed = PatternFingerprint("m:1", kFnvBasis);
  for (int i = 0; i < 30; ++i) c.Add(mixed, 1700001000 + i, 5000);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(c.Add(mixed, 1700002000, 5000), 0);
  // Tenants count apart: four keys each in one second make no cluster for either.
  const uint64_t a = PatternFingerprint("t:1", Fingerprint("tenant:a:")),
                 b = PatternFingerprint("t:1", Fingerprint("tenant:b:"));
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(c.Add(a, 1700000200, 5000), 0);
    EXPECT_EQ(c.Add(b, 1700000200, 5000), 0);
  }
  EXPECT_EQ(c.Add(a, 1700000200, 5000), 5);
}

TEST(Finding, JsonIsTheEventsProto) {
  Finding f{Kind::kDelBigKey};
  f.action = Action::kRewrite;
  f.key = "user:1:\"feed\"";
  f.key_pattern = "user:{id}:feed";
  f.command = "del";
  f.tenant = "a";
  f.client = "127.0.0.1:5000";
  f.bytes = 20480;
  f.elements = 6000;
  f.ttl_s = 60;
  f.suggestion = "use UNLINK";
  keyguard::events::v1::Finding parsed;
  const std::string json = FindingJson(f, 1700000000123);
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &parsed).ok()) << json;
  EXPECT_EQ(parsed.time_ms(), 1700000000123);
  EXPECT_EQ(parsed.kind(), "del_big_key");
  EXPECT_EQ(parsed.rule(), "del_big_key");
  EXPECT_EQ(parsed.action(), "rewrite");
  EXPECT_EQ(parsed.key(), "user:1:\"feed\"");
  EXPECT_EQ(parsed.tenant(), "a");
  EXPECT_EQ(parsed.bytes(), 20480);
  EXPECT_EQ(parsed.elements(), 6000);
  EXPECT_EQ(parsed.ttl_s(), 60);
  EXPECT_EQ(parsed.suggestion(), "use UNLINK");
}

TEST(Finding, KeyModes) {
  EXPECT_EQ(ShownKey("user:1", KeyMode::kRaw), "user:1");
  EXPECT_EQ(ShownKey("user:1", KeyMode::kRedacted), "");
  const std::string h = ShownKey("user:1", KeyMode::kHashed);
  EXPECT_EQ(h.size(), 5u + 16u);
  EXPECT_EQ(h.substr(0, 5), "hash:");
  EXPECT_EQ(h, ShownKey("user:1", KeyMode::kHashed));
  EXPECT_NE(h, ShownKey("user:2", KeyMode::kHashed));
}

}  // namespace
}  // namespace keyguard::hygiene
