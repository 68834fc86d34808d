//! The embedded origin: the region's cells in the gateway's own memory, for a single gateway
//! that needs no Redis. Same contract as Redis: one [`CellLedger`] per cell (own counts per
//! process merged with `max`, live leases), expiring three windows after its first write, and
//! atomic decisions under one lock: the core's [`ledger::decide`], which the Redis decide
//! script ports.

use std::hash::BuildHasher;
use std::sync::Mutex;

use foldhash::fast::RandomState;
use hashbrown::HashTable;
use strata_core::ledger::{self, CellLedger, Ledgers};
use strata_core::{WindowKey, WindowKeyRef, lease};

use super::{CellRead, CellUsed, DecideAnswer, DecideLimit, Replayed};

#[derive(Debug)]
struct Cell {
    key: WindowKey,
    sequence: u64,
    /// Where it hashes, kept so that a growing table moves cells without reading their keys.
    hash: u64,
    ledger: CellLedger,
    expires_at: u64,
}

impl Cell {
    fn is(&self, key: WindowKeyRef<'_>, sequence: u64) -> bool {
        self.sequence == sequence && self.key.matches(key)
    }
}

/// Tables the cells are spread over. A hash table grows by moving every entry at once, under
/// the lock every origin decision takes: one table of two million cells stalled the gateway
/// for hundreds of milliseconds as it doubled; one of 64 moves a 64th of them.
const SUBTABLES: usize = 64;

/// Where a purge step goes on: a subtable, and a bucket in it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PurgeCursor {
    table: usize,
    bucket: usize,
}

/// Ledgers per `(window key, sequence)`, found by the borrowed key: a replay or a read of a
/// cell already held copies no key (only a cell's first write does).
#[derive(Debug)]
struct Cells {
    tables: Box<[HashTable<Cell>]>,
    hasher: RandomState,
}

impl Default for Cells {
    fn default() -> Self {
        Self {
            tables: (0..SUBTABLES).map(|_| HashTable::new()).collect(),
            hasher: RandomState::default(),
        }
    }
}

impl Cells {
    /// The hash of `(key, sequence)` and the subtable it lives in, always one of the
    /// `SUBTABLES` (bits the table's own bucket index and control bytes do not use, so each
    /// subtable stays evenly spread).
    fn place(&self, key: WindowKeyRef<'_>, sequence: u64) -> (u64, usize) {
        let hash = self.hasher.hash_one((key, sequence));
        // Six bits from the middle: truncation is the point.
        #[allow(clippy::cast_possible_truncation)]
        let table = (hash >> 40) as usize & (SUBTABLES - 1);
        (hash, table)
    }

    fn get(&self, key: WindowKeyRef<'_>, sequence: u64) -> Option<&Cell> {
        let (hash, t) = self.place(key, sequence);
        self.tables[t].find(hash, |c| c.hash == hash && c.is(key, sequence))
    }

    /// The live ledger of a cell, created (or started again, if expired) on first use.
    fn ledger(&mut self, key: WindowKeyRef<'_>, sequence: u64, now_ms: u64) -> &mut CellLedger {
        let ttl = key.duration().as_ms().saturating_mul(3);
        let fresh = || (CellLedger::default(), now_ms.saturating_add(ttl));
        let (hash, t) = self.place(key, sequence);
        let cell = self.tables[t]
            .entry(hash, |c| c.hash == hash && c.is(key, sequence), |c| c.hash)
            .or_insert_with(|| {
                let (ledger, expires_at) = fresh();
                Cell {
                    key: key.to_owned_key(),
                    sequence,
                    hash,
                    ledger,
                    expires_at,
                }
            })
            .into_mut();
        if now_ms >= cell.expires_at {
            (cell.ledger, cell.expires_at) = fresh();
        }
        &mut cell.ledger
    }

    fn count(&self, key: WindowKeyRef<'_>, sequence: u64, now_ms: u64) -> u64 {
        self.get(key, sequence)
            .filter(|c| now_ms < c.expires_at)
            .map_or(0, |c| c.ledger.count())
    }

    fn len(&self) -> usize {
        self.tables.iter().map(HashTable::len).sum()
    }
}

impl Ledgers for Cells {
    fn ledger(&mut self, key: WindowKeyRef<'_>, sequence: u64, now_ms: u64) -> &mut CellLedger {
        Cells::ledger(self, key, sequence, now_ms)
    }
}

/// Ledgers per `(window key, sequence)`.
#[derive(Debug, Default)]
pub struct MemoryOrigin {
    cells: Mutex<Cells>,
}

