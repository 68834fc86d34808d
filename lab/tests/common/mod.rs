//! What the lab's tests share: the built binaries, and reading a run's report.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)] // test code: a panic is the failure report; each test binary uses some of these

use std::path::{Path, PathBuf};

/// The built `strata-lab` and the `strata-gateway` beside it (`cargo test --workspace` builds
/// both).
pub(crate) fn binaries() -> (PathBuf, PathBuf) {
    let lab = PathBuf::from(env!("CARGO_BIN_EXE_strata-lab"));
    let gateway = lab.with_file_name("strata-gateway");
    assert!(
        gateway.exists(),
        "{} is missing: cargo test --workspace builds it",
        gateway.display()
    );
    (lab, gateway)
}

/// Runs `strata-lab <args>` on the built gateway, writing to `out`; its exit status.
pub(crate) fn run(args: &[&str], out: &Path) -> std::process::ExitStatus {
    let (lab, gateway) = binaries();
    std::process::Command::new(&lab)
        .args(args)
        .arg("--gateway")
        .arg(&gateway)
        .arg("--out")
        .arg(out)
        .status()
        .unwrap()
}

/// `<out>/<scenario>.json`, whole.
pub(crate) fn report(out: &Path, scenario: &str) -> serde_json::Value {
    let path = out.join(format!("{scenario}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// A figure of a report's `figures`.
pub(crate) fn number(f: &serde_json::Value, name: &str) -> f64 {
    f[name]
        .as_f64()
        .unwrap_or_else(|| panic!("{name} missing in {f}"))
}
