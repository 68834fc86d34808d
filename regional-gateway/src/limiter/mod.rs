//! The gateway's own decisions, layered like an edge's: local memory first; a synchronous
//! origin read for cold, stale and strict cells (one read per cell however many requests wait
//! on it); accepted cost queued for replay. All rules come from `strata-core`; this file only
//! orders the steps around locks and awaits.

mod multi;
mod refresh;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use strata_core::origin::OriginPolicy;
use strata_core::table::{LimitRequest, Step};
use strata_core::{Counts, Decision, OriginAnswer, OriginPlan, Reason, WindowKeyRef};

use crate::clock::Clock;
use crate::local::LocalTables;
use crate::metrics::{Metrics, Source};
use crate::origin::{CellIncrement, DecideLimit, DecideOutcome, OriginClient};
use crate::replay::ReplayQueue;

use refresh::InflightMap;

/// Local tables, origin and replay queue, and the decision flow over them.
#[derive(Debug)]
pub struct Limiter {
    /// Local memory.
    pub local: LocalTables,
    /// The regional origin.
    pub origin: OriginClient,
    /// Accepted cost waiting for replay.
    pub replay: ReplayQueue,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Time.
    pub clock: Clock,
    /// This process's random id, sent with its origin calls (the origin counts peers by it).
    pub instance: String,
    /// The region's counts as this gateway knows them, and what it imported from the others.
    pub global: crate::global::Global,
    policy: OriginPolicy,
    inflight: InflightMap,
}

/// The core's view of an origin outcome for one limit.
pub(super) fn origin_answer(outcome: &DecideOutcome, counted: bool) -> OriginAnswer {
    OriginAnswer {
        limit: outcome.decision.limit,
        remaining: outcome.decision.remaining,
        reset_ms: outcome.decision.reset_ms,
        sequence: outcome.sequence,
        counted,
        denied: !outcome.decision.success,
        current: Counts {
            regional: outcome.current,
            global: 0,
        },
        previous: Counts {
            regional: outcome.previous,
            global: 0,
        },
        peers: outcome.peers,
    }
}

/// The sequence of the cell a decision counted in (its window ends at `reset_ms`).
fn counted_sequence(key: WindowKeyRef<'_>, decision: &Decision) -> u64 {
    (decision.reset_ms / key.duration().as_ms()).saturating_sub(1)
}

impl Limiter {
    /// Assembles a limiter.
    pub fn new(
        local: LocalTables,
        origin: OriginClient,
        replay: ReplayQueue,
        metrics: Arc<Metrics>,
        clock: Clock,
        policy: OriginPolicy,
        global: crate::global::Global,
    ) -> Self {
        Self {
            local,
            origin,
            replay,
            metrics,
            clock,
            global,
            instance: format!("gw-{:016x}", rand::random::<u64>()),
            policy,
            inflight: Mutex::new(HashMap::new()),
        }
    }

    /// Decides one limit: locally where the local view is enough (a denial, or a pass with the
    /// band covered), otherwise at the origin, atomically.
    pub async fn decide(&self, limit: LimitRequest<'_>) -> Decision {
        let key = limit.key;
        let step = self
            .local
            .lock(key)
            .check(key, limit.limit, limit.cost, self.clock.now_ms());
        let (decision, source, counted_there) = match step {
            Step::Decided(d) => (d, Source::Local, false),
            Step::Origin(plan) => self.at_origin(limit, plan).await,
        };
        self.metrics.decision(source, decision.success);
        // A decision made at the origin was counted there; local passes are replayed.
        if decision.success && !counted_there {
            self.queue_replay(&limit, &decision);
        }
        decision
    }

