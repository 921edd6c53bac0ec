#include "keyguard/commands/traits.h"

#include <gtest/gtest.h>

namespace keyguard::commands {
namespace {

const Traits& Of(const char* name) { return TraitsOf(LookupCommand(name)); }

TEST(TraitsTest, OneCompactEntryPerCommand) {
  EXPECT_EQ(sizeof(Traits), 16u);
  for (size_t id = 0; id < CommandCount(); ++id) {
    const Traits& t = TraitsOf(static_cast<CommandId>(id));
    EXPECT_EQ(t.has_subcommands, Spec(static_cast<CommandId>(id)).sub_count > 0) << CommandName(id);
    if (t.has_subcommands) EXPECT_FALSE(t.first_key) << CommandName(id);
  }
  EXPECT_EQ(TraitsOf(kUnknownCommand).tenant, TenantHandling::kPlain);
  EXPECT_FALSE(TraitsOf(kUnknownCommand).first_key);
}

TEST(TraitsTest, FirstKeyFromTheKeySpecs) {
  for (const char* name : {"get", "set", "hgetall", "incr", "lrange", "sinter", "xadd"}) {
    EXPECT_TRUE(Of(name).first_key) << name;
  }
  // A subcommand first, no key, a channel, a script first, a key count first.
  for (const char* name :
       {"object", "ping", "publish", "eval", "zunion", "zinter", "zdiff", "lmpop", "zmpop", "sintercard"}) {
    EXPECT_FALSE(Of(name).first_key) << name;
  }
}

TEST(TraitsTest, StringWrites) {
  EXPECT_EQ(Of("set").value_pos, 2);
  EXPECT_EQ(Of("setex").value_pos, 3);
  EXPECT_TRUE(Of("set").rmw_write && Of("set").sized_write && Of("set").needs_ttl);
  EXPECT_EQ(Of("set").options_from, 3);
  // APPEND shows a size but does not replace the value; SETRANGE does neither.
  EXPECT_TRUE(Of("append").sized_write);
  EXPECT_FALSE(Of("append").rmw_write);
  EXPECT_EQ(Of("setrange").value_pos, 3);
  EXPECT_FALSE(Of("setrange").sized_write || Of("setrange").rmw_write);
  EXPECT_TRUE(Of("mset").pairs && Of("msetnx").needs_ttl);
  EXPECT_FALSE(Of("setex").needs_ttl);
  EXPECT_EQ(Of("mset").type, KeyType::kString);
}

TEST(TraitsTest, TtlsAndReads) {
  EXPECT_EQ(Of("expire").ttl_unit, TtlUnit::kSeconds);
  EXPECT_EQ(Of("psetex").ttl_unit, TtlUnit::kMillis);
  EXPECT_EQ(Of("expireat").ttl_unit, TtlUnit::kUnixSeconds);
  EXPECT_EQ(Of("pexpireat").ttl_unit, TtlUnit::kUnixMillis);
  EXPECT_EQ(Of("getex").options_from, 2);
  EXPECT_EQ(Of("get").reply, ReplyShows::kValue);
  EXPECT_EQ(Of("strlen").reply, ReplyShows::kLength);
  EXPECT_EQ(Of("zcard").reply, ReplyShows::kCount);
  EXPECT_EQ(Of("zcard").type, KeyType::kZset);
  EXPECT_EQ(Of("hgetall").reply, ReplyShows::kMembers);
  EXPECT_TRUE(Of("hgetall").field_value_pairs);
  EXPECT_FALSE(Of("hkeys").field_value_pairs);
  EXPECT_EQ(Of("sdiff").reply, ReplyShows::kComputedMembers);
  EXPECT_EQ(KeyTypeName(Of("xrange").type), "stream");
  EXPECT_EQ(KeyTypeName(Of("incr").type), "");
  EXPECT_TRUE(Of("hget").probe && Of("expire").probe);
  EXPECT_FALSE(Of("get").probe);
  EXPECT_EQ(Of("keys").hygiene, HygieneRole::kKeys);
  EXPECT_EQ(Of("flushdb").hygiene, HygieneRole::kFlush);
  EXPECT_EQ(Of("unlink").hygiene, HygieneRole::kUnlink);
}

TEST(TraitsTest, ScriptsTenancyAndConnectionState) {
  EXPECT_EQ(Of("evalsha").script, ScriptKind::kEvalSha);
  EXPECT_EQ(Of("function").script, ScriptKind::kFunction);
  EXPECT_EQ(Of("eval_ro").script, ScriptKind::kNone);  // not reviewed by key_policy.scripts
  EXPECT_EQ(Of("eval_ro").tenant, TenantHandling::kEval);
  EXPECT_EQ(Of("swapdb").tenant, TenantHandling::kNever);
  EXPECT_EQ(Of("restore-asking").tenant, TenantHandling::kKeyed);
  EXPECT_EQ(Of("get").tenant, TenantHandling::kPlain);
  EXPECT_EQ(Of("psync").connection, ConnectionRole::kSync);
  EXPECT_EQ(Of("ssubscribe").connection, ConnectionRole::kSubscribe);
  EXPECT_EQ(Of("punsubscribe").connection, ConnectionRole::kUnsubscribe);
  EXPECT_EQ(Of("client").connection, ConnectionRole::kClient);
  EXPECT_EQ(Of("auth").connection, ConnectionRole::kNone);
  EXPECT_EQ(Of("get").connection, ConnectionRole::kNone);
}

}  // namespace
}  // namespace keyguard::commands
