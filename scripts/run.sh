#!/usr/bin/env bash
# Installs what is missing, builds, and runs keyguard in the foreground.
#   scripts/run.sh [keyguard flags...]        e.g. scripts/run.sh --config examples/strict.yaml
# The upstream is --upstream when given, else the config file's `upstream:` when it names one that
# accepts connections; otherwise (no upstream named, or the named one unreachable) it starts a
# private redis-server on a free loopback port and proxies to it. Ctrl-C (or SIGTERM, or keyguard
# exiting by itself) stops keyguard and the private redis-server and removes its directory:
# nothing is left running. Defaults: clients connect to 127.0.0.1:6380, metrics at 127.0.0.1:9121.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh run
bash scripts/build.sh release keyguard >/dev/null
args=("$@")

# The value of a flag given as `--flag VALUE` or `--flag=VALUE` (the last one wins, as in keyguard).
flag() {
  local want=$1 value="" i
  for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
      "$want") value=${args[i + 1]-} ;;
      "$want"=*) value=${args[i]#*=} ;;
    esac
  done
  printf '%s' "$value"
}

# Whether HOST:PORT accepts a TCP connection within two seconds.
reachable() {
  local host=${1%:*} port=${1##*:}
  host=${host#[}
  host=${host%]}
  timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$host" "$port" 2>/dev/null
}

kg="" redis_pid="" dir=""
cleanup() {
  trap - EXIT INT TERM
  # Never stop half way: each step runs whatever the one before returned.
  if [ -n "$kg" ]; then kill -TERM "$kg" 2>/dev/null || true; wait "$kg" 2>/dev/null || true; fi
  if [ -n "$redis_pid" ]; then kill -TERM "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; fi
  if [ -n "$dir" ]; then rm -rf "$dir"; fi
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM

private=yes
if [ -n "$(flag --upstream)" ]; then
  private=no
elif config=$(flag --config) && [ -n "$config" ] && [ -f "$config" ]; then
  named=$(sed -n 's/^upstream:[[:space:]]*\([^[:space:]#]*\).*/\1/p' "$config" | tr -d "\"'" | tail -n 1)
  if [ -n "$named" ] && reachable "$named"; then
    private=no
  elif [ -n "$named" ]; then
    echo "$config names upstream $named, which does not accept connections: using a private redis-server"
  fi
fi

if [ "$private" = yes ]; then
  # A free port that is not the one keyguard is about to listen on (or serve metrics on): the
  # kernel may hand out a port that was free a moment ago, --listen's included.
  listen=$(flag --listen) admin=$(flag --admin)
  while :; do
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    [ "$port" != "${listen##*:}" ] && [ "$port" != "${admin##*:}" ] && break
  done
  dir=$(mktemp -d /tmp/keyguard-redis.XXXX)
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" --daemonize no \
    --logfile "$dir/redis.log" &
  redis_pid=$!
  for _ in $(seq 600); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && break
    kill -0 "$redis_pid" 2>/dev/null || { echo "redis-server did not start: $dir/redis.log" >&2; exit 1; }
    sleep 0.05
  done
  echo "started a private redis-server on 127.0.0.1:$port (log: $dir/redis.log)"
  args+=(--upstream "127.0.0.1:$port")
fi
echo "connect with: redis-cli -p 6380 (unless --listen says otherwise); metrics: curl http://127.0.0.1:9121/metrics"
./build/keyguard "${args[@]}" &
kg=$!
status=0
wait "$kg" || status=$?
kg=""  # it has exited: nothing to stop
exit "$status"
