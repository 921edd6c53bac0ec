#!/usr/bin/env bash
# keyguard's user-space instructions per command (valgrind callgrind, counters zeroed after a
# warm-up) under the same redis-benchmark load, for its variants: deterministic where CPU time on
# a shared 2-core machine is not. Prints each variant's instructions per command and its ratio to
# keyguard with its defaults. Kernel work (the syscalls, equal for all variants) is not counted.
# usage: bench/instructions.sh [KEYGUARD_BIN]   env: N (requests per test, 50000), P (pipeline, 16),
#        VARIANTS (default: bare nodetect defaults tenant shared)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
KG=${1:-build/keyguard}
N=${N:-50000}; P=${P:-16}
D=$(mktemp -d /tmp/kg-instr.XXXX)
RP=$(port)
redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --logfile "$D/redis.log" & RPID=$!
trap 'kill $RPID 2>/dev/null; rm -rf "$D"' EXIT
sleep 0.5
declare -A CONF=(
  [bare]='key_policy: {enabled: false}\nhygiene: {enabled: false}\n'
  [nodetect]='hygiene: {enabled: false}\n'
  [defaults]=''
  [tenant]='tenancy: {prefix: "tenant:bench:"}\n'
  [shared]='upstream_connections: shared\n'
  [shared-bare]='key_policy: {enabled: false}\nhygiene: {enabled: false}\nupstream_connections: shared\n'
)
printf "%-10s %10s\n" variant "instr/cmd"
for v in ${VARIANTS:-bare nodetect defaults tenant shared}; do
  KP=$(port); KA=$(port)
  printf "${CONF[$v]}" > "$D/$v.yaml"
  valgrind --tool=callgrind --callgrind-out-file="$D/$v.cg" "$KG" --config "$D/$v.yaml" --threads 1 \
    --listen "127.0.0.1:$KP" --upstream "127.0.0.1:$RP" --admin "127.0.0.1:$KA" >"$D/$v.log" 2>&1 & KPID=$!
  for _ in $(seq 100); do redis-cli -p "$KP" ping >/dev/null 2>&1 && break; sleep 0.2; done
  redis-benchmark -p "$KP" -t set,get -n 5000 -P "$P" -r 100000 -q >/dev/null 2>&1  # warm up
  callgrind_control -z "$KPID" >/dev/null
  redis-benchmark -p "$KP" -t set,get -n "$N" -c 50 -P "$P" -r 100000 -q >/dev/null 2>&1
  callgrind_control -d "$KPID" >/dev/null
  sleep 0.5
  kill "$KPID"; wait "$KPID" 2>/dev/null || true
  ir=$(grep -h '^summary:' "$D/$v.cg".* | head -1 | awk '{print $2}')
  per=$(awk -v i="$ir" -v n="$N" 'BEGIN{printf "%.0f", i/(2*n)}')
  printf "%-10s %10s\n" "$v" "$per"
  echo "$v $per" >> "$D/results"
done
awk '{v[NR]=$1; p[NR]=$2; if ($1=="defaults") b=$2} END{for (i=1;i<=NR;i++) printf "  %-10s %.3fx keyguard defaults\n", v[i], p[i]/b}' "$D/results"
awk '{p[$1]=$2} END{if (p["defaults"] && p["nodetect"] && p["tenant"] && p["shared"])
  printf "  detectors on/off: %.3fx   tenant prefixing on/off: %.3fx   shared/dedicated connections: %.3fx\n",
    p["defaults"]/p["nodetect"], p["tenant"]/p["defaults"], p["shared"]/p["defaults"]}' "$D/results"
