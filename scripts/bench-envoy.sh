#!/usr/bin/env bash
# The Envoy filter's cost under wrk (not part of the test command). Envoy 1.40 (the test
# command's venv) answers from a `direct_response` route, so no upstream hides the filters'
# share. Each round runs, side by side and in turn: Envoy with no Wasm filter, with its own
# `local_ratelimit` (one token bucket far from empty: what a native filter costs), with the no-op
# filter of bench/noop-filter (the floor any Wasm filter pays: V8, a context per stream, one
# header read), and with Strata's filter on a warm key far from its limit, each at
# `--concurrency 1` under `wrk -t1 -c32`. Then Strata's filter at `--concurrency 2` with KEYS
# keys drawn with Zipf s = ZIPF_S (default 1.1; 0: uniform; bench/zipf-keys.lua) beside Envoy
# with no Wasm filter at the same concurrency, and where its requests were decided.
# BASELINE_WASM adds another build of the filter beside the current one in both parts, and
# FILTER_CONFIG adds settings to the Strata filters' configuration (`'"shared_slots": 0,'`,
# `'"headers_on_pass": false,'`: what a part costs); BASELINE_CONFIG gives the baseline other
# settings (alone: the current build with them, e.g. `'"failure_mode": "deny",'`). Before the rounds, each Envoy's resident
# memory after start and its CPU over 5 s idle. PIN=1 runs every Envoy on CPU 0 and wrk and the
# gateway on CPU 1 (ENVOY_CPUS and LOAD_CPUS for other sets): on a 2-core machine the load
# generator otherwise takes turns with Envoy, and rounds of one build vary by a third.
#
#   ./scripts/build-envoy.sh && cargo build --release -p strata-gateway
#   scripts/bench-envoy.sh                             # 3 rounds of 5 s, 10,000 keys
#   ROUNDS=5 DURATION=10 KEYS=100000 scripts/bench-envoy.sh
#   BASELINE_WASM=/tmp/old.wasm scripts/bench-envoy.sh
#   BASELINE_CONFIG='"failure_mode": "deny",' scripts/bench-envoy.sh
#   PIN=1 ROUNDS=10 DURATION=3 WARM="baseline strata" BASELINE_WASM=/tmp/old.wasm scripts/bench-envoy.sh
#   PIN=1 UPSTREAM=envoy scripts/bench-envoy.sh         # proxied to an upstream Envoy
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/strata/target}"
ROUNDS=${ROUNDS:-3}
if [ "${PIN:-}" = 1 ]; then
  export ENVOY_CPUS=${ENVOY_CPUS:-0} LOAD_CPUS=${LOAD_CPUS:-1}
fi
DURATION=${DURATION:-5}
KEYS=${KEYS:-10000}
ZIPF_S=${ZIPF_S:-1.1}
FILTER_CONFIG=${FILTER_CONFIG:-}
envoy=wasm-tests/envoy-venv/bin/envoy
gateway="$CARGO_TARGET_DIR/release/strata-gateway"
strata="$PWD/envoy-wasm/dist/strata_envoy.wasm"
require_built "run the test command, then the build lines above" "$envoy" "$gateway" "$strata"
command -v wrk >/dev/null || apt_install wrk
(cd bench/noop-filter && CARGO_TARGET_DIR="$CARGO_TARGET_DIR/noop-filter" \
  cargo build -q --release --target wasm32-wasip1)
noop="$CARGO_TARGET_DIR/noop-filter/wasm32-wasip1/release/noop_filter.wasm"

work=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT INT TERM

gw_port=$(free_port)
${LOAD_CPUS:+taskset -c "$LOAD_CPUS"} "$gateway" --listen "127.0.0.1:$gw_port" --data-dir "$work/gw" \
  >"$work/gateway.log" 2>&1 &
pids+=($!)
wait_port "$gw_port" || { cat "$work/gateway.log"; exit 1; }

