// What `keyguard audit` found, gathered key by key and rendered as a terminal table, JSON or
// Prometheus text. Sans-io: the scan loop (audit.cc) feeds it KeyRecords; tests feed it directly.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "keyguard/config/config.h"
#include "maintenance/settings.h"

namespace keyguard::maintenance {

// One key as the audit saw it.
struct KeyRecord {
  std::string key;
  std::string type;           // TYPE: string, hash, list, set, zset, stream, or a module type
  int64_t pttl_ms = -1;       // PTTL; -1: no TTL
  int64_t memory = -1;        // MEMORY USAGE bytes; -1: unknown
  int64_t idle_seconds = -1;  // OBJECT IDLETIME; -1: unknown (e.g. under an LFU policy)
  int64_t lfu_freq = -1;      // OBJECT FREQ under an LFU policy; -1: unknown
  int64_t size = -1;          // strings: STRLEN bytes; collections: members; -1: unknown
  std::string head;           // strings: the first value_prefix_bytes bytes
  std::string tail;           // strings longer than head: their last bytes
};

// Facts about the walk itself, shown in every format.
struct ScanInfo {
  std::string upstream;
  int db = 0;
  uint64_t scanned = 0;  // keys SCAN returned
  uint64_t sampled = 0;  // keys looked at (all of them without --sample)
  double sample = 1.0;
  int64_t dbsize = -1;
  bool complete = false;
  std::string cursor = "0";  // where a resumed run starts (when not complete)
  std::string start_cursor = "0";
  double seconds = 0;
  uint64_t commands = 0;
  bool lfu = false;  // cold keys judged by OBJECT FREQ (an LFU maxmemory-policy)
};

class AuditReport {
 public:
  AuditReport(const config::ProxyConfig& proxy, const AuditSettings& settings);

  void Add(const KeyRecord& r);

  ScanInfo& scan() { return scan_; }
  const ScanInfo& scan() const { return scan_; }

  // Findings of severity `s`: one per key breaking the key policy (whatever number of rules it
  // breaks), big key, key without TTL, cold key, serialized value.
  uint64_t Findings(Severity s) const { return findings_[static_cast<int>(s)]; }
  // True when a finding reaches `fail_on`.
  bool Fails(Severity fail_on) const;

  std::string Table() const;
  std::string Json() const;
  std::string Prometheus() const;

 private:
  struct TypeStats {
    uint64_t keys = 0;
    uint64_t memory = 0;
  };
  struct PatternStats {
    std::map<std::string, TypeStats> types;
    uint64_t keys = 0, memory = 0, no_ttl_keys = 0, no_ttl_memory = 0, cold_keys = 0;
  };
  struct Example {
    std::string key;
    std::string detail;  // suggestion, format, ...
    int64_t number = 0;  // size, idle seconds, depth
    int64_t memory = 0;
    std::vector<std::string> also;  // naming: the other rules the key breaks
  };
  struct Group {
    uint64_t keys = 0;
    std::map<std::string, uint64_t> by_pattern;
    std::vector<Example> examples;
  };
  struct TopKey {
    std::string key, type;
    int64_t memory, size, pttl_ms;
  };

  const std::string& PatternOf(const std::string& key);
  void Count(Severity s) { ++findings_[static_cast<int>(s)]; }
  void Note(Group* g, const std::string& pattern, Example e);

  const config::ProxyConfig& proxy_;
  const AuditSettings& settings_;
  ScanInfo scan_;
  std::string pattern_;  // the last key's pattern
  std::map<std::string, PatternStats> patterns_;
  std::map<std::string, Group> naming_;  // by the first rule a key breaks (user rules first)
  std::map<std::string, Group> big_;     // by type
  Group huge_;                           // strings of at least huge_string_bytes
  Group cold_;
  std::map<std::string, Group> serialized_;  // by format: objects that should be Hashes
  Group json_documents_;                     // nested JSON objects: the JSON type suits them
  std::vector<TopKey> top_;                  // by memory, descending, at most top_keys
  uint64_t findings_[5] = {};
  uint64_t memory_ = 0;
};

}  // namespace keyguard::maintenance
