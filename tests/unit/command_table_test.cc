#include "keyguard/commands/command_table.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "keyguard/commands/traits.h"
#include "keyguard/resp/encoder.h"

namespace keyguard::commands {
namespace {

// Keys of a request as strings, or {"!"} when the arguments do not fit the specs.
std::vector<std::string> Keys(std::vector<std::string_view> args) {
  const CommandId id = LookupCommand(args[0]);
  const CommandSpec* spec = ResolveSpec(id, args);
  if (spec == nullptr) return {"?"};
  std::vector<KeyRef> refs;
  if (!FindKeys(*spec, args, &refs)) return {"!"};
  std::vector<std::string> out;
  for (const KeyRef& r : refs) out.emplace_back(args[r.pos]);
  return out;
}

using V = std::vector<std::string>;

TEST(FindKeys, KeySpecShapes) {
  EXPECT_EQ(Keys({"GET", "a"}), V{"a"});
  EXPECT_EQ(Keys({"set", "a", "v", "EX", "10"}), V{"a"});
  EXPECT_EQ(Keys({"MSET", "a", "1", "b", "2", "c", "3"}), (V{"a", "b", "c"}));
  EXPECT_EQ(Keys({"DEL", "a", "b", "c"}), (V{"a", "b", "c"}));
  EXPECT_EQ(Keys({"RENAME", "a", "b"}), (V{"a", "b"}));
  EXPECT_EQ(Keys({"ZUNIONSTORE", "dst", "2", "a", "b", "WEIGHTS", "1", "2"}), (V{"dst", "a", "b"}));
  EXPECT_EQ(Keys({"EVAL", "return 1", "2", "k1", "k2", "arg"}), (V{"k1", "k2"}));
  EXPECT_EQ(Keys({"FCALL", "f", "1", "k1", "arg"}), V{"k1"});
  EXPECT_EQ(Keys({"EVAL", "return 1", "0"}), V{});
  EXPECT_EQ(Keys({"XREAD", "COUNT", "2", "STREAMS", "s1", "s2", "0", "0"}), (V{"s1", "s2"}));
  EXPECT_EQ(Keys({"XREADGROUP", "GROUP", "g", "c", "STREAMS", "streams", "0"}), V{"streams"});
  EXPECT_EQ(Keys({"LMPOP", "2", "l1", "l2", "LEFT"}), (V{"l1", "l2"}));
  EXPECT_EQ(Keys({"BLMPOP", "0", "1", "l1", "RIGHT"}), V{"l1"});
  EXPECT_EQ(Keys({"GEORADIUS", "g", "0", "0", "1", "km", "STORE", "dst"}), (V{"g", "dst"}));
  EXPECT_EQ(Keys({"OBJECT", "ENCODING", "k"}), V{"k"});
  EXPECT_EQ(Keys({"MEMORY", "USAGE", "k", "SAMPLES", "5"}), V{"k"});
  EXPECT_EQ(Keys({"PING"}), V{});
  EXPECT_EQ(Keys({"SPUBLISH", "channel", "msg"}), V{});  // a sharded channel, not a key
}

TEST(FindKeys, InvalidArgumentsFindNothing) {
  // EVAL's keys are optional: a numkeys that does not fit means no keys (COMMAND GETKEYS: []).
  EXPECT_EQ(Keys({"EVAL", "s", "3", "k1"}), V{});
  EXPECT_EQ(Keys({"EVAL", "s", "x", "k1"}), V{});
  EXPECT_EQ(Keys({"BLMPOP", "0", "3", "l1", "LEFT"}), V{"!"});
  EXPECT_EQ(Keys({"ZUNIONSTORE", "dst", "-1", "a"}), V{"!"});
  EXPECT_EQ(Keys({"XREAD", "STREAMS", "s1", "s2", "0"}), (V{"s1"}));  // what COMMAND GETKEYS says
  EXPECT_EQ(Keys({"OBJECT", "NOSUCH", "k"}), V{"?"});
}

TEST(FindKeys, IncompleteSpecsParsedLikeRedis) {
  EXPECT_EQ(Keys({"SORT", "l", "BY", "w_*", "GET", "o_*", "LIMIT", "0", "5", "STORE", "dst"}), (V{"l", "dst"}));
  EXPECT_EQ(Keys({"SORT", "l", "STORE", "d1", "STORE", "d2"}), (V{"l", "d2"}));
  EXPECT_EQ(Keys({"SORT_RO", "l", "BY", "w_*"}), V{"l"});
  // GEORADIUS writes to the last STORE/STOREDIST; its key specs name only the first of each.
  // Keys are what the specs name (as COMMAND GETKEYS, ACL and cluster checks see them) and the
  // destination really written.
  EXPECT_EQ(Keys({"GEORADIUS", "g", "0", "0", "1", "km", "STORE", "d1", "STORE", "d2"}), (V{"g", "d1", "d2"}));
  EXPECT_EQ(Keys({"GEORADIUSBYMEMBER", "g", "m", "1", "km", "STOREDIST", "d1", "STORE", "d2", "STOREDIST", "d3"}),
            (V{"g", "d2", "d1", "d3"}));
}

// Redis reads option words and command names as C strings (strcasecmp): a NUL ends them, so
// "STORE\0" is STORE to the server, and must be to keyguard.
TEST(FindKeys, ANulEndsAnOptionWordOrACommandName) {
  using namespace std::string_view_literals;
  EXPECT_TRUE(EqualsIgnoreCase("STORE\0x"sv, "store"));
  EXPECT_FALSE(EqualsIgnoreCase("STOREx"sv, "store"));
  EXPECT_EQ(LookupCommand("set\0anything"sv), LookupCommand("set"));
  EXPECT_EQ(LookupCommand("\0set"sv), kUnknownCommand);
  EXPECT_EQ(Keys({"GEORADIUS", "src", "0", "0", "1", "km", std::string("STORE\0", 6), "tenant:b:secret"}),
            (V{"src", "tenant:b:secret"}));
  EXPECT_EQ(Keys({"GEORADIUSBYMEMBER", "src", "m", "100", "km", std::string("storedist\0x", 11), "z"}),
            (V{"src", "z"}));
  EXPECT_EQ(Keys({"SORT", "l", std::string("STORE\0", 6), "d"}), (V{"l", "d"}));
}

// What the server executes, not what its key helpers guess (sortGetKeys does not skip STORE's
// argument, so Redis's own COMMAND GETKEYS answers `k GET` for the first case).
TEST(FindKeys, SortAndGeoradiusFollowTheExecutedParse) {
  EXPECT_EQ(Keys({"SORT", "l", "STORE", "GET", "STORE", "Bad_Key"}), (V{"l", "Bad_Key"}));
  EXPECT_EQ(Keys({"SORT", "l", "STORE", "by", "STORE", ""}), (V{"l", ""}));
  EXPECT_EQ(Keys({"sort", "l", "store", "limit", "asc", "store", "Bad Key*"}), (V{"l", "Bad Key*"}));
  EXPECT_EQ(Keys({"SORT", "l", "STORE", "GET", "STORE", "list:b"}), (V{"l", "list:b"}));
  EXPECT_EQ(Keys({"SORT", "l", "GET", "STORE", "STORE", "d"}), (V{"l", "d"}));  // GET's pattern is "STORE"
  EXPECT_EQ(Keys({"SORT", "l", "LIMIT", "0", "STORE", "STORE", "d"}), V{"l"});  // not an integer: nothing runs
  EXPECT_EQ(Keys({"SORT", "l", "NOSUCH", "STORE", "d"}), V{"l"});               // a syntax error
  EXPECT_EQ(Keys({"SORT_RO", "l", "STORE", "d"}), V{"l"});                      // SORT_RO has no STORE
  const SortOptions o = ParseSort(
      false, std::vector<std::string_view>{"SORT", "l", "BY", "STORE", "GET", "#", "GET", "o_*", "STORE", "d"});
  EXPECT_EQ(o.store, 9);
  EXPECT_EQ(o.patterns, (std::vector<uint32_t>{3, 5, 7}));
  EXPECT_EQ(o.gets, (std::vector<uint32_t>{5, 7}));
  EXPECT_EQ(o.by, 3);
  const SortOptions two = ParseSort(
      false, std::vector<std::string_view>{"SORT", "l", "STORE", "a", "GET", "STORE", "store", "b", "DESC", "ALPHA"});
  EXPECT_EQ(two.stores, (std::vector<uint32_t>{3, 7}));  // every STORE; the last applies
  EXPECT_EQ(two.store, 7);
  EXPECT_EQ(two.gets, (std::vector<uint32_t>{5}));
  EXPECT_TRUE(two.desc && two.alpha);
  EXPECT_EQ(ParseSort(false, std::vector<std::string_view>{"SORT", "l", "LIMIT", "x", "1"}).error,
            "ERR value is not an integer or out of range");
  EXPECT_EQ(ParseSort(true, std::vector<std::string_view>{"SORT_RO", "l", "STORE", "d"}).error, "ERR syntax error");
  // GEORADIUS: STORE's and COUNT's arguments are skipped; `STORE store ASC` stores into "store".
  EXPECT_EQ(Keys({"GEORADIUS", "geo:a", "13", "38", "500", "km", "STORE", "store", "ASC"}), (V{"geo:a", "store"}));
  // The specs' STORE here is STOREDIST's argument and their key past the end: the real one stays.
  EXPECT_EQ(Keys({"GEORADIUS", "g", "0", "0", "1", "km", "COUNT", "3", "STOREDIST", "STORE"}), (V{"g", "STORE"}));
  EXPECT_EQ(
      GeoRadiusStore(std::vector<std::string_view>{"GEORADIUS", "g", "0", "0", "1", "km", "COUNT", "STORE", "x"}, 6),
      -1);  // COUNT not an integer: nothing runs
  EXPECT_EQ(
      GeoRadiusStore(std::vector<std::string_view>{"GEORADIUS", "g", "0", "0", "1", "km", "NOSUCH", "STORE", "x"}, 6),
      -1);
  EXPECT_EQ(
      GeoRadiusStore(std::vector<std::string_view>{"GEORADIUS", "g", "0", "0", "1", "km", "ANY", "STORE", "x"}, 6),
      -1);  // ANY without COUNT
  EXPECT_EQ(GeoRadiusStore(std::vector<std::string_view>{"GEORADIUS", "g", "0", "0", "1", "km", "COUNT", "1", "ANY",
                                                         "WITHDIST", "STORE", "x"},
                           6),
            -1);  // STORE with WITHDIST
  EXPECT_EQ(Keys({"MIGRATE", "h", "6379", "k", "0", "100"}), V{"k"});
  EXPECT_EQ(Keys({"MIGRATE", "h", "6379", "", "0", "100", "AUTH", "pw", "KEYS", "a", "b"}), (V{"a", "b"}));
}

TEST(FindKeys, VariableFlags) {
  std::vector<KeyRef> refs;
  std::vector<std::string_view> set_get = {"SET", "k", "v", "GET"};
  ASSERT_TRUE(FindKeys(*ResolveSpec(LookupCommand("set"), set_get), set_get, &refs));
  ASSERT_EQ(refs.size(), 1u);
  EXPECT_EQ(refs[0].flags, kKeyRw | kKeyAccess | kKeyUpdate);
  refs.clear();
  std::vector<std::string_view> set = {"SET", "k", "v"};
  ASSERT_TRUE(FindKeys(*ResolveSpec(LookupCommand("set"), set), set, &refs));
  EXPECT_EQ(refs[0].flags, kKeyOw | kKeyUpdate);
  refs.clear();
  std::vector<std::string_view> bf = {"BITFIELD", "k", "GET", "u8", "0"};
  ASSERT_TRUE(FindKeys(*ResolveSpec(LookupCommand("bitfield"), bf), bf, &refs));
  EXPECT_EQ(refs[0].flags, kKeyRo | kKeyAccess);
}

// SET takes the one-key fast path; its flags still follow GET anywhere after the value, in any
// case, and a SET without its key finds none.
TEST(FindKeys, SetFlagsOnTheFastPath) {
  const CommandSpec& set = *ResolveSpec(LookupCommand("set"), std::vector<std::string_view>{"SET"});
  auto flags = [&](std::vector<std::string_view> args) -> int64_t {
    std::vector<KeyRef> refs;
    if (!FindKeys(set, args, &refs)) return -1;
    EXPECT_EQ(refs.size(), 1u);
    EXPECT_EQ(refs[0].pos, 1u);
    return refs.empty() ? -2 : refs[0].flags;
  };
  EXPECT_EQ(flags({"set", "k", "v", "nx", "get"}), kKeyRw | kKeyAccess | kKeyUpdate);
  EXPECT_EQ(flags({"SET", "k", "v", "EX", "10", "gEt"}), kKeyRw | kKeyAccess | kKeyUpdate);
  EXPECT_EQ(flags({"SET", "k", "get"}), kKeyOw | kKeyUpdate);  // "get" is the value here
  EXPECT_EQ(flags({"SET", "k"}), kKeyOw | kKeyUpdate);         // the server answers the arity error
  EXPECT_EQ(flags({"SET"}), -1);
  // A copy of the spec (not the table's own) is judged by its name, the same way.
  const CommandSpec copy = set;
  std::vector<KeyRef> refs;
  std::vector<std::string_view> args = {"SET", "k", "v", "GET"};
  ASSERT_TRUE(FindKeys(copy, args, &refs));
  EXPECT_EQ(refs[0].flags, kKeyRw | kKeyAccess | kKeyUpdate);
}

TEST(CommandTable, LookupIgnoresCaseAndNeedsTheWholeName) {
  EXPECT_EQ(LookupCommand("SET"), LookupCommand("set"));
  EXPECT_EQ(LookupCommand("sEt"), LookupCommand("set"));
  EXPECT_EQ(CommandName(LookupCommand("GeoRadiusByMember")), "georadiusbymember");
  EXPECT_EQ(LookupCommand("se"), kUnknownCommand);
  EXPECT_EQ(LookupCommand("sett"), kUnknownCommand);
  EXPECT_EQ(LookupCommand(""), kUnknownCommand);
  EXPECT_EQ(LookupCommand(std::string(200, 'a')), kUnknownCommand);
  for (const CommandSpec& s : AllSpecs()) {
    const std::string_view name(s.name);
    if (name.find('|') != std::string_view::npos) continue;  // subcommands are not looked up by name
    EXPECT_EQ(CommandName(LookupCommand(absl::AsciiStrToUpper(std::string(name)))), name);
  }
}

TEST(CommandTable, FlagsAndCategories) {
  const CommandSpec& set = Spec(LookupCommand("set"));
  EXPECT_EQ(set.arity, -3);
  EXPECT_NE(set.flags & CommandFlagMask("write"), 0u);
  EXPECT_NE(set.acl & AclCategoryMask("@string"), 0u);
  EXPECT_EQ(Spec(LookupCommand("get")).flags & CommandFlagMask("write"), 0u);
  EXPECT_NE(Spec(LookupCommand("flushall")).acl & AclCategoryMask("dangerous"), 0u);
  EXPECT_EQ(CommandFlagMask("nosuchflag"), 0u);
  EXPECT_GE(CommandCount(), 230u);
  EXPECT_GT(AllSpecs().size(), CommandCount() + 100);  // subcommands too
}

}  // namespace
}  // namespace keyguard::commands

