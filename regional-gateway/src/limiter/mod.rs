//! The gateway's own decisions, through the core's request flow like an edge's
//! ([`strata_core::driver::Flow`]): local memory first (a denial, or a pass the lease covers);
//! otherwise one origin decision, which concurrent requests on its keys wait for instead of
//! making their own, merged back by the core; a call that fails or outlives the request's
//! time is decided per the failure mode. This file maps tokio onto the flow's events: a
//! request's arrival, a call's answer or failure, the call's bound as a tokio timeout.

mod flows;
mod janitor;
mod replay;

pub use flows::Flows;
pub use janitor::{JANITOR_SCAN, ORIGIN_PURGE_STEP, Purged};
pub use replay::{ReplayPass, ReplayPump};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use strata_core::driver::{DecidedBy, Dispatch, FlowConfig, Outgoing};
use strata_core::replay::{ReplayBatch, ReplayEvent};
use strata_core::request::OriginCall;
use strata_core::table::LimitRequest;
use strata_core::wire::{
    CellsResponse, DecideRef, DecideResponse, DecideResult, MAX_BATCH, RenewedLease, ReplayPace,
    ReplayRef,
};
use strata_core::{Counts, Decision, MultiDecision};
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::local::{LocalTables, ReplayCursor};
use crate::metrics::{Metrics, Source};
use crate::origin::{CellUsed, DecideAnswer, DecideLimit, OriginClient, OriginError};
use flows::Tables;

/// Cells per batch of the replay loop. A batch is taken, merged at the origin and acknowledged
/// without a yield on the embedded origin (nothing in it waits), and on Redis it is one script
/// call that Redis runs before serving anyone else, so its size bounds how long a replay holds
/// a worker (or Redis) between two requests: at about 3 us a cell on the embedded origin
/// (measured at 10,000 keys), 128 cells hold it under half a millisecond, where the 1,000 of a
/// wire batch held it 4 ms; at 10,000 keys a pass is still about ten round trips to Redis.
pub const REPLAY_STEP: usize = 128;

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
    /// Requests waiting for the origin, and the calls in flight they wait for.
    pub flows: Flows,
    next_request: AtomicU64,
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

/// The metrics' name for a path.
fn source(by: DecidedBy) -> Source {
    match by {
        DecidedBy::Local => Source::Local,
        DecidedBy::Origin => Source::Origin,
        DecidedBy::Fallback => Source::Fallback,
        DecidedBy::Ahead => Source::Ahead,
    }
}

/// A request waiting in flow `shard`: withdrawn from it if the request is dropped (its
/// client hung up) before its decision came, so a call it joined does not begin it again.
struct Waiter<'a> {
    limiter: &'a Limiter,
    shard: usize,
    id: u64,
    done: bool,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut flow = self.limiter.flows.lock(self.shard);
            flow.flow.cancel((self.id, 0));
            flow.waiting.remove(&self.id);
        }
    }
}

impl Limiter {
    /// Assembles a limiter; `flows` request flows share the decisions' bookkeeping (about
    /// one per worker thread keeps their locks uncontended).
    pub fn new(
        local: LocalTables,
        origin: OriginClient,
        metrics: Arc<Metrics>,
        clock: Clock,
        global: crate::global::Global,
        flows: usize,
    ) -> Arc<Self> {
        let timeout_ms = u64::try_from(origin.timeout().as_millis()).unwrap_or(u64::MAX);
        let config = FlowConfig {
            timeout_ms,
            // The request flows replay nothing (`Tables::homes`): the `ReplayPump`'s does.
            replay_interval_ms: 0,
            replay_batch: REPLAY_STEP,
        };
        Arc::new(Self {
            local,
            origin,
            metrics,
            clock,
            global,
            flows: Flows::new(flows, config),
            next_request: AtomicU64::new(0),
            instance: format!("gw-{:016x}", rand::random::<u64>()),
        })
    }

