// Command traits: the per-command facts the stages act on (hygiene, hot keys, the key policy's
// script review, tenancy, connection state), one compact entry per CommandId. The derived facts
// (where the first key is, whether args[1] names a subcommand) come from the command table for
// every command, compiled in or added at start-up; the hand-written ones (which argument is a
// written value, a TTL, what a reply shows) name Redis 7.0's own commands in traits.cc.
//
// The table is built once, before main, and grows with ExtendFromCommandInfo (at start-up, before
// any worker runs); after that it is read-only and shared by every thread. TraitsOf is one indexed
// load of a 16-byte entry. Text a stage shows (hygiene's suggestions) stays in the stage, keyed by
// these facts.
#pragma once

#include <cstdint>
#include <string_view>

#include "keyguard/commands/command_table.h"

namespace keyguard::commands {

// What a command's reply shows about its first key.
enum class ReplyShows : uint8_t {
  kNothing,
  kValue,            // GET, GETEX, GETDEL: the bulk is the string value
  kLength,           // STRLEN: an integer, the string's bytes
  kCount,            // HLEN, SCARD, LLEN, ZCARD, XLEN: an integer, the members
  kMembers,          // HGETALL, SMEMBERS, LRANGE, ZRANGE.., XRANGE..: the members, read whole
  kComputedMembers,  // SINTER, SUNION, SDIFF: members computed from several keys
};

// The type of the key a command writes or reads, as far as the command tells.
enum class KeyType : uint8_t { kUnknown, kString, kHash, kSet, kList, kZset, kStream };
// "string", "hash", ... ("" for kUnknown).
std::string_view KeyTypeName(KeyType t);

// How a TTL argument counts.
enum class TtlUnit : uint8_t { kNone, kSeconds, kMillis, kUnixSeconds, kUnixMillis };

// Commands hygiene has a rule about, beyond writes, TTLs and reads.
enum class HygieneRole : uint8_t { kNone, kKeys, kFlush, kDel, kUnlink };

// The scripts the key policy reviews (key_policy.scripts). The _RO variants are not reviewed.
enum class ScriptKind : uint8_t { kNone, kEval, kEvalSha, kFcall, kScript, kFunction };

// How tenancy handles a command beyond prefixing the keys its specs name (tenant/request.cc).
enum class TenantHandling : uint8_t {
  kPlain,
  kFlush,
  kDbsize,
  kRandomkey,
  kKeys,
  kScan,
  kSort,
  kSelect,
  kCopy,
  kMigrate,
  kNever,  // MOVE, SWAPDB (another database), CLUSTER (GETKEYSINSLOT lists any key): refused
  kInfo,
  kDebug,
  kEval,  // and EVAL_RO, as every kind below names the _RO variants too
  kEvalSha,
  kFcall,
  kScript,
  kFunction,
  kClient,
  kPubsub,
  kSubscribe,   // (s)subscribe, (s)unsubscribe: channels
  kPsubscribe,  // psubscribe, punsubscribe: patterns
  kPublish,     // publish, spublish
  kFirstKey,
  kStreams,
  kKeyed,   // admin or dangerous by category, but confined by prefixing its keys (RESTORE)
  kMemory,  // MEMORY STATS counts every tenant's keys, like INFO's # Keyspace
};

// A collection write that may create its key, and what its reply says about that (missing_ttl
// judges only writes that created the key: an existing key keeps whatever TTL it has).
enum class CreatesKey : uint8_t {
  kNo,
  kFieldPairs,  // HSET, HSETNX: field value pairs from args[2]; the reply counts new fields
  kMembers,     // SADD: members from args[2]; the reply counts new members
  kScored,      // ZADD: options, then score member pairs; without CH or INCR the reply counts new members
  kPushed,      // LPUSH, RPUSH: elements from args[2]; the reply is the list's new length
  kUncounted,   // HMSET, XADD: the reply does not say (XADD ... NOMKSTREAM never creates)
};

// What a command does to the connection's state (followed by proxy::ConnectionState).
enum class ConnectionRole : uint8_t {
  kNone,
  kQuit,
  kReset,
  kMulti,
  kExec,
  kDiscard,
  kWatch,
  kUnwatch,
  kHello,
  kMonitor,
  kClient,
  kSync,         // SYNC, PSYNC
  kSubscribe,    // SUBSCRIBE, PSUBSCRIBE, SSUBSCRIBE
  kUnsubscribe,  // UNSUBSCRIBE, PUNSUBSCRIBE, SUNSUBSCRIBE
};

struct alignas(16) Traits {
  // Derived from the command table.
  bool first_key : 1;        // args[1] is the first key (GET, SET, HGETALL; not OBJECT ENCODING)
  bool has_subcommands : 1;  // args[1] names a subcommand (OBJECT, CLIENT, XINFO, ...)
  // String writes.
  bool pairs : 1;        // MSET, MSETNX: key value pairs from args[1]
  bool rmw_write : 1;    // replaces the whole value (SET, GETSET, SETEX, MSET, ...; not APPEND)
  bool sized_write : 1;  // the written value shows the key's size (every string write but SETRANGE)
  bool needs_ttl : 1;    // creates a string value: cache and session patterns want a TTL
  // Reads.
  bool field_value_pairs : 1;  // a RESP2 reply alternates fields and values (HGETALL)
  bool probe : 1;              // the reply does not show the key's size (HGET, LINDEX, EXPIRE, ...)
  uint8_t value_pos;           // a string write: position of its value (0: none)
  TtlUnit ttl_unit;            // EXPIRE family, SETEX, PSETEX: the TTL is args[2], counted so
  uint8_t options_from;        // SET, GETEX: EX/PX/EXAT/PXAT/KEEPTTL among the arguments from here
  ReplyShows reply;
  KeyType type;
  HygieneRole hygiene;
  ScriptKind script;
  TenantHandling tenant;
  ConnectionRole connection;
  CreatesKey creates;
};
static_assert(sizeof(Traits) == 16);

namespace detail {
extern const Traits* traits;  // by CommandId; set before main, moved only by ExtendTraits
// Gives the commands added since the last call (ExtendFromCommandInfo) their derived traits.
void ExtendTraits();
}  // namespace detail

// The traits of `id`, any id LookupCommand returned. Not for use during static initialization.
inline const Traits& TraitsOf(CommandId id) { return detail::traits[id]; }

}  // namespace keyguard::commands
