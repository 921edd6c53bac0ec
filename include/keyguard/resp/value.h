// A parsed RESP value tree with views into the frame's bytes, for the replies keyguard has to look
// inside (and for tests). The forwarding path never builds one: it moves frames as bytes.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace keyguard::resp {

// Levels of aggregates ParseValue parses; deeper ones it keeps as their bytes (see `unparsed`), so
// that neither parsing, nor encoding, nor destroying a Value recurses more than this, however deep
// the reply. Every reply keyguard looks inside has its keys and channels within 3 levels.
constexpr int kMaxParseDepth = 32;

struct Value {
  char type = 0;      // the RESP type byte: + - : $ * _ , # ! = ( % ~ >
  bool null = false;  // $-1 / *-1 / _
  // An aggregate nested kMaxParseDepth levels deep: not parsed; `text` is all of its bytes (with
  // an attribute before it, if any) and `type` their first byte.
  bool unparsed = false;
  std::string_view text;          // payload of bulk/verbatim/blob error, line of simple types
  int64_t integer = 0;            // for ':'
  std::vector<Value> elements;    // aggregates; a map holds key, value, key, value, ...
  std::vector<Value> attributes;  // from the '|'s before the value, key, value, ...
};

// Parses one complete frame (as delimited by ReplyFramer). Views point into `frame`.
// Returns nullopt if `frame` is not exactly one well-formed value.
std::optional<Value> ParseValue(std::string_view frame);

// A map's value of `name` (ASCII case ignored), or nullptr: `map` a RESP3 map or a RESP2 flat
// [name, value, name, value, ...] array, as both hold their elements.
const Value* FieldOf(const Value& map, std::string_view name);

}  // namespace keyguard::resp
