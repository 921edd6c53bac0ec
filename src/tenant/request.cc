// Request side of tenancy: keys get the prefix, patterns get the escaped prefix, channels are
// mapped, and commands that reach beyond the tenant's keys are emulated within the prefix or
// refused.
#include <algorithm>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "keyguard/commands/traits.h"
#include "keyguard/resp/encoder.h"
#include "keyguard/resp/framer.h"
#include "keyguard/tenant/rewrite.h"
#include "keyguard/common/views.h"

namespace keyguard::tenant {
namespace {

using commands::EqualsIgnoreCase;

// Special handling by command id (commands::Traits::tenant).
using enum commands::TenantHandling;

// SHA1s of the whole-walk emulation scripts of earlier releases: a tenant's SCRIPT EXISTS still
// answers 0 for them (another tenant may have run them through an older keyguard).
constexpr std::string_view kOldFlushScript =
    "local c='0' repeat local r=redis.call('SCAN',c,'MATCH',ARGV[1],'COUNT',1000) c=r[1] "
    "for _,k in ipairs(r[2]) do redis.call('UNLINK',k) end until c=='0' return redis.status_reply('OK')";
constexpr std::string_view kOldDbsizeScript =
    "local c='0' local n=0 repeat local r=redis.call('SCAN',c,'MATCH',ARGV[1],'COUNT',1000) c=r[1] n=n+#r[2] "
    "until c=='0' return n";
constexpr std::string_view kOldRandomkeyScript =
    "for i=1,32 do local k=redis.call('RANDOMKEY') if not k then return false end "
    "if string.sub(k,1,#ARGV[2])==ARGV[2] then return k end end "
    "local c='0' repeat local r=redis.call('SCAN',c,'MATCH',ARGV[1],'COUNT',100) c=r[1] "
    "if #r[2]>0 then return r[2][math.random(#r[2])] end until c=='0' return false";

// One step of a walk over the tenant's keys (WalkStep). ARGV: the walk (flush, dbsize or
// randomkey), the tenant's escaped prefix followed by '*', the raw prefix, the SCAN cursor, the
// COUNT, and the step number. RANDOMKEY's first step tries the server's RANDOMKEY (cheap when the
// tenant holds a fair share of the keys) before it scans.
constexpr std::string_view kWalkScript =
    "local w,c=ARGV[1],ARGV[4] "
    "if w=='randomkey' and ARGV[6]=='0' then for i=1,32 do local k=redis.call('RANDOMKEY') "
    "if not k then return {'0',0,''} end if string.sub(k,1,#ARGV[3])==ARGV[3] then return {'0',0,k} end end end "
    "local r=redis.call('SCAN',c,'MATCH',ARGV[2],'COUNT',ARGV[5]) local ks=r[2] "
    "if w=='flush' then for _,k in ipairs(ks) do redis.call('UNLINK',k) end "
    "elseif w=='randomkey' and #ks>0 then return {'0',#ks,ks[math.random(#ks)]} end "
    "return {r[1],#ks,''}";

// A loop rather than memchr: command names are a few bytes, checked on every command.
bool HasNul(std::string_view s) {
  for (char c : s) {
    if (c == '\0') return true;
  }
  return false;
}

constexpr std::string_view kUnconfinedPattern =
    "ERR keyguard: this pattern may match other tenants' channels; keyspace patterns must start with "
    "__keyspace@<db>__: literally";

std::string NotAllowed(std::string_view what) {
  return absl::StrCat("ERR keyguard: command '", std::string(what), "' is not allowed for tenants");
}

// Gives every key in `out` the tenant's prefix: all prefixed keys in one reserved buffer, so no
// allocation per key and no view moves. Sets `modified` when there was a key.
void PrefixKeys(const Tenant& tenant, std::span<const commands::KeyRef> keys, std::string* space,
                std::vector<std::string_view>* out, bool* modified) {
  if (keys.empty()) return;
  const std::string_view prefix = tenant.prefix;
  size_t total = 0;
  for (const commands::KeyRef& k : keys) total += prefix.size() + (*out)[k.pos].size();
  // Sized once (the buffer never moves while the views point into it), written with memcpy.
  if (space->size() < total) space->resize(std::max(total, 2 * space->size()));
  char* w = space->data();
  for (const commands::KeyRef& k : keys) {
    const std::string_view key = (*out)[k.pos];
    char* const start = w;
    std::memcpy(w, prefix.data(), prefix.size());
    w += prefix.size();
    if (!key.empty()) std::memcpy(w, key.data(), key.size());
    w += key.size();
    (*out)[k.pos] = std::string_view(start, static_cast<size_t>(w - start));
  }
  *modified = true;
}

}  // namespace

RequestRewriter::RequestRewriter(const Tenancy& tenancy, const Connections* connections)
    : tenancy_(tenancy),
      connections_(connections),
      own_scripts_{Sha1Hex(kWalkScript), Sha1Hex(kOldFlushScript), Sha1Hex(kOldDbsizeScript),
                   Sha1Hex(kOldRandomkeyScript)},
      plain_(commands::CommandCount(), 0),
      reach_(commands::AclCategoryMask("admin") | commands::AclCategoryMask("dangerous")) {
  for (size_t id = 1; id < plain_.size(); ++id) {
    const auto c = static_cast<commands::CommandId>(id);
    const commands::Traits& t = commands::TraitsOf(c);
    plain_[id] = t.tenant == kPlain && !t.has_subcommands && commands::IsBuiltin(c);
  }
}

std::string_view RequestRewriter::Own(std::string s) { return owned_.emplace_back(std::move(s)); }

std::string_view RequestRewriter::Joined(std::string_view a, std::string_view b) {
  std::string& s = owned_.emplace_back();
  s.reserve(a.size() + b.size());
  return s.append(a).append(b);
}

std::string_view RequestRewriter::ChannelIn(const Tenant& t, std::string_view channel) {
  switch (ClassifyChannel(channel)) {
    case ChannelKind::kKeyspace: {
      const size_t head = KeyspaceHeadLength(channel);
      return Own(absl::StrCat(AsAbsl(channel.substr(0, head)), t.prefix, AsAbsl(channel.substr(head))));
    }
    case ChannelKind::kKeyevent:
    case ChannelKind::kInvalidate: return channel;  // shared; their payloads are confined on the way back
    case ChannelKind::kOrdinary: break;
  }
  if (tenancy_.channels == ChannelMode::kShared) return channel;
  return Joined(t.prefix, channel);
}

std::optional<std::string_view> RequestRewriter::PatternIn(const Tenant& t, std::string_view pattern) {
  // A keyspace pattern gets the prefix after its head, which is only sound when the head is
  // literal: in `__keyspace@[^__:]*` the "head" ends inside a class, and `__keyspace@*__:` lets
  // the '*' run into any tenant's key.
  if (const size_t head = LiteralKeyspaceHead(pattern); head != 0) {
    return Own(absl::StrCat(AsAbsl(pattern.substr(0, head)), t.glob_prefix, AsAbsl(pattern.substr(head))));
  }
  if (pattern.starts_with("__keyspace@")) return std::nullopt;
  if (pattern.starts_with("__keyevent@")) return pattern;  // shared; payloads are confined on the way back
  if (tenancy_.channels == ChannelMode::kShared) {
    if (GlobMayMatchPrefix(pattern, "__keyspace@")) return std::nullopt;
    return pattern;
  }
  return Joined(t.glob_prefix, pattern);  // matches only what starts with the literal prefix
}

bool RequestRewriter::ConfineUnplacedKeys(const Tenant& tenant, const commands::CommandSpec& spec,
                                          std::vector<std::string_view>* args) {
  // A key count that does not fit the arguments (`SINTERCARD 0 k`, `ZUNIONSTORE d 3 a x`) is an
  // error the server reports in its own words, which differ by command and by which check fails
  // first. The command goes to the server so that it answers (in MULTI: queues it and fails at
  // EXEC) as it would directly, with every argument that could be a key prefixed: the checks
  // before the error read only the count, the arguments before the keys and the argument count,
  // none of which change, and should the server run it after all, it reaches no other tenant.
  std::span<const commands::KeySpec> specs = commands::KeySpecs(spec);
  if (specs.empty()) return false;
  size_t from = SIZE_MAX;
  bool keynum = false;
  for (const commands::KeySpec& k : specs) {
    if (k.begin != commands::KeySpec::kIndex || k.index < 1 || (k.flags & commands::kKeyIncomplete) != 0) return false;
    keynum |= k.find == commands::KeySpec::kKeynum;
    from = std::min(from, static_cast<size_t>(k.index));
  }
  if (!keynum) return false;
  std::vector<std::string_view>& out = *args;
  size_t total = 0;
  for (size_t i = from; i < out.size(); ++i) total += tenant.prefix.size() + out[i].size();
  key_space_.clear();
  key_space_.reserve(total);
  for (size_t i = from; i < out.size(); ++i) {
    const bool count = std::any_of(specs.begin(), specs.end(), [&](const commands::KeySpec& k) {
      return k.find == commands::KeySpec::kKeynum && static_cast<size_t>(k.index + k.keynumidx) == i;
    });
    if (count) continue;
    const size_t start = key_space_.size();
    key_space_.append(tenant.prefix).append(out[i]);
    out[i] = std::string_view(key_space_.data() + start, key_space_.size() - start);
  }
  return true;
}

RequestResult RequestRewriter::Rewrite(const Tenant& tenant, commands::CommandId id, const commands::CommandSpec* spec,
                                       std::span<const std::string_view> args, std::span<const commands::KeyRef> keys,
                                       bool keys_ok, std::vector<std::string_view>* out) {
  if (!owned_.empty()) owned_.clear();
  // The common case, a built-in command without subcommands that nothing below treats specially
  // (GET, SET, HSET, ...) and that is neither @admin nor @dangerous: every key prefixed. The same
  // answer as the general path, returned without copying a result.
  if (keys_ok && id < plain_.size() && plain_[id] && spec != nullptr && (spec->acl & reach_) == 0 && !HasNul(args[0])) {
    out->assign(args.begin(), args.end());
    bool modified = false;
    PrefixKeys(tenant, keys, &key_space_, out, &modified);
    return RequestResult{.modified = modified};
  }
  RequestResult r;
  auto refuse = [&](std::string message) {
    r.kind = RequestResult::Kind::kRefuse;
    r.message = std::move(message);
    return r;
  };
  // The server finds a name holding a NUL only when its hash shares a bucket with the name the
  // NUL cuts it to (the lookup hashes every byte, compares with strcasecmp): by its random hash
  // seed, "CLIENT REPLY\0x SKIP" runs as CLIENT REPLY SKIP on one server and is refused on the
  // next. keyguard cannot know which, so connection state it follows could differ: refused.
  if (HasNul(args[0]) || (args.size() > 1 && id != commands::kUnknownCommand &&
                          commands::TraitsOf(id).has_subcommands && HasNul(args[1]))) {
    return refuse("ERR keyguard: a command or subcommand name holding a NUL byte is not allowed for tenants");
  }
  if (id == commands::kUnknownCommand) {
    // A command keyguard cannot see the keys of (a module the upstream did not describe).
    return refuse(
        absl::StrCat("ERR keyguard: unknown command '", std::string(args[0]), "' is not allowed for tenants"));
  }
  if (!commands::IsBuiltin(id)) {
    // A module command (or a newer server's) is confined only when its key specs say where every
    // key is: FT.CREATE ... PREFIX or FT.SEARCH have none, and would reach every tenant's keys.
    const commands::CommandSpec* s = spec != nullptr ? spec : &commands::Spec(id);
    bool complete = s->spec_count > 0;
    for (const commands::KeySpec& k : commands::KeySpecs(*s)) complete &= (k.flags & commands::kKeyIncomplete) == 0;
    if (!complete) {
      return refuse(absl::StrCat("ERR keyguard: command '", Upper(args[0]),
                                 "' does not declare all its keys, so it cannot be confined to the tenant"));
    }
  }
  if (spec == nullptr) {
    return refuse(absl::StrCat("ERR unknown subcommand '", std::string(args.size() > 1 ? args[1] : ""), "'. Try ",
                               Upper(args[0]), " HELP."));
  }
  out->assign(args.begin(), args.end());
  auto set = [&](size_t pos, std::string_view v) {
    (*out)[pos] = v;
    r.modified = true;
  };
  auto append = [&](std::string_view v) {
    out->push_back(v);
    r.modified = true;
  };
  const std::string_view sub = args.size() > 1 ? args[1] : std::string_view();
  // The command as errors name it ("CLIENT KILL"); built only when something is refused.
  auto display = [&] {
    return std::string_view(spec->name).find('|') != std::string_view::npos
               ? absl::StrCat(Upper(args[0]), " ", Upper(sub))
               : Upper(args[0]);
  };
  bool handled = true;
  const commands::TenantHandling handling = commands::TraitsOf(id).tenant;
  switch (handling) {
    // The walks answer as the server would, its argument errors included.
    case kFlush:
      if (tenancy_.flush == Emulation::kRefuse) return refuse(NotAllowed(display()));
      if (args.size() > 2 || (args.size() == 2 && !commands::EqualsIgnoreCase(args[1], "async") &&
                              !commands::EqualsIgnoreCase(args[1], "sync"))) {
        return refuse("ERR syntax error");
      }
      r.walk = Walk::kFlush;
      return r;
    case kDbsize:
    case kRandomkey:
      if ((handling == kDbsize ? tenancy_.dbsize : tenancy_.randomkey) == Emulation::kRefuse) {
        return refuse(NotAllowed(display()));
      }
      if (args.size() != 1) {
        return refuse(absl::StrCat("ERR wrong number of arguments for '", std::string(spec->name), "' command"));
      }
      r.walk = handling == kDbsize ? Walk::kDbsize : Walk::kRandomkey;
      return r;
    case kKeys:
      if (args.size() == 2) set(1, Joined(tenant.glob_prefix, args[1]));
      r.reply = ReplyRewrite::kKeyArray;
      break;
    case kScan: {
      // SCAN cursor [MATCH pattern] [COUNT n] [TYPE t]: every MATCH is confined; without one the
      // tenant's own prefix is the pattern.
      bool matched = false;
      for (size_t i = 2; i + 1 < args.size(); i += 2) {
        if (EqualsIgnoreCase(args[i], "match")) {
          set(i + 1, Joined(tenant.glob_prefix, args[i + 1]));
          matched = true;
        }
      }
      if (!matched) {
        append("MATCH");
        append(Joined(tenant.glob_prefix, "*"));
      }
      r.reply = ReplyRewrite::kScan;
      break;
    }
    case kSort: {
      // BY and GET patterns name keys (the '*' takes each element); they are not globs. Redis
      // puts the element at the pattern's first '*': one in the prefix would let the element
      // choose the key, so such a tenant's patterns are refused. Positions are those the server
      // executes (ParseSort); options it refuses are refused here with its own error, so that
      // nothing keyguard reads differently can run.
      const commands::SortOptions o = commands::ParseSort(std::string_view(spec->name) == "sort_ro", args);
      if (!o.error.empty()) return refuse(std::string(o.error));
      for (uint32_t i : o.patterns) {
        if (args[i] == "#") continue;
        if (tenant.prefix.find('*') != std::string::npos) {
          return refuse(absl::StrCat("ERR keyguard: ", display(),
                                     " BY/GET patterns are not allowed for a tenant whose "
                                     "prefix holds '*'"));
        }
        set(i, Joined(tenant.prefix, args[i]));
      }
      break;
    }
    case kSelect:
      if (args.size() == 2 && args[1] == "0") break;
      return refuse("ERR keyguard: a tenant has one database: only SELECT 0 is allowed");
    case kCopy:
      for (size_t i = 3; i < args.size(); ++i) {
        if (EqualsIgnoreCase(args[i], "db")) return refuse("ERR keyguard: COPY ... DB is not allowed for tenants");
      }
      break;
    case kMigrate: {
      if (args.size() < 3) break;
      const std::string target = absl::StrCat(std::string(args[1]), ":", std::string(args[2]));
      if (std::find(tenancy_.migrate_targets.begin(), tenancy_.migrate_targets.end(), target) ==
          tenancy_.migrate_targets.end()) {
        return refuse(absl::StrCat("ERR keyguard: MIGRATE to ", target, " is not allowed for tenants"));
      }
      break;
    }
    case kNever: return refuse(NotAllowed(display()));
    case kInfo: r.reply = ReplyRewrite::kInfo; break;
    case kDebug:
      if (args.size() == 3 && EqualsIgnoreCase(args[1], "object")) {
        set(2, Joined(tenant.prefix, args[2]));
        return r;
      }
      return refuse(NotAllowed(display()));
    case kEval:
    case kEvalSha: {
      if (args.size() < 2) break;
      const std::string sha = handling == kEval ? Sha1Hex(args[1]) : absl::AsciiStrToLower(std::string(args[1]));
      if (!tenancy_.allowed_scripts.contains(sha)) {
        return refuse(absl::StrCat("ERR keyguard: script ", sha,
                                   " is not in tenancy.allowed_scripts (a script may touch keys it was not given)"));
      }
      break;
    }
    case kFcall:
      if (args.size() >= 2 && !tenancy_.allowed_functions.contains(std::string(args[1]))) {
        return refuse(
            absl::StrCat("ERR keyguard: function '", std::string(args[1]), "' is not in tenancy.allowed_functions"));
      }
      break;
    case kScript:
      if (EqualsIgnoreCase(sub, "load") && args.size() == 3) {
        const std::string sha = Sha1Hex(args[2]);
        if (!tenancy_.allowed_scripts.contains(sha)) {
          return refuse(absl::StrCat("ERR keyguard: script ", sha, " is not in tenancy.allowed_scripts"));
        }
      } else if (EqualsIgnoreCase(sub, "exists")) {
        // The script cache is the server's: EXISTS would tell whether anyone ran a script since
        // the last flush, keyguard's own emulations (another tenant's DBSIZE) included. A tenant
        // can run only allow-listed scripts, so only those are asked; the others become "",
        // which names no script, and answer 0 in their place.
        for (size_t i = 2; i < args.size(); ++i) {
          const std::string sha = absl::AsciiStrToLower(std::string(args[i]));
          const bool own = std::find(own_scripts_.begin(), own_scripts_.end(), sha) != own_scripts_.end();
          if (own || !tenancy_.allowed_scripts.contains(sha)) set(i, std::string_view());
        }
      } else if (!EqualsIgnoreCase(sub, "help")) {
        return refuse(NotAllowed(display()));  // FLUSH, KILL, DEBUG act on every tenant's scripts
      }
      break;
    case kFunction:
      if (!EqualsIgnoreCase(sub, "help")) return refuse(NotAllowed(display()));
      break;
    case kClient:
      if (EqualsIgnoreCase(sub, "tracking")) {
        bool on = args.size() > 2 && EqualsIgnoreCase(args[2], "on");
        bool bcast = false, prefixed = false;
        for (size_t i = 3; i < args.size(); ++i) {
          if (EqualsIgnoreCase(args[i], "redirect") && i + 1 < args.size()) {
            // The server sends invalidations to any connection named here; only the tenant's own
            // may be named. Not a number: the server refuses it (and redirects nowhere).
            ++i;
            int64_t client_id;
            if (resp::ParseRedisInt(args[i], &client_id) &&
                (connections_ == nullptr || !connections_->Serves(client_id, tenant))) {
              return refuse("ERR keyguard: CLIENT TRACKING REDIRECT may only name a connection of the same tenant");
            }
          } else if (EqualsIgnoreCase(args[i], "prefix") && i + 1 < args.size()) {
            ++i;
            set(i, Joined(tenant.prefix, args[i]));
            prefixed = true;
          } else if (EqualsIgnoreCase(args[i], "bcast")) {
            bcast = true;
          }
        }
        // Broadcast tracking without a prefix would announce every tenant's writes.
        if (on && bcast && !prefixed) {
          append("PREFIX");
          append(tenant.prefix);
        }
      } else if (EqualsIgnoreCase(sub, "trackinginfo")) {
        r.reply = ReplyRewrite::kTrackingInfo;
      } else {
        handled = false;  // the category check below refuses KILL, LIST, PAUSE, UNBLOCK, ...
      }
      break;
    case kPubsub:
      if (EqualsIgnoreCase(sub, "channels") || EqualsIgnoreCase(sub, "shardchannels")) {
        if (args.size() == 3) {
          const auto p = PatternIn(tenant, args[2]);
          if (!p) return refuse(std::string(kUnconfinedPattern));
          set(2, *p);
        } else if (args.size() == 2 && tenancy_.channels == ChannelMode::kPrefix) {
          append(Joined(tenant.glob_prefix, "*"));
        }
        r.reply = ReplyRewrite::kChannelArray;
      } else if (EqualsIgnoreCase(sub, "numsub") || EqualsIgnoreCase(sub, "shardnumsub")) {
        for (size_t i = 2; i < args.size(); ++i) set(i, ChannelIn(tenant, args[i]));
        r.reply = ReplyRewrite::kChannelCounts;
      } else if (EqualsIgnoreCase(sub, "numpat")) {
        return refuse(NotAllowed(display()));  // counts every tenant's patterns
      }
      break;
    case kSubscribe:
      for (size_t i = 1; i < args.size(); ++i) set(i, ChannelIn(tenant, args[i]));
      return r;
    case kPsubscribe:
      for (size_t i = 1; i < args.size(); ++i) {
        const auto p = PatternIn(tenant, args[i]);
        if (!p) return refuse(std::string(kUnconfinedPattern));
        set(i, *p);
      }
      return r;
    case kPublish:
      if (args.size() < 2) break;
      if (tenancy_.channels == ChannelMode::kPrefix) {
        set(1, Joined(tenant.prefix, args[1]));
      } else if (ClassifyChannel(args[1]) != ChannelKind::kOrdinary) {
        return refuse("ERR keyguard: tenants may not publish to Redis's own channels");
      }
      return r;
    case kFirstKey: r.reply = ReplyRewrite::kFirstKey; break;
    case kStreams: r.reply = ReplyRewrite::kStreams; break;
    case kKeyed: break;
    case kMemory:
      // MEMORY USAGE of an own key; STATS counts every tenant's keys, DOCTOR, MALLOC-STATS and
      // PURGE describe or act on the whole server.
      if (!EqualsIgnoreCase(sub, "usage") && !EqualsIgnoreCase(sub, "help")) return refuse(NotAllowed(display()));
      handled = false;
      break;
    case kPlain:
    default: handled = false; break;
  }
  if (!handled && (spec->acl & reach_) != 0) return refuse(NotAllowed(display()));
  if (!keys_ok) {
    if (!ConfineUnplacedKeys(tenant, *spec, out)) {
      return refuse(absl::StrCat("ERR wrong number of arguments for '", std::string(spec->name), "' command"));
    }
    r.modified = true;
    return r;
  }
  PrefixKeys(tenant, keys, &key_space_, out, &r.modified);
  return r;
}

std::string WalkStep(const Tenant& tenant, Walk walk, std::string_view cursor, uint64_t step, uint32_t count) {
  const std::string glob = absl::StrCat(tenant.glob_prefix, "*");
  const std::string count_text = absl::StrCat(count), step_text = absl::StrCat(step);
  const std::string_view name = walk == Walk::kFlush ? "flush" : walk == Walk::kDbsize ? "dbsize" : "randomkey";
  const std::string_view args[] = {"EVAL", kWalkScript, "0", name, glob, tenant.prefix, cursor, count_text, step_text};
  std::string out;
  resp::AppendCommand(&out, args);
  return out;
}

}  // namespace keyguard::tenant