impl MemoryOrigin {
    /// An empty origin.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cells> {
        // Every update leaves the ledgers consistent, so a lock poisoned by a panicking holder
        // is still safe to use.
        self.cells.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn read(&self, cells: &[CellRead<'_>], now_ms: u64) -> Vec<u64> {
        let state = self.lock();
        cells
            .iter()
            .map(|(key, sequence)| state.count(*key, *sequence, now_ms))
            .collect()
    }

    pub(crate) fn replay(
        &self,
        instance: &str,
        cells: &[CellUsed<'_>],
        now_ms: u64,
        lease_ms: u64,
    ) -> Vec<Replayed> {
        let mut state = self.lock();
        let until = lease::reserved_until(now_ms, lease_ms);
        cells
            .iter()
            .map(|c| {
                let l = state.ledger(c.key, c.sequence, now_ms);
                l.merge_own(instance, c.used);
                l.undo(instance, c.undo_from);
                if c.release > 0 {
                    l.release(instance, c.release);
                }
                let renewed = if c.renew > 0 {
                    l.renew(instance, c.renew, now_ms, until)
                } else {
                    0
                };
                Replayed {
                    count: l.count(),
                    renewed,
                }
            })
            .collect()
    }

    pub(crate) fn decide(
        &self,
        instance: &str,
        limits: &[DecideLimit<'_>],
        now_ms: u64,
        lease_ms: u64,
    ) -> DecideAnswer {
        ledger::decide(&mut *self.lock(), instance, limits, now_ms, lease_ms)
    }

    /// Drops expired cells; returns how many, and where the next step goes on (`None`: the
    /// last subtable's end).
    ///
    /// Looks at up to `max` buckets of one subtable from `from` on, under the lock for those
    /// only (a million cells take tens of milliseconds to walk, and every origin decision
    /// waits on this lock). A subtable that grew between two steps has moved its cells: some
    /// are looked at twice, some wait for the next pass, which a purge can afford.
    pub fn purge_expired(
        &self,
        now_ms: u64,
        from: PurgeCursor,
        max: usize,
    ) -> (usize, Option<PurgeCursor>) {
        let mut state = self.lock();
        let Some(table) = state.tables.get_mut(from.table) else {
            return (0, None);
        };
        let buckets = table.num_buckets();
        let end = from.bucket.saturating_add(max).min(buckets);
        let mut dropped = 0;
        for i in from.bucket..end {
            if let Ok(cell) = table.get_bucket_entry(i)
                && now_ms >= cell.get().expires_at
            {
                cell.remove();
                dropped += 1;
            }
        }
        let next = if end < buckets {
            Some(PurgeCursor {
                table: from.table,
                bucket: end,
            })
        } else {
            (from.table + 1 < SUBTABLES).then_some(PurgeCursor {
                table: from.table + 1,
                bucket: 0,
            })
        };
        (dropped, next)
    }

    /// Cells held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no cell is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_core::WindowDuration;

    /// Cells spread over the subtables, so none grows (and moves its cells) with all of them.
    #[test]
    fn cells_spread_over_the_subtables() {
        let mut cells = Cells::default();
        let d = WindowDuration::from_ms(60_000).unwrap();
        let ids: Vec<String> = (0..6_400).map(|i| format!("k{i}")).collect();
        for id in &ids {
            let key = WindowKeyRef::new("ws", "ns", id, d).unwrap();
            cells.ledger(key, 1, 0).pass("e", 1);
            cells.ledger(key, 2, 0).pass("e", 2);
        }
        assert_eq!(cells.len(), 12_800);
        let largest = cells.tables.iter().map(HashTable::len).max().unwrap();
        let smallest = cells.tables.iter().map(HashTable::len).min().unwrap();
        // 200 a subtable on average.
        assert!(largest < 400 && smallest > 50, "{smallest}..{largest}");
        let key = WindowKeyRef::new("ws", "ns", "k17", d).unwrap();
        assert_eq!((cells.count(key, 1, 0), cells.count(key, 2, 0)), (1, 2));
    }

    /// A purge goes subtable by subtable, bounded steps, and drops exactly what expired.
    #[test]
    fn a_purge_walks_every_subtable_in_bounded_steps() {
        let origin = MemoryOrigin::new();
        let d = WindowDuration::from_ms(60_000).unwrap();
        let ids: Vec<String> = (0..1_000).map(|i| format!("k{i}")).collect();
        {
            let mut cells = origin.lock();
            for (i, id) in ids.iter().enumerate() {
                let key = WindowKeyRef::new("ws", "ns", id, d).unwrap();
                // Half the cells written a window later: they expire a window later.
                cells
                    .ledger(key, 1, if i % 2 == 0 { 0 } else { 60_000 })
                    .pass("e", 1);
            }
        }
        let pass = |now| {
            let (mut dropped, mut steps, mut from) = (0, 0, Some(PurgeCursor::default()));
            while let Some(at) = from {
                let (n, next) = origin.purge_expired(now, at, 4);
                dropped += n;
                steps += 1;
                from = next;
            }
            (dropped, steps)
        };
        let (dropped, steps) = pass(180_000);
        assert_eq!(dropped, 500);
        assert!(steps > SUBTABLES, "{steps} steps of 4 buckets");
        assert_eq!(origin.len(), 500);
        assert_eq!(pass(240_000).0, 500);
        assert!(origin.is_empty());
    }
}
