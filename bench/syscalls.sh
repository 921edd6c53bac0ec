#!/usr/bin/env bash
# keyguard's system calls per command under redis-benchmark: `strace -c` attached to keyguard
# (--threads 1, default config) for the measured run only, after a warm-up. Counts are exact (strace
# slows keyguard, so epoll_wait, which returns every ready socket at once, is batched more than
# without it); recvfrom's errors are the EAGAIN reads. Needs strace and permission to attach (root
# or ptrace_scope 0).
# usage: bench/syscalls.sh [KEYGUARD_BIN]   env: N (requests per test, 20000), P (pipeline, 1),
#        C (clients, 50), KG_FLAGS (more keyguard flags, e.g. "--upstream-connections shared")
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
KG=${1:-build/keyguard}
N=${N:-20000}; P=${P:-1}; C=${C:-50}
D=$(mktemp -d /tmp/kg-sys.XXXX)
RP=$(port)
while :; do KP=$(port); KA=$(port); [[ $KP != "$RP" && $KA != "$RP" && $KP != "$KA" ]] && break; done
redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --logfile "$D/redis.log" & RPID=$!
KPID=
trap 'kill $RPID ${KPID:-} 2>/dev/null; rm -rf "$D"' EXIT
sleep 0.5
: > "$D/kg.yaml"
"$KG" --config "$D/kg.yaml" --threads 1 --listen "127.0.0.1:$KP" --upstream "127.0.0.1:$RP" \
  --admin "127.0.0.1:$KA" ${KG_FLAGS:-} >"$D/kg.log" 2>&1 & KPID=$!
for _ in $(seq 100); do redis-cli -p "$KP" ping >/dev/null 2>&1 && break; sleep 0.1; done
redis-benchmark -p "$KP" -t set,get -n 5000 -c "$C" -P "$P" -r 100000 -q >/dev/null 2>&1  # warm up
strace -c -f -o "$D/strace" -p "$KPID" 2>/dev/null & SPID=$!
sleep 1  # strace attaches to every thread
redis-benchmark -p "$KP" -t set,get -n "$N" -c "$C" -P "$P" -r 100000 -q >/dev/null 2>&1
kill -INT "$SPID"; wait "$SPID" 2>/dev/null || true
# strace -c columns: % time, seconds, usecs/call, calls, [errors,] syscall
awk -v n=$((2 * N)) -v p="$P" -v flags="${KG_FLAGS:+ ($KG_FLAGS)}" '
  $NF ~ /^[a-z_0-9]+$/ && $4 ~ /^[0-9]+$/ && $NF != "total" {
    calls[$NF] = $4; errs[$NF] = (NF == 6 ? $5 : 0); total += $4 }
  END {
    printf "P=%s, %d commands%s: system calls per command\n", p, n, flags
    printf "  recvfrom %.2f (EAGAIN %.2f)  sendmsg %.2f  epoll_wait %.2f  epoll_ctl %.2f  all %.2f\n",
      calls["recvfrom"] / n, errs["recvfrom"] / n, calls["sendmsg"] / n, calls["epoll_wait"] / n,
      calls["epoll_ctl"] / n, total / n }' "$D/strace"