    pub(crate) fn tables(&self) -> Tables<'_> {
        Tables {
            local: &self.local,
            instance: &self.instance,
        }
    }

    /// Decides one limit: locally where the lease allows it (or the local view denies),
    /// otherwise at the origin, atomically. A request whose key already has a call in flight
    /// waits for that call (never past its own time), then decides again: a burst on a cold
    /// key, or on a hot key at its window's rollover, makes one call, not one per request.
    pub async fn decide(self: &Arc<Self>, limit: LimitRequest<'_>) -> Decision {
        only(&self.decide_all(&[limit]).await, &limit)
    }

    /// Decides several limits, all or nothing: locally if the local view denies one or every
    /// lease covers its limit, otherwise all of them in one origin decision. Answered within
    /// the origin timeout of its arrival, however many calls it waits on.
    pub async fn decide_all(self: &Arc<Self>, limits: &[LimitRequest<'_>]) -> MultiDecision {
        let now = self.clock.now_ms();
        let deadline = now.saturating_add(self.flows.timeout_ms());
        let id = self.next_request.fetch_add(1, Ordering::Relaxed);
        let shard = self.flows.shard_of(limits);
        let (begun, dispatches) = {
            let mut flow = self.flows.lock(shard);
            let tables = &mut self.tables();
            match flow.flow.begin(tables, (id, 0), limits, deadline, now) {
                Some(decided) => (Ok(decided), flow.drain()),
                None => {
                    // Registered under the flow's lock: its wake-up cannot be missed.
                    let (wake, woken) = oneshot::channel();
                    flow.waiting.insert(id, wake);
                    (Err(woken), flow.drain())
                }
            }
        };
        // The call it waits on (nothing awaits between here and the waiter's guard, so a
        // dropped request cannot slip between them).
        for d in dispatches {
            self.dispatch(shard, d);
        }
        let (decision, by) = match begun {
            Ok(decided) => decided,
            Err(woken) => {
                let mut waiter = Waiter {
                    limiter: self,
                    shard,
                    id,
                    done: false,
                };
                // Every call in flight is answered, fails or times out (its task's bound), and
                // the flow decides every group waiting on it then (one that joined another's
                // call begins again in the flow): the sender is never dropped unused but by a
                // bug, answered then as a failed call would be.
                let settled = woken.await;
                waiter.done = true;
                match settled {
                    Ok(done) => (done.decision, done.by),
                    Err(_) => return self.fail_unsettled(limits),
                }
            }
        };
        let by = source(by);
        for d in &decision.decisions {
            self.metrics.decision(by, decision.success && d.success);
        }
        decision
    }

    /// A waiting request whose wake-up was dropped without an answer: denied, counted nowhere.
    fn fail_unsettled(&self, limits: &[LimitRequest<'_>]) -> MultiDecision {
        tracing::error!("a request waiting for the origin was dropped by the flow; denied");
        let none = MultiDecision {
            success: false,
            decisions: Vec::new(),
        };
        MultiDecision {
            success: false,
            decisions: limits.iter().map(|l| only(&none, l)).collect(),
        }
    }

    /// Makes call `d` of flow `shard` on a task of its own (so a request whose client hangs
    /// up does not take the call that others wait for with it), bounded by the time its
    /// requests have left, and hands the answer or failure back to the flow.
    fn dispatch(self: &Arc<Self>, shard: usize, d: Dispatch) {
        let this = self.clone();
        tokio::spawn(async move {
            let bound = Duration::from_millis(d.timeout_ms);
            let result = match &d.outgoing {
                Outgoing::Decide(call) => this
                    .ask_origin(call, bound)
                    .await
                    .map_err(|e| e.to_string()),
                // The flow replays no home of the gateway's (`Tables::homes`).
                Outgoing::Replay(_) => Err("the gateway replays its own tables".to_string()),
            };
            let now = this.clock.now_ms();
            let more = {
                let mut flow = this.flows.lock(shard);
                let tables = &mut this.tables();
                match result {
                    Ok(response) => flow.flow.decided(
                        tables,
                        d.call,
                        Some(&response),
                        || "an answer that does not fit the call".to_string(),
                        now,
                    ),
                    Err(why) => flow.flow.failed(tables, d.call, &why, now),
                }
                flow.drain()
            };
            for d in more {
                this.dispatch(shard, d);
            }
        });
    }

    /// Sends `call` to the origin, waiting at most `bound`, and returns its answer as
    /// `/v1/origin/decide` gives it (the region view records it on the way).
    async fn ask_origin(
        &self,
        call: &OriginCall,
        bound: Duration,
    ) -> Result<DecideResponse, OriginError> {
        self.metrics.origin_reason(call.reason());
        let now = self.clock.now_ms();
        let limits: Vec<DecideLimit<'_>> = call
            .limits()
            .iter()
            .map(|l| self.origin_limit(&l.decide_ref(), now))
            .collect();
        let answer = self
            .origin
            .decide_within(&self.instance, &limits, now, bound)
            .await?;
        Ok(self.respond(&limits, &answer))
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
                    covers: o.covers,
                }
            })
            .collect();
        DecideResponse {
            success: answer.success,
            sequence: results.first().map_or(0, |r| r.sequence),
            results,
        }
    }

    /// Who reads the region's counts now, which paces the replay of quiet cells (this
    /// gateway's, and its callers' through the replay answer). Alone, the region's counts are
    /// imported by no one: the publish floor does not hold a cell's cost back from the pace.
    pub fn replay_pace(&self, flush_ms: u64) -> ReplayPace {
        ReplayPace::new(self.global.alone(), self.global.policy(), flush_ms)
    }

    /// Sends one replay batch (up to `MAX_BATCH` cells) of every cell holding unacknowledged
    /// cost, unpaced (the shutdown's drain, and tests). Returns false if it failed, or a cell
    /// failed alone; the counts not acknowledged stay in the tables and the next batch
    /// carries them.
    pub async fn replay_once(&self) -> bool {
        let now = self.clock.now_ms();
        let from = ReplayCursor::default();
        let (batch, _) = self.local.take_replay(MAX_BATCH, now, None, from);
        if batch.is_empty() {
            return true;
        }
        let refs: Vec<ReplayRef<'_>> = batch.events.iter().map(ReplayEvent::replay_ref).collect();
        match self.replay_refs(&self.instance, &refs, now).await {
            Ok(answers) => self.ack_delivered(&batch, &answers, now) == batch.len(),
            Err(e) => {
                self.metrics.replay_failed();
                tracing::warn!(error = %e, cells = batch.len(), "replay batch failed; sent again with the next");
                false
            }
        }
    }

    /// Acknowledges in the local tables the cells of `batch`, taken at `taken_ms`, that the
    /// origin merged (`answers`, as [`replay_refs`](Self::replay_refs) gives them), a renewed
    /// lease running a lease lifetime from then, and counts them. Returns how many there were.
    pub(crate) fn ack_delivered(
        &self,
        batch: &ReplayBatch,
        answers: &[Option<(Counts, u64)>],
        taken_ms: u64,
    ) -> usize {
        let until = taken_ms.saturating_add(self.origin.lease_ms());
        let (mut delivered, mut renewed) = (0, 0);
        let acks = batch.events.iter().zip(answers).filter_map(|(e, answer)| {
            let (counts, lease_id) = (*answer)?;
            delivered += 1;
            renewed += usize::from(lease_id > 0);
            Some((e, counts, (lease_id > 0).then_some((lease_id, until))))
        });
        self.local.ack_replay(acks);
        self.metrics.replayed(delivered);
        self.metrics.leases_renewed(renewed);
        delivered
    }

    /// The answer to a replay caller from `answers`, one per event as
    /// [`replay_refs`](Self::replay_refs) gives them: each cell's counts, the leases renewed
    /// (each for the origin's lease lifetime) and the pace the region's view states (a flush
    /// every `flush_ms`). A cell that failed alone fails the call, `Err` naming its event: the
    /// others were merged, and merging them again when the caller retries counts nothing
    /// twice.
    pub fn replay_answer(
        &self,
        answers: &[Option<(Counts, u64)>],
        flush_ms: u64,
    ) -> Result<CellsResponse, usize> {
        let lease_ms = self.origin.lease_ms();
        let mut answer = CellsResponse {
            cells: Vec::with_capacity(answers.len()),
            renewed: Vec::new(),
            pace: Some(self.replay_pace(flush_ms)),
        };
        for (i, (event, cell)) in (0_u64..).zip(answers).enumerate() {
            let (counts, lease_id) = cell.ok_or(i)?;
            answer.cells.push(counts);
            if lease_id > 0 {
                answer.renewed.push(RenewedLease {
                    event,
                    lease_id,
                    lease_ms,
                });
            }
        }
        Ok(answer)
    }

    /// Merges `instance`'s replayed own counts at the origin, renews the leases events ask
    /// for (`renew`), and records each cell's answer in
    /// the region view (with the limit it was admitted under); returns the counts as the
    /// gateway answers them and the renewed lease's id (0: not renewed), `None` for a cell
    /// that failed alone.
    pub async fn replay_refs(
        &self,
        instance: &str,
        events: &[ReplayRef<'_>],
        now_ms: u64,
    ) -> Result<Vec<Option<(Counts, u64)>>, OriginError> {
        let cells: Vec<CellUsed<'_>> = events
            .iter()
            .map(|e| CellUsed {
                key: e.cell.key,
                sequence: e.cell.sequence,
                used: e.used,
                release: e.release,
                renew: e.renew,
                acked: e.acked,
                undo_from: e.undo_from,
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
