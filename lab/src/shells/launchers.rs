//! The end-to-end tests' process launchers (`wasm-tests/tests/common`), included by path: one
//! copy. They are test code: a missing workerd, Envoy or build stops the lab with their message.

use std::path::PathBuf;

#[path = "../../../wasm-tests/tests/common/cpu.rs"]
pub mod cpu;
#[path = "../../../wasm-tests/tests/common/envoy.rs"]
pub mod envoy;
#[path = "../../../wasm-tests/tests/common/message.rs"]
pub mod message;
#[path = "../../../regional-gateway/tests/common/port.rs"]
pub mod port;
#[path = "../../../wasm-tests/tests/common/upstream.rs"]
pub mod upstream;
#[path = "../../../wasm-tests/tests/common/workerd.rs"]
pub mod workerd;

/// The repository root, where the builds and the installed workerd and Envoy are.
fn root() -> PathBuf {
    let lab = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    lab.parent().map_or(lab.clone(), PathBuf::from)
}

fn free_port() -> u16 {
    port::try_free_port().unwrap_or(0)
}
