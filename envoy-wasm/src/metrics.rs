//! The filter's counters, named as Envoy operators read the local rate-limit filter's
//! (`<prefix>.ok`, `.rate_limited`, `.enforced`), plus `.shadow`, where requests were decided,
//! gateway call and replay outcomes, and the VMs' tables and linear memory (gauges). Envoy shows
//! them in `/stats`, summed across VMs.

use crate::host::Host;

/// Each counter and gauge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// Passed every enforced limit.
    Ok,
    /// Over a limit, enforced or shadow.
    RateLimited,
    /// Answered 429.
    Enforced,
    /// A shadow rule would have denied.
    Shadow,
    /// Decided from the VM's memory.
    DecidedLocal,
    /// Decided by the gateway.
    DecidedOrigin,
    /// Decided by the failure mode (the gateway failed or was too slow).
    DecidedFallback,
    /// Decided from the VM's memory ahead of the gateway's answer (no live answer, far from
    /// the limit; the call goes out meanwhile).
    DecidedAhead,
    /// Decision calls sent to the gateway.
    OriginCalls,
    /// Decision calls sent because the key was cold to the VM (no answer in its window).
    ReasonCold,
    /// Decision calls sent because the key's lease had expired.
    ReasonStale,
    /// Decision calls sent because a recent denial keeps passes beyond the lease at the
    /// gateway.
    ReasonStrict,
    /// Decision calls sent because the lease left did not cover the request.
    ReasonLease,
    /// Decision calls that failed (refused, error status, timeout).
    OriginFailures,
    /// Requests that waited for a call another request on the same key had in flight.
    Coalesced,
    /// Replay batches the gateway took.
    Replays,
    /// Replay batches that failed (their counts go with the next).
    ReplayFailures,
    /// Requests a `remote_address` rule did not apply to: no trusted client address.
    Unaddressed,
    /// Window keys the VMs' tables evicted to make room.
    TableEvicted,
    /// Own admitted cost evicted before the gateway acknowledged it.
    ReplayDropped,
    /// Gauge: window keys the VMs' tables hold.
    TableEntries,
    /// Gauge: the most they hold.
    TableCapacity,
    /// Gauge: the bytes they hold.
    TableBytes,
    /// Gauge: the VMs' linear memory.
    MemoryBytes,
}

/// The gauges: each VM adds the change in its own figure, so Envoy shows their sum.
const GAUGES: [Metric; 4] = [
    Metric::TableEntries,
    Metric::TableCapacity,
    Metric::TableBytes,
    Metric::MemoryBytes,
];

const ALL: [(Metric, &str); 24] = [
    (Metric::Ok, "ok"),
    (Metric::RateLimited, "rate_limited"),
    (Metric::Enforced, "enforced"),
    (Metric::Shadow, "shadow"),
    (Metric::DecidedLocal, "decided.local"),
    (Metric::DecidedOrigin, "decided.origin"),
    (Metric::DecidedFallback, "decided.fallback"),
    (Metric::DecidedAhead, "decided.ahead"),
    (Metric::OriginCalls, "origin.calls"),
    (Metric::ReasonCold, "origin.reason.cold"),
    (Metric::ReasonStale, "origin.reason.stale"),
    (Metric::ReasonStrict, "origin.reason.strict"),
    (Metric::ReasonLease, "origin.reason.lease"),
    (Metric::OriginFailures, "origin.failures"),
    (Metric::Coalesced, "origin.coalesced"),
    (Metric::Replays, "replay.ok"),
    (Metric::ReplayFailures, "replay.failures"),
    (Metric::Unaddressed, "unaddressed"),
    (Metric::TableEvicted, "table.evicted"),
    (Metric::ReplayDropped, "replay.dropped"),
    (Metric::TableEntries, "table.entries"),
    (Metric::TableCapacity, "table.capacity"),
    (Metric::TableBytes, "table.bytes"),
    (Metric::MemoryBytes, "memory.bytes"),
];

/// The ids the host gave the counters.
#[derive(Debug, Default)]
pub struct Metrics {
    ids: Vec<(Metric, u32)>,
}

impl Metrics {
    /// Defines every counter under `prefix`.
    pub fn define(host: &impl Host, prefix: &str) -> Self {
        let ids = ALL
            .iter()
            .filter_map(|(m, name)| {
                let name = format!("{prefix}.{name}");
                let gauge = GAUGES.contains(m);
                Some((*m, host.define_metric(&name, gauge)?))
            })
            .collect();
        Self { ids }
    }

    /// Adds `by` to `metric` (a gauge may go down).
    pub fn add(&self, host: &impl Host, metric: Metric, by: i64) {
        if let Some((_, id)) = self.ids.iter().find(|(m, _)| *m == metric) {
            host.increment(*id, by);
        }
    }

    /// The full names, for documentation and tests.
    pub fn names(prefix: &str) -> Vec<String> {
        ALL.iter().map(|(_, n)| format!("{prefix}.{n}")).collect()
    }
}
