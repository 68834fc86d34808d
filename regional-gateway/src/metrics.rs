//! Prometheus metrics on `prometheus-client`, which does the exposition, types and escaping.
//! Strata keeps the names, labels and buckets operators' dashboards use. Every labelled series
//! is created up front and its handle kept, so the request path increments an atomic and takes
//! no lock (a `Family` lookup would read-lock its map on every request); values owned elsewhere
//! in the gateway are copied in at scrape time ([`Gauges`]). The one exception is the
//! rate-limit service's series per configured descriptor, which a reload can add: looked up
//! per call (a gRPC call's cost dwarfs the read lock), labelled from the configuration only.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Where a decision was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// From local memory, warm and fresh.
    Local,
    /// After a synchronous origin read (cold, stale or strict).
    Origin,
    /// Local, because the origin read failed.
    Fallback,
    /// From local memory ahead of the origin's answer (no live answer, far from the limit).
    Ahead,
}

impl Source {
    const fn index(self) -> usize {
        match self {
            Source::Local => 0,
            Source::Origin => 1,
            Source::Fallback => 2,
            Source::Ahead => 3,
        }
    }
}

const SOURCES: [&str; 4] = ["local", "origin", "fallback", "ahead"];
const OUTCOMES: [&str; 2] = ["allowed", "denied"];
const OPS: [&str; 4] = ["read", "replay", "decide", "ping"];
const RESULTS: [&str; 5] = ["ok", "timeout", "circuit_open", "backend", "rejected"];
/// Upper bounds of the origin latency histogram, in seconds.
const BUCKETS: [f64; 11] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];
const RLS_RESULTS: [&str; 3] = ["ok", "over_limit", "refused"];
const RELOAD_RESULTS: [&str; 2] = ["ok", "failed"];
/// Upper bounds of the lease size histogram, in cost units.
const LEASE_BUCKETS: [f64; 10] = [
    0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1_000.0, 10_000.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    source: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    op: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// A descriptor of the rate-limit service: its domain and its place in the configuration
/// (never a request's value, so the series are as many as the configuration makes).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DescriptorLabels {
    domain: String,
    descriptor: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

fn latency_histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// Every series of `family` over `labels`, created now so none is missing from the first
/// scrape, and their handles in the same order.
fn series<S, M, C, const N: usize>(family: &Family<S, M, C>, labels: [S; N]) -> [M; N]
where
    S: Clone + std::hash::Hash + Eq,
    M: Clone,
    C: prometheus_client::metrics::family::MetricConstructor<M>,
{
    labels.map(|l| family.get_or_create(&l).clone())
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

/// Every counter, gauge and histogram of the gateway but the global layer's.
#[derive(Debug)]
pub struct Metrics {
    decision_family: Family<DecisionLabels, Counter>,
    decisions: [[Counter; 2]; SOURCES.len()],
    reason_family: Family<ReasonLabels, Counter>,
    origin_reasons: [Counter; strata_core::Reason::LABELS.len()],
    call_family: Family<CallLabels, Counter>,
    origin_calls: [[Counter; RESULTS.len()]; OPS.len()],
    latency_family: Family<OpLabels, Histogram, fn() -> Histogram>,
    origin_latency: [Histogram; OPS.len()],
    lease_size: Histogram,
    replay_cells: Counter,
    replay_pass: Histogram,
    leases_renewed: Counter,
    replay_dropped: Counter,
    replay_failed_batches: Counter,
    replay_queue_cells: Gauge,
    local_windows: Gauge,
    local_evictions: Counter,
    breaker_open: Gauge,
    origin_up: Gauge,
    rls_family: Family<ResultLabels, Counter>,
    rls_calls: [Counter; RLS_RESULTS.len()],
    rls_shadow_over: Counter,
    rls_descriptors: Family<DescriptorLabels, Counter>,
    rls_reload_family: Family<ResultLabels, Counter>,
    rls_reloads: [Counter; RELOAD_RESULTS.len()],
    rls_config_broken: Gauge,
}

/// How the rate-limit service answered a `ShouldRateLimit` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RlsResult {
    /// `OK`.
    Ok,
    /// `OVER_LIMIT`.
    OverLimit,
    /// A call it cannot decide as sent, answered without counting anything.
    Refused,
}

impl Default for Metrics {
    fn default() -> Self {
        let decision_family = Family::default();
        let decisions = SOURCES.map(|source| {
            series(
                &decision_family,
                OUTCOMES.map(|outcome| DecisionLabels { source, outcome }),
            )
        });
        let reason_family = Family::default();
        let origin_reasons = series(
            &reason_family,
            strata_core::Reason::LABELS.map(|reason| ReasonLabels { reason }),
        );
        let call_family = Family::default();
        let origin_calls = OPS.map(|op| {
            series(
                &call_family,
                RESULTS.map(|result| CallLabels { op, result }),
            )
        });
        let latency_family = Family::<OpLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram,
        );
        let origin_latency = series(&latency_family, OPS.map(|op| OpLabels { op }));
        let rls_family = Family::default();
        let rls_calls = series(
            &rls_family,
            RLS_RESULTS.map(|result| ResultLabels { result }),
        );
        let rls_reload_family = Family::default();
        let rls_reloads = series(
            &rls_reload_family,
            RELOAD_RESULTS.map(|result| ResultLabels { result }),
        );
        Self {
            decision_family,
            decisions,
            reason_family,
            origin_reasons,
            call_family,
            origin_calls,
            latency_family,
            origin_latency,
            lease_size: Histogram::new(LEASE_BUCKETS),
            replay_cells: Counter::default(),
            replay_pass: latency_histogram(),
            leases_renewed: Counter::default(),
            replay_dropped: Counter::default(),
            replay_failed_batches: Counter::default(),
            replay_queue_cells: Gauge::default(),
            local_windows: Gauge::default(),
            local_evictions: Counter::default(),
            breaker_open: Gauge::default(),
            origin_up: Gauge::default(),
            rls_family,
            rls_calls,
            rls_shadow_over: Counter::default(),
            rls_descriptors: Family::default(),
            rls_reload_family,
            rls_reloads,
            rls_config_broken: Gauge::default(),
        }
    }
}

