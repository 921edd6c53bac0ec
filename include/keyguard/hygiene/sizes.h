// What the TTL, big-key and sizing-probe detectors remember, per worker and bounded: key sizes,
// keys waiting for a probe, expiry seconds. Sans-io; the proxy drives them.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "keyguard/hygiene/detectors.h"

namespace keyguard::hygiene {

// Redis glob matching (stringmatchlen): * ? [abc] [^a-z] and \ escapes.
bool GlobMatch(std::string_view pattern, std::string_view text);

// The command that counts a type's members (bytes for a string): STRLEN, HLEN, LLEN, SCARD,
// ZCARD, XLEN; nullptr for "none" and module types.
const char* SizeCommand(std::string_view type);

struct KeySize {
  std::string type;       // string, hash, list, set, zset, stream
  int64_t bytes = -1;     // string length
  int64_t elements = -1;  // collection members
  int64_t memory = -1;    // MEMORY USAGE, when probed
  int64_t at_ms = 0;      // when learned
};

// Sizes of keys seen lately: from writes, from replies and from the probe. Bounded by
// Settings::size_cache_keys (an arbitrary entry goes when full); entries older than
// Settings::size_cache_ttl_ms are not returned.
class SizeCache {
 public:
  // `shards`: one of this many that share Settings::size_cache_keys.
  explicit SizeCache(const Settings& s, size_t shards = 1) : settings_(s), shards_(shards) {}
  void Put(uint64_t key, KeySize size);
  const KeySize* Get(uint64_t key, int64_t now_ms) const;
  void Erase(uint64_t key) { entries_.erase(key); }
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }
  // Over the big-string or big-collection threshold.
  bool IsBig(const KeySize& s) const;

 private:
  const Settings& settings_;
  size_t shards_;
  absl::flat_hash_map<uint64_t, KeySize> entries_;
};

// Keys waiting for the sizing probe, with what the finding needs when the size comes back.
// Bounded (kCapacity waiting, one entry per key) and rate-limited by Settings::probe_keys_per_second.
struct ProbeRequest {
  uint64_t hash = 0;
  std::string upstream_key;  // the name on the server (with the tenant prefix)
  Finding finding;           // kind kBigKeyAccess, with key, pattern, command, client, tenant filled
};

class ProbeQueue {
 public:
  static constexpr size_t kCapacity = 1024;
  explicit ProbeQueue(const Settings& s) : settings_(s) {}
  // False when the key is already waiting or the queue is full.
  bool Push(ProbeRequest r);
  // Up to `max` requests the rate allows at `now_ms`.
  size_t Take(int64_t now_ms, size_t max, std::deque<ProbeRequest>* out);
  bool empty() const { return queue_.empty(); }
  size_t size() const { return queue_.size(); }
  uint64_t dropped() const { return dropped_; }

 private:
  const Settings& settings_;
  std::deque<ProbeRequest> queue_;
  absl::flat_hash_set<uint64_t> waiting_;
  double tokens_ = 0;
  int64_t last_ms_ = 0;
  uint64_t dropped_ = 0;
};

// Where each key pattern's TTL writes land. A pattern is clustered when, within
// Settings::expiry_cluster_window_ms of its writes, one expiry second holds at least
// Settings::expiry_cluster_keys of its keys and at least half of its TTL writes: most of its keys
// expire together (a batch written with one TTL and no jitter). A pattern written steadily with a
// fixed TTL, or with jittered TTLs, spreads its expiries and is never clustered, whatever its
// volume.
class ExpiryClusters {
 public:
  static constexpr size_t kPatterns = 4096;  // patterns tracked in all; a collision starts over
  static constexpr int kSeconds = 4;         // expiry seconds tracked per pattern (the busiest stay)
  explicit ExpiryClusters(const Settings& s, size_t patterns = kPatterns) : settings_(s), entries_(patterns) {}
  // Records one TTL write, at `now_ms`, of a key of `pattern` (a fingerprint of the key's pattern
  // in its tenant's scope: PatternFingerprint) expiring at `second` (Unix seconds). Returns the
  // number of the pattern's keys that share that second when the pattern becomes clustered (once
  // per window), else 0.
  int64_t Add(uint64_t pattern, int64_t second, int64_t now_ms);

 private:
  struct Entry {
    uint64_t pattern = 0;
    int64_t window_start_ms = 0;
    int64_t total = 0;  // TTL writes in the window
    bool reported = false;
    std::array<int64_t, kSeconds> seconds{};
    std::array<int64_t, kSeconds> counts{};
  };
  const Settings& settings_;
  std::vector<Entry> entries_;
};

// A fingerprint of `key`'s pattern in `scope`: the key with each run of digits folded into one
// marker, so `session:1001` and `session:42` are one pattern.
uint64_t PatternFingerprint(std::string_view key, uint64_t scope);

}  // namespace keyguard::hygiene
