// The TLS side of the connections keyguard makes (to the upstream, to the Sentinels) and of those
// its listener accepts (listen_tls): one SSL_CTX built from config::TlsSettings, rebuilt when a
// certificate, key or CA file changes on disk, and (making connections) the session each context
// last got, to resume.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <openssl/ssl.h>

#include <boost/asio/ssl/context.hpp>
#include <boost/system/error_code.hpp>

#include "absl/status/statusor.h"
#include "keyguard/config/config.h"
#include "proxy/file_stamp.h"

namespace keyguard::proxy {

// One built SSL_CTX and the client session to resume with it. Connections hold it (shared_ptr)
// for as long as they are open, so a rebuilt context never pulls one from under them.
enum class TlsSide { kClient, kServer };

class TlsContext {
 public:
  ~TlsContext();
  boost::asio::ssl::context& context() { return ssl_; }
  // Prepares `ssl` (made from context()) to connect to `name` (a DNS name or an IP address) at
  // `server` (its address and port, which keys the sessions): SNI for a DNS name, the name or
  // address the certificate must match, the session to resume.
  void Prepare(SSL* ssl, const std::string& name, const std::string& server);

 private:
  friend class TlsClient;
  explicit TlsContext(TlsSide side)
      : ssl_(side == TlsSide::kClient ? boost::asio::ssl::context::tls_client : boost::asio::ssl::context::tls_server) {
  }
  static int OnNewSession(SSL* ssl, SSL_SESSION* session);

  // The sessions one server (name and address) issued. A new connection takes an unused one
  // (servers may accept a session once: stateful TLS 1.3 resumption, RFC 8446's advice to
  // clients), else offers the newest again (stateless tickets resume many times).
  struct Sessions {
    std::deque<SSL_SESSION*> unused;  // owned, newest last
    SSL_SESSION* newest = nullptr;    // owned
  };
  static constexpr size_t kUnusedPerServer = 64;
  static constexpr size_t kServers = 256;  // more (a cluster's nodes replaced many times): not resumed

  boost::asio::ssl::context ssl_;
  bool verify_ = true;
  std::mutex mu_;
  std::unordered_map<std::string, std::unique_ptr<Sessions>> sessions_;  // by server
};

// The current TlsContext for a set of settings, shared by every worker thread. kClient connects
// (the upstream, the Sentinels); kServer accepts (the listener: keyguard's certificate, and
// client certificates verified against the CAs when there are any, required with
// require_client_cert).
class TlsClient {
 public:
  // Builds the first context; an unreadable or invalid file is an error naming `field` (e.g.
  // "upstream_tls.ca_file: ...").
  static absl::StatusOr<std::shared_ptr<TlsClient>> Create(const config::TlsSettings& settings, std::string field,
                                                           TlsSide side = TlsSide::kClient);

  // The context for a new connection. At most once a second it looks at the files (mtime, size,
  // inode: a Kubernetes Secret's symlink swap changes them) and, when one changed, builds a new
  // context from them; if that fails (a key that does not match its certificate yet), the old one
  // stays and the failure is logged.
  std::shared_ptr<TlsContext> Current();
  // The name to verify for a server reached as `host`: server_name when set, else `host`.
  const std::string& NameFor(const std::string& host) const {
    return settings_.server_name.empty() ? host : settings_.server_name;
  }
  // How many times the files changed and a new context was built.
  uint64_t rebuilds() const;
  // Handshakes completed, and how many of them resumed a session.
  void CountHandshake(bool resumed) { (resumed ? resumed_ : full_).fetch_add(1, std::memory_order_relaxed); }
  uint64_t handshakes(bool resumed) const { return (resumed ? resumed_ : full_).load(std::memory_order_relaxed); }
  // Handshakes that failed (kServer: a client without a trusted certificate, not speaking TLS).
  void CountFailure() { failed_.fetch_add(1, std::memory_order_relaxed); }
  uint64_t failures() const { return failed_.load(std::memory_order_relaxed); }

 private:
  TlsClient(config::TlsSettings settings, std::string field, TlsSide side)
      : settings_(std::move(settings)), field_(std::move(field)), side_(side) {}
  absl::StatusOr<std::shared_ptr<TlsContext>> Build() const;
  std::vector<FileStamp> Stamps() const;

  const config::TlsSettings settings_;
  const std::string field_;
  const TlsSide side_;
  mutable std::mutex mu_;
  std::shared_ptr<TlsContext> current_;
  std::vector<FileStamp> stamps_;
  std::chrono::steady_clock::time_point next_check_;
  uint64_t rebuilds_ = 0;
  std::atomic<uint64_t> full_{0};
  std::atomic<uint64_t> resumed_{0};
  std::atomic<uint64_t> failed_{0};
};

// A readable text for the TLS failure of `ssl` after a handshake that failed with `ec`:
// "certificate verify failed: <why>" when the server's certificate was refused.
std::string TlsFailure(SSL* ssl, const boost::system::error_code& ec);

// The names of the peer's certificate once it verified: its subject CN, then its DNS, email and
// URI subjectAltNames. Empty without a certificate, or one that did not verify.
std::vector<std::string> PeerCertificateNames(SSL* ssl);

}  // namespace keyguard::proxy
