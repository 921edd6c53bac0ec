#!/usr/bin/env bash
# Detector memory over a 1M-key workload: the integration test tests/integration/test_detector_memory.py
# with 1M distinct keys per family (6 families through redis-benchmark: JSON values written and read,
# one attribute per key, cache keys with and without TTL, HGETs the sizing probe looks at), printing
# keyguard's RSS after 200k and after 1M keys.  usage: bench/detector_memory.sh [KEYGUARD_BIN]
set -euo pipefail
cd "$(dirname "$0")/.."
KEYGUARD_BIN=${1:-$PWD/build/keyguard} KG_MEMORY_KEYS=${KG_MEMORY_KEYS:-1000000} \
  /usr/bin/python3 -m pytest -q -s tests/integration/test_detector_memory.py 2>&1 | grep -E "RSS|passed|failed"
