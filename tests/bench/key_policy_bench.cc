// Cost of the key policy on the per-command path. Target: a conforming key checked in < 100 ns.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "keyguard/commands/command_table.h"
#include "keyguard/policy/key_pattern.h"
#include "keyguard/policy/key_policy.h"

namespace {

using namespace keyguard;

void BM_CheckConformingKey(benchmark::State& state) {
  auto policy = policy::KeyPolicy::Default();
  const commands::CommandId id = commands::LookupCommand("set");
  const commands::CommandSpec& spec = commands::Spec(id);
  std::vector<policy::Violation> out;
  for (auto _ : state) {
    out.clear();
    policy->Check("user:1001:profile", id, spec, &out);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_CheckConformingKey);

void BM_CheckViolatingKey(benchmark::State& state) {
  auto policy = policy::KeyPolicy::Default();
  const commands::CommandId id = commands::LookupCommand("set");
  const commands::CommandSpec& spec = commands::Spec(id);
  std::vector<policy::Violation> out;
  for (auto _ : state) {
    out.clear();
    policy->Check("User_1001_Profile", id, spec, &out);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_CheckViolatingKey);

void BM_FindKeysAndCheckSet(benchmark::State& state) {
  auto policy = policy::KeyPolicy::Default();
  const std::vector<std::string_view> args = {"SET", "user:1001:profile", "value"};
  std::vector<commands::KeyRef> keys;
  std::vector<policy::Violation> out;
  for (auto _ : state) {
    const commands::CommandId id = commands::LookupCommand(args[0]);
    const commands::CommandSpec* spec = commands::ResolveSpec(id, args);
    keys.clear();
    commands::FindKeys(*spec, args, &keys);
    out.clear();
    for (const auto& k : keys) policy->Check(args[k.pos], id, *spec, &out);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_FindKeysAndCheckSet);

void BM_KeyPattern(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(policy::KeyPattern("user:1001:profile"));
}
BENCHMARK(BM_KeyPattern);

}  // namespace

BENCHMARK_MAIN();
