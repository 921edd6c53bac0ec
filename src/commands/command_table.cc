#include "keyguard/common/fnv.h"
#include "keyguard/commands/command_table.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <deque>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "keyguard/commands/traits.h"
#include "keyguard/resp/framer.h"
#include "keyguard/resp/value.h"

namespace keyguard::commands {
namespace {

#include "command_table.inc"

// The commands whose keys Redis finds with its own code rather than (only) the key specs.
enum class KeyParser : uint8_t {
  kSpecs,
  kGeoradius,
  kGeoradiusByMember,
  kSort,
  kSortRo,
  kMigrate,
  kSet,
  kBitfield,
  kXread,
  kXreadGroup
};

KeyParser KeyParserByName(std::string_view name) {
  static constexpr std::pair<std::string_view, KeyParser> kNamed[] = {
      {"georadius", KeyParser::kGeoradius},
      {"georadiusbymember", KeyParser::kGeoradiusByMember},
      {"sort", KeyParser::kSort},
      {"sort_ro", KeyParser::kSortRo},
      {"migrate", KeyParser::kMigrate},
      {"set", KeyParser::kSet},
      {"bitfield", KeyParser::kBitfield},
      {"xread", KeyParser::kXread},
      {"xreadgroup", KeyParser::kXreadGroup},
  };
  for (const auto& [n, parser] : kNamed) {
    if (n == name) return parser;
  }
  return KeyParser::kSpecs;
}

// The live table: the generated one, plus what the upstream's COMMAND INFO added at start-up.
struct Table {
  std::vector<CommandSpec> specs;  // top-level commands and subcommands, by index
  std::vector<KeySpec> key_specs;
  std::vector<uint32_t> top;        // CommandId -> index in specs
  std::deque<std::string> strings;  // names and keywords of added commands
  // Open addressing on FNV-1a of the lowercase name: one short loop lowercases and hashes the
  // request's first argument, one probe (rarely two) finds the id.
  // The name is kept with its length: a probe compares hash and length, then the bytes.
  struct Slot {
    uint64_t hash = 0;
    const char* name = nullptr;
    uint32_t len = 0;
    CommandId id = kUnknownCommand;
  };
  std::vector<Slot> slots;
  size_t max_len = 0;
  // By spec index, for the compiled-in specs: which key parser Redis runs for it.
  std::vector<KeyParser> parsers;

