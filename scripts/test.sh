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

no_std_builds() {
  # Default features off is the no_std build; the Wasm targets are what the edge shells use.
  for target in "${WASM_TARGETS[@]}"; do
    cargo build -p strata-core --no-default-features --target "$target" || return 1
  done
}

step "install missing tools (Rust targets, components)" install_toolchain_parts
step "cargo fmt --check" cargo fmt --all -- --check
step "cargo clippy -D warnings" cargo clippy --workspace --all-targets -- -D warnings
step "cargo test (unit, reference cases, properties, accuracy sweep)" \
  cargo test --workspace -- --nocapture --test-threads 2
step "no_std builds of strata-core for ${WASM_TARGETS[*]}" no_std_builds

echo
echo "==> summary"
printf '  %s\n' "${results[@]}"
echo "steps: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
