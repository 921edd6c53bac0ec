// Command-line flags of keyguard and its subcommands: `--name value`, `--name=value`, bare
// switches and positional words, with errors that name the flag.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace keyguard::maintenance {

struct Args {
  std::map<std::string, std::string, std::less<>> flags;  // valued flags, and switches as ""
  std::vector<std::string> positional;

  bool Has(std::string_view name) const { return flags.find(name) != flags.end(); }
  // The flag's value as an integer in [lo, hi], or `fallback` when absent.
  absl::StatusOr<int64_t> Int(std::string_view name, int64_t fallback, int64_t lo, int64_t hi) const;
  absl::StatusOr<double> Double(std::string_view name, double fallback, double lo, double hi) const;
  std::string Str(std::string_view name, std::string_view fallback = "") const;
};

// Writes "<tool>: <message>" to stderr, for people, and returns 2: the exit code of a usage,
// config or connection error.
int UsageError(std::string_view tool, std::string_view message);

// SIGINT and SIGTERM no longer end the process: a walk over the keyspace finishes its batch,
// reports, and prints where to resume. StopRequested() says whether one arrived.
void CatchStopSignals();
bool StopRequested();

absl::StatusOr<Args> ParseArgs(const std::vector<std::string>& args, std::initializer_list<std::string_view> valued,
                               std::initializer_list<std::string_view> switches);

}  // namespace keyguard::maintenance
