# Helpers the bench scripts share (sourced: `. bench/lib.sh` from the repository's root).

# A free TCP port on 127.0.0.1.
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# The 1-minute load average.
load1() { awk '{print $1}' /proc/loadavg; }

# With MAX_LOAD set (not empty), waits until the 1-minute load average is below it, looking every
# 30 s for up to WAIT_LOAD seconds (default $1); then prints the load averages.
wait_for_quiet() {
  if [ -n "${MAX_LOAD:-}" ]; then
    local waited=0
    while awk -v l="$(load1)" -v m="$MAX_LOAD" 'BEGIN{exit !(l >= m)}' && [ "$waited" -lt "${WAIT_LOAD:-$1}" ]; do
      echo "load average $(load1) >= $MAX_LOAD, waiting 30 s" >&2
      sleep 30; waited=$((waited + 30))
    done
  fi
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
}

# Kills the processes in `pids` and removes $D unless KEEP is set (the scripts' EXIT trap).
pids=()
bench_cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "${KEEP:-}" ] || rm -rf "$D"
}

# The CPU ticks (user + system) process $1 has used so far; 0 for pid 0 (no process: direct).
cpu() { [ "$1" = 0 ] && echo 0 || awk '{print $14+$15}' "/proc/$1/stat"; }
# Microseconds of CPU per command from two cpu() readings over $3 SETs and $3 GETs.
us_per_cmd() { awk -v a="$1" -v b="$2" -v hz="$(getconf CLK_TCK)" -v n="$3" 'BEGIN{printf "%.2f", (b-a)/hz*1e6/(2*n)}'; }
