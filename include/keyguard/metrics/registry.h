// Metrics: per-worker shards written only by their worker thread (no atomics RMW, no locks on the
// data path), summed when /metrics is scraped, rendered as Prometheus text exposition 0.0.4.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/string_view.h"
#include "keyguard/commands/command_table.h"
#include "keyguard/metrics/families.h"
#include "keyguard/metrics/text_writer.h"
#include "keyguard/common/views.h"

namespace keyguard::metrics {

// A monotonically increasing count with one writer thread; any thread may read it.
class Counter {
 public:
  [[gnu::always_inline]] void Add(uint64_t n = 1) {
    v_.store(v_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  uint64_t Get() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> v_{0};
};

// A value that goes up and down, with one writer thread.
class Gauge {
 public:
  void Add(int64_t n) { v_.store(v_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed); }
  int64_t Get() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> v_{0};
};

// What became of a command.
enum class Outcome : uint8_t {
  kOk,        // upstream replied with a non-error reply
  kError,     // upstream replied with an error
  kRejected,  // refused by keyguard, never forwarded
  kFailed,    // forwarded, but the upstream went away before replying
  kNoReply,   // forwarded under CLIENT REPLY OFF/SKIP: no reply expected
  kCount,
};
inline constexpr const char* kOutcomeNames[] = {"ok", "error", "rejected", "failed", "noreply"};

// Upper bounds of the latency histogram buckets, in seconds.
inline constexpr std::array<double, 16> kLatencyBuckets = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                                           0.025,   0.05,   0.1,     0.25,   0.5,   1,      2.5,   10};

// Upper bounds of the reply size histograms: bytes of a reply frame, and elements of a top-level
// aggregate reply (pairs for a RESP3 map).
inline constexpr std::array<double, 10> kReplyBytesBuckets = {64,    256,    1024,    4096,    16384,
                                                              65536, 262144, 1048576, 4194304, 16777216};
inline constexpr std::array<double, 8> kReplyElementsBuckets = {1, 10, 100, 1000, 5000, 10000, 100000, 1000000};

// A Prometheus histogram with one writer: a counter per bound, the last for values over them all.
template <size_t N>
struct Histogram {
  std::array<Counter, N + 1> buckets;
  Counter count;
  Counter sum;  // in the unit observed (nanoseconds for latency)

  void Observe(const std::array<double, N>& bounds, double value, uint64_t sum_value) {
    size_t b = 0;
    while (b < N && value > bounds[b]) ++b;
    buckets[b].Add();
    count.Add();
    sum.Add(sum_value);
  }
};

struct CommandStats {
  std::array<Counter, static_cast<size_t>(Outcome::kCount)> outcomes;
  Histogram<kLatencyBuckets.size()> latency;               // seconds; sum in nanoseconds
  Histogram<kReplyBytesBuckets.size()> reply_bytes;        // every reply
  Histogram<kReplyElementsBuckets.size()> reply_elements;  // aggregate replies only
};

// kRefused: the upstream refused a command keyguard sends on its own for the client (the MULTI
// it answered for a cluster transaction, HELLO 3 on a RESP3 client's pinned connection).
enum class UpstreamError : uint8_t { kConnect, kClosed, kReset, kProtocol, kAuth, kTls, kRefused, kTimeout, kCount };

// The kinds of upstream connection (keyguard_upstream_connections_by_kind).
enum class UpstreamKind : uint8_t { kDedicated, kShared, kPinned, kIdle, kCount };
inline constexpr const char* kUpstreamKindNames[] = {"dedicated", "shared", "pinned", "idle"};
// Why a client was pinned (proxy::PinReason, in its order; keyguard_upstream_pins_total).
inline constexpr const char* kPinReasonNames[] = {"none",    "transaction", "blocking",    "pubsub",
                                                  "monitor", "client",      "select",      "hello",
                                                  "auth",    "reset",       "replication", "control"};
inline constexpr size_t kPinReasons = std::size(kPinReasonNames);
inline constexpr const char* kUpstreamErrorNames[] = {"connect", "closed", "reset",   "protocol",
                                                      "auth",    "tls",    "refused", "timeout"};
static_assert(std::size(kUpstreamErrorNames) == static_cast<size_t>(UpstreamError::kCount), "a name for each");

// The counters of one labeled family of the table, one per label-value set, created on first use.
// Callers pass label values as values (one per label name of the family) and keep the Counter&
// it returns: a handle, valid as long as the shard, to resolve once (per worker, per tenant
// binding, per cached rule/pattern) rather than per event. A lookup hashes the values, with no
// string built. Only the owning worker creates and looks up; lookups need no lock because only
// that thread inserts, and inserts take the mutex that Registry::Render holds while it reads.
template <FamilyId F>
class LabeledCounters {
 public:
  static constexpr const Family& kFamily = Of(F);
  static constexpr size_t kLabels = kFamily.label_count();
  static_assert(kFamily.type == Type::kCounter && kLabels > 0);
  using Values = std::array<std::string_view, kLabels>;

