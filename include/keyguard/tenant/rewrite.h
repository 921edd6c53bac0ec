// Tenant prefixing, sans-io: requests in, replies out. The session calls these; tests drive them
// with plain argument lists and reply frames.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keyguard/commands/command_table.h"
#include "keyguard/tenant/connections.h"
#include "keyguard/tenant/tenancy.h"

namespace keyguard::tenant {

// How a reply must be rewritten for the tenant. Stored per pending command (uint8_t).
enum class ReplyRewrite : uint8_t {
  kNone,
  kKeyArray,       // KEYS: every element a key
  kScan,           // SCAN: [cursor, [keys]]
  kFirstKey,       // BLPOP, BRPOP, BZPOPMIN/MAX, LMPOP, BLMPOP, ZMPOP, BZMPOP: [key, ...]
  kBulkKey,        // RANDOMKEY: a key or nil
  kStreams,        // XREAD, XREADGROUP: [[key, entries], ...] or, in RESP3, {key: entries}
  kChannelArray,   // PUBSUB CHANNELS / SHARDCHANNELS: channel names
  kChannelCounts,  // PUBSUB NUMSUB / SHARDNUMSUB: [channel, count, ...]
  kInfo,           // INFO: without the # Keyspace section (other tenants' key counts)
  kExec,           // EXEC: element i rewritten as queued command i
  kTrackingInfo,   // CLIENT TRACKINGINFO: [name, value, ...] or a map; "prefixes" lose the prefix
  kOwn,            // in kExec: keyguard's own queued command (a legacy-key move): its element goes
};

// A command keyguard answers by walking the tenant's keys one bounded step at a time, so no single
// server-side call blocks every other client: FLUSHALL/FLUSHDB, DBSIZE, RANDOMKEY.
enum class Walk : uint8_t { kNone, kFlush, kDbsize, kRandomkey };

// The request for step `step` (0 first) of `walk` from SCAN `cursor`: one EVAL that SCANs up to
// `count` keys matching the tenant's prefix (and UNLINKs them for a flush; RANDOMKEY first tries
// the server's RANDOMKEY). Its reply is [next cursor, keys seen, a key found or ""].
std::string WalkStep(const Tenant& tenant, Walk walk, std::string_view cursor, uint64_t step, uint32_t count);

struct RequestResult {
  enum class Kind : uint8_t {
    kForward,  // forward `out` (when `modified`) or the request as it came
    kRefuse,   // answer `message` as an error; nothing is forwarded
  };
  Kind kind = Kind::kForward;
  bool modified = false;
  ReplyRewrite reply = ReplyRewrite::kNone;
  Walk walk = Walk::kNone;  // kForward: nothing is forwarded as is; the session walks the keys
  std::string message;      // kRefuse: the error text, without '-'
};

// Rewrites requests for one tenant. One per worker; not thread-safe.
class RequestRewriter {
 public:
  // `connections` says which upstream client ids a CLIENT TRACKING REDIRECT may name (those of
  // the tenant's own connections); without it every REDIRECT is refused.
  explicit RequestRewriter(const Tenancy& tenancy, const Connections* connections = nullptr);

  // `args` is the request as the policy stage left it (name first); `keys` are its keys as
  // FindKeys found them (`keys_ok` false when the arguments did not fit the key specs). On
  // kForward with `modified`, `out` holds the arguments to send; its views point into `args` or
  // into storage owned here, valid until the next Rewrite().
  RequestResult Rewrite(const Tenant& tenant, commands::CommandId id, const commands::CommandSpec* spec,
                        std::span<const std::string_view> args, std::span<const commands::KeyRef> keys, bool keys_ok,
                        std::vector<std::string_view>* out);

 private:
  std::string_view Own(std::string s);
  // `a` followed by `b`, owned here.
  std::string_view Joined(std::string_view a, std::string_view b);
  // For a command whose key count does not fit its arguments (FindKeys placed no keys): prefixes
  // every argument from the first key position on except the counts, in `args`. False when the
  // command's keys are not given by a count (the caller refuses it).
  bool ConfineUnplacedKeys(const Tenant& tenant, const commands::CommandSpec& spec,
                           std::vector<std::string_view>* args);
  std::string_view ChannelIn(const Tenant& t, std::string_view channel);
  // The pattern confined to the tenant, or nullopt when its structure cannot be proven confined
  // (a keyspace pattern whose head is not literal, or in shared-channel mode a pattern that may
  // match keyspace channels): the command is then refused.
  std::optional<std::string_view> PatternIn(const Tenant& t, std::string_view pattern);

  const Tenancy& tenancy_;
  const Connections* connections_;
  std::array<std::string, 4> own_scripts_;  // SHA1s of keyguard's scripts (the walk step, and earlier emulations)
  std::deque<std::string> owned_;
  std::string key_space_;       // the prefixed keys of the last request
  std::vector<uint8_t> plain_;  // by CommandId: Rewrite's fast path may take it
  uint32_t reach_;              // @admin | @dangerous: refused unless handled below
};

enum class ReplyAction : uint8_t { kPass, kReplace, kDrop };

// Rewrites the reply `frame` (one complete RESP frame) of a command for `tenant`. kReplace puts
// the new frame in `out`. `exec` holds the rewrite of each queued command for kExec. Error
// replies lose every occurrence of the prefix (NOGROUP names the key).
ReplyAction RewriteReply(const Tenancy& tenancy, const Tenant& tenant, ReplyRewrite kind, std::span<const uint8_t> exec,
                         std::string_view frame, std::string* out);

// An EXEC reply without the elements of keyguard's own queued commands (kOwn in `exec`), for a
// connection without a tenant. kReplace puts the new frame in `out`; an EXEC reply whose element
// count is not exec's (or any reply but an array) is passed as it is.
ReplyAction DropOwnElements(std::span<const uint8_t> exec, std::string_view frame, std::string* out);

// What keyguard's own queued commands (kOwn in `exec`: legacy-key moves) did in an EXEC reply:
// the sum of their integer elements (keys moved) and how many were errors. {0, 0} when the reply
// is not an array of exec's size.
struct OwnResults {
  int64_t moved = 0;
  int64_t errors = 0;
};
OwnResults OwnElementResults(std::span<const uint8_t> exec, std::string_view frame);

// The key names in the reply `frame` of a command whose keys the key policy renamed, back to the
// names the client used: each (new, old) pair of `names` in the reply's shape (kFirstKey or
// kStreams; kNone: none), and in an error's text where it quotes a new name ('user:5:profile', as
// NOGROUP does). kReplace puts the new frame in `out`.
ReplyAction RenameKeys(ReplyRewrite shape, std::span<const std::pair<std::string, std::string>> names,
                       std::string_view frame, std::string* out);

// Rewrites an out-of-band frame: pub/sub messages and subscribe confirmations (RESP2 arrays or
// RESP3 pushes), keyspace/keyevent notifications, tracking invalidations. kDrop when the frame
// concerns another tenant's keys or channels.
ReplyAction RewritePush(const Tenancy& tenancy, const Tenant& tenant, std::string_view frame, std::string* out);

}  // namespace keyguard::tenant
