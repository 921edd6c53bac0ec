#include "keyguard/config/config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/wrappers.pb.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config/yaml_proto.h"
#include "keyguard/config/config_store.h"
#include "keyguard/config/v1/config.pb.h"

namespace keyguard::config {
namespace {

namespace fs = std::filesystem;

TEST(Config, EmptyDocumentGivesDefaults) {
  auto c = ParseConfig("");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen.ToString(), "127.0.0.1:6380");
  EXPECT_EQ(c->upstream.ToString(), "127.0.0.1:6379");
  EXPECT_EQ(c->limits.max_bulk_len, 512LL * 1024 * 1024);
  EXPECT_EQ(c->limits.max_inline_len, 64u * 1024);
  EXPECT_EQ(c->shared_reply_timeout_ms, 30000);
}

TEST(Config, ParsesEverySetting) {
  auto c = ParseConfig(R"(
listen: 0.0.0.0:7000
upstream: "[::1]:6379"
admin: 127.0.0.1:9999
threads: 3
upstream_connect_timeout_ms: 500
drain_timeout_ms: 100
shared_reply_timeout_ms: 0
deny_commands: [FLUSHALL, flushdb]
limits:
  max_bulk_len: 1024
  max_multibulk_len: 10
  max_inline_len: 100
  max_depth: 8                  # ignored, still accepted
  max_pending_commands: 5
  max_output_buffer: 8192
  read_buffer_size: 1024
  slow_client_grace_ms: 2500
)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen.ToString(), "0.0.0.0:7000");
  EXPECT_EQ(c->upstream.address.host, "::1");
  EXPECT_EQ(c->upstream.ToString(), "[::1]:6379");
  EXPECT_EQ(c->threads, 3);
  EXPECT_EQ(c->deny_commands, (std::vector<std::string>{"flushall", "flushdb"}));
  EXPECT_EQ(c->limits.max_bulk_len, 1024);
  EXPECT_EQ(c->max_pending_commands, 5);
  EXPECT_EQ(c->read_buffer_size, 1024);
  EXPECT_EQ(c->slow_client_grace_ms, 2500);
  EXPECT_EQ(c->shared_reply_timeout_ms, 0);
}

TEST(Config, ErrorsNameTheField) {
  struct Case {
    const char* yaml;
    const char* error;
  } cases[] = {
      {"lissten: a:1", "lissten: unknown field"},
      {"limits:\n  max_bulk: 3", "limits.max_bulk: unknown field"},
      {"threads: many", "threads: expected an integer"},
      {"threads: -1", "threads: must be between 0 and "},
      {"threads: 300", "threads: must be between 0 and 256"},
      {"limits:\n  slow_client_grace_ms: 50", "limits.slow_client_grace_ms: must be between 100 and 86400000"},
      {"shared_reply_timeout_ms: 90000000", "shared_reply_timeout_ms: must be between 0 and 86400000"},
      {"upstream: localhost", "upstream: 'localhost' is not HOST:PORT"},
      {"upstream: host:99999", "upstream: 'host:99999' is not HOST:PORT with a port in 0..65535"},
      {"deny_commands: [FLUSHALL, NOPE]", "deny_commands[1]: 'NOPE' is not a Redis command"},
      {"deny_commands: FLUSHALL", "deny_commands: expected a list"},
      {"key_policy:\n  rules:\n    - name: a\n      pattern: \"(x\"", "key_policy.rules[0].pattern: missing )"},
      {"key_policy: {scripts: {allowed_scripts: [abc]}}",
       "key_policy.scripts.allowed_scripts[0]: must be 40 hex digits (the SHA1 SCRIPT LOAD answers)"},
      {"key_policy:\n  lowercase: {action: rejekt}",
       "key_policy.lowercase.action: 'rejekt' is not one of observe, warn, rewrite, reject"},
      {"key_policy:\n  charset: {scope: {categories: [nope]}}",
       "key_policy.charset.scope.categories[0]: 'nope' is neither"},
      {"listen: [a", "line 1, column"},
      {"listen: 127.0.0.1:7000\nadmin: 127.0.0.1:7000", "admin: must differ from listen"},
  };
  for (const Case& c : cases) {
    auto r = ParseConfig(c.yaml);
    ASSERT_FALSE(r.ok()) << c.yaml;
    EXPECT_EQ(std::string(r.status().message()).rfind(c.error, 0), 0u) << r.status().message();
  }
}

// The first error of the whole text -> proto -> compiled config path, or "ok".
std::string ParseError(const std::string& yaml) {
  auto c = ParseConfig(yaml);
  return c.ok() ? "ok" : std::string(c.status().message());
}

