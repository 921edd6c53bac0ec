// Unit tests of the maintenance commands' sans-io parts: config sections, JSON splitting, the
// audit report fed with key records directly, and what the links make of Sentinel and cluster
// replies and of the upstream settings.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "maintenance/args.h"
#include "maintenance/audit_report.h"
#include "maintenance/json_fields.h"
#include "maintenance/redis_link.h"
#include "maintenance/settings.h"

namespace keyguard::maintenance {
namespace {

using Json = nlohmann::json;

MaintenanceConfig Parse(const std::string& yaml) {
  auto c = ParseMaintenanceConfig(yaml);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *std::move(c) : MaintenanceConfig();
}

std::string ParseError(const std::string& yaml) {
  auto c = ParseMaintenanceConfig(yaml);
  return c.ok() ? "ok" : std::string(c.status().message());
}

TEST(MaintenanceSettingsTest, DefaultsWithoutSections) {
  MaintenanceConfig c = Parse("listen: 127.0.0.1:7000\n");
  EXPECT_EQ(c.audit.scan_count, 500u);
  EXPECT_EQ(c.audit.max_ops_per_second, 10000u);
  EXPECT_EQ(c.audit.cold_after_seconds, 2592000u);
  EXPECT_EQ(c.audit.fail_on, Severity::kNever);
  EXPECT_TRUE(c.migrations.empty());
}

TEST(MaintenanceSettingsTest, AuditSection) {
  MaintenanceConfig c = Parse(
      "audit: {scan_count: 100, max_ops_per_second: 0, cold_after_seconds: 5, fail_on: warning, "
      "json_depth: 3, top_keys: 4}\n");
  EXPECT_EQ(c.audit.scan_count, 100u);
  EXPECT_EQ(c.audit.max_ops_per_second, 0u);
  EXPECT_EQ(c.audit.cold_after_seconds, 5u);
  EXPECT_EQ(c.audit.fail_on, Severity::kWarning);
  EXPECT_EQ(c.audit.json_depth, 3u);
  EXPECT_EQ(c.audit.top_keys, 4u);
  EXPECT_EQ(ParseError("audit: {scan_count: 0}\n"), "audit.scan_count: must be between 1 and 100000");
  EXPECT_EQ(ParseError("audit: {fail_on: loud}\n"),
            "audit.fail_on: 'loud' is not one of info, warning, critical, never");
}

TEST(MaintenanceSettingsTest, MigrationFromItsOwnPatternOrAPolicyRule) {
  MaintenanceConfig c = Parse(R"(
key_policy:
  rules:
    - {name: legacy-profile, pattern: '^User_(\d+)_Profile$', rewrite: 'user:$1:profile', action: rewrite}
migrations:
  - {name: profiles, match: 'User_*_Profile', rule: legacy-profile, reshape: json_to_hash, nested: separate_key}
  - {name: carts, match: 'Cart-*', pattern: '^Cart-(\w+)$', rewrite: 'cart:$1', batch: 50}
  - {name: skip, rule: legacy-profile, reshape: json_to_hash, unconvertible: skip}
  - {name: asis, rule: legacy-profile, reshape: json_to_hash, unconvertible: copy_unchanged}
)");
  ASSERT_EQ(c.migrations.size(), 4u);
  EXPECT_EQ(c.FindMigration("profiles")->unconvertible, Migration::Unconvertible::kFail);
  EXPECT_EQ(c.FindMigration("skip")->unconvertible, Migration::Unconvertible::kSkip);
  EXPECT_EQ(c.FindMigration("asis")->unconvertible, Migration::Unconvertible::kCopyUnchanged);
  const Migration* p = c.FindMigration("profiles");
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(p->json_to_hash);
  EXPECT_TRUE(p->separate_nested);
  EXPECT_EQ(p->match, "User_*_Profile");
  EXPECT_EQ(p->NewName("User_1001_Profile"), "user:1001:profile");
  EXPECT_EQ(p->NewName("User_x_Profile"), std::nullopt);
  const Migration* k = c.FindMigration("carts");
  ASSERT_NE(k, nullptr);
  EXPECT_FALSE(k->json_to_hash);
  EXPECT_EQ(k->batch, 50u);
  EXPECT_EQ(k->NewName("Cart-ab12"), "cart:ab12");
  EXPECT_EQ(c.FindMigration("nope"), nullptr);
}

TEST(MaintenanceSettingsTest, MigrationErrorsNameTheField) {
  EXPECT_EQ(ParseError("migrations: [{name: a, rule: nope}]\n"),
            "migrations[0].rule: no key_policy.rules entry is named 'nope'");
  EXPECT_EQ(ParseError("migrations: [{name: a, rewrite: 'x:$1'}]\n"),
            "migrations[0].pattern: required (or name a key_policy rule in rule)");
  EXPECT_EQ(ParseError("migrations: [{name: a, pattern: '(x'}]\n"),
            "migrations[0].rewrite: required (or name a key_policy rule in rule)");
  EXPECT_EQ(ParseError("migrations: [{name: a, pattern: '^(x$', rewrite: 'y'}]\n"),
            "migrations[0].pattern: missing ): ^(x$");
  EXPECT_EQ(ParseError("migrations: [{name: a, pattern: '^x$', rewrite: 'y:$2'}]\n"),
            "migrations[0].rewrite: Rewrite schema requests 2 matches, but the regexp only has 0 parenthesized "
            "subexpressions.");
  EXPECT_EQ(ParseError("migrations: [{name: a, pattern: '^(x)$', rewrite: 'y', nested: separate_key}]\n"),
            "migrations[0].nested: applies to reshape: json_to_hash only");
  EXPECT_EQ(ParseError("migrations: [{name: a, pattern: '^(x)$', rewrite: 'y', unconvertible: skip}]\n"),
            "migrations[0].unconvertible: applies to reshape: json_to_hash only");
  EXPECT_EQ(
      ParseError(
          "migrations: [{name: a, pattern: '^(x)$', rewrite: 'y', reshape: json_to_hash, unconvertible: drop}]\n"),
      "migrations[0].unconvertible: 'drop' is not one of fail, skip, copy_unchanged");
  EXPECT_EQ(
      ParseError("migrations: [{name: a, pattern: '^(x)$', rewrite: y}, {name: a, pattern: '^(x)$', rewrite: y}]\n"),
      "migrations[1].name: 'a' is used twice");
  EXPECT_EQ(ParseError("key_policy: {rules: [{name: r, pattern: x}]}\nmigrations: [{name: a, rule: r}]\n"),
            "migrations[0].rule: rule 'r' has no rewrite");
}

TEST(MaintenanceArgsTest, ValuedSwitchesAndPositional) {
  auto a = ParseArgs({"copy", "--migration", "profiles", "--dry-run", "--max-keys=10"}, {"--migration", "--max-keys"},
                     {"--dry-run"});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->positional, std::vector<std::string>{"copy"});
  EXPECT_EQ(a->Str("--migration"), "profiles");
  EXPECT_TRUE(a->Has("--dry-run"));
  EXPECT_EQ(*a->Int("--max-keys", 0, 0, 100), 10);
  EXPECT_EQ(a->Int("--max-keys", 0, 0, 5).status().message(), "--max-keys: expected an integer in 0..5");
  EXPECT_EQ(ParseArgs({"--bogus"}, {}, {}).status().message(), "unknown flag '--bogus'");
  EXPECT_EQ(ParseArgs({"--migration"}, {"--migration"}, {}).status().message(), "--migration needs a value");
}

Reply Bulk(std::string s) {
  Reply r;
  r.kind = Reply::Kind::kString;
  r.str = std::move(s);
  return r;
}

Reply Int(int64_t v) {
  Reply r;
  r.kind = Reply::Kind::kInteger;
  r.integer = v;
  return r;
}

Reply Array(std::vector<Reply> elements) {
  Reply r;
  r.kind = Reply::Kind::kArray;
  r.elements = std::move(elements);
  return r;
}

TEST(RedisLinkTest, PrimaryFromASentinelsAnswer) {
  auto p = PrimaryFromSentinel(Array({Bulk("10.0.0.7"), Bulk("6380")}));
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->ToString(), "10.0.0.7:6380");
  EXPECT_FALSE(PrimaryFromSentinel(Reply()).has_value());  // nil: the Sentinel does not know the master
  Reply error;
  error.kind = Reply::Kind::kError;
  error.str = "NOAUTH Authentication required.";
  EXPECT_FALSE(PrimaryFromSentinel(error).has_value());
  EXPECT_FALSE(PrimaryFromSentinel(Array({Bulk("10.0.0.7"), Bulk("65536")})).has_value());
  EXPECT_FALSE(PrimaryFromSentinel(Array({Bulk("10.0.0.7"), Bulk("0")})).has_value());
  EXPECT_FALSE(PrimaryFromSentinel(Array({Bulk(""), Bulk("6379")})).has_value());
  EXPECT_FALSE(PrimaryFromSentinel(Array({Bulk("10.0.0.7")})).has_value());
}

