// Every metric family keyguard exposes, declared once: name, type, help text and label names.
// The /metrics scrape, the hot-key board, the config store and `keyguard audit --format prom`
// all write their HELP/TYPE lines and label names from this table (see text_writer.h), and the
// registry's labeled counters take their label count from it. Like Envoy's ALL_*_STATS lists.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace keyguard::metrics {

enum class Type : uint8_t { kCounter, kGauge, kHistogram };

constexpr std::string_view TypeName(Type t) {
  return t == Type::kCounter ? "counter" : t == Type::kGauge ? "gauge" : "histogram";
}

// One per row of kFamilies, in the same order.
enum class FamilyId : uint8_t {
  // /metrics: the registry's per-worker shards.
  kBuildInfo,
  kClientConnections,
  kClientConnectionsTotal,
  kUpstreamConnections,
  kClientReceivedBytes,
  kClientSentBytes,
  kUpstreamReceivedBytes,
  kUpstreamSentBytes,
  kClientProtocolErrors,
  kUnexpectedReplies,
  kLegacyKeysMoved,
  kLegacyMoveErrors,
  kProbedKeys,
  kUpstreamErrors,
  kUpstreamConnectionsByKind,
  kUpstreamPins,
  kUpstreamPinDuration,
  kSharedWrites,
  kSharedCommands,
  kKeyViolations,
  kKeysRewritten,
  kCommandsRejected,
  kFindings,
  kBigkeyAccess,
  kHygieneActions,
  kTenantCommands,
  kTenantReceivedBytes,
  kTenantSentBytes,
  kTenantRejected,
  kDraining,
  kCommands,
  kCommandDuration,
  kReplyBytes,
  kReplyElements,
  // /metrics: process-wide values, from collectors.
  kConfigReloads,
  kConfigReloadFailures,
  kConfigVersion,
  kUpstreamTlsHandshakes,
  kUpstreamTlsReloads,
  kUpstreamAuthReloads,
  kClientTlsHandshakes,
  kClientTlsReloads,
  kClientTlsFailures,
  kUpstreamFailovers,
  kHotKeyPatternAccesses,
  // `keyguard audit --format prom`.
  kAuditScannedKeys,
  kAuditSampledKeys,
  kAuditComplete,
  kAuditDuration,
  kAuditMemoryBytes,
  kAuditKeys,
  kAuditKeysWithoutTtl,
  kAuditMemoryWithoutTtl,
  kAuditColdKeys,
  kAuditNamingViolations,
  kAuditBigKeys,
  kAuditSerializedKeys,
  kAuditFindings,
  kCount,
};

inline constexpr size_t kMaxLabels = 3;

struct Family {
  FamilyId id;
  std::string_view name;
  Type type;
  std::string_view help;
  // Label names in exposition order; the unused tail is empty. A histogram's `le` is implied.
  std::array<std::string_view, kMaxLabels> labels{};

  constexpr size_t label_count() const {
    size_t n = 0;
    while (n < kMaxLabels && !labels[n].empty()) ++n;
    return n;
  }
  constexpr std::span<const std::string_view> label_names() const { return {labels.data(), label_count()}; }
};

