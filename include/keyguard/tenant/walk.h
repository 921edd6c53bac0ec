// A key walk (a tenant's FLUSHALL/FLUSHDB, DBSIZE, RANDOMKEY) as a state machine, sans-io: the
// request of each step, the step's reply in, the next step or the client's answer out. And the
// per-tenant budget of steps per second that keeps many walks from crowding the server.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "keyguard/resp/framer.h"
#include "keyguard/tenant/rewrite.h"
#include "keyguard/tenant/tenancy.h"

namespace keyguard::tenant {

class KeyWalk {
 public:
  KeyWalk() = default;
  // `nodes`: a Redis Cluster's primaries, walked one after the other (each SCAN from cursor 0).
  void Start(Walk walk, uint32_t nodes = 1) {
    *this = KeyWalk(walk);
    nodes_ = std::max<uint32_t>(1, nodes);
  }
  void Finish() { *this = KeyWalk(); }
  Walk walk() const { return walk_; }
  bool active() const { return walk_ != Walk::kNone; }
  // The node the next step goes to (0 without a cluster).
  uint32_t node() const { return node_; }

  // The request of the next step for `tenant` (up to `step_keys` keys), kept here while it is
  // on its way upstream.
  const std::string& NextRequest(const Tenant& tenant, uint32_t step_keys);

  struct Step {
    bool done = false;   // false: send the next step
    bool error = false;  // done: the answer is an error
    std::string reply;   // done: the client's answer, one RESP frame
  };
  // The reply to the last step, as its type and top-level scalars ([cursor, keys seen, a key
  // found or ""]). `prefix` is the tenant's (RANDOMKEY answers the key without it), `protocol`
  // the connection's (RESP3 answers a missing key with its null).
  Step OnReply(char type, std::span<const resp::ReplyFramer::Scalar> head, std::string_view prefix, int protocol);

 private:
  explicit KeyWalk(Walk walk) : walk_(walk) {}

  Walk walk_ = Walk::kNone;
  uint64_t step_ = 0;
  uint64_t total_ = 0;
  uint32_t nodes_ = 1;
  uint32_t node_ = 0;
  std::string cursor_ = "0";
  std::string request_;
};

// A token bucket of `per_second` steps, up to one second's worth.
class StepBudget {
 public:
  // Takes a token at `now_ns`: 0 when there was one, else the nanoseconds until there is.
  int64_t Take(uint32_t per_second, int64_t now_ns);

 private:
  double tokens_ = 0;
  int64_t at_ns_ = 0;
};

}  // namespace keyguard::tenant
