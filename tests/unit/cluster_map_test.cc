// Redis Cluster, sans-io: key slots against values a Redis 7.0 server computed (CLUSTER KEYSLOT),
// the slot map of a captured CLUSTER SLOTS reply, redirections, the SCAN cursor and merges.
#include "proxy/cluster_map.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace keyguard::proxy::cluster {
namespace {

TEST(KeySlot, MatchesRedis) {
  // From redis-server 7.0's CLUSTER KEYSLOT.
  EXPECT_EQ(KeySlot("foo"), 12182);
  EXPECT_EQ(KeySlot("bar"), 5061);
  EXPECT_EQ(KeySlot("123456789"), 12739);
  EXPECT_EQ(KeySlot("user:1001:profile"), 2549);
  // Hash tags: the first '{' and the next '}', when something is between them.
  EXPECT_EQ(KeySlot("{bar"), 4015);
  EXPECT_EQ(KeySlot("foo{}{bar}"), 8363);  // an empty tag: the whole key
  EXPECT_EQ(KeySlot("{user1000}.following"), KeySlot("{user1000}.followers"));
  EXPECT_EQ(KeySlot("{user1000}.following"), KeySlot("user1000"));
  EXPECT_EQ(KeySlot("foo{bar}{zap}"), KeySlot("bar"));
  EXPECT_EQ(KeySlot("foo{{bar}}zap"), KeySlot("{bar"));
  EXPECT_EQ(KeySlot(""), 0);
}

// A three-primary cluster's CLUSTER SLOTS, as redis-server 7.0 sent it (ids shortened).
constexpr std::string_view kSlots =
    "*3\r\n*3\r\n:0\r\n:5460\r\n*4\r\n$9\r\n127.0.0.1\r\n:7101\r\n$2\r\nid\r\n*0\r\n"
    "*4\r\n:5461\r\n:10922\r\n*4\r\n$9\r\n127.0.0.1\r\n:7102\r\n$2\r\nid\r\n*0\r\n"
    "*4\r\n$9\r\n127.0.0.1\r\n:7105\r\n$2\r\nir\r\n*0\r\n"
    "*3\r\n:10923\r\n:16383\r\n*4\r\n$0\r\n\r\n:7103\r\n$2\r\nid\r\n*0\r\n";

TEST(SlotMap, ParsedFromClusterSlots) {
  auto m = ParseClusterSlots(kSlots, "10.0.0.9");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->primaries.size(), 3u);
  // In the order of their addresses.
  EXPECT_EQ(m->primaries[0].ToString(), "10.0.0.9:7103") << "an empty host is the host asked";
  EXPECT_EQ(m->primaries[1].ToString(), "127.0.0.1:7101");
  EXPECT_EQ(m->primaries[2].ToString(), "127.0.0.1:7102");
  ASSERT_EQ(m->replicas[2].size(), 1u);
  EXPECT_EQ(m->replicas[2][0].port, 7105);
  EXPECT_EQ(m->owner[0], 1);
  EXPECT_EQ(m->owner[5460], 1);
  EXPECT_EQ(m->owner[5461], 2);
  EXPECT_EQ(m->owner[16383], 0);
  EXPECT_TRUE(m->complete());
  auto again = ParseClusterSlots(kSlots, "10.0.0.9");
  EXPECT_TRUE(m->SameAs(*again));
  again->owner[100] = 2;
  EXPECT_FALSE(m->SameAs(*again));
  // A redirection is followed only to a primary the map has: not a replica, not an unknown address.
  EXPECT_EQ(m->PrimaryAt("127.0.0.1", 7102), std::optional<uint16_t>(2));
  EXPECT_EQ(m->PrimaryAt("127.0.0.1", 7105), std::nullopt) << "a replica";
  EXPECT_EQ(m->PrimaryAt("203.0.113.9", 7101), std::nullopt);
}

