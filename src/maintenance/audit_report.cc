#include "maintenance/audit_report.h"

#include <algorithm>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "keyguard/commands/command_table.h"
#include "keyguard/hygiene/serialized.h"
#include "keyguard/metrics/text_writer.h"
#include "keyguard/policy/key_pattern.h"
#include "maintenance/json_fields.h"
#include "maintenance/terminal.h"

namespace keyguard::maintenance {
namespace {

using JsonValue = nlohmann::ordered_json;

// The command a stored key of `type` is held to the key policy as: the one that writes that
// type, so rule scopes such as `categories: [write]` or `commands: [hset]` apply as in traffic.
commands::CommandId WriterOf(const std::string& type) {
  static const commands::CommandId set = commands::LookupCommand("set"), hset = commands::LookupCommand("hset"),
                                   rpush = commands::LookupCommand("rpush"), sadd = commands::LookupCommand("sadd"),
                                   zadd = commands::LookupCommand("zadd"), xadd = commands::LookupCommand("xadd");
  if (type == "hash") return hset;
  if (type == "list") return rpush;
  if (type == "set") return sadd;
  if (type == "zset") return zadd;
  if (type == "stream") return xadd;
  return set;
}

bool IsCollection(const std::string& type) {
  return type == "hash" || type == "list" || type == "set" || type == "zset" || type == "stream";
}

std::string Bytes(uint64_t n) {
  if (n < 1024) return absl::StrCat(n, " B");
  if (n < 1024 * 1024) return absl::StrFormat("%.1f KiB", n / 1024.0);
  if (n < 1024ull * 1024 * 1024) return absl::StrFormat("%.1f MiB", n / 1048576.0);
  return absl::StrFormat("%.2f GiB", n / 1073741824.0);
}

std::string Duration(int64_t s) {
  if (s >= 86400) return absl::StrFormat("%.1fd", s / 86400.0);
  if (s >= 3600) return absl::StrFormat("%.1fh", s / 3600.0);
  if (s >= 60) return absl::StrFormat("%.1fm", s / 60.0);
  return absl::StrCat(s, "s");
}

double Share(uint64_t part, uint64_t whole) { return whole == 0 ? 0.0 : static_cast<double>(part) / whole; }

// Columns padded to their widest cell; the first row is the header.
class TextTable {
 public:
  void Row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  void AppendTo(std::string* out) const {
    std::vector<size_t> width;
    for (const auto& r : rows_) {
      width.resize(std::max(width.size(), r.size()));
      for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
    }
    for (const auto& r : rows_) {
      std::string line = " ";
      for (size_t i = 0; i < r.size(); ++i) {
        line += " " + r[i];
        if (i + 1 < r.size()) line.append(width[i] - r[i].size(), ' ');
      }
      absl::StrAppend(out, line, "\n");
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::string Dump(const JsonValue& j) { return j.dump(2, ' ', false, JsonValue::error_handler_t::replace) + "\n"; }

}  // namespace

AuditReport::AuditReport(const config::ProxyConfig& proxy, const AuditSettings& settings)
    : proxy_(proxy), settings_(settings) {}

const std::string& AuditReport::PatternOf(const std::string& key) {
  pattern_ = policy::KeyPattern(key);
  // Patterns are bounded like the proxy's metric labels: the rest is "{other}".
  if (!patterns_.count(pattern_) && patterns_.size() >= proxy_.key_policy->max_key_patterns()) pattern_ = "{other}";
  return pattern_;
}

void AuditReport::Note(Group* g, const std::string& pattern, Example e) {
  ++g->keys;
  ++g->by_pattern[pattern];
  if (g->examples.size() < settings_.examples) g->examples.push_back(std::move(e));
}

void AuditReport::Add(const KeyRecord& r) {
  const std::string pattern = PatternOf(r.key);
  const uint64_t memory = r.memory > 0 ? static_cast<uint64_t>(r.memory) : 0;
  memory_ += memory;
  PatternStats& p = patterns_[pattern];
  ++p.keys;
  p.memory += memory;
  TypeStats& t = p.types[r.type];
  ++t.keys;
  t.memory += memory;

  // Naming, per rule, with the policy's suggestion.
  std::vector<policy::Violation> violations;
  const commands::CommandId writer = WriterOf(r.type);
  proxy_.key_policy->Check(r.key, writer, commands::Spec(writer), &violations);
  // One finding per key, under the first rule it breaks (a user rule before the built-in ones, so
  // `User_1_Profile` is counted once, under the rule written for it, not again as `lowercase`).
  if (!violations.empty()) {
    Example e{r.key, violations[0].suggestion, 0, 0, {}};
    for (size_t i = 1; i < violations.size(); ++i) {
      const std::string& name = violations[i].rule->name;
      if (name != violations[0].rule->name && std::find(e.also.begin(), e.also.end(), name) == e.also.end())
        e.also.push_back(name);
    }
    Note(&naming_[violations[0].rule->name], pattern, std::move(e));
    Count(Severity::kWarning);
  }

  // Big keys, by the hygiene thresholds.
  const hygiene::Settings& h = proxy_.hygiene;
  if (r.type == "string" && r.size >= 0 && static_cast<uint64_t>(r.size) >= h.big_string_bytes) {
    Note(&big_[r.type], pattern, Example{r.key, "", r.size, r.memory});
    if (static_cast<uint64_t>(r.size) >= h.huge_string_bytes) {
      Note(&huge_, pattern, Example{r.key, "", r.size, r.memory});
      Count(Severity::kCritical);
    } else {
      Count(Severity::kWarning);
    }
  } else if (IsCollection(r.type) && r.size >= h.big_collection_elements) {
    Note(&big_[r.type], pattern, Example{r.key, "", r.size, r.memory});
    Count(Severity::kWarning);
  }

  if (r.pttl_ms == -1) {
    ++p.no_ttl_keys;
    p.no_ttl_memory += memory;
    Count(Severity::kInfo);
  }

  const bool cold = scan_.lfu
                        ? r.lfu_freq == 0
                        : r.idle_seconds >= 0 && static_cast<uint64_t>(r.idle_seconds) >= settings_.cold_after_seconds;
  if (cold) {
    ++p.cold_keys;
    Note(&cold_, pattern, Example{r.key, "", scan_.lfu ? r.lfu_freq : r.idle_seconds, r.memory});
    Count(Severity::kInfo);
  }

  // Serialized objects in strings: hygiene's detection on the head (plus the tail, whose last
  // byte tells a JSON object from a truncated prefix).
  if (r.type == "string" && !r.head.empty()) {
    const hygiene::Format f = hygiene::DetectFormat(r.tail.empty() ? r.head : r.head + r.tail);
    if (f != hygiene::Format::kNone) {
      const int depth = f == hygiene::Format::kJsonObject || f == hygiene::Format::kJsonArray ? JsonDepth(r.head) : 0;
      if (f == hygiene::Format::kJsonObject && depth >= static_cast<int>(settings_.json_depth)) {
        Note(&json_documents_, pattern, Example{r.key, hygiene::FormatName(f), depth, r.memory});
        Count(Severity::kInfo);
      } else {
        Note(&serialized_[hygiene::FormatName(f)], pattern, Example{r.key, hygiene::FormatName(f), depth, r.memory});
        Count(Severity::kWarning);
      }
    }
  }

  // Top keys by memory: a small sorted vector (top_keys is small).
  if (settings_.top_keys > 0 && r.memory >= 0) {
    if (top_.size() < settings_.top_keys || r.memory > top_.back().memory) {
      TopKey k{r.key, r.type, r.memory, r.size, r.pttl_ms};
      auto at = std::upper_bound(top_.begin(), top_.end(), k,
                                 [](const TopKey& a, const TopKey& b) { return a.memory > b.memory; });
      top_.insert(at, std::move(k));
      if (top_.size() > settings_.top_keys) top_.pop_back();
    }
  }
}

bool AuditReport::Fails(Severity fail_on) const {
  if (fail_on == Severity::kNever) return false;
  for (int s = static_cast<int>(fail_on); s <= static_cast<int>(Severity::kCritical); ++s) {
    if (findings_[s] > 0) return true;
  }
  return false;
}

std::string AuditReport::Table() const {
  std::string out;
  const ScanInfo& s = scan_;
  absl::StrAppendFormat(&out, "keyguard audit of %s db %d: %u keys scanned", s.upstream, s.db, s.scanned);
  if (s.sample < 1.0) absl::StrAppendFormat(&out, ", %u sampled (%.4g)", s.sampled, s.sample);
  if (s.dbsize >= 0) absl::StrAppendFormat(&out, " of %d", s.dbsize);
  absl::StrAppendFormat(&out, " in %.1f s, %s\n", s.seconds,
                        s.complete ? "complete" : absl::StrCat("incomplete: resume with --cursor ", s.cursor));
  absl::StrAppend(&out, "memory total ", Bytes(memory_), "\n");

  out += "\nkeys by pattern and type\n";
  TextTable patterns;
  patterns.Row({"PATTERN", "TYPE", "KEYS", "MEMORY", "NO TTL", "NO-TTL MEMORY", "COLD"});
  for (const auto& [name, p] : patterns_) {
    bool first = true;
    for (const auto& [type, t] : p.types) {
      patterns.Row(
          {first ? Printable(name) : "", type, absl::StrCat(t.keys), Bytes(t.memory),
           first ? absl::StrCat(p.no_ttl_keys) : "",
           first ? absl::StrFormat("%s (%.0f%%)", Bytes(p.no_ttl_memory), 100 * Share(p.no_ttl_memory, p.memory)) : "",
           first ? absl::StrCat(p.cold_keys) : ""});
      first = false;
    }
  }
  patterns.AppendTo(&out);

  auto section = [&out](const char* title, bool any) {
    absl::StrAppend(&out, "\n", title, any ? "\n" : ": none\n");
    return any;
  };
  if (section("names breaking a rule (warning)", !naming_.empty())) {
    TextTable t;
    t.Row({"RULE", "KEYS", "EXAMPLE", "SUGGESTED NAME", "ALSO BREAKS"});
    for (const auto& [rule, g] : naming_) {
      for (size_t i = 0; i < g.examples.size(); ++i) {
        const Example& e = g.examples[i];
        t.Row({i == 0 ? rule : "", i == 0 ? absl::StrCat(g.keys) : "", Printable(e.key),
               e.detail.empty() ? "-" : Printable(e.detail), e.also.empty() ? "-" : absl::StrJoin(e.also, ", ")});
      }
    }
    t.AppendTo(&out);
    absl::StrAppend(&out, "  (each key once, under the first rule it breaks: user rules before built-in ones)\n");
  }
  if (section(
          absl::StrFormat("big keys (strings >= %d bytes, collections >= %d members; warning, huge strings critical)",
                          proxy_.hygiene.big_string_bytes, proxy_.hygiene.big_collection_elements)
              .c_str(),
          !big_.empty())) {
    TextTable t;
    t.Row({"TYPE", "KEYS", "KEY", "SIZE", "MEMORY"});
    for (const auto& [type, g] : big_) {
      std::vector<Example> ex = g.examples;
      std::sort(ex.begin(), ex.end(), [](const Example& a, const Example& b) { return a.number > b.number; });
      for (size_t i = 0; i < ex.size(); ++i) {
        t.Row({i == 0 ? type : "", i == 0 ? absl::StrCat(g.keys) : "", Printable(ex[i].key),
               type == "string" ? Bytes(ex[i].number) : absl::StrCat(ex[i].number, " members"), Bytes(ex[i].memory)});
      }
    }
    t.AppendTo(&out);
  }
  if (section(s.lfu ? "cold keys (OBJECT FREQ 0; info)"
                    : absl::StrCat("cold keys (idle >= ", Duration(settings_.cold_after_seconds), "; info)").c_str(),
              cold_.keys > 0)) {
    TextTable t;
    t.Row({"KEY", s.lfu ? "FREQ" : "IDLE", "MEMORY"});
    for (const Example& e : cold_.examples)
      t.Row({Printable(e.key), s.lfu ? absl::StrCat(e.number) : Duration(e.number), Bytes(e.memory)});
    t.AppendTo(&out);
    if (cold_.keys > cold_.examples.size())
      absl::StrAppend(&out, "  ... ", cold_.keys - cold_.examples.size(), " more\n");
  }
  if (section("serialized objects in strings", !serialized_.empty() || json_documents_.keys > 0)) {
    TextTable t;
    t.Row({"FORMAT", "KEYS", "EXAMPLE", "SUGGESTION"});
    for (const auto& [format, g] : serialized_) {
      for (size_t i = 0; i < g.examples.size(); ++i) {
        t.Row({i == 0 ? format : "", i == 0 ? absl::StrCat(g.keys) : "", Printable(g.examples[i].key),
               "a Hash, one field per attribute (warning)"});
      }
    }
    for (size_t i = 0; i < json_documents_.examples.size(); ++i) {
      const Example& e = json_documents_.examples[i];
      t.Row({i == 0 ? "json_document" : "", i == 0 ? absl::StrCat(json_documents_.keys) : "", Printable(e.key),
             absl::StrCat("the JSON type: nested ", e.number, " deep (info)")});
    }
    t.AppendTo(&out);
  }
  if (section(absl::StrCat("top ", settings_.top_keys, " keys by memory").c_str(), !top_.empty())) {
    TextTable t;
    t.Row({"KEY", "TYPE", "MEMORY", "SIZE", "TTL"});
    for (const TopKey& k : top_) {
      t.Row({Printable(k.key), k.type, Bytes(k.memory), k.size < 0 ? "-" : absl::StrCat(k.size),
             k.pttl_ms < 0 ? "none" : Duration(k.pttl_ms / 1000)});
    }
    t.AppendTo(&out);
  }
  absl::StrAppendFormat(&out, "\nfindings: %u critical, %u warning, %u info\n", Findings(Severity::kCritical),
                        Findings(Severity::kWarning), Findings(Severity::kInfo));
  return out;
}

std::string AuditReport::Json() const {
  const ScanInfo& s = scan_;
  JsonValue j;
  j["upstream"] = s.upstream;
  j["db"] = s.db;
  j["scanned"] = s.scanned;
  j["sampled"] = s.sampled;
  j["sample"] = s.sample;
  j["dbsize"] = s.dbsize;
  j["complete"] = s.complete;
  j["start_cursor"] = s.start_cursor;
  j["cursor"] = s.cursor;
  j["seconds"] = s.seconds;
  j["commands"] = s.commands;
  j["cold_by"] = s.lfu ? "object_freq" : "object_idletime";
  j["thresholds"] = {{"big_string_bytes", proxy_.hygiene.big_string_bytes},
                     {"huge_string_bytes", proxy_.hygiene.huge_string_bytes},
                     {"big_collection_elements", proxy_.hygiene.big_collection_elements},
                     {"cold_after_seconds", settings_.cold_after_seconds},
                     {"json_depth", settings_.json_depth}};
  j["memory"] = memory_;
  JsonValue patterns = JsonValue::array();
  for (const auto& [name, p] : patterns_) {
    JsonValue types = JsonValue::object();
    for (const auto& [type, t] : p.types) types[type] = {{"keys", t.keys}, {"memory", t.memory}};
    patterns.push_back({{"pattern", name},
                        {"keys", p.keys},
                        {"memory", p.memory},
                        {"no_ttl_keys", p.no_ttl_keys},
                        {"no_ttl_memory", p.no_ttl_memory},
                        {"no_ttl_memory_share", Share(p.no_ttl_memory, p.memory)},
                        {"cold_keys", p.cold_keys},
                        {"types", types}});
  }
  j["patterns"] = patterns;
  auto by_pattern = [](const Group& g) {
    JsonValue o = JsonValue::object();
    for (const auto& [p, n] : g.by_pattern) o[p] = n;
    return o;
  };
  JsonValue naming = JsonValue::array();
  for (const auto& [rule, g] : naming_) {
    JsonValue ex = JsonValue::array();
    for (const Example& e : g.examples) ex.push_back({{"key", e.key}, {"suggestion", e.detail}, {"also", e.also}});
    naming.push_back(
        {{"rule", rule}, {"severity", "warning"}, {"keys", g.keys}, {"patterns", by_pattern(g)}, {"examples", ex}});
  }
  j["naming"] = naming;
  JsonValue big = JsonValue::array();
  for (const auto& [type, g] : big_) {
    std::vector<Example> sorted = g.examples;
    std::sort(sorted.begin(), sorted.end(), [](const Example& a, const Example& b) { return a.number > b.number; });
    JsonValue ex = JsonValue::array();
    for (const Example& e : sorted) ex.push_back({{"key", e.key}, {"size", e.number}, {"memory", e.memory}});
    big.push_back({{"type", type}, {"keys", g.keys}, {"patterns", by_pattern(g)}, {"examples", ex}});
  }
  j["big_keys"] = big;
  JsonValue huge = JsonValue::array();
  for (const Example& e : huge_.examples) huge.push_back(e.key);
  j["huge_strings"] = {{"keys", huge_.keys}, {"examples", huge}};
  JsonValue cold = JsonValue::array();
  for (const Example& e : cold_.examples) cold.push_back({{"key", e.key}, {s.lfu ? "freq" : "idle_seconds", e.number}});
  j["cold_keys"] = {{"keys", cold_.keys}, {"patterns", by_pattern(cold_)}, {"examples", cold}};
  JsonValue serialized = JsonValue::array();
  for (const auto& [format, g] : serialized_) {
    for (const Example& e : g.examples) {
      serialized.push_back({{"key", e.key}, {"format", format}, {"suggestion", "hash"}, {"severity", "warning"}});
    }
  }
  for (const Example& e : json_documents_.examples) {
    serialized.push_back(
        {{"key", e.key}, {"format", e.detail}, {"depth", e.number}, {"suggestion", "json"}, {"severity", "info"}});
  }
  JsonValue serialized_counts = JsonValue::object();
  for (const auto& [format, g] : serialized_) serialized_counts[format] = g.keys;
  j["serialized"] = {
      {"hash_candidates", serialized_counts}, {"json_documents", json_documents_.keys}, {"examples", serialized}};
  JsonValue top = JsonValue::array();
  for (const TopKey& k : top_) {
    top.push_back({{"key", k.key}, {"type", k.type}, {"memory", k.memory}, {"size", k.size}, {"pttl_ms", k.pttl_ms}});
  }
  j["top_keys"] = top;
  j["findings"] = {{"critical", Findings(Severity::kCritical)},
                   {"warning", Findings(Severity::kWarning)},
                   {"info", Findings(Severity::kInfo)}};
  return Dump(j);
}

std::string AuditReport::Prometheus() const {
  using metrics::FamilyId;
  std::string out;
  metrics::TextWriter w(&out);
  // Each family's HELP/TYPE lines, then its samples.
  auto family = [&w](FamilyId id) -> const metrics::Family& {
    w.Header(metrics::Of(id));
    return metrics::Of(id);
  };
  const ScanInfo& s = scan_;
  w.Sample(family(FamilyId::kAuditScannedKeys), {}, s.scanned);
  w.Sample(family(FamilyId::kAuditSampledKeys), {}, s.sampled);
  w.Sample(family(FamilyId::kAuditComplete), {}, s.complete ? 1 : 0);
  w.FormattedSample(family(FamilyId::kAuditDuration), {}, absl::StrFormat("%.3f", s.seconds));
  const metrics::Family& memory = family(FamilyId::kAuditMemoryBytes);
  for (const auto& [name, p] : patterns_) {
    for (const auto& [type, t] : p.types) w.Sample(memory, {name, type}, t.memory);
  }
  const metrics::Family& keys = family(FamilyId::kAuditKeys);
  for (const auto& [name, p] : patterns_) {
    for (const auto& [type, t] : p.types) w.Sample(keys, {name, type}, t.keys);
  }
  const metrics::Family& no_ttl = family(FamilyId::kAuditKeysWithoutTtl);
  for (const auto& [name, p] : patterns_) w.Sample(no_ttl, {name}, p.no_ttl_keys);
  const metrics::Family& no_ttl_memory = family(FamilyId::kAuditMemoryWithoutTtl);
  for (const auto& [name, p] : patterns_) w.Sample(no_ttl_memory, {name}, p.no_ttl_memory);
  const metrics::Family& cold = family(FamilyId::kAuditColdKeys);
  for (const auto& [name, p] : patterns_) w.Sample(cold, {name}, p.cold_keys);
  const metrics::Family& naming = family(FamilyId::kAuditNamingViolations);
  for (const auto& [rule, g] : naming_) {
    for (const auto& [pattern, n] : g.by_pattern) w.Sample(naming, {rule, pattern}, n);
  }
  const metrics::Family& big = family(FamilyId::kAuditBigKeys);
  for (const auto& [type, g] : big_) {
    for (const auto& [pattern, n] : g.by_pattern) w.Sample(big, {type, pattern}, n);
  }
  const metrics::Family& serialized = family(FamilyId::kAuditSerializedKeys);
  for (const auto& [format, g] : serialized_) {
    for (const auto& [pattern, n] : g.by_pattern) w.Sample(serialized, {format, "hash", pattern}, n);
  }
  for (const auto& [pattern, n] : json_documents_.by_pattern) {
    w.Sample(serialized, {"json_object", "json", pattern}, n);
  }
  const metrics::Family& findings = family(FamilyId::kAuditFindings);
  for (Severity sev : {Severity::kCritical, Severity::kWarning, Severity::kInfo}) {
    w.Sample(findings, {SeverityName(sev)}, Findings(sev));
  }
  return out;
}

}  // namespace keyguard::maintenance
