#include "proxy/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <deque>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "keyguard/commands/traits.h"
#include "keyguard/common/json_line.h"
#include "keyguard/common/views.h"
#include "keyguard/hygiene/sizes.h"
#include "keyguard/policy/key_pattern.h"
#include "keyguard/resp/value.h"
#include "keyguard/resp/encoder.h"
#include "keyguard/tenant/tenancy.h"

namespace keyguard::proxy {
namespace {

using commands::EqualsIgnoreCase;

}  // namespace

std::string KeyInError(std::string_view key) {
  constexpr size_t kShown = 64;
  std::string out;
  for (size_t i = 0; i < key.size() && i < kShown; ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
  if (key.size() > kShown) absl::StrAppend(&out, "... (", key.size(), " bytes)");
  return out;
}

bool MayBeSubscribed(const ConnectionState& state, const ReplyQueue& queue) {
  return state.subscribed() ||
         std::any_of(queue.begin(), queue.end(), [](const Pending& p) { return p.kind == Pending::Kind::kSubscribe; });
}

StageShared::StageShared(const config::ProxyConfig& c, config::ConfigStore& st, metrics::WorkerShard* s,
                         tenant::Connections* conns)
    : config(c), store(st), shard(s), connections(conns), auth(commands::Known().auth) {
  Refresh();
  for (size_t r = 0; r < kRefusalCount; ++r) {
    rejected[r] = &shard->commands_rejected.Get({RefusalName(static_cast<Refusal>(r))});
  }
  if (config.tenancy != nullptr) rewriter = std::make_unique<tenant::RequestRewriter>(*config.tenancy, connections);
}

void StageShared::Refresh() {
  const uint64_t v = store.version();
  if (v == live_version && live != nullptr) return;
  live = store.Current();
  live_version = v;
  maps_patterns = live->key_policy->maps_patterns();
  violation_handles.Clear();  // keyed by the old snapshot's rules
  rewrite_handles.Clear();
  access.assign(commands::CommandCount(), 0);
  constexpr auto kCode = [](Refusal r) { return static_cast<uint8_t>(static_cast<uint8_t>(r) + 1); };
  constexpr uint8_t kSharedWait = StageShared::kSharedWait;
  if (live->reject_unknown_commands) access[commands::kUnknownCommand] = kCode(Refusal::kUnknownCommand);
  for (const std::string& name : live->deny_commands) {
    const commands::CommandId id = commands::LookupCommand(name);
    if (id != commands::kUnknownCommand) access[id] = kCode(Refusal::kDenyList);
  }
  if (config.shared_upstream) {
    // WAIT and WAITAOF count the replicas that have this connection's writes: on a shared
    // connection (or a connection pinned for them, which carried none) that would be others'
    // writes, or none. Refused unless the client's commands go to a connection of its own.
    for (std::string_view name : {"wait", "waitaof"}) {
      const commands::CommandId id = commands::LookupCommand(name);
      if (id != commands::kUnknownCommand && access[id] == 0) access[id] = kSharedWait;
    }
  }
}

CommandPipeline::CommandPipeline(StageShared& shared, hygiene::ConnectionDetectors& detectors)
    : shared_(shared), detectors_(detectors) {}

const Verdict& CommandPipeline::Run(const CommandContext& c) {
  v_.action = Verdict::Action::kForward;
  v_.args = c.args;
  v_.modified = false;
  v_.bind = false;
  v_.login = nullptr;
  v_.rewrite = 0;
  v_.reply_check = 0;
  v_.walk = tenant::Walk::kNone;
  v_.prelude = {};
  v_.renamed = {};
  if (!v_.message.empty()) v_.message.clear();
  // The gate has nothing to say about a logged-in tenant's command that changes no connection
  // state (GET, SET, ...): it runs for AUTH, before login, and for the commands with a role.
  if (shared_.config.tenancy != nullptr &&
      (c.tenant == nullptr || c.id == shared_.auth ||
       commands::TraitsOf(c.id).connection != commands::ConnectionRole::kNone) &&
      !Gate(c)) {
    return v_;
  }
  if (!c.upstream_ready) {
    v_.action = Verdict::Action::kUnavailable;
    return v_;
  }
  if (shared_.access[c.id] != 0 && !Access(c)) return v_;
  const bool check_policy = !shared_.live->key_policy->empty();
  if (check_policy || c.tenant != nullptr) {
    const commands::CommandSpec* spec = commands::ResolveSpec(c.id, c.args);
    key_refs_.clear();
    legacy_.clear();
    const bool keys_ok = spec != nullptr && commands::FindKeys(*spec, c.args, &key_refs_);
    if (check_policy && commands::TraitsOf(c.id).script != commands::ScriptKind::kNone && !ScriptPolicy(c)) {
      return v_;
    }
    if (check_policy && !key_refs_.empty() && !KeyPolicy(c, *spec)) return v_;
    if (shared_.maps_patterns) [[unlikely]] {
      if (key_refs_.empty()) {
        OldNamePatterns(c);
      } else if (c.id == known_.sort || c.id == known_.sort_ro) {
        after_ = After::kSort;  // once the tenant's names are in
      }
    }
    if (c.tenant != nullptr && !Tenant(c, spec, keys_ok)) return v_;
    if (!legacy_.empty() && !MoveLegacy(c)) return v_;
  }
  // Most commands have nothing for the detectors to check before they go (GET: only its reply).
  if (shared_.config.hygiene.enabled && !detectors_.Quick(c.id, c.args, &v_.reply_check) && !Hygiene(c)) return v_;
  if (after_ != After::kNone) [[unlikely]] {  // (a refusal clears it)
    if (after_ == After::kKeys) {
      KeysWithNewNames();
    } else {
      SortWithNewNames(c);
    }
    after_ = After::kNone;
  }
  if (v_.walk != tenant::Walk::kNone) v_.action = Verdict::Action::kWalk;
  return v_;
}

bool CommandPipeline::Refuse(Refusal reason, std::string message) {
  v_.action = Verdict::Action::kRefuse;
  after_ = After::kNone;
  v_.reason = reason;
  v_.message = std::move(message);
  edit_.Release();
  return false;
}

// Tenancy: AUTH and HELLO are keyguard's; what a tenant may not do on this connection.
bool CommandPipeline::Gate(const CommandContext& c) {
  const commands::KnownCommands& known = commands::Known();
  if (c.id == known.auth || c.id == known.hello) return Login(c);
  static const uint32_t kNoAuth = commands::CommandFlagMask("no_auth");
  if (c.tenant == nullptr) {
    if ((commands::Spec(c.id).flags & kNoAuth) == 0) return Refuse(Refusal::kNoAuth, "NOAUTH Authentication required.");
    return true;
  }
  const commands::ConnectionRole role = commands::TraitsOf(c.id).connection;
  const bool subscribe = role == commands::ConnectionRole::kSubscribe || role == commands::ConnectionRole::kUnsubscribe;
  // keyguard tells RESP2 pub/sub messages from replies by the confirmations it reads in step
  // with its commands. Inside MULTI, and under CLIENT REPLY OFF/SKIP, Redis sends those out of
  // step, and a message of any tenant's keys would then pass as some command's reply.
  if (subscribe && (c.state->in_multi() || c.mode.silent)) {
    return Refuse(Refusal::kTenant,
                  absl::StrCat("ERR keyguard: ", Upper(c.args[0]),
                               " inside MULTI or under CLIENT REPLY OFF/SKIP is not allowed for tenants"));
  }
  if (c.id == known.client && c.args.size() > 1 && EqualsIgnoreCase(c.args[1], "reply")) {
    if (c.state->in_multi()) {
      return Refuse(Refusal::kTenant, "ERR keyguard: CLIENT REPLY inside MULTI is not allowed for tenants");
    }
    // A RESP2 server refuses CLIENT REPLY while the connection is subscribed, but keyguard
    // follows OFF/SKIP when it forwards them: its replies would fall out of step with the
    // server's, and a reply (INFO's keyspace) would pass with another command's filter. Whether
    // the subscription holds when the server gets there is not known here, so fail closed.
    if (MayBeSubscribed(*c.state, *c.queue)) {
      return Refuse(Refusal::kTenant,
                    "ERR keyguard: CLIENT REPLY on a subscribed connection is not allowed for tenants");
    }
  }
  return true;
}

bool CommandPipeline::Login(const CommandContext& c) {
  const tenant::Tenancy& tenancy = *shared_.config.tenancy;
  const bool hello = c.id == commands::Known().hello;
  const auto args = c.args;
  if (c.state->in_multi()) return Refuse(Refusal::kTenant, "ERR keyguard: AUTH and HELLO are not allowed inside MULTI");
  if (hello && c.mode.silent) {
    // keyguard must read HELLO's reply to know the protocol, and with it what is a push.
    return Refuse(Refusal::kTenant, "ERR keyguard: HELLO under CLIENT REPLY OFF/SKIP is not allowed");
  }
  std::string_view user, password;
  bool has_auth = false;
  if (!hello) {
    if (args.size() == 2) {
      user = "default";
      password = args[1];
    } else if (args.size() == 3) {
      user = args[1];
      password = args[2];
    } else {
      return Refuse(Refusal::kTenant, "ERR wrong number of arguments for 'auth' command");
    }
    has_auth = true;
  } else {
    hello_args_.assign(args.begin(), args.begin() + std::min<size_t>(args.size(), 2));
    for (size_t i = 2; i < args.size(); ++i) {
      if (EqualsIgnoreCase(args[i], "auth") && i + 2 < args.size()) {
        user = args[i + 1];
        password = args[i + 2];
        has_auth = true;
        i += 2;
      } else {
        hello_args_.push_back(args[i]);
      }
    }
  }
  if (has_auth) {
    if (!tenancy.requires_auth()) {
      // Static tenancy: clients need no password, as with Redis's passwordless default user.
      if (!hello && args.size() == 2) {
        return Refuse(Refusal::kAuth,
                      "ERR AUTH <password> called without any password configured for the default user. Are you sure "
                      "your configuration is correct?");
      }
      if (user != "default") {
        return Refuse(Refusal::kAuth, "WRONGPASS invalid username-password pair or user is disabled.");
      }
    } else {
      const tenant::User* u = tenancy.Authenticate(user, password);
      if (u == nullptr) return Refuse(Refusal::kAuth, "WRONGPASS invalid username-password pair or user is disabled.");
      v_.bind = true;
      v_.login = u->tenant;
    }
  }
  if (hello && (v_.bind ? v_.login : c.tenant) == nullptr) {
    return Refuse(Refusal::kNoAuth,
                  "NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> "
                  "AUTH <user> <pass> option can be used to authenticate the client and select the RESP protocol "
                  "version at the same time");
  }
  v_.action = Verdict::Action::kLogin;
  v_.args = hello ? std::span<const std::string_view>(hello_args_) : std::span<const std::string_view>();
  return false;  // the run ends here: keyguard answers AUTH, HELLO goes as it is now
}

bool CommandPipeline::Access(const CommandContext& c) {
  if (shared_.access[c.id] == StageShared::kSharedWait) {
    if (c.own_upstream) return true;
    return Refuse(Refusal::kDenyList,
                  absl::StrCat("ERR keyguard: ", Upper(c.args[0]),
                               " cannot tell about this client's writes: they go over shared upstream connections "
                               "(upstream_connections: shared)"));
  }
  if (static_cast<Refusal>(shared_.access[c.id] - 1) == Refusal::kUnknownCommand) {
    return Refuse(Refusal::kUnknownCommand,
                  absl::StrCat("ERR keyguard: unknown command '", std::string(c.args[0]), "'"));
  }
  return Refuse(Refusal::kDenyList, absl::StrCat("ERR keyguard: command '", Upper(c.args[0]), "' is not allowed here"));
}

bool CommandPipeline::ScriptPolicy(const CommandContext& c) {
  using enum commands::ScriptKind;
  const auto args = c.args;
  const commands::ScriptKind kind = commands::TraitsOf(c.id).script;
  if (kind == kNone || args.size() < 2) return true;
  const policy::KeyPolicy& policy = *shared_.live->key_policy;
  auto script = [&](std::string_view sha) {
    return policy.ScriptReviewed(sha) ? std::string() : "script " + std::string(sha);
  };
  std::string unreviewed;  // what the refusal names
  switch (kind) {
    case kEval: unreviewed = script(tenant::Sha1Hex(args[1])); break;
    case kEvalSha: unreviewed = script(absl::AsciiStrToLower(std::string(args[1]))); break;
    case kFcall:
      if (!policy.FunctionReviewed(args[1])) unreviewed = absl::StrCat("function '", KeyInError(args[1]), "'");
      break;
    case kScript:
      if (args.size() == 3 && EqualsIgnoreCase(args[1], "load")) unreviewed = script(tenant::Sha1Hex(args[2]));
      break;
    case kFunction:
      if (args.size() >= 3 && EqualsIgnoreCase(args[1], "load")) {
        unreviewed = script(tenant::Sha1Hex(args.back()));  // the library code comes last
      } else if (EqualsIgnoreCase(args[1], "restore")) {
        unreviewed = "FUNCTION RESTORE (a dump cannot be reviewed)";
      }
      break;
    case kNone: break;
  }
  if (unreviewed.empty()) return true;
  const policy::Rule& rule = policy.scripts_rule();
  const policy::Action action = rule.action == policy::Action::kReject || rule.action == policy::Action::kWarn
                                    ? rule.action
                                    : policy::Action::kObserve;  // nothing to rewrite
  shared_.shard->key_violations.Get({"scripts", policy::ActionName(action), ""}).Add();
  if (action == policy::Action::kWarn) Warn(c, rule, "", unreviewed);
  if (action != policy::Action::kReject) return true;
  return Refuse(Refusal::kKeyPolicy,
                absl::StrCat("ERR keyguard: ", unreviewed,
                             " is not reviewed (key_policy.scripts): a script may write key names the key policy "
                             "never sees"));
}

bool CommandPipeline::KeyPolicy(const CommandContext& c, const commands::CommandSpec& spec) {
  const policy::KeyPolicy& policy = *shared_.live->key_policy;
  // The common case: every key conforms, and nothing below needs building.
  if (std::all_of(key_refs_.begin(), key_refs_.end(),
                  [&](const commands::KeyRef& ref) { return policy.Conforms(c.args[ref.pos]); })) {
    return true;
  }
  metrics::WorkerShard& shard = *shared_.shard;
  const auto args = c.args;
  const policy::Violation* reject = nullptr;
  std::string reject_key, reject_rules, reject_suggestion;
  bool rewritten_any = false;
  for (const commands::KeyRef& ref : key_refs_) {
    const std::string_view key = args[ref.pos];
    violations_.clear();
    policy.Check(key, c.id, spec, &violations_);
    if (violations_.empty()) continue;
    const std::string& pattern = shard.PatternLabel(policy::KeyPattern(key), policy.max_key_patterns());
    // Rules judge the names a command creates: reading, expiring, deleting or renaming away an
    // existing bad name is observed, never refused.
    const bool creates = policy::MayCreateKey(ref.flags, spec);
    bool rewritten = false;
    for (const policy::Violation& v : violations_) {
      const policy::Action action =
          v.rule->action == policy::Action::kReject && !creates ? policy::Action::kObserve : v.rule->action;
      shared_.KeyViolations(*v.rule, action, pattern).Add();
      switch (action) {
        case policy::Action::kWarn: Warn(c, *v.rule, v.suggestion, key); break;
        case policy::Action::kReject:
          // The refusal names every rule the first refused key breaks, and a suggestion only
          // when the suggested name itself passes every rule.
          if (reject == nullptr) {
            reject = &v;
            reject_key.assign(key.data(), key.size());
          }
          if (key == reject_key) {
            absl::StrAppend(&reject_rules, reject_rules.empty() ? "" : ", ", "'", v.rule->name, "'");
            if (reject_suggestion.empty() && !v.suggestion.empty() &&
                SuggestionBreaks(policy, c, spec, v.suggestion).empty()) {
              reject_suggestion = v.suggestion;
            }
          }
          break;
        case policy::Action::kRewrite:
          if (!rewritten && !v.suggestion.empty() && v.suggestion != key) {
            if (v.rule->move_legacy && RewrittenAgain(policy, c, spec, v)) {
              return Refuse(Refusal::kKeyPolicy,
                            absl::StrCat("ERR keyguard: rule '", v.rule->name, "' rewrites key '", KeyInError(key),
                                         "' to '", KeyInError(v.suggestion),
                                         "', which another rewrite rule rewrites again: a chain of rewrite rules "
                                         "would move one client's keys onto another's (fix key_policy.rules)"));
            }
            rewritten = true;
            if (!rewritten_any) policy_args_.assign(args.begin(), args.end());
            rewritten_any = true;
            policy_args_[ref.pos] = edit_.Own(v.suggestion);
            shared_.KeysRewritten(*v.rule).Add();
            if (v.rule->move_legacy) {
              constexpr uint32_t kWrites = commands::kKeyRw | commands::kKeyOw | commands::kKeyRm |
                                           commands::kKeyUpdate | commands::kKeyInsert | commands::kKeyDelete;
              legacy_.push_back({ref.pos, key, (ref.flags & kWrites) != 0, v.rule->json_to_hash});
            }
          }
          break;
        case policy::Action::kObserve: break;
      }
    }
    if (reject != nullptr) break;
  }
  if (reject != nullptr) {
    std::string refusal = absl::StrCat("ERR keyguard: key '", KeyInError(reject_key), "' violates rule",
                                       reject_rules.find(',') == std::string::npos ? " " : "s ", reject_rules);
    if (!reject_suggestion.empty()) absl::StrAppend(&refusal, ": use ", KeyInError(reject_suggestion));
    return Refuse(Refusal::kKeyPolicy, std::move(refusal));
  }
  if (rewritten_any) {
    v_.args = policy_args_;
    v_.modified = true;
    // A reply that names keys names the new ones: they go back to the client's names. So do the
    // stream commands' errors (NOGROUP No such key '<key>' ...).
    const commands::TenantHandling shape = commands::TraitsOf(c.id).tenant;
    static const uint32_t kStreamAcl = commands::AclCategoryMask("stream");
    if (shape == commands::TenantHandling::kFirstKey || shape == commands::TenantHandling::kStreams ||
        (spec.acl & kStreamAcl) != 0) {
      renamed_.clear();
      for (const commands::KeyRef& ref : key_refs_) {
        if (policy_args_[ref.pos].data() != args[ref.pos].data())
          renamed_.emplace_back(policy_args_[ref.pos], args[ref.pos]);
      }
      v_.renamed = renamed_;
      v_.renamed_shape =
          static_cast<uint8_t>(shape == commands::TenantHandling::kFirstKey  ? tenant::ReplyRewrite::kFirstKey
                               : shape == commands::TenantHandling::kStreams ? tenant::ReplyRewrite::kStreams
                                                                             : tenant::ReplyRewrite::kNone);
    }
  }
  return true;
}

namespace {

// With a Redis Cluster upstream keyguard answers these CLUSTER queries itself, as a one-node
// cluster at its own address (Connection::RouteCluster): they name nothing of the real cluster nor
// of another tenant, and cluster-aware clients (redis-py RedisCluster, ioredis Cluster, go-redis,
// Lettuce) ask them to connect. COUNTKEYSINSLOT and GETKEYSINSLOT would count and name every
// tenant's keys: not among them.
bool OneNodeClusterQuery(std::span<const std::string_view> args) {
  if (args.size() == 3) return commands::EqualsIgnoreCase(args[1], "keyslot");
  if (args.size() != 2) return false;
  for (std::string_view sub : {"slots", "shards", "nodes", "info", "myid"}) {
    if (commands::EqualsIgnoreCase(args[1], sub)) return true;
  }
  return false;
}

}  // namespace

bool CommandPipeline::Tenant(const CommandContext& c, const commands::CommandSpec* spec, bool keys_ok) {
  static const commands::CommandId kCluster = commands::LookupCommand("cluster");
  if (c.id == kCluster && shared_.config.upstream.kind == config::Upstream::Kind::kCluster &&
      OneNodeClusterQuery(v_.args)) [[unlikely]] {
    return true;  // answered by keyguard, unchanged
  }
  const tenant::RequestResult r =
      shared_.rewriter->Rewrite(*c.tenant, c.id, spec, v_.args, key_refs_, keys_ok, &tenant_args_);
  if (r.kind == tenant::RequestResult::Kind::kRefuse) return Refuse(Refusal::kTenant, r.message);
  if (r.modified) {
    v_.args = tenant_args_;
    v_.modified = true;
  }
  v_.rewrite = static_cast<uint8_t>(r.reply);
  v_.walk = r.walk;
  if (v_.walk != tenant::Walk::kNone && c.state->protocol() == 2 && MayBeSubscribed(*c.state, *c.queue)) [[unlikely]] {
    // A RESP2 subscribed connection runs no DBSIZE, FLUSH* or RANDOMKEY: the server's error, naming
    // the command (the walk's EVAL would have it name 'eval').
    return Refuse(Refusal::kTenant,
                  absl::StrCat("ERR Can't execute '", commands::Spec(c.id).name,
                               "': only (P|S)SUBSCRIBE / (P|S)UNSUBSCRIBE / PING / QUIT / RESET are allowed in this "
                               "context"));
  }
  if (v_.walk != tenant::Walk::kNone && (c.state->in_multi() || c.mode.silent)) {
    // A walk takes several round trips: it cannot be queued in a transaction, and under CLIENT
    // REPLY OFF/SKIP the server would not answer its steps.
    return Refuse(Refusal::kTenant,
                  absl::StrCat("ERR keyguard: ", Upper(c.args[0]),
                               " inside MULTI or under CLIENT REPLY OFF/SKIP is not allowed for tenants (keyguard "
                               "walks the tenant's keys in steps)"));
  }
  return true;
}

const std::vector<policy::Violation>& CommandPipeline::SuggestionBreaks(const policy::KeyPolicy& policy,
                                                                        const CommandContext& c,
                                                                        const commands::CommandSpec& spec,
                                                                        std::string_view suggestion) {
  suggestion_violations_.clear();
  policy.Check(suggestion, c.id, spec, &suggestion_violations_);
  return suggestion_violations_;
}

bool CommandPipeline::RewrittenAgain(const policy::KeyPolicy& policy, const CommandContext& c,
                                     const commands::CommandSpec& spec, const policy::Violation& v) {
  const std::vector<policy::Violation>& again = SuggestionBreaks(policy, c, spec, v.suggestion);
  return std::any_of(again.begin(), again.end(), [](const policy::Violation& w) {
    return w.rule->kind == policy::Rule::Kind::kUser && !w.rule->rewrite.empty() &&
           w.rule->action == policy::Action::kRewrite;
  });
}

bool CommandPipeline::MoveLegacy(const CommandContext& c) {
  if (v_.walk != tenant::Walk::kNone) return true;  // keyless: nothing was rewritten
  // The command runs against the new names without the move, as outside MULTI after a refusal.
  if (c.state->in_multi() && shared_.moves_refused) return true;
  if (c.state->in_multi() && c.mode.silent) {
    // The move would be queued in the transaction, and its element of EXEC's reply could not be
    // told from the client's own under CLIENT REPLY OFF/SKIP.
    return Refuse(Refusal::kKeyPolicy,
                  absl::StrCat("ERR keyguard: key '", KeyInError(legacy_.front().old),
                               "' is an old name keyguard moves to its new one; inside MULTI under CLIENT REPLY "
                               "OFF/SKIP that is not supported"));
  }
  // The names the server stores, both built here from the client's (old) name and the key
  // policy's (new) one with the tenant's prefix: whatever the tenant stage made of the command's
  // arguments, a tenant's move stays inside its own keys.
  const std::string_view prefix = c.tenant != nullptr ? std::string_view(c.tenant->prefix) : std::string_view();
  size_t total = 0;
  for (const Legacy& l : legacy_) total += 2 * prefix.size() + l.old.size() + policy_args_[l.pos].size();
  if (legacy_space_.size() < total) legacy_space_.resize(std::max(total, 2 * legacy_space_.size()));
  char* w = legacy_space_.data();
  const auto stored = [&](std::string_view name) {
    char* const start = w;
    if (!prefix.empty()) std::memcpy(w, prefix.data(), prefix.size());
    w += prefix.size();
    if (!name.empty()) std::memcpy(w, name.data(), name.size());
    w += name.size();
    return std::string_view(start, static_cast<size_t>(w - start));
  };
  legacy_count_ = std::to_string(2 * legacy_.size());
  const bool json = std::any_of(legacy_.begin(), legacy_.end(), [](const Legacy& l) { return l.json; });
  prelude_.assign({"EVAL", json ? kMoveLegacyJsonScript : kMoveLegacyScript, legacy_count_});
  for (const Legacy& l : legacy_) {
    prelude_.push_back(stored(l.old));
    prelude_.push_back(stored(policy_args_[l.pos]));
  }
  for (const Legacy& l : legacy_) prelude_.push_back(l.json ? (l.write ? "wj" : "rj") : (l.write ? "w" : "r"));
  v_.prelude = prelude_;
  return true;
}

void CommandPipeline::OldNamePatterns(const CommandContext& c) {
  if (c.id == known_.client) {
    BroadcastPrefixes(c);
    return;
  }
  // Inside MULTI the reply (KEYS, SCAN) or the confirmations ((P)(UN)SUBSCRIBE) are elements of
  // EXEC's reply, which keeps the server's names.
  if (c.state->in_multi()) return;
  if (c.id == known_.subscribe || c.id == known_.unsubscribe) {
    KeyspaceChannels(c);
    return;
  }
  if (c.id == known_.psubscribe || c.id == known_.punsubscribe) {
    KeyspacePatterns(c);
    return;
  }
  if (c.id != known_.keys && c.id != known_.scan) return;
  std::string_view pattern;
  size_t match = 0;  // SCAN: the position of the MATCH that applies (the last)
  if (c.id == known_.keys) {
    // KEYS of a cluster fans out to every node; the script that also finds new names would not.
    if (c.args.size() != 2 || shared_.config.upstream.kind == config::Upstream::Kind::kCluster) return;
    pattern = c.args[1];
  } else {
    for (size_t i = 2; i + 1 < c.args.size(); i += 2) {
      if (commands::EqualsIgnoreCase(c.args[i], "match")) match = i;
    }
    if (match == 0) return;
    pattern = c.args[match + 1];
  }
  // The rules whose old names the pattern may match; for KEYS, their new-name globs (with the
  // tenant's prefix), which KeysWithNewNames sends.
  pattern_space_.clear();
  bool may = false;
  for (const policy::Rule& r : shared_.live->key_policy->rules()) {
    if (!r.maps_patterns || !tenant::GlobMayMatchPrefix(pattern, r.old_head)) continue;
    may = true;
    if (c.id == known_.keys) {
      pattern_space_.push_back(c.tenant != nullptr ? absl::StrCat(c.tenant->glob_prefix, r.new_glob) : r.new_glob);
    }
  }
  if (!may) return;
  if (c.id == known_.keys) after_ = After::kKeys;
  renamed_.assign({{pattern, std::string_view()}});
  v_.renamed = renamed_;
  v_.renamed_shape =
      static_cast<uint8_t>(c.id == known_.keys ? tenant::ReplyRewrite::kKeyArray : tenant::ReplyRewrite::kScan);
  if (c.id == known_.scan) {
    // SCAN without its MATCHes (a tenant's own prefix becomes the pattern): the reply keeps the
    // keys that match, and the new names whose old names match, under their old names.
    policy_args_.clear();
    for (size_t i = 0; i < c.args.size(); ++i) {
      if (i >= 2 && i + 1 < c.args.size() && i % 2 == 0 && commands::EqualsIgnoreCase(c.args[i], "match")) {
        ++i;
        continue;
      }
      policy_args_.push_back(c.args[i]);
    }
    v_.args = policy_args_;
    v_.modified = true;
  }
}

void CommandPipeline::KeyspaceChannels(const CommandContext& c) {
  // SUBSCRIBE __keyspace@0__:User_1_Profile: the channel of the key's new name, whose messages
  // and confirmations the connection names back (Connection::RenameChannels).
  const policy::KeyPolicy& policy = *shared_.live->key_policy;
  channel_space_.clear();
  std::vector<size_t> at;
  for (size_t i = 1; i < c.args.size(); ++i) {
    const size_t head = tenant::KeyspaceHeadLength(c.args[i]);
    if (head == 0) continue;
    std::optional<std::string> renamed = policy.NewName(c.args[i].substr(head));
    if (!renamed) continue;
    channel_space_.push_back(std::string(c.args[i].substr(0, head)) + *renamed);
    at.push_back(i);
  }
  RenameArgs(c, at, static_cast<uint8_t>(tenant::ReplyRewrite::kChannelArray));
}

std::string CoverPattern(std::string_view pattern, size_t head, std::span<const policy::Rule* const> rules) {
  const std::string_view key = pattern.substr(head);
  size_t literal = key.find_first_of("*?[\\");
  if (literal == std::string_view::npos) literal = key.size();
  for (const policy::Rule* r : rules) literal = std::min(literal, r->new_head.size());
  std::string out(pattern.substr(0, head));
  constexpr std::string_view kSpecial = "*?[]\\^-";
  for (size_t i = 0; i < literal; ++i) {
    std::string chars(1, key[i]);
    for (const policy::Rule* r : rules) {
      if (chars.find(r->new_head[i]) == std::string::npos) chars.push_back(r->new_head[i]);
    }
    if (chars.find_first_of(kSpecial) != std::string::npos) break;
    if (chars.size() == 1) {
      out += chars;
    } else {
      absl::StrAppend(&out, "[", chars, "]");
    }
  }
  out += "**";
  return out;
}

void CommandPipeline::KeyspacePatterns(const CommandContext& c) {
  // PSUBSCRIBE __keyspace@0__:User_*: a pattern that also matches the new names, unique on the
  // connection (more '*' at its end), so the server's subscription counts stay the client's.
  const auto& pairs = patterns_renamed_;
  const bool subscribe = c.id == known_.psubscribe;
  channel_space_.clear();
  channel_space_.reserve(c.args.size());  // views of them go out: no reallocation
  std::vector<size_t> at;
  std::vector<const policy::Rule*> rules;
  for (size_t i = 1; i < c.args.size(); ++i) {
    const std::string_view p = c.args[i];
    const auto known = std::find_if(pairs.begin(), pairs.end(), [&](const auto& x) { return x.second == p; });
    if (known != pairs.end()) {
      channel_space_.push_back(known->first);
      at.push_back(i);
      continue;
    }
    // The same pattern earlier in this command: the same one again, as the server would see it.
    const auto earlier = std::find_if(at.begin(), at.end(), [&](size_t j) { return c.args[j] == p; });
    if (earlier != at.end()) {
      std::string again = channel_space_[static_cast<size_t>(earlier - at.begin())];
      channel_space_.push_back(std::move(again));
      at.push_back(i);
      continue;
    }
    if (!subscribe || pairs.size() + at.size() >= kMaxRenamedSubscriptions) continue;
    const size_t head = tenant::KeyspaceHeadLength(p);
    if (head == 0) continue;
    rules.clear();
    for (const policy::Rule& r : shared_.live->key_policy->rules()) {
      if (r.maps_patterns && tenant::GlobMayMatchPrefix(p.substr(head), r.old_head)) rules.push_back(&r);
    }
    if (rules.empty()) continue;
    std::string cover = CoverPattern(p, head, rules);
    const auto taken = [&](const std::string& g) {
      return std::any_of(pairs.begin(), pairs.end(), [&](const auto& x) { return x.first == g; }) ||
             std::find(channel_space_.begin(), channel_space_.end(), g) != channel_space_.end();
    };
    while (taken(cover)) cover.push_back('*');
    channel_space_.push_back(std::move(cover));
    at.push_back(i);
  }
  // (PUNSUBSCRIBE: the pair goes with the server's confirmation, RenamePatterns.)
  RenameArgs(c, at, subscribe ? std::optional<uint8_t>(kRenamedPatterns) : std::nullopt);
}

void CommandPipeline::RenameArgs(const CommandContext& c, const std::vector<size_t>& at, std::optional<uint8_t> shape) {
  if (at.empty()) return;
  policy_args_.assign(c.args.begin(), c.args.end());
  renamed_.clear();
  for (size_t n = 0; n < at.size(); ++n) {
    policy_args_[at[n]] = channel_space_[n];
    renamed_.emplace_back(channel_space_[n], c.args[at[n]]);
  }
  v_.args = policy_args_;
  v_.modified = true;
  if (shape) {
    v_.renamed = renamed_;
    v_.renamed_shape = *shape;
  }
}

tenant::ReplyAction RenamePatterns(const policy::KeyPolicy& policy,
                                   std::vector<std::pair<std::string, std::string>>* pairs, std::string_view frame,
                                   std::string* out) {
  std::optional<resp::Value> v = resp::ParseValue(frame);
  if (!v || (v->type != '*' && v->type != '>') || v->elements.size() < 3) return tenant::ReplyAction::kPass;
  auto& e = v->elements;
  const bool message = IsWord(e[0], "pmessage");
  if (!message && !IsWord(e[0], "punsubscribe") && !IsWord(e[0], "psubscribe")) return tenant::ReplyAction::kPass;
  if (e[1].null) return tenant::ReplyAction::kPass;
  const auto it = std::find_if(pairs->begin(), pairs->end(), [&](const auto& p) { return p.first == e[1].text; });
  if (it == pairs->end()) return tenant::ReplyAction::kPass;
  const std::string client_pattern = it->second;  // (the values' text are views)
  std::string named;
  e[1].text = client_pattern;
  if (message) {
    if (e.size() < 4 || e[2].null) return tenant::ReplyAction::kDrop;
    const std::string_view channel = e[2].text;
    if (!hygiene::GlobMatch(client_pattern, channel)) {
      // Not the client's pattern: a new name whose old name it matches, else nothing it asked for.
      const size_t head = tenant::KeyspaceHeadLength(channel);
      if (head == 0) return tenant::ReplyAction::kDrop;
      const std::optional<std::string> old = policy.OldName(channel.substr(head), /*pattern_rules=*/true);
      if (!old) return tenant::ReplyAction::kDrop;
      named = absl::StrCat(AsAbsl(channel.substr(0, head)), *old);
      if (!hygiene::GlobMatch(client_pattern, named)) return tenant::ReplyAction::kDrop;
      e[2].text = named;
    }
  }
  out->clear();
  resp::AppendValue(out, *v);
  return tenant::ReplyAction::kReplace;
}

void CommandPipeline::BroadcastPrefixes(const CommandContext& c) {
  // CLIENT TRACKING ON ... BCAST ... PREFIX p ...: a prefix of old names gets the new names'
  // prefix too, so that their invalidations come (InvalidateOldNames adds the old names).
  const auto args = c.args;
  if (args.size() < 5 || !commands::EqualsIgnoreCase(args[1], "tracking") ||
      !commands::EqualsIgnoreCase(args[2], "on")) {
    return;
  }
  bool bcast = false;
  std::vector<std::string_view> prefixes;
  for (size_t i = 3; i < args.size(); ++i) {
    if (commands::EqualsIgnoreCase(args[i], "bcast")) {
      bcast = true;
    } else if (i + 1 < args.size() &&
               (commands::EqualsIgnoreCase(args[i], "prefix") || commands::EqualsIgnoreCase(args[i], "redirect"))) {
      if (commands::EqualsIgnoreCase(args[i], "prefix")) prefixes.push_back(args[i + 1]);
      ++i;
    }
  }
  if (!bcast || prefixes.empty()) return;  // (without a prefix every key's invalidation comes)
  const auto related = [](std::string_view a, std::string_view b) { return a.starts_with(b) || b.starts_with(a); };
  const size_t given = prefixes.size();
  for (const policy::Rule& r : shared_.live->key_policy->rules()) {
    if (!r.maps_patterns || r.new_head.empty()) continue;
    const bool names_old = std::any_of(prefixes.begin(), prefixes.begin() + static_cast<std::ptrdiff_t>(given),
                                       [&](std::string_view p) { return related(p, r.old_head); });
    // The server refuses overlapping prefixes: one that overlaps the new names' is left as it is.
    const bool overlaps =
        std::any_of(prefixes.begin(), prefixes.end(), [&](std::string_view p) { return related(p, r.new_head); });
    if (names_old && !overlaps) prefixes.push_back(r.new_head);
  }
  if (prefixes.size() == given) return;
  policy_args_.assign(args.begin(), args.end());
  for (size_t i = given; i < prefixes.size(); ++i) {
    policy_args_.push_back("PREFIX");
    policy_args_.push_back(prefixes[i]);
  }
  v_.args = policy_args_;
  v_.modified = true;
}

void CommandPipeline::KeysWithNewNames() {
  // KEYS pattern -> one script that also runs KEYS for the new names of each rule that maps
  // patterns (OldNamePatterns' globs): the reply is both lists, filtered as for SCAN.
  const std::string_view first = v_.args[1];  // the tenant's pattern when it has one
  pattern_args_.assign({"EVAL", kKeysWithNewNamesScript, "0", first});
  for (const std::string& g : pattern_space_) pattern_args_.push_back(g);
  v_.args = pattern_args_;
  v_.modified = true;
}

void CommandPipeline::SortWithNewNames(const CommandContext& c) {
  // SORT's BY and GET name `<prefix><element><suffix>[-><field>]` (the first '*' takes the
  // element): for a pattern whose prefix and suffix are a one-group rule's literals around its
  // group, the new names are `<new head><element><new tail>`, and the script reads each key under
  // its new name when that holds a value, else under its old name (a key not moved yet). Not in
  // a cluster, where the server refuses BY and GET patterns; KEYS is not mapped there either.
  if (shared_.config.upstream.kind == config::Upstream::Kind::kCluster) return;
  const bool read_only = c.id == known_.sort_ro;
  const commands::SortOptions o = commands::ParseSort(read_only, c.args);
  if (!o.error.empty() || o.patterns.empty()) return;
  const std::string_view prefix = c.tenant != nullptr ? std::string_view(c.tenant->prefix) : std::string_view();
  // The new names' pattern for the client's pattern at `pos`, as the server gets it (the tenant's
  // prefix first); empty when the pattern names no rule's old names.
  const auto new_pattern = [&](uint32_t pos) -> std::string {
    const std::string_view p = c.args[pos];
    const std::string_view spat = p.substr(0, p.find('\0'));  // the server's strchr
    const size_t star = spat.find('*');
    if (star == std::string_view::npos) return {};
    size_t end = p.find("->", star + 1);
    if (end == std::string_view::npos || end + 2 == p.size()) end = p.size();  // no field: the whole key
    const std::string_view head = p.substr(0, star), tail = p.substr(star + 1, end - star - 1);
    for (const policy::Rule& r : shared_.live->key_policy->rules()) {
      if (!r.maps_patterns || r.groups != 1 || head != r.old_head || tail != r.old_tail ||
          r.new_head.find('*') != std::string::npos) {
        continue;
      }
      return absl::StrCat(AsAbsl(prefix), r.new_head, "*", r.new_tail, AsAbsl(p.substr(end)));
    }
    return {};
  };
  sort_space_.clear();
  sort_space_.reserve(o.patterns.size() + 2);  // views of them go out: no reallocation
  std::vector<int> mapped(c.args.size(), -1);  // by position: its new pattern in sort_space_
  for (uint32_t pos : o.patterns) {
    std::string n = new_pattern(pos);
    if (n.empty()) continue;
    mapped[pos] = static_cast<int>(sort_space_.size());
    sort_space_.push_back(std::move(n));
  }
  // BY matters only when the server sorts by it: a BY without '*' anywhere means no sorting.
  const bool lua_sort = o.by >= 0 && !o.dontsort && mapped[static_cast<size_t>(o.by)] >= 0;
  const bool any_get = std::any_of(o.gets.begin(), o.gets.end(), [&](uint32_t pos) { return mapped[pos] >= 0; });
  if (!lua_sort && !any_get) return;
  const auto args = v_.args;  // the key policy's and the tenant's names, at the client's positions
  std::string layout = lua_sort ? "pm" : "";
  std::string flags = lua_sort ? absl::StrCat("s", o.alpha ? "A" : "", o.desc ? "D" : "") : "";
  std::vector<std::string_view> server;  // SORT's arguments after the key
  // After a GET's pattern: its new names' when it has some ('m' in the layout, else 'p').
  const auto also_new = [&](uint32_t pos) {
    const bool both = mapped[pos] >= 0;
    if (both) server.insert(server.end(), {"GET", sort_space_[static_cast<size_t>(mapped[pos])]});
    layout.push_back(both ? 'm' : 'p');
  };
  if (lua_sort) {
    // Every element with its weight under both names, then the GETs; BY, LIMIT, ASC/DESC and
    // ALPHA are the script's.
    const size_t by = static_cast<size_t>(o.by);
    server.insert(server.end(), {"BY", "nosort", "GET", "#", "GET", args[by], "GET", sort_space_[mapped[by]]});
    for (uint32_t pos : o.gets) {
      server.insert(server.end(), {"GET", args[pos]});
      also_new(pos);
    }
    if (o.gets.empty()) {
      server.insert(server.end(), {"GET", "#"});
      layout.push_back('p');
    }
  } else {
    // The client's options as they are, each mapped GET asked again under the new names, without
    // STORE (the script writes the result).
    auto store = o.stores.begin();
    auto next_get = o.gets.begin();
    for (size_t j = 2; j < args.size(); ++j) {
      if (store != o.stores.end() && j + 1 == *store) {
        ++j;
        ++store;
        continue;
      }
      server.push_back(args[j]);
      if (next_get != o.gets.end() && j == *next_get) also_new(*next_get++);
    }
  }
  // Lua's unpack takes some 8,000 values: a SORT with more options goes as it is.
  constexpr size_t kMaxUnpacked = 7000;
  if (server.size() > kMaxUnpacked) return;
  sort_space_.push_back(std::move(layout));
  sort_space_.push_back(std::move(flags));
  const std::string_view script_layout = sort_space_[sort_space_.size() - 2], script_flags = sort_space_.back();
  pattern_args_.assign({read_only ? "EVAL_RO" : "EVAL", kSortWithNewNamesScript, o.store > 0 ? "2" : "1", args[1]});
  if (o.store > 0) pattern_args_.push_back(args[static_cast<size_t>(o.store)]);
  pattern_args_.insert(pattern_args_.end(), {read_only ? "SORT_RO" : "SORT", script_layout, script_flags});
  if (lua_sort && o.limit > 0) {
    pattern_args_.push_back(args[static_cast<size_t>(o.limit)]);
    pattern_args_.push_back(args[static_cast<size_t>(o.limit) + 1]);
  } else {
    pattern_args_.insert(pattern_args_.end(), {"0", "-1"});
  }
  pattern_args_.insert(pattern_args_.end(), server.begin(), server.end());
  v_.args = pattern_args_;
  v_.modified = true;
}

bool CommandPipeline::Hygiene(const CommandContext& c) {
  // The detectors look at the client's own names (c.args); their rewrites apply on top of what
  // the policy and the tenant stage made (v_.args): positions are the same.
  edit_.Reset(v_.args);
  v_.reply_check = detectors_.OnRequest(c.id, c.args, edit_, c.state->watching(), c.tenant != nullptr, &v_.message);
  if (!v_.message.empty()) return Refuse(Refusal::kHygiene, std::move(v_.message));
  if (edit_.modified()) {
    v_.args = edit_.args();
    v_.modified = true;
  }
  return true;
}

void CommandPipeline::Warn(const CommandContext& c, const policy::Rule& rule, std::string_view suggestion,
                           std::string_view key) {
  // At most kWarnBurst lines per second per worker, so a misbehaving app cannot flood the log.
  constexpr int kWarnBurst = 20;
  const int64_t second =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  if (second != shared_.warn_second) {
    shared_.warn_second = second;
    shared_.warn_count = 0;
  }
  if (++shared_.warn_count > kWarnBurst) return;
  EventLine line("warn", "key_violation");
  line.Str("rule", rule.name).Str("key", key).Str("command", commands::CommandName(c.id));
  if (!suggestion.empty()) line.Str("suggestion", suggestion);
  line.Str("client", c.client).Str("client_name", c.state->client_name()).Write(stderr);
}

bool IsWord(const resp::Value& v, std::string_view word) {
  return !v.null && (v.type == '$' || v.type == '+') && commands::EqualsIgnoreCase(v.text, word);
}

tenant::ReplyAction InvalidateOldNames(const policy::KeyPolicy& policy, std::string_view frame, std::string* out) {
  if (!policy.has_reversible_rules() || frame.find("invalidate") == std::string_view::npos) {
    return tenant::ReplyAction::kPass;
  }
  std::optional<resp::Value> v = resp::ParseValue(frame);
  if (!v || v->elements.empty()) return tenant::ReplyAction::kPass;
  auto& e = v->elements;
  resp::Value* keys = nullptr;
  if (v->type == '>' && e.size() == 2 && IsWord(e[0], "invalidate")) {
    keys = &e[1];
  } else if (v->type == '*' && e.size() == 3 && IsWord(e[0], "message") && IsWord(e[1], "__redis__:invalidate")) {
    keys = &e[2];
  }
  if (keys == nullptr || keys->null || keys->elements.empty()) return tenant::ReplyAction::kPass;
  std::deque<std::string> names;
  std::vector<resp::Value> with_old;
  for (resp::Value& k : keys->elements) {
    std::optional<std::string> old = k.null ? std::nullopt : policy.OldName(k.text);
    with_old.push_back(k);
    if (!old) continue;
    resp::Value o = k;
    o.text = names.emplace_back(*std::move(old));
    with_old.push_back(std::move(o));
  }
  if (with_old.size() == keys->elements.size()) return tenant::ReplyAction::kPass;
  keys->elements = std::move(with_old);
  out->clear();
  resp::AppendValue(out, *v);
  return tenant::ReplyAction::kReplace;
}

tenant::ReplyAction OldNamesMatching(const policy::KeyPolicy& policy, uint8_t shape, std::string_view pattern,
                                     std::string_view frame, std::string* out) {
  std::optional<resp::Value> v = resp::ParseValue(frame);
  if (!v || v->null || (v->type != '*' && v->type != '~')) return tenant::ReplyAction::kPass;
  resp::Value* keys = &*v;
  if (shape == static_cast<uint8_t>(tenant::ReplyRewrite::kScan)) {
    if (v->elements.size() != 2 || (v->elements[1].type != '*' && v->elements[1].type != '~')) {
      return tenant::ReplyAction::kPass;
    }
    keys = &v->elements[1];
  }
  std::deque<std::string> names;
  absl::flat_hash_set<std::string_view> seen;
  const bool once = shape == static_cast<uint8_t>(tenant::ReplyRewrite::kKeyArray);
  std::vector<resp::Value> kept;
  kept.reserve(keys->elements.size());
  for (resp::Value& k : keys->elements) {
    if (k.null) continue;
    // (KEYS * and SCAN MATCH * list every key, "" too, which stringmatchlen's "*" does not match.)
    if (pattern != "*" && !hygiene::GlobMatch(pattern, k.text)) {
      std::optional<std::string> old = policy.OldName(k.text, /*pattern_rules=*/true);
      if (!old || !hygiene::GlobMatch(pattern, *old)) continue;
      k.text = names.emplace_back(*std::move(old));
    }
    if (once && !seen.insert(k.text).second) continue;
    kept.push_back(k);
  }
  keys->elements = std::move(kept);
  out->clear();
  resp::AppendValue(out, *v);
  return tenant::ReplyAction::kReplace;
}

}  // namespace keyguard::proxy
