#include "keyguard/hygiene/sizes.h"

#include <algorithm>

namespace keyguard::hygiene {

namespace {

// Redis's stringmatchlen, case-sensitive, step for step (its quirks are the server's, so a filter
// keyguard applies agrees with what the server matched): a class's `x-y` takes the next two bytes
// whatever they are (`[3-]` is 3 to ']'), an unterminated class ends the pattern, a trailing '\'
// is itself, "*" does not match "", bytes compare as signed chars in ranges, and past 1,000
// nested '*' nothing matches. `skip_longer`: the rest after a '*' matched nowhere, so no earlier
// '*' can help.
bool Match(std::string_view p, std::string_view s, bool* skip_longer, int nesting) {
  if (nesting > 1000) return false;
  size_t pi = 0, si = 0;
  while (pi < p.size() && si < s.size()) {
    switch (p[pi]) {
      case '*':
        while (pi + 1 < p.size() && p[pi + 1] == '*') ++pi;
        if (pi + 1 == p.size()) return true;
        for (; si < s.size(); ++si) {
          if (Match(p.substr(pi + 1), s.substr(si), skip_longer, nesting + 1)) return true;
          if (*skip_longer) return false;
        }
        *skip_longer = true;
        return false;
      case '?': ++si; break;
      case '[': {
        ++pi;
        const bool negate = pi < p.size() && p[pi] == '^';
        if (negate) ++pi;
        bool match = false;
        for (;; ++pi) {
          const size_t left = p.size() - pi;
          if (left >= 2 && p[pi] == '\\') {
            ++pi;
            match |= p[pi] == s[si];
          } else if (left >= 1 && p[pi] == ']') {
            break;
          } else if (left == 0) {
            --pi;  // the class ran to the end of the pattern
            break;
          } else if (left >= 3 && p[pi + 1] == '-') {
            int lo = static_cast<signed char>(p[pi]), hi = static_cast<signed char>(p[pi + 2]);
            if (lo > hi) std::swap(lo, hi);
            const int c = static_cast<signed char>(s[si]);
            match |= c >= lo && c <= hi;
            pi += 2;
          } else {
            match |= p[pi] == s[si];
          }
        }
        if (match == negate) return false;
        ++si;
        break;
      }
      case '\\':
        if (p.size() - pi >= 2) ++pi;
        [[fallthrough]];
      default:
        if (p[pi] != s[si]) return false;
        ++si;
        break;
    }
    ++pi;
    if (si == s.size()) {
      while (pi < p.size() && p[pi] == '*') ++pi;
      break;
    }
  }
  return pi == p.size() && si == s.size();
}

}  // namespace

bool GlobMatch(std::string_view p, std::string_view s) {
  bool skip_longer = false;
  return Match(p, s, &skip_longer, 0);
}

const char* SizeCommand(std::string_view type) {
  if (type == "string") return "STRLEN";
  if (type == "hash") return "HLEN";
  if (type == "list") return "LLEN";
  if (type == "set") return "SCARD";
  if (type == "zset") return "ZCARD";
  if (type == "stream") return "XLEN";
  return nullptr;
}

void SizeCache::Put(uint64_t key, KeySize size) {
  if (entries_.size() >= std::max<size_t>(1, settings_.size_cache_keys / shards_) && !entries_.contains(key)) {
    entries_.erase(entries_.begin());
  }
  entries_[key] = std::move(size);
}

const KeySize* SizeCache::Get(uint64_t key, int64_t now_ms) const {
  auto it = entries_.find(key);
  if (it == entries_.end() || now_ms - it->second.at_ms > settings_.size_cache_ttl_ms) return nullptr;
  return &it->second;
}

bool SizeCache::IsBig(const KeySize& s) const {
  return (s.bytes >= 0 && static_cast<size_t>(s.bytes) >= settings_.big_string_bytes) ||
         (s.elements >= 0 && s.elements >= settings_.big_collection_elements);
}

bool ProbeQueue::Push(ProbeRequest r) {
  if (queue_.size() >= kCapacity || !waiting_.insert(r.hash).second) {
    ++dropped_;
    return false;
  }
  queue_.push_back(std::move(r));
  return true;
}

size_t ProbeQueue::Take(int64_t now_ms, size_t max, std::deque<ProbeRequest>* out) {
  const double rate = settings_.probe_keys_per_second;
  if (last_ms_ == 0) last_ms_ = now_ms - 1000;  // a full bucket to start with
  tokens_ = std::min(rate, tokens_ + rate * static_cast<double>(now_ms - last_ms_) / 1000.0);
  last_ms_ = now_ms;
  size_t n = 0;
  while (n < max && !queue_.empty() && tokens_ >= 1.0) {
    waiting_.erase(queue_.front().hash);
    out->push_back(std::move(queue_.front()));
    queue_.pop_front();
    tokens_ -= 1.0;
    ++n;
  }
  return n;
}

int64_t ExpiryClusters::Add(uint64_t pattern, int64_t second, int64_t now_ms) {
  // The high bits: a sharded owner (SharedDetectors) picks the shard by the low ones.
  Entry& e = entries_[(pattern >> 8) % entries_.size()];
  if (e.pattern != pattern || e.total == 0 || now_ms - e.window_start_ms > settings_.expiry_cluster_window_ms) {
    e = Entry{};
    e.pattern = pattern;
    e.window_start_ms = now_ms;
  }
  ++e.total;
  // The second's counter, or a free one, or the least busy one starts over for it: a second
  // holding half the writes always keeps its counter.
  int at = -1, least = 0;
  for (int i = 0; i < kSeconds; ++i) {
    if (e.counts[i] > 0 && e.seconds[i] == second) {
      at = i;
      break;
    }
    if (e.counts[i] < e.counts[least]) least = i;
  }
  if (at < 0) {
    at = least;
    e.seconds[at] = second;
    e.counts[at] = 0;
  }
  const int64_t n = ++e.counts[at];
  if (e.reported || n < settings_.expiry_cluster_keys || 2 * n < e.total) return 0;
  e.reported = true;
  return n;
}

uint64_t PatternFingerprint(std::string_view key, uint64_t scope) {
  uint64_t h = scope;
  bool digits = false;
  for (unsigned char c : key) {
    const bool digit = c >= '0' && c <= '9';
    if (digit && digits) continue;
    h = Fnv1a(std::string_view(digit ? "#" : reinterpret_cast<const char*>(&c), 1), h);
    digits = digit;
  }
  return h;
}

}  // namespace keyguard::hygiene
