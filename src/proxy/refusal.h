// Why keyguard answers a command itself instead of forwarding it: the `reason` label of
// keyguard_commands_rejected_total and keyguard_tenant_rejected_total.
#pragma once

#include <cstddef>
#include <cstdint>

namespace keyguard::proxy {

enum class Refusal : uint8_t {
  kNoAuth,          // tenancy: not authenticated yet
  kAuth,            // tenancy: AUTH/HELLO refused (wrong password, ...)
  kTenant,          // tenancy: the command cannot be confined to the tenant
  kUnknownCommand,  // reject_unknown_commands
  kDenyList,        // deny_commands
  kKeyPolicy,       // a key_policy rule (or key_policy.scripts) rejects it
  kHygiene,         // a hygiene rule rejects it
  kCluster,         // a Redis Cluster upstream cannot serve it (CROSSSLOT, ...)
  kCount,
};
inline constexpr size_t kRefusalCount = static_cast<size_t>(Refusal::kCount);

// The label value, e.g. "key_policy".
inline const char* RefusalName(Refusal r) {
  constexpr const char* kNames[] = {"noauth",    "auth",       "tenant",  "unknown_command",
                                    "deny_list", "key_policy", "hygiene", "cluster"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == kRefusalCount);
  return kNames[static_cast<size_t>(r)];
}

}  // namespace keyguard::proxy
