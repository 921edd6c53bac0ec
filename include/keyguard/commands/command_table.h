// The command table: every Redis command and subcommand with its arity, flags, ACL categories
// and key specs, generated from a real server's COMMAND INFO (scripts/capture_commands.py,
// scripts/gen_command_table.py), and key extraction that follows Redis's own
// getKeysFromCommandWithSpecs, with explicit handling where the specs are incomplete.
//
// Top-level commands have dense ids (CommandId), used to index per-command metric arrays; id 0
// stands for every command the table does not know, so label sets stay bounded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace keyguard::commands {

using CommandId = uint16_t;
inline constexpr CommandId kUnknownCommand = 0;

// Key spec flags, as Redis names them (RO RW OW RM access update insert delete not_key
// incomplete variable_flags).
enum KeyFlag : uint32_t {
  kKeyRo = 1u << 0,
  kKeyRw = 1u << 1,
  kKeyOw = 1u << 2,
  kKeyRm = 1u << 3,
  kKeyAccess = 1u << 4,
  kKeyUpdate = 1u << 5,
  kKeyInsert = 1u << 6,
  kKeyDelete = 1u << 7,
  kKeyNotKey = 1u << 8,
  kKeyIncomplete = 1u << 9,
  kKeyVariableFlags = 1u << 10,
};

// One Redis key spec: where the search for keys begins, and how keys are found from there.
struct KeySpec {
  enum Begin : uint8_t { kUnknownBegin, kIndex, kKeyword };
  enum Find : uint8_t { kUnknownFind, kRange, kKeynum };
  Begin begin;
  int16_t index;        // kIndex: position of the first key
  const char* keyword;  // kKeyword: the keyword before the first key
  int16_t startfrom;    // kKeyword: where to start looking; negative counts from the end
  Find find;
  int16_t lastkey;    // kRange: last key relative to the first; negative counts from the end
  int16_t keystep;    // kRange and kKeynum: distance between keys
  int16_t limit;      // kRange with lastkey -1: only 1/limit of the remaining arguments
  int16_t keynumidx;  // kKeynum: position of the key count, relative to the begin
  int16_t firstkey;   // kKeynum: position of the first key, relative to the begin
  uint32_t flags;     // KeyFlag
};

struct CommandSpec {
  const char* name;  // lowercase; subcommands as "object|encoding"
  int16_t arity;     // Redis arity: N exact, -N at least N (the name included)
  uint32_t flags;    // command flags (see CommandFlagMask)
  uint32_t acl;      // ACL categories (see AclCategoryMask)
  uint16_t spec_begin, spec_count;
  uint16_t sub_begin, sub_count;
};

// Case-insensitive lookup of a command name (the first argument of a request).
CommandId LookupCommand(std::string_view name);
// The lowercase name of `id`, "unknown" for kUnknownCommand.
std::string_view CommandName(CommandId id);
// Number of top-level ids, kUnknownCommand included.
size_t CommandCount();
// True for the commands compiled into the table (Redis 7.0's own); false for those added from the
// upstream's COMMAND INFO (modules, newer servers).
bool IsBuiltin(CommandId id);

const CommandSpec& Spec(CommandId id);
// The spec a request runs under: the subcommand's when `id` has subcommands and args[1] names
// one, else the command's own. nullptr for an unknown subcommand.
const CommandSpec* ResolveSpec(CommandId id, std::span<const std::string_view> args);
std::span<const KeySpec> KeySpecs(const CommandSpec& spec);
// Every spec in the table, top-level commands first (for tests and coverage reports).
std::span<const CommandSpec> AllSpecs();

// Masks for the names Redis uses in COMMAND INFO: flags ("write", "readonly", ...) and ACL
// categories ("keyspace", "string", "dangerous", ...; with or without '@'). 0 when unknown.
uint32_t CommandFlagMask(std::string_view name);
uint32_t AclCategoryMask(std::string_view name);

// A key found in a request: its position in the arguments (0 is the command name) and how the
// command uses it (KeyFlag).
struct KeyRef {
  uint32_t pos;
  uint32_t flags;
  bool operator==(const KeyRef&) const = default;
};

