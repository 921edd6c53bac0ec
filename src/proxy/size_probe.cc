#include "proxy/size_probe.h"

#include <chrono>

#include "absl/strings/numbers.h"
#include "keyguard/resp/encoder.h"
#include "keyguard/resp/framer.h"
#include "proxy/worker.h"

namespace keyguard::proxy {
namespace {

constexpr size_t kBatch = 16;

}  // namespace

SizeProbe::SizeProbe(Worker& worker) : worker_(worker), socket_(worker.io), timer_(worker.io) {}

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
  error_code ignored;
  socket_.close(ignored);
  timer_.cancel();
}

awaitable<bool> SizeProbe::Connect() {
  error_code ec;
  socket_ = Socket(worker_.io);
  co_await socket_.async_connect(worker_.upstream, AwaitEc(ec));
  if (ec) co_return false;
  socket_.set_option(tcp::no_delay(true), ec);
  buf_ = ReadBuffer(16 * 1024);
  const std::shared_ptr<const std::string> auth = worker_.upstream_credentials->Current();
  if (!auth->empty()) {
    if (!co_await RoundTrip(*auth, 1) || replies_.front().front() != '+') co_return false;
  }
  co_return true;
}

awaitable<bool> SizeProbe::RoundTrip(const std::string& commands, size_t n) {
  replies_.clear();
  error_code ec;
  co_await asio::async_write(socket_, asio::buffer(commands), AwaitEc(ec));
  if (ec) co_return false;
  resp::ReplyFramer framer(worker_.config.limits);
  size_t hint = 0;
  while (replies_.size() < n) {
    const char* base = buf_.data();
    size_t pos = 0;
    while (replies_.size() < n) {
      const resp::Status st = framer.Next(base + pos, buf_.size() - pos);
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
    buf_.Consume(pos);
    if (replies_.size() == n) break;
    buf_.Prepare(hint);
    const size_t got = co_await socket_.async_read_some(buf_.free_space(), AwaitEc(ec));
    if (ec) co_return false;
    buf_.Commit(got);
  }
  co_return true;
}

awaitable<void> SizeProbe::Run() {
  auto self = shared_from_this();
  hygiene::ProbeQueue& queue = worker_.hygiene.probe_queue;
  bool connected = false;
  while (!stopped_) {
    if (queue.empty() || (batch_.clear(), queue.Take(hygiene::UnixMs(), kBatch, &batch_)) == 0) {
      // Nothing to ask (or the rate says wait): sleep until woken, at most 200 ms.
      sleeping_ = true;
      timer_.expires_after(std::chrono::milliseconds(queue.empty() ? 1000 : 200));
      error_code ignored;
      co_await timer_.async_wait(AwaitEc(ignored));
      sleeping_ = false;
      continue;
    }
    if (!connected) {
      connected = co_await Connect();
      if (!connected) {
        batch_.clear();  // the upstream is away: drop this batch, retry on the next one
        timer_.expires_after(std::chrono::seconds(1));
        error_code ignored;
        co_await timer_.async_wait(AwaitEc(ignored));
        continue;
      }
    }
    // Round one: the type and the memory of every key; round two: the size command per type.
    std::string out;
    for (const auto& r : batch_) {
      std::string_view type_cmd[] = {"TYPE", r.upstream_key};
      resp::AppendCommand(&out, type_cmd);
      std::string_view mem_cmd[] = {"MEMORY", "USAGE", r.upstream_key, "SAMPLES", "5"};
      resp::AppendCommand(&out, mem_cmd);
    }
    if (!co_await RoundTrip(out, batch_.size() * 2)) {
      connected = false;
      continue;
    }
    std::vector<std::string> types;
    std::vector<int64_t> memory;
    for (size_t i = 0; i < batch_.size(); ++i) {
      types.push_back(replies_[i * 2].substr(1));
      int64_t m = -1;
      if (replies_[i * 2 + 1][0] == ':') (void)absl::SimpleAtoi(absl::string_view(replies_[i * 2 + 1]).substr(1), &m);
      memory.push_back(m);
    }
    out.clear();
    size_t asked = 0;
    for (size_t i = 0; i < batch_.size(); ++i) {
      if (const char* cmd = hygiene::SizeCommand(types[i])) {
        std::string_view size_cmd[] = {cmd, batch_[i].upstream_key};
        resp::AppendCommand(&out, size_cmd);
        ++asked;
      }
    }
    if (asked > 0 && !co_await RoundTrip(out, asked)) {
      connected = false;
      continue;
    }
    size_t j = 0;
    for (size_t i = 0; i < batch_.size(); ++i) {
      if (hygiene::SizeCommand(types[i]) == nullptr) continue;  // "none": the key is gone
      int64_t size = -1;
      if (replies_[j][0] == ':') (void)absl::SimpleAtoi(absl::string_view(replies_[j]).substr(1), &size);
      ++j;
      Learn(batch_[i], types[i], size, memory[i]);
    }
    worker_.shard->probed_keys.Add(batch_.size());
  }
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
