//! The single-threaded local counter table of a process: window key → [`WindowState`],
//! bounded (see [`crate::slab`] for storage and eviction), and the decision API shells call.
//!
//! A single-limit request is [`CounterTable::check`]: decided locally (allocation-free on the
//! warm path) or an [`OriginPlan`] for [`OriginCall::single`]; a multi-limit one is
//! [`CounterTable::begin`]. Either way the answer goes to [`CounterTable::finish`] and a
//! failure to [`CounterTable::fail`] (see [`crate::request`]).

use alloc::vec::Vec;
use core::fmt;

use crate::cell::WindowState;
use crate::decision::{Counts, Decision, MultiDecision};
use crate::gcounter::{FlushRow, PublishPolicy, sort_flush_rows};
use crate::identity::WindowKeyRef;
pub use crate::limit::LimitRequest;
use crate::origin::{OriginAnswer, OriginPlan, OriginPolicy, Verdict};
use crate::request::{self, Begin, OriginCall, States};
use crate::slab::Slab;
pub use crate::slab::TableStats;

/// Default bound on entries (window keys), as Fastly's ratecounter.
pub const DEFAULT_CAPACITY: usize = 200_000;
/// The smallest table: a multi-limit request must fit without evicting its own entries.
pub const MIN_CAPACITY: usize = 64;
/// A Wasm shell's table when its `table_capacity` is not set: about 14 MB of linear memory
/// when full (see [`BYTES_PER_ENTRY`]), well inside a Worker isolate's 128 MB beside the
/// Worker's own JavaScript, and paid once per worker thread by an Envoy.
pub const SHELL_CAPACITY: usize = 50_000;
/// The largest `table_capacity` a Wasm shell takes: about 300 MB when full.
pub const MAX_SHELL_CAPACITY: usize = 1_000_000;
/// The most a full table holds per entry whose key's text fits inline (38 bytes of namespace
/// and identifier; a longer one adds its length): the slot (key and both cells, 256 bytes),
/// the eviction mark, the touched flag and its place in the replay list (6), and its share of
/// the key index (9 bytes a bucket, from 2.3 to 4.6 buckets a key once the table's first
/// eviction sized it for churn: see the test
/// `a_full_table_holds_at_most_its_stated_bytes_per_key_and_stays_there`). Measured: 274
/// bytes a key at 50,000 keys before any eviction, 286 after.
pub const BYTES_PER_ENTRY: usize = 304;

/// A Wasm shell's `table_capacity` (the edge's `STRATA_TABLE_CAPACITY`): the most window keys
/// its table holds, from [`MIN_CAPACITY`] to [`MAX_SHELL_CAPACITY`]. A full table evicts the
/// entry least recently used (see [`crate::slab`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "u64", into = "u64")]
pub struct TableCapacity(usize);

impl TableCapacity {
    /// The entries it allows.
    pub fn get(self) -> usize {
        self.0
    }
}

impl Default for TableCapacity {
    fn default() -> Self {
        Self(SHELL_CAPACITY)
    }
}

impl TryFrom<u64> for TableCapacity {
    type Error = alloc::string::String;
    fn try_from(n: u64) -> Result<Self, Self::Error> {
        match usize::try_from(n) {
            Ok(n) if (MIN_CAPACITY..=MAX_SHELL_CAPACITY).contains(&n) => Ok(Self(n)),
            _ => Err(alloc::format!(
                "must be a whole number of window keys from {MIN_CAPACITY} to {MAX_SHELL_CAPACITY}, not {n}"
            )),
        }
    }
}

impl From<TableCapacity> for u64 {
    fn from(c: TableCapacity) -> u64 {
        u64::try_from(c.0).unwrap_or(u64::MAX)
    }
}
/// Table settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableConfig {
    /// Most entries held; at least `MIN_CAPACITY`.
    pub capacity: usize,
    /// Origin settings.
    pub origin: OriginPolicy,
    /// Eviction passes over entries whose counts a flush has not published yet (a region
    /// view, whose flush is the only way those counts reach other regions); a table full of
    /// them still evicts, and counts the loss in `TableStats::unpublished_lost`.
    pub keep_unpublished: bool,
    /// Replays ask the origin to keep reserving leases in use in the last quarter of their lifetime
    /// ([`ReplayEvent::renew`](crate::replay::ReplayEvent)), for a shell whose origin renews
    /// them (the gateway's; an edge's `/v1/origin/replay` does not carry it yet).
    pub renew_leases: bool,
    /// Size the key index for `capacity` when the table is made instead of growing it with
    /// the keys: for one large table (a region view of up to a million keys), where a growth
    /// would hold its lock for milliseconds. A table that is one of many shards grows its own
    /// cheaply and stays compact for a few keys.
    pub presize_index: bool,
}

