// keyguard's own credentials for its upstream connections (upstream_auth), shared by every worker
// thread, and those for the Sentinels (sentinel.password_file). With a password file the file is
// looked at for each new connection and read again when it changed (a rotated Secret): new
// connections AUTH with the new secret, open ones keep theirs.
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
  // keyguard's credentials for its upstream connections (upstream_auth).
  explicit UpstreamCredentials(const config::ProxyConfig& config);
  // Other credentials that rotate the same way (`what` names them in log events: "sentinel_auth" for
  // the Sentinels' sentinel.user and sentinel.password_file).
  UpstreamCredentials(std::string what, std::string user, std::string password, std::string file);

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

  const std::string what_;  // "upstream_auth", "sentinel_auth"
  const std::string user_;
  const std::string file_;  // empty: the password is fixed
  mutable std::mutex mu_;
  std::shared_ptr<const std::string> current_;
  std::string password_;
  FileStamp stamp_;
  uint64_t reloads_ = 0;
};

}  // namespace keyguard::proxy
