#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "keyguard/hygiene/detectors.h"
#include "keyguard/hygiene/serialized.h"

namespace keyguard::hygiene {
namespace {

using namespace std::string_literals;

TEST(DetectFormat, RecognisesSerializedObjects) {
  EXPECT_EQ(DetectFormat(R"({"name":"ada","age":36})"), Format::kJsonObject);
  EXPECT_EQ(DetectFormat("  [1, 2, 3]\n"), Format::kJsonArray);
  EXPECT_EQ(DetectFormat("\x82\xa4name\xa3"
                         "ada\xa3"
                         "age\x24"s),
            Format::kMessagePack);
  EXPECT_EQ(DetectFormat("\xac\xed\x00\x05sr\x00\x04User"s), Format::kJavaSerialized);
  EXPECT_EQ(DetectFormat("\x80\x04\x95\x10\x00"s), Format::kPickle);
  EXPECT_EQ(DetectFormat(R"(a:2:{s:4:"name";s:3:"ada";s:3:"age";i:36;})"), Format::kPhpSerialize);
  EXPECT_EQ(DetectFormat(R"(O:4:"User":1:{s:4:"name";s:3:"ada";})"), Format::kPhpSerialize);
  for (const char* plain : {"ada", "36", "{not json", "", "a:b"})
    EXPECT_EQ(DetectFormat(plain), Format::kNone) << plain;
}

TEST(JsonTopLevelFields, FingerprintsEachField) {
  std::vector<std::pair<uint64_t, uint64_t>> a, b;
  ASSERT_TRUE(
      JsonTopLevelFields(R"({"name":"ada","tags":["x","y"],"addr":{"city":"Paris","zip":"75001"},"age":36})", &a));
  ASSERT_EQ(a.size(), 4u);
  ASSERT_TRUE(JsonTopLevelFields(
      R"({ "name" : "ada", "tags":["x","y"], "addr":{"city":"Lyon","zip":"75001"}, "age":36 })", &b));
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(a[0], b[0]);
  EXPECT_NE(a[2], b[2]);  // the nested object changed
  std::vector<std::pair<uint64_t, uint64_t>> c;
  EXPECT_TRUE(JsonTopLevelFields(R"({"s":"a \"quoted\" } brace"})", &c));
  EXPECT_EQ(c.size(), 1u);
  for (const char* bad : {"[1]", "{", R"({"a":})", R"({"a" 1})", R"({"a":1,})"}) {
    std::vector<std::pair<uint64_t, uint64_t>> d;
    EXPECT_FALSE(JsonTopLevelFields(bad, &d)) << bad;
  }
}

TEST(RmwTracker, ReadModifyWriteAndLostUpdate) {
  Settings s;
  RmwTracker t(s);
  std::vector<RmwTracker::Result> out;
  t.OnRead("user:1:profile", 1, R"({"name":"ada","age":36,"city":"Paris"})", 1000);
  t.OnWrite("user:1:profile", 1, R"({"name":"ada","age":37,"city":"Paris"})", false, 1200, &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].kind, Kind::kSerializedRmw);
  EXPECT_EQ(out[0].fields_changed, 1);
  EXPECT_EQ(out[0].fields_total, 3);
  // Two connections read, both write back: the second write may lose the first.
  out.clear();
  t.OnRead("user:2:profile", 1, R"({"n":1})", 2000);
  t.OnRead("user:2:profile", 2, R"({"n":1})", 2001);
  t.OnWrite("user:2:profile", 1, R"({"n":2})", false, 2002, &out);
  ASSERT_EQ(out.size(), 1u);
  out.clear();
  t.OnWrite("user:2:profile", 2, R"({"n":3})", false, 2003, &out);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].kind, Kind::kSerializedRmw);
  EXPECT_EQ(out[1].kind, Kind::kLostUpdateRisk);
  // With WATCH the second writer is safe; outside the window nothing is reported; plain values
  // are not tracked.
  out.clear();
  t.OnRead("k3", 1, R"({"n":1})", 3000);
  t.OnRead("k3", 2, R"({"n":1})", 3000);
  t.OnWrite("k3", 1, R"({"n":2})", false, 3001, &out);
  out.clear();
  t.OnWrite("k3", 2, R"({"n":3})", true, 3002, &out);
  ASSERT_EQ(out.size(), 1u);
  out.clear();
  t.OnRead("k4", 1, R"({"n":1})", 0);
  t.OnWrite("k4", 1, R"({"n":2})", false, s.rmw_window_ms + 1, &out);
  EXPECT_TRUE(out.empty());
  t.OnRead("k5", 1, "plain", 0);
  t.OnWrite("k5", 1, "plain2", false, 1, &out);
  EXPECT_TRUE(out.empty());
}

