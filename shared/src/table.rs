//! The single-threaded local counter table of an edge process: window key → [`WindowState`],
//! bounded, with least-recently-used eviction.
//!
//! One hash probe per window key reaches both cells (they live in the same entry). Entries sit
//! in a slab threaded by an intrusive LRU list, so a warm decision allocates nothing and moves
//! no memory; a full table recycles its least recently used entry in place. Like Fastly's
//! ratecounter (200,000 entries per site), the bound keeps memory flat under key floods: an
//! evicted key simply starts cold again and is re-read from the origin.

use alloc::vec::Vec;
use core::fmt;

use foldhash::quality::FixedState;
use hashbrown::HashTable;

use crate::cell::WindowState;
use crate::decision::{Decision, LimitCheck, MultiDecision, decide_all};
use crate::gcounter::{FlushRow, PublishPolicy, sort_flush_rows};
use crate::identity::{WindowKey, WindowKeyRef};
use crate::origin::{OriginPolicy, ReadPlan};

/// Default bound on entries (window keys), as Fastly's ratecounter.
pub const DEFAULT_CAPACITY: usize = 200_000;
/// The smallest table: a multi-limit request must fit without evicting its own entries.
pub const MIN_CAPACITY: usize = 64;
const NIL: u32 = u32::MAX;

/// Table settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableConfig {
    /// Most entries held; clamped to `MIN_CAPACITY ..= u32::MAX - 1`.
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

/// What a local check produced: a decision, or the cells to read first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Decided locally and applied.
    Decided(Decision),
    /// Read these cells from the origin, merge them (`apply_origin`/`fail_origin`), then call
    /// [`CounterTable::decide`]. Nothing was counted.
    Read(ReadPlan),
}

/// The multi-limit form of [`Step`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MultiStep {
    /// Decided locally and applied (all or nothing).
    Decided(MultiDecision),
    /// `(limit index, plan)` for every limit with cells to read. Nothing was counted.
    Read(Vec<(usize, ReadPlan)>),
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

#[derive(Debug)]
struct Slot {
    key: WindowKey,
    hash: u64,
    state: WindowState,
    newer: u32,
    older: u32,
}

