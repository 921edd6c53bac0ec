#!/usr/bin/env bash
# Side by side in front of a Redis Cluster, in one run: a 3-primary cluster (no replicas) on free
# ports, and redis-benchmark SET/GET over random keys (50 clients, pipeline 1 and 16) against it
# directly (redis-benchmark --cluster, one client thread as for the proxies), through predixy
# (ClusterServerPool, one worker thread) and through keyguard (--upstream redis-cluster://...,
# --threads 1) with its defaults (key policy and hygiene detectors, observe-only) and bare (both
# off); ops/s and each proxy's CPU microseconds per command from /proc, with keyguard's ratios to
# predixy, per round and as the mean over the rounds. Each run starts from an empty cluster and
# is checked: no error from redis-benchmark, and keys on every node afterwards (DBSIZE > 0 on all 3).
# predixy is a build from a fetched checkout (never committed), named by PREDIXY or the first
# argument after KEYGUARD_BIN; without it the predixy lines are left out.
# usage: bench/cluster_side_by_side.sh [KEYGUARD_BIN [PREDIXY_BIN]]
#        env: N (requests per test, 100000), C (clients, 50), ROUNDS (2), PREDIXY,
#             MAX_LOAD (wait until the 1-minute load average is below it, checked every 30 s for
#             up to WAIT_LOAD seconds, 1200; empty: do not wait),
#             PIN=1 (the proxies on the last CPU, the cluster and redis-benchmark on the others: each
#             proxy then sees the same load, unperturbed by the scheduler's placement; the
#             throughput is that of the other CPUs, so only the CPU per command compares)
# The proxies take turns in a different order each round (round r starts at the r-th), so none
# always runs right after another.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
KG=${1:-build/keyguard}
PREDIXY=${2:-${PREDIXY:-}}
[ -x "$KG" ] || bash scripts/build.sh release >/dev/null
N=${N:-100000}; C=${C:-50}; ROUNDS=${ROUNDS:-2}
MAX_LOAD=${MAX_LOAD-1.0}; WAIT_LOAD=${WAIT_LOAD:-1200}
D=$(mktemp -d /tmp/kg-cbench.XXXX)
ON_PROXY=(); ON_REST=()
if [ -n "${PIN:-}" ]; then
  last=$(($(nproc) - 1)); [ "$last" -ge 1 ] || { echo "PIN needs 2 CPUs" >&2; exit 1; }
  ON_PROXY=(taskset -c "$last"); ON_REST=(taskset -c "0-$((last - 1))")
fi
trap bench_cleanup EXIT
wait_for_quiet "$WAIT_LOAD"

# The cluster: 3 primaries, each with its own dir and an explicit bus port.
NODES=(); SEEDS=""
for i in 1 2 3; do
  p=$(port); bp=$(port); mkdir -p "$D/n$i"
  "${ON_REST[@]}" redis-server --port "$p" --bind 127.0.0.1 --cluster-enabled yes --cluster-port "$bp" \
    --cluster-config-file "$D/n$i/nodes.conf" --dir "$D/n$i" --save '' --appendonly no \
    --daemonize no --logfile "$D/n$i/redis.log" & pids+=($!)
  NODES+=("$p"); SEEDS="$SEEDS${SEEDS:+,}127.0.0.1:$p"
done
for p in "${NODES[@]}"; do
  for _ in $(seq 50); do redis-cli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
done
redis-cli --cluster create "${NODES[@]/#/127.0.0.1:}" --cluster-replicas 0 --cluster-yes >"$D/create.log" 2>&1
for p in "${NODES[@]}"; do
  for _ in $(seq 100); do
    redis-cli -p "$p" cluster info 2>/dev/null | grep -q '^cluster_state:ok' && break; sleep 0.2
  done
  redis-cli -p "$p" cluster info | grep -q '^cluster_state:ok' || { echo "node $p: cluster not ok" >&2; exit 1; }
done

KP=$(port); KA=$(port); NP=$(port); NA=$(port); PXP=$(port)
"${ON_PROXY[@]}" "$KG" --threads 1 --listen "127.0.0.1:$KP" --upstream "redis-cluster://$SEEDS" --admin "127.0.0.1:$KA" \
  >"$D/kg.log" 2>&1 & pids+=($!); KGP=$!
printf 'key_policy: {enabled: false}\nhygiene: {enabled: false}\n' > "$D/bare.yaml"
"${ON_PROXY[@]}" "$KG" --config "$D/bare.yaml" --threads 1 --listen "127.0.0.1:$NP" --upstream "redis-cluster://$SEEDS" \
  --admin "127.0.0.1:$NA" >"$D/kg-bare.log" 2>&1 & pids+=($!); NPP=$!
TARGETS=()
if [ -n "$PREDIXY" ]; then
  cat > "$D/predixy.conf" <<CFG
