// keyguard's own credentials for its upstream connections (upstream_auth), shared by every worker
// thread. With upstream_auth.password_file the file is looked at for each new connection and read
// again when it changed (a rotated Secret): new connections AUTH with the new secret, open ones
// keep theirs.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "keyguard/config/config.h"
#include "proxy/file_stamp.h"

namespace keyguard::proxy {

class UpstreamCredentials {
 public:
  explicit UpstreamCredentials(const config::ProxyConfig& config);

  // The encoded AUTH a new upstream connection sends first (empty: none). A file that cannot be
  // read, or is empty, keeps the secret read before (logged).
  std::shared_ptr<const std::string> Current();
  // The password itself, as Current() reads it (for the ROLE check of a Sentinel's primary).
  std::string Password();
  // How many times the password file changed and was read again.
  uint64_t reloads() const;

 private:
  std::shared_ptr<const std::string> Encode(const std::string& password) const;
  // Reads the file again when it changed. Holds mu_.
  void Refresh();

  const std::string user_;
  const std::string file_;  // empty: the password is fixed
  mutable std::mutex mu_;
  std::shared_ptr<const std::string> current_;
  std::string password_;
  FileStamp stamp_;
  uint64_t reloads_ = 0;
};

}  // namespace keyguard::proxy
