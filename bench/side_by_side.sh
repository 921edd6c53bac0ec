#!/usr/bin/env bash
# Side by side, in one run: redis-benchmark SET/GET (50 clients, pipeline 1 and 16) against direct
# redis-server, haproxy (TCP mode), twemproxy (nutcracker) and keyguard; ops/s and each proxy's CPU
# microseconds per command from /proc, with keyguard's ratios to haproxy and twemproxy, and keyguard
# with its defaults (key policy and hygiene detectors, observe-only) against keyguard with both off,
# keyguard with the hygiene detectors against keyguard without them, and keyguard with a static
# tenant prefix against keyguard without tenancy; keyguard with shared upstream connections
# (kg-shared; kg-shared1 with one worker thread, like for like) against the best multiplexing
# peer measured: predixy when PREDIXY names a build of
# it (from a fetched checkout, never committed; one worker thread), else twemproxy.
# usage: bench/side_by_side.sh [KEYGUARD_BIN]   env: N (requests, 200000), C (clients, 50), ROUNDS (2),
#        PREDIXY (path to a predixy binary)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
KG=${1:-build/keyguard}
[ -x "$KG" ] || bash scripts/build.sh release >/dev/null
N=${N:-200000}; C=${C:-50}; ROUNDS=${ROUNDS:-2}
D=$(mktemp -d /tmp/kg-bench.XXXX)
trap bench_cleanup EXIT
RP=$(port); HP=$(port); TP=$(port); TS=$(port); KP=$(port); KA=$(port); NP=$(port); NA=$(port); XP=$(port); XA=$(port)
DP=$(port); DA=$(port); SP=$(port); SA=$(port); PXP=$(port); S1P=$(port); S1A=$(port)
redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --logfile "$D/redis.log" &
pids+=($!)
cat > "$D/haproxy.cfg" <<CFG
global
  maxconn 4096
defaults
  mode tcp
  timeout connect 5s
  timeout client 60s
  timeout server 60s
listen r
  bind 127.0.0.1:$HP
  server s1 127.0.0.1:$RP
CFG
haproxy -f "$D/haproxy.cfg" -db >"$D/haproxy.log" 2>&1 & pids+=($!); HAP=$!
cat > "$D/nut.yml" <<CFG
pool:
  listen: 127.0.0.1:$TP
  redis: true
  hash: fnv1a_64
  distribution: ketama
  server_connections: 1
  servers:
    - 127.0.0.1:$RP:1
CFG
nutcracker -c "$D/nut.yml" -o "$D/nut.log" -s "$TS" & pids+=($!); NUT=$!
"$KG" --listen "127.0.0.1:$KP" --upstream "127.0.0.1:$RP" --admin "127.0.0.1:$KA" >"$D/kg.log" 2>&1 & pids+=($!); KGP=$!
# The same binary with the key policy and the hygiene detectors off, to show what the defaults
# (both on, observe-only) cost.
printf 'key_policy: {enabled: false}\nhygiene: {enabled: false}\n' > "$D/nopolicy.yaml"
"$KG" --config "$D/nopolicy.yaml" --listen "127.0.0.1:$NP" --upstream "127.0.0.1:$RP" --admin "127.0.0.1:$NA" \
  >"$D/kg-bare.log" 2>&1 & pids+=($!); NPP=$!
# The defaults with only the hygiene detectors off, to show what the detectors cost.
printf 'hygiene: {enabled: false}\n' > "$D/nodetect.yaml"
"$KG" --config "$D/nodetect.yaml" --listen "127.0.0.1:$DP" --upstream "127.0.0.1:$RP" --admin "127.0.0.1:$DA" \
  >"$D/kg-nodetect.log" 2>&1 & pids+=($!); DPP=$!
# The defaults plus a static tenant: every key prefixed, every reply checked for the prefix.
printf 'tenancy: {prefix: "tenant:bench:"}\n' > "$D/tenant.yaml"
"$KG" --config "$D/tenant.yaml" --listen "127.0.0.1:$XP" --upstream "127.0.0.1:$RP" --admin "127.0.0.1:$XA" \
  >"$D/kg-tenant.log" 2>&1 & pids+=($!); XPP=$!
# Shared upstream connections: many clients' commands per write to Redis.
"$KG" --listen "127.0.0.1:$SP" --upstream "127.0.0.1:$RP" --admin "127.0.0.1:$SA" --upstream-connections shared \
  >"$D/kg-shared.log" 2>&1 & pids+=($!); SPP=$!
# The same with one worker thread, as predixy runs here (WorkerThreads 1): like for like against
# the peer (with a worker per core, 50 clients are split over two sets of shared connections).
"$KG" --threads 1 --listen "127.0.0.1:$S1P" --upstream "127.0.0.1:$RP" --admin "127.0.0.1:$S1A" \
  --upstream-connections shared >"$D/kg-shared1.log" 2>&1 & pids+=($!); S1PP=$!
