// Shared upstream connections (upstream_connections: shared): which client commands a shared,
// pipelined connection cannot serve exactly, because they start state that belongs to one
// connection. Such a client is pinned to an upstream connection of its own first. Sans-io.
//
// A shared connection stays in the state a new connection has (RESP2, database 0, keyguard's
// user, no name, no subscriptions, no tracking, every reply on): every command that would change
// that, or wait on it, pins. A transaction or a blocking command pins until it ends (the
// connection goes back to the idle pool); everything else pins for the rest of the client's
// connection. docs/configuration.md has the table.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "keyguard/commands/command_table.h"

namespace keyguard::proxy {

enum class PinReason : uint8_t {
  kNone,
  kTransaction,  // MULTI, WATCH: until EXEC, DISCARD or UNWATCH
  kBlocking,     // BLPOP and the blocking family, XREAD(GROUP) BLOCK, WAIT, WAITAOF: until the reply
  kPubSub,       // SUBSCRIBE, PSUBSCRIBE, SSUBSCRIBE and their UNSUBSCRIBEs
  kMonitor,      // MONITOR
  kClient,       // CLIENT (a name, tracking, reply modes, its id), READONLY, READWRITE, ASKING
  kSelect,       // SELECT of a database other than 0
  kHello,        // HELLO (a protocol, a name, credentials)
  kAuth,         // AUTH as a user of the client's own (not with tenancy: keyguard answers it)
  kReset,        // RESET
  kReplication,  // SYNC, PSYNC, REPLCONF: the connection becomes a replica's
  kControl,      // SCRIPT KILL, FUNCTION KILL: heard while a script holds the shared connection: until the reply
  kCount,
};

// "transaction", "blocking", ... (the label of keyguard_upstream_pins_total: metrics::kPinReasonNames,
// in this enum's order).
const char* PinReasonName(PinReason r);

// Whether a pin for `r` ends with its state (the client goes back to the shared connection).
inline bool PinEnds(PinReason r) {
  return r == PinReason::kTransaction || r == PinReason::kBlocking || r == PinReason::kControl;
}

// What command `id` with `args` (the name included) needs: kNone when a shared connection serves
// it as a connection of the client's own would. `tenancy`: keyguard answers AUTH itself.
// One table load for every command but the few whose arguments decide (SELECT, XREAD).
PinReason PinFor(commands::CommandId id, std::span<const std::string_view> args, bool tenancy);

// By command id (CommandCount() of them): 0 when PinFor is kNone whatever the arguments, so the
// caller's check of the common command is one load.
const uint8_t* PinClasses();

// By command id, the lane of a client's shared connections a command goes to, so that reads never
// wait behind a command a server under CLIENT PAUSE WRITE holds, or behind a script: 1 (write
// lane) for a command flagged `write`, one of 7.0's may-replicate commands (which COMMAND INFO
// does not show: EVAL, EVALSHA, FCALL, PUBLISH, SPUBLISH, PFCOUNT) or any other script (EVAL_RO,
// EVALSHA_RO, FCALL_RO: a long one would hold the reads behind it); 2 for a command whose
// subcommand decides (XGROUP, FUNCTION, ...: LaneWrites); 0 (read lane) for the rest, an unknown
// command too (the server refuses it before its pause check). `tenancy`: DBSIZE and RANDOMKEY
// are 1 (a tenant's run as walk scripts).
const uint8_t* WriteLaneClasses(bool tenancy);
// Whether the command goes to the write lane: its class, its subcommand's flags for class 2; a
// command of the wrong arity does not (the server refuses it before its pause check).
bool LaneWrites(const uint8_t* classes, commands::CommandId id, std::span<const std::string_view> args);

}  // namespace keyguard::proxy
