// Hygiene detectors: data-model mistakes keyguard can see in traffic, reported as findings with
// the key pattern and the fix. Each kind is also a rule with an action: observe (count), warn
// (count and log, the default), rewrite (where a rewrite exists) or reject.
//
// Kinds: serialized read-modify-write (with "changed N of M fields" for JSON), lost-update risk
// between connections, one attribute per key (hash candidates), big string writes and reads,
// whole-collection reads of big collections, big keys touched (sizes from the sizing probe), DEL
// and EXPIRE of big keys, KEYS, FLUSHALL/FLUSHDB without ASYNC, writes without a TTL to cache or
// session patterns, many keys expiring in the same second.
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "keyguard/common/json_line.h"
#include "keyguard/hygiene/serialized.h"
#include "keyguard/policy/action.h"

namespace keyguard::hygiene {

enum class Kind : uint8_t {
  kSerializedRmw,
  kLostUpdateRisk,
  kBigStringWrite,
  kBigStringRead,
  kWholeCollectionRead,
  kKeysCommand,
  kFlushWithoutAsync,
  kHashCandidate,
  kBigKeyAccess,
  kDelBigKey,
  kExpireBigKey,
  kMissingTtl,
  kExpiryClustering,
  kCount,
};
inline constexpr size_t kKindCount = static_cast<size_t>(Kind::kCount);
const char* KindName(Kind k);

using Action = policy::Action;
using policy::ActionName;
// Whether a kind has a rewrite (DEL -> UNLINK, FLUSH... ASYNC, the default TTL, TTL jitter) and
// whether keyguard can refuse the command that shows it (it must be known before forwarding).
bool CanRewrite(Kind k);
bool CanReject(Kind k);

// A key pattern that must carry a TTL (`hygiene.ttl_patterns`).
struct TtlPattern {
  std::string glob;           // Redis glob on the client's key name, e.g. "cache:*"
  bool session = false;       // session data rather than a cache (only the log wording differs)
  int64_t default_ttl_s = 0;  // the TTL the rewrite adds; 0: missing_ttl cannot rewrite
};

enum class KeyMode : uint8_t { kRaw, kHashed, kRedacted };

struct Settings {
  bool enabled = true;
  size_t big_string_bytes = 10 * 1024;          // a string value this large is a big key
  size_t huge_string_bytes = 10 * 1024 * 1024;  // and this large a huge one
  int64_t big_collection_elements = 5000;       // members in one reply that make a whole-collection read
  int64_t rmw_window_ms = 10000;                // a write this soon after a read is read-modify-write
  size_t tracked_keys = 10000;                  // serialized keys (and attribute parents) remembered per process
  size_t findings_kept = 1000;                  // recent findings at /debug/findings
  int64_t hot_keys_interval_s = 60;             // hot-key sketches start afresh this often
  size_t hot_keys_capacity = 256;               // counters per hot-key sketch per worker (0: off)
  uint32_t hot_keys_sample = 8;                 // count about one keyed command in this many (1: all)
  std::array<Action, kKindCount> actions = DefaultActions();
  KeyMode finding_keys = KeyMode::kRaw;      // how findings show keys
  std::string findings_file;                 // JSON lines go here (appended) instead of stderr
  std::vector<TtlPattern> ttl_patterns;      // cache/session patterns that must carry a TTL
  int64_t missing_ttl_window_ms = 1000;      // a later EXPIRE on the connection within this is fine
  int64_t expiry_cluster_keys = 20;          // keys of one pattern sharing an expiry second that may cluster
  int64_t expiry_cluster_window_ms = 60000;  // ... counted over this much time of the pattern's writes
  int jitter_percent = 10;                   // the expiry_clustering rewrite adds up to this much TTL
  // Sizing probe: its own upstream connection asks the size of keys touched by commands whose
  // replies do not show it (HGET, DEL, EXPIRE, ...), at most this many keys a second per worker.
  bool probe = true;
  int probe_keys_per_second = 50;
  size_t size_cache_keys = 10000;     // sizes remembered per process
  int64_t size_cache_ttl_ms = 60000;  // ... for this long

