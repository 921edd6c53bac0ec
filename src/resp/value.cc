#include "keyguard/resp/value.h"

#include <cstring>

#include "absl/strings/match.h"
#include "keyguard/resp/framer.h"

namespace keyguard::resp {
namespace {

// Keeps the value at *pos, an aggregate with any attributes before it, as its bytes: the framer
// finds where it ends without recursing.
bool ParseUnparsed(std::string_view in, size_t* pos, Value* out) {
  Limits limits;
  limits.max_bulk_len = static_cast<int64_t>(in.size());  // any bulk that fits in the frame
  ReplyFramer framer(limits);
  if (framer.Next(in.data() + *pos, in.size() - *pos) != Status::kOk) return false;
  out->type = in[*pos];
  out->unparsed = true;
  out->text = in.substr(*pos, framer.consumed());
  *pos += framer.consumed();
  return true;
}

bool ParseAt(std::string_view in, size_t* pos, Value* out, int depth) {
  char t;
  std::string_view line;
  for (;;) {
    if (*pos >= in.size()) return false;
    t = in[*pos];
    if (depth >= kMaxParseDepth && (t == '*' || t == '~' || t == '%' || t == '>' || t == '|')) {
      return ParseUnparsed(in, pos, out);
    }
    const size_t crlf = in.find("\r\n", *pos);
    if (crlf == std::string_view::npos) return false;
    line = in.substr(*pos + 1, crlf - *pos - 1);
    *pos = crlf + 2;
    if (t != '|') break;
    // An attribute: its pairs, then the value it annotates (or another attribute) follows.
    int64_t n;
    if (!ParseRedisInt(line, &n) || n < 0 || static_cast<uint64_t>(n) > in.size()) return false;
    const size_t first = out->attributes.size();
    out->attributes.resize(first + static_cast<size_t>(n) * 2);
    for (size_t i = first; i < out->attributes.size(); ++i) {
      if (!ParseAt(in, pos, &out->attributes[i], depth + 1)) return false;
    }
  }
  out->type = t;
  switch (t) {
    case '+':
    case '-':
    case '(':
    case ',':
    case '#': out->text = line; return true;
    case '_': out->null = true; return line.empty();
    case ':': out->text = line; return ParseRedisInt(line, &out->integer);
    case '$':
    case '!':
    case '=': {
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
    case '*':
    case '~':
    case '%':
    case '>': {
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
    default: return false;
  }
}

}  // namespace

std::optional<Value> ParseValue(std::string_view frame) {
  Value v;
  size_t pos = 0;
  if (!ParseAt(frame, &pos, &v, 0) || pos != frame.size()) return std::nullopt;
  return v;
}

const Value* FieldOf(const Value& map, std::string_view name) {
  for (size_t i = 0; i + 1 < map.elements.size(); i += 2) {
    const std::string_view key = map.elements[i].text;
    if (key.size() == name.size() && absl::EqualsIgnoreCase(absl::string_view(key.data(), key.size()),
                                                            absl::string_view(name.data(), name.size()))) {
      return &map.elements[i + 1];
    }
  }
  return nullptr;
}

}  // namespace keyguard::resp
