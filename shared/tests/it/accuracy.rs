//! Deterministic accuracy sweep of the local decision: limits 5 / 100 / 10,000, windows
//! 1 s / 60 s / 1 h, offered load 0.9 / 1 / 10 times the limit, 50 windows of evenly spaced
//! arrivals on a simulated clock, one process with no origin. Prints the worst ratios.
//!
//! `allowed` is `limit x windows`. The sliding estimate weights the previous window as if its
//! traffic were spread evenly, so it can only err by the rounding of that weight.

use strata_core::{WindowDuration, WindowState};

const LIMITS: [u64; 3] = [5, 100, 10_000];
const DURATIONS_MS: [u64; 3] = [1_000, 60_000, 3_600_000];
const LOADS: [(u64, u64); 3] = [(9, 10), (1, 1), (10, 1)]; // numerator, denominator
const WINDOWS: u64 = 50;

struct Outcome {
    admitted: u64,
    offered: u64,
    worst_window: u64,
    worst_sliding: u64,
}

fn run(limit: u64, duration_ms: u64, (num, den): (u64, u64)) -> Outcome {
    let d = WindowDuration::from_ms(duration_ms).unwrap();
    // Start on a window boundary, like a real clock at an arbitrary but aligned epoch.
    let start = d.start(d.sequence(1_700_000_000_000));
    let offered = limit * num * WINDOWS / den;
    let span = duration_ms * WINDOWS;
    let mut state = WindowState::new(d, start);
    let mut admitted_at = Vec::new();
    let mut per_window = vec![0_u64; WINDOWS as usize];
    for k in 0..offered {
        // Evenly spaced over the run: arrival k at start + k * span / offered.
        let now = start + (u128::from(k) * u128::from(span) / u128::from(offered)) as u64;
        if state.decide(d, limit, 1, now).success {
            admitted_at.push(now);
            per_window[((now - start) / duration_ms) as usize] += 1;
        }
    }
    // The most admitted in any interval [t, t + duration) (two pointers over admissions).
    let mut worst_sliding = 0;
    let mut lo = 0;
    for hi in 0..admitted_at.len() {
        while admitted_at[hi] - admitted_at[lo] >= duration_ms {
            lo += 1;
        }
        worst_sliding = worst_sliding.max((hi - lo + 1) as u64);
    }
    Outcome {
        admitted: admitted_at.len() as u64,
        offered,
        worst_window: per_window.into_iter().max().unwrap_or(0),
        worst_sliding,
    }
}

#[test]
fn accuracy_sweep() {
    let mut worst_over = 0.0_f64;
    let mut worst_under_at_10 = f64::MAX;
    let mut worst_under_at_1 = f64::MAX;
    let mut worst_sliding = 0.0_f64;
    println!("limit  window   load  admitted/allowed  worst-window/limit  worst-sliding/limit");
    for limit in LIMITS {
        for duration_ms in DURATIONS_MS {
            for load in LOADS {
                let o = run(limit, duration_ms, load);
                let allowed = (limit * WINDOWS) as f64;
                let ratio = o.admitted as f64 / allowed;
                let window = o.worst_window as f64 / limit as f64;
                let sliding = o.worst_sliding as f64 / limit as f64;
                println!(
                    "{limit:>6} {:>6}s {:>5.1}  {ratio:>16.4}  {window:>18.4}  {sliding:>19.4}",
                    duration_ms / 1_000,
                    load.0 as f64 / load.1 as f64
                );
                assert!(
                    ratio <= 1.02,
                    "over-admitted: {ratio} at limit {limit}, {duration_ms} ms, load {load:?}"
                );
                assert!(window <= 1.0, "a fixed window admitted {window}x its limit");
                // Under steady arrivals the weighted previous window holds every interval of
                // one window length to the limit too (bursts straddling a boundary can pass
                // more; that is the approximation's documented cost, not measured here).
                assert!(
                    sliding <= 1.0,
                    "a sliding interval admitted {sliding}x its limit at {limit}, {duration_ms} ms, load {load:?}"
                );
                worst_over = worst_over.max(ratio);
                worst_sliding = worst_sliding.max(sliding);
                match load {
                    (10, 1) => {
                        assert!(ratio >= 0.98, "under-admitted at load 10: {ratio}");
                        worst_under_at_10 = worst_under_at_10.min(ratio);
                    }
                    (1, 1) => {
                        assert!(ratio >= 0.9, "under-admitted at load 1: {ratio}");
                        worst_under_at_1 = worst_under_at_1.min(ratio);
                    }
                    _ => assert_eq!(o.admitted, o.offered, "load 0.9 must all pass"),
                }
            }
        }
    }
    println!(
        "worst admitted/allowed {worst_over:.4}; lowest at load 10 {worst_under_at_10:.4}; \
         lowest at load 1 {worst_under_at_1:.4}; worst sliding interval {worst_sliding:.4}x limit"
    );
}
