#!/usr/bin/env bash
# Side by side with a TLS upstream, in one run: a redis-server listening on a TLS port only (a CA
# and a server certificate for localhost/127.0.0.1 made with openssl in the temp dir, no client
# certificates), and redis-benchmark SET/GET (50 clients, pipeline 1 and 16, plain TCP to the
# proxies) through haproxy (TCP mode, `nbthread 1`, `ssl verify required ca-file ... sni
# str(localhost)` to the server) and keyguard (--upstream rediss://..., upstream_tls.ca_file and
# server_name localhost, so the same verification) with --threads 1: its defaults (key policy and
# hygiene detectors, observe-only), bare (both off) and with shared upstream connections; and
# haproxy and keyguard with their default thread counts. Direct TLS to the server
# (redis-benchmark --tls --cacert) is the reference line. ops/s and each proxy's CPU microseconds
# per command from /proc, with keyguard's ratios to haproxy, per round and as the mean over the
# rounds; the server's connections per run (total_connections_received) and, at the end, the TLS
# handshakes each keyguard made and how many resumed a session, and haproxy's backend TLS key
# computations. Each run starts from an empty server and is checked: no error from
# redis-benchmark, and keys on the server afterwards.
# usage: bench/tls_side_by_side.sh [KEYGUARD_BIN]
#        env: N (requests per test, 100000), C (clients, 50), ROUNDS (2),
#             MAX_LOAD (wait until the 1-minute load average is below it, checked every 30 s for
#             up to WAIT_LOAD seconds, 900; empty: do not wait), KEEP (keep the temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
KG=${1:-build/keyguard}
[ -x "$KG" ] || bash scripts/build.sh release >/dev/null
N=${N:-100000}; C=${C:-50}; ROUNDS=${ROUNDS:-2}
MAX_LOAD=${MAX_LOAD-1.0}; WAIT_LOAD=${WAIT_LOAD:-900}
D=$(mktemp -d /tmp/kg-tbench.XXXX)
trap bench_cleanup EXIT

# The certificates: a CA, and the server's for CN localhost with DNS:localhost and IP:127.0.0.1.
ossl() { (cd "$D" && openssl "$@") >/dev/null 2>&1; }
ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -keyout ca.key -out ca.crt -subj /CN=bench-ca
ossl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout server.key -out server.csr -subj /CN=localhost
printf 'basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$D/server.ext"
ossl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -out server.crt -extfile server.ext

RP=$(port)
redis-server --port 0 --tls-port "$RP" --bind 127.0.0.1 --tls-cert-file "$D/server.crt" --tls-key-file "$D/server.key" \
  --tls-ca-cert-file "$D/ca.crt" --tls-auth-clients no --save '' --appendonly no --daemonize no \
  --logfile "$D/redis.log" & pids+=($!)
rcli() { redis-cli --tls --cacert "$D/ca.crt" --sni localhost -h 127.0.0.1 -p "$RP" "$@"; }
for _ in $(seq 50); do rcli ping >/dev/null 2>&1 && break; sleep 0.1; done
rcli ping | grep -q PONG || { echo "redis-server on TLS port $RP does not answer" >&2; exit 1; }

# haproxy: plain TCP in, TLS out, verifying the server as keyguard does. nbthread 1 is the
# one-thread peer of keyguard --threads 1; haproxy-mt keeps haproxy's default (one thread per CPU).
HP=$(port); HM=$(port)
for v in 1 mt; do
  p=$HP; nb="nbthread 1"; [ "$v" = mt ] && { p=$HM; nb=""; }
  cat > "$D/haproxy-$v.cfg" <<CFG
global
  maxconn 4096
  $nb
  stats socket $D/haproxy-$v.sock
defaults
  mode tcp
  timeout connect 5s
  timeout client 60s
  timeout server 60s
listen r
  bind 127.0.0.1:$p
  server s1 127.0.0.1:$RP ssl verify required ca-file $D/ca.crt sni str(localhost)
CFG
done
haproxy -f "$D/haproxy-1.cfg" -db >"$D/haproxy-1.log" 2>&1 & pids+=($!); HAP=$!
haproxy -f "$D/haproxy-mt.cfg" -db >"$D/haproxy-mt.log" 2>&1 & pids+=($!); HAM=$!

# keyguard: the same CA, SNI and verified name localhost.
TLSCFG="upstream_tls: {ca_file: \"$D/ca.crt\", server_name: localhost}"
echo "$TLSCFG" > "$D/kg.yaml"
printf '%s\nkey_policy: {enabled: false}\nhygiene: {enabled: false}\n' "$TLSCFG" > "$D/bare.yaml"
printf '%s\nupstream_connections: shared\n' "$TLSCFG" > "$D/shared.yaml"
TARGETS=("haproxy:$HP:$HAP")
start_kg() { # name config threads(empty: default)
  local p a; p=$(port); a=$(port)
  "$KG" --config "$D/$2.yaml" ${3:+--threads "$3"} --listen "127.0.0.1:$p" --upstream "rediss://127.0.0.1:$RP" \
    --admin "127.0.0.1:$a" >"$D/$1.log" 2>&1 & pids+=($!)
  TARGETS+=("$1:$p:$!"); ADMIN[$1]=$a
}
declare -A ADMIN
start_kg keyguard kg 1
start_kg kg-bare bare 1
start_kg kg-shared shared 1
TARGETS+=("haproxy-mt:$HM:$HAM")
start_kg kg-mt kg ""
ready() { [ "$(redis-cli -p "$1" set probe 1 2>&1)" = OK ]; }
for t in "${TARGETS[@]}"; do
  IFS=: read -r name p _ <<<"$t"
  for _ in $(seq 100); do ready "$p" && break; sleep 0.2; done
  ready "$p" || { echo "$name on $p does not answer:" >&2; redis-cli -p "$p" set probe 1 >&2; exit 1; }
