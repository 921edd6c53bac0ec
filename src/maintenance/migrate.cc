// `keyguard migrate`: the three steps of a safe rename or re-shape of existing keys (copy, verify,
// cleanup), each idempotent, resumable from a SCAN cursor, rate-limited and with --dry-run.
//
// No step trusts what it read a round trip earlier. Every decision about one key is taken by one
// server-side script (kKeyScript) that runs atomically: it checks that the old key still holds
// what keyguard read (for a re-shape, the JSON text the new fields were computed from), compares
// the new key(s) with the old one, and only then copies, refreshes or deletes. So copy never
// writes a Hash from a value the app has since changed, and cleanup never deletes an old key that
// does not match its new key at that instant.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "keyguard/maintenance/maintenance.h"
#include "maintenance/args.h"
#include "maintenance/json_fields.h"
#include "maintenance/redis_link.h"
#include "maintenance/settings.h"
#include "maintenance/terminal.h"

namespace keyguard::maintenance {
namespace {

int Fail(const std::string& message) { return UsageError("keyguard migrate", message); }

// One key's decision, atomically. KEYS: the old key, the new key, then the new key's nested keys.
// ARGV[1]: mode: verify (read only), copy (write when no new key exists), refresh (also rewrite
// new keys that differ), cleanup (UNLINK the old key when its new keys match it), supersede (also
// when its new key exists but differs: after the switch-over the new keys are the truth).
// ARGV[2]: how old and new compare: `dump` (same type, DUMP and expiry; COPY to write) or `json`
// (ARGV[3] is the old key's JSON text as keyguard read it; then per new key its kind, `hash` or
// `string`, the number of items and the items: field, value, ... or the text).
// The new keys match when each has the kind and exactly the items, and the old key's expiry
// (PEXPIRETIME: copy writes it with PEXPIREAT, so equal means equal).
// Returns {status, detail}: gone (no old key), changed (the old key no longer holds ARGV[3]),
// same, missing (no new key exists), differs (detail: the first difference); after a write
// copied or refreshed, after a delete unlinked or superseded, and copy's stale (differs, not
// refreshed).
constexpr char kKeyScript[] = R"lua(
local mode, how = ARGV[1], ARGV[2]
local src, dst = KEYS[1], KEYS[2]
local stype = redis.call('TYPE', src).ok
if stype == 'none' then return {'gone', ''} end
local at = redis.call('PEXPIRETIME', src)
local exists = 0
for k = 2, #KEYS do exists = exists + redis.call('EXISTS', KEYS[k]) end
local status, detail = 'same', ''
if how == 'dump' then
  local dtype = redis.call('TYPE', dst).ok
  if exists == 0 then status = 'missing'
  elseif dtype ~= stype then status, detail = 'differs', 'a ' .. dtype .. ', not a ' .. stype
  elseif redis.call('DUMP', src) ~= redis.call('DUMP', dst) then status, detail = 'differs', 'value differs'
  elseif redis.call('PEXPIRETIME', dst) ~= at then status, detail = 'differs', 'expiry differs' end
else
  if stype ~= 'string' or redis.call('GET', src) ~= ARGV[3] then return {'changed', ''} end
  if exists == 0 then status = 'missing' else
    local a = 4
    for k = 2, #KEYS do
      local key, kind, n = KEYS[k], ARGV[a], tonumber(ARGV[a + 1])
      local t = redis.call('TYPE', key).ok
      local d
      if t == 'none' then d = 'missing'
      elseif t ~= kind then d = 'a ' .. t .. ', not a ' .. kind
      elseif kind == 'string' then
        if redis.call('GET', key) ~= ARGV[a + 2] then d = 'value differs' end
      else
        for j = a + 2, a + 1 + n, 2 do
          local v = redis.call('HGET', key, ARGV[j])
          if not v then d = "field '" .. ARGV[j] .. "' missing" break end
          if v ~= ARGV[j + 1] then d = "field '" .. ARGV[j] .. "' differs" break end
        end
        if not d and redis.call('HLEN', key) ~= n / 2 then
          local want = {}
          for j = a + 2, a + 1 + n, 2 do want[ARGV[j]] = true end
          for _, f in ipairs(redis.call('HKEYS', key)) do
            if not want[f] then d = "extra field '" .. f .. "'" break end
          end
        end
      end
      if not d and redis.call('PEXPIRETIME', key) ~= at then d = 'expiry differs' end
      if d then
        status, detail = 'differs', (k == 2 and d or key .. ': ' .. d)
        break
      end
      a = a + 2 + n
    end
  end
end
if mode == 'verify' or status == 'same' and mode ~= 'cleanup' then return {status, detail} end
if mode == 'cleanup' or mode == 'supersede' then
  if status == 'same' then
    redis.call('UNLINK', src)
    return {'unlinked', ''}
  end
  if mode == 'supersede' and status == 'differs' and redis.call('EXISTS', dst) == 1 then
    redis.call('UNLINK', src)
    return {'superseded', detail}
  end
  return {status, detail}
end
if status == 'differs' and mode ~= 'refresh' then return {'stale', detail} end
if how == 'dump' then
  if status == 'missing' then redis.call('COPY', src, dst) else redis.call('COPY', src, dst, 'REPLACE') end
else
  if status ~= 'missing' then redis.call('UNLINK', unpack(KEYS, 2)) end
  local a = 4
  for k = 2, #KEYS do
    local key, kind, n = KEYS[k], ARGV[a], tonumber(ARGV[a + 1])
    if kind == 'hash' then
      for j = a + 2, a + 1 + n, 1000 do
        redis.call('HSET', key, unpack(ARGV, j, math.min(j + 999, a + 1 + n)))
      end
    else
      redis.call('SET', key, ARGV[a + 2])
    end
    if at > 0 then redis.call('PEXPIREAT', key, at) end
    a = a + 2 + n
  end
end
return {status == 'missing' and 'copied' or 'refreshed', detail}
)lua";

// How many times one batch re-reads keys whose value changed between the read and the script.
constexpr int kAttempts = 3;
// Routine lines (would copy, would unlink, skipped) shown per kind without --verbose.
constexpr uint64_t kSamples = 10;

struct Pair {
  std::string old_key, new_key;
};

// One key ready for kKeyScript.
struct Item {
  const Pair* pair;
  bool dump = false;   // compare and copy by DUMP/COPY (keep_type, or an unconvertible value copied unchanged)
  std::string source;  // json: the old value as read
  HashShape shape;     // json: the new keys
};

enum class StepKind { kCopy, kVerify, kCleanup };

struct Step {
  StepKind kind;
  const Migration& m;
  RedisLink& link;
  Pacer& pacer;
  bool dry_run;
  bool refresh;
  bool supersede;  // cleanup --new-keys-win
  bool verbose;
  std::string sha;  // kKeyScript's SHA1 on the server
  std::map<std::string, uint64_t> counts;
  bool failed = false;  // something needs the operator: exit 1

