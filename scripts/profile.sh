#!/usr/bin/env bash
# Where a request's CPU time goes (not part of the test command). Each contender runs alone on
# CPU 1, wrk drives it from CPU 0 (bench/ratelimit.lua, every request passing), and
# `perf record -e cpu-clock` samples CPU 1 for the measured run. Prints, per request, the
# nanoseconds CPU 1 spent in all, in the kernel and in user space, and in parts of user space
# (the key lookup, the allocator, HTTP, JSON, the runtime, the core's decision), then each
# contender's top user-space symbols. The user-space parts repeat within a few percent from run
# to run on a shared VM where requests/s swing by a fifth, so a change to the gateway's own work
# shows here first; the kernel's share (loopback TCP) is the noisy one.
#
#   scripts/profile.sh                          # bare and the gateway (embedded origin), 10,000 keys
#   KEYS=1 ROUNDS=3 scripts/profile.sh
#   GATEWAYS="new=target/release/strata-gateway old=/tmp/gw-old" scripts/profile.sh
#                                               # two builds side by side, alternating
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/strata/target}"
KEYS=${KEYS:-10000}
ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-8}
WARMUP=${WARMUP:-6}
TOP=${TOP:-12}

command -v wrk >/dev/null 2>&1 || apt_install wrk
command -v perf >/dev/null 2>&1 || apt_install linux-perf
command -v taskset >/dev/null || { echo "profile: taskset (util-linux) is needed" >&2; exit 1; }
cargo build --release -q -p strata-gateway --bin strata-gateway --example bare
BIN="$CARGO_TARGET_DIR/release"
GATEWAYS=${GATEWAYS:-gateway=$BIN/strata-gateway}
WORK=$(mktemp -d /tmp/strata-profile.XXXXXX)
SERVER=""
cleanup() {
  [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

# Parts of user space, by symbol; the first pattern a symbol matches takes it.
PARTS='
key lookup|Slab::slot|WindowKey::matches|memcmp|hashbrown
allocator|malloc|_int_free|cfree|unlink_chunk| mi_|_mi_
JSON|serde|itoa|ryu
core decision|strata_core
HTTP|hyper|httparse|axum|tower|http::|http_body|bytes::
runtime|tokio|mio|atomic_waker|futures|epoll|writev|recv|pthread
clock|clock_gettime
'

printf '%-6s %-10s %8s %8s %8s %8s' round contender "req/s" "all ns" kernel user
while IFS='|' read -r part _; do [ -n "$part" ] && printf ' %13s' "$part"; done <<<"$PARTS"
printf ' %8s\n' other

for round in $(seq "$ROUNDS"); do
  for c in bare $GATEWAYS; do
    name=${c%%=*}
    port=8091
    if [ "$c" = bare ]; then
      port=8090
      taskset -c 1 "$BIN/examples/bare" 127.0.0.1:8090 >"$WORK/$name.log" 2>&1 &
    else
      rm -f "$WORK"/global.db*
      taskset -c 1 "${c#*=}" --listen 127.0.0.1:8091 --database-url "sqlite://$WORK/global.db" \
        >"$WORK/$name.log" 2>&1 &
    fi
    SERVER=$!
    wait_port "$port" || { echo "profile: $name did not start; its log:" >&2; cat "$WORK/$name.log" >&2; exit 1; }
    url="http://127.0.0.1:$port"
    taskset -c 0 wrk -t1 -c64 -d"${WARMUP}s" -s bench/ratelimit.lua "$url" -- "$KEYS" >/dev/null
    perf record -q -C 1 -e cpu-clock -F 2000 -o "$WORK/perf.data" -- \
      taskset -c 0 wrk -t1 -c64 -d"${DURATION}s" -s bench/ratelimit.lua "$url" -- "$KEYS" \
      >"$WORK/wrk.out" 2>/dev/null
    kill "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    SERVER=""
    read_wrk "$(cat "$WORK/wrk.out")" || exit 1
    # period (ns of CPU 1), dso, symbol
    perf report -i "$WORK/perf.data" --no-children --stdio -q --sort dso,sym -F period,dso,sym \
      2>/dev/null >"$WORK/$name.syms"
    awk -v req="$requests" -v secs="$seconds" -v round="$round" -v name="$name" -v parts="$PARTS" '
      BEGIN {
        n = split(parts, lines, "\n")
        for (i = 1; i <= n; i++) if (lines[i] != "") {
          k = index(lines[i], "|"); np++
          label[np] = substr(lines[i], 1, k - 1); pattern[np] = substr(lines[i], k + 1)
        }
      }
      {
        all += $1
        if ($2 == "[kernel.kallsyms]") { kernel += $1; next }
        user += $1
        sym = $0
        for (i = 1; i <= np; i++) if (sym ~ pattern[i]) { sum[i] += $1; next }
        other += $1
      }
      END {
        printf "%-6s %-10s %8d %8.0f %8.0f %8.0f", round, name, req / secs, all / req, kernel / req, user / req
        for (i = 1; i <= np; i++) printf " %13.0f", sum[i] / req
        printf " %8.0f\n", other / req
      }' "$WORK/$name.syms"
    grep -v '\[kernel.kallsyms\]' "$WORK/$name.syms" | sort -nr | awk -v n="$TOP" 'NR <= n' |
      awk -v req="$requests" -v name="$name" '{ p = $1; $1 = ""; printf "%s.top %7.1f ns %s\n", name, p / req, substr($0, 2, 150) }' \
      >>"$WORK/top.txt"
  done
done
echo
echo "Top user-space symbols, ns per request (the last round):"
for c in bare $GATEWAYS; do
  name=${c%%=*}
  awk -v p="$name.top" -v n="$TOP" '$1 == p { line[++k] = $0 }
    END { for (i = k - n + 1; i <= k; i++) if (i > 0) { sub(/^[^ ]+ /, "", line[i]); print p, line[i] } }' "$WORK/top.txt" |
    sed "s/^$name\.top /$name /"
done
