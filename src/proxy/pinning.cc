#include "proxy/pinning.h"

#include <array>
#include <vector>

#include "keyguard/commands/traits.h"
#include "keyguard/metrics/registry.h"

namespace keyguard::proxy {
namespace {

using commands::ConnectionRole;

// Decided by the arguments, not the id alone.
constexpr uint8_t kByArgs = static_cast<uint8_t>(PinReason::kCount);

struct Table {
  std::vector<uint8_t> by_id;
  commands::CommandId select, xread, xreadgroup, client, hello, script, function;
};

PinReason ByRole(ConnectionRole role) {
  switch (role) {
    case ConnectionRole::kMulti:
    case ConnectionRole::kWatch: return PinReason::kTransaction;
    case ConnectionRole::kHello: return PinReason::kHello;
    case ConnectionRole::kMonitor: return PinReason::kMonitor;
    case ConnectionRole::kClient: return PinReason::kClient;
    case ConnectionRole::kSync: return PinReason::kReplication;
    case ConnectionRole::kSubscribe:
    case ConnectionRole::kUnsubscribe: return PinReason::kPubSub;
    case ConnectionRole::kReset: return PinReason::kReset;
    // EXEC, DISCARD, UNWATCH outside a transaction answer an error or OK and change nothing; QUIT
    // is answered by keyguard on a shared connection.
    case ConnectionRole::kNone:
    case ConnectionRole::kExec:
    case ConnectionRole::kDiscard:
    case ConnectionRole::kUnwatch:
    case ConnectionRole::kQuit: break;
  }
  return PinReason::kNone;
}

// Built on first use, after the command table took the upstream's extra commands.
const Table& PinTable() {
  static const Table table = [] {
    Table t;
    t.select = commands::LookupCommand("select");
    t.xread = commands::LookupCommand("xread");
    t.xreadgroup = commands::LookupCommand("xreadgroup");
    t.client = commands::Known().client;
    t.hello = commands::Known().hello;
    t.script = commands::LookupCommand("script");
    t.function = commands::LookupCommand("function");
    const uint32_t blocking = commands::CommandFlagMask("blocking");
    const commands::CommandId client_state[] = {
        commands::LookupCommand("readonly"), commands::LookupCommand("readwrite"), commands::LookupCommand("asking")};
    t.by_id.assign(commands::CommandCount(), 0);
    for (size_t i = 0; i < t.by_id.size(); ++i) {
      const auto id = static_cast<commands::CommandId>(i);
      PinReason r = ByRole(commands::TraitsOf(id).connection);
      if (r == PinReason::kNone && (commands::Spec(id).flags & blocking) != 0) r = PinReason::kBlocking;
      t.by_id[i] = static_cast<uint8_t>(r);
    }
    for (commands::CommandId id : client_state) t.by_id[id] = static_cast<uint8_t>(PinReason::kClient);
    // REPLCONF sets up the replication that SYNC/PSYNC start (redis-cli --functions-rdb filters
    // the dump with it): both on the same connection.
    t.by_id[commands::LookupCommand("replconf")] = static_cast<uint8_t>(PinReason::kReplication);
    t.by_id[commands::Known().auth] = static_cast<uint8_t>(PinReason::kAuth);
    // WAIT (and WAITAOF, on servers that have it) block without the `blocking` flag.
    for (std::string_view name : {"wait", "waitaof"}) {
      const commands::CommandId id = commands::LookupCommand(name);
      if (id != commands::kUnknownCommand) t.by_id[id] = static_cast<uint8_t>(PinReason::kBlocking);
    }
    for (commands::CommandId id : {t.select, t.xread, t.xreadgroup, t.client, t.hello, t.script, t.function}) {
      if (id != commands::kUnknownCommand) t.by_id[id] = kByArgs;
    }
    return t;
  }();
  return table;
}

}  // namespace

static_assert(static_cast<size_t>(PinReason::kCount) == metrics::kPinReasons, "a name for each reason");

const char* PinReasonName(PinReason r) {
  const auto i = static_cast<size_t>(r);
  return i < metrics::kPinReasons ? metrics::kPinReasonNames[i] : "none";
}

const uint8_t* PinClasses() { return PinTable().by_id.data(); }

const uint8_t* WriteLaneClasses(bool tenancy) {
  static const std::array<std::vector<uint8_t>, 2> tables = [] {
    std::vector<uint8_t> t(commands::CommandCount(), 0);
    const uint32_t write = commands::CommandFlagMask("write");
    for (size_t i = 0; i < t.size(); ++i) {
      const commands::CommandSpec& spec = commands::Spec(static_cast<commands::CommandId>(i));
      if ((spec.flags & write) != 0) t[i] = 1;
      if (spec.sub_count > 0) t[i] = 2;
    }
    for (std::string_view name :
         {"eval", "evalsha", "fcall", "publish", "spublish", "pfcount", "eval_ro", "evalsha_ro", "fcall_ro"}) {
      if (const commands::CommandId id = commands::LookupCommand(name); id != commands::kUnknownCommand) t[id] = 1;
    }
    t[commands::kUnknownCommand] = 0;
    std::vector<uint8_t> walks = t;
    for (std::string_view name : {"dbsize", "randomkey"}) walks[commands::LookupCommand(name)] = 1;
    return std::array<std::vector<uint8_t>, 2>{std::move(t), std::move(walks)};
  }();
  return tables[tenancy ? 1 : 0].data();
}

bool LaneWrites(const uint8_t* classes, commands::CommandId id, std::span<const std::string_view> args) {
  const uint8_t c = classes[id];
  if (c == 0) return false;
  const commands::CommandSpec* spec = &commands::Spec(id);
  if (c == 2) {
    spec = commands::ResolveSpec(id, args);
    if (spec == nullptr || spec == &commands::Spec(id)) return false;  // an unknown subcommand: refused
    static const uint32_t write = commands::CommandFlagMask("write");
    if ((spec->flags & write) == 0) return false;
  }
  const auto n = static_cast<int64_t>(args.size());
  return spec->arity >= 0 ? n == spec->arity : n >= -int64_t{spec->arity};
}

PinReason PinFor(commands::CommandId id, std::span<const std::string_view> args, bool tenancy) {
  const Table& t = PinTable();
  const uint8_t v = id < t.by_id.size() ? t.by_id[id] : 0;
  if (v == 0) return PinReason::kNone;
  if (v != kByArgs) {
    if (tenancy && v == static_cast<uint8_t>(PinReason::kAuth)) return PinReason::kNone;
    return static_cast<PinReason>(v);
  }
  if (id == t.select) {
    // SELECT 0 (or a bad argument, which the server refuses) leaves the connection where it is.
    const bool zero = args.size() == 2 && args[1] == "0";
    return zero || args.size() != 2 ? PinReason::kNone : PinReason::kSelect;
  }
  if (id == t.client) {
    // CLIENT SETNAME and GETNAME are answered by keyguard on a shared connection (the name is
    // the client's, kept by keyguard); SETINFO (a library's name and version) goes to the shared
    // connection, whose server answers it (7.0 does not know it) and whose CLIENT LIST it names.
    if (args.size() >= 2 &&
        (commands::EqualsIgnoreCase(args[1], "setname") || commands::EqualsIgnoreCase(args[1], "getname") ||
         commands::EqualsIgnoreCase(args[1], "setinfo"))) {
      return PinReason::kNone;
    }
    return PinReason::kClient;
  }
  if (id == t.hello) {
    // HELLO, or HELLO 2, without AUTH or SETNAME changes nothing a shared connection has (it
    // speaks RESP2): its reply is the shared connection's. RESP3, credentials or a name pin.
    // (With tenancy, HELLO is how a client logs in: it pins as before.)
    const bool plain = !tenancy && (args.size() == 1 || (args.size() == 2 && args[1] == "2"));
    return plain ? PinReason::kNone : PinReason::kHello;
  }
  if (id == t.script || id == t.function) {
    // SCRIPT KILL, FUNCTION KILL: the script to kill may be running on the client's shared
    // connection (its reply is what every command behind it waits for), where the kill would wait
    // behind it for ever. They go on a connection of their own, which the server reads while it
    // runs the script (after busy-reply-threshold), and the client comes back with the reply.
    return args.size() == 2 && commands::EqualsIgnoreCase(args[1], "kill") ? PinReason::kControl : PinReason::kNone;
  }
  // XREAD, XREADGROUP: with a BLOCK among options the server accepts (a bad timeout is then its
  // error: a pin for nothing, never a block missed).
  return commands::ParseXread(id == t.xreadgroup, args).block ? PinReason::kBlocking : PinReason::kNone;
}

}  // namespace keyguard::proxy
