// keyguard's logs are JSON lines and nothing else: one escaper for string values and one builder
// for event lines, used by every place that logs.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace keyguard {

// The body of a JSON string for `in` (quotes and backslashes escaped, other bytes outside
// printable ASCII as \u00XX): always valid JSON, whatever the bytes (control characters, invalid
// UTF-8), and reversible (the decoded string's code points are the original bytes: Python's
// `s.encode("latin-1")`). The one JSON escaper of the code base.
std::string JsonEscape(std::string_view in);
// The same in double quotes: a whole JSON string value.
std::string JsonString(std::string_view in);

// One log event: {"level":...,"event":...,<fields>}. Keys are keyguard's own (not escaped).
//   EventLine("error", "config_reload_failed").Str("trigger", t).Int("version", v).Write(stderr);
class EventLine {
 public:
  EventLine(std::string_view level, std::string_view event);
  EventLine& Str(std::string_view key, std::string_view value);
  EventLine& Int(std::string_view key, int64_t value);
  // A value that is already JSON (an object, a number, true/false).
  EventLine& Raw(std::string_view key, std::string_view json);
  // The line without its newline.
  std::string Text() const { return line_ + "}"; }
  // The line and a newline in one write; flushed (a log pipeline reads it at once).
  void Write(std::FILE* out) const;

 private:
  std::string line_;
};

}  // namespace keyguard
