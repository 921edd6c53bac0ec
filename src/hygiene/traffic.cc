#include "keyguard/hygiene/traffic.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "keyguard/commands/traits.h"
#include "keyguard/resp/framer.h"
#include "keyguard/common/views.h"

namespace keyguard::hygiene {
namespace {

using commands::EqualsIgnoreCase;

std::string CommandNameOf(commands::CommandId id) {
  const std::string_view n = commands::CommandName(id);
  return std::string(n.data(), n.size());
}

using commands::HygieneRole;
using commands::KeyType;
using commands::ReplyShows;
using commands::TtlUnit;

// What to look for in the reply, by what it shows (commands::ReplyShows).
constexpr uint8_t kReplyCheckOf[] = {kNoReplyCheck, kStringRead,     kNoReplyCheck,
                                     kNoReplyCheck, kCollectionRead, kCollectionRead};
static_assert(std::size(kReplyCheckOf) == static_cast<size_t>(ReplyShows::kComputedMembers) + 1);

// How to read a collection of `type` without reading it whole.
const char* CollectionReadSuggestion(KeyType type) {
  switch (type) {
    case KeyType::kHash: return "read it in pages with HSCAN, or only the fields you need with HMGET";
    case KeyType::kSet: return "read it in pages with SSCAN";
    case KeyType::kList: return "read it in windows: LRANGE key start start+N";
    case KeyType::kZset: return "read it in pages with ZSCAN or ZRANGE windows with LIMIT";
    case KeyType::kStream: return "read it in pages with XRANGE ... COUNT N";
    case KeyType::kString:
    case KeyType::kUnknown: break;
  }
  return "";
}

}  // namespace

void ConnectionDetectors::Emit(Finding f, std::string_view key, commands::CommandId id, bool can_act) {
  Finding full{f.kind};
  sink_.Stamp(&full, key, id);
  full.format = std::move(f.format);
  full.suggestion = std::move(f.suggestion);
  full.bytes = f.bytes;
  full.elements = f.elements;
  full.fields_changed = f.fields_changed;
  full.fields_total = f.fields_total;
  full.keys = f.keys;
  full.ttl_s = f.ttl_s;
  // Callers mark the findings they rewrote; a rewrite rule whose command could not be rewritten
  // (MSET cannot carry a TTL) warns.
  if ((full.action == Action::kRewrite && f.action != Action::kRewrite) ||
      (!can_act && (full.action == Action::kRewrite || full.action == Action::kReject))) {
    full.action = Action::kWarn;
  }
  if (full.action == Action::kReject && CanReject(full.kind) && refusal_ != nullptr && refusal_->empty()) {
    *refusal_ = absl::StrCat("ERR keyguard: ", KindName(full.kind), ": ", full.suggestion);
  }
  sink_.Report(std::move(full));
}

void ConnectionDetectors::RememberSize(std::string_view key, std::string_view type, int64_t bytes, int64_t elements) {
  KeySize s;
  s.type.assign(type.data(), type.size());
  s.bytes = bytes;
  s.elements = elements;
  s.at_ms = UnixMs();
  w_.sizes.Put(SizeKey(key), std::move(s));
}

void ConnectionDetectors::FlushPendingTtl(bool all) {
  const int64_t now_ms = UnixMs();
  while (!pending_ttl_.empty() && (all || pending_ttl_.front().deadline_ms <= now_ms)) {
    PendingTtl t = std::move(pending_ttl_.front());
    pending_ttl_.pop_front();
    // A collection write whose reply never said it created the key (an error reply: it wrote
    // nothing) is no finding.
    if (t.collection && t.expect >= 0) continue;
    const TtlPattern& pattern = settings_.ttl_patterns[t.pattern];
    Finding f{Kind::kMissingTtl};
    f.suggestion = absl::StrCat(pattern.session ? "session" : "cache", " key (", pattern.glob,
                                t.collection ? ") created without a TTL: EXPIRE it right after the write (in the same "
                                               "MULTI or pipeline), or it stays until evicted"
                                             : ") written without a TTL: give it one (SET ... EX seconds), or it stays "
                                               "until evicted");
    Emit(std::move(f), t.key, t.command, /*can_act=*/false);
  }
}

uint8_t ConnectionDetectors::OnRequest(commands::CommandId id, std::span<const std::string_view> args, ArgEditor& edit,
                                       bool watching, bool tenant, std::string* refusal) {
  refusal_ = refusal;
  if (!pending_ttl_.empty()) FlushPendingTtl(false);
  const commands::Traits& info = commands::TraitsOf(id);
  const uint8_t check = kReplyCheckOf[static_cast<uint8_t>(info.reply)];
  const Settings& settings = settings_;
  SharedSizeCache& sizes = w_.sizes;
  auto write = [&](std::string_view key, std::string_view value) {
    const bool big = value.size() >= settings.big_string_bytes;
    if (big) {
      Finding f{Kind::kBigStringWrite};
      f.bytes = static_cast<int64_t>(value.size());
      f.suggestion = value.size() >= settings.huge_string_bytes
                         ? "huge value: split it (a Hash or several keys) or keep it outside Redis"
                         : "big value: store the parts you update separately (a Hash), or compress it";
      Emit(std::move(f), key, id);
      RememberSize(key, "string", static_cast<int64_t>(value.size()), -1);
    } else if (!sizes.empty()) {
      sizes.Erase(SizeKey(key));
    }
    if (!info.rmw_write) return;
    // Plain small values under a `parent:attribute` name (an id as the last segment is none).
    if (std::string_view parent_name;
        value.size() < 256 && DetectFormat(value) == Format::kNone && AttributeTracker::ParentOf(key, &parent_name)) {
      std::string parent;
      std::vector<std::string> names;
      if (w_.shared.OnAttributeWrite(key, parent_name, &parent, &names, scope_)) {
        Finding f{Kind::kHashCandidate};
        f.elements = static_cast<int64_t>(names.size());
        f.suggestion = absl::StrCat("one attribute per key: keep them in one Hash, HSET ", parent);
        for (const std::string& n : names) absl::StrAppend(&f.suggestion, " ", n, " ...");
        Emit(std::move(f), parent, id);
      }
    }
    if (w_.shared.rmw_idle()) return;
    std::vector<RmwTracker::Result> results;
    w_.shared.OnWrite(key, connection_, value, watching, UnixMs(), &results, scope_);
    for (const auto& r : results) {
      Finding f{r.kind};
      f.format = FormatName(r.format);
      f.fields_changed = r.fields_changed;
      f.fields_total = r.fields_total;
      if (r.kind == Kind::kSerializedRmw) {
        f.suggestion = r.fields_total >= 0
                           ? absl::StrCat("changed ", r.fields_changed, " of ", r.fields_total,
                                          " fields: store it as a Hash and update fields with HSET / HINCRBY, or use "
                                          "JSON.SET on a path for nested data")
                           : "store it as a Hash and update fields with HSET / HINCRBY, or use JSON.SET on a path";
      } else {
        f.suggestion =
            "another connection wrote this key between this connection's read and write: use WATCH/MULTI, "
            "a Lua script, or field updates on a Hash";
      }
      Emit(std::move(f), key, id);
    }
  };
  if (info.value_pos > 0 && args.size() > static_cast<size_t>(info.value_pos)) {
    write(args[1], args[info.value_pos]);
  } else if (info.pairs) {
    for (size_t i = 1; i + 1 < args.size(); i += 2) write(args[i], args[i + 1]);
  } else if (info.hygiene == HygieneRole::kKeys && args.size() > 1) {
    Finding f{Kind::kKeysCommand};
    f.suggestion = "KEYS blocks the server while it walks every key: use SCAN with MATCH and COUNT";
    Emit(std::move(f), args[1], id);
  } else if (info.hygiene == HygieneRole::kFlush) {
    bool async = false;
    for (size_t i = 1; i < args.size(); ++i) async |= EqualsIgnoreCase(args[i], "async");
    if (!async) {
      Finding f{Kind::kFlushWithoutAsync};
      f.suggestion = absl::StrCat(absl::AsciiStrToUpper(CommandNameOf(id)), " ASYNC frees memory in the background");
      // Under tenancy the flush is an emulation over the tenant's keys, not this command.
      if (settings.action(f.kind) == Action::kRewrite && !tenant && args.size() == 1) {
        edit.Edit().push_back("ASYNC");
        f.action = Action::kRewrite;
      }
      Emit(std::move(f), "", id);
    }
  } else if (info.hygiene == HygieneRole::kDel) {
    if (!sizes.empty()) {
      const int64_t now_ms = UnixMs();
      bool rewritten = false;
      for (size_t i = 1; i < args.size(); ++i) {
        const uint64_t h = SizeKey(args[i]);
        const std::optional<KeySize> s = sizes.Get(h, now_ms);
        if (s && sizes.IsBig(*s)) {
          Finding f{Kind::kDelBigKey};
          f.bytes = s->bytes >= 0 ? s->bytes : s->memory;
          f.elements = s->elements;
          f.suggestion = "DEL frees a big key in one blocking step: use UNLINK, which frees it in the background";
          if (settings.action(f.kind) == Action::kRewrite && !rewritten) {
            edit.Edit()[0] = "UNLINK";
            rewritten = true;
          }
          if (rewritten) f.action = Action::kRewrite;
          Emit(std::move(f), args[i], id);
        }
        sizes.Erase(h);
      }
    }
  } else if (info.hygiene == HygieneRole::kUnlink) {
    if (!sizes.empty()) {
      for (size_t i = 1; i < args.size(); ++i) sizes.Erase(SizeKey(args[i]));
    }
  }
  // A TTL given (EXPIRE family, SETEX, or an option after SET's value), or a write that should
  // have one: SET k v with no ttl_patterns configured has nothing to look at.
  if (info.ttl_unit != TtlUnit::kNone || (info.options_from > 0 && args.size() > info.options_from) ||
      (info.needs_ttl && !settings.ttl_patterns.empty())) {
    DetectTtl(id, args, edit);
  }
  uint8_t creates_check = kNoReplyCheck;
  if (info.creates != commands::CreatesKey::kNo && !settings.ttl_patterns.empty() && args.size() > 2 &&
      PendCollectionTtl(id, args, info.creates)) {
    creates_check = kCollectionWrite;
  }
  if (args.size() > 1) {
    if (check == kCollectionRead && settings.action(Kind::kWholeCollectionRead) == Action::kReject && !sizes.empty()) {
      // A read known in advance to return a big collection can be refused before it runs.
      const std::optional<KeySize> s = sizes.Get(SizeKey(args[1]), UnixMs());
      if (s && s->elements >= settings.big_collection_elements) {
        Finding f{Kind::kWholeCollectionRead};
        f.elements = s->elements;
        f.suggestion = CollectionReadSuggestion(info.type);
        Emit(std::move(f), args[1], id);
      }
    }
    if (info.probe && settings.probe && w_.probe_queue.size() < ProbeQueue::kCapacity) {
      const uint64_t h = SizeKey(args[1]);
      if (!sizes.Get(h, UnixMs())) {
        ProbeRequest r;
        r.hash = h;
        // The name the server stores: after the key policy's rewrite and the tenant prefix.
        r.upstream_key = std::string(edit.input()[1]);
        r.finding.kind = Kind::kBigKeyAccess;
        sink_.Stamp(&r.finding, args[1], id);
        if (w_.probe_queue.Push(std::move(r))) sink_.WakeProbe();
      }
    }
  }
  refusal_ = nullptr;
  if (creates_check != kNoReplyCheck) return creates_check;
  return args.size() > 1 ? check : kNoReplyCheck;
}

bool ConnectionDetectors::PendCollectionTtl(commands::CommandId id, std::span<const std::string_view> args,
                                            commands::CreatesKey creates) {
  const std::string_view key = args[1];
  const int pattern = TtlPatternOf(key);
  if (pattern < 0) return false;
  // Items the write adds, when its reply counts them.
  int64_t expect = -1;
  switch (creates) {
    case commands::CreatesKey::kFieldPairs: expect = static_cast<int64_t>((args.size() - 2) / 2); break;
    case commands::CreatesKey::kMembers:
    case commands::CreatesKey::kPushed: expect = static_cast<int64_t>(args.size() - 2); break;
    case commands::CreatesKey::kScored: {
      size_t i = 2;
      for (; i < args.size(); ++i) {
        const std::string_view o = args[i];
        if (EqualsIgnoreCase(o, "ch") || EqualsIgnoreCase(o, "incr")) return false;  // the reply does not say
        if (!EqualsIgnoreCase(o, "nx") && !EqualsIgnoreCase(o, "xx") && !EqualsIgnoreCase(o, "gt") &&
            !EqualsIgnoreCase(o, "lt")) {
          break;
        }
        if (EqualsIgnoreCase(o, "xx")) return false;  // updates only: never creates
      }
      expect = static_cast<int64_t>((args.size() - i) / 2);
      break;
    }
    case commands::CreatesKey::kUncounted:
      for (size_t i = 2; i < args.size(); ++i) {
        if (EqualsIgnoreCase(args[i], "nomkstream")) return false;  // XADD that never creates
      }
      break;
    case commands::CreatesKey::kNo: return false;
  }
  if (expect == 0) return false;
  // One entry per key: a later write's reply cannot undo what an earlier one created.
  for (const PendingTtl& t : pending_ttl_) {
    if (t.key == key) return false;
  }
  PendTtl(key, pattern, id, /*collection=*/true, expect);
  return expect >= 0;
}

int ConnectionDetectors::TtlPatternOf(std::string_view key) const {
  const std::vector<TtlPattern>& patterns = settings_.ttl_patterns;
  for (size_t i = 0; i < patterns.size(); ++i) {
    if (GlobMatch(patterns[i].glob, key)) return static_cast<int>(i);
  }
  return -1;
}

void ConnectionDetectors::PendTtl(std::string_view key, int pattern, commands::CommandId id, bool collection,
                                  int64_t expect) {
  if (pending_ttl_.size() >= kMaxPendingTtl) FlushPendingTtlFront();
  pending_ttl_.push_back(PendingTtl{std::string(key), UnixMs() + settings_.missing_ttl_window_ms,
                                    static_cast<uint32_t>(pattern), id, collection, expect});
}

void ConnectionDetectors::DetectTtl(commands::CommandId id, std::span<const std::string_view> args, ArgEditor& edit) {
  const commands::Traits& info = commands::TraitsOf(id);
  const Settings& settings = settings_;
  if (args.size() < 2) return;
  // Where the TTL is and how it counts.
  int ttl_arg = -1;
  TtlUnit unit = TtlUnit::kNone;
  bool keepttl = false;
  if (info.ttl_unit != TtlUnit::kNone && args.size() > 2) {
    ttl_arg = 2;
    unit = info.ttl_unit;
  } else if (info.options_from > 0) {
    for (size_t i = static_cast<size_t>(info.options_from); i < args.size(); ++i) {
      const std::string_view o = args[i];
      const TtlUnit u = EqualsIgnoreCase(o, "ex")     ? TtlUnit::kSeconds
                        : EqualsIgnoreCase(o, "px")   ? TtlUnit::kMillis
                        : EqualsIgnoreCase(o, "exat") ? TtlUnit::kUnixSeconds
                        : EqualsIgnoreCase(o, "pxat") ? TtlUnit::kUnixMillis
                                                      : TtlUnit::kNone;
      if (u != TtlUnit::kNone && i + 1 < args.size()) {
        ttl_arg = static_cast<int>(i + 1);
        unit = u;
        ++i;
      } else if (EqualsIgnoreCase(o, "keepttl") || EqualsIgnoreCase(o, "persist")) {
        keepttl = true;
      }
    }
  }
  int64_t value = 0;
  if (ttl_arg > 0 && resp::ParseRedisInt(args[ttl_arg], &value) && value > 0) {
    const int64_t now_ms = UnixMs();
    // Any value the client sends, up to INT64_MAX: the sums saturate (the server refuses an
    // expiry that overflows its own arithmetic; counting it is harmless).
    int64_t at_s = value;
    if (unit == TtlUnit::kSeconds) {
      if (__builtin_add_overflow(now_ms / 1000, value, &at_s)) at_s = INT64_MAX;
    } else if (unit == TtlUnit::kMillis) {
      int64_t at_ms;
      at_s = __builtin_add_overflow(now_ms, value, &at_ms) ? INT64_MAX / 1000 : at_ms / 1000;
    } else if (unit == TtlUnit::kUnixMillis) {
      at_s = value / 1000;
    }
    const int64_t ttl_s = at_s - now_ms / 1000;
    // A TTL given right after a write without one (on this connection) is what missing_ttl waits for.
    if (!pending_ttl_.empty()) {
      std::erase_if(pending_ttl_, [&](const PendingTtl& t) { return t.key == args[1]; });
    }
    if (const int64_t n = w_.shared.AddExpiry(PatternFingerprint(args[1], scope_), at_s, now_ms); n > 0) {
      Finding f{Kind::kExpiryClustering};
      f.keys = n;
      f.ttl_s = ttl_s;
      f.suggestion = absl::StrCat(n,
                                  " keys of this pattern expire in the same second, most of its TTL writes: add "
                                  "random jitter to their TTLs (the expiry_clustering rewrite does) so the server "
                                  "does not expire them all at once");
      Emit(std::move(f), args[1], id);
    }
    // Relative TTLs up to ~31,700 years (in either unit) are spread; a larger one is left as it
    // came, so the jitter never makes an expiry the server accepts into one it refuses.
    constexpr int64_t kMaxJitteredTtl = 1000000000000;
    if (settings.action(Kind::kExpiryClustering) == Action::kRewrite) {
      // Spread expiries: never sooner than asked, up to jitter_percent of the time left later. A
      // relative TTL is the time left; an absolute one (EXPIREAT, PEXPIREAT, EXAT, PXAT) is moved
      // by a share of what is left until it, in its own unit.
      const bool relative = unit == TtlUnit::kSeconds || unit == TtlUnit::kMillis;
      const int64_t left = relative ? value : value - (unit == TtlUnit::kUnixSeconds ? now_ms / 1000 : now_ms);
      if (left > 0 && left <= kMaxJitteredTtl) {
        const int64_t extra = left * settings.jitter_percent / 100;
        if (extra > 0) {
          const int64_t jittered = value + static_cast<int64_t>(w_.random() % static_cast<uint64_t>(extra + 1));
          edit.Edit()[ttl_arg] = edit.Own(absl::StrCat(jittered));
        }
      }
    }
    // EXPIRE (or SET ... EX) on a big key: when it expires, the server frees it in one step.
    const std::optional<KeySize> s = w_.sizes.empty() ? std::nullopt : w_.sizes.Get(SizeKey(args[1]), now_ms);
    const int64_t bytes = info.value_pos > 0 && args.size() > static_cast<size_t>(info.value_pos)
                              ? static_cast<int64_t>(args[info.value_pos].size())
                              : -1;
    if ((s && w_.sizes.IsBig(*s)) || (bytes >= 0 && static_cast<size_t>(bytes) >= settings.big_string_bytes)) {
      Finding f{Kind::kExpireBigKey};
      f.bytes = bytes >= 0 ? bytes : (s->bytes >= 0 ? s->bytes : s->memory);
      if (s && bytes < 0) f.elements = s->elements;
      f.ttl_s = ttl_s;
      f.suggestion =
          "a big key with a TTL is freed in one blocking step when it expires: delete it with UNLINK instead, "
          "or enable lazyfree-lazy-expire";
      Emit(std::move(f), args[1], id);
    }
    return;
  }
  if (!info.needs_ttl || keepttl || settings.ttl_patterns.empty()) return;
  // A string written without a TTL: cache and session patterns must have one.
  auto check = [&](std::string_view key, bool can_rewrite) {
    if (const int i = TtlPatternOf(key); i >= 0) {
      const TtlPattern& pattern = settings.ttl_patterns[static_cast<size_t>(i)];
      const Action action = settings.action(Kind::kMissingTtl);
      if (action == Action::kRewrite && can_rewrite) {
        auto& out = edit.Edit();
        out.push_back("EX");
        out.push_back(edit.Own(absl::StrCat(pattern.default_ttl_s)));
        Finding f{Kind::kMissingTtl};
        f.action = Action::kRewrite;
        f.ttl_s = pattern.default_ttl_s;
        f.suggestion = absl::StrCat(pattern.session ? "session" : "cache", " key (", pattern.glob,
                                    ") written without a TTL: keyguard added EX ", pattern.default_ttl_s);
        Emit(std::move(f), key, id);
      } else if (action == Action::kReject) {
        Finding f{Kind::kMissingTtl};
        f.suggestion = absl::StrCat(pattern.session ? "session" : "cache", " key (", pattern.glob,
                                    ") needs a TTL: SET key value EX seconds");
        Emit(std::move(f), key, id);
      } else {
        // Wait a moment: a following EXPIRE on this connection gives the key its TTL.
        PendTtl(key, i, id, /*collection=*/false, -1);
      }
    }
  };
  if (info.pairs) {
    for (size_t i = 1; i + 1 < args.size(); i += 2) check(args[i], false);
  } else {
    check(args[1], EqualsIgnoreCase(args[0], "set"));
  }
}

void ConnectionDetectors::FlushPendingTtlFront() {
  pending_ttl_.front().deadline_ms = 0;  // the oldest goes now: the list is bounded
  FlushPendingTtl(false);
}

void ConnectionDetectors::OnReplyFull(commands::CommandId id, uint8_t check, std::string_view key, char type,
                                      int64_t size, std::string_view bulk, uint64_t scope) {
  const Settings& settings = settings_;
  if (check == kCollectionWrite) {
    // Whether the write created the key: if not, the key keeps whatever TTL it had.
    for (auto t = pending_ttl_.begin(); t != pending_ttl_.end(); ++t) {
      if (!t->collection || t->expect < 0 || t->key != key) continue;
      // A push's new length equals what it pushed, an add counts every item as new: the key was
      // created (or, for an add, was there without any of these items: a false positive).
      int64_t n = -1;
      const bool created = type == ':' && resp::ParseRedisInt(bulk, &n) && n == t->expect;
      if (created) {
        t->expect = -1;
      } else {
        pending_ttl_.erase(t);
      }
      break;
    }
    return;
  }
  if (check == kStringRead && type == '$') {
    if (bulk.size() >= settings.big_string_bytes) {
      Finding f{Kind::kBigStringRead};
      f.bytes = static_cast<int64_t>(bulk.size());
      f.suggestion = "big value read whole: read the part you need (GETRANGE, or a Hash with HGET)";
      Emit(std::move(f), key, id);
      RememberSize(key, "string", static_cast<int64_t>(bulk.size()), -1);
    }
    if (!w_.shared.rmw_idle() || DetectFormat(bulk) != Format::kNone) {
      w_.shared.OnRead(key, connection_, bulk, UnixMs(), scope);
    }
  } else if (check == kCollectionRead && (type == '*' || type == '%' || type == '~')) {
    const commands::Traits& info = commands::TraitsOf(id);
    const bool pairs = type == '*' && info.field_value_pairs;
    const int64_t members = pairs ? size / 2 : size;
    if (members >= settings.big_collection_elements) {
      Finding f{Kind::kWholeCollectionRead};
      f.elements = members;
      f.suggestion = CollectionReadSuggestion(info.type);
      Emit(std::move(f), key, id);
      RememberSize(key, commands::KeyTypeName(info.type), -1, members);
    }
  }
}

namespace {

// Keeps a shard-wide `count` equal to the sum of its shards' sizes, after a shard's size went
// from `before` to `after` under its lock.
void Recount(std::atomic<int64_t>* count, size_t before, size_t after) {
  count->fetch_add(static_cast<int64_t>(after) - static_cast<int64_t>(before), std::memory_order_relaxed);
}

}  // namespace

SharedSizeCache::SharedSizeCache(const Settings& s) {
  for (auto& shard : shards_) shard = std::make_unique<Shard>(s);
}

void SharedSizeCache::Put(uint64_t key, KeySize size) {
  Shard& shard = *shards_[key % kShards];
  std::lock_guard<std::mutex> lock(shard.mu);
  const size_t before = shard.cache.size();
  shard.cache.Put(key, std::move(size));
  Recount(&count_, before, shard.cache.size());
}

std::optional<KeySize> SharedSizeCache::Get(uint64_t key, int64_t now_ms) {
  Shard& shard = *shards_[key % kShards];
  std::lock_guard<std::mutex> lock(shard.mu);
  const KeySize* s = shard.cache.Get(key, now_ms);
  return s != nullptr ? std::optional<KeySize>(*s) : std::nullopt;
}

void SharedSizeCache::Erase(uint64_t key) {
  Shard& shard = *shards_[key % kShards];
  std::lock_guard<std::mutex> lock(shard.mu);
  const size_t before = shard.cache.size();
  shard.cache.Erase(key);
  Recount(&count_, before, shard.cache.size());
}

SharedDetectors::SharedDetectors(const Settings& s) : sizes(s) {
  for (auto& shard : shards_) shard = std::make_unique<Shard>(s);
  plans_ = std::make_unique<std::array<CommandPlan, size_t{1} << (8 * sizeof(commands::CommandId))>>();
  plans_->fill(CommandPlan{0xff, 0});
  for (size_t id = 0; id < commands::CommandCount(); ++id) {
    const commands::Traits& t = commands::TraitsOf(static_cast<commands::CommandId>(id));
    const uint8_t check = kReplyCheckOf[static_cast<uint8_t>(t.reply)];
    uint8_t plan = check;
    if (t.value_pos > 0 || t.pairs) plan |= kPlanWrite;
    if (t.hygiene != HygieneRole::kNone) plan |= kPlanRole;
    if (t.ttl_unit != TtlUnit::kNone || t.options_from > 0) plan |= kPlanTtl;
    if (t.needs_ttl || t.creates != commands::CreatesKey::kNo) plan |= kPlanTtlPattern;
    if (t.probe) plan |= kPlanProbe;
    if (check == kCollectionRead) plan |= kPlanCollectionRead;
    // One value, then nothing the detectors read: no TTL argument, and options (SET's) only after
    // the value, so that `args.size() == value_pos + 1` means none were given.
    uint8_t write = 0;
    if (t.value_pos > 0 && t.value_pos < kWriteReplaces && !t.pairs && t.ttl_unit == TtlUnit::kNone &&
        t.hygiene == HygieneRole::kNone && t.creates == commands::CreatesKey::kNo &&
        (t.options_from == 0 || t.options_from > t.value_pos)) {
      write = static_cast<uint8_t>(t.value_pos | (t.rmw_write ? kWriteReplaces : 0));
    }
    (*plans_)[id] = CommandPlan{plan, write};
  }
}

void SharedDetectors::OnRead(std::string_view key, uint64_t connection, std::string_view value, int64_t now_ms,
                             uint64_t scope) {
  const uint64_t h = Fingerprint(key, scope);  // picks the shard and keys the tracker
  Shard& shard = ShardOf(h);
  std::lock_guard<std::mutex> lock(shard.mu);
  const size_t before = shard.rmw.tracked();
  shard.rmw.OnReadHashed(h, connection, value, now_ms);
  Recount(&rmw_tracked_, before, shard.rmw.tracked());
}

void SharedDetectors::OnWrite(std::string_view key, uint64_t connection, std::string_view value, bool watched,
                              int64_t now_ms, std::vector<RmwTracker::Result>* out, uint64_t scope) {
  const uint64_t h = Fingerprint(key, scope);
  Shard& shard = ShardOf(h);
  std::lock_guard<std::mutex> lock(shard.mu);
  const size_t before = shard.rmw.tracked();
  shard.rmw.OnWriteHashed(h, connection, value, watched, now_ms, out);
  Recount(&rmw_tracked_, before, shard.rmw.tracked());
}

bool SharedDetectors::OnAttributeWrite(std::string_view key, std::string_view parent_name, std::string* parent,
                                       std::vector<std::string>* attributes, uint64_t scope) {
  const uint64_t h = Fingerprint(parent_name, scope);
  Shard& shard = ShardOf(h);
  std::lock_guard<std::mutex> lock(shard.mu);
  return shard.attributes.OnParentWrite(key, parent_name, h, UnixMs(), parent, attributes);
}

int64_t SharedDetectors::AddExpiry(uint64_t pattern, int64_t second, int64_t now_ms) {
  Shard& shard = ShardOf(pattern);
  std::lock_guard<std::mutex> lock(shard.mu);
  return shard.expiries.Add(pattern, second, now_ms);
}

uint64_t NewConnectionId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

void HotKeySize(HotKeys& hot, commands::CommandId id, std::string_view tenant, std::string_view key, bool elements,
                uint64_t size) {
  hot.ObserveSize(AsAbsl(tenant), AsAbsl(key), elements, size, commands::CommandName(id),
                  commands::KeyTypeName(commands::TraitsOf(id).type));
}

void HotKeyPairs(HotKeys& hot, commands::CommandId id, std::span<const std::string_view> args,
                 std::string_view tenant) {
  for (size_t i = 1; i + 1 < args.size(); i += 2) {
    if (!args[i + 1].empty() && hot.Admits(false, args[i + 1].size())) {
      HotKeySize(hot, id, tenant, args[i], false, args[i + 1].size());
    }
  }
}

void HotKeyReplySize(HotKeys& hot, commands::CommandId id, std::string_view tenant, std::string_view key, char type,
                     int64_t size, std::string_view bulk) {
  const commands::Traits& info = commands::TraitsOf(id);
  int64_t n = -1;
  bool elements = true;
  switch (info.reply) {
    case ReplyShows::kLength:
    case ReplyShows::kCount:
      if (type == ':' && !resp::ParseRedisInt(bulk, &n)) n = -1;
      elements = info.reply == ReplyShows::kCount;
      break;
    case ReplyShows::kMembers:
      if (type == '*' || type == '~' || type == '%') n = (type == '*' && info.field_value_pairs) ? size / 2 : size;
      break;
    case ReplyShows::kValue:
    case ReplyShows::kNothing:
    case ReplyShows::kComputedMembers: return;  // HotKeyReply's own
  }
  if (n <= 0 || !hot.Admits(elements, static_cast<uint64_t>(n))) return;
  HotKeySize(hot, id, tenant, key, elements, static_cast<uint64_t>(n));
}

}  // namespace keyguard::hygiene