impl Default for TableConfig {
    fn default() -> Self {
        Self {
            capacity: DEFAULT_CAPACITY,
            origin: OriginPolicy::default(),
            keep_unpublished: false,
            renew_leases: false,
            presize_index: false,
        }
    }
}

/// What a local check produced: a decision, or a decision the origin must make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Decided locally and applied (a denial, or a pass the lease covers).
    Decided(Decision),
    /// Decide at the origin: send [`OriginCall::single`] and hand the answer to
    /// [`CounterTable::finish`], or a failure to [`CounterTable::fail`]. Nothing was counted.
    Origin(OriginPlan),
    /// Decided and applied per the failure mode, with no call: the origin must decide, but a
    /// call on the cell failed moments ago.
    Fallback(Decision),
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

/// The bounded local table. Not thread-safe by design: a Wasm isolate owns one; a native
/// process shards several behind locks.
pub struct CounterTable {
    pub(crate) slab: Slab,
    config: TableConfig,
    /// The lifetime of the leases the origin lent last (its answers carry it; the configured
    /// one until then): a lease in use is renewed in the last quarter of it.
    pub(crate) lease_ms: u64,
}

impl fmt::Debug for CounterTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CounterTable")
            .field("len", &self.len())
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// The pinned slots of one request's limits, as the request path reads them.
struct Pinned<'t> {
    slab: &'t mut Slab,
    slots: &'t [usize],
}

impl States for Pinned<'_> {
    fn state(&mut self, i: usize) -> Option<&mut WindowState> {
        let slot = *self.slots.get(i)?;
        self.slab.slots.get_mut(slot).map(|s| &mut s.state)
    }
    fn same(&self, i: usize, j: usize) -> bool {
        self.slots.get(i) == self.slots.get(j)
    }
    fn next_call(&mut self, _: usize) -> u64 {
        self.slab.last_call = self.slab.last_call.saturating_add(1);
        self.slab.last_call
    }
}

impl CounterTable {
    /// An empty table. `seed` keys the hash so clients cannot aim collisions at it: pass
    /// randomness from the host (`getrandom`, the OS).
    pub fn new(config: TableConfig, seed: u64) -> Self {
        let capacity = config.capacity.clamp(MIN_CAPACITY, u32::MAX as usize);
        Self {
            slab: Slab::new(
                capacity,
                seed,
                config.keep_unpublished,
                config.presize_index,
            ),
            lease_ms: config.origin.lease_ms,
            config: TableConfig { capacity, ..config },
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.slab.len()
    }
    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.slab.len() == 0
    }
    /// The settings in force (capacity after clamping).
    pub fn config(&self) -> &TableConfig {
        &self.config
    }
    /// What the table did so far.
    pub fn stats(&self) -> TableStats {
        self.slab.stats
    }

    /// Approximate heap bytes held: slots, index, side arrays and the keys' text.
    pub fn heap_bytes(&self) -> usize {
        self.slab.heap_bytes()
    }

    /// The state of a key, without marking it used.
    pub fn get(&self, key: WindowKeyRef<'_>) -> Option<&WindowState> {
        self.slab.find(key).map(|i| &self.slab.slots[i].state)
    }

    /// Decides one limit locally where that is safe (see [`WindowState::classify`]): a local
    /// denial, or a pass the lease covers; otherwise says what to ask the origin.
    pub fn check(&mut self, key: WindowKeyRef<'_>, limit: u64, cost: u64, now_ms: u64) -> Step {
        let d = key.duration();
        let (slot, now_ms) = self.rolled_slot(key, now_ms);
        let slab = &mut self.slab;
        let state = &mut slab.slots[slot].state;
        state.observe_limit(limit);
        match state.classify(d, limit, cost, now_ms) {
            Verdict::Local(decision) => {
                state.apply(&decision, d, cost, now_ms);
                Step::Decided(decision)
            }
            Verdict::Origin(mut plan) => {
                state.begin_origin(&plan, cost);
                slab.last_call = slab.last_call.saturating_add(1);
                plan.call = slab.last_call;
                Step::Origin(plan)
            }
            Verdict::Unreachable(local) => {
                // A failure-mode denial proves nothing about the counts: applied only from
                // memory (no strict mode).
                if !self.config.origin.failure_mode.from_memory() {
                    return Step::Fallback(request::failed_denial(d, limit, now_ms));
                }
                state.apply(&local, d, cost, now_ms);
                Step::Fallback(local)
            }
        }
    }

