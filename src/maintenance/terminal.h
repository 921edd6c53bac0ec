// What the maintenance commands show people: key names made safe for a terminal line, and a
// progress report (keys done, rate, ETA) on stderr.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace keyguard::maintenance {

// Key names may hold any bytes: printable ASCII as is, the rest (and backslash) as \xHH, so one
// key is always one line.
std::string Printable(std::string_view s);

// Progress of a walk over `total` keys (DBSIZE; <= 0: unknown). On a terminal one line is
// redrawn in place; otherwise (a log, CI) a full line is written every `interval` (zero: at every
// Show). Off: nothing is written.
class Progress {
 public:
  enum class Mode { kOff, kTerminal, kLines };
  Progress(Mode mode, std::string label, int64_t total, std::chrono::milliseconds interval = std::chrono::seconds(10));
  void Show(uint64_t done);
  // Clears the terminal line.
  void Done();

 private:
  Mode mode_;
  std::string label_;
  int64_t total_;
  std::chrono::milliseconds interval_;
  std::chrono::steady_clock::time_point start_, last_;
  bool shown_ = false;
};

}  // namespace keyguard::maintenance