  absl::StatusOr<std::vector<Reply>> Run(const std::vector<Command>& cmds) {
    if (cmds.empty()) return std::vector<Reply>();
    pacer.Before(cmds.size());
    return link.Pipeline(cmds);
  }

  // Counts `what` and shows `line`: a routine line with --verbose or as one of the first kSamples
  // of its kind in a dry run; a listed one always; an attention one always, and it fails the step.
  enum Level { kRoutine, kListed, kAttention };
  void Record(const std::string& what, const std::string& line, Level level) {
    const uint64_t n = ++counts[what];
    if (level == kAttention) failed = true;
    if (line.empty()) return;
    if (level != kRoutine || verbose || (dry_run && n <= kSamples)) {
      std::printf("%s\n", line.c_str());
    }
  }

  absl::Status LoadScript() {
    auto r = link.Call({"SCRIPT", "LOAD", kKeyScript});
    if (!r.ok()) return r.status();
    if (r->is_error()) return absl::FailedPreconditionError(absl::StrCat("SCRIPT LOAD: ", r->str));
    sha = r->str;
    return absl::OkStatus();
  }
};

std::string Arrow(const Pair& p) { return absl::StrCat(Printable(p.old_key), " -> ", Printable(p.new_key)); }

// Reads the old values (json_to_hash) and turns each key into an Item, or records why it has none.
absl::StatusOr<std::vector<Item>> Prepare(Step& st, const std::vector<const Pair*>& pairs) {
  std::vector<Item> items;
  if (!st.m.json_to_hash) {
    for (const Pair* p : pairs) items.push_back(Item{p, true, {}, {}});
    return items;
  }
  std::vector<Command> reads;
  for (const Pair* p : pairs) {
    reads.push_back({"TYPE", p->old_key});
    reads.push_back({"GET", p->old_key});
  }
  auto r = st.Run(reads);
  if (!r.ok()) return r.status();
  for (size_t i = 0; i < pairs.size(); ++i) {
    const Pair& p = *pairs[i];
    const std::string& type = (*r)[2 * i].str;
    if (type == "none") {
      st.Record("gone", "", Step::kRoutine);
      continue;
    }
    ShapeError why;
    Item item{&p, false, {}, {}};
    if (type != "string") {
      why = ShapeError{"wrong_type", absl::StrCat("a ", type, ", not a string")};
    } else {
      item.source = std::move((*r)[2 * i + 1].str);
      if (auto shape = JsonToHash(item.source, st.m.separate_nested, &why)) {
        item.shape = *std::move(shape);
        items.push_back(std::move(item));
        continue;
      }
    }
    switch (st.m.unconvertible) {
      case Migration::Unconvertible::kCopyUnchanged:
        item.dump = true;
        item.source.clear();
        items.push_back(std::move(item));
        break;
      case Migration::Unconvertible::kSkip:
        st.Record(absl::StrCat("skipped.", why.reason), absl::StrCat("skipped ", Printable(p.old_key), ": ", why.text),
                  Step::kRoutine);
        break;
      case Migration::Unconvertible::kFail:
        st.Record(absl::StrCat("unconvertible.", why.reason),
                  absl::StrCat("unconvertible ", Printable(p.old_key), ": ", why.text,
                               " (migrations[].unconvertible: skip or copy_unchanged decides what becomes of it)"),
                  Step::kAttention);
        break;
    }
  }
  return items;
}

Command ScriptCall(const Step& st, const Item& item, const char* mode) {
  const Pair& p = *item.pair;
  const bool read_only = std::string_view(mode) == "verify";
  Command c = {read_only ? "EVALSHA_RO" : "EVALSHA", st.sha, absl::StrCat(2 + item.shape.subkeys.size()), p.old_key,
               p.new_key};
  for (const auto& sub : item.shape.subkeys) c.push_back(absl::StrCat(p.new_key, ":", sub.suffix));
  c.push_back(mode);
  if (item.dump) {
    c.push_back("dump");
    return c;
  }
  c.insert(c.end(), {"json", item.source});
  auto add_fields = [&c](const Fields& fields) {
    c.insert(c.end(), {"hash", absl::StrCat(2 * fields.size())});
    for (const auto& [f, v] : fields) c.insert(c.end(), {f, v});
  };
  add_fields(item.shape.fields);
  for (const auto& sub : item.shape.subkeys) {
    if (sub.hash) {
      add_fields(sub.fields);
    } else {
      c.insert(c.end(), {"string", "1", sub.text});
    }
  }
  return c;
}

// What the step makes of one script result.
void Judge(Step& st, const Item& item, const std::string& status, const std::string& detail) {
  const Pair& p = *item.pair;
  const std::string diff = detail.empty() ? "" : absl::StrCat(": ", Printable(detail));
  if (status == "gone") return st.Record("gone", "", Step::kRoutine);
  switch (st.kind) {
    case StepKind::kCopy:
      if (status == "same") return st.Record("up_to_date", "", Step::kRoutine);
      if (status == "copied" || (st.dry_run && status == "missing")) {
        return st.Record(st.dry_run ? "would_copy" : "copied",
                         absl::StrCat(st.dry_run ? "would copy " : "copied ", Arrow(p)), Step::kRoutine);
      }
      if (status == "refreshed" || (st.dry_run && st.refresh && status == "differs")) {
        return st.Record(st.dry_run ? "would_refresh" : "refreshed",
                         absl::StrCat(st.dry_run ? "would refresh " : "refreshed ", Arrow(p), diff), Step::kRoutine);
      }
      if (status == "stale" || status == "differs") {
        return st.Record("stale",
                         absl::StrCat("stale ", Arrow(p), diff, " (copy --refresh rewrites it from the old key)"),
                         Step::kAttention);
      }
      break;
    case StepKind::kVerify:
      if (status == "same") return st.Record("same", absl::StrCat("same ", Arrow(p)), Step::kRoutine);
      if (status == "missing") return st.Record("missing", absl::StrCat("missing ", Arrow(p)), Step::kAttention);
      if (status == "differs") return st.Record("differ", absl::StrCat("differs ", Arrow(p), diff), Step::kAttention);
      break;
    case StepKind::kCleanup:
      if (status == "superseded" || (st.dry_run && st.supersede && status == "differs" && detail != "missing")) {
        return st.Record(
            st.dry_run ? "would_supersede" : "superseded",
            absl::StrCat(st.dry_run ? "would unlink " : "unlinked ", Printable(p.old_key), ": superseded by ",
                         Printable(p.new_key), ", which differs", diff, " (--new-keys-win)"),
            Step::kListed);
      }
      if (status == "unlinked" || (st.dry_run && status == "same")) {
        return st.Record(st.dry_run ? "would_unlink" : "unlinked",
                         absl::StrCat(st.dry_run ? "would unlink " : "unlinked ", Printable(p.old_key)),
                         Step::kRoutine);
      }
      if (status == "missing") {
        return st.Record("kept.missing",
                         absl::StrCat("kept ", Printable(p.old_key), ": ", Printable(p.new_key), " does not exist"),
                         Step::kAttention);
      }
      if (status == "differs") {
        return st.Record("kept.differs",
                         absl::StrCat("kept ", Printable(p.old_key), ": ", Printable(p.new_key), " differs", diff),
                         Step::kAttention);
      }
      break;
  }
  st.Record("failed", absl::StrCat("failed ", Arrow(p), ": unexpected result '", Printable(status), "'"),
            Step::kAttention);
}

// Runs one batch of keys through kKeyScript, re-reading keys whose old value changed in between.
absl::Status RunBatch(Step& st, const std::vector<Pair>& batch) {
  const char* mode = st.kind == StepKind::kVerify || st.dry_run ? "verify"
                     : st.kind == StepKind::kCleanup            ? (st.supersede ? "supersede" : "cleanup")
                     : st.refresh                               ? "refresh"
                                                                : "copy";
  std::vector<const Pair*> todo;
  for (const Pair& p : batch) todo.push_back(&p);
  for (int attempt = 0; attempt < kAttempts && !todo.empty(); ++attempt) {
    auto items = Prepare(st, todo);
    if (!items.ok()) return items.status();
    todo.clear();
    std::vector<Command> calls;
    for (const Item& item : *items) calls.push_back(ScriptCall(st, item, mode));
    auto r = st.Run(calls);
    if (!r.ok()) return r.status();
    // A script cache flushed under us (SCRIPT FLUSH, a restart, a failover): load it again and
    // re-run what did not run.
    std::vector<size_t> again;
    for (size_t i = 0; i < r->size(); ++i) {
      if ((*r)[i].is_error() && absl::StartsWith((*r)[i].str, "NOSCRIPT")) again.push_back(i);
    }
    if (!again.empty()) {
      if (auto s = st.LoadScript(); !s.ok()) return s;
      std::vector<Command> retry;
      for (size_t i : again) {
        calls[i][1] = st.sha;
        retry.push_back(calls[i]);
      }
      auto rr = st.Run(retry);
      if (!rr.ok()) return rr.status();
      for (size_t j = 0; j < again.size(); ++j) (*r)[again[j]] = std::move((*rr)[j]);
    }
    for (size_t i = 0; i < items->size(); ++i) {
      const Item& item = (*items)[i];
      const Reply& x = (*r)[i];
      if (x.is_error() || x.kind != Reply::Kind::kArray || x.elements.size() != 2) {
        st.Record(
            "failed",
            absl::StrCat("failed ", Arrow(*item.pair), ": ", Printable(x.is_error() ? x.str : "unexpected reply")),
            Step::kAttention);
        continue;
      }
      if (x.elements[0].str == "changed") {
        // The app wrote the old key between our read and the script: read it again.
        if (attempt + 1 < kAttempts) st.Record("retried", "", Step::kRoutine);
        todo.push_back(item.pair);
        continue;
      }
      Judge(st, item, x.elements[0].str, x.elements[1].str);
    }
  }
  for (const Pair* p : todo) {
    st.Record("changed",
              absl::StrCat("changed ", Arrow(*p), ": the old key changed on each of ", kAttempts,
                           " attempts; run the step again"),
              Step::kAttention);
  }
  return absl::OkStatus();
}

}  // namespace

