#include "keyguard/policy/key_policy.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "keyguard/config/config.h"
#include "keyguard/policy/key_pattern.h"

namespace keyguard::policy {
namespace {

std::shared_ptr<const KeyPolicy> FromYaml(const std::string& yaml) {
  auto c = config::ParseConfig(yaml);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? c->key_policy : nullptr;
}

// "rule:suggestion" for every rule `key` breaks under `command`.
std::vector<std::string> Broken(const KeyPolicy& p, std::string_view key, std::string_view command = "set") {
  const commands::CommandId id = commands::LookupCommand(command);
  std::vector<Violation> v;
  p.Check(key, id, commands::Spec(id), &v);
  std::vector<std::string> out;
  for (const Violation& x : v) out.push_back(x.rule->name + (x.suggestion.empty() ? "" : ":" + x.suggestion));
  return out;
}

using V = std::vector<std::string>;

TEST(KeyPolicy, DefaultRulesObserveAndConformingKeysPass) {
  auto p = KeyPolicy::Default();
  for (const Rule& r : p->rules()) EXPECT_EQ(r.action, Action::kObserve) << r.name;
  for (const char* ok : {"user:1001:profile", "game:space-invaders:leaderboard", "session:ab12", "a", "x.y_z-w|v",
                         "cart:{user:7}:items"}) {
    EXPECT_EQ(Broken(*p, ok), V{}) << ok;
  }
}

struct Case {
  const char* key;
  V broken;
};

TEST(KeyPolicy, EveryBuiltinRule) {
  auto p = KeyPolicy::Default();
  const Case cases[] = {
      {"User_1001_Profile", {"lowercase:user:1001:profile"}},
      {"userProfile", {"lowercase:user:profile"}},
      {"user#1", {"charset"}},
      {"user 1", {"charset", "forbidden_characters"}},
      {"1user", {"starts_with_letter"}},
      {":user", {"starts_with_letter"}},
      {"user:*", {"charset", "forbidden_characters"}},
      {"user\x01", {"charset", "forbidden_characters"}},
      {"user:\"q\"", {"charset", "forbidden_characters"}},
      {"a{b", {"hash_tags"}},
      {"a{b}{c}", {"hash_tags"}},
      {"a{}", {"hash_tags"}},
      {"https://example.com/x", {"charset", "no_opaque_segments"}},
      {"a:b:c:d:e:f:g:h:i", {"max_segments"}},
  };
  for (const Case& c : cases) EXPECT_EQ(Broken(*p, c.key), c.broken) << c.key;
  EXPECT_EQ(Broken(*p, std::string(129, 'a')), (V{"max_length", "no_opaque_segments"}));
  EXPECT_EQ(Broken(*p, "blob:" + std::string(65, 'x')), V{"no_opaque_segments"});
  EXPECT_EQ(Broken(*p, "User.Name"), (V{"lowercase:user:name"}));
}

// Conforms is Check's fast path on its own: true only for keys no rule breaks under any command,
// and, with only shape rules, true for every such key without braces, at each limit's edge.
TEST(KeyPolicy, ConformsAgreesWithCheck) {
  auto p = KeyPolicy::Default();
  const std::string seg64(64, 's'), seg65(65, 's');
  const std::vector<std::string> keys = {
      "",
      "a",
      "ab",
      "abc",
      "abcd",
      "abcde",
      "key:000000012345",
      "user:1001:profile",
      "a:b:c:d:e:f:g:h",    // 8 segments: the limit
      "a:b:c:d:e:f:g:h:i",  // 9
      "a:b:c:d:e:f:g::",
      "::::::::",
      "x:" + seg64 + ":y",
      "x:" + seg65 + ":y",
      "x:" + seg64,
      "x:" + seg65,
      seg64,
      seg65,
      std::string(128, 'a'),
      std::string(129, 'a'),
      "a:" + std::string(125, 'b') + ":",
      "{user:1001}:profile",
      "{1001}:profile",
      "cart:{user:7}:items",
      "a{b",
      "userProfile",
      "user#1",
      "user 1",
      "1user",
      "https://example.com/x",
      "user\x01",
  };
  auto tuned = FromYaml(R"(
key_policy:
  allowed_punctuation: ":/._"
  max_segment_bytes: 8
  max_segment_count: 3
)");
  ASSERT_NE(tuned, nullptr);
  auto listed = FromYaml("key_policy: {entities: [user]}\n");
  ASSERT_NE(listed, nullptr);
  for (const KeyPolicy* policy : {p.get(), tuned.get(), listed.get()}) {
    for (std::string key : keys) {
      for (std::string k : {key, key + "://x", "a/" + key}) {
        const bool clean = Broken(*policy, k, "set").empty() && Broken(*policy, k, "get").empty();
        if (policy->Conforms(k)) EXPECT_TRUE(clean) << k;
        // Hash tags are judged by the rules (well formed or not), never on the fast path.
        const bool braces = k.find_first_of("{}") != std::string::npos;
        if (policy != listed.get() && !braces) EXPECT_EQ(policy->Conforms(k), clean) << k;
      }
    }
  }
  EXPECT_FALSE(listed->Conforms("user:1"));  // an entity rule looks at more than the shape
  EXPECT_TRUE(FromYaml("key_policy: {enabled: false}\n")->Conforms("Bad Key*"));  // no rules
}

TEST(KeyPolicy, ALeadingHashTagStartsWithItsLetter) {
  auto p = KeyPolicy::Default();
  EXPECT_EQ(Broken(*p, "{user:1001}:profile"), V{});
  EXPECT_EQ(Broken(*p, "{1001}:profile"), V{"starts_with_letter"});
  EXPECT_EQ(Broken(*p, "{"), (V{"starts_with_letter", "hash_tags"}));
}

// Which keys a command may create: what the key policy refuses. Reading, expiring, deleting and
// renaming away an existing bad name is never refused.
// Whether the rule `pattern` -> `rewrite` ($1 form) can be reversed, and the old name of `key`.
std::string OldNameOf(const std::string& pattern, const std::string& rewrite, const std::string& key) {
  auto p = FromYaml("key_policy:\n  rules:\n    - {name: r, pattern: '" + pattern + "', rewrite: '" + rewrite +
                    "', action: rewrite}\n");
  if (p == nullptr) return "(bad config)";
  if (!p->has_reversible_rules()) return "(not reversible)";
  return p->OldName(key).value_or("(none)");
}

TEST(KeyPolicy, ReversibleRewriteRulesGiveTheOldNameBack) {
  struct Case {
    const char* pattern;
    const char* rewrite;
    const char* key;
    const char* old;
  };
  const Case cases[] = {
      {"^User_(\\d+)_Profile$", "user:$1:profile", "user:1001:profile", "User_1001_Profile"},
      {"^User_(\\d+)_Profile$", "user:$1:profile", "user:x:profile", "(none)"},
      {"^User_(\\d+)_Profile$", "user:$1:profile", "order:1:profile", "(none)"},
      // Groups in another order, escaped literals, an unanchored pattern.
      {"^Cart\\.([a-z]+)-(\\d+)$", "cart:$2:$1", "cart:7:eu", "Cart.eu-7"},
      {"Session_([0-9a-f]+)", "session:$1", "session:beef", "Session_beef"},
      // Checked both ways: a name the rule would not have made has no old name.
      {"^Item_([0-9]+)$", "item:$1", "item:0x", "(none)"},
      // Not reversible: a class escape outside a group, a group left out or used twice, two
      // groups with nothing between them, a nested group, a non-capturing group.
      {"^User_\\d+_(\\w+)$", "user:$1", "user:a", "(not reversible)"},
      {"^User_(\\d+)_(\\w+)$", "user:$1", "user:1", "(not reversible)"},
      {"^User_(\\d+)$", "user:$1:$1", "user:1:1", "(not reversible)"},
      {"^a(\\d+)b(\\d+)$", "x:$1$2", "x:12", "(not reversible)"},
      {"^a((\\d)+)$", "x:$1", "x:1", "(not reversible)"},
      {"^a(?:b)(\\d+)$", "x:$1", "x:1", "(not reversible)"},
  };
  for (const Case& c : cases) EXPECT_EQ(OldNameOf(c.pattern, c.rewrite, c.key), c.old) << c.pattern << " " << c.key;
}

TEST(MayCreateKey, ByKeySpecFlagsAndDenyoom) {
  auto creates = [](std::vector<std::string_view> args) {
    const commands::CommandId id = commands::LookupCommand(args[0]);
    const commands::CommandSpec* spec = commands::ResolveSpec(id, args);
    std::vector<commands::KeyRef> keys;
    EXPECT_TRUE(spec != nullptr && commands::FindKeys(*spec, args, &keys));
    std::string out;
    for (const commands::KeyRef& k : keys) out += MayCreateKey(k.flags, *spec) ? "c" : "-";
    return out;
  };
  for (auto args : std::vector<std::vector<std::string_view>>{{"GET", "k"},
                                                              {"EXISTS", "k"},
                                                              {"TTL", "k"},
                                                              {"DUMP", "k"},
                                                              {"WATCH", "k"},
                                                              {"EXPIRE", "k", "1"},
                                                              {"PERSIST", "k"},
                                                              {"DEL", "k"},
                                                              {"UNLINK", "k"},
                                                              {"GETDEL", "k"},
                                                              {"LPOP", "k"},
                                                              {"HDEL", "k", "f"},
                                                              {"TYPE", "k"},
                                                              {"OBJECT", "ENCODING", "k"},
                                                              {"GETEX", "k", "EX", "1"}}) {
    EXPECT_EQ(creates(args), "-") << args[0];
  }
  for (auto args : std::vector<std::vector<std::string_view>>{{"SET", "k", "v"},
                                                              {"SET", "k", "v", "GET"},
                                                              {"INCR", "k"},
                                                              {"HSET", "k", "f", "v"},
                                                              {"LPUSH", "k", "v"},
                                                              {"APPEND", "k", "v"},
                                                              {"SETRANGE", "k", "0", "v"},
                                                              {"RESTORE", "k", "0", "x"},
                                                              {"XADD", "k", "*", "f", "v"},
                                                              {"PFADD", "k", "a"}}) {
    EXPECT_EQ(creates(args), "c") << args[0];
  }
  EXPECT_EQ(creates({"RENAME", "old", "new"}), "-c");  // the source is renamed away
  EXPECT_EQ(creates({"COPY", "src", "dst"}), "-c");
  EXPECT_EQ(creates({"SMOVE", "src", "dst", "m"}), "-c");
  EXPECT_EQ(creates({"LMOVE", "src", "dst", "LEFT", "RIGHT"}), "-c");
  EXPECT_EQ(creates({"ZUNIONSTORE", "dst", "2", "a", "b"}), "c--");
}

TEST(KeyPolicy, TunedRulesEntitiesPrefixAndUserRules) {
  auto p = FromYaml(R"(
key_policy:
  default_action: reject
  allowed_punctuation: ":_"
  max_length_bytes: 20
  max_segment_count: 3
  entities: [user, game]
  required_prefix: "user:"
  hash_tags: {enabled: false}
  rules:
    - name: legacy-profile
      pattern: '^User_(\d+)_Profile$'
      rewrite: 'user:$1:profile'
      action: rewrite
)");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->rules().front().name, "legacy-profile");
  EXPECT_EQ(p->rules().front().action, Action::kRewrite);
  EXPECT_EQ(p->rules().back().action, Action::kReject);
  EXPECT_EQ(Broken(*p, "user:1"), V{});
  EXPECT_EQ(Broken(*p, "game:1"), V{"prefix"});
  EXPECT_EQ(Broken(*p, "cart:1"), (V{"entity_allow_list", "prefix"}));
  EXPECT_EQ(Broken(*p, "user:a.b"), V{"charset:user:a:b"});  // '.' no longer allowed
  EXPECT_EQ(Broken(*p, "user:a:b:c"), V{"max_segments"});
  EXPECT_EQ(Broken(*p, "user:aaaaaaaaaaaaaaaaaaaa"), V{"max_length"});
  EXPECT_EQ(Broken(*p, "User_42_Profile"),
            (V{"legacy-profile:user:42:profile", "lowercase:user:42:profile", "entity_allow_list", "prefix"}));
}

TEST(KeyPolicy, ScopeByCommandAndCategory) {
  auto p = FromYaml(R"(
key_policy:
  lowercase: {scope: {categories: [write]}}
  charset: {scope: {commands: [hset]}}
  starts_with_letter: {enabled: false}
)");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(Broken(*p, "A#", "set"), V{"lowercase:a#"});
  EXPECT_EQ(Broken(*p, "A#", "get"), V{});
  EXPECT_EQ(Broken(*p, "A#", "hset"), (V{"lowercase:a#", "charset"}));
  EXPECT_EQ(Broken(*p, "1a", "get"), V{});
}

TEST(KeyPolicy, Normalize) {
  EXPECT_EQ(KeyPolicy::Normalize("User_1001_Profile"), "user:1001:profile");
  EXPECT_EQ(KeyPolicy::Normalize("getUserById"), "get:user:by:id");
  EXPECT_EQ(KeyPolicy::Normalize("order-items.v2Beta"), "order:items:v2:beta");
  EXPECT_EQ(KeyPolicy::Normalize("__a__"), "a");
  EXPECT_EQ(KeyPolicy::Normalize("ABC"), "abc");
}

TEST(KeyPattern, FoldsVariableSegments) {
  EXPECT_EQ(KeyPattern("user:1001:profile"), "user:{id}:profile");
  EXPECT_EQ(KeyPattern("User_1001_Profile"), "User_{id}_Profile");
  EXPECT_EQ(KeyPattern("session:3f2b8c1d9e:data"), "session:{id}:data");
  EXPECT_EQ(KeyPattern("order:123e4567-e89b-12d3-a456-426614174000"), "order:{id}");
  EXPECT_EQ(KeyPattern("blob:" + std::string(30, 'x')), "blob:{id}");
  EXPECT_EQ(KeyPattern("game:space-invaders:leaderboard"), "game:space-invaders:leaderboard");
  EXPECT_EQ(KeyPattern("a\"b\\c\n"), "a?b?c?");
}

}  // namespace
}  // namespace keyguard::policy