TEST(RedisLinkTest, PrimariesInTheOrderOfTheirAddressesAndEachSlotsOwner) {
  // CLUSTER SLOTS: [first, last, [host, port, id], replicas...], in no particular order.
  auto range = [](int64_t first, int64_t last, std::string host, int64_t port) {
    return Array({Int(first), Int(last), Array({Bulk(std::move(host)), Int(port), Bulk("id")}),
                  Array({Bulk("10.0.0.9"), Int(7000), Bulk("replica")})});
  };
  const Reply slots =
      Array({range(10923, 16383, "10.0.0.3", 7002), range(0, 100, "10.0.0.2", 7001), range(5461, 10922, "", 7003),
             range(101, 5460, "10.0.0.1", 7000), range(200, 100, "10.0.0.2", 7001)});
  std::vector<std::string> got;
  const ClusterLayout layout = LayoutFromSlots(slots, "seed.example");
  for (const config::HostPort& p : layout.primaries) got.push_back(p.ToString());
  // In the order of their addresses, as the proxy numbers them for SCAN.
  EXPECT_EQ(got, (std::vector<std::string>{"10.0.0.1:7000", "10.0.0.2:7001", "10.0.0.3:7002", "seed.example:7003"}));
  EXPECT_EQ(layout.owner[0], 1);
  EXPECT_EQ(layout.owner[100], 1);
  EXPECT_EQ(layout.owner[101], 0);
  EXPECT_EQ(layout.owner[5460], 0);
  EXPECT_EQ(layout.owner[5461], 3);
  EXPECT_EQ(layout.owner[10923], 2);
  EXPECT_EQ(layout.owner[16383], 2);
  EXPECT_TRUE(LayoutFromSlots(Array({}), "seed").primaries.empty());
  EXPECT_EQ(LayoutFromSlots(Array({}), "seed").owner[0], ClusterLayout::kNoOwner);
}