# envoy_config NAME WASM|- : a config from envoy-wasm/envoy.yaml on free ports (its listener
# and admin ports in NAME.ports).
envoy_config() {
  local name=$1 wasm=$2 extra=${3-$FILTER_CONFIG} port admin
  port=$(free_port); admin=$(free_port)
  python3 - "$name" "$wasm" "$port" "$admin" "$gw_port" "$extra" "${up_port:-}" >"$work/$name.yaml" <<'PY'
import sys
name, wasm, port, admin, gw, extra, up = sys.argv[1:]
LOCAL = """          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: local
              token_bucket: { max_tokens: 1000000000, tokens_per_fill: 1000000000, fill_interval: 1s }
              filter_enabled: { default_value: { numerator: 100, denominator: HUNDRED } }
              filter_enforced: { default_value: { numerator: 100, denominator: HUNDRED } }
"""
s = open("envoy-wasm/envoy.yaml").read()
s = s.replace("port_value: 9901", f"port_value: {admin}").replace("port_value: 10000", f"port_value: {port}")
if up:
    # Proxied to the upstream Envoy: only the upstream cluster's port changes here.
    a = s.index("  - name: upstream")
    b = s.index("  - name: strata_gateway")
    s = s[:a] + s[a:b].replace("port_value: 8080", f"port_value: {up}") + s[b:]
else:
    s = s.replace("route: { cluster: upstream }", 'direct_response: { status: 200, body: { inline_string: "ok" } }')
s = s.replace("port_value: 8080", f"port_value: {gw}")
s = s.replace('"limit": 5,', '"limit": 1000000000,').replace("vm_id: strata", f"vm_id: {name}")
s = s.replace('"stat_prefix": "strata",', '"stat_prefix": "strata", ' + extra)
start, end = s.index("          - name: envoy.filters.http.wasm"), s.index("          - name: envoy.filters.http.router")
if wasm == "-":
    s = s[:start] + s[end:]
elif wasm == "local_ratelimit":
    # Envoy's own local rate limit, one token bucket far from empty: a native filter's cost.
    s = s[:start] + LOCAL + s[end:]
else:
    s = s.replace("envoy-wasm/dist/strata_envoy.wasm", wasm)
print(s, end="")
PY
  echo "$port $admin" >"$work/$name.ports"
}

# start NAME CONCURRENCY : starts the config's Envoy; sets PORT and ADMIN, and its pid in
# pid[NAME].
declare -A pid pid_at
start() {
  read -r PORT ADMIN <"$work/$1.ports"
  start_envoy "$envoy" "$work/$1.yaml" "$2" "$PORT" "$work/$1.log"
  pid[$1]=$ENVOY_PID
  pid_at[$PORT]=$ENVOY_PID
}

# ticks PID : the process's user and system CPU so far, in clock ticks.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# load PORT [wrk args...] : requests/s, p50, p99, and the CPU the Envoy on PORT spent per
# request (all its threads): steadier than requests/s where the load generator and other
# processes take turns on the same cores.
load() {
  local t0 line rps
  t0=$(ticks "${pid_at[$1]}")
  line=$(wrk_line 32 "$DURATION" "$@")
  rps=$(awk '{print $1}' <<<"$line")
  printf "%s  CPU %6.1f us/req" "$line" \
    "$(echo "($(ticks "${pid_at[$1]}") - $t0) * 1000000 / $(getconf CLK_TCK) / ($rps * $DURATION + 1)" | bc -l)"
}
warm() { load "$1" -H "x-api-key: warm"; }

# UPSTREAM=envoy: the Envoys under test proxy every request to one more Envoy, with no filter,
# answering from a `direct_response` route (on the load's CPUs when pinned), as a deployed
# Envoy forwards to a service, instead of answering themselves.
up_port=""
if [ "${UPSTREAM:-}" = envoy ]; then
  envoy_config upstream -
  read -r up_port _ <"$work/upstream.ports"
  ENVOY_CPUS=${LOAD_CPUS:-} start upstream 1
