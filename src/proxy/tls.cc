#include "proxy/tls.h"

#include <arpa/inet.h>

#include <cstdio>

#include <openssl/err.h>
#include <openssl/x509v3.h>

#include "absl/strings/str_cat.h"
#include "keyguard/common/field_error.h"
#include "keyguard/common/json_line.h"
#include "keyguard/common/views.h"

namespace keyguard::proxy {
namespace {

// The oldest error OpenSSL queued (the cause, rather than what it led to), and the queue cleared.
std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "unknown OpenSSL error";
  char text[256];
  ERR_error_string_n(e, text, sizeof text);
  const char* reason = ERR_reason_error_string(e);
  return reason != nullptr ? std::string(reason) : std::string(text);
}

// Where an SSL_CTX keeps its TlsContext (Asio's ssl::context owns the app-data slot).
int ContextIndex() {
  static const int index = SSL_CTX_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

bool IsIpAddress(const std::string& name) {
  in6_addr a6;
  in_addr a4;
  return inet_pton(AF_INET, name.c_str(), &a4) == 1 || inet_pton(AF_INET6, name.c_str(), &a6) == 1;
}

// Where an SSL keeps the TlsContext::Sessions of the server it connects to.
int SslSessionsIndex() {
  static const int index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

void FreeSessions(std::deque<SSL_SESSION*>& sessions) {
  for (SSL_SESSION* s : sessions) SSL_SESSION_free(s);
  sessions.clear();
}

}  // namespace

TlsContext::~TlsContext() {
  for (auto& [server, sessions] : sessions_) {
    FreeSessions(sessions->unused);
    if (sessions->newest != nullptr) SSL_SESSION_free(sessions->newest);
  }
}

int TlsContext::OnNewSession(SSL* ssl, SSL_SESSION* session) {
  auto* self = static_cast<TlsContext*>(SSL_CTX_get_ex_data(SSL_get_SSL_CTX(ssl), ContextIndex()));
  auto* sessions = static_cast<Sessions*>(SSL_get_ex_data(ssl, SslSessionsIndex()));
  if (sessions == nullptr) return 0;  // not ours to keep: OpenSSL frees it
  // Kept as a copy: `session` is the connection's own, and a fatal alert on it later (a reset, a
  // refused request) would mark that object not resumable (ssl3_send_alert removes it), spoiling
  // what the next connection offers.
  SSL_SESSION* copy = SSL_SESSION_dup(session);
  if (copy == nullptr) return 0;
  std::lock_guard<std::mutex> lock(self->mu_);
  if (sessions->unused.size() == kUnusedPerServer) {
    SSL_SESSION_free(sessions->unused.front());
    sessions->unused.pop_front();
  }
  sessions->unused.push_back(copy);
  SSL_SESSION_up_ref(copy);
  if (sessions->newest != nullptr) SSL_SESSION_free(sessions->newest);
  sessions->newest = copy;
  return 0;  // OpenSSL keeps (and frees) its own reference to `session`
}

void TlsContext::Prepare(SSL* ssl, const std::string& name, const std::string& server) {
  if (!IsIpAddress(name)) SSL_set_tlsext_host_name(ssl, name.c_str());
  if (verify_) {
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
    if (IsIpAddress(name)) {
      X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str());
    } else {
      X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
      X509_VERIFY_PARAM_set1_host(param, name.c_str(), name.size());
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::string key = absl::StrCat(name, "|", server);
  auto it = sessions_.find(key);
  if (it == sessions_.end()) {
    // Open connections may still get sessions for every server known, so none is forgotten; a
    // server past the bound (a cluster's nodes replaced many times over) is not resumed.
    if (sessions_.size() >= kServers) return;
    it = sessions_.emplace(std::move(key), std::make_unique<Sessions>()).first;
  }
  Sessions* sessions = it->second.get();
  SSL_set_ex_data(ssl, SslSessionsIndex(), sessions);
  // The connection gets a copy, never an object the pool still holds: OpenSSL marks the session
  // of a connection freed without close_notify (or that sent a fatal alert) not resumable, and the
  // newest is also the last unused one, so offering it directly spoiled every later offer of the
  // newest (4 to 16 of 150 connections in a burst made a full handshake).
  SSL_SESSION* offer = nullptr;
  while (!sessions->unused.empty() && offer == nullptr) {
    SSL_SESSION* s = sessions->unused.back();
    sessions->unused.pop_back();
    if (SSL_SESSION_is_resumable(s) == 1) offer = SSL_SESSION_dup(s);
    SSL_SESSION_free(s);
  }
  if (offer == nullptr && sessions->newest != nullptr && SSL_SESSION_is_resumable(sessions->newest) == 1) {
    offer = SSL_SESSION_dup(sessions->newest);
  }
  if (offer != nullptr) {
    SSL_set_session(ssl, offer);
    SSL_SESSION_free(offer);
  }
}

absl::StatusOr<std::shared_ptr<TlsClient>> TlsClient::Create(const config::TlsSettings& settings, std::string field,
                                                             TlsSide side) {
  std::shared_ptr<TlsClient> c(new TlsClient(settings, std::move(field), side));
  c->stamps_ = c->Stamps();
  auto built = c->Build();
  if (!built.ok()) return built.status();
  c->current_ = *std::move(built);
  c->next_check_ = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  return c;
}

std::vector<FileStamp> TlsClient::Stamps() const {
  std::vector<FileStamp> out;
  for (const std::string* path : {&settings_.ca_file, &settings_.ca_dir, &settings_.cert_file, &settings_.key_file}) {
    out.push_back(FileStamp::Of(*path));
  }
  return out;
}

absl::StatusOr<std::shared_ptr<TlsContext>> TlsClient::Build() const {
  std::shared_ptr<TlsContext> t(new TlsContext(side_));
  ERR_clear_error();
  SSL_CTX* ctx = t->ssl_.native_handle();
  const config::TlsSettings& s = settings_;
  const bool server = side_ == TlsSide::kServer;
  const bool have_ca = !s.ca_file.empty() || !s.ca_dir.empty();
  t->verify_ = s.verify;
  SSL_CTX_set_min_proto_version(ctx, s.min_version == "1.3" ? TLS1_3_VERSION : TLS1_2_VERSION);
  if (!s.ciphers.empty() && SSL_CTX_set_cipher_list(ctx, s.ciphers.c_str()) != 1) {
    return FieldError(field_ + ".ciphers", absl::StrCat("'", s.ciphers, "': ", OpenSslError()));
  }
  if (!s.ciphersuites.empty() && SSL_CTX_set_ciphersuites(ctx, s.ciphersuites.c_str()) != 1) {
    return FieldError(field_ + ".ciphersuites", absl::StrCat("'", s.ciphersuites, "': ", OpenSslError()));
  }
  if (!have_ca) {
    // A listener without CAs asks for no client certificate.
    if (!server && SSL_CTX_set_default_verify_paths(ctx) != 1) return FieldError(field_ + ".ca_file", OpenSslError());
  } else if (SSL_CTX_load_verify_locations(ctx, s.ca_file.empty() ? nullptr : s.ca_file.c_str(),
                                           s.ca_dir.empty() ? nullptr : s.ca_dir.c_str()) != 1) {
    return FieldError(field_ + (s.ca_file.empty() ? ".ca_dir" : ".ca_file"),
                      absl::StrCat(s.ca_file.empty() ? s.ca_dir : s.ca_file, ": ", OpenSslError()));
  }
  if (!s.cert_file.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx, s.cert_file.c_str()) != 1) {
      return FieldError(field_ + ".cert_file", absl::StrCat(s.cert_file, ": ", OpenSslError()));
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, s.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
      return FieldError(field_ + ".key_file", absl::StrCat(s.key_file, ": ", OpenSslError()));
    }
    if (SSL_CTX_check_private_key(ctx) != 1) {
      return FieldError(field_ + ".key_file", absl::StrCat(s.key_file, " does not match ", s.cert_file));
    }
  }
  // An idle connection keeps no read/write buffers (about 34 KB each otherwise).
  SSL_CTX_set_mode(ctx, SSL_MODE_RELEASE_BUFFERS);
  // A peer that closes without close_notify ends the stream (SSL_ERROR_ZERO_RETURN), as the
  // Stream and RedisLink take it, rather than with a fatal error: that would mark the
  // connection's session not resumable, and a client's is the one kept to offer next (RESP's
  // framing shows a reply cut short).
  SSL_CTX_set_options(ctx, SSL_OP_IGNORE_UNEXPECTED_EOF);
  // No TLS 1.2 renegotiation either way: Redis never asks for it, a client could use it to burn
  // the listener's CPU, and a write that must read (one renegotiating) would wait behind the
  // reader's wait for the socket.
  SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION);
  if (server) {
    // Client certificates: asked for when there are CAs (the CA file's names tell the client
    // which to send), verified when given, required with require_client_cert.
    if (have_ca && !s.ca_file.empty()) SSL_CTX_set_client_CA_list(ctx, SSL_load_client_CA_file(s.ca_file.c_str()));
    SSL_CTX_set_verify(ctx,
                       !have_ca                ? SSL_VERIFY_NONE
                       : s.require_client_cert ? SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT
                                               : SSL_VERIFY_PEER,
                       nullptr);
    // Resumption (the server's cache, TLS 1.3 tickets) needs a session id context with verification.
    static constexpr unsigned char kSessionContext[] = "keyguard";
    SSL_CTX_set_session_id_context(ctx, kSessionContext, sizeof kSessionContext - 1);
    return t;
  }
  SSL_CTX_set_verify(ctx, s.verify ? SSL_VERIFY_PEER : SSL_VERIFY_NONE, nullptr);
  // Resumption: OpenSSL hands each session the server issues to OnNewSession, the next
  // connection offers it (Prepare); the internal store is for servers only.
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
  SSL_CTX_sess_set_new_cb(ctx, &TlsContext::OnNewSession);
  SSL_CTX_set_ex_data(ctx, ContextIndex(), t.get());
  return t;
}

