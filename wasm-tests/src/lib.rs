//! Test-only package: `tests/` holds wasm-bindgen-test suites (run with
//! `--target wasm32-unknown-unknown` under Node) and native end-to-end tests that start
//! workerd, `strata-gateway` and Redis as real processes.
