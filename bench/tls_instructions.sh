#!/usr/bin/env bash
# User-space instructions per command (valgrind callgrind, counters zeroed after a warm-up) with a
# TLS upstream, side by side: keyguard (--threads 1; variants bare, defaults, shared-bare) and
# haproxy (nbthread 1, `ssl verify required`), both verifying the same CA and name, under the same
# redis-benchmark load (SET/GET, C clients, pipeline P, plain TCP to the proxy). Deterministic
# where CPU time on a shared machine is not; the handshakes of each run's new connections count.
# usage: bench/tls_instructions.sh [KEYGUARD_BIN]   env: N (20000), P (1), C (50),
#        VARIANTS (bare defaults shared-bare), NO_HAPROXY, KEEP_DIR (keep the profiles there)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
KG=$(realpath "${1:-build/keyguard}")
N=${N:-20000}; P=${P:-1}; C=${C:-50}
D=${KEEP_DIR:-$(mktemp -d /tmp/kg-tinstr.XXXX)}; mkdir -p "$D"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "${KEEP_DIR:-}" ] || rm -rf "$D"
}
trap cleanup EXIT
ossl() { (cd "$D" && openssl "$@") >/dev/null 2>&1; }
ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -keyout ca.key -out ca.crt -subj /CN=bench-ca
ossl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout server.key -out server.csr -subj /CN=localhost
printf 'basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$D/server.ext"
ossl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -out server.crt -extfile server.ext
RP=$(port)
redis-server --port 0 --tls-port "$RP" --bind 127.0.0.1 --tls-cert-file "$D/server.crt" --tls-key-file "$D/server.key" \
  --tls-ca-cert-file "$D/ca.crt" --tls-auth-clients no --save '' --appendonly no --daemonize no --logfile "$D/redis.log" & pids+=($!)
sleep 0.5
TLSCFG="upstream_tls: {ca_file: \"$D/ca.crt\", server_name: localhost}"
printf '%s\nkey_policy: {enabled: false}\nhygiene: {enabled: false}\n' "$TLSCFG" > "$D/bare.yaml"
echo "$TLSCFG" > "$D/defaults.yaml"
printf '%s\nkey_policy: {enabled: false}\nhygiene: {enabled: false}\nupstream_connections: shared\n' "$TLSCFG" > "$D/shared-bare.yaml"
measure() { # name port pid
  for _ in $(seq 100); do [ "$(redis-cli -p "$2" set probe 1 2>&1)" = OK ] && break; sleep 0.2; done
  redis-benchmark -p "$2" -t set,get -n 5000 -c "$C" -P "$P" -r 100000 -q >/dev/null 2>&1
  callgrind_control -z "$3" >/dev/null
  redis-benchmark -p "$2" -t set,get -n "$N" -c "$C" -P "$P" -r 100000 -q >/dev/null 2>&1
  callgrind_control -d "$3" >/dev/null; sleep 0.5
  kill "$3"; wait "$3" 2>/dev/null || true
  ir=$(grep -h '^summary:' "$D/$1.cg".* | head -1 | awk '{print $2}')
  printf "%-12s P%-3s %8.0f instr/cmd\n" "$1" "$P" "$(awk -v i="$ir" -v n="$N" 'BEGIN{print i/(2*n)}')"
}
for v in ${VARIANTS:-bare defaults shared-bare}; do
  KP=$(port); KA=$(port)
  valgrind --tool=callgrind --callgrind-out-file="$D/$v.cg" "$KG" --config "$D/$v.yaml" --threads 1 \
    --listen "127.0.0.1:$KP" --upstream "rediss://127.0.0.1:$RP" --admin "127.0.0.1:$KA" >"$D/$v.log" 2>&1 & KPID=$!
  measure "$v" "$KP" "$KPID"
done
if [ -z "${NO_HAPROXY:-}" ]; then
HP=$(port)
cat > "$D/haproxy.cfg" <<CFG
global
  maxconn 4096
  nbthread 1
defaults
  mode tcp
  timeout connect 5s
  timeout client 60s
  timeout server 60s
listen r
  bind 127.0.0.1:$HP
  server s1 127.0.0.1:$RP ssl verify required ca-file $D/ca.crt sni str(localhost)
CFG
valgrind --tool=callgrind --callgrind-out-file="$D/haproxy.cg" haproxy -f "$D/haproxy.cfg" -db >"$D/haproxy.log" 2>&1 & HPID=$!
measure haproxy "$HP" "$HPID"
fi
