// Connection with a Redis Cluster upstream: each command's route (its keys' slot, any node, every
// node with a merge), CROSSSLOT, and what keyguard answers as a one-node cluster. The transport
// (ClusterClient) sends each command where its route says.
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "keyguard/common/views.h"
#include "keyguard/tenant/tenancy.h"
#include "proxy/connection.h"

namespace keyguard::proxy {
namespace {

constexpr std::string_view kCrossSlotError = "CROSSSLOT Keys in request don't hash to the same slot";

struct ClusterIds {
  commands::CommandId cluster, dbsize, keys, flushall, flushdb, randomkey, script, function, scan, client, readonly,
      readwrite, mget, mset, del, unlink, exists, touch, spublish, ssubscribe, sunsubscribe, publish, pubsub, wait,
      waitaof, asking, subscribe, psubscribe;
};
const ClusterIds& Ids() {
  static const ClusterIds ids{commands::LookupCommand("cluster"),
                              commands::LookupCommand("dbsize"),
                              commands::LookupCommand("keys"),
                              commands::LookupCommand("flushall"),
                              commands::LookupCommand("flushdb"),
                              commands::LookupCommand("randomkey"),
                              commands::LookupCommand("script"),
                              commands::LookupCommand("function"),
                              commands::LookupCommand("scan"),
                              commands::LookupCommand("client"),
                              commands::LookupCommand("readonly"),
                              commands::LookupCommand("readwrite"),
                              commands::LookupCommand("mget"),
                              commands::LookupCommand("mset"),
                              commands::LookupCommand("del"),
                              commands::LookupCommand("unlink"),
                              commands::LookupCommand("exists"),
                              commands::LookupCommand("touch"),
                              commands::LookupCommand("spublish"),
                              commands::LookupCommand("ssubscribe"),
                              commands::LookupCommand("sunsubscribe"),
                              commands::LookupCommand("publish"),
                              commands::LookupCommand("pubsub"),
                              commands::LookupCommand("wait"),
                              commands::LookupCommand("waitaof"),
                              commands::LookupCommand("asking"),
                              commands::Known().subscribe,
                              commands::Known().psubscribe};
  return ids;
}

// By command id: how RouteCluster treats it. kSingleKey: exactly one key, args[1] (GET, SET, HSET,
// ...: one CRC and done); kSpecial: keyguard answers it, fans it out, splits it or reads its
// channel; kGeneral: the key finder. Or'ed with kReadOnly for the table's readonly commands, and
// with kScripted for the @scripting ones (Route::scripted).
enum : uint8_t { kGeneral, kSingleKey, kSpecial, kKindMask = 3, kReadOnly = 4, kScripted = 8 };
const std::vector<uint8_t>& Classes() {
  static const std::vector<uint8_t> classes = [] {
    std::vector<uint8_t> c(commands::CommandCount(), kGeneral);
    for (size_t id = 1; id < c.size(); ++id) {
      const commands::CommandSpec& spec = commands::Spec(static_cast<commands::CommandId>(id));
      const auto keys = commands::KeySpecs(spec);
      if (spec.sub_count == 0 && keys.size() == 1 && keys[0].begin == commands::KeySpec::kIndex && keys[0].index == 1 &&
          keys[0].find == commands::KeySpec::kRange && keys[0].lastkey == 0 &&
          (keys[0].flags & (commands::kKeyIncomplete | commands::kKeyNotKey)) == 0) {
        c[id] = kSingleKey;
      }
      if ((spec.flags & commands::CommandFlagMask("readonly")) != 0) c[id] |= kReadOnly;
      if ((spec.acl & commands::AclCategoryMask("scripting")) != 0) c[id] |= kScripted;
    }
    const ClusterIds& ids = Ids();
    for (commands::CommandId id :
         {ids.cluster,  ids.dbsize, ids.keys,   ids.flushall, ids.flushdb,   ids.randomkey,  ids.script,
          ids.function, ids.scan,   ids.client, ids.readonly, ids.readwrite, ids.mget,       ids.mset,
          ids.del,      ids.unlink, ids.exists, ids.touch,    ids.spublish,  ids.ssubscribe, ids.sunsubscribe,
          ids.publish,  ids.pubsub, ids.wait,   ids.waitaof,  ids.asking,    ids.subscribe,  ids.psubscribe}) {
      if (id != commands::kUnknownCommand) c[id] = static_cast<uint8_t>(kSpecial | (c[id] & (kReadOnly | kScripted)));
    }
    return c;
  }();
  return classes;
}

std::string Lower(std::string_view s) { return absl::AsciiStrToLower(absl::string_view(s.data(), s.size())); }

}  // namespace

void Connection::EndRoute(size_t bytes) {
  Route r = route_;
  r.bytes = static_cast<uint32_t>(bytes);
  out_.routes.push_back(r);
}

void Connection::ForwardRouted(std::string_view bytes) {
  if (!split_.empty()) {
    ForwardSplit();
  } else if (!splice_.empty()) {
    size_t n = 0;
    for (std::string_view b : splice_) {
      ForwardRaw(b);
      n += b.size();
    }
    ++out_.commands;
    EndRoute(n);
  } else {
    ForwardCommand(bytes);
    EndRoute(bytes.size());
  }
  route_ = Route{};
}

void Connection::ClearRoutes() {
  out_.routes.clear();
  if (!split_keys_.empty()) split_keys_.clear();  // (a deque's clear walks its map even when empty)
}

bool Connection::ClientQuery(std::span<const std::string_view> args) {
  // CLIENT ID, INFO and LIST describe a connection (LIST: the node's) and set nothing. Pinned for
  // them, a cluster client would be on one node's connection for good, and every key of another
  // node refused: StackExchange.Redis sends CLIENT ID as it connects. Without a connection of its
  // own, what they describe is keyguard's shared connection (docs/configuration.md says so); so
  // do TRACKINGINFO and GETREDIR, whose answer (no tracking) is the client's too: tracking pins.
  // Any arity (the server's arity error sets nothing either), and a bare CLIENT.
  if (args.size() < 2) return true;
  for (std::string_view sub : {"id", "info", "list", "trackinginfo", "getredir"}) {
    if (commands::EqualsIgnoreCase(args[1], sub)) return true;
  }
  return false;
}

bool Connection::Scripted(commands::CommandId id) { return (Classes()[id] & kScripted) != 0; }

bool Connection::TrackingRedirect(std::span<const std::string_view> args) {
  // CLIENT TRACKING ON|OFF [REDIRECT id] [PREFIX p]... [BCAST] [OPTIN] [OPTOUT] [NOLOOP]: the
  // options from the third argument, PREFIX's and REDIRECT's values skipped.
  if (args.size() < 4 || !commands::EqualsIgnoreCase(args[1], "tracking")) return false;
  for (size_t i = 3; i < args.size(); ++i) {
    if (commands::EqualsIgnoreCase(args[i], "redirect")) return true;
    if (commands::EqualsIgnoreCase(args[i], "prefix")) ++i;
  }
  return false;
}

bool Connection::RefusedKeyspaceSubscription(commands::CommandId id, std::span<const std::string_view> args) const {
  const ClusterIds& ids = Ids();
  if (!cluster_ || (id != ids.subscribe && id != ids.psubscribe)) return false;
  // A one-primary cluster's node hears every key (a primary added later is not heard: documented).
  if (shared_.cluster_map == nullptr || *shared_.cluster_map == nullptr) return false;
  const cluster::SlotMap& m = **shared_.cluster_map;
  if (m.primaries.size() + m.slotless.size() <= 1) return false;
  const bool pattern = id == ids.psubscribe;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string_view a = args[i];
    if (a.starts_with("__keyspace@") || a.starts_with("__keyevent@")) return true;
    if (pattern && !a.empty() && a[0] != '*' && a[0] != '?' && a[0] != '[' &&
        (tenant::GlobMayMatchPrefix(a, "__keyspace@") || tenant::GlobMayMatchPrefix(a, "__keyevent@"))) {
      return true;
    }
  }
  return false;
}

