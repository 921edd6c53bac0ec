// The per-command pipeline without a proxy: a config, a command and the connection's state in, one
// verdict out (forward what, refuse why, log in whom, walk which keys), and the counters it moved.
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "proxy/pipeline.h"

namespace keyguard::proxy {
namespace {

class NoSink : public hygiene::FindingSink {
 public:
  void Stamp(hygiene::Finding* f, std::string_view, commands::CommandId) override {
    f->action = settings->action(f->kind);
  }
  void Report(hygiene::Finding f) override { findings.push_back(std::move(f)); }
  void WakeProbe() override {}
  const hygiene::Settings* settings = nullptr;
  std::vector<hygiene::Finding> findings;
};

std::string Join(std::span<const std::string_view> args) {
  std::string out;
  for (std::string_view a : args) {
    if (!out.empty()) out.push_back(' ');
    out.append(a.data(), a.size());
  }
  return out;
}

// "EVAL <the move script> <keys>": the prelude that moves legacy keys.
std::string Move(const std::string& keys) { return "EVAL " + std::string(kMoveLegacyScript) + " " + keys; }

// One connection through the pipeline of one worker, with the settings of `yaml`.
class Connection {
 public:
  explicit Connection(const std::string& yaml) {
    auto parsed = config::ParseConfig(yaml);
    if (!parsed.ok()) throw std::runtime_error(std::string(parsed.status().message()));
    config_ = std::make_shared<const config::ProxyConfig>(*parsed);
    store_ = std::make_unique<config::ConfigStore>(config_, "");
    shared_ = std::make_unique<StageShared>(*config_, *store_, &shard_, &connections_);
    sink_.settings = &config_->hygiene;
    hygiene_ = std::make_unique<hygiene::WorkerDetectors>(config_->hygiene);
    detectors_ = std::make_unique<hygiene::ConnectionDetectors>(config_->hygiene, *hygiene_, sink_, 1);
    pipeline_ = std::make_unique<CommandPipeline>(*shared_, *detectors_);
  }

  // Runs `line` (words split at spaces) and returns the verdict; `upstream` gets what would be sent.
  const Verdict& Run(const std::string& line) {
    pipeline_->Release();
    words_ = absl::StrSplit(line, ' ');
    args_.assign(words_.begin(), words_.end());
    CommandContext c;
    c.id = commands::LookupCommand(args_[0]);
    c.args = args_;
    c.mode = state.TakeReplyMode();
    c.tenant = tenant;
    c.state = &state;
    c.queue = &queue;
    c.upstream_ready = upstream_ready;
    c.client = "127.0.0.1:5555";
    const Verdict& v = pipeline_->Run(c);
    upstream = Join(v.args);
    prelude = Join(v.prelude);
    if (v.action == Verdict::Action::kLogin && v.bind) tenant = v.login;
    if (v.action == Verdict::Action::kRefuse) state.OnRefused();
    if (v.action == Verdict::Action::kForward) {
      Pending p;
      state.OnForward(c.id, args_, c.mode, tenant != nullptr, &p);
    }
    return v;
  }

  // The value of the counter of `family` with exactly these label values, 0 when absent.
  template <typename Family>
  uint64_t Count(const Family& family, const typename Family::Values& values) const {
    uint64_t n = 0;
    family.ForEach([&](const typename Family::Values& v, uint64_t value) {
      if (v == values) n = value;
    });
    return n;
  }

  const tenant::Tenant* StaticTenant() const { return config_->tenancy->static_tenant(); }
  std::vector<std::pair<std::string, std::string>>& patterns_renamed() { return pipeline_->patterns_renamed(); }

  metrics::WorkerShard shard_;
  ConnectionState state;
  ReplyQueue queue;
  const tenant::Tenant* tenant = nullptr;
  bool upstream_ready = true;
  std::string upstream;
  std::string prelude;  // keyguard's own command sent first
  NoSink sink_;

