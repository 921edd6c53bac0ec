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

void Header(std::string* out, absl::string_view name, absl::string_view type, absl::string_view help) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

template <typename F>
uint64_t Sum(const std::deque<WorkerShard>& shards, F f) {
  uint64_t total = 0;
  for (const WorkerShard& s : shards) total += f(s);
  return total;
}

absl::string_view Name(size_t id) {
  const std::string_view n = commands::CommandName(static_cast<commands::CommandId>(id));
  return absl::string_view(n.data(), n.size());
}

std::string FormatSeconds(double v) { return absl::StrFormat("%.9g", v); }

}  // namespace

std::string Registry::Render() const {
  std::lock_guard<std::mutex> lock(const_cast<std::mutex&>(mu_));
  std::string out;
  out.reserve(16 * 1024);
  Header(&out, "keyguard_build_info", "gauge", "Build information; the value is always 1.");
  absl::StrAppend(&out, "keyguard_build_info{version=\"", KEYGUARD_VERSION_STRING, "\"} 1\n");

  auto counter = [&](absl::string_view name, absl::string_view help, auto field) {
    Header(&out, name, "counter", help);
    absl::StrAppend(&out, name, " ", Sum(shards_, [&](const WorkerShard& s) { return (s.*field).Get(); }), "\n");
  };
  auto gauge = [&](absl::string_view name, absl::string_view help, auto field) {
    Header(&out, name, "gauge", help);
    int64_t total = 0;
    for (const WorkerShard& s : shards_) total += (s.*field).Get();
    absl::StrAppend(&out, name, " ", total, "\n");
  };

  gauge("keyguard_client_connections", "Client connections open now.", &WorkerShard::client_connections);
  counter("keyguard_client_connections_total", "Client connections accepted.", &WorkerShard::client_connections_total);
  gauge("keyguard_upstream_connections", "Upstream connections open now.", &WorkerShard::upstream_connections);
  counter("keyguard_client_received_bytes_total", "Bytes read from clients.", &WorkerShard::client_bytes_received);
  counter("keyguard_client_sent_bytes_total", "Bytes written to clients.", &WorkerShard::client_bytes_sent);
  counter("keyguard_upstream_received_bytes_total", "Bytes read from the upstream Redis.",
          &WorkerShard::upstream_bytes_received);
  counter("keyguard_upstream_sent_bytes_total", "Bytes written to the upstream Redis.",
          &WorkerShard::upstream_bytes_sent);
  counter("keyguard_client_protocol_errors_total", "Client connections closed for malformed RESP.",
          &WorkerShard::client_protocol_errors);
  counter("keyguard_unexpected_replies_total", "Upstream replies that matched no pending command.",
          &WorkerShard::unexpected_replies);
  counter("keyguard_probed_keys_total", "Keys the sizing probe asked the upstream about (TYPE, size, MEMORY USAGE).",
          &WorkerShard::probed_keys);

  Header(&out, "keyguard_upstream_errors_total", "counter",
         "Upstream failures by reason: connect, closed, reset, protocol, auth.");
  for (size_t r = 0; r < static_cast<size_t>(UpstreamError::kCount); ++r) {
    absl::StrAppend(&out, "keyguard_upstream_errors_total{reason=\"", kUpstreamErrorNames[r], "\"} ",
                    Sum(shards_, [&](const WorkerShard& s) { return s.upstream_errors[r].Get(); }), "\n");
  }

  auto labeled = [&](absl::string_view name, absl::string_view help, LabeledCounters WorkerShard::*field) {
    std::map<std::string, uint64_t> merged;
    for (const WorkerShard& s : shards_) {
      (s.*field).ForEach([&](const std::string& labels, uint64_t v) { merged[labels] += v; });
    }
    Header(&out, name, "counter", help);
    for (const auto& [labels, v] : merged) absl::StrAppend(&out, name, "{", labels, "} ", v, "\n");
  };
  labeled("keyguard_key_violations_total", "Keys that broke a key-name rule, by rule, action and key pattern.",
          &WorkerShard::key_violations);
  labeled("keyguard_keys_rewritten_total", "Keys keyguard rewrote before forwarding, by rule.",
          &WorkerShard::keys_rewritten);
  labeled("keyguard_commands_rejected_total", "Commands keyguard refused, by reason.", &WorkerShard::commands_rejected);
  labeled("keyguard_findings_total", "Hygiene findings by kind and key pattern.", &WorkerShard::findings);
  labeled("keyguard_bigkey_access_total", "Accesses to big keys by kind, command and key pattern.",
          &WorkerShard::bigkey_access);
  labeled("keyguard_hygiene_actions_total",
          "Hygiene findings by kind and the action taken: observe, warn, rewrite (the command was changed) or "
          "reject (it was refused).",
          &WorkerShard::hygiene_actions);
  labeled("keyguard_tenant_commands_total", "Commands from each tenant's clients (refused ones included).",
          &WorkerShard::tenant_commands);
  labeled("keyguard_tenant_received_bytes_total", "Request bytes received from each tenant's clients.",
          &WorkerShard::tenant_received_bytes);
  labeled("keyguard_tenant_sent_bytes_total", "Reply bytes sent to each tenant's clients.",
          &WorkerShard::tenant_sent_bytes);
  labeled("keyguard_tenant_rejected_total", "Commands refused for each tenant, by reason.",
          &WorkerShard::tenant_rejected);

  for (const auto& f : collectors_) f(&out);

  Header(&out, "keyguard_draining", "gauge", "1 while keyguard drains connections before exiting.");
  absl::StrAppend(&out, "keyguard_draining ", draining_.Get(), "\n");

  const size_t ncommands = commands::CommandCount();
  Header(&out, "keyguard_commands_total", "counter", "Commands by command name and outcome.");
  for (size_t id = 0; id < ncommands; ++id) {
    for (size_t o = 0; o < static_cast<size_t>(Outcome::kCount); ++o) {
      const uint64_t n = Sum(shards_, [&](const WorkerShard& s) { return s.commands_[id].outcomes[o].Get(); });
      if (n == 0) continue;
      absl::StrAppend(&out, "keyguard_commands_total{command=\"", Name(id), "\",outcome=\"", kOutcomeNames[o], "\"} ",
                      n, "\n");
    }
  }

  // Per-command histograms, only for commands seen. `sum_scale` converts the stored sum (0: an
  // integer sum, printed as it is).
  auto histogram = [&](absl::string_view name, absl::string_view help, const auto& bounds, auto field,
                       double sum_scale) {
    Header(&out, name, "histogram", help);
    for (size_t id = 0; id < ncommands; ++id) {
      const uint64_t count = Sum(shards_, [&](const WorkerShard& s) { return (s.commands_[id].*field).count.Get(); });
      if (count == 0) continue;
      const absl::string_view command = Name(id);
      uint64_t cumulative = 0;
      for (size_t b = 0; b < bounds.size(); ++b) {
        cumulative += Sum(shards_, [&](const WorkerShard& s) { return (s.commands_[id].*field).buckets[b].Get(); });
        absl::StrAppend(&out, name, "_bucket{command=\"", command, "\",le=\"", FormatSeconds(bounds[b]), "\"} ",
                        cumulative, "\n");
      }
      cumulative += Sum(shards_, [&](const WorkerShard& s) { return (s.commands_[id].*field).buckets.back().Get(); });
      // Buckets and count are read one after the other while workers write; keep +Inf == count.
      const uint64_t total = cumulative > count ? cumulative : count;
      absl::StrAppend(&out, name, "_bucket{command=\"", command, "\",le=\"+Inf\"} ", total, "\n");
      const uint64_t sum = Sum(shards_, [&](const WorkerShard& s) { return (s.commands_[id].*field).sum.Get(); });
      absl::StrAppend(&out, name, "_sum{command=\"", command, "\"} ",
                      sum_scale == 0 ? absl::StrCat(sum) : FormatSeconds(static_cast<double>(sum) * sum_scale), "\n");
      absl::StrAppend(&out, name, "_count{command=\"", command, "\"} ", total, "\n");
    }
  };
  histogram("keyguard_command_duration_seconds",
            "Upstream round trip per command, from forwarding the command to receiving its reply.", kLatencyBuckets,
            &CommandStats::latency, 1e-9);
  histogram("keyguard_reply_bytes", "Size of each command's reply as the upstream sent it, in bytes.",
            kReplyBytesBuckets, &CommandStats::reply_bytes, 0);
  histogram("keyguard_reply_elements",
            "Elements of each aggregate reply (array, set; pairs of a map), per command; scalar replies are not "
            "counted.",
            kReplyElementsBuckets, &CommandStats::reply_elements, 0);
  return out;
}

}  // namespace keyguard::metrics
