//! The storage under a [`crate::CounterTable`]: window key → [`WindowState`] in a bounded slab
//! with CLOCK (approximate least-recently-used) eviction, and the list of entries holding own
//! cost the origin has not acknowledged (the replay buffer's index).
//!
//! One hash probe per window key reaches both cells, which live in one slab slot; a warm
//! lookup allocates nothing. The slab never grows past the capacity and recycles slots in
//! place, so memory stays flat under churn (a hash table holding the entries themselves was
//! measured to double its buckets under eviction churn: tombstones force a resize). Like
//! Fastly's ratecounter (200,000 entries per site), the bound keeps memory flat under key
//! floods; an evicted key simply starts cold again and is decided at the origin.
//!
//! Eviction is CLOCK (second chance): a hit sets a one-byte mark in a dense side array, and a
//! full table sweeps a hand over the slots, clearing marks, until it finds one not used since
//! the last sweep. An exact LRU list would write to two random neighbours' links on every
//! hit, two more cache misses on a path whose cost at 100,000 keys is nearly all misses. New
//! entries start unmarked, so a flood of one-off keys evicts itself before keys in use; an
//! entry whose own cost is not yet acknowledged is passed over while any other can go.

use alloc::vec::Vec;

use foldhash::quality::FixedState;
use hashbrown::HashTable;

use crate::cell::WindowState;
use crate::chunks::Chunks;
use crate::identity::{WindowKey, WindowKeyRef};

/// Most slots holding unreplayed cost one eviction passes over before it takes one.
const MAX_UNREPLAYED_SKIPS: usize = 256;

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

/// Key and state, 48 + 208 bytes. Eviction and replay bookkeeping live apart.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) key: WindowKey,
    pub(crate) state: WindowState,
}

/// What the slab did, for metrics.
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
    /// Own cost dropped before the origin acknowledged it (an entry evicted from a table full
    /// of unreplayed entries, or a cell that aged out while the origin was unreachable).
    pub replay_lost: u64,
    /// In a table that keeps unpublished counts (a region view): regional counts evicted
    /// before a flush published them (the table was full of such entries).
    pub unpublished_lost: u64,
}

/// The bounded map. Not thread-safe by design: a Wasm isolate owns one; a native process
/// shards several behind locks.
pub(crate) struct Slab {
    /// Whether eviction passes over entries holding counts a flush has not published yet.
    keep_unpublished: bool,
    /// Key hash → slot index, 8 bytes a bucket. It grows with the keys unless presized: sized
    /// for the capacity at once, 10,000 keys in a table of a million were spread over
    /// megabytes of index, a cache miss more per lookup.
    index: HashTable<IndexEntry>,
    /// Never more than the capacity, and never moved (see [`Chunks`]).
    pub(crate) slots: Chunks<Slot>,
    /// One byte per slot: a dense array the hot path writes and the hand sweeps.
    clock: Vec<Clock>,
    free: Vec<u32>,
    /// Slots of the multi-limit operation in progress: not evictable during it.
    pub(crate) pinned: Vec<usize>,
    /// Slots touched since the last replay pass (each once): where unacknowledged own cost
    /// can be. Its capacity follows the slab's, so marking a slot never allocates.
    pub(crate) touched: Vec<u32>,
    marked: Vec<bool>,
    hand: usize,
    purge_at: usize,
    /// The last origin call id handed out (ids only grow, also across evicted entries).
    pub(crate) last_call: u64,
    hasher: FixedState,
    /// Whether the index was sized for churn (the table filled once).
    churn_sized: bool,
    /// Heap bytes of the slots' keys' text (a long key's), kept as keys come and go: the
    /// Envoy filter reports its table every tick, and a walk of 50,000 slots took
    /// milliseconds.
    key_bytes: usize,
    pub(crate) stats: TableStats,
}

