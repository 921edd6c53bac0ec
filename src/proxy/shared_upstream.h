// Shared upstream connections (upstream_connections: shared): each worker keeps a few pipelined
// connections to the upstream, and many clients' commands go over them. A SharedLink is one such
// connection: clients Submit their commands (with how many there are: each is answered by one
// reply frame, as nothing else goes to a shared connection), everything submitted in one turn of
// the worker's event loop goes out in one write, and the replies are framed (once: the client's
// connection takes the framer's facts) and handed back to the client that owes them, in order, as
// runs of frames (one Begin/End per client per read).
//
// A link that fails fails the commands in flight on it (each client is told once and answers its
// commands with an error; the clients stay) and connects again with backoff.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <chrono>
#include <optional>
#include <vector>

#include "keyguard/config/config.h"
#include "keyguard/metrics/registry.h"
#include "keyguard/resp/framer.h"
#include "proxy/asio.h"
#include "proxy/outbox.h"
#include "proxy/read_buffer.h"
#include "proxy/stream.h"

namespace keyguard::proxy {

struct Worker;
class SharedLink;

// A client of a shared link (a Session), told about its replies and failures.
class LinkClient {
 public:
  // The reply frames of this client's commands, in order, framed by the link (`f` holds each
  // frame's facts; the bytes are valid during the call): a run of them between Begin and End.
  virtual void BeginLinkReplies(SharedLink* from) = 0;
  // Returns false when the frame answers none of the client's commands (its count of them is not
  // the link's): the link's stream is not what keyguard sent, and it fails (SharedLink::Desync).
  virtual bool OnLinkFrame(std::string_view frame, const resp::ReplyFramer& f) = 0;
  // A RESP3 push in the run (a RESP3 link), which answers no command: DEBUG PROTOCOL push's, or
  // one aimed at the link's connection (CLIENT TRACKING REDIRECT), which is nobody's.
  virtual void OnLinkPush(std::string_view frame, const resp::ReplyFramer& f) = 0;
  // Returns true when the client's output is over its bound: the link reads nothing more until
  // WaitForClient() completes.
  virtual bool EndLinkReplies() = 0;
  // Keeps the client alive while the link waits for it.
  virtual std::shared_ptr<void> Hold() = 0;
  // Bytes written to the client so far (its progress).
  virtual uint64_t ClientProgress() = 0;
  // Completes when the client's output is below its bound, or the client is cut off: it wrote
  // nothing more than `progress` by `deadline` (or in any later window of the same length).
  virtual awaitable<void> WaitForClient(uint64_t progress, std::chrono::steady_clock::time_point deadline) = 0;
  // The link failed: every command of this client in flight on it is lost.
  virtual void OnLinkFailed(SharedLink* from, metrics::UpstreamError reason) = 0;

 protected:
  ~LinkClient() = default;
};

// Where an upstream connection goes: the worker's upstream (`endpoint` unset), or a cluster node.
struct UpstreamAddress {
  std::optional<tcp::endpoint> endpoint;
  std::string host;       // its name, for TLS verification
  bool readonly = false;  // a cluster replica serving reads: READONLY after keyguard's AUTH
  bool resp3 = false;     // HELLO 3 after keyguard's AUTH: a shared connection for RESP3 clients
};

// Connects `stream` to the worker's upstream (or `to`), sends keyguard's AUTH (when configured) and
// reads its answer. false on any failure, counted (keyguard_upstream_errors_total) and logged; a
// TLS failure's reason in `*tls_failure` ("" for any other); a refused HELLO 3 (`to->resp3`) in
// `*refused` ("upstream refused HELLO 3: <the server's error>").
awaitable<bool> ConnectUpstream(Worker& worker, Stream& stream, std::string* tls_failure = nullptr,
                                const UpstreamAddress* to = nullptr, std::string* refused = nullptr);

// Upstream connections kept connected and authenticated for clients that get pinned, up to
// pinned_idle_connections per worker.
class PinPool {
 public:
  // `resp3`: for RESP3 clients (HELLO 3 after keyguard's AUTH).
  explicit PinPool(Worker& worker, bool resp3 = false) : worker_(worker) { to_.resp3 = resp3; }
  ~PinPool();
  // An idle connection that is still open, or nullptr (the caller connects one). Refills.
  std::unique_ptr<Stream> Take();
  // A connection back from a client, in the state a new one has: kept while below the bound.
  void Return(std::unique_ptr<Stream> stream);
  // Connects in the background until the bound is reached.
  void Fill();
  // Closes the idle connections; `for_good`: and keeps none from now on (else: the upstream
  // moved, new ones go to the new address).
  void Stop(bool for_good = true);

