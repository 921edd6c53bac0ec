#include "keyguard/commands/traits.h"

#include <initializer_list>
#include <vector>

namespace keyguard::commands {
namespace {

std::vector<Traits>& Storage() {
  static std::vector<Traits>* table = new std::vector<Traits>();
  return *table;
}

// The facts the command table gives, for every command (modules and newer servers' too).
Traits Derived(CommandId id) {
  Traits t{};
  const CommandSpec& spec = Spec(id);
  t.has_subcommands = spec.sub_count > 0;
  if (id != kUnknownCommand && spec.sub_count == 0) {
    const auto specs = KeySpecs(spec);
    // A spec that finds its keys by a count starting at args[1] (ZUNION, LMPOP, SINTERCARD)
    // has the count there, not a key.
    t.first_key = !specs.empty() && specs[0].begin == KeySpec::kIndex && specs[0].index == 1 &&
                  specs[0].find == KeySpec::kRange && (specs[0].flags & kKeyNotKey) == 0;
  }
  return t;
}

// The hand-written facts about Redis's own commands.
void Describe(std::vector<Traits>& t) {
  auto each = [&](std::initializer_list<const char*> names, auto&& f) {
    for (const char* n : names) {
      const CommandId id = LookupCommand(n);
      if (id != kUnknownCommand) f(t[id]);
    }
  };
  // String writes: where the value is, whether it replaces the whole value, whether it shows the
  // key's size, whether it creates a value that may want a TTL.
  each({"set", "setnx", "getset", "append"}, [](Traits& x) { x.value_pos = 2; });
  each({"setex", "psetex", "setrange"}, [](Traits& x) { x.value_pos = 3; });
  each({"mset", "msetnx"}, [](Traits& x) { x.pairs = true; });
  each({"set", "setnx", "getset", "setex", "psetex", "mset", "msetnx"}, [](Traits& x) { x.rmw_write = true; });
  each({"set", "setnx", "getset", "append", "setex", "psetex", "mset", "msetnx"},
       [](Traits& x) { x.sized_write = true; });
  each({"set", "setnx", "getset", "mset", "msetnx"}, [](Traits& x) { x.needs_ttl = true; });
  each({"set", "setnx", "getset", "append", "setex", "psetex", "setrange", "mset", "msetnx"},
       [](Traits& x) { x.type = KeyType::kString; });
  // TTLs.
  each({"set"}, [](Traits& x) { x.options_from = 3; });
  each({"getex"}, [](Traits& x) { x.options_from = 2; });
  each({"setex", "expire"}, [](Traits& x) { x.ttl_unit = TtlUnit::kSeconds; });
  each({"psetex", "pexpire"}, [](Traits& x) { x.ttl_unit = TtlUnit::kMillis; });
  each({"expireat"}, [](Traits& x) { x.ttl_unit = TtlUnit::kUnixSeconds; });
  each({"pexpireat"}, [](Traits& x) { x.ttl_unit = TtlUnit::kUnixMillis; });
  // Collection writes that may create their key.
  auto creates = [&](std::initializer_list<const char*> names, CreatesKey c) {
    each(names, [&](Traits& x) { x.creates = c; });
  };
  creates({"hset", "hsetnx"}, CreatesKey::kFieldPairs);
  creates({"sadd"}, CreatesKey::kMembers);
  creates({"zadd"}, CreatesKey::kScored);
  creates({"lpush", "rpush"}, CreatesKey::kPushed);
  creates({"hmset", "xadd"}, CreatesKey::kUncounted);
  // Reads: what the reply shows, and of which type.
  auto reads = [&](std::initializer_list<const char*> names, ReplyShows r, KeyType type) {
    each(names, [&](Traits& x) {
      x.reply = r;
      x.type = type;
    });
  };
  reads({"get", "getex", "getdel"}, ReplyShows::kValue, KeyType::kString);
  reads({"strlen"}, ReplyShows::kLength, KeyType::kString);
  reads({"hlen"}, ReplyShows::kCount, KeyType::kHash);
  reads({"scard"}, ReplyShows::kCount, KeyType::kSet);
  reads({"llen"}, ReplyShows::kCount, KeyType::kList);
  reads({"zcard"}, ReplyShows::kCount, KeyType::kZset);
  reads({"xlen"}, ReplyShows::kCount, KeyType::kStream);
  reads({"hgetall", "hkeys", "hvals"}, ReplyShows::kMembers, KeyType::kHash);
  reads({"smembers"}, ReplyShows::kMembers, KeyType::kSet);
  reads({"sinter", "sunion", "sdiff"}, ReplyShows::kComputedMembers, KeyType::kSet);
  reads({"lrange"}, ReplyShows::kMembers, KeyType::kList);
  reads({"zrange", "zrevrange", "zrangebyscore", "zrevrangebyscore", "zrangebylex", "zrevrangebylex"},
        ReplyShows::kMembers, KeyType::kZset);
  reads({"xrange", "xrevrange"}, ReplyShows::kMembers, KeyType::kStream);
  each({"hgetall"}, [](Traits& x) { x.field_value_pairs = true; });
  // Replies that do not show how big the key is.
  each({"hget",    "hmget",    "hexists",   "hincrby",  "hincrbyfloat", "hstrlen", "sismember", "smismember",
        "zscore",  "zmscore",  "zrank",     "zrevrank", "zincrby",      "lindex",  "lset",      "expire",
        "pexpire", "expireat", "pexpireat", "persist",  "getrange",     "setrange"},
       [](Traits& x) { x.probe = true; });
  // Hygiene's other rules.
  each({"keys"}, [](Traits& x) { x.hygiene = HygieneRole::kKeys; });
  each({"flushall", "flushdb"}, [](Traits& x) { x.hygiene = HygieneRole::kFlush; });
  each({"del"}, [](Traits& x) { x.hygiene = HygieneRole::kDel; });
  each({"unlink"}, [](Traits& x) { x.hygiene = HygieneRole::kUnlink; });
  // The key policy's script review.
  auto script = [&](const char* name, ScriptKind k) { each({name}, [&](Traits& x) { x.script = k; }); };
  script("eval", ScriptKind::kEval);
  script("evalsha", ScriptKind::kEvalSha);
  script("fcall", ScriptKind::kFcall);
  script("script", ScriptKind::kScript);
  script("function", ScriptKind::kFunction);
  // Tenancy.
  auto tenant = [&](std::initializer_list<const char*> names, TenantHandling h) {
    each(names, [&](Traits& x) { x.tenant = h; });
  };
  tenant({"flushall", "flushdb"}, TenantHandling::kFlush);
  tenant({"dbsize"}, TenantHandling::kDbsize);
  tenant({"randomkey"}, TenantHandling::kRandomkey);
  tenant({"keys"}, TenantHandling::kKeys);
  tenant({"scan"}, TenantHandling::kScan);
  tenant({"sort", "sort_ro"}, TenantHandling::kSort);
  tenant({"select"}, TenantHandling::kSelect);
  tenant({"copy"}, TenantHandling::kCopy);
  tenant({"migrate"}, TenantHandling::kMigrate);
  tenant({"move", "swapdb", "cluster"}, TenantHandling::kNever);
  tenant({"info"}, TenantHandling::kInfo);
  tenant({"debug"}, TenantHandling::kDebug);
  tenant({"eval", "eval_ro"}, TenantHandling::kEval);
  tenant({"evalsha", "evalsha_ro"}, TenantHandling::kEvalSha);
  tenant({"fcall", "fcall_ro"}, TenantHandling::kFcall);
  tenant({"script"}, TenantHandling::kScript);
  tenant({"function"}, TenantHandling::kFunction);
  tenant({"client"}, TenantHandling::kClient);
  tenant({"pubsub"}, TenantHandling::kPubsub);
  tenant({"subscribe", "unsubscribe", "ssubscribe", "sunsubscribe"}, TenantHandling::kSubscribe);
  tenant({"psubscribe", "punsubscribe"}, TenantHandling::kPsubscribe);
  tenant({"publish", "spublish"}, TenantHandling::kPublish);
  tenant({"blpop", "brpop", "bzpopmin", "bzpopmax", "lmpop", "blmpop", "zmpop", "bzmpop"}, TenantHandling::kFirstKey);
  tenant({"xread", "xreadgroup"}, TenantHandling::kStreams);
  tenant({"restore", "restore-asking"}, TenantHandling::kKeyed);
  tenant({"memory"}, TenantHandling::kMemory);
  // Connection state.
  auto connection = [&](std::initializer_list<const char*> names, ConnectionRole r) {
    each(names, [&](Traits& x) { x.connection = r; });
  };
  connection({"quit"}, ConnectionRole::kQuit);
  connection({"reset"}, ConnectionRole::kReset);
  connection({"multi"}, ConnectionRole::kMulti);
  connection({"exec"}, ConnectionRole::kExec);
  connection({"discard"}, ConnectionRole::kDiscard);
  connection({"watch"}, ConnectionRole::kWatch);
  connection({"unwatch"}, ConnectionRole::kUnwatch);
  connection({"hello"}, ConnectionRole::kHello);
  connection({"monitor"}, ConnectionRole::kMonitor);
  connection({"client"}, ConnectionRole::kClient);
  connection({"sync", "psync"}, ConnectionRole::kSync);
  connection({"subscribe", "psubscribe", "ssubscribe"}, ConnectionRole::kSubscribe);
  connection({"unsubscribe", "punsubscribe", "sunsubscribe"}, ConnectionRole::kUnsubscribe);
}

const Traits* Build() {
  std::vector<Traits>& t = Storage();
  for (size_t id = 0; id < CommandCount(); ++id) t.push_back(Derived(static_cast<CommandId>(id)));
  Describe(t);
  return t.data();
}

}  // namespace

namespace detail {

const Traits* traits = Build();

void ExtendTraits() {
  std::vector<Traits>& t = Storage();
  for (size_t id = t.size(); id < CommandCount(); ++id) t.push_back(Derived(static_cast<CommandId>(id)));
  traits = t.data();
}

}  // namespace detail

std::string_view KeyTypeName(KeyType t) {
  switch (t) {
    case KeyType::kUnknown: return "";
    case KeyType::kString: return "string";
    case KeyType::kHash: return "hash";
    case KeyType::kSet: return "set";
    case KeyType::kList: return "list";
    case KeyType::kZset: return "zset";
    case KeyType::kStream: return "stream";
  }
  return "";
}

}  // namespace keyguard::commands
