#include "maintenance/json_fields.h"

#include <algorithm>

#include <nlohmann/json.hpp>

namespace keyguard::maintenance {
namespace {

using Json = nlohmann::ordered_json;

// Strings as their text, everything else as compact JSON.
std::string FieldText(const Json& v) {
  if (v.is_string()) return v.get<std::string>();
  return v.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace

int JsonDepth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

std::optional<HashShape> JsonToHash(std::string_view json, bool separate_nested, std::string* error) {
  Json doc = Json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    *error = "not valid JSON";
    return std::nullopt;
  }
  if (!doc.is_object()) {
    *error = "not a JSON object";
    return std::nullopt;
  }
  HashShape shape;
  for (const auto& [name, value] : doc.items()) {
    const bool nested = value.is_object() || value.is_array();
    // An empty object or array cannot be a key of its own (Redis has no empty Hash): keep it as text.
    if (separate_nested && nested && !value.empty()) {
      HashShape::SubKey sub;
      sub.suffix = name;
      sub.hash = value.is_object();
      if (sub.hash) {
        for (const auto& [sub_name, sub_value] : value.items()) sub.fields.emplace_back(sub_name, FieldText(sub_value));
      } else {
        sub.text = FieldText(value);
      }
      shape.subkeys.push_back(std::move(sub));
      continue;
    }
    shape.fields.emplace_back(name, FieldText(value));
  }
  if (shape.fields.empty()) {
    // The main Hash marks the key as migrated (copy skips a key whose Hash exists), and Redis has
    // no empty Hash.
    *error = shape.subkeys.empty() ? "an empty object" : "no top-level field left for the main Hash";
    return std::nullopt;
  }
  return shape;
}

}  // namespace keyguard::maintenance