TEST(RedisLinkTest, AClusterCursorNamesItsPrimaries) {
  const std::vector<config::HostPort> three = {{"10.0.0.1", 7000}, {"10.0.0.2", 7001}, {"10.0.0.3", 7002}};
  std::vector<config::HostPort> failed_over = three;
  failed_over[1].port = 7004;
  const std::string tag = LayoutTag(three);
  EXPECT_EQ(tag.size(), 8u);
  EXPECT_EQ(LayoutTag(three), tag);
  EXPECT_NE(LayoutTag(failed_over), tag);
  EXPECT_EQ(SplitCursor("4503599627370569-" + tag), (std::pair<std::string, std::string>{"4503599627370569", tag}));
  EXPECT_EQ(SplitCursor("17"), (std::pair<std::string, std::string>{"17", ""}));
  EXPECT_EQ(StaleCursor("4503599627370569", tag, three), "");
  EXPECT_EQ(StaleCursor("0", "", failed_over), "");
  EXPECT_NE(StaleCursor("4503599627370569", tag, failed_over).find("primaries changed"), std::string::npos);
  EXPECT_NE(StaleCursor("4503599627370569", "", three).find("not a cursor of this cluster"), std::string::npos);
}

std::string CreateError(const std::string& yaml, const std::string& upstream) {
  auto c = ParseMaintenanceConfig(yaml);
  if (!c.ok()) return std::string(c.status().message());
  auto u = config::ParseUpstream(upstream, "--upstream");
  if (!u.ok()) return std::string(u.status().message());
  c->proxy.upstream = *u;
  auto links = UpstreamLinks::Create(c->proxy);
  return links.ok() ? "ok" : std::string(links.status().message());
}