  Counter& Get(const Values& values) {
    auto it = counters_.find(values);
    if (it != counters_.end()) return *it->second;
    Key key;
    for (size_t i = 0; i < kLabels; ++i) key[i].assign(values[i].data(), values[i].size());
    std::lock_guard<std::mutex> lock(mu_);
    return *counters_.emplace(std::move(key), std::make_unique<Counter>()).first->second;
  }
  // Calls f(values, value) for every counter, under the lock.
  template <typename Fn>
  void ForEach(Fn f) const {
    std::lock_guard<std::mutex> lock(mu_);
    Values values;
    for (const auto& [key, counter] : counters_) {
      for (size_t i = 0; i < kLabels; ++i) values[i] = key[i];
      f(values, counter->Get());
    }
  }

 private:
  using Key = std::array<std::string, kLabels>;
  // Heterogeneous: a Values finds a Key without building one.
  struct Hash {
    using is_transparent = void;
    size_t operator()(const Values& v) const {
      std::array<absl::string_view, kLabels> a;
      for (size_t i = 0; i < kLabels; ++i) a[i] = AsAbsl(v[i]);
      return absl::Hash<decltype(a)>{}(a);
    }
    size_t operator()(const Key& k) const {
      Values v;
      for (size_t i = 0; i < kLabels; ++i) v[i] = k[i];
      return (*this)(v);
    }
  };
  struct Eq {
    using is_transparent = void;
    template <typename A, typename B>
    bool operator()(const A& a, const B& b) const {
      for (size_t i = 0; i < kLabels; ++i) {
        if (std::string_view(a[i]) != std::string_view(b[i])) return false;
      }
      return true;
    }
  };
  mutable std::mutex mu_;
  absl::flat_hash_map<Key, std::unique_ptr<Counter>, Hash, Eq> counters_;
};

// Counter handles of a labeled family cached by a key the caller already holds (addresses of
// label values that outlive the cache, enums), so a hot path resolves each label set once and
// afterwards hashes a few words instead of the label values. One owner thread. The caller clears
// it when what the key points at may go away.
template <typename Key>
class HandleCache {
 public:
  // The handle for `key`; `resolve()` returns the Counter& the first time.
  template <typename Resolve>
  Counter& Get(const Key& key, Resolve resolve) {
    auto [it, inserted] = handles_.try_emplace(key, nullptr);
    if (inserted) it->second = &resolve();
    return *it->second;
  }
  void Clear() { handles_.clear(); }

 private:
  absl::flat_hash_map<Key, Counter*> handles_;
};

// One worker's metrics. Only that worker writes; Registry::Render reads.
class WorkerShard {
 public:
  WorkerShard();

  void CountCommand(commands::CommandId id, Outcome outcome) {
    commands_[id].outcomes[static_cast<size_t>(outcome)].Add();
  }
  void ObserveLatency(commands::CommandId id, uint64_t nanos);
  // A command's reply: its frame size, and its element count when it is an aggregate (else -1).
  void ObserveReply(commands::CommandId id, uint64_t bytes, int64_t elements) {
    CommandStats& s = commands_[id];
    s.reply_bytes.Observe(kReplyBytesBuckets, static_cast<double>(bytes), bytes);
    if (elements >= 0) {
      s.reply_elements.Observe(kReplyElementsBuckets, static_cast<double>(elements), static_cast<uint64_t>(elements));
    }
  }
  void CountUpstreamError(UpstreamError e) { upstream_errors[static_cast<size_t>(e)].Add(); }
  Gauge& UpstreamOf(UpstreamKind k) { return upstream_kinds[static_cast<size_t>(k)]; }
  // `n` upstream connections of kind `k` opened (or closed, n < 0): the total and the kind's gauge.
  void CountUpstream(UpstreamKind k, int64_t n) {
    upstream_connections.Add(n);
    UpstreamOf(k).Add(n);
  }

