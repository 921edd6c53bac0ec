// Configuration errors name the field they are about: "key_policy.rules[1].pattern: ...".
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace keyguard {

// absl::string_view is its own type in this abseil build: one view type for StrCat.
inline absl::string_view AsAbsl(absl::string_view s) { return s; }
inline absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }
inline absl::string_view AsAbsl(const std::string& s) { return absl::string_view(s); }
inline absl::string_view AsAbsl(const char* s) { return absl::string_view(s); }

template <typename Path, typename What>
absl::Status FieldError(const Path& path, const What& what) {
  return absl::InvalidArgumentError(absl::StrCat(AsAbsl(path), ": ", AsAbsl(what)));
}

}  // namespace keyguard
