//! The embedded origin: the region's cells in the gateway's own memory, for a single gateway
//! that needs no Redis. Same contract as Redis: one [`CellLedger`] per cell (own counts per
//! process merged with `max`, live leases), expiring three windows after its first write, and
//! atomic decisions under one lock.

use std::hash::BuildHasher;
use std::sync::Mutex;

use foldhash::fast::RandomState;
use hashbrown::HashTable;
use strata_core::ledger::{CellLedger, Counted, origin_check};
use strata_core::{LimitCheck, WindowKey, WindowKeyRef, decide_all, lease};

use super::{CellRead, CellUsed, DecideAnswer, DecideLimit, DecideOutcome, Replayed};

#[derive(Debug)]
struct Cell {
    key: WindowKey,
    sequence: u64,
    ledger: CellLedger,
    expires_at: u64,
}

impl Cell {
    fn is(&self, key: WindowKeyRef<'_>, sequence: u64) -> bool {
        self.sequence == sequence && self.key.matches(key)
    }
}

/// Where `(key, sequence)` hashes, for a lookup by the borrowed key and for a held cell alike.
fn hash(hasher: &RandomState, key: WindowKeyRef<'_>, sequence: u64) -> u64 {
    hasher.hash_one((key, sequence))
}

/// Ledgers per `(window key, sequence)`, found by the borrowed key: a replay or a read of a
/// cell already held copies no key (only a cell's first write does).
#[derive(Debug, Default)]
struct Cells {
    table: HashTable<Cell>,
    hasher: RandomState,
}

impl Cells {
    fn get(&self, key: WindowKeyRef<'_>, sequence: u64) -> Option<&Cell> {
        self.table
            .find(hash(&self.hasher, key, sequence), |c| c.is(key, sequence))
    }

    /// The live ledger of a cell, created (or started again, if expired) on first use.
    fn ledger(&mut self, key: WindowKeyRef<'_>, sequence: u64, now_ms: u64) -> &mut CellLedger {
        let ttl = key.duration().as_ms().saturating_mul(3);
        let fresh = || (CellLedger::default(), now_ms.saturating_add(ttl));
        let hasher = &self.hasher;
        let cell = self
            .table
            .entry(
                hash(hasher, key, sequence),
                |c| c.is(key, sequence),
                |c| hash(hasher, c.key.as_ref(), c.sequence),
            )
            .or_insert_with(|| {
                let (ledger, expires_at) = fresh();
                Cell {
                    key: key.to_owned_key(),
                    sequence,
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
        let mut state = self.lock();
        let mut mine_leases = Vec::with_capacity(limits.len());
        let checks: Vec<LimitCheck> = limits
            .iter()
            .map(|l| {
                let key = l.key;
                let sequence = key.duration().sequence(now_ms);
                let current = state.ledger(key, sequence, now_ms);
                current.merge_own(instance, l.used[0]);
                current.undo(instance, l.undo_from);
                current.raise(l.floor[0]);
                if l.release > 0 {
                    current.release(instance, l.release);
                }
                let prev = sequence.saturating_sub(1);
                let mut previous = std::mem::take(state.ledger(key, prev, now_ms));
                previous.merge_own(instance, l.used[1]);
                previous.raise(l.floor[1]);
                let current = state.ledger(key, sequence, now_ms);
                let (check, mine) = origin_check(
                    current,
                    &mut previous,
                    instance,
                    l.global,
                    l.key.duration(),
                    l.limit,
                    l.cost,
                    now_ms,
                );
                *state.ledger(key, prev, now_ms) = previous;
                mine_leases.push(mine);
                check
            })
            .collect();
        let multi = decide_all(&checks, now_ms, |i, j| {
            limits.get(i).map(|l| l.key) == limits.get(j).map(|l| l.key)
        });
        let until = lease::reserved_until(now_ms, lease_ms);
        let outcomes = limits
            .iter()
            .zip(&multi.decisions)
            .zip(&mine_leases)
            .map(|((l, decision), mine)| {
                let sequence = l.key.duration().sequence(now_ms);
                let previous = state.count(l.key, sequence.saturating_sub(1), now_ms);
                let current = state.ledger(l.key, sequence, now_ms);
                let (mut granted, mut lease_id) = (0, 0);
                if multi.success {
                    current.add(l.cost);
                    // The caller's live lease is raised, not added to: what it held is free.
                    let available = decision.remaining.saturating_add(*mine);
                    let holders = current.holders(instance, now_ms);
                    let grant = lease::grant(l.want, available, l.limit, holders);
                    (granted, lease_id) = current.lease(instance, grant, now_ms, until);
                    current.record(
                        instance,
                        Counted {
                            call: l.call,
                            cost: l.cost,
                            lease_id,
                        },
                    );
                }
                DecideOutcome {
                    decision: *decision,
                    sequence,
                    current: current.count(),
                    previous,
                    used: current.own(instance),
                    lease: granted,
                    lease_id,
                }
            })
            .collect();
        DecideAnswer {
            success: multi.success,
            limits: outcomes,
        }
    }

    /// Drops expired cells; returns how many.
    pub fn purge_expired(&self, now_ms: u64) -> usize {
        let mut state = self.lock();
        let before = state.table.len();
        state.table.retain(|c| now_ms < c.expires_at);
        before - state.table.len()
    }

    /// Cells held.
    pub fn len(&self) -> usize {
        self.lock().table.len()
    }

    /// Whether no cell is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
