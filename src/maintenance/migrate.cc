// `keyguard migrate`: the three steps of a safe rename or re-shape of existing keys (copy, verify,
// cleanup), each idempotent, resumable from a SCAN cursor, rate-limited and with --dry-run.
//
// No step trusts what it read a round trip earlier. Every decision about one key is taken by one
// server-side script (kKeyScript) that runs atomically: it checks that the old key still holds
// what keyguard read (for a re-shape, the JSON text the new fields were computed from), compares
// the new key(s) with the old one, and only then copies, refreshes or deletes. So copy never
// writes a Hash from a value the app has since changed, and cleanup never deletes an old key that
// does not match its new key at that instant.
//
// A Redis Cluster: each primary's keys in turn, each key's commands sent to the primary that owns
// its slot. An old key whose new keys share its slot (a hash tag) gets the same atomic script. One
// whose new keys live elsewhere cannot: its decision is taken in steps, each atomic on one node
// (kPartScript), and copy and cleanup act only on what the last step proves:
//   read     the old key: type, expiry, a digest of its content and its DUMP (one script);
//   compare  each new key on its own node with what was read;
//   write    (copy) each new key, only where it is still absent (or, --refresh, differs);
//   check    on the old key's node, that it still holds what was read, and for cleanup UNLINK it
//            in the same script. A copy whose old key changed since the read is undone: each
//            written key is deleted where it still holds what keyguard wrote, and read again.
// So cleanup deletes an old key only when, at the moment of the delete, it holds exactly what its
// new keys held a moment before (a later change of the new keys is the app's own write); and copy
// leaves no new key computed from a value the app had changed by the time the copy was checked.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "keyguard/maintenance/maintenance.h"
#include "maintenance/args.h"
#include "maintenance/json_fields.h"
#include "maintenance/redis_link.h"
#include "maintenance/settings.h"
#include "maintenance/terminal.h"
#include "proxy/cluster_map.h"

