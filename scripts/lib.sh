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