// The error of mapping `yaml` onto `m`, or "ok".
std::string ProtoError(const std::string& yaml, google::protobuf::Message* m) {
  auto s = YamlTextToProto(yaml, m);
  return s.ok() ? "ok" : std::string(s.message());
}

TEST(ConfigLoadTest, NonScalarKeysAreFieldErrors) {
  EXPECT_EQ(ParseError("? [a, b]\n: 1\n"), "(top level): a key must be a field name, not a list (line 1, column 3)");
  EXPECT_EQ(ParseError("key_policy:\n  ? {a: 1}\n  : 2\n"),
            "key_policy: a key must be a field name, not a mapping (line 2, column 5)");
  EXPECT_EQ(ParseError("limits:\n  ~: 1\n"), "limits: a key must be a field name, not null (line 2, column 3)");
  EXPECT_EQ(ParseError("tenancy:\n  users:\n    - ? [x]\n      : y\n"),
            "tenancy.users[0]: a key must be a field name, not a list (line 3, column 9)");
}

TEST(ConfigLoadTest, AnchorsAndAliasesWorkMergeKeysAreRefused) {
  auto c = ParseConfig("threads: &n 3\ndrain_timeout_ms: *n\ndeny_commands: &deny [flushall]\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->threads, 3);
  EXPECT_EQ(c->drain_timeout_ms, 3);
  EXPECT_EQ(ParseError("threads: *nope\n"), "line 1, column 10: the referenced anchor is not defined");
  EXPECT_EQ(ParseError("key_policy:\n  <<: {default_action: warn}\n"),
            "key_policy.<<: merge keys are not supported; write the fields out (an alias may stand for a whole value, "
            "as in `rules: *shared_rules`)");
  // A quoted "<<" is just an unknown field name.
  EXPECT_EQ(ParseError("limits:\n  '<<': 1\n").rfind("limits.<<: unknown field (known: ", 0), 0u);
}

TEST(ConfigLoadTest, AliasBombsStopAtTheExpansionBudget) {
  // 1001 rules, each the same 1000-command scope: a 7 KB text that expands to a million values.
  std::string commands = "[get";
  for (int i = 1; i < 1000; ++i) commands += ", get";
  commands += "]";
  std::string yaml = "key_policy:\n  rules:\n    - &r {name: a, scope: {commands: " + commands + "}}\n";
  for (int i = 0; i < 1000; ++i) yaml += "    - *r\n";
  v1::Config proto;
  EXPECT_EQ(
      ProtoError(yaml, &proto),
      "key_policy.rules[993].scope.commands[37]: the document expands (through aliases) to more than 1000000 values");
  // Few values, but a 100 KB scalar aliased 200 times: 20 MB of text.
  std::string big(100000, 'x');
  yaml = "key_policy:\n  rules:\n    - &r {name: " + big + "}\n";
  for (int i = 0; i < 200; ++i) yaml += "    - *r\n";
  proto.Clear();
  EXPECT_EQ(ProtoError(yaml, &proto),
            "key_policy.rules[167].name: the document expands (through aliases) to more than 16777216 bytes of text");
  // An alias inside its own anchor is a cycle; the depth limit ends the walk.
  google::protobuf::ListValue list;
  std::string want = "values[0]";
  for (int i = 0; i < 10; ++i) want += ".list_value.values[0]";
  EXPECT_EQ(ProtoError("&a {values: [{list_value: *a}]}", &list), want + ": nested deeper than 32 levels");
}

TEST(ConfigLoadTest, DeepNestingStopsInTheParser) {
  // yaml-cpp has a recursion limit of its own (it calls it "bad file"); ours (32) comes later.
  EXPECT_EQ(ParseError(std::string(100000, '[')), "line 1, column 1: nested deeper than yaml-cpp's limit (499 levels)");
  std::string yaml;
  for (int i = 0; i < 600; ++i) yaml += std::string(i, ' ') + "a:\n";
  EXPECT_EQ(ParseError(yaml), "line 499, column 501: nested deeper than yaml-cpp's limit (499 levels)");
}

TEST(ConfigLoadTest, TagsAreRefused) {
  EXPECT_EQ(ParseError("threads: !!int 3\n"), "threads: tags are not supported (!!int); write the plain value");
  EXPECT_EQ(ParseError("listen: !!str 127.0.0.1:1\n"), "listen: tags are not supported (!!str); write the plain value");
  EXPECT_EQ(ParseError("listen: !custom x\n"), "listen: tags are not supported (!custom); write the plain value");
  EXPECT_EQ(ParseError("!!map {threads: 1}\n"), "(top level): tags are not supported (!!map); write the plain value");
  EXPECT_EQ(ParseError("deny_commands: !!seq [get]\n"),
            "deny_commands: tags are not supported (!!seq); write the plain value");
  EXPECT_EQ(ParseError("? !!str threads\n: 1\n"), "(top level): tags are not supported (!!str); write the plain value");
  // Quoting is not a tag.
  EXPECT_EQ(ParseError("listen: '127.0.0.1:7001'\nupstream: \"127.0.0.1:7002\"\n"), "ok");
}

TEST(ConfigLoadTest, DuplicateKeysAreRefused) {
  EXPECT_EQ(ParseError("threads: 1\nthreads: 2\n"), "threads: duplicate key (first at line 1)");
  EXPECT_EQ(ParseError("limits:\n  max_depth: 1\n  'max_depth': 2\n"),
            "limits.max_depth: duplicate key (first at line 2)");
  EXPECT_EQ(ParseError("key_policy: {rules: [{name: a, name: b}]}\n"),
            "key_policy.rules[0].name: duplicate key (first at line 1)");
}

TEST(ConfigLoadTest, IntegersOutsideTheFieldTypeAreRangeErrors) {
  struct Case {
    const char* yaml;
    const char* error;
  } cases[] = {
      // int32 (limits.max_depth)
      {"limits: {max_depth: 2147483648}", "limits.max_depth: must be between -2147483648 and 2147483647"},
      {"limits: {max_depth: -2147483649}", "limits.max_depth: must be between -2147483648 and 2147483647"},
      {"limits: {max_depth: -2147483648}", "ok"},
      // uint32 (threads)
      {"threads: -1", "threads: must be between 0 and 4294967295"},
      {"threads: 4294967296", "threads: must be between 0 and 4294967295"},
      {"threads: 4294967295", "ok"},
      {"threads: -0", "ok"},
      // int64 (limits.max_bulk_len)
      {"limits: {max_bulk_len: 9223372036854775808}",
       "limits.max_bulk_len: must be between -9223372036854775808 and 9223372036854775807"},
      {"limits: {max_bulk_len: -9223372036854775809}",
       "limits.max_bulk_len: must be between -9223372036854775808 and 9223372036854775807"},
      {"limits: {max_bulk_len: 99999999999999999999999999999}",
       "limits.max_bulk_len: must be between -9223372036854775808 and 9223372036854775807"},
      {"limits: {max_bulk_len: -9223372036854775808}", "ok"},
      // uint64 (hygiene.big_string_bytes)
      {"hygiene: {big_string_bytes: 18446744073709551616}",
       "hygiene.big_string_bytes: must be between 0 and 18446744073709551615"},
      {"hygiene: {big_string_bytes: -1}", "hygiene.big_string_bytes: must be between 0 and 18446744073709551615"},
      {"hygiene: {big_string_bytes: 18446744073709551615}", "ok"},
      // Not decimal integers.
      {"threads: 1e3", "threads: expected an integer"},
      {"threads: 0x10", "threads: expected an integer"},
      {"threads: 1.5", "threads: expected an integer"},
      {"threads: ''", "threads: expected an integer"},
      {"threads: '-'", "threads: expected an integer"},
      {"threads: ' 1'", "threads: expected an integer"},
  };
  for (const Case& c : cases) {
    v1::Config proto;
    EXPECT_EQ(ProtoError(c.yaml, &proto), c.error) << c.yaml;
  }
  // After the type, the compiled config checks its own ranges.
  EXPECT_EQ(ParseError("threads: 4294967295"), "threads: must be between 0 and 256");
  EXPECT_EQ(ParseError("hygiene: {jitter_percent: 4294967295}"), "hygiene.jitter_percent: must be between 1 and 100");
  EXPECT_EQ(ParseError("limits: {max_depth: -2147483648}"), "ok");  // deprecated: accepted and ignored
}

TEST(ConfigLoadTest, EveryNumericTypeKeepsItsRange) {
  google::protobuf::Int32Value i32;
  EXPECT_EQ(ProtoError("value: 2147483647", &i32), "ok");
  EXPECT_EQ(i32.value(), 2147483647);
  EXPECT_EQ(ProtoError("value: 2147483648", &i32), "value: must be between -2147483648 and 2147483647");
  google::protobuf::UInt32Value u32;
  EXPECT_EQ(ProtoError("value: -5", &u32), "value: must be between 0 and 4294967295");
  google::protobuf::Int64Value i64;
  EXPECT_EQ(ProtoError("value: -9223372036854775808", &i64), "ok");
  EXPECT_EQ(i64.value(), INT64_MIN);
  google::protobuf::UInt64Value u64;
  EXPECT_EQ(ProtoError("value: 18446744073709551615", &u64), "ok");
  EXPECT_EQ(u64.value(), UINT64_MAX);
  google::protobuf::DoubleValue d;
  EXPECT_EQ(ProtoError("value: -1.5e3", &d), "ok");
  EXPECT_EQ(d.value(), -1500.0);
  EXPECT_EQ(ProtoError("value: 1e999", &d), "value: must be a finite number");
  EXPECT_EQ(ProtoError("value: -1e999", &d), "value: must be a finite number");
  EXPECT_EQ(ProtoError("value: nan", &d), "value: must be a finite number");
  EXPECT_EQ(ProtoError("value: .inf", &d), "value: expected a number");
  EXPECT_EQ(ProtoError("value: twelve", &d), "value: expected a number");
  google::protobuf::FloatValue f;
  EXPECT_EQ(ProtoError("value: 1e39", &f), "value: must be between -3.40282e+38 and 3.40282e+38");
  EXPECT_EQ(ProtoError("value: 0.25", &f), "ok");
  EXPECT_EQ(f.value(), 0.25f);
}

TEST(ConfigLoadTest, WrongTypesNameTheField) {
  EXPECT_EQ(ParseError("threads: [1]"), "threads: expected a scalar value");
  EXPECT_EQ(ParseError("listen: {a: 1}"), "listen: expected a string");
  EXPECT_EQ(ParseError("limits: 5"), "limits: expected a mapping");
  EXPECT_EQ(ParseError("deny_commands: {a: 1}"), "deny_commands: expected a list");
  EXPECT_EQ(ParseError("deny_commands: [[get]]"), "deny_commands[0]: expected a string");
  EXPECT_EQ(ParseError("hygiene: {enabled: maybe}"), "hygiene.enabled: expected true or false");
  EXPECT_EQ(ParseError("- threads"), "(top level): expected a mapping");
  EXPECT_EQ(ParseError("just text"), "(top level): expected a mapping");
  EXPECT_EQ(
      ParseError("key_policy: {default_action: " + std::string(100, 'x') + "}"),
      "key_policy.default_action: '" + std::string(64, 'x') + "...' is not one of observe, warn, rewrite, reject");
}

TEST(ConfigLoadTest, TextMustBePrintableUtf8) {
  EXPECT_EQ(ParseError(std::string("threads: 1\n\0", 12)),
            "line 2, column 1: control character 0x00 is not allowed in YAML text (in a double-quoted string write it "
            "as \\x00)");
  EXPECT_EQ(ParseError("listen: a\x0b"),
            "line 1, column 10: control character 0x0b is not allowed in YAML text (in a double-quoted string write it "
            "as \\x0b)");
  EXPECT_EQ(ParseError("listen: \xff"), "line 1, column 9: invalid UTF-8 (byte 0xff)");
  EXPECT_EQ(ParseError("# caf\xc3\xa9\nlisten: \xc0\xaf"),
            "line 2, column 9: invalid UTF-8 (byte 0xc0)");                                      // overlong '/'
  EXPECT_EQ(ParseError("listen: \xed\xa0\x80"), "line 1, column 9: invalid UTF-8 (byte 0xed)");  // a surrogate
  EXPECT_EQ(ParseError("listen: \xe2\x82"), "line 1, column 9: invalid UTF-8 (byte 0xe2)");      // cut short
  EXPECT_EQ(ParseError("listen: \xc2\x80"), "line 1, column 9: control character U+0080 is not allowed in YAML text");
  // Escapes in double quotes may write any character; UTF-8, tabs, CR and a byte order mark are fine.
  v1::Config proto;
  EXPECT_EQ(ProtoError("\xef\xbb\xbflisten: \"a\\x0b\\u00ff\"\r\nkey_policy: {entities:\t[caf\xc3\xa9]}\n", &proto),
            "ok");
  EXPECT_EQ(proto.listen(), "a\x0b\xc3\xbf");
  EXPECT_EQ(proto.key_policy().entities(0), "caf\xc3\xa9");
}

TEST(ConfigLoadTest, EmptyAndCommentOnlyFilesGiveDefaults) {
  for (const char* yaml : {"", "\n", "# nothing\n", "---\n", "~\n", "--- # nothing\n...\n"}) {
    auto c = ParseConfig(yaml);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->listen.ToString(), "127.0.0.1:6380") << yaml;
  }
  EXPECT_EQ(ParseError("threads: 1\n---\nthreads: 2\n"),
            "line 2, column 1: a second YAML document; a config file holds one");
  EXPECT_EQ(ParseError("threads: 1\n...\nthreads: 2\n"),
            "line 3, column 1: a second YAML document; a config file holds one");
  // yaml-cpp 0.7 reports endless empty documents at a ',' outside a flow collection (config_fuzz).
  EXPECT_EQ(ParseError(","), "line 1, column 1: unexpected ','");
  EXPECT_EQ(ParseError("- a\n,\n"), "line 2, column 1: unexpected ','");
}