 private:
  awaitable<void> Connect();
  Worker& worker_;
  UpstreamAddress to_;  // the worker's upstream (resp3 or not)
  std::vector<std::unique_ptr<Stream>> idle_;
  int connecting_ = 0;
  uint64_t generation_ = 0;  // Stop(false) counts: a connect begun before it is not kept
  bool stopped_ = false;
};

// A shared link of the worker's for RESP3 clients (HELLO 3), round robin; the first call makes
// shared_connections of them (worker.links holds the RESP2 ones first, then these).
SharedLink* PickResp3Link(Worker& worker);
// The worker's idle connections for RESP3 clients' pins (made, and filled, on first use).
PinPool& Resp3Pins(Worker& worker);

// How long a client past 16 times its output bound, which the link waits for, may go without
// taking anything before it is cut off (the link's other clients wait meanwhile).
inline constexpr std::chrono::milliseconds kSlowClientWindow(1000);

class SharedLink : public std::enable_shared_from_this<SharedLink> {
 public:
  // To the worker's upstream, or (`node`, `host`) a cluster node.
  explicit SharedLink(Worker& worker, bool resp3 = false);
  SharedLink(Worker& worker, tcp::endpoint node, std::string host, bool readonly = false, bool resp3 = false);
  SharedLink(const SharedLink&) = delete;
  SharedLink& operator=(const SharedLink&) = delete;

  // Connects (and connects again after a failure, with backoff) until Stop().
  void Start();
  void Stop();
  // A cluster node that left the map: stops for good, quietly (no error counted or logged for
  // the close); clients drop it (ClusterClient::DropRetiredQueues) and the worker frees it.
  void Retire() {
    retired_ = true;
    Stop();
  }
  bool retired() const { return retired_; }
  // The write lane's connection of a read lane's (Connection::set_lanes): made, started and
  // stopped with it; nullptr for a cluster node's.
  SharedLink* partner() const { return partner_; }
  void set_partner(SharedLink* write_lane) { partner_ = write_lane; }
  // Closes the connection (what is in flight fails) and connects again (the upstream moved).
  void Restart() {
    if (conn_ != nullptr) conn_->stream.Close();
  }
  bool up() const { return up_; }
  // Down: waits for the end of the link's next connect (the one under way, or the one after the
  // backoff: clients never hasten it), for upstream_connect_timeout_ms at most. A new client waits
  // here, as a dedicated connection waits for its own connect, rather than get `upstream
  // unavailable` while the link is still connecting (at start, or after a failure).
  awaitable<void> WaitForConnect();
  // Whether replies are owed on it (commands in flight).
  bool owes() const { return !owed_.empty(); }
  // "host:port" of a cluster node ("" for the worker's upstream).
  std::string address() const {
    return to_.host.empty() ? std::string() : config::HostPort{to_.host, to_.endpoint->port()}.ToString();
  }
  // While down after a TLS failure: "upstream TLS: <reason>" (the error clients get), else "".
  const std::string& failure() const { return failure_; }