done

wait_for_quiet "$WAIT_LOAD"
echo "haproxy threads: $(ls /proc/$HAP/task | wc -l) (nbthread 1), $(ls /proc/$HAM/task | wc -l) (default);" \
  "keyguard threads: $(ls /proc/${TARGETS[1]##*:}/task | wc -l) (--threads 1), $(ls /proc/${TARGETS[5]##*:}/task | wc -l) (default)"

conns() { rcli info stats | tr -d '\r' | awk -F: '/^total_connections_received:/{print $2}'; }
printf "%-10s %-4s %12s %12s %8s %10s\n" target pipe "ops/s" "proxy_us/op" keys "srv_conns"
declare -A US OPS
for r in $(seq "$ROUNDS"); do
  for P in 1 16; do
    for t in "direct-tls:$RP:0" "${TARGETS[@]}"; do
      IFS=: read -r name p pid <<<"$t"
      tls=""; [ "$name" = direct-tls ] && tls="--tls --cacert $D/ca.crt --sni localhost"
      rcli flushall >/dev/null
      n0=$(conns)
      c0=$(cpu "$pid")
      out=$(redis-benchmark -h 127.0.0.1 -p "$p" $tls -t set,get -n "$N" -c "$C" -P "$P" -r 100000 -q --csv \
        2>"$D/bench.err") || true
      c1=$(cpu "$pid")
      n1=$(conns); keys=$(rcli dbsize)
      ops=$(echo "$out" | awk -F'"' '/"SET"|"GET"/{s+=$4; n++} END{if(n==2) printf "%.0f", s/n; else print 0}')
      if grep -qi error "$D/bench.err" || [ "$ops" = 0 ] || [ "$keys" = 0 ]; then
        echo "$name, pipeline $P: did not answer every command (keys $keys):" >&2
        head -5 "$D/bench.err" >&2; echo "$out" >&2; exit 1
      fi
      us=$(us_per_cmd "$c0" "$c1" "$N")
      # connections the server accepted during the run, less redis-cli's own two (INFO, DBSIZE
      # come after n1; FLUSHALL before n0), so: the proxy's (or redis-benchmark's) upstream connections
      printf "%-10s %-4s %12s %12s %8s %10s\n" "$name" "$P" "$ops" "$us" "$keys" "$((n1 - n0 - 1))"
      US[$r.$P.$name]=$us; OPS[$r.$P.$name]=$ops
      US[$P.$name]=$(awk -v a="${US[$P.$name]:-0}" -v b="$us" 'BEGIN{print a+b}')
      OPS[$P.$name]=$(awk -v a="${OPS[$P.$name]:-0}" -v b="$ops" 'BEGIN{print a+b}')
    done
    for k in keyguard kg-bare kg-shared; do
      awk -v a="${OPS[$r.$P.$k]}" -v b="${OPS[$r.$P.haproxy]}" -v c="${US[$r.$P.$k]}" -v d="${US[$r.$P.haproxy]}" \
        -v p="$P" -v k="$k" 'BEGIN{printf "  pipeline %s: %s = %.2fx haproxy throughput, %.2fx its CPU/cmd\n", p, k, (b>0?a/b:0), (d>0?c/d:0)}'
    done
    awk -v a="${OPS[$r.$P.kg-mt]}" -v b="${OPS[$r.$P.haproxy-mt]}" -v c="${US[$r.$P.kg-mt]}" -v d="${US[$r.$P.haproxy-mt]}" \
      -v p="$P" 'BEGIN{printf "  pipeline %s: kg-mt = %.2fx haproxy-mt throughput, %.2fx its CPU/cmd\n", p, (b>0?a/b:0), (d>0?c/d:0)}'
  done
done
echo "mean over $ROUNDS rounds:"
for P in 1 16; do
  for t in "direct-tls:0:0" "${TARGETS[@]}"; do
    IFS=: read -r name _ _ <<<"$t"
    awk -v o="${OPS[$P.$name]}" -v u="${US[$P.$name]}" -v r="$ROUNDS" -v n="$name" -v p="$P" \
      'BEGIN{printf "%-10s %-4s %12.0f %12.2f\n", n, p, o/r, u/r}'
  done
  for k in keyguard:haproxy kg-bare:haproxy kg-shared:haproxy kg-mt:haproxy-mt; do
    IFS=: read -r k h <<<"$k"
    awk -v a="${OPS[$P.$k]}" -v b="${OPS[$P.$h]}" -v c="${US[$P.$k]}" -v d="${US[$P.$h]}" -v p="$P" -v k="$k" -v h="$h" \
      'BEGIN{printf "  pipeline %s: %s = %.2fx %s throughput, %.2fx its CPU/cmd\n", p, k, (b>0?a/b:0), h, (d>0?c/d:0)}'
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
# TLS handshakes over the whole run (with the readiness probes).
for k in keyguard kg-bare kg-shared kg-mt; do
  echo "$k: $(curl -s "http://127.0.0.1:${ADMIN[$k]}/metrics" | grep '^keyguard_upstream_tls_handshakes_total' | paste -sd' ')"
done
for v in 1 mt; do
  echo "haproxy-$v: $(python3 - "$D/haproxy-$v.sock" <<'PY'
import socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(b"show info\n")
data = b""
while chunk := s.recv(65536): data += chunk
print(" ".join(l for l in data.decode().splitlines() if l.startswith(("SslBackend", "CumSslConns", "CumConns"))))
PY
)"
done
