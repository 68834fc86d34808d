#!/usr/bin/env bash
# Gateway throughput harness (not part of the test command). Builds release binaries, then in
# each round runs wrk against, in turn, a bare axum endpoint of /v1/ratelimit's shape, the
# gateway on its embedded origin, and the gateway on a private Redis, each freshly started,
# round-robin over each key count. Prints requests/s, p50, p99, the ratio to bare in the same
# round (after a warm-up, not counted, long enough to decide every key once), p99.9 and the
# slowest request, the server's CPU seconds, decisions per CPU second
# and resident memory after the run, and for the gateway the origin round trips per 1,000
# decisions and (on Redis) Redis commands per decision and per replayed cell, from INFO
# commandstats (commands scripts run included).
#
#   scripts/bench.sh                      # 2 rounds, 3 s warm-up + 10 s runs, 64 connections, 1 and 10000 keys
#   ROUNDS=3 DURATION=5 KEYS="1 100000" scripts/bench.sh
#   PIN=1 ROUNDS=1 DURATION=30 KEYS=1000000 scripts/bench.sh
#                                         # a million keys: the warm-up (66 s) decides each
#                                         # key once; a gateway's memory shows in "rss MB"
#   CLUSTER=1 scripts/bench.sh          # also the gateway on a private 3-node Redis Cluster
#   PIN=1 scripts/bench.sh              # each server on CPU 1, wrk and Redis on CPU 0 (taskset):
#                                         # less noise between rounds, and Redis never takes
#                                         # the gateway's core (as on a host of its own)
#   EXTRA="name=cmd with args" EXTRA_API=limitador scripts/bench.sh
#                                         # one more contender on 127.0.0.1:8093 (EXTRA_API:
#                                         # the request shape bench/ratelimit.lua sends it)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/strata/target}"
ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-10}
WARMUP=${WARMUP:-3}
WARM_RATE=${WARM_RATE:-15000} # the slowest rate the warm-up's length assumes, requests/s
CONNS=${CONNS:-64}
KEYS=${KEYS:-"1 10000"}
EXTRA=${EXTRA:-}
EXTRA_API=${EXTRA_API:-strata}
CLUSTER=${CLUSTER:-0}
PIN=${PIN:-0}
SERVER_CPU=()
WRK_CPU=()
if [ "$PIN" = 1 ]; then
  command -v taskset >/dev/null || { echo "bench: PIN=1 needs taskset (util-linux)" >&2; exit 1; }
  SERVER_CPU=(taskset -c 1)
  WRK_CPU=(taskset -c 0)
fi
REDIS_CPU=("${WRK_CPU[@]}")

command -v wrk >/dev/null 2>&1 || apt_install wrk
command -v redis-server >/dev/null || { echo "bench: redis-server is needed (scripts/test.sh installs it)" >&2; exit 1; }

cargo build --release -q -p strata-gateway --bin strata-gateway --example bare
BIN="$CARGO_TARGET_DIR/release"
GATEWAY=${GATEWAY:-$BIN/strata-gateway} # another build of the gateway to compare, e.g. an older commit's
WORK=$(mktemp -d /tmp/strata-bench.XXXXXX)
REDIS_PORT=$(free_port)
CLUSTER_PORTS=()
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  local p
  for p in "$REDIS_PORT" "${CLUSTER_PORTS[@]}"; do
    redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
