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
# release builds them only when that pass is skipped.
if [ "${SKIP_ASAN:-0}" != 1 ]; then
  bash scripts/build.sh release keyguard hiredis_client_test command_keys_check framer_bench key_policy_bench hot_keys_bench
else
  bash scripts/build.sh release
fi

# The sanitizer and fuzz builds run meanwhile, in the background at idle priority (SCHED_IDLE: they
# get only the CPU time the release passes leave idle, about half of it, as those passes mostly wait
# on sockets and timers). Same session, so the same scheduling group (with autogroup, another
# session would get an equal share whatever its priority). Its output is shown if it fails.
bg=""
bg_log=$PWD/background-builds.log
stop_bg() { [ -z "$bg" ] || kill -- -"$bg" 2>/dev/null || true; }
trap stop_bg EXIT
set -m  # the background builds are a process group of their own, stopped with it if a pass fails
( chrt --idle 0 bash -c 'set -e; if [ "${SKIP_ASAN:-0}" != 1 ]; then bash scripts/build.sh asan; fi
    bash scripts/build.sh fuzz; echo "background builds done in ${SECONDS}s"' >"$bg_log" 2>&1 ) &
bg=$!
set +m

if [ "${SKIP_ASAN:-0}" != 1 ]; then
  step "hiredis client tests"
  (cd build && ctest --output-on-failure -R hiredis_client_test)
else
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
  --ignore=tests/integration/test_cluster.py

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
  tests/integration/test_hygiene_rules.py

step "packaging e2e: Prometheus + dashboards + alerts, Helm render, image and compose (release)"
KEYGUARD_BIN=$PWD/build/keyguard /usr/bin/python3 -m pytest -q tests/e2e

step "wait for the background builds (ASan+UBSan, fuzz)"
if ! wait "$bg"; then bg=""; tail -60 "$bg_log"; echo "a background build failed"; exit 1; fi
bg=""
tail -1 "$bg_log"

if [ "${SKIP_ASAN:-0}" != 1 ]; then
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  step "unit + hiredis client tests (ASan+UBSan)"
  (cd build-asan && ctest --output-on-failure)
  step "integration tests (ASan+UBSan keyguard)"
  # (test_run_script.py runs scripts/run.sh, which runs the release build whatever KEYGUARD_BIN says.)
  KEYGUARD_BIN=$PWD/build-asan/keyguard integration tests/integration --ignore=tests/integration/test_run_script.py
fi

step "fuzz the framers and the config load path (${FUZZ_SECONDS:-15}s each)"
mkdir -p build-fuzz/corpus
./build-fuzz/framer_fuzz tests/fuzz/regressions/* >/dev/null 2>&1 || { echo "fuzz regression input fails"; exit 1; }
./build-fuzz/framer_fuzz -max_total_time="${FUZZ_SECONDS:-15}" -dict=tests/fuzz/resp.dict \
  -max_len=4096 build-fuzz/corpus tests/fuzz/corpus 2>&1 | tail -3
# Seeds: the shipped configs (examples/, the compose demo's) and tests/fuzz/config_corpus (a users
# file after "#@users"). -timeout: one input taking 10 s is a hang; -rss_limit_mb: a blow-up.
mkdir -p build-fuzz/config-corpus build-fuzz/config-seeds
for f in examples/*.yaml docker/demo/*.yaml; do cp "$f" "build-fuzz/config-seeds/${f//\//_}"; done
./build-fuzz/config_fuzz tests/fuzz/config_regressions/* >/dev/null 2>&1 || { echo "config fuzz regression input fails"; exit 1; }
./build-fuzz/config_fuzz -max_total_time="${FUZZ_SECONDS:-15}" -dict=tests/fuzz/config.dict -max_len=16384 \
  -timeout=10 -rss_limit_mb=2048 build-fuzz/config-corpus build-fuzz/config-seeds tests/fuzz/config_corpus 2>&1 | tail -3

step "framer throughput (informational)"
./build/framer_bench --benchmark_min_time=0.2 2>/dev/null | grep -E "BM_"

step "all tests passed"