  static std::array<Action, kKindCount> DefaultActions() {
    std::array<Action, kKindCount> a;
    a.fill(Action::kWarn);
    return a;
  }
  Action action(Kind k) const { return actions[static_cast<size_t>(k)]; }
};
struct Finding {
  Kind kind;
  Action action = Action::kWarn;
  std::string key;
  std::string key_pattern;
  std::string command;
  std::string client;
  std::string client_name;
  std::string tenant;
  std::string format;      // of a serialized value
  std::string suggestion;  // what to do instead
  int64_t bytes = -1;
  int64_t elements = -1;
  int64_t fields_changed = -1;
  int64_t fields_total = -1;
  int64_t keys = -1;   // expiry_clustering: keys expiring in the same second
  int64_t ttl_s = -1;  // the TTL the command gave (or the rewrite added)
};

// JSON string values of log lines and findings (keyguard/common/json_line.h).
using keyguard::JsonEscape;
using keyguard::JsonString;
// Wall-clock milliseconds since the epoch.
int64_t UnixMs();

// One JSON object per finding (the log line and the /debug/findings entry), in the shape of
// keyguard.events.v1.Finding (proto/keyguard/events/v1/finding.proto).
std::string FindingJson(const Finding& f, int64_t unix_ms);
// The key as findings show it under `mode`: itself, "sha256:" and 16 hex digits, or empty.
std::string ShownKey(std::string_view key, KeyMode mode);

// Process-wide: the recent findings (a bounded ring) and their JSON lines (stderr or a file), at
// most one line per kind and key pattern every 10 seconds, and none for observe-only rules.
// Thread-safe; findings are rare events.
class FindingLog {
 public:
  explicit FindingLog(size_t capacity, std::string file = "");
  ~FindingLog();
  // False when the findings file cannot be opened (the log then goes to stderr).
  bool ok() const { return file_ok_; }
  void Add(const Finding& f);
  // {"findings":[...]} newest last.
  std::string RecentJson() const;

 private:
  mutable std::mutex mu_;
  size_t capacity_;
  std::FILE* out_ = stderr;
  bool file_ok_ = true;
  std::deque<std::string> recent_;
  absl::flat_hash_map<std::string, int64_t> last_logged_;  // kind + pattern -> second
};

// Per worker: which connections read which serialized strings, as key hashes and field
// fingerprints (never copies of values), bounded by Settings::tracked_keys.
class RmwTracker {
 public:
  // `shards`: one of this many that share Settings::tracked_keys.
  explicit RmwTracker(const Settings& s, size_t shards = 1) : settings_(s), shards_(shards) {}

  // `scope` keeps apart keys of the same name that belong to different tenants:
  // Fingerprint(tenant prefix), kFnvBasis without tenancy. Every other tracker takes it too.
  void OnRead(std::string_view key, uint64_t session, std::string_view value, int64_t now_ms,
              uint64_t scope = kFnvBasis) {
    OnReadHashed(Fingerprint(key, scope), session, value, now_ms);
  }
  // The same for a key already fingerprinted: `key_hash` is Fingerprint(key, scope).
  void OnReadHashed(uint64_t key_hash, uint64_t session, std::string_view value, int64_t now_ms);

  struct Result {
    Kind kind;
    Format format;
    int64_t fields_changed = -1;
    int64_t fields_total = -1;
  };
  // A write of `value` to `key` by `session`; `watched` when the session WATCHes in a transaction
  // (optimistic locking: no lost update). Appends what it finds.
  void OnWrite(std::string_view key, uint64_t session, std::string_view value, bool watched, int64_t now_ms,
               std::vector<Result>* out, uint64_t scope = kFnvBasis) {
    OnWriteHashed(Fingerprint(key, scope), session, value, watched, now_ms, out);
  }
  void OnWriteHashed(uint64_t key_hash, uint64_t session, std::string_view value, bool watched, int64_t now_ms,
                     std::vector<Result>* out);
  size_t tracked() const { return entries_.size(); }
  // Nothing tracked: writes cannot find anything, and only serialized reads need a look.
  bool idle() const { return entries_.empty(); }

