#include "keyguard/hygiene/hot_keys.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "keyguard/common/views.h"

namespace keyguard::hygiene {

// ---------------------------------------------------------------------------------------------
// SpaceSaving

SpaceSaving::SpaceSaving(size_t capacity, size_t filter_buckets) : capacity_(capacity) {
  slots_.reserve(capacity);
  heap_.reserve(capacity);
  size_t buckets = 2;
  while (buckets < 2 * capacity) buckets *= 2;
  index_.assign(buckets, 0);
  if (filter_buckets > 0 && capacity > 0) {
    size_t n = 2;
    filter_shift_ = 63;
    while (n < filter_buckets) {
      n *= 2;
      --filter_shift_;
    }
    filter_.assign(n, 0);
    held_.assign(n, 0);
  }
}

namespace {

// 64x64 -> 128-bit multiply, folded: the mixing step of wyhash.
uint64_t Mum(uint64_t a, uint64_t b) {
  const unsigned __int128 r = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(r) ^ static_cast<uint64_t>(r >> 64);
}

uint64_t Load8(const char* p) {
  uint64_t x;
  std::memcpy(&x, p, 8);
  return x;
}

// Random per process, so that which keys collide in the index cannot be chosen by clients.
const uint64_t kHashSeed = absl::Hash<const void*>{}(&kHashSeed) | 1;

// SpaceSaving::Hash, inline here for HotKeys::Access.
inline uint64_t HashItem(absl::string_view item) {
  // wyhash-style: 8 bytes at a time, the tail as the last 8 bytes (overlapping) or fewer.
  constexpr uint64_t k0 = 0xa0761d6478bd642full, k1 = 0xe7037ed1a0b428dbull;
  const char* p = item.data();
  size_t n = item.size();
  uint64_t h = kHashSeed ^ Mum(n ^ k0, k1);
  if (n >= 8) {
    while (n > 8) {
      h = Mum(h ^ Load8(p), k1);
      p += 8;
      n -= 8;
    }
    h = Mum(h ^ Load8(item.data() + item.size() - 8), k0);
  } else {
    uint64_t x = 0;
    for (size_t i = 0; i < n; ++i) x |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
    h = Mum(h ^ x, k0);
  }
  return Mum(h, k1 ^ kHashSeed);
}

}  // namespace

uint64_t SpaceSaving::Hash(absl::string_view item) { return HashItem(item); }

// Hole-based sifts: the moving counter is written once, where it ends. They compare exactly as a
// sift by swaps does, so ties are broken the same way.
void SpaceSaving::SiftUp(uint32_t pos) {
  const Counter c = heap_[pos];
  while (pos > 0) {
    const uint32_t parent = (pos - 1) / 2;
    if (heap_[parent].count <= c.count) break;
    Place(pos, heap_[parent]);
    pos = parent;
  }
  Place(pos, c);
}

void SpaceSaving::SiftDown(uint32_t pos) {
  const uint32_t n = static_cast<uint32_t>(heap_.size());
  const Counter c = heap_[pos];
  for (;;) {
    const uint32_t l = 2 * pos + 1;
    if (l >= n) break;
    uint32_t smallest = l;
    if (l + 1 < n && heap_[l + 1].count < heap_[l].count) smallest = l + 1;
    if (c.count <= heap_[smallest].count) break;
    Place(pos, heap_[smallest]);
    pos = smallest;
  }
  Place(pos, c);
}

int64_t SpaceSaving::Find(absl::string_view item, uint64_t hash) const {
  const size_t mask = index_.size() - 1;
  for (size_t i = hash & mask; index_[i] != 0; i = (i + 1) & mask) {
    const Slot& s = slots_[index_[i] - 1];
    if (s.hash == hash && s.item == item) return index_[i] - 1;
  }
  return -1;
}

void SpaceSaving::Index(uint32_t slot) {
  const size_t mask = index_.size() - 1;
  size_t i = slots_[slot].hash & mask;
  while (index_[i] != 0) i = (i + 1) & mask;
  index_[i] = slot + 1;
  if (!held_.empty()) ++held_[slots_[slot].hash >> filter_shift_];
}

void SpaceSaving::Unindex(uint32_t slot) {
  const size_t mask = index_.size() - 1;
  size_t hole = slots_[slot].hash & mask;
  while (index_[hole] != slot + 1) hole = (hole + 1) & mask;
  // Backward shift: pull later entries of the probe run into the hole when their home position
  // does not lie (cyclically) after it, so that every entry stays reachable from its home.
  for (size_t j = (hole + 1) & mask; index_[j] != 0; j = (j + 1) & mask) {
    const size_t home = slots_[index_[j] - 1].hash & mask;
    const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (stays) continue;
    index_[hole] = index_[j];
    hole = j;
  }
  index_[hole] = 0;
  if (!held_.empty()) --held_[slots_[slot].hash >> filter_shift_];
}

void SpaceSaving::AddSlow(absl::string_view item, uint64_t hash, uint64_t weight) {
  if (capacity_ == 0) return;
  total_ += weight;
  // Filtered: a bucket that holds no counter's item tells at once that the item is absent.
  const bool absent = !held_.empty() && held_[hash >> filter_shift_] == 0;
  if (const int64_t found = absent ? -1 : Find(item, hash); found >= 0) {
    const uint32_t pos = slots_[static_cast<size_t>(found)].heap;
    heap_[pos].count += weight;
    SiftDown(pos);
    return;
  }
  if (slots_.size() < capacity_) {
    const uint32_t idx = static_cast<uint32_t>(slots_.size());
    const uint32_t pos = static_cast<uint32_t>(heap_.size());
    slots_.push_back(Slot{std::string(item.data(), item.size()), 0, hash, pos});
    heap_.push_back(Counter{weight, idx});
    SiftUp(pos);
    Index(idx);
    return;
  }
  // Full: the new item takes over the smallest counter. Plain: that counter's count becomes its
  // error. Filtered: it enters only once its bucket's charge plus its weight exceed that count,
  // with the charge as its error; the item it replaces leaves its count in its own bucket.
  const uint64_t min = heap_[0].count;
  const uint32_t idx = heap_[0].slot;
  Slot& s = slots_[idx];
  uint64_t prior = min;  // what the new item may have had while it was absent
  if (!filter_.empty()) {
    uint64_t& charge = filter_[hash >> filter_shift_];
    if (charge + weight <= min) {
      charge += weight;
      return;
    }
    prior = charge;
    uint64_t& left = filter_[s.hash >> filter_shift_];
    left = std::max(left, min);
  }
  Unindex(idx);
  s.item.assign(item.data(), item.size());
  s.hash = hash;
  s.error = prior;
  heap_[0].count = prior + weight;
  Index(idx);
  SiftDown(0);
}

void SpaceSaving::Clear() {
  std::fill(index_.begin(), index_.end(), 0);
  std::fill(filter_.begin(), filter_.end(), 0);
  std::fill(held_.begin(), held_.end(), 0);
  heap_.clear();
  slots_.clear();
  total_ = 0;
}

std::vector<SpaceSaving::Entry> SpaceSaving::Entries() const {
  std::vector<Entry> out;
  out.reserve(slots_.size());
  for (const Slot& s : slots_) out.push_back(Entry{s.item, heap_[s.heap].count, s.error});
  std::sort(out.begin(), out.end(),
            [](const Entry& a, const Entry& b) { return a.count != b.count ? a.count > b.count : a.item < b.item; });
  return out;
}

std::vector<SpaceSaving::Entry> SpaceSaving::Counters() const {
  std::vector<Entry> out;
  out.reserve(slots_.size());
  for (const Slot& s : slots_) out.push_back(Entry{s.item, heap_[s.heap].count, s.error});
  return out;
}

// Unsorted: MergeTop and the metric read every entry, in any order.
SketchSnapshot Snapshot(const SpaceSaving& s) { return SketchSnapshot{s.Counters(), s.min_count(), s.total()}; }

std::vector<SpaceSaving::Entry> MergeTop(const std::vector<const SketchSnapshot*>& parts, size_t n) {
  absl::flat_hash_map<std::string, std::pair<uint64_t, uint64_t>> merged;
  uint64_t all_min = 0;  // what an item absent from every full part may have had
  for (const SketchSnapshot* p : parts) all_min += p->min_count;
  for (const SketchSnapshot* p : parts) {
    for (const SpaceSaving::Entry& e : p->entries) {
      // First sight: start from what it may have had in every full part, then swap in the actual
      // counter for each part that has it (unsigned wrap-around cancels out: the sums are >= 0).
      auto [it, inserted] = merged.try_emplace(e.item, all_min, all_min);
      it->second.first += e.count - p->min_count;
      it->second.second += e.error - p->min_count;
    }
  }
  std::vector<SpaceSaving::Entry> out;
  out.reserve(merged.size());
  for (auto& [item, ce] : merged) out.push_back(SpaceSaving::Entry{item, ce.first, ce.second});
  std::sort(out.begin(), out.end(), [](const SpaceSaving::Entry& a, const SpaceSaving::Entry& b) {
    return a.count != b.count ? a.count > b.count : a.item < b.item;
  });
  if (out.size() > n) out.resize(n);
  return out;
}

// ---------------------------------------------------------------------------------------------
// LargestKeys

void LargestKeys::Observe(absl::string_view item, uint64_t size, std::string_view command, std::string_view type,
                          int64_t now_ms) {
  if (!Admits(size)) return;
  auto it = index_.find(item);
  if (it != index_.end()) {
    Entry& e = entries_[it->second];
    if (size < e.size) return;
    e.size = size;
    e.command = command;
    e.type = type;
    e.seen_ms = now_ms;
  } else if (entries_.size() < capacity_) {
    index_.emplace(std::string(item.data(), item.size()), static_cast<uint32_t>(entries_.size()));
    entries_.push_back(Entry{std::string(item.data(), item.size()), size, command, type, now_ms});
  } else {
    // Replace the smallest; a linear scan, as entries enter only when they beat the smallest.
    size_t smallest = 0;
    for (size_t i = 1; i < entries_.size(); ++i) {
      if (entries_[i].size < entries_[smallest].size) smallest = i;
    }
    if (size <= entries_[smallest].size) return;
    index_.erase(entries_[smallest].item);
    entries_[smallest] = Entry{std::string(item.data(), item.size()), size, command, type, now_ms};
    index_.emplace(entries_[smallest].item, static_cast<uint32_t>(smallest));
  }
  ++version_;
  if (entries_.size() == capacity_) {
    admit_above_ = entries_[0].size;
    for (const Entry& e : entries_) admit_above_ = std::min(admit_above_, e.size);
  }
}

// ---------------------------------------------------------------------------------------------
// Items

absl::string_view HotKeyItem(absl::string_view tenant, absl::string_view key, std::string* buffer) {
  const size_t t = std::min<size_t>(tenant.size(), 255);
  const size_t n = 1 + t + key.size();
  if (buffer->size() < n) buffer->resize(std::max(n, 2 * buffer->size()));
  char* w = buffer->data();
  w[0] = static_cast<char>(t);
  if (t > 0) std::memcpy(w + 1, tenant.data(), t);
  CopyBytes(w + 1 + t, key.data(), key.size());
  return absl::string_view(w, n);
}

TenantKey SplitHotKeyItem(absl::string_view item) {
  if (item.empty()) return {};
  const size_t t = std::min<size_t>(static_cast<unsigned char>(item[0]), item.size() - 1);
  return TenantKey{item.substr(1, t), item.substr(1 + t)};
}

// ---------------------------------------------------------------------------------------------
// HotKeys

size_t HotKeys::FilterBuckets(size_t capacity) { return std::min<size_t>(32 * capacity, 65536); }

HotKeys::HotKeys(const Settings& s)
    : capacity_(s.enabled ? s.hot_keys_capacity : 0),
      sample_(s.hot_keys_sample > 0 ? s.hot_keys_sample : 1),
      skip_(capacity_ > 0 ? 1 : INT64_MAX),
      interval_ns_(s.hot_keys_interval_s * 1000000000),
      by_count_(capacity_, FilterBuckets(capacity_)),
      by_bytes_(capacity_, FilterBuckets(capacity_)),
      big_bytes_(capacity_ > 0 ? kLargestKept : 0),
      big_elements_(capacity_ > 0 ? kLargestKept : 0) {}

void HotKeys::Access(absl::string_view tenant, absl::string_view key, uint64_t bytes) {
  const absl::string_view item = HotKeyItem(tenant, key, &item_);
  const uint64_t hash = HashItem(item);
  by_count_.Add(item, hash, 1);
  by_bytes_.Add(item, hash, bytes);
}

void HotKeys::ObserveSize(absl::string_view tenant, absl::string_view key, bool elements, uint64_t size,
                          std::string_view command, std::string_view type) {
  LargestKeys& big = elements ? big_elements_ : big_bytes_;
  if (!big.Admits(size)) return;
  big.Observe(HotKeyItem(tenant, key, &item_), size, command, type, UnixMs());
}

void HotKeys::Tick(int64_t now_ns) {
  if (board_ == nullptr || capacity_ == 0) return;
  HotKeysBoard::Published p;
  if (interval_end_ns_ < 0) {
    interval_end_ns_ = now_ns + interval_ns_;
    interval_start_ms_ = UnixMs();
  } else if (now_ns >= interval_end_ns_) {
    p.has_last = true;
    p.last_count = Snapshot(by_count_);
    p.last_bytes = Snapshot(by_bytes_);
    by_count_.Clear();
    by_bytes_.Clear();
    interval_end_ns_ = now_ns + interval_ns_;
    interval_start_ms_ = UnixMs();
  }
  p.cur_count = Snapshot(by_count_);
  p.cur_bytes = Snapshot(by_bytes_);
  p.interval_start_ms = interval_start_ms_;
  // The largest keys are copied only when they changed (most ticks of a steady workload).
  if (const uint64_t big = big_bytes_.version() + big_elements_.version(); big != published_big_) {
    p.has_big = true;
    p.big_bytes = big_bytes_.entries();
    p.big_elements = big_elements_.entries();
    published_big_ = big;
  }
  board_->Publish(slot_, std::move(p));
}

// ---------------------------------------------------------------------------------------------
// HotKeysBoard

size_t HotKeysBoard::AddWorker() {
  std::lock_guard<std::mutex> lock(mu_);
  slots_.emplace_back();
  return slots_.size() - 1;
}

void HotKeysBoard::Publish(size_t slot, Published p) {
  std::lock_guard<std::mutex> lock(mu_);
  Published& s = slots_[slot];
  if (!p.has_last) {
    // No interval closed on this tick: keep the last complete one.
    p.has_last = s.has_last;
    p.last_count = std::move(s.last_count);
    p.last_bytes = std::move(s.last_bytes);
  }
  if (!p.has_big) {
    p.big_bytes = std::move(s.big_bytes);
    p.big_elements = std::move(s.big_elements);
  }
  s = std::move(p);
}

namespace {

std::string Quoted(absl::string_view s) { return JsonString(std::string_view(s.data(), s.size())); }
std::string Quoted(std::string_view s) { return JsonString(s); }

// "key":..,"tenant":..,"key_pattern":.. of an item.
std::string KeyFields(absl::string_view item, HotKeysBoard::PatternFn pattern) {
  const TenantKey tk = SplitHotKeyItem(item);
  return absl::StrCat("\"key\":", Quoted(tk.key), ",\"tenant\":", tk.tenant.empty() ? "null" : Quoted(tk.tenant),
                      ",\"key_pattern\":", Quoted(AsAbsl(pattern(AsStd(tk.key)))));
}

// Counts are scaled by the sampling interval `scale` (1: every command counted, exact bounds).
void AppendEntries(std::string* out, const std::vector<SpaceSaving::Entry>& entries, HotKeysBoard::PatternFn pattern,
                   uint64_t scale) {
  for (size_t i = 0; i < entries.size(); ++i) {
    const SpaceSaving::Entry& e = entries[i];
    absl::StrAppend(out, i ? "," : "", "{", KeyFields(e.item, pattern), ",\"count\":", e.count * scale,
                    ",\"error\":", e.error * scale, "}");
  }
}

}  // namespace

std::string HotKeysBoard::HotKeysJson(size_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const SketchSnapshot*> count_parts, bytes_parts;
  std::string tracked;
  int64_t oldest_start_ms = 0;
  for (const Published& p : slots_) {
    if (p.has_last) {
      count_parts.push_back(&p.last_count);
      bytes_parts.push_back(&p.last_bytes);
    }
    count_parts.push_back(&p.cur_count);
    bytes_parts.push_back(&p.cur_bytes);
    absl::StrAppend(&tracked, tracked.empty() ? "" : ",", "{\"by_count\":", p.cur_count.entries.size(),
                    ",\"by_bytes\":", p.cur_bytes.entries.size(), ",\"largest_by_bytes\":", p.big_bytes.size(),
                    ",\"largest_by_elements\":", p.big_elements.size(), "}");
    if (p.interval_start_ms != 0 && (oldest_start_ms == 0 || p.interval_start_ms < oldest_start_ms)) {
      oldest_start_ms = p.interval_start_ms;
    }
  }
  const uint64_t scale = Scale();
  std::string out =
      absl::StrCat("{\"interval_s\":", settings_.hot_keys_interval_s, ",\"capacity\":", settings_.hot_keys_capacity,
                   ",\"sample_rate\":", absl::StrFormat("%.6g", 1.0 / scale), ",\"counts_scaled_by\":", scale,
                   ",\"current_interval_start_ms\":", oldest_start_ms, ",\"workers\":[", tracked, "],\"by_count\":[");
  AppendEntries(&out, MergeTop(count_parts, n), pattern_, scale);
  absl::StrAppend(&out, "],\"by_bytes\":[");
  AppendEntries(&out, MergeTop(bytes_parts, n), pattern_, scale);
  absl::StrAppend(&out, "]}");
  return out;
}

std::string HotKeysBoard::BigKeysJson(size_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto top = [&](std::vector<LargestKeys::Entry> Published::*field) {
    // Per item, the largest size any worker saw.
    absl::flat_hash_map<std::string, const LargestKeys::Entry*> best;
    for (const Published& p : slots_) {
      for (const LargestKeys::Entry& e : p.*field) {
        auto [it, inserted] = best.try_emplace(e.item, &e);
        if (!inserted &&
            (e.size > it->second->size || (e.size == it->second->size && e.seen_ms > it->second->seen_ms))) {
          it->second = &e;
        }
      }
    }
    std::vector<const LargestKeys::Entry*> out;
    out.reserve(best.size());
    for (const auto& [item, e] : best) out.push_back(e);
    std::sort(out.begin(), out.end(), [](const LargestKeys::Entry* a, const LargestKeys::Entry* b) {
      return a->size != b->size ? a->size > b->size : a->item < b->item;
    });
    if (out.size() > n) out.resize(n);
    return out;
  };
  std::string out = absl::StrCat("{\"capacity\":", HotKeys::kLargestKept, ",\"by_bytes\":[");
  auto append = [&](const std::vector<const LargestKeys::Entry*>& entries, const char* unit) {
    for (size_t i = 0; i < entries.size(); ++i) {
      const LargestKeys::Entry& e = *entries[i];
      absl::StrAppend(&out, i ? "," : "", "{", KeyFields(e.item, pattern_), ",\"type\":", Quoted(e.type), ",\"", unit,
                      "\":", e.size, ",\"command\":", Quoted(e.command), ",\"last_seen_ms\":", e.seen_ms, "}");
    }
  };
  append(top(&Published::big_bytes), "bytes");
  absl::StrAppend(&out, "],\"by_elements\":[");
  append(top(&Published::big_elements), "elements");
  absl::StrAppend(&out, "]}");
  return out;
}

void HotKeysBoard::AppendMetrics(metrics::TextWriter& w) const {
  std::map<std::string, uint64_t> by_pattern;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Published& p : slots_) {
      if (!p.has_last) continue;
      for (const SpaceSaving::Entry& e : p.last_count.entries) {
        const absl::string_view key = SplitHotKeyItem(e.item).key;
        by_pattern[pattern_(std::string_view(key.data(), key.size()))] += e.count * Scale();
      }
    }
  }
  std::vector<std::pair<uint64_t, std::string>> ranked;
  for (auto& [pattern, n] : by_pattern) ranked.emplace_back(n, pattern);
  std::sort(ranked.begin(), ranked.end(),
            [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  if (ranked.size() > 10) ranked.resize(10);
  const metrics::Family& family = metrics::Of(metrics::FamilyId::kHotKeyPatternAccesses);
  w.Header(family);
  for (const auto& [n, pattern] : ranked) w.Sample(family, {pattern}, n);
}

}  // namespace keyguard::hygiene
