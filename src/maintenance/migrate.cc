// `keyguard migrate`: the three steps of a safe rename or re-shape of existing keys (copy, verify,
// cleanup), each idempotent, resumable from a SCAN cursor, rate-limited and with --dry-run.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <csignal>
#include <cstdio>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "keyguard/maintenance/maintenance.h"
#include "maintenance/args.h"
#include "maintenance/json_fields.h"
#include "maintenance/redis_link.h"
#include "maintenance/settings.h"

namespace keyguard::maintenance {
namespace {

std::atomic<bool> stop_requested{false};
void RequestStop(int) { stop_requested = true; }

int Fail(const std::string& message) {
  std::fprintf(stderr, "keyguard migrate: %s\n", message.c_str());
  return 2;
}

// Writes a re-shaped key and its nested keys, with the old key's TTL, all or nothing, and only
// when the new key does not exist yet: a re-run skips what is done, and a new key the app already
// wrote through the proxy's rewrite rule is never overwritten.
// KEYS: the new key, then its nested keys. ARGV[1]: PTTL in ms (<= 0: none); then per key its
// kind ("hash" or "string"), the number of items, and the items (field, value, ... or the text).
constexpr char kWriteScript[] = R"lua(
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then return redis.error_reply('nested key exists: ' .. KEYS[i]) end
end
local ttl = tonumber(ARGV[1])
local at = 2
for i = 1, #KEYS do
  local kind, n = ARGV[at], tonumber(ARGV[at + 1])
  at = at + 2
  if kind == 'hash' then
    for j = at, at + n - 1, 1000 do
      redis.call('HSET', KEYS[i], unpack(ARGV, j, math.min(j + 999, at + n - 1)))
    end
  else
    redis.call('SET', KEYS[i], ARGV[at])
  end
  at = at + n
  if ttl > 0 then redis.call('PEXPIRE', KEYS[i], ttl) end
end
return 1
)lua";

struct Pair {
  std::string old_key, new_key;
};

struct Counters {
  std::map<std::string, uint64_t> n;  // printed in this (alphabetical) order
  void Add(const std::string& what, uint64_t k = 1) { n[what] += k; }
};

struct Step {
  const Migration& m;
  RedisLink& link;
  Pacer& pacer;
  bool dry_run;
  bool verbose;
  Counters counters;
  bool differences = false;

