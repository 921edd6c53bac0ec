// Key patterns: keys with their variable parts folded, so they can be metric labels without
// one series per key: `user:1001:profile` -> `user:{id}:profile`.
#pragma once

#include <string>
#include <string_view>

namespace keyguard::policy {

// Folds each colon-separated segment that is a number, a UUID, hex of 8 or more characters or
// longer than 24 bytes into `{id}`, and every run of digits inside other segments into `{id}`
// (`User_1001_Profile` -> `User_{id}_Profile`). Bytes outside printable ASCII become `?`.
std::string KeyPattern(std::string_view key);

}  // namespace keyguard::policy
