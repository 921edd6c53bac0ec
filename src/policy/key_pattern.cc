#include "keyguard/policy/key_pattern.h"

namespace keyguard::policy {
namespace {

bool IsHex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

bool Opaque(std::string_view s) {
  if (s.empty()) return false;
  if (s.size() > 24) return true;
  bool all_digits = true, all_hex = true, has_digit = false;
  for (char c : s) {
    all_digits &= IsDigit(c);
    all_hex &= IsHex(c);
    has_digit |= IsDigit(c);
  }
  if (all_digits) return true;
  if (all_hex && s.size() >= 8 && has_digit) return true;
  // UUID: 8-4-4-4-12 hex digits.
  if (s.size() == 36 && s[8] == '-' && s[13] == '-' && s[18] == '-' && s[23] == '-') {
    for (size_t i = 0; i < s.size(); ++i) {
      if (i != 8 && i != 13 && i != 18 && i != 23 && !IsHex(s[i])) return false;
    }
    return true;
  }
  return false;
}

}  // namespace

std::string KeyPattern(std::string_view key) {
  std::string out;
  out.reserve(key.size());
  size_t start = 0;
  for (;;) {
    const size_t end = key.find(':', start);
    const std::string_view seg =
        key.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
    if (Opaque(seg)) {
      out += "{id}";
    } else {
      for (size_t i = 0; i < seg.size(); ++i) {
        const unsigned char c = seg[i];
        if (IsDigit(c)) {
          while (i + 1 < seg.size() && IsDigit(seg[i + 1])) ++i;
          out += "{id}";
        } else {
          out.push_back(c >= 0x20 && c < 0x7f && c != '"' && c != '\\' ? static_cast<char>(c) : '?');
        }
      }
    }
    if (end == std::string_view::npos) break;
    out.push_back(':');
    start = end + 1;
  }
  return out;
}

}  // namespace keyguard::policy