TEST(ConfigLoadTest, TooManyNodesAreRefusedBeforeTheTreeIsBuilt) {
  std::string yaml = "deny_commands: [get";
  for (int i = 1; i < 200001; ++i) yaml += ",get";
  yaml += "]\n";
  EXPECT_EQ(ParseError(yaml), "line 1, column 800005: more than 200000 YAML nodes (scalars, lists, mappings, aliases)");
}

// A scratch directory, removed with everything in it.
class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kg-config-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  static std::string LoadError(const std::string& path) {
    auto c = LoadConfigFile(path);
    return c.ok() ? "ok" : std::string(c.status().message());
  }
  std::string dir_;
};

TEST_F(ConfigFileTest, WhatIsNotARegularReadableFileIsRefused) {
  EXPECT_EQ(LoadError(dir_), dir_ + ": is a directory, not a file");
  EXPECT_EQ(LoadError(dir_ + "/missing.yaml"), dir_ + "/missing.yaml: cannot open: No such file or directory");
  EXPECT_EQ(LoadConfigFile(dir_ + "/missing.yaml").status().code(), absl::StatusCode::kNotFound);
  // Root reads any file whatever its mode, so "unreadable" is a path through a non-directory.
  const std::string file = Write("k.yaml", "threads: 1\n");
  EXPECT_EQ(LoadError(file + "/x.yaml"), file + "/x.yaml: cannot open: Not a directory");
  // A FIFO with no writer: opening it would block forever; it is refused at once.
  const std::string fifo = dir_ + "/fifo.yaml";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(LoadError(fifo), fifo + ": is not a regular file (a FIFO)");
  EXPECT_EQ(LoadError("/dev/zero"), "/dev/zero: is not a regular file (a device)");
  // A symlink to a good file is followed.
  fs::create_symlink(file, dir_ + "/link.yaml");
  EXPECT_EQ(LoadError(dir_ + "/link.yaml"), "ok");
}

