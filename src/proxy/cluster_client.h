// One client's commands over a Redis Cluster (upstream redis-cluster://): each command goes to the
// shared link of the primary that owns its slot (Connection::Output::routes says which slot, or any
// node, or every node), and the replies come back to the client in the order of its commands
// whatever order the nodes answer in. Redirections never reach the client: MOVED updates the
// worker's slot map and sends the command again to the node named (the map is refreshed too), ASK
// sends ASKING and the command to the node named, TRYAGAIN sends it again after a pause; each
// within a bound. A command sent to every primary (DBSIZE, KEYS, FLUSHALL, ...) gets the merge of
// their replies (cluster::MergeReplies); SCAN walks the nodes one after the other.
//
// A ClusterClient is the LinkClient of the node links for its session, and hands the session its
// replies through the session's own LinkClient calls, as one link would.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "keyguard/resp/framer.h"
#include "proxy/cluster_map.h"
#include "proxy/connection.h"
#include "proxy/shared_upstream.h"

namespace keyguard::proxy {

struct ClusterState;
struct Worker;

class ClusterClient final : public LinkClient {
 public:
  ClusterClient(Worker& worker, LinkClient& session);
  ~ClusterClient();
  ClusterClient(const ClusterClient&) = delete;
  ClusterClient& operator=(const ClusterClient&) = delete;

  // Whether a slot map is known (commands can be routed).
  bool ready() const;
  // Sends the commands of one call: `pieces` hold them in order, `routes` says where each goes.
  void Submit(std::span<const std::string_view> pieces, std::span<const Route> routes);
  // The largest backlog of the links this client's commands wait on.
  size_t backlog() const;
  awaitable<void> WaitBelow(size_t limit);
  // The session goes away: the links drop the replies still owed to it.
  void Detach();
  // Called once when the replies kept until their turn (a node answers late, the others' replies
  // wait behind it) pass 16 times limits.max_output_buffer: the session cuts the client off.
  void set_on_overflow(std::function<void()> f) { on_overflow_ = std::move(f); }
  // The client speaks RESP3 (HELLO 3, nothing pending): its commands go to the nodes' RESP3 links.
  void set_resp3(bool resp3) { resp3_ = resp3; }

  // LinkClient (called by the node links).
  void BeginLinkReplies(SharedLink* from) override;
  bool OnLinkFrame(std::string_view frame, const resp::ReplyFramer& f) override;
  // Passed on in place (its link's head command is the client's next reply), else dropped.
  void OnLinkPush(std::string_view frame, const resp::ReplyFramer& f) override;
  bool EndLinkReplies() override;
  std::shared_ptr<void> Hold() override { return session_.Hold(); }
  uint64_t ClientProgress() override { return session_.ClientProgress(); }
  awaitable<void> WaitForClient(uint64_t progress, std::chrono::steady_clock::time_point deadline) override {
    return session_.WaitForClient(progress, deadline);
  }
  void OnLinkFailed(SharedLink* from, metrics::UpstreamError reason) override;

  // Drops the queues of links retired since the last call (a node left the map) that owe this
  // client nothing, so that the worker can free them (on its next command, and when the worker
  // sweeps its clients: FreeRetiredLinks).
  void DropRetiredQueues();

  // Redirections followed for one command before its error is given to the client.
  static constexpr int kMaxRedirects = 5;
  static constexpr int kMaxTryAgain = 20;
  // A script's redirection to a node the map does not have, or its MOVED after a MOVED, waits
  // this many times (10 + ... + 60 ms, as long as a refresh takes): the script runs again with
  // each, and a made-up one should not run it 20 times.
  static constexpr int kScriptRedirectTries = 6;

