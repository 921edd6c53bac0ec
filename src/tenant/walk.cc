#include "keyguard/tenant/walk.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "keyguard/resp/encoder.h"

namespace keyguard::tenant {

const std::string& KeyWalk::NextRequest(const Tenant& tenant, uint32_t step_keys) {
  request_ = WalkStep(tenant, walk_, cursor_, step_, step_keys);
  return request_;
}

KeyWalk::Step KeyWalk::OnReply(char type, std::span<const resp::ReplyFramer::Scalar> head, std::string_view prefix,
                               int protocol) {
  Step s;
  s.done = true;
  if (type == '-' || type == '!') {
    // The server refused a step (OOM, a script timeout, ...): the command fails with its error.
    s.error = true;
    resp::AppendError(&s.reply, head.empty() ? std::string_view("ERR keyguard: walk step failed") : head[0].text);
    return s;
  }
  int64_t seen = 0;
  if (type != '*' || head.size() < 3 || !resp::ParseRedisInt(head[1].text, &seen) || seen < 0) {
    s.error = true;
    s.reply = "-ERR keyguard: unexpected reply to a key walk step\r\n";
    return s;
  }
  total_ += static_cast<uint64_t>(seen);
  ++step_;
  cursor_.assign(head[0].text.data(), head[0].text.size());
  const std::string_view found = head[2].text;
  if (walk_ == Walk::kRandomkey && !found.empty()) {
    resp::AppendBulk(&s.reply, found.starts_with(prefix) ? found.substr(prefix.size()) : found);
    return s;
  }
  if (cursor_ != "0") {
    s.done = false;
    return s;
  }
  if (node_ + 1 < nodes_) {  // the next primary, from its first key
    ++node_;
    s.done = false;
    return s;
  }
  switch (walk_) {
    case Walk::kDbsize: s.reply = absl::StrCat(":", total_, "\r\n"); break;
    case Walk::kRandomkey: s.reply = protocol == 3 ? "_\r\n" : "$-1\r\n"; break;
    default: s.reply = "+OK\r\n"; break;
  }
  return s;
}

int64_t StepBudget::Take(uint32_t per_second, int64_t now_ns) {
  if (per_second == 0) return 0;  // no limit
  if (at_ns_ == 0) tokens_ = per_second;
  tokens_ = std::min<double>(per_second, tokens_ + static_cast<double>(now_ns - at_ns_) * per_second / 1e9);
  at_ns_ = now_ns;
  if (tokens_ >= 1) {
    tokens_ -= 1;
    return 0;
  }
  return static_cast<int64_t>((1 - tokens_) * 1e9 / per_second) + 1;
}

}  // namespace keyguard::tenant