/// The bounded local table. Not thread-safe by design: a Wasm isolate owns one; a native
/// process shards several behind locks.
pub struct CounterTable {
    index: HashTable<u32>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    newest: u32,
    oldest: u32,
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
        let capacity = config.capacity.clamp(MIN_CAPACITY, NIL as usize - 1);
        Self {
            index: HashTable::new(),
            slots: Vec::new(),
            free: Vec::new(),
            newest: NIL,
            oldest: NIL,
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

    /// Approximate heap bytes held: slots, index and key text.
    pub fn heap_bytes(&self) -> usize {
        let keys: usize = self.slots.iter().map(|s| s.key.heap_bytes()).sum();
        self.slots.capacity() * core::mem::size_of::<Slot>()
            + self.index.allocation_size()
            + self.free.capacity() * core::mem::size_of::<u32>()
            + keys
    }

    /// The state of a key, without touching its recency.
    pub fn get(&self, key: WindowKeyRef<'_>) -> Option<&WindowState> {
        self.find(key).map(|i| &self.slots[i as usize].state)
    }

    /// Decides one limit locally if the key's cells allow it (warm, fresh, not strict);
    /// otherwise returns the cells to read from the origin first.
    pub fn check(&mut self, key: WindowKeyRef<'_>, limit: u64, cost: u64, now_ms: u64) -> Step {
        let d = key.duration();
        let state = self.state_mut(key, now_ms);
        let now_ms = state.roll(d, now_ms);
        state.observe_limit(limit);
        let plan = state.plan_reads(now_ms);
        if !plan.is_empty() {
            return Step::Read(plan);
        }
        let decision = state.check(d, limit, cost).decide(now_ms, 0);
        state.apply(&decision, d, cost, now_ms);
        Step::Decided(decision)
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
        self.state_mut(key, now_ms)
            .decide(key.duration(), limit, cost, now_ms)
    }

    /// [`check`](Self::check) for several limits, all or nothing.
    pub fn check_all(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<MultiStep, TooManyLimits> {
        let slots = self.slots_for(limits, now_ms)?;
        let mut reads = Vec::new();
        for (i, (&slot, limit)) in slots.iter().zip(limits).enumerate() {
            let state = &mut self.slots[slot as usize].state;
            let now_ms = state.roll(limit.key.duration(), now_ms);
            state.observe_limit(limit.limit);
            let plan = state.plan_reads(now_ms);
            if !plan.is_empty() {
                reads.push((i, plan));
            }
        }
        if !reads.is_empty() {
            return Ok(MultiStep::Read(reads));
        }
        Ok(MultiStep::Decided(
            self.decide_slots(&slots, limits, now_ms),
        ))
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

    fn slots_for(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<Vec<u32>, TooManyLimits> {
        if limits.len() > self.config.capacity {
            return Err(TooManyLimits {
                limits: limits.len(),
                capacity: self.config.capacity,
            });
        }
        // Each lookup makes its entry the newest, so later inserts cannot evict earlier ones.
        Ok(limits.iter().map(|l| self.slot(l.key, now_ms)).collect())
    }

    fn decide_slots(
        &mut self,
        slots: &[u32],
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> MultiDecision {
        let checks: Vec<LimitCheck> = slots
            .iter()
            .zip(limits)
            .map(|(&slot, l)| {
                let state = &mut self.slots[slot as usize].state;
                state.roll(l.key.duration(), now_ms);
                state.observe_limit(l.limit);
                state.check(l.key.duration(), l.limit, l.cost)
            })
            .collect();
        let multi = decide_all(&checks, now_ms, |i, j| slots[i] == slots[j]);
        for ((&slot, l), decision) in slots.iter().zip(limits).zip(&multi.decisions) {
            // All counted, or only the denials recorded (strict mode) and nothing counted.
            if multi.success || !decision.success {
                let state = &mut self.slots[slot as usize].state;
                let now_ms = state.roll(l.key.duration(), now_ms);
                state.apply(decision, l.key.duration(), l.cost, now_ms);
            }
        }
        multi
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
        let slot = self.slot_counted(key, now_ms, true);
        let state = &mut self.slots[slot as usize].state;
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
        for &i in self.index.iter() {
            let slot = &self.slots[i as usize];
            let d = slot.key.duration();
            for cell in slot.state.cells() {
                let expires_at = d.expires_at(cell.sequence());
                if now_ms < expires_at && policy.should_publish(cell) {
                    rows.push(FlushRow {
                        key: slot.key.clone(),
                        sequence: cell.sequence(),
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
            if let Some(cell) = self.slots[i as usize].state.cell_mut(row.sequence) {
                cell.last_flushed = cell.last_flushed.max(row.count);
            }
        }
    }

    /// Drops entries whose cells can no longer affect a decision, looking at up to `max_scan`
    /// of the least recently used. Returns how many were dropped.
    pub fn purge_expired(&mut self, now_ms: u64, max_scan: usize) -> usize {
        let mut dropped = 0;
        let mut at = self.oldest;
        for _ in 0..max_scan {
            if at == NIL {
                break;
            }
            let slot = &self.slots[at as usize];
            let next = slot.newer;
            if slot.state.is_expired(slot.key.duration(), now_ms) {
                self.unlink(at);
                self.unindex(at);
                self.free.push(at);
                dropped += 1;
            }
            at = next;
        }
        self.stats.expired += dropped as u64;
        dropped
    }

    fn state_mut(&mut self, key: WindowKeyRef<'_>, now_ms: u64) -> &mut WindowState {
        let i = self.slot(key, now_ms);
        &mut self.slots[i as usize].state
    }

    fn find(&self, key: WindowKeyRef<'_>) -> Option<u32> {
        let hash = key.hash_with(&self.hasher);
        let slots = &self.slots;
        self.index
            .find(hash, |&i| {
                let s = &slots[i as usize];
                s.hash == hash && s.key.as_ref() == key
            })
            .copied()
    }

    /// The entry of `key`, created (or recycled from the least recently used) if absent, and
    /// made the newest.
    fn slot(&mut self, key: WindowKeyRef<'_>, now_ms: u64) -> u32 {
        self.slot_counted(key, now_ms, false)
    }

    fn slot_counted(&mut self, key: WindowKeyRef<'_>, now_ms: u64, by_sync: bool) -> u32 {
        if let Some(i) = self.find(key) {
            self.unlink(i);
            self.push_newest(i);
            return i;
        }
        let hash = key.hash_with(&self.hasher);
        let fresh = Slot {
            key: key.to_owned_key(),
            hash,
            state: WindowState::new(key.duration(), now_ms),
            newer: NIL,
            older: NIL,
        };
        let i = if let Some(i) = self.free.pop() {
            self.slots[i as usize] = fresh;
            i
        } else if self.index.len() >= self.config.capacity && self.oldest != NIL {
            let i = self.oldest;
            self.unlink(i);
            self.unindex(i);
            self.stats.evicted += 1;
            self.slots[i as usize] = fresh;
            i
        } else {
            // len < capacity <= u32::MAX - 1, so the index fits.
            let i = u32::try_from(self.slots.len()).unwrap_or(NIL - 1);
            self.slots.push(fresh);
            i
        };
        let slots = &self.slots;
        self.index
            .insert_unique(hash, i, |&j| slots[j as usize].hash);
        self.push_newest(i);
        if by_sync {
            self.stats.created_by_sync += 1;
        } else {
            self.stats.created += 1;
        }
        i
    }

    fn unindex(&mut self, i: u32) {
        let hash = self.slots[i as usize].hash;
        if let Ok(entry) = self.index.find_entry(hash, |&j| j == i) {
            entry.remove();
        }
    }

    fn unlink(&mut self, i: u32) {
        let (newer, older) = {
            let s = &self.slots[i as usize];
            (s.newer, s.older)
        };
        match newer {
            NIL => self.newest = older,
            n => self.slots[n as usize].older = older,
        }
        match older {
            NIL => self.oldest = newer,
            o => self.slots[o as usize].newer = newer,
        }
        let s = &mut self.slots[i as usize];
        s.newer = NIL;
        s.older = NIL;
    }

    fn push_newest(&mut self, i: u32) {
        let old_newest = self.newest;
        {
            let s = &mut self.slots[i as usize];
            s.newer = NIL;
            s.older = old_newest;
        }
        match old_newest {
            NIL => self.oldest = i,
            n => self.slots[n as usize].newer = i,
        }
        self.newest = i;
    }
}