 private:
  // How a command (or one part of a fanned-out or split command) is being tried.
  struct Tries {
    // Sends its node could not take, TRYAGAINs, and MOVEDs after a MOVED: kMaxTryAgain, each
    // followed by a pause of 10 ms x the count.
    uint8_t count = 0;
    bool moved = false;  // it followed a MOVED (and no ASK since)
    // The node an ASK named: tries go there, ASKING first (`asking`; false: a redirection
    // followed for this command alone, OnLinkFrame). Held, so that a link retired while the
    // entry waits (held behind its slot's earlier commands) is not freed under it.
    std::shared_ptr<SharedLink> ask;
    bool asking = true;
  };
  // One client command: its bytes (kept to send again), and its reply once it is complete.
  struct Entry {
    std::string command;
    int32_t slot = kAnyNode;
    cluster::Merge merge = cluster::Merge::kNone;
    bool scan = false;
    bool read = false;         // read-only: a replica may serve it (cluster.read_from)
    bool scripted = false;     // Route::scripted
    bool keys_untold = false;  // Route::keys_untold
    bool held = false;         // in waiting_ (ReleaseHeld), behind earlier commands of a redirected slot
    size_t buffered = 0;       // reply bytes kept for it (buffered_)
    int scan_node = 0;
    uint32_t redirects = 0;
    Tries own;                      // a single command's (a part's: part_tries)
    std::vector<Tries> part_tries;  // fanned out or split: each part's, on its own
    int64_t retry_at = 0;           // held after its node could not take it: not tried before (steady ns)
    int parts_left = 1;
    std::vector<std::string> parts;  // fanned out or split: each part's reply
    // Split by slot (Route::split): each part's command, slot, and (MGET) its keys' places.
    std::vector<std::string> split_commands;
    std::vector<int32_t> split_slots;
    std::vector<std::vector<uint32_t>> positions;
    bool done = false;
    std::string reply;
    // As new, its buffers' capacity kept (a warm client's command costs no allocation).
    void Reset();
  };
  // The client's commands in flight, in order: a ring of entries addressed by sequence number
  // (a pointer would not survive its growth).
  class EntryRing {
   public:
    bool empty() const { return head_ == tail_; }
    uint64_t front_seq() const { return head_; }
    uint64_t tail_seq() const { return tail_; }
    Entry& front() { return slots_[head_ & mask_]; }
    Entry& At(uint64_t seq) { return slots_[seq & mask_]; }
    // A reset entry at the back; its sequence number.
    uint64_t Push();
    // (The entry lets go of the links an ASK named: a retired one is freed though the slot waits
    // for its reuse.)
    void Pop() {
      Entry& e = front();
      if (e.own.ask != nullptr) [[unlikely]]
        e.own.ask = nullptr;
      if (!e.part_tries.empty()) e.part_tries.clear();
      ++head_;
    }

   private:
    std::vector<Entry> slots_;
    uint64_t head_ = 0, tail_ = 0, mask_ = 0;
  };
  // A command in flight on a link: the entry (and which part of a fanned-out one), and how many
  // replies to drop first (ASKING's +OK).
  struct InFlight {
    uint64_t seq;  // the entry's
    int part;
    uint8_t skip;
  };
  struct LinkQueue {
    std::shared_ptr<SharedLink> link;  // (keeps a retired link until this client drops it)
    std::deque<InFlight> items;
  };

