#!/usr/bin/env bash
# Builds the deployable edge bundle into edge/dist/ (or the directory given as $1):
#   worker.mjs            the ES-module Worker (entry point)
#   strata_edge.js        wasm-bindgen glue (--target web, initialised with initSync)
#   strata_edge_bg.wasm   the size-optimised module
# and, into edge/dist/, the npm package of those three and edge/index.d.ts
# (strata-edge-<version>.tgz, edge/package.json's version: the crate's).
# Needs the wasm32-unknown-unknown target and wasm-bindgen-cli at the version Cargo.lock pins
# (scripts/test.sh installs both).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-edge/dist}"
target_dir="${CARGO_TARGET_DIR:-target}"
cargo build -p strata-edge --target wasm32-unknown-unknown --profile wasm-release
mkdir -p "$out"
wasm-bindgen --target web --no-typescript --remove-name-section --remove-producers-section --out-dir "$out" \
  "$target_dir/wasm32-unknown-unknown/wasm-release/strata_edge.wasm"
cp edge/worker.mjs "$out/worker.mjs"
echo "edge bundle: $out ($(wc -c <"$out/strata_edge_bg.wasm") bytes of wasm)"
if [ "$out" = edge/dist ]; then
  crate=$(sed -n 's/^version = "\(.*\)"$/\1/p' edge/Cargo.toml)
  package=$(node -p 'require("./edge/package.json").version')
  if [ "$crate" != "$package" ]; then
    echo "edge/package.json says version $package, edge/Cargo.toml $crate: make them one" >&2
    exit 1
  fi
  tarball=$(cd edge && npm pack --silent --pack-destination dist)
  echo "npm package: edge/dist/$tarball"
fi