  Counter client_connections_total;
  Gauge client_connections;
  Gauge upstream_connections;
  Counter client_bytes_received;
  Counter client_bytes_sent;
  Counter upstream_bytes_received;
  Counter upstream_bytes_sent;
  Counter client_protocol_errors;
  Counter unexpected_replies;
  Counter shared_link_desyncs;  // SharedLink::Desync
  Counter legacy_keys_moved;    // keys a rewrite rule's move took from the old name to the new
  Counter legacy_move_errors;   // moves the upstream refused
  Counter probed_keys;          // keys the sizing probe asked about
  std::array<Counter, static_cast<size_t>(UpstreamError::kCount)> upstream_errors;
  // Shared upstream connections.
  std::array<Gauge, static_cast<size_t>(UpstreamKind::kCount)> upstream_kinds;
  std::array<Counter, kPinReasons> upstream_pins;                           // by reason
  std::array<Histogram<kLatencyBuckets.size()>, kPinReasons> pin_duration;  // seconds; sum in nanoseconds
  Counter shared_writes;
  Counter shared_commands;
  std::array<Counter, 2> cluster_redirects;                        // moved, ask
  Gauge cluster_retired_links;                                     // links of departed nodes, not yet freed
  LabeledCounters<FamilyId::kKeyViolations> key_violations;        // rule, action, key_pattern
  LabeledCounters<FamilyId::kKeysRewritten> keys_rewritten;        // rule
  LabeledCounters<FamilyId::kCommandsRejected> commands_rejected;  // reason
  LabeledCounters<FamilyId::kFindings> findings;                   // kind, key_pattern
  LabeledCounters<FamilyId::kBigkeyAccess> bigkey_access;          // kind, command, key_pattern
  LabeledCounters<FamilyId::kHygieneActions> hygiene_actions;      // kind, action: what keyguard did about each finding
  // Per tenant (label values bounded by the configured tenants).
  LabeledCounters<FamilyId::kClusterNodeCommands> cluster_node_commands;  // node
  LabeledCounters<FamilyId::kClusterNodeErrors> cluster_node_errors;      // node
  LabeledCounters<FamilyId::kTenantCommands> tenant_commands;             // tenant
  LabeledCounters<FamilyId::kTenantReceivedBytes> tenant_received_bytes;  // tenant
  LabeledCounters<FamilyId::kTenantSentBytes> tenant_sent_bytes;          // tenant
  LabeledCounters<FamilyId::kTenantRejected> tenant_rejected;             // tenant, reason

  // The label value for a key pattern: itself while fewer than `cap` distinct patterns were seen
  // on this worker, then "{other}" for new ones. The reference lives as long as the shard (its
  // address may key a HandleCache).
  const std::string& PatternLabel(const std::string& pattern, size_t cap);

 private:
  std::set<std::string> patterns_;
  std::string other_ = "{other}";
  friend class Registry;
  std::vector<CommandStats> commands_;
};

// Owns the shards and process-wide values; renders the exposition.
class Registry {
 public:
  // Creates a shard; call before workers start. The pointer lives as long as the registry.
  WorkerShard* AddShard();
  Gauge& draining() { return draining_; }
  // Adds a function that appends more exposition text at each scrape (process-wide values), with
  // a TextWriter over the scrape's text and families from the table.
  void AddCollector(std::function<void(TextWriter&)> f) { collectors_.push_back(std::move(f)); }
  // Prometheus text exposition of every metric.
  std::string Render() const;

 private:
  std::mutex mu_;
  std::deque<WorkerShard> shards_;
  Gauge draining_;
  std::vector<std::function<void(TextWriter&)>> collectors_;
};

}  // namespace keyguard::metrics