"${REDIS_CPU[@]}" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --daemonize yes --logfile "$WORK/redis.log" --dir "$WORK" >/dev/null
for _ in $(seq 50); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
if [ "$CLUSTER" = 1 ]; then
  for _ in 1 2 3; do
    port=$(free_port)
    # The cluster bus listens on the port + 10000, which must be a port too.
    while [ "$port" -gt 55535 ]; do port=$(free_port); done
    mkdir -p "$WORK/node-$port"
    "${REDIS_CPU[@]}" redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --cluster-enabled yes \
      --cluster-config-file nodes.conf --daemonize yes --logfile "$WORK/node-$port/redis.log" \
      --dir "$WORK/node-$port" >/dev/null
    CLUSTER_PORTS+=("$port")
  done
  for port in "${CLUSTER_PORTS[@]}"; do
    for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  done
  redis-cli --cluster create "${CLUSTER_PORTS[@]/#/127.0.0.1:}" --cluster-replicas 0 --cluster-yes >/dev/null
  for port in "${CLUSTER_PORTS[@]}"; do
    until redis-cli -p "$port" cluster info | grep -q cluster_state:ok; do sleep 0.1; done
  done
fi
REDIS_PORTS=("$REDIS_PORT") # the Redis servers of the contender being measured
rcli() { local p; for p in "${REDIS_PORTS[@]}"; do redis-cli -p "$p" "$@"; done; }

cpu_seconds() { # utime + stime of a process, in seconds
  awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / hz }' "/proc/$1/stat"
}
metric_sum() { # the sum of a gateway metric's samples whose line matches $2
  curl -s "127.0.0.1:$1/metrics" | awk -v pat="$2" '$0 ~ pat && $1 !~ /^#/ { s += $NF } END { printf "%d", s }'
}
redis_calls() { rcli info commandstats | awk -F'[=,:]' '/^cmdstat_/ && !/^cmdstat_(info|config|flushall):/ { s += $3 } END { printf "%d", s }'; }
rss_mb() { awk '/^VmRSS:/ { printf "%d", $2 / 1024 }' "/proc/$1/status"; }
redis_cpu() { rcli info cpu | awk -F: '/^used_cpu_(sys|user):/ { s += $2 } END { printf "%.2f", s }'; }

start() { # name port command...: starts a contender, waits until it accepts connections
  local name=$1 port=$2
  shift 2
  "${SERVER_CPU[@]}" "$@" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!)
  SERVER=$!
  wait_port "$port" && return 0
  echo "bench: $name did not start; its log:" >&2
  cat "$WORK/$name.log" >&2
  exit 1
}
stop() { kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; }

