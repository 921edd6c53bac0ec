#include "proxy/cluster_map.h"

#include <algorithm>
#include <cstdio>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "keyguard/common/fnv.h"
#include "keyguard/common/views.h"
#include "keyguard/resp/value.h"

namespace keyguard::proxy::cluster {
namespace {

// CRC16-CCITT (XMODEM: polynomial 0x1021, initial 0), the one Redis Cluster hashes keys with.
constexpr std::array<uint16_t, 256> MakeCrcTable() {
  std::array<uint16_t, 256> t{};
  for (int i = 0; i < 256; ++i) {
    uint16_t crc = static_cast<uint16_t>(i << 8);
    for (int b = 0; b < 8; ++b) crc = static_cast<uint16_t>((crc & 0x8000) ? (crc << 1) ^ 0x1021 : crc << 1);
    t[static_cast<size_t>(i)] = crc;
  }
  return t;
}
constexpr std::array<uint16_t, 256> kCrcTable = MakeCrcTable();

uint16_t Crc16(std::string_view s) {
  uint16_t crc = 0;
  for (unsigned char c : s) crc = static_cast<uint16_t>((crc << 8) ^ kCrcTable[((crc >> 8) ^ c) & 0xff]);
  return crc;
}

void AppendBulk(std::string* out, std::string_view s) {
  absl::StrAppend(out, "$", s.size(), "\r\n", AsAbsl(s), "\r\n");
}

std::string NodeId(std::string_view host, uint16_t port) {
  const uint64_t h = Fnv1a(absl::StrCat(AsAbsl(host), ":", port));
  char buf[48];
  std::snprintf(buf, sizeof buf, "%016llx%016llx%08llx", static_cast<unsigned long long>(h),
                static_cast<unsigned long long>(~h), static_cast<unsigned long long>(h >> 32));
  return std::string(buf, 40);
}

// Nodes in the order of their addresses (SlotMap's primaries and slotless).
bool ByAddress(const Node& x, const Node& y) { return std::tie(x.host, x.port) < std::tie(y.host, y.port); }

// The first error among `replies`, if any.
const std::string* FirstError(std::span<const std::string> replies) {
  for (const std::string& r : replies) {
    if (!r.empty() && r[0] == '-') return &r;
  }
  return nullptr;
}

}  // namespace

uint16_t KeySlot(std::string_view key) {
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close != open + 1) key = key.substr(open + 1, close - open - 1);
  }
  return Crc16(key) & (kSlots - 1);
}

