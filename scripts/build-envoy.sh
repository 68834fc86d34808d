#!/usr/bin/env bash
# Builds the Envoy filter into envoy-wasm/dist/strata_envoy.wasm (or the file given as $1), the
# path envoy-wasm/envoy.yaml loads. Needs the wasm32-wasip1 target (scripts/test.sh adds it).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-envoy-wasm/dist/strata_envoy.wasm}"
target_dir="${CARGO_TARGET_DIR:-target}"
cargo build -p strata-envoy --target wasm32-wasip1 --profile wasm-release
mkdir -p "$(dirname "$out")"
cp "$target_dir/wasm32-wasip1/wasm-release/strata_envoy.wasm" "$out"
echo "envoy filter: $out ($(wc -c <"$out") bytes)"