namespace keyguard::commands {
namespace {

// A COMMAND INFO reply as a server with a module would send it.
std::string ModuleCommandInfo() {
  using namespace resp;
  std::string r;
  AppendArrayHeader(&r, 3);
  // JSON.SET key path value: a 7.0-style entry with a key spec.
  AppendArrayHeader(&r, 10);
  AppendBulk(&r, "json.set");
  AppendInteger(&r, -4);
  AppendArrayHeader(&r, 2);
  AppendSimple(&r, "write");
  AppendSimple(&r, "denyoom");
  AppendInteger(&r, 1);
  AppendInteger(&r, 1);
  AppendInteger(&r, 1);
  AppendArrayHeader(&r, 2);
  AppendSimple(&r, "@write");
  AppendSimple(&r, "@json");
  AppendArrayHeader(&r, 0);
  AppendArrayHeader(&r, 1);
  AppendArrayHeader(&r, 6);
  AppendBulk(&r, "flags");
  AppendArrayHeader(&r, 2);
  AppendSimple(&r, "RW");
  AppendSimple(&r, "update");
  AppendBulk(&r, "begin_search");
  AppendArrayHeader(&r, 4);
  AppendBulk(&r, "type");
  AppendBulk(&r, "index");
  AppendBulk(&r, "spec");
  AppendArrayHeader(&r, 2);
  AppendBulk(&r, "index");
  AppendInteger(&r, 1);
  AppendBulk(&r, "find_keys");
  AppendArrayHeader(&r, 4);
  AppendBulk(&r, "type");
  AppendBulk(&r, "range");
  AppendBulk(&r, "spec");
  AppendArrayHeader(&r, 6);
  AppendBulk(&r, "lastkey");
  AppendInteger(&r, 0);
  AppendBulk(&r, "keystep");
  AppendInteger(&r, 1);
  AppendBulk(&r, "limit");
  AppendInteger(&r, 0);
  AppendArrayHeader(&r, 0);
  // A pre-7.0 entry: first key 1, last key -1, step 2 (key value key value ...).
  AppendArrayHeader(&r, 6);
  AppendBulk(&r, "legacy.mset");
  AppendInteger(&r, -3);
  AppendArrayHeader(&r, 1);
  AppendSimple(&r, "write");
  AppendInteger(&r, 1);
  AppendInteger(&r, -1);
  AppendInteger(&r, 2);
  // A command the table knows already: left alone.
  AppendArrayHeader(&r, 6);
  AppendBulk(&r, "get");
  AppendInteger(&r, 99);
  AppendArrayHeader(&r, 0);
  AppendInteger(&r, 0);
  AppendInteger(&r, 0);
  AppendInteger(&r, 0);
  return r;
}

TEST(CommandTable, ExtendsFromUpstreamCommandInfo) {
  const size_t before = CommandCount();
  ASSERT_EQ(LookupCommand("JSON.SET"), kUnknownCommand);
  auto added = ExtendFromCommandInfo(ModuleCommandInfo());
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  EXPECT_EQ(*added, 2);
  EXPECT_EQ(CommandCount(), before + 2);
  const CommandId json_set = LookupCommand("JSON.SET");
  ASSERT_NE(json_set, kUnknownCommand);
  EXPECT_EQ(CommandName(json_set), "json.set");
  EXPECT_NE(Spec(json_set).flags & CommandFlagMask("write"), 0u);
  EXPECT_EQ(Keys({"JSON.SET", "doc:1", "$", "{}"}), V{"doc:1"});
  EXPECT_EQ(Keys({"legacy.mset", "a", "1", "b", "2"}), (V{"a", "b"}));
  EXPECT_EQ(Spec(LookupCommand("get")).arity, 2);  // known commands keep the built-in entry
  // Added commands get the traits the table gives: args[1] is JSON.SET's first key.
  EXPECT_TRUE(TraitsOf(json_set).first_key);
  EXPECT_FALSE(TraitsOf(json_set).has_subcommands);
  EXPECT_EQ(TraitsOf(json_set).tenant, TenantHandling::kPlain);
  EXPECT_TRUE(TraitsOf(LookupCommand("legacy.mset")).first_key);
  EXPECT_FALSE(ExtendFromCommandInfo("-NOAUTH Authentication required.\r\n").ok());
  EXPECT_FALSE(ExtendFromCommandInfo("garbage").ok());
}

}  // namespace
}  // namespace keyguard::commands