TEST(RmwTracker, BoundedState) {
  Settings s;
  s.tracked_keys = 100;
  RmwTracker t(s);
  for (int i = 0; i < 1000; ++i) t.OnRead("k" + std::to_string(i), 1, R"({"a":1})", i);
  EXPECT_LE(t.tracked(), 100u);
}

TEST(FindingLog, RingIsBoundedAndJson) {
  FindingLog log(2);
  for (int i = 0; i < 3; ++i) {
    Finding f{Kind::kKeysCommand};
    f.key = "pat" + std::to_string(i) + "*\"";
    f.key_pattern = "pat{id}*?";
    f.command = "keys";
    f.suggestion = "use SCAN";
    log.Add(f);
  }
  const std::string json = log.RecentJson();
  EXPECT_EQ(json.find("pat0"), std::string::npos);
  EXPECT_NE(json.find(R"("key":"pat2*\"")"), std::string::npos) << json;
  EXPECT_NE(json.find(R"("kind":"keys_command")"), std::string::npos);
}

}  // namespace
}  // namespace keyguard::hygiene

namespace keyguard::hygiene {
namespace {

// #12 break 5: two tenants' keys of the same name are different keys; state and findings are
// per scope (Fingerprint of the tenant prefix).
TEST(RmwTracker, TenantsNeverShareState) {
  Settings s;
  RmwTracker t(s);
  std::vector<RmwTracker::Result> out;
  const uint64_t a = Fingerprint("tenant:a:"), b = Fingerprint("tenant:b:");
  t.OnRead("cart:1", 1, R"({"n":1})", 1000, a);
  t.OnRead("cart:1", 2, R"({"n":1})", 1001, b);
  t.OnWrite("cart:1", 1, R"({"n":2})", false, 1002, &out, a);
  t.OnWrite("cart:1", 2, R"({"n":3})", false, 1003, &out, b);
  ASSERT_EQ(out.size(), 2u);  // each its own read-modify-write, and no lost update between them
  EXPECT_EQ(out[0].kind, Kind::kSerializedRmw);
  EXPECT_EQ(out[1].kind, Kind::kSerializedRmw);
  out.clear();
  t.OnWrite("cart:1", 3, R"({"n":4})", false, 1004, &out);  // no tenant: no read was seen
  EXPECT_TRUE(out.empty());
}

// The parent ParentOf finds, or "-".
std::string ParentName(std::string_view key) {
  std::string_view p;
  return AttributeTracker::ParentOf(key, &p) ? std::string(p) : std::string("-");
}

TEST(AttributeTracker, OnlyShortNonIdAttributesHaveAParent) {
  EXPECT_EQ(ParentName("user:7:name"), "user:7");
  EXPECT_EQ(ParentName("user:ab12"), "user");
  EXPECT_EQ(ParentName("user:12ab"), "user");
  EXPECT_EQ(ParentName("order:1001"), "-");  // an id
  EXPECT_EQ(ParentName("key:000000012345"), "-");
  EXPECT_EQ(ParentName("12345"), "-");
  EXPECT_EQ(ParentName("plain"), "-");
  EXPECT_EQ(ParentName("user:"), "-");  // no attribute
  EXPECT_EQ(ParentName(":name"), "-");  // no parent
  EXPECT_EQ(ParentName("a:b:"), "-");
  EXPECT_EQ(ParentName("p:" + std::string(32, 'x')), "p");
  EXPECT_EQ(ParentName("p:" + std::string(33, 'x')), "-");  // too long for an attribute name
  EXPECT_EQ(ParentName(""), "-");
}

// ParentOf reads trailing digits 8 bytes at a time: ids and attributes around that width, and
// bytes a digit test could confuse (above 0x7f, just below '0' and just above '9').
TEST(AttributeTracker, ParentOfAcrossEightByteWords) {
  EXPECT_EQ(ParentName("a:12345678"), "-");
  EXPECT_EQ(ParentName("a:1234567812345678"), "-");
  EXPECT_EQ(ParentName("12345678"), "-");
  EXPECT_EQ(ParentName("1234567812345678"), "-");
  EXPECT_EQ(ParentName("user:x12345678"), "user");
  EXPECT_EQ(ParentName("user:x1234567812345678"), "user");
  EXPECT_EQ(ParentName("user:12345678x"), "user");
  EXPECT_EQ(ParentName("k:\xb0"
                       "12345678"),
            "k");                             // 0xb0: '0' with the top bit set
  EXPECT_EQ(ParentName("k:/12345678"), "k");  // '/' is just below '0'
  EXPECT_EQ(ParentName("k::12345678"), "-");  // an id after an empty attribute
  EXPECT_EQ(ParentName("k:;12345678"), "k");  // ';' is just above ':' and '9'
  EXPECT_EQ(ParentName("k:" + std::string(31, 'x') + "1"), "k");
  EXPECT_EQ(ParentName("k:" + std::string(32, 'x') + "12345678"), "-");  // attribute too long
}

TEST(AttributeTracker, TenantsNeverShareAParent) {
  Settings s;
  AttributeTracker t(s);
  std::string parent;
  std::vector<std::string> names;
  const uint64_t a = Fingerprint("tenant:a:"), b = Fingerprint("tenant:b:");
  EXPECT_FALSE(t.OnWrite("user:1:name", 0, &parent, &names, a));
  EXPECT_FALSE(t.OnWrite("user:1:email", 1, &parent, &names, a));
  EXPECT_FALSE(t.OnWrite("user:1:phone", 2, &parent, &names, b));  // bob's first, not alice's third
  ASSERT_TRUE(t.OnWrite("user:1:phone", 3, &parent, &names, a));
  EXPECT_EQ(names, (std::vector<std::string>{"name", "email", "phone"}));
}

TEST(AttributeTracker, ThreeAttributesUnderOneParentOnce) {
  Settings s;
  AttributeTracker t(s);
  std::string parent;
  std::vector<std::string> names;
  EXPECT_FALSE(t.OnWrite("user:1:name", 0, &parent, &names));
  EXPECT_FALSE(t.OnWrite("user:1:name", 1, &parent, &names));  // same attribute again
  EXPECT_FALSE(t.OnWrite("user:1:age", 2, &parent, &names));
  EXPECT_FALSE(t.OnWrite("user:2:age", 3, &parent, &names));  // another parent
  ASSERT_TRUE(t.OnWrite("user:1:favor", 4, &parent, &names));
  EXPECT_EQ(parent, "user:1");
  EXPECT_EQ(names, (std::vector<std::string>{"name", "age", "favor"}));
  EXPECT_FALSE(t.OnWrite("user:1:email", 5, &parent, &names));  // reported once per window
  // Ids are not attributes; keys without a parent are ignored; writes far apart are not "together".
  for (const char* k : {"session:1", "session:2", "session:3", "plain", ":x"})
    EXPECT_FALSE(t.OnWrite(k, 6, &parent, &names));
  EXPECT_FALSE(t.OnWrite("user:3:a", 0, &parent, &names));
  EXPECT_FALSE(t.OnWrite("user:3:b", 0, &parent, &names));
  EXPECT_FALSE(t.OnWrite("user:3:c", s.rmw_window_ms + 1, &parent, &names));
}

}  // namespace
}  // namespace keyguard::hygiene

namespace keyguard {
namespace {

// The one JSON escaper and event-line builder every log line goes through.
TEST(JsonLineTest, EscapesEveryByteReversiblyAndBuildsOneObjectPerLine) {
  EXPECT_EQ(JsonEscape("plain"), "plain");
  EXPECT_EQ(JsonEscape(std::string("q\"b\\c\n\x01\xff\x7f", 9)), "q\\\"b\\\\c\\u000a\\u0001\\u00ff\\u007f");
  EXPECT_EQ(JsonString("a\"b"), "\"a\\\"b\"");
  EXPECT_EQ(EventLine("warn", "key_violation").Str("key", "K\"1").Int("n", -3).Raw("o", "{}").Text(),
            R"({"level":"warn","event":"key_violation","key":"K\"1","n":-3,"o":{}})");
  EXPECT_EQ(EventLine("info", "stopped").Text(), R"({"level":"info","event":"stopped"})");
}

}  // namespace
}  // namespace keyguard