std::string Node::ToString() const {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

bool SlotMap::complete() const {
  for (uint16_t o : owner) {
    if (o == kNoOwner) return false;
  }
  return true;
}

bool SlotMap::SameAs(const SlotMap& o) const {
  if (primaries.size() != o.primaries.size() || slotless != o.slotless) return false;
  for (size_t s = 0; s < owner.size(); ++s) {
    const bool a = owner[s] == kNoOwner, b = o.owner[s] == kNoOwner;
    if (a != b) return false;
    if (!a && !(primaries[owner[s]] == o.primaries[o.owner[s]])) return false;
  }
  return true;
}

uint16_t SlotMap::NodeIndex(std::string_view host, uint16_t port) {
  if (const std::optional<uint16_t> i = PrimaryAt(host, port); i.has_value()) return *i;
  primaries.push_back(Node{std::string(host), port, ""});
  replicas.emplace_back();
  return static_cast<uint16_t>(primaries.size() - 1);
}

std::optional<uint16_t> SlotMap::PrimaryAt(std::string_view host, uint16_t port) const {
  for (size_t i = 0; i < primaries.size(); ++i) {
    if (primaries[i].host == host && primaries[i].port == port) return static_cast<uint16_t>(i);
  }
  return std::nullopt;
}

const Node* SlotMap::SlotlessAt(std::string_view host, uint16_t port) const {
  for (const Node& n : slotless) {
    if (n.host == host && n.port == port) return &n;
  }
  return nullptr;
}

std::vector<Node> SlotlessPrimaries(std::string_view frame, std::string_view default_host, bool tls) {
  std::vector<Node> out;
  const std::optional<resp::Value> v = resp::ParseValue(frame);
  if (!v.has_value() || v->type != '*') return out;
  const auto field = resp::FieldOf;
  for (const resp::Value& shard : v->elements) {
    const resp::Value* slots = field(shard, "slots");
    const resp::Value* nodes = field(shard, "nodes");
    if (slots == nullptr || nodes == nullptr || !slots->elements.empty()) continue;
    for (const resp::Value& n : nodes->elements) {
      const resp::Value *role = field(n, "role"), *health = field(n, "health"), *endpoint = field(n, "endpoint");
      const resp::Value *port = field(n, "port"), *tls_port = field(n, "tls-port");
      if (role == nullptr || role->text != "master" || health == nullptr || health->text != "online") continue;
      const int64_t p = tls && tls_port != nullptr && tls_port->integer > 0 ? tls_port->integer
                        : port != nullptr                                   ? port->integer
                                                                            : 0;
      if (p <= 0 || p > 65535) continue;
      Node node;
      node.host = endpoint == nullptr || endpoint->text.empty() || endpoint->text == "?" ? std::string(default_host)
                                                                                         : std::string(endpoint->text);
      node.port = static_cast<uint16_t>(p);
      out.push_back(std::move(node));
    }
  }
  return out;
}

absl::StatusOr<SlotMap> ParseClusterSlots(std::string_view frame, std::string_view default_host,
                                          std::span<const Node> slotless) {
  const std::optional<resp::Value> v = resp::ParseValue(frame);
  if (!v.has_value()) return absl::DataLossError("CLUSTER SLOTS: not one RESP value");
  if (v->type == '-') return absl::FailedPreconditionError(absl::StrCat("CLUSTER SLOTS: ", AsAbsl(v->text)));
  if (v->type != '*') return absl::DataLossError("CLUSTER SLOTS: not an array");
  SlotMap m;
  auto node_of = [&](const resp::Value& n) -> std::optional<Node> {
    if (n.type != '*' || n.elements.size() < 2 || n.elements[1].type != ':') return std::nullopt;
    Node node;
    node.host = std::string(n.elements[0].text);
    if (node.host.empty() || node.host == "?") node.host = std::string(default_host);
    if (n.elements[1].integer <= 0 || n.elements[1].integer > 65535) return std::nullopt;
    node.port = static_cast<uint16_t>(n.elements[1].integer);
    if (n.elements.size() > 2) node.id = std::string(n.elements[2].text);
    return node;
  };
  for (const resp::Value& range : v->elements) {
    if (range.type != '*' || range.elements.size() < 3 || range.elements[0].type != ':' ||
        range.elements[1].type != ':') {
      return absl::DataLossError("CLUSTER SLOTS: a range is not [start, end, primary, ...]");
    }
    const int64_t lo = range.elements[0].integer, hi = range.elements[1].integer;
    if (lo < 0 || hi >= kSlots || lo > hi) return absl::DataLossError("CLUSTER SLOTS: a slot out of range");
    std::optional<Node> primary = node_of(range.elements[2]);
    if (!primary) return absl::DataLossError("CLUSTER SLOTS: a node is not [host, port, ...]");
    const uint16_t idx = m.NodeIndex(primary->host, primary->port);
    m.primaries[idx].id = primary->id;
    for (size_t r = 3; r < range.elements.size(); ++r) {
      std::optional<Node> replica = node_of(range.elements[r]);
      if (!replica) continue;
      auto& list = m.replicas[idx];
      bool known = false;
      for (const Node& n : list) known = known || n == *replica;
      if (!known) list.push_back(*std::move(replica));
    }
    for (int64_t s = lo; s <= hi; ++s) m.owner[static_cast<size_t>(s)] = idx;
  }
  if (m.primaries.empty()) return absl::FailedPreconditionError("CLUSTER SLOTS: no slot is served");
  // Primaries in the order of their addresses, so that the SCAN cursor's node index is the same
  // in every node's answer and across a reshard (which moves slots, not nodes).
  std::vector<uint16_t> order(m.primaries.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<uint16_t>(i);
  std::sort(order.begin(), order.end(),
            [&](uint16_t a, uint16_t b) { return ByAddress(m.primaries[a], m.primaries[b]); });
  std::vector<uint16_t> rank(m.primaries.size());
  SlotMap sorted;
  for (uint16_t i : order) {
    rank[i] = static_cast<uint16_t>(sorted.primaries.size());
    sorted.primaries.push_back(m.primaries[i]);
    sorted.replicas.push_back(m.replicas[i]);
  }
  for (size_t s = 0; s < m.owner.size(); ++s) {
    if (m.owner[s] != SlotMap::kNoOwner) sorted.owner[s] = rank[m.owner[s]];
  }
  for (const Node& n : slotless) {
    if (!sorted.PrimaryAt(n.host, n.port).has_value() && sorted.SlotlessAt(n.host, n.port) == nullptr) {
      sorted.slotless.push_back(n);
    }
  }
  std::sort(sorted.slotless.begin(), sorted.slotless.end(), ByAddress);
  return sorted;
}

std::optional<Redirect> ParseRedirect(std::string_view error) {
  Redirect r;
  if (error.starts_with("MOVED ")) {
    error.remove_prefix(6);
  } else if (error.starts_with("ASK ")) {
    r.ask = true;
    error.remove_prefix(4);
  } else {
    return std::nullopt;
  }
  const size_t sp = error.find(' ');
  if (sp == std::string_view::npos) return std::nullopt;
  uint32_t slot = 0;
  if (!absl::SimpleAtoi(absl::string_view(error.data(), sp), &slot) || slot >= kSlots) return std::nullopt;
  r.slot = static_cast<uint16_t>(slot);
  std::string_view addr = error.substr(sp + 1);
  const size_t colon = addr.rfind(':');
  if (colon == std::string_view::npos) return std::nullopt;
  uint32_t port = 0;
  if (!absl::SimpleAtoi(absl::string_view(addr.data() + colon + 1, addr.size() - colon - 1), &port) || port == 0 ||
      port > 65535) {
    return std::nullopt;
  }
  r.port = static_cast<uint16_t>(port);
  std::string_view host = addr.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  r.host = std::string(host);
  return r;
}

std::optional<ScanCursor> DecodeScanCursor(std::string_view cursor) {
  uint64_t c = 0;
  if (!absl::SimpleAtoi(AsAbsl(cursor), &c)) return std::nullopt;
  ScanCursor out;
  out.node = static_cast<int>(c >> kScanNodeShift);
  out.node_cursor = absl::StrCat(c & ((uint64_t{1} << kScanNodeShift) - 1));
  return out;
}

std::string EncodeScanCursor(std::string_view node_cursor, int node, int nodes) {
  uint64_t c = 0;
  if (!absl::SimpleAtoi(AsAbsl(node_cursor), &c) || c >= (uint64_t{1} << kScanNodeShift)) return "0";
  if (c == 0) {
    if (node + 1 >= nodes) return "0";
    ++node;
  }
  return absl::StrCat((static_cast<uint64_t>(node) << kScanNodeShift) | c);
}

std::string MergeReplies(Merge how, std::span<const std::string> replies) {
  if (replies.empty()) return "-ERR keyguard: no cluster node to ask\r\n";
  if (const std::string* e = FirstError(replies); e != nullptr) return *e;
  switch (how) {
    case Merge::kNone:
    case Merge::kAllOk: return replies[0];
    case Merge::kSum: {
      int64_t total = 0;
      for (const std::string& r : replies) {
        const auto v = resp::ParseValue(r);
        if (v.has_value() && v->type == ':') total += v->integer;
      }
      return absl::StrCat(":", total, "\r\n");
    }
    case Merge::kRandom:
      for (const std::string& r : replies) {
        if (r != "$-1\r\n" && r != "_\r\n") return r;
      }
      return replies[0];
    case Merge::kConcat: {
      std::string body;
      size_t n = 0;
      for (const std::string& r : replies) {
        const auto v = resp::ParseValue(r);
        if (!v.has_value()) continue;
        for (const resp::Value& e : v->elements) {
          AppendBulk(&body, e.text);
          ++n;
        }
      }
      return absl::StrCat("*", n, "\r\n", body);
    }
    case Merge::kMget:  // (MergeMget)
      return replies[0];
    case Merge::kAllOf: {
      std::vector<int64_t> all;
      for (size_t i = 0; i < replies.size(); ++i) {
        const auto v = resp::ParseValue(replies[i]);
        if (!v.has_value()) continue;
        if (i == 0) all.assign(v->elements.size(), 1);
        for (size_t j = 0; j < v->elements.size() && j < all.size(); ++j) all[j] &= v->elements[j].integer != 0;
      }
      std::string out = absl::StrCat("*", all.size(), "\r\n");
      for (int64_t x : all) absl::StrAppend(&out, ":", x, "\r\n");
      return out;
    }
  }
  return replies[0];
}

std::string MergeMget(std::span<const std::string> replies, std::span<const std::vector<uint32_t>> positions,
                      size_t total, bool resp3) {
  if (const std::string* e = FirstError(replies); e != nullptr) return *e;
  const char* const null = resp3 ? "_\r\n" : "$-1\r\n";
  std::vector<std::string> values(total, null);
  for (size_t i = 0; i < replies.size() && i < positions.size(); ++i) {
    const auto v = resp::ParseValue(replies[i]);
    if (!v.has_value() || v->type != '*') return "-ERR keyguard: a cluster node's MGET reply is not an array\r\n";
    for (size_t j = 0; j < v->elements.size() && j < positions[i].size(); ++j) {
      const resp::Value& e = v->elements[j];
      if (positions[i][j] >= total) continue;
      std::string& out = values[positions[i][j]];
      out.clear();
      if (e.null) {
        out = null;
      } else {
        AppendBulk(&out, e.text);
      }
    }
  }
  std::string out = absl::StrCat("*", total, "\r\n");
  for (const std::string& v : values) out += v;
  return out;
}

std::string RewriteScanReply(std::string_view reply, int node, int nodes) {
  const auto v = resp::ParseValue(reply);
  if (!v.has_value() || v->type != '*' || v->elements.size() != 2) return std::string(reply);
  std::string out = "*2\r\n";
  AppendBulk(&out, EncodeScanCursor(v->elements[0].text, node, nodes));
  absl::StrAppend(&out, "*", v->elements[1].elements.size(), "\r\n");
  for (const resp::Value& e : v->elements[1].elements) AppendBulk(&out, e.text);
  return out;
}

std::string LocalClusterReply(std::string_view sub, std::string_view host, uint16_t port, int protocol) {
  const std::string id = NodeId(host, port);
  const bool resp3 = protocol == 3;
  // NODES and INFO: a bulk string, verbatim text ("txt:") in RESP3.
  auto text = [&](std::string* out, std::string_view body) {
    if (resp3) {
      absl::StrAppend(out, "=", body.size() + 4, "\r\ntxt:", absl::string_view(body.data(), body.size()), "\r\n");
    } else {
      AppendBulk(out, body);
    }
  };
  std::string out;
  if (sub == "slots") {
    out = "*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n";
    AppendBulk(&out, host);
    absl::StrAppend(&out, ":", port, "\r\n");
    AppendBulk(&out, id);
  } else if (sub == "shards") {
    out = resp3 ? "*1\r\n%2\r\n$5\r\nslots\r\n*2\r\n:0\r\n:16383\r\n$5\r\nnodes\r\n*1\r\n%6\r\n"
                : "*1\r\n*4\r\n$5\r\nslots\r\n*2\r\n:0\r\n:16383\r\n$5\r\nnodes\r\n*1\r\n*12\r\n";
    AppendBulk(&out, "id");
    AppendBulk(&out, id);
    AppendBulk(&out, "port");
    absl::StrAppend(&out, ":", port, "\r\n");
    AppendBulk(&out, "ip");
    AppendBulk(&out, host);
    AppendBulk(&out, "endpoint");
    AppendBulk(&out, host);
    AppendBulk(&out, "role");
    AppendBulk(&out, "master");
    AppendBulk(&out, "health");
    AppendBulk(&out, "online");
  } else if (sub == "nodes") {
    text(&out, absl::StrCat(id, " ", Node{std::string(host), port, ""}.ToString(), "@0 myself,master - 0 0 1 ",
                            "connected 0-16383\n"));
  } else if (sub == "info") {
    text(&out,
         "cluster_enabled:1\r\ncluster_state:ok\r\ncluster_slots_assigned:16384\r\ncluster_slots_ok:16384\r\n"
         "cluster_slots_pfail:0\r\ncluster_slots_fail:0\r\ncluster_known_nodes:1\r\ncluster_size:1\r\n"
         "cluster_current_epoch:1\r\ncluster_my_epoch:1\r\n");
  } else if (sub == "myid") {
    AppendBulk(&out, id);
  }
  return out;
}

}  // namespace keyguard::proxy::cluster
