//! The gateway's own decisions, driven through the core's request path like an edge's: local
//! memory first (a denial, or a pass the lease covers); otherwise one origin decision, merged
//! back by the core; a failure falls back to local memory. This file only orders the steps
//! around locks and awaits: no lock is held across an await.

mod inflight;
mod janitor;
mod multi;

pub use inflight::InFlight;
use inflight::Turn;
pub use janitor::{JANITOR_SCAN, ORIGIN_PURGE_STEP, Purged};

use std::sync::Arc;

use strata_core::replay::{QuietPace, ReplayEvent};
use strata_core::request::OriginCall;
use strata_core::table::{LimitRequest, Step};
use strata_core::wire::{DecideRef, DecideResponse, DecideResult, ReplayRef};
use strata_core::{Counts, Decision, MultiDecision, OriginAnswer, WindowKeyRef};

use crate::clock::Clock;
use crate::local::{LocalTables, ReplayCursor};
use crate::metrics::{Metrics, Source};
use crate::origin::{CellUsed, DecideAnswer, DecideLimit, OriginClient, OriginError};

/// Cells per batch of the replay loop. A batch is taken, merged at the origin and acknowledged
/// without a yield on the embedded origin (nothing in it waits), and on Redis it is one script
/// call that Redis runs before serving anyone else, so its size bounds how long a replay holds
/// a worker (or Redis) between two requests: at about 3 us a cell on the embedded origin
/// (measured at 10,000 keys), 128 cells hold it under half a millisecond, where the 1,000 of a
/// wire batch held it 4 ms; at 10,000 keys a pass is still about ten round trips to Redis.
pub const REPLAY_STEP: usize = 128;

/// What one tick of the replay loop did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayTick {
    /// Whether every batch was delivered.
    pub delivered: bool,
    /// Batches sent (an empty take sends none).
    pub batches: usize,
    /// Cells they carried.
    pub cells: usize,
}

/// Local tables and origin, and the decision flow over them.
#[derive(Debug)]
pub struct Limiter {
    /// Local memory (and, in it, the replay buffer).
    pub local: LocalTables,
    /// The regional origin.
    pub origin: OriginClient,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Time.
    pub clock: Clock,
    /// This process's random id, sent with its origin calls (own counts and leases are kept
    /// per instance at the origin).
    pub instance: String,
    /// The region's counts as this gateway knows them, and what it imported from the others.
    pub global: crate::global::Global,
    /// Single-limit origin calls in flight, which concurrent requests on their key wait for.
    pub in_flight: InFlight,
}

/// The only decision of a one-limit request (a denial if the core answered none).
fn only(multi: &MultiDecision, limit: &LimitRequest<'_>) -> Decision {
    multi.decisions.first().copied().unwrap_or(Decision {
        success: false,
        limit: limit.limit,
        remaining: 0,
        reset_ms: 0,
        retry_after_ms: Some(1),
    })
}

impl Limiter {
    /// Assembles a limiter.
    pub fn new(
        local: LocalTables,
        origin: OriginClient,
        metrics: Arc<Metrics>,
        clock: Clock,
        global: crate::global::Global,
    ) -> Self {
        Self {
            local,
            origin,
            metrics,
            clock,
            global,
            in_flight: InFlight::default(),
            instance: format!("gw-{:016x}", rand::random::<u64>()),
        }
    }

    /// Decides one limit: locally where the lease allows it (or the local view denies),
    /// otherwise at the origin, atomically. A request whose key already has a call in flight
    /// waits for that call once (bounded by the origin timeout), then decides again: a burst
    /// on a cold key, or on a hot key at its window's rollover, makes one call, not one per
    /// request.
    pub async fn decide(&self, limit: LimitRequest<'_>) -> Decision {
        let key = limit.key;
        let mut followed = false;
        let mut outlived = false;
        loop {
            let now = self.clock.now_ms();
            let step = self
                .local
                .lock(key)
                .check(key, limit.limit, limit.cost, now);
            let plan = match step {
                Step::Decided(d) => {
                    self.metrics.decision(Source::Local, d.success);
                    return d;
                }
                Step::Fallback(d) => {
                    self.metrics.decision(Source::Fallback, d.success);
                    return d;
                }
                Step::Origin(plan) => plan,
            };
            // The plan of a request that follows is dropped: the leader's call gives back
            // whatever lease it gave back, and an unused call id is only a gap. Both waits are
            // boxed: a request's future is as large as its largest await, so unboxed the origin
            // call's few kilobytes were allocated for every request, though about one in a
            // thousand goes to the origin.
            let lead = match (followed, self.in_flight.turn(key)) {
                (false, Turn::Follow(done)) => {
                    followed = true;
                    let waited = tokio::time::timeout(self.origin.timeout(), done);
                    outlived = Box::pin(waited).await.is_err();
                    continue;
                }
                (_, Turn::Lead(lead)) => Some(lead),
                (true, Turn::Follow(_)) => None,
            };
            let call = OriginCall::single(limit, plan);
            if outlived && lead.is_none() {
                // The call it waited for outlived the timeout and is still out: it failed,
                // recorded or not yet. A call of its own would wait the timeout again.
                let multi = self.fail_call(&call);
                let d = only(&multi, &limit);
                self.metrics.decision(Source::Fallback, d.success);
                return d;
            }
            let (multi, source) = Box::pin(self.decide_at_origin(&call)).await;
            drop(lead);
            let d = only(&multi, &limit);
            self.metrics.decision(source, d.success);
            return d;
        }
    }

