//! The single-threaded local counter table of an edge process: window key → [`WindowState`],
//! bounded, with CLOCK (approximate least-recently-used) eviction.
//!
//! One hash probe per window key reaches both cells, which live in one slab slot; a warm
//! decision allocates nothing. The slab never grows past the capacity and recycles slots in
//! place, so memory stays flat under churn (a hash table holding the entries themselves was
//! measured to double its buckets under eviction churn: tombstones force a resize). Like
//! Fastly's ratecounter (200,000 entries per site), the bound keeps memory flat under key
//! floods; an evicted key simply starts cold again and is re-read from the origin.
//!
//! Eviction is CLOCK (second chance), the usual approximation of least-recently-used: a hit
//! sets a one-byte mark in a dense side array, and a full table sweeps a hand over the slots,
//! clearing marks, until it finds one not used since the last sweep. An exact LRU list would
//! write to two random neighbours' links on every hit, two more cache misses on a path whose
//! cost at 100,000 keys is nearly all misses. New entries start unmarked, so a flood of
//! one-off keys evicts itself before keys in use.

use alloc::vec::Vec;
use core::fmt;

use foldhash::quality::FixedState;
use hashbrown::HashTable;

use crate::cell::WindowState;
use crate::decision::{Decision, LimitCheck, MultiDecision, decide_all};
use crate::gcounter::{FlushRow, PublishPolicy, sort_flush_rows};
use crate::identity::{WindowKey, WindowKeyRef};
use crate::origin::{OriginAnswer, OriginPlan, OriginPolicy, Verdict};

/// Default bound on entries (window keys), as Fastly's ratecounter.
pub const DEFAULT_CAPACITY: usize = 200_000;
/// The smallest table: a multi-limit request must fit without evicting its own entries.
pub const MIN_CAPACITY: usize = 64;
/// Table settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableConfig {
    /// Most entries held; at least `MIN_CAPACITY`.
    pub capacity: usize,
    /// Freshness settings.
    pub origin: OriginPolicy,
}

impl Default for TableConfig {
    fn default() -> Self {
        Self {
            capacity: DEFAULT_CAPACITY,
            origin: OriginPolicy::default(),
        }
    }
}

/// Counters of what the table did, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Entries created by requests or origin answers.
    pub created: u64,
    /// Entries created by a global sync for a key this process had not seen.
    pub created_by_sync: u64,
    /// Entries dropped to make room.
    pub evicted: u64,
    /// Entries dropped because both cells aged out.
    pub expired: u64,
}

/// One limit of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitRequest<'a> {
    /// Which window key.
    pub key: WindowKeyRef<'a>,
    /// Allowed cost per window.
    pub limit: u64,
    /// This request's cost.
    pub cost: u64,
}

/// What a local check produced: a decision, or a decision the origin must make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Decided locally and applied (a denial, or a pass with the band covered).
    Decided(Decision),
    /// Decide at the origin and merge its answer with [`CounterTable::apply_decided`]; on
    /// failure, [`CounterTable::fail_origin`] then [`CounterTable::decide`] (the local
    /// fallback). Nothing was counted.
    Origin(OriginPlan),
}

/// The multi-limit form of [`Step`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MultiStep {
    /// Decided locally and applied (all or nothing).
    Decided(MultiDecision),
    /// `(limit index, plan)` for every limit the origin must decide; the shell sends the
    /// whole request there (all or nothing). Nothing was counted.
    Origin(Vec<(usize, OriginPlan)>),
}

/// A multi-limit request larger than the table can hold at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooManyLimits {
    /// Limits in the request.
    pub limits: usize,
    /// The table's capacity.
    pub capacity: usize,
}

impl fmt::Display for TooManyLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} limits do not fit a table of {} entries",
            self.limits, self.capacity
        )
    }
}

#[cfg(feature = "std")]
impl std::error::Error for TooManyLimits {}

