//! The gateway's local memory: the core's counter table, sharded behind mutexes so many
//! worker threads decide at once without over-admitting. One key always maps to one shard, so
//! decisions on a hot key serialize on its shard's lock (held for a few hundred nanoseconds,
//! never across an await); keys on other shards proceed in parallel.

use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard};

use foldhash::fast::RandomState;
use strata_core::origin::OriginPolicy;
use strata_core::replay::{QuietPace, ReplayEvent};
use strata_core::{CounterTable, Counts, TableConfig, WindowKeyRef};

/// Where a replay pass's next batch goes on: a shard, and a position in its table's list of
/// touched cells (see `CounterTable::take_replay_from`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayCursor {
    /// The shard.
    pub shard: usize,
    /// The position in its touched list.
    pub at: usize,
}

/// Sharded local tables.
#[derive(Debug)]
pub struct LocalTables {
    shards: Box<[Mutex<CounterTable>]>,
    hasher: RandomState,
    policy: OriginPolicy,
}

impl LocalTables {
    /// `capacity` window keys in all, over `shards` tables (rounded up to a power of two).
    pub fn new(capacity: usize, shards: usize, origin: OriginPolicy) -> Self {
        let n = shards.max(1).next_power_of_two();
        let per_shard = capacity.div_ceil(n);
        let shards = (0..n)
            .map(|_| {
                let config = TableConfig {
                    capacity: per_shard,
                    origin,
                    keep_unpublished: false,
                    renew_leases: true,
                    // One shard of many: its index grows with its keys, each growth short.
                    presize_index: false,
                };
                Mutex::new(CounterTable::new(config, rand::random()))
            })
            .collect();
        Self {
            shards,
            hasher: RandomState::default(),
            policy: origin,
        }
    }

    /// The origin policy every shard decides with (its failure mode among it).
    pub const fn policy(&self) -> &OriginPolicy {
        &self.policy
    }

    fn index(&self, key: WindowKeyRef<'_>) -> usize {
        // n is a power of two; the hash's low bits pick the shard (truncation is the point).
        #[allow(clippy::cast_possible_truncation)]
        let low = self.hasher.hash_one(key) as usize;
        low & (self.shards.len() - 1)
    }

    fn guard(&self, i: usize) -> MutexGuard<'_, CounterTable> {
        // Table updates are plain field writes that leave it consistent at every step, so a
        // lock poisoned by a panicking holder is still safe to use.
        let shard = &self.shards[i & (self.shards.len() - 1)]; // masked: always in range
        match shard.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The table that holds `key`, locked.
    pub fn lock(&self, key: WindowKeyRef<'_>) -> MutexGuard<'_, CounterTable> {
        self.guard(self.index(key))
    }

    /// The tables holding `keys`, locked in shard order (so concurrent multi-limit requests
    /// cannot deadlock), and for each key the position of its table in the returned list.
    pub fn lock_many(
        &self,
        keys: &[WindowKeyRef<'_>],
    ) -> (Vec<MutexGuard<'_, CounterTable>>, Vec<usize>) {
        let indices: Vec<usize> = keys.iter().map(|k| self.index(*k)).collect();
        let mut order = indices.clone();
        order.sort_unstable();
        order.dedup();
        let guards = order.iter().map(|&i| self.guard(i)).collect();
        let positions = indices
            .iter()
            .map(|i| order.binary_search(i).unwrap_or(0))
            .collect();
        (guards, positions)
    }

    /// Window keys held, and evictions so far, over all shards.
    pub fn stats(&self) -> (usize, u64) {
        (0..self.shards.len()).fold((0, 0), |(len, evicted), i| {
            let g = self.guard(i);
            (len + g.len(), evicted + g.stats().evicted)
        })
    }

    /// Up to `max` cells holding own cost the origin has not acknowledged, over the shards
    /// from where `from` points on. Quiet cells wait for their turn under `pace` (`None`: every
    /// cell goes). Also returns where the next batch of the same pass goes on when this one
    /// filled up (`None`: every shard was looked at), so the batches of a pass look at each
    /// cell once.
    pub fn take_replay(
        &self,
        max: usize,
        now_ms: u64,
        pace: Option<QuietPace>,
        from: ReplayCursor,
    ) -> (strata_core::replay::ReplayBatch, Option<ReplayCursor>) {
        let mut batch = strata_core::replay::ReplayBatch::default();
        if max == 0 {
            return (batch, None);
        }
        for shard in from.shard..self.shards.len() {
            let at = if shard == from.shard { from.at } else { 0 };
            // A full batch asks the next shard for nothing, and learns where to go on.
            let left = max.saturating_sub(batch.len());
            // Each shard's turns are its own, or its first slots would all go on one pass.
            let part = pace.map(|p| p.for_part(u32::try_from(shard).unwrap_or(0)));
            let (taken, next) = self.guard(shard).take_replay_from(left, now_ms, part, at);
            batch.events.extend(taken.events);
            if let Some(at) = next {
                return (batch, Some(ReplayCursor { shard, at }));
            }
        }
        (batch, None)
    }

    /// Merges the origin's answers to replayed events: each cell's counts, and the lease it
    /// renewed (its new id and until when, if any). Each shard is locked once per run of
    /// events on it, so once for a batch `take_replay` took (shard by shard).
    pub fn ack_replay<'e>(
        &self,
        answers: impl IntoIterator<Item = (&'e ReplayEvent, Counts, Option<(u64, u64)>)>,
    ) {
        let mut held: Option<(usize, MutexGuard<'_, CounterTable>)> = None;
        for (event, counts, renewed) in answers {
            let i = self.index(event.key.as_ref());
            let table = match &mut held {
                Some((at, table)) if *at == i => table,
                _ => {
                    // The previous shard's lock is released before the next is taken.
                    held = None;
                    &mut held.insert((i, self.guard(i))).1
                }
            };
            table.ack_one(event, counts);
            if let Some((lease_id, until)) = renewed {
                table.renewed(event, lease_id, until);
            }
        }
    }

    /// Cells holding unacknowledged own cost, and own cost lost before acknowledgement
    /// (evicted or aged out), over all shards.
    pub fn replay_state(&self) -> (usize, u64) {
        (0..self.shards.len()).fold((0, 0), |(cells, lost), i| {
            let g = self.guard(i);
            (cells + g.unreplayed_cells(), lost + g.stats().replay_lost)
        })
    }

    /// How many shards the tables are split into.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Drops expired entries from shard `shard`, a scan of up to `max_scan` slots from where
    /// its last one stopped; returns how many. One shard at a time, so a janitor can let
    /// requests run between two.
    pub fn purge_expired(&self, shard: usize, now_ms: u64, max_scan: usize) -> usize {
        self.guard(shard).purge_expired(now_ms, max_scan)
    }
}
