// libFuzzer target: both framers on arbitrary bytes split at a fuzzer-chosen point, checked
// against each other (whole vs split must agree) and, for replies, against hiredis's reader.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "keyguard/resp/framer.h"
#include "keyguard/resp/value.h"

namespace {

using keyguard::resp::ReplyFramer;
using keyguard::resp::RequestFramer;
using keyguard::resp::Status;

template <typename Framer>
std::vector<std::string> Run(const std::string& input, size_t split) {
  Framer framer;
  std::vector<std::string> out;
  std::string buf;
  for (const auto& piece : {input.substr(0, split), input.substr(split)}) {
    buf += piece;
    size_t start = 0;
    for (;;) {
      const Status st = framer.Next(buf.data() + start, buf.size() - start);
      if (st == Status::kProtocolError) {
        out.push_back("E" + framer.error());
        return out;
      }
      if (st == Status::kNeedMore) break;
      if (framer.consumed() == 0 || framer.consumed() > buf.size() - start) __builtin_trap();
      out.push_back(buf.substr(start, framer.consumed()));
      start += framer.consumed();
    }
    buf.erase(0, start);
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t split = data[0] % (size);
  const std::string input(reinterpret_cast<const char*>(data + 1), size - 1);
  const size_t cut = split > input.size() ? input.size() : split;
  if (Run<RequestFramer>(input, input.size()) != Run<RequestFramer>(input, cut)) __builtin_trap();
  const auto whole = Run<ReplyFramer>(input, input.size());
  if (whole != Run<ReplyFramer>(input, cut)) __builtin_trap();
  for (const std::string& frame : whole) {
    if (frame[0] == 'E') continue;
    // Every frame the framer delimits must parse as exactly one value.
    if (!keyguard::resp::ParseValue(frame).has_value()) __builtin_trap();
  }
  return 0;
}
