#!/usr/bin/env bash
# The global layer at scale on MariaDB (not part of the test command): three regions, one
# release gateway each (embedded origin, a private MariaDB database of the run's), KEYS active
# keys in every region, RATE requests/s on each gateway (default 2,000), and SEED more live rows
# written straight into the table before the gateways start (a region of no gateway's, an hour's
# window: rows every sync must not read again and again; default 0). Three phases, each measured
# for PHASE seconds after a warm-up that makes every key live in every region:
#   idle   no load at all (what the gateways read for nothing changing);
#   busy   the load runs over all KEYS keys (most cells change every second);
#   quiet  the load runs over the first QUIET_KEYS keys only (KEYS cells stay live, few change).
# PHASES names the ones to run, in order (default "idle busy quiet").
# For each phase: SQL rows read and written per second (MariaDB's Handler_read_* and Handler_write +
# Handler_update over the phase, divided by the gateways), syncs and the cells they returned per gateway per second, and a
# sync's mean duration (strata_global_sync_seconds / strata_global_syncs_total). SYNC_FULL sets
# --sync-full-interval (1ms: every sync reads every row; 60s: the full read of older builds).
#
#   cargo build --release -p strata-gateway --bins --example loadgen
#   scripts/bench-sync.sh                                # 100,000 keys, default settings
#   SYNC_FULL=1ms scripts/bench-sync.sh                  # every sync a full read
#   SEED=1000000 KEYS=10000 WARM=20 scripts/bench-sync.sh  # 10^6 live rows, 1% of them busy
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/strata/target}"
KEYS=${KEYS:-100000}
QUIET_KEYS=${QUIET_KEYS:-1000}
RATE=${RATE:-2000}
WARM=${WARM:-60}
PHASE=${PHASE:-20}
SYNC_FULL=${SYNC_FULL:-1h}
SEED=${SEED:-0}
PHASES=${PHASES:-idle busy quiet}
gateway="$CARGO_TARGET_DIR/release/strata-gateway"
loadgen="$CARGO_TARGET_DIR/release/examples/loadgen"
require_built "run the build line above" "$gateway" "$loadgen"
mysql -uroot -h127.0.0.1 -e 'SELECT 1' >/dev/null || { echo "MariaDB is not on 127.0.0.1:3306 (the test command starts it)" >&2; exit 1; }

