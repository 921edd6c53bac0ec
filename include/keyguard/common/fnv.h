// FNV-1a, 64-bit: the one hash of short names used for lookups and fingerprints (the command
// table's name index, the detectors' key fingerprints). Not for anything an attacker may choose
// to collide where a collision costs more than a lookup.
#pragma once

#include <cstdint>
#include <string_view>

namespace keyguard {

inline constexpr uint64_t kFnvBasis = 1469598103934665603ull;
inline constexpr uint64_t kFnvPrime = 1099511628211ull;

// Continues the hash `h` over `bytes` (a seed other than kFnvBasis gives another family).
constexpr uint64_t Fnv1a(std::string_view bytes, uint64_t h = kFnvBasis) {
  for (unsigned char c : bytes) h = (h ^ c) * kFnvPrime;
  return h;
}

}  // namespace keyguard
