// The one writer of Prometheus text exposition (format 0.0.4) in keyguard: HELP and TYPE lines
// from the family table, samples with label names from the table and label values escaped by one
// rule. Every place that writes exposition text (the registry, the hot-key board, the config
// store's collector, the audit report) goes through it.
#pragma once

#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "keyguard/metrics/families.h"

namespace keyguard::metrics {

// Appends `v` as a label value's text between its quotes: backslash, double quote and newline
// escaped (\\, \", \n) as the format requires, and every byte that is not part of valid UTF-8
// replaced by U+FFFD, since Prometheus rejects a scrape holding a label value that is not UTF-8.
void AppendEscapedLabelValue(std::string* out, std::string_view v);
std::string EscapeLabelValue(std::string_view v);

// Appends `a="x",b="y"` (no braces) for label names and values of equal count.
void AppendLabels(std::string* out, std::span<const std::string_view> names, std::span<const std::string_view> values);

using LabelValues = std::span<const std::string_view>;

// Appends to a string the caller owns. `values` always holds one value per label name of the
// family, in the table's order (checked with assert).
class TextWriter {
 public:
  explicit TextWriter(std::string* out) : out_(out) {}

  // `# HELP name help` and `# TYPE name type`, once per family, before its samples.
  void Header(const Family& f);

  // `name{labels} value`.
  template <std::integral T>
  void Sample(const Family& f, LabelValues values, T value) {
    Start(f, "", values, "");
    AppendNumber(value);
  }
  template <std::integral T>
  void Sample(const Family& f, std::initializer_list<std::string_view> values, T value) {
    Sample(f, LabelValues(values.begin(), values.size()), value);
  }
  // A value the caller formatted (a float at its own precision).
  void FormattedSample(const Family& f, LabelValues values, std::string_view value);

  // A sample whose label text AppendLabels rendered (series merged and ordered by that text).
  void RenderedSample(const Family& f, std::string_view labels, uint64_t value);

  // Histogram lines: `name_bucket{labels,le="bound"} n`, `name_sum{labels} sum`, `name_count{labels} n`.
  void Bucket(const Family& f, LabelValues values, std::string_view le, uint64_t cumulative);
  void HistogramSum(const Family& f, LabelValues values, std::string_view sum);
  void HistogramCount(const Family& f, LabelValues values, uint64_t count);

 private:
  // Appends `name suffix{labels,le="x"} ` (braces only when there are labels).
  void Start(const Family& f, std::string_view suffix, LabelValues values, std::string_view le);
  void AppendNumber(uint64_t v);
  void AppendNumber(int64_t v);
  template <std::integral T>
  void AppendNumber(T v) {
    if constexpr (std::is_signed_v<T>) {
      AppendNumber(static_cast<int64_t>(v));
    } else {
      AppendNumber(static_cast<uint64_t>(v));
    }
  }

  std::string* out_;
};

}  // namespace keyguard::metrics