TEST_F(ConfigFileTest, SizeLimitIsCheckedBeforeParsing) {
  const std::string big = Write("big.yaml", std::string(10 << 20, '#'));
  EXPECT_EQ(LoadError(big), big + ": is 10485760 bytes; a config file may have at most 4194304 (4 MiB)");
  // Exactly the limit is fine (one comment line), one byte more is not.
  const std::string edge = Write("edge.yaml", "#" + std::string(kMaxConfigFileBytes - 2, 'x') + "\n");
  EXPECT_EQ(LoadError(edge), "ok");
  const std::string over = Write("over.yaml", "#" + std::string(kMaxConfigFileBytes - 1, 'x') + "\n");
  EXPECT_EQ(LoadError(over), over + ": is 4194305 bytes; a config file may have at most 4194304 (4 MiB)");
  EXPECT_EQ(ParseError(std::string(kMaxConfigFileBytes + 1, '#')),
            "the text is 4194305 bytes; a config file may have at most 4194304 (4 MiB)");
}

TEST_F(ConfigFileTest, UsersFileGoesThroughTheSameChecks) {
  const std::string config = "tenancy:\n  users_file: ";
  const std::string bad = Write("users.yaml", "? [a, b]\n: 1\n");
  EXPECT_EQ(ParseError(config + bad),
            "tenancy.users_file: " + bad + ": (top level): a key must be a field name, not a list (line 1, column 3)");
  EXPECT_EQ(ParseError(config + dir_), "tenancy.users_file: " + dir_ + ": is a directory, not a file");
  const std::string dup = Write("dup.yaml", "users:\n  - name: a\n    name: b\n");
  EXPECT_EQ(ParseError(config + dup),
            "tenancy.users_file: " + dup + ": users[0].name: duplicate key (first at line 2)");
  const std::string nul = Write("nul.yaml", std::string("users: []\0", 10));
  EXPECT_EQ(ParseError(config + nul), "tenancy.users_file: " + nul +
                                          ": line 1, column 10: control character 0x00 is not allowed in YAML text (in "
                                          "a double-quoted string write it as \\x00)");
}

