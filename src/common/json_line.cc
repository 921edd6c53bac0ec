#include "keyguard/common/json_line.h"

#include "absl/strings/str_cat.h"

namespace keyguard {

std::string JsonEscape(std::string_view in) {
  std::string out;
  out.reserve(in.size());
  for (unsigned char c : in) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c < 0x20 || c >= 0x7f) {
      absl::StrAppend(&out, "\\u00", absl::Hex(c, absl::kZeroPad2));
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

std::string JsonString(std::string_view in) { return absl::StrCat("\"", JsonEscape(in), "\""); }

EventLine::EventLine(std::string_view level, std::string_view event) {
  line_ = "{\"level\":" + JsonString(level) + ",\"event\":" + JsonString(event);
}

EventLine& EventLine::Str(std::string_view key, std::string_view value) {
  line_.append(",\"").append(key).append("\":").append(JsonString(value));
  return *this;
}

EventLine& EventLine::Int(std::string_view key, int64_t value) {
  line_.append(",\"").append(key).append("\":").append(std::to_string(value));
  return *this;
}

EventLine& EventLine::Raw(std::string_view key, std::string_view json) {
  line_.append(",\"").append(key).append("\":").append(json);
  return *this;
}

void EventLine::Write(std::FILE* out) const {
  const std::string text = line_ + "}\n";
  std::fwrite(text.data(), 1, text.size(), out);
  std::fflush(out);
}

}  // namespace keyguard
