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
  explicit SizeCache(const Settings& s) : settings_(s) {}
  void Put(uint64_t key, KeySize size);
  const KeySize* Get(uint64_t key, int64_t now_ms) const;
  void Erase(uint64_t key) { entries_.erase(key); }
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }
  // Over the big-string or big-collection threshold.
  bool IsBig(const KeySize& s) const;

 private:
  const Settings& settings_;
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

// How many keys were given each expiry second, over a sliding window of kSlots seconds.
class ExpiryClusters {
 public:
  static constexpr size_t kSlots = 4096;
  explicit ExpiryClusters(const Settings& s) : settings_(s) {}
  // Records one key of `scope` (see RmwTracker::OnRead) expiring at `second` (Unix seconds).
  // Returns the key count when it reaches Settings::expiry_cluster_keys (once per second and
  // scope), else 0.
  int64_t Add(int64_t second, uint64_t scope = kFnvBasis);

 private:
  struct Slot {
    int64_t second = -1;
    uint64_t scope = 0;
    int64_t count = 0;
  };
  const Settings& settings_;
  std::array<Slot, kSlots> slots_{};
};

}  // namespace keyguard::hygiene
