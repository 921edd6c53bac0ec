// Cost of the hot-key sketch on the per-command path: one SpaceSaving::Add per sketch per
// command. Keys are prepared up front; the loop measures the sketch only.
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "keyguard/hygiene/hot_keys.h"

namespace {

using namespace keyguard;

// `distinct` keys drawn uniformly (range(1)), through a sketch of range(0) counters.
std::vector<std::string> Keys(int distinct) {
  std::vector<std::string> keys;
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> pick(0, distinct - 1);
  for (int i = 0; i < 65536; ++i) keys.push_back(absl::StrCat("user:", pick(rng), ":profile"));
  return keys;
}

void BM_SpaceSavingAdd(benchmark::State& state) {
  hygiene::SpaceSaving sketch(static_cast<size_t>(state.range(0)));
  const std::vector<std::string> keys = Keys(static_cast<int>(state.range(1)));
  size_t i = 0;
  for (auto _ : state) {
    sketch.Add(keys[i++ & 65535], 1);
  }
  state.SetItemsProcessed(state.iterations());
}
// Hits only (100 keys), and a long tail that evicts on most updates (1M keys).
BENCHMARK(BM_SpaceSavingAdd)->Args({256, 100})->Args({256, 1000000})->Args({4096, 1000000});

// What the session does per keyed command: both sketches (count and bytes) with the tenant item.
void BM_HotKeysAccess(benchmark::State& state) {
  hygiene::Settings settings;
  hygiene::HotKeys hot(settings);
  const std::vector<std::string> keys = Keys(static_cast<int>(state.range(0)));
  size_t i = 0;
  for (auto _ : state) {
    hot.Access("svc", keys[i++ & 65535], 64);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_HotKeysAccess)->Arg(100)->Arg(1000000);

}  // namespace

BENCHMARK_MAIN();