// CLUSTER SHARDS (RESP2) as redis-server 7.0 sent it: a primary just added (no slot yet), a
// shard with slots, and a slotless shard whose primary is failed (ids shortened).
std::string Shard(std::string_view slots, std::string_view port, std::string_view endpoint, std::string_view role,
                  std::string_view health) {
  auto bulk = [](std::string_view s) { return "$" + std::to_string(s.size()) + "\r\n" + std::string(s) + "\r\n"; };
  return "*4\r\n" + bulk("slots") + std::string(slots) + bulk("nodes") + "*1\r\n*14\r\n" + bulk("id") + bulk("n1") +
         bulk("port") + ":" + std::string(port) + "\r\n" + bulk("ip") + bulk("127.0.0.1") + bulk("endpoint") +
         bulk(endpoint) + bulk("role") + bulk(role) + bulk("replication-offset") + ":0\r\n" + bulk("health") +
         bulk(health);
}

TEST(SlotMap, SlotlessPrimariesOfClusterShards) {
  const std::string shards = "*4\r\n" + Shard("*0\r\n", "7104", "127.0.0.1", "master", "online") +
                             Shard("*2\r\n:1\r\n:3\r\n", "7101", "127.0.0.1", "master", "online") +
                             Shard("*0\r\n", "7106", "127.0.0.1", "master", "failed") +
                             Shard("*0\r\n", "7107", "?", "master", "online");
  const std::vector<Node> slotless = SlotlessPrimaries(shards, "10.0.0.9", /*tls=*/false);
  ASSERT_EQ(slotless.size(), 2u);
  EXPECT_EQ(slotless[0].ToString(), "127.0.0.1:7104");
  EXPECT_EQ(slotless[1].ToString(), "10.0.0.9:7107") << "an unknown endpoint is the host asked";
  EXPECT_TRUE(SlotlessPrimaries("-ERR unknown subcommand 'SHARDS'\r\n", "h", false).empty());
  // Kept apart, by address: known (a redirection to one is followed), in no fan-out or walk.
  auto m = ParseClusterSlots(kSlots, "10.0.0.9", slotless);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->primaries.size(), 3u);
  ASSERT_EQ(m->slotless.size(), 2u);
  EXPECT_EQ(m->slotless[0].ToString(), "10.0.0.9:7107");
  EXPECT_EQ(m->slotless[1].ToString(), "127.0.0.1:7104");
  EXPECT_EQ(m->PrimaryAt("127.0.0.1", 7104), std::nullopt);
  ASSERT_NE(m->SlotlessAt("127.0.0.1", 7104), nullptr);
  EXPECT_EQ(m->SlotlessAt("127.0.0.1", 7101), nullptr) << "a primary with slots";
  EXPECT_EQ(m->owner[0], 1);
  EXPECT_TRUE(m->complete());
  EXPECT_FALSE(m->SameAs(*ParseClusterSlots(kSlots, "10.0.0.9"))) << "a node added is a new map";
  EXPECT_TRUE(m->SameAs(*ParseClusterSlots(kSlots, "10.0.0.9", slotless)));
}

TEST(SlotMap, PrimariesInTheOrderOfTheirAddresses) {
  // The primaries' hosts, and the owner of `slot`, as parsed.
  auto parsed = [](std::string_view frame, size_t slot) {
    auto m = ParseClusterSlots(frame, "x");
    std::vector<std::string> hosts;
    if (!m.ok()) return std::make_pair(hosts, -1);
    for (const Node& n : m->primaries) hosts.push_back(n.host);
    return std::make_pair(hosts, static_cast<int>(m->owner[slot]));
  };
  const std::vector<std::string> ab = {"a", "b"};
  // The node of the high range listed first: still node 1 (the SCAN cursor's order is stable).
  EXPECT_EQ(parsed("*2\r\n*3\r\n:8192\r\n:16383\r\n*2\r\n$1\r\nb\r\n:2\r\n*3\r\n:0\r\n:8191\r\n*2\r\n$1\r\na\r\n:1\r\n",
                   8192),
            std::make_pair(ab, 1));
  // A reshard that gives b the first slots leaves the order as it was.
  constexpr std::string_view resharded =
      "*3\r\n*3\r\n:0\r\n:100\r\n*2\r\n$1\r\nb\r\n:2\r\n*3\r\n:101\r\n:8191\r\n*2\r\n$1\r\na\r\n:1\r\n"
      "*3\r\n:8192\r\n:16383\r\n*2\r\n$1\r\nb\r\n:2\r\n";
  EXPECT_EQ(parsed(resharded, 0), std::make_pair(ab, 1));
  EXPECT_EQ(parsed(resharded, 101), std::make_pair(ab, 0));
}

