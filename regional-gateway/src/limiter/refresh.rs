//! Refreshing cold and stale cells: one origin read per cell however many requests wait on it
//! (an in-flight map of `OnceCell`s), merged into local memory with the peers it reports.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use strata_core::{Counts, WindowKey, WindowKeyRef};
use tokio::sync::OnceCell;

use super::Limiter;
use crate::metrics::Source;
use crate::origin::OriginError;

/// Both cells' regional counts and the peers on the key.
pub(super) type ReadResult = Result<([u64; 2], u32), OriginError>;
pub(super) type InflightMap = Mutex<HashMap<(WindowKey, u64), Arc<OnceCell<ReadResult>>>>;

/// Removes a finished read from the in-flight map, even if the leading request was dropped.
struct InflightGuard<'a> {
    map: &'a InflightMap,
    key: Option<(WindowKey, u64)>,
    cell: Arc<OnceCell<ReadResult>>,
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.get(&key).is_some_and(|c| Arc::ptr_eq(c, &self.cell)) {
            map.remove(&key);
        }
    }
}

impl Limiter {
    /// Reads both cells of `key` at `sequence` and merges them; requests that need the same
    /// cells meanwhile wait for this read instead of sending their own.
    pub(super) async fn refresh(&self, key: WindowKeyRef<'_>, sequence: u64) -> Source {
        let id = (key.to_owned_key(), sequence);
        let (cell, leader) = {
            let mut map = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            match map.get(&id) {
                Some(cell) => (cell.clone(), false),
                None => {
                    let cell = Arc::new(OnceCell::new());
                    map.insert(id.clone(), cell.clone());
                    (cell, true)
                }
            }
        };
        let _guard = InflightGuard {
            map: &self.inflight,
            key: leader.then_some(id),
            cell: cell.clone(),
        };
        if !leader {
            self.metrics.read_coalesced();
        }
        let cells = [(key, sequence), (key, sequence.saturating_sub(1))];
        let result = cell
            .get_or_init(|| async {
                let read = self
                    .origin
                    .read(Some(&self.instance), &cells, self.clock.now_ms())
                    .await?;
                let at = |i: usize| read.get(i).copied().unwrap_or((0, 1));
                Ok(([at(0).0, at(1).0], at(0).1))
            })
            .await
            .clone();
        let now = self.clock.now_ms();
        let merged = result.as_ref().map(|(counts, peers)| {
            (
                [
                    self.merged(key, sequence, counts[0], now),
                    self.merged(key, sequence.saturating_sub(1), counts[1], now),
                ],
                *peers,
            )
        });
        let mut table = self.local.lock(key);
        match merged {
            Ok((counts, peers)) => {
                table.observe_peers(key, peers, now);
                for ((_, seq), counts) in cells.iter().zip(counts) {
                    table.apply_origin(key, *seq, counts, now);
                }
                Source::Origin
            }
            Err(_) => {
                table.fail_window(key, sequence, now);
                Source::Fallback
            }
        }
    }

    /// A read answer for one cell, recorded in the region's view (what the flush publishes)
    /// and returned with the imported components, as every origin answer is.
    fn merged(&self, key: WindowKeyRef<'_>, sequence: u64, regional: u64, now: u64) -> Counts {
        self.global.observe(key, sequence, regional, None, now);
        self.global.counts(key, sequence, regional)
    }

    /// One origin read for the cells of several keys (a multi-limit request).
    pub(super) async fn refresh_many(&self, reads: &[(WindowKeyRef<'_>, u64)]) -> Source {
        let cells: Vec<(WindowKeyRef<'_>, u64)> = reads
            .iter()
            .flat_map(|&(key, seq)| [(key, seq), (key, seq.saturating_sub(1))])
            .collect();
        let result = self
            .origin
            .read(Some(&self.instance), &cells, self.clock.now_ms())
            .await;
        let now = self.clock.now_ms();
        match result {
            Ok(counts) => {
                for (&(key, seq), (regional, peers)) in cells.iter().zip(counts) {
                    let counts = self.merged(key, seq, regional, now);
                    let mut table = self.local.lock(key);
                    table.observe_peers(key, peers, now);
                    table.apply_origin(key, seq, counts, now);
                }
                Source::Origin
            }
            Err(_) => {
                for &(key, sequence) in reads {
                    self.local.lock(key).fail_window(key, sequence, now);
                }
                Source::Fallback
            }
        }
    }
}
