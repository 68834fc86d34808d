//! Prometheus metrics, kept as plain atomics with fixed label sets (no registry, no locks on
//! the request path) and rendered as text for `/metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Where a decision was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// From local memory, warm and fresh.
    Local,
    /// After a synchronous origin read (cold, stale or strict).
    Origin,
    /// Local, because the origin read failed.
    Fallback,
}

const SOURCES: [&str; 3] = ["local", "origin", "fallback"];
const OPS: [&str; 4] = ["read", "replay", "decide", "ping"];
const RESULTS: [&str; 5] = ["ok", "timeout", "circuit_open", "backend", "rejected"];
/// Upper bounds of the origin latency histogram, in seconds.
const BUCKETS: [f64; 11] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

const REASONS: [&str; 4] = ["cold", "stale", "strict", "lease"];
/// Upper bounds of the lease size histogram, in cost units.
const LEASE_BUCKETS: [f64; 10] = [
    0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1_000.0, 10_000.0,
];

#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

/// Every counter and gauge the gateway exports.
#[derive(Debug, Default)]
pub struct Metrics {
    decisions: [[AtomicU64; 2]; 3],
    origin_calls: [[AtomicU64; RESULTS.len()]; OPS.len()],
    origin_latency: [Histogram; OPS.len()],
    origin_reasons: [AtomicU64; REASONS.len()],
    lease_buckets: [AtomicU64; LEASE_BUCKETS.len()],
    lease_count: AtomicU64,
    lease_sum: AtomicU64,
    replay_cells: AtomicU64,
    replay_failed_batches: AtomicU64,
    leases_renewed: AtomicU64,
}

/// Values sampled when rendering (owned by other parts of the gateway).
#[derive(Clone, Copy, Debug, Default)]
pub struct Gauges {
    /// Cells whose own count the origin has not acknowledged yet.
    pub replay_queue_cells: usize,
    /// Own cost lost before acknowledgement.
    pub replay_lost: u64,
    /// Window keys in local memory.
    pub local_windows: usize,
    /// Window keys evicted from local memory so far.
    pub local_evictions: u64,
    /// Whether the origin breaker refuses calls.
    pub breaker_open: bool,
    /// Whether the origin answered the last readiness probe.
    pub origin_up: bool,
}

impl Metrics {
    /// Counts one decision.
    pub fn decision(&self, source: Source, allowed: bool) {
        let s = match source {
            Source::Local => 0,
            Source::Origin => 1,
            Source::Fallback => 2,
        };
        self.decisions[s][usize::from(!allowed)].fetch_add(1, Ordering::Relaxed);
    }

    /// Decisions so far from `source` (for tests and the load harness).
    pub fn decisions(&self, source: Source) -> u64 {
        let s = match source {
            Source::Local => 0,
            Source::Origin => 1,
            Source::Fallback => 2,
        };
        self.decisions[s]
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .sum()
    }