TEST(SlotMap, RefusesWhatIsNotAMap) {
  EXPECT_FALSE(ParseClusterSlots("-ERR This instance has cluster support disabled\r\n", "x").ok());
  EXPECT_FALSE(ParseClusterSlots("*0\r\n", "x").ok());
  EXPECT_FALSE(ParseClusterSlots("*1\r\n*3\r\n:0\r\n:99999\r\n*2\r\n$1\r\na\r\n:1\r\n", "x").ok());
  EXPECT_FALSE(ParseClusterSlots("*1\r\n", "x").ok());
  auto partial = ParseClusterSlots("*1\r\n*3\r\n:0\r\n:10\r\n*2\r\n$1\r\na\r\n:1\r\n", "x");
  ASSERT_TRUE(partial.ok());
  EXPECT_FALSE(partial->complete());
  EXPECT_EQ(partial->owner[11], SlotMap::kNoOwner);
}

TEST(Redirect, MovedAndAsk) {
  auto m = ParseRedirect("MOVED 3999 127.0.0.1:6381");
  ASSERT_TRUE(m.has_value());
  EXPECT_FALSE(m->ask);
  EXPECT_EQ(m->slot, 3999);
  EXPECT_EQ(m->host, "127.0.0.1");
  EXPECT_EQ(m->port, 6381);
  auto a = ParseRedirect("ASK 1 [::1]:7000");
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->ask);
  EXPECT_EQ(a->host, "::1");
  EXPECT_FALSE(ParseRedirect("ERR wrong number of arguments").has_value());
  EXPECT_FALSE(ParseRedirect("MOVED 16384 h:1").has_value());
  EXPECT_FALSE(ParseRedirect("MOVED 1 nohost").has_value());
}

TEST(ScanCursor, WalksEveryNodeAndSurvivesIntegerClients) {
  auto start = DecodeScanCursor("0");
  ASSERT_TRUE(start.has_value());
  EXPECT_EQ(start->node, 0);
  EXPECT_EQ(start->node_cursor, "0");
  // Node 0 is not done: its cursor, on node 0.
  EXPECT_EQ(EncodeScanCursor("17", 0, 3), "17");
  // Node 0 is done: node 1 from its start; node 2 done: the end.
  const std::string next = EncodeScanCursor("0", 0, 3);
  EXPECT_NE(next, "0");
  auto d = DecodeScanCursor(next);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->node, 1);
  EXPECT_EQ(d->node_cursor, "0");
  EXPECT_EQ(EncodeScanCursor("0", 2, 3), "0");
  auto mid = DecodeScanCursor(EncodeScanCursor("12345", 2, 3));
  EXPECT_EQ(mid->node, 2);
  EXPECT_EQ(mid->node_cursor, "12345");
  EXPECT_FALSE(DecodeScanCursor("abc").has_value());
  EXPECT_FALSE(DecodeScanCursor("-1").has_value());
}

TEST(Merge, RepliesOfEveryNode) {
  const std::vector<std::string> sizes = {":3\r\n", ":0\r\n", ":4\r\n"};
  EXPECT_EQ(MergeReplies(Merge::kSum, sizes), ":7\r\n");
  const std::vector<std::string> keys = {"*1\r\n$1\r\na\r\n", "*0\r\n", "*2\r\n$1\r\nb\r\n$2\r\ncc\r\n"};
  EXPECT_EQ(MergeReplies(Merge::kConcat, keys), "*3\r\n$1\r\na\r\n$1\r\nb\r\n$2\r\ncc\r\n");
  const std::vector<std::string> oks = {"+OK\r\n", "-ERR boom\r\n", "+OK\r\n"};
  EXPECT_EQ(MergeReplies(Merge::kAllOk, oks), "-ERR boom\r\n");
  const std::vector<std::string> random = {"$-1\r\n", "$1\r\nk\r\n"};
  EXPECT_EQ(MergeReplies(Merge::kRandom, random), "$1\r\nk\r\n");
  const std::vector<std::string> exists = {"*2\r\n:1\r\n:1\r\n", "*2\r\n:1\r\n:0\r\n"};
  EXPECT_EQ(MergeReplies(Merge::kAllOf, exists), "*2\r\n:1\r\n:0\r\n");
}

