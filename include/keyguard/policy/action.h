// What keyguard does about a broken rule: the key policy's rules and the hygiene rules share it.
#pragma once

#include <cstdint>

namespace keyguard::policy {

enum class Action : uint8_t { kObserve, kWarn, kRewrite, kReject };

// "observe", "warn", "rewrite", "reject".
inline const char* ActionName(Action a) {
  switch (a) {
    case Action::kObserve: return "observe";
    case Action::kWarn: return "warn";
    case Action::kRewrite: return "rewrite";
    case Action::kReject: return "reject";
  }
  return "observe";
}

}  // namespace keyguard::policy
