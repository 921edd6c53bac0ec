// One client connection and its own upstream connection (1:1), on one worker thread.
//
// Two coroutines move bytes: ClientPump frames client commands and forwards them upstream,
// UpstreamPump frames replies and forwards them to the client. The ReplyQueue (queue_) holds one
// entry per command that expects a reply, in request order, including replies keyguard makes
// itself, so every client sees its replies in the order it sent the commands. Out-of-band frames
// (pub/sub messages, RESP3 pushes, MONITOR lines) pass through without taking an entry.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "keyguard/hygiene/serialized.h"
#include "keyguard/hygiene/traffic.h"
#include "keyguard/resp/framer.h"
#include "keyguard/tenant/rewrite.h"
#include "keyguard/tenant/walk.h"
#include "proxy/asio.h"
#include "proxy/connection_state.h"
#include "proxy/outbox.h"
#include "proxy/pipeline.h"
#include "proxy/read_buffer.h"
#include "proxy/refusal.h"
#include "proxy/reply_queue.h"
#include "proxy/scratch.h"
#include "proxy/stream.h"
#include "proxy/worker.h"

namespace keyguard::proxy {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Worker& worker, Socket client);
  ~Session();

  // Connects upstream and starts both pumps.
  void Start();
  // Stop gracefully: close once no reply is pending.
  void Drain();
  // Close both connections now.
  void Close();

 private:
  awaitable<void> Run();
  awaitable<void> ClientPump();
  awaitable<void> UpstreamPump();
  awaitable<void> FlushAndClose();

  // Client side.
  void ProcessClientBytes(size_t* hint);
  void HandleCommand(std::span<const std::string_view> args, const char* raw, size_t raw_len, int64_t now);
  void ForwardRaw(const char* data, size_t len);
  // Encodes a rewritten command into the batch's scratch chunks; the view lives until the batch
  // has been handed to the upstream outbox.
  std::string_view Encode(std::span<const std::string_view> args);
  // A rewritten command from the client's own bytes with only the changed arguments encoded
  // anew: a small one copied into the scratch chunk (`*bytes`), a big one as pieces in splice_
  // (its values never copied). False when `out` cannot be spliced (another arity, an inline
  // command) and Encode must re-encode it.
  bool Splice(const char* raw, size_t raw_len, std::span<const std::string_view> args,
              std::span<const std::string_view> out, std::string_view* bytes);
  // AUTH or HELLO accepted (tenancy): keyguard answers AUTH; HELLO goes upstream without AUTH.
  void Login(const CommandContext& c, const Verdict& v, int64_t now);
  void BindTenant(const tenant::Tenant* t);
  // Queues keyguard's upstream AUTH (when configured); `send_now` outside a client batch.
  void SendUpstreamAuth(bool send_now);
  // Queues keyguard's own `command` (encoded; its reply is not the client's), `id` telling
  // ProcessUpstreamBytes what the reply is for.
  void SendInternal(std::string_view command, commands::CommandId id, bool send_now);
  // Delivers an out-of-band frame (pub/sub message, push), confined to the tenant.
  void DeliverPush(std::string_view frame);
  // Answers a refused command in its place, counts it by `reason`, keeps MULTI and CLIENT REPLY
  // SKIP semantics.
  void Refuse(const CommandContext& c, Refusal reason, std::string_view message);
  // The tenant's name for the hot-key hooks ("" without one).
  std::string_view TenantName() const {
    return tenant_ != nullptr ? std::string_view(tenant_->name) : std::string_view();
  }
  void Reply(std::string text, commands::CommandId id, bool close_after);

  // Tenancy: FLUSH*/DBSIZE/RANDOMKEY as a walk over the tenant's keys in steps. While it runs no
  // later command is processed (they wait in the client buffer), so its answer keeps its place.
  void StartWalk(tenant::Walk walk, commands::CommandId id, int64_t now);
  // A step's reply (the kWalk entry at the head): the next step, or the answer.
  void ContinueWalk(char type, std::span<const resp::ReplyFramer::Scalar> head, int64_t now);
  void SendWalkStep();
  // Takes one of the tenant's step tokens on this worker; without one, arms the timer that calls
  // SendWalkStep when one is due and returns true.
  bool WaitForWalkToken();
  // Whether the client hung up with nothing read behind the walk (a peek at its socket).
  bool ClientGone();
  void FinishWalk(std::string reply, bool error, int64_t now);

  // Upstream side.
  bool ProcessUpstreamBytes(size_t* hint);
  void DeliverLocalsAtHead();
  // `frame_len`: the reply frame's bytes (0 for subscribe confirmations: not measured).
  void CompleteHead(char reply_type, int64_t size, std::string_view bulk, size_t frame_len, int64_t now);
  void FailUpstream(metrics::UpstreamError reason);
  // The error reply for an upstream that is gone: why, when TLS said.
  std::string UpstreamUnavailable() const;
  // Closes the upstream connection (and counts it gone, if it was up).
  void CloseUpstream();
  // Every command still waiting gets `error`, and the connection closes once it is delivered.
  void AbortPending(std::string_view error);
  void NotifyQueue();
  void AppendOut(std::string_view bytes);

  Worker& worker_;
  Socket client_;
  Stream upstream_;
  Outbox client_out_;
  Outbox upstream_out_;
  ReadBuffer client_buf_;
  ReadBuffer upstream_buf_;
  resp::RequestFramer request_framer_;
  resp::ReplyFramer reply_framer_;
  ReplyQueue queue_;
  ConnectionState state_;
  Timer queue_event_;
  bool queue_waiter_ = false;

  // Batch scratch, reused.
  std::vector<asio::const_buffer> forward_;  // client bytes going upstream
  std::vector<asio::const_buffer> deliver_;  // reply bytes going to the client
  std::deque<std::string> held_;             // local replies referenced by deliver_ until sent
  Scratch scratch_;                          // the bytes of rewritten commands forward_ points into until sent
  std::vector<asio::const_buffer> splice_;   // the pieces of the current command, when spliced
  std::string client_address_;
  uint64_t id_ = 0;  // per worker, for the hygiene trackers
  // Where detectors_ report: findings stamped with this client (who and where), counted, logged.
  struct Sink final : hygiene::FindingSink {
    explicit Sink(Session& s) : session(s) {}
    void Stamp(hygiene::Finding* f, std::string_view key, commands::CommandId id) override;
    void Report(hygiene::Finding f) override;
    void WakeProbe() override;
    Session& session;
  };
  Sink sink_{*this};
  hygiene::ConnectionDetectors detectors_;
  CommandPipeline pipeline_;  // what becomes of each command, before anything is sent

  // Tenancy: the tenant of this client (nullptr: none yet, or tenancy off).
  const tenant::Tenant* tenant_ = nullptr;
  // The tenant replies and pushes are confined to. RESET logs the client out at once, but what
  // the server sends until its +RESET is still the old tenant's; nullptr drops every push.
  const tenant::Tenant* reply_tenant_ = nullptr;
  uint64_t reply_scope_ = hygiene::kFnvBasis;  // DetectorScope(reply_tenant_), for the detectors
  metrics::Counter* tenant_commands_ = nullptr;
  metrics::Counter* tenant_received_ = nullptr;
  metrics::Counter* tenant_sent_ = nullptr;
  std::array<metrics::Counter*, kRefusalCount> tenant_rejected_{};  // by Refusal, resolved on first use
  bool upstream_auth_failed_ = false;
  bool desynced_ = false;  // a reply showed the server's transaction state differs from keyguard's
  // The server's CLIENT ID of the upstream connection, once known (0 before, and after it closed);
  // registered in worker_.connections with tenant_.
  int64_t upstream_client_id_ = 0;

  // The walk in progress (holding_: later commands wait until it ends; resume_: process them).
  tenant::KeyWalk walk_;
  std::unique_ptr<Timer> walk_timer_;  // a step waiting for the tenant's rate
  bool holding_ = false;
  bool resume_ = false;
  bool drain_after_walk_ = false;  // Drain() came while commands were held behind a walk

  bool upstream_ready_ = false;
  bool stop_reading_ = false;
  bool closing_ = false;
  bool closed_ = false;
};

}  // namespace keyguard::proxy