/// Where a slot stands with the eviction hand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Clock {
    /// Free (purged); on the free list.
    Vacant,
    /// Not used since the hand last passed: evictable.
    Idle,
    /// Used since the hand last passed: gets a second chance.
    Used,
}

/// Key and state, 24 + 104 bytes: exactly one aligned pair of cache lines, which x86's
/// adjacent-line prefetch fetches together. Eviction bookkeeping lives apart (`clock`).
#[derive(Debug)]

struct Slot {
    key: WindowKey,
    state: WindowState,
}

/// The bounded local table. Not thread-safe by design: a Wasm isolate owns one; a native
/// process shards several behind locks.
pub struct CounterTable {
    /// Key hash → slot index. Small (4 bytes a bucket), so its own growth under churn is cheap.
    index: HashTable<u32>,
    slots: Vec<Slot>,
    /// One byte per slot: a dense array the hot path writes and the hand sweeps.
    clock: Vec<Clock>,
    free: Vec<u32>,
    /// Slots of the multi-limit operation in progress: not evictable during it.
    pinned: Vec<usize>,
    /// Slot the eviction hand looks at next.
    hand: usize,
    /// Slot `purge_expired` resumes from.
    purge_at: usize,
    hasher: FixedState,
    config: TableConfig,
    stats: TableStats,
}

