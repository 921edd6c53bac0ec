#!/usr/bin/env bash
# Installs what is missing, checks the C++ formatting, builds, and runs the whole test suite:
#   unit tests (framer fragment replay, hiredis differential, config, metrics),
#   integration tests through keyguard against real redis-server (hiredis, redis-py, redis-cli,
#   raw RESP), promtool on real /metrics, the packaging e2e tests (a real Prometheus scraping
#   keyguard under the demo workload answers every dashboard query and alert expression; promtool
#   rule tests; the Helm chart rendered and checked; Dockerfile and compose checked statically;
#   yamllint), the same suites against an ASan+UBSan build, and a short libFuzzer run of the framers
#   and of the config load path.
# Env: FUZZ_SECONDS (default 15; longer budgets on demand), SKIP_ASAN=1 to skip the sanitizer pass.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
step() { echo; echo "=== $* ($(( $(date +%s) - start ))s)"; }
# An integration pass on both cores (pytest-xdist: each worker has its own redis-server and its own
# block of ports, conftest.free_port), then the tests marked `alone` one at a time: they measure a
# rate or a bound that the other worker's load would change. Exit status 5 is "none selected".
integration() {
  /usr/bin/python3 -m pytest -q -n 2 -m "not alone" --durations=10 "$@"
  /usr/bin/python3 -m pytest -q -m alone "$@" || [ $? = 5 ]
}

step "install"
bash scripts/install-deps.sh all
# Tests start their own redis-server on free ports; nothing else is needed running.

step "format (.clang-format)"
bash scripts/check_format.sh

step "build (release)"
# The unit tests run in the ASan+UBSan build (built once, not twice: a third of each build's time);
# release builds them only when that pass is skipped. The sanitizer build runs after it, in the background at idle priority (SCHED_IDLE: it gets only
# the CPU time the release passes leave idle, about half of it, as those passes mostly wait on
# sockets and timers), and the fuzz build likewise during the sanitizer pass. Same session, so the
# same scheduling group (with autogroup, another session would get an equal share whatever its
# priority). A build's output is shown if it fails; a failing pass stops the build in progress.
bg=""
stop_bg() { [ -z "$bg" ] || kill -- -"$bg" 2>/dev/null || true; }
trap stop_bg EXIT
background() {  # background NAME COMMAND...: $bg is its process group
  set -m
  ( chrt --idle 0 bash -c 'SECONDS=0; "$@" || exit; echo "$0: done in ${SECONDS}s"' "$@" >"$PWD/build-$1.log" 2>&1 ) &
  bg=$!
  set +m
}
wait_background() {  # wait_background NAME
  if ! wait "$bg"; then bg=""; tail -60 "build-$1.log"; echo "the $1 build failed"; exit 1; fi
  bg=""
  tail -1 "build-$1.log"
}
if [ "${SKIP_ASAN:-0}" != 1 ]; then
  bash scripts/build.sh release keyguard hiredis_client_test command_keys_check framer_bench key_policy_bench hot_keys_bench
  background asan bash scripts/build.sh asan
  step "hiredis client tests"
  (cd build && ctest --output-on-failure -R hiredis_client_test)
else
  bash scripts/build.sh release
  background fuzz bash scripts/build.sh fuzz
  step "unit + hiredis client tests"
  (cd build && ctest --output-on-failure)
fi

step "integration tests (release)"
KEYGUARD_BIN=$PWD/build/keyguard integration tests/integration

step "integration tests with shared upstream connections (release)"
# Every test of the proxy's data path again, each keyguard with upstream_connections: shared; the
# tests whose results must differ are marked dedicated_only, with the reason.
KEYGUARD_UPSTREAM_CONNECTIONS=shared KEYGUARD_BIN=$PWD/build/keyguard integration tests/integration \
  --ignore=tests/integration/test_audit.py --ignore=tests/integration/test_migrate.py \
  --ignore=tests/integration/test_maintenance_upstreams.py \
  --ignore=tests/integration/test_admin_cli.py --ignore=tests/integration/test_detector_memory.py \
  --ignore=tests/integration/test_shared_upstream.py --ignore=tests/integration/test_shared_review.py \
  --ignore=tests/integration/test_cluster.py --ignore=tests/integration/test_every_mode.py