  // Queues `pieces`, `commands` whole commands of `client`, after everything queued before; the
  // bytes are copied. Returns false when the link is down (nothing is queued).
  bool Submit(LinkClient* client, std::span<const std::string_view> pieces, uint32_t commands);
  // `client` goes away: the replies it still owes are read and dropped.
  void Forget(LinkClient* client);
  // Called about once a second: owing replies and silent for a second, the link asks (a peek)
  // whether the server closed it (Session::CheckUpstream says why); silent for
  // shared_reply_timeout_ms, it fails (reason timeout) and connects again.
  void CheckLiveness(int64_t now_ns);
  // Bytes queued or being written: clients stop reading while it is over the output bound.
  // (What this turn queued goes out with the turn: not counted, so a waiter never spins on it.)
  size_t backlog() const { return conn_ != nullptr ? conn_->out.backlog() : 0; }
  awaitable<void> WaitBelow(size_t limit);

 private:
  awaitable<void> Run();
  // Connects (ConnectUpstream): true when the link is up.
  awaitable<bool> Open();
  // Reads replies until the connection fails; returns why.
  awaitable<metrics::UpstreamError> Pump();
  // A client whose output went over its bound, held while the link waits for it.
  struct Slow {
    LinkClient* client;
    std::shared_ptr<void> hold;
    uint64_t progress;
  };
  // Frames the replies in the buffer and hands each run of one client's frames over. False on a
  // protocol error or a frame nobody owes. Appends the clients over their bound to `*slow`.
  bool Deliver(size_t* hint, std::vector<Slow>* slow);
  void Flush();
  void Fail(metrics::UpstreamError reason);

  struct Owed {
    LinkClient* client;  // nullptr: the client went away
    uint32_t frames;
  };
  // Who owes what, in order: a vector with a moving head (no allocation per entry, as a deque
  // has), emptied when drained and compacted when its consumed part dominates.
  class OwedQueue {
   public:
    bool empty() const { return items_.empty(); }
    Owed& front() { return items_[head_]; }
    Owed& back() { return items_.back(); }
    void push_back(Owed o) { items_.push_back(o); }
    void pop_front() {
      if (++head_ == items_.size()) {
        clear();
      } else if (head_ >= 1024 && 2 * head_ > items_.size()) {
        items_.erase(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(head_));
        head_ = 0;
      }
    }
    void clear() {
      items_.clear();
      head_ = 0;
    }
    std::span<Owed> entries() { return std::span<Owed>(items_).subspan(head_); }

   private:
    std::vector<Owed> items_;
    size_t head_ = 0;
  };

  // One connection and its writer, kept alive by a write still in flight after a failure.
  struct Conn {
    Conn(asio::io_context& io, metrics::Counter* sent) : stream(io), out(stream, sent) {}
    Stream stream;
    Outbox out;
  };

  Worker& worker_;
  UpstreamAddress to_;
  metrics::Counter* node_commands_ = nullptr;  // a cluster node's keyguard_cluster_node_commands_total
  metrics::Counter* node_errors_ = nullptr;
  std::shared_ptr<Conn> conn_;
  ReadBuffer buf_;
  resp::ReplyFramer framer_;
  OwedQueue owed_;
  std::vector<Slow> slow_;  // reused by Pump
  std::string batch_;       // submitted this turn, written by Flush
  uint32_t batch_commands_ = 0;
  bool flush_posted_ = false;
  bool up_ = false;
  bool stopped_ = false;
  bool retired_ = false;
  SharedLink* partner_ = nullptr;
  std::string failure_;
  int64_t last_read_ns_ = 0;
  int64_t owed_since_ns_ = 0;         // when the first reply now owed was submitted (from none owed)
  bool waiting_for_clients_ = false;  // Pump waits for slow clients: nothing is read meanwhile
  // Counts and logs a breach of the one-frame-per-command invariant (Deliver then fails the link).
  void Desync(std::string_view what);
  // The replies owed, for the log.
  uint64_t InFlight() {
    uint64_t n = 0;
    for (const Owed& o : owed_.entries()) n += o.frames;
    return n;
  }
  bool eof_ = false;  // CheckLiveness found the server closed the connection
  Timer backoff_;
  // WaitForConnect's timers, each set to its waiter's limit and cancelled at the end of a connect.
  std::vector<Timer*> waiters_;
  void WakeWaiters();
};

}  // namespace keyguard::proxy
