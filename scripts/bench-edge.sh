#!/usr/bin/env bash
# The edge's cost under wrk (not part of the test command): workerd processes serving the
# built bundle (edge/dist) in front of an upstream that is itself a workerd answering `ok`, and
# a release gateway (embedded origin). Each round runs, side by side and in turn, under
# `wrk -t1 -c8`: the pass-through Worker of wasm-tests/bench/passthrough.mjs; the edge on a
# warm key far from its limit; the edge with STRATA_HEADERS_ON_PASS=false (a pass returns the
# upstream's response without the copy adding headers takes). Then the edge with KEYS keys drawn
# with Zipf s = ZIPF_S (default 1.1; 0: uniform; bench/zipf-keys.lua), and where its requests
# were decided (its /__strata/stats). Each workerd's resident memory after start and after the
# rounds.
#
#   ./scripts/build-edge.sh && cargo build --release -p strata-gateway
#   scripts/bench-edge.sh                             # 3 rounds of 5 s, 10,000 keys
#   ROUNDS=5 DURATION=10 KEYS=100000 scripts/bench-edge.sh
#   EDGE_VARS="STRATA_FAILURE_MODE=deny" scripts/bench-edge.sh   # more settings for the edges
#   BASELINE_VARS="STRATA_FAILURE_MODE=deny" scripts/bench-edge.sh  # a second keyed edge, beside
#   PIN=1 ROUNDS=8 DURATION=3 scripts/bench-edge.sh   # the workerds measured on CPU 0, the rest on 1
#
# PIN=1 runs the measured workerds on CPU 0 (EDGE_CPUS) and the upstream workerd, the gateway and
# wrk on CPU 1 (LOAD_CPUS): unpinned, wrk, the upstream and the measured workerd take turns on
# two cores and one build's rounds move by a quarter.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/strata/target}"
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5}
KEYS=${KEYS:-10000}
ZIPF_S=${ZIPF_S:-1.1}
if [ "${PIN:-}" = 1 ]; then
  export EDGE_CPUS=${EDGE_CPUS:-0} LOAD_CPUS=${LOAD_CPUS:-1}
fi
workerd=wasm-tests/node_modules/workerd/bin/workerd
gateway="$CARGO_TARGET_DIR/release/strata-gateway"
require_built "run the test command, then the build lines above" "$workerd" "$gateway" \
  edge/dist/worker.mjs edge/dist/strata_edge.js edge/dist/strata_edge_bg.wasm
command -v wrk >/dev/null || apt_install wrk

work=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT INT TERM

gw_port=$(free_port)
${LOAD_CPUS:+taskset -c "$LOAD_CPUS"} "$gateway" --listen "127.0.0.1:$gw_port" --data-dir "$work/gw" >"$work/gateway.log" 2>&1 &
pids+=($!)
wait_port "$gw_port" || { cat "$work/gateway.log"; exit 1; }

