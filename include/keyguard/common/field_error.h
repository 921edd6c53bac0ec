// Configuration errors name the field they are about: "key_policy.rules[1].pattern: ...".
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "keyguard/common/views.h"

namespace keyguard {

template <typename Path, typename What>
absl::Status FieldError(const Path& path, const What& what) {
  return absl::InvalidArgumentError(absl::StrCat(AsAbsl(path), ": ", AsAbsl(what)));
}

}  // namespace keyguard
