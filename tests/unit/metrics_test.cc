#include "keyguard/metrics/registry.h"

#include <gtest/gtest.h>

namespace keyguard::metrics {
namespace {

TEST(Registry, SumsShardsAndRendersExposition) {
  Registry registry;
  WorkerShard* a = registry.AddShard();
  WorkerShard* b = registry.AddShard();
  const auto get = commands::LookupCommand("GET");
  a->CountCommand(get, Outcome::kOk);
  b->CountCommand(get, Outcome::kOk);
  b->CountCommand(get, Outcome::kError);
  a->ObserveLatency(get, 80'000);     // 80 us: bucket le=0.0001
  b->ObserveLatency(get, 3'000'000);  // 3 ms: bucket le=0.005
  a->client_connections.Add(2);
  b->client_connections.Add(1);
  a->client_connections.Add(-1);
  b->CountUpstreamError(UpstreamError::kClosed);
  const std::string text = registry.Render();
  auto has = [&](const std::string& line) { return text.find("\n" + line + "\n") != std::string::npos; };
  EXPECT_TRUE(has("keyguard_commands_total{command=\"get\",outcome=\"ok\"} 2")) << text;
  EXPECT_TRUE(has("keyguard_commands_total{command=\"get\",outcome=\"error\"} 1"));
  EXPECT_TRUE(has("keyguard_client_connections 2"));
  EXPECT_TRUE(has("keyguard_upstream_errors_total{reason=\"closed\"} 1"));
  EXPECT_TRUE(has("keyguard_upstream_errors_total{reason=\"connect\"} 0"));
  EXPECT_TRUE(has("keyguard_command_duration_seconds_bucket{command=\"get\",le=\"5e-05\"} 0"));
  EXPECT_TRUE(has("keyguard_command_duration_seconds_bucket{command=\"get\",le=\"0.0001\"} 1"));
  EXPECT_TRUE(has("keyguard_command_duration_seconds_bucket{command=\"get\",le=\"0.0025\"} 1"));
  EXPECT_TRUE(has("keyguard_command_duration_seconds_bucket{command=\"get\",le=\"0.005\"} 2"));
  EXPECT_TRUE(has("keyguard_command_duration_seconds_bucket{command=\"get\",le=\"+Inf\"} 2"));
  EXPECT_TRUE(has("keyguard_command_duration_seconds_count{command=\"get\"} 2"));
  EXPECT_TRUE(has("keyguard_command_duration_seconds_sum{command=\"get\"} 0.00308"));
  EXPECT_EQ(text.find("command=\"set\""), std::string::npos);  // no series for unused commands
}

TEST(Registry, RendersReplySizeHistogramsForCommandsSeen) {
  Registry registry;
  WorkerShard* a = registry.AddShard();
  WorkerShard* b = registry.AddShard();
  const auto get = commands::LookupCommand("get");
  const auto hgetall = commands::LookupCommand("hgetall");
  a->ObserveReply(get, 107, -1);
  b->ObserveReply(get, 64, -1);
  b->ObserveReply(get, 20'000'000, -1);  // over every bound
  a->ObserveReply(hgetall, 90'000, 12000);
  const std::string text = registry.Render();
  auto has = [&](const std::string& line) { return text.find("\n" + line + "\n") != std::string::npos; };
  EXPECT_TRUE(has("# TYPE keyguard_reply_bytes histogram")) << text;
  EXPECT_TRUE(has("keyguard_reply_bytes_bucket{command=\"get\",le=\"64\"} 1"));
  EXPECT_TRUE(has("keyguard_reply_bytes_bucket{command=\"get\",le=\"256\"} 2"));
  EXPECT_TRUE(has("keyguard_reply_bytes_bucket{command=\"get\",le=\"16777216\"} 2"));
  EXPECT_TRUE(has("keyguard_reply_bytes_bucket{command=\"get\",le=\"+Inf\"} 3"));
  EXPECT_TRUE(has("keyguard_reply_bytes_sum{command=\"get\"} 20000171"));
  EXPECT_TRUE(has("keyguard_reply_bytes_count{command=\"get\"} 3"));
  EXPECT_TRUE(has("keyguard_reply_bytes_bucket{command=\"hgetall\",le=\"65536\"} 0"));
  EXPECT_TRUE(has("keyguard_reply_bytes_bucket{command=\"hgetall\",le=\"262144\"} 1"));
  EXPECT_TRUE(has("keyguard_reply_elements_bucket{command=\"hgetall\",le=\"10000\"} 0"));
  EXPECT_TRUE(has("keyguard_reply_elements_bucket{command=\"hgetall\",le=\"100000\"} 1"));
  EXPECT_TRUE(has("keyguard_reply_elements_bucket{command=\"hgetall\",le=\"1000000\"} 1"));
  EXPECT_TRUE(has("keyguard_reply_elements_sum{command=\"hgetall\"} 12000"));
  EXPECT_EQ(text.find("keyguard_reply_elements_count{command=\"get\"}"), std::string::npos);  // scalars only
  EXPECT_EQ(text.find("command=\"set\""), std::string::npos);
}

TEST(CommandTable, LookupIsCaseInsensitiveAndBounded) {
  EXPECT_NE(commands::LookupCommand("get"), commands::kUnknownCommand);
  EXPECT_EQ(commands::LookupCommand("GeT"), commands::LookupCommand("get"));
  EXPECT_EQ(commands::CommandName(commands::LookupCommand("FLUSHALL")), "flushall");
  EXPECT_EQ(commands::LookupCommand("nosuchcommand"), commands::kUnknownCommand);
  EXPECT_EQ(commands::LookupCommand(std::string(200, 'a')), commands::kUnknownCommand);
  EXPECT_EQ(commands::CommandName(commands::kUnknownCommand), "unknown");
}

}  // namespace
}  // namespace keyguard::metrics