bool Connection::ClusterAnswers(commands::CommandId id, std::span<const std::string_view> args) const {
  const ClusterIds& ids = Ids();
  if (id == commands::kUnknownCommand) return false;  // (WAITAOF is unknown to a 7.0 table: its id is 0)
  return id == ids.readonly || id == ids.readwrite || id == ids.asking || id == ids.wait || id == ids.waitaof;
}

namespace {

// The slot of `key` as stored under `prefix`.
int32_t StoredKeySlot(std::string_view prefix, std::string_view key) {
  if (prefix.empty()) [[likely]]
    return cluster::KeySlot(key);
  return cluster::KeySlot(absl::StrCat(AsAbsl(prefix), AsAbsl(key)));
}

}  // namespace

int32_t Connection::SlotOf(commands::CommandId id, std::span<const std::string_view> args, std::string_view prefix) {
  if ((Classes()[id] & kKindMask) == kSingleKey && args.size() >= 2) [[likely]] {
    return StoredKeySlot(prefix, args[1]);
  }
  const ClusterIds& ids = Ids();
  if ((id == ids.spublish || id == ids.ssubscribe || id == ids.sunsubscribe) && args.size() >= 2) {
    // Shard channels hash as keys do (their specs are not keys): every channel of one command in one slot.
    const size_t last = id == ids.spublish ? 2 : args.size();
    int32_t slot = StoredKeySlot(prefix, args[1]);
    for (size_t i = 2; i < last; ++i) {
      if (StoredKeySlot(prefix, args[i]) != slot) return kCrossSlot;
    }
    return slot;
  }
  const commands::CommandSpec* spec = commands::ResolveSpec(id, args);
  if (spec == nullptr || id == commands::kUnknownCommand) {
    keys_untold_ = true;
    return kAnyNode;
  }
  cluster_keys_.clear();
  if (!commands::FindKeys(*spec, args, &cluster_keys_)) {
    keys_untold_ = true;
    return kAnyNode;
  }
  if (cluster_keys_.empty()) return kAnyNode;
  int32_t slot = kAnyNode;
  for (const commands::KeyRef& k : cluster_keys_) {
    const int32_t s = StoredKeySlot(prefix, args[k.pos]);
    if (slot == kAnyNode) {
      slot = s;
    } else if (slot != s) {
      return kCrossSlot;
    }
  }
  return slot;
}

