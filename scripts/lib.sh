# Helpers shared by the scripts (sourced, not run).

# Installs Debian packages; `apt-get update` only when something is missing.
apt_install() {
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "cannot install $*: no apt-get here; install it and rerun" >&2
    return 1
  fi
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@"
}

# A loopback TCP port free now.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits until 127.0.0.1:$1 accepts connections (up to 10 s); fails if it never does.
wait_port() {
  local _
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# start_envoy BINARY CONFIG CONCURRENCY PORT LOG : starts Envoy on CONFIG with a --base-id of
# its own (so several run side by side), logging to LOG; sets ENVOY_PID and adds it to the
# caller's `pids`; waits until a request with `x-api-key: warm` passes on 127.0.0.1:PORT (5 s
# after the port opens). If it never does, prints the log and exits.
_envoy_base_id=$((RANDOM % 1000 + 100))
start_envoy() {
  local bin=$1 config=$2 concurrency=$3 port=$4 log=$5 _
  _envoy_base_id=$((_envoy_base_id + 1))
  ${ENVOY_CPUS:+taskset -c "$ENVOY_CPUS"} "$bin" -c "$config" --concurrency "$concurrency" \
    --base-id "$_envoy_base_id" >"$log" 2>&1 &
  ENVOY_PID=$!
  pids+=("$ENVOY_PID")
  wait_port "$port" || { cat "$log"; exit 1; }
  for _ in $(seq 50); do
    curl -sf -o /dev/null -H "x-api-key: warm" "127.0.0.1:$port/" && return 0
    sleep 0.1
  done
  cat "$log"
  exit 1
}

# Sets the variables of the `WRK k=v ...` line bench/ratelimit.lua prints at the end of a run
# (requests, seconds, p50_us, p99_us, p999_us, max_us, errors), read from wrk's output $1;
# fails, printing that output, if it holds no such line.
read_wrk() {
  local line
  line=$(grep '^WRK ' <<<"$1") || { echo "$1" >&2; return 1; }
  eval "$(sed 's/^WRK //' <<<"$line")"
}

# Fails with what to build when a file a script needs is not there: require_built HINT FILE...
require_built() {
  local hint=$1
  shift
  for need in "$@"; do
    [ -e "$need" ] || { echo "missing $need: $hint" >&2; exit 1; }
  done
}

# wrk_line CONNECTIONS SECONDS PORT [wrk args...] : requests/s, p50 and p99 of one wrk run
# (one thread) against http://127.0.0.1:PORT/.
wrk_line() {
  local connections=$1 seconds=$2 port=$3
  shift 3
  ${LOAD_CPUS:+taskset -c "$LOAD_CPUS"} wrk -t1 -c"$connections" -d"${seconds}s" --latency "$@" \
    "http://127.0.0.1:$port/" |
    awk '/^ +50%/{p50=$2} /^ +99%/{p99=$2} /^Requests\/sec/{rps=$2} END{printf "%9.0f req/s  p50 %8s  p99 %8s", rps, p50, p99}'
}

# ratio_rounds ROUNDS LOAD NAME=PORT... : ROUNDS rounds of `LOAD PORT` (a function printing a
# wrk_line) for each contender in turn, each line with its requests/s as a ratio of the
# first contender's in the same round.
ratio_rounds() {
  local rounds=$1 load=$2 r c base line rps
  shift 2
  for r in $(seq "$rounds"); do
    base=""
    for c in "$@"; do
      line=$("$load" "${c#*=}")
      rps=$(awk '{print $1}' <<<"$line")
      base=${base:-$rps}
      printf "  round %s  %-13s %s  %.2fx\n" "$r" "${c%%=*}" "$line" "$(echo "$rps / $base" | bc -l)"
    done
  done
}
