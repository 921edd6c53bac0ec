// One client connection and its own upstream connection (1:1), on one worker thread: the
// transport of a Connection (connection.h), which decides what every byte becomes.
//
// Both ends are Streams (plain TCP, or TLS: listen_tls, rediss://). Two coroutines move bytes:
// ClientPump reads the client and hands the bytes to the Connection, UpstreamPump does the same
// for the upstream; after each call, Flush writes what the Connection produced for each side.
// Session owns the streams, the read buffers, backpressure (a slow reader on one side stops reads
// on the other), the walk timer, drain and close.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "proxy/asio.h"
#include "proxy/cluster_client.h"
#include "proxy/connection.h"
#include "proxy/outbox.h"
#include "proxy/stream.h"
#include "proxy/read_buffer.h"
#include "proxy/shared_upstream.h"
#include "proxy/worker.h"

namespace keyguard::proxy {

class Session : public std::enable_shared_from_this<Session>, private ConnectionHost, private LinkClient {
 public:
  Session(Worker& worker, Socket client);
  ~Session();

  // Connects upstream and starts both pumps.
  void Start();
  // Stop gracefully: close once no reply is pending.
  void Drain();
  // Called about once a second: an upstream connection owing replies that has sent nothing for a
  // second is asked (a peek) whether the server closed it. A close that came with the last bytes
  // raises no further epoll edge (async_read.h), so it is not waited for forever.
  void CheckUpstream(int64_t now_ns);
  // Called about once a second: whether the client is not read (its commands wait for replies,
  // or it sent QUIT), the oldest reply it is owed is a blocking command's, none came for a second,
  // and it hung up. CloseHungUp then closes it,
  // and with it a pinned or dedicated connection whose command may block for ever (BLPOP 0, then
  // QUIT or a protocol error): the server frees such a client when it reads the end of its stream.
  bool ClientHungUp(int64_t now_ns);
  void CloseHungUp();
  // Close both connections now.
  void Close();

 private:
  awaitable<void> Run();
  // listen_tls: the handshake with the client, and the tenant its certificate names. False when
  // the session closed.
  awaitable<bool> AcceptTls();
  template <bool kShared>
  awaitable<void> ClientPump();
  awaitable<void> UpstreamPump();
  awaitable<void> FlushAndClose();
  // FlushAndClose in its own coroutine, unless it runs already.
  void StartFlushAndClose();

  // Reads the commands in the client buffer, and writes what they became. Inlined into the pump,
  // as is Flush: at pipeline depth 1 each runs once per command.
  template <bool kShared>
  [[gnu::always_inline]] inline void ProcessClientBytes(size_t* hint);
  // Writes what the last call into conn_ produced (the client's side first), and arms the walk
  // timer when the connection asks for it. FlushAs<kShared> where the mode is known.
  void Flush();
  template <bool kShared>
  [[gnu::always_inline]] inline void FlushAs();
  void ArmWalkTimer(int64_t wait_ns);
  // `tell_client` false: the commands still pending get no error reply (the close says it).
  void FailUpstream(metrics::UpstreamError reason, bool tell_client = true);
  // Shared upstream: the client gets a connection of its own (the idle pool's, or a new one) for
  // the command that waits unread, and its replies come from UpstreamPump until Unpin.
  awaitable<void> Pin();
  void Unpin();
  // HELLO 2|3 on a shared connection of the other protocol: the client moves to one of the
  // worker's links of that protocol (RESP3's made at the first such HELLO) and waits for it to be
  // up, as a new client does.
  awaitable<void> SwitchLink();
  // The idle pool of the client's protocol (a RESP3 client's connections said HELLO 3 already).
  PinPool& Pins() { return conn_.link_protocol() == 3 ? Resp3Pins(worker_) : *worker_.pins; }
  // The pinned time, observed by reason (at Unpin, or when the client closes pinned).
  void ObservePin();
  // Closes a client that does not read its replies from a shared link (slow_client_closed).
  void CutOff();
  // A window from now: a client still over its output bound that took nothing since `progress`
  // is cut off.
  void ArmWatchdog(uint64_t progress);
  // Where the client's commands go now: a shared link (not pinned), or upstream_.
  bool on_link() const { return multiplexed() && !conn_.pinned(); }
  // Shared upstream connections: one link, or a cluster's (not dedicated).
  bool multiplexed() const { return link_ != nullptr || cluster_ != nullptr; }
  // Closes the upstream connection (and counts it gone, if it was up).
  void CloseUpstream();
  void NotifyQueue();
  // ClientPump stops reading the client (from now, if it was reading).
  void WaitingForUpstream();