int32_t Connection::StoredSlotOf(commands::CommandId id, std::span<const std::string_view> args) {
  // The keys are found in the client's arguments (a prefix on every argument would hide option
  // words: XREAD's STREAMS), and hashed as the server will store them, with the tenant's prefix.
  return SlotOf(id, args, tenant_ != nullptr ? std::string_view(tenant_->prefix) : std::string_view());
}

int32_t Connection::LookAheadSlot(const char* data, size_t len, bool* ends) {
  resp::RequestFramer framer;
  size_t pos = 0;
  for (int i = 0; i < 64 && pos < len; ++i) {
    if (framer.Next(data + pos, len - pos) != resp::Status::kOk) break;
    pos += framer.consumed();
    const auto args = framer.args();
    if (args.empty()) continue;
    const commands::CommandId id = commands::LookupCommand(args[0]);
    if (id == commands::Known().exec || id == commands::Known().discard) {
      if (ends != nullptr) *ends = true;
      break;
    }
    if (const int32_t slot = StoredSlotOf(id, args); slot >= 0) return slot;
  }
  return kAnyNode;
}

bool Connection::RouteCluster(const CommandContext& c, const Verdict& v) {
  const ClusterIds& ids = Ids();
  const std::span<const std::string_view> args = v.args;
  route_ = Route{};
  if (const uint8_t kind = Classes()[c.id]; (kind & kKindMask) != kSpecial) [[likely]] {
    route_.read = (kind & kReadOnly) != 0;
    route_.scripted = (kind & kScripted) != 0;
    return RouteByKeys(c, args);
  }
  auto answer = [&](std::string reply) {
    Answer(c, std::move(reply), metrics::Outcome::kOk);
    return false;
  };
  if (state_.in_multi() && (c.id == ids.readonly || c.id == ids.readwrite || c.id == ids.asking)) [[unlikely]] {
    // Inside a transaction the server queues what it gets and answers in EXEC's array: keyguard's
    // +OK would come at once, out of it. The transaction's node queues it (a primary ignores it).
    return RouteByKeys(c, args);
  }
  if (c.id == ids.cluster && args.size() >= 2) {
    const std::string sub = Lower(args[1]);
    if (state_.in_multi()) [[unlikely]] {
      // Inside a transaction every answer must come in EXEC's array. KEYSLOT and the slot
      // queries are the transaction node's to queue (a bad slot is its error, in the array);
      // keyguard's one-node answers cannot take their place there, and the node's own would
      // describe the real cluster: refused, so EXEC aborts (as for any command refused while
      // queued).
      if (sub == "keyslot" || sub == "countkeysinslot" || sub == "getkeysinslot" || sub == "help") {
        return RouteByKeys(c, args);
      }
      Refuse(c, Refusal::kCluster,
             absl::StrCat("ERR keyguard: CLUSTER ", absl::AsciiStrToUpper(sub),
                          " is not served inside MULTI through keyguard (ask outside the transaction)"));
      return false;
    }
    if (std::string r = cluster::LocalClusterReply(sub, cluster_host_, cluster_port_, ReplyProtocol()); !r.empty())
      return answer(r);
    if (sub == "keyslot" && args.size() == 3) return answer(absl::StrCat(":", cluster::KeySlot(args[2]), "\r\n"));
    if ((sub == "countkeysinslot" || sub == "getkeysinslot") && args.size() >= 3) {
      uint32_t slot = 0;
      if (!absl::SimpleAtoi(absl::string_view(args[2].data(), args[2].size()), &slot) || slot >= cluster::kSlots) {
        return answer("-ERR Invalid slot\r\n");
      }
      route_.slot = static_cast<int32_t>(slot);
      return true;
    }
    if (sub == "help") return true;
    Refuse(c, Refusal::kCluster,
           absl::StrCat("ERR keyguard: CLUSTER ", absl::AsciiStrToUpper(sub),
                        " is not served through keyguard (ask the cluster's nodes directly)"));
    return false;
  }
  if (ClusterAnswers(c.id, args)) {
    if (c.id == ids.wait || c.id == ids.waitaof) {
      // The client's writes went over shared connections to several nodes: no connection of the
      // server knows them, so WAIT would answer for someone else's writes.
      Refuse(c, Refusal::kCluster,
             absl::StrCat("ERR keyguard: ", absl::AsciiStrToUpper(Lower(args[0])),
                          " cannot tell about this client's writes through a Redis Cluster upstream (they go over "
                          "shared connections to several nodes)"));
      return false;
    }
    // READONLY, READWRITE: reads go to the primaries (or replicas, by cluster.read_from). ASKING: the
    // client of a one-node cluster is never sent an ASK (keyguard follows each itself), so it
    // asks for nothing; pinned for it, the client was on one node for good (CROSSSLOT after).
    return answer("+OK\r\n");
  }
  // Every primary, the replies merged.
  auto every = [&](cluster::Merge how) {
    route_.slot = kEveryNode;
    route_.merge = how;
    return true;
  };
  if (c.id == ids.dbsize) return every(cluster::Merge::kSum);
  if (c.id == ids.keys) return every(cluster::Merge::kConcat);
  if (c.id == ids.flushall || c.id == ids.flushdb) return every(cluster::Merge::kAllOk);
  if (c.id == ids.randomkey) return every(cluster::Merge::kRandom);
  if ((c.id == ids.script || c.id == ids.function) && args.size() >= 2) {
    const std::string sub = Lower(args[1]);
    if (c.id == ids.script && sub == "exists") return every(cluster::Merge::kAllOf);
    if (sub == "load" || sub == "flush" || sub == "delete" || sub == "restore") return every(cluster::Merge::kAllOk);
  }
  if (c.id == ids.scan) {
    route_.scan = true;
    return true;
  }
  if (c.id == client_id_ && TrackingRedirect(args)) {
    // The id a client without a connection of its own gets from CLIENT ID is keyguard's shared
    // connection's (ClientQuery), and an id names one node's connection: the invalidations would
    // go to keyguard, and the client's cache would never hear of a change. Refused. A tenant's
    // CLIENT ID pins, and tenancy would let it name its own connections; but ids are counted per
    // node, so the id of its connection to one node is another connection's (maybe another
    // tenant's) on the node its REDIRECT goes to, or on a one-primary cluster's next primary
    // after a failover (its registered connection to the old one stays open): refused too.
    Refuse(c, Refusal::kCluster,
           shared_.stages.config.tenancy == nullptr
               ? "ERR keyguard: CLIENT TRACKING REDIRECT is not served through a Redis Cluster upstream (a client id "
                 "names one node's connection, and CLIENT ID answers keyguard's); use RESP3 tracking (HELLO 3, then "
                 "CLIENT TRACKING ON)"
               : "ERR keyguard: CLIENT TRACKING REDIRECT is not served through a Redis Cluster upstream (a client id "
                 "names one node's connection); use RESP3 tracking (HELLO 3, then CLIENT TRACKING ON)");
    return false;
  }
  if (c.id == client_id_ && !pinned_) {
    // A CLIENT query or SETINFO (the rest pin): keyguard's connection to the first primary, the
    // same one each time.
    route_.slot = kFirstNode;
    return true;
  }
  if (RefusedKeyspaceSubscription(c.id, c.args)) {
    // Each primary notifies of its own keys only (1 event in 3 was heard): refused, with no pin
    // made (NeedsPin, which reads the same arguments: the client's), rather than heard from one
    // node.
    Refuse(c, Refusal::kCluster,
           "ERR keyguard: keyspace notifications are not served through a Redis Cluster upstream (each primary "
           "sends its own keys' events, and a subscription is on one node); subscribe on every primary directly");
    return false;
  }
  if (c.id == ids.publish || c.id == ids.pubsub) {
    // The node subscriptions pin to (the first primary): one client's messages in its order,
    // PUBLISH's and PUBSUB's counts those of the node its subscribers are on.
    route_.slot = kFirstNode;
    return true;
  }
  return RouteByKeys(c, args);
}

