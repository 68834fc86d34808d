//! The lab with its traffic through the shells users deploy: `five-burst` (20x the limit in one
//! second over five gateways) through a workerd edge in front of each gateway, then through an
//! Envoy in front of each (the bundle and the filter the test command builds). Every request is
//! answered 200 or 429, and the five shells together hold the limit as the gateways do.

use crate::common;

use common::number;

fn five_burst_through(shell: &str) {
    let out = std::env::temp_dir().join(format!("strata-lab-{shell}-{}", std::process::id()));
    let status = common::run(&["five-burst", "--through", shell], &out);
    assert!(
        status.success(),
        "strata-lab through {shell} failed: {status}"
    );
    let report = common::report(&out, "five-burst");
    assert_eq!(report["through"], shell, "{report}");
    let f = report["figures"].clone();
    println!("five-burst through {shell}: {f}");
    assert_eq!(number(&f, "errors"), 0.0, "{f}");
    // At least 5x the limit of 100 was offered, the burst far past it: through five shells in
    // front of five gateways, on two cores, the load generator sends less of the 20x than
    // straight to the gateways (992 seen, 10x being the gateway API run's floor, quick.rs).
    assert!(number(&f, "offered") >= 500.0, "{f}");
    // The gateway-API run's bound (quick.rs); measured 1.00 through both shells.
    assert!(number(&f, "worst_window") <= 1.05, "{f}");
    assert!(number(&f, "admitted_over_allowed") >= 0.95, "{f}");
    // The shells decided at the gateway: their calls are its origin calls; none timed out
    // into the failure mode (which decides from memory, past the limit).
    assert!(number(&f, "origin_calls_per_1000") > 0.0, "{f}");
    assert_eq!(number(&f["decided_per_1000_by"], "fallback"), 0.0, "{f}");
    let _ = std::fs::remove_dir_all(&out);
}

/// One after the other: five shells and five gateways at once are enough for two cores.
#[test]
fn five_burst_through_workerd_edges_then_envoys_holds_the_limit() {
    five_burst_through("edge");
    five_burst_through("envoy");
}