namespace keyguard::maintenance {
namespace {

int Fail(const std::string& message) { return UsageError("keyguard migrate", message); }

// Lua shared by both scripts. digest: SHA1 of a key's content (Hash fields and Set members
// sorted; lists and sorted sets in order; other types by DUMP), not of DUMP's bytes, for a key
// compared with one on another node: a hash-table encoded value serializes in its table's order,
// which a RESTORE on another node does not keep. False for a collection of more than 50,000
// items: sorting it in Lua would hold the server for seconds. same: whether keys a and b of type t
// on one node hold the same content: DUMP's bytes, else (a COPY of a hash table) a Set by
// SINTERCARD, a Hash field by field over HSCAN, in O(n) without materializing it. differs: the
// first way key (of type t) differs from the kind and items at ARGV[a] (`hash` or `string`, the
// number of items, then field, value, ... or the text), or nil. write: writes them (after the
// caller removed any old value), and the expiry `at` when there is one.
constexpr char kLuaHelpers[] = R"lua(
local function digest(key, t)
  local items
  if t == 'string' then return redis.sha1hex(redis.call('GET', key))
  elseif t == 'list' then
    if redis.call('LLEN', key) > 50000 then return false end
    items = redis.call('LRANGE', key, 0, -1)
  elseif t == 'set' then
    if redis.call('SCARD', key) > 50000 then return false end
    items = redis.call('SMEMBERS', key)
    table.sort(items)
  elseif t == 'zset' then
    if redis.call('ZCARD', key) > 50000 then return false end
    items = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  elseif t == 'hash' then
    if redis.call('HLEN', key) > 50000 then return false end
    local all, value, names = redis.call('HGETALL', key), {}, {}
    for i = 1, #all, 2 do
      names[#names + 1] = all[i]
      value[all[i]] = all[i + 1]
    end
    table.sort(names)
    items = {}
    for _, f in ipairs(names) do
      items[#items + 1] = f
      items[#items + 1] = value[f]
    end
  else return redis.sha1hex(redis.call('DUMP', key)) end
  local parts = {}
  for i, v in ipairs(items) do parts[i] = #v .. ':' .. v end
  return redis.sha1hex(t .. '|' .. table.concat(parts, ','))
end
local function same(a, b, t)
  if redis.call('DUMP', a) == redis.call('DUMP', b) then return true end
  if t == 'set' then
    local n = redis.call('SCARD', a)
    return n == redis.call('SCARD', b) and redis.call('SINTERCARD', 2, a, b) == n
  end
  if t ~= 'hash' or redis.call('HLEN', a) ~= redis.call('HLEN', b) then return false end
  local cursor = '0'
  repeat
    local page = redis.call('HSCAN', a, cursor, 'COUNT', 1000)
    cursor = page[1]
    for i = 1, #page[2], 2 do
      if redis.call('HGET', b, page[2][i]) ~= page[2][i + 1] then return false end
    end
  until cursor == '0'
  return true
end
local function differs(key, t, a)
  local kind, n = ARGV[a], tonumber(ARGV[a + 1])
  if t == 'none' then return 'missing' end
  if t ~= kind then return 'a ' .. t .. ', not a ' .. kind end
  if kind == 'string' then
    if redis.call('GET', key) ~= ARGV[a + 2] then return 'value differs' end
    return nil
  end
  for j = a + 2, a + 1 + n, 2 do
    local v = redis.call('HGET', key, ARGV[j])
    if not v then return "field '" .. ARGV[j] .. "' missing" end
    if v ~= ARGV[j + 1] then return "field '" .. ARGV[j] .. "' differs" end
  end
  if redis.call('HLEN', key) ~= n / 2 then
    local want = {}
    for j = a + 2, a + 1 + n, 2 do want[ARGV[j]] = true end
    for _, f in ipairs(redis.call('HKEYS', key)) do
      if not want[f] then return "extra field '" .. f .. "'" end
    end
  end
  return nil
end
local function write(key, a, at)
  local n = tonumber(ARGV[a + 1])
  if ARGV[a] == 'hash' then
    for j = a + 2, a + 1 + n, 1000 do redis.call('HSET', key, unpack(ARGV, j, math.min(j + 999, a + 1 + n))) end
  else
    redis.call('SET', key, ARGV[a + 2])
  end
  if at > 0 then redis.call('PEXPIREAT', key, at) end
end
)lua";

// One key's decision, atomically. KEYS: the old key, the new key, then the new key's nested keys.
// ARGV[1]: mode: verify (read only), copy (write when no new key exists), refresh (also rewrite
// new keys that differ), cleanup (UNLINK the old key when its new keys match it), supersede (also
// when its new key exists but differs: after the switch-over the new keys are the truth).
// ARGV[2]: how old and new compare: `dump` (same type, content and expiry; COPY to write) or `json`
// (ARGV[3] is the old key's JSON text as keyguard read it; then per new key its kind, `hash` or
// `string`, the number of items and the items: field, value, ... or the text).
// The new keys match when each has the kind and exactly the items, and the old key's expiry
// (PEXPIRETIME: copy writes it with PEXPIREAT, so equal means equal).
// Returns {status, detail}: gone (no old key), changed (the old key no longer holds ARGV[3]),
// same, missing (no new key exists), differs (detail: the first difference); after a write
// copied or refreshed, after a delete unlinked or superseded, and copy's stale (differs, not
// refreshed).
constexpr char kKeyScript[] = R"lua(
local mode, how = ARGV[1], ARGV[2]
local src, dst = KEYS[1], KEYS[2]
local stype = redis.call('TYPE', src).ok
if stype == 'none' then return {'gone', ''} end
local at = redis.call('PEXPIRETIME', src)
local exists = 0
for k = 2, #KEYS do exists = exists + redis.call('EXISTS', KEYS[k]) end
local status, detail = 'same', ''
if how == 'dump' then
  local dtype = redis.call('TYPE', dst).ok
  if exists == 0 then status = 'missing'
  elseif dtype ~= stype then status, detail = 'differs', 'a ' .. dtype .. ', not a ' .. stype
  elseif not same(src, dst, stype) then status, detail = 'differs', 'value differs'
  elseif redis.call('PEXPIRETIME', dst) ~= at then status, detail = 'differs', 'expiry differs' end
else
  if stype ~= 'string' or redis.call('GET', src) ~= ARGV[3] then return {'changed', ''} end
  if exists == 0 then status = 'missing' else
    local a = 4
    for k = 2, #KEYS do
      local key, n = KEYS[k], tonumber(ARGV[a + 1])
      local d = differs(key, redis.call('TYPE', key).ok, a)
      if not d and redis.call('PEXPIRETIME', key) ~= at then d = 'expiry differs' end
      if d then
        status, detail = 'differs', (k == 2 and d or key .. ': ' .. d)
        break
      end
      a = a + 2 + n
    end
  end
end
if mode == 'verify' or status == 'same' and mode ~= 'cleanup' then return {status, detail} end
if mode == 'cleanup' or mode == 'supersede' then
  if status == 'same' then
    redis.call('UNLINK', src)
    return {'unlinked', ''}
  end
  if mode == 'supersede' and status == 'differs' and redis.call('EXISTS', dst) == 1 then
    redis.call('UNLINK', src)
    return {'superseded', detail}
  end
  return {status, detail}
end
if status == 'differs' and mode ~= 'refresh' then return {'stale', detail} end
if how == 'dump' then
  if status == 'missing' then redis.call('COPY', src, dst) else redis.call('COPY', src, dst, 'REPLACE') end
else
  if status ~= 'missing' then redis.call('UNLINK', unpack(KEYS, 2)) end
  local a = 4
  for k = 2, #KEYS do
    write(KEYS[k], a, at)
    a = a + 2 + tonumber(ARGV[a + 1])
  end
end
return {status == 'missing' and 'copied' or 'refreshed', detail}
)lua";

// One step of a decision whose keys are on different nodes (a cluster, keys in different slots).
// ARGV[1] is the step:
// `read` KEYS[1] the old key: {type, PEXPIRETIME, digest ('' past 50,000 items), DUMP (when ARGV[2]
//   is '1': copy writes it), its text when a string}.
// `check` KEYS[1] the old key; ARGV[2] the digest read, ARGV[3] the expiry read, ARGV[4] '1' to
//   UNLINK it: {gone|changed|same|unlinked, ''}.
// `compare`, `create`, `replace`, `undo` KEYS[1] one new key; ARGV[2] the expiry it should have;
//   ARGV[3] its kind: `dump` (ARGV[4] the old key's type, ARGV[5] its digest, ARGV[6] its DUMP),
//   `hash` (ARGV[4] the number of items, then field, value, ...) or `string` (ARGV[4] 1, ARGV[5]
//   the text). compare: {same|differs, detail} (detail `missing` for no key); create writes only
//   an absent key ({written} or {raced, ''}); replace writes one that differs ({written} or
//   {same}); undo deletes it only while it is exactly that ({undone} or {kept, detail}).
constexpr char kPartScript[] = R"lua(
local op, key = ARGV[1], KEYS[1]
local t = redis.call('TYPE', key).ok
if op == 'read' then
  if t == 'none' then return {t, -2, '', '', ''} end
  return {t, redis.call('PEXPIRETIME', key), digest(key, t) or '', ARGV[2] == '1' and redis.call('DUMP', key) or '',
          t == 'string' and redis.call('GET', key) or ''}
end
if op == 'check' then
  if t == 'none' then return {'gone', ''} end
  if digest(key, t) ~= ARGV[2] or redis.call('PEXPIRETIME', key) ~= tonumber(ARGV[3]) then return {'changed', ''} end
  if ARGV[4] == '1' then
    redis.call('UNLINK', key)
    return {'unlinked', ''}
  end
  return {'same', ''}
end
local at, d = tonumber(ARGV[2])
if ARGV[3] ~= 'dump' then d = differs(key, t, 3)
elseif t == 'none' then d = 'missing'
elseif t ~= ARGV[4] then d = 'a ' .. t .. ', not a ' .. ARGV[4]
elseif digest(key, t) ~= ARGV[5] then d = 'value differs' end
if not d and redis.call('PEXPIRETIME', key) ~= at then d = 'expiry differs' end
if op == 'compare' then return d and {'differs', d} or {'same', ''} end
if op == 'undo' then
  if d then return {'kept', d} end
  redis.call('UNLINK', key)
  return {'undone', ''}
end
if op == 'create' and t ~= 'none' then return {'raced', d or ''} end
if not d then return {'same', ''} end
if t ~= 'none' then redis.call('UNLINK', key) end
if ARGV[3] == 'dump' then
  redis.call('RESTORE', key, at > 0 and at or 0, ARGV[6], 'ABSTTL')
else
  write(key, 3, at)
end
return {'written', ''}
)lua";

// How many times one batch re-reads keys whose value changed between the read and the script.
constexpr int kAttempts = 3;
// Routine lines (would copy, would unlink, skipped) shown per kind without --verbose.
constexpr uint64_t kSamples = 10;

struct Pair {
  std::string old_key, new_key;
};

// One key ready for kKeyScript, or for kPartScript's steps when its keys are on different nodes.
struct Item {
  const Pair* pair;
  bool dump = false;     // compare and copy by DUMP/COPY (keep_type, or an unconvertible value copied unchanged)
  std::string source{};  // json: the old value as read
  HashShape shape{};     // json: the new keys
  // A cluster: what `read` gave (the old key's type, expiry, content digest and DUMP), and
  // whether a new key is in another slot than the old one.
  bool apart = false;
  std::string type{}, digest{}, dumped{};
  int64_t at = -1;
  // The new keys: the new name, then the separate nested keys.
  std::vector<std::string> NewKeys() const {
    std::vector<std::string> keys = {pair->new_key};
    for (const auto& sub : shape.subkeys) keys.push_back(absl::StrCat(pair->new_key, ":", sub.suffix));
    return keys;
  }
};

// A command for one node: an index into Servers.
struct Routed {
  size_t node;
  Command command;
};

// An error reply that says a slot is elsewhere or moving: the command did not run; run it again
// after learning the map again.
bool Redirected(const Reply& r) {
  return r.is_error() && (absl::StartsWith(r.str, "MOVED ") || absl::StartsWith(r.str, "ASK ") ||
                          absl::StartsWith(r.str, "TRYAGAIN") || absl::StartsWith(r.str, "CLUSTERDOWN"));
}

// Where a step's commands go: one server, or a Redis Cluster's primaries, each key to the one
// that owns its slot (by CLUSTER SLOTS, asked again after a redirection). Loads the scripts on
// each node before its first command and again after NOSCRIPT (a flush, a restart, a failover).
class Servers {
 public:
  static constexpr size_t kNowhere = SIZE_MAX;