impl fmt::Debug for CounterTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CounterTable")
            .field("len", &self.len())
            .field("config", &self.config)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl CounterTable {
    /// An empty table. `seed` keys the hash so clients cannot aim collisions at it: pass
    /// randomness from the host (`getrandom`, the OS).
    pub fn new(config: TableConfig, seed: u64) -> Self {
        let capacity = config.capacity.clamp(MIN_CAPACITY, u32::MAX as usize);
        Self {
            index: HashTable::new(),
            slots: Vec::new(),
            clock: Vec::new(),
            free: Vec::new(),
            pinned: Vec::new(),
            hand: 0,
            purge_at: 0,
            hasher: FixedState::with_seed(seed),
            config: TableConfig { capacity, ..config },
            stats: TableStats::default(),
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.index.len()
    }
    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
    /// The settings in force (capacity after clamping).
    pub fn config(&self) -> &TableConfig {
        &self.config
    }
    /// What the table did so far.
    pub fn stats(&self) -> TableStats {
        self.stats
    }

    /// Approximate heap bytes held: slots, index and the keys' text.
    pub fn heap_bytes(&self) -> usize {
        let keys: usize = self.slots.iter().map(|s| s.key.heap_bytes()).sum();
        self.slots.capacity() * core::mem::size_of::<Slot>()
            + self.clock.capacity()
            + self.index.allocation_size()
            + self.free.capacity() * core::mem::size_of::<u32>()
            + keys
    }

    /// The state of a key, without marking it used.
    pub fn get(&self, key: WindowKeyRef<'_>) -> Option<&WindowState> {
        self.find(key).map(|i| &self.slots[i].state)
    }

    /// Decides one limit locally where that is safe (see [`WindowState::classify`]): a local
    /// denial, or a pass with the band covered; otherwise says why the origin must decide.
    pub fn check(&mut self, key: WindowKeyRef<'_>, limit: u64, cost: u64, now_ms: u64) -> Step {
        let d = key.duration();
        let policy = self.config.origin;
        let state = self.state_mut(key, now_ms);
        let now_ms = state.roll(d, now_ms);
        state.observe_limit(limit);
        match state.classify(d, limit, cost, now_ms, &policy) {
            Verdict::Local(decision) => {
                state.apply(&decision, d, cost, now_ms, &policy);
                Step::Decided(decision)
            }
            Verdict::Origin(plan) => Step::Origin(plan),
        }
    }

    /// Decides one limit from local state whatever its freshness (after the reads of a
    /// [`Step::Read`], or as the fallback when the origin is unreachable).
    pub fn decide(
        &mut self,
        key: WindowKeyRef<'_>,
        limit: u64,
        cost: u64,
        now_ms: u64,
    ) -> Decision {
        let policy = self.config.origin;
        self.state_mut(key, now_ms)
            .decide(key.duration(), limit, cost, now_ms, &policy)
    }

    /// [`check`](Self::check) for several limits, all or nothing.
    pub fn check_all(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<MultiStep, TooManyLimits> {
        let slots = self.slots_for(limits, now_ms)?;
        let policy = self.config.origin;
        let mut origin = Vec::new();
        let mut local = Vec::with_capacity(limits.len());
        for (i, (&slot, l)) in slots.iter().zip(limits).enumerate() {
            let state = &mut self.slots[slot].state;
            let now_ms = state.roll(l.key.duration(), now_ms);
            state.observe_limit(l.limit);
            match state.classify(l.key.duration(), l.limit, l.cost, now_ms, &policy) {
                Verdict::Local(d) => local.push(d),
                Verdict::Origin(plan) => origin.push((i, plan)),
            }
        }
        // Any limit the local view denies denies the request: all or nothing, no round trip.
        if origin.is_empty() || local.iter().any(|d| !d.success) {
            return Ok(MultiStep::Decided(
                self.decide_slots(&slots, limits, now_ms),
            ));
        }
        Ok(MultiStep::Origin(origin))
    }

    /// [`decide`](Self::decide) for several limits, all or nothing.
    pub fn decide_all(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<MultiDecision, TooManyLimits> {
        let slots = self.slots_for(limits, now_ms)?;
        Ok(self.decide_slots(&slots, limits, now_ms))
    }

    /// Slots of every limit's entry, created where missing; pinned while the later ones are
    /// inserted, so no limit of a request evicts another's entry.
    fn slots_for(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<Vec<usize>, TooManyLimits> {
        // Pinned entries cannot be evicted, so at least half the table must stay evictable.
        if limits.len() * 2 > self.config.capacity {
            return Err(TooManyLimits {
                limits: limits.len(),
                capacity: self.config.capacity,
            });
        }
        self.pinned.clear();
        for l in limits {
            let slot = self.slot(l.key, now_ms, false);
            self.pinned.push(slot);
        }
        Ok(core::mem::take(&mut self.pinned))
    }

    fn decide_slots(
        &mut self,
        slots: &[usize],
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> MultiDecision {
        let checks: Vec<LimitCheck> = slots
            .iter()
            .zip(limits)
            .map(|(&slot, l)| {
                self.slots[slot]
                    .state
                    .prepare(l.key.duration(), l.limit, l.cost, now_ms)
            })
            .collect();
        let multi = decide_all(&checks, now_ms, |i, j| slots[i] == slots[j]);
        let policy = self.config.origin;
        for (i, decision) in multi.to_apply() {
            if let (Some(&slot), Some(l)) = (slots.get(i), limits.get(i)) {
                self.slots[slot]
                    .state
                    .settle(decision, l.key.duration(), l.cost, now_ms, &policy);
            }
        }
        multi
    }

    /// The state of `key`, created if absent and marked used: for shells that hold several
    /// tables (a native process's shards) and decide across them with [`decide_all`].
    pub fn entry(&mut self, key: WindowKeyRef<'_>, now_ms: u64) -> &mut WindowState {
        self.state_mut(key, now_ms)
    }

    /// Merges an origin answer (read, replay or decision) for one cell; see
    /// [`WindowState::apply_origin`].
    pub fn apply_origin(
        &mut self,
        key: WindowKeyRef<'_>,
        sequence: u64,
        counts: crate::decision::Counts,
        now_ms: u64,
    ) -> bool {
        let policy = self.config.origin;
        let state = self.state_mut(key, now_ms);
        let now_ms = state.roll(key.duration(), now_ms);
        state.apply_origin(sequence, counts, now_ms, &policy)
    }

    /// Merges the origin's decision for one limit; see [`WindowState::apply_decided`].
    pub fn apply_decided(
        &mut self,
        key: WindowKeyRef<'_>,
        cost: u64,
        answer: &OriginAnswer,
        now_ms: u64,
    ) -> Decision {
        let policy = self.config.origin;
        self.state_mut(key, now_ms)
            .apply_decided(key.duration(), answer, cost, now_ms, &policy)
    }

    /// Merges a replay answer that delivered `delivered` of this process's own cost; see
    /// [`WindowState::apply_replay`].
    pub fn apply_replay(
        &mut self,
        key: WindowKeyRef<'_>,
        sequence: u64,
        counts: crate::decision::Counts,
        delivered: u64,
        peers: Option<u32>,
        now_ms: u64,
    ) -> bool {
        let policy = self.config.origin;
        let state = self.state_mut(key, now_ms);
        let now_ms = state.roll(key.duration(), now_ms);
        state.apply_replay(sequence, counts, delivered, peers, now_ms, &policy)
    }

    /// Records the number of processes the origin reports on a key.
    pub fn observe_peers(&mut self, key: WindowKeyRef<'_>, peers: u32, now_ms: u64) {
        self.state_mut(key, now_ms).observe_peers(peers);
    }

    /// Records a failed origin call that covered both cells of the window `sequence` is the
    /// current cell of (a read or a decision always asks for both).
    pub fn fail_window(&mut self, key: WindowKeyRef<'_>, sequence: u64, now_ms: u64) {
        self.fail_origin(key, sequence, now_ms);
        self.fail_origin(key, sequence.saturating_sub(1), now_ms);
    }

    /// Records a failed origin call for one cell; see [`WindowState::fail_origin`].
    pub fn fail_origin(&mut self, key: WindowKeyRef<'_>, sequence: u64, now_ms: u64) -> bool {
        let policy = self.config.origin;
        let state = self.state_mut(key, now_ms);
        let now_ms = state.roll(key.duration(), now_ms);
        state.fail_origin(sequence, now_ms, &policy)
    }

    /// Applies one row of a global sync: this region's own component (a lower bound on the
    /// regional count) and the other regions' sum. Creates the entry if this process has not
    /// seen the key (counted apart in `created_by_sync`). Returns false if the cell is too old
    /// to be held.
    pub fn apply_sync(
        &mut self,
        key: WindowKeyRef<'_>,
        sequence: u64,
        own: u64,
        foreign: u64,
        now_ms: u64,
    ) -> bool {
        let slot = self.slot(key, now_ms, true);
        let state = &mut self.slots[slot].state;
        state.roll(key.duration(), now_ms);
        match state.cell_mut(sequence) {
            Some(cell) => {
                cell.import_own(own);
                cell.import_foreign(foreign);
                true
            }
            None => false,
        }
    }

    /// The cells a flush should publish at `now_ms`, in unique-key order.
    pub fn flush_candidates(&self, policy: &PublishPolicy, now_ms: u64) -> Vec<FlushRow> {
        let mut rows = Vec::new();
        let live = self.slots.iter().zip(&self.clock);
        for (slot, _) in live.filter(|(_, c)| **c != Clock::Vacant) {
            let d = slot.key.duration();
            for (sequence, cell) in slot.state.cells() {
                let expires_at = d.expires_at(sequence);
                if now_ms < expires_at && policy.should_publish(cell, slot.state.limit()) {
                    rows.push(FlushRow {
                        key: slot.key.clone(),
                        sequence,
                        count: cell.counts().regional,
                        expires_at,
                    });
                }
            }
        }
        sort_flush_rows(&mut rows);
        rows
    }

    /// Records rows a flush wrote successfully (and only then), so unchanged cells are not
    /// written again. Rows of entries evicted or rolled away since are ignored.
    pub fn commit_flush(&mut self, rows: &[FlushRow]) {
        for row in rows {
            let Some(i) = self.find(row.key.as_ref()) else {
                continue;
            };
            if let Some(cell) = self.slots[i].state.cell_mut(row.sequence) {
                cell.last_flushed = cell.last_flushed.max(row.count);
            }
        }
    }

    /// Drops entries whose cells can no longer affect a decision, looking at up to `max_scan`
    /// slots from where the last call stopped. Returns how many were dropped.
    pub fn purge_expired(&mut self, now_ms: u64, max_scan: usize) -> usize {
        let mut dropped = 0;
        for _ in 0..max_scan.min(self.slots.len()) {
            self.purge_at = (self.purge_at + 1) % self.slots.len();
            let slot = &self.slots[self.purge_at];
            let live = self.clock[self.purge_at] != Clock::Vacant;
            if live && slot.state.is_expired(slot.key.duration(), now_ms) {
                self.release(self.purge_at);
                self.free.push(slot_id(self.purge_at));
                dropped += 1;
            }
        }
        self.stats.expired += dropped as u64;
        dropped
    }

    fn state_mut(&mut self, key: WindowKeyRef<'_>, now_ms: u64) -> &mut WindowState {
        let slot = self.slot(key, now_ms, false);
        &mut self.slots[slot].state
    }

    fn find(&self, key: WindowKeyRef<'_>) -> Option<usize> {
        let hash = key.hash_with(&self.hasher);
        let slots = &self.slots;
        self.index
            .find(hash, |&i| slots[i as usize].key.matches(key))
            .map(|&i| i as usize)
    }

    /// The slot of `key`'s entry, created if absent (recycling a free or evicted slot when
    /// the table is full), and marked as used.
    fn slot(&mut self, key: WindowKeyRef<'_>, now_ms: u64, by_sync: bool) -> usize {
        if let Some(i) = self.find(key) {
            self.clock[i] = Clock::Used;
            return i;
        }
        let fresh = Slot {
            key: key.to_owned_key(),
            state: WindowState::new(key.duration(), now_ms),
        };
        let i = if let Some(i) = self.free.pop() {
            self.slots[i as usize] = fresh;
            i as usize
        } else if self.slots.len() < self.config.capacity {
            self.slots.push(fresh);
            self.clock.push(Clock::Vacant);
            self.slots.len() - 1
        } else {
            let i = self.victim();
            self.release(i);
            self.stats.evicted += 1;
            self.slots[i] = fresh;
            i
        };
        // New entries start idle: a flood of one-off keys evicts itself first.
        self.clock[i] = Clock::Idle;
        let hasher = &self.hasher;
        let slots = &self.slots;
        self.index
            .insert_unique(key.hash_with(hasher), slot_id(i), |&j| {
                slots[j as usize].key.as_ref().hash_with(hasher)
            });
        if by_sync {
            self.stats.created_by_sync += 1;
        } else {
            self.stats.created += 1;
        }
        i
    }

    /// The next slot not used since the hand last passed it (and not pinned by the operation
    /// in progress). Two sweeps always find one: the first clears every reference bit, and
    /// pins cover at most half the table.
    fn victim(&mut self) -> usize {
        let n = self.slots.len();
        for _ in 0..2 * n {
            self.hand = (self.hand + 1) % n;
            if self.pinned.contains(&self.hand) {
                continue;
            }
            match self.clock[self.hand] {
                Clock::Used => self.clock[self.hand] = Clock::Idle,
                Clock::Idle | Clock::Vacant => return self.hand,
            }
        }
        self.hand
    }

    /// Takes slot `i` out of the index and marks it vacant (its key stays until reuse).
    fn release(&mut self, i: usize) {
        let hash = self.slots[i].key.as_ref().hash_with(&self.hasher);
        if let Ok(entry) = self.index.find_entry(hash, |&j| j as usize == i) {
            entry.remove();
        }
        self.clock[i] = Clock::Vacant;
    }
}

/// A slot index as the index stores it. The capacity is clamped to `u32::MAX`, so every slot
/// index fits.
fn slot_id(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_three_cache_lines() {
        assert_eq!(core::mem::size_of::<Slot>(), 192);
        assert_eq!(core::mem::size_of::<WindowKey>(), 24);
    }
}
