// Stream over TLS, on loopback with a certificate made here.
#include "proxy/stream.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "proxy/tls.h"

namespace keyguard::proxy {
namespace {

using namespace std::chrono_literals;

// A self-signed certificate for localhost and its key, as PEM files in the test's directory.
void WriteCertificate(const std::string& cert_path, const std::string& key_path) {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  ASSERT_NE(key, nullptr);
  X509* x = X509_new();
  ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
  X509_gmtime_adj(X509_getm_notBefore(x), 0);
  X509_gmtime_adj(X509_getm_notAfter(x), 3600);
  X509_set_pubkey(x, key);
  X509_NAME* name = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("localhost"), -1, -1, 0);
  X509_set_issuer_name(x, name);
  ASSERT_GT(X509_sign(x, key, EVP_sha256()), 0);
  FILE* f = std::fopen(cert_path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  PEM_write_X509(f, x);
  std::fclose(f);
  f = std::fopen(key_path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr);
  std::fclose(f);
  X509_free(x);
  EVP_PKEY_free(key);
}

class TlsStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::signal(SIGPIPE, SIG_IGN);  // as keyguard's main: OpenSSL writes with write(2)
    const std::string dir = ::testing::TempDir();
    const std::string cert = dir + "/stream_test.crt";
    const std::string key = dir + "/stream_test.key";
    WriteCertificate(cert, key);
    config::TlsSettings server;
    server.cert_file = cert;
    server.key_file = key;
    auto s = TlsClient::Create(server, "listen_tls", TlsSide::kServer);
    ASSERT_TRUE(s.ok()) << s.status();
    server_tls_ = *s;
    config::TlsSettings client;
    client.verify = false;
    auto c = TlsClient::Create(client, "upstream_tls");
    ASSERT_TRUE(c.ok()) << c.status();
    client_tls_ = *c;
  }

  // Connects `client_` to a TLS server on loopback (`server_`), both handshakes done.
  void Connect() {
    Acceptor acceptor(io_, tcp::endpoint(asio::ip::address_v4::loopback(), 0));
    error_code client_ec = asio::error::in_progress;
    error_code server_ec = asio::error::in_progress;
    asio::co_spawn(
        io_,
        [&]() -> awaitable<void> {
          error_code ec;
          Socket s = co_await acceptor.async_accept(AwaitEc(ec));
          if (ec) {
            server_ec = ec;
            co_return;
          }
          server_ = std::make_unique<Stream>(std::move(s));
          server_ec = co_await server_->Accept(*server_tls_, 5s);
        },
        asio::detached);
    asio::co_spawn(
        io_,
        [&]() -> awaitable<void> {
          client_ec = co_await client_.Connect(acceptor.local_endpoint(), client_tls_.get(), "localhost", 5s);
        },
        asio::detached);
    Run();
    ASSERT_FALSE(client_ec) << client_ec.message();
    ASSERT_FALSE(server_ec) << server_ec.message();
  }

  void Run() {
    io_.restart();
    io_.run();
  }

  asio::io_context io_;
  std::shared_ptr<TlsClient> server_tls_;
  std::shared_ptr<TlsClient> client_tls_;
  Stream client_{io_};
  std::unique_ptr<Stream> server_;
};

TEST_F(TlsStreamTest, HandshakesLeaveTheErrorQueueEmpty) {
  // SSL_get_error reads the thread's queue: a stale error would make the next read that has to
  // wait an SSL error.
  Connect();
  EXPECT_EQ(ERR_peek_error(), 0u);
}

TEST_F(TlsStreamTest, AfterCloseReadsAndWritesFailAndTouchNoSocketThatTookTheNumber) {
  Connect();
  const int number = client_.socket().native_handle();
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  client_.Close();
  // A descriptor made since (by any thread: another connection) has the number again.
  ASSERT_EQ(::dup2(pair[0], number), number);
  // A Send to the closed stream (Outbox::Send's immediate write) writes nothing there.
  error_code ec;
  const std::string_view command = "PING\r\n";
  EXPECT_EQ(client_.TryTlsWrite(std::span<const std::string_view>(&command, 1), ec), 0u);
  EXPECT_EQ(ec, asio::error::bad_descriptor);
  // Nor does a write resumed after the Close (its wait completed just before it).
  ec = {};
  size_t n = 99;
  asio::co_spawn(
      io_, [&]() -> awaitable<void> { n = co_await client_.WriteSome(asio::buffer("PING\r\n", 6), ec); },
      asio::detached);
  Run();
  EXPECT_EQ(ec, asio::error::bad_descriptor);
  EXPECT_EQ(n, 0u);
  char buf[64];
  EXPECT_EQ(::recv(pair[1], buf, sizeof buf, MSG_DONTWAIT), -1);
  // Nor does a read take what is there for that socket's owner.
  ASSERT_EQ(::send(pair[1], "+OK\r\n", 5, 0), 5);
  ec = {};
  n = 99;
  asio::co_spawn(
      io_, [&]() -> awaitable<void> { n = co_await client_.ReadSome(asio::buffer(buf), ec); }, asio::detached);
  Run();
  EXPECT_EQ(ec, asio::error::bad_descriptor);
  EXPECT_EQ(n, 0u);
  EXPECT_EQ(::recv(number, buf, sizeof buf, MSG_DONTWAIT), 5);
  ::close(number);
  ::close(pair[0]);
  ::close(pair[1]);
}

}  // namespace
}  // namespace keyguard::proxy
