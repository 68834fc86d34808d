//! The embedded origin: regional counts in the gateway's own memory, for a single gateway
//! that needs no Redis. Same contract as Redis: counts per cell expiring three windows after
//! the first write, atomic decisions (under one lock), and the processes seen per key.

use std::collections::HashMap;
use std::sync::Mutex;

use strata_core::{LimitCheck, WindowKey, decide_all};

use super::{
    CellIncrement, CellRead, DecideAnswer, DecideLimit, DecideOutcome, Peers, peers_with_prior,
};

#[derive(Debug, Clone, Copy)]
struct Count {
    value: u64,
    expires_at: u64,
}

#[derive(Debug, Default)]
struct State {
    cells: HashMap<(WindowKey, u64), Count>,
    peers: HashMap<WindowKey, Peers>,
    active: Peers,
}

/// Counts per `(window key, sequence)`, and who was seen on each key.
#[derive(Debug, Default)]
pub struct MemoryOrigin {
    state: Mutex<State>,
}

impl State {
    fn count(&self, key: &WindowKey, sequence: u64, now_ms: u64) -> u64 {
        self.cells
            .get(&(key.clone(), sequence))
            .filter(|c| now_ms < c.expires_at)
            .map_or(0, |c| c.value)
    }

    fn add(&mut self, key: &WindowKey, sequence: u64, cost: u64, now_ms: u64) -> u64 {
        let ttl = key.duration().as_ms().saturating_mul(3);
        let fresh = Count {
            value: 0,
            expires_at: now_ms.saturating_add(ttl),
        };
        let entry = self.cells.entry((key.clone(), sequence)).or_insert(fresh);
        if now_ms >= entry.expires_at {
            *entry = fresh;
        }
        entry.value = entry.value.saturating_add(cost);
        entry.value
    }

    fn seen(&mut self, key: &WindowKey, instance: Option<&str>, now_ms: u64) -> u32 {
        let Some(instance) = instance else {
            return self.peers.get(key).map_or(1, |p| p.count(now_ms));
        };
        self.active.see(instance, now_ms);
        let prior = self.active.count(now_ms);
        let peers = self.peers.entry(key.clone()).or_default();
        peers.see(instance, now_ms);
        peers_with_prior(peers.count(now_ms), peers.young(now_ms), prior)
    }
}

impl MemoryOrigin {
    /// An empty origin.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every update is a handful of assignments that leave the maps consistent, so a lock
        // poisoned by a panicking holder is still safe to use.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn read(
        &self,
        instance: Option<&str>,
        cells: &[CellRead<'_>],
        now_ms: u64,
    ) -> Vec<(u64, u32)> {
        let mut state = self.lock();
        cells
            .iter()
            .map(|(key, sequence)| {
                let key = key.to_owned_key();
                (
                    state.count(&key, *sequence, now_ms),
                    state.seen(&key, instance, now_ms),
                )
            })
            .collect()
    }

    pub(crate) fn replay(
        &self,
        instance: Option<&str>,
        cells: &[CellIncrement<'_>],
        now_ms: u64,
    ) -> Vec<(u64, u32)> {
        let mut state = self.lock();
        cells
            .iter()
            .map(|c| {
                let key = c.key.to_owned_key();
                let count = state.add(&key, c.sequence, c.cost, now_ms);
                (count, state.seen(&key, instance, now_ms))
            })
            .collect()
    }

    pub(crate) fn decide(
        &self,
        instance: &str,
        limits: &[DecideLimit<'_>],
        now_ms: u64,
    ) -> DecideAnswer {
        let mut state = self.lock();
        let keys: Vec<WindowKey> = limits.iter().map(|l| l.key.to_owned_key()).collect();
        let checks: Vec<LimitCheck> = limits
            .iter()
            .zip(&keys)
            .map(|(l, key)| {
                let sequence = l.key.duration().sequence(now_ms);
                let current = state.count(key, sequence, now_ms);
                let previous = state.count(key, sequence.saturating_sub(1), now_ms);
                l.check(current, previous)
            })
            .collect();
        let multi = decide_all(&checks, now_ms, |i, j| keys.get(i) == keys.get(j));
        if multi.success {
            for (l, key) in limits.iter().zip(&keys) {
                state.add(key, l.key.duration().sequence(now_ms), l.cost, now_ms);
            }
        }
        let outcomes = limits
            .iter()
            .zip(&keys)
            .zip(&multi.decisions)
            .map(|((l, key), decision)| {
                let sequence = l.key.duration().sequence(now_ms);
                DecideOutcome {
                    decision: *decision,
                    sequence,
                    current: state.count(key, sequence, now_ms),
                    previous: state.count(key, sequence.saturating_sub(1), now_ms),
                    peers: state.seen(key, Some(instance), now_ms),
                }
            })
            .collect();
        DecideAnswer {
            success: multi.success,
            limits: outcomes,
        }
    }

    /// Drops expired cells and forgotten peers; returns how many cells.
    pub fn purge_expired(&self, now_ms: u64) -> usize {
        let mut state = self.lock();
        let before = state.cells.len();
        state.cells.retain(|_, c| now_ms < c.expires_at);
        state
            .peers
            .retain(|_, p| p.count(now_ms) > 0 && !p.is_empty(now_ms));
        before - state.cells.len()
    }

    /// Cells held.
    pub fn len(&self) -> usize {
        self.lock().cells.len()
    }

    /// Whether no cell is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