  // One server (a direct upstream or a Sentinel group's primary).
  static absl::StatusOr<Servers> One(UpstreamLinks& upstream, int db) {
    auto link = upstream.Connect(db);
    if (!link.ok()) return link.status();
    Servers s(upstream, false);
    s.links_.push_back(*std::move(link));
    s.addresses_.push_back(s.links_[0]->address());
    s.walk_ = {0};
    return s;
  }
  // A cluster: every primary, walked in the order of their addresses.
  static absl::StatusOr<Servers> Cluster(UpstreamLinks& upstream) {
    Servers s(upstream, true);
    if (auto st = s.Refresh(); !st.ok()) return st;
    for (size_t i = 0; i < s.links_.size(); ++i) {
      if (auto st = s.Open(i); !st.ok()) return st;
      s.walk_.push_back(i);
    }
    return s;
  }

  bool cluster() const { return cluster_; }
  // The nodes whose keys are walked (SCAN), in order.
  size_t walk_size() const { return walk_.size(); }
  size_t walk(size_t i) const { return walk_[i]; }
  // The node of `key`'s slot; kNowhere while its slot has no primary.
  size_t NodeOf(std::string_view key) const { return cluster_ ? slot_node_[proxy::cluster::KeySlot(key)] : 0; }
  // The slot map again (after a redirection); new primaries are connected at their first command.
  absl::Status Refresh() {
    auto layout = upstream_.ClusterSlots();
    if (!layout.ok()) return layout.status();
    std::vector<size_t> index(layout->primaries.size());
    for (size_t i = 0; i < layout->primaries.size(); ++i) {
      const std::string address = layout->primaries[i].ToString();
      const auto at = std::find(addresses_.begin(), addresses_.end(), address);
      index[i] = static_cast<size_t>(at - addresses_.begin());
      if (at == addresses_.end()) {
        addresses_.push_back(address);
        hosts_.push_back(layout->primaries[i]);
        links_.emplace_back();
      }
    }
    slot_node_.assign(proxy::cluster::kSlots, kNowhere);
    for (size_t slot = 0; slot < slot_node_.size(); ++slot) {
      if (layout->owner[slot] != ClusterLayout::kNoOwner) slot_node_[slot] = index[layout->owner[slot]];
    }
    return absl::OkStatus();
  }
  // Loads `script` on every node (now, and on nodes connected later); returns its SHA1.
  absl::StatusOr<std::string> AddScript(std::string script) {
    scripts_.push_back(std::move(script));
    std::string sha;
    for (size_t i = 0; i < links_.size(); ++i) {
      if (!links_[i]) continue;
      auto r = LoadScripts(i, scripts_.size() - 1);
      if (!r.ok()) return r.status();
      sha = *r;
    }
    shas_.push_back(sha);
    return sha;
  }
  // Runs `commands`, one pipeline per node; the replies in the order of `commands`. A Redis error
  // is a reply; a node that cannot be reached is an error.
  absl::StatusOr<std::vector<Reply>> Run(const std::vector<Routed>& commands) {
    std::vector<Reply> replies(commands.size());
    std::vector<std::vector<size_t>> by_node(links_.size());
    for (size_t i = 0; i < commands.size(); ++i) by_node[commands[i].node].push_back(i);
    for (size_t node = 0; node < by_node.size(); ++node) {
      if (by_node[node].empty()) continue;
      if (!links_[node]) {
        if (auto st = Open(node); !st.ok()) return st;
      }
      std::vector<Command> batch;
      for (size_t i : by_node[node]) batch.push_back(commands[i].command);
      auto r = links_[node]->Pipeline(batch);
      if (!r.ok()) return r.status();
      std::vector<size_t> again;
      for (size_t j = 0; j < r->size(); ++j) {
        if ((*r)[j].is_error() && absl::StartsWith((*r)[j].str, "NOSCRIPT")) again.push_back(j);
      }
      if (!again.empty()) {
        for (size_t k = 0; k < scripts_.size(); ++k) {
          if (auto l = LoadScripts(node, k); !l.ok()) return l.status();
        }
        std::vector<Command> retry;
        for (size_t j : again) retry.push_back(batch[j]);
        auto rr = links_[node]->Pipeline(retry);
        if (!rr.ok()) return rr.status();
        for (size_t j = 0; j < again.size(); ++j) (*r)[again[j]] = std::move((*rr)[j]);
      }
      for (size_t j = 0; j < r->size(); ++j) replies[by_node[node][j]] = std::move((*r)[j]);
    }
    return replies;
  }
  RedisLink& link(size_t node) { return *links_[node]; }
  // The primaries the walk numbers (a cluster), in the order it walks them.
  std::vector<config::HostPort> walked() const {
    std::vector<config::HostPort> out;
    for (size_t i : walk_) out.push_back(hosts_[i]);
    return out;
  }