TEST(Merge, ScanReplyGetsTheClientsCursor) {
  EXPECT_EQ(RewriteScanReply("*2\r\n$1\r\n0\r\n*1\r\n$1\r\nk\r\n", 2, 3), "*2\r\n$1\r\n0\r\n*1\r\n$1\r\nk\r\n");
  const std::string r = RewriteScanReply("*2\r\n$1\r\n0\r\n*1\r\n$1\r\nk\r\n", 0, 3);
  EXPECT_EQ(r, "*2\r\n$" + std::to_string(EncodeScanCursor("0", 0, 3).size()) + "\r\n" + EncodeScanCursor("0", 0, 3) +
                   "\r\n*1\r\n$1\r\nk\r\n");
}

TEST(LocalReplies, OneNodeOwningEverySlot) {
  const std::string slots = LocalClusterReply("slots", "127.0.0.1", 7200);
  auto m = ParseClusterSlots(slots, "x");
  ASSERT_TRUE(m.ok()) << slots;
  ASSERT_EQ(m->primaries.size(), 1u);
  EXPECT_EQ(m->primaries[0].ToString(), "127.0.0.1:7200");
  EXPECT_TRUE(m->complete());
  EXPECT_NE(LocalClusterReply("info", "127.0.0.1", 7200).find("cluster_state:ok\r\n"), std::string::npos);
  EXPECT_NE(
      LocalClusterReply("nodes", "127.0.0.1", 7200).find(" 127.0.0.1:7200@0 myself,master - 0 0 1 connected 0-16383\n"),
      std::string::npos);
  EXPECT_EQ(LocalClusterReply("myid", "127.0.0.1", 7200).size(), 47u);  // $40\r\n + 40 + \r\n
  EXPECT_EQ(LocalClusterReply("failover", "127.0.0.1", 7200), "");
}

TEST(LocalReplies, Resp3AsTheServerAnswersARESP3Client) {
  // NODES and INFO: verbatim text; SHARDS: maps (the same pairs); SLOTS and MYID as in RESP2.
  const std::string nodes = LocalClusterReply("nodes", "127.0.0.1", 7200, 3);
  const std::string body = LocalClusterReply("nodes", "127.0.0.1", 7200).substr(5);  // past $NN\r\n
  EXPECT_EQ(nodes, "=" + std::to_string(body.size() - 2 + 4) + "\r\ntxt:" + body);
  const std::string info = LocalClusterReply("info", "127.0.0.1", 7200).substr(6);  // past $NNN\r\n
  EXPECT_EQ(LocalClusterReply("info", "127.0.0.1", 7200, 3),
            "=" + std::to_string(info.size() - 2 + 4) + "\r\ntxt:" + info);
  const std::string shards = LocalClusterReply("shards", "127.0.0.1", 7200, 3);
  EXPECT_TRUE(
      shards.starts_with("*1\r\n%2\r\n$5\r\nslots\r\n*2\r\n:0\r\n:16383\r\n$5\r\nnodes\r\n*1\r\n%6\r\n$2\r\nid\r\n"))
      << shards;
  const std::string shards2 = LocalClusterReply("shards", "127.0.0.1", 7200);
  EXPECT_EQ(shards.substr(shards.find("$2\r\nid")), shards2.substr(shards2.find("$2\r\nid")));
  EXPECT_EQ(LocalClusterReply("slots", "127.0.0.1", 7200, 3), LocalClusterReply("slots", "127.0.0.1", 7200));
}

TEST(Merge, MgetNullsInTheClientsProtocol) {
  const std::vector<std::string> parts = {"*2\r\n$1\r\na\r\n_\r\n", "*1\r\n$-1\r\n"};
  const std::vector<std::vector<uint32_t>> positions = {{0, 2}, {1}};
  EXPECT_EQ(MergeMget(parts, positions, 3), "*3\r\n$1\r\na\r\n$-1\r\n$-1\r\n");
  EXPECT_EQ(MergeMget(parts, positions, 3, /*resp3=*/true), "*3\r\n$1\r\na\r\n_\r\n_\r\n");
}

}  // namespace
}  // namespace keyguard::proxy::cluster
