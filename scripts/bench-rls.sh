#!/usr/bin/env bash
# Envoy's own `ratelimit` filter against Strata's rate-limit service, beside the Strata Wasm
# filter and beside no limiting at all (not part of the test command). Envoy 1.40 (the test
# command's venv), `--concurrency 1`, `wrk -t1 -c32`; the upstream is a `direct_response`
# listener of the same Envoy (the `ratelimit` filter acts only on routes to a cluster, so every
# variant takes the same extra hop). Each round runs, in turn:
#   none    no rate limiting;
#   rls     envoy-wasm/envoy-rls.yaml's `ratelimit` filter calling a release gateway's
#           `--rls-listen` (a limit far above the load, so every request is decided, none denied);
#   wasm    envoy-wasm/envoy.yaml's Strata filter with the same limit, calling the same gateway
#           for cold keys and replays.
# First one warm key, then KEYS keys (Zipf s = ZIPF_S, default 1.1; bench/zipf-keys.lua). For
# each run: requests/s, p50, p99, the ratio to `none` in the same round, and the gateway's CPU
# per request (its utime + stime over the run, from /proc).
#
#   ./scripts/build-envoy.sh && cargo build --release -p strata-gateway
#   scripts/bench-rls.sh                               # 3 rounds of 5 s, 10,000 keys
#   ROUNDS=5 DURATION=10 scripts/bench-rls.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/strata/target}"
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5}
KEYS=${KEYS:-10000}
ZIPF_S=${ZIPF_S:-1.1}
envoy=wasm-tests/envoy-venv/bin/envoy
gateway="$CARGO_TARGET_DIR/release/strata-gateway"
strata="$PWD/envoy-wasm/dist/strata_envoy.wasm"
require_built "run the test command, then the build lines above" "$envoy" "$gateway" "$strata"
command -v wrk >/dev/null || apt_install wrk

work=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT INT TERM

# envoy-wasm/rls.yaml with a limit no run reaches.
sed 's/requests_per_unit: 5$/requests_per_unit: 4000000000/' envoy-wasm/rls.yaml >"$work/rls.yaml"
gw_port=$(free_port)
rls_port=$(free_port)
"$gateway" --listen "127.0.0.1:$gw_port" --data-dir "$work/gw" \
  --rls-listen "127.0.0.1:$rls_port" --rls-config "$work/rls.yaml" >"$work/gateway.log" 2>&1 &
gw_pid=$!
pids+=("$gw_pid")
wait_port "$gw_port" || { cat "$work/gateway.log"; exit 1; }

# envoy_config NAME : the Envoy of variant NAME on free ports (listener, admin, upstream in
# NAME.ports).
envoy_config() {
  local name=$1 port admin up
  port=$(free_port); admin=$(free_port); up=$(free_port)
  python3 - "$name" "$strata" "$port" "$admin" "$up" "$gw_port" "$rls_port" >"$work/$name.yaml" <<'PY'
import sys
name, wasm, port, admin, up, gw, rls = sys.argv[1:]
source = "envoy-wasm/envoy.yaml" if name == "wasm" else "envoy-wasm/envoy-rls.yaml"
s = open(source).read()
s = s.replace("port_value: 9901", f"port_value: {admin}").replace("port_value: 10000", f"port_value: {port}")
s = s.replace("port_value: 8081", f"port_value: {rls}")
# The upstream cluster to this Envoy's own direct_response listener; the wasm gateway cluster
# to the gateway.
first = s.index("port_value: 8080")
s = s[:first] + f"port_value: {up}" + s[first + len("port_value: 8080"):]
s = s.replace("port_value: 8080", f"port_value: {gw}")
s = s.replace('"limit": 5,', '"limit": 4000000000,').replace("vm_id: strata", f"vm_id: {name}")
if name == "none":
    start, end = s.index("          - name: envoy.filters.http.ratelimit"), s.index("          - name: envoy.filters.http.router")
    s = s[:start] + s[end:]
upstream = f"""
  - name: upstream_listener
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {up} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: upstream_http
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                direct_response: {{ status: 200, body: {{ inline_string: "ok" }} }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"""
s = s.replace("\n  clusters:", upstream + "\n  clusters:", 1)
print(s, end="")
PY
  echo "$port $admin" >"$work/$name.ports"
}

declare -A port admin
# start NAME : starts variant NAME's Envoy; its ports in port[NAME] and admin[NAME].
start() {
  local p a
  read -r p a <"$work/$1.ports"
  start_envoy "$envoy" "$work/$1.yaml" 1 "$p" "$work/$1.log"
  port[$1]=$p
  admin[$1]=$a
}

names=(none rls wasm)
for n in "${names[@]}"; do envoy_config "$n"; start "$n"; done

gateway_ticks() { awk '{print $14 + $15}' "/proc/$gw_pid/stat"; }

# run LABEL [wrk args...] : each variant in turn, ROUNDS times.
run() {
  local label=$1; shift
  echo "$label, --concurrency 1, wrk -t1 -c32 -d${DURATION}s; ratio to no limiting in the same round:"
  for r in $(seq "$ROUNDS"); do
    local base=""
    for n in "${names[@]}"; do
      local t0 out rps p50 p99 requests cpu
      t0=$(gateway_ticks)
      out=$(KEYS=$KEYS ZIPF_S=$ZIPF_S wrk -t1 -c32 -d"${DURATION}s" --latency "$@" "http://127.0.0.1:${port[$n]}/")
      cpu=$(( ($(gateway_ticks) - t0) * 1000000 / $(getconf CLK_TCK) ))
      read -r rps p50 p99 requests < <(awk '/^ +50%/{p50=$2} /^ +99%/{p99=$2} /^Requests\/sec/{rps=$2}
        / requests in /{n=$1} END{print rps, p50, p99, n}' <<<"$out")
      base=${base:-$rps}
      printf "  round %s  %-5s %9.0f req/s  p50 %8s  p99 %8s  %.2fx  gateway %6.2f us CPU a request\n" \
        "$r" "$n" "$rps" "$p50" "$p99" "$(echo "$rps / $base" | bc -l)" "$(echo "$cpu / $requests" | bc -l)"
    done
  done
}

run "One warm key" -H "x-api-key: warm"
run "$KEYS keys (Zipf $ZIPF_S)" -s bench/zipf-keys.lua
for n in rls wasm; do
  curl -s "127.0.0.1:${admin[$n]}/stats" | awk -v n="$n" '
    /cluster.upstream.ratelimit.ok:/ {ok=$2} /cluster.upstream.ratelimit.over_limit:/ {over=$2}
    /cluster.upstream.ratelimit.error:/ {err=$2}
    /wasmcustom.strata.decided.local:/ {l=$2} /wasmcustom.strata.decided.origin:/ {o=$2}
    END {
      if (n == "rls") printf "  rls   service answers: ok %d, over_limit %d, error %d\n", ok, over, err
      else printf "  wasm  decided locally %d, at the gateway %d\n", l, o
    }'
done
