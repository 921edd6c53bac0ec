// Framing throughput on redis-benchmark-shaped traffic (pipelined SET/GET with 3-byte values and
// key:NNNNNNNNNNNN keys), for requests and for replies. Target: >= 1 GB/s per core. Also replies
// that take the framer's aggregate path: a flat LRANGE-shaped array, an array of pairs
// (ZRANGE WITHSCORES in RESP3: one nested aggregate per element), and nesting 100 and 10000 levels
// deep.
#include <benchmark/benchmark.h>

#include <random>
#include <string>

#include "keyguard/resp/framer.h"

namespace {

std::string Bulk(const std::string& s) { return "$" + std::to_string(s.size()) + "\r\n" + s + "\r\n"; }

std::string RequestTraffic(size_t value_size) {
  std::mt19937 rng(1);
  std::string out;
  const std::string value(value_size, 'x');
  while (out.size() < (1 << 20)) {
    char key[32];
    snprintf(key, sizeof key, "key:%012u", static_cast<unsigned>(rng() % 100000));
    out += "*3\r\n" + Bulk("SET") + Bulk(key) + Bulk(value);
    out += "*2\r\n" + Bulk("GET") + Bulk(key);
  }
  return out;
}

std::string ReplyTraffic(size_t value_size) {
  std::string out;
  const std::string value(value_size, 'x');
  while (out.size() < (1 << 20)) out += "+OK\r\n" + Bulk(value);
  return out;
}

// Aggregate replies, repeated up to 1 MiB.
std::string Repeated(const std::string& reply) {
  std::string out;
  while (out.size() < (1 << 20)) out += reply;
  return out;
}

std::string FlatArray() {
  std::string out = "*1000\r\n";
  for (int i = 0; i < 1000; ++i) out += Bulk("abc");
  return Repeated(out);
}

std::string ArrayOfPairs() {
  std::string out = "*1000\r\n";
  for (int i = 0; i < 1000; ++i) out += "*2\r\n" + Bulk("member") + ",1.5\r\n";
  return Repeated(out);
}

std::string Nested(int depth) {
  std::string out;
  for (int i = 0; i < depth; ++i) out += "*1\r\n";
  return Repeated(out + ":1\r\n");
}

template <typename Framer>
void Frame(benchmark::State& state, const std::string& input) {
  Framer framer;
  size_t frames = 0;
  for (auto _ : state) {
    size_t pos = 0;
    while (framer.Next(input.data() + pos, input.size() - pos) == keyguard::resp::Status::kOk) {
      pos += framer.consumed();
      ++frames;
    }
    framer.Reset();
    benchmark::DoNotOptimize(pos);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(input.size()));
  state.counters["frames/s"] = benchmark::Counter(static_cast<double>(frames), benchmark::Counter::kIsRate);
}

void BM_RequestFramerSetGet(benchmark::State& state) {
  static const std::string input = RequestTraffic(static_cast<size_t>(state.range(0)));
  Frame<keyguard::resp::RequestFramer>(state, input);
}
BENCHMARK(BM_RequestFramerSetGet)->Arg(3);

void BM_RequestFramerSetGet1K(benchmark::State& state) {
  static const std::string input = RequestTraffic(1024);
  Frame<keyguard::resp::RequestFramer>(state, input);
}
BENCHMARK(BM_RequestFramerSetGet1K);

void BM_ReplyFramerOkBulk(benchmark::State& state) {
  static const std::string input = ReplyTraffic(3);
  Frame<keyguard::resp::ReplyFramer>(state, input);
}
BENCHMARK(BM_ReplyFramerOkBulk);

// The input is made before timing starts (each run makes it anew: it is cheap).
void BM_ReplyFramerShape(benchmark::State& state, std::string (*make)()) {
  Frame<keyguard::resp::ReplyFramer>(state, make());
}
BENCHMARK_CAPTURE(BM_ReplyFramerShape, flat_array, FlatArray);
BENCHMARK_CAPTURE(BM_ReplyFramerShape, array_of_pairs, ArrayOfPairs);
BENCHMARK_CAPTURE(BM_ReplyFramerShape, nested_100, [] { return Nested(100); });
BENCHMARK_CAPTURE(BM_ReplyFramerShape, nested_10000, [] { return Nested(10000); });

}  // namespace

BENCHMARK_MAIN();