TEST_F(ConfigFileTest, UpstreamPasswordFileGoesThroughTheSameChecks) {
  const std::string config = "upstream_auth:\n  user: keyguard\n  password_file: ";
  const std::string fifo = dir_ + "/password";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(ParseError(config + fifo), "upstream_auth.password_file: " + fifo + ": is not a regular file (a FIFO)");
  EXPECT_EQ(ParseError(config + "/dev/zero"),
            "upstream_auth.password_file: /dev/zero: is not a regular file (a device)");
  EXPECT_EQ(ParseError(config + dir_), "upstream_auth.password_file: " + dir_ + ": is a directory, not a file");
  const std::string empty = Write("empty", "\n");
  EXPECT_EQ(ParseError(config + empty), "upstream_auth.password_file: " + empty + " is empty");
  auto c = ParseConfig(config + Write("pw", "s3cret\n"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->upstream_auth.user, "keyguard");
  EXPECT_EQ(c->upstream_auth.password, "s3cret");
}

// ParseUpstream: every accepted form, and the errors, with the field named.
TEST(Upstream, ParsesEveryForm) {
  struct Case {
    const char* text;
    Upstream::Kind kind;
    bool tls;
    const char* address;  // kDirect
    const char* user;
    const char* master;
    std::vector<std::string> sentinels;
    const char* canonical;
  } cases[] = {
      {"10.0.0.1:6379", Upstream::Kind::kDirect, false, "10.0.0.1:6379", "", "", {}, "10.0.0.1:6379"},
      {"[::1]:7000", Upstream::Kind::kDirect, false, "[::1]:7000", "", "", {}, "[::1]:7000"},
      {"redis://db.internal:6379", Upstream::Kind::kDirect, false, "db.internal:6379", "", "", {}, "db.internal:6379"},
      {"redis://app@db.internal:6379",
       Upstream::Kind::kDirect,
       false,
       "db.internal:6379",
       "app",
       "",
       {},
       "redis://app@db.internal:6379"},
      {"rediss://cache.example.com:6380",
       Upstream::Kind::kDirect,
       true,
       "cache.example.com:6380",
       "",
       "",
       {},
       "rediss://cache.example.com:6380"},
      {"rediss://svc@[::1]:6380",
       Upstream::Kind::kDirect,
       true,
       "[::1]:6380",
       "svc",
       "",
       {},
       "rediss://svc@[::1]:6380"},
      {"redis-sentinel://mymaster@s1:26379,s2:26380,[::1]:26381",
       Upstream::Kind::kSentinel,
       false,
       "127.0.0.1:6379",
       "",
       "mymaster",
       {"s1:26379", "s2:26380", "[::1]:26381"},
       "redis-sentinel://mymaster@s1:26379,s2:26380,[::1]:26381"},
      {"rediss-sentinel://m@s1:26379",
       Upstream::Kind::kSentinel,
       true,
       "127.0.0.1:6379",
       "",
       "m",
       {"s1:26379"},
       "rediss-sentinel://m@s1:26379"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    auto u = ParseUpstream(c.text, "upstream");
    ASSERT_TRUE(u.ok()) << u.status();
    EXPECT_EQ(u->kind, c.kind);
    EXPECT_EQ(u->tls, c.tls);
    EXPECT_EQ(u->address.ToString(), c.address);
    EXPECT_EQ(u->user, c.user);
    EXPECT_EQ(u->master, c.master);
    std::vector<std::string> sentinels;
    for (const HostPort& s : u->sentinels) sentinels.push_back(s.ToString());
    EXPECT_EQ(sentinels, c.sentinels);
    EXPECT_EQ(u->ToString(), c.canonical);
  }
}

TEST(Upstream, ErrorsNameTheFieldAndNeverEchoAPassword) {
  struct Case {
    const char* text;
    const char* error;
  } cases[] = {
      {"localhost", "--upstream: 'localhost' is not HOST:PORT"},
      {"http://h:1",
       "--upstream: unknown scheme 'http://' (use HOST:PORT, redis://, rediss://, redis-sentinel:// or "
       "rediss-sentinel://)"},
      {"redis://app:hunter2@h:6379",
       "--upstream: a password in the URL is refused: put it in the file named by upstream_auth.password_file (or "
       "sentinel.password_file for the Sentinels)"},
      {"rediss://:hunter2@h:6379",
       "--upstream: a password in the URL is refused: put it in the file named by upstream_auth.password_file (or "
       "sentinel.password_file for the Sentinels)"},
      {"redis-sentinel://m:hunter2@s:1",
       "--upstream: a password in the URL is refused: put it in the file named by upstream_auth.password_file (or "
       "sentinel.password_file for the Sentinels)"},
      {"redis://@h:1", "--upstream: 'redis://@h:1': empty user before '@'"},
      {"redis://h:6379/0",
       "--upstream: 'redis://h:6379/0': nothing may follow HOST:PORT (no database, no options: they belong in the "
       "config file)"},
      {"rediss://h", "--upstream: 'h' is not HOST:PORT"},
      {"redis-sentinel://s1:26379",
       "--upstream: 'redis-sentinel://s1:26379' names no master: "
       "redis-sentinel://MASTER@HOST:PORT[,HOST:PORT...]"},
      {"redis-sentinel://m@s1:26379,,s2:1", "--upstream (Sentinel 2): '' is not HOST:PORT"},
      {"redis-sentinel://m@s1:26379,s2:99999",
       "--upstream (Sentinel 2): 's2:99999' is not HOST:PORT with a port in 0..65535"},
  };
  for (const Case& c : cases) {
    auto u = ParseUpstream(c.text, "--upstream");
    ASSERT_FALSE(u.ok()) << c.text;
    EXPECT_EQ(u.status().message(), c.error) << c.text;
    EXPECT_EQ(std::string(u.status().message()).find("hunter2"), std::string::npos);
  }
}

TEST(Upstream, TlsAndSentinelSettingsAreCheckedAgainstTheUpstream) {
  EXPECT_EQ(ParseError("upstream: h:1\nupstream_tls: {ca_file: /ca.pem}\n"),
            "upstream_tls: set, but upstream 'h:1' is not TLS (rediss:// or rediss-sentinel://)");
  EXPECT_EQ(ParseError("upstream: rediss://h:1\nupstream_tls: {min_version: '1.1'}\n"),
            "upstream_tls.min_version: '1.1' is not \"1.2\" or \"1.3\"");
  EXPECT_EQ(ParseError("upstream: rediss://h:1\nupstream_tls: {cert_file: /c.pem}\n"),
            "upstream_tls.key_file: cert_file and key_file go together (a certificate needs its key)");
  EXPECT_EQ(ParseError("upstream: rediss://h:1\nupstream_tls: {key_file: /k.pem}\n"),
            "upstream_tls.cert_file: cert_file and key_file go together (a certificate needs its key)");
  EXPECT_EQ(ParseError("upstream: h:1\nsentinel: {user: u}\n"), "sentinel.user: given without sentinel.password_file");
  EXPECT_EQ(ParseError("upstream: redis://app@h:1\n"),
            "upstream: names user 'app' but no password is set: upstream_auth.password_file");

  auto c = ParseConfig(R"(
upstream: rediss://redis.example:6380
upstream_tls:
  ca_file: /etc/keyguard/ca.pem
  cert_file: /etc/keyguard/client.pem
  key_file: /etc/keyguard/client.key
  server_name: redis.internal
  min_version: "1.3"
  ciphers: ECDHE+AESGCM
)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->upstream.tls);
  EXPECT_EQ(c->upstream_tls.ca_file, "/etc/keyguard/ca.pem");
  EXPECT_EQ(c->upstream_tls.server_name, "redis.internal");
  EXPECT_EQ(c->upstream_tls.min_version, "1.3");
  EXPECT_TRUE(c->upstream_tls.verify);
  const std::string described = DescribeConfig(*c);
  EXPECT_NE(described.find("upstream: rediss://redis.example:6380\n"), std::string::npos) << described;
  EXPECT_NE(described.find("upstream_tls:\n  ca: /etc/keyguard/ca.pem\n  client_certificate: "
                           "/etc/keyguard/client.pem (key /etc/keyguard/client.key)\n  server_name: redis.internal\n"
                           "  verify: on\n  min_version: 1.3\n  ciphers: ECDHE+AESGCM\n  ciphersuites: default\n"),
            std::string::npos)
      << described;
}

TEST_F(ConfigFileTest, UrlUserAndSentinelPasswordFile) {
  const std::string pw = Write("pw", "s3cret\n");
  auto c = ParseConfig("upstream: redis://app@h:1\nupstream_auth: {password_file: " + pw + "}\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->UpstreamUser(), "app");
  EXPECT_EQ(c->upstream_auth.password, "s3cret");
  EXPECT_EQ(ParseError("upstream: redis://app@h:1\nupstream_auth: {user: other, password_file: " + pw + "}\n"),
            "upstream_auth.user: 'other' differs from the user 'app' in upstream");

  const std::string sentinel_pw = Write("sentinel-pw", "hunter2\n");
  c = ParseConfig(
      "upstream: redis-sentinel://mymaster@127.0.0.1:26379,127.0.0.1:26380\nsentinel: {user: watcher, "
      "password_file: " +
      sentinel_pw + "}\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sentinel.user, "watcher");
  EXPECT_EQ(c->sentinel.password, "hunter2");
  const std::string described = DescribeConfig(*c);
  EXPECT_NE(
      described.find("sentinel:\n  master: mymaster\n  sentinels: 2\n  auth: user watcher (" + sentinel_pw + ")\n"),
      std::string::npos)
      << described;
  EXPECT_EQ(described.find("hunter2"), std::string::npos);
  EXPECT_EQ(described.find("s3cret"), std::string::npos);
  EXPECT_EQ(ParseError("upstream: redis-sentinel://m@h:1\nsentinel: {password_file: " + Write("e", "\n") + "}\n"),
            "sentinel.password_file: " + dir_ + "/e is empty");
}

// What ConfigStore logs for a failed reload: one JSON line on stderr.
nlohmann::json ReloadFailureLine(ConfigStore& store) {
  testing::internal::CaptureStderr();
  (void)store.Reload("SIGHUP");
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_EQ(out.back(), '\n');
  EXPECT_EQ(out.find('\n'), out.size() - 1) << out;
  return nlohmann::json::parse(out);
}

TEST_F(ConfigFileTest, FailedReloadKeepsTheConfigCountsAndLogsJson) {
  const std::string path = Write("k.yaml", "key_policy: {default_action: reject}\n");
  auto initial = LoadConfigFile(path);
  ASSERT_TRUE(initial.ok()) << initial.status();
  ConfigStore store(std::make_shared<ProxyConfig>(*initial), path);
  const auto before = store.Current();
  Write("k.yaml", "? [a, b]\n: 1\n");
  nlohmann::json line = ReloadFailureLine(store);
  EXPECT_EQ(line, nlohmann::json::parse(
                      R"j({"level":"error","event":"config_reload_failed","trigger":"SIGHUP","version":1,)j"
                      R"j("error":")j" +
                      path + R"j(: (top level): a key must be a field name, not a list (line 1, column 3)"})j"));
  EXPECT_EQ(store.failures(), 1u);
  EXPECT_EQ(store.version(), 1u);
  EXPECT_EQ(store.Current(), before);
  // Control characters, quotes, backslashes in the message: still one JSON line, and the bytes
  // come back exactly (each byte is one code point).
  Write("k.yaml", "key_policy: {default_action: \"a\\x0b\\\"\\\\\\u00ff\"}\n");
  line = ReloadFailureLine(store);
  const std::string error = line["error"];
  std::string bytes;
  for (size_t i = 0; i < error.size();) {  // UTF-8 of U+0000..U+00FF back to bytes
    const unsigned char c = error[i];
    bytes.push_back(c < 0x80 ? static_cast<char>(c) : static_cast<char>(((c & 0x03) << 6) | (error[i + 1] & 0x3f)));
    i += c < 0x80 ? 1 : 2;
  }
  EXPECT_EQ(bytes,
            path + ": key_policy.default_action: 'a\x0b\"\\\xc3\xbf' is not one of observe, warn, rewrite, reject");
  EXPECT_EQ(store.failures(), 2u);
  EXPECT_EQ(store.Current(), before);
}

TEST_F(ConfigFileTest, ConfigMapSymlinkSwapIsPickedUpAndABadOneKept) {
  // What the kubelet does: <dir>/keyguard.yaml -> ..data/keyguard.yaml, ..data -> ..<timestamp>,
  // and an update writes a new timestamped directory and renames a new ..data link over the old.
  const auto version_dir = [&](const std::string& name, const std::string& text) {
    fs::create_directory(dir_ + "/" + name);
    Write(name + "/keyguard.yaml", text);
  };
  const auto swap_to = [&](const std::string& name) {
    fs::create_symlink(name, dir_ + "/..data_tmp");
    fs::rename(dir_ + "/..data_tmp", dir_ + "/..data");
  };
  version_dir("..v1", "deny_commands: [flushall]\n");
  fs::create_symlink("..v1", dir_ + "/..data");
  fs::create_symlink("..data/keyguard.yaml", dir_ + "/keyguard.yaml");
  const std::string path = dir_ + "/keyguard.yaml";
  auto initial = LoadConfigFile(path);
  ASSERT_TRUE(initial.ok()) << initial.status();
  ConfigStore store(std::make_shared<ProxyConfig>(*initial), path);
  store.PollFile();
  EXPECT_EQ(store.reloads(), 0u);
  // The same size and text in a new directory: a new inode all the same.
  version_dir("..v2", "deny_commands: [flushdb]\n");
  testing::internal::CaptureStderr();
  swap_to("..v2");
  store.PollFile();
  EXPECT_EQ(nlohmann::json::parse(testing::internal::GetCapturedStderr()),
            nlohmann::json::parse(R"({"level":"info","event":"config_reloaded","trigger":"file change","version":2})"));
  EXPECT_EQ(store.reloads(), 1u);
  EXPECT_EQ(store.version(), 2u);
  EXPECT_EQ(store.Current()->deny_commands, std::vector<std::string>{"flushdb"});
  version_dir("..v3", "deny_commands: [flushdb]\ndeny_commands: [get]\n");
  testing::internal::CaptureStderr();
  swap_to("..v3");
  store.PollFile();
  EXPECT_EQ(nlohmann::json::parse(testing::internal::GetCapturedStderr())["error"],
            path + ": deny_commands: duplicate key (first at line 1)");
  EXPECT_EQ(store.failures(), 1u);
  EXPECT_EQ(store.version(), 2u);
  EXPECT_EQ(store.Current()->deny_commands, std::vector<std::string>{"flushdb"});
}

}  // namespace
}  // namespace keyguard::config
