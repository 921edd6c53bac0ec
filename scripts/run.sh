#!/usr/bin/env bash
# Installs what is missing, builds, and runs keyguard in the foreground.
#   scripts/run.sh [keyguard flags...]
# Without --upstream (and without a config file), it starts a private redis-server on a free port
# and proxies to it. Defaults: clients connect to 127.0.0.1:6380, metrics at 127.0.0.1:9121.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh run
bash scripts/build.sh release >/dev/null
args=("$@")
if [[ " ${args[*]-} " != *" --upstream"* && " ${args[*]-} " != *" --config"* ]]; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  dir=$(mktemp -d /tmp/keyguard-redis.XXXX)
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" --daemonize no \
    --logfile "$dir/redis.log" &
  redis_pid=$!
  trap 'kill $redis_pid 2>/dev/null; wait $redis_pid 2>/dev/null; rm -rf "$dir"' EXIT
  for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
  echo "started a private redis-server on 127.0.0.1:$port (log: $dir/redis.log)"
  args+=(--upstream "127.0.0.1:$port")
fi
echo "connect with: redis-cli -p 6380 (unless --listen says otherwise); metrics: curl http://127.0.0.1:9121/metrics"
./build/keyguard "${args[@]}" &
kg=$!
trap 'kill -TERM $kg 2>/dev/null; wait $kg; [ -n "${redis_pid:-}" ] && kill $redis_pid 2>/dev/null; rm -rf "${dir:-/nonexistent}"' EXIT INT TERM
wait $kg
