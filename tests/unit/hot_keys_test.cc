#include "keyguard/hygiene/hot_keys.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "keyguard/hygiene/traffic.h"

namespace keyguard::hygiene {
namespace {

std::map<std::string, SpaceSaving::Entry> ByItem(const std::vector<SpaceSaving::Entry>& entries) {
  std::map<std::string, SpaceSaving::Entry> out;
  for (const auto& e : entries) out[e.item] = e;
  return out;
}

// 200000 weighted additions: "hot:a" 20% of them, "hot:b" 10%, the rest drawn from `tail_keys`
// cold items. Adds every item's true weight to `truth`; returns the total.
uint64_t AddSkewedStream(SpaceSaving& s, int tail_keys, std::map<std::string, uint64_t>* truth) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> tail(0, tail_keys - 1);
  uint64_t n = 0;
  for (int i = 0; i < 200000; ++i) {
    const int r = i % 10;
    const std::string item = r < 2 ? "hot:a" : r < 3 ? "hot:b" : absl::StrCat("cold:", tail(rng));
    const uint64_t w = 1 + static_cast<uint64_t>(i % 3);
    s.Add(item, w);
    (*truth)[item] += w;
    n += w;
  }
  return n;
}

TEST(SpaceSavingTest, ExactWhileDistinctItemsFit) {
  SpaceSaving s(8);
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 8; ++i) s.Add(absl::StrCat("k", i), static_cast<uint64_t>(i + 1));
  }
  EXPECT_EQ(s.size(), 8u);
  EXPECT_EQ(s.min_count(), 3u);  // full now: k0 has 3
  const auto entries = s.Entries();
  ASSERT_EQ(entries.size(), 8u);
  EXPECT_EQ(entries[0].item, "k7");
  for (const auto& e : entries) {
    const int i = e.item[1] - '0';
    EXPECT_EQ(e.count, 3u * static_cast<uint64_t>(i + 1)) << e.item;
    EXPECT_EQ(e.error, 0u) << e.item;
  }
  EXPECT_EQ(s.total(), 3u * 36u);
}

TEST(SpaceSavingTest, BoundsHoldAndHeavyHittersStayWhenItemsOverflow) {
  constexpr size_t kCapacity = 64;
  SpaceSaving s(kCapacity);
  std::map<std::string, uint64_t> truth;
  const uint64_t n = AddSkewedStream(s, 10000, &truth);
  EXPECT_EQ(s.total(), n);
  EXPECT_EQ(s.size(), kCapacity);
  EXPECT_LE(s.min_count(), n / kCapacity);
  const auto entries = ByItem(s.Entries());
  for (const auto& [item, e] : entries) {
    EXPECT_LE(e.count - e.error, truth[item]) << item;
    EXPECT_GE(e.count, truth[item]) << item;
    EXPECT_LE(e.error, n / kCapacity) << item;
  }
  // Every item above N/capacity is present; the two heavy hitters lead.
  for (const auto& [item, t] : truth) {
    if (t > n / kCapacity) EXPECT_TRUE(entries.count(item)) << item;
  }
  const auto top = s.Entries();
  EXPECT_EQ(top[0].item, "hot:a");
  EXPECT_EQ(top[1].item, "hot:b");
  // The sum of counters is the total weight (space-saving conserves it).
  uint64_t sum = 0;
  for (const auto& e : top) sum += e.count;
  EXPECT_EQ(sum, n);
}

// Items come and go through the index many thousand times: every counter's item is still found
// (adding it again grows its own counter), and an item that left is not.
TEST(SpaceSavingTest, EveryHeldItemStaysFoundThroughEvictions) {
  SpaceSaving s(16);
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> key(0, 199);
  for (int i = 0; i < 50000; ++i) s.Add(absl::StrCat("k", key(rng)), 1 + static_cast<uint64_t>(i % 5));
  const auto before = ByItem(s.Entries());
  ASSERT_EQ(before.size(), 16u);
  for (const auto& [item, e] : before) {
    s.Add(item, 1000000);
    const auto after = ByItem(s.Entries());
    ASSERT_EQ(after.size(), 16u);
    ASSERT_TRUE(after.count(item)) << item;
    EXPECT_EQ(after.at(item).count, e.count + 1000000) << item;
    EXPECT_EQ(after.at(item).error, e.error) << item;
  }
  // Every item is now far above the rest: a new one replaces the smallest, and only that.
  s.Add("new", 1);
  const auto last = ByItem(s.Entries());
  EXPECT_EQ(last.size(), 16u);
  ASSERT_TRUE(last.count("new"));
  EXPECT_EQ(last.at("new").error + 1, last.at("new").count);
  size_t kept = 0;
  for (const auto& [item, e] : before) kept += last.count(item);
  EXPECT_EQ(kept, 15u);
}