TEST(UpstreamLinksTest, SettingsAreCheckedAsTheProxyChecksThem) {
  unsetenv("REDISCLI_AUTH");
  EXPECT_EQ(CreateError("", "rediss://127.0.0.1:6390"), "ok");
  EXPECT_EQ(CreateError("upstream_tls: {ca_file: /nonexistent/ca.pem}\n", "rediss://127.0.0.1:6390").substr(0, 43),
            "upstream_tls.ca_file: /nonexistent/ca.pem: ");
  EXPECT_EQ(CreateError("upstream_tls: {ca_file: /nonexistent/ca.pem}\n", "127.0.0.1:6379"),
            "upstream_tls: set, but upstream '127.0.0.1:6379' is not TLS (rediss:// or rediss-sentinel://)");
  EXPECT_EQ(CreateError("", "redis://alice@127.0.0.1:6379"),
            "upstream: names user 'alice' but no password is set: upstream_auth.password_file");
  // A Sentinel group's config pointed at one of its servers: the Sentinel credentials go unused.
  const std::string password_file = testing::TempDir() + "/kg-sentinel-password";
  std::ofstream(password_file) << "secret\n";
  EXPECT_EQ(CreateError("sentinel: {password_file: " + password_file + "}\n", "127.0.0.1:6379"), "ok");
  std::remove(password_file.c_str());
  // $REDISCLI_AUTH is the password, as for redis-cli.
  setenv("REDISCLI_AUTH", "secret", 1);
  EXPECT_EQ(CreateError("", "redis://alice@127.0.0.1:6379"), "ok");
  unsetenv("REDISCLI_AUTH");
}

TEST(UpstreamLinksTest, ErrorsNameTheUpstream) {
  unsetenv("REDISCLI_AUTH");
  auto c = ParseMaintenanceConfig("");
  ASSERT_TRUE(c.ok());
  // Port 1 on loopback: nothing listens there (refused at once).
  c->proxy.upstream = *config::ParseUpstream("redis://127.0.0.1:1", "--upstream");
  auto direct = UpstreamLinks::Create(c->proxy);
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(direct->Connect(0).status().message(), "upstream 127.0.0.1:1: Connection refused");
  c->proxy.upstream = *config::ParseUpstream("redis-sentinel://mymaster@127.0.0.1:1,127.0.0.1:2", "--upstream");
  auto sentinel = UpstreamLinks::Create(c->proxy);
  ASSERT_TRUE(sentinel.ok());
  EXPECT_EQ(sentinel->Connect(0).status().message(),
            "upstream redis-sentinel://mymaster@127.0.0.1:1,127.0.0.1:2: no Sentinel gave a verified master: "
            "Sentinel 127.0.0.1:1: Connection refused; Sentinel 127.0.0.1:2: Connection refused");
}

