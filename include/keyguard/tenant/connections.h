// Which tenant each of keyguard's upstream connections serves, by the server's client id, so that
// a command naming another connection (CLIENT TRACKING ... REDIRECT <id>) can be held to the
// tenant's own. Process-wide: sessions of every worker register here.
#pragma once

#include <cstdint>
#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "keyguard/tenant/tenancy.h"

namespace keyguard::tenant {

class Connections {
 public:
  // Records that the upstream connection `client_id` serves `tenant` (nullptr: nobody, which
  // removes the entry). A session calls it when it learns its id, when its tenant changes and
  // when its upstream connection closes, so there is one entry per open tenant connection.
  void Set(int64_t client_id, const Tenant* tenant);
  // Whether `client_id` is an upstream connection of keyguard's that serves `tenant` now.
  bool Serves(int64_t client_id, const Tenant& tenant) const;
  size_t size() const;

 private:
  mutable std::mutex mu_;
  absl::flat_hash_map<int64_t, const Tenant*> tenant_;  // guarded by mu_
};

}  // namespace keyguard::tenant
