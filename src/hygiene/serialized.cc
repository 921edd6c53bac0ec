#include "keyguard/hygiene/serialized.h"

#include <array>

namespace keyguard::hygiene {
namespace {

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

// Skips one JSON value starting at s[i] (after whitespace); returns the index after it, or npos.
size_t SkipValue(std::string_view s, size_t i) {
  while (i < s.size() && IsSpace(s[i])) ++i;
  if (i >= s.size()) return std::string_view::npos;
  if (s[i] == '"') {
    for (++i; i < s.size(); ++i) {
      if (s[i] == '\\') {
        ++i;
      } else if (s[i] == '"') {
        return i + 1;
      }
    }
    return std::string_view::npos;
  }
  if (s[i] == '{' || s[i] == '[') {
    int depth = 0;
    for (; i < s.size(); ++i) {
      const char c = s[i];
      if (c == '"') {
        const size_t end = SkipValue(s, i);
        if (end == std::string_view::npos) return end;
        i = end - 1;
      } else if (c == '{' || c == '[') {
        ++depth;
      } else if (c == '}' || c == ']') {
        if (--depth == 0) return i + 1;
      }
    }
    return std::string_view::npos;
  }
  // A number, true, false or null: up to the next delimiter.
  const size_t start = i;
  while (i < s.size() && s[i] != ',' && s[i] != '}' && s[i] != ']' && !IsSpace(s[i])) ++i;
  return i > start ? i : std::string_view::npos;
}

}  // namespace

uint64_t Fingerprint(std::string_view bytes, uint64_t h) { return Fnv1a(bytes, h); }

const char* FormatName(Format f) {
  switch (f) {
    case Format::kJsonObject: return "json_object";
    case Format::kJsonArray: return "json_array";
    case Format::kMessagePack: return "messagepack";
    case Format::kJavaSerialized: return "java_serialized";
    case Format::kPickle: return "python_pickle";
    case Format::kPhpSerialize: return "php_serialize";
    case Format::kNone: break;
  }
  return "none";
}

namespace detail {

// The first bytes DetectFormatSlow can answer anything but kNone for (whitespace: JSON after it).
constexpr std::array<bool, 256> MayStartSerialized() {
  std::array<bool, 256> t{};
  for (int b :
       {0xAC, 0x80, 0xDE, 0xDF, int{'a'}, int{'O'}, int{'{'}, int{'['}, int{' '}, int{'\t'}, int{'\n'}, int{'\r'}}) {
    t[static_cast<size_t>(b)] = true;
  }
  for (size_t b = 0x81; b <= 0x8F; ++b) t[b] = true;
  return t;
}
constinit const std::array<bool, 256> kMayStartSerialized = MayStartSerialized();

Format DetectFormatSlow(std::string_view value) {
  if (value.size() < 2) return Format::kNone;
  const unsigned char b0 = value[0], b1 = value[1];
  if (b0 == 0xAC && b1 == 0xED) return Format::kJavaSerialized;  // STREAM_MAGIC
  if (b0 == 0x80 && b1 >= 2 && b1 <= 5) return Format::kPickle;  // PROTO opcode
  if ((b0 >= 0x81 && b0 <= 0x8F) || b0 == 0xDE || b0 == 0xDF) {  // fixmap, map16/32
    return value.size() >= 3 ? Format::kMessagePack : Format::kNone;
  }
  if ((b0 == 'a' || b0 == 'O') && b1 == ':' && value.find(":{") != std::string_view::npos && value.back() == '}') {
    return Format::kPhpSerialize;  // a:2:{...} O:8:"Foo":1:{...}
  }
  const std::string_view t = Trim(value);
  if (t.size() >= 2 && t.front() == '{' && t.back() == '}') return Format::kJsonObject;
  if (t.size() >= 2 && t.front() == '[' && t.back() == ']') return Format::kJsonArray;
  return Format::kNone;
}

}  // namespace detail

bool JsonTopLevelFields(std::string_view json, std::vector<std::pair<uint64_t, uint64_t>>* out) {
  const std::string_view s = Trim(json);
  if (s.size() < 2 || s.front() != '{' || s.back() != '}') return false;
  size_t i = 1;
  bool first = true;
  for (;;) {
    while (i < s.size() && IsSpace(s[i])) ++i;
    if (first && i < s.size() && s[i] == '}') return i + 1 == s.size();  // {}
    first = false;
    if (i >= s.size() || s[i] != '"') return false;
    const size_t name_end = SkipValue(s, i);
    if (name_end == std::string_view::npos) return false;
    const std::string_view name = s.substr(i, name_end - i);
    i = name_end;
    while (i < s.size() && IsSpace(s[i])) ++i;
    if (i >= s.size() || s[i] != ':') return false;
    ++i;
    while (i < s.size() && IsSpace(s[i])) ++i;
    const size_t value_end = SkipValue(s, i);
    if (value_end == std::string_view::npos) return false;
    out->emplace_back(Fingerprint(name), Fingerprint(s.substr(i, value_end - i)));
    i = value_end;
    while (i < s.size() && IsSpace(s[i])) ++i;
    if (i < s.size() && s[i] == ',') {
      ++i;
      continue;
    }
    if (i < s.size() && s[i] == '}') return i + 1 == s.size();
    return false;
  }
}

}  // namespace keyguard::hygiene