 private:
  std::shared_ptr<const config::ProxyConfig> config_;
  std::unique_ptr<config::ConfigStore> store_;
  tenant::Connections connections_;
  std::unique_ptr<StageShared> shared_;
  std::unique_ptr<hygiene::WorkerDetectors> hygiene_;
  std::unique_ptr<hygiene::ConnectionDetectors> detectors_;
  std::unique_ptr<CommandPipeline> pipeline_;
  std::vector<std::string> words_;
  std::vector<std::string_view> args_;
};

using Action = Verdict::Action;

TEST(PipelineTest, WithNothingToDoTheClientsOwnArgumentsGoAsTheyAre) {
  Connection c("key_policy: {enabled: false}\nhygiene: {enabled: false}\n");
  const Verdict& v = c.Run("SET user:1:name ada");
  EXPECT_EQ(v.action, Action::kForward);
  EXPECT_FALSE(v.modified);
  EXPECT_EQ(c.upstream, "SET user:1:name ada");
}

TEST(PipelineTest, AccessStageRefusesUnknownAndDeniedCommandsAfterTheUpstreamCheck) {
  Connection c("deny_commands: [FLUSHALL]\nunknown_commands: reject_unknown\n");
  const Verdict& denied = c.Run("flushall");
  EXPECT_EQ(denied.action, Action::kRefuse);
  EXPECT_EQ(denied.reason, Refusal::kDenyList);
  EXPECT_EQ(denied.message, "ERR keyguard: command 'FLUSHALL' is not allowed here");
  const Verdict& unknown = c.Run("NOSUCHCMD a");
  EXPECT_EQ(unknown.action, Action::kRefuse);
  EXPECT_EQ(unknown.reason, Refusal::kUnknownCommand);
  EXPECT_EQ(unknown.message, "ERR keyguard: unknown command 'NOSUCHCMD'");
  c.upstream_ready = false;  // the upstream is gone: that is the answer, whatever the command
  EXPECT_EQ(c.Run("NOSUCHCMD a").action, Action::kUnavailable);
  EXPECT_EQ(c.Run("GET k").action, Action::kUnavailable);
}

TEST(PipelineTest, KeyPolicyRejectNamesEveryRuleOfTheFirstKeyAndAPassingSuggestion) {
  Connection c("key_policy: {default_action: reject}\n");
  const Verdict& v = c.Run("SET User_1001_Profile x");
  EXPECT_EQ(v.action, Action::kRefuse);
  EXPECT_EQ(v.reason, Refusal::kKeyPolicy);
  EXPECT_EQ(v.message, "ERR keyguard: key 'User_1001_Profile' violates rule 'lowercase': use user:1001:profile");
  EXPECT_EQ(c.Count(c.shard_.key_violations, {"lowercase", "reject", "User_{id}_Profile"}), 1u);
  // Reading a bad name is observed, never refused.
  const Verdict& read = c.Run("GET User_1001_Profile");
  EXPECT_EQ(read.action, Action::kForward);
  EXPECT_EQ(c.Count(c.shard_.key_violations, {"lowercase", "observe", "User_{id}_Profile"}), 1u);
  EXPECT_EQ(c.Run("SET user:1001:profile x").action, Action::kForward);
}

TEST(PipelineTest, KeyPolicyRewriteChangesOnlyTheKeyAndCountsIt) {
  Connection c(
      "key_policy:\n  default_action: observe\n  rules:\n    - name: legacy-profile\n      pattern: "
      "'^User_(\\d+)_Profile$'\n      rewrite: 'user:$1:profile'\n      action: rewrite\n");
  const Verdict& v = c.Run("MSET User_7_Profile a other b");
  EXPECT_EQ(v.action, Action::kForward);
  EXPECT_TRUE(v.modified);
  EXPECT_EQ(c.upstream, "MSET user:7:profile a other b");
  EXPECT_EQ(c.Count(c.shard_.keys_rewritten, {"legacy-profile"}), 1u);
  // A key stored under the old name moves to the new one first (legacy_keys: move, the default).
  EXPECT_EQ(c.prelude, Move("2 User_7_Profile user:7:profile w"));
  // The next command starts from its own arguments.
  const Verdict& next = c.Run("GET other");
  EXPECT_FALSE(next.modified);
  EXPECT_EQ(c.upstream, "GET other");
  EXPECT_EQ(c.prelude, "");
  // A reply that names keys (BLPOP's) goes back to the client's names.
  const Verdict& blpop = c.Run("BLPOP other User_5_Profile 1");
  ASSERT_EQ(blpop.renamed.size(), 1u);
  EXPECT_EQ(blpop.renamed[0].first, "user:5:profile");
  EXPECT_EQ(blpop.renamed[0].second, "User_5_Profile");
  EXPECT_EQ(blpop.renamed_shape, static_cast<uint8_t>(tenant::ReplyRewrite::kFirstKey));
  EXPECT_TRUE(c.Run("MGET User_1_Profile").renamed.empty());  // its reply names no key
  c.Run("MGET User_1_Profile user:2:profile User_3_Profile");
  EXPECT_EQ(c.upstream, "MGET user:1:profile user:2:profile user:3:profile");
  EXPECT_EQ(c.prelude, Move("4 User_1_Profile user:1:profile User_3_Profile user:3:profile r r"));
}

TEST(PipelineTest, KeysAndScanOfOldNamePatternsAlsoFindTheNewNames) {
  const std::string rule =
      "key_policy:\n  default_action: observe\n  rules:\n    - name: legacy-profile\n      pattern: "
      "'^User_(\\d+)_Profile$'\n      rewrite: 'user:$1:profile'\n      action: rewrite\n";
  Connection c(rule);
  const Verdict& scan = c.Run("SCAN 0 MATCH x COUNT 10 match User_*_Profile TYPE hash");
  EXPECT_TRUE(scan.modified);
  EXPECT_EQ(c.upstream, "SCAN 0 COUNT 10 TYPE hash");  // every MATCH goes; the last one applies
  ASSERT_EQ(scan.renamed.size(), 1u);
  EXPECT_EQ(scan.renamed[0].first, "User_*_Profile");
  EXPECT_EQ(scan.renamed_shape, static_cast<uint8_t>(tenant::ReplyRewrite::kScan));
  const Verdict& keys = c.Run("KEYS User_1*");
  EXPECT_EQ(c.upstream, "EVAL " + std::string(kKeysWithNewNamesScript) + " 0 User_1* user:*:profile");
  EXPECT_EQ(keys.renamed_shape, static_cast<uint8_t>(tenant::ReplyRewrite::kKeyArray));
  // Patterns no old name can match go as they are: another literal start, no MATCH.
  for (const char* line : {"KEYS user:*", "KEYS Other_*", "SCAN 0 MATCH user:*", "SCAN 0 COUNT 5", "GET User"}) {
    const Verdict& v = c.Run(line);
    EXPECT_FALSE(v.modified) << line;
    EXPECT_TRUE(v.renamed.empty()) << line;
    EXPECT_EQ(c.upstream, line);
  }
  EXPECT_TRUE(c.Run("KEYS U?er_*").modified);  // a glob character may match the literal start
  EXPECT_TRUE(c.Run("KEYS *").modified);
  // Inside MULTI the reply is EXEC's element: nothing is mapped.
  c.Run("MULTI");
  EXPECT_FALSE(c.Run("KEYS User_*").modified);
  // CLIENT TRACKING BCAST with a prefix of old names: the new names' prefix is added, unless a
  // prefix given overlaps it (the server would refuse it).
  c.Run("EXEC");
  c.Run("CLIENT TRACKING ON BCAST PREFIX User_ PREFIX x");
  EXPECT_EQ(c.upstream, "CLIENT TRACKING ON BCAST PREFIX User_ PREFIX x PREFIX user:");
  c.Run("CLIENT TRACKING ON REDIRECT 7 PREFIX U BCAST");
  EXPECT_EQ(c.upstream, "CLIENT TRACKING ON REDIRECT 7 PREFIX U BCAST PREFIX user:");
  for (const char* line : {"CLIENT TRACKING ON BCAST PREFIX User_ PREFIX us", "CLIENT TRACKING ON BCAST PREFIX Other",
                           "CLIENT TRACKING ON BCAST", "CLIENT TRACKING ON PREFIX User_", "CLIENT TRACKING OFF"}) {
    EXPECT_FALSE(c.Run(line).modified) << line;
  }
  // SUBSCRIBE to an old name's keyspace channel: the new name's channel.
  Connection sub(rule);
  const Verdict& v = sub.Run("SUBSCRIBE __keyspace@0__:User_5_Profile other __keyspace@1__:user:6:profile");
  EXPECT_EQ(sub.upstream, "SUBSCRIBE __keyspace@0__:user:5:profile other __keyspace@1__:user:6:profile");
  ASSERT_EQ(v.renamed.size(), 1u);
  EXPECT_EQ(v.renamed[0].first, "__keyspace@0__:user:5:profile");
  EXPECT_EQ(v.renamed[0].second, "__keyspace@0__:User_5_Profile");
  EXPECT_EQ(v.renamed_shape, static_cast<uint8_t>(tenant::ReplyRewrite::kChannelArray));
  EXPECT_FALSE(sub.Run("UNSUBSCRIBE other __keyevent@0__:set").modified);
  // A scoped rule does not map patterns.
  Connection scoped(rule + "      legacy_keys: leave\n      scope: {commands: [get]}\n");
  EXPECT_FALSE(scoped.Run("KEYS User_*").modified);
}

TEST(PipelineTest, SortPatternsOfOldNamesAlsoReadTheNewNames) {
  Connection c(
      "key_policy:\n  default_action: observe\n  rules:\n    - name: legacy-profile\n      pattern: "
      "'^User_(\\d+)_Profile$'\n      rewrite: 'user:$1:profile'\n      action: rewrite\n");
  const std::string script(kSortWithNewNamesScript);
  // GET only: the server sorts, each mapped GET is asked under both names ('m').
  c.Run("SORT ids LIMIT 0 5 GET User_*_Profile GET # GET Other_* ALPHA");
  EXPECT_EQ(c.upstream,
            "EVAL " + script +
                " 1 ids SORT mpp  0 -1 LIMIT 0 5 GET User_*_Profile GET user:*:profile GET # GET Other_* ALPHA");
  // BY too: every element with both weights, and the script sorts; STORE is the script's (the last
  // one applies), a hash field stays on both patterns.
  c.Run("SORT ids STORE a BY User_*_Profile->age DESC LIMIT 1 2 ALPHA STORE b");
  EXPECT_EQ(c.upstream, "EVAL " + script +
                            " 2 ids b SORT pmp sAD 1 2 BY nosort GET # GET User_*_Profile->age GET "
                            "user:*:profile->age GET #");
  // "->" with no field after it is part of the key's name (`User_1_Profile->`, no old name).
  c.Run("SORT_RO ids BY User_*_Profile GET User_*_Profile->");
  EXPECT_EQ(c.upstream, "EVAL_RO " + script +
                            " 1 ids SORT_RO pmp s 0 -1 BY nosort GET # GET User_*_Profile GET user:*:profile GET "
                            "User_*_Profile->");
  // A BY without '*' means no sorting, so only the GETs are mapped; patterns that name no old
  // names (another literal around the '*', no '*') and refused options go as they are.
  c.Run("SORT ids BY nosort BY User_*_Profile GET User_*_Profile");
  EXPECT_EQ(c.upstream,
            "EVAL " + script + " 1 ids SORT m  0 -1 BY nosort BY User_*_Profile GET User_*_Profile GET user:*:profile");
  for (const char* line : {"SORT ids BY User_*_Profile_x GET X_*", "SORT ids GET User_1_Profile",
                           "SORT ids GET User_*_Profile LIMIT x 1", "SORT ids BY nosort"}) {
    EXPECT_FALSE(c.Run(line).modified) << line;
  }
  c.Run("SORT User_3_Profile GET User_*_Profile");  // the key itself is renamed (and moved first)
  EXPECT_EQ(c.upstream, "EVAL " + script + " 1 user:3:profile SORT m  0 -1 GET User_*_Profile GET user:*:profile");
  EXPECT_EQ(c.prelude, Move("2 User_3_Profile user:3:profile r"));
}

TEST(PipelineTest, KeyspacePatternsOfOldNamesGetAWiderPatternOfTheirOwn) {
  Connection c(
      "key_policy:\n  default_action: observe\n  rules:\n    - name: legacy-profile\n      pattern: "
      "'^User_(\\d+)_Profile$'\n      rewrite: 'user:$1:profile'\n      action: rewrite\n");
  std::vector<std::pair<std::string, std::string>>& kept = c.patterns_renamed();
  const Verdict& v = c.Run("PSUBSCRIBE __keyspace@0__:User_*_Profile x* __keyspace@0__:user:* __keyspace@0__:User_*");
  // Each gets a pattern of its own ('*' added until it is unique); patterns no old name matches stay.
  EXPECT_EQ(c.upstream,
            "PSUBSCRIBE __keyspace@0__:[Uu]ser[_:]** x* __keyspace@0__:user:* __keyspace@0__:[Uu]ser[_:]***");
  ASSERT_EQ(v.renamed.size(), 2u);
  EXPECT_EQ(v.renamed_shape, kRenamedPatterns);
  EXPECT_EQ(v.renamed[1].first, "__keyspace@0__:[Uu]ser[_:]***");
  EXPECT_EQ(v.renamed[1].second, "__keyspace@0__:User_*");
  kept = {{"__keyspace@0__:[Uu]ser[_:]**", "__keyspace@0__:User_*_Profile"}};
  // Subscribed already: the same pattern again; another one does not take it.
  c.Run("PSUBSCRIBE __keyspace@0__:User_*_Profile __keyspace@1__:Us?r_1*");
  EXPECT_EQ(c.upstream, "PSUBSCRIBE __keyspace@0__:[Uu]ser[_:]** __keyspace@1__:[Uu]s**");
  const Verdict& un = c.Run("PUNSUBSCRIBE __keyspace@0__:User_*_Profile other");
  EXPECT_EQ(c.upstream, "PUNSUBSCRIBE __keyspace@0__:[Uu]ser[_:]** other");
  EXPECT_TRUE(un.renamed.empty());                                     // the pair goes with the server's confirmation
  EXPECT_FALSE(c.Run("PUNSUBSCRIBE __keyspace@0__:User_*").modified);  // never renamed here
  // The same pattern twice in one command: the same one twice, as the server would count it.
  c.Run("PSUBSCRIBE __keyspace@2__:User_* __keyspace@2__:User_*");
  EXPECT_EQ(c.upstream, "PSUBSCRIBE __keyspace@2__:[Uu]ser[_:]** __keyspace@2__:[Uu]ser[_:]**");
  // Inside MULTI the confirmations are EXEC's elements: nothing is mapped.
  c.Run("MULTI");
  EXPECT_FALSE(c.Run("PSUBSCRIBE __keyspace@3__:User_*").modified);
  EXPECT_FALSE(c.Run("SUBSCRIBE __keyspace@3__:User_1_Profile").modified);
}

TEST(RenamePatterns, NamesTheClientsPatternAndDropsWhatItDidNotAskFor) {
  auto p = config::ParseConfig(
      "key_policy:\n  rules:\n    - {name: r, pattern: '^User_(\\d+)_Profile$', rewrite: 'user:$1:profile', "
      "action: rewrite}\n");
  ASSERT_TRUE(p.ok()) << p.status();
  const policy::KeyPolicy& policy = *p->key_policy;
  std::vector<std::pair<std::string, std::string>> pairs = {{"__keyspace@0__:[Uu]ser[_:]**", "__keyspace@0__:User_*"}};
  std::string out;
  const auto pmessage = [](std::string_view channel) {
    return absl::StrCat("*4\r\n$8\r\npmessage\r\n$28\r\n__keyspace@0__:[Uu]ser[_:]**\r\n$", channel.size(), "\r\n",
                        AsAbsl(channel), "\r\n$3\r\nset\r\n");
  };
  // A new name: under its old name; an old name: as it is; anything else the wider pattern matches: dropped.
  EXPECT_EQ(RenamePatterns(policy, &pairs, pmessage("__keyspace@0__:user:7:profile"), &out),
            tenant::ReplyAction::kReplace);
  EXPECT_EQ(out,
            "*4\r\n$8\r\npmessage\r\n$21\r\n__keyspace@0__:User_*\r\n$29\r\n__keyspace@0__:User_7_Profile\r\n$"
            "3\r\nset\r\n");
  EXPECT_EQ(RenamePatterns(policy, &pairs, pmessage("__keyspace@0__:User_x"), &out), tenant::ReplyAction::kReplace);
  EXPECT_EQ(out,
            "*4\r\n$8\r\npmessage\r\n$21\r\n__keyspace@0__:User_*\r\n$21\r\n__keyspace@0__:User_x\r\n$3\r\nset\r\n");
  for (const char* other : {"__keyspace@0__:user:x", "__keyspace@0__:User:1", "__keyspace@0__:user:7:profile:x"}) {
    EXPECT_EQ(RenamePatterns(policy, &pairs, pmessage(other), &out), tenant::ReplyAction::kDrop) << other;
  }
  // Other patterns' messages pass; the punsubscribe confirmation names the client's.
  EXPECT_EQ(RenamePatterns(policy, &pairs, "*4\r\n$8\r\npmessage\r\n$2\r\nx*\r\n$2\r\nxy\r\n$1\r\nm\r\n", &out),
            tenant::ReplyAction::kPass);
  EXPECT_EQ(RenamePatterns(policy, &pairs, ">3\r\n$12\r\npunsubscribe\r\n$28\r\n__keyspace@0__:[Uu]ser[_:]**\r\n:0\r\n",
                           &out),
            tenant::ReplyAction::kReplace);
  EXPECT_EQ(out, ">3\r\n$12\r\npunsubscribe\r\n$21\r\n__keyspace@0__:User_*\r\n:0\r\n");
  EXPECT_EQ(pairs.size(), 1u);  // kept: a PSUBSCRIBE of it may be in flight
}

TEST(OldNamesMatching, KeepsMatchesAndNamesNewKeysAsTheClientKnowsThem) {
  auto p = config::ParseConfig(
      "key_policy:\n  rules:\n    - {name: r, pattern: '^User_(\\d+)_Profile$', rewrite: 'user:$1:profile', "
      "action: rewrite}\n");
  ASSERT_TRUE(p.ok()) << p.status();
  const policy::KeyPolicy& policy = *p->key_policy;
  std::string out;
  const auto keys = static_cast<uint8_t>(tenant::ReplyRewrite::kKeyArray);
  const auto scan = static_cast<uint8_t>(tenant::ReplyRewrite::kScan);
  // A new name listed twice (by both KEYS of the script) and its old copy: once.
  EXPECT_EQ(OldNamesMatching(policy, keys, "User_*",
                             "*5\r\n$14\r\nUser_1_Profile\r\n$5\r\nother\r\n$14\r\nuser:1:profile\r\n"
                             "$14\r\nuser:2:profile\r\n$14\r\nuser:1:profile\r\n",
                             &out),
            tenant::ReplyAction::kReplace);
  EXPECT_EQ(out, "*2\r\n$14\r\nUser_1_Profile\r\n$14\r\nUser_2_Profile\r\n");
  // SCAN: the cursor stays; a key matching the pattern as stored keeps its name.
  EXPECT_EQ(
      OldNamesMatching(policy, scan, "*1*",
                       "*2\r\n$2\r\n17\r\n*3\r\n$14\r\nuser:1:profile\r\n$14\r\nuser:2:profile\r\n$1\r\nx\r\n", &out),
      tenant::ReplyAction::kReplace);
  EXPECT_EQ(out, "*2\r\n$2\r\n17\r\n*1\r\n$14\r\nuser:1:profile\r\n");
  EXPECT_EQ(OldNamesMatching(policy, scan, "User_?_Profile", "*2\r\n$1\r\n0\r\n*1\r\n$15\r\nuser:12:profile\r\n", &out),
            tenant::ReplyAction::kReplace);
  EXPECT_EQ(out, "*2\r\n$1\r\n0\r\n*0\r\n");
  EXPECT_EQ(OldNamesMatching(policy, keys, "*", "-NOPERM no\r\n", &out), tenant::ReplyAction::kPass);
}

TEST(PipelineTest, LegacyKeysLeaveSendsNoMoveAndAMoveInsideMultiUnderReplyOffIsRefused) {
  const std::string rule =
      "key_policy:\n  default_action: observe\n  rules:\n    - name: legacy-profile\n      pattern: "
      "'^User_(\\d+)_Profile$'\n      rewrite: 'user:$1:profile'\n      action: rewrite\n";
  Connection leave(rule + "      legacy_keys: leave\n");
  leave.Run("GET User_1_Profile");
  EXPECT_EQ(leave.upstream, "GET user:1:profile");
  EXPECT_EQ(leave.prelude, "");
  Connection c(rule);
  EXPECT_EQ(c.Run("CLIENT REPLY OFF").action, Action::kForward);
  EXPECT_EQ(c.Run("MULTI").action, Action::kForward);
  const Verdict& v = c.Run("GET User_1_Profile");
  EXPECT_EQ(v.action, Action::kRefuse);
  EXPECT_EQ(v.message,
            "ERR keyguard: key 'User_1_Profile' is an old name keyguard moves to its new one; inside MULTI under "
            "CLIENT REPLY OFF/SKIP that is not supported");
  EXPECT_EQ(c.Run("GET user:1:profile").action, Action::kForward);  // a new name needs no move
}

TEST(PipelineTest, AReshapingRuleMovesWithTheJsonScript) {
  const std::string rule =
      "key_policy:\n  default_action: observe\n  rules:\n    - name: legacy-profile\n      pattern: "
      "'^User_(\\d+)_Profile$'\n      rewrite: 'user:$1:profile'\n      action: rewrite\n";
  const std::string other = "    - {name: orders, pattern: '^Order_(\\d+)$', rewrite: 'order:$1', action: rewrite}\n";
  Connection c(rule + "      reshape: json_to_hash\n" + other);
  c.Run("HSET User_1_Profile f v");
  EXPECT_EQ(c.prelude, "EVAL " + std::string(kMoveLegacyJsonScript) + " 2 User_1_Profile user:1:profile wj");
  c.Run("MGET Order_5 User_2_Profile");  // one script for both: only the reshaping rule's key says 'j'
  EXPECT_EQ(c.prelude,
            "EVAL " + std::string(kMoveLegacyJsonScript) + " 4 Order_5 order:5 User_2_Profile user:2:profile r rj");
  c.Run("GET Order_6");
  EXPECT_EQ(c.prelude, Move("2 Order_6 order:6 r"));
  // Only with a move, and not with a scope.
  for (const std::string& bad :
       std::vector<std::string>{rule + "      legacy_keys: leave\n      reshape: json_to_hash\n",
                                rule + "      reshape: json_to_hash\n      scope: {commands: [get]}\n",
                                "key_policy:\n  rules:\n    - {name: r, pattern: 'x', rewrite: 'y', action: observe, "
                                "reshape: json_to_hash}\n"}) {
    auto parsed = config::ParseConfig(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_NE(parsed.status().message().find(".reshape: json_to_hash "), std::string::npos) << parsed.status();
  }
}

TEST(PipelineTest, UnreviewedScriptsAreRefusedUnderRejectAndCountedUnderTheScriptsRule) {
  Connection c("key_policy: {default_action: reject}\n");
  const Verdict& v = c.Run("EVAL return 0");
  EXPECT_EQ(v.action, Action::kRefuse);
  EXPECT_EQ(v.reason, Refusal::kKeyPolicy);
  EXPECT_EQ(v.message.rfind("ERR keyguard: script ", 0), 0u) << v.message;
  EXPECT_NE(v.message.find("is not reviewed (key_policy.scripts)"), std::string::npos);
  EXPECT_EQ(c.Count(c.shard_.key_violations, {"scripts", "reject", ""}), 1u);
  EXPECT_EQ(c.Run("FUNCTION RESTORE x").message,
            "ERR keyguard: FUNCTION RESTORE (a dump cannot be reviewed) is not reviewed (key_policy.scripts): a "
            "script may write key names the key policy never sees");
  EXPECT_EQ(c.Run("EVAL_RO return 0").action, Action::kForward);
}

constexpr const char* kTenants =
    "tenancy:\n"
    "  users:\n"
    "    - {name: alice, password_sha256: 0c848abb03307b06cf70cd4e29c157dc81af5e94ab3eb1d0c59a120269572376, "
    "prefix: 'tenant:a:', tenant: a}\n"
    "  dbsize: emulate\n"
    "key_policy: {default_action: observe}\n";

TEST(PipelineTest, TenantsLogInFirstAndAreRefusedWhatTheyCannotProveConfined) {
  Connection c(kTenants);
  const Verdict& noauth = c.Run("GET k");
  EXPECT_EQ(noauth.action, Action::kRefuse);
  EXPECT_EQ(noauth.reason, Refusal::kNoAuth);
  EXPECT_EQ(noauth.message, "NOAUTH Authentication required.");
  const Verdict& wrong = c.Run("AUTH alice nope");
  EXPECT_EQ(wrong.action, Action::kRefuse);
  EXPECT_EQ(wrong.reason, Refusal::kAuth);
  EXPECT_EQ(wrong.message, "WRONGPASS invalid username-password pair or user is disabled.");
  EXPECT_EQ(c.Run("AUTH a b c").message, "ERR wrong number of arguments for 'auth' command");
  const Verdict& hello_first = c.Run("HELLO 3");
  EXPECT_EQ(hello_first.reason, Refusal::kNoAuth);
  const Verdict& hello = c.Run("HELLO 3 AUTH alice alice-secret SETNAME app");
  EXPECT_EQ(hello.action, Action::kLogin);
  ASSERT_NE(c.tenant, nullptr);
  EXPECT_EQ(c.tenant->prefix, "tenant:a:");
  EXPECT_EQ(c.upstream, "HELLO 3 SETNAME app") << "HELLO goes upstream without its AUTH";

  const Verdict& get = c.Run("MGET k l");
  EXPECT_EQ(get.action, Action::kForward);
  EXPECT_EQ(c.upstream, "MGET tenant:a:k tenant:a:l");
  EXPECT_EQ(c.Run("DBSIZE").action, Action::kWalk);
  EXPECT_EQ(c.Run("MULTI").action, Action::kForward);
  const Verdict& walk_in_multi = c.Run("DBSIZE");
  EXPECT_EQ(walk_in_multi.action, Action::kRefuse);
  EXPECT_EQ(
      walk_in_multi.message,
      "ERR keyguard: DBSIZE inside MULTI or under CLIENT REPLY OFF/SKIP is not allowed for tenants (keyguard walks "
      "the tenant's keys in steps)");
  EXPECT_EQ(c.Run("SUBSCRIBE ch").message,
            "ERR keyguard: SUBSCRIBE inside MULTI or under CLIENT REPLY OFF/SKIP is not allowed for tenants");
  EXPECT_EQ(c.Run("CLIENT REPLY OFF").message, "ERR keyguard: CLIENT REPLY inside MULTI is not allowed for tenants");
  EXPECT_EQ(c.Run("AUTH alice alice-secret").message, "ERR keyguard: AUTH and HELLO are not allowed inside MULTI");
}

TEST(PipelineTest, ClientReplyIsRefusedToATenantWhileASubscribeIsUnconfirmed) {
  Connection c(kTenants);
  ASSERT_EQ(c.Run("AUTH alice alice-secret").action, Action::kLogin);
  EXPECT_EQ(c.Run("CLIENT REPLY ON").action, Action::kForward);
  Pending sub;
  sub.kind = Pending::Kind::kSubscribe;
  c.queue.Push(std::move(sub));
  const Verdict& v = c.Run("CLIENT REPLY ON");
  EXPECT_EQ(v.action, Action::kRefuse);
  EXPECT_EQ(v.message, "ERR keyguard: CLIENT REPLY on a subscribed connection is not allowed for tenants");
}

TEST(PipelineTest, PolicyRewriteTenantPrefixAndHygieneRewriteCompose) {
  Connection c(
      "tenancy: {prefix: 'tenant:s:'}\n"
      "key_policy:\n  default_action: observe\n  rules:\n    - name: legacy-profile\n      pattern: "
      "'^User_(\\d+)_Profile$'\n      rewrite: 'user:$1:profile'\n      action: rewrite\n"
      "hygiene:\n  rules: {missing_ttl: {action: rewrite}, keys_command: {action: reject}}\n"
      "  ttl_patterns: [{pattern: 'User_*', kind: cache, default_ttl_s: 600}]\n");
  c.tenant = c.StaticTenant();  // what the session binds at connect
  ASSERT_NE(c.tenant, nullptr);
  const Verdict& set = c.Run("SET User_3_Profile v");
  EXPECT_EQ(set.action, Action::kForward);
  EXPECT_EQ(c.upstream, "SET tenant:s:user:3:profile v EX 600");
  // The old name moves inside the tenant's own keys.
  EXPECT_EQ(c.prelude, Move("2 tenant:s:User_3_Profile tenant:s:user:3:profile w"));
  const Verdict& keys = c.Run("KEYS *");
  EXPECT_EQ(keys.action, Action::kRefuse);
  EXPECT_EQ(keys.reason, Refusal::kHygiene);
  EXPECT_EQ(keys.message.rfind("ERR keyguard: keys_command: ", 0), 0u) << keys.message;
}

}  // namespace
}  // namespace keyguard::proxy
