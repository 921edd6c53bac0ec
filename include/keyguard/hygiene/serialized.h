// Recognising serialized objects stored in strings, and cheap fingerprints of a JSON object's
// top-level fields (hashes, never copies of values) to tell how many fields an update changed.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "keyguard/common/fnv.h"

namespace keyguard::hygiene {

enum class Format : uint8_t { kNone, kJsonObject, kJsonArray, kMessagePack, kJavaSerialized, kPickle, kPhpSerialize };
const char* FormatName(Format f);

namespace detail {
extern const std::array<bool, 256> kMayStartSerialized;  // by first byte: whether any Format may follow
Format DetectFormatSlow(std::string_view value);
}  // namespace detail

// What kind of serialized object `value` holds, from its first bytes (and, for JSON, its last).
// Most values are told apart by their first byte alone, inline (every GET reply and SET value
// goes through here).
inline Format DetectFormat(std::string_view value) {
  if (value.size() < 2 || !detail::kMayStartSerialized[static_cast<unsigned char>(value[0])]) return Format::kNone;
  return detail::DetectFormatSlow(value);
}

// For a JSON object: appends (hash of field name, hash of the field's raw value text) per
// top-level field. Returns false when `json` is not a well-formed top-level object.
bool JsonTopLevelFields(std::string_view json, std::vector<std::pair<uint64_t, uint64_t>>* out);

// FNV-1a 64's offset basis: the fingerprint of nothing.
using keyguard::kFnvBasis;
// FNV-1a 64 of `bytes`; pass a previous result as `h` to hash a concatenation in parts.
uint64_t Fingerprint(std::string_view bytes, uint64_t h = kFnvBasis);

}  // namespace keyguard::hygiene
