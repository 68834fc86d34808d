//! The gateway's own decisions, layered like an edge's: local memory first; a synchronous
//! origin read for cold, stale and strict cells (one read per cell however many requests wait
//! on it); accepted cost queued for replay. All rules come from `strata-core`; this file only
//! orders the steps around locks and awaits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use strata_core::origin::OriginPolicy;
use strata_core::table::{LimitRequest, Step};
use strata_core::{
    Counts, Decision, LimitCheck, MultiDecision, WindowKey, WindowKeyRef, decide_all,
};
use strata_core::{OriginAnswer, OriginPlan, Reason, Verdict};
use tokio::sync::OnceCell;

use crate::clock::Clock;
use crate::local::LocalTables;
use crate::metrics::{Metrics, Source};
use crate::origin::{CellIncrement, DecideLimit, DecideOutcome, OriginClient, OriginError};
use crate::replay::ReplayQueue;

/// Both cells' regional counts and the peers on the key.
type ReadResult = Result<([u64; 2], u32), OriginError>;
type InflightMap = Mutex<HashMap<(WindowKey, u64), Arc<OnceCell<ReadResult>>>>;

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
    policy: OriginPolicy,
    inflight: InflightMap,
}

/// Removes a finished read from the in-flight map, even if the leading request was dropped.
struct InflightGuard<'a> {
    map: &'a InflightMap,
    key: Option<(WindowKey, u64)>,
    cell: Arc<OnceCell<ReadResult>>,
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.get(&key).is_some_and(|c| Arc::ptr_eq(c, &self.cell)) {
            map.remove(&key);
        }
    }
}

/// The locked table of limit `i`.
fn table_at<'a>(
    tables: &'a mut [std::sync::MutexGuard<'_, strata_core::CounterTable>],
    position: &[usize],
    i: usize,
) -> Option<&'a mut strata_core::CounterTable> {
    let p = *position.get(i)?;
    tables.get_mut(p).map(|t| &mut **t)
}

