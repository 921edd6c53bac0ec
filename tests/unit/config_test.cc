#include "keyguard/config/config.h"

#include <gtest/gtest.h>

namespace keyguard::config {
namespace {

TEST(Config, EmptyDocumentGivesDefaults) {
  auto c = ParseConfig("");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen.ToString(), "127.0.0.1:6380");
  EXPECT_EQ(c->upstream.ToString(), "127.0.0.1:6379");
  EXPECT_EQ(c->limits.max_bulk_len, 512LL * 1024 * 1024);
  EXPECT_EQ(c->limits.max_inline_len, 64u * 1024);
}

TEST(Config, ParsesEverySetting) {
  auto c = ParseConfig(R"(
listen: 0.0.0.0:7000
upstream: "[::1]:6379"
admin: 127.0.0.1:9999
threads: 3
upstream_connect_timeout_ms: 500
drain_timeout_ms: 100
deny_commands: [FLUSHALL, flushdb]
limits:
  max_bulk_len: 1024
  max_multibulk_len: 10
  max_inline_len: 100
  max_depth: 8                  # ignored, still accepted
  max_pending_commands: 5
  max_output_buffer: 8192
  read_buffer_size: 1024
)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen.ToString(), "0.0.0.0:7000");
  EXPECT_EQ(c->upstream.host, "::1");
  EXPECT_EQ(c->upstream.ToString(), "[::1]:6379");
  EXPECT_EQ(c->threads, 3);
  EXPECT_EQ(c->deny_commands, (std::vector<std::string>{"flushall", "flushdb"}));
  EXPECT_EQ(c->limits.max_bulk_len, 1024);
  EXPECT_EQ(c->max_pending_commands, 5);
  EXPECT_EQ(c->read_buffer_size, 1024);
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
      {"upstream: localhost", "upstream: 'localhost' is not HOST:PORT"},
      {"upstream: host:99999", "upstream: 'host:99999' is not HOST:PORT with a port in 0..65535"},
      {"deny_commands: [FLUSHALL, NOPE]", "deny_commands[1]: 'NOPE' is not a Redis command"},
      {"deny_commands: FLUSHALL", "deny_commands: expected a list"},
      {"key_policy:\n  rules:\n    - name: a\n      pattern: \"(x\"", "key_policy.rules[0].pattern: missing )"},
      {"key_policy:\n  lowercase: {action: rejekt}", "key_policy.lowercase.action: 'rejekt' is not one of observe, warn, rewrite, reject"},
      {"key_policy:\n  charset: {scope: {categories: [nope]}}", "key_policy.charset.scope.categories[0]: 'nope' is neither"},
      {"listen: [a", "line 1, column"},
      {"listen: 127.0.0.1:7000\nadmin: 127.0.0.1:7000", "admin: must differ from listen"},
  };
  for (const Case& c : cases) {
    auto r = ParseConfig(c.yaml);
    ASSERT_FALSE(r.ok()) << c.yaml;
    EXPECT_EQ(std::string(r.status().message()).rfind(c.error, 0), 0u) << r.status().message();
  }
}

}  // namespace
}  // namespace keyguard::config