// Filtered (what HotKeys uses): the same bounds, exact while the items fit, and on a long tail
// most additions stay in their bucket.
TEST(SpaceSavingTest, FilteredKeepsTheBoundsAndTheHeavyHitters) {
  constexpr size_t kCapacity = 64;
  SpaceSaving exact(kCapacity, 16 * kCapacity);
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 64; ++i) exact.Add(absl::StrCat("k", i), static_cast<uint64_t>(i + 1));
  }
  for (const auto& e : exact.Entries()) {
    EXPECT_EQ(e.count, 3u * static_cast<uint64_t>(std::stoi(e.item.substr(1)) + 1)) << e.item;
    EXPECT_EQ(e.error, 0u) << e.item;
  }
  SpaceSaving s(kCapacity, 16 * kCapacity);
  std::map<std::string, uint64_t> truth;
  const uint64_t n = AddSkewedStream(s, 100000, &truth);
  EXPECT_EQ(s.total(), n);
  EXPECT_EQ(s.size(), kCapacity);
  EXPECT_LE(s.min_count(), n / kCapacity);
  const auto entries = ByItem(s.Entries());
  uint64_t sum = 0;
  for (const auto& [item, e] : entries) {
    EXPECT_LE(e.count - e.error, truth[item]) << item;
    EXPECT_GE(e.count, truth[item]) << item;
    EXPECT_LE(e.error, s.min_count()) << item;
    sum += e.count;
  }
  EXPECT_LE(sum, n);
  // Every item above the smallest counter is present (an absent one had at most that much).
  for (const auto& [item, t] : truth) {
    if (t > s.min_count()) EXPECT_TRUE(entries.count(item)) << item << " " << t;
  }
  const auto top = s.Entries();
  EXPECT_EQ(top[0].item, "hot:a");
  EXPECT_EQ(top[1].item, "hot:b");
  EXPECT_EQ(top[0].count, truth["hot:a"]);  // present since its first additions: exact
}

TEST(SpaceSavingTest, ClearStartsAfresh) {
  SpaceSaving s(2);
  s.Add("a");
  s.Add("b");
  s.Add("c");
  s.Clear();
  EXPECT_EQ(s.size(), 0u);
  EXPECT_EQ(s.total(), 0u);
  s.Add("a", 5);
  ASSERT_EQ(s.Entries().size(), 1u);
  EXPECT_EQ(s.Entries()[0].count, 5u);
  EXPECT_EQ(s.Entries()[0].error, 0u);
}

TEST(MergeTopTest, SumsPartsAndBoundsAbsentItems) {
  SpaceSaving a(2), b(2), c(4);
  // a is full: min 2. b is full: min 1. c is not full.
  a.Add("x", 5);
  a.Add("y", 2);
  b.Add("x", 1);
  b.Add("z", 3);
  c.Add("y", 1);
  const SketchSnapshot sa = Snapshot(a), sb = Snapshot(b), sc = Snapshot(c);
  EXPECT_EQ(sa.min_count, 2u);
  EXPECT_EQ(sc.min_count, 0u);
  const auto merged = ByItem(MergeTop({&sa, &sb, &sc}, 10));
  // x: 5 + 1, exact in both.
  EXPECT_EQ(merged.at("x").count, 6u);
  EXPECT_EQ(merged.at("x").error, 0u);
  // y: 2 (a) + 1 (c) + up to 1 while absent from full b.
  EXPECT_EQ(merged.at("y").count, 4u);
  EXPECT_EQ(merged.at("y").error, 1u);
  // z: 3 (b) + up to 2 while absent from full a.
  EXPECT_EQ(merged.at("z").count, 5u);
  EXPECT_EQ(merged.at("z").error, 2u);
  EXPECT_EQ(MergeTop({&sa, &sb, &sc}, 1).size(), 1u);
  EXPECT_EQ(MergeTop({&sa, &sb, &sc}, 1)[0].item, "x");
}