    /// Decides one limit from local state whatever its lease (the fallback when the origin
    /// is unreachable, or a shell with no origin).
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

    /// Starts a request of one or several limits (see [`request::begin`]).
    pub fn begin(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<Begin, TooManyLimits> {
        let slots = self.slots_for(limits.iter().map(|l| l.key), now_ms)?;
        let policy = self.config.origin;
        let begun = request::begin(&mut self.pinned(&slots), limits, now_ms, &policy);
        self.unpin(slots);
        Ok(begun)
    }

    /// Merges the origin's answers to `call` (see [`request::finish`]).
    pub fn finish(
        &mut self,
        call: &OriginCall,
        answers: &[OriginAnswer],
        now_ms: u64,
    ) -> Result<MultiDecision, TooManyLimits> {
        let keys = call.limits().iter().map(|l| l.key.as_ref());
        let slots = self.slots_for(keys, now_ms)?;
        let decided = request::finish(&mut self.pinned(&slots), call, answers, now_ms);
        self.unpin(slots);
        self.lent_for(
            answers
                .iter()
                .filter(|a| a.lease_id > 0)
                .map(|a| a.lease_ms),
        );
        Ok(decided)
    }

    /// The lifetime of the leases the origin lent last (the configured one until then).
    pub fn lease_ms(&self) -> u64 {
        self.lease_ms
    }

    /// Notes the lifetime of leases the origin just lent (the longest of them; none: no
    /// change), which sets the renewal window.
    pub(crate) fn lent_for(&mut self, lease_ms: impl Iterator<Item = u64>) {
        if let Some(ms) = lease_ms.filter(|&ms| ms > 0).max() {
            self.lease_ms = ms;
        }
    }

    /// The origin could not decide `call` (see [`request::fail`]): decided per the table's
    /// failure mode.
    pub fn fail(&mut self, call: &OriginCall, now_ms: u64) -> Result<MultiDecision, TooManyLimits> {
        let keys = call.limits().iter().map(|l| l.key.as_ref());
        let slots = self.slots_for(keys, now_ms)?;
        let policy = self.config.origin;
        let decided = request::fail(&mut self.pinned(&slots), call, now_ms, &policy);
        self.unpin(slots);
        Ok(decided)
    }

    /// Decides `limits` as `mode` decides a request the origin gave no answer for (see
    /// [`request::decide_failed`]), on this table's states: a shell whose call's own states
    /// are out of reach when it fails still counts what it admits, where its replay finds it.
    pub fn decide_failed(
        &mut self,
        limits: &[LimitRequest<'_>],
        mode: crate::FailureMode,
        now_ms: u64,
    ) -> Result<MultiDecision, TooManyLimits> {
        let slots = self.slots_for(limits.iter().map(|l| l.key), now_ms)?;
        let decided = request::decide_failed(&mut self.pinned(&slots), limits, mode, now_ms);
        self.unpin(slots);
        Ok(decided)
    }

    /// [`decide`](Self::decide) for several limits, all or nothing.
    pub fn decide_all(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<MultiDecision, TooManyLimits> {
        let slots = self.slots_for(limits.iter().map(|l| l.key), now_ms)?;
        let decided = request::decide_from_memory(&mut self.pinned(&slots), limits, now_ms);
        self.unpin(slots);
        Ok(decided)
    }

    /// Returns the pin list (kept for its allocation), empty.
    fn unpin(&mut self, mut slots: Vec<usize>) {
        slots.clear();
        self.slab.pinned = slots;
    }

    fn pinned<'t>(&'t mut self, slots: &'t [usize]) -> Pinned<'t> {
        Pinned {
            slab: &mut self.slab,
            slots,
        }
    }

    /// Slots of every key's entry, created where missing; pinned while the later ones are
    /// inserted, so no limit of a request evicts another's entry.
    fn slots_for<'k>(
        &mut self,
        keys: impl ExactSizeIterator<Item = WindowKeyRef<'k>>,
        now_ms: u64,
    ) -> Result<Vec<usize>, TooManyLimits> {
        // Pinned entries cannot be evicted, so at least half the table must stay evictable.
        if keys.len() * 2 > self.config.capacity {
            return Err(TooManyLimits {
                limits: keys.len(),
                capacity: self.config.capacity,
            });
        }
        let mut pinned = core::mem::take(&mut self.slab.pinned);
        pinned.clear();
        self.slab.pinned = pinned;
        for key in keys {
            let (slot, _) = self.rolled_slot(key, now_ms);
            self.slab.pinned.push(slot);
        }
        Ok(core::mem::take(&mut self.slab.pinned))
    }

    /// A new origin call id: only growing, across evicted entries too (a call id names what
    /// the origin counted for this process, so a later call can ask it to undo that).
    pub fn next_call(&mut self) -> u64 {
        self.slab.last_call = self.slab.last_call.saturating_add(1);
        self.slab.last_call
    }

    /// The state of `key`, created if absent and marked used: for shells that hold several
    /// tables (a native process's shards) and drive the request path across them.
    pub fn entry(&mut self, key: WindowKeyRef<'_>, now_ms: u64) -> &mut WindowState {
        let (slot, _) = self.rolled_slot(key, now_ms);
        &mut self.slab.slots[slot].state
    }

    /// Merges counts of one cell seen elsewhere (a read, the region view) with `max`.
    pub fn merge_counts(
        &mut self,
        key: WindowKeyRef<'_>,
        sequence: u64,
        counts: Counts,
        now_ms: u64,
    ) -> bool {
        let state = self.state_mut(key, now_ms);
        state.roll(key.duration(), now_ms);
        state.merge_counts(sequence, counts)
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
        let slot = self.slab.slot(key, now_ms, true);
        let state = &mut self.slab.slots[slot].state;
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
        self.flush_candidates_from(policy, now_ms, 0, usize::MAX, &mut rows);
        sort_flush_rows(&mut rows);
        rows
    }

    /// One step of [`flush_candidates`](Self::flush_candidates) over a large table: the rows
    /// of up to `max` slots from slot `from` on, added to `rows` (unsorted: sort the whole
    /// with [`sort_flush_rows`] once every step is done). Returns the slot the next step
    /// starts at, or `None` at the end. A shell that holds the table behind a lock takes it
    /// once per step: at a million keys one walk of every slot took milliseconds.
    pub fn flush_candidates_from(
        &self,
        policy: &PublishPolicy,
        now_ms: u64,
        from: usize,
        max: usize,
        rows: &mut Vec<FlushRow>,
    ) -> Option<usize> {
        let end = from.saturating_add(max).min(self.slab.slots.len());
        for i in from..end {
            if !self.slab.is_live(i) {
                continue;
            }
            let slot = &self.slab.slots[i];
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
        (end < self.slab.slots.len()).then_some(end)
    }

    /// Records rows a flush wrote successfully (and only then), so unchanged cells are not
    /// written again. Rows of entries evicted or rolled away since are ignored.
    pub fn commit_flush(&mut self, rows: &[FlushRow]) {
        for row in rows {
            let Some(i) = self.slab.find(row.key.as_ref()) else {
                continue;
            };
            if let Some(cell) = self.slab.slots[i].state.cell_mut(row.sequence) {
                cell.last_flushed = cell.last_flushed.max(row.count);
            }
        }
    }

    /// Drops entries whose cells can no longer affect a decision, looking at up to `max_scan`
    /// slots from where the last call stopped. Returns how many were dropped.
    pub fn purge_expired(&mut self, now_ms: u64, max_scan: usize) -> usize {
        self.slab.purge_expired(now_ms, max_scan)
    }

    fn state_mut(&mut self, key: WindowKeyRef<'_>, now_ms: u64) -> &mut WindowState {
        let slot = self.slab.slot(key, now_ms, false);
        &mut self.slab.slots[slot].state
    }

    /// The slot of `key`, its cells aged to `now_ms`, and the time to decide at (see
    /// [`WindowState::roll`]): own cost that ages out unacknowledged is counted lost here,
    /// whichever entry point a request comes through.
    fn rolled_slot(&mut self, key: WindowKeyRef<'_>, now_ms: u64) -> (usize, u64) {
        let slot = self.slab.slot(key, now_ms, false);
        let slab = &mut self.slab;
        let (now_ms, lost) = slab.slots[slot]
            .state
            .roll_counting_lost(key.duration(), now_ms);
        slab.stats.replay_lost += lost;
        (slot, now_ms)
    }
}