step "integration tests with a Redis Cluster upstream (release)"
# The proxy core, key policy, tenancy and hygiene suites again, each redis-server a one-node
# cluster owning every slot and each keyguard in front of it with redis-cluster:// (direct checks
# still see every key); the tests whose results must differ are marked not_cluster, with the
# reason. test_cluster.py (in the first pass) has the real three-primary clusters. (The whole
# suite passes this way too: KEYGUARD_UPSTREAM=cluster pytest tests/integration, 2 minutes; this
# subset keeps CI within its budget.)
KEYGUARD_UPSTREAM=cluster KEYGUARD_BIN=$PWD/build/keyguard integration \
  tests/integration/test_proxy.py tests/integration/test_key_policy.py tests/integration/test_tenants.py \
  tests/integration/test_tenant_escapes.py tests/integration/test_tenant_walks.py tests/integration/test_hygiene.py \
  tests/integration/test_hygiene_rules.py tests/integration/test_tenant_fuzz.py tests/integration/test_mode_table.py

step "packaging e2e: Prometheus + dashboards + alerts, Helm render, image and compose (release)"
KEYGUARD_BIN=$PWD/build/keyguard /usr/bin/python3 -m pytest -q tests/e2e

if [ "${SKIP_ASAN:-0}" != 1 ]; then
  step "wait for the ASan+UBSan build"
  wait_background asan
  background fuzz bash scripts/build.sh fuzz
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  step "unit + hiredis client tests (ASan+UBSan)"
  (cd build-asan && ctest --output-on-failure)
  step "integration tests (ASan+UBSan keyguard)"
  # (test_run_script.py runs scripts/run.sh, which runs the release build whatever KEYGUARD_BIN says.)
  KEYGUARD_BIN=$PWD/build-asan/keyguard integration tests/integration --ignore=tests/integration/test_run_script.py
fi

step "wait for the fuzz build"
wait_background fuzz

step "fuzz the framers and the config load path (${FUZZ_SECONDS:-15}s each)"
mkdir -p build-fuzz/corpus
./build-fuzz/framer_fuzz tests/fuzz/regressions/* >/dev/null 2>&1 || { echo "fuzz regression input fails"; exit 1; }
# (The two fuzzers run side by side, one per core.)
./build-fuzz/framer_fuzz -max_total_time="${FUZZ_SECONDS:-15}" -dict=tests/fuzz/resp.dict \
  -max_len=4096 build-fuzz/corpus tests/fuzz/corpus >build-fuzz/framer_fuzz.log 2>&1 &
framer_fuzz=$!
# Seeds: the shipped configs (examples/, the compose demo's) and tests/fuzz/config_corpus (a users
# file after "#@users"). -timeout: one input taking 10 s is a hang; -rss_limit_mb: a blow-up.
mkdir -p build-fuzz/config-corpus build-fuzz/config-seeds
for f in examples/*.yaml docker/demo/*.yaml; do cp "$f" "build-fuzz/config-seeds/${f//\//_}"; done
./build-fuzz/config_fuzz tests/fuzz/config_regressions/* >/dev/null 2>&1 || { echo "config fuzz regression input fails"; exit 1; }
./build-fuzz/config_fuzz -max_total_time="${FUZZ_SECONDS:-15}" -dict=tests/fuzz/config.dict -max_len=16384 \
  -timeout=10 -rss_limit_mb=2048 build-fuzz/config-corpus build-fuzz/config-seeds tests/fuzz/config_corpus \
  >build-fuzz/config_fuzz.log 2>&1 || { tail -40 build-fuzz/config_fuzz.log; echo "config_fuzz failed"; exit 1; }
tail -3 build-fuzz/config_fuzz.log
wait "$framer_fuzz" || { tail -40 build-fuzz/framer_fuzz.log; echo "framer_fuzz failed"; exit 1; }
tail -3 build-fuzz/framer_fuzz.log

step "framer throughput (informational)"
./build/framer_bench --benchmark_min_time=0.2 2>/dev/null | grep -E "BM_"

step "all tests passed"