TEST(HotKeyItemTest, CarriesTheTenant) {
  std::string item;
  EXPECT_EQ(SplitHotKeyItem(HotKeyItem("svc", "user:1", &item)).tenant, "svc");
  EXPECT_EQ(SplitHotKeyItem(HotKeyItem("svc", "user:1", &item)).key, "user:1");
  // A shorter item in the same buffer: only its own bytes.
  EXPECT_EQ(SplitHotKeyItem(HotKeyItem("", std::string("a\0b", 3), &item)).tenant, "");
  EXPECT_EQ(SplitHotKeyItem(HotKeyItem("", std::string("a\0b", 3), &item)).key, absl::string_view("a\0b", 3));
}

TEST(LargestKeysTest, KeepsTheLargestWithinItsBound) {
  LargestKeys big(4);
  for (int i = 1; i <= 100; ++i) {
    const uint64_t size = static_cast<uint64_t>((i * 37) % 101);
    if (big.Admits(size)) big.Observe(absl::StrCat("k", size), size, "set", "string", i);
  }
  ASSERT_EQ(big.entries().size(), 4u);
  std::vector<uint64_t> sizes;
  for (const auto& e : big.entries()) sizes.push_back(e.size);
  std::sort(sizes.begin(), sizes.end());
  EXPECT_EQ(sizes, (std::vector<uint64_t>{97, 98, 99, 100}));
  EXPECT_FALSE(big.Admits(96));
  // A key seen again keeps its largest size; a larger one takes the smallest's place.
  big.Observe("k100", 5, "get", "string", 200);
  big.Observe("k500", 500, "get", "string", 201);
  std::map<std::string, uint64_t> by_key;
  for (const auto& e : big.entries()) by_key[e.item] = e.size;
  EXPECT_EQ(by_key, (std::map<std::string, uint64_t>{{"k98", 98}, {"k99", 99}, {"k100", 100}, {"k500", 500}}));
}

TEST(HotKeysTest, SamplesAboutOneInN) {
  Settings settings;
  settings.hot_keys_sample = 8;
  HotKeys hot(settings);
  int sampled = 0;
  for (int i = 0; i < 80000; ++i) sampled += hot.Sample();
  EXPECT_NEAR(sampled, 10000, 500);
  settings.hot_keys_sample = 1;
  HotKeys all(settings);
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(all.Sample());
}