# serve NAME MAIN [BINDING...] : a workerd serving MAIN (with the edge bundle beside it) on a
# free port, each BINDING a `name = "text"` pair; sets PORT, and the pid in pid[NAME]. On
# CPUS (a taskset list) when set.
declare -A pid
serve() {
  local name=$1 main=$2 dir="$work/$1" b bindings=""
  shift 2
  mkdir -p "$dir"
  cp edge/dist/worker.mjs edge/dist/strata_edge.js edge/dist/strata_edge_bg.wasm "$dir/"
  [ -e "$dir/$(basename "$main")" ] || cp "$main" "$dir/"
  for b in "$@"; do bindings+="(name = \"${b%%=*}\", text = $(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "${b#*=}")), "; done
  PORT=$(free_port)
  cat >"$dir/config.capnp" <<CAPNP
using Workerd = import "/workerd/workerd.capnp";
const config :Workerd.Config = (
  services = [(name = "main", worker = .w), (name = "net", network = (allow = ["public", "private", "local"]))],
  sockets = [(name = "http", address = "127.0.0.1:$PORT", http = (), service = "main")],
);
const w :Workerd.Worker = (
  modules = [
    (name = "$(basename "$main")", esModule = embed "$(basename "$main")"),
    (name = "strata_edge.js", esModule = embed "strata_edge.js"),
    (name = "strata_edge_bg.wasm", wasm = embed "strata_edge_bg.wasm"),
  ],
  compatibilityDate = "2026-04-01",
  globalOutbound = "net",
  bindings = [$bindings],
);
CAPNP
  (cd "$dir" && exec ${CPUS:+taskset -c "$CPUS"} "$OLDPWD/$workerd" serve config.capnp >"$dir/log" 2>&1) &
  pid[$name]=$!
  pids+=("${pid[$name]}")
  wait_port "$PORT" || { cat "$dir/log"; exit 1; }
}

cat >"$work/ok.mjs" <<'JS'
export default { fetch: () => new Response("ok") };
JS
CPUS=${LOAD_CPUS:-} serve upstream "$work/ok.mjs"
upstream="http://127.0.0.1:$PORT"
rules='{"rules": [{"name": "per-key", "namespace": "bench", "limit": 1000000000, "duration": "1h",
  "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}]}]}'
edge_vars=("STRATA_GATEWAY_URL=http://127.0.0.1:$gw_port" "STRATA_UPSTREAM=$upstream" "STRATA_RULES=$rules")
read -r -a extra <<<"${EDGE_VARS:-}"
edge_vars+=("${extra[@]}")
names=(pass-through edge no-headers)
declare -A port
CPUS=${EDGE_CPUS:-}
serve pass-through wasm-tests/bench/passthrough.mjs "STRATA_UPSTREAM=$upstream"
port[pass-through]=$PORT
serve edge worker.mjs "${edge_vars[@]}"
port[edge]=$PORT
serve no-headers worker.mjs "${edge_vars[@]}" STRATA_HEADERS_ON_PASS=false
port[no-headers]=$PORT
serve keys worker.mjs "${edge_vars[@]}" STRATA_DEBUG=true
port[keys]=$PORT
keyed=(keys)
if [ -n "${BASELINE_VARS:-}" ]; then
  read -r -a base <<<"$BASELINE_VARS"
  serve keys-base worker.mjs "${edge_vars[@]}" STRATA_DEBUG=true "${base[@]}"
  port[keys-base]=$PORT
  keyed+=(keys-base)
fi
for n in "${names[@]}" "${keyed[@]}"; do
  curl -sf -o /dev/null -H "x-api-key: warm" "127.0.0.1:${port[$n]}/" ||
    { echo "$n does not answer"; cat "$work/$n/log"; exit 1; }
done

resident() {
  for n in "$@"; do
    printf "  %-13s resident %6d kB\n" "$n" "$(awk '/VmRSS/ {print $2}' "/proc/${pid[$n]}/status")"
  done
}
echo "Each workerd after start:"
resident "${names[@]}" "${keyed[@]}"

# load PORT [wrk args...] : requests/s, p50 and p99.
load() { wrk_line 8 "$DURATION" "$@"; }
warm() { load "$1" -H "x-api-key: warm"; }
echo "Warm key, wrk -t1 -c8 -d${DURATION}s; ratio to the pass-through in the same round:"
contenders=()
for n in "${names[@]}"; do contenders+=("$n=${port[$n]}"); done
ratio_rounds "$ROUNDS" warm "${contenders[@]}"
echo "$KEYS keys (Zipf $ZIPF_S), the edge with STRATA_DEBUG=true:"
for r in $(seq "$ROUNDS"); do
  for n in "${keyed[@]}"; do
    printf "  round %s  %-13s %s\n" "$r" "$n" "$(KEYS=$KEYS ZIPF_S=$ZIPF_S load "${port[$n]}" -s bench/zipf-keys.lua)"
  done
done
for n in "${keyed[@]}"; do
  curl -s "127.0.0.1:${port[$n]}/__strata/stats" | N="$n" python3 -c '
import json, os, sys
s = json.load(sys.stdin)
local, origin, fallback, ahead = (s["decided"][k] for k in ("local", "origin", "fallback", "ahead"))
total = max(local + origin + fallback + ahead, 1)
calls, replays, entries = s["origin_calls"], s["replays"], s["table"]["entries"]
name = os.environ["N"]
print(f"  {name:<13} decided locally {local}, ahead of the gateway {ahead}, at the gateway "
      f"{origin} ({1000 * origin / total:.1f} per 1,000 waited), gateway calls {calls} "
      f"({1000 * calls / total:.1f} per 1,000), replays {replays}, table entries {entries}")'
done
echo "Each workerd after the rounds:"
resident "${names[@]}" "${keyed[@]}"
