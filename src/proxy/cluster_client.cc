#include "proxy/cluster_client.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "keyguard/common/json_line.h"
#include "keyguard/resp/encoder.h"
#include "proxy/clock.h"
#include "proxy/cluster_watch.h"
#include "proxy/worker.h"

namespace keyguard::proxy {
namespace {

constexpr std::string_view kAsking = "*1\r\n$6\r\nASKING\r\n";

std::string NodeUnavailable(const SharedLink* link) {
  return absl::StrCat("-ERR keyguard: cluster node ", link != nullptr ? link->address() : std::string("(none)"),
                      " unavailable\r\n");
}

// Whether one of `nodes` is at `addr` ("host:port").
bool Names(const std::vector<cluster::Node>& nodes, std::string_view addr) {
  return std::any_of(nodes.begin(), nodes.end(), [&](const cluster::Node& n) { return n.ToString() == addr; });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The worker's view of the cluster

namespace {

// The link to `n` (made and started on first use; "r:" for a replica's, which sends READONLY;
// "3:" for one of RESP3 clients, which sends HELLO 3).
SharedLink* LinkTo(Worker& worker, const cluster::Node& n, bool replica, bool resp3 = false) {
  ClusterState& c = *worker.cluster;
  const std::string key = absl::StrCat(resp3 ? "3:" : "", replica ? "r:" : "", n.ToString());
  auto it = c.links.find(key);
  if (it == c.links.end()) {
    const auto at = NodeEndpoint(n);
    if (!at.has_value()) return nullptr;
    auto link = std::make_shared<SharedLink>(worker, *at, n.host, replica, resp3);
    link->Start();
    it = c.links.emplace(key, std::move(link)).first;
  }
  return it->second.get();
}

// The replicas' links of each primary, of one protocol's set.
std::vector<std::vector<SharedLink*>> ReplicaLinks(Worker& worker, bool resp3) {
  ClusterState& c = *worker.cluster;
  std::vector<std::vector<SharedLink*>> out(c.map->primaries.size());
  for (size_t i = 0; i < c.map->replicas.size() && i < out.size(); ++i) {
    for (const cluster::Node& r : c.map->replicas[i]) {
      if (SharedLink* l = LinkTo(worker, r, /*replica=*/true, resp3); l != nullptr) out[i].push_back(l);
    }
  }
  return out;
}

}  // namespace

void AdoptClusterMap(Worker& worker, std::shared_ptr<const cluster::SlotMap> map) {
  ClusterState& c = *worker.cluster;
  c.map = std::make_shared<cluster::SlotMap>(*map);
  c.node_links.assign(c.map->primaries.size(), nullptr);
  for (size_t i = 0; i < c.map->primaries.size(); ++i) {
    c.node_links[i] = ClusterNodeLink(worker, static_cast<uint16_t>(i));
  }
  // The RESP3 links made so far stay with their primaries (RetireDepartedLinks keeps what the
  // map uses); the others are made as RESP3 clients come.
  c.node_links3.assign(c.map->primaries.size(), nullptr);
  for (size_t i = 0; i < c.map->primaries.size(); ++i) {
    if (auto it = c.links.find("3:" + c.map->primaries[i].ToString()); it != c.links.end()) {
      c.node_links3[i] = it->second.get();
    }
  }
  // A node that is no longer a primary (failed over: hung, partitioned, demoted) answers its
  // commands in flight late or never: its link is closed (they fail, their clients go on) and
  // connects again, in case it serves again.
  for (auto& [key, link] : c.links) {
    const std::string_view addr = std::string_view(key).substr(key.starts_with("3:") ? 2 : 0);
    if (addr.starts_with("r:") || !link->owes()) continue;
    // (A primary without slots yet takes its first import: an ASK's commands are in flight there.)
    const bool primary = Names(c.map->primaries, addr) || Names(c.map->slotless, addr);
    if (!primary) link->Restart();
  }
  c.replica_links.assign(c.map->primaries.size(), {});
  c.replica_links3.assign(c.map->primaries.size(), {});
  if (worker.config.read_from_replicas) {
    c.replica_links = ReplicaLinks(worker, false);
    if (c.resp3_replicas) c.replica_links3 = ReplicaLinks(worker, true);
  }
  RetireDepartedLinks(worker);
}

void RetireDepartedLinks(Worker& worker) {
  // A node in neither role of the map (removed, or replaced by another address) would be
  // connected to again and again: its link is retired once it owes nothing (one that owes was
  // restarted above: its commands fail, and the next map retires it).
  ClusterState& c = *worker.cluster;
  const auto now = std::chrono::steady_clock::now();
  for (auto it = c.links.begin(); it != c.links.end();) {
    SharedLink* l = it->second.get();
    auto in = [l](const std::vector<SharedLink*>& v) { return std::find(v.begin(), v.end(), l) != v.end(); };
    const std::string_view addr = std::string_view(it->first).substr(it->first.starts_with("3:") ? 2 : 0);
    const bool used = in(c.node_links) || in(c.node_links3) ||
                      std::any_of(c.replica_links.begin(), c.replica_links.end(), in) ||
                      std::any_of(c.replica_links3.begin(), c.replica_links3.end(), in) || Names(c.map->slotless, addr);
    if (used || l->owes()) {
      ++it;
      continue;
    }
    EventLine("info", "cluster_node_left").Str("node", l->address()).Write(stderr);
    l->Retire();
    c.retired.push_back({std::move(it->second), now});
    ++c.retirements;
    worker.shard->cluster_retired_links.Add(1);
    it = c.links.erase(it);
  }
  FreeRetiredLinks(worker);
}

void FreeRetiredLinks(Worker& worker) {
  ClusterState& c = *worker.cluster;
  if (c.retired.empty()) return;
  // A client that holds a retired link with nothing in flight (idle since the node left) would
  // keep it for as long as it stays connected.
  for (ClusterClient* client : c.clients) client->DropRetiredQueues();
  const auto now = std::chrono::steady_clock::now();
  const size_t freed = std::erase_if(c.retired, [&](const ClusterState::Retired& r) {
    return r.link.use_count() == 1 && now - r.since >= ClusterState::kRetiredGrace;
  });
  worker.shard->cluster_retired_links.Add(-static_cast<int64_t>(freed));
  if (c.retired.empty() || c.retired_sweep != nullptr) return;
  c.retired_sweep = std::make_shared<Timer>(worker.io, ClusterState::kRetiredGrace);
  c.retired_sweep->async_wait([&worker, timer = c.retired_sweep](error_code ec) {
    if (ec || worker.cluster->retired_sweep != timer) return;
    worker.cluster->retired_sweep = nullptr;
    FreeRetiredLinks(worker);
  });
}

SharedLink* ClusterReplicaLink(Worker& worker, int32_t slot, bool resp3) {
  ClusterState& c = *worker.cluster;
  if (c.map == nullptr || slot < 0) return nullptr;
  if (resp3 && !c.resp3_replicas) {
    c.resp3_replicas = true;
    c.replica_links3 = ReplicaLinks(worker, true);
  }
  const uint16_t owner = c.map->owner[static_cast<size_t>(slot)];
  const std::vector<std::vector<SharedLink*>>& all = resp3 ? c.replica_links3 : c.replica_links;
  if (owner >= all.size()) return nullptr;
  const std::vector<SharedLink*>& replicas = all[owner];
  for (size_t i = 0; i < replicas.size(); ++i) {
    SharedLink* l = replicas[c.next_replica++ % replicas.size()];
    if (l->up()) return l;
  }
  return nullptr;
}

SharedLink* ClusterNodeLink(Worker& worker, uint16_t index, bool resp3) {
  ClusterState& c = *worker.cluster;
  if (c.map == nullptr || index >= c.map->primaries.size()) return nullptr;
  std::vector<SharedLink*>& links = resp3 ? c.node_links3 : c.node_links;
  if (index < links.size() && links[index] != nullptr) return links[index];
  SharedLink* link = LinkTo(worker, c.map->primaries[index], /*replica=*/false, resp3);
  if (link == nullptr) return nullptr;
  if (links.size() <= index) links.resize(index + 1, nullptr);
  links[index] = link;
  return link;
}

std::optional<UpstreamAddress> ClusterNodeAddress(Worker& worker, int32_t slot) {
  ClusterState& c = *worker.cluster;
  if (c.map == nullptr || c.map->primaries.empty()) return std::nullopt;
  uint16_t index = 0;
  if (slot >= 0) index = c.map->owner[static_cast<size_t>(slot)];
  if (index == cluster::SlotMap::kNoOwner) return std::nullopt;
  const cluster::Node& n = c.map->primaries[index];
  const auto at = NodeEndpoint(n);
  if (!at.has_value()) return std::nullopt;
  return UpstreamAddress{*at, n.host};
}

void OnClusterMoved(Worker& worker, const cluster::Redirect& r) {
  ClusterState& c = *worker.cluster;
  if (c.map == nullptr) return;
  // Only to a primary the cluster itself named (the text may be a script's: RedirectFor).
  if (const std::optional<uint16_t> to = c.map->PrimaryAt(r.host, r.port); to.has_value()) c.map->owner[r.slot] = *to;
  if (c.refresh) c.refresh();
}

// ---------------------------------------------------------------------------------------------
// ClusterClient

ClusterClient::ClusterClient(Worker& worker, LinkClient& session)
    : worker_(worker), session_(session), registry_(worker.cluster) {
  registry_->clients.insert(this);
}

ClusterClient::~ClusterClient() {
  *alive_ = false;
  Detach();
  registry_->clients.erase(this);
}

void ClusterClient::Detach() {
  for (LinkQueue& q : queues_) q.link->Forget(this);
  queues_.clear();
  if (buffered_wait_ != nullptr) buffered_wait_->cancel();
}

bool ClusterClient::ready() const {
  const ClusterState& c = *worker_.cluster;
  return c.map != nullptr && !c.node_links.empty();
}

size_t ClusterClient::backlog() const {
  size_t most = buffered_;  // replies waiting for their turn: no more commands read meanwhile
  for (const LinkQueue& q : queues_) most = std::max(most, q.link->backlog());
  return most;
}

awaitable<void> ClusterClient::WaitBelow(size_t limit) {
  SharedLink* busiest = nullptr;  // (of the links that are up: a down one's output waits for nothing)
  for (const LinkQueue& q : queues_) {
    if (q.link->up() && (busiest == nullptr || q.link->backlog() > busiest->backlog())) busiest = q.link.get();
  }
  if (busiest != nullptr && busiest->backlog() > limit) {
    co_await busiest->WaitBelow(limit);
  } else if (buffered_ > limit && buffered_wait_ == nullptr) {
    // Replies kept for their turn (behind a node that answers late): until they are handed over.
    // (Returning at once would have the pump spin, never back in the event loop that reads the
    // late node's reply.)
    Timer wait(worker_.io, std::chrono::steady_clock::time_point::max());
    buffered_wait_ = &wait;
    buffered_low_ = limit;
    error_code ignored;
    co_await wait.async_wait(AwaitEc(ignored));
    buffered_wait_ = nullptr;
  } else {
    // Over the bound by a link that is down (its output is dropped once its aborted write
    // completes, in the event loop): back to the loop for a moment rather than spin.
    Timer pause(worker_.io, std::chrono::milliseconds(1));
    error_code ignored;
    co_await pause.async_wait(AwaitEc(ignored));
  }
}

ClusterClient::LinkQueue& ClusterClient::QueueOf(SharedLink* link) {
  if (last_queue_ < queues_.size() && queues_[last_queue_].link.get() == link) return queues_[last_queue_];
  for (size_t i = 0; i < queues_.size(); ++i) {
    if (queues_[i].link.get() == link) {
      last_queue_ = i;
      return queues_[i];
    }
  }
  last_queue_ = queues_.size();
  queues_.push_back(LinkQueue{link->shared_from_this(), {}});
  return queues_.back();
}

void ClusterClient::DropRetiredQueues() {
  bool left = false;
  std::erase_if(queues_, [&](LinkQueue& q) {
    if (!q.link->retired()) return false;
    if (!q.items.empty()) {
      left = true;  // (its commands fail as its connection closes; dropped on a later call)
      return false;
    }
    q.link->Forget(this);
    return true;
  });
  last_queue_ = 0;
  if (!left) retirements_seen_ = worker_.cluster->retirements;
}

SharedLink* ClusterClient::LinkForSlot(int32_t slot) {
  ClusterState& c = *worker_.cluster;
  if (c.map == nullptr || c.map->primaries.empty()) return nullptr;
  if (slot == kFirstNode) return ClusterNodeLink(worker_, 0, resp3_);
  if (slot < 0) {
    // Any node: one that is up, spread over the primaries.
    for (size_t i = 0; i < c.map->primaries.size(); ++i) {
      SharedLink* l = ClusterNodeLink(worker_, static_cast<uint16_t>(c.next_any++ % c.map->primaries.size()), resp3_);
      if (l != nullptr && l->up()) return l;
    }
    return ClusterNodeLink(worker_, 0, resp3_);
  }
  const uint16_t owner = c.map->owner[static_cast<size_t>(slot)];
  if (owner == cluster::SlotMap::kNoOwner) return nullptr;
  const std::vector<SharedLink*>& links = resp3_ ? c.node_links3 : c.node_links;
  if (owner < links.size() && links[owner] != nullptr) [[likely]] {
    return links[owner];
  }
  return ClusterNodeLink(worker_, owner, resp3_);
}

void ClusterClient::Entry::Reset() {
  command.clear();
  slot = kAnyNode;
  merge = cluster::Merge::kNone;
  scan = false;
  read = false;
  scripted = false;
  keys_untold = false;
  held = false;
  buffered = 0;
  scan_node = 0;
  redirects = 0;
  own = Tries{};
  part_tries.clear();
  retry_at = 0;
  parts_left = 1;
  parts.clear();
  split_commands.clear();
  split_slots.clear();
  positions.clear();
  done = false;
  reply.clear();
}

uint64_t ClusterClient::EntryRing::Push() {
  if (tail_ - head_ == slots_.size()) {
    // Full: twice the room, the entries in flight at their places in it.
    std::vector<Entry> bigger(std::max<size_t>(8, 2 * slots_.size()));
    const uint64_t mask = bigger.size() - 1;
    for (uint64_t s = head_; s != tail_; ++s) bigger[s & mask] = std::move(slots_[s & mask_]);
    slots_ = std::move(bigger);
    mask_ = mask;
  }
  slots_[tail_ & mask_].Reset();
  return tail_++;
}

bool ClusterClient::Send(uint64_t seq, int part, SharedLink* link, bool asking) {
  if (link == nullptr) return false;
  Entry* e = &entries_.At(seq);
  bool ok;
  const std::string& command = e->split_commands.empty() ? e->command : e->split_commands[static_cast<size_t>(part)];
  if (asking) {
    const std::string_view pieces[] = {kAsking, command};
    ok = link->Submit(this, pieces, 2);
  } else {
    const std::string_view pieces[] = {command};
    ok = link->Submit(this, pieces, 1);
  }
  if (!ok) return false;
  QueueOf(link).items.push_back(InFlight{seq, part, static_cast<uint8_t>(asking ? 1 : 0)});
  return true;
}

void ClusterClient::Submit(std::span<const std::string_view> pieces, std::span<const Route> routes) {
  if (retirements_seen_ != worker_.cluster->retirements) [[unlikely]]
    DropRetiredQueues();
  size_t piece = 0, offset = 0;
  auto take = [&](size_t need, std::string* out) {
    out->reserve(need);
    while (need > 0 && piece < pieces.size()) {
      const size_t n = std::min(need, pieces[piece].size() - offset);
      out->append(pieces[piece].data() + offset, n);
      need -= n;
      offset += n;
      if (offset == pieces[piece].size()) {
        ++piece;
        offset = 0;
      }
    }
  };
  bool pending = false;  // the last entry is sent once its parts are all known
  uint64_t last = 0;
  for (const Route& r : routes) {
    if (r.split == 2 && pending) {
      Entry& p = entries_.At(last);
      take(r.bytes, &p.split_commands.emplace_back());
      p.split_slots.push_back(r.slot);
      p.positions.emplace_back(r.positions.begin(), r.positions.end());
      continue;
    }
    if (pending) Dispatch(last);
    last = entries_.Push();
    pending = true;
    Entry& e = entries_.At(last);
    e.slot = r.slot;
    e.merge = r.merge;
    e.scan = r.scan;
    e.read = r.read;
    e.scripted = r.scripted;
    e.keys_untold = r.keys_untold;
    if (r.split != 0) {
      take(r.bytes, &e.split_commands.emplace_back());
      e.split_slots.push_back(r.slot);
      e.positions.emplace_back(r.positions.begin(), r.positions.end());
    } else {
      take(r.bytes, &e.command);
    }
  }
  if (pending) Dispatch(last);
  // Replies already complete (a node that is down) are handed over once the call has returned:
  // the connection's output of this call is still being written.
  if (!entries_.empty() && entries_.front().done) {
    std::weak_ptr<bool> alive = alive_;
    asio::post(worker_.io, [this, alive]() {
      if (auto a = alive.lock(); a && *a) {
        DeliverReady();
        if (run_open_ && !in_link_run_) EndRun();
      }
    });
  }
}

void ClusterClient::Dispatch(uint64_t seq) {
  ClusterState& c = *worker_.cluster;
  Entry* e = &entries_.At(seq);
  if (!e->split_commands.empty()) {
    if (!redirected_.empty()) [[unlikely]] {
      if (const int32_t s = BlockingSlot(seq, *e); s != kAnyNode) {
        // Behind an earlier command of one of its slots that is being redirected (a SET of a key
        // this MGET reads): it must not overtake it. Its other slots count as redirected too, so
        // that a later command of one of them waits behind it in turn.
        e->held = true;
        for (int32_t other : e->split_slots) {
          redirected_.insert(other);
        }
        Wait(s, Waiter{seq, -1, nullptr});
        return;
      }
    }
    // One part per slot; the client gets their merge.
    const size_t n = e->split_commands.size();
    e->parts.assign(n, std::string());
    e->part_tries.assign(n, Tries{});
    e->parts_left = static_cast<int>(n);
    for (size_t i = 0; i < n; ++i) {
      SharedLink* l = LinkForSlot(e->split_slots[i]);
      SendOrRetry(seq, static_cast<int>(i), l);
    }
    return;
  }
  if (e->slot == kEveryNode) {
    const size_t n = c.map != nullptr ? c.map->primaries.size() : 0;
    e->parts.assign(n, std::string());
    e->part_tries.assign(n, Tries{});
    e->parts_left = static_cast<int>(n);
    if (n == 0) {
      e->done = true;
      e->reply = "-ERR keyguard: no cluster slot map yet\r\n";
      return;
    }
    for (size_t i = 0; i < n; ++i) {
      SharedLink* l = ClusterNodeLink(worker_, static_cast<uint16_t>(i), resp3_);
      SendOrRetry(seq, static_cast<int>(i), l);
    }
    return;
  }
  if (e->scan) {
    // SCAN cursor [options]: the node the cursor names, with that node's cursor.
    resp::RequestFramer framer;
    std::string_view cursor;
    std::vector<std::string_view> args;
    if (framer.Next(e->command.data(), e->command.size()) == resp::Status::kOk && framer.args().size() >= 2) {
      args.assign(framer.args().begin(), framer.args().end());
      cursor = args[1];
    }
    const auto decoded = cluster::DecodeScanCursor(cursor);
    const int nodes = c.map != nullptr ? static_cast<int>(c.map->primaries.size()) : 0;
    if (!decoded.has_value() || decoded->node >= nodes) {
      e->done = true;
      e->reply = "-ERR invalid cursor\r\n";
      return;
    }
    e->scan_node = decoded->node;
    args[1] = decoded->node_cursor;
    std::string command;
    resp::AppendCommand(&command, args);
    e->command = std::move(command);
    SharedLink* l = ClusterNodeLink(worker_, static_cast<uint16_t>(e->scan_node), resp3_);
    SendOrRetry(seq, 0, l);
    return;
  }
  if (!redirected_.empty() && Redirected(e->slot) && EarlierPending(seq, e->slot)) [[unlikely]] {
    Hold(seq);  // after the earlier commands of its slot, which are being redirected
    return;
  }
  SharedLink* l = nullptr;
  if (e->read && worker_.config.read_from_replicas) l = ClusterReplicaLink(worker_, e->slot, resp3_);
  if (l == nullptr) l = LinkForSlot(e->slot);
  if (Send(seq, 0, l, false)) return;
  // The node is down, still connecting or unknown: the command waits, and those after it for
  // the same slot wait behind it.
  if (worker_.cluster->refresh) worker_.cluster->refresh();
  ++e->own.count;
  HoldForRetry(seq);
}

bool ClusterClient::Redirected(int32_t slot) const { return redirected_.contains(slot); }

uint64_t ClusterClient::OldestPending(int32_t slot) {
  // Entries before a slot's cursor are answered or not of the slot, for good (an answered entry
  // stays so until it leaves the front; a command's slots never change): the cursor only moves
  // on, so each entry is looked at about once per slot while the slot is redirected.
  Cursor& cur = cursors_.try_emplace(slot, Cursor{entries_.front_seq(), false}).first->second;
  // The entry the cursor stopped at covered the slot then, and does for good: while it is pending,
  // it is the answer, without looking at its slots again (a split command's may be thousands).
  if (cur.at_cover && cur.seq >= entries_.front_seq() && cur.seq != entries_.tail_seq() && !entries_.At(cur.seq).done) {
    return cur.seq;
  }
  uint64_t q = std::max(cur.seq, entries_.front_seq());
  while (q != entries_.tail_seq()) {
    const Entry& x = entries_.At(q);
    if (!x.done && Covers(x, slot)) break;
    ++q;
  }
  cur.seq = q;
  cur.at_cover = q != entries_.tail_seq();
  return q;
}

bool ClusterClient::EarlierPending(uint64_t seq, int32_t slot) { return OldestPending(slot) < seq; }

void ClusterClient::SendPartInOrder(uint64_t seq, int part, SharedLink* link) {
  const Entry& e = entries_.At(seq);
  const int32_t slot = e.split_slots[static_cast<size_t>(part)];
  if (EarlierPending(seq, slot)) {
    // (Its slot counts as redirected while it waits: ReleaseHeld runs after each reply.)
    MarkPartRedirected(e, part);
    Wait(slot, Waiter{seq, part, link != nullptr ? link->shared_from_this() : nullptr});
    return;
  }
  SendOrRetry(seq, part, link);
}

void ClusterClient::MarkPartRedirected(const Entry& e, int part) {
  // A part of a split command sent again (MOVED, ASK, TRYAGAIN: a multi-key part in a slot being
  // migrated): later commands of its slot wait behind it (ReleaseHeld), as behind a single one.
  if (part < 0 || static_cast<size_t>(part) >= e.split_slots.size()) return;
  const int32_t slot = e.split_slots[static_cast<size_t>(part)];
  redirected_.insert(slot);
}

int32_t ClusterClient::BlockingSlot(uint64_t seq, const Entry& e) {
  for (int32_t s : e.split_slots) {
    if (Redirected(s) && EarlierPending(seq, s)) return s;
  }
  return kAnyNode;
}

void ClusterClient::Wait(int32_t slot, Waiter w) {
  auto it = std::find_if(waiting_.begin(), waiting_.end(), [&](const SlotWaiters& x) { return x.slot == slot; });
  if (it == waiting_.end()) it = waiting_.insert(waiting_.end(), SlotWaiters{slot, {}});
  std::deque<Waiter>& q = it->q;
  // Mostly at the back (a new command); a command redirected while those after it wait goes in
  // front of them.
  if (q.empty() || q.back().seq < w.seq) {
    q.push_back(std::move(w));
    return;
  }
  q.insert(std::upper_bound(q.begin(), q.end(), w.seq, [](uint64_t seq, const Waiter& x) { return seq < x.seq; }),
           std::move(w));
}

void ClusterClient::Hold(uint64_t seq) {
  Entry& e = entries_.At(seq);
  if (!e.held) {
    e.held = true;
    Wait(e.slot, Waiter{seq, -1, nullptr});
  }
  redirected_.insert(e.slot);
}

void ClusterClient::ReleaseHeld() {
  if (redirected_.empty() && waiting_.empty()) return;
  // Each waiting command goes once every earlier command of its slot is answered: a slot's
  // commands reach its new node in the client's order, one after the other while it moves. Passes
  // over the queues' heads until none moves (a command failed or sent in one queue can let
  // another's head go); a head held again (its node still down) is not looked at again here.
  std::vector<int32_t> stalled;   // slots whose head was held again in this call
  std::vector<int32_t> given_up;  // slots whose node did not come back in time: their held commands fail
  int64_t now = 0;                // (read when first needed)
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t i = 0; i < waiting_.size(); ++i) {
      const int32_t slot = waiting_[i].slot;
      if (std::find(stalled.begin(), stalled.end(), slot) != stalled.end()) continue;
      // (waiting_[i] is looked up again after each call below: Wait may grow waiting_.)
      while (!waiting_[i].q.empty() && !EarlierPending(waiting_[i].q.front().seq, slot)) {
        if (const int64_t at = entries_.At(waiting_[i].q.front().seq).retry_at; at != 0) {
          // Held after its node could not take it (or TRYAGAIN): not again before its pause is
          // over, however many other replies come meanwhile (each would spend a try).
          if (now == 0) now = NowNs();
          if (now < at) {
            ArmHoldTimer(std::chrono::milliseconds((at - now) / 1000000 + 1));
            stalled.push_back(slot);
            break;
          }
          entries_.At(waiting_[i].q.front().seq).retry_at = 0;
        }
        Waiter w = std::move(waiting_[i].q.front());
        waiting_[i].q.pop_front();
        moved = true;
        Entry& e = entries_.At(w.seq);
        if (w.part >= 0) {
          SendOrRetry(w.seq, w.part, w.link.get());
          continue;
        }
        if (!e.split_commands.empty()) {
          if (const int32_t s = BlockingSlot(w.seq, e); s != kAnyNode) {
            Wait(s, std::move(w));  // behind the next of its slots
          } else {
            e.held = false;
            Dispatch(w.seq);  // (every part, none of which went before)
          }
          continue;
        }
        e.held = false;
        SharedLink* l = e.own.ask != nullptr ? e.own.ask.get() : LinkForSlot(e.slot);
        if (std::find(given_up.begin(), given_up.end(), slot) != given_up.end()) {
          Fail(&e, 0, NodeUnavailable(l));
        } else if (Send(w.seq, 0, l, e.own.ask != nullptr && e.own.asking)) {
          continue;
        } else if (e.own.count < kMaxTryAgain) {
          ++e.own.count;
          HoldForRetry(w.seq);  // (at the head again)
          stalled.push_back(slot);
          break;
        } else {
          Fail(&e, 0, NodeUnavailable(l));
          given_up.push_back(slot);
        }
      }
    }
    std::erase_if(waiting_, [](const SlotWaiters& x) { return x.q.empty(); });
  }
  // A slot none of whose commands is pending any more is an ordinary one again. (Its cursor is
  // kept while commands are in flight: it is still right, and a slot redirected again would
  // otherwise be looked for from the front.)
  absl::erase_if(redirected_, [&](int32_t slot) { return OldestPending(slot) == entries_.tail_seq(); });
  if (entries_.empty()) {
    cursors_.clear();
  } else if (cursors_.size() > 64) {
    absl::erase_if(cursors_, [&](const auto& c) { return !Redirected(c.first); });
  }
}

void ClusterClient::HoldForRetry(uint64_t seq) {
  Entry& e = entries_.At(seq);
  Hold(seq);
  const std::chrono::milliseconds pause(10 * e.own.count);
  e.retry_at = NowNs() + std::chrono::duration_cast<std::chrono::nanoseconds>(pause).count();
  ArmHoldTimer(pause);
}

bool ClusterClient::StillBouncing(int32_t slot) {
  const int64_t now = NowNs();
  constexpr int64_t kWindow = int64_t{10'000'000} * kMaxTryAgain * (kMaxTryAgain + 1) / 2;  // the pauses' sum
  int64_t& until = bouncing_.try_emplace(slot, now + kWindow).first->second;
  // A window that ended a while ago (its slot's replies since were all errors, or none came)
  // says nothing of this disagreement: a new one starts. (Right after one ends, the commands that
  // waited behind it fail at once.)
  if (now >= until + kWindow) until = now + kWindow;
  return now < until;
}

int32_t ClusterClient::SlotOf(const Entry& e, int part) {
  return part >= 0 && static_cast<size_t>(part) < e.split_slots.size() ? e.split_slots[static_cast<size_t>(part)]
                                                                       : e.slot;
}

std::optional<cluster::Redirect> ClusterClient::RedirectFor(const Entry& e, int part, std::string_view error) {
  std::optional<cluster::Redirect> r = cluster::ParseRedirect(error);
  // A node redirects a command for the slot of its keys, which keyguard routed by. Any other
  // "MOVED"/"ASK" is a reply, passed on as it is: a script's (EVAL "return
  // redis.error_reply('MOVED ...')" 0), followed, would take the slot to an address of the
  // script's choosing for every client of the worker, with keyguard's upstream credentials.
  // (A command whose keys keyguard could not tell takes the node's word for their slot.)
  if (r.has_value() && !(e.keys_untold && e.slot == kAnyNode) && static_cast<int32_t>(r->slot) != SlotOf(e, part)) {
    r.reset();
  }
  return r;
}

void ClusterClient::RetryAfterPause(uint64_t seq, int part) {
  Entry& e = entries_.At(seq);
  if (Single(e)) {
    HoldForRetry(seq);
    return;
  }
  MarkPartRedirected(e, part);
  RetryLater(seq, part);
}

void ClusterClient::ArmHoldTimer(std::chrono::milliseconds after) {
  const int64_t at = NowNs() + std::chrono::duration_cast<std::chrono::nanoseconds>(after).count();
  if (hold_timer_ != nullptr) {
    if (hold_at_ <= at) return;  // the one armed ends first
    hold_timer_->cancel();       // (a shorter pause: it ends earlier)
  }
  hold_at_ = at;
  auto timer = std::make_shared<Timer>(worker_.io, after);
  hold_timer_ = timer;
  std::weak_ptr<bool> alive = alive_;
  timer->async_wait([this, alive, timer](error_code ec) {
    auto a = alive.lock();
    if (ec || a == nullptr || !*a || hold_timer_ != timer) return;
    hold_timer_ = nullptr;
    ReleaseHeld();
    DeliverReady();
    if (run_open_ && !in_link_run_) EndRun();
  });
}

void ClusterClient::Complete(Entry* e, int part, std::string_view reply) {
  // Replies kept until their turn (behind an earlier command still unanswered) count against the
  // client: past the bound, it is cut off. (The head's parts are merged as they come, as big as
  // the reply itself.)
  if (e != &entries_.front()) {
    e->buffered += reply.size();
    buffered_ += reply.size();
  }
  if (buffered_ > 16 * static_cast<size_t>(worker_.config.max_output_buffer) && on_overflow_ && !overflowed_) {
    overflowed_ = true;
    on_overflow_();  // (posts the cut-off: this runs inside a link's delivery)
  }
  if (e->merge != cluster::Merge::kNone) {
    if (part >= 0 && static_cast<size_t>(part) < e->parts.size()) e->parts[static_cast<size_t>(part)] = reply;
    if (--e->parts_left > 0) return;
    if (e->merge == cluster::Merge::kMget) {
      size_t total = 0;
      for (const auto& p : e->positions) total += p.size();
      e->reply = cluster::MergeMget(e->parts, e->positions, total, resp3_);
    } else {
      e->reply = cluster::MergeReplies(e->merge, e->parts);
    }
    e->parts.clear();
  } else if (e->scan && !reply.starts_with("-")) {
    const ClusterState& c = *worker_.cluster;
    e->reply = cluster::RewriteScanReply(reply, e->scan_node, static_cast<int>(c.map->primaries.size()));
  } else {
    e->reply = reply;
  }
  e->done = true;
}

void ClusterClient::Fail(Entry* e, int part, std::string_view error) { Complete(e, part, error); }

void ClusterClient::BeginLinkReplies(SharedLink* from) {
  from_ = from;
  in_link_run_ = true;
}

void ClusterClient::OpenRun() {
  if (!run_open_) {
    run_open_ = true;
    session_.BeginLinkReplies(from_);
  }
}

bool ClusterClient::Deliver(std::string_view frame, const resp::ReplyFramer& f) {
  OpenRun();
  return session_.OnLinkFrame(frame, f);
}

void ClusterClient::DeliverReady() {
  while (!entries_.empty() && entries_.front().done) {
    // The connection keeps views of the frame until the run ends: the bytes are kept until then.
    buffered_ -= entries_.front().buffered;
    const std::string& reply = delivered_.emplace_back(std::move(entries_.front().reply));
    entries_.Pop();
    reframer_.Reset();
    if (reframer_.Next(reply.data(), reply.size()) == resp::Status::kOk) {
      Deliver(std::string_view(reply.data(), reframer_.consumed()), reframer_);
    }
  }
  if (buffered_wait_ != nullptr && buffered_ <= buffered_low_) buffered_wait_->cancel();
}

void ClusterClient::OnLinkPush(std::string_view frame, const resp::ReplyFramer& f) {
  LinkQueue& q = QueueOf(from_);
  if (q.items.empty() || q.items.front().skip > 0 || q.items.front().seq != entries_.front_seq()) return;
  OpenRun();
  session_.OnLinkPush(frame, f);
}

bool ClusterClient::OnLinkFrame(std::string_view frame, const resp::ReplyFramer& f) {
  LinkQueue& q = QueueOf(from_);
  if (q.items.empty()) return false;  // the link owes this client nothing: a desync
  InFlight& head = q.items.front();
  if (head.skip > 0) {
    --head.skip;  // ASKING's +OK
    return true;
  }
  const uint64_t seq = head.seq;
  Entry* e = &entries_.At(seq);
  const int part = head.part;
  q.items.pop_front();
  if (f.type() == '-' && !f.head().empty()) [[unlikely]] {
    const std::string_view text = f.head()[0].text;
    // (The budget is per part: each part of a split command may be redirected on its own.)
    const size_t budget = kMaxRedirects * std::max<size_t>(1, e->parts.size());
    Tries& t = TriesOf(*e, part);
    auto r = RedirectFor(*e, part, text);
    const cluster::SlotMap& map = *worker_.cluster->map;
    const std::optional<uint16_t> primary = r.has_value() ? map.PrimaryAt(r->host, r->port) : std::nullopt;
    const cluster::Node* slotless = r.has_value() && !primary ? map.SlotlessAt(r->host, r->port) : nullptr;
    const int max_tries = e->scripted ? kScriptRedirectTries : kMaxTryAgain;  // (a script runs again each time)
    if (r.has_value() && !primary && slotless == nullptr) [[unlikely]] {
      // A node the map does not have (one that joined or was promoted since the map was read, or
      // an address a script made up): nothing is sent there before the cluster itself names it,
      // and the map is not changed. It is asked for again, and the command waits like a TRYAGAIN
      // and goes where the map then says: a node's own redirection comes back and is followed
      // once the map has its target; a script's error is its client's reply once the tries are
      // used up (fewer for a script, which runs again with each).
      if (worker_.cluster->refresh) worker_.cluster->refresh();
      if (t.count < max_tries) {
        ++t.count;
        t.ask = nullptr;
        RetryAfterPause(seq, part);
        return true;
      }
      r.reset();
    }
    // Followed for this command alone, the map unchanged: an ASK (the owner knows where the slot
    // goes), a script's MOVED or one for keys keyguard could not tell (the text may be the
    // command's own, and must not move a slot for every client: the map is asked for again), and
    // a MOVED to a primary the map has with no slot yet (until the map has it own the slot).
    const bool once = r.has_value() && (r->ask || e->scripted || e->keys_untold || !primary);
    if (r.has_value() && !r->ask && t.moved && t.count < max_tries && StillBouncing(SlotOf(*e, part))) {
      // A MOVED after a MOVED: the nodes disagree for a moment (a SETSLOT NODE done on the
      // slot's old owner before the new one, each naming the other). Followed at once, the
      // command ran out of redirects in a few round trips; it waits like a TRYAGAIN instead,
      // then goes where this MOVED says (or the refreshed map).
      worker_.shard->cluster_redirects[0].Add();
      if (!once) {
        OnClusterMoved(worker_, *r);
      } else if (worker_.cluster->refresh) {
        worker_.cluster->refresh();
      }
      ++t.count;
      t.ask = nullptr;
      RetryAfterPause(seq, part);
      return true;
    }
    if (r.has_value() && e->redirects < budget) {
      ++e->redirects;
      t.moved = !r->ask;  // (an ASK: the owner knows where the slot goes)
      worker_.shard->cluster_redirects[r->ask ? 1 : 0].Add();
      if (!once) {
        OnClusterMoved(worker_, *r);
      } else if (!r->ask && !e->keys_untold && worker_.cluster->refresh) {
        // (A command whose keys keyguard could not tell went to any node: the map is not wrong.)
        worker_.cluster->refresh();
      }
      SharedLink* target =
          primary ? ClusterNodeLink(worker_, *primary, resp3_) : LinkTo(worker_, *slotless, /*replica=*/false, resp3_);
      t.ask = once && target != nullptr ? target->shared_from_this() : nullptr;
      t.asking = r->ask;
      if (Single(*e)) {
        // In the client's order behind the earlier commands of its slot (ReleaseHeld).
        Hold(seq);
        ReleaseHeld();
        DeliverReady();
        return true;
      }
      // (A node keyguard had no link to yet is still connecting: the command waits for it.)
      if (!e->split_slots.empty()) {
        MarkPartRedirected(*e, part);
        SendPartInOrder(seq, part, target);
      } else {
        SendOrRetry(seq, part, target);
      }
      // (Out of tries, the part failed: the command may be complete, and those behind it free.)
      ReleaseHeld();
      DeliverReady();
      return true;
    } else if (text.starts_with("TRYAGAIN") && t.count < kMaxTryAgain) {
      ++t.count;
      // A node importing the slot answers an ASKed multi-key command TRYAGAIN while its keys are
      // not all there yet; the retry goes to the slot's owner, which ASKs again. That cycle lasts
      // as long as the migration and is bounded by the tries: its ASK is not counted as a
      // redirect (10 cycles, about 0.5 s, used up a split MGET's redirects, and the next MOVED
      // reached the client: CI, test_a_pipeline_keeps_its_order_while_its_slot_moves).
      if (t.ask != nullptr && t.asking && e->redirects > 0) --e->redirects;
      t.ask = nullptr;
      RetryAfterPause(seq, part);
      return true;
    }
  }
  if (!bouncing_.empty() && f.type() != '-' && f.type() != '!') [[unlikely]]
    bouncing_.erase(SlotOf(*e, part));  // (not for the -MOVED of a command out of tries)
  if (seq == entries_.front_seq() && e->merge == cluster::Merge::kNone && !e->scan) [[likely]] {
    // In order: handed over as the link framed it.
    entries_.Pop();
    if (!Deliver(frame, f)) return false;
  } else {
    Complete(e, part, frame);
  }
  if (!redirected_.empty()) [[unlikely]]
    ReleaseHeld();
  DeliverReady();
  return true;
}

bool ClusterClient::EndLinkReplies() {
  in_link_run_ = false;
  if (!run_open_) return false;
  return EndRun();
}

bool ClusterClient::EndRun() {
  run_open_ = false;
  const bool slow = session_.EndLinkReplies();
  if (!delivered_.empty()) delivered_.clear();
  return slow;
}

void ClusterClient::OnLinkFailed(SharedLink* from, metrics::UpstreamError /*reason*/) {
  for (size_t i = 0; i < queues_.size(); ++i) {
    if (queues_[i].link.get() != from) continue;
    std::deque<InFlight> items = std::move(queues_[i].items);
    queues_.erase(queues_.begin() + static_cast<std::ptrdiff_t>(i));
    for (const InFlight& it : items) Fail(&entries_.At(it.seq), it.part, NodeUnavailable(from));
    break;
  }
  if (worker_.cluster->refresh) worker_.cluster->refresh();
  from_ = from;
  ReleaseHeld();
  DeliverReady();
  if (run_open_ && !in_link_run_) EndRun();
}

void ClusterClient::SendOrRetry(uint64_t seq, int part, SharedLink* link) {
  Entry* e = &entries_.At(seq);
  const Tries& tries = TriesOf(*e, part);
  if (Send(seq, part, link, tries.ask != nullptr && link == tries.ask.get() && tries.asking)) return;
  // The node is down, still connecting, or not known: ask for the map, and try again a little
  // later (10 ms more each time, about 2 s in all) before the command gets an error.
  if (worker_.cluster->refresh) worker_.cluster->refresh();
  if (uint8_t& tries = TriesOf(*e, part).count; tries < kMaxTryAgain) {
    ++tries;
    RetryLater(seq, part);
    return;
  }
  Fail(e, part, NodeUnavailable(link));
}

void ClusterClient::RetryLater(uint64_t seq, int part) {
  auto timer =
      std::make_shared<Timer>(worker_.io, std::chrono::milliseconds(10 * TriesOf(entries_.At(seq), part).count));
  std::weak_ptr<bool> alive = alive_;
  timer->async_wait([this, alive, timer, seq, part](error_code ec) {
    auto a = alive.lock();
    if (ec || a == nullptr || !*a) return;
    Entry* e = &entries_.At(seq);
    const std::shared_ptr<SharedLink>& ask = TriesOf(*e, part).ask;
    SharedLink* l = ask != nullptr                      ? ask.get()
                    : !e->split_slots.empty()           ? LinkForSlot(e->split_slots[static_cast<size_t>(part)])
                    : e->merge != cluster::Merge::kNone ? ClusterNodeLink(worker_, static_cast<uint16_t>(part), resp3_)
                    : e->scan ? ClusterNodeLink(worker_, static_cast<uint16_t>(e->scan_node), resp3_)
                              : LinkForSlot(e->slot);
    if (!e->split_slots.empty()) {
      SendPartInOrder(seq, part, l);
    } else {
      SendOrRetry(seq, part, l);
    }
    ReleaseHeld();  // (a command that failed here lets those held behind it go)
    DeliverReady();
    if (run_open_ && !in_link_run_) EndRun();
  });
}

}  // namespace keyguard::proxy
