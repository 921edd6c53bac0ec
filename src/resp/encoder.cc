#include "keyguard/resp/encoder.h"

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "keyguard/resp/value.h"

namespace keyguard::resp {
namespace {

void AppendLine(std::string* out, char type, std::string_view text) {
  out->push_back(type);
  const size_t start = out->size();
  out->append(text);
  for (size_t i = start; i < out->size(); ++i) {
    if ((*out)[i] == '\r' || (*out)[i] == '\n') (*out)[i] = ' ';
  }
  out->append("\r\n");
}

void AppendHeader(std::string* out, char type, int64_t n) {
  char buf[32];
  buf[0] = type;
  char* end = absl::numbers_internal::FastIntToBuffer(n, buf + 1);
  end[0] = '\r';
  end[1] = '\n';
  out->append(buf, end + 2 - buf);
}

}  // namespace

void AppendError(std::string* out, std::string_view text) { AppendLine(out, '-', text); }
void AppendSimple(std::string* out, std::string_view text) { AppendLine(out, '+', text); }
void AppendInteger(std::string* out, int64_t value) { AppendHeader(out, ':', value); }

void AppendBulk(std::string* out, std::string_view value) {
  AppendHeader(out, '$', static_cast<int64_t>(value.size()));
  out->append(value);
  out->append("\r\n");
}

char* WriteBulk(char* out, std::string_view value) {
  out[0] = '$';
  char* p = absl::numbers_internal::FastIntToBuffer(static_cast<uint64_t>(value.size()), out + 1);
  p[0] = '\r';
  p[1] = '\n';
  p += 2;
  if (!value.empty()) std::memcpy(p, value.data(), value.size());
  p += value.size();
  p[0] = '\r';
  p[1] = '\n';
  return p + 2;
}

void AppendNullBulk(std::string* out) { out->append("$-1\r\n"); }
void AppendArrayHeader(std::string* out, int64_t count) { AppendHeader(out, '*', count); }

void AppendCommand(std::string* out, std::span<const std::string_view> args) {
  AppendArrayHeader(out, static_cast<int64_t>(args.size()));
  for (std::string_view a : args) AppendBulk(out, a);
}

char* WriteCommand(char* out, std::span<const std::string_view> args) {
  out[0] = '*';
  char* p = absl::numbers_internal::FastIntToBuffer(static_cast<uint64_t>(args.size()), out + 1);
  p[0] = '\r';
  p[1] = '\n';
  p += 2;
  for (std::string_view a : args) p = WriteBulk(p, a);
  return p;
}

size_t CommandBound(std::span<const std::string_view> args) {
  size_t n = kBulkOverhead;  // the header: '*', at most 20 digits, CRLF
  for (std::string_view a : args) n += a.size() + kBulkOverhead;
  return n;
}

void AppendValue(std::string* out, const Value& v) {
  if (v.unparsed) {
    out->append(v.text);
    return;
  }
  if (!v.attributes.empty()) {
    AppendHeader(out, '|', static_cast<int64_t>(v.attributes.size() / 2));
    for (const Value& a : v.attributes) AppendValue(out, a);
  }
  switch (v.type) {
    case '$':
    case '!':
    case '=':
      if (v.null) {
        out->append("$-1\r\n");
        return;
      }
      AppendHeader(out, v.type, static_cast<int64_t>(v.text.size()));
      out->append(v.text);
      out->append("\r\n");
      return;
    case '*':
    case '~':
    case '%':
    case '>':
      if (v.null) {
        out->append("*-1\r\n");
        return;
      }
      AppendHeader(out, v.type, static_cast<int64_t>(v.type == '%' ? v.elements.size() / 2 : v.elements.size()));
      for (const Value& e : v.elements) AppendValue(out, e);
      return;
    case '_': out->append("_\r\n"); return;
    default:  // + - : , # ( : the line as it came
      out->push_back(v.type);
      out->append(v.text);
      out->append("\r\n");
      return;
  }
}

}  // namespace keyguard::resp
