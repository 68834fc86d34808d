#!/usr/bin/env bash
# Builds the Envoy filter into envoy-wasm/dist/strata_envoy.wasm (or the file given as $1), the
# path envoy-wasm/envoy.yaml loads. Needs the wasm32-wasip1 target (scripts/test.sh adds it).
# `--fault-injection` builds the tests' variant instead, into dist/strata_envoy_fault.wasm: a
# request carrying `x-strata-fault: trap` traps its VM. Never deploy that one.
set -euo pipefail
cd "$(dirname "$0")/.."
features=()
default_out=envoy-wasm/dist/strata_envoy.wasm
if [ "${1:-}" = "--fault-injection" ]; then
  shift
  features=(--features fault-injection)
  default_out=envoy-wasm/dist/strata_envoy_fault.wasm
fi
out="${1:-$default_out}"
target_dir="${CARGO_TARGET_DIR:-target}"
cargo build -p strata-envoy --target wasm32-wasip1 --profile wasm-release "${features[@]}"
mkdir -p "$(dirname "$out")"
cp "$target_dir/wasm32-wasip1/wasm-release/strata_envoy.wasm" "$out"
echo "envoy filter${features:+ (fault injection)}: $out ($(wc -c <"$out") bytes)"