  absl::StatusOr<std::vector<Reply>> Run(const std::vector<Command>& cmds) {
    if (cmds.empty()) return std::vector<Reply>();
    pacer.Before(cmds.size());
    return link.Pipeline(cmds);
  }
  void Say(const std::string& line) { std::printf("%s\n", line.c_str()); }
};

std::string TtlText(int64_t pttl) { return pttl > 0 ? absl::StrCat("ttl ", pttl, " ms") : "no ttl"; }

// --- copy ---

absl::Status CopyKeepType(Step& st, const std::vector<Pair>& batch) {
  std::vector<Command> cmds;
  for (const Pair& p : batch) {
    if (st.dry_run) {
      cmds.push_back({"EXISTS", p.new_key});
    } else {
      // COPY keeps the type, the value and the TTL, and the old key stays readable; without
      // REPLACE it never overwrites a new key.
      cmds.push_back({"COPY", p.old_key, p.new_key});
    }
  }
  auto r = st.Run(cmds);
  if (!r.ok()) return r.status();
  for (size_t i = 0; i < batch.size(); ++i) {
    const Reply& x = (*r)[i];
    if (x.is_error()) return absl::InternalError(absl::StrCat("COPY ", batch[i].old_key, ": ", x.str));
    const bool done = st.dry_run ? x.integer == 0 : x.integer == 1;
    if (!done) {
      st.counters.Add("exists");
    } else {
      st.counters.Add(st.dry_run ? "would_copy" : "copied");
      if (st.dry_run || st.verbose) st.Say(absl::StrCat(st.dry_run ? "would copy " : "copied ", batch[i].old_key, " -> ", batch[i].new_key));
    }
  }
  return absl::OkStatus();
}

absl::Status CopyJsonToHash(Step& st, const std::vector<Pair>& batch) {
  std::vector<Command> reads;
  for (const Pair& p : batch) {
    reads.push_back({"TYPE", p.old_key});
    reads.push_back({"GET", p.old_key});
    reads.push_back({"PTTL", p.old_key});
    reads.push_back({"EXISTS", p.new_key});
  }
  auto r = st.Run(reads);
  if (!r.ok()) return r.status();
  std::vector<Command> writes;
  std::vector<size_t> written;
  for (size_t i = 0; i < batch.size(); ++i) {
    const Pair& p = batch[i];
    const std::string& type = (*r)[4 * i].str;
    const int64_t pttl = (*r)[4 * i + 2].integer;
    if (type == "none" || pttl == -2) continue;  // gone since SCAN
    if ((*r)[4 * i + 3].integer == 1) {
      st.counters.Add("exists");
      continue;
    }
    if (type != "string") {
      st.counters.Add("skipped");
      st.Say(absl::StrCat("skip ", p.old_key, ": a ", type, ", not a string"));
      continue;
    }
    std::string error;
    auto shape = JsonToHash((*r)[4 * i + 1].str, st.m.separate_nested, &error);
    if (!shape) {
      st.counters.Add("skipped");
      st.Say(absl::StrCat("skip ", p.old_key, ": ", error));
      continue;
    }
    Command eval = {"EVAL", kWriteScript, absl::StrCat(1 + shape->subkeys.size()), p.new_key};
    for (const auto& sub : shape->subkeys) eval.push_back(absl::StrCat(p.new_key, ":", sub.suffix));
    eval.push_back(absl::StrCat(pttl));
    auto add_fields = [&eval](const Fields& fields) {
      eval.insert(eval.end(), {"hash", absl::StrCat(2 * fields.size())});
      for (const auto& [f, v] : fields) eval.insert(eval.end(), {f, v});
    };
    add_fields(shape->fields);
    for (const auto& sub : shape->subkeys) {
      if (sub.hash) {
        add_fields(sub.fields);
      } else {
        eval.insert(eval.end(), {"string", "1", sub.text});
      }
    }
    if (st.dry_run || st.verbose) {
      std::string line = absl::StrCat(st.dry_run ? "would write " : "wrote ", p.new_key, " (hash, ", shape->fields.size(),
                                      " fields, ", TtlText(pttl), ")");
      for (const auto& sub : shape->subkeys) {
        absl::StrAppend(&line, " + ", p.new_key, ":", sub.suffix, sub.hash ? " (hash)" : " (string)");
      }
      absl::StrAppend(&line, " from ", p.old_key);
      st.Say(line);
    }
    if (st.dry_run) {
      st.counters.Add("would_copy");
      continue;
    }
    writes.push_back(std::move(eval));
    written.push_back(i);
  }
  auto w = st.Run(writes);
  if (!w.ok()) return w.status();
  for (size_t j = 0; j < written.size(); ++j) {
    const Reply& x = (*w)[j];
    if (x.is_error()) {
      st.counters.Add("failed");
      st.Say(absl::StrCat("failed ", batch[written[j]].old_key, ": ", x.str));
    } else {
      st.counters.Add(x.integer == 1 ? "copied" : "exists");
    }
  }
  return absl::OkStatus();
}

// --- verify ---

std::map<std::string, std::string> ToMap(const Fields& f) { return {f.begin(), f.end()}; }
std::map<std::string, std::string> ToMap(const Reply& hgetall) {
  std::map<std::string, std::string> out;
  for (size_t i = 0; i + 1 < hgetall.elements.size(); i += 2) out[hgetall.elements[i].str] = hgetall.elements[i + 1].str;
  return out;
}

// The TTLs agree when both keys have none, or both have one within a second (copy reads the old
// TTL a moment before it writes the new key).
bool SameTtl(int64_t a, int64_t b) { return (a < 0 && b < 0) || (a >= 0 && b >= 0 && std::abs(a - b) <= 1000); }

std::string FirstDifference(const std::map<std::string, std::string>& want, const std::map<std::string, std::string>& got) {
  for (const auto& [f, v] : want) {
    auto it = got.find(f);
    if (it == got.end()) return absl::StrCat("field '", f, "' missing");
    if (it->second != v) return absl::StrCat("field '", f, "' differs");
  }
  for (const auto& [f, v] : got) {
    if (!want.count(f)) return absl::StrCat("extra field '", f, "'");
  }
  return "";
}

absl::Status Verify(Step& st, const std::vector<Pair>& batch) {
  std::vector<Command> cmds;
  const bool hash = st.m.json_to_hash;
  for (const Pair& p : batch) {
    cmds.push_back({"TYPE", p.old_key});
    cmds.push_back({"TYPE", p.new_key});
    cmds.push_back({"PTTL", p.old_key});
    cmds.push_back({"PTTL", p.new_key});
    if (hash) {
      cmds.push_back({"GET", p.old_key});
      cmds.push_back({"HGETALL", p.new_key});
    } else {
      // DUMP is the value in RDB form: equal values of equal encoding dump alike.
      cmds.push_back({"DUMP", p.old_key});
      cmds.push_back({"DUMP", p.new_key});
    }
  }
  auto r = st.Run(cmds);
  if (!r.ok()) return r.status();
  struct Nested {
    size_t pair;
    std::string key;
    bool hash;
    Fields fields;
    std::string text;
    int64_t pttl;
  };
  std::vector<Nested> nested;
  std::vector<std::string> problem(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const Reply* x = &(*r)[6 * i];
    const std::string &old_type = x[0].str, &new_type = x[1].str;
    if (old_type == "none") {
      problem[i] = "-";  // gone since SCAN: nothing to compare
      continue;
    }
    if (new_type == "none") {
      problem[i] = "missing";
      continue;
    }
    if (!SameTtl(x[2].integer, x[3].integer)) {
      problem[i] = absl::StrCat("ttl differs (", TtlText(x[2].integer), " vs ", TtlText(x[3].integer), ")");
      continue;
    }
    if (!hash) {
      if (old_type != new_type) {
        problem[i] = absl::StrCat("type differs (", old_type, " vs ", new_type, ")");
      } else if (x[4].str != x[5].str) {
        problem[i] = "value differs";
      }
      continue;
    }
    if (new_type != "hash") {
      problem[i] = absl::StrCat("a ", new_type, ", not a hash");
      continue;
    }
    std::string error;
    auto shape = JsonToHash(x[4].str, st.m.separate_nested, &error);
    if (!shape) {
      problem[i] = absl::StrCat("old value: ", error);
      continue;
    }
    problem[i] = FirstDifference(ToMap(shape->fields), ToMap(x[5]));
    for (auto& sub : shape->subkeys) {
      nested.push_back({i, absl::StrCat(batch[i].new_key, ":", sub.suffix), sub.hash, std::move(sub.fields), std::move(sub.text), x[2].integer});
    }
  }
  if (!nested.empty()) {
    cmds.clear();
    for (const Nested& n : nested) {
      cmds.push_back({"TYPE", n.key});
      cmds.push_back({"PTTL", n.key});
      cmds.push_back({n.hash ? "HGETALL" : "GET", n.key});
    }
    auto nr = st.Run(cmds);
    if (!nr.ok()) return nr.status();
    for (size_t j = 0; j < nested.size(); ++j) {
      const Nested& n = nested[j];
      std::string& pb = problem[n.pair];
      if (!pb.empty()) continue;
      const Reply* x = &(*nr)[3 * j];
      if (x[0].str != (n.hash ? "hash" : "string")) {
        pb = absl::StrCat(n.key, ": ", x[0].str == "none" ? "missing" : "a " + x[0].str);
      } else if (!SameTtl(n.pttl, x[1].integer)) {
        pb = absl::StrCat(n.key, ": ttl differs");
      } else if (n.hash) {
        if (std::string d = FirstDifference(ToMap(n.fields), ToMap(x[2])); !d.empty()) pb = absl::StrCat(n.key, ": ", d);
      } else if (x[2].str != n.text) {
        pb = absl::StrCat(n.key, ": value differs");
      }
    }
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    if (problem[i] == "-") continue;
    if (problem[i].empty()) {
      st.counters.Add("same");
      if (st.verbose) st.Say(absl::StrCat("same ", batch[i].old_key, " -> ", batch[i].new_key));
      continue;
    }
    st.counters.Add(problem[i] == "missing" ? "missing" : "differ");
    st.differences = true;
    st.Say(absl::StrCat(problem[i] == "missing" ? "missing " : "differs ", batch[i].old_key, " -> ", batch[i].new_key,
                        problem[i] == "missing" ? "" : absl::StrCat(": ", problem[i])));
  }
  return absl::OkStatus();
}

// --- cleanup ---

absl::Status Cleanup(Step& st, const std::vector<Pair>& batch) {
  std::vector<Command> cmds;
  for (const Pair& p : batch) cmds.push_back({"EXISTS", p.new_key});
  auto r = st.Run(cmds);
  if (!r.ok()) return r.status();
  // UNLINK frees big values in a background thread; one UNLINK per batch.
  Command unlink = {"UNLINK"};
  for (size_t i = 0; i < batch.size(); ++i) {
    if ((*r)[i].integer != 1) {
      // Never delete a key whose data has no new home.
      st.counters.Add("kept");
      st.Say(absl::StrCat("kept ", batch[i].old_key, ": ", batch[i].new_key, " does not exist"));
      continue;
    }
    if (st.dry_run || st.verbose) st.Say(absl::StrCat(st.dry_run ? "would unlink " : "unlinked ", batch[i].old_key));
    unlink.push_back(batch[i].old_key);
  }
  if (unlink.size() == 1) return absl::OkStatus();
  if (st.dry_run) {
    st.counters.Add("would_unlink", unlink.size() - 1);
    return absl::OkStatus();
  }
  auto u = st.Run({unlink});
  if (!u.ok()) return u.status();
  if ((*u)[0].is_error()) return absl::InternalError(absl::StrCat("UNLINK: ", (*u)[0].str));
  st.counters.Add("unlinked", static_cast<uint64_t>((*u)[0].integer));
  return absl::OkStatus();
}

}  // namespace