const char kMigrateUsage[] =
    "usage: keyguard migrate --migration NAME {copy|verify|cleanup} [--config FILE] [--upstream URL]\n"
    "                        [--db N] [--dry-run] [--refresh] [--new-keys-win] [--cursor C] [--max-keys N]\n"
    "                        [--rate OPS] [--verbose] [--summary-json FILE] [--progress-seconds S]\n"
    "                        [--no-progress]\n"
    "  copy     writes the new key for every old key the migration matches; a new key that differs\n"
    "           from its old key is reported as stale and kept, or with --refresh rewritten from it\n"
    "           (use --refresh while the app still writes the old names: the old key is the truth)\n"
    "  verify   compares old and new keys (type, value, expiry); exit 1 on a difference\n"
    "  cleanup  UNLINKs each old key whose new key matches it, checked atomically with the delete;\n"
    "           every other old key is kept and listed with the reason. After the switch-over, when\n"
    "           the app writes only the new keys, --new-keys-win also UNLINKs (and lists) an old key\n"
    "           whose new key exists but differs; an old key without a new key is still kept\n"
    "  Every decision about a key is one server-side script: a key the app changes meanwhile is\n"
    "  re-read, never copied stale nor deleted. The migrations are in the config file (migrations:).\n"
    "  --dry-run changes nothing and says what would change (totals, and the first lines of each\n"
    "  kind; --verbose lists every key). --max-keys stops after about N keys and prints the cursor to\n"
    "  resume from (as does Ctrl-C). --summary-json writes the totals as JSON ('-': stdout).\n"
    "  --upstream: HOST:PORT, redis[s]://[USER@]HOST:PORT or redis[s]-sentinel://MASTER@H:P,... (the\n"
    "  primary), as for audit (a Redis Cluster: each primary in turn).\n"
    "  Exit: 0 done, 1 a key needs attention (listed), 2 usage, config or connection error,\n"
    "  3 stopped before the end with nothing to report so far (resume with --cursor).\n";

