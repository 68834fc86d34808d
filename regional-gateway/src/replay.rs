//! Replay of accepted requests to the regional origin: accepted cost is summed per cell in a
//! bounded queue and sent in batches every replay interval; answers (each cell's count after
//! the increment) merge back into local memory and keep hot cells fresh. A failed batch goes
//! back into the queue while it has room; what does not fit is counted and logged, never
//! silently lost.

use std::collections::HashMap;
use std::sync::Mutex;

use strata_core::WindowKey;
use strata_core::wire::MAX_BATCH;

/// One cell's accepted cost waiting for replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    /// The window key.
    pub key: WindowKey,
    /// The window's sequence.
    pub sequence: u64,
    /// Cost accepted since the last replay.
    pub cost: u64,
    /// The latest limit it was accepted under (the publish floor follows it).
    pub limit: u64,
}

/// The bounded queue of cells to replay.
#[derive(Debug)]
pub struct ReplayQueue {
    cells: Mutex<HashMap<(WindowKey, u64), (u64, u64)>>,
    max_cells: usize,
}

impl ReplayQueue {
    /// A queue holding at most `max_cells` distinct cells.
    pub fn new(max_cells: usize) -> Self {
        Self {
            cells: Mutex::new(HashMap::new()),
            max_cells,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(WindowKey, u64), (u64, u64)>> {
        self.cells.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds accepted cost to a cell. Returns false if the queue is full and the cell is not
    /// already in it (the caller counts the drop).
    pub fn push(&self, key: &WindowKey, sequence: u64, cost: u64, limit: u64) -> bool {
        let mut cells = self.lock();
        let full = cells.len() >= self.max_cells;
        match cells.get_mut(&(key.clone(), sequence)) {
            Some((total, latest)) => {
                *total = total.saturating_add(cost);
                *latest = limit;
                true
            }
            None if full => false,
            None => {
                cells.insert((key.clone(), sequence), (cost, limit));
                true
            }
        }
    }

    /// Takes up to one batch (`MAX_BATCH` cells) out of the queue.
    pub fn take_batch(&self) -> Vec<Pending> {
        let mut cells = self.lock();
        let keys: Vec<(WindowKey, u64)> = cells.keys().take(MAX_BATCH).cloned().collect();
        keys.into_iter()
            .filter_map(|k| {
                let (cost, limit) = cells.remove(&k)?;
                Some(Pending {
                    key: k.0,
                    sequence: k.1,
                    cost,
                    limit,
                })
            })
            .collect()
    }

    /// Puts a failed batch back. Returns the cost that did not fit (to be counted as dropped).
    pub fn restore(&self, batch: Vec<Pending>) -> u64 {
        let mut dropped = 0;
        for p in batch {
            if !self.push(&p.key, p.sequence, p.cost, p.limit) {
                dropped += p.cost;
            }
        }
        dropped
    }

    /// Accepted cost of one cell still waiting (not yet known to the origin).
    pub fn pending(&self, key: &WindowKey, sequence: u64) -> u64 {
        self.lock().get(&(key.clone(), sequence)).map_or(0, |p| p.0)
    }

    /// Cells waiting.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_core::WindowDuration;

    fn key(id: &str) -> WindowKey {
        WindowKey::new("ws", "ns", id, WindowDuration::from_ms(1_000).unwrap()).unwrap()
    }

    #[test]
    fn costs_of_one_cell_are_summed() {
        let q = ReplayQueue::new(10);
        assert!(q.push(&key("a"), 5, 1, 10));
        assert!(q.push(&key("a"), 5, 2, 10));
        assert!(q.push(&key("a"), 6, 1, 10));
        let mut batch = q.take_batch();
        batch.sort_by_key(|p| p.sequence);
        assert_eq!(batch.len(), 2);
        assert_eq!(batch[0].cost, 3);
        assert!(q.is_empty());
    }

    #[test]
    fn a_full_queue_refuses_new_cells_but_still_sums_known_ones() {
        let q = ReplayQueue::new(1);
        assert!(q.push(&key("a"), 5, 1, 10));
        assert!(!q.push(&key("b"), 5, 1, 10));
        assert!(q.push(&key("a"), 5, 1, 10));
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn a_failed_batch_goes_back_and_what_does_not_fit_is_reported() {
        let q = ReplayQueue::new(2);
        q.push(&key("a"), 5, 3, 10);
        q.push(&key("b"), 5, 4, 10);
        let batch = q.take_batch();
        q.push(&key("c"), 5, 1, 10);
        let dropped = q.restore(batch);
        assert_eq!(q.len(), 2);
        assert!(
            dropped == 3 || dropped == 4,
            "one of a or b did not fit: {dropped}"
        );
    }
}
