// `keyguard audit`: walks a live Redis with SCAN, inspects every key with pipelined read-only
// commands at a capped rate, and reports what breaks the key policy and the hygiene thresholds.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "keyguard/hygiene/serialized.h"
#include "keyguard/hygiene/sizes.h"
#include "keyguard/maintenance/maintenance.h"
#include "maintenance/args.h"
#include "maintenance/audit_report.h"
#include "maintenance/redis_link.h"
#include "maintenance/terminal.h"
#include "proxy/cluster_map.h"

namespace keyguard::maintenance {
namespace {

int Fail(const std::string& message) { return UsageError("keyguard audit", message); }

int64_t IntOr(const Reply& r, int64_t fallback) { return r.kind == Reply::Kind::kInteger ? r.integer : fallback; }

// Samples by a hash of the key, so a resumed or repeated run looks at the same keys.
bool Sampled(const std::string& key, double fraction) {
  if (fraction >= 1.0) return true;
  return static_cast<double>(hygiene::Fingerprint(key) % 1000000) < fraction * 1000000;
}

constexpr int kTailBytes = 16;

}  // namespace

const char kAuditUsage[] =
    "usage: keyguard audit [--config FILE] [--upstream URL] [--db N] [--format table|json|prom]\n"
    "                      [--match GLOB] [--count N] [--rate OPS] [--pause-ms MS] [--sample FRACTION]\n"
    "                      [--max-keys N] [--cursor C] [--cold-after SECONDS] [--top N]\n"
    "                      [--fail-on info|warning|critical|never] [--no-progress]\n"
    "  Walks the keyspace with SCAN (never KEYS) and reports, by key pattern: names breaking the key\n"
    "  policy with the suggested name, big keys, keys without TTL and their memory, cold keys,\n"
    "  strings holding serialized objects, memory per pattern and type, and the top keys by memory.\n"
    "  --rate caps commands per second (default audit.max_ops_per_second, 10000; 0: no cap).\n"
    "  --sample looks at a fraction of the keys; --max-keys stops after about N keys and prints the\n"
    "  cursor to resume from (as does Ctrl-C). Exit 1 when a finding reaches --fail-on.\n"
    "  --upstream: HOST:PORT, redis[s]://[USER@]HOST:PORT, redis[s]-sentinel://MASTER@H:P,... (the\n"
    "  primary) or redis[s]-cluster://SEED,... (walked primary after primary); rediss uses the config's\n"
    "  upstream_tls. AUTH: $REDISCLI_AUTH, else the config's upstream_auth.\n";

int RunAudit(const std::vector<std::string>& argv) {
  auto parsed = ParseArgs(argv,
                          {"--config", "--upstream", "--db", "--format", "--match", "--count", "--rate", "--pause-ms",
                           "--sample", "--max-keys", "--cursor", "--cold-after", "--top", "--fail-on"},
                          {"--no-progress", "--help"});
  if (!parsed.ok()) return Fail(absl::StrCat(parsed.status().message(), "\n", kAuditUsage));
  const Args& args = *parsed;
  if (args.Has("--help")) {
    std::fputs(kAuditUsage, stdout);
    return 0;
  }
  if (!args.positional.empty())
    return Fail(absl::StrCat("unexpected argument '", args.positional[0], "'\n", kAuditUsage));
  auto loaded = LoadMaintenanceConfig(args.Str("--config"));
  if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
  MaintenanceConfig& cfg = *loaded;
  AuditSettings& s = cfg.audit;
  if (args.Has("--upstream")) {
    auto u = config::ParseUpstream(args.Str("--upstream"), "--upstream");
    if (!u.ok()) return Fail(std::string(u.status().message()));
    cfg.proxy.upstream = *u;
  }
  const std::string format = args.Str("--format", "table");
  if (format != "table" && format != "json" && format != "prom") return Fail("--format: expected table, json or prom");
  auto db = args.Int("--db", 0, 0, 1 << 20);
  auto count = args.Int("--count", s.scan_count, 1, 100000);
  auto rate = args.Int("--rate", s.max_ops_per_second, 0, 100000000);
  auto pause = args.Int("--pause-ms", s.pause_ms, 0, 3600000);
  auto sample = args.Double("--sample", 1.0, 1e-6, 1.0);
  auto max_keys = args.Int("--max-keys", 0, 0, INT64_MAX);
  auto cold = args.Int("--cold-after", static_cast<int64_t>(s.cold_after_seconds), 0, INT64_MAX);
  auto top = args.Int("--top", s.top_keys, 0, 10000);
  for (const absl::Status& st : {db.status(), count.status(), rate.status(), pause.status(), sample.status(),
                                 max_keys.status(), cold.status(), top.status()}) {
    if (!st.ok()) return Fail(std::string(st.message()));
  }
  s.scan_count = static_cast<uint32_t>(*count);
  s.cold_after_seconds = static_cast<uint64_t>(*cold);
  s.top_keys = static_cast<uint32_t>(*top);
  if (args.Has("--fail-on")) {
    auto f = ParseSeverity(args.Str("--fail-on"));
    if (!f) return Fail("--fail-on: expected info, warning, critical or never");
    s.fail_on = *f;
  }
  auto [cursor, cursor_tag] = SplitCursor(args.Str("--cursor", "0"));  // a cluster's: NUMBER-TAG
  if (cursor.empty() || !std::all_of(cursor.begin(), cursor.end(), absl::ascii_isdigit))
    return Fail("--cursor: expected a SCAN cursor");

  // One link per primary of a Redis Cluster (walked one after the other; the resume cursor names
  // the node as keyguard's SCAN does), else one.
  std::vector<std::unique_ptr<RedisLink>> links;
  const bool cluster = cfg.proxy.upstream.kind == config::Upstream::Kind::kCluster;
  if (cluster && *db != 0) return Fail("--db: a Redis Cluster has database 0 only");
  auto upstream = UpstreamLinks::Create(cfg.proxy);
  if (!upstream.ok()) return Fail(std::string(upstream.status().message()));
  size_t node = 0;
  std::vector<config::HostPort> primaries;  // a cluster's, as walked
  if (cluster) {
    auto layout = upstream->ClusterSlots();
    if (!layout.ok()) return Fail(std::string(layout.status().message()));
    primaries = layout->primaries;
    for (const config::HostPort& p : primaries) {
      auto l = upstream->ConnectNode(p, 0);
      if (!l.ok()) return Fail(std::string(l.status().message()));
      links.push_back(*std::move(l));
    }
    auto c = proxy::cluster::DecodeScanCursor(cursor);
    if (!c.has_value() || c->node >= static_cast<int>(links.size()))
      return Fail("--cursor: not a cursor of this cluster");
    if (std::string stale = StaleCursor(cursor, cursor_tag, primaries); !stale.empty()) return Fail(stale);
    node = static_cast<size_t>(c->node);
    cursor = c->node_cursor;
  } else if (!cursor_tag.empty()) {
    return Fail("--cursor: expected a SCAN cursor");
  } else {
    auto link_or = upstream->Connect(static_cast<int>(*db));
    if (!link_or.ok()) return Fail(std::string(link_or.status().message()));
    links.push_back(*std::move(link_or));
  }
  RedisLink* link = links[node].get();

  AuditReport report(cfg.proxy, s);
  ScanInfo& info = report.scan();
  info.upstream = cfg.proxy.upstream.ToString();
  // A Sentinel group: the primary its Sentinels named (and whose ROLE said master).
  if (cfg.proxy.upstream.kind == config::Upstream::Kind::kSentinel) {
    absl::StrAppend(&info.upstream, " primary ", link->address());
  }
  info.db = static_cast<int>(*db);
  info.sample = *sample;
  info.start_cursor = cursor;
  // Under an LFU policy OBJECT IDLETIME is an error and OBJECT FREQ is the access measure.
  if (auto policy = link->Call({"CONFIG", "GET", "maxmemory-policy"});
      policy.ok() && policy->elements.size() == 2 && policy->elements[1].str.find("lfu") != std::string::npos) {
    info.lfu = true;
  }
  info.dbsize = 0;
  for (auto& l : links) {
    if (auto size = l->Call({"DBSIZE"}); size.ok() && info.dbsize >= 0) info.dbsize += IntOr(*size, -1);
    // Redis 7.2+: the audit's reads leave access times (and so LRU/LFU eviction) alone. Older
    // servers answer with an error, ignored; there OBJECT IDLETIME is read before any value.
    (void)l->Call({"CLIENT", "NO-TOUCH", "ON"});
  }

  CatchStopSignals();
  Progress progress(
      isatty(STDERR_FILENO) && !args.Has("--no-progress") ? Progress::Mode::kTerminal : Progress::Mode::kOff, "",
      info.dbsize);
  Pacer pacer(static_cast<uint32_t>(*rate));
  const auto start = std::chrono::steady_clock::now();
  const std::string match = args.Str("--match");
  const std::string samples = absl::StrCat(s.memory_samples);
  const std::string prefix_end = absl::StrCat(static_cast<int64_t>(s.value_prefix_bytes) - 1);
  const std::string tail_start = absl::StrCat(-kTailBytes);
  std::vector<Command> round;
  for (;;) {
    Command scan = {"SCAN", cursor};
    if (!match.empty()) scan.insert(scan.end(), {"MATCH", match});
    scan.insert(scan.end(), {"COUNT", absl::StrCat(s.scan_count)});
    pacer.Before(1);
    auto page = link->Call(scan);
    if (!page.ok()) return Fail(std::string(page.status().message()));
    if (page->kind != Reply::Kind::kArray || page->elements.size() != 2) {
      return Fail(absl::StrCat("SCAN: unexpected reply ", page->str));
    }
    ++info.commands;
    const std::string next = page->elements[0].str;
    std::vector<KeyRecord> records;
    for (Reply& k : page->elements[1].elements) {
      ++info.scanned;
      if (Sampled(k.str, *sample)) records.push_back(KeyRecord{.key = std::move(k.str)});
    }
    // Round one: what every key has. OBJECT IDLETIME comes before anything that reads the value
    // (STRLEN, GETRANGE update the key's access time on Redis < 7.2).
    round.clear();
    for (const KeyRecord& r : records) {
      round.push_back({"TYPE", r.key});
      round.push_back({"PTTL", r.key});
      round.push_back({"MEMORY", "USAGE", r.key, "SAMPLES", samples});
      round.push_back({"OBJECT", info.lfu ? "FREQ" : "IDLETIME", r.key});
    }
    if (!round.empty()) {
      pacer.Before(round.size());
      auto replies = link->Pipeline(round);
      if (!replies.ok()) return Fail(std::string(replies.status().message()));
      info.commands += round.size();
      for (size_t i = 0; i < records.size(); ++i) {
        KeyRecord& r = records[i];
        r.type = (*replies)[4 * i].str;
        r.pttl_ms = IntOr((*replies)[4 * i + 1], -1);
        r.memory = IntOr((*replies)[4 * i + 2], -1);
        (info.lfu ? r.lfu_freq : r.idle_seconds) = IntOr((*replies)[4 * i + 3], -1);
      }
      // Round two: the size per type, and the head and tail of strings.
      round.clear();
      std::vector<std::pair<size_t, int>> slots;  // record index, replies it has
      for (size_t i = 0; i < records.size(); ++i) {
        const KeyRecord& r = records[i];
        const char* size = hygiene::SizeCommand(r.type);
        if (size == nullptr) continue;
        round.push_back({size, r.key});
        if (r.type == "string") {
          round.push_back({"GETRANGE", r.key, "0", prefix_end});
          round.push_back({"GETRANGE", r.key, tail_start, "-1"});
        }
        slots.emplace_back(i, r.type == "string" ? 3 : 1);
      }
      if (!round.empty()) {
        pacer.Before(round.size());
        auto sizes = link->Pipeline(round);
        if (!sizes.ok()) return Fail(std::string(sizes.status().message()));
        info.commands += round.size();
        size_t at = 0;
        for (auto [i, n] : slots) {
          KeyRecord& r = records[i];
          r.size = IntOr((*sizes)[at], -1);
          if (n == 3) {
            r.head = std::move((*sizes)[at + 1].str);
            if (r.size > static_cast<int64_t>(r.head.size())) r.tail = std::move((*sizes)[at + 2].str);
          }
          at += n;
        }
      }
      for (const KeyRecord& r : records) {
        if (r.type == "none") continue;  // deleted or expired since SCAN returned it
        ++info.sampled;
        report.Add(r);
      }
    }
    cursor = next;
    if (cursor == "0" && node + 1 < links.size()) {
      link = links[++node].get();  // the next primary, from its start
    } else if (cursor == "0") {
      info.complete = true;
      break;
    }
    if ((*max_keys > 0 && info.scanned >= static_cast<uint64_t>(*max_keys)) || StopRequested()) break;
    progress.Show(info.scanned);
    if (*pause > 0) std::this_thread::sleep_for(std::chrono::milliseconds(*pause));
  }
  progress.Done();
  if (cluster && !info.complete) {
    // The node's own cursor with the node in it ("0": that node from its start).
    const int n = static_cast<int>(links.size());
    cursor = cursor != "0" ? proxy::cluster::EncodeScanCursor(cursor, static_cast<int>(node), n)
             : node == 0   ? std::string("0")
                           : proxy::cluster::EncodeScanCursor("0", static_cast<int>(node) - 1, n);
    if (cursor != "0") absl::StrAppend(&cursor, "-", LayoutTag(primaries));
  }
  info.cursor = cursor;
  info.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string out = format == "json" ? report.Json() : format == "prom" ? report.Prometheus() : report.Table();
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
  if (!info.complete) {
    std::fprintf(stderr, "keyguard audit: stopped after %llu keys; resume with --cursor %s\n",
                 static_cast<unsigned long long>(info.scanned), cursor.c_str());
  }
  return report.Fails(s.fail_on) ? 1 : 0;
}

}  // namespace keyguard::maintenance
