#!/usr/bin/env bash
# The one test command. Installs what is missing (idempotent: present tools are left alone),
# then runs formatting, lints, every test, and the no_std Wasm builds of strata-core.
# Prints a summary of every step; exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

WASM_TARGETS=(wasm32-unknown-unknown wasm32-wasip1)
results=()
failed=0
passed=0

step() {
  local name=$1
  shift
  local started=$SECONDS
  echo
  echo "==> $name"
  if "$@"; then
    results+=("ok    $(printf '%4ds' $((SECONDS - started)))  $name")
    passed=$((passed + 1))
  else
    results+=("FAIL  $(printf '%4ds' $((SECONDS - started)))  $name")
    failed=$((failed + 1))
  fi
}

install_toolchain_parts() {
  local have
  have=$(rustup target list --installed) || return 1
  for target in "${WASM_TARGETS[@]}"; do
    if ! grep -qx "$target" <<<"$have"; then
      echo "installing Rust target $target"
      rustup target add "$target" || return 1
    fi
  done
  for component in rustfmt clippy; do
    if ! rustup component list --installed | grep -q "^$component"; then
      echo "installing Rust component $component"
      rustup component add "$component" || return 1
    fi
  done
  echo "toolchain: $(rustc --version); targets: ${WASM_TARGETS[*]}"
}

apt_install() {
  # Debian packages for services the tests run for real. `apt-get update` only when needed.
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "cannot install $*: no apt-get here; install it and rerun" >&2
    return 1
  fi
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@"
}

ensure_redis() {
  if ! command -v redis-server >/dev/null 2>&1; then
    echo "installing redis-server"
    apt_install redis-server || return 1
  fi
  # The tests start private instances on free ports; the shared one is for manual runs.
  if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    echo "starting the shared Redis on 127.0.0.1:6379"
    mkdir -p /tmp/strata-redis
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
      --dir /tmp/strata-redis --logfile /tmp/strata-redis/redis.log || return 1
  fi
  echo "redis: $(redis-server --version | cut -d' ' -f3)"
}

ensure_mariadb() {
  if ! command -v mariadbd >/dev/null 2>&1 && ! [ -x /usr/sbin/mariadbd ]; then
    echo "installing mariadb-server"
    apt_install mariadb-server mariadb-client || return 1
  fi
  # Tests create (and drop) databases of their own on this server, as root without a password.
  if ! mysqladmin -uroot -h127.0.0.1 --connect-timeout=2 ping >/dev/null 2>&1; then
    echo "starting MariaDB on 127.0.0.1:3306"
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld 2>/dev/null || true
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd -- --user=mysql || return 1
    for _ in $(seq 1 60); do
      mysqladmin -uroot -h127.0.0.1 --connect-timeout=2 ping >/dev/null 2>&1 && break
      sleep 0.5
    done
    mysqladmin -uroot -h127.0.0.1 --connect-timeout=2 ping >/dev/null 2>&1 || { echo "MariaDB did not start" >&2; return 1; }
  fi
  echo "mariadb: $(mysqladmin -uroot -h127.0.0.1 version 2>/dev/null | awk '/Server version/ {print $3}')"
}

ensure_faketime() {
  # A process test runs one gateway with its clock shifted by libfaketime (LD_PRELOAD).
  if ! dpkg -s libfaketime >/dev/null 2>&1; then
    echo "installing libfaketime"
    apt_install libfaketime || return 1
  fi
  echo "libfaketime: $(dpkg-query -W -f='${Version}' libfaketime)"
}

no_std_builds() {
  # Default features off is the no_std build; the Wasm targets are what the edge shells use.
  for target in "${WASM_TARGETS[@]}"; do
    cargo build -p strata-core --no-default-features --target "$target" || return 1
  done
}

step "install missing tools (Rust targets, components)" install_toolchain_parts
step "install and start services (Redis)" ensure_redis
step "install and start services (MariaDB)" ensure_mariadb
step "install libfaketime (clock skew between gateway processes)" ensure_faketime
step "cargo fmt --check" cargo fmt --all -- --check
step "cargo clippy -D warnings" cargo clippy --workspace --all-targets -- -D warnings
step "cargo test (unit, reference cases, properties, accuracy sweep)" \
  cargo test --workspace -- --nocapture --test-threads 2
step "no_std builds of strata-core for ${WASM_TARGETS[*]}" no_std_builds
step "README examples, run as written (scripts/readme-examples.sh)" ./scripts/readme-examples.sh

echo
echo "==> summary"
printf '  %s\n' "${results[@]}"
echo "steps: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
