#include "keyguard/resp/value.h"

#include <cstring>

#include "keyguard/resp/framer.h"

namespace keyguard::resp {
namespace {

constexpr int kMaxDepth = 128;

bool ParseAt(std::string_view in, size_t* pos, Value* out, int depth) {
  if (depth > kMaxDepth || *pos >= in.size()) return false;
  const size_t crlf = in.find("\r\n", *pos);
  if (crlf == std::string_view::npos) return false;
  const char t = in[*pos];
  const std::string_view line = in.substr(*pos + 1, crlf - *pos - 1);
  *pos = crlf + 2;
  if (t == '|') {
    int64_t n;
    if (!ParseRedisInt(line, &n) || n < 0) return false;
    out->attributes.resize(static_cast<size_t>(n) * 2);
    for (Value& v : out->attributes) {
      if (!ParseAt(in, pos, &v, depth + 1)) return false;
    }
    return ParseAt(in, pos, out, depth);
  }
  out->type = t;
  switch (t) {
    case '+': case '-': case '(': case ',': case '#':
      out->text = line;
      return true;
    case '_':
      out->null = true;
      return line.empty();
    case ':':
      out->text = line;
      return ParseRedisInt(line, &out->integer);
    case '$': case '!': case '=': {
      int64_t n;
      if (!ParseRedisInt(line, &n)) return false;
      if (n == -1 && t == '$') {
        out->null = true;
        return true;
      }
      if (n < 0 || in.size() - *pos < static_cast<size_t>(n) + 2) return false;
      out->text = in.substr(*pos, static_cast<size_t>(n));
      *pos += static_cast<size_t>(n) + 2;
      return true;
    }
    case '*': case '~': case '%': case '>': {
      int64_t n;
      if (!ParseRedisInt(line, &n)) return false;
      if (n == -1 && t == '*') {
        out->null = true;
        return true;
      }
      if (n < 0) return false;
      const int64_t count = t == '%' ? n * 2 : n;
      if (static_cast<uint64_t>(count) > in.size()) return false;
      out->elements.resize(static_cast<size_t>(count));
      for (Value& v : out->elements) {
        if (!ParseAt(in, pos, &v, depth + 1)) return false;
      }
      return true;
    }
    default:
      return false;
  }
}

}  // namespace

std::optional<Value> ParseValue(std::string_view frame) {
  Value v;
  size_t pos = 0;
  if (!ParseAt(frame, &pos, &v, 0) || pos != frame.size()) return std::nullopt;
  return v;
}

}  // namespace keyguard::resp