int RunMigrate(const std::vector<std::string>& argv) {
  auto parsed = ParseArgs(argv,
                          {"--config", "--upstream", "--db", "--migration", "--cursor", "--max-keys", "--rate",
                           "--summary-json", "--progress-seconds"},
                          {"--dry-run", "--refresh", "--new-keys-win", "--verbose", "--no-progress", "--help"});
  if (!parsed.ok()) return Fail(absl::StrCat(parsed.status().message(), "\n", kMigrateUsage));
  const Args& args = *parsed;
  if (args.Has("--help")) {
    std::fputs(kMigrateUsage, stdout);
    return 0;
  }
  if (args.positional.size() != 1 ||
      (args.positional[0] != "copy" && args.positional[0] != "verify" && args.positional[0] != "cleanup")) {
    return Fail(absl::StrCat("name one step: copy, verify or cleanup\n", kMigrateUsage));
  }
  const std::string step_name = args.positional[0];
  const StepKind kind = step_name == "copy"     ? StepKind::kCopy
                        : step_name == "verify" ? StepKind::kVerify
                                                : StepKind::kCleanup;
  if (args.Has("--refresh") && kind != StepKind::kCopy) return Fail("--refresh applies to copy only");
  if (args.Has("--new-keys-win") && kind != StepKind::kCleanup) return Fail("--new-keys-win applies to cleanup only");
  auto loaded = LoadMaintenanceConfig(args.Str("--config"));
  if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
  MaintenanceConfig& cfg = *loaded;
  if (!args.Has("--migration")) return Fail("--migration NAME is required");
  const Migration* m = cfg.FindMigration(args.Str("--migration"));
  if (m == nullptr) {
    std::string known;
    for (const Migration& x : cfg.migrations) absl::StrAppend(&known, known.empty() ? "" : ", ", x.name);
    return Fail(absl::StrCat("no migration named '", args.Str("--migration"),
                             "' in the config (known: ", known.empty() ? "none" : known, ")"));
  }
  if (args.Has("--upstream")) {
    auto u = config::ParseUpstream(args.Str("--upstream"), "--upstream");
    if (!u.ok()) return Fail(std::string(u.status().message()));
    cfg.proxy.upstream = *u;
  }
  auto db = args.Int("--db", 0, 0, 1 << 20);
  auto max_keys = args.Int("--max-keys", 0, 0, INT64_MAX);
  auto rate = args.Int("--rate", m->max_ops_per_second, 0, 100000000);
  auto progress_seconds = args.Double("--progress-seconds", 10, 0, 86400);
  for (const absl::Status& s : {db.status(), max_keys.status(), rate.status(), progress_seconds.status()}) {
    if (!s.ok()) return Fail(std::string(s.message()));
  }
  std::string cursor = args.Str("--cursor", "0");
  if (cursor.empty() || !std::all_of(cursor.begin(), cursor.end(), absl::ascii_isdigit))
    return Fail("--cursor: expected a SCAN cursor");
  const std::string start_cursor = cursor;
  if (cfg.proxy.upstream.kind == config::Upstream::Kind::kCluster) {
    return Fail(absl::StrCat("upstream ", cfg.proxy.upstream.ToString(),
                             ": migrate works on one server at a time: point --upstream at each primary in "
                             "turn (HOST:PORT, redis:// or rediss://)"));
  }
  auto upstream = UpstreamLinks::Create(cfg.proxy);
  if (!upstream.ok()) return Fail(std::string(upstream.status().message()));
  auto link = upstream->Connect(static_cast<int>(*db));
  if (!link.ok()) return Fail(std::string(link.status().message()));

  CatchStopSignals();
  Pacer pacer(static_cast<uint32_t>(*rate));
  const bool dry_run = args.Has("--dry-run") && kind != StepKind::kVerify;
  Step st{kind, *m, **link, pacer, dry_run, args.Has("--refresh"), args.Has("--new-keys-win"), args.Has("--verbose"),
          "",   {}, false};
  if (auto s = st.LoadScript(); !s.ok()) return Fail(std::string(s.message()));
  int64_t dbsize = -1;
  if (auto size = st.link.Call({"DBSIZE"}); size.ok() && size->kind == Reply::Kind::kInteger) dbsize = size->integer;
  const Progress::Mode progress_mode = args.Has("--no-progress") ? Progress::Mode::kOff
                                       : isatty(STDERR_FILENO)   ? Progress::Mode::kTerminal
                                                                 : Progress::Mode::kLines;
  Progress progress(progress_mode, absl::StrCat(step_name, " ", m->name, ": "), dbsize,
                    std::chrono::milliseconds(static_cast<int64_t>(*progress_seconds * 1000)));
  const auto started = std::chrono::steady_clock::now();
  uint64_t scanned = 0, matched = 0;
  bool complete = false;
  for (;;) {
    pacer.Before(1);
    auto page = st.link.Call({"SCAN", cursor, "MATCH", m->match, "COUNT", absl::StrCat(m->batch)});
    if (!page.ok()) return Fail(absl::StrCat(page.status().message(), "; resume with --cursor ", cursor));
    if (page->kind != Reply::Kind::kArray || page->elements.size() != 2) return Fail(absl::StrCat("SCAN: ", page->str));
    std::vector<Pair> batch;
    for (const Reply& k : page->elements[1].elements) {
      ++scanned;
      auto to = m->NewName(k.str);
      if (!to || *to == k.str) continue;
      batch.push_back(Pair{k.str, *std::move(to)});
    }
    matched += batch.size();
    if (absl::Status s = RunBatch(st, batch); !s.ok()) {
      return Fail(absl::StrCat(step_name, ": ", s.message(), "; resume with --cursor ", cursor));
    }
    cursor = page->elements[0].str;
    if (cursor == "0") {
      complete = true;
      break;
    }
    progress.Show(scanned);
    if ((*max_keys > 0 && scanned >= static_cast<uint64_t>(*max_keys)) || StopRequested()) break;
  }
  progress.Done();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const int exit_code = st.failed ? 1 : complete ? 0 : 3;

  std::string summary =
      absl::StrCat(step_name, " ", m->name, ":", dry_run ? " dry-run" : "", " scanned=", scanned, " matched=", matched);
  for (const auto& [what, n] : st.counts) absl::StrAppend(&summary, " ", what, "=", n);
  absl::StrAppend(&summary, " complete=", complete ? "true" : "false", " cursor=", cursor);
  std::printf("%s\n", summary.c_str());
  if (args.Has("--summary-json")) {
    nlohmann::ordered_json j;
    j["step"] = step_name;
    j["migration"] = m->name;
    j["dry_run"] = dry_run;
    j["refresh"] = st.refresh;
    j["scanned"] = scanned;
    j["matched"] = matched;
    j["counts"] = nlohmann::ordered_json::object();
    for (const auto& [what, n] : st.counts) j["counts"][what] = n;
    j["complete"] = complete;
    j["start_cursor"] = start_cursor;
    j["cursor"] = cursor;
    j["seconds"] = seconds;
    j["exit_code"] = exit_code;
    const std::string text = j.dump() + "\n";
    const std::string path = args.Str("--summary-json");
    if (path == "-") {
      std::fputs(text.c_str(), stdout);
    } else {
      std::ofstream out(path, std::ios::trunc);
      out << text;
      if (!out) std::fprintf(stderr, "keyguard migrate: cannot write %s\n", path.c_str());
    }
  }
  std::fflush(stdout);
  if (!complete) {
    std::fprintf(stderr, "keyguard migrate: stopped after %llu keys; resume with --cursor %s\n",
                 static_cast<unsigned long long>(scanned), cursor.c_str());
  }
  if (st.failed) {
    std::fprintf(stderr, "keyguard migrate: %s found keys that need attention (listed above with the reason)\n",
                 step_name.c_str());
  }
  return exit_code;
}

}  // namespace keyguard::maintenance
