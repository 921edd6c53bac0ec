#include "proxy/size_probe.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/strings/numbers.h"
#include "keyguard/resp/encoder.h"
#include "keyguard/resp/framer.h"
#include "proxy/cluster_map.h"
#include "proxy/worker.h"

namespace keyguard::proxy {
namespace {

constexpr size_t kBatch = 16;

}  // namespace

SizeProbe::SizeProbe(Worker& worker) : worker_(worker), timer_(worker.io) {}

void SizeProbe::Start() {
  auto self = shared_from_this();
  asio::co_spawn(
      worker_.io, [self]() { return self->Run(); }, asio::detached);
}

void SizeProbe::Wake() {
  if (sleeping_) timer_.cancel();
}

void SizeProbe::Stop() {
  stopped_ = true;
  for (auto& [key, c] : conns_) c->stream.Close();
  timer_.cancel();
}

awaitable<SizeProbe::Conn*> SizeProbe::ConnFor(const std::string& key, const UpstreamAddress* to) {
  if (auto it = conns_.find(key); it != conns_.end()) co_return it->second.get();
  auto c = std::make_unique<Conn>(worker_.io);
  if (!co_await ConnectUpstream(worker_, c->stream, nullptr, to) || stopped_) co_return nullptr;
  Conn* raw = c.get();
  conns_[key] = std::move(c);
  co_return raw;
}

awaitable<bool> SizeProbe::RoundTrip(Conn& c, const std::string& commands, size_t n) {
  replies_.clear();
  // A node that holds the connection and answers nothing (stopped, hung) must not stop the probe
  // for the others: the round trip ends within the connect timeout, and the connection with it.
  const StreamDeadline deadline(c.stream, std::chrono::milliseconds(worker_.config.upstream_connect_timeout_ms));
  error_code ec;
  for (size_t sent = 0; sent < commands.size();) {
    sent += co_await c.stream.WriteSome(asio::buffer(commands.data() + sent, commands.size() - sent), ec);
    if (ec) co_return false;
  }
  resp::ReplyFramer framer(worker_.config.limits);
  size_t hint = 0;
  while (replies_.size() < n) {
    const char* base = c.buf.data();
    size_t pos = 0;
    while (replies_.size() < n) {
      const resp::Status st = framer.Next(base + pos, c.buf.size() - pos);
      if (st == resp::Status::kProtocolError) co_return false;
      if (st == resp::Status::kNeedMore) {
        hint = framer.hint();
        break;
      }
      const auto head = framer.head();
      std::string r(1, framer.type());
      if (!head.empty()) r.append(head[0].text);
      replies_.push_back(std::move(r));
      pos += framer.consumed();
    }
    c.buf.Consume(pos);
    if (replies_.size() == n) break;
    c.buf.Prepare(hint);
    const size_t got = co_await c.stream.ReadSome(c.buf.free_space(), ec);
    if (ec) co_return false;
    c.buf.Commit(got);
  }
  co_return true;
}

awaitable<bool> SizeProbe::Ask(Conn& c, const std::vector<size_t>& which) {
  // Round one: the type and the memory of every key; round two: the size command per type.
  std::string out;
  for (size_t i : which) {
    std::string_view type_cmd[] = {"TYPE", batch_[i].upstream_key};
    resp::AppendCommand(&out, type_cmd);
    std::string_view mem_cmd[] = {"MEMORY", "USAGE", batch_[i].upstream_key, "SAMPLES", "5"};
    resp::AppendCommand(&out, mem_cmd);
  }
  if (!co_await RoundTrip(c, out, which.size() * 2)) co_return false;
  // (A node that no longer owns the key answers MOVED: no type, nothing learned.)
  std::vector<std::string> types;
  std::vector<int64_t> memory;
  for (size_t j = 0; j < which.size(); ++j) {
    types.push_back(replies_[j * 2].substr(1));
    int64_t m = -1;
    if (replies_[j * 2 + 1][0] == ':') (void)absl::SimpleAtoi(absl::string_view(replies_[j * 2 + 1]).substr(1), &m);
    memory.push_back(m);
  }
  out.clear();
  size_t asked = 0;
  for (size_t j = 0; j < which.size(); ++j) {
    if (const char* cmd = hygiene::SizeCommand(types[j])) {
      std::string_view size_cmd[] = {cmd, batch_[which[j]].upstream_key};
      resp::AppendCommand(&out, size_cmd);
      ++asked;
    }
  }
  if (asked > 0 && !co_await RoundTrip(c, out, asked)) co_return false;
  size_t k = 0;
  for (size_t j = 0; j < which.size(); ++j) {
    if (hygiene::SizeCommand(types[j]) == nullptr) continue;  // "none": the key is gone
    int64_t size = -1;
    if (replies_[k][0] == ':') (void)absl::SimpleAtoi(absl::string_view(replies_[k]).substr(1), &size);
    ++k;
    Learn(batch_[which[j]], types[j], size, memory[j]);
  }
  co_return true;
}

awaitable<void> SizeProbe::Run() {
  auto self = shared_from_this();
  hygiene::ProbeQueue& queue = worker_.hygiene.probe_queue;
  bool failed = false;
  while (!stopped_) {
    if (worker_.cluster != nullptr) DropDepartedNodes();
    if (failed || queue.empty() || (batch_.clear(), queue.Take(hygiene::UnixMs(), kBatch, &batch_)) == 0) {
      // Nothing to ask (or the rate says wait, or the upstream was away): sleep until woken, at
      // most 200 ms (a second after a failure).
      sleeping_ = !failed;
      timer_.expires_after(std::chrono::milliseconds(failed ? 1000 : queue.empty() ? 1000 : 200));
      failed = false;
      error_code ignored;
      co_await timer_.async_wait(AwaitEc(ignored));
      sleeping_ = false;
      continue;
    }
    // The keys of the batch by where they are asked: the upstream, or each key's cluster node.
    std::vector<std::pair<std::string, std::vector<size_t>>> groups;
    std::vector<std::optional<UpstreamAddress>> targets;
    for (size_t i = 0; i < batch_.size(); ++i) {
      std::string key;
      std::optional<UpstreamAddress> to;
      if (worker_.cluster != nullptr) {
        to = ClusterNodeAddress(worker_, cluster::KeySlot(batch_[i].upstream_key));
        if (!to.has_value()) continue;  // no map yet, or the slot has no owner: not asked
        key = config::HostPort{to->host, to->endpoint->port()}.ToString();
      }
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == key; });
      if (g == groups.end()) {
        groups.emplace_back(key, std::vector<size_t>{});
        targets.push_back(to);
        g = groups.end() - 1;
      }
      g->second.push_back(i);
    }
    for (size_t n = 0; n < groups.size() && !stopped_; ++n) {
      const UpstreamAddress* to = targets[n].has_value() ? &*targets[n] : nullptr;
      Conn* c = co_await ConnFor(groups[n].first, to);
      if (c == nullptr || !co_await Ask(*c, groups[n].second)) {
        // The upstream (or node) is away: this batch's keys there are dropped; asked again when a
        // command touches them.
        conns_.erase(groups[n].first);
        failed = true;
        continue;
      }
      worker_.shard->probed_keys.Add(groups[n].second.size());
    }
  }
}