    /// Sends `call` to the origin and returns the core's answers (the region view records
    /// them on the way).
    async fn ask_origin(&self, call: &OriginCall) -> Result<Vec<OriginAnswer>, OriginError> {
        self.metrics.origin_reason(call.reason());
        let now = self.clock.now_ms();
        let limits: Vec<DecideLimit<'_>> = call
            .limits()
            .iter()
            .map(|l| self.origin_limit(&l.decide_ref(), now))
            .collect();
        let answer = self.origin.decide(&self.instance, &limits, now).await?;
        let response = self.respond(&limits, &answer);
        call.answers(&response)
            .map_err(|e| OriginError::Rejected(e.to_string()))
    }

    /// One limit as this gateway's origin decides it, from this process's own call or an
    /// edge's: the caller's own counts mapped onto the origin's cells, and the region view's
    /// imported counts.
    pub fn origin_limit<'a>(&self, r: &DecideRef<'a>, now_ms: u64) -> DecideLimit<'a> {
        let key = r.limit.key;
        let (global, floor) = self.global.imported(key, key.duration().sequence(now_ms));
        DecideLimit::new(r, now_ms, global, floor)
    }

    /// An origin decision as `/v1/origin/decide` answers it: recorded in the region's view
    /// (what the flush publishes), with the imported components.
    pub fn respond(&self, limits: &[DecideLimit<'_>], answer: &DecideAnswer) -> DecideResponse {
        let now = self.clock.now_ms();
        let results: Vec<DecideResult> = limits
            .iter()
            .zip(&answer.limits)
            .map(|(l, o)| {
                let (current, previous) =
                    self.global
                        .record(l.key, o.sequence, [o.current, o.previous], l.limit, now);
                if answer.success {
                    self.metrics.lease_granted(o.lease);
                }
                DecideResult {
                    success: o.decision.success,
                    limit: o.decision.limit,
                    remaining: o.decision.remaining,
                    reset: o.decision.reset_ms,
                    sequence: o.sequence,
                    current,
                    previous,
                    used: o.used,
                    lease: o.lease,
                    lease_id: o.lease_id,
                    lease_ms: self.origin.lease_ms(),
                }
            })
            .collect();
        DecideResponse {
            success: answer.success,
            sequence: results.first().map_or(0, |r| r.sequence),
            results,
        }
    }

    /// Sends one replay batch (up to `MAX_BATCH` cells) of every cell holding unacknowledged
    /// cost. Returns false if it failed; the counts stay in the tables and the next batch
    /// carries them.
    pub async fn replay_once(&self) -> bool {
        let (delivered, _, _) = self
            .replay_batch(None, strata_core::wire::MAX_BATCH, ReplayCursor::default())
            .await;
        delivered
    }

    /// One tick of the replay loop, the `pass`-th, `interval_ms` after the last: every cell
    /// holding unacknowledged cost, a quiet one only on its turn ([`QuietPace::new`]), sent
    /// in batches of [`REPLAY_STEP`] cells, each taken from where the last stopped, with a
    /// yield to the requests between two. A failed batch ends the tick (its cells go with the
    /// next). Its wall time goes to `strata_replay_pass_seconds`: under a load that fills the
    /// workers, a pass stretches (every waiting request runs between two batches), and one
    /// nearing the interval says the replay is falling behind.
    pub async fn replay_tick(&self, pass: u32, interval_ms: u64) -> ReplayTick {
        // Alone, the region's counts are imported by no one: the publish floor does not
        // hold a cell's cost back from the pace.
        let publish = (!self.global.alone()).then(|| self.global.policy());
        let pace = QuietPace::new(pass, interval_ms, publish, self.origin.lease_ms());
        let started = std::time::Instant::now();
        let mut tick = ReplayTick {
            delivered: true,
            batches: 0,
            cells: 0,
        };
        let mut from = Some(ReplayCursor::default());
        while let Some(cursor) = from {
            if tick.batches > 0 {
                tokio::task::yield_now().await;
            }
            let (delivered, taken, next) = self.replay_batch(Some(pace), REPLAY_STEP, cursor).await;
            if taken > 0 {
                tick.batches += 1;
                tick.cells += taken;
            }
            if !delivered {
                tick.delivered = false;
                break;
            }
            from = next;
        }
        self.metrics.replay_pass(started.elapsed().as_secs_f64());
        tick
    }

    /// Takes up to `max` cells from where `from` points on and sends them to the origin.
    /// Returns whether they were delivered, how many were taken, and where the next batch of
    /// the same pass goes on (`None`: every cell was looked at).
    async fn replay_batch(
        &self,
        pace: Option<QuietPace>,
        max: usize,
        from: ReplayCursor,
    ) -> (bool, usize, Option<ReplayCursor>) {
        let now = self.clock.now_ms();
        let (batch, next) = self.local.take_replay(max, now, pace, from);
        if batch.is_empty() {
            return (true, 0, None);
        }
        let refs: Vec<ReplayRef<'_>> = batch.events.iter().map(ReplayEvent::replay_ref).collect();
        let renew: Vec<u64> = batch.events.iter().map(|e| e.renew).collect();
        // A renewed lease runs a lease lifetime from when the batch was taken.
        let until = now.saturating_add(self.origin.lease_ms());
        match self.replay_refs(&self.instance, &refs, &renew, now).await {
            Ok(answers) => {
                let (mut delivered, mut renewed) = (0, 0);
                let acks = batch.events.iter().zip(answers).filter_map(|(e, answer)| {
                    let (counts, lease_id) = answer?;
                    delivered += 1;
                    renewed += usize::from(lease_id > 0);
                    Some((e, counts, (lease_id > 0).then_some((lease_id, until))))
                });
                self.local.ack_replay(acks);
                self.metrics.replayed(delivered);
                self.metrics.leases_renewed(renewed);
                (delivered == batch.len(), batch.len(), next)
            }
            Err(e) => {
                self.metrics.replay_failed();
                tracing::warn!(error = %e, cells = batch.len(), "replay batch failed; sent again with the next");
                (false, batch.len(), next)
            }
        }
    }

    /// Merges `instance`'s replayed own counts at the origin, renews the leases `renew` names
    /// (per event, 0: none; an empty slice: none at all), and records each cell's answer in
    /// the region view (with the limit it was admitted under); returns the counts as the
    /// gateway answers them and the renewed lease's id (0: not renewed), `None` for a cell
    /// that failed alone.
    pub async fn replay_refs(
        &self,
        instance: &str,
        events: &[ReplayRef<'_>],
        renew: &[u64],
        now_ms: u64,
    ) -> Result<Vec<Option<(Counts, u64)>>, OriginError> {
        let cells: Vec<CellUsed<'_>> = events
            .iter()
            .enumerate()
            .map(|(i, e)| CellUsed {
                key: e.cell.key,
                sequence: e.cell.sequence,
                used: e.used,
                release: e.release,
                renew: renew.get(i).copied().unwrap_or(0),
                acked: e.acked,
            })
            .collect();
        let after = self.origin.replay(instance, &cells, now_ms).await?;
        let delivered = events
            .iter()
            .zip(&after)
            .filter_map(|(e, a)| a.map(|r| (e.cell.key, e.cell.sequence, r.count, Some(e.limit))));
        let mut counts = self.global.record_cells(delivered, now_ms).into_iter();
        Ok(after
            .into_iter()
            .map(|answer| {
                let r = answer?;
                Some((counts.next().unwrap_or_default(), r.renewed))
            })
            .collect())
    }

    /// Cells whose own count the origin has not acknowledged yet.
    pub fn unreplayed(&self) -> usize {
        self.local.replay_state().0
    }
}

/// The window keys of a request, for the shards it locks.
fn keys<'a>(limits: &[LimitRequest<'a>]) -> Vec<WindowKeyRef<'a>> {
    limits.iter().map(|l| l.key).collect()
}
