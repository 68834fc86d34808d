//! Helpers of the end-to-end tests: real processes only. The private Redis and the gateway
//! process helpers are the gateway's own test helpers, included by path (one copy).

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::path::PathBuf;

#[path = "../../../regional-gateway/tests/common/conformance.rs"]
pub mod conformance;
pub mod cpu;
pub mod envoy;
pub mod hostile;
pub mod identity;
pub mod memory;
pub mod message;
pub mod paths;
#[path = "../../../regional-gateway/tests/common/port.rs"]
mod port;
#[path = "../../../regional-gateway/tests/common/process.rs"]
pub mod process;
#[path = "../../../regional-gateway/tests/common/redis.rs"]
pub mod redis;
#[path = "../../../regional-gateway/tests/common/slow.rs"]
pub mod slow;
pub mod stack;
pub mod upstream;
pub mod workerd;

pub use port::free_port;
#[allow(unused_imports)] // the README tests' alone
pub use port::readme_lock;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("wasm-tests sits in the repository")
        .to_path_buf()
}

/// The `strata-gateway` binary of this build (`cargo test --workspace` builds it).
pub fn gateway_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // target/<profile>/deps/<test> → target/<profile>/strata-gateway
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join("strata-gateway"))
        .expect("a target directory");
    assert!(
        bin.exists(),
        "{} is missing: build it first (cargo build -p strata-gateway; scripts/test.sh does)",
        bin.display()
    );
    bin
}

/// The `p` quantile of sorted durations, in microseconds (the latency benches).
pub fn percentile_us(sorted: &[std::time::Duration], p: f64) -> f64 {
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let i = ((sorted.len().saturating_sub(1)) as f64 * p).round() as usize;
    sorted.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}
