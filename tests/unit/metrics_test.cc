#include "keyguard/metrics/registry.h"

#include <gtest/gtest.h>

#include <set>

#include "keyguard/metrics/families.h"
#include "keyguard/metrics/text_writer.h"

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

// The table: one row per family, valid and unique names, help without the characters HELP lines
// must escape, and the naming conventions promtool checks (counters end in _total, nothing else does).
TEST(FamiliesTest, TableIsWellFormed) {
  auto valid_name = [](std::string_view n) {
    if (n.empty() || (n[0] >= '0' && n[0] <= '9')) return false;
    for (char c : n) {
      if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
    }
    return true;
  };
  std::set<std::string_view> names;
  for (size_t i = 0; i < static_cast<size_t>(FamilyId::kCount); ++i) {
    const Family& f = kFamilies[i];
    SCOPED_TRACE(f.name);
    EXPECT_EQ(static_cast<size_t>(f.id), i);
    EXPECT_EQ(&Of(f.id), &f);
    EXPECT_TRUE(f.name.starts_with("keyguard_"));
    EXPECT_TRUE(valid_name(f.name));
    EXPECT_TRUE(names.insert(f.name).second) << "duplicate family";
    EXPECT_FALSE(f.help.empty());
    EXPECT_EQ(f.help.find_first_of("\\\n"), std::string_view::npos);
    EXPECT_EQ(f.name.ends_with("_total"), f.type == Type::kCounter);
    std::set<std::string_view> labels;
    for (std::string_view l : f.label_names()) {
      EXPECT_TRUE(valid_name(l) && !l.starts_with("__")) << l;
      EXPECT_NE(l, "le");
      EXPECT_TRUE(labels.insert(l).second) << "duplicate label " << l;
    }
    for (size_t k = f.label_count(); k < kMaxLabels; ++k) EXPECT_TRUE(f.labels[k].empty());
  }
  EXPECT_EQ(Of(FamilyId::kKeyViolations).label_count(), 3u);
  EXPECT_EQ(Of(FamilyId::kDraining).label_count(), 0u);
  static_assert(LabeledCounters<FamilyId::kTenantRejected>::kLabels == 2);
}

TEST(TextWriterTest, EscapesLabelValuesByPrometheusRules) {
  EXPECT_EQ(EscapeLabelValue(""), "");
  EXPECT_EQ(EscapeLabelValue("user:{id}:profile"), "user:{id}:profile");
  EXPECT_EQ(EscapeLabelValue("a\"b"), "a\\\"b");
  EXPECT_EQ(EscapeLabelValue("a\\b"), "a\\\\b");
  EXPECT_EQ(EscapeLabelValue("a\nb"), "a\\nb");
  EXPECT_EQ(EscapeLabelValue("\\\"\n"), "\\\\\\\"\\n");
  EXPECT_EQ(EscapeLabelValue("tab\tcr\r"), "tab\tcr\r");  // only the three are escaped
  EXPECT_EQ(EscapeLabelValue(std::string_view("nul\0x", 5)), std::string("nul\0x", 5));
  // Valid UTF-8 passes as it is: 2, 3 and 4 byte sequences.
  EXPECT_EQ(EscapeLabelValue("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x94\x91"), "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x94\x91");
  // Each byte outside valid UTF-8 becomes U+FFFD: stray continuation, bytes never valid, a
  // truncated sequence, an overlong form, a surrogate, a code point over U+10FFFF.
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(EscapeLabelValue("a\x80z"), "a" + r + "z");
  EXPECT_EQ(EscapeLabelValue("\xFF\xFE"), r + r);
  EXPECT_EQ(EscapeLabelValue("x\xE2\x82"), "x" + r + r);
  EXPECT_EQ(EscapeLabelValue("\xC0\xAF"), r + r);
  EXPECT_EQ(EscapeLabelValue("\xED\xA0\x80"), r + r + r);
  EXPECT_EQ(EscapeLabelValue("\xF4\x90\x80\x80"), r + r + r + r);
  EXPECT_EQ(EscapeLabelValue("\xFF\"\n"), r + "\\\"\\n");
}

