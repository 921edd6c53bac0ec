#include "maintenance/settings.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "config/yaml_proto.h"
#include "keyguard/common/field_error.h"
#include "keyguard/config/v1/config.pb.h"
#include "keyguard/policy/key_policy.h"
#include "re2/re2.h"

namespace keyguard::maintenance {
namespace {

namespace pb = keyguard::config::v1;

Severity FromProto(pb::Severity s) {
  switch (s) {
    case pb::INFO: return Severity::kInfo;
    case pb::WARNING: return Severity::kWarning;
    case pb::CRITICAL: return Severity::kCritical;
    default: return Severity::kNever;
  }
}

// The pattern and rewrite of a migration are compiled by the key policy's own compiler (as a
// one-rule policy), so `$1` templates and their checks are the same as for the proxy's rules.
absl::Status CompileRewrite(const std::string& path, const std::string& pattern, const std::string& rewrite,
                            Migration* m) {
  pb::KeyPolicy one;
  pb::UserRule* rule = one.add_rules();
  rule->set_name("migration");
  rule->set_pattern(pattern);
  rule->set_rewrite(rewrite);
  auto policy = policy::KeyPolicy::Compile(one);
  if (!policy.ok()) {
    std::string message(policy.status().message());
    const std::string inner = "key_policy.rules[0].";
    if (absl::StartsWith(message, inner)) message = message.substr(inner.size());
    return absl::InvalidArgumentError(absl::StrCat(path, ".", message));
  }
  m->pattern = (*policy)->rules()[0].pattern;
  m->rewrite = (*policy)->rules()[0].rewrite;
  return absl::OkStatus();
}

absl::StatusOr<MaintenanceConfig> Compile(const pb::Config& p) {
  MaintenanceConfig c;
  auto proxy = config::Compile(p);
  if (!proxy.ok()) return proxy.status();
  c.proxy = *std::move(proxy);

  const pb::Audit& a = p.audit();
  AuditSettings& s = c.audit;
  if (a.has_scan_count()) {
    if (a.scan_count() == 0 || a.scan_count() > 100000)
      return FieldError("audit.scan_count", "must be between 1 and 100000");
    s.scan_count = a.scan_count();
  }
  if (a.has_max_ops_per_second()) s.max_ops_per_second = a.max_ops_per_second();
  if (a.has_pause_ms()) s.pause_ms = a.pause_ms();
  if (a.has_memory_samples()) s.memory_samples = a.memory_samples();
  if (a.has_cold_after_seconds()) s.cold_after_seconds = a.cold_after_seconds();
  if (a.has_value_prefix_bytes()) {
    if (a.value_prefix_bytes() < 16 || a.value_prefix_bytes() > (1u << 20)) {
      return FieldError("audit.value_prefix_bytes", "must be between 16 and 1048576");
    }
    s.value_prefix_bytes = a.value_prefix_bytes();
  }
  if (a.has_top_keys()) s.top_keys = a.top_keys();
  if (a.has_examples()) s.examples = a.examples();
  s.fail_on = FromProto(a.fail_on());
  if (a.has_json_depth()) {
    if (a.json_depth() < 1) return FieldError("audit.json_depth", "must be at least 1");
    s.json_depth = a.json_depth();
  }

  for (int i = 0; i < p.migrations_size(); ++i) {
    const pb::Migration& in = p.migrations(i);
    const std::string path = absl::StrCat("migrations[", i, "]");
    Migration m;
    if (in.name().empty()) return FieldError(path + ".name", "required");
    if (c.FindMigration(in.name()) != nullptr)
      return FieldError(path + ".name", absl::StrCat("'", in.name(), "' is used twice"));
    m.name = in.name();
    if (!in.match().empty()) m.match = in.match();
    if (!in.rule().empty()) {
      if (!in.pattern().empty() || !in.rewrite().empty()) {
        return FieldError(path + ".rule", "takes the rule's pattern and rewrite; leave pattern and rewrite out");
      }
      const policy::Rule* found = nullptr;
      for (const policy::Rule& r : c.proxy.key_policy->rules()) {
        if (r.kind == policy::Rule::Kind::kUser && r.name == in.rule()) found = &r;
      }
      if (found == nullptr)
        return FieldError(path + ".rule", absl::StrCat("no key_policy.rules entry is named '", in.rule(), "'"));
      if (found->rewrite.empty())
        return FieldError(path + ".rule", absl::StrCat("rule '", in.rule(), "' has no rewrite"));
      m.pattern = found->pattern;
      m.rewrite = found->rewrite;
    } else {
      if (in.pattern().empty()) return FieldError(path + ".pattern", "required (or name a key_policy rule in rule)");
      if (in.rewrite().empty()) return FieldError(path + ".rewrite", "required (or name a key_policy rule in rule)");
      if (auto st = CompileRewrite(path, in.pattern(), in.rewrite(), &m); !st.ok()) return st;
    }
    m.json_to_hash = in.reshape() == pb::JSON_TO_HASH;
    m.separate_nested = in.nested() == pb::SEPARATE_KEY;
    if (m.separate_nested && !m.json_to_hash)
      return FieldError(path + ".nested", "applies to reshape: json_to_hash only");
    switch (in.unconvertible()) {
      case pb::SKIP: m.unconvertible = Migration::Unconvertible::kSkip; break;
      case pb::COPY_UNCHANGED: m.unconvertible = Migration::Unconvertible::kCopyUnchanged; break;
      default: m.unconvertible = Migration::Unconvertible::kFail; break;
    }
    if (in.unconvertible() != pb::UNCONVERTIBLE_UNSPECIFIED && !m.json_to_hash) {
      return FieldError(path + ".unconvertible", "applies to reshape: json_to_hash only");
    }
    if (in.has_batch()) {
      if (in.batch() == 0 || in.batch() > 100000) return FieldError(path + ".batch", "must be between 1 and 100000");
      m.batch = in.batch();
    }
    if (in.has_max_ops_per_second()) m.max_ops_per_second = in.max_ops_per_second();
    c.migrations.push_back(std::move(m));
  }
  return c;
}

}  // namespace

const char* SeverityName(Severity s) {
  switch (s) {
    case Severity::kInfo: return "info";
    case Severity::kWarning: return "warning";
    case Severity::kCritical: return "critical";
    case Severity::kNever: return "never";
  }
  return "never";
}

std::optional<Severity> ParseSeverity(std::string_view name) {
  for (Severity s : {Severity::kInfo, Severity::kWarning, Severity::kCritical, Severity::kNever}) {
    if (name == SeverityName(s)) return s;
  }
  return std::nullopt;
}

std::optional<std::string> Migration::NewName(std::string_view key) const {
  std::string out;
  if (!re2::RE2::FullMatch(key, *pattern) || !re2::RE2::Extract(key, *pattern, rewrite, &out)) return std::nullopt;
  return out;
}

const Migration* MaintenanceConfig::FindMigration(std::string_view name) const {
  for (const Migration& m : migrations) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

absl::StatusOr<MaintenanceConfig> ParseMaintenanceConfig(std::string_view yaml) {
  pb::Config proto;
  if (auto s = config::YamlTextToProto(yaml, &proto); !s.ok()) return s;
  return Compile(proto);
}

absl::StatusOr<MaintenanceConfig> LoadMaintenanceConfig(const std::string& path) {
  if (path.empty()) return Compile(pb::Config());
  auto text = config::ReadConfigText(path);
  if (!text.ok()) return text.status();
  auto c = ParseMaintenanceConfig(*text);
  if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

}  // namespace keyguard::maintenance
