// Hot keys and big keys: which keys take the most accesses and bytes per interval, and which hold
// the largest values, in bounded memory per worker thread.
//
// SpaceSaving is the space-saving top-K summary of Metwally, Agrawal and El Abbadi ("Efficient
// computation of frequent and top-k elements in data streams", 2005), with weights. LargestKeys
// keeps the N largest sizes seen. HotKeys is one worker's pair of sketches plus its largest keys,
// written only by that worker; HotKeysBoard is where workers publish snapshots (under a mutex,
// once a tick) and where /debug/hotkeys, /debug/bigkeys and the metrics read them. All sans-io.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "keyguard/hygiene/detectors.h"
#include "keyguard/metrics/text_writer.h"

namespace keyguard::hygiene {

// Space-saving top-K with `capacity` counters. For every item, with N the total weight added:
//   count - error <= true weight <= count, and error <= N / capacity (the smallest counter);
// an item whose true weight exceeds N / capacity is always present. While at most `capacity`
// distinct items were added, every count is exact (error 0). Add() costs one probe of an index
// keyed by the item's hash (computed once by the caller for several sketches of one stream) and
// a heap sift of log2(capacity) steps; in steady state it allocates only for items longer than
// the string's inline buffer or its previous capacity.
//
// With `filter_buckets` it is the filtered space-saving of Homem and Carvalho ("Finding top-k
// elements in data streams", 2010): an item absent from a full summary is charged to one of
// `filter_buckets` counters chosen by its hash, and takes over the smallest counter only when
// its bucket's charge plus its weight exceeds that counter; it then enters with that sum as its
// count and its bucket's charge as its error, and the item it replaced leaves its count in its
// own bucket. A bucket never exceeds the smallest counter and always covers what every absent
// item of its bucket had, so the bounds above hold (the counters' sum is then at most N, not
// equal to it), and while at most `capacity` distinct items were added every count is exact. On a
// long tail of distinct items most additions only touch their bucket: no eviction, no sift.
class SpaceSaving {
 public:
  struct Entry {
    std::string item;
    uint64_t count = 0;
    uint64_t error = 0;  // how much of `count` may belong to items this counter replaced
  };

  // `filter_buckets`: 0 for the plain summary, else rounded up to a power of two.
  explicit SpaceSaving(size_t capacity, size_t filter_buckets = 0);
  SpaceSaving(const SpaceSaving&) = delete;
  SpaceSaving& operator=(const SpaceSaving&) = delete;

  void Add(absl::string_view item, uint64_t weight = 1) { Add(item, Hash(item), weight); }
  // The same with the item's Hash(), for callers that add one item to several sketches. Inline:
  // on a long tail of keys most additions only charge the item's filter bucket.
  void Add(absl::string_view item, uint64_t hash, uint64_t weight) {
    // Filtered and full, and no counter's item falls in the bucket: the item is absent.
    if (!held_.empty() && held_[hash >> filter_shift_] == 0 && heap_.size() == capacity_) {
      uint64_t& charge = filter_[hash >> filter_shift_];
      if (charge + weight <= heap_[0].count) {
        total_ += weight;
        charge += weight;
        return;
      }
    }
    AddSlow(item, hash, weight);
  }
  // An item's hash (wyhash-style, seeded per process: items are keys that clients choose).
  static uint64_t Hash(absl::string_view item);
  // Forgets everything (a new interval); keeps the reserved memory.
  void Clear();

  size_t size() const { return slots_.size(); }
  size_t capacity() const { return capacity_; }
  bool full() const { return slots_.size() == capacity_; }
  uint64_t total() const { return total_; }
  // The smallest counter: the error bound of any item, and what an absent item may have had.
  // 0 while not full.
  uint64_t min_count() const { return full() && capacity_ > 0 ? heap_[0].count : 0; }
  // Every counter, largest count first.
  std::vector<Entry> Entries() const;
  // Every counter, in no order.
  std::vector<Entry> Counters() const;

