#!/usr/bin/env bash
# Installs what keyguard needs to build, run and test on Debian 12, skipping what is present.
# The single list of packages: CI, the README and docker/Dockerfile all use this script.
#   build: compile keyguard   run: build + a local redis-server (scripts/run.sh)
#   runtime: only the shared libraries the binary needs (the container image)
#   all: everything CI needs (tests, Prometheus, yamllint, Go + sprig for the chart render check)
set -euo pipefail
BUILD_PKGS=(build-essential cmake ninja-build pkg-config libboost-dev libabsl-dev libre2-dev
            libprotobuf-dev protobuf-compiler libyaml-cpp-dev libhiredis-dev libssl-dev nlohmann-json3-dev)
RUN_PKGS=(redis-server redis-tools)
# What the keyguard binary links at run time, and nothing else: the container image's runtime
# stage (docker/Dockerfile) installs exactly this set. libc6, libgcc-s1, zlib1g and libstdc++6
# are in debian:12-slim already; tests/e2e/test_packaging.py checks the set against ldd.
RUNTIME_PKGS=(libabsl20220623 libprotobuf32 libre2-9 libyaml-cpp0.7 libstdc++6 libssl3 libhiredis0.14)
TEST_PKGS=(libgtest-dev libgmock-dev libbenchmark-dev clang clang-format libclang-rt-14-dev python3 python3-redis
           python3-pytest python3-pytest-xdist prometheus haproxy nutcracker yamllint curl procps
           golang-go golang-github-masterminds-sprig-dev golang-gopkg-yaml.v2-dev)
case "${1:-all}" in
  build) want=("${BUILD_PKGS[@]}") ;;
  run) want=("${BUILD_PKGS[@]}" "${RUN_PKGS[@]}") ;;
  runtime) want=("${RUNTIME_PKGS[@]}") ;;
  all) want=("${BUILD_PKGS[@]}" "${RUN_PKGS[@]}" "${TEST_PKGS[@]}")
       # Node.js and npm for the Node clients the tests drive (ioredis); Debian's packages when the
       # machine has no node of its own.
       command -v node >/dev/null && command -v npm >/dev/null || want+=(nodejs npm) ;;
  *) echo "usage: $0 [build|run|runtime|all]" >&2; exit 2 ;;
esac
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The Debian redis-server package starts a system redis on 6379; keyguard's scripts and tests
# start their own on private ports and do not need it.
if [ "${1:-all}" = all ]; then
  # The Node.js clients of the integration tests, at the versions package-lock.json pins (from the
  # npm registry; node_modules is not committed).
  node_dir="$(cd "$(dirname "$0")/.." && pwd)/tests/integration/node"
  if [ ! -d "$node_dir/node_modules/ioredis" ]; then
    (cd "$node_dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  fi
fi
