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

// Splits a JSON object into Hash fields: a string value is stored as its text, any other scalar
// as its JSON text (`36`, `true`, `null`), an object or array as its JSON text, or, with
// `separate_nested`, as a SubKey. nullopt with `*error` set when `json` is not a JSON object
// or the main Hash would have no field (`{}`, or only nested values kept
// separately).
std::optional<HashShape> JsonToHash(std::string_view json, bool separate_nested, std::string* error);

}  // namespace keyguard::maintenance
