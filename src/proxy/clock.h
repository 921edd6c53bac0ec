// The worker's clock for deadlines, pauses and latencies: steady_clock, in nanoseconds.
#pragma once

#include <chrono>
#include <cstdint>

namespace keyguard::proxy {

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace keyguard::proxy
