//! The lab across its simulated WAN: two regions of gateway processes splitting 10x the limit,
//! each reaching the global store (the test command's MariaDB) through a proxy that holds every
//! chunk 50 ms each way. The regions still hold the limit and see each other within the goal,
//! and the gateways' syncs show the link's round trips (a sync on loopback takes a few ms).

use crate::common;

use std::process::Command;

use common::number;

/// The test command's MariaDB (scripts/test.sh starts it); the lab makes a database of its own.
const MARIADB: &str = "mysql://root@127.0.0.1:3306";

#[test]
fn two_regions_across_a_wan_hold_the_limit_and_see_each_other() {
    let out = std::env::temp_dir().join(format!("strata-lab-wan-{}", std::process::id()));
    let status = common::run(
        &[
            "two-split-10x",
            "--quick",
            "--mysql",
            MARIADB,
            "--wan",
            "50ms",
            "--wan-jitter",
            "5ms",
        ],
        &out,
    );
    assert!(
        status.success(),
        "strata-lab across the WAN failed: {status}"
    );
    let report = common::report(&out, "two-split-10x");
    let f = &report["figures"];
    println!("two-split-10x across the WAN: {f}");
    assert_eq!(report["wan"], "50 ms ± 5 ms one way", "{report}");
    assert_eq!(number(f, "errors"), 0.0, "{f}");
    assert_eq!(number(f, "sql_errors"), 0.0, "{f}");
    // A sync is one statement (the cells changed, with the store's clock): one round trip of at
    // least 2 x 45 ms across the link, where a clock read first would make it two (180 ms).
    let sync = number(f, "sync_ms_mean");
    assert!((90.0..180.0).contains(&sync), "{f}");
    // Issue 37's goals over the WAN are a worst window of 1.10x and a propagation p95 of 2 s
    // (met by the full release run, docs/LAB.md); the quick debug run gets a margin for a
    // loaded two-core machine.
    assert!(number(f, "worst_window") <= 1.15, "{f}");
    assert!(
        f["propagation_ms"]["p95"]
            .as_f64()
            .is_some_and(|p95| p95 <= 2_500.0),
        "{f}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn the_wan_needs_a_store_that_is_a_server() {
    let (lab, gateway) = common::binaries();
    let out = Command::new(&lab)
        .args(["five-burst", "--wan", "50ms", "--gateway"])
        .arg(&gateway)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--wan needs --mysql"), "{stderr}");
}
