//! The gateway's own decisions, layered like an edge's: local memory first; a synchronous
//! origin read for cold, stale and strict cells (one read per cell however many requests wait
//! on it); accepted cost queued for replay. All rules come from `strata-core`; this file only
//! orders the steps around locks and awaits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use strata_core::table::{LimitRequest, Step};
use strata_core::{
    Counts, Decision, LimitCheck, MultiDecision, WindowKey, WindowKeyRef, decide_all,
};
use tokio::sync::OnceCell;

use crate::clock::Clock;
use crate::local::LocalTables;
use crate::metrics::{Metrics, Source};
use crate::origin::{CellIncrement, OriginClient, OriginError};
use crate::replay::ReplayQueue;

type ReadResult = Result<[u64; 2], OriginError>;
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
    ) -> Self {
        Self {
            local,
            origin,
            replay,
            metrics,
            clock,
            inflight: Mutex::new(HashMap::new()),
        }
    }

    /// Decides one limit.
    pub async fn decide(&self, limit: LimitRequest<'_>) -> Decision {
        let key = limit.key;
        let now = self.clock.now_ms();
        let step = self
            .local
            .lock(key)
            .check(key, limit.limit, limit.cost, now);
        let (decision, source) = match step {
            Step::Decided(d) => (d, Source::Local),
            Step::Read(plan) => {
                let source = self.refresh(key, plan.sequence).await;
                let now = self.clock.now_ms();
                let d = self
                    .local
                    .lock(key)
                    .decide(key, limit.limit, limit.cost, now);
                (d, source)
            }
        };
        self.account(&limit, &decision, source);
        decision
    }

    /// Decides several limits, all or nothing, across shards.
    pub async fn decide_all(&self, limits: &[LimitRequest<'_>]) -> MultiDecision {
        let now = self.clock.now_ms();
        let mut reads: Vec<(WindowKeyRef<'_>, u64)> = Vec::new();
        for l in limits {
            let mut table = self.local.lock(l.key);
            let state = table.entry(l.key, now);
            let now = state.roll(l.key.duration(), now);
            state.observe_limit(l.limit);
            let plan = state.plan_reads(now);
            if !plan.is_empty() && !reads.contains(&(l.key, plan.sequence)) {
                reads.push((l.key, plan.sequence));
            }
        }
        let source = if reads.is_empty() {
            Source::Local
        } else {
            self.refresh_many(&reads).await
        };

        let now = self.clock.now_ms();
        let keys: Vec<WindowKeyRef<'_>> = limits.iter().map(|l| l.key).collect();
        let multi = {
            // Every table involved stays locked from the check to the increment: no other
            // request can slip between them, which is what makes it all or nothing.
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
                if let (Some(l), Some(table)) = (limits.get(i), table_at(&mut tables, &position, i))
                {
                    let state = table.entry(l.key, now);
                    let now = state.roll(l.key.duration(), now);
                    state.apply(decision, l.key.duration(), l.cost, now);
                }
            }
            multi
        };
        for (l, d) in limits.iter().zip(&multi.decisions) {
            let counted = multi.success && d.success;
            self.metrics.decision(source, counted);
            if counted {
                self.queue_replay(l, d);
            }
        }
        multi
    }

    fn account(&self, limit: &LimitRequest<'_>, decision: &Decision, source: Source) {
        self.metrics.decision(source, decision.success);
        if decision.success {
            self.queue_replay(limit, decision);
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
                let counts = self.origin.read(&cells, self.clock.now_ms()).await?;
                Ok([
                    counts.first().copied().unwrap_or(0),
                    counts.get(1).copied().unwrap_or(0),
                ])
            })
            .await
            .clone();
        let now = self.clock.now_ms();
        let mut table = self.local.lock(key);
        match result {
            Ok(counts) => {
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
        let result = self.origin.read(&cells, self.clock.now_ms()).await;
        let now = self.clock.now_ms();
        match result {
            Ok(counts) => {
                for (&(key, seq), regional) in cells.iter().zip(counts) {
                    self.local.lock(key).apply_origin(
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
        match self.origin.replay(&increments, self.clock.now_ms()).await {
            Ok(counts) => {
                let now = self.clock.now_ms();
                for (c, regional) in increments.iter().zip(counts) {
                    self.local.lock(c.key).apply_origin(
                        c.key,
                        c.sequence,
                        Counts {
                            regional,
                            global: 0,
                        },
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