Name bench
Bind 127.0.0.1:$PXP
WorkerThreads 1
ClientTimeout 300
Log $D/predixy.log
LogInfoSample ${PX_INFO:-0}
LogNoticeSample ${PX_INFO:-0}
Authority {
    Auth {
        Mode write
    }
}
ClusterServerPool {
    MasterReadPriority 100
    RefreshInterval 1
    Servers {
        + 127.0.0.1:${NODES[0]}
        + 127.0.0.1:${NODES[1]}
        + 127.0.0.1:${NODES[2]}
    }
}
CFG
  "${ON_PROXY[@]}" "$PREDIXY" "$D/predixy.conf" >"$D/predixy.out" 2>&1 & pids+=($!)
  TARGETS+=("predixy:$PXP:$!")
fi
TARGETS+=("keyguard:$KP:$KGP" "kg-bare:$NP:$NPP")
# Ready when 30 keys (over all 3 nodes) are set through the proxy without a redirection: predixy
# forwards to any node (and passes MOVED on) until its first refresh of the slot map.
ready() { [ "$(for i in $(seq 30); do echo "SET probe:$i 1"; done | redis-cli -p "$1" 2>&1 | grep -c '^OK$')" = 30 ]; }
for t in "${TARGETS[@]}"; do
  IFS=: read -r name p _ <<<"$t"
  for _ in $(seq 100); do ready "$p" && break; sleep 0.2; done
  ready "$p" || { echo "$name on $p does not answer" >&2; exit 1; }
done

flush() { local n; for n in "${NODES[@]}"; do redis-cli -p "$n" flushall >/dev/null; done; }
sizes() { local n; for n in "${NODES[@]}"; do redis-cli -p "$n" dbsize; done | paste -sd/; }
printf "%-10s %-4s %12s %12s   %s\n" target pipe "ops/s" "proxy_us/op" "keys per node"
declare -A US OPS
for r in $(seq "$ROUNDS"); do
  for P in 1 16; do
    order=("${TARGETS[@]:$(((r - 1) % ${#TARGETS[@]}))}" "${TARGETS[@]:0:$(((r - 1) % ${#TARGETS[@]}))}")
    for t in "direct:${NODES[0]}:0" "${order[@]}"; do
      IFS=: read -r name p pid <<<"$t"
      # --threads 1: redis-benchmark's cluster mode otherwise runs a thread per node and times each
      # test in steps of 250 ms (100000 requests in 0.25 s printed as 400000 ops/s)
      cl=""; [ "$name" = direct ] && cl="--cluster --threads 1"
      flush
      c0=$(cpu "$pid")
      out=$("${ON_REST[@]}" redis-benchmark -h 127.0.0.1 -p "$p" $cl -t set,get -n "$N" -c "$C" -P "$P" -r 100000 -q --csv \
        2>"$D/bench.err") || true
      c1=$(cpu "$pid")
      keys=$(sizes)
      ops=$(echo "$out" | awk -F'"' '/"SET"|"GET"/{s+=$4; n++} END{if(n==2) printf "%.0f", s/n; else print 0}')
      if grep -qi error "$D/bench.err" || [ "$ops" = 0 ] || echo "$keys" | grep -qE '(^|/)0(/|$)'; then
        echo "$name, pipeline $P: did not answer every command (keys per node $keys):" >&2
        head -5 "$D/bench.err" >&2; echo "$out" >&2; exit 1
      fi
      us=$(us_per_cmd "$c0" "$c1" "$N")
      printf "%-10s %-4s %12s %12s   %s\n" "$name" "$P" "$ops" "$us" "$keys"
      US[$r.$P.$name]=$us; OPS[$r.$P.$name]=$ops
      US[$P.$name]=$(awk -v a="${US[$P.$name]:-0}" -v b="$us" 'BEGIN{print a+b}')
      OPS[$P.$name]=$(awk -v a="${OPS[$P.$name]:-0}" -v b="$ops" 'BEGIN{print a+b}')
    done
    if [ -n "$PREDIXY" ]; then
      for k in keyguard kg-bare; do
        awk -v a="${OPS[$r.$P.$k]}" -v b="${OPS[$r.$P.predixy]}" -v c="${US[$r.$P.$k]}" -v d="${US[$r.$P.predixy]}" \
          -v p="$P" -v k="$k" 'BEGIN{printf "  pipeline %s: %s = %.2fx predixy throughput, %.2fx its CPU/cmd\n", p, k, (b>0?a/b:0), (d>0?c/d:0)}'
      done
    fi
  done
done
echo "mean over $ROUNDS rounds:"
for P in 1 16; do
  for t in "direct:0:0" "${TARGETS[@]}"; do
    IFS=: read -r name _ _ <<<"$t"
    awk -v o="${OPS[$P.$name]}" -v u="${US[$P.$name]}" -v r="$ROUNDS" -v n="$name" -v p="$P" \
      'BEGIN{printf "%-10s %-4s %12.0f %12.2f\n", n, p, o/r, u/r}'
  done
  if [ -n "$PREDIXY" ]; then
    for k in keyguard kg-bare; do
      awk -v a="${OPS[$P.$k]}" -v b="${OPS[$P.predixy]}" -v c="${US[$P.$k]}" -v d="${US[$P.predixy]}" -v p="$P" -v k="$k" \
        'BEGIN{printf "  pipeline %s: %s = %.2fx predixy throughput, %.2fx its CPU/cmd\n", p, k, (b>0?a/b:0), (d>0?c/d:0)}'
    done
  fi
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