TEST(TextWriterTest, WritesHeadersSamplesAndHistogramLines) {
  std::string out;
  TextWriter w(&out);
  const Family& violations = Of(FamilyId::kKeyViolations);
  w.Header(violations);
  w.Sample(violations, {"lower\"case", "observe", "a\\b\nc"}, uint64_t{3});
  const Family& draining = Of(FamilyId::kDraining);
  w.Header(draining);
  w.Sample(draining, {}, int64_t{-1});
  const Family& duration = Of(FamilyId::kAuditDuration);
  w.FormattedSample(duration, {}, "1.250");
  const Family& latency = Of(FamilyId::kCommandDuration);
  const std::string_view get[] = {"get"};
  w.Bucket(latency, get, "0.001", 2);
  w.HistogramSum(latency, get, "0.0015");
  w.HistogramCount(latency, get, 2);
  std::string labels;
  AppendLabels(&labels, Of(FamilyId::kTenantRejected).label_names(), std::array<std::string_view, 2>{"a", "tenant"});
  w.RenderedSample(Of(FamilyId::kTenantRejected), labels, 7);
  EXPECT_EQ(out,
            "# HELP keyguard_key_violations_total Keys that broke a key-name rule, by rule, action and key pattern.\n"
            "# TYPE keyguard_key_violations_total counter\n"
            "keyguard_key_violations_total{rule=\"lower\\\"case\",action=\"observe\",key_pattern=\"a\\\\b\\nc\"} 3\n"
            "# HELP keyguard_draining 1 while keyguard drains connections before exiting.\n"
            "# TYPE keyguard_draining gauge\n"
            "keyguard_draining -1\n"
            "keyguard_audit_duration_seconds 1.250\n"
            "keyguard_command_duration_seconds_bucket{command=\"get\",le=\"0.001\"} 2\n"
            "keyguard_command_duration_seconds_sum{command=\"get\"} 0.0015\n"
            "keyguard_command_duration_seconds_count{command=\"get\"} 2\n"
            "keyguard_tenant_rejected_total{tenant=\"a\",reason=\"tenant\"} 7\n");
}

// Handles are stable, values are looked up as values, and a label value that needs escaping is
// escaped once, at the scrape; shards sum into one series.
TEST(Registry, LabeledCountersHandOutStableHandlesAndEscapeAtScrape) {
  Registry registry;
  WorkerShard* a = registry.AddShard();
  WorkerShard* b = registry.AddShard();
  Counter& c = a->key_violations.Get({"r\"1", "observe", "k\\{id}"});
  c.Add();
  for (int i = 0; i < 100; ++i) a->key_violations.Get({"rule" + std::to_string(i), "warn", "p"}).Add();
  EXPECT_EQ(&a->key_violations.Get({"r\"1", "observe", "k\\{id}"}), &c);
  EXPECT_NE(&a->key_violations.Get({"r\"1", "observe", "k"}), &c);
  b->key_violations.Get({"r\"1", "observe", "k\\{id}"}).Add(2);
  b->tenant_commands.Get({"t\n\xFF"}).Add(5);
  const std::string text = registry.Render();
  auto has = [&](const std::string& line) { return text.find("\n" + line + "\n") != std::string::npos; };
  EXPECT_TRUE(has("keyguard_key_violations_total{rule=\"r\\\"1\",action=\"observe\",key_pattern=\"k\\\\{id}\"} 3"))
      << text;
  EXPECT_TRUE(has("keyguard_key_violations_total{rule=\"r\\\"1\",action=\"observe\",key_pattern=\"k\"} 0"));
  EXPECT_TRUE(has("keyguard_key_violations_total{rule=\"rule42\",action=\"warn\",key_pattern=\"p\"} 1"));
  EXPECT_TRUE(has("keyguard_tenant_commands_total{tenant=\"t\\n\xEF\xBF\xBD\"} 5"));
  // Series of a family are ordered by their label text, as before the table.
  EXPECT_LT(text.find("rule=\"rule10\""), text.find("rule=\"rule9\""));
}

TEST(Registry, CollectorsWriteThroughTheWriter) {
  Registry registry;
  registry.AddCollector([](TextWriter& w) {
    w.Header(Of(FamilyId::kConfigVersion));
    w.Sample(Of(FamilyId::kConfigVersion), {}, uint64_t{4});
  });
  const std::string text = registry.Render();
  EXPECT_NE(text.find("# HELP keyguard_config_version Version of the live config, 1 at start-up.\n"
                      "# TYPE keyguard_config_version gauge\nkeyguard_config_version 4\n"),
            std::string::npos)
      << text;
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