 private:
  struct Reader {
    uint64_t session;
    int64_t at_ms;
    bool stale;  // someone else wrote the key after this read
  };
  struct Entry {
    Format format;
    std::vector<std::pair<uint64_t, uint64_t>> fields;
    std::vector<Reader> readers;
  };
  const Settings& settings_;
  size_t shards_;
  absl::flat_hash_map<uint64_t, Entry> entries_;
};

// The top bit of every byte of `x` that is not an ASCII digit. Each byte is tested on its own
// (its low 7 bits plus a constant stay below 0x100: no carry crosses into the next byte).
inline uint64_t NonDigits(uint64_t x) {
  constexpr uint64_t kHigh = 0x8080808080808080ull, kLow = 0x7f7f7f7f7f7f7f7full;
  const uint64_t low = x & kLow;
  const uint64_t at_least_0 = low + 0x5050505050505050ull;  // top bit: low >= '0'
  const uint64_t above_9 = low + 0x4646464646464646ull;     // top bit: low > '9'
  return ~(at_least_0 & ~above_9 & ~x) & kHigh;
}

// Plain string keys written under one parent (`user:1:name`, `user:1:age`, ...), to
// spot one-attribute-per-key models that want a Hash. Bounded by Settings::tracked_keys parents.
class AttributeTracker {
 public:
  static constexpr size_t kThreshold = 3;  // distinct attributes that make a hash candidate

  explicit AttributeTracker(const Settings& s, size_t shards = 1) : settings_(s), shards_(shards) {}
  // A plain string write of `key` at `now_ms` (-1: read the clock, only for keys that qualify).
  // Returns true the first time the key's parent reaches kThreshold distinct attributes within
  // the window; `parent` and `attributes` then name them.
  bool OnWrite(std::string_view key, int64_t now_ms, std::string* parent, std::vector<std::string>* attributes,
               uint64_t scope = kFnvBasis) {
    std::string_view parent_name;
    return ParentOf(key, &parent_name) &&
           OnParentWrite(key, parent_name, Fingerprint(parent_name, scope), now_ms, parent, attributes);
  }
  // The same for a key whose parent ParentOf found, fingerprinted: `parent_hash` is
  // Fingerprint(parent_name, scope).
  bool OnParentWrite(std::string_view key, std::string_view parent_name, uint64_t parent_hash, int64_t now_ms,
                     std::string* parent, std::vector<std::string>* attributes);
  // Whether `key` is `parent:attribute` with a short attribute that is not an id (only those
  // count), and its parent. Inline: every plain small string write asks.
  static bool ParentOf(std::string_view key, std::string_view* parent) {
    // One pass from the end: digits first (an id, as in `order:1001`, is not an attribute: the
    // common case stops at its colon), 8 at a time, then the rest of the attribute up to its colon.
    size_t i = key.size();
    for (;;) {
      if (i < 8) {
        while (i > 0 && static_cast<unsigned char>(key[i - 1] - '0') < 10) --i;
        break;
      }
      uint64_t x;
      std::memcpy(&x, key.data() + i - 8, 8);
      if (const uint64_t other = NonDigits(x); other != 0) {
        // Just past the last byte that is no digit: little-endian, the highest one flagged, whose
        // top bit has 8 * (digits after it) zero bits above it.
        i -= static_cast<size_t>(__builtin_clzll(other)) / 8;
        break;
      }
      i -= 8;
    }
    if (i == 0 || (key[i - 1] == ':')) return false;  // all digits (or a trailing colon)
    while (i > 0 && key[i - 1] != ':') --i;
    if (i == 0) return false;  // no colon
    const size_t colon = i - 1;
    // Only `parent:attribute` keys with a short attribute name.
    if (colon == 0 || key.size() - colon - 1 > 32) return false;
    *parent = key.substr(0, colon);
    return true;
  }
  size_t tracked() const { return parents_.size(); }

 private:
  struct Parent {
    int64_t first_ms;
    bool reported;
    std::vector<std::string> attributes;  // at most kThreshold short names
  };
  const Settings& settings_;
  size_t shards_;
  absl::flat_hash_map<uint64_t, Parent> parents_;
};

}  // namespace keyguard::hygiene
