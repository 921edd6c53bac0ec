// The connection without sockets: client bytes in -> the bytes for the upstream and for the client
// out, upstream bytes in -> the same. Every case asserts the exact bytes each side would be sent.
#include "proxy/connection.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "keyguard/config/config_store.h"

// Heap allocations of this binary, counted so that a test can show a path makes none.
namespace {
std::atomic<size_t> allocations{0};
}  // namespace

void* operator new(size_t n) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n != 0 ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace keyguard::proxy {
namespace {

// A client, keyguard and a scripted upstream, with the settings of `yaml`: Client() and
// Upstream() feed bytes (kept, like a read buffer, until the connection consumes them) and
// collect what each side would be sent.
class ConnectionTest : public ::testing::Test, public ConnectionHost {
 protected:
  // `shared`: the connection's commands go to a shared upstream connection (which is up).
  void Open(const std::string& yaml, bool connections = false, std::string upstream_auth = "", bool shared = false) {
    conn_.reset();  // before what it refers to
    auto parsed = config::ParseConfig(yaml);
    if (!parsed.ok()) throw std::runtime_error(std::string(parsed.status().message()));
    config_ = std::make_shared<const config::ProxyConfig>(*parsed);
    store_ = std::make_unique<config::ConfigStore>(config_, "");
    stages_ = std::make_unique<StageShared>(*config_, *store_, &shard_, connections ? &connections_ : nullptr);
    hygiene_ = std::make_unique<hygiene::WorkerDetectors>(config_->hygiene);
    hot_ = std::make_unique<hygiene::HotKeys>(config_->hygiene);
    upstream_auth_ = std::move(upstream_auth);
    conn_ = std::make_unique<Connection>(ConnectionShared{*stages_, *hygiene_, *hot_, walk_budget_}, *this);
    conn_->set_client_address("127.0.0.1:5555");
    if (shared) {
      conn_->set_multiplexed();
      conn_->set_shared_ready(true);
    } else {
      conn_->OnUpstreamConnected();
    }
    Collect();
  }

  // The client sends `bytes`.
  void Client(std::string_view bytes) {
    client_in_.append(bytes);
    size_t hint = 0;
    const size_t used = conn_->OnClientBytes(client_in_.data(), client_in_.size(), ++now_, &hint);
    Collect();
    client_in_.erase(0, used);
  }
  // The upstream sends `bytes`; returns whether the connection keeps it.
  bool Upstream(std::string_view bytes) {
    upstream_in_.append(bytes);
    size_t hint = 0;
    bool ok = true;
    const size_t used = conn_->OnUpstreamBytes(upstream_in_.data(), upstream_in_.size(), ++now_, &hint, &ok);
    Collect();
    upstream_in_.erase(0, used);
    return ok;
  }
  // What the upstream and the client were sent since the last call, then forgotten.
  std::string TakeUpstream() { return std::exchange(to_upstream_, std::string()); }
  std::string TakeClient() { return std::exchange(to_client_, std::string()); }
  // The routes (Output::routes, a cluster upstream) since the last call, then forgotten; their
  // positions copied into route_positions_.
  std::vector<Route> TakeRoutes() {
    route_positions_taken_ = std::exchange(route_positions_, {});
    return std::exchange(routes_, {});
  }
  std::vector<std::vector<uint32_t>> route_positions_taken_;
  // The commands (Output::commands) sent upstream since the last call, then forgotten.
  uint32_t TakeCommands() { return std::exchange(commands_, 0u); }
  // Calls `f` (a call into the connection outside Client and Upstream) and collects its output.
  template <typename F>
  auto Call(F f) {
    auto r = f();
    Collect();
    return r;
  }

  // After a warm-up, `batch` and `replies` through the connection again and again allocate nothing.
  void ExpectNoAllocationPerCommand(const std::string& batch, const std::string& replies) {
    for (int i = 0; i < 4; ++i) {  // warm-up: buffers, the ring, the metric handles
      Client(batch);
      Upstream(replies);
    }
    const size_t before = allocations.load();
    for (int i = 0; i < 100; ++i) {
      to_upstream_.clear();  // keeps the harness's own buffers
      to_client_.clear();
      Client(batch);
      Upstream(replies);
    }
    EXPECT_EQ(allocations.load() - before, 0u);
    EXPECT_EQ(to_client_, replies);
  }

  // ConnectionHost.
  bool ClientGone() override { return client_gone_; }
  void Report(hygiene::Finding f) override { findings_.push_back(std::move(f)); }
  void WakeProbe() override {}
  std::string_view UpstreamAuth() override {
    if (!rotate_auth_) return upstream_auth_;
    // A rotated secret each time, the one before overwritten and freed (as a Session's
    // shared_ptr to the old secret lets it go).
    if (rotated_ != nullptr) rotated_->assign(rotated_->size(), 'X');
    rotated_ = std::make_unique<std::string>(absl::StrCat("*2\r\n$4\r\nAUTH\r\n$3\r\npw", ++rotations_ % 10, "\r\n"));
    return *rotated_;
  }
  bool rotate_auth_ = false;
  std::unique_ptr<std::string> rotated_;
  int rotations_ = 0;

  metrics::WorkerShard shard_;
  std::vector<hygiene::Finding> findings_;
  bool client_gone_ = false;
  int64_t now_ = 0;  // nanoseconds: each call is one later

 private:
  void Collect() {
    commands_ += conn_->output().commands;
    for (const Route& r : conn_->output().routes) {
      routes_.push_back(r);
      route_positions_.emplace_back(r.positions.begin(), r.positions.end());
    }
    for (std::string_view b : conn_->output().upstream) to_upstream_.append(b);
    for (std::string_view b : conn_->output().client) to_client_.append(b);
  }

  std::shared_ptr<const config::ProxyConfig> config_;
  std::unique_ptr<config::ConfigStore> store_;
  tenant::Connections connections_;
  std::unique_ptr<StageShared> stages_;
  std::unique_ptr<hygiene::WorkerDetectors> hygiene_;
  std::unique_ptr<hygiene::HotKeys> hot_;
  std::string upstream_auth_;
  std::unordered_map<const tenant::Tenant*, tenant::StepBudget> walk_budget_;
  std::string client_in_;
  std::string upstream_in_;
  std::string to_upstream_;
  std::string to_client_;
  uint32_t commands_ = 0;
  std::vector<Route> routes_;
  std::vector<std::vector<uint32_t>> route_positions_;

 protected:
  std::unique_ptr<Connection> conn_;  // last: it unregisters from connections_ as it goes
};

constexpr const char* kPlain = "key_policy: {enabled: false}\nhygiene: {enabled: false}\n";

TEST_F(ConnectionTest, PipelinedCommandsGoUpstreamAsOneBufferAndRepliesComeBackInOrder) {
  Open(kPlain);
  const std::string batch =
      "*1\r\n$4\r\nPING\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n";
  Client(batch);
  EXPECT_EQ(conn_->output().upstream.size(), 1u) << "adjacent frames are one piece";
  EXPECT_EQ(TakeUpstream(), batch);
  EXPECT_EQ(TakeClient(), "");
  EXPECT_EQ(conn_->pending(), 3u);
  // Replies split anywhere: each is delivered once complete, in order.
  const std::string replies = "+PONG\r\n$5\r\nhello\r\n+OK\r\n";
  for (char c : replies) EXPECT_TRUE(Upstream(std::string_view(&c, 1)));
  EXPECT_EQ(TakeClient(), replies);
  EXPECT_EQ(conn_->pending(), 0u);
  EXPECT_TRUE(conn_->idle());
}

// Both sides at every fragment size: the bytes each side gets do not depend on how reads split.
TEST_F(ConnectionTest, ReadsSplitAnywhereGiveTheSameBytes) {
  const std::string batch =
      "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n*1\r\n$8\r\nFLUSHALL\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
      "*3\r\n$9\r\nSUBSCRIBE\r\n$1\r\na\r\n$1\r\nb\r\n";
  const std::string replies =
      "+OK\r\n$1\r\nv\r\n*3\r\n$9\r\nsubscribe\r\n$1\r\na\r\n:1\r\n*3\r\n$9\r\nsubscribe\r\n$1\r\nb\r\n:2\r\n"
      "*3\r\n$7\r\nmessage\r\n$1\r\na\r\n$2\r\nhi\r\n";
  const std::string refusal = "-ERR keyguard: command 'FLUSHALL' is not allowed here\r\n";
  for (size_t size : {batch.size(), size_t{100}, size_t{10}, size_t{5}, size_t{2}, size_t{1}}) {
    SCOPED_TRACE(size);
    Open("deny_commands: [FLUSHALL]\nhygiene: {enabled: false}\n");
    for (size_t i = 0; i < batch.size(); i += size) Client(std::string_view(batch).substr(i, size));
    for (size_t i = 0; i < replies.size(); i += size) Upstream(std::string_view(replies).substr(i, size));
    EXPECT_EQ(TakeUpstream(),
              "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
              "*3\r\n$9\r\nSUBSCRIBE\r\n$1\r\na\r\n$1\r\nb\r\n");
    EXPECT_EQ(TakeClient(), "+OK\r\n" + refusal + replies.substr(5));
    EXPECT_EQ(conn_->pending(), 0u);
  }
}

TEST_F(ConnectionTest, AClientsCommandSplitAcrossReadsGoesUpstreamOnceComplete) {
  Open(kPlain);
  Client("*2\r\n$3\r\nGET\r\n$1");
  EXPECT_EQ(TakeUpstream(), "");
  Client("\r\nk\r\n");
  EXPECT_EQ(TakeUpstream(), "*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
}

TEST_F(ConnectionTest, ARefusedCommandsReplyTakesItsPlaceAmongTheUpstreamsReplies) {
  Open("deny_commands: [FLUSHALL]\nhygiene: {enabled: false}\n");
  Client("*2\r\n$3\r\nGET\r\n$1\r\na\r\n*1\r\n$8\r\nFLUSHALL\r\n*2\r\n$3\r\nGET\r\n$1\r\nb\r\n");
  EXPECT_EQ(TakeUpstream(), "*2\r\n$3\r\nGET\r\n$1\r\na\r\n*2\r\n$3\r\nGET\r\n$1\r\nb\r\n");
  EXPECT_EQ(TakeClient(), "") << "the refusal waits for the reply before it";
  Upstream("$1\r\n1\r\n");
  EXPECT_EQ(TakeClient(), "$1\r\n1\r\n-ERR keyguard: command 'FLUSHALL' is not allowed here\r\n");
  Upstream("$1\r\n2\r\n");
  EXPECT_EQ(TakeClient(), "$1\r\n2\r\n");
  // With nothing pending the refusal goes out at once.
  Client("*1\r\n$8\r\nflushall\r\n");
  EXPECT_EQ(TakeUpstream(), "");
  EXPECT_EQ(TakeClient(), "-ERR keyguard: command 'FLUSHALL' is not allowed here\r\n");
  EXPECT_EQ(conn_->pending(), 0u);
}

TEST_F(ConnectionTest, AProtocolErrorIsTheLastReplyAndNothingMoreIsRead) {
  Open(kPlain);
  Client("*1\r\n$4\r\nPING\r\n*1\r\n$x\r\n*1\r\n$4\r\nPING\r\n");
  EXPECT_EQ(TakeUpstream(), "*1\r\n$4\r\nPING\r\n");
  EXPECT_TRUE(conn_->stop_reading());
  Upstream("+PONG\r\n");
  EXPECT_EQ(TakeClient(), "+PONG\r\n-ERR Protocol error: invalid bulk length\r\n");
}

TEST_F(ConnectionTest, TransactionRepliesPassAndARefusalInsideMultiAbortsExec) {
  Open("deny_commands: [FLUSHALL]\nhygiene: {enabled: false}\n");
  Client("*1\r\n$5\r\nMULTI\r\n*2\r\n$4\r\nINCR\r\n$1\r\nx\r\n*1\r\n$4\r\nEXEC\r\n");
  EXPECT_EQ(TakeUpstream(), "*1\r\n$5\r\nMULTI\r\n*2\r\n$4\r\nINCR\r\n$1\r\nx\r\n*1\r\n$4\r\nEXEC\r\n");
  Upstream("+OK\r\n+QUEUED\r\n*1\r\n:1\r\n");
  EXPECT_EQ(TakeClient(), "+OK\r\n+QUEUED\r\n*1\r\n:1\r\n");

  // A command keyguard refuses inside MULTI: the server never queued it, so EXEC must fail as
  // Redis fails it; DISCARD goes in its place and the client gets EXECABORT.
  Client("*1\r\n$5\r\nMULTI\r\n*2\r\n$4\r\nINCR\r\n$1\r\nx\r\n*1\r\n$8\r\nFLUSHALL\r\n*1\r\n$4\r\nEXEC\r\n");
  EXPECT_EQ(TakeUpstream(), "*1\r\n$5\r\nMULTI\r\n*2\r\n$4\r\nINCR\r\n$1\r\nx\r\n*1\r\n$7\r\nDISCARD\r\n");
  Upstream("+OK\r\n+QUEUED\r\n+OK\r\n");
  EXPECT_EQ(TakeClient(),
            "+OK\r\n+QUEUED\r\n-ERR keyguard: command 'FLUSHALL' is not allowed here\r\n"
            "-EXECABORT Transaction discarded because of previous errors.\r\n");
  EXPECT_EQ(conn_->pending(), 0u);
}

TEST_F(ConnectionTest, SubscribeConfirmationsEndTheCommandAndMessagesPassOutOfBand) {
  Open(kPlain);
  Client("*3\r\n$9\r\nSUBSCRIBE\r\n$1\r\na\r\n$1\r\nb\r\n");
  EXPECT_EQ(TakeUpstream(), "*3\r\n$9\r\nSUBSCRIBE\r\n$1\r\na\r\n$1\r\nb\r\n");
  const std::string first = "*3\r\n$9\r\nsubscribe\r\n$1\r\na\r\n:1\r\n";
  const std::string second = "*3\r\n$9\r\nsubscribe\r\n$1\r\nb\r\n:2\r\n";
  Upstream(first);
  EXPECT_EQ(conn_->pending(), 1u) << "one confirmation per channel";
  Upstream(second);
  EXPECT_EQ(conn_->pending(), 0u);
  EXPECT_EQ(TakeClient(), first + second);
  const std::string message = "*3\r\n$7\r\nmessage\r\n$1\r\na\r\n$2\r\nhi\r\n";
  Upstream(message);
  EXPECT_EQ(TakeClient(), message);
  EXPECT_EQ(conn_->state().subscriptions(0), 2u);
  // A bare UNSUBSCRIBE waits for one confirmation per channel subscribed.
  Client("*1\r\n$11\r\nUNSUBSCRIBE\r\n");
  Upstream("*3\r\n$11\r\nunsubscribe\r\n$1\r\na\r\n:1\r\n");
  EXPECT_EQ(conn_->pending(), 1u);
  Upstream("*3\r\n$11\r\nunsubscribe\r\n$1\r\nb\r\n:0\r\n");
  EXPECT_EQ(conn_->pending(), 0u);
  EXPECT_FALSE(conn_->state().subscribed());
}

TEST_F(ConnectionTest, Resp3PushesPassBetweenReplies) {
  Open(kPlain);
  Client("*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
  const std::string push = ">3\r\n$7\r\nmessage\r\n$1\r\na\r\n$2\r\nhi\r\n";
  Upstream(push + "_\r\n");
  EXPECT_EQ(TakeClient(), push + "_\r\n");
  EXPECT_EQ(conn_->pending(), 0u);
}

TEST_F(ConnectionTest, ClientReplyOffSilencesRepliesAndRefusals) {
  Open("deny_commands: [FLUSHALL]\nhygiene: {enabled: false}\n");
  Client(
      "*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$3\r\nOFF\r\n*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n"
      "*1\r\n$8\r\nFLUSHALL\r\n");
  EXPECT_EQ(TakeUpstream(),
            "*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$3\r\nOFF\r\n*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n");
  EXPECT_EQ(TakeClient(), "") << "no refusal is shown";
  EXPECT_EQ(conn_->pending(), 0u) << "no reply will come";
  Client("*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$2\r\nON\r\n");
  EXPECT_EQ(conn_->pending(), 1u);
  Upstream("+OK\r\n");
  EXPECT_EQ(TakeClient(), "+OK\r\n");
}

TEST_F(ConnectionTest, ClientReplySkipSpentOnARefusalStillTakesTheServersSkip) {
  Open("deny_commands: [FLUSHALL]\nhygiene: {enabled: false}\n");
  Client("*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$4\r\nSKIP\r\n*1\r\n$8\r\nFLUSHALL\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
  // The server still owes the skip: a PING takes it, so GET's reply is not swallowed.
  EXPECT_EQ(TakeUpstream(),
            "*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$4\r\nSKIP\r\n*1\r\n$4\r\nPING\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
  Upstream("$1\r\nv\r\n");
  EXPECT_EQ(TakeClient(), "$1\r\nv\r\n");
  EXPECT_EQ(conn_->pending(), 0u);
}

TEST_F(ConnectionTest, KeyguardsOwnUpstreamAuthGoesFirstAndItsReplyIsNotTheClients) {
  Open(kPlain, /*connections=*/false, "*2\r\n$4\r\nAUTH\r\n$2\r\npw\r\n");
  EXPECT_EQ(TakeUpstream(), "*2\r\n$4\r\nAUTH\r\n$2\r\npw\r\n");
  Client("*1\r\n$4\r\nPING\r\n");
  EXPECT_EQ(TakeUpstream(), "*1\r\n$4\r\nPING\r\n");
  EXPECT_TRUE(Upstream("+OK\r\n+PONG\r\n"));
  EXPECT_EQ(TakeClient(), "+PONG\r\n");
  // A refused AUTH: the upstream must go, and why.
  Open(kPlain, false, "*2\r\n$4\r\nAUTH\r\n$2\r\npw\r\n");
  EXPECT_FALSE(Upstream("-WRONGPASS invalid username-password pair or user is disabled.\r\n"));
  EXPECT_EQ(conn_->read_error(), metrics::UpstreamError::kAuth);
  std::string owed;
  EXPECT_EQ(conn_->OnUpstreamFailed(metrics::UpstreamError::kAuth, &owed), Connection::AfterFailure::kContinue);
  EXPECT_FALSE(conn_->upstream_ready());
  Client("*1\r\n$4\r\nPING\r\n");
  EXPECT_EQ(TakeClient(),
            "-ERR keyguard: upstream refused keyguard's AUTH: WRONGPASS invalid username-password pair or user is "
            "disabled.\r\n");
  EXPECT_TRUE(conn_->stop_reading());
}

TEST_F(ConnectionTest, EachResetInABatchGetsTheSecretOfItsMomentIntact) {
  Open(kPlain, /*connections=*/false, "*2\r\n$4\r\nAUTH\r\n$3\r\npw0\r\n");
  EXPECT_EQ(TakeUpstream(), "*2\r\n$4\r\nAUTH\r\n$3\r\npw0\r\n");
  rotate_auth_ = true;
  Client("*1\r\n$5\r\nRESET\r\n*1\r\n$5\r\nRESET\r\n*1\r\n$4\r\nPING\r\n");
  EXPECT_EQ(TakeUpstream(),
            "*1\r\n$5\r\nRESET\r\n*2\r\n$4\r\nAUTH\r\n$3\r\npw1\r\n*1\r\n$5\r\nRESET\r\n*2\r\n$4\r\nAUTH\r\n$"
            "3\r\npw2\r\n*1\r\n$4\r\nPING\r\n");
  EXPECT_TRUE(Upstream("+OK\r\n+RESET\r\n+OK\r\n+RESET\r\n+OK\r\n+PONG\r\n"));
  EXPECT_EQ(TakeClient(), "+RESET\r\n+RESET\r\n+PONG\r\n");
}

TEST_F(ConnectionTest, AnUpstreamTlsRefusalBeforeTheClientAskedIsTheAnswerToItsFirstCommand) {
  // TLS 1.3 refuses keyguard's client certificate after the handshake: the alert may come before
  // the client's first command.
  Open(kPlain);
  conn_->set_upstream_failure("upstream TLS: tlsv13 alert certificate required");
  std::string owed;
  EXPECT_EQ(conn_->OnUpstreamFailed(metrics::UpstreamError::kTls, &owed), Connection::AfterFailure::kContinue);
  EXPECT_EQ(owed, "");
  EXPECT_FALSE(conn_->upstream_ready());
  Client("*1\r\n$4\r\nPING\r\n");
  EXPECT_EQ(TakeClient(), "-ERR keyguard: upstream TLS: tlsv13 alert certificate required\r\n");
  EXPECT_TRUE(conn_->stop_reading());
  // Once the client waits for a reply, the same failure answers it and closes.
  Open(kPlain);
  conn_->set_upstream_failure("upstream TLS: tlsv13 alert certificate required");
  Client("*1\r\n$4\r\nPING\r\n");
  EXPECT_EQ(conn_->OnUpstreamFailed(metrics::UpstreamError::kTls, &owed), Connection::AfterFailure::kClose);
  EXPECT_EQ(owed, "-ERR keyguard: upstream TLS: tlsv13 alert certificate required\r\n");
}

TEST_F(ConnectionTest, AFailedUpstreamOwesEveryPendingCommandAnErrorInOrder) {
  Open("deny_commands: [FLUSHALL]\nhygiene: {enabled: false}\n");
  Client("*2\r\n$3\r\nGET\r\n$1\r\na\r\n*1\r\n$8\r\nFLUSHALL\r\n*2\r\n$3\r\nGET\r\n$1\r\nb\r\n");
  std::string owed;
  EXPECT_EQ(conn_->OnUpstreamFailed(metrics::UpstreamError::kReset, &owed), Connection::AfterFailure::kClose);
  EXPECT_EQ(owed,
            "-ERR keyguard: upstream unavailable\r\n-ERR keyguard: command 'FLUSHALL' is not allowed here\r\n"
            "-ERR keyguard: upstream unavailable\r\n");
  EXPECT_TRUE(conn_->stop_reading());
  EXPECT_EQ(conn_->pending(), 0u);
  EXPECT_EQ(conn_->OnUpstreamFailed(metrics::UpstreamError::kReset, &owed), Connection::AfterFailure::kNone);
}

constexpr const char* kTenant = "tenancy: {prefix: 'tenant:a:', name: a}\nhygiene: {enabled: false}\n";

TEST_F(ConnectionTest, ATenantsKeysArePrefixedAndItsRepliesShowThemWithout) {
  Open(kTenant, /*connections=*/true);
  EXPECT_EQ(TakeUpstream(), "*2\r\n$6\r\nCLIENT\r\n$2\r\nID\r\n");
  Upstream(":42\r\n");  // keyguard's CLIENT ID: not the client's
  EXPECT_EQ(TakeClient(), "");
  Client("*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*2\r\n$4\r\nKEYS\r\n$1\r\n*\r\n");
  EXPECT_EQ(TakeUpstream(), "*2\r\n$3\r\nGET\r\n$10\r\ntenant:a:k\r\n*2\r\n$4\r\nKEYS\r\n$10\r\ntenant:a:*\r\n");
  Upstream("$1\r\nv\r\n*2\r\n$10\r\ntenant:a:x\r\n$10\r\ntenant:a:y\r\n");
  EXPECT_EQ(TakeClient(), "$1\r\nv\r\n*2\r\n$1\r\nx\r\n$1\r\ny\r\n");
  EXPECT_EQ(shard_.tenant_sent_bytes.Get({"a"}).Get(), 25u) << "the replies as the client got them";
}

TEST_F(ConnectionTest, ATenantsMessagesShowItsChannelsWithoutThePrefix) {
  Open(kTenant);
  Client("*2\r\n$9\r\nSUBSCRIBE\r\n$1\r\nc\r\n");
  EXPECT_EQ(TakeUpstream(), "*2\r\n$9\r\nSUBSCRIBE\r\n$10\r\ntenant:a:c\r\n");
  Upstream(
      "*3\r\n$9\r\nsubscribe\r\n$10\r\ntenant:a:c\r\n:1\r\n*3\r\n$7\r\nmessage\r\n$10\r\ntenant:a:c\r\n$2\r\nhi\r\n");
  EXPECT_EQ(TakeClient(), "*3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:1\r\n*3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$2\r\nhi\r\n");
  EXPECT_EQ(conn_->pending(), 0u);
}

std::string Repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

TEST_F(ConnectionTest, AnOldNameMovesFirstAndOnlyTheClientsRepliesReachIt) {
  Open(
      "key_policy:\n  default_action: observe\n  rules:\n    - {name: legacy-profile, pattern: "
      "'^User_(\\d+)_Profile$', "
      "rewrite: 'user:$1:profile', action: rewrite}\n");
  const std::string move = "*6\r\n$4\r\nEVAL\r\n$" + std::to_string(kMoveLegacyScript.size()) + "\r\n" +
                           std::string(kMoveLegacyScript) +
                           "\r\n$1\r\n2\r\n$14\r\nUser_7_Profile\r\n$14\r\nuser:7:profile\r\n$1\r\nr\r\n";
  Client("*2\r\n$3\r\nGET\r\n$14\r\nUser_7_Profile\r\n");
  EXPECT_EQ(TakeUpstream(), move + "*2\r\n$3\r\nGET\r\n$14\r\nuser:7:profile\r\n");
  EXPECT_EQ(conn_->pending(), 2u);
  ASSERT_TRUE(Upstream(":1\r\n$3\r\nada\r\n"));
  EXPECT_EQ(TakeClient(), "$3\r\nada\r\n");
  EXPECT_EQ(shard_.legacy_keys_moved.Get(), 1u);
  // Inside MULTI the move is queued too; its +QUEUED and its EXEC element are keyguard's.
  Client("*1\r\n$5\r\nMULTI\r\n*2\r\n$3\r\nGET\r\n$14\r\nUser_7_Profile\r\n*1\r\n$4\r\nEXEC\r\n");
  EXPECT_EQ(TakeUpstream(),
            "*1\r\n$5\r\nMULTI\r\n" + move + "*2\r\n$3\r\nGET\r\n$14\r\nuser:7:profile\r\n*1\r\n$4\r\nEXEC\r\n");
  ASSERT_TRUE(Upstream("+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n:0\r\n$3\r\nada\r\n"));
  EXPECT_EQ(TakeClient(), "+OK\r\n+QUEUED\r\n*1\r\n$3\r\nada\r\n");
  // A BLPOP's reply names the key as the client did.
  Client("*3\r\n$5\r\nBLPOP\r\n$14\r\nUser_8_Profile\r\n$1\r\n0\r\n");
  TakeUpstream();
  ASSERT_TRUE(Upstream(":0\r\n*2\r\n$14\r\nuser:8:profile\r\n$1\r\nx\r\n"));
  EXPECT_EQ(TakeClient(), "*2\r\n$14\r\nUser_8_Profile\r\n$1\r\nx\r\n");
  EXPECT_EQ(conn_->pending(), 0u);
}

TEST_F(ConnectionTest, SteadyStateAllocatesNothingPerCommand) {
  const std::string batch =
      Repeat("*3\r\n$3\r\nSET\r\n$5\r\nkey:1\r\n$3\r\nabc\r\n*2\r\n$3\r\nGET\r\n$5\r\nkey:1\r\n", 8);
  const std::string replies = Repeat("+OK\r\n$3\r\nabc\r\n", 8);
  Open(kPlain);
  ExpectNoAllocationPerCommand(batch, replies);
  Open("");  // the key policy and the detectors at their defaults
  ExpectNoAllocationPerCommand(batch, replies);
  Open(kTenant);  // prefixed keys: spliced into the scratch arena
  ExpectNoAllocationPerCommand(batch, replies);
}

constexpr const char* kWalking =
    "tenancy: {prefix: 'tenant:a:', name: a, dbsize: emulate, walk_steps_per_second: 1}\nhygiene: {enabled: false}\n";

TEST_F(ConnectionTest, AWalkHoldsLaterCommandsAndWaitsForTheTenantsRate) {
  Open(kWalking);
  Client("*1\r\n$6\r\nDBSIZE\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
  const std::string step = TakeUpstream();
  EXPECT_NE(step.find("EVAL"), std::string::npos) << step;
  EXPECT_EQ(step.find("GET"), std::string::npos) << "GET waits behind the walk";
  EXPECT_TRUE(conn_->holding());
  EXPECT_EQ(conn_->TakeWalkWait(), 0) << "the first step had a token";
  // [cursor, keys seen, key found]: more to walk, but the tenant's one step a second is spent.
  Upstream("*3\r\n$1\r\n7\r\n:2\r\n$0\r\n\r\n");
  EXPECT_EQ(TakeUpstream(), "");
  const int64_t wait = conn_->TakeWalkWait();
  EXPECT_GT(wait, 900'000'000);
  EXPECT_EQ(conn_->TakeWalkWait(), 0) << "asked for once";
  now_ += wait;
  conn_->OnWalkTimer(now_);
  ASSERT_EQ(conn_->output().upstream.size(), 1u);
  const std::string second(conn_->output().upstream[0]);
  EXPECT_NE(second.find("EVAL"), std::string::npos) << second;
  EXPECT_NE(second, step) << "the next step starts at the cursor";
  Upstream("*3\r\n$1\r\n0\r\n:3\r\n$0\r\n\r\n");
  EXPECT_EQ(TakeClient(), ":5\r\n");
  EXPECT_FALSE(conn_->holding());
  EXPECT_TRUE(conn_->resume());
  Client("");  // the commands read meanwhile
  EXPECT_EQ(TakeUpstream(), "*2\r\n$3\r\nGET\r\n$10\r\ntenant:a:k\r\n");
  EXPECT_FALSE(conn_->resume());
}

TEST_F(ConnectionTest, AWalkForAClientThatHungUpEndsAtTheNextStep) {
  Open(kWalking);
  Client("*1\r\n$6\r\nDBSIZE\r\n");
  TakeUpstream();
  client_gone_ = true;
  Upstream("*3\r\n$1\r\n7\r\n:2\r\n$0\r\n\r\n");
  EXPECT_EQ(TakeUpstream(), "");
  EXPECT_EQ(TakeClient(), "-ERR keyguard: the client closed the connection\r\n");
  EXPECT_EQ(conn_->pending(), 0u);
  EXPECT_FALSE(conn_->holding());
}

// ---------------------------------------------------------------------------------------------
// Shared upstream connections

TEST(PinFor, ConnectionStateCommandsPinAndPlainOnesDoNot) {
  auto pin = [](std::initializer_list<std::string_view> a, bool tenancy = false) {
    const std::vector<std::string_view> args = a;
    return PinFor(commands::LookupCommand(args[0]), args, tenancy);
  };
  EXPECT_EQ(pin({"GET", "k"}), PinReason::kNone);
  EXPECT_EQ(pin({"EVAL", "return 1", "0"}), PinReason::kNone);
  EXPECT_EQ(pin({"EXEC"}), PinReason::kNone);  // outside a transaction: an error, nothing changes
  EXPECT_EQ(pin({"multi"}), PinReason::kTransaction);
  EXPECT_EQ(pin({"WATCH", "k"}), PinReason::kTransaction);
  EXPECT_EQ(pin({"BLPOP", "q", "0"}), PinReason::kBlocking);
  EXPECT_EQ(pin({"BZPOPMIN", "z", "1"}), PinReason::kBlocking);
  EXPECT_EQ(pin({"WAIT", "1", "0"}), PinReason::kBlocking);
  EXPECT_EQ(pin({"XREAD", "COUNT", "1", "STREAMS", "s", "0"}), PinReason::kNone);
  EXPECT_EQ(pin({"XREAD", "block", "0", "STREAMS", "s", "$"}), PinReason::kBlocking);
  EXPECT_EQ(pin({"XREADGROUP", "GROUP", "g", "c", "STREAMS", "block", ">"}), PinReason::kNone);  // a stream named block
  EXPECT_EQ(pin({"XREADGROUP", "GROUP", "streams", "c1", "BLOCK", "0", "STREAMS", "s", ">"}), PinReason::kBlocking);
  EXPECT_EQ(pin({"XREADGROUP", "GROUP", "g", "STREAMS", "COUNT", "1", "NOACK", "BLOCK", "0", "STREAMS", "s", ">"}),
            PinReason::kBlocking);
  EXPECT_EQ(pin({"XREAD", "COUNT", "block", "STREAMS", "s", "0"}), PinReason::kNone);  // COUNT's value
  // Options in any order, as xreadCommand reads them: BLOCK before GROUP, after NOACK, a second
  // GROUP; a NUL ends an option word (strcasecmp).
  EXPECT_EQ(pin({"XREADGROUP", "COUNT", "1", "BLOCK", "0", "GROUP", "g", "c", "STREAMS", "s", ">"}),
            PinReason::kBlocking);
  EXPECT_EQ(pin({"XREADGROUP", "NOACK", "BLOCK", "0", "GROUP", "g", "c", "STREAMS", "s", ">"}), PinReason::kBlocking);
  EXPECT_EQ(pin({"XREADGROUP", "GROUP", "g", "c", "GROUP", "g", "c", "BLOCK", "0", "STREAMS", "s", ">"}),
            PinReason::kBlocking);
  EXPECT_EQ(pin({"XREAD", std::string_view("BLOCK\0x", 7), "0", "STREAMS", "s", "$"}), PinReason::kBlocking);
  EXPECT_EQ(pin({"XREAD", "BLOCK", "0", "GROUP", "g", "c", "STREAMS", "s", "$"}), PinReason::kNone);  // an error
  EXPECT_EQ(pin({"XREADGROUP", "BLOCK", "0", "STREAMS", "s", ">"}), PinReason::kNone);     // no GROUP: an error
  EXPECT_EQ(pin({"XREAD", "BLOCK", "0", "JUNK", "STREAMS", "s", "$"}), PinReason::kNone);  // a syntax error
  EXPECT_EQ(pin({"SUBSCRIBE", "c"}), PinReason::kPubSub);
  EXPECT_EQ(pin({"PUNSUBSCRIBE"}), PinReason::kPubSub);
  EXPECT_EQ(pin({"MONITOR"}), PinReason::kMonitor);
  EXPECT_EQ(pin({"CLIENT", "SETNAME", "x"}), PinReason::kNone);  // keyguard keeps the name
  EXPECT_EQ(pin({"CLIENT", "SETINFO", "LIB-NAME", "redis-py"}), PinReason::kNone);
  EXPECT_EQ(pin({"CLIENT", "TRACKING", "on"}), PinReason::kClient);
  EXPECT_EQ(pin({"CLIENT", "ID"}), PinReason::kClient);
  EXPECT_EQ(pin({"client", "getname"}), PinReason::kNone);
  EXPECT_EQ(pin({"HELLO"}), PinReason::kNone);
  EXPECT_EQ(pin({"HELLO", "2"}), PinReason::kNone);
  EXPECT_EQ(pin({"HELLO", "2", "SETNAME", "x"}), PinReason::kHello);
  EXPECT_EQ(pin({"HELLO", "2", "AUTH", "u", "p"}), PinReason::kHello);
  EXPECT_EQ(pin({"HELLO", "2"}, /*tenancy=*/true), PinReason::kHello);  // how a tenant logs in
  EXPECT_EQ(pin({"READONLY"}), PinReason::kClient);
  EXPECT_EQ(pin({"SELECT", "0"}), PinReason::kNone);
  EXPECT_EQ(pin({"SELECT", "2"}), PinReason::kSelect);
  EXPECT_EQ(pin({"HELLO", "3"}), PinReason::kHello);
  EXPECT_EQ(pin({"AUTH", "pw"}), PinReason::kAuth);
  EXPECT_EQ(pin({"AUTH", "pw"}, /*tenancy=*/true), PinReason::kNone);  // keyguard answers it
  EXPECT_EQ(pin({"RESET"}), PinReason::kReset);
  EXPECT_EQ(pin({"PSYNC", "?", "-1"}), PinReason::kReplication);
  EXPECT_EQ(pin({"REPLCONF", "rdb-filter-only", "functions"}), PinReason::kReplication);
  EXPECT_EQ(pin({"SCRIPT", "KILL"}), PinReason::kControl);
  EXPECT_EQ(pin({"function", "kill"}), PinReason::kControl);
  EXPECT_EQ(pin({"SCRIPT", std::string_view("KILL\0x", 6)}), PinReason::kControl);  // strcasecmp
  EXPECT_EQ(pin({"SCRIPT", "LOAD", "return 1"}), PinReason::kNone);
  EXPECT_EQ(pin({"SCRIPT", "KILL", "x"}), PinReason::kNone);  // the server's syntax error
  EXPECT_TRUE(PinEnds(PinReason::kControl));
  EXPECT_STREQ(PinReasonName(PinReason::kControl), "control");
  EXPECT_TRUE(PinEnds(PinReason::kTransaction));
  EXPECT_TRUE(PinEnds(PinReason::kBlocking));
  EXPECT_FALSE(PinEnds(PinReason::kSelect));
  EXPECT_STREQ(PinReasonName(PinReason::kReplication), "replication");
}

TEST_F(ConnectionTest, OnASharedConnectionEachCommandIsOneReplyInOrder) {
  Open(kPlain, false, "", /*shared=*/true);
  EXPECT_EQ(TakeUpstream(), "") << "no AUTH or CLIENT ID of its own";
  Client("*3\r\n$3\r\nSET\r\n$1\r\na\r\n$1\r\n1\r\n*2\r\n$3\r\nGET\r\n$1\r\na\r\nPING\r\n");
  EXPECT_EQ(TakeCommands(), 3u);
  // (The inline PING goes as multibulk: nothing else goes on a shared connection.)
  EXPECT_EQ(TakeUpstream(),
            "*3\r\n$3\r\nSET\r\n$1\r\na\r\n$1\r\n1\r\n*2\r\n$3\r\nGET\r\n$1\r\na\r\n*1\r\n$4\r\nPING\r\n");
  ASSERT_TRUE(Upstream("+OK\r\n$1\r\n1\r\n+PONG\r\n"));
  EXPECT_EQ(TakeClient(), "+OK\r\n$1\r\n1\r\n+PONG\r\n");
  // QUIT is keyguard's to answer: the shared connection must stay.
  Client("*1\r\n$4\r\nQUIT\r\n");
  EXPECT_EQ(TakeUpstream(), "");
  EXPECT_EQ(TakeClient(), "+OK\r\n");
  EXPECT_TRUE(conn_->stop_reading());
}

TEST_F(ConnectionTest, APinningCommandWaitsUnreadUntilEverythingBeforeItIsAnswered) {
  Open(kPlain, false, "", /*shared=*/true);
  Client(
      "*2\r\n$3\r\nGET\r\n$1\r\na\r\n*1\r\n$5\r\nMULTI\r\n*2\r\n$4\r\nINCR\r\n$1\r\na\r\n"
      "*1\r\n$4\r\nEXEC\r\n");
  EXPECT_EQ(TakeUpstream(), "*2\r\n$3\r\nGET\r\n$1\r\na\r\n") << "only what came before MULTI";
  EXPECT_EQ(conn_->pin_wanted(), PinReason::kTransaction);
  ASSERT_TRUE(Upstream("$-1\r\n"));
  EXPECT_EQ(TakeClient(), "$-1\r\n");
  EXPECT_EQ(conn_->pending(), 0u);
  // Pinned to a fresh connection: keyguard's AUTH goes first, then the commands that waited.
  EXPECT_EQ(Call([&] { return conn_->OnPinned(/*fresh=*/true); }), PinReason::kTransaction);
  EXPECT_EQ(shard_.upstream_connections.Get(), 1);
  EXPECT_EQ(shard_.UpstreamOf(metrics::UpstreamKind::kPinned).Get(), 1);
  Client("");
  EXPECT_EQ(TakeUpstream(), "*1\r\n$5\r\nMULTI\r\n*2\r\n$4\r\nINCR\r\n$1\r\na\r\n*1\r\n$4\r\nEXEC\r\n");
  EXPECT_FALSE(conn_->CanUnpin());
  ASSERT_TRUE(Upstream("+OK\r\n+QUEUED\r\n"));
  EXPECT_FALSE(conn_->CanUnpin()) << "inside the transaction";
  ASSERT_TRUE(Upstream("*1\r\n:1\r\n"));
  EXPECT_EQ(TakeClient(), "+OK\r\n+QUEUED\r\n*1\r\n:1\r\n");
  EXPECT_TRUE(conn_->CanUnpin());
  conn_->OnUnpinned();
  EXPECT_FALSE(conn_->pinned());
  EXPECT_EQ(shard_.upstream_connections.Get(), 0);
  EXPECT_EQ(shard_.UpstreamOf(metrics::UpstreamKind::kPinned).Get(), 0);
}

TEST_F(ConnectionTest, OnASharedConnectionKeyguardKeepsTheClientsName) {
  Open(kPlain, false, "", /*shared=*/true);
  Client(
      "*2\r\n$6\r\nCLIENT\r\n$7\r\nGETNAME\r\n*3\r\n$6\r\nclient\r\n$7\r\nsetname\r\n$5\r\napp-1\r\n"
      "*2\r\n$6\r\nCLIENT\r\n$7\r\nGETNAME\r\n*3\r\n$6\r\nCLIENT\r\n$7\r\nSETNAME\r\n$3\r\na b\r\n"
      "*3\r\n$6\r\nCLIENT\r\n$7\r\nSETNAME\r\n$2\r\n\xc3\xa9\r\n*2\r\n$6\r\nCLIENT\r\n$7\r\nGETNAME\r\n");
  EXPECT_EQ(TakeUpstream(), "") << "answered by keyguard, nothing pinned";
  EXPECT_EQ(conn_->pin_wanted(), PinReason::kNone);
  EXPECT_EQ(TakeClient(),
            "$-1\r\n+OK\r\n$5\r\napp-1\r\n"
            "-ERR Client names cannot contain spaces, newlines or special characters.\r\n"
            "-ERR Client names cannot contain spaces, newlines or special characters.\r\n$5\r\napp-1\r\n");
  // An empty name removes it, as on the server; SETINFO and HELLO 2 go to the shared connection.
  Client(
      "*3\r\n$6\r\nCLIENT\r\n$7\r\nSETNAME\r\n$0\r\n\r\n*2\r\n$6\r\nCLIENT\r\n$7\r\nGETNAME\r\n"
      "*4\r\n$6\r\nCLIENT\r\n$7\r\nSETINFO\r\n$8\r\nLIB-NAME\r\n$2\r\npy\r\n*2\r\n$5\r\nHELLO\r\n$1\r\n2\r\n");
  EXPECT_EQ(TakeUpstream(),
            "*4\r\n$6\r\nCLIENT\r\n$7\r\nSETINFO\r\n$8\r\nLIB-NAME\r\n$2\r\npy\r\n*2\r\n$5\r\nHELLO\r\n$1\r\n2\r\n");
  EXPECT_EQ(conn_->pin_wanted(), PinReason::kNone);
  ASSERT_TRUE(Upstream("-ERR unknown subcommand 'SETINFO'. Try CLIENT HELP.\r\n*2\r\n$5\r\nproto\r\n:2\r\n"));
  EXPECT_EQ(TakeClient(),
            "+OK\r\n$-1\r\n-ERR unknown subcommand 'SETINFO'. Try CLIENT HELP.\r\n*2\r\n$5\r\nproto\r\n:2\r\n");
  // Pinned (a transaction), a CLIENT SETNAME goes to the pinned connection, which then is the
  // client's for good (not pooled with a name).
  Client("*1\r\n$5\r\nMULTI\r\n");
  Call([&] { return conn_->OnPinned(/*fresh=*/false); });
  Client("*3\r\n$6\r\nCLIENT\r\n$7\r\nSETNAME\r\n$1\r\nx\r\n*1\r\n$4\r\nEXEC\r\n");
  EXPECT_EQ(TakeUpstream(),
            "*1\r\n$5\r\nMULTI\r\n*3\r\n$6\r\nCLIENT\r\n$7\r\nSETNAME\r\n$1\r\nx\r\n*1\r\n$4\r\nEXEC\r\n");
  ASSERT_TRUE(Upstream("+OK\r\n+QUEUED\r\n*1\r\n+OK\r\n"));
  EXPECT_EQ(conn_->pending(), 0u);
  EXPECT_FALSE(conn_->CanUnpin()) << "named: the client's for good";
}

TEST_F(ConnectionTest, APinWhoseCommandKeyguardRefusesEndsAfterAPing) {
  Open("deny_commands: [SUBSCRIBE]\n", false, "", /*shared=*/true);
  Client("*2\r\n$9\r\nSUBSCRIBE\r\n$1\r\nc\r\n");
  EXPECT_EQ(conn_->pin_wanted(), PinReason::kPubSub);
  Call([&] { return conn_->OnPinned(/*fresh=*/false); });
  Client("");
  EXPECT_EQ(TakeClient(), "-ERR keyguard: command 'SUBSCRIBE' is not allowed here\r\n");
  EXPECT_EQ(TakeUpstream(), "*1\r\n$4\r\nPING\r\n") << "nothing of the client's, a PING of keyguard's";
  EXPECT_FALSE(conn_->CanUnpin()) << "until the PING is answered";
  ASSERT_TRUE(Upstream("+PONG\r\n"));
  EXPECT_EQ(TakeClient(), "") << "the PING's reply is keyguard's";
  EXPECT_TRUE(conn_->CanUnpin()) << "no longer pinned for good: SUBSCRIBE never reached the server";
  conn_->OnUnpinned();
  // An error answering the PING (a server still loading) ends the pin as well: it is not taken
  // for the server refusing keyguard's AUTH.
  Client("*2\r\n$9\r\nSUBSCRIBE\r\n$1\r\nc\r\n");
  Call([&] { return conn_->OnPinned(/*fresh=*/false); });
  Client("");
  EXPECT_EQ(TakeClient(), "-ERR keyguard: command 'SUBSCRIBE' is not allowed here\r\n");
  EXPECT_EQ(TakeUpstream(), "*1\r\n$4\r\nPING\r\n");
  ASSERT_TRUE(Upstream("-LOADING Redis is loading the dataset in memory\r\n"));
  EXPECT_EQ(TakeClient(), "");
  EXPECT_TRUE(conn_->CanUnpin());
  conn_->OnUnpinned();
  // A pin whose command went to the server stays, whatever is refused after it.
  Client("*2\r\n$6\r\nSELECT\r\n$1\r\n2\r\n");
  Call([&] { return conn_->OnPinned(/*fresh=*/false); });
  Client("*2\r\n$9\r\nSUBSCRIBE\r\n$1\r\nc\r\n");
  EXPECT_EQ(TakeUpstream(), "*2\r\n$6\r\nSELECT\r\n$1\r\n2\r\n");
  ASSERT_TRUE(Upstream("+OK\r\n"));
  EXPECT_EQ(TakeClient(), "+OK\r\n-ERR keyguard: command 'SUBSCRIBE' is not allowed here\r\n");
  EXPECT_FALSE(conn_->CanUnpin()) << "database 2 is this connection's for good";
}

TEST_F(ConnectionTest, ARefusedCommandThatWouldMakeAPinLastLeavesItAsItWas) {
  Open("deny_commands: [SUBSCRIBE]\n", false, "", /*shared=*/true);
  Client("*1\r\n$5\r\nMULTI\r\n");
  Call([&] { return conn_->OnPinned(/*fresh=*/false); });
  Client("*2\r\n$9\r\nSUBSCRIBE\r\n$1\r\nc\r\n*1\r\n$4\r\nEXEC\r\n");
  EXPECT_EQ(TakeUpstream(), "*1\r\n$5\r\nMULTI\r\n*1\r\n$7\r\nDISCARD\r\n") << "EXEC aborted: DISCARD";
  ASSERT_TRUE(Upstream("+OK\r\n+OK\r\n"));
  EXPECT_EQ(TakeClient(),
            "+OK\r\n-ERR keyguard: command 'SUBSCRIBE' is not allowed here\r\n"
            "-EXECABORT Transaction discarded because of previous errors.\r\n");
  EXPECT_TRUE(conn_->CanUnpin()) << "the transaction is over, and no subscription was made";
}

TEST_F(ConnectionTest, StateThatLastsKeepsThePin) {
  Open(kPlain, false, "", /*shared=*/true);
  Client("*2\r\n$5\r\nWATCH\r\n$1\r\na\r\n");
  EXPECT_EQ(TakeUpstream(), "");
  Call([&] { return conn_->OnPinned(/*fresh=*/false); });
  Client("*2\r\n$6\r\nSELECT\r\n$1\r\n1\r\n*1\r\n$7\r\nUNWATCH\r\n");
  EXPECT_EQ(TakeUpstream(), "*2\r\n$5\r\nWATCH\r\n$1\r\na\r\n*2\r\n$6\r\nSELECT\r\n$1\r\n1\r\n*1\r\n$7\r\nUNWATCH\r\n");
  ASSERT_TRUE(Upstream("+OK\r\n+OK\r\n+OK\r\n"));
  EXPECT_EQ(conn_->pending(), 0u);
  EXPECT_FALSE(conn_->CanUnpin()) << "database 1 is this connection's for good";
}

TEST_F(ConnectionTest, ASharedConnectionThatFailsFailsWhatWasInFlightAndTheClientStays) {
  Open(kPlain, false, "", /*shared=*/true);
  Client("*2\r\n$3\r\nGET\r\n$1\r\na\r\n*2\r\n$3\r\nGET\r\n$1\r\nb\r\n");
  EXPECT_EQ(conn_->OnSharedFailed(), "-ERR keyguard: upstream unavailable\r\n-ERR keyguard: upstream unavailable\r\n");
  EXPECT_EQ(conn_->pending(), 0u);
  EXPECT_FALSE(conn_->stop_reading());
  // While it is down, commands get the error and the client stays.
  conn_->set_shared_ready(false);
  TakeUpstream();
  Client("*2\r\n$3\r\nGET\r\n$1\r\na\r\n");
  EXPECT_EQ(TakeUpstream(), "");
  EXPECT_EQ(TakeClient(), "-ERR keyguard: upstream unavailable\r\n");
  EXPECT_FALSE(conn_->stop_reading());
  conn_->set_shared_ready(true);
  Client("*2\r\n$3\r\nGET\r\n$1\r\na\r\n");
  EXPECT_EQ(TakeUpstream(), "*2\r\n$3\r\nGET\r\n$1\r\na\r\n");
}

}  // namespace
}  // namespace keyguard::proxy

namespace keyguard::proxy {
namespace {

// A Redis Cluster upstream: each forwarded command's route, the splits, and what keyguard answers.
class ClusterConnectionTest : public ConnectionTest {
 protected:
  void OpenCluster() {
    Open(kPlain, false, "", /*shared=*/true);
    conn_->set_cluster("10.1.2.3", 7000);
  }
};

TEST_F(ClusterConnectionTest, EachCommandIsRoutedByTheSlotOfItsKeys) {
  OpenCluster();
  const std::string batch =
      "*2\r\n$3\r\nGET\r\n$3\r\nfoo\r\n*1\r\n$4\r\nPING\r\n"
      "*3\r\n$4\r\nMGET\r\n$6\r\n{a}one\r\n$6\r\n{a}two\r\n*1\r\n$6\r\nDBSIZE\r\n"
      "*2\r\n$4\r\nSCAN\r\n$1\r\n0\r\n";
  Client(batch);
  EXPECT_EQ(TakeUpstream(), batch);
  const std::vector<Route> r = TakeRoutes();
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[0].slot, 12182);  // CLUSTER KEYSLOT foo
  EXPECT_EQ(r[0].bytes, 22u);
  EXPECT_EQ(r[1].slot, kAnyNode);
  EXPECT_EQ(r[2].slot, cluster::KeySlot("a"));
  EXPECT_EQ(r[3].slot, kEveryNode);
  EXPECT_EQ(r[3].merge, cluster::Merge::kSum);
  EXPECT_TRUE(r[4].scan);
  size_t total = 0;
  for (const Route& x : r) total += x.bytes;
  EXPECT_EQ(total, batch.size());
}

TEST_F(ClusterConnectionTest, MultiKeyCommandsAcrossSlotsAreSplitOthersGetCrossslot) {
  OpenCluster();
  // foo and bar are in different slots; {foo}x is in foo's.
  Client("*4\r\n$4\r\nMGET\r\n$3\r\nfoo\r\n$3\r\nbar\r\n$6\r\n{foo}x\r\n");
  EXPECT_EQ(TakeUpstream(), "*3\r\n$4\r\nMGET\r\n$3\r\nfoo\r\n$6\r\n{foo}x\r\n*2\r\n$4\r\nMGET\r\n$3\r\nbar\r\n");
  const std::vector<Route> r = TakeRoutes();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].split, 1);
  EXPECT_EQ(r[1].split, 2);
  EXPECT_EQ(r[0].merge, cluster::Merge::kMget);
  EXPECT_EQ(r[0].slot, 12182);
  EXPECT_EQ(r[1].slot, 5061);
  EXPECT_EQ(route_positions_taken_, (std::vector<std::vector<uint32_t>>{{0, 2}, {1}}));
  EXPECT_EQ(conn_->pending(), 1u) << "one reply is owed to the client";
  // MSET keeps each value with its key.
  Client("*5\r\n$4\r\nMSET\r\n$3\r\nfoo\r\n$1\r\n1\r\n$3\r\nbar\r\n$1\r\n2\r\n");
  EXPECT_EQ(TakeUpstream(), "*3\r\n$4\r\nMSET\r\n$3\r\nfoo\r\n$1\r\n1\r\n*3\r\n$4\r\nMSET\r\n$3\r\nbar\r\n$1\r\n2\r\n");
  EXPECT_EQ(TakeRoutes()[0].merge, cluster::Merge::kAllOk);
  // Not split: Redis's error, in its place, nothing sent.
  Client("*3\r\n$6\r\nRENAME\r\n$3\r\nfoo\r\n$3\r\nbar\r\n");
  EXPECT_EQ(TakeUpstream(), "");
  EXPECT_TRUE(TakeRoutes().empty());
  EXPECT_TRUE(Upstream("*2\r\n$1\r\nv\r\n$-1\r\n+OK\r\n"));
  EXPECT_EQ(TakeClient(), "*2\r\n$1\r\nv\r\n$-1\r\n+OK\r\n-CROSSSLOT Keys in request don't hash to the same slot\r\n");
}

TEST_F(ClusterConnectionTest, AnUnknownCommandGoesToTheServerWhichAnswersIt) {
  OpenCluster();
  // (WAITAOF is not in a 7.0 table: its id is the unknown command's, which must not be refused as WAIT.)
  const std::string unknown = "*2\r\n$9\r\nNOSUCHCMD\r\n$1\r\nx\r\n";
  Client(unknown);
  EXPECT_EQ(TakeUpstream(), unknown);
  const std::vector<Route> r = TakeRoutes();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].slot, kAnyNode);
  EXPECT_EQ(TakeClient(), "");
  // WAIT is refused: the client's writes went over shared connections to several nodes.
  Client("*3\r\n$4\r\nWAIT\r\n$1\r\n1\r\n$1\r\n0\r\n");
  EXPECT_EQ(TakeUpstream(), "");
  EXPECT_EQ(conn_->pin_wanted(), PinReason::kNone);
}

TEST_F(ClusterConnectionTest, KeyguardAnswersAsAOneNodeCluster) {
  OpenCluster();
  Client(
      "*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n*3\r\n$7\r\nCLUSTER\r\n$7\r\nKEYSLOT\r\n$3\r\nfoo\r\n"
      "*3\r\n$6\r\nCLIENT\r\n$7\r\nSETNAME\r\n$2\r\nme\r\n*2\r\n$6\r\nCLIENT\r\n$7\r\nGETNAME\r\n"
      "*2\r\n$7\r\nCLUSTER\r\n$8\r\nFAILOVER\r\n");
  EXPECT_EQ(TakeUpstream(), "");
  EXPECT_EQ(conn_->pin_wanted(), PinReason::kNone) << "CLIENT SETNAME does not pin";
  const std::string out = TakeClient();
  EXPECT_TRUE(out.starts_with("*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$8\r\n10.1.2.3\r\n:7000\r\n$40\r\n")) << out;
  EXPECT_TRUE(
      out.ends_with(":12182\r\n+OK\r\n$2\r\nme\r\n-ERR keyguard: CLUSTER FAILOVER is not served through "
                    "keyguard (ask the cluster's nodes directly)\r\n"))
      << out;
}

}  // namespace
}  // namespace keyguard::proxy
