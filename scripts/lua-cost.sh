#!/usr/bin/env bash
# What the Redis decide script costs Redis, in CPU instructions per call, counted by valgrind's
# callgrind inside a private redis-server (only `evalShaCommand` is counted: the call, its
# commands and its Lua). A count, unlike a time, does not move with a noisy or shared machine,
# so two versions of the script compare on any host. Not part of the test command.
#
#   scripts/lua-cost.sh              # this checkout's DECIDE_LUA
#   scripts/lua-cost.sh HEAD~3       # ... beside the one of another revision
#   N=2000 scripts/lua-cost.sh       # calls per case (default 1000)
#
# Cases: "new key", a first decision (both cells new: fresh random keys each call);
# "warm key", the same key and caller every call (a pass that raises the caller's lease).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
N=${N:-1000}
REV=${1:-}
command -v valgrind >/dev/null 2>&1 || apt_install valgrind
command -v redis-server >/dev/null || { echo "lua-cost: redis-server is needed (scripts/test.sh installs it)" >&2; exit 1; }
WORK=$(mktemp -d /tmp/strata-lua-cost.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
SRC=regional-gateway/src/origin/redis/mod.rs

# The script as the gateway loads it (see RedisOrigin::over and decide_lua): LEASE_LUA, then
# DECIDE_LUA, with the core's lease constants of the same revision ($1: its lease.rs) written
# in.
extract() {
  python3 -c '
import re, sys
src = sys.stdin.read()
lua = dict(re.findall(r"const (\w+): &str = r#\"(.*?)\"#;", src, re.S))
script = lua["LEASE_LUA"] + lua["DECIDE_LUA"]
for name, value in re.findall(r"pub const (\w+): u64 = ([0-9_]+);", open(sys.argv[1]).read()):
    script = script.replace(name, value.replace("_", ""))
sys.stdout.write(script)' "$1"
}

# instructions per call of script $1, keys from $2 (a redis-benchmark key pattern)
cost() {
  local script=$1 k=$2 p out
  p=$(free_port)
  out="$WORK/callgrind.$p"
  valgrind --tool=callgrind --callgrind-out-file="$out" --toggle-collect=evalShaCommand \
    redis-server --port "$p" --save '' --appendonly no >"$WORK/valgrind.$p.log" 2>&1 &
  local vg=$!
  for _ in $(seq 150); do redis-cli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.2; done
  local sha now
  sha=$(redis-cli -p "$p" script load "$(cat "$script")")
  now=$(date +%s%3N)
  # ARGV: limit 10^9, cost 1, an hour's window, now, caller gw1, nothing used, want 10, a 5 s
  # reservation, counted, no global counts, nothing given back, no floors, nothing undone,
  # call 1, a 4 s lease, the previous cell not left, a caller that counts its share.
  # Four keys: a script from before the leases moved into the cells reads the last two as
  # their lease hashes; a later one leaves them unread.
  local call=(4 "$k:1" "$k:0" "$k:1:l" "$k:0:l" 1000000000 1 3600000 "$now" gw1 0 0 10 5000 0 0 0 0 0 0 0 1 4000 0 1)
  # One call first, whose answer must not be an error (redis-benchmark only prints those).
  local first
  first=$(redis-cli -p "$p" EVALSHA "$sha" "${call[@]//__rand_int__/0}" 2>&1)
  case "$first" in
    *ERR*) echo "lua-cost: the script failed: $first" >&2; kill "$vg"; exit 1 ;;
  esac
  redis-benchmark -p "$p" -n "$N" -c 1 -r 100000000 -q EVALSHA "$sha" "${call[@]}" >/dev/null
  redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true
  wait "$vg" || true
  local total
  total=$(awk '/^(summary|totals):/ { print $2; exit }' "$out")
  echo $((total / N))
}

LEASE=shared/src/lease.rs
extract "$LEASE" <"$SRC" >"$WORK/this.lua"
labels=("this checkout")
files=("$WORK/this.lua")
if [ -n "$REV" ]; then
  git show "$REV:$LEASE" >"$WORK/rev-lease.rs"
  git show "$REV:$SRC" | extract "$WORK/rev-lease.rs" >"$WORK/rev.lua"
  labels+=("$REV")
  files+=("$WORK/rev.lua")
fi
printf '%-16s %14s %14s\n' "decide script" "new key" "warm key"
for i in "${!files[@]}"; do
  # assigned first, so a script that fails stops this one (set -e)
  fresh=$(cost "${files[$i]}" '{k__rand_int__}')
  warm=$(cost "${files[$i]}" '{k}')
  printf '%-16s %14s %14s\n' "${labels[$i]}" "$fresh" "$warm"
done
echo "(instructions per call, $N calls each)"
