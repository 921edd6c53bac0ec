#include "maintenance/terminal.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace keyguard::maintenance {

std::string Printable(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "\\x%02x", c);
    }
  }
  return out;
}

Progress::Progress(Mode mode, std::string label, int64_t total, std::chrono::milliseconds interval)
    : mode_(mode),
      label_(std::move(label)),
      total_(total),
      interval_(interval),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

void Progress::Show(uint64_t done) {
  if (mode_ == Mode::kOff) return;
  const auto now = std::chrono::steady_clock::now();
  if (mode_ == Mode::kLines && now - last_ < interval_) return;
  last_ = now;
  const double s = std::chrono::duration<double>(now - start_).count();
  const double rate = s > 0 ? done / s : 0;
  std::string line = absl::StrFormat("%s%u keys, %.0f keys/s", label_, done, rate);
  if (total_ > 0) {
    const double part = std::min(1.0, static_cast<double>(done) / total_);
    if (mode_ == Mode::kTerminal) {
      const int bar = static_cast<int>(part * 30);
      absl::StrAppendFormat(&line, " [%s%s]", std::string(bar, '#'), std::string(30 - bar, '.'));
    } else {
      absl::StrAppendFormat(&line, " of about %d", total_);
    }
    absl::StrAppendFormat(&line, " %.0f%%", part * 100);
    if (rate > 0)
      absl::StrAppendFormat(&line, " ETA %.0fs", std::max(0.0, (total_ - static_cast<double>(done)) / rate));
  }
  if (mode_ == Mode::kTerminal) {
    std::fprintf(stderr, "\r\033[K%s", line.c_str());
    shown_ = true;
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

void Progress::Done() {
  if (mode_ == Mode::kTerminal && shown_) std::fputs("\r\033[K", stderr);
}

}  // namespace keyguard::maintenance
