// Inline (telnet-style) command splitting, a faithful port of Redis's sdssplitargs (sds.c) so that
// keyguard sees the same arguments Redis would for the same line.
#include <cctype>

#include "keyguard/resp/framer.h"

namespace keyguard::resp {
namespace {

bool IsHexDigit(char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; }

int HexDigitToInt(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return 0;
}

// sdssplitargs uses isspace(): space, \t, \n, \v, \f, \r.
bool IsSpace(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }

}  // namespace

bool SplitInlineArgs(std::string_view line, std::vector<std::string>* out) {
  // sdssplitargs works on a C string: a NUL byte ends the line.
  line = line.substr(0, line.find('\0'));
  size_t i = 0;
  const size_t n = line.size();
  for (;;) {
    while (i < n && IsSpace(line[i])) ++i;
    if (i >= n) return true;
    bool inq = false;   // inside "double quotes"
    bool insq = false;  // inside 'single quotes'
    bool done = false;
    std::string current;
    while (!done) {
      const char c = i < n ? line[i] : '\0';
      if (inq) {
        if (c == '\\' && i + 3 < n && line[i + 1] == 'x' && IsHexDigit(line[i + 2]) && IsHexDigit(line[i + 3])) {
          current.push_back(static_cast<char>(HexDigitToInt(line[i + 2]) * 16 + HexDigitToInt(line[i + 3])));
          i += 3;
        } else if (c == '\\' && i + 1 < n) {
          ++i;
          char e;
          switch (line[i]) {
            case 'n': e = '\n'; break;
            case 'r': e = '\r'; break;
            case 't': e = '\t'; break;
            case 'b': e = '\b'; break;
            case 'a': e = '\a'; break;
            default: e = line[i]; break;
          }
          current.push_back(e);
        } else if (c == '"') {
          // The closing quote must be followed by a space or the end of the line.
          if (i + 1 < n && !IsSpace(line[i + 1])) return false;
          done = true;
        } else if (i >= n) {
          return false;  // unterminated quotes
        } else {
          current.push_back(c);
        }
      } else if (insq) {
        if (c == '\\' && i + 1 < n && line[i + 1] == '\'') {
          ++i;
          current.push_back('\'');
        } else if (c == '\'') {
          if (i + 1 < n && !IsSpace(line[i + 1])) return false;
          done = true;
        } else if (i >= n) {
          return false;
        } else {
          current.push_back(c);
        }
      } else {
        if (i >= n) {
          done = true;
        } else {
          switch (c) {
            case ' ':
            case '\n':
            case '\r':
            case '\t':
            case '\0': done = true; break;
            case '"': inq = true; break;
            case '\'': insq = true; break;
            default: current.push_back(c); break;
          }
        }
      }
      if (i < n) ++i;
    }
    out->push_back(std::move(current));
  }
}

}  // namespace keyguard::resp