  Table()
      : specs(std::begin(kCommandSpecs), std::end(kCommandSpecs)),
        key_specs(std::begin(kKeySpecs), std::end(kKeySpecs)) {
    for (size_t id = 0; id < kTopLevelCommands; ++id) top.push_back(static_cast<uint32_t>(id));
    for (size_t id = 1; id < kTopLevelCommands; ++id) Index(static_cast<CommandId>(id));
    for (const CommandSpec& s : specs) parsers.push_back(KeyParserByName(s.name));
  }
  static uint64_t Hash(std::string_view lower) { return Fnv1a(lower); }
  void Index(CommandId id) {
    const std::string_view name = specs[top[id]].name;
    if (name.size() > max_len) max_len = name.size();
    if ((top.size() + 1) * 2 > slots.size()) {
      // Keep the load under one half: rebuild for every id so far.
      slots.assign(std::max<size_t>(1024, slots.size() * 2), Slot{});
      for (CommandId i = 1; i < id; ++i) Insert(i);
    }
    Insert(id);
  }
  void Insert(CommandId id) {
    const std::string_view name = specs[top[id]].name;
    const uint64_t h = Hash(name);
    size_t i = h & (slots.size() - 1);
    while (slots[i].id != kUnknownCommand) i = (i + 1) & (slots.size() - 1);
    slots[i] = Slot{h, name.data(), static_cast<uint32_t>(name.size()), id};
  }
};

Table& GetTable() {
  static Table* table = new Table();
  return *table;
}

// Added commands and subcommands never carry one of these names (an added name is one the
// compiled-in table lacks, or has a '|'), but a spec that is not the table's is judged by name.
KeyParser ParserOf(const CommandSpec& spec) {
  const Table& t = GetTable();
  const std::less<const CommandSpec*> before;
  if (!before(&spec, t.specs.data()) && before(&spec, t.specs.data() + t.parsers.size())) {
    return t.parsers[static_cast<size_t>(&spec - t.specs.data())];
  }
  return KeyParserByName(spec.name);
}

bool HasArg(std::span<const std::string_view> args, size_t from, std::string_view word) {
  for (size_t i = from; i < args.size(); ++i) {
    if (EqualsIgnoreCase(args[i], word)) return true;
  }
  return false;
}

// Redis's getKeysUsingKeySpecs (db.c), position for position. Returns false for an invalid or
// incomplete spec, which makes Redis fall back to the command's own key parser.
bool KeysFromSpecs(const CommandSpec& cmd, std::span<const std::string_view> args, std::vector<KeyRef>* out) {
  const int argc = static_cast<int>(args.size());
  for (const KeySpec& spec : KeySpecs(cmd)) {
    if (spec.flags & kKeyNotKey) continue;
    int first = 0;
    if (spec.begin == KeySpec::kIndex) {
      first = spec.index;
    } else if (spec.begin == KeySpec::kKeyword) {
      const int start = spec.startfrom > 0 ? spec.startfrom : argc + spec.startfrom;
      const int end = spec.startfrom > 0 ? argc - 1 : 1;
      for (int i = start; i != end; i = start <= end ? i + 1 : i - 1) {
        if (i >= argc || i < 1) break;
        if (EqualsIgnoreCase(args[i], spec.keyword)) {
          first = i + 1;
          break;
        }
      }
      if (first == 0) continue;  // keyword not present: this spec has no keys here
    } else {
      return false;
    }
    int last, step;
    if (spec.find == KeySpec::kRange) {
      step = spec.keystep;
      if (spec.lastkey >= 0) {
        last = first + spec.lastkey;
      } else if (spec.limit == 0) {
        last = argc + spec.lastkey;
      } else {
        last = first + ((argc - first) / spec.limit + spec.lastkey);
      }
    } else if (spec.find == KeySpec::kKeynum) {
      step = spec.keystep;
      const int at = first + spec.keynumidx;
      int64_t numkeys;
      if (at >= argc || !resp::ParseRedisInt(args[at], &numkeys) || numkeys < 0 || numkeys > argc) return false;
      first += spec.firstkey;
      last = first + static_cast<int>(numkeys) - 1;
    } else {
      return false;
    }
    if (last >= argc || last < first || first >= argc) return false;
    for (int i = first; i <= last; i += step) {
      if (i >= argc) continue;  // commands of variable arity report the error themselves
      out->push_back(KeyRef{static_cast<uint32_t>(i), spec.flags});
    }
    if (spec.flags & kKeyIncomplete) return false;
  }
  return true;
}

// The sort key, and for SORT the destination it really writes. BY and GET take patterns, not keys.
void SortKeys(bool read_only, std::span<const std::string_view> args, std::vector<KeyRef>* out) {
  if (args.size() < 2) return;  // a bare SORT has no key (the server answers with an arity error)
  out->push_back(KeyRef{1, kKeyRo | kKeyAccess});
  const SortOptions o = ParseSort(read_only, args);
  if (o.store > 0) out->push_back(KeyRef{static_cast<uint32_t>(o.store), kKeyOw | kKeyUpdate});
}

// migrateGetKeys: argv[3], or with an empty argv[3] everything after KEYS.
void MigrateKeys(std::span<const std::string_view> args, std::vector<KeyRef>* out) {
  const int argc = static_cast<int>(args.size());
  int first = 3, num = 1;
  if (argc > 6) {
    for (int i = 6; i < argc; ++i) {
      if (EqualsIgnoreCase(args[i], "keys")) {
        if (!args[3].empty()) {
          num = 0;
        } else {
          first = i + 1;
          num = argc - first;
        }
        break;
      }
      if (EqualsIgnoreCase(args[i], "auth")) {
        i += 1;
      } else if (EqualsIgnoreCase(args[i], "auth2")) {
        i += 2;
      }
    }
  }
  for (int i = 0; i < num; ++i) {
    if (first + i < argc) out->push_back(KeyRef{static_cast<uint32_t>(first + i), kKeyRw | kKeyAccess | kKeyDelete});
  }
}

// GEORADIUS and GEORADIUSBYMEMBER: what their key specs name (the source, the first STORE and the
// first STOREDIST word wherever it stands: COMMAND GETKEYS, ACL and cluster checks see those) and
// the destination georadiusGeneric really writes, the last STORE/STOREDIST, which the specs miss
// (`... STORE d1 STORE d2`) or cannot place (`... STOREDIST STORE`: the specs' STORE is the
// argument, the key past the end). `specs_ok` says whether the specs placed their keys.
void GeoRadiusKeys(int base, std::span<const std::string_view> args, bool specs_ok, std::vector<KeyRef>* out,
                   size_t before) {
  if (!specs_ok) {
    out->resize(before);
    out->push_back(KeyRef{1, kKeyRo | kKeyAccess});
  }
  const int store = GeoRadiusStore(args, base);
  if (store > 0 && std::none_of(out->begin() + static_cast<std::ptrdiff_t>(before), out->end(),
                                [&](const KeyRef& k) { return k.pos == static_cast<uint32_t>(store); })) {
    out->push_back(KeyRef{static_cast<uint32_t>(store), kKeyOw | kKeyUpdate});
  }
}

// bitfieldGetKeys: read-only when only GET and OVERFLOW appear.
// SET writes its key, and reads it too with GET.
uint32_t SetKeyFlags(std::span<const std::string_view> args) {
  return HasArg(args, 3, "get") ? (kKeyRw | kKeyAccess | kKeyUpdate) : (kKeyOw | kKeyUpdate);
}

uint32_t BitfieldFlags(std::span<const std::string_view> args) {
  const int argc = static_cast<int>(args.size());
  for (int i = 2; i < argc; ++i) {
    const int rem = argc - i - 1;
    if (EqualsIgnoreCase(args[i], "get") && rem >= 2) {
      i += 2;
    } else if ((EqualsIgnoreCase(args[i], "set") || EqualsIgnoreCase(args[i], "incrby")) && rem >= 3) {
      return kKeyRw | kKeyAccess | kKeyUpdate;
    } else if (EqualsIgnoreCase(args[i], "overflow") && rem >= 1) {
      i += 1;
    } else {
      return kKeyRw | kKeyAccess | kKeyUpdate;
    }
  }
  return kKeyRo | kKeyAccess;
}

}  // namespace

CommandId LookupCommand(std::string_view name) {
  const Table& t = GetTable();
  // Redis compares command names with strcasecmp (its dict is hashed on the whole name, so
  // "set\0x" finds SET when the hashes share a bucket): a NUL ends the name here, so such a
  // command is judged as the command the server may run.
  char lower[128];
  const size_t limit = std::min(t.max_len, sizeof lower);
  // Lowercases and hashes (Table::Hash, FNV-1a) in one pass.
  uint64_t h = kFnvBasis;
  size_t n = 0;
  for (; n < name.size() && name[n] != '\0'; ++n) {
    if (n == limit) return kUnknownCommand;  // longer than any name
    const char c = name[n];
    const char l = (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c;
    lower[n] = l;
    h = (h ^ static_cast<unsigned char>(l)) * kFnvPrime;
  }
  if (n == 0) return kUnknownCommand;
  for (size_t i = h & (t.slots.size() - 1);; i = (i + 1) & (t.slots.size() - 1)) {
    const Table::Slot& slot = t.slots[i];
    if (slot.id == kUnknownCommand) return kUnknownCommand;
    if (slot.hash == h && slot.len == n && std::memcmp(slot.name, lower, n) == 0) return slot.id;
  }
}

std::string_view CommandName(CommandId id) { return Spec(id).name; }

size_t CommandCount() { return GetTable().top.size(); }

bool IsBuiltin(CommandId id) { return id < kTopLevelCommands; }

const CommandSpec& Spec(CommandId id) {
  const Table& t = GetTable();
  return t.specs[id < t.top.size() ? t.top[id] : 0];
}

std::span<const CommandSpec> AllSpecs() { return GetTable().specs; }

std::span<const KeySpec> KeySpecs(const CommandSpec& spec) {
  return std::span<const KeySpec>(GetTable().key_specs).subspan(spec.spec_begin, spec.spec_count);
}

const CommandSpec* ResolveSpec(CommandId id, std::span<const std::string_view> args) {
  const CommandSpec& top = Spec(id);
  if (top.sub_count == 0) return &top;
  if (args.size() < 2) return &top;  // Redis answers with an arity error
  const std::string_view prefix(top.name);
  const Table& t = GetTable();
  for (size_t i = top.sub_begin; i < top.sub_begin + top.sub_count; ++i) {
    const std::string_view name(t.specs[i].name);
    if (name.size() > prefix.size() && EqualsIgnoreCase(name.substr(prefix.size() + 1), args[1])) return &t.specs[i];
  }
  return nullptr;
}

uint32_t CommandFlagMask(std::string_view name) {
  for (size_t i = 0; i < std::size(kCommandFlagNames); ++i) {
    if (EqualsIgnoreCase(kCommandFlagNames[i], name)) return 1u << i;
  }
  return 0;
}

uint32_t AclCategoryMask(std::string_view name) {
  if (!name.empty() && name[0] == '@') name.remove_prefix(1);
  for (size_t i = 0; i < std::size(kAclCategoryNames); ++i) {
    if (EqualsIgnoreCase(kAclCategoryNames[i], name)) return 1u << i;
  }
  return 0;
}

SortOptions ParseSort(bool read_only, std::span<const std::string_view> args) {
  SortOptions o;
  const int argc = static_cast<int>(args.size());
  for (int j = 2; j < argc; ++j) {
    const int left = argc - j - 1;
    const std::string_view a = args[j];
    int64_t n;
    if (EqualsIgnoreCase(a, "asc") || EqualsIgnoreCase(a, "desc")) {
      o.desc = EqualsIgnoreCase(a, "desc");
    } else if (EqualsIgnoreCase(a, "alpha")) {
      o.alpha = true;
    } else if (EqualsIgnoreCase(a, "limit") && left >= 2) {
      if (!resp::ParseRedisInt(args[j + 1], &n) || !resp::ParseRedisInt(args[j + 2], &n)) {
        o.error = "ERR value is not an integer or out of range";
        break;
      }
      o.limit = j + 1;
      j += 2;
    } else if (!read_only && EqualsIgnoreCase(a, "store") && left >= 1) {
      o.store = ++j;
      o.stores.push_back(static_cast<uint32_t>(j));
    } else if (EqualsIgnoreCase(a, "by") && left >= 1) {
      o.by = ++j;
      // strchr: the pattern ends at a NUL for the server
      if (args[j].substr(0, args[j].find('\0')).find('*') == std::string_view::npos) o.dontsort = true;
      o.patterns.push_back(static_cast<uint32_t>(j));
    } else if (EqualsIgnoreCase(a, "get") && left >= 1) {
      o.patterns.push_back(static_cast<uint32_t>(++j));
      o.gets.push_back(static_cast<uint32_t>(j));
    } else {
      o.error = "ERR syntax error";
      break;
    }
  }
  if (!o.error.empty()) {
    o.store = o.by = o.limit = -1;  // the server runs nothing
    o.patterns.clear();
    o.gets.clear();
    o.stores.clear();
  }
  return o;
}

XreadOptions ParseXread(bool xreadgroup, std::span<const std::string_view> args) {
  auto is = [](std::string_view arg, std::string_view word) {
    return EqualsIgnoreCase(arg.substr(0, arg.find('\0')), word);
  };
  XreadOptions o;
  const int argc = static_cast<int>(args.size());
  for (int i = 1; i < argc; ++i) {
    const int more = argc - i - 1;
    const std::string_view a = args[i];
    if (is(a, "block") && more >= 1) {
      o.block = true;
      ++i;
    } else if (is(a, "count") && more >= 1) {
      ++i;
    } else if (is(a, "streams") && more >= 1) {
      if (more % 2 != 0 || (xreadgroup && !o.group)) break;  // unbalanced, or no GROUP: refused
      o.streams = i;
      o.keys = more / 2;
      return o;
    } else if (is(a, "group") && more >= 2 && xreadgroup) {
      o.group = true;
      i += 2;
    } else if (!(is(a, "noack") && xreadgroup)) {
      break;  // a syntax error (GROUP and NOACK too, in XREAD)
    }
  }
  o.block = false;
  return o;
}

int GeoRadiusStore(std::span<const std::string_view> args, int base) {
  const int argc = static_cast<int>(args.size());
  int store = -1;
  bool with = false, any = false, count = false;
  for (int i = base; i < argc; ++i) {
    const std::string_view a = args[i];
    const bool has_arg = i + 1 < argc;
    int64_t n;
    if (EqualsIgnoreCase(a, "withdist") || EqualsIgnoreCase(a, "withhash") || EqualsIgnoreCase(a, "withcoord")) {
      with = true;
    } else if (EqualsIgnoreCase(a, "any")) {
      any = true;
    } else if (EqualsIgnoreCase(a, "asc") || EqualsIgnoreCase(a, "desc")) {
      continue;
    } else if (EqualsIgnoreCase(a, "count") && has_arg) {
      if (!resp::ParseRedisInt(args[i + 1], &n) || n <= 0) return -1;
      count = true;
      ++i;
    } else if ((EqualsIgnoreCase(a, "store") || EqualsIgnoreCase(a, "storedist")) && has_arg) {
      store = ++i;
    } else {
      return -1;  // a syntax error: nothing runs
    }
  }
  // Refused after the options are read: STORE with WITH*, ANY without COUNT.
  if ((store > 0 && with) || (any && !count)) return -1;
  return store;
}

bool FindKeys(const CommandSpec& spec, std::span<const std::string_view> args, std::vector<KeyRef>* out) {
  const size_t before = out->size();
  if (spec.spec_count == 1) {
    // The most common shape by far (GET, SET, HSET, INCR, ...): one key at a fixed position.
    const KeySpec& k = KeySpecs(spec)[0];
    if (k.begin == KeySpec::kIndex && k.find == KeySpec::kRange && k.lastkey == 0 &&
        (k.flags & (kKeyNotKey | kKeyIncomplete)) == 0 && k.index > 0 && static_cast<size_t>(k.index) < args.size()) {
      if ((k.flags & kKeyVariableFlags) == 0) {
        out->push_back(KeyRef{static_cast<uint32_t>(k.index), k.flags});
        return true;
      }
      if (ParserOf(spec) == KeyParser::kSet) {  // as below, without the walk over the specs
        out->push_back(KeyRef{static_cast<uint32_t>(k.index), SetKeyFlags(args)});
        return true;
      }
    }
  }
  uint32_t all = 0, missing = 0;
  for (const KeySpec& k : KeySpecs(spec)) {
    all |= k.flags;
    missing |= ~k.flags;
  }
  const bool has_keyspec = (missing & kKeyNotKey) != 0;
  const bool variable_flags = (all & kKeyVariableFlags) != 0;
  const KeyParser parser = ParserOf(spec);
  if (parser == KeyParser::kXread || parser == KeyParser::kXreadGroup) {
    // The streams the server reads; when it refuses the options nothing runs, and the keys are
    // those of the specs (as COMMAND GETKEYS says).
    const XreadOptions o = ParseXread(parser == KeyParser::kXreadGroup, args);
    if (o.streams > 0 && spec.spec_count > 0) {
      const uint32_t flags = KeySpecs(spec)[0].flags;
      for (int i = 1; i <= o.keys; ++i) out->push_back(KeyRef{static_cast<uint32_t>(o.streams + i), flags});
      return true;
    }
  }
  if (has_keyspec && !variable_flags) {
    if (parser == KeyParser::kGeoradius || parser == KeyParser::kGeoradiusByMember) {
      const bool specs_ok = KeysFromSpecs(spec, args, out);
      GeoRadiusKeys(parser == KeyParser::kGeoradius ? 6 : 5, args, specs_ok, out, before);
      return true;
    }
    if (KeysFromSpecs(spec, args, out)) return true;
    out->resize(before);
    // Redis falls back to the command's own parser; only these differ from "no keys".
    if (parser == KeyParser::kSort || parser == KeyParser::kSortRo) {
      SortKeys(parser == KeyParser::kSortRo, args, out);
      return true;
    }
    if (parser == KeyParser::kMigrate) {
      MigrateKeys(args, out);
      return out->size() > before;
    }
    // EVAL/FCALL: when numkeys does not fit, Redis's own parser finds no keys, and for commands
    // whose keys are optional that is an answer, not an error.
    return (spec.flags & CommandFlagMask("no_mandatory_keys")) != 0;
  }
  if (variable_flags) {
    // SET and BITFIELD: the positions of their specs, the flags their arguments imply.
    if (!KeysFromSpecs(spec, args, out)) {
      out->resize(before);
      return false;
    }
    uint32_t flags = 0;
    if (parser == KeyParser::kSet) {
      flags = SetKeyFlags(args);
    } else if (parser == KeyParser::kBitfield) {
      flags = BitfieldFlags(args);
    }
    if (flags != 0) {
      for (size_t i = before; i < out->size(); ++i) (*out)[i].flags = flags;
    }
    return true;
  }
  return true;  // no keys
}

namespace {

using resp::Value;

int16_t Small(const Value* v) {
  if (v == nullptr) return 0;
  return static_cast<int16_t>(std::clamp<int64_t>(v->integer, INT16_MIN, INT16_MAX));
}

uint32_t KeyFlagMask(std::string_view name) {
  static constexpr std::pair<std::string_view, uint32_t> kNames[] = {{"RO", kKeyRo},
                                                                     {"RW", kKeyRw},
                                                                     {"OW", kKeyOw},
                                                                     {"RM", kKeyRm},
                                                                     {"access", kKeyAccess},
                                                                     {"update", kKeyUpdate},
                                                                     {"insert", kKeyInsert},
                                                                     {"delete", kKeyDelete},
                                                                     {"not_key", kKeyNotKey},
                                                                     {"incomplete", kKeyIncomplete},
                                                                     {"variable_flags", kKeyVariableFlags}};
  for (const auto& [n, m] : kNames) {
    if (EqualsIgnoreCase(n, name)) return m;
  }
  return 0;
}

KeySpec ParseKeySpec(const Value& v, Table& t) {
  KeySpec k{KeySpec::kUnknownBegin, 0, nullptr, 0, KeySpec::kUnknownFind, 0, 0, 0, 0, 0, 0};
  if (const Value* flags = resp::FieldOf(v, "flags")) {
    for (const Value& f : flags->elements) k.flags |= KeyFlagMask(f.text);
  }
  if (const Value* bs = resp::FieldOf(v, "begin_search")) {
    const Value* type = resp::FieldOf(*bs, "type");
    const Value* spec = resp::FieldOf(*bs, "spec");
    if (type != nullptr && spec != nullptr && type->text == "index") {
      k.begin = KeySpec::kIndex;
      k.index = Small(resp::FieldOf(*spec, "index"));
    } else if (type != nullptr && spec != nullptr && type->text == "keyword") {
      k.begin = KeySpec::kKeyword;
      const Value* kw = resp::FieldOf(*spec, "keyword");
      k.keyword = t.strings.emplace_back(kw ? std::string(kw->text) : std::string()).c_str();
      k.startfrom = Small(resp::FieldOf(*spec, "startfrom"));
    }
  }
  if (const Value* fk = resp::FieldOf(v, "find_keys")) {
    const Value* type = resp::FieldOf(*fk, "type");
    const Value* spec = resp::FieldOf(*fk, "spec");
    if (type != nullptr && spec != nullptr && type->text == "range") {
      k.find = KeySpec::kRange;
      k.lastkey = Small(resp::FieldOf(*spec, "lastkey"));
      k.keystep = Small(resp::FieldOf(*spec, "keystep"));
      k.limit = Small(resp::FieldOf(*spec, "limit"));
    } else if (type != nullptr && spec != nullptr && type->text == "keynum") {
      k.find = KeySpec::kKeynum;
      k.keynumidx = Small(resp::FieldOf(*spec, "keynumidx"));
      k.firstkey = Small(resp::FieldOf(*spec, "firstkey"));
      k.keystep = Small(resp::FieldOf(*spec, "keystep"));
    }
  }
  if (k.keystep <= 0) k.keystep = 1;
  return k;
}

// Builds a CommandSpec from one COMMAND INFO entry; subcommands are appended after it.
bool AddCommand(const Value& c, Table& t, CommandSpec* out) {
  if (c.type != '*' || c.elements.size() < 6) return false;
  const std::string name = absl::AsciiStrToLower(std::string(c.elements[0].text));
  if (name.empty() || name.size() > 100) return false;
  CommandSpec spec{t.strings.emplace_back(name).c_str(), static_cast<int16_t>(c.elements[1].integer), 0, 0, 0, 0, 0, 0};
  for (const Value& f : c.elements[2].elements) spec.flags |= CommandFlagMask(f.text);
  if (c.elements.size() > 6) {
    for (const Value& a : c.elements[6].elements) spec.acl |= AclCategoryMask(a.text);
  }
  spec.spec_begin = static_cast<uint16_t>(t.key_specs.size());
  if (c.elements.size() > 8 && c.elements[8].type == '*') {
    for (const Value& ks : c.elements[8].elements) t.key_specs.push_back(ParseKeySpec(ks, t));
  } else if (c.elements[3].integer > 0) {
    // Before Redis 7: first key, last key, step.
    const int16_t first = Small(&c.elements[3]), last = Small(&c.elements[4]), step = Small(&c.elements[5]);
    t.key_specs.push_back(KeySpec{KeySpec::kIndex, first, nullptr, 0, KeySpec::kRange,
                                  static_cast<int16_t>(last < 0 ? last : last - first), step > 0 ? step : int16_t{1}, 0,
                                  0, 0, kKeyRw | kKeyAccess});
  }
  spec.spec_count = static_cast<uint16_t>(t.key_specs.size() - spec.spec_begin);
  *out = spec;
  return true;
}

}  // namespace

absl::StatusOr<int> ExtendFromCommandInfo(std::string_view reply) {
  const auto v = resp::ParseValue(reply);
  if (!v) return absl::InvalidArgumentError("COMMAND INFO reply is not one RESP value");
  if (v->type == '-') return absl::UnavailableError(std::string(v->text));
  if (v->type != '*')
    return absl::InvalidArgumentError(absl::StrCat("COMMAND INFO replied with type '", std::string(1, v->type), "'"));
  Table& t = GetTable();
  int added = 0;
  for (const Value& c : v->elements) {
    if (c.null || c.type != '*' || c.elements.empty()) continue;
    if (LookupCommand(c.elements[0].text) != kUnknownCommand) continue;
    CommandSpec spec;
    if (!AddCommand(c, t, &spec)) continue;
    const size_t index = t.specs.size();
    t.specs.push_back(spec);
    if (c.elements.size() > 9 && !c.elements[9].elements.empty()) {
      t.specs[index].sub_begin = static_cast<uint16_t>(t.specs.size());
      for (const Value& sub : c.elements[9].elements) {
        CommandSpec s;
        if (AddCommand(sub, t, &s)) t.specs.push_back(s);
      }
      t.specs[index].sub_count = static_cast<uint16_t>(t.specs.size() - t.specs[index].sub_begin);
    }
    const CommandId id = static_cast<CommandId>(t.top.size());
    t.top.push_back(static_cast<uint32_t>(index));
    t.Index(id);
    ++added;
  }
  detail::ExtendTraits();
  return added;
}

const KnownCommands& Known() {
  static const KnownCommands known{
      LookupCommand("multi"),       LookupCommand("exec"),         LookupCommand("discard"),
      LookupCommand("subscribe"),   LookupCommand("psubscribe"),   LookupCommand("ssubscribe"),
      LookupCommand("unsubscribe"), LookupCommand("punsubscribe"), LookupCommand("sunsubscribe"),
      LookupCommand("hello"),       LookupCommand("monitor"),      LookupCommand("reset"),
      LookupCommand("quit"),        LookupCommand("client"),       LookupCommand("watch"),
      LookupCommand("unwatch"),     LookupCommand("auth"),         LookupCommand("sync"),
      LookupCommand("psync"),       LookupCommand("eval"),         LookupCommand("keys"),
      LookupCommand("scan"),        LookupCommand("sort"),         LookupCommand("sort_ro"),
      LookupCommand("debug"),       LookupCommand("module")};
  return known;
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  // Redis matches option words with strcasecmp on C strings: a NUL ends the word, so the server
  // reads "STORE\0x" as STORE. Reading it otherwise would let a client hide an option from keyguard.
  if (const size_t nul = a.find('\0'); nul != std::string_view::npos) a = a.substr(0, nul);
  if (const size_t nul = b.find('\0'); nul != std::string_view::npos) b = b.substr(0, nul);
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = static_cast<char>(x + 32);
    if (y >= 'A' && y <= 'Z') y = static_cast<char>(y + 32);
    if (x != y) return false;
  }
  return true;
}

}  // namespace keyguard::commands
