#!/usr/bin/env bash
# Builds keyguard. usage: scripts/build.sh [release|asan|fuzz] [TARGET...]   (default release, into
# build/; release builds every target unless TARGETs are named)
# asan is GCC with ASan+UBSan (clang 14 + Boost 1.74 Asio lack C++20 coroutine support together);
# fuzz is clang with libFuzzer: the framers (framer_fuzz) and the config load path (config_fuzz);
# no Asio in either.
# KEYGUARD_TESTS=OFF builds only the binary (build/keyguard), with just `install-deps.sh build`
# installed: the container image does that.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-release}
shift || true
case "$kind" in
  release) cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKEYGUARD_TESTS="${KEYGUARD_TESTS:-ON}" \
            >/dev/null && ninja -C build "$@" ;;
  # -O1 -g1: sanitizer reports keep file:line, and the build takes a fraction of -O2 -g; only what
  # the sanitizer pass runs (the binary, the gtest suites, the key-spec differential helper).
  asan) cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
          -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DKEYGUARD_SANITIZE=ON >/dev/null &&
        ninja -C build-asan keyguard unit_tests hiredis_client_test command_keys_check ;;
  fuzz) CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
          -DKEYGUARD_TESTS=OFF -DKEYGUARD_FUZZ=ON >/dev/null && ninja -C build-fuzz framer_fuzz config_fuzz ;;
  *) echo "usage: $0 [release|asan|fuzz]" >&2; exit 2 ;;
esac