PEERS=""
if [ -n "${PREDIXY:-}" ]; then
  cat > "$D/predixy.conf" <<CFG
Name bench
Bind 127.0.0.1:$PXP
WorkerThreads 1
ClientTimeout 300
Log $D/predixy.log
LogInfoSample 0
LogNoticeSample 0
Authority {
    Auth {
        Mode write
    }
}
StandaloneServerPool {
    Hash crc16
    Distribution modula
    RefreshMethod fixed
    Group shard001 {
        + 127.0.0.1:$RP
    }
}
CFG
  "$PREDIXY" "$D/predixy.conf" >"$D/predixy.out" 2>&1 & pids+=($!)
  PEERS="predixy:$PXP:$!"
fi
sleep 1
printf "%-10s %-4s %12s %12s\n" target pipe "ops/s" "proxy_us/op"
declare -A US OPS
for r in $(seq "$ROUNDS"); do
  for P in 1 16; do
    for t in "direct:$RP:0" "haproxy:$HP:$HAP" "twemproxy:$TP:$NUT" $PEERS "keyguard:$KP:$KGP" "kg-bare:$NP:$NPP" "kg-nodetect:$DP:$DPP" "kg-tenant:$XP:$XPP" \
      "kg-shared:$SP:$SPP" "kg-shared1:$S1P:$S1PP"; do
      IFS=: read -r name p pid <<<"$t"
      c0=$(cpu "$pid")
      out=$(redis-benchmark -h 127.0.0.1 -p "$p" -t set,get -n "$N" -c "$C" -P "$P" -r 100000 -q --csv 2>/dev/null)
      c1=$(cpu "$pid")
      ops=$(echo "$out" | awk -F'"' '/"SET"|"GET"/{s+=$4; n++} END{if(n) printf "%.0f", s/n; else print 0}')
      us=$(us_per_cmd "$c0" "$c1" "$N")
      printf "%-10s %-4s %12s %12s\n" "$name" "$P" "$ops" "$us"
      US[$r.$P.$name]=$us
      OPS[$r.$P.$name]=$ops
    done
    awk -v k="${US[$r.$P.keyguard]}" -v h="${US[$r.$P.haproxy]}" -v t="${US[$r.$P.twemproxy]}" -v p="$P" \
      'BEGIN{printf "  pipeline %s: keyguard CPU/cmd = %.2fx haproxy, %.2fx twemproxy\n", p, (h>0?k/h:0), (t>0?k/t:0)}'
    awk -v a="${OPS[$r.$P.keyguard]}" -v b="${OPS[$r.$P.kg-bare]}" -v c="${US[$r.$P.keyguard]}" -v d="${US[$r.$P.kg-bare]}" -v p="$P" \
      'BEGIN{printf "  pipeline %s: defaults (key policy + detectors) = %.2fx the throughput of both off, %.2fx its CPU/cmd\n", p, (b>0?a/b:0), (d>0?c/d:0)}'
    awk -v a="${OPS[$r.$P.keyguard]}" -v b="${OPS[$r.$P.kg-nodetect]}" -v c="${US[$r.$P.keyguard]}" -v d="${US[$r.$P.kg-nodetect]}" -v p="$P" \
      'BEGIN{printf "  pipeline %s: hygiene detectors on = %.2fx the throughput of detectors off, %.2fx its CPU/cmd\n", p, (b>0?a/b:0), (d>0?c/d:0)}'
    awk -v a="${OPS[$r.$P.kg-tenant]}" -v b="${OPS[$r.$P.keyguard]}" -v c="${US[$r.$P.kg-tenant]}" -v d="${US[$r.$P.keyguard]}" -v p="$P" \
      'BEGIN{printf "  pipeline %s: tenant prefixing = %.2fx the throughput of keyguard without tenancy, %.2fx its CPU/cmd\n", p, (b>0?a/b:0), (d>0?c/d:0)}'
    peer=twemproxy; [ -n "$PEERS" ] && peer=predixy
    awk -v s="${US[$r.$P.kg-shared]}" -v k="${US[$r.$P.keyguard]}" -v m="${US[$r.$P.$peer]}" -v peer="$peer" -v p="$P" \
      'BEGIN{printf "  pipeline %s: kg-shared CPU/cmd = %.2fx %s, %.2fx keyguard with dedicated connections\n", p, (m>0?s/m:0), peer, (k>0?s/k:0)}'
    awk -v s="${US[$r.$P.kg-shared1]}" -v m="${US[$r.$P.$peer]}" -v a="${OPS[$r.$P.kg-shared1]}" -v b="${OPS[$r.$P.$peer]}" \
      -v peer="$peer" -v p="$P" \
      'BEGIN{printf "  pipeline %s: kg-shared1 (one worker) CPU/cmd = %.2fx %s, %.2fx its throughput\n", p, (m>0?s/m:0), peer, (b>0?a/b:0)}'
  done
done