inline constexpr Family kFamilies[] = {
    {FamilyId::kBuildInfo,
     "keyguard_build_info",
     Type::kGauge,
     "Build information; the value is always 1.",
     {"version"}},
    {FamilyId::kClientConnections, "keyguard_client_connections", Type::kGauge, "Client connections open now."},
    {FamilyId::kClientConnectionsTotal, "keyguard_client_connections_total", Type::kCounter,
     "Client connections accepted."},
    {FamilyId::kUpstreamConnections, "keyguard_upstream_connections", Type::kGauge, "Upstream connections open now."},
    {FamilyId::kClientReceivedBytes, "keyguard_client_received_bytes_total", Type::kCounter,
     "Bytes read from clients."},
    {FamilyId::kClientSentBytes, "keyguard_client_sent_bytes_total", Type::kCounter, "Bytes written to clients."},
    {FamilyId::kUpstreamReceivedBytes, "keyguard_upstream_received_bytes_total", Type::kCounter,
     "Bytes read from the upstream Redis."},
    {FamilyId::kUpstreamSentBytes, "keyguard_upstream_sent_bytes_total", Type::kCounter,
     "Bytes written to the upstream Redis."},
    {FamilyId::kClientProtocolErrors, "keyguard_client_protocol_errors_total", Type::kCounter,
     "Client connections closed for malformed RESP."},
    {FamilyId::kUnexpectedReplies, "keyguard_unexpected_replies_total", Type::kCounter,
     "Upstream replies that matched no pending command."},
    {FamilyId::kLegacyKeysMoved, "keyguard_legacy_keys_moved_total", Type::kCounter,
     "Keys stored under a rewrite rule's old name that keyguard moved to the new name on first use."},
    {FamilyId::kLegacyMoveErrors, "keyguard_legacy_move_errors_total", Type::kCounter,
     "Moves of old-name keys the upstream refused (the command went on against the new name)."},
    {FamilyId::kProbedKeys, "keyguard_probed_keys_total", Type::kCounter,
     "Keys the sizing probe asked the upstream about (TYPE, size, MEMORY USAGE)."},
    {FamilyId::kUpstreamErrors,
     "keyguard_upstream_errors_total",
     Type::kCounter,
     "Upstream failures by reason: connect, closed, reset, protocol, auth, tls (a TLS handshake failed).",
     {"reason"}},
    {FamilyId::kUpstreamConnectionsByKind,
     "keyguard_upstream_connections_by_kind",
     Type::kGauge,
     "Upstream connections open now, by kind: dedicated (one per client), shared (pipelined, per worker), pinned "
     "(a client's own while its connection state lasts), idle (kept for pinning).",
     {"kind"}},
    {FamilyId::kUpstreamPins,
     "keyguard_upstream_pins_total",
     Type::kCounter,
     "Clients moved from a shared upstream connection to one of their own, by the state that needed it.",
     {"reason"}},
    {FamilyId::kUpstreamPinDuration,
     "keyguard_upstream_pin_duration_seconds",
     Type::kHistogram,
     "How long clients stayed pinned (to the end of a transaction or blocking command, or to the client's close).",
     {"reason"}},
    {FamilyId::kSharedWrites, "keyguard_upstream_shared_writes_total", Type::kCounter,
     "Batches written to shared upstream connections (many clients' commands in one write)."},
    {FamilyId::kSharedCommands, "keyguard_upstream_shared_commands_total", Type::kCounter,
     "Commands written to shared upstream connections; divided by the writes, the commands per write."},
    {FamilyId::kKeyViolations,
     "keyguard_key_violations_total",
     Type::kCounter,
     "Keys that broke a key-name rule, by rule, action and key pattern.",
     {"rule", "action", "key_pattern"}},
    {FamilyId::kKeysRewritten,
     "keyguard_keys_rewritten_total",
     Type::kCounter,
     "Keys keyguard rewrote before forwarding, by rule.",
     {"rule"}},
    {FamilyId::kCommandsRejected,
     "keyguard_commands_rejected_total",
     Type::kCounter,
     "Commands keyguard refused, by reason.",
     {"reason"}},
    {FamilyId::kFindings,
     "keyguard_findings_total",
     Type::kCounter,
     "Hygiene findings by kind and key pattern.",
     {"kind", "key_pattern"}},
    {FamilyId::kBigkeyAccess,
     "keyguard_bigkey_access_total",
     Type::kCounter,
     "Accesses to big keys by kind, command and key pattern.",
     {"kind", "command", "key_pattern"}},
    {FamilyId::kHygieneActions,
     "keyguard_hygiene_actions_total",
     Type::kCounter,
     "Hygiene findings by kind and the action taken: observe, warn, rewrite (the command was changed) or "
     "reject (it was refused).",
     {"kind", "action"}},
    {FamilyId::kTenantCommands,
     "keyguard_tenant_commands_total",
     Type::kCounter,
     "Commands from each tenant's clients (refused ones included).",
     {"tenant"}},
    {FamilyId::kTenantReceivedBytes,
     "keyguard_tenant_received_bytes_total",
     Type::kCounter,
     "Request bytes received from each tenant's clients.",
     {"tenant"}},
    {FamilyId::kTenantSentBytes,
     "keyguard_tenant_sent_bytes_total",
     Type::kCounter,
     "Reply bytes sent to each tenant's clients.",
     {"tenant"}},
    {FamilyId::kTenantRejected,
     "keyguard_tenant_rejected_total",
     Type::kCounter,
     "Commands refused for each tenant, by reason.",
     {"tenant", "reason"}},
    {FamilyId::kDraining, "keyguard_draining", Type::kGauge, "1 while keyguard drains connections before exiting."},
    {FamilyId::kCommands,
     "keyguard_commands_total",
     Type::kCounter,
     "Commands by command name and outcome.",
     {"command", "outcome"}},
    {FamilyId::kCommandDuration,
     "keyguard_command_duration_seconds",
     Type::kHistogram,
     "Upstream round trip per command, from forwarding the command to receiving its reply.",
     {"command"}},
    {FamilyId::kReplyBytes,
     "keyguard_reply_bytes",
     Type::kHistogram,
     "Size of each command's reply as the upstream sent it, in bytes.",
     {"command"}},
    {FamilyId::kReplyElements,
     "keyguard_reply_elements",
     Type::kHistogram,
     "Elements of each aggregate reply (array, set; pairs of a map), per command; scalar replies are not "
     "counted.",
     {"command"}},
    {FamilyId::kConfigReloads, "keyguard_config_reloads_total", Type::kCounter, "Successful config reloads."},
    {FamilyId::kConfigReloadFailures, "keyguard_config_reload_failures_total", Type::kCounter,
     "Config reloads that failed; the previous config stays live."},
    {FamilyId::kConfigVersion, "keyguard_config_version", Type::kGauge, "Version of the live config, 1 at start-up."},
    {FamilyId::kUpstreamTlsHandshakes,
     "keyguard_upstream_tls_handshakes_total",
     Type::kCounter,
     "TLS handshakes with the upstream that succeeded, by whether they resumed a session.",
     {"resumed"}},
    {FamilyId::kUpstreamTlsReloads, "keyguard_upstream_tls_reloads_total", Type::kCounter,
     "Times the upstream TLS certificate, key or CA files changed on disk and were loaded for new connections."},
    {FamilyId::kUpstreamAuthReloads, "keyguard_upstream_auth_reloads_total", Type::kCounter,
     "Times upstream_auth.password_file changed on disk and was read again for new connections."},
    {FamilyId::kClientTlsHandshakes,
     "keyguard_client_tls_handshakes_total",
     Type::kCounter,
     "TLS handshakes with clients (listen_tls) that succeeded, by whether they resumed a session.",
     {"resumed"}},
    {FamilyId::kClientTlsReloads, "keyguard_client_tls_reloads_total", Type::kCounter,
     "Times the listener's TLS certificate, key or CA files changed on disk and were loaded for new connections."},
    {FamilyId::kClientTlsFailures, "keyguard_client_tls_handshake_failures_total", Type::kCounter,
     "TLS handshakes with clients that failed (no TLS, no trusted certificate where one is required, timeout)."},
    {FamilyId::kUpstreamFailovers, "keyguard_upstream_failovers_total", Type::kCounter,
     "Times the Sentinels named a new primary and keyguard moved to it."},
    {FamilyId::kHotKeyPatternAccesses,
     "keyguard_hot_key_pattern_accesses",
     Type::kGauge,
     "Accesses in the last complete hot-key interval, by key pattern: the 10 patterns whose keys hold the most of "
     "the hot-key sketches' counts.",
     {"key_pattern"}},
    {FamilyId::kAuditScannedKeys, "keyguard_audit_scanned_keys", Type::kGauge, "Keys the last audit scanned."},
    {FamilyId::kAuditSampledKeys, "keyguard_audit_sampled_keys", Type::kGauge,
     "Keys the last audit inspected (all scanned keys unless sampling)."},
    {FamilyId::kAuditComplete, "keyguard_audit_complete", Type::kGauge,
     "1 when the last audit walked the whole keyspace."},
    {FamilyId::kAuditDuration, "keyguard_audit_duration_seconds", Type::kGauge, "How long the last audit took."},
    {FamilyId::kAuditMemoryBytes,
     "keyguard_audit_memory_bytes",
     Type::kGauge,
     "MEMORY USAGE of the inspected keys, by key pattern and type.",
     {"key_pattern", "type"}},
    {FamilyId::kAuditKeys,
     "keyguard_audit_keys",
     Type::kGauge,
     "Inspected keys, by key pattern and type.",
     {"key_pattern", "type"}},
    {FamilyId::kAuditKeysWithoutTtl,
     "keyguard_audit_keys_without_ttl",
     Type::kGauge,
     "Inspected keys without a TTL, by key pattern.",
     {"key_pattern"}},
    {FamilyId::kAuditMemoryWithoutTtl,
     "keyguard_audit_memory_without_ttl_bytes",
     Type::kGauge,
     "MEMORY USAGE of keys without a TTL, by key pattern.",
     {"key_pattern"}},
    {FamilyId::kAuditColdKeys,
     "keyguard_audit_cold_keys",
     Type::kGauge,
     "Keys idle longer than audit.cold_after_seconds, by key pattern.",
     {"key_pattern"}},
    {FamilyId::kAuditNamingViolations,
     "keyguard_audit_naming_violations",
     Type::kGauge,
     "Keys breaking the key policy, each once, by the first rule it breaks (user rules first) and key pattern.",
     {"rule", "key_pattern"}},
    {FamilyId::kAuditBigKeys,
     "keyguard_audit_big_keys",
     Type::kGauge,
     "Strings and collections over the hygiene thresholds, by type and key pattern.",
     {"type", "key_pattern"}},
    {FamilyId::kAuditSerializedKeys,
     "keyguard_audit_serialized_keys",
     Type::kGauge,
     "Strings holding serialized objects, by format, suggested type and key pattern.",
     {"format", "suggestion", "key_pattern"}},
    {FamilyId::kAuditFindings,
     "keyguard_audit_findings",
     Type::kGauge,
     "Findings of the last audit, by severity.",
     {"severity"}},
};

constexpr bool FamiliesInIdOrder() {
  size_t i = 0;
  for (const Family& f : kFamilies) {
    if (static_cast<size_t>(f.id) != i++) return false;
  }
  return i == static_cast<size_t>(FamilyId::kCount);
}
static_assert(FamiliesInIdOrder(), "kFamilies must have one row per FamilyId, in FamilyId order");

// The row of family `id`.
constexpr const Family& Of(FamilyId id) { return kFamilies[static_cast<size_t>(id)]; }

}  // namespace keyguard::metrics
