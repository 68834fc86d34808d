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

# Sets the variables of the `WRK k=v ...` line bench/ratelimit.lua prints at the end of a run
# (requests, seconds, p50_us, p99_us, p999_us, max_us, errors), read from wrk's output $1;
# fails, printing that output, if it holds no such line.
read_wrk() {
  local line
  line=$(grep '^WRK ' <<<"$1") || { echo "$1" >&2; return 1; }
  eval "$(sed 's/^WRK //' <<<"$line")"
}