 private:
  struct Slot {
    std::string item;
    uint64_t error;
    uint64_t hash;
    uint32_t heap;  // position in heap_
  };
  // The counts live in the heap, so that a sift compares without following slot indexes.
  struct Counter {
    uint64_t count;
    uint32_t slot;
  };
  // Add's every other case.
  void AddSlow(absl::string_view item, uint64_t hash, uint64_t weight);
  void SiftUp(uint32_t pos);
  void SiftDown(uint32_t pos);
  void Place(uint32_t pos, Counter c) {
    heap_[pos] = c;
    slots_[c.slot].heap = pos;
  }
  // The slot holding `item`, or -1.
  int64_t Find(absl::string_view item, uint64_t hash) const;
  void Index(uint32_t slot);
  void Unindex(uint32_t slot);

  size_t capacity_;
  uint64_t total_ = 0;
  std::vector<Slot> slots_;
  std::vector<Counter> heap_;  // a min-heap by count
  // Open addressing with linear probing on the items' hashes: slot index + 1, 0 when empty. A
  // power of two at least twice the capacity, so probes stay short.
  std::vector<uint32_t> index_;
  // Filtered: what absent items may have had, by the top bits of their hash (empty: plain).
  std::vector<uint64_t> filter_;
  std::vector<uint32_t> held_;  // counters whose item falls in each bucket: 0 means absent, no probe
  int filter_shift_ = 64;
};

// A sketch as published: its counters (in no order) and what a merge needs to bound absent items.
struct SketchSnapshot {
  std::vector<SpaceSaving::Entry> entries;
  uint64_t min_count = 0;  // 0 unless the sketch was full
  uint64_t total = 0;
};
SketchSnapshot Snapshot(const SpaceSaving& s);

// Merges sketches of disjoint parts of a stream (workers, intervals) and returns the top `n` by
// count. Sums count and error per item; an item absent from a full sketch may have had up to that
// sketch's min_count there, which is added to both its count and its error, so the merged entry
// keeps count - error <= true <= count.
std::vector<SpaceSaving::Entry> MergeTop(const std::vector<const SketchSnapshot*>& parts, size_t n);

// The N largest sizes seen, one entry per item with the largest size it was seen with.
class LargestKeys {
 public:
  struct Entry {
    std::string item;
    uint64_t size = 0;
    std::string_view command;  // static storage (the command table's names)
    std::string_view type;     // static storage: "string", "hash", ...
    int64_t seen_ms = 0;       // wall clock, last time this size was seen
  };

  explicit LargestKeys(size_t capacity) : capacity_(capacity), admit_above_(capacity > 0 ? 0 : UINT64_MAX) {}
  // Whether a size could enter or grow an entry: one compare, so callers skip the clock and the
  // lookup. A size of 0 never enters; when full, only a size above the smallest held can change
  // anything (an equal one neither enters nor grows an entry).
  bool Admits(uint64_t size) const { return size > admit_above_; }
  void Observe(absl::string_view item, uint64_t size, std::string_view command, std::string_view type, int64_t now_ms);
  const std::vector<Entry>& entries() const { return entries_; }
  size_t capacity() const { return capacity_; }
  // Counts the changes to entries(): equal versions, equal entries.
  uint64_t version() const { return version_; }

 private:
  size_t capacity_;
  uint64_t version_ = 0;
  uint64_t admit_above_;  // 0 while not full, then the smallest size held (UINT64_MAX: no capacity)
  std::vector<Entry> entries_;
  absl::flat_hash_map<std::string, uint32_t> index_;
};

// Sketch items carry the tenant: one length byte, the tenant name (at most 255 bytes, empty
// without tenancy), then the key as the client named it. Written at the start of `*buffer`,
// which only grows (no resize per item); the view is valid until the buffer's next use.
absl::string_view HotKeyItem(absl::string_view tenant, absl::string_view key, std::string* buffer);
struct TenantKey {
  absl::string_view tenant;
  absl::string_view key;
};
TenantKey SplitHotKeyItem(absl::string_view item);

class HotKeysBoard;

// One worker's hot and big keys. Only the worker calls these, except through the board.
class HotKeys {
 public:
  static constexpr size_t kLargestKept = 128;  // per worker, per unit (bytes, elements)

