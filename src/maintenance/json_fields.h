// JSON helpers for audit and migrate: how deep a (possibly truncated) JSON text nests, and a
// JSON object's top-level fields as Hash fields.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace keyguard::maintenance {

// The deepest nesting of objects and arrays in `text`, counting only brackets outside strings:
// `{"a":1}` is 1, `{"a":{"b":[1]}}` is 3. Works on a prefix cut anywhere (it counts what it saw).
int JsonDepth(std::string_view text);

using Fields = std::vector<std::pair<std::string, std::string>>;

// What JSON_TO_HASH writes for one JSON object.
struct HashShape {
  Fields fields;  // the main Hash, in the object's order
  // With separate nested keys: `<new key>:<field>` per nested value.
  struct SubKey {
    std::string suffix;  // the field name
    bool hash = false;   // an object becomes a Hash (fields), an array a string (text)
    Fields fields;
    std::string text;
  };
  std::vector<SubKey> subkeys;
};

// Why a value cannot be re-shaped: a short reason for counters ("not_json", "not_object",
// "empty_object", "duplicate_field", "no_top_level_field") and a sentence for people.
struct ShapeError {
  std::string reason;
  std::string text;
};

// Splits a JSON object into Hash fields, exactly: a string value is stored as its unescaped text;
// any other value as its JSON text as written, byte for byte, with only the whitespace between
// tokens removed (`12345678901234567890123`, `88.36768`, `-0`, `1E400`, `true`, `null`,
// `{"a":[1,2.50]}`), or, with `separate_nested`, as a SubKey (an object's members by the same rule).
// No number is converted and no escape re-encoded, so the Hash holds what the JSON said.
// nullopt with `*error` set when `json` is not valid JSON (RFC 8259; string bytes need not be
// UTF-8 and are kept as they are), not a JSON object, an object that repeats a field name (one of
// the values would be lost), or an object that leaves the main Hash without a field.
std::optional<HashShape> JsonToHash(std::string_view json, bool separate_nested, ShapeError* error);

}  // namespace keyguard::maintenance