// Appends the keys of `args` (a whole request, name included) to `out`, as Redis's COMMAND
// GETKEYS finds them: key specs first, and for commands whose specs are incomplete or carry
// variable flags (MIGRATE, SET, BITFIELD) the same parsing Redis does; for SORT/SORT_RO and
// GEORADIUS(BYMEMBER) the destination the command really writes (ParseSort, GeoRadiusStore), for
// XREAD/XREADGROUP the streams the command really reads when its options parse (ParseXread). Returns
// false when the arguments do not fit the specs (Redis will refuse the command); `out` then
// holds nothing for this request. Channel specs (SPUBLISH, SSUBSCRIBE: not_key) are skipped.
bool FindKeys(const CommandSpec& spec, std::span<const std::string_view> args, std::vector<KeyRef>* out);

// SORT/SORT_RO's options as sortCommand executes them (not as Redis's sortGetKeys guesses, which
// takes `SORT k STORE GET STORE x` to store into GET): options start at args[2]; LIMIT takes two
// integers, STORE one key (the last STORE wins; SORT_RO has none), BY and GET one pattern each;
// anything else is a syntax error and the server runs nothing.
struct SortOptions {
  int store = -1;                  // the destination the server writes, -1 for none
  std::vector<uint32_t> patterns;  // positions of BY and GET patterns
  std::vector<uint32_t> gets;      // ... of the GET patterns alone, in order
  std::vector<uint32_t> stores;    // ... of every STORE's destination (`store` is the last)
  std::string_view error;          // the server's error when it refuses the options, else empty
  int by = -1;                     // the BY pattern that applies (the last), -1 for none
  int limit = -1;                  // LIMIT's offset (its count follows), -1 for none
  bool dontsort = false;           // a BY pattern without '*' (even one a later BY replaces)
  bool desc = false;               // DESC (the last of ASC and DESC)
  bool alpha = false;
};
SortOptions ParseSort(bool read_only, std::span<const std::string_view> args);

// XREAD/XREADGROUP's options as xreadCommand (t_stream.c) reads them: from args[1], in any order
// and as often as given, up to STREAMS; BLOCK and COUNT take a value and GROUP two words, each only
// when that many arguments follow it; NOACK takes none; option words compare as the server's
// strcasecmp does (a NUL ends them: "BLOCK\0x" is BLOCK). Their key specs (the first "STREAMS"
// from a fixed place) name other arguments when a group or consumer is called "streams" or the
// options come in another order; these are the keys the server reads.
struct XreadOptions {
  int streams = -1;    // the position of STREAMS; -1 when the server refuses the options
  int keys = 0;        // how many keys follow it (then as many IDs)
  bool block = false;  // a BLOCK option (its timeout unchecked: a bad one is the server's error)
  bool group = false;  // a GROUP option (XREADGROUP needs one)
};
XreadOptions ParseXread(bool xreadgroup, std::span<const std::string_view> args);

// GEORADIUS(BYMEMBER)'s destination as georadiusGeneric parses its options (from args[base],
// base 6 for GEORADIUS, 5 for GEORADIUSBYMEMBER): the last STORE or STOREDIST, whose argument is
// skipped, as COUNT's is; -1 for none, or when the options are refused.
int GeoRadiusStore(std::span<const std::string_view> args, int base);

// Adds the commands of a COMMAND INFO reply (one RESP2 frame, as the upstream sent it) that the
// table does not know yet: module commands (JSON.SET, FT.SEARCH) and those of newer servers,
// with key specs (or, from servers before 7.0, the legacy first/last/step range) and
// subcommands. Not synchronized: call before any worker starts. Returns how many were added.
absl::StatusOr<int> ExtendFromCommandInfo(std::string_view reply);

// Ids the proxy treats specially, resolved once.
struct KnownCommands {
  CommandId multi, exec, discard, subscribe, psubscribe, ssubscribe, unsubscribe, punsubscribe, sunsubscribe, hello,
      monitor, reset, quit, client, watch, unwatch, auth, sync, psync, eval, keys, scan, sort, sort_ro, debug, module;
};
const KnownCommands& Known();

// True when two names are equal ignoring ASCII case.
// Ends each at its first NUL first, as Redis's strcasecmp does with option words.
bool EqualsIgnoreCase(std::string_view a, std::string_view b);

}  // namespace keyguard::commands