TEST(HotKeysBoardTest, PublishesIntervalsAndRendersJson) {
  Settings settings;
  settings.hot_keys_capacity = 4;
  settings.hot_keys_interval_s = 10;
  settings.hot_keys_sample = 1;
  HotKeysBoard board(settings, [](std::string_view k) { return absl::StrCat("p:", std::string(k.substr(0, 1))); });
  HotKeys hot(settings);
  hot.Attach(&board, board.AddWorker());
  hot.Tick(0);  // starts the interval
  for (int i = 0; i < 5; ++i) hot.Access("", "a1", 10);
  hot.Access("svc", "b1", 7);
  hot.ObserveSize("svc", "big", false, 50000, "set", "string");
  hot.ObserveSize("", "h", true, 6000, "hgetall", "hash");
  hot.Tick(1);  // partial
  std::string json = board.HotKeysJson(20);
  EXPECT_NE(json.find(R"("by_count":[{"key":"a1","tenant":null,"key_pattern":"p:a","count":5,"error":0},)"
                      R"({"key":"b1","tenant":"svc","key_pattern":"p:b","count":1,"error":0}])"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find(R"("by_bytes":[{"key":"a1","tenant":null,"key_pattern":"p:a","count":50,"error":0},)"),
            std::string::npos)
      << json;
  // The interval closes: its counts stay visible next to the new one, and feed the metric.
  hot.Tick(10'000'000'000);
  hot.Access("", "a1", 1);
  hot.Tick(10'000'000'001);
  json = board.HotKeysJson(1);
  EXPECT_NE(json.find(R"("by_count":[{"key":"a1","tenant":null,"key_pattern":"p:a","count":6,"error":0}])"),
            std::string::npos)
      << json;
  std::string metrics;
  metrics::TextWriter writer(&metrics);
  board.AppendMetrics(writer);
  EXPECT_NE(metrics.find("keyguard_hot_key_pattern_accesses{key_pattern=\"p:a\"} 5\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("keyguard_hot_key_pattern_accesses{key_pattern=\"p:b\"} 1\n"), std::string::npos) << metrics;
  const std::string big = board.BigKeysJson(20);
  EXPECT_NE(
      big.find(R"({"key":"big","tenant":"svc","key_pattern":"p:b","type":"string","bytes":50000,"command":"set",)"),
      std::string::npos)
      << big;
  EXPECT_NE(big.find(R"("by_elements":[{"key":"h","tenant":null,"key_pattern":"p:h","type":"hash","elements":6000,)"),
            std::string::npos)
      << big;
}

// The traffic hooks (HotKeyRequest, HotKeyReply) driven as the session drives them, no sockets.
class HotKeyHooksTest : public ::testing::Test {
 protected:
  HotKeyHooksTest() {
    settings_.hot_keys_capacity = 8;
    settings_.hot_keys_interval_s = 10;
    settings_.hot_keys_sample = 1;  // every command is an access
  }
  void Start() {
    hot_ = std::make_unique<HotKeys>(settings_);
    hot_->Attach(&board_, board_.AddWorker());
    hot_->Tick(0);
  }
  // The request hook for `args` (a request of `len` bytes); `bytes` gets the access's bytes.
  bool Request(std::vector<std::string_view> args, std::string_view tenant = "", size_t len = 20,
               uint32_t* bytes = nullptr) {
    uint32_t b = 0;
    const bool want = hot_->Sample() && HotKeyRequest(*hot_, commands::LookupCommand(args[0]), args, tenant, len, &b);
    if (bytes != nullptr) *bytes = b;
    return want;
  }
  void Reply(const char* command, std::string_view key, uint32_t request_bytes, char type, int64_t size,
             std::string_view bulk, size_t frame_len = 10) {
    HotKeyReply(*hot_, commands::LookupCommand(command), "", key, request_bytes, type, size, bulk, frame_len);
  }
  std::string HotJson() {
    hot_->Tick(1);
    return board_.HotKeysJson(20);
  }
  std::string BigJson() {
    hot_->Tick(1);
    return board_.BigKeysJson(20);
  }

  // Each of `parts` appears in `json` (`present`), or none does.
  static void Expect(bool present, const std::string& json, std::initializer_list<std::string_view> parts) {
    for (std::string_view p : parts) EXPECT_EQ(json.find(p) != std::string::npos, present) << p << " in " << json;
  }

  Settings settings_;
  HotKeysBoard board_{settings_, [](std::string_view k) { return std::string(k); }};
  std::unique_ptr<HotKeys> hot_;
};

TEST_F(HotKeyHooksTest, StringWritesShowTheirSizesWithTheTenant) {
  Start();
  const std::string value(5000, 'v');
  uint32_t bytes = 0;
  EXPECT_TRUE(Request({"SET", "s1", value}, "svc", 5030, &bytes));
  EXPECT_EQ(bytes, 5030u);  // sampled: an access of s1 once the reply comes
  EXPECT_TRUE(Request({"setex", "s2", "60", "abc"}));
  EXPECT_TRUE(Request({"MSET", "m1", "12", "m2", "123456"}));
  EXPECT_TRUE(Request({"APPEND", "a1", "xy"}));
  // SETRANGE's value is not the key's size; an empty value shows nothing.
  EXPECT_TRUE(Request({"SETRANGE", "r1", "0", "abcdefgh"}));
  EXPECT_TRUE(Request({"SET", "e1", ""}));
  const std::string big = BigJson();
  Expect(true, big,
         {R"({"key":"s1","tenant":"svc","key_pattern":"s1","type":"string","bytes":5000,"command":"set",)",
          R"({"key":"m2","tenant":null,"key_pattern":"m2","type":"string","bytes":6,"command":"mset",)",
          R"("key":"s2","tenant":null,"key_pattern":"s2","type":"string","bytes":3,"command":"setex")",
          R"("key":"m1",)", R"("key":"a1",)"});
  Expect(false, big, {R"("key":"r1")", R"("key":"e1")"});
}

TEST_F(HotKeyHooksTest, RepliesCountAccessesAndShowSizes) {
  Start();
  uint32_t bytes = 0;
  ASSERT_TRUE(Request({"GET", "g"}, "", 22, &bytes));
  Reply("get", "g", bytes, '$', 0, "hello", 11);
  Reply("strlen", "g", 0, ':', 0, "7000");
  Reply("hlen", "h", 0, ':', 0, "300");
  Reply("hgetall", "h2", 0, '*', 12, "");  // RESP2: field, value, ... = 6 members
  Reply("hgetall", "h3", 0, '%', 6, "");   // RESP3 map: 6 members
  Reply("zrange", "z", 0, '*', 40, "");    // one member per element
  Reply("sinter", "s", 0, '*', 900, "");   // a set operation: not s's size
  Reply("llen", "l", 0, '-', 0, "ERR x");  // an error shows nothing
  const std::string hot = HotJson();
  Expect(true, hot,
         {R"("by_count":[{"key":"g","tenant":null,"key_pattern":"g","count":1,"error":0}])",
          R"("by_bytes":[{"key":"g","tenant":null,"key_pattern":"g","count":33,"error":0}])"});
  const std::string big = BigJson();
  Expect(true, big,
         {R"("key":"g","tenant":null,"key_pattern":"g","type":"string","bytes":7000,"command":"strlen")",
          R"("key":"h","tenant":null,"key_pattern":"h","type":"hash","elements":300,"command":"hlen")",
          R"("key":"h2","tenant":null,"key_pattern":"h2","type":"hash","elements":6,"command":"hgetall")",
          R"("key":"h3","tenant":null,"key_pattern":"h3","type":"hash","elements":6,"command":"hgetall")",
          R"("key":"z","tenant":null,"key_pattern":"z","type":"zset","elements":40,"command":"zrange")"});
  Expect(false, big, {R"("key":"s")", R"("key":"l")"});
}

// The largest keys see the commands the sketches count: an unsampled command shows no size.
TEST_F(HotKeyHooksTest, ReplyWantedAndSizesSeenOnlyForSampledCommands) {
  settings_.hot_keys_sample = 1000000000;
  Start();
  uint32_t bytes = 0;
  const std::string big(5000, 'v');
  EXPECT_TRUE(Request({"SET", "first", big}, "", 5020, &bytes));  // the first command is sampled
  EXPECT_EQ(bytes, 5020u);
  bytes = 0;
  EXPECT_FALSE(Request({"INCR", "c"}, "", 20, &bytes));  // then about one in a billion
  EXPECT_EQ(bytes, 0u);
  EXPECT_FALSE(Request({"SET", "unsampled", big + big}, "", 10020, &bytes));
  EXPECT_EQ(bytes, 0u);
  EXPECT_FALSE(Request({"GET", "c"}, "", 20, &bytes));  // its reply's size is not read either
  EXPECT_EQ(bytes, 0u);
  const std::string sizes = BigJson();
  Expect(true, sizes, {R"("key":"first","tenant":null,"key_pattern":"first","type":"string","bytes":5000,)"});
  Expect(false, sizes, {R"("key":"unsampled")"});
  EXPECT_FALSE(Request({"SINTER", "a", "b"}));
  EXPECT_FALSE(Request({"OBJECT", "ENCODING", "c"}));  // args[1] is a subcommand
  EXPECT_FALSE(Request({"PING"}));
  settings_.hot_keys_capacity = 0;  // hot keys off
  Start();
  EXPECT_FALSE(Request({"GET", "c"}));
}

}  // namespace
}  // namespace keyguard::hygiene