/// The core's view of an origin outcome for one limit.
fn origin_answer(outcome: &DecideOutcome, counted: bool) -> OriginAnswer {
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
    ) -> Self {
        Self {
            local,
            origin,
            replay,
            metrics,
            clock,
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
        }];
        let budget = deadline.saturating_duration_since(std::time::Instant::now());
        match self
            .origin
            .decide_within(&self.instance, &request, self.clock.now_ms(), budget)
            .await
        {
            Ok(answer) => match answer.limits.first() {
                Some(outcome) => {
                    let a = origin_answer(outcome, answer.success);
                    let now = self.clock.now_ms();
                    let d = self.local.lock(key).apply_decided(key, limit.cost, &a, now);
                    (d, Source::Origin, a.counted)
                }
                None => (self.fall_back(limit), Source::Fallback, false),
            },
            Err(_) => {
                let now = self.clock.now_ms();
                let mut table = self.local.lock(key);
                table.fail_origin(key, plan.sequence, now);
                table.fail_origin(key, plan.sequence.saturating_sub(1), now);
                drop(table);
                (self.fall_back(limit), Source::Fallback, false)
            }
        }
    }

    /// The failure mode: decide from local memory.
    fn fall_back(&self, limit: LimitRequest<'_>) -> Decision {
        let now = self.clock.now_ms();
        self.local
            .lock(limit.key)
            .decide(limit.key, limit.limit, limit.cost, now)
    }

    /// Decides several limits, all or nothing: locally if every limit can be decided there
    /// (or any one denies there), otherwise all of them at the origin.
    pub async fn decide_all(&self, limits: &[LimitRequest<'_>]) -> MultiDecision {
        let mut refreshed = false;
        loop {
            let plans = self.classify_all(limits);
            let origin: Vec<(usize, OriginPlan)> = plans
                .iter()
                .enumerate()
                .filter_map(|(i, v)| match v {
                    Verdict::Origin(p) => Some((i, *p)),
                    Verdict::Local(_) => None,
                })
                .collect();
            let denied_here = plans
                .iter()
                .any(|v| matches!(v, Verdict::Local(d) if !d.success));
            if origin.is_empty() || denied_here {
                let multi = self.decide_all_locally(limits);
                self.account_all(limits, &multi, Source::Local);
                return multi;
            }
            let cold: Vec<(WindowKeyRef<'_>, u64)> = origin
                .iter()
                .filter(|(_, p)| matches!(p.reason, Reason::Cold | Reason::Stale))
                .filter_map(|(i, p)| limits.get(*i).map(|l| (l.key, p.sequence)))
                .collect();
            for (_, p) in &origin {
                self.metrics.origin_reason(p.reason, p.band);
            }
            if !cold.is_empty() && !refreshed {
                refreshed = true;
                if self.refresh_many(&cold).await == Source::Fallback {
                    let multi = self.decide_all_locally(limits);
                    self.account_all(limits, &multi, Source::Fallback);
                    return multi;
                }
                continue;
            }
            let (multi, source) = self.decide_all_at_origin(limits, &origin).await;
            self.account_all(limits, &multi, source);
            return multi;
        }
    }

    fn classify_all(&self, limits: &[LimitRequest<'_>]) -> Vec<Verdict> {
        let now = self.clock.now_ms();
        limits
            .iter()
            .map(|l| {
                let mut table = self.local.lock(l.key);
                let state = table.entry(l.key, now);
                let now = state.roll(l.key.duration(), now);
                state.observe_limit(l.limit);
                state.classify(l.key.duration(), l.limit, l.cost, now, &self.policy)
            })
            .collect()
    }

    /// Decides every limit from local memory with every involved table locked from the check
    /// to the increment: no other request can slip between them.
    fn decide_all_locally(&self, limits: &[LimitRequest<'_>]) -> MultiDecision {
        let now = self.clock.now_ms();
        let keys: Vec<WindowKeyRef<'_>> = limits.iter().map(|l| l.key).collect();
        let (mut tables, position) = self.local.lock_many(&keys);
        let checks: Vec<LimitCheck> = limits
            .iter()
            .enumerate()
            .filter_map(|(i, l)| {
                let state = table_at(&mut tables, &position, i)?.entry(l.key, now);
                state.roll(l.key.duration(), now);
                state.observe_limit(l.limit);
                Some(state.check(l.key.duration(), l.limit, l.cost))
            })
            .collect();
        let multi = decide_all(&checks, now, |i, j| keys.get(i) == keys.get(j));
        for (i, decision) in multi.to_apply() {
            if let (Some(l), Some(table)) = (limits.get(i), table_at(&mut tables, &position, i)) {
                let state = table.entry(l.key, now);
                let now = state.roll(l.key.duration(), now);
                state.apply(decision, l.key.duration(), l.cost, now, &self.policy);
            }
        }
        multi
    }

    async fn decide_all_at_origin(
        &self,
        limits: &[LimitRequest<'_>],
        plans: &[(usize, OriginPlan)],
    ) -> (MultiDecision, Source) {
        let now = self.clock.now_ms();
        let request: Vec<DecideLimit<'_>> = limits
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let sequence = l.key.duration().sequence(now);
                let band = plans
                    .iter()
                    .find(|(j, _)| *j == i)
                    .map_or(0, |(_, p)| p.reserve());
                DecideLimit {
                    key: l.key,
                    limit: l.limit,
                    cost: l.cost,
                    unseen: self
                        .replay
                        .pending(&l.key.to_owned_key(), sequence)
                        .saturating_add(band),
                }
            })
            .collect();
        match self.origin.decide(&self.instance, &request, now).await {
            Ok(answer) if answer.limits.len() == limits.len() => {
                let now = self.clock.now_ms();
                let decisions = limits
                    .iter()
                    .zip(&answer.limits)
                    .map(|(l, outcome)| {
                        let a = origin_answer(outcome, answer.success);
                        self.local.lock(l.key).apply_decided(l.key, l.cost, &a, now)
                    })
                    .collect();
                (
                    MultiDecision {
                        success: answer.success,
                        decisions,
                    },
                    Source::Origin,
                )
            }
            _ => {
                for (i, p) in plans {
                    if let Some(l) = limits.get(*i) {
                        let mut table = self.local.lock(l.key);
                        table.fail_origin(l.key, p.sequence, now);
                        table.fail_origin(l.key, p.sequence.saturating_sub(1), now);
                    }
                }
                (self.decide_all_locally(limits), Source::Fallback)
            }
        }
    }

    fn account_all(&self, limits: &[LimitRequest<'_>], multi: &MultiDecision, source: Source) {
        for (l, d) in limits.iter().zip(&multi.decisions) {
            let counted = multi.success && d.success;
            self.metrics.decision(source, counted);
            // The origin counted its own decisions; only local ones are replayed.
            if counted && source != Source::Origin {
                self.queue_replay(l, d);
            }
        }
    }

    fn queue_replay(&self, limit: &LimitRequest<'_>, decision: &Decision) {
        if limit.cost == 0 {
            return;
        }
        let sequence = counted_sequence(limit.key, decision);
        if !self
            .replay
            .push(&limit.key.to_owned_key(), sequence, limit.cost)
        {
            self.metrics.replay_dropped(limit.cost);
            tracing::warn!(
                cells = self.replay.len(),
                "replay queue full: accepted cost not replayed"
            );
        }
    }

    /// Reads both cells of `key` at `sequence` and merges them; requests that need the same
    /// cells meanwhile wait for this read instead of sending their own.
    async fn refresh(&self, key: WindowKeyRef<'_>, sequence: u64) -> Source {
        let id = (key.to_owned_key(), sequence);
        let (cell, leader) = {
            let mut map = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            match map.get(&id) {
                Some(cell) => (cell.clone(), false),
                None => {
                    let cell = Arc::new(OnceCell::new());
                    map.insert(id.clone(), cell.clone());
                    (cell, true)
                }
            }
        };
        let _guard = InflightGuard {
            map: &self.inflight,
            key: leader.then_some(id),
            cell: cell.clone(),
        };
        if !leader {
            self.metrics.read_coalesced();
        }
        let cells = [(key, sequence), (key, sequence.saturating_sub(1))];
        let result = cell
            .get_or_init(|| async {
                let read = self
                    .origin
                    .read(Some(&self.instance), &cells, self.clock.now_ms())
                    .await?;
                let at = |i: usize| read.get(i).copied().unwrap_or((0, 1));
                Ok(([at(0).0, at(1).0], at(0).1))
            })
            .await
            .clone();
        let now = self.clock.now_ms();
        let mut table = self.local.lock(key);
        match result {
            Ok((counts, peers)) => {
                table.observe_peers(key, peers, now);
                for ((_, seq), regional) in cells.iter().zip(counts) {
                    table.apply_origin(
                        key,
                        *seq,
                        Counts {
                            regional,
                            global: 0,
                        },
                        now,
                    );
                }
                Source::Origin
            }
            Err(_) => {
                for (_, seq) in cells {
                    table.fail_origin(key, seq, now);
                }
                Source::Fallback
            }
        }
    }

    /// One origin read for the cells of several keys (a multi-limit request).
    async fn refresh_many(&self, reads: &[(WindowKeyRef<'_>, u64)]) -> Source {
        let cells: Vec<(WindowKeyRef<'_>, u64)> = reads
            .iter()
            .flat_map(|&(key, seq)| [(key, seq), (key, seq.saturating_sub(1))])
            .collect();
        let result = self
            .origin
            .read(Some(&self.instance), &cells, self.clock.now_ms())
            .await;
        let now = self.clock.now_ms();
        match result {
            Ok(counts) => {
                for (&(key, seq), (regional, peers)) in cells.iter().zip(counts) {
                    let mut table = self.local.lock(key);
                    table.observe_peers(key, peers, now);
                    table.apply_origin(
                        key,
                        seq,
                        Counts {
                            regional,
                            global: 0,
                        },
                        now,
                    );
                }
                Source::Origin
            }
            Err(_) => {
                for &(key, seq) in &cells {
                    self.local.lock(key).fail_origin(key, seq, now);
                }
                Source::Fallback
            }
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
                for (c, (regional, peers)) in increments.iter().zip(counts) {
                    let counts = Counts {
                        regional,
                        global: 0,
                    };
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