/// A count as a gauge's value.
fn gauge_value(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Metrics {
    /// Registers every metric under its exported name (counters get their `_total` from the
    /// registry).
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "strata_decisions",
            "Rate-limit decisions by outcome and where they were made",
            self.decision_family.clone(),
        );
        r.register(
            "strata_rls_calls",
            "Calls to Envoy's rate-limit service (--rls-listen), by answer: ok, over_limit, or refused (a call it cannot decide as sent: an unknown domain, answered per --rls-unknown-domain, or a malformed descriptor, answered OVER_LIMIT; nothing counted)",
            self.rls_family.clone(),
        );
        r.register(
            "strata_rls_decisions",
            "Descriptors the rate-limit service decided, by domain, descriptor (its place in --rls-config: `key_value` or `key` per level, joined by `.`; `request_limit` for a limit the request carried) and outcome: ok, over_limit, or shadow_over_limit (a shadow descriptor that would have denied)",
            self.rls_descriptors.clone(),
        );
        r.register(
            "strata_rls_config_reloads",
            "Reloads of --rls-config after it changed or on SIGHUP, by result: ok, or failed (the last good configuration stays in force)",
            self.rls_reload_family.clone(),
        );
        r.register(
            "strata_rls_config_broken",
            "1 while --rls-config as it is on disk does not load (the last good configuration is in force), else 0",
            self.rls_config_broken.clone(),
        );
        r.register(
            "strata_rls_shadow_over_limit",
            "Shadow descriptors of the rate-limit service found over their limit (they never deny)",
            self.rls_shadow_over.clone(),
        );
        r.register(
            "strata_origin_reasons",
            "Requests sent to the origin, by why: cold, stale (lease expired), strict, or lease (used up)",
            self.reason_family.clone(),
        );
        r.register(
            "strata_lease_size",
            "Leases granted by this gateway's origin decisions, in cost units",
            self.lease_size.clone(),
        );
        r.register(
            "strata_origin_calls",
            "Calls to the regional origin by operation and result",
            self.call_family.clone(),
        );
        r.register(
            "strata_origin_call_seconds",
            "Latency of calls to the regional origin",
            self.latency_family.clone(),
        );
        r.register(
            "strata_replay_cells",
            "Cells delivered to the origin by replay",
            self.replay_cells.clone(),
        );
        r.register(
            "strata_replay_pass_seconds",
            "Wall time of a replay pass that sent something: every waiting cell, in batches, requests served between two (near the replay interval, the replay falls behind)",
            self.replay_pass.clone(),
        );
        r.register(
            "strata_lease_renewals",
            "Leases in use renewed by a replay instead of by a request's origin decision",
            self.leases_renewed.clone(),
        );
        r.register(
            "strata_replay_dropped",
            "Accepted cost lost before the origin acknowledged it (evicted from a table full of unreplayed keys, or aged out while the origin was unreachable)",
            self.replay_dropped.clone(),
        );
        r.register(
            "strata_replay_failed_batches",
            "Replay batches that failed (their counts go out with the next)",
            self.replay_failed_batches.clone(),
        );
        r.register(
            "strata_replay_queue_cells",
            "Cells whose own count the origin has not acknowledged yet",
            self.replay_queue_cells.clone(),
        );
        r.register(
            "strata_local_windows",
            "Window keys held in local memory",
            self.local_windows.clone(),
        );
        r.register(
            "strata_local_evictions",
            "Window keys evicted from local memory",
            self.local_evictions.clone(),
        );
        r.register(
            "strata_origin_breaker_open",
            "1 while the origin circuit breaker refuses calls",
            self.breaker_open.clone(),
        );
        r.register(
            "strata_origin_up",
            "1 if the origin answered the last readiness probe",
            self.origin_up.clone(),
        );
    }

    /// Copies in the values other parts of the gateway own, before a scrape.
    pub fn sample(&self, g: Gauges) {
        // Counters whose running total lives elsewhere: the scrape shows that total.
        self.replay_dropped
            .inner()
            .store(g.replay_lost, std::sync::atomic::Ordering::Relaxed);
        self.local_evictions
            .inner()
            .store(g.local_evictions, std::sync::atomic::Ordering::Relaxed);
        self.replay_queue_cells
            .set(gauge_value(g.replay_queue_cells));
        self.local_windows.set(gauge_value(g.local_windows));
        self.breaker_open.set(i64::from(g.breaker_open));
        self.origin_up.set(i64::from(g.origin_up));
    }

    /// Counts one decision.
    pub fn decision(&self, source: Source, allowed: bool) {
        self.decisions[source.index()][usize::from(!allowed)].inc();
    }

    /// Decisions so far from `source` (for tests and the load harness).
    pub fn decisions(&self, source: Source) -> u64 {
        self.decisions[source.index()]
            .iter()
            .map(Counter::get)
            .sum()
    }

    /// Counts one origin call with its outcome (`Err(kind)`) and latency.
    pub fn origin_call(&self, op: &str, result: Result<(), &str>, elapsed: Duration) {
        let o = OPS.iter().position(|x| *x == op).unwrap_or(0);
        let r = match result {
            Ok(()) => 0,
            Err(kind) => RESULTS.iter().position(|x| *x == kind).unwrap_or(3),
        };
        self.origin_calls[o][r].inc();
        self.origin_latency[o].observe(elapsed.as_secs_f64());
    }

    /// Origin calls of `op` so far, all outcomes.
    pub fn origin_calls(&self, op: &str) -> u64 {
        let o = OPS.iter().position(|x| *x == op).unwrap_or(0);
        self.origin_calls[o].iter().map(Counter::get).sum()
    }

    /// Origin calls of `op` that were answered (`result="ok"`).
    pub fn origin_answers(&self, op: &str) -> u64 {
        let o = OPS.iter().position(|x| *x == op).unwrap_or(0);
        self.origin_calls[o].first().map_or(0, Counter::get)
    }

    /// A decision that went to the origin, and why.
    pub fn origin_reason(&self, reason: strata_core::Reason) {
        self.origin_reasons[reason.index()].inc();
    }

    /// A lease this gateway's origin granted (to itself or an edge).
    pub fn lease_granted(&self, lease: u64) {
        // Exact below 2^53; a lease is at most a limit, which the API caps there.
        #[allow(clippy::cast_precision_loss)]
        self.lease_size.observe(lease as f64);
    }

    /// Requests sent to the origin for `reason` so far.
    pub fn origin_reasons(&self, reason: strata_core::Reason) -> u64 {
        self.origin_reasons[reason.index()].get()
    }

    /// Cells delivered to the origin by replay.
    pub fn replayed(&self, cells: usize) {
        self.replay_cells.inc_by(cells as u64);
    }

    /// A replay pass that took `seconds` of wall time.
    pub fn replay_pass(&self, seconds: f64) {
        self.replay_pass.observe(seconds);
    }

    /// Leases in use renewed by a replay (each spares a request a round trip).
    pub fn leases_renewed(&self, leases: usize) {
        self.leases_renewed.inc_by(leases as u64);
    }

    /// A replay batch that failed (its counts go out with the next).
    pub fn replay_failed(&self) {
        self.replay_failed_batches.inc();
    }

    /// A shadow descriptor over its limit.
    pub fn rls_shadow_over(&self) {
        self.rls_shadow_over.inc();
    }

    /// A descriptor of `domain` decided: `descriptor` is its place in the configuration.
    pub fn rls_descriptor(&self, domain: &str, descriptor: &str, outcome: &'static str) {
        let labels = DescriptorLabels {
            domain: domain.to_string(),
            descriptor: descriptor.to_string(),
            outcome,
        };
        self.rls_descriptors.get_or_create(&labels).inc();
    }

    /// A reload of the rate-limit service's configuration: whether it loaded.
    pub fn rls_reload(&self, ok: bool) {
        if let Some(c) = self.rls_reloads.get(usize::from(!ok)) {
            c.inc();
        }
        self.rls_config_broken.set(i64::from(!ok));
    }

    /// A `ShouldRateLimit` call answered.
    pub fn rls_call(&self, result: RlsResult) {
        let i = match result {
            RlsResult::Ok => 0,
            RlsResult::OverLimit => 1,
            RlsResult::Refused => 2,
        };
        if let Some(c) = self.rls_calls.get(i) {
            c.inc();
        }
    }
}

/// The OpenMetrics text of `registry`.
pub fn render(registry: &Registry) -> String {
    let mut out = String::with_capacity(8192);
    // Writing into a String cannot fail; an encoder error would leave a partial page, which
    // Prometheus rejects as a whole.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, registry) {
        tracing::warn!(error = %e, "metrics encoding failed");
    }
    out
}

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
