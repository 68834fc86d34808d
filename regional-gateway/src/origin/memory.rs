//! The embedded origin: regional counts in the gateway's own memory, for a single gateway
//! that needs no Redis. Same contract as Redis: counts per cell, expiring three windows after
//! the first write.

use std::collections::HashMap;
use std::sync::Mutex;

use strata_core::WindowKey;

use super::{CellIncrement, CellRead};

#[derive(Debug, Clone, Copy)]
struct Count {
    value: u64,
    expires_at: u64,
}

/// Counts per `(window key, sequence)`.
#[derive(Debug, Default)]
pub struct MemoryOrigin {
    cells: Mutex<HashMap<(WindowKey, u64), Count>>,
}

impl MemoryOrigin {
    /// An empty origin.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(WindowKey, u64), Count>> {
        // A panic while holding this lock cannot leave a count half-written (every update is
        // one assignment), so a poisoned lock is still consistent.
        self.cells.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn read(&self, cells: &[CellRead<'_>], now_ms: u64) -> Vec<u64> {
        let map = self.lock();
        cells
            .iter()
            .map(|(key, sequence)| {
                map.get(&(key.to_owned_key(), *sequence))
                    .filter(|c| now_ms < c.expires_at)
                    .map_or(0, |c| c.value)
            })
            .collect()
    }

    pub(crate) fn replay(&self, cells: &[CellIncrement<'_>], now_ms: u64) -> Vec<u64> {
        let mut map = self.lock();
        cells
            .iter()
            .map(|c| {
                let ttl = c.key.duration().as_ms().saturating_mul(3);
                let entry = map
                    .entry((c.key.to_owned_key(), c.sequence))
                    .or_insert(Count {
                        value: 0,
                        expires_at: now_ms.saturating_add(ttl),
                    });
                if now_ms >= entry.expires_at {
                    *entry = Count {
                        value: 0,
                        expires_at: now_ms.saturating_add(ttl),
                    };
                }
                entry.value = entry.value.saturating_add(c.cost);
                entry.value
            })
            .collect()
    }

    /// Drops expired cells; returns how many.
    pub fn purge_expired(&self, now_ms: u64) -> usize {
        let mut map = self.lock();
        let before = map.len();
        map.retain(|_, c| now_ms < c.expires_at);
        before - map.len()
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