  // Sends `e` (part `part`) to `link`, ASKING first when `asking`. False when the link is down.
  bool Send(uint64_t seq, int part, SharedLink* link, bool asking);
  // Sends a new entry: to its slot's node, any node, or every node.
  void Dispatch(uint64_t seq);
  // The link of the node owning `slot` (kAnyNode: a node), or nullptr while none is known.
  SharedLink* LinkForSlot(int32_t slot);
  void Complete(Entry* e, int part, std::string_view reply);
  void Fail(Entry* e, int part, std::string_view error);
  // Delivers the complete entries at the head, in order. `direct`: the head's frame as framed by
  // the link (when the head completes with it), passed on without a copy.
  void DeliverReady();
  bool Deliver(std::string_view frame, const resp::ReplyFramer& f);  // false: OnLinkFrame's
  void OpenRun();
  // Ends the session's run of replies; true when the client is over its output bound.
  bool EndRun();
  LinkQueue& QueueOf(SharedLink* link);
  // Sends part `part` of `e` to `link` (ASKING first when `link` is the one an ASK named); when it
  // cannot go (the node down, connecting or unknown), again after a pause, a bounded number of times.
  void SendOrRetry(uint64_t seq, int part, SharedLink* link);
  // A TRYAGAIN, or a node that could not take the command: the entry goes again after a pause.
  void RetryLater(uint64_t seq, int part);
  // A command with one slot (not fanned out, split or a SCAN): redirections keep its order.
  static bool Single(const Entry& e) {
    return e.merge == cluster::Merge::kNone && !e.scan && e.split_commands.empty() && e.slot >= 0;
  }
  // Slots with a command being redirected (MOVED, ASK, TRYAGAIN, a node down): a later command of
  // such a slot waits until every earlier one of the slot is answered, so none overtakes another
  // on the way to the slot's new node.
  bool Redirected(int32_t slot) const;
  bool EarlierPending(uint64_t seq, int32_t slot);
  // The oldest unanswered command of `slot` (tail_seq() when none), found from a cursor kept per
  // slot (cursors_): amortized O(1), not a scan from the front.
  uint64_t OldestPending(int32_t slot);
  struct Cursor {
    uint64_t seq;
    bool at_cover;  // stopped at a pending command of the slot (not at the tail)
  };
  absl::flat_hash_map<int32_t, Cursor> cursors_;
  // Whether `e` goes to `slot`: its own, or one of its parts' (a command split by slot).
  static bool Covers(const Entry& e, int32_t slot) {
    return e.slot == slot || std::find(e.split_slots.begin(), e.split_slots.end(), slot) != e.split_slots.end();
  }
  // The first of a split command's slots that has an earlier command being redirected
  // (kAnyNode: none): the whole command waits behind it, then behind the next such slot.
  int32_t BlockingSlot(uint64_t seq, const Entry& e);
  void MarkPartRedirected(const Entry& e, int part);
  // Sends part `part` of split command `seq` again (to `link`) once no earlier command of its slot
  // is pending: at once, or from ReleaseHeld.
  void SendPartInOrder(uint64_t seq, int part, SharedLink* link);
  // What waits behind an earlier command of a redirected slot, per slot in the client's order: a
  // held command, or a part of a split command sent again (`part`, to `link`). Only a queue's head
  // can be next (the head is itself pending), so ReleaseHeld looks at the heads alone: a client
  // with many commands in flight while their slot moves costs O(1) per reply, not a walk of all.
  struct Waiter {
    uint64_t seq;
    int part;  // -1: the whole command
    std::shared_ptr<SharedLink> link;
  };
  struct SlotWaiters {
    int32_t slot;
    std::deque<Waiter> q;  // by seq
  };
  std::vector<SlotWaiters> waiting_;
  void Wait(int32_t slot, Waiter w);
  void Hold(uint64_t seq);
  void ReleaseHeld();
  // ReleaseHeld again after `after` (one timer for the client: one armed already stands unless
  // this pause ends first).
  void ArmHoldTimer(std::chrono::milliseconds after);
  // Holds single command `seq`, whose node could not take it (or answered TRYAGAIN), until a
  // pause of 10 ms x its tries is over (Entry::retry_at).
  void HoldForRetry(uint64_t seq);
  // Sends `seq` (its part `part`) again after a pause of 10 ms x its tries: a single command held
  // in its slot's order (HoldForRetry), a part on its own (RetryLater).
  void RetryAfterPause(uint64_t seq, int part);
  // The redirection `error` (a node's reply to the command's part) is, if it is one a node sends:
  // for the slot the part was routed by.
  std::optional<cluster::Redirect> RedirectFor(const Entry& e, int part, std::string_view error);
  // Whether commands of `slot`, whose nodes send them back and forth, still wait for the nodes to
  // agree (bouncing_: from the first such MOVED, for as long as one command's pauses).
  bool StillBouncing(int32_t slot);
  // The slot of `e`'s part `part` (a split command's), else `e`'s own.
  static int32_t SlotOf(const Entry& e, int part);
  // How `e`'s part `part` is being tried (a single command: `own`).
  static Tries& TriesOf(Entry& e, int part) {
    return part >= 0 && static_cast<size_t>(part) < e.part_tries.size() ? e.part_tries[static_cast<size_t>(part)]
                                                                        : e.own;
  }

  Worker& worker_;
  LinkClient& session_;
  // Where this client is registered (ClusterState::clients): held, as at exit a session suspended
  // in the io_context can end after the worker's members.
  std::shared_ptr<ClusterState> registry_;
  EntryRing entries_;
  std::vector<LinkQueue> queues_;            // one per link used (a few)
  size_t last_queue_ = 0;                    // the one QueueOf found last
  uint64_t retirements_seen_ = 0;            // ClusterState::retirements at the last DropRetiredQueues
  absl::flat_hash_set<int32_t> redirected_;  // see Redirected (a set: a split command marks all its slots)
  // Slots whose nodes send commands back and forth (a MOVED after a MOVED), and until when their
  // commands wait for the nodes to agree (kMaxTryAgain's pauses, about 2 s, from the first): a
  // slot whose nodes never agree costs its pipelined commands that wait once, not each in turn.
  // Forgotten at the slot's next reply that is not an error; one long over starts anew.
  absl::flat_hash_map<int32_t, int64_t> bouncing_;
  size_t buffered_ = 0;  // bytes of replies kept until their turn
  // WaitBelow's wait while buffered_ is over `buffered_low_` (DeliverReady ends it).
  Timer* buffered_wait_ = nullptr;
  size_t buffered_low_ = 0;
  bool resp3_ = false;  // set_resp3
  bool overflowed_ = false;
  std::function<void()> on_overflow_;
  // ArmHoldTimer's timer while one is armed, and when it ends (steady ns).
  std::shared_ptr<Timer> hold_timer_;
  int64_t hold_at_ = 0;
  SharedLink* from_ = nullptr;  // the link whose replies are being handed over
  bool run_open_ = false;       // the session's Begin was called, its End is due
  bool in_link_run_ = false;
  resp::ReplyFramer reframer_;         // frames a reply kept out of order, to hand it over
  std::deque<std::string> delivered_;  // replies handed over in this run (the connection holds views)
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

}  // namespace keyguard::proxy