TEST(JsonFieldsTest, DepthCountsBracketsOutsideStringsEvenOnAPrefix) {
  EXPECT_EQ(JsonDepth("{}"), 1);
  EXPECT_EQ(JsonDepth(R"({"a":1,"b":"x"})"), 1);
  EXPECT_EQ(JsonDepth(R"({"a":{"b":[1,2]}})"), 3);
  EXPECT_EQ(JsonDepth(R"({"a":"{[{[","b":"\"{"})"), 1);
  EXPECT_EQ(JsonDepth(R"({"a":{"b":{"c)"), 3);  // cut mid-string
  EXPECT_EQ(JsonDepth("plain text"), 0);
}

TEST(JsonFieldsTest, TopLevelFieldsBecomeHashFields) {
  ShapeError error;
  auto s =
      JsonToHash(R"({"name":"ada","age":36,"vip":true,"x":null,"pi":1.5,"tags":["a","b"],"addr":{"city":"Paris"}})",
                 false, &error);
  ASSERT_TRUE(s) << error.text;
  EXPECT_EQ(s->fields, (Fields{{"name", "ada"},
                               {"age", "36"},
                               {"vip", "true"},
                               {"x", "null"},
                               {"pi", "1.5"},
                               {"tags", R"(["a","b"])"},
                               {"addr", R"({"city":"Paris"})"}}));
  EXPECT_TRUE(s->subkeys.empty());
}

// Issue #20: numbers and escapes are kept as the JSON wrote them; only whitespace between tokens
// goes. A double round trip would turn these into 1.2345678901234568e+22 and 88.36767999999999.
TEST(JsonFieldsTest, NumbersAndNestedTextAreByteExact) {
  ShapeError error;
  auto s = JsonToHash(
      "{ \"big\" : 12345678901234567890123 , \"f\":88.36768,\"z\":-0,\"e\":1E400,\"t\":1.10,"
      "\"n\": { \"x\" : [ 1.50 , \"a \\u00e9 b\" ] },\"s\":\"tab\\there \\u00e9 \\ud83d\\ude00 "
      "\\/\",\"raw\":\"\xff\xfe\"}",
      false, &error);
  ASSERT_TRUE(s) << error.text;
  EXPECT_EQ(s->fields, (Fields{{"big", "12345678901234567890123"},
                               {"f", "88.36768"},
                               {"z", "-0"},
                               {"e", "1E400"},
                               {"t", "1.10"},
                               {"n", R"({"x":[1.50,"a \u00e9 b"]})"},
                               {"s", "tab\there \xc3\xa9 \xf0\x9f\x98\x80 /"},
                               {"raw", "\xff\xfe"}}));
}

TEST(JsonFieldsTest, NestedValuesAsSeparateKeys) {
  ShapeError error;
  auto s =
      JsonToHash(R"({"name":"ada","tags":["a"],"addr":{"city":"Paris","geo":{"lat":1}},"empty":{}})", true, &error);
  ASSERT_TRUE(s) << error.text;
  EXPECT_EQ(s->fields, (Fields{{"name", "ada"}, {"empty", "{}"}}));
  ASSERT_EQ(s->subkeys.size(), 2u);
  EXPECT_EQ(s->subkeys[0].suffix, "tags");
  EXPECT_FALSE(s->subkeys[0].hash);
  EXPECT_EQ(s->subkeys[0].text, R"(["a"])");
  EXPECT_EQ(s->subkeys[1].suffix, "addr");
  EXPECT_TRUE(s->subkeys[1].hash);
  EXPECT_EQ(s->subkeys[1].fields, (Fields{{"city", "Paris"}, {"geo", R"({"lat":1})"}}));
}

TEST(JsonFieldsTest, WhatCannotBecomeAHash) {
  const std::vector<std::tuple<std::string, bool, std::string, std::string>> cases = {
      {"[1,2]", false, "not_object", "not a JSON object"},
      {"\"text\"", false, "not_object", "not a JSON object"},
      {"12", false, "not_object", "not a JSON object"},
      {"{\"a\":", false, "not_json", "not valid JSON"},
      {"not json", false, "not_json", "not valid JSON"},
      {"", false, "not_json", "not valid JSON"},
      {"{\"a\":1}x", false, "not_json", "not valid JSON"},
      {"{\"a\":01}", false, "not_json", "not valid JSON"},
      {"{\"a\":1.}", false, "not_json", "not valid JSON"},
      {"{\"a\":+1}", false, "not_json", "not valid JSON"},
      {"{\"a\":[1,]}", false, "not_json", "not valid JSON"},
      {"{\"a\":1,}", false, "not_json", "not valid JSON"},
      {"{'a':1}", false, "not_json", "not valid JSON"},
      {"{\"a\":\"\x01\"}", false, "not_json", "not valid JSON"},
      {"{\"a\":\"\\ud800\"}", false, "not_json", "not valid JSON"},
      {"{\"a\":\"\\udc00\"}", false, "not_json", "not valid JSON"},
      {"{\"a\":\"\\x\"}", false, "not_json", "not valid JSON"},
      {"{\"a\":tru}", false, "not_json", "not valid JSON"},
      {"{\"a\":[{]}", false, "not_json", "not valid JSON"},
      {"{}", false, "empty_object", "an empty object"},
      {" { } ", false, "empty_object", "an empty object"},
      {"{\"a\":1,\"a\":2}", false, "duplicate_field", "the field 'a' appears twice (one value would be lost)"},
      {"{\"a\":1,\"b\":{\"c\":1,\"c\":2}}", true, "duplicate_field",
       "field 'b': the field 'c' appears twice (one value would be lost)"},
      {R"({"a":{"b":1}})", true, "no_top_level_field", "no top-level field left for the main Hash"},
  };
  for (const auto& [json, separate, reason, text] : cases) {
    ShapeError error;
    EXPECT_FALSE(JsonToHash(json, separate, &error)) << json;
    EXPECT_EQ(error.reason, reason) << json;
    EXPECT_EQ(error.text, text) << json;
  }
  // Deep nesting is read without recursion.
  ShapeError error;
  const std::string deep = "{\"a\":" + std::string(200000, '[') + std::string(200000, ']') + "}";
  auto s = JsonToHash(deep, false, &error);
  ASSERT_TRUE(s) << error.text;
  EXPECT_EQ(s->fields[0].second.size(), 400000u);
  EXPECT_FALSE(JsonToHash("{\"a\":" + std::string(200000, '['), false, &error));
}

class AuditReportTest : public ::testing::Test {
 protected:
  AuditReportTest()
      : cfg_(Parse("hygiene: {big_string_bytes: 100, huge_string_bytes: 1000, big_collection_elements: 10}\n"
                   "audit: {cold_after_seconds: 60, top_keys: 3}\n")),
        report_(cfg_.proxy, cfg_.audit) {}
  void Add(std::string key, std::string type, int64_t pttl, int64_t memory, int64_t idle, int64_t size,
           std::string head = "") {
    KeyRecord r;
    r.key = std::move(key);
    r.type = std::move(type);
    r.pttl_ms = pttl;
    r.memory = memory;
    r.idle_seconds = idle;
    r.size = size;
    r.head = std::move(head);
    report_.Add(r);
  }
  MaintenanceConfig cfg_;
  AuditReport report_;
};

TEST_F(AuditReportTest, EveryKindOfFindingWithExactCounts) {
  Add("user:1:profile", "hash", -1, 100, 5, 3);
  Add("user:2:profile", "hash", 5000, 300, 120, 20);                          // big collection, cold
  Add("User_3_Profile", "string", -1, 80, 1, 30, R"({"name":"x","age":3})");  // naming, serialized -> hash
  Add("doc:1", "string", 1000, 2000, 1, 1500, R"({"a":{"b":1}})");            // huge, nested JSON -> json type
  Add("blob:1", "string", 1000, 200, 1, 150, "\x80\x04\x95");                 // big, pickle
  Json j = Json::parse(report_.Json());
  EXPECT_EQ(j["memory"], 2680);
  ASSERT_EQ(j["patterns"].size(), 4u);
  // Patterns sort by name: User_{id}_Profile, blob:{id}, doc:{id}, user:{id}:profile.
  const Json& users = j["patterns"][3];
  EXPECT_EQ(users["pattern"], "user:{id}:profile");
  EXPECT_EQ(users["keys"], 2);
  EXPECT_EQ(users["memory"], 400);
  EXPECT_EQ(users["no_ttl_keys"], 1);
  EXPECT_EQ(users["no_ttl_memory"], 100);
  EXPECT_DOUBLE_EQ(users["no_ttl_memory_share"].get<double>(), 0.25);
  EXPECT_EQ(users["cold_keys"], 1);
  ASSERT_EQ(j["naming"].size(), 1u);  // `_` is allowed punctuation: only lowercase is broken
  EXPECT_EQ(j["naming"][0]["rule"], "lowercase");
  EXPECT_EQ(j["naming"][0]["examples"][0]["key"], "User_3_Profile");
  EXPECT_EQ(j["naming"][0]["examples"][0]["suggestion"], "user:3:profile");
  ASSERT_EQ(j["big_keys"].size(), 2u);
  EXPECT_EQ(j["big_keys"][0]["type"], "hash");
  EXPECT_EQ(j["big_keys"][0]["keys"], 1);
  EXPECT_EQ(j["big_keys"][1]["type"], "string");
  EXPECT_EQ(j["big_keys"][1]["keys"], 2);
  EXPECT_EQ(j["big_keys"][1]["examples"][0]["key"], "doc:1");  // by size, largest first
  EXPECT_EQ(j["huge_strings"]["keys"], 1);
  EXPECT_EQ(j["cold_keys"]["keys"], 1);
  EXPECT_EQ(j["cold_keys"]["examples"][0]["key"], "user:2:profile");
  EXPECT_EQ(j["serialized"]["hash_candidates"], Json({{"json_object", 1}, {"python_pickle", 1}}));
  EXPECT_EQ(j["serialized"]["json_documents"], 1);
  ASSERT_EQ(j["top_keys"].size(), 3u);
  EXPECT_EQ(j["top_keys"][0]["key"], "doc:1");
  EXPECT_EQ(j["top_keys"][1]["key"], "user:2:profile");
  EXPECT_EQ(j["top_keys"][2]["key"], "blob:1");
  // critical: the huge string (not also a big-string warning); warning: lowercase, the big hash,
  // the big string, two serialized; info: two keys without TTL, one cold key, one JSON document.
  EXPECT_EQ(j["findings"], Json({{"critical", 1}, {"warning", 5}, {"info", 4}}));
  EXPECT_TRUE(report_.Fails(Severity::kCritical));
  EXPECT_FALSE(report_.Fails(Severity::kNever));
}

TEST_F(AuditReportTest, PrometheusSeries) {
  Add("user:1:profile", "hash", -1, 100, 5, 3);
  Add("User_3_Profile", "string", -1, 80, 1, 30);
  const std::string prom = report_.Prometheus();
  for (const char* line : {"keyguard_audit_keys{key_pattern=\"user:{id}:profile\",type=\"hash\"} 1\n",
                           "keyguard_audit_memory_bytes{key_pattern=\"User_{id}_Profile\",type=\"string\"} 80\n",
                           "keyguard_audit_keys_without_ttl{key_pattern=\"user:{id}:profile\"} 1\n",
                           "keyguard_audit_naming_violations{rule=\"lowercase\",key_pattern=\"User_{id}_Profile\"} 1\n",
                           "keyguard_audit_findings{severity=\"info\"} 2\n", "# TYPE keyguard_audit_keys gauge\n"}) {
    EXPECT_NE(prom.find(line), std::string::npos) << line << prom;
  }
  EXPECT_FALSE(report_.Fails(Severity::kCritical));
  EXPECT_TRUE(report_.Fails(Severity::kWarning));
}

}  // namespace
}  // namespace keyguard::maintenance