  // ConnectionHost.
  bool ClientGone() override;
  void Report(hygiene::Finding f) override;
  void WakeProbe() override;
  std::string_view UpstreamAuth() override;
  // LinkClient.
  void BeginLinkReplies(SharedLink* from) override;
  bool OnLinkFrame(std::string_view frame, const resp::ReplyFramer& f) override;
  void OnLinkPush(std::string_view frame, const resp::ReplyFramer& f) override;
  bool EndLinkReplies() override;
  std::shared_ptr<void> Hold() override { return shared_from_this(); }
  // Bytes the client has taken: written to its socket and no longer queued there (SIOCOUTQ), so
  // a client that reads is seen reading before its socket is writable again.
  uint64_t ClientProgress() override;
  awaitable<void> WaitForClient(uint64_t progress, std::chrono::steady_clock::time_point deadline) override;
  void OnLinkFailed(SharedLink* from, metrics::UpstreamError reason) override;

  Worker& worker_;
  Stream client_;
  std::unique_ptr<Stream> upstream_;  // dedicated, or pinned (shared: nullptr while not pinned)
  // The last read ended with a reply the server may close the connection after (CLIENT KILL of
  // itself, ...: Connection::TakeCloseMayFollow).
  bool last_reply_may_close_ = false;
  SharedLink* link_ = nullptr;  // upstream_connections: shared (the read lane's)
  // The link the client's commands go to now: its write lane's for writes (Connection::set_lanes).
  SharedLink* lane_link() const { return conn_.write_lane() && link_->partner() != nullptr ? link_->partner() : link_; }
  // Waits (each bounded by the connect timeout) for both lanes' connections of `link`; whether
  // both are up.
  awaitable<bool> WaitForLanes(SharedLink* link);
  std::unique_ptr<ClusterClient> cluster_;  // a Redis Cluster upstream (instead of link_)
  int64_t pinned_at_ns_ = 0;
  int64_t link_now_ns_ = 0;       // the time of the link's run of replies
  int64_t upstream_read_ns_ = 0;  // the last read from upstream_ (or its start)
  bool upstream_eof_ = false;     // CheckUpstream found the server closed upstream_
  int64_t waiting_since_ns_ = 0;  // since when ClientPump has not read the client (0: it reads)
  bool link_ok_ = true;           // no frame from the link broke the connection (else it closes)
  bool watchdog_armed_ = false;   // a client over its output bound gets a window to read in
  PinReason pin_reason_ = PinReason::kNone;
  Outbox client_out_;
  Outbox upstream_out_;
  ReadBuffer client_buf_;
  ReadBuffer upstream_buf_;
  std::shared_ptr<const std::string> upstream_auth_;  // the AUTH last sent upstream (UpstreamAuth)
  Connection conn_;
  Timer queue_event_;  // wakes ClientPump when replies were delivered
  bool queue_waiter_ = false;
  std::unique_ptr<Timer> walk_timer_;  // a walk step waiting for the tenant's rate
  bool drain_after_walk_ = false;      // Drain() came while commands were held behind a walk
  bool closing_ = false;
  bool closed_ = false;
};

}  // namespace keyguard::proxy