impl Slab {
    pub(crate) fn new(capacity: usize, seed: u64, keep_unpublished: bool, presize: bool) -> Self {
        Self {
            keep_unpublished,
            index: if presize {
                HashTable::with_capacity(capacity)
            } else {
                HashTable::new()
            },
            slots: Chunks::new(capacity),
            clock: Vec::new(),
            free: Vec::new(),
            pinned: Vec::new(),
            touched: Vec::new(),
            marked: Vec::new(),
            hand: 0,
            purge_at: 0,
            last_call: 0,
            hasher: FixedState::with_seed(seed),
            churn_sized: false,
            key_bytes: 0,
            stats: TableStats::default(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.heap_bytes()
            + self.clock.capacity()
            + self.marked.capacity()
            + self.index.allocation_size()
            + (self.free.capacity() + self.touched.capacity()) * core::mem::size_of::<u32>()
            + self.key_bytes
    }

    pub(crate) fn find(&self, key: WindowKeyRef<'_>) -> Option<usize> {
        self.find_hashed(key, IndexEntry::hash_of(key, &self.hasher))
    }

    /// [`Self::find`] with the index hash of `key` already made.
    fn find_hashed(&self, key: WindowKeyRef<'_>, hash: u64) -> Option<usize> {
        let slots = &self.slots;
        self.index
            .find(hash, |e| slots[e.slot as usize].key.matches(key))
            .map(|e| e.slot as usize)
    }

    /// Whether slot `i` holds a live entry.
    pub(crate) fn is_live(&self, i: usize) -> bool {
        self.clock.get(i).is_some_and(|c| *c != Clock::Vacant)
    }

    /// Marks slot `i` as touched (a replay pass will look at it). Never allocates.
    fn touch(&mut self, i: usize) {
        if let Some(m) = self.marked.get_mut(i) {
            if !*m {
                *m = true;
                self.touched.push(slot_id(i));
            }
        }
    }

    /// Forgets that slot `i` was touched (its own cost is acknowledged, or it is gone).
    pub(crate) fn untouch(&mut self, i: usize) {
        if let Some(m) = self.marked.get_mut(i) {
            *m = false;
        }
    }

    /// The slot of `key`'s entry, created if absent (recycling a free or evicted slot when the
    /// table is full), marked as used and as touched.
    pub(crate) fn slot(&mut self, key: WindowKeyRef<'_>, now_ms: u64, by_sync: bool) -> usize {
        // Hashed once: a new key is looked up, then filed under the same hash.
        let hash = IndexEntry::hash_of(key, &self.hasher);
        if let Some(i) = self.find_hashed(key, hash) {
            self.clock[i] = Clock::Used;
            self.touch(i);
            return i;
        }
        let fresh = Slot {
            key: key.to_owned_key(),
            state: WindowState::new(key.duration(), now_ms),
        };
        let text = fresh.key.heap_bytes();
        let i = if let Some(i) = self.free.pop() {
            self.replace(i as usize, fresh);
            i as usize
        } else {
            match self.slots.push(fresh) {
                Ok(i) => {
                    self.reserve_side();
                    self.clock.push(Clock::Vacant);
                    self.marked.push(false);
                    i
                }
                // Full: the fresh entry takes a victim's slot.
                Err(fresh) => {
                    self.size_index_for_churn();
                    let i = self.victim();
                    if self.keep_unpublished {
                        self.stats.unpublished_lost += unpublished(&self.slots[i].state);
                    }
                    self.release(i);
                    self.stats.evicted += 1;
                    self.replace(i, fresh);
                    i
                }
            }
        };
        self.key_bytes = self.key_bytes.saturating_add(text);
        // New entries start idle: a flood of one-off keys evicts itself first.
        self.clock[i] = Clock::Idle;
        let entry = IndexEntry {
            slot: slot_id(i),
            hash: IndexEntry::kept(hash),
        };
        self.index.insert_unique(hash, entry, IndexEntry::rehash);
        if by_sync {
            self.stats.created_by_sync += 1;
        } else {
            self.stats.created += 1;
        }
        self.touch(i);
        i
    }

    /// Puts `fresh` in slot `i`, whose key's text goes with the entry it held.
    fn replace(&mut self, i: usize, fresh: Slot) {
        let old = core::mem::replace(&mut self.slots[i], fresh);
        self.key_bytes = self.key_bytes.saturating_sub(old.key.heap_bytes());
    }

    /// Room in the side arrays for every slot the chunks hold, reserved exactly as a chunk
    /// comes (marking a slot as touched never allocates, and no array outgrows the slots).
    fn reserve_side(&mut self) {
        let room = self.slots.allocated();
        if self.clock.capacity() < room {
            self.clock.reserve_exact(room - self.clock.len());
            self.marked.reserve_exact(room - self.marked.len());
        }
        if self.touched.capacity() < room {
            self.touched.reserve_exact(room - self.touched.len());
        }
    }

    /// Sizes the key index of a full table, once, for the churn evictions bring: an evicted
    /// key leaves a tombstone, and an index more than 7/16 full grows when tombstones use up
    /// its room rather than clean them in place, so it would double at a moment the hashes
    /// pick. Grown now to twice the keys, it only ever cleans in place: its size is final
    /// when the table first fills (about 1.2 MB at 50,000 keys).
    fn size_index_for_churn(&mut self) {
        if !self.churn_sized {
            self.churn_sized = true;
            let want = 2 * self.slots.len() + 2;
            self.index
                .reserve(want.saturating_sub(self.index.len()), IndexEntry::rehash);
        }
    }

    /// The next slot not used since the hand last passed it, not pinned by the operation in
    /// progress, and holding no unacknowledged own cost. Passing over unreplayed slots is
    /// bounded (`MAX_UNREPLAYED_SKIPS`): with the origin down under a key flood nearly every
    /// slot holds such cost, and an insert must not sweep the whole table; then the slot at
    /// the hand goes, and its cost is counted as lost.
    fn victim(&mut self) -> usize {
        let n = self.slots.len();
        let mut skipped = 0;
        for _ in 0..2 * n {
            self.hand = (self.hand + 1) % n;
            if self.pinned.contains(&self.hand) {
                continue;
            }
            if self.pending(&self.slots[self.hand].state) > 0 && skipped < MAX_UNREPLAYED_SKIPS {
                skipped += 1;
                continue;
            }
            match self.clock[self.hand] {
                Clock::Used => self.clock[self.hand] = Clock::Idle,
                Clock::Idle | Clock::Vacant => return self.hand,
            }
        }
        while self.pinned.contains(&self.hand) {
            self.hand = (self.hand + 1) % n;
        }
        self.hand
    }

    /// Takes slot `i` out of the index and marks it vacant (its key stays until reuse); own
    /// cost it still held unacknowledged is counted as lost.
    fn release(&mut self, i: usize) {
        self.stats.replay_lost += unacked(&self.slots[i].state);
        let hash = IndexEntry::hash_of(self.slots[i].key.as_ref(), &self.hasher);
        if let Ok(entry) = self.index.find_entry(hash, |e| e.slot as usize == i) {
            entry.remove();
        }
        self.clock[i] = Clock::Vacant;
    }

    /// Drops entries whose cells can no longer affect a decision, looking at up to `max_scan`
    /// slots from where the last call stopped. Returns how many were dropped.
    pub(crate) fn purge_expired(&mut self, now_ms: u64, max_scan: usize) -> usize {
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
}

/// Own cost of both cells the origin has not acknowledged.
/// Regional counts of a state's cells beyond what the last flush published.
fn unpublished(state: &WindowState) -> u64 {
    state.cells().iter().fold(0, |sum, (_, c)| {
        sum.saturating_add(c.counts().regional.saturating_sub(c.last_flushed()))
    })
}

impl Slab {
    /// What evicting a state would lose: own cost not yet replayed, and, in a table that
    /// keeps them, counts not yet published.
    fn pending(&self, state: &WindowState) -> u64 {
        let own = unacked(state);
        if self.keep_unpublished {
            own.saturating_add(unpublished(state))
        } else {
            own
        }
    }
}

pub(crate) fn unacked(state: &WindowState) -> u64 {
    state
        .current()
        .unacked()
        .saturating_add(state.previous().unacked())
}

/// A slot in the index, with 32 bits of its key's hash: growing the index rehashes from the
/// entries alone. Reading each slot's key instead made a growth past half a million keys a
/// stall of tens of milliseconds; this way it is one pass over the index (about 10 ms at
/// 900,000 keys, 0.6 ms for a shard of a gateway's million-key table).
#[derive(Clone, Copy, Debug)]
struct IndexEntry {
    slot: u32,
    hash: u32,
}

impl IndexEntry {
    /// The hash the index files `key` under: the high half of its full hash, repeated in both
    /// halves, so the table's bucket (low bits) and tag (top seven) come from the 32 bits an
    /// entry keeps.
    fn hash_of(key: WindowKeyRef<'_>, hasher: &FixedState) -> u64 {
        Self::spread(Self::kept(key.hash_with(hasher)))
    }

    fn kept(hash: u64) -> u32 {
        (hash >> 32) as u32
    }

    fn spread(kept: u32) -> u64 {
        (u64::from(kept) << 32) | u64::from(kept)
    }

    fn rehash(&self) -> u64 {
        Self::spread(self.hash)
    }
}

/// A slot index as the index stores it. The capacity is clamped to `u32::MAX`, so every slot
/// index fits.
pub(crate) fn slot_id(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(slab: &mut Slab, ids: &[alloc::string::String]) {
        let d = crate::WindowDuration::from_ms(60_000).unwrap();
        for id in ids {
            slab.slot(WindowKeyRef::new("ws", "ns", id, d).unwrap(), 0, false);
        }
    }

    /// A table sized for a million keys holding a thousand has an index for about a thousand
    /// (compact, so a lookup stays in cache), and every key is found after the growths that
    /// took it there, each of which rehashed from the entries alone.
    #[test]
    fn the_index_grows_with_the_keys() {
        let mut slab = Slab::new(1_000_000, 7, false, false);
        assert_eq!(slab.index.allocation_size(), 0);
        let ids: Vec<alloc::string::String> = (0..1_000).map(|i| alloc::format!("k{i}")).collect();
        fill(&mut slab, &ids);
        assert_eq!(slab.len(), 1_000);
        assert!(slab.index.allocation_size() <= 2_048 * 9 + 64);
        let d = crate::WindowDuration::from_ms(60_000).unwrap();
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(
                slab.find(WindowKeyRef::new("ws", "ns", id, d).unwrap()),
                Some(i)
            );
        }
        assert_eq!(
            slab.find(WindowKeyRef::new("ws", "ns", "k1000", d).unwrap()),
            None
        );
    }

    /// A presized index holds the capacity without growing (no growth's pause at all).
    #[test]
    fn a_presized_index_never_grows() {
        let mut slab = Slab::new(5_000, 7, false, true);
        let size = slab.index.allocation_size();
        let ids: Vec<alloc::string::String> = (0..5_000).map(|i| alloc::format!("k{i}")).collect();
        fill(&mut slab, &ids);
        assert_eq!(slab.len(), 5_000);
        assert_eq!(slab.index.allocation_size(), size);
    }

    /// The keys' text is counted as keys come, are evicted and are purged, so reporting a
    /// table's bytes reads no slot.
    #[test]
    fn the_keys_text_is_counted_as_keys_come_and_go() {
        let mut slab = Slab::new(64, 7, false, false);
        let held = |slab: &Slab| slab.slots.iter().map(|s| s.key.heap_bytes()).sum::<usize>();
        let long: Vec<alloc::string::String> = (0..100)
            .map(|i| alloc::format!("{i}-{}", "x".repeat(i)))
            .collect();
        fill(&mut slab, &long);
        assert_eq!(slab.stats.evicted, 36);
        assert!(slab.key_bytes > 0);
        assert_eq!(slab.key_bytes, held(&slab));
        // Purged (their cells long expired), then their slots reused by short keys.
        assert!(slab.purge_expired(10 * 86_400_000, 64) > 0);
        let short: Vec<alloc::string::String> = (0..64).map(|i| alloc::format!("s{i}")).collect();
        fill(&mut slab, &short);
        assert_eq!(slab.key_bytes, held(&slab));
        assert_eq!(slab.key_bytes, 0);
    }

    #[test]
    fn a_slot_is_256_bytes() {
        assert_eq!(core::mem::size_of::<Slot>(), 256);
        assert_eq!(core::mem::size_of::<WindowKey>(), 48);
    }
}
