// Settings of `keyguard audit` and `keyguard migrate`, read from the same config file as the
// proxy: the proxy's own settings (key policy, hygiene thresholds) plus the `audit` and
// `migrations` sections, compiled once into plain structs.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "keyguard/config/config.h"

namespace re2 {
class RE2;
}

namespace keyguard::maintenance {

// Ordered: a finding "reaches" fail_on when its severity is >= fail_on.
enum class Severity : uint8_t { kInfo = 1, kWarning = 2, kCritical = 3, kNever = 4 };
const char* SeverityName(Severity s);
// "info", "warning", "critical", "never".
std::optional<Severity> ParseSeverity(std::string_view name);

struct AuditSettings {
  uint32_t scan_count = 500;
  uint32_t max_ops_per_second = 10000;  // 0: no cap
  uint32_t pause_ms = 0;
  uint32_t memory_samples = 5;
  uint64_t cold_after_seconds = 30 * 24 * 3600;
  uint32_t value_prefix_bytes = 4096;
  uint32_t top_keys = 10;
  uint32_t examples = 10;
  Severity fail_on = Severity::kNever;
  uint32_t json_depth = 2;
};

struct Migration {
  std::string name;
  std::string match = "*";                  // SCAN MATCH glob
  std::shared_ptr<const re2::RE2> pattern;  // full match
  std::string rewrite;                      // RE2 template (\1..\9)
  bool json_to_hash = false;                // else a KEEP_TYPE copy
  bool separate_nested = false;             // JSON_TO_HASH: nested values under <new>:<field>
  // JSON_TO_HASH: what becomes of a key that cannot be re-shaped.
  enum class Unconvertible : uint8_t { kFail, kSkip, kCopyUnchanged } unconvertible = Unconvertible::kFail;
  uint32_t batch = 500;
  uint32_t max_ops_per_second = 10000;

  // The new name of `key`, or nullopt when `key` does not match the pattern.
  std::optional<std::string> NewName(std::string_view key) const;
};

struct MaintenanceConfig {
  config::ProxyConfig proxy;
  AuditSettings audit;
  std::vector<Migration> migrations;
  const Migration* FindMigration(std::string_view name) const;
};

// Parses the same YAML as the proxy; errors name the field path (`migrations[0].rule: ...`).
absl::StatusOr<MaintenanceConfig> ParseMaintenanceConfig(std::string_view yaml);
// An empty path gives the defaults (every built-in rule, no migrations).
absl::StatusOr<MaintenanceConfig> LoadMaintenanceConfig(const std::string& path);

}  // namespace keyguard::maintenance