std::shared_ptr<TlsContext> TlsClient::Current() {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  if (now < next_check_) return current_;
  next_check_ = now + std::chrono::seconds(1);
  std::vector<FileStamp> stamps = Stamps();
  if (stamps == stamps_) return current_;
  stamps_ = std::move(stamps);
  auto built = Build();
  ERR_clear_error();  // a Build that worked may still have queued errors; reads need the queue empty
  if (built.ok()) {
    current_ = *std::move(built);
    ++rebuilds_;
    EventLine("info", "tls_files_reloaded")
        .Str("settings", field_)
        .Int("rebuilds", static_cast<int64_t>(rebuilds_))
        .Write(stderr);
  } else {
    // Stamps are kept: the next change of a file (the rest of a rotation) tries again.
    EventLine("error", "tls_files_reload_failed").Str("error", AsStd(built.status().message())).Write(stderr);
  }
  return current_;
}

uint64_t TlsClient::rebuilds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rebuilds_;
}

std::string TlsFailure(SSL* ssl, const boost::system::error_code& ec) {
  if (ssl != nullptr) {
    const long verify = SSL_get_verify_result(ssl);
    if (verify != X509_V_OK) return absl::StrCat("certificate verify failed: ", X509_verify_cert_error_string(verify));
  }
  std::string text = ec.message();
  // One line: it goes into an error reply.
  for (char& c : text) {
    if (c == '\r' || c == '\n') c = ' ';
  }
  return text;
}

std::vector<std::string> PeerCertificateNames(SSL* ssl) {
  std::vector<std::string> names;
  X509* cert = SSL_get_peer_certificate(ssl);
  if (cert == nullptr) return names;
  if (SSL_get_verify_result(ssl) == X509_V_OK) {
    char cn[256];
    const int n = X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, cn, sizeof cn);
    if (n > 0) names.emplace_back(cn, static_cast<size_t>(n));
    auto* sans = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
    for (int i = 0; sans != nullptr && i < sk_GENERAL_NAME_num(sans); ++i) {
      const GENERAL_NAME* g = sk_GENERAL_NAME_value(sans, i);
      if (g->type == GEN_DNS || g->type == GEN_EMAIL || g->type == GEN_URI) {
        const ASN1_IA5STRING* text = g->d.ia5;
        names.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(text)),
                           static_cast<size_t>(ASN1_STRING_length(text)));
      }
    }
    GENERAL_NAMES_free(sans);
  }
  X509_free(cert);
  ERR_clear_error();  // the queue stays empty for the next SSL_read (see stream.h)
  return names;
}

}  // namespace keyguard::proxy
