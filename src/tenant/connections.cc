#include "keyguard/tenant/connections.h"

namespace keyguard::tenant {

void Connections::Set(int64_t client_id, const Tenant* tenant) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tenant == nullptr) {
    tenant_.erase(client_id);
  } else {
    tenant_[client_id] = tenant;
  }
}

bool Connections::Serves(int64_t client_id, const Tenant& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = tenant_.find(client_id);
  return it != tenant_.end() && it->second == &tenant;
}

size_t Connections::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tenant_.size();
}

}  // namespace keyguard::tenant
