// absl::string_view is its own type in this abseil build (not std::string_view): the one place
// that turns one view into the other, for StrCat, absl::Hash and absl's parsers.
#pragma once

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

// A command name as errors show it: "client" -> "CLIENT".
inline std::string Upper(std::string_view s) { return absl::AsciiStrToUpper(AsAbsl(s)); }

}  // namespace keyguard