    /// The origin path of one limit. Cold and stale cells are first refreshed by one read
    /// shared by every request waiting on them, then checked again (most keys far from their
    /// limit then pass locally); strict and near-limit ones are decided at the origin.
    /// Returns the decision, where it was made, and whether the origin counted it.
    async fn at_origin(
        &self,
        limit: LimitRequest<'_>,
        mut plan: OriginPlan,
    ) -> (Decision, Source, bool) {
        let key = limit.key;
        // One origin timeout for the whole request, however many calls it takes.
        let deadline = std::time::Instant::now() + self.origin.timeout();
        if matches!(plan.reason, Reason::Cold | Reason::Stale) {
            self.metrics.origin_reason(plan.reason, plan.band);
            if self.refresh(key, plan.sequence).await == Source::Fallback {
                return (self.fall_back(limit), Source::Fallback, false);
            }
            let now = self.clock.now_ms();
            match self
                .local
                .lock(key)
                .check(key, limit.limit, limit.cost, now)
            {
                Step::Decided(d) => return (d, Source::Origin, false),
                Step::Origin(next) => plan = next,
            }
        }
        self.metrics.origin_reason(plan.reason, plan.band);
        let unseen = self
            .replay
            .pending(&key.to_owned_key(), plan.sequence)
            .saturating_add(plan.reserve());
        let request = [DecideLimit {
            key,
            limit: limit.limit,
            cost: limit.cost,
            unseen,
            global: self.global.foreign(key, plan.sequence),
        }];
        let budget = deadline.saturating_duration_since(std::time::Instant::now());
        match self
            .origin
            .decide_within(&self.instance, &request, self.clock.now_ms(), budget)
            .await
        {
            Ok(answer) => match answer.limits.first() {
                Some(outcome) => {
                    let a =
                        self.answer_with_imports(key, outcome, answer.success, Some(limit.limit));
                    let now = self.clock.now_ms();
                    let d = self.local.lock(key).apply_decided(key, limit.cost, &a, now);
                    (d, Source::Origin, a.counted)
                }
                None => (self.fall_back(limit), Source::Fallback, false),
            },
            Err(_) => {
                let now = self.clock.now_ms();
                self.local.lock(key).fail_window(key, plan.sequence, now);
                (self.fall_back(limit), Source::Fallback, false)
            }
        }
    }

    /// An origin outcome as the core merges it, with the imported components, recorded in
    /// the region's view (for the flush).
    pub fn answer_with_imports(
        &self,
        key: WindowKeyRef<'_>,
        outcome: &DecideOutcome,
        counted: bool,
        limit: Option<u64>,
    ) -> OriginAnswer {
        let now = self.clock.now_ms();
        let previous = outcome.sequence.saturating_sub(1);
        self.global
            .observe(key, outcome.sequence, outcome.current, limit, now);
        self.global
            .observe(key, previous, outcome.previous, None, now);
        OriginAnswer {
            current: self.global.counts(key, outcome.sequence, outcome.current),
            previous: self.global.counts(key, previous, outcome.previous),
            ..origin_answer(outcome, counted)
        }
    }

    /// The failure mode: decide from local memory.
    pub(super) fn fall_back(&self, limit: LimitRequest<'_>) -> Decision {
        let now = self.clock.now_ms();
        self.local
            .lock(limit.key)
            .decide(limit.key, limit.limit, limit.cost, now)
    }

    pub(super) fn queue_replay(&self, limit: &LimitRequest<'_>, decision: &Decision) {
        if limit.cost == 0 {
            return;
        }
        let sequence = counted_sequence(limit.key, decision);
        if !self
            .replay
            .push(&limit.key.to_owned_key(), sequence, limit.cost, limit.limit)
        {
            self.metrics.replay_dropped(limit.cost);
            tracing::warn!(
                cells = self.replay.len(),
                "replay queue full: accepted cost not replayed"
            );
        }
    }

    /// Sends one replay batch. Returns false if it failed (the batch was queued again).
    pub async fn replay_once(&self) -> bool {
        let batch = self.replay.take_batch();
        if batch.is_empty() {
            return true;
        }
        let increments: Vec<CellIncrement<'_>> = batch
            .iter()
            .map(|p| CellIncrement {
                key: p.key.as_ref(),
                sequence: p.sequence,
                cost: p.cost,
            })
            .collect();
        let now = self.clock.now_ms();
        match self
            .origin
            .replay(Some(&self.instance), &increments, now)
            .await
        {
            Ok(counts) => {
                let now = self.clock.now_ms();
                for ((c, (regional, peers)), p) in increments.iter().zip(counts).zip(&batch) {
                    self.global
                        .observe(c.key, c.sequence, regional, Some(p.limit), now);
                    let counts = self.global.counts(c.key, c.sequence, regional);
                    self.local.lock(c.key).apply_replay(
                        c.key,
                        c.sequence,
                        counts,
                        c.cost,
                        Some(peers),
                        now,
                    );
                }
                self.metrics.replayed(increments.len());
                true
            }
            Err(e) => {
                drop(increments);
                self.metrics.replay_failed();
                let dropped = self.replay.restore(batch);
                if dropped > 0 {
                    self.metrics.replay_dropped(dropped);
                }
                tracing::warn!(error = %e, dropped, queued = self.replay.len(), "replay batch failed; queued again");
                false
            }
        }
    }
}