fi

names=(none local noop strata)
envoy_config none -
envoy_config local local_ratelimit
envoy_config noop "$noop"
envoy_config strata "$strata"
baseline_wasm=${BASELINE_WASM:-}
[ -n "${BASELINE_CONFIG:-}" ] && baseline_wasm=${baseline_wasm:-$strata}
baseline_config=${BASELINE_CONFIG:-$FILTER_CONFIG}
if [ -n "$baseline_wasm" ]; then
  envoy_config baseline "$baseline_wasm" "$baseline_config"
  names+=(baseline)
fi
# WARM="baseline strata" runs only these in the warm part, in this order (ratios to the first).
[ -n "${WARM:-}" ] && read -r -a names <<<"$WARM"
declare -A port admin
for n in "${names[@]}"; do start "$n" 1; port[$n]=$PORT; admin[$n]=$ADMIN; done
# idle NAME... : each Envoy's resident memory now and its CPU over the next 5 s.
idle() {
  local n cpu0=()
  for n in "$@"; do cpu0+=("$(ticks "${pid[$n]}")"); done
  sleep 5
  local i=0
  for n in "$@"; do
    printf "  %-12s resident %6d kB, idle CPU %4d ms in 5 s\n" "$n" \
      "$(awk '/VmRSS/ {print $2}' "/proc/${pid[$n]}/status")" \
      "$(( ($(ticks "${pid[$n]}") - ${cpu0[$i]}) * 1000 / $(getconf CLK_TCK) ))"
    i=$((i + 1))
  done
}
echo "Each Envoy after start:"
idle "${names[@]}"
echo "Warm key, --concurrency 1, wrk -t1 -c32 -d${DURATION}s; ratio to the first (no Wasm filter unless WARM says) in the same round:"
contenders=()
for n in "${names[@]}"; do contenders+=("$n=${port[$n]}"); done
ratio_rounds "$ROUNDS" warm "${contenders[@]}"

keyed=(strata)
[ -n "$baseline_wasm" ] && keyed+=(baseline)
envoy_config none-keys -
start none-keys 2; port[none-keys]=$PORT
for n in "${keyed[@]}"; do
  if [ "$n" = strata ]; then
    envoy_config "$n-keys" "$strata"
  else
    envoy_config "$n-keys" "$baseline_wasm" "$baseline_config"
  fi
  start "$n-keys" 2; port[$n-keys]=$PORT; admin[$n-keys]=$ADMIN
done
echo "The --concurrency 2 Envoys after start:"
idle none-keys "${keyed[@]/%/-keys}"
echo "$KEYS keys (Zipf $ZIPF_S), --concurrency 2; ratio to no Wasm filter in the same round:"
zipf() { KEYS=$KEYS ZIPF_S=$ZIPF_S load "$1" -s bench/zipf-keys.lua; }
contenders=("none=${port[none-keys]}")
for n in "${keyed[@]}"; do contenders+=("$n=${port[$n-keys]}"); done
ratio_rounds "$ROUNDS" zipf "${contenders[@]}"
for n in "${keyed[@]}"; do
  curl -s "127.0.0.1:${admin[$n-keys]}/stats" | awk -v n="$n" '
    /wasmcustom.strata.decided.local:/ {l=$2} /wasmcustom.strata.decided.origin:/ {o=$2}
    /wasmcustom.strata.decided.ahead:/ {a=$2} /wasmcustom.strata.origin.calls:/ {c=$2}
    /wasmcustom.strata.replay.ok:/ {r=$2}
    END {t=l+o+a; printf "  %-9s decided locally %d, ahead of the gateway %d, at the gateway %d (%.1f per 1,000 waited), gateway calls %d (%.1f per 1,000), replay batches %d\n", n, l, a, o, 1000*o/t, c, 1000*c/t, r}'
done
