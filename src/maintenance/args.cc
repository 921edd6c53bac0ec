#include "maintenance/args.h"

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace keyguard::maintenance {

absl::StatusOr<int64_t> Args::Int(std::string_view name, int64_t fallback, int64_t lo, int64_t hi) const {
  auto it = flags.find(name);
  if (it == flags.end()) return fallback;
  int64_t v;
  if (!absl::SimpleAtoi(it->second, &v) || v < lo || v > hi) {
    return absl::InvalidArgumentError(absl::StrCat(it->first, ": expected an integer in ", lo, "..", hi));
  }
  return v;
}

absl::StatusOr<double> Args::Double(std::string_view name, double fallback, double lo, double hi) const {
  auto it = flags.find(name);
  if (it == flags.end()) return fallback;
  double v;
  if (!absl::SimpleAtod(it->second, &v) || v < lo || v > hi) {
    return absl::InvalidArgumentError(absl::StrCat(it->first, ": expected a number in ", lo, "..", hi));
  }
  return v;
}

std::string Args::Str(std::string_view name, std::string_view fallback) const {
  auto it = flags.find(name);
  return it == flags.end() ? std::string(fallback) : it->second;
}

namespace {
std::atomic<bool> stop_requested{false};
void RequestStop(int) { stop_requested = true; }
}  // namespace

int UsageError(std::string_view tool, std::string_view message) {
  std::fprintf(stderr, "%.*s: %.*s\n", static_cast<int>(tool.size()), tool.data(), static_cast<int>(message.size()),
               message.data());
  return 2;
}

void CatchStopSignals() {
  std::signal(SIGINT, RequestStop);
  std::signal(SIGTERM, RequestStop);
}

bool StopRequested() { return stop_requested; }

absl::StatusOr<Args> ParseArgs(const std::vector<std::string>& args, std::initializer_list<std::string_view> valued,
                               std::initializer_list<std::string_view> switches) {
  Args out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) {
      out.positional.push_back(a);
      continue;
    }
    std::string name = a, value;
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
    }
    if (std::find(switches.begin(), switches.end(), name) != switches.end()) {
      if (eq != std::string::npos) return absl::InvalidArgumentError(absl::StrCat(name, " takes no value"));
      out.flags[name] = "";
      continue;
    }
    if (std::find(valued.begin(), valued.end(), name) == valued.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag '", name, "'"));
    }
    if (eq == std::string::npos) {
      if (i + 1 >= args.size()) return absl::InvalidArgumentError(absl::StrCat(name, " needs a value"));
      value = args[++i];
    }
    out.flags[name] = value;
  }
  return out;
}

}  // namespace keyguard::maintenance
