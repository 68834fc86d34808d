//! The Wasm builds in their real runtimes (workerd, Envoy), one binary for all of them: each
//! module holds the tests of one runtime or subject. `edge_node` (wasm-bindgen-test, under Node)
//! is the Wasm target's own.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::expect_used, clippy::panic, clippy::unwrap_used)] // test code: a panic is the failure report

#[path = "../common/mod.rs"]
mod common;

mod envoy;
mod envoy_hostile;
mod envoy_rls;
mod npm_package;
mod readme_wasm;
mod workerd;