    /// Counts one origin call with its outcome (`Err(kind)`) and latency.
    pub fn origin_call(&self, op: &str, result: Result<(), &str>, elapsed: Duration) {
        let o = OPS.iter().position(|x| *x == op).unwrap_or(0);
        let r = match result {
            Ok(()) => 0,
            Err(kind) => RESULTS.iter().position(|x| *x == kind).unwrap_or(3),
        };
        self.origin_calls[o][r].fetch_add(1, Ordering::Relaxed);
        let h = &self.origin_latency[o];
        let secs = elapsed.as_secs_f64();
        for (bound, bucket) in BUCKETS.iter().zip(&h.buckets) {
            if secs <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        h.count.fetch_add(1, Ordering::Relaxed);
        h.sum_micros.fetch_add(
            u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Origin calls of `op` so far, all outcomes.
    pub fn origin_calls(&self, op: &str) -> u64 {
        let o = OPS.iter().position(|x| *x == op).unwrap_or(0);
        self.origin_calls[o]
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .sum()
    }

    /// A decision that went to the origin, and why.
    pub fn origin_reason(&self, reason: strata_core::Reason) {
        let r = match reason {
            strata_core::Reason::Cold => 0,
            strata_core::Reason::Stale => 1,
            strata_core::Reason::Strict => 2,
            strata_core::Reason::Lease => 3,
        };
        self.origin_reasons[r].fetch_add(1, Ordering::Relaxed);
    }

    /// A lease this gateway's origin granted (to itself or an edge).
    pub fn lease_granted(&self, lease: u64) {
        for (bound, bucket) in LEASE_BUCKETS.iter().zip(&self.lease_buckets) {
            if lease as f64 <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.lease_count.fetch_add(1, Ordering::Relaxed);
        self.lease_sum.fetch_add(lease, Ordering::Relaxed);
    }

    /// Requests sent to the origin for `reason` so far.
    pub fn origin_reasons(&self, reason: strata_core::Reason) -> u64 {
        let i = REASONS
            .iter()
            .position(|r| *r == reason.as_str())
            .unwrap_or(0);
        self.origin_reasons[i].load(Ordering::Relaxed)
    }

    /// Cells delivered to the origin by replay.
    pub fn replayed(&self, cells: usize) {
        self.replay_cells.fetch_add(cells as u64, Ordering::Relaxed);
    }

    /// Leases in use renewed by a replay (each spares a request a round trip).
    pub fn leases_renewed(&self, leases: usize) {
        self.leases_renewed
            .fetch_add(leases as u64, Ordering::Relaxed);
    }

    /// A replay batch that failed (its counts go out with the next).
    pub fn replay_failed(&self) {
        self.replay_failed_batches.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn render(&self, g: Gauges) -> String {
        let mut out = String::with_capacity(4096);
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.push_str("# HELP strata_decisions_total Rate-limit decisions by outcome and where they were made.\n");
        out.push_str("# TYPE strata_decisions_total counter\n");
        for (s, source) in SOURCES.iter().enumerate() {
            for (a, outcome) in ["allowed", "denied"].iter().enumerate() {
                let _ = writeln!(
                    out,
                    "strata_decisions_total{{source=\"{source}\",outcome=\"{outcome}\"}} {}",
                    load(&self.decisions[s][a])
                );
            }
        }
        out.push_str("# HELP strata_origin_reasons_total Requests sent to the origin, by why: cold, stale (lease expired), strict, or lease (used up).\n");
        out.push_str("# TYPE strata_origin_reasons_total counter\n");
        for (r, reason) in REASONS.iter().enumerate() {
            let _ = writeln!(
                out,
                "strata_origin_reasons_total{{reason=\"{reason}\"}} {}",
                load(&self.origin_reasons[r])
            );
        }
        out.push_str("# HELP strata_lease_size Leases granted by this gateway's origin decisions, in cost units.\n");
        out.push_str("# TYPE strata_lease_size histogram\n");
        for (bound, bucket) in LEASE_BUCKETS.iter().zip(&self.lease_buckets) {
            let _ = writeln!(
                out,
                "strata_lease_size_bucket{{le=\"{bound}\"}} {}",
                load(bucket)
            );
        }
        let lease_count = load(&self.lease_count);
        let _ = writeln!(out, "strata_lease_size_bucket{{le=\"+Inf\"}} {lease_count}");
        let _ = writeln!(out, "strata_lease_size_sum {}", load(&self.lease_sum));
        let _ = writeln!(out, "strata_lease_size_count {lease_count}");
        out.push_str("# HELP strata_origin_calls_total Calls to the regional origin by operation and result.\n");
        out.push_str("# TYPE strata_origin_calls_total counter\n");
        for (o, op) in OPS.iter().enumerate() {
            for (r, result) in RESULTS.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "strata_origin_calls_total{{op=\"{op}\",result=\"{result}\"}} {}",
                    load(&self.origin_calls[o][r])
                );
            }
        }
        out.push_str(
            "# HELP strata_origin_call_seconds Latency of calls to the regional origin.\n",
        );
        out.push_str("# TYPE strata_origin_call_seconds histogram\n");
        for (o, op) in OPS.iter().enumerate() {
            let h = &self.origin_latency[o];
            for (bound, bucket) in BUCKETS.iter().zip(&h.buckets) {
                let _ = writeln!(
                    out,
                    "strata_origin_call_seconds_bucket{{op=\"{op}\",le=\"{bound}\"}} {}",
                    load(bucket)
                );
            }
            let count = load(&h.count);
            let _ = writeln!(
                out,
                "strata_origin_call_seconds_bucket{{op=\"{op}\",le=\"+Inf\"}} {count}"
            );
            let _ = writeln!(
                out,
                "strata_origin_call_seconds_sum{{op=\"{op}\"}} {}",
                load(&h.sum_micros) as f64 / 1e6
            );
            let _ = writeln!(
                out,
                "strata_origin_call_seconds_count{{op=\"{op}\"}} {count}"
            );
        }
        let scalars: [(&str, &str, &str, String); 8] = [
            (
                "strata_replay_cells_total",
                "counter",
                "Cells delivered to the origin by replay.",
                load(&self.replay_cells).to_string(),
            ),
            (
                "strata_lease_renewals_total",
                "counter",
                "Leases in use renewed by a replay instead of by a request's origin decision.",
                load(&self.leases_renewed).to_string(),
            ),
            (
                "strata_replay_dropped_total",
                "counter",
                "Accepted cost lost before the origin acknowledged it (evicted from a table full of unreplayed keys, or aged out while the origin was unreachable).",
                g.replay_lost.to_string(),
            ),
            (
                "strata_replay_failed_batches_total",
                "counter",
                "Replay batches that failed (their counts go out with the next).",
                load(&self.replay_failed_batches).to_string(),
            ),
            (
                "strata_replay_queue_cells",
                "gauge",
                "Cells whose own count the origin has not acknowledged yet.",
                g.replay_queue_cells.to_string(),
            ),
            (
                "strata_local_windows",
                "gauge",
                "Window keys held in local memory.",
                g.local_windows.to_string(),
            ),
            (
                "strata_local_evictions_total",
                "counter",
                "Window keys evicted from local memory.",
                g.local_evictions.to_string(),
            ),
            (
                "strata_origin_breaker_open",
                "gauge",
                "1 while the origin circuit breaker refuses calls.",
                u8::from(g.breaker_open).to_string(),
            ),
        ];
        for (name, kind, help, value) in scalars {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP strata_origin_up 1 if the origin answered the last readiness probe.\n# TYPE strata_origin_up gauge\nstrata_origin_up {}",
            u8::from(g.origin_up)
        );
        out
    }
}
