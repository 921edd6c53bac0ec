#!/usr/bin/env bash
# keyguard audit against redis-cli --bigkeys and --memkeys on the same data, side by side: wall
# time, keys/s, and ratios to --bigkeys. keyguard audit runs uncapped (--rate 0) and at a fixed
# cap (RATE commands/s); it asks more per key (TYPE, PTTL, MEMORY USAGE, OBJECT IDLETIME, the
# size, and two GETRANGEs per string) than --bigkeys (TYPE and the size) or --memkeys (TYPE and
# MEMORY USAGE), so commands per key are shown too.
# usage: bench/audit_vs_bigkeys.sh [KEYGUARD_BIN]   env: KEYS (200000), RATE (50000), ROUNDS (1)
set -euo pipefail
cd "$(dirname "$0")/.."
KG=${1:-build/keyguard}
[ -x "$KG" ] || bash scripts/build.sh release >/dev/null
NKEYS=${KEYS:-200000}; RATE=${RATE:-50000}; ROUNDS=${ROUNDS:-1}
D=$(mktemp -d /tmp/kg-auditbench.XXXX)
RP=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --dir "$D" --logfile "$D/redis.log" &
RPID=$!
cleanup() { kill "$RPID" 2>/dev/null || true; wait "$RPID" 2>/dev/null || true; rm -rf "$D"; }
trap cleanup EXIT
for _ in $(seq 50); do redis-cli -p "$RP" ping >/dev/null 2>&1 && break; sleep 0.1; done

# The data: 70% small strings (some JSON, some with a TTL, some with legacy names), 10% hashes,
# 10% lists, 5% sets, 5% sorted sets, plus a few big keys.
/usr/bin/python3 - "$NKEYS" > "$D/fill.resp" <<'PY'
import sys
n = int(sys.argv[1])
out = sys.stdout.buffer
def cmd(*args):
    out.write(b"*%d\r\n" % len(args))
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.write(b"$%d\r\n%s\r\n" % (len(a), a))
for i in range(n):
    k = i % 100
    if k < 70:
        if k < 10:
            cmd("SET", "User_%d_Profile" % i, '{"name":"u%d","age":%d,"plan":"pro"}' % (i, k))
        elif k < 40:
            cmd("SET", "session:%d" % i, "tok%d" % i, "EX", 86400)
        else:
            cmd("SET", "cache:item:%d" % i, "v" * (k * 3))
    elif k < 80:
        cmd("HSET", "user:%d:profile" % i, "name", "u%d" % i, "age", k, "city", "Paris")
    elif k < 90:
        cmd("RPUSH", "queue:%d" % i, *range(k - 75))
    elif k < 95:
        cmd("SADD", "tags:%d" % i, *("t%d" % j for j in range(k - 85)))
    else:
        cmd("ZADD", "board:%d" % i, *(x for j in range(k - 90) for x in (j, "p%d" % j)))
for b in range(5):
    cmd("SET", "blob:%d" % b, "x" * 50000)
    cmd("RPUSH", "biglist:%d" % b, *range(6000))
PY
redis-cli -p "$RP" --pipe < "$D/fill.resp" >/dev/null
total=$(redis-cli -p "$RP" dbsize)
echo "keyspace: $total keys (redis $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/'))"

now() { date +%s.%N; }
declare -A SECS
run() {  # name, command...
  local name=$1; shift
  local best=
  for _ in $(seq "$ROUNDS"); do
    local t0; t0=$(now)
    "$@" >"$D/$name.out" 2>"$D/$name.err"
    local t; t=$(awk -v a="$(now)" -v b="$t0" 'BEGIN{print a-b}')
    if [ -z "$best" ] || awk -v t="$t" -v b="$best" 'BEGIN{exit !(t<b)}'; then best=$t; fi
  done
  SECS[$name]=$best
}
run bigkeys redis-cli -p "$RP" --bigkeys
run memkeys redis-cli -p "$RP" --memkeys
run audit-uncapped "$KG" audit --upstream "127.0.0.1:$RP" --format json --rate 0 --no-progress
run audit-capped "$KG" audit --upstream "127.0.0.1:$RP" --format json --rate "$RATE" --no-progress

cmds() { /usr/bin/python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print("%.2f" % (j["commands"]/j["scanned"]))' "$D/$1.out"; }
printf "%-22s %9s %11s %10s %12s\n" tool seconds "keys/s" "cmds/key" "vs bigkeys"
for name in bigkeys memkeys audit-uncapped audit-capped; do
  s=${SECS[$name]}
  kps=$(awk -v n="$total" -v s="$s" 'BEGIN{print n/s}')
  ratio=$(awk -v b="${SECS[bigkeys]}" -v s="$s" 'BEGIN{print b/s}')
  case $name in
    bigkeys) per="~2" ;;
    memkeys) per="~2" ;;
    *) per=$(cmds "$name") ;;
  esac
  label=$name; [ "$name" = audit-capped ] && label="audit --rate $RATE"
  printf "%-22s %9.2f %11.0f %10s %11.2fx\n" "$label" "$s" "$kps" "$per" "$ratio"
done
echo
echo "audit findings (uncapped run):"
/usr/bin/python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(" ", j["findings"], "big keys:", [(b["type"], b["keys"]) for b in j["big_keys"]])' "$D/audit-uncapped.out"
echo "redis-cli --bigkeys summary:"; sed -n '/summary/,$p' "$D/bigkeys.out" | grep -E "^Biggest" | sed 's/^/  /'
