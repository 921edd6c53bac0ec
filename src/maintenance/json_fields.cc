#include "maintenance/json_fields.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"

namespace keyguard::maintenance {
namespace {

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// A strict RFC 8259 reader over one text. Every method starts at `i_` and leaves `i_` after what
// it read; false means the text is not valid JSON there. Nesting is walked with an explicit
// stack, so no input can exhaust the call stack.
class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}

  size_t pos() const { return i_; }
  void SkipSpace() {
    while (i_ < s_.size() && IsSpace(s_[i_])) ++i_;
  }
  bool AtEnd() {
    SkipSpace();
    return i_ == s_.size();
  }
  bool Peek(char c) {
    SkipSpace();
    return i_ < s_.size() && s_[i_] == c;
  }
  bool Take(char c) {
    if (!Peek(c)) return false;
    ++i_;
    return true;
  }

  // A string at `i_` (after spaces); its unescaped bytes go to `out` when not null.
  bool String(std::string* out) {
    if (!Take('"')) return false;
    while (i_ < s_.size()) {
      const char c = s_[i_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return false;
      if (c != '\\') {
        if (out) out->push_back(c);
        continue;
      }
      if (i_ >= s_.size()) return false;
      const char e = s_[i_++];
      char plain = 0;
      switch (e) {
        case '"': plain = '"'; break;
        case '\\': plain = '\\'; break;
        case '/': plain = '/'; break;
        case 'b': plain = '\b'; break;
        case 'f': plain = '\f'; break;
        case 'n': plain = '\n'; break;
        case 'r': plain = '\r'; break;
        case 't': plain = '\t'; break;
        case 'u': {
          uint32_t cp;
          if (!Hex4(&cp)) return false;
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            // A high surrogate must be followed by an escaped low one: together one code point.
            uint32_t low;
            if (i_ + 1 >= s_.size() || s_[i_] != '\\' || s_[i_ + 1] != 'u') return false;
            i_ += 2;
            if (!Hex4(&low) || low < 0xDC00 || low > 0xDFFF) return false;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return false;  // a lone low surrogate has no UTF-8 form
          }
          if (out) AppendUtf8(cp, out);
          continue;
        }
        default: return false;
      }
      if (out) out->push_back(plain);
    }
    return false;
  }

  // Any value at `i_`: objects and arrays to their closing bracket.
  bool Value() {
    std::vector<char> open;  // the closing bracket of each container we are inside
    for (;;) {
      // A value starts here.
      SkipSpace();
      if (i_ >= s_.size()) return false;
      const char c = s_[i_];
      bool scalar = true;
      if (c == '{' || c == '[') {
        ++i_;
        const char close = c == '{' ? '}' : ']';
        if (Take(close)) {
          // empty: a complete value
        } else {
          open.push_back(close);
          if (close == '}' && !MemberName()) return false;
          scalar = false;
        }
      } else if (c == '"') {
        if (!String(nullptr)) return false;
      } else if (c == '-' || IsDigit(c)) {
        if (!Number()) return false;
      } else if (!Word("true") && !Word("false") && !Word("null")) {
        return false;
      }
      if (!scalar) continue;
      // A value ended: close what it completes, or go on to the next member or element.
      for (;;) {
        if (open.empty()) return true;
        if (Take(open.back())) {
          open.pop_back();
          continue;
        }
        if (!Take(',')) return false;
        if (open.back() == '}' && !MemberName()) return false;
        break;
      }
    }
  }

  // `"name":` with the name unescaped into `out` when not null.
  bool MemberName(std::string* out = nullptr) { return String(out) && Take(':'); }

 private:
  bool Hex4(uint32_t* cp) {
    if (i_ + 4 > s_.size()) return false;
    *cp = 0;
    for (int k = 0; k < 4; ++k) {
      const int d = HexDigit(s_[i_ + k]);
      if (d < 0) return false;
      *cp = *cp * 16 + static_cast<uint32_t>(d);
    }
    i_ += 4;
    return true;
  }
  bool Digits() {
    const size_t start = i_;
    while (i_ < s_.size() && IsDigit(s_[i_])) ++i_;
    return i_ > start;
  }
  bool Number() {
    if (s_[i_] == '-') ++i_;
    if (i_ < s_.size() && s_[i_] == '0') {
      ++i_;
    } else if (!Digits()) {
      return false;
    }
    if (i_ < s_.size() && s_[i_] == '.') {
      ++i_;
      if (!Digits()) return false;
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (!Digits()) return false;
    }
    return true;
  }
  bool Word(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }

  std::string_view s_;
  size_t i_ = 0;
};

// The JSON text of a valid value without the whitespace between its tokens.
std::string Compact(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  bool in_string = false;
  for (size_t i = 0; i < v.size(); ++i) {
    const char c = v[i];
    if (in_string) {
      out.push_back(c);
      if (c == '\\') {
        out.push_back(v[++i]);
      } else if (c == '"') {
        in_string = false;
      }
    } else if (!IsSpace(c)) {
      out.push_back(c);
      in_string = c == '"';
    }
  }
  return out;
}

struct Member {
  std::string name;
  std::string_view value;  // the value's text as written
};

// The members of the JSON object `text`, in order; nullopt with `*error` set otherwise.
std::optional<std::vector<Member>> Members(std::string_view text, ShapeError* error) {
  auto fail = [error](const char* reason, std::string message) {
    *error = ShapeError{reason, std::move(message)};
    return std::nullopt;
  };
  Reader r(text);
  if (!r.Peek('{')) {
    Reader whole(text);
    if (whole.Value() && whole.AtEnd()) return fail("not_object", "not a JSON object");
    return fail("not_json", "not valid JSON");
  }
  r.Take('{');
  std::vector<Member> out;
  std::set<std::string_view> seen;
  if (!r.Take('}')) {
    do {
      Member m;
      if (!r.MemberName(&m.name)) return fail("not_json", "not valid JSON");
      r.SkipSpace();
      const size_t start = r.pos();
      if (!r.Value()) return fail("not_json", "not valid JSON");
      m.value = text.substr(start, r.pos() - start);
      out.push_back(std::move(m));
    } while (r.Take(','));
    if (!r.Take('}')) return fail("not_json", "not valid JSON");
  }
  if (!r.AtEnd()) return fail("not_json", "not valid JSON");
  for (const Member& m : out) {
    if (!seen.insert(m.name).second) {
      return fail("duplicate_field", absl::StrCat("the field '", m.name, "' appears twice (one value would be lost)"));
    }
  }
  return out;
}

// A string as its text, anything else as its compact JSON text.
std::string FieldText(std::string_view value) {
  if (!value.empty() && value[0] == '"') {
    std::string text;
    Reader(value).String(&text);
    return text;
  }
  return Compact(value);
}

bool IsEmptyContainer(std::string_view value) {
  const std::string c = Compact(value);
  return c == "{}" || c == "[]";
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

std::optional<HashShape> JsonToHash(std::string_view json, bool separate_nested, ShapeError* error) {
  auto members = Members(json, error);
  if (!members) return std::nullopt;
  HashShape shape;
  for (const Member& m : *members) {
    const char first = m.value[0];
    const bool nested = first == '{' || first == '[';
    // An empty object or array cannot be a key of its own (Redis has no empty Hash): keep it as text.
    if (separate_nested && nested && !IsEmptyContainer(m.value)) {
      HashShape::SubKey sub;
      sub.suffix = m.name;
      sub.hash = first == '{';
      if (sub.hash) {
        auto inner = Members(m.value, error);
        if (!inner) {
          error->text = absl::StrCat("field '", m.name, "': ", error->text);
          return std::nullopt;
        }
        for (const Member& x : *inner) sub.fields.emplace_back(x.name, FieldText(x.value));
      } else {
        sub.text = Compact(m.value);
      }
      shape.subkeys.push_back(std::move(sub));
      continue;
    }
    shape.fields.emplace_back(m.name, FieldText(m.value));
  }
  if (shape.fields.empty()) {
    // The main Hash is the key's new home (cleanup compares against it), and Redis has no empty Hash.
    *error = shape.subkeys.empty() ? ShapeError{"empty_object", "an empty object"}
                                   : ShapeError{"no_top_level_field", "no top-level field left for the main Hash"};
    return std::nullopt;
  }
  return shape;
}

}  // namespace keyguard::maintenance
