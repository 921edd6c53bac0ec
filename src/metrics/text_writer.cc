#include "keyguard/metrics/text_writer.h"

#include <cassert>

#include "absl/strings/str_cat.h"

namespace keyguard::metrics {

namespace {

// Length of the valid UTF-8 sequence starting at s[i], or 0 when s[i] does not start one
// (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF).
size_t Utf8Length(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = byte(i);
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return n;
}

}  // namespace

void AppendEscapedLabelValue(std::string* out, std::string_view v) {
  size_t plain = 0;  // start of the run of bytes copied as they are
  for (size_t i = 0; i < v.size();) {
    const char c = v[i];
    const char* escaped = c == '\\' ? "\\\\" : c == '"' ? "\\\"" : c == '\n' ? "\\n" : nullptr;
    size_t len = 1;
    if (escaped == nullptr && static_cast<unsigned char>(c) >= 0x80) {
      len = Utf8Length(v, i);
      if (len == 0) escaped = "\xEF\xBF\xBD";  // U+FFFD for a byte outside valid UTF-8
    }
    if (escaped == nullptr) {
      i += len;
      continue;
    }
    out->append(v.data() + plain, i - plain);
    out->append(escaped);
    plain = ++i;
  }
  out->append(v.data() + plain, v.size() - plain);
}

std::string EscapeLabelValue(std::string_view v) {
  std::string out;
  AppendEscapedLabelValue(&out, v);
  return out;
}

void AppendLabels(std::string* out, std::span<const std::string_view> names, std::span<const std::string_view> values) {
  assert(names.size() == values.size());
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out->push_back(',');
    out->append(names[i]);
    out->append("=\"");
    AppendEscapedLabelValue(out, values[i]);
    out->push_back('"');
  }
}

void TextWriter::Header(const Family& f) {
  for (std::string_view part :
       {std::string_view("# HELP "), f.name, std::string_view(" "), f.help, std::string_view("\n# TYPE "), f.name,
        std::string_view(" "), TypeName(f.type), std::string_view("\n")}) {
    out_->append(part);
  }
}

void TextWriter::Start(const Family& f, std::string_view suffix, LabelValues values, std::string_view le) {
  assert(values.size() == f.label_count());
  out_->append(f.name);
  out_->append(suffix);
  if (!values.empty() || !le.empty()) {
    out_->push_back('{');
    AppendLabels(out_, f.label_names(), values);
    if (!le.empty()) {
      out_->append(values.empty() ? "le=\"" : ",le=\"");
      out_->append(le);
      out_->push_back('"');
    }
    out_->push_back('}');
  }
  out_->push_back(' ');
}

void TextWriter::AppendNumber(uint64_t v) { absl::StrAppend(out_, v, "\n"); }

void TextWriter::AppendNumber(int64_t v) { absl::StrAppend(out_, v, "\n"); }

void TextWriter::FormattedSample(const Family& f, LabelValues values, std::string_view value) {
  Start(f, "", values, "");
  out_->append(value);
  out_->push_back('\n');
}

void TextWriter::RenderedSample(const Family& f, std::string_view labels, uint64_t value) {
  out_->append(f.name);
  if (!labels.empty()) {
    out_->push_back('{');
    out_->append(labels);
    out_->push_back('}');
  }
  out_->push_back(' ');
  AppendNumber(value);
}

void TextWriter::Bucket(const Family& f, LabelValues values, std::string_view le, uint64_t cumulative) {
  Start(f, "_bucket", values, le);
  AppendNumber(cumulative);
}

void TextWriter::HistogramSum(const Family& f, LabelValues values, std::string_view sum) {
  Start(f, "_sum", values, "");
  out_->append(sum);
  out_->push_back('\n');
}

void TextWriter::HistogramCount(const Family& f, LabelValues values, uint64_t count) {
  Start(f, "_count", values, "");
  AppendNumber(count);
}

}  // namespace keyguard::metrics
