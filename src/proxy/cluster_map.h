// Redis Cluster, sans-io: key slots (CRC16 with hash tags, as Redis defines them), the slot map
// learnt from CLUSTER SLOTS, the SCAN cursor that names a node, the merge of a fanned-out
// command's replies, and the replies keyguard gives as a one-node cluster (a cluster-aware client
// pointed at keyguard keeps all its traffic on it). Unit-tested in tests/unit/cluster_map_test.cc.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace keyguard::proxy::cluster {

inline constexpr int kSlots = 16384;

// The slot of `key`: CRC16 (XMODEM) of the key, or of the part between the first '{' and the
// next '}' when that part is not empty, modulo 16384.
uint16_t KeySlot(std::string_view key);

struct Node {
  std::string host;  // as the cluster announces it: an address, or a name (cluster-announce-hostname)
  uint16_t port = 0;
  std::string id;
  std::string ip;  // a name's address, resolved by ClusterWatch ("": host is an address)
  const std::string& address() const { return ip.empty() ? host : ip; }
  std::string ToString() const;  // "host:port"
  bool operator==(const Node& o) const { return host == o.host && port == o.port; }
};

// Which primary owns each slot.
struct SlotMap {
  static constexpr uint16_t kNoOwner = 0xFFFF;
  std::vector<Node> primaries;              // in the order of their addresses
  std::vector<std::vector<Node>> replicas;  // by primary
  std::array<uint16_t, kSlots> owner;       // index into primaries, or kNoOwner
  // Primaries that serve no slot yet (a node just added), by address: in no fan-out, walk or
  // cursor, only known (a slot's first import to one is followed: an ASK names it).
  std::vector<Node> slotless;
  SlotMap() { owner.fill(kNoOwner); }
  // Every slot has an owner.
  bool complete() const;
  // The same primaries owning the same slots.
  bool SameAs(const SlotMap& o) const;
  // The primary at `host:port`, added when new (the parser's).
  uint16_t NodeIndex(std::string_view host, uint16_t port);
  // The primary at `host:port` (as the cluster announces it), if the map has it.
  std::optional<uint16_t> PrimaryAt(std::string_view host, uint16_t port) const;
  // The slotless primary at `host:port`, or nullptr.
  const Node* SlotlessAt(std::string_view host, uint16_t port) const;
};

// The map of a CLUSTER SLOTS reply (one RESP2 frame). An empty host (a node that does not know its
// address) is `default_host`, the host that was asked. `slotless`: primaries that serve no slot
// yet (SlotlessPrimaries), kept apart in SlotMap::slotless.
absl::StatusOr<SlotMap> ParseClusterSlots(std::string_view frame, std::string_view default_host,
                                          std::span<const Node> slotless = {});
// The online primaries of a CLUSTER SHARDS reply (one RESP2 frame, Redis 7.0+) whose shard has no
// slot, by the endpoint redirections name (`tls`: the TLS port where the node has one).
std::vector<Node> SlotlessPrimaries(std::string_view frame, std::string_view default_host, bool tls);

// A redirection in an error reply: "MOVED 3999 127.0.0.1:6381" or "ASK 3999 127.0.0.1:6381".
struct Redirect {
  bool ask = false;
  uint16_t slot = 0;
  std::string host;
  uint16_t port = 0;
};
// The redirection in `error` (the text after '-'), or nullopt.
std::optional<Redirect> ParseRedirect(std::string_view error);

// SCAN over a cluster: the client's cursor is a number, the node's index in SlotMap::primaries in
// its bits from kScanNodeShift up and the node's own cursor below ("0" starts at node 0; a node's
// "0" moves to the next). A number, as clients parse cursors into integers (redis-cli, redis-py,
// Jedis's signed long: up to 2048 nodes).
inline constexpr int kScanNodeShift = 52;
struct ScanCursor {
  std::string node_cursor = "0";
  int node = 0;
};
std::optional<ScanCursor> DecodeScanCursor(std::string_view cursor);
// The client's cursor after node `node` answered `node_cursor`, with `nodes` primaries.
std::string EncodeScanCursor(std::string_view node_cursor, int node, int nodes);

// How the replies of a command sent to every primary become the one the client gets.
enum class Merge : uint8_t {
  kNone,    // not fanned out
  kSum,     // DBSIZE: the sum of the integers
  kConcat,  // KEYS: every node's elements in one array
  kAllOk,   // FLUSHALL, FLUSHDB, SCRIPT FLUSH, SCRIPT LOAD, FUNCTION FLUSH: the first error, else the first reply
  kRandom,  // RANDOMKEY: the first reply that is not nil
  kAllOf,   // SCRIPT EXISTS: per element, 1 only where every node says 1
  kMget,    // MGET split by slot: each part's values in the places of its keys
};
// The merged reply (each of `replies` one whole RESP2 frame, in node order). An error reply wins.
std::string MergeReplies(Merge how, std::span<const std::string> replies);
// MGET split by slot: `replies[i]` has the values of the keys at `positions[i]` of the client's
// command (`total` keys); an error reply wins. `resp3`: a missing key is RESP3's null.
std::string MergeMget(std::span<const std::string> replies, std::span<const std::vector<uint32_t>> positions,
                      size_t total, bool resp3 = false);
// A SCAN reply from node `node`: the same with the client's cursor.
std::string RewriteScanReply(std::string_view reply, int node, int nodes);

// keyguard as a one-node cluster at `host:port` that owns every slot: the reply to CLUSTER
// `sub` (SLOTS, SHARDS, NODES, INFO, MYID; lowercase), or "" when keyguard does not answer it.
// `protocol` 3: as the server answers a RESP3 client (SHARDS' maps, verbatim text for NODES and
// INFO).
std::string LocalClusterReply(std::string_view sub, std::string_view host, uint16_t port, int protocol = 2);

}  // namespace keyguard::proxy::cluster