ROW='%-6s %-8s %-10s %8s %7s %7s %8s %8s %6s %6s %9s %6s %8s %8s %8s\n'
printf "$ROW" round keys contender "req/s" "p50 us" "p99 us" "p99.9 us" "max us" "x bare" "cpu s" "req/cpu s" "rss MB" "rt/1000" "cmd/dec" "cmd/cell"
for round in $(seq "$ROUNDS"); do
  for keys in $KEYS; do
    bare_rps=""
    contenders=(bare embedded redis)
    [ "$CLUSTER" = 1 ] && contenders+=(cluster)
    [ -n "$EXTRA" ] && contenders+=(extra)
    for c in "${contenders[@]}"; do
      port=8090
      gw_args=(--listen 127.0.0.1:8091 --database-url "sqlite://$WORK/global-$c.db")
      case $c in
        bare) start bare 8090 "$BIN/examples/bare" 127.0.0.1:8090 ;;
        embedded) port=8091; start "$c" 8091 "$GATEWAY" "${gw_args[@]}" ;;
        redis)
          port=8091
          REDIS_PORTS=("$REDIS_PORT")
          rcli flushall >/dev/null
          start "$c" 8091 "$GATEWAY" "${gw_args[@]}" --redis-url "redis://127.0.0.1:$REDIS_PORT/"
          ;;
        cluster)
          port=8091
          REDIS_PORTS=("${CLUSTER_PORTS[@]}")
          rcli flushall >/dev/null
          seeds=$(printf 'redis://127.0.0.1:%s/,' "${CLUSTER_PORTS[@]}")
          start "$c" 8091 "$GATEWAY" "${gw_args[@]}" --redis-cluster "${seeds%,}"
          ;;
        extra) port=8093; start "${EXTRA%%=*}" 8093 bash -c "exec ${EXTRA#*=}" ;;
      esac
      api=strata
      [ "$c" = extra ] && api=$EXTRA_API
      # Every key warm first (cold keys are a one-time cost per key, not the steady state):
      # WARMUP seconds, or long enough to reach every key at WARM_RATE requests/s.
      warm=$(( keys / WARM_RATE > WARMUP ? keys / WARM_RATE : WARMUP ))
      warmed=$("${WRK_CPU[@]}" wrk -t1 -c"$CONNS" -d"${warm}s" -s bench/ratelimit.lua "http://127.0.0.1:$port" -- "$keys" "$api" | sed -n 's/^WRK requests=\([0-9]*\).*/\1/p')
      [ "${warmed:-0}" -ge "$keys" ] || echo "  $c: the ${warm} s warm-up reached ${warmed:-0} of $keys keys: set WARM_RATE lower" >&2
      rt0=0; cells0=0
      if [ "$port" = 8091 ]; then
        rt0=$(metric_sum 8091 '^strata_origin_calls_total')
        cells0=$(metric_sum 8091 '^strata_replay_cells_total')
      fi
      rcli config resetstat >/dev/null
      rcpu0=$(redis_cpu)
      cpu0=$(cpu_seconds "$SERVER")
      out=$("${WRK_CPU[@]}" wrk -t1 -c"$CONNS" -d"${DURATION}s" --latency -s bench/ratelimit.lua "http://127.0.0.1:$port" -- "$keys" "$api")
      cpu1=$(cpu_seconds "$SERVER")
      rss=$(rss_mb "$SERVER")
      read_wrk "$out" || exit 1
      rps=$(awk -v r="$requests" -v s="$seconds" 'BEGIN { printf "%d", r / s }')
      [ "$c" = bare ] && bare_rps=$rps
      ratio=$(awk -v a="$rps" -v b="$bare_rps" 'BEGIN { printf "%.2f", a / b }')
      cpu=$(awk -v a="$cpu0" -v b="$cpu1" 'BEGIN { printf "%.2f", b - a }')
      per_cpu=$(awk -v r="$requests" -v c="$cpu" 'BEGIN { printf "%d", (c > 0) ? r / c : 0 }')
      rt="-"; cmd="-"; per_cell="-"
      if [ "$port" = 8091 ]; then
        # The replay buffer drains within one interval of the load stopping: wait for it so
        # the commands it costs are counted against the decisions that caused them.
        sleep 0.5
        rt1=$(metric_sum 8091 '^strata_origin_calls_total')
        cells=$(( $(metric_sum 8091 '^strata_replay_cells_total') - cells0 ))
        rt=$(awk -v a="$rt0" -v b="$rt1" -v r="$requests" 'BEGIN { printf "%.1f", (b - a) * 1000 / r }')
        if [ "$c" = redis ] || [ "$c" = cluster ]; then
          calls=$(redis_calls)
          cmd=$(awk -v a="$calls" -v r="$requests" 'BEGIN { printf "%.2f", a / r }')
          per_cell=$(awk -v a="$calls" -v c="$cells" 'BEGIN { printf "%.2f", (c > 0) ? a / c : 0 }')
          echo "  $c: $calls commands ($(rcli info commandstats | grep -o '^cmdstat_[a-z]*:calls=[0-9]*' | sed 's/cmdstat_//; s/:calls=/=/' | tr '\n' ' ')), $cells replayed cells, cpu $(awk -v a="$rcpu0" -v b="$(redis_cpu)" 'BEGIN { printf "%.2f", b - a }') s" >&2
        fi
      fi
      [ "$errors" -eq 0 ] || echo "  $c: $errors failed requests" >&2
      printf "$ROW" "$round" "$keys" "$c" "$rps" "$p50_us" "$p99_us" "$p999_us" "$max_us" "$ratio" "$cpu" "$per_cpu" "$rss" "$rt" "$cmd" "$per_cell"
      stop
    done
  done
done