const char kMigrateUsage[] =
    "usage: keyguard migrate --migration NAME {copy|verify|cleanup} [--config FILE] [--upstream HOST:PORT]\n"
    "                        [--db N] [--dry-run] [--cursor C] [--max-keys N] [--rate OPS] [--verbose]\n"
    "  copy     writes the new key for every old key the migration matches (never overwriting one)\n"
    "  verify   compares old and new keys (type, value, TTL); exit 1 on a difference\n"
    "  cleanup  UNLINKs the old keys whose new key exists, in batches\n"
    "  The migrations are in the config file (migrations:). --dry-run changes nothing and lists what\n"
    "  would change; --max-keys stops after about N keys and prints the cursor to resume from.\n";

int RunMigrate(const std::vector<std::string>& argv) {
  auto parsed = ParseArgs(argv, {"--config", "--upstream", "--db", "--migration", "--cursor", "--max-keys", "--rate"},
                          {"--dry-run", "--verbose", "--help"});
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
  auto loaded = LoadMaintenanceConfig(args.Str("--config"));
  if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
  MaintenanceConfig& cfg = *loaded;
  if (!args.Has("--migration")) return Fail("--migration NAME is required");
  const Migration* m = cfg.FindMigration(args.Str("--migration"));
  if (m == nullptr) {
    std::string known;
    for (const Migration& x : cfg.migrations) absl::StrAppend(&known, known.empty() ? "" : ", ", x.name);
    return Fail(absl::StrCat("no migration named '", args.Str("--migration"), "' in the config (known: ",
                             known.empty() ? "none" : known, ")"));
  }
  if (args.Has("--upstream")) {
    auto hp = config::ParseHostPort(args.Str("--upstream"), "--upstream");
    if (!hp.ok()) return Fail(std::string(hp.status().message()));
    cfg.proxy.upstream = *hp;
  }
  auto db = args.Int("--db", 0, 0, 1 << 20);
  auto max_keys = args.Int("--max-keys", 0, 0, INT64_MAX);
  auto rate = args.Int("--rate", m->max_ops_per_second, 0, 100000000);
  for (const absl::Status& s : {db.status(), max_keys.status(), rate.status()}) {
    if (!s.ok()) return Fail(std::string(s.message()));
  }
  std::string cursor = args.Str("--cursor", "0");
  if (cursor.empty() || !std::all_of(cursor.begin(), cursor.end(), absl::ascii_isdigit)) return Fail("--cursor: expected a SCAN cursor");
  auto link = RedisLink::Connect(cfg.proxy.upstream, static_cast<int>(*db));
  if (!link.ok()) return Fail(std::string(link.status().message()));

  std::signal(SIGINT, RequestStop);
  std::signal(SIGTERM, RequestStop);
  Pacer pacer(static_cast<uint32_t>(*rate));
  const bool dry_run = args.Has("--dry-run");
  Step st{*m, **link, pacer, dry_run && step_name != "verify", args.Has("--verbose"), {}, false};
  uint64_t scanned = 0, matched = 0;
  bool complete = false;
  for (;;) {
    pacer.Before(1);
    auto page = st.link.Call({"SCAN", cursor, "MATCH", m->match, "COUNT", absl::StrCat(m->batch)});
    if (!page.ok()) return Fail(std::string(page.status().message()));
    if (page->kind != Reply::Kind::kArray || page->elements.size() != 2) return Fail(absl::StrCat("SCAN: ", page->str));
    std::vector<Pair> batch;
    for (const Reply& k : page->elements[1].elements) {
      ++scanned;
      auto to = m->NewName(k.str);
      if (!to || *to == k.str) continue;
      batch.push_back(Pair{k.str, *std::move(to)});
    }
    matched += batch.size();
    absl::Status s = absl::OkStatus();
    if (!batch.empty()) {
      if (step_name == "copy") {
        s = m->json_to_hash ? CopyJsonToHash(st, batch) : CopyKeepType(st, batch);
      } else if (step_name == "verify") {
        s = Verify(st, batch);
      } else {
        s = Cleanup(st, batch);
      }
    }
    if (!s.ok()) return Fail(absl::StrCat(step_name, ": ", s.message(), "; resume with --cursor ", cursor));
    cursor = page->elements[0].str;
    if (cursor == "0") {
      complete = true;
      break;
    }
    if ((*max_keys > 0 && scanned >= static_cast<uint64_t>(*max_keys)) || stop_requested) break;
  }
  std::string summary = absl::StrCat(step_name, " ", m->name, ":", dry_run ? " dry-run" : "", " scanned=", scanned,
                                     " matched=", matched);
  for (const auto& [what, n] : st.counters.n) absl::StrAppend(&summary, " ", what, "=", n);
  absl::StrAppend(&summary, " complete=", complete ? "true" : "false", " cursor=", cursor);
  std::printf("%s\n", summary.c_str());
  std::fflush(stdout);
  if (!complete) std::fprintf(stderr, "keyguard migrate: stopped after %llu keys; resume with --cursor %s\n",
                              static_cast<unsigned long long>(scanned), cursor.c_str());
  return st.differences ? 1 : 0;
}

}  // namespace keyguard::maintenance