db="strata_bench_sync_$$"
work=$(mktemp -d)
pids=()
cleanup() {
  kill "${pids[@]}" 2>/dev/null || true
  [ -n "${KEEP_LOGS:-}" ] && cp "$work"/*.log /tmp/ 2>/dev/null
  mysql -uroot -h127.0.0.1 -e "DROP DATABASE IF EXISTS $db" || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
mysql -uroot -h127.0.0.1 -e "CREATE DATABASE $db"
if [ "$SEED" -gt 0 ]; then
  "$gateway" --database-url "mysql://root@127.0.0.1:3306/$db" migrate >/dev/null
  # An hour's window of the current hour, live for two (WindowDuration::expires_at), from
  # MariaDB's sequence engine.
  mysql -uroot -h127.0.0.1 "$db" -e "
    SET @seq = FLOOR(UNIX_TIMESTAMP() / 3600);
    INSERT INTO ratelimit_window_counts
      (workspace_id, namespace, identifier, duration_ms, sequence, region, count, expires_at, updated_at, stamp)
    SELECT 'default', 'seed', CONCAT('k', seq), 3600000, @seq, 'seed', 5, (@seq + 2) * 3600000,
      CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS UNSIGNED), 0
    FROM seq_1_to_$SEED;"
  echo "seeded $SEED live rows"
fi

regions=(eu us ap)
declare -A port
for r in "${regions[@]}"; do
  port[$r]=$(free_port)
  "$gateway" --region "$r" --listen "127.0.0.1:${port[$r]}" --data-dir "$work/$r" \
    --database-url "mysql://root@127.0.0.1:3306/$db" --sync-full-interval "$SYNC_FULL" \
    >"$work/$r.log" 2>&1 &
  pids+=($!)
done
for r in "${regions[@]}"; do wait_port "${port[$r]}" || { cat "$work/$r.log"; exit 1; }; done

# load KEYS SECONDS : loadgen against every gateway at once, RATE requests/s each (the machine's
# two cores also run MariaDB), limit 10 a minute: a key's first request crosses the publish
# floor, so every touched cell is published.
load() {
  local lp=()
  for r in "${regions[@]}"; do
    "$loadgen" --url "http://127.0.0.1:${port[$r]}" --keys "$1" --limit 10 --concurrency 4 --rate "$RATE" \
      --seconds "$2" >"$work/load-$r.txt" 2>&1 &
    lp+=($!)
  done
  wait "${lp[@]}"
}

# handler : MariaDB's rows read (every Handler_read_*: index lookups, index and table scans)
# and rows written (Handler_write + Handler_update), server-wide.
handler() {
  mysql -uroot -h127.0.0.1 -N -e "SHOW GLOBAL STATUS LIKE 'Handler_%'" |
    awk '$1 ~ /^Handler_read_/ {r+=$2} $1 == "Handler_write" || $1 == "Handler_update" {w+=$2} END {print r, w}'
}

# gateways : summed over the gateways: syncs, full syncs, cells returned, sync seconds.
gateways() {
  for r in "${regions[@]}"; do curl -s "127.0.0.1:${port[$r]}/metrics"; done | awk '
    /^strata_global_syncs_total / {s+=$2} /^strata_global_full_syncs_total / {f+=$2}
    /^strata_global_sync_rows_applied_total / {c+=$2} /^strata_global_sync_seconds_total / {t+=$2}
    END {print s, f, c, t}'
}

rows_live() { mysql -uroot -h127.0.0.1 -N -e "SELECT COUNT(*) FROM $db.ratelimit_window_counts"; }

phase() {
  local name=$1 keys=$2 r0 w0 s0 f0 c0 t0 r1 w1 s1 f1 c1 t1 n=${#regions[@]}
  read -r r0 w0 < <(handler)
  read -r s0 f0 c0 t0 < <(gateways)
  if [ "$keys" -gt 0 ]; then load "$keys" "$PHASE"; else rm -f "$work"/load-*.txt; sleep "$PHASE"; fi
  read -r r1 w1 < <(handler)
  read -r s1 f1 c1 t1 < <(gateways)
  awk -v name="$name" -v keys="$keys" -v p="$PHASE" -v n="$n" -v live="$(rows_live)" \
    -v dr=$((r1 - r0)) -v dw=$((w1 - w0)) -v ds=$((s1 - s0)) -v df=$((f1 - f0)) -v dc=$((c1 - c0)) \
    -v dt="$(echo "$t1 - $t0" | bc -l)" 'BEGIN {
      printf "  %-6s load over %6d keys, %6d rows in the table: per gateway per second: SQL rows read %9.0f, written %7.0f; syncs %.2f (full %.2f), cells returned %8.0f; a sync %.1f ms\n",
        name, keys, live, dr / p / n, dw / p / n, ds / p / n, df / p / n, dc / p / n, (ds > 0 ? 1000 * dt / ds : 0)
    }'
  if [ "$keys" -gt 0 ]; then sed 's/^/      /' "$work"/load-*.txt; fi
}

# Every gateway's first sync reads every live row (seconds at a million): measured phases start
# after it, so that the idle phase measures what a running gateway reads.
deadline=$((SECONDS + 600))
for r in "${regions[@]}"; do
  until curl -s "127.0.0.1:${port[$r]}/metrics" | awk '/^strata_global_full_syncs_total / {f=$2} END {exit !(f >= 1)}'; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "$r made no full sync within 600 s" >&2; exit 1; }
    sleep 1
  done
done
echo "Three regions on MariaDB, $KEYS keys, --sync-full-interval $SYNC_FULL; warming up for ${WARM}s"
load "$KEYS" "$WARM"
for p in $PHASES; do
  case $p in
    idle) phase idle 0 ;;
    busy) phase busy "$KEYS" ;;
    quiet) phase quiet "$QUIET_KEYS" ;;
    *) echo "PHASES: idle, busy or quiet, not $p" >&2; exit 2 ;;
  esac
done
