// absl::string_view is its own type in this abseil build (not std::string_view): the one place
// that turns one view into the other, for StrCat, absl::Hash and absl's parsers.
#pragma once

#include <cstddef>
#include <cstring>
#include <string>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/string_view.h"

namespace keyguard {

inline absl::string_view AsAbsl(absl::string_view s) { return s; }
inline absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }
inline absl::string_view AsAbsl(const std::string& s) { return absl::string_view(s); }
inline absl::string_view AsAbsl(const char* s) { return absl::string_view(s); }
inline std::string_view AsStd(absl::string_view s) { return std::string_view(s.data(), s.size()); }

// Copies `n` bytes from `from` to `to` (not overlapping): 8 to 16 bytes, most keys, as two
// overlapping 8-byte moves inline, with no call.
inline void CopyBytes(char* to, const char* from, size_t n) {
  if (n >= 8 && n <= 16) {
    std::memcpy(to, from, 8);
    std::memcpy(to + n - 8, from + n - 8, 8);
  } else if (n > 0) {
    std::memcpy(to, from, n);
  }
}

// A command name as errors show it: "client" -> "CLIENT".
inline std::string Upper(std::string_view s) { return absl::AsciiStrToUpper(AsAbsl(s)); }

}  // namespace keyguard