void SizeProbe::DropDepartedNodes() {
  const std::shared_ptr<cluster::SlotMap>& map = worker_.cluster->map;
  if (map == nullptr) return;
  std::erase_if(conns_, [&](const auto& entry) {
    const bool primary = std::any_of(map->primaries.begin(), map->primaries.end(), [&](const cluster::Node& n) {
      return config::HostPort{n.host, n.port}.ToString() == entry.first;
    });
    if (!primary) entry.second->stream.Close();
    return !primary;
  });
}

void SizeProbe::Learn(hygiene::ProbeRequest& r, std::string_view type, int64_t size, int64_t memory) {
  hygiene::KeySize s;
  s.type.assign(type.data(), type.size());
  (type == "string" ? s.bytes : s.elements) = size;
  s.memory = memory;
  s.at_ms = hygiene::UnixMs();
  const bool big = worker_.hygiene.sizes.IsBig(s);
  worker_.hygiene.sizes.Put(r.hash, s);
  if (!big) return;
  hygiene::Finding f = std::move(r.finding);
  f.bytes = s.bytes >= 0 ? s.bytes : memory;
  f.elements = s.elements;
  f.suggestion = type == "string"
                     ? "big string: read or update the part you need (GETRANGE/SETRANGE), or split it into a Hash"
                     : "big collection: keep collections under a few thousand members (split by a bucket in the key), "
                       "read with SCAN-family commands, delete with UNLINK";
  ReportFinding(worker_, std::move(f));
}

}  // namespace keyguard::proxy
