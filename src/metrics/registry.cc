#include "keyguard/metrics/registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace keyguard::metrics {

WorkerShard::WorkerShard() : commands_(commands::CommandCount()) {}

void WorkerShard::ObserveLatency(commands::CommandId id, uint64_t nanos) {
  commands_[id].latency.Observe(kLatencyBuckets, static_cast<double>(nanos) * 1e-9, nanos);
}

const std::string& WorkerShard::PatternLabel(const std::string& pattern, size_t cap) {
  auto it = patterns_.find(pattern);
  if (it != patterns_.end()) return *it;
  if (patterns_.size() >= cap) return other_;
  return *patterns_.insert(pattern).first;
}

WorkerShard* Registry::AddShard() {
  std::lock_guard<std::mutex> lock(mu_);
  return &shards_.emplace_back();
}

namespace {

template <typename F>
uint64_t Sum(const std::deque<WorkerShard>& shards, F f) {
  uint64_t total = 0;
  for (const WorkerShard& s : shards) total += f(s);
  return total;
}

std::string FormatSeconds(double v) { return absl::StrFormat("%.9g", v); }

}  // namespace

std::string Registry::Render() const {
  std::lock_guard<std::mutex> lock(const_cast<std::mutex&>(mu_));
  std::string out;
  out.reserve(16 * 1024);
  TextWriter w(&out);
  w.Header(Of(FamilyId::kBuildInfo));
  w.Sample(Of(FamilyId::kBuildInfo), {KEYGUARD_VERSION_STRING}, 1);

  auto counter = [&](FamilyId id, auto field) {
    w.Header(Of(id));
    w.Sample(Of(id), {}, Sum(shards_, [&](const WorkerShard& s) { return (s.*field).Get(); }));
  };
  auto gauge = [&](FamilyId id, auto field) {
    w.Header(Of(id));
    int64_t total = 0;
    for (const WorkerShard& s : shards_) total += (s.*field).Get();
    w.Sample(Of(id), {}, total);
  };

  gauge(FamilyId::kClientConnections, &WorkerShard::client_connections);
  counter(FamilyId::kClientConnectionsTotal, &WorkerShard::client_connections_total);
  gauge(FamilyId::kUpstreamConnections, &WorkerShard::upstream_connections);
  counter(FamilyId::kClientReceivedBytes, &WorkerShard::client_bytes_received);
  counter(FamilyId::kClientSentBytes, &WorkerShard::client_bytes_sent);
  counter(FamilyId::kUpstreamReceivedBytes, &WorkerShard::upstream_bytes_received);
  counter(FamilyId::kUpstreamSentBytes, &WorkerShard::upstream_bytes_sent);
  counter(FamilyId::kClientProtocolErrors, &WorkerShard::client_protocol_errors);
  counter(FamilyId::kUnexpectedReplies, &WorkerShard::unexpected_replies);
  counter(FamilyId::kSharedLinkDesyncs, &WorkerShard::shared_link_desyncs);
  counter(FamilyId::kLegacyKeysMoved, &WorkerShard::legacy_keys_moved);
  counter(FamilyId::kLegacyMoveErrors, &WorkerShard::legacy_move_errors);
  counter(FamilyId::kProbedKeys, &WorkerShard::probed_keys);

  const Family& upstream_errors = Of(FamilyId::kUpstreamErrors);
  w.Header(upstream_errors);
  for (size_t r = 0; r < static_cast<size_t>(UpstreamError::kCount); ++r) {
    w.Sample(upstream_errors, {kUpstreamErrorNames[r]},
             Sum(shards_, [&](const WorkerShard& s) { return s.upstream_errors[r].Get(); }));
  }

  const Family& kinds = Of(FamilyId::kUpstreamConnectionsByKind);
  w.Header(kinds);
  for (size_t k = 0; k < static_cast<size_t>(UpstreamKind::kCount); ++k) {
    int64_t total = 0;
    for (const WorkerShard& s : shards_) total += s.upstream_kinds[k].Get();
    w.Sample(kinds, {kUpstreamKindNames[k]}, total);
  }
  const Family& pins = Of(FamilyId::kUpstreamPins);
  w.Header(pins);
  for (size_t r = 1; r < kPinReasons; ++r) {
    w.Sample(pins, {kPinReasonNames[r]}, Sum(shards_, [&](const WorkerShard& s) { return s.upstream_pins[r].Get(); }));
  }
  counter(FamilyId::kSharedWrites, &WorkerShard::shared_writes);
  gauge(FamilyId::kClusterRetiredLinks, &WorkerShard::cluster_retired_links);
  counter(FamilyId::kSharedCommands, &WorkerShard::shared_commands);
  const Family& redirects = Of(FamilyId::kClusterRedirects);
  w.Header(redirects);
  for (size_t k = 0; k < 2; ++k) {
    w.Sample(redirects, {k == 0 ? "moved" : "ask"},
             Sum(shards_, [&](const WorkerShard& s) { return s.cluster_redirects[k].Get(); }));
  }

  // Series summed over the shards and ordered by their label text.
  auto labeled = [&](auto WorkerShard::*field) {
    using Counters = std::remove_cvref_t<decltype(shards_.front().*field)>;
    const Family& f = Counters::kFamily;
    std::map<std::string, uint64_t> merged;
    std::string labels;
    for (const WorkerShard& s : shards_) {
      (s.*field).ForEach([&](const typename Counters::Values& values, uint64_t v) {
        labels.clear();
        AppendLabels(&labels, f.label_names(), values);
        merged[labels] += v;
      });
    }
    w.Header(f);
    for (const auto& [text, v] : merged) w.RenderedSample(f, text, v);
  };
  labeled(&WorkerShard::key_violations);
  labeled(&WorkerShard::keys_rewritten);
  labeled(&WorkerShard::commands_rejected);
  labeled(&WorkerShard::findings);
  labeled(&WorkerShard::bigkey_access);
  labeled(&WorkerShard::hygiene_actions);
  labeled(&WorkerShard::cluster_node_commands);
  labeled(&WorkerShard::cluster_node_errors);
  labeled(&WorkerShard::tenant_commands);
  labeled(&WorkerShard::tenant_received_bytes);
  labeled(&WorkerShard::tenant_sent_bytes);
  labeled(&WorkerShard::tenant_rejected);

  for (const auto& f : collectors_) f(w);

  w.Header(Of(FamilyId::kDraining));
  w.Sample(Of(FamilyId::kDraining), {}, draining_.Get());

  const size_t ncommands = commands::CommandCount();
  const Family& commands_total = Of(FamilyId::kCommands);
  w.Header(commands_total);
  for (size_t id = 0; id < ncommands; ++id) {
    for (size_t o = 0; o < static_cast<size_t>(Outcome::kCount); ++o) {
      const uint64_t n = Sum(shards_, [&](const WorkerShard& s) { return s.commands_[id].outcomes[o].Get(); });
      if (n == 0) continue;
      w.Sample(commands_total, {commands::CommandName(static_cast<commands::CommandId>(id)), kOutcomeNames[o]}, n);
    }
  }

  // One histogram series summed over the shards, `of(shard)` its Histogram there, written when it
  // has observations. `sum_scale` converts the stored sum (0: an integer sum, printed as it is).
  auto histogram_series = [&](const Family& f, LabelValues labels, const auto& bounds, auto of, double sum_scale) {
    const uint64_t count = Sum(shards_, [&](const WorkerShard& s) { return of(s).count.Get(); });
    if (count == 0) return;
    uint64_t cumulative = 0;
    for (size_t b = 0; b < bounds.size(); ++b) {
      cumulative += Sum(shards_, [&](const WorkerShard& s) { return of(s).buckets[b].Get(); });
      w.Bucket(f, labels, FormatSeconds(bounds[b]), cumulative);
    }
    cumulative += Sum(shards_, [&](const WorkerShard& s) { return of(s).buckets.back().Get(); });
    // Buckets and count are read one after the other while workers write; keep +Inf == count.
    const uint64_t total = cumulative > count ? cumulative : count;
    w.Bucket(f, labels, "+Inf", total);
    const uint64_t sum = Sum(shards_, [&](const WorkerShard& s) { return of(s).sum.Get(); });
    w.HistogramSum(f, labels, sum_scale == 0 ? absl::StrCat(sum) : FormatSeconds(static_cast<double>(sum) * sum_scale));
    w.HistogramCount(f, labels, total);
  };
  const Family& pin_duration = Of(FamilyId::kUpstreamPinDuration);
  w.Header(pin_duration);
  for (size_t r = 1; r < kPinReasons; ++r) {
    const std::string_view reason[] = {kPinReasonNames[r]};
    histogram_series(
        pin_duration, reason, kLatencyBuckets, [r](const WorkerShard& s) -> const auto& { return s.pin_duration[r]; },
        1e-9);
  }
  // Per-command histograms, only for commands seen.
  auto histogram = [&](FamilyId family, const auto& bounds, auto field, double sum_scale) {
    const Family& f = Of(family);
    w.Header(f);
    for (size_t id = 0; id < ncommands; ++id) {
      const std::string_view command[] = {commands::CommandName(static_cast<commands::CommandId>(id))};
      histogram_series(
          f, command, bounds, [ id, field ](const WorkerShard& s) -> const auto& { return s.commands_[id].*field; },
          sum_scale);
    }
  };
  histogram(FamilyId::kCommandDuration, kLatencyBuckets, &CommandStats::latency, 1e-9);
  histogram(FamilyId::kReplyBytes, kReplyBytesBuckets, &CommandStats::reply_bytes, 0);
  histogram(FamilyId::kReplyElements, kReplyElementsBuckets, &CommandStats::reply_elements, 0);
  return out;
}

}  // namespace keyguard::metrics