  explicit HotKeys(const Settings& s);
  // The sketches are filtered (SpaceSaving): 32 buckets per counter, at most 65536 (768 KiB per
  // sketch; 96 KiB at the default capacity), so a long tail of keys seldom evicts.
  static size_t FilterBuckets(size_t capacity);
  bool enabled() const { return capacity_ > 0; }
  // Whether to count this command: about one in Settings::hot_keys_sample, at random gaps (a
  // xorshift draw per sampled command, so periodic traffic cannot alias with the sampling). Asked
  // of every command, keyed or not: each is sampled with the same chance. Never true while
  // disabled.
  bool Sample() {
    if (--skip_ > 0) return false;
    rng_ ^= rng_ << 13;
    rng_ ^= rng_ >> 7;
    rng_ ^= rng_ << 17;
    skip_ = sample_ <= 1 ? 1 : 1 + static_cast<int64_t>(rng_ % (2 * sample_ - 1));  // mean sample_
    return true;
  }
  // Publishes to `slot` (from HotKeysBoard::AddWorker) from now on.
  void Attach(HotKeysBoard* board, size_t slot) {
    board_ = board;
    slot_ = slot;
  }

  // One access of `key` by `tenant` ("" without tenancy) with `bytes` of request and reply.
  void Access(absl::string_view tenant, absl::string_view key, uint64_t bytes);
  // A value size seen: `elements` counts collection members, otherwise string bytes.
  bool Admits(bool elements, uint64_t size) const { return (elements ? big_elements_ : big_bytes_).Admits(size); }
  void ObserveSize(absl::string_view tenant, absl::string_view key, bool elements, uint64_t size,
                   std::string_view command, std::string_view type);
  // On the worker's timer: closes the interval when `now_ns` (steady clock) has reached its end,
  // then publishes the last complete interval, the current partial one and the largest keys.
  void Tick(int64_t now_ns);
  size_t tracked_by_count() const { return by_count_.size(); }

 private:
  size_t capacity_;
  uint64_t sample_;
  int64_t skip_;  // commands until the next sampled one (INT64_MAX while disabled)
  uint64_t rng_ = 0x9e3779b97f4a7c15ull;
  int64_t interval_ns_;
  int64_t interval_end_ns_ = -1;
  int64_t interval_start_ms_ = 0;
  SpaceSaving by_count_;
  SpaceSaving by_bytes_;
  LargestKeys big_bytes_;
  LargestKeys big_elements_;
  std::string item_;  // HotKeyItem's buffer
  HotKeysBoard* board_ = nullptr;
  size_t slot_ = 0;
  uint64_t published_big_ = UINT64_MAX;  // the largest keys' versions (summed) last published
};

// Where workers publish, and what the admin server renders. Thread-safe.
class HotKeysBoard {
 public:
  // Folds a key into its pattern (policy::KeyPattern; passed in so hygiene needs no policy).
  using PatternFn = std::string (*)(std::string_view);

  HotKeysBoard(const Settings& s, PatternFn pattern) : settings_(s), pattern_(pattern) {}
  // A slot for one more worker; call before workers start.
  size_t AddWorker();

  struct Published {
    bool has_last = false;
    SketchSnapshot last_count, last_bytes;  // the last complete interval
    SketchSnapshot cur_count, cur_bytes;    // the current one, as of the last tick
    int64_t interval_start_ms = 0;          // of the current interval
    bool has_big = false;                   // false: the largest keys did not change since the last Publish
    std::vector<LargestKeys::Entry> big_bytes, big_elements;
  };
  void Publish(size_t slot, Published p);

  // {"interval_s":..,"by_count":[{"key","tenant","key_pattern","count","error"}],"by_bytes":[..],..}:
  // every worker's last complete interval plus its current one, top `n` of each.
  std::string HotKeysJson(size_t n) const;
  // {"by_bytes":[{"key","tenant","key_pattern","type","bytes","command","last_seen_ms"}],
  //  "by_elements":[...elements...]}: the largest keys over every worker, top `n` of each.
  std::string BigKeysJson(size_t n) const;
  // keyguard_hot_key_pattern_accesses{key_pattern} for the 10 patterns with the most accesses in
  // the workers' last complete intervals.
  void AppendMetrics(metrics::TextWriter& w) const;

 private:
  uint64_t Scale() const { return settings_.hot_keys_sample > 0 ? settings_.hot_keys_sample : 1; }

  const Settings& settings_;
  PatternFn pattern_;
  mutable std::mutex mu_;
  std::deque<Published> slots_;
};

}  // namespace keyguard::hygiene