bool Connection::RouteByKeys(const CommandContext& c, std::span<const std::string_view> args) {
  keys_untold_ = false;
  const int32_t slot = SlotOf(c.id, args);
  if (slot == kCrossSlot) {
    if (!pinned_ && SplitBySlot(c.id, args)) return true;
    Refuse(c, Refusal::kCluster, kCrossSlotError);
    return false;
  }
  if (pinned_ && slot >= 0 && shared_.cluster_map != nullptr && *shared_.cluster_map != nullptr &&
      (*shared_.cluster_map)->owner[static_cast<size_t>(slot)] != pinned_node_) {
    // A transaction (or a blocking command) is on one node's connection: a key of another node's
    // slot cannot be served on it.
    Refuse(c, Refusal::kCluster,
           absl::StrCat("ERR keyguard: slot ", slot,
                        " is on another cluster node than this connection's transaction or subscription (keys of "
                        "one transaction must share a node: use a hash tag)"));
    return false;
  }
  route_.slot = slot;
  route_.keys_untold = keys_untold_;
  return true;
}

bool Connection::SplitBySlot(commands::CommandId id, std::span<const std::string_view> args) {
  const ClusterIds& ids = Ids();
  cluster::Merge how;
  size_t step = 1;  // arguments per key
  if (id == ids.mget) {
    how = cluster::Merge::kMget;
  } else if (id == ids.mset) {
    how = cluster::Merge::kAllOk;
    step = 2;
    if (args.size() < 3 || (args.size() - 1) % 2 != 0) return false;
  } else if (id == ids.del || id == ids.unlink || id == ids.exists || id == ids.touch) {
    how = cluster::Merge::kSum;
  } else {
    return false;
  }
  // One part per slot, in the order each slot first appears; each part's keys in their order.
  std::vector<std::pair<int32_t, std::vector<uint32_t>>> groups;
  for (size_t i = 1; i + step - 1 < args.size(); i += step) {
    const int32_t slot = cluster::KeySlot(args[i]);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == slot; });
    if (it == groups.end()) {
      groups.emplace_back(slot, std::vector<uint32_t>());
      it = groups.end() - 1;
    }
    it->second.push_back(static_cast<uint32_t>((i - 1) / step));
  }
  split_.clear();
  std::vector<std::string_view> part;
  for (auto& [slot, keys] : groups) {
    part.assign(1, args[0]);
    for (uint32_t k : keys) {
      for (size_t j = 0; j < step; ++j) part.push_back(args[1 + k * step + j]);
    }
    const std::string_view bytes = Encode(part);
    std::vector<uint32_t>& positions = split_keys_.emplace_back(std::move(keys));
    split_.push_back(SplitPart{bytes, slot, positions});
  }
  route_.merge = how;
  return true;
}

void Connection::ForwardSplit() {
  for (size_t i = 0; i < split_.size(); ++i) {
    ForwardRaw(split_[i].command);
    ++out_.commands;
    Route r;
    r.bytes = static_cast<uint32_t>(split_[i].command.size());
    r.slot = split_[i].slot;
    r.merge = route_.merge;
    r.split = i == 0 ? 1 : 2;
    if (route_.merge == cluster::Merge::kMget) r.positions = split_[i].positions;
    out_.routes.push_back(r);
  }
  split_.clear();
}

}  // namespace keyguard::proxy