 private:
  Servers(UpstreamLinks& upstream, bool cluster) : upstream_(upstream), cluster_(cluster) {}
  absl::Status Open(size_t node) {
    auto link = upstream_.ConnectNode(hosts_[node], 0);
    if (!link.ok()) return link.status();
    links_[node] = *std::move(link);
    for (size_t k = 0; k < scripts_.size(); ++k) {
      if (auto r = LoadScripts(node, k); !r.ok()) return r.status();
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> LoadScripts(size_t node, size_t k) {
    auto r = links_[node]->Call({"SCRIPT", "LOAD", scripts_[k]});
    if (!r.ok()) return r.status();
    if (r->is_error()) {
      return absl::FailedPreconditionError(absl::StrCat(addresses_[node], ": SCRIPT LOAD: ", r->str));
    }
    return r->str;
  }

  UpstreamLinks& upstream_;
  bool cluster_;
  std::vector<std::unique_ptr<RedisLink>> links_;  // by node; null until its first command
  std::vector<std::string> addresses_;             // by node, "host:port"
  std::vector<config::HostPort> hosts_;            // by node (a cluster)
  std::vector<size_t> walk_;
  std::vector<size_t> slot_node_;  // a cluster: each slot's node, or kNowhere
  std::vector<std::string> scripts_;
  std::vector<std::string> shas_;
};

enum class StepKind { kCopy, kVerify, kCleanup };

struct Step {
  StepKind kind;
  const Migration& m;
  Servers& servers;
  Pacer& pacer;
  bool dry_run;
  bool refresh;
  bool supersede;  // cleanup --new-keys-win
  bool verbose;
  std::string sha{};       // kKeyScript's SHA1 on the servers
  std::string part_sha{};  // kPartScript's
  std::map<std::string, uint64_t> counts{};
  bool failed = false;  // something needs the operator: exit 1
  bool moved = false;   // a cluster redirected a command: learn the map again

  absl::StatusOr<std::vector<Reply>> Run(const std::vector<Routed>& cmds) {
    if (cmds.empty()) return std::vector<Reply>();
    pacer.Before(cmds.size());
    return servers.Run(cmds);
  }
  // kPartScript's `op` on `key`, with `args`.
  Routed Part(std::string_view op, const std::string& key, std::vector<std::string> args = {}) const {
    Command c = {"EVALSHA", part_sha, "1", key, std::string(op)};
    for (std::string& a : args) c.push_back(std::move(a));
    return Routed{servers.NodeOf(key), std::move(c)};
  }

  // Counts `what` and shows `line`: a routine line with --verbose or as one of the first kSamples
  // of its kind in a dry run; a listed one always; an attention one always, and it fails the step.
  enum Level { kRoutine, kListed, kAttention };
  void Record(const std::string& what, const std::string& line, Level level) {
    const uint64_t n = ++counts[what];
    if (level == kAttention) failed = true;
    if (line.empty()) return;
    if (level != kRoutine || verbose || (dry_run && n <= kSamples)) {
      std::printf("%s\n", line.c_str());
    }
  }

  absl::Status LoadScripts() {
    auto key = servers.AddScript(absl::StrCat(kLuaHelpers, kKeyScript));
    if (!key.ok()) return key.status();
    sha = *key;
    if (servers.cluster()) {
      auto part = servers.AddScript(absl::StrCat(kLuaHelpers, kPartScript));
      if (!part.ok()) return part.status();
      part_sha = *part;
    }
    return absl::OkStatus();
  }
};

std::string Arrow(const Pair& p) { return absl::StrCat(Printable(p.old_key), " -> ", Printable(p.new_key)); }

// Whether `item`'s new keys are not all in its old key's slot (a cluster).
bool Apart(const Step& st, const Item& item) {
  if (!st.servers.cluster()) return false;
  const uint16_t slot = proxy::cluster::KeySlot(item.pair->old_key);
  for (const std::string& k : item.NewKeys()) {
    if (proxy::cluster::KeySlot(k) != slot) return true;
  }
  return false;
}

// A value moved to another node whose content read could not digest (a collection past 50,000
// items): listed, and left where it is.
bool TooBig(Step& st, const Item& item) {
  if (!item.apart || !item.digest.empty()) return false;
  st.Record("too_big",
            absl::StrCat("too big ", Arrow(*item.pair),
                         ": a collection of more than 50000 items, to be compared with its copy on another node (move "
                         "it yourself, or give both names one hash tag: one slot)"),
            Step::kAttention);
  return true;
}

// Reads the old values (json_to_hash; every key of a cluster, with kPartScript's `read`) and turns
// each key into an Item, or records why it has none. `moved`: keys whose read was redirected.
absl::StatusOr<std::vector<Item>> Prepare(Step& st, const std::vector<const Pair*>& pairs,
                                          std::vector<const Pair*>* moved) {
  std::vector<Item> items;
  const bool cluster = st.servers.cluster();
  if (!st.m.json_to_hash && !cluster) {
    for (const Pair* p : pairs) items.push_back(Item{.pair = p, .dump = true});
    return items;
  }
  std::vector<Routed> reads;
  for (const Pair* p : pairs) {
    if (cluster) {
      reads.push_back(st.Part("read", p->old_key, {st.kind == StepKind::kCopy && !st.dry_run ? "1" : "0"}));
    } else {
      reads.push_back(Routed{0, {"TYPE", p->old_key}});
      reads.push_back(Routed{0, {"GET", p->old_key}});
    }
  }
  for (const Routed& r : reads) {
    if (r.node == Servers::kNowhere) {
      st.moved = true;
      *moved = pairs;  // a slot without a primary: learn the map again first
      return items;
    }
  }
  auto r = st.Run(reads);
  if (!r.ok()) return r.status();
  for (size_t i = 0; i < pairs.size(); ++i) {
    const Pair& p = *pairs[i];
    Item item{.pair = &p, .dump = !st.m.json_to_hash};
    if (cluster) {
      Reply& x = (*r)[i];
      if (Redirected(x)) {
        st.moved = true;
        moved->push_back(&p);
        continue;
      }
      if (x.is_error() || x.elements.size() != 5) {
        st.Record("failed",
                  absl::StrCat("failed ", Arrow(p), ": ", Printable(x.is_error() ? x.str : "unexpected reply")),
                  Step::kAttention);
        continue;
      }
      item.type = x.elements[0].str;
      item.at = x.elements[1].integer;
      item.digest = std::move(x.elements[2].str);
      item.dumped = std::move(x.elements[3].str);
      item.source = std::move(x.elements[4].str);
    } else {
      item.type = (*r)[2 * i].str;
      item.source = std::move((*r)[2 * i + 1].str);
    }
    if (item.type == "none") {
      st.Record("gone", "", Step::kRoutine);
      continue;
    }
    if (item.dump) {
      item.source.clear();
      item.apart = Apart(st, item);
      if (TooBig(st, item)) continue;
      items.push_back(std::move(item));
      continue;
    }
    ShapeError why;
    if (item.type != "string") {
      why = ShapeError{"wrong_type", absl::StrCat("a ", item.type, ", not a string")};
    } else {
      if (auto shape = JsonToHash(item.source, st.m.separate_nested, &why)) {
        item.shape = *std::move(shape);
        item.apart = Apart(st, item);
        items.push_back(std::move(item));
        continue;
      }
    }
    switch (st.m.unconvertible) {
      case Migration::Unconvertible::kCopyUnchanged:
        item.dump = true;
        item.source.clear();
        item.apart = Apart(st, item);
        if (TooBig(st, item)) break;
        items.push_back(std::move(item));
        break;
      case Migration::Unconvertible::kSkip:
        st.Record(absl::StrCat("skipped.", why.reason), absl::StrCat("skipped ", Printable(p.old_key), ": ", why.text),
                  Step::kRoutine);
        break;
      case Migration::Unconvertible::kFail:
        st.Record(absl::StrCat("unconvertible.", why.reason),
                  absl::StrCat("unconvertible ", Printable(p.old_key), ": ", why.text,
                               " (migrations[].unconvertible: skip or copy_unchanged decides what becomes of it)"),
                  Step::kAttention);
        break;
    }
  }
  return items;
}

Command ScriptCall(const Step& st, const Item& item, const char* mode) {
  const Pair& p = *item.pair;
  const bool read_only = std::string_view(mode) == "verify";
  Command c = {read_only ? "EVALSHA_RO" : "EVALSHA", st.sha, absl::StrCat(2 + item.shape.subkeys.size()), p.old_key};
  for (std::string& k : item.NewKeys()) c.push_back(std::move(k));
  c.push_back(mode);
  if (item.dump) {
    c.push_back("dump");
    return c;
  }
  c.insert(c.end(), {"json", item.source});
  auto add_fields = [&c](const Fields& fields) {
    c.insert(c.end(), {"hash", absl::StrCat(2 * fields.size())});
    for (const auto& [f, v] : fields) c.insert(c.end(), {f, v});
  };
  add_fields(item.shape.fields);
  for (const auto& sub : item.shape.subkeys) {
    if (sub.hash) {
      add_fields(sub.fields);
    } else {
      c.insert(c.end(), {"string", "1", sub.text});
    }
  }
  return c;
}

// What the step makes of one script result.
void Judge(Step& st, const Item& item, const std::string& status, const std::string& detail) {
  const Pair& p = *item.pair;
  const std::string diff = detail.empty() ? "" : absl::StrCat(": ", Printable(detail));
  if (status == "gone") return st.Record("gone", "", Step::kRoutine);
  switch (st.kind) {
    case StepKind::kCopy:
      if (status == "same") return st.Record("up_to_date", "", Step::kRoutine);
      if (status == "copied" || (st.dry_run && status == "missing")) {
        return st.Record(st.dry_run ? "would_copy" : "copied",
                         absl::StrCat(st.dry_run ? "would copy " : "copied ", Arrow(p)), Step::kRoutine);
      }
      if (status == "refreshed" || (st.dry_run && st.refresh && status == "differs")) {
        return st.Record(st.dry_run ? "would_refresh" : "refreshed",
                         absl::StrCat(st.dry_run ? "would refresh " : "refreshed ", Arrow(p), diff), Step::kRoutine);
      }
      if (status == "stale" || status == "differs") {
        return st.Record("stale",
                         absl::StrCat("stale ", Arrow(p), diff, " (copy --refresh rewrites it from the old key)"),
                         Step::kAttention);
      }
      break;
    case StepKind::kVerify:
      if (status == "same") return st.Record("same", absl::StrCat("same ", Arrow(p)), Step::kRoutine);
      if (status == "missing") return st.Record("missing", absl::StrCat("missing ", Arrow(p)), Step::kAttention);
      if (status == "differs") return st.Record("differ", absl::StrCat("differs ", Arrow(p), diff), Step::kAttention);
      break;
    case StepKind::kCleanup:
      if (status == "superseded" || (st.dry_run && st.supersede && status == "differs" && detail != "missing")) {
        return st.Record(
            st.dry_run ? "would_supersede" : "superseded",
            absl::StrCat(st.dry_run ? "would unlink " : "unlinked ", Printable(p.old_key), ": superseded by ",
                         Printable(p.new_key), ", which differs", diff, " (--new-keys-win)"),
            Step::kListed);
      }
      if (status == "unlinked" || (st.dry_run && status == "same")) {
        return st.Record(st.dry_run ? "would_unlink" : "unlinked",
                         absl::StrCat(st.dry_run ? "would unlink " : "unlinked ", Printable(p.old_key)),
                         Step::kRoutine);
      }
      if (status == "missing") {
        return st.Record("kept.missing",
                         absl::StrCat("kept ", Printable(p.old_key), ": ", Printable(p.new_key), " does not exist"),
                         Step::kAttention);
      }
      if (status == "differs") {
        return st.Record("kept.differs",
                         absl::StrCat("kept ", Printable(p.old_key), ": ", Printable(p.new_key), " differs", diff),
                         Step::kAttention);
      }
      break;
  }
  st.Record("failed", absl::StrCat("failed ", Arrow(p), ": unexpected result '", Printable(status), "'"),
            Step::kAttention);
}

// kPartScript's arguments for new key `k` of `item` (0: the new name, then the nested keys):
// the expiry, the kind and what the key should hold (`value`: also the DUMP to write).
std::vector<std::string> Expected(const Item& item, size_t k, bool value) {
  std::vector<std::string> a = {absl::StrCat(item.at)};
  if (item.dump) {
    a.insert(a.end(), {"dump", item.type, item.digest, value ? item.dumped : ""});
    return a;
  }
  const Fields* fields = &item.shape.fields;
  if (k > 0) {
    const HashShape::SubKey& sub = item.shape.subkeys[k - 1];
    if (!sub.hash) {
      a.insert(a.end(), {"string", "1", sub.text});
      return a;
    }
    fields = &sub.fields;
  }
  a.insert(a.end(), {"hash", absl::StrCat(2 * fields->size())});
  for (const auto& [f, v] : *fields) a.insert(a.end(), {f, v});
  return a;
}

// Items whose new keys are on other nodes than their old key, through kPartScript's steps (see
// the top of this file). Keys to read again go to `again` (the old key changed, or a new key
// appeared between compare and create) or `moved` (a slot is elsewhere or moving).
absl::Status RunApart(Step& st, const std::vector<Item*>& items, std::string_view mode, std::vector<const Pair*>* again,
                      std::vector<const Pair*>* moved) {
  struct State {
    Item* item;
    std::vector<std::string> keys;   // the new keys
    std::string status{}, detail{};  // compare's verdict, as kKeyScript gives it
    bool main_exists = false;
    bool done = false;
    bool write = false, unlink = false, supersede = false;
    std::vector<size_t> written{};  // new keys this run wrote (undone unless the check says the old key is unchanged)
    bool checked = false;           // the check found the old key unchanged
    bool undo = false;
  };
  std::vector<State> states;
  for (Item* item : items) states.push_back(State{.item = item, .keys = item->NewKeys()});
  auto redirected = [&](State& s) {
    st.moved = true;
    moved->push_back(s.item->pair);
    s.done = true;
  };
  auto failed = [&](State& s, const Reply& x) {
    st.Record("failed",
              absl::StrCat("failed ", Arrow(*s.item->pair), ": ", Printable(x.is_error() ? x.str : "unexpected reply")),
              Step::kAttention);
    s.done = true;
  };
  // Runs one command per (state, key) that `make` gives (nullopt: none), all in one go, and hands
  // each reply to `take`. A key whose slot has no primary counts as redirected.
  auto round = [&](auto make, auto take) -> absl::Status {
    std::vector<Routed> cmds;
    std::vector<std::pair<size_t, size_t>> who;
    for (size_t i = 0; i < states.size(); ++i) {
      State& s = states[i];
      if (s.done) continue;
      std::vector<Routed> mine;
      std::vector<size_t> ks;
      bool nowhere = false;
      for (size_t k = 0; k < s.keys.size() + 1; ++k) {
        std::optional<Routed> r = make(s, k);
        if (!r) continue;
        nowhere |= r->node == Servers::kNowhere;
        mine.push_back(*std::move(r));
        ks.push_back(k);
      }
      if (nowhere) {
        redirected(s);
        continue;
      }
      for (size_t n = 0; n < mine.size(); ++n) {
        cmds.push_back(std::move(mine[n]));
        who.emplace_back(i, ks[n]);
      }
    }
    auto r = st.Run(cmds);
    if (!r.ok()) return r.status();
    for (size_t n = 0; n < who.size(); ++n) {
      State& s = states[who[n].first];
      const Reply& x = (*r)[n];
      if (x.kind == Reply::Kind::kArray && x.elements.size() == 2) {
        take(s, who[n].second, x.elements[0].str, x.elements[1].str);  // even when settled: a key written
      } else if (!s.done) {                                            // the first failure of the item settles it
        Redirected(x) ? redirected(s) : failed(s, x);
      }
    }
    return absl::OkStatus();
  };

  // 1. Each new key against what the old key held when read (keys index k - 1; k == 0 unused).
  std::vector<std::vector<std::pair<std::string, std::string>>> compared(states.size());
  for (size_t i = 0; i < states.size(); ++i) compared[i].resize(states[i].keys.size());
  auto status = round(
      [&](State& s, size_t k) -> std::optional<Routed> {
        if (k == 0) return std::nullopt;
        return st.Part("compare", s.keys[k - 1], Expected(*s.item, k - 1, false));
      },
      [&](State& s, size_t k, const std::string& verdict, const std::string& detail) {
        compared[static_cast<size_t>(&s - states.data())][k - 1] = {verdict, detail};
      });
  if (!status.ok()) return status;
  for (size_t i = 0; i < states.size(); ++i) {
    State& s = states[i];
    if (s.done) continue;
    int exists = 0;
    for (size_t k = 0; k < s.keys.size(); ++k) {
      const auto& [verdict, detail] = compared[i][k];
      const bool missing = verdict == "differs" && detail == "missing";
      exists += missing ? 0 : 1;
      if (k == 0) s.main_exists = !missing;
      if (verdict == "differs" && s.status.empty()) {
        s.status = "differs";
        s.detail = k == 0 ? detail : absl::StrCat(s.keys[k], ": ", detail);
      }
    }
    if (exists == 0) {
      s.status = "missing";
      s.detail.clear();
    } else if (s.status.empty()) {
      s.status = "same";
    }
    // 2. What the step does about it.
    if (mode == "verify" || (s.status == "same" && (mode == "copy" || mode == "refresh"))) {
      Judge(st, *s.item, s.status, s.detail);
      s.done = true;
    } else if (mode == "copy" || mode == "refresh") {
      if (s.status == "differs" && mode == "copy") {
        Judge(st, *s.item, "stale", s.detail);
        s.done = true;
      } else {
        s.write = true;
      }
    } else if (s.status == "same" || (mode == "supersede" && s.status == "differs" && s.main_exists)) {
      s.unlink = true;
      s.supersede = s.status != "same";
    } else {
      Judge(st, *s.item, s.status, s.detail);
      s.done = true;
    }
  }

  // 3. copy: the new keys, each only while still absent (or, --refresh, while it differs).
  status = round(
      [&](State& s, size_t k) -> std::optional<Routed> {
        if (k == 0 || !s.write) return std::nullopt;
        return st.Part(s.status == "missing" ? "create" : "replace", s.keys[k - 1], Expected(*s.item, k - 1, true));
      },
      [&](State& s, size_t k, const std::string& verdict, const std::string&) {
        if (verdict == "written") {
          s.written.push_back(k - 1);
        } else if (verdict == "raced" && !s.done) {  // created by someone else since compare: decide again
          again->push_back(s.item->pair);
          s.done = true;
        }
      });
  // Keys written for an item that failed part-way are undone (below), even when a node failed.
  auto undo = [&]() -> absl::Status {
    for (State& s : states) {
      s.undo = s.write && !s.checked && !s.written.empty();
      s.done = !s.undo;
    }
    return round(
        [&](State& s, size_t k) -> std::optional<Routed> {
          if (k == 0 || std::find(s.written.begin(), s.written.end(), k - 1) == s.written.end()) return std::nullopt;
          return st.Part("undo", s.keys[k - 1], Expected(*s.item, k - 1, false));
        },
        [&](State& s, size_t k, const std::string& verdict, const std::string& detail) {
          if (verdict == "kept" && detail != "missing") {  // (missing: it expired, or the app deleted it)
            st.Record("kept.changed",
                      absl::StrCat("kept ", Printable(s.keys[k - 1]), ": copied from ",
                                   Printable(s.item->pair->old_key), ", which then changed; the new key changed too (",
                                   Printable(detail), "), so it was not undone"),
                      Step::kAttention);
          }
        });
  };
  if (!status.ok()) {
    (void)undo();
    return status;
  }

  // 4. The old key still holds what was read (and cleanup UNLINKs it in the same script). A raced,
  // redirected or failed item is done: not checked, its writes undone.
  status = round(
      [&](State& s, size_t k) -> std::optional<Routed> {
        if (k != 0 || !(s.write || s.unlink)) return std::nullopt;
        return st.Part("check", s.item->pair->old_key,
                       {s.item->digest, absl::StrCat(s.item->at), s.unlink ? "1" : "0"});
      },
      [&](State& s, size_t, const std::string& verdict, const std::string&) {
        s.done = true;
        if (verdict == "same" && s.write) {
          s.checked = true;
          Judge(st, *s.item, s.status == "missing" ? "copied" : "refreshed", s.detail);
        } else if (verdict == "unlinked" && s.unlink) {
          Judge(st, *s.item, s.supersede ? "superseded" : "unlinked", s.detail);
        } else if (verdict == "changed") {
          again->push_back(s.item->pair);
        } else if (verdict == "gone") {
          // The app deleted (or let expire) the old key since the read: the new keys stay, they may
          // be the only copy now (an app that moves a key itself deletes the old one).
          s.checked = true;
          Judge(st, *s.item, "gone", "");
        } else {
          failed(s, Reply{.kind = Reply::Kind::kError,
                          .str = absl::StrCat("unexpected result '", verdict, "'"),
                          .elements = {}});
        }
      });
  // 5. A copy whose old key changed since the read, or that failed part-way: each key it wrote is
  // deleted where it still holds what was written.
  absl::Status undone = undo();
  return status.ok() ? undone : status;
}

// Runs one batch of keys through kKeyScript (or, for keys on different nodes, kPartScript's
// steps), re-reading keys whose old value changed in between.
absl::Status RunBatch(Step& st, const std::vector<Pair>& batch) {
  const char* mode = st.kind == StepKind::kVerify || st.dry_run ? "verify"
                     : st.kind == StepKind::kCleanup            ? (st.supersede ? "supersede" : "cleanup")
                     : st.refresh                               ? "refresh"
                                                                : "copy";
  std::vector<const Pair*> todo, moved;
  for (const Pair& p : batch) todo.push_back(&p);
  for (int attempt = 0; attempt < kAttempts && !todo.empty(); ++attempt) {
    if (st.moved) {  // a redirection: the slot map again, and a moment for a moving slot to settle
      st.moved = false;
      if (absl::Status s = st.servers.Refresh(); !s.ok()) return s;
      if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(200 * attempt));
    }
    std::vector<const Pair*> again;
    moved.clear();
    auto items = Prepare(st, todo, &moved);
    if (!items.ok()) return items.status();
    std::vector<Routed> calls;
    std::vector<const Item*> called;
    std::vector<Item*> apart;
    for (Item& item : *items) {
      if (item.apart) {
        apart.push_back(&item);
        continue;
      }
      const size_t node = st.servers.NodeOf(item.pair->old_key);
      if (node == Servers::kNowhere) {
        st.moved = true;
        moved.push_back(item.pair);
        continue;
      }
      calls.push_back(Routed{node, ScriptCall(st, item, mode)});
      called.push_back(&item);
    }
    auto r = st.Run(calls);
    if (!r.ok()) return r.status();
    for (size_t i = 0; i < called.size(); ++i) {
      const Item& item = *called[i];
      const Reply& x = (*r)[i];
      if (Redirected(x)) {
        st.moved = true;
        moved.push_back(item.pair);
        continue;
      }
      if (x.is_error() || x.kind != Reply::Kind::kArray || x.elements.size() != 2) {
        st.Record(
            "failed",
            absl::StrCat("failed ", Arrow(*item.pair), ": ", Printable(x.is_error() ? x.str : "unexpected reply")),
            Step::kAttention);
        continue;
      }
      if (x.elements[0].str == "changed") {
        // The app wrote the old key between our read and the script: read it again.
        again.push_back(item.pair);
        continue;
      }
      Judge(st, item, x.elements[0].str, x.elements[1].str);
    }
    if (!apart.empty()) {
      if (absl::Status s = RunApart(st, apart, mode, &again, &moved); !s.ok()) return s;
    }
    if (attempt + 1 < kAttempts) {
      for (size_t i = 0; i < again.size(); ++i) st.Record("retried", "", Step::kRoutine);
    }
    todo = std::move(again);
    todo.insert(todo.end(), moved.begin(), moved.end());
  }
  for (const Pair* p : todo) {
    if (std::find(moved.begin(), moved.end(), p) != moved.end()) {
      st.Record("moved",
                absl::StrCat("moved ", Arrow(*p), ": its slot was elsewhere or moving on each of ", kAttempts,
                             " attempts; run the step again"),
                Step::kAttention);
      continue;
    }
    st.Record("changed",
              absl::StrCat("changed ", Arrow(*p), ": the old key changed on each of ", kAttempts,
                           " attempts; run the step again"),
              Step::kAttention);
  }
  return absl::OkStatus();
}

}  // namespace

const char kMigrateUsage[] =
    "usage: keyguard migrate --migration NAME {copy|verify|cleanup} [--config FILE] [--upstream URL]\n"
    "                        [--db N] [--dry-run] [--refresh] [--new-keys-win] [--cursor C] [--max-keys N]\n"
    "                        [--rate OPS] [--verbose] [--summary-json FILE] [--progress-seconds S]\n"
    "                        [--no-progress]\n"
    "  copy     writes the new key for every old key the migration matches; a new key that differs\n"
    "           from its old key is reported as stale and kept, or with --refresh rewritten from it\n"
    "           (use --refresh while the app still writes the old names: the old key is the truth)\n"
    "  verify   compares old and new keys (type, value, expiry); exit 1 on a difference\n"
    "  cleanup  UNLINKs each old key whose new key matches it, checked atomically with the delete;\n"
    "           every other old key is kept and listed with the reason. After the switch-over, when\n"
    "           the app writes only the new keys, --new-keys-win also UNLINKs (and lists) an old key\n"
    "           whose new key exists but differs; an old key without a new key is still kept\n"
    "  Every decision about a key is one server-side script: a key the app changes meanwhile is\n"
    "  re-read, never copied stale nor deleted. The migrations are in the config file (migrations:).\n"
    "  --dry-run changes nothing and says what would change (totals, and the first lines of each\n"
    "  kind; --verbose lists every key). --max-keys stops after about N keys and prints the cursor to\n"
    "  resume from (as does Ctrl-C). --summary-json writes the totals as JSON ('-': stdout).\n"
    "  --upstream: HOST:PORT, redis[s]://[USER@]HOST:PORT, redis[s]-sentinel://MASTER@H:P,... (the\n"
    "  primary) or redis[s]-cluster://SEED,... (each primary's keys in turn; a new key in another slot\n"
    "  than its old key is written, compared and checked in steps on each key's own node), as for audit.\n"
    "  Exit: 0 done, 1 a key needs attention (listed), 2 usage, config or connection error,\n"
    "  3 stopped before the end with nothing to report so far (resume with --cursor).\n";

int RunMigrate(const std::vector<std::string>& argv) {
  auto parsed = ParseArgs(argv,
                          {"--config", "--upstream", "--db", "--migration", "--cursor", "--max-keys", "--rate",
                           "--summary-json", "--progress-seconds"},
                          {"--dry-run", "--refresh", "--new-keys-win", "--verbose", "--no-progress", "--help"});
  if (!parsed.ok()) return Fail(absl::StrCat(parsed.status().message(), "\n", kMigrateUsage));
  const Args& args = *parsed;
  if (args.Has("--help")) {
    std::fputs(kMigrateUsage, stdout);
    return 0;
  }
  if (args.positional.size() != 1 ||
      (args.positional[0] != "copy" && args.positional[0] != "verify" && args.positional[0] != "cleanup")) {
    return Fail(absl::StrCat("name one step: copy, verify or cleanup\n", kMigrateUsage));
  }
  const std::string step_name = args.positional[0];
  const StepKind kind = step_name == "copy"     ? StepKind::kCopy
                        : step_name == "verify" ? StepKind::kVerify
                                                : StepKind::kCleanup;
  if (args.Has("--refresh") && kind != StepKind::kCopy) return Fail("--refresh applies to copy only");
  if (args.Has("--new-keys-win") && kind != StepKind::kCleanup) return Fail("--new-keys-win applies to cleanup only");
  auto loaded = LoadMaintenanceConfig(args.Str("--config"));
  if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
  MaintenanceConfig& cfg = *loaded;
  if (!args.Has("--migration")) return Fail("--migration NAME is required");
  const Migration* m = cfg.FindMigration(args.Str("--migration"));
  if (m == nullptr) {
    std::string known;
    for (const Migration& x : cfg.migrations) absl::StrAppend(&known, known.empty() ? "" : ", ", x.name);
    return Fail(absl::StrCat("no migration named '", args.Str("--migration"),
                             "' in the config (known: ", known.empty() ? "none" : known, ")"));
  }
  if (args.Has("--upstream")) {
    auto u = config::ParseUpstream(args.Str("--upstream"), "--upstream");
    if (!u.ok()) return Fail(std::string(u.status().message()));
    cfg.proxy.upstream = *u;
  }
  auto db = args.Int("--db", 0, 0, 1 << 20);
  auto max_keys = args.Int("--max-keys", 0, 0, INT64_MAX);
  auto rate = args.Int("--rate", m->max_ops_per_second, 0, 100000000);
  auto progress_seconds = args.Double("--progress-seconds", 10, 0, 86400);
  for (const absl::Status& s : {db.status(), max_keys.status(), rate.status(), progress_seconds.status()}) {
    if (!s.ok()) return Fail(std::string(s.message()));
  }
  const std::string start_cursor = args.Str("--cursor", "0");
  auto [cursor, cursor_tag] = SplitCursor(start_cursor);  // a cluster's: NUMBER-TAG (LayoutTag)
  if (cursor.empty() || !std::all_of(cursor.begin(), cursor.end(), absl::ascii_isdigit))
    return Fail("--cursor: expected a SCAN cursor");
  const bool cluster = cfg.proxy.upstream.kind == config::Upstream::Kind::kCluster;
  if (cluster && *db != 0) return Fail("--db: a Redis Cluster has database 0 only");
  auto upstream = UpstreamLinks::Create(cfg.proxy);
  if (!upstream.ok()) return Fail(std::string(upstream.status().message()));
  auto servers = cluster ? Servers::Cluster(*upstream) : Servers::One(*upstream, static_cast<int>(*db));
  if (!servers.ok()) return Fail(std::string(servers.status().message()));
  // A cluster's cursor names the primary (as keyguard's SCAN and audit do): its keys are walked
  // one primary after the other.
  size_t node = 0;
  if (cluster) {
    auto c = proxy::cluster::DecodeScanCursor(cursor);
    if (!c.has_value() || c->node >= static_cast<int>(servers->walk_size()))
      return Fail("--cursor: not a cursor of this cluster");
    if (std::string stale = StaleCursor(cursor, cursor_tag, servers->walked()); !stale.empty()) {
      return Fail(absl::StrCat(stale, " (every step is idempotent)"));
    }
    node = static_cast<size_t>(c->node);
    cursor = c->node_cursor;
  } else if (!cursor_tag.empty()) {
    return Fail("--cursor: expected a SCAN cursor");
  }
  // The cursor to print: the node's own, with the node in it for a cluster ("0" of a node: the
  // next node from its start).
  auto resume_cursor = [&]() -> std::string {
    if (!cluster) return cursor;
    const int n = static_cast<int>(servers->walk_size());
    if (cursor == "0" && node == 0) return std::string("0");
    return absl::StrCat(cursor != "0" ? proxy::cluster::EncodeScanCursor(cursor, static_cast<int>(node), n)
                                      : proxy::cluster::EncodeScanCursor("0", static_cast<int>(node) - 1, n),
                        "-", LayoutTag(servers->walked()));
  };

  CatchStopSignals();
  Pacer pacer(static_cast<uint32_t>(*rate));
  const bool dry_run = args.Has("--dry-run") && kind != StepKind::kVerify;
  Step st{.kind = kind,
          .m = *m,
          .servers = *servers,
          .pacer = pacer,
          .dry_run = dry_run,
          .refresh = args.Has("--refresh"),
          .supersede = args.Has("--new-keys-win"),
          .verbose = args.Has("--verbose")};
  if (auto s = st.LoadScripts(); !s.ok()) return Fail(std::string(s.message()));
  int64_t dbsize = 0;
  for (size_t i = 0; i < servers->walk_size() && dbsize >= 0; ++i) {
    auto size = servers->link(servers->walk(i)).Call({"DBSIZE"});
    dbsize = size.ok() && size->kind == Reply::Kind::kInteger ? dbsize + size->integer : -1;
  }
  const Progress::Mode progress_mode = args.Has("--no-progress") ? Progress::Mode::kOff
                                       : isatty(STDERR_FILENO)   ? Progress::Mode::kTerminal
                                                                 : Progress::Mode::kLines;
  Progress progress(progress_mode, absl::StrCat(step_name, " ", m->name, ": "), dbsize,
                    std::chrono::milliseconds(static_cast<int64_t>(*progress_seconds * 1000)));
  const auto started = std::chrono::steady_clock::now();
  uint64_t scanned = 0, matched = 0;
  bool complete = false;
  for (;;) {
    pacer.Before(1);
    auto page =
        servers->link(servers->walk(node)).Call({"SCAN", cursor, "MATCH", m->match, "COUNT", absl::StrCat(m->batch)});
    if (!page.ok()) return Fail(absl::StrCat(page.status().message(), "; resume with --cursor ", resume_cursor()));
    if (page->kind != Reply::Kind::kArray || page->elements.size() != 2) return Fail(absl::StrCat("SCAN: ", page->str));
    std::vector<Pair> batch;
    for (const Reply& k : page->elements[1].elements) {
      ++scanned;
      auto to = m->NewName(k.str);
      if (!to || *to == k.str) continue;
      batch.push_back(Pair{k.str, *std::move(to)});
    }
    matched += batch.size();
    if (absl::Status s = RunBatch(st, batch); !s.ok()) {
      return Fail(absl::StrCat(step_name, ": ", s.message(), "; resume with --cursor ", resume_cursor()));
    }
    cursor = page->elements[0].str;
    if (cursor == "0" && node + 1 < servers->walk_size()) {
      ++node;  // the next primary, from its start
    } else if (cursor == "0") {
      complete = true;
      break;
    }
    progress.Show(scanned);
    if ((*max_keys > 0 && scanned >= static_cast<uint64_t>(*max_keys)) || StopRequested()) break;
  }
  if (!complete) cursor = resume_cursor();
  progress.Done();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const int exit_code = st.failed ? 1 : complete ? 0 : 3;

  std::string summary =
      absl::StrCat(step_name, " ", m->name, ":", dry_run ? " dry-run" : "", " scanned=", scanned, " matched=", matched);
  for (const auto& [what, n] : st.counts) absl::StrAppend(&summary, " ", what, "=", n);
  absl::StrAppend(&summary, " complete=", complete ? "true" : "false", " cursor=", cursor);
  std::printf("%s\n", summary.c_str());
  if (args.Has("--summary-json")) {
    nlohmann::ordered_json j;
    j["step"] = step_name;
    j["migration"] = m->name;
    j["dry_run"] = dry_run;
    j["refresh"] = st.refresh;
    j["scanned"] = scanned;
    j["matched"] = matched;
    j["counts"] = nlohmann::ordered_json::object();
    for (const auto& [what, n] : st.counts) j["counts"][what] = n;
    j["complete"] = complete;
    j["start_cursor"] = start_cursor;
    j["cursor"] = cursor;
    j["seconds"] = seconds;
    j["exit_code"] = exit_code;
    const std::string text = j.dump() + "\n";
    const std::string path = args.Str("--summary-json");
    if (path == "-") {
      std::fputs(text.c_str(), stdout);
    } else {
      std::ofstream out(path, std::ios::trunc);
      out << text;
      if (!out) std::fprintf(stderr, "keyguard migrate: cannot write %s\n", path.c_str());
    }
  }
  std::fflush(stdout);
  if (!complete) {
    std::fprintf(stderr, "keyguard migrate: stopped after %llu keys; resume with --cursor %s\n",
                 static_cast<unsigned long long>(scanned), cursor.c_str());
  }
  if (st.failed) {
    std::fprintf(stderr, "keyguard migrate: %s found keys that need attention (listed above with the reason)\n",
                 step_name.c_str());
  }
  return exit_code;
}

}  // namespace keyguard::maintenance
