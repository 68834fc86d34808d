//! The gateway's side of the global layer: its view of the region's counts (fed by every origin
//! answer, native or for an edge), flushed to the global table by the publish policy, and the
//! imported components (own and foreign) from each sync, applied to local memory and to every
//! origin answer the gateway gives.

use std::sync::Mutex;
use std::sync::atomic::Ordering;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use strata_core::{CounterTable, Counts, PublishPolicy, Region, TableConfig, WindowKeyRef};

use super::store::{STALE_FLUSH_MS, Store, StoreError, SyncRead};
use crate::local::LocalTables;
use crate::steps::in_steps;

/// Slots of the region view one flush step looks through (a few hundred microseconds).
pub const FLUSH_SCAN_STEP: usize = 16_384;

/// When a sync reads every row and when only what changed: every row on the first sync and
/// then every `full_every_ms` (the gateway's clock), a repair for a key the view evicted while
/// no region wrote it again; otherwise the cells with a row stamped after the cursor the last
/// read returned ([`Store::sync_cells`] says why that misses no flush, however late it
/// commits). A read that returned nothing moves nothing: the next looks from the same point.
/// Every [`STALE_FLUSH_MS`] a sync also deletes the registrations of flushes that died, which
/// would otherwise hold every cursor below them.
#[derive(Clone, Copy, Debug)]
pub struct SyncPlan {
    full_every_ms: u64,
    /// Where the next read of changes starts (after).
    cursor: Option<u64>,
    /// The gateway's clock when the last full read began.
    last_full: Option<u64>,
    /// The gateway's clock when stale registrations were last deleted.
    last_clear: Option<u64>,
}

impl SyncPlan {
    /// A plan whose first read is full.
    pub const fn new(full_every_ms: u64) -> Self {
        Self {
            full_every_ms,
            cursor: None,
            last_full: None,
            last_clear: None,
        }
    }

    /// What a sync beginning at `now_ms` (the gateway's clock) reads.
    pub fn next(&self, now_ms: u64) -> SyncRead {
        match (self.cursor, self.last_full) {
            (Some(cursor), Some(full)) if now_ms.saturating_sub(full) < self.full_every_ms => {
                SyncRead::After(cursor)
            }
            _ => SyncRead::Full,
        }
    }

    /// Records a read that began at `began_ms` (the gateway's clock) and succeeded, with the
    /// cursor it returned (none: it returned no row). The cursor only moves on: a later read's
    /// may be lower (a flush registered after the last read), never needed lower.
    pub fn done(&mut self, read: SyncRead, began_ms: u64, cursor: Option<u64>) {
        if let Some(c) = cursor {
            self.cursor = Some(self.cursor.map_or(c, |r| r.max(c)));
        }
        if read == SyncRead::Full {
            self.last_full = Some(began_ms);
        }
    }

    /// Whether a sync at `now_ms` should delete stale registrations (then it is recorded).
    pub fn clear_due(&mut self, now_ms: u64) -> bool {
        let due = self
            .last_clear
            .is_none_or(|at| now_ms.saturating_sub(at) >= STALE_FLUSH_MS);
        if due {
            self.last_clear = Some(now_ms);
        }
        due
    }
}

/// Counters of the global layer, exported as `strata_global_*`.
#[derive(Debug, Default)]
pub struct GlobalMetrics {
    /// Flush statements that succeeded.
    pub writes: Counter,
    /// Flushes that failed (retried on the next tick).
    pub write_errors: Counter,
    /// Rows written.
    pub rows_written: Counter,
    /// Sync rows applied.
    pub sync_rows_applied: Counter,
    /// Syncs that succeeded.
    pub syncs: Counter,
    /// Syncs that failed.
    pub sync_errors: Counter,
    /// Syncs that read every live row (the others read what changed).
    pub full_syncs: Counter,
    /// Seconds spent in syncs that succeeded (with `syncs`, their mean).
    pub sync_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    /// Local entries created by a sync (keys this gateway had not seen).
    pub entries_created: Counter,
    /// Rows returned by the last sync.
    pub rows_last_poll: Gauge,
    unpublished_dropped: Counter,
    breaker_open: Gauge,
    regions: Gauge,
    alone: Gauge,
}

/// The region's counts as this gateway knows them, and the imported components.
#[derive(Debug)]
pub struct Global {
    /// The global table.
    pub store: Store,
    region: Region,
    policy: PublishPolicy,
    view: Mutex<CounterTable>,
    /// Counters.
    pub metrics: GlobalMetrics,
    /// A sick database fails fast instead of stalling every tick on its timeout.
    breaker: crate::breaker::Breaker,
    /// Woken when a cell becomes worth publishing before the next tick
    /// ([`PublishPolicy::publish_early`]); the flush loop waits on it.
    pub publish_soon: tokio::sync::Notify,
    /// Regions seen publishing lately (at least this one): the floor is divided among them.
    regions: std::sync::atomic::AtomicU64,
    /// How many announcements in a row found no other region live: one is not enough to
    /// call the region alone, as a region that started beside it may not have announced yet.
    alone_streak: std::sync::atomic::AtomicU32,
    /// What the next sync reads.
    plan: Mutex<SyncPlan>,
}

/// Whether cell `sequence` of `state` should be written before the flush loop's next tick.
fn wants_early(policy: PublishPolicy, state: &strata_core::WindowState, sequence: u64) -> bool {
    state
        .cell(sequence)
        .is_some_and(|c| policy.publish_early(c, state.limit()))
}

/// Merges the origin's count of cell `sequence` into the view's state and returns the cell's
/// counts as the gateway answers them: the origin's regional count as it came, and the imported
/// global. Not the view's regional count, the highest any answer brought: an answer pairs its
/// count with the caller's own count the origin held then (`used`), from which the caller
/// reckons the passes the origin had not heard of; a higher count from a later answer (another
/// call on the key, in flight at once) would count those passes twice, and the caller would
/// deny until the window ends. The origin is floored at the region's published count itself.
fn answered(state: &mut strata_core::WindowState, sequence: u64, regional: u64) -> Counts {
    state.merge_counts(
        sequence,
        Counts {
            regional,
            global: 0,
        },
    );
    let imported = state.cell(sequence).map(|c| c.counts()).unwrap_or_default();
    Counts {
        regional,
        global: imported.global,
    }
}

impl Global {
    /// A layer over `store` for `region`, holding at most `capacity` window keys in its view,
    /// whose syncs read every row every `full_sync_every` and only what changed in between.
    pub fn new(
        store: Store,
        region: Region,
        policy: PublishPolicy,
        capacity: usize,
        full_sync_every: std::time::Duration,
    ) -> Self {
        Self {
            store,
            region,
            policy,
            view: Mutex::new(CounterTable::new(
                TableConfig {
                    capacity,
                    keep_unpublished: true,
                    renew_leases: false,
                    // One table for every key of the region: growing its index at half a
                    // million keys would hold the view's lock for milliseconds.
                    presize_index: true,
                    ..TableConfig::default()
                },
                rand::random(),
            )),
            metrics: GlobalMetrics::default(),
            breaker: crate::breaker::Breaker::default(),
            publish_soon: tokio::sync::Notify::new(),
            regions: std::sync::atomic::AtomicU64::new(1),
            alone_streak: std::sync::atomic::AtomicU32::new(0),
            plan: Mutex::new(SyncPlan::new(
                u64::try_from(full_sync_every.as_millis()).unwrap_or(u64::MAX),
            )),
        }
    }

    /// The policy this region publishes by now: the floor shared by the live regions.
    pub fn policy(&self) -> PublishPolicy {
        self.policy.shared_by(self.regions.load(Ordering::Relaxed))
    }

    /// Regions seen publishing lately, this one included.
    pub fn regions(&self) -> u64 {
        self.regions.load(Ordering::Relaxed)
    }

    /// Says this region publishes, and learns how many regions did within `live_ms`.
    pub async fn announce(&self, now_ms: u64, live_ms: u64) -> Result<u64, StoreError> {
        let since = now_ms.saturating_sub(live_ms);
        let regions = self
            .guarded(self.store.announce(&self.region, now_ms, since))
            .await?;
        self.regions.store(regions, Ordering::Relaxed);
        if regions <= 1 {
            self.alone_streak.fetch_add(1, Ordering::Relaxed);
        } else {
            self.alone_streak.store(0, Ordering::Relaxed);
        }
        Ok(regions)
    }

    /// Whether no other region imports this one's counts: the last two announcements found
    /// none live (until then, and whenever one is, the counts are wanted elsewhere).
    pub fn alone(&self) -> bool {
        self.alone_streak.load(Ordering::Relaxed) >= 2
    }

    /// Whether the database breaker refuses calls.
    pub fn breaker_open(&self) -> bool {
        self.breaker.is_open(std::time::Instant::now())
    }

    async fn guarded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        if !self.breaker.allow(std::time::Instant::now()) {
            return Err(StoreError::Query("circuit breaker open".into()));
        }
        let result = call.await;
        self.breaker
            .record(result.is_ok(), std::time::Instant::now());
        result
    }

    fn view(&self) -> std::sync::MutexGuard<'_, CounterTable> {
        self.view.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn sync_plan(&self) -> std::sync::MutexGuard<'_, SyncPlan> {
        self.plan.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records what the regional origin answered for cells (and the limit, if the answer
    /// came with one): the region's count, the thing this gateway publishes. Returns each
    /// cell's counts as the gateway answers them: the regional count never below this
    /// region's own published component, and the other regions' sum as `global`. One lock of
    /// the view for all of them (a replay or read batch holds up to a thousand cells).
    pub fn record_cells<'k>(
        &self,
        cells: impl IntoIterator<Item = (WindowKeyRef<'k>, u64, u64, Option<u64>)>,
        now_ms: u64,
    ) -> Vec<Counts> {
        let mut view = self.view();
        let policy = self.policy();
        let mut early = false;
        let counts = cells
            .into_iter()
            .map(|(key, sequence, regional, limit)| {
                let state = view.entry(key, now_ms);
                state.roll(key.duration(), now_ms);
                if let Some(limit) = limit {
                    state.observe_limit(limit);
                }
                let counts = answered(state, sequence, regional);
                early |= wants_early(policy, state, sequence);
                counts
            })
            .collect();
        if early {
            self.publish_soon.notify_one();
        }
        counts
    }

    /// [`record_cells`](Self::record_cells) for both cells of an origin decision, in one lookup:
    /// the current one `sequence` (with the request's limit) and the one before.
    pub fn record(
        &self,
        key: WindowKeyRef<'_>,
        sequence: u64,
        regional: [u64; 2],
        limit: u64,
        now_ms: u64,
    ) -> (Counts, Counts) {
        let mut view = self.view();
        let state = view.entry(key, now_ms);
        state.roll(key.duration(), now_ms);
        state.observe_limit(limit);
        let counts = (
            answered(state, sequence, regional[0]),
            answered(state, sequence.saturating_sub(1), regional[1]),
        );
        if wants_early(self.policy(), state, sequence) {
            self.publish_soon.notify_one();
        }
        counts
    }

    /// What an origin decision adds to its own counts of window `sequence` and the one
    /// before, in one look at the view: the other regions' imported counts, and this region's
    /// published component (what the global table holds for it: a floor for the origin). Not
    /// the view's regional count: an origin answer can carry a count the origin corrects later
    /// (a rollback, an undone call), and raising the origin to it would count that again.
    pub fn imported(&self, key: WindowKeyRef<'_>, sequence: u64) -> ([u64; 2], [u64; 2]) {
        let view = self.view();
        let cell = |seq| {
            view.get(key)
                .and_then(|s| s.cell(seq).map(|c| (c.counts().global, c.last_flushed())))
                .unwrap_or_default()
        };
        let (cur, prev) = (cell(sequence), cell(sequence.saturating_sub(1)));
        ([cur.0, prev.0], [cur.1, prev.1])
    }

    /// Drops the view's entries whose cells expired (the global table expires their rows at
    /// the same time), a bounded scan; returns how many.
    pub fn purge_expired(&self, now_ms: u64, max_scan: usize) -> usize {
        self.view().purge_expired(now_ms, max_scan)
    }

    /// Window keys the view holds.
    pub fn view_len(&self) -> usize {
        self.view().len()
    }

    /// Writes the cells worth publishing; commits them as flushed only once written. The view
    /// is looked through in steps of [`FLUSH_SCAN_STEP`] slots, locked once per step with a
    /// yield between two: at a million keys one walk of every slot under the lock held the
    /// worker long enough to double a gateway's p99.
    pub async fn flush_once(&self, now_ms: u64) -> Result<u64, StoreError> {
        let policy = self.policy();
        let mut rows = Vec::new();
        in_steps(0, |at| {
            self.view()
                .flush_candidates_from(&policy, now_ms, at, FLUSH_SCAN_STEP, &mut rows)
        })
        .await;
        strata_core::gcounter::sort_flush_rows(&mut rows);
        if rows.is_empty() {
            return Ok(0);
        }
        match self.guarded(self.store.flush(&self.region, &rows)).await {
            Ok(written) => {
                self.view().commit_flush(&rows);
                self.metrics.writes.inc();
                self.metrics.rows_written.inc_by(written);
                Ok(written)
            }
            Err(e) => {
                self.metrics.write_errors.inc();
                Err(e)
            }
        }
    }

    /// Imports the own and foreign sums of the live cells the plan says (every one, or those
    /// changed since the last sync): into the view (for answers and flushes) and into local
    /// memory (for decisions). Returns the rows applied.
    pub async fn sync_once(&self, local: &LocalTables, now_ms: u64) -> Result<usize, StoreError> {
        let started = std::time::Instant::now();
        if self.sync_plan().clear_due(now_ms) {
            match self.guarded(self.store.clear_stale_flushes()).await {
                Ok(0) => {}
                Ok(n) => tracing::warn!(
                    registrations = n,
                    "deleted the registrations of flushes older than {STALE_FLUSH_MS} ms (a gateway that died mid-flush)"
                ),
                Err(e) => tracing::warn!(error = %e, "could not delete stale flush registrations"),
            }
        }
        let read = self.sync_plan().next(now_ms);
        let rows = match self
            .guarded(self.store.sync_cells(&self.region, now_ms, read))
            .await
        {
            Ok((rows, cursor)) => {
                self.sync_plan().done(read, now_ms, cursor);
                if read == SyncRead::Full {
                    self.metrics.full_syncs.inc();
                }
                self.metrics
                    .sync_seconds
                    .inc_by(started.elapsed().as_secs_f64());
                rows
            }
            Err(e) => {
                self.metrics.sync_errors.inc();
                return Err(e);
            }
        };
        self.metrics
            .rows_last_poll
            .set(i64::try_from(rows.len()).unwrap_or(i64::MAX));
        for r in &rows {
            let key = r.key.as_ref();
            self.view()
                .apply_sync(key, r.sequence, r.own, r.foreign, now_ms);
            let mut table = local.lock(key);
            let before = table.stats().created_by_sync;
            table.apply_sync(key, r.sequence, r.own, r.foreign, now_ms);
            if table.stats().created_by_sync > before {
                self.metrics.entries_created.inc();
            }
        }
        self.metrics.sync_rows_applied.inc_by(rows.len() as u64);
        self.metrics.syncs.inc();
        Ok(rows.len())
    }

    /// Registers the `strata_global_*` metrics.
    pub fn register(&self, r: &mut Registry) {
        let m = &self.metrics;
        for (name, help, counter) in [
            ("writes", "Flush statements that succeeded", &m.writes),
            (
                "write_errors",
                "Flushes that failed and will be retried",
                &m.write_errors,
            ),
            (
                "rows_written",
                "Rows written to the global table",
                &m.rows_written,
            ),
            (
                "sync_rows_applied",
                "Sync rows applied to local memory",
                &m.sync_rows_applied,
            ),
            ("syncs", "Syncs that succeeded", &m.syncs),
            ("sync_errors", "Syncs that failed", &m.sync_errors),
            (
                "full_syncs",
                "Syncs that read every live row (the others read the cells changed since the last)",
                &m.full_syncs,
            ),
            (
                "entries_created",
                "Local entries a sync created for keys not seen here",
                &m.entries_created,
            ),
            (
                "unpublished_dropped",
                "Regional counts the region view evicted before a flush published them (it was full of unpublished keys)",
                &m.unpublished_dropped,
            ),
        ] {
            r.register(format!("strata_global_{name}"), help, counter.clone());
        }
        r.register(
            "strata_global_sync_seconds",
            "Seconds spent in syncs that succeeded (over strata_global_syncs_total: the mean)",
            m.sync_seconds.clone(),
        );
        r.register(
            "strata_global_rows_last_poll",
            "Rows the last sync returned",
            m.rows_last_poll.clone(),
        );
        r.register(
            "strata_global_breaker_open",
            "1 while the database breaker refuses calls",
            m.breaker_open.clone(),
        );
        r.register(
            "strata_global_regions",
            "Regions seen publishing lately, which share the publish floor",
            m.regions.clone(),
        );
        r.register(
            "strata_global_alone",
            "1 while no other region is live (the last two announcements found none): no cell's count is needed elsewhere, so a cell its lease covers waits for the lease's end to be replayed",
            m.alone.clone(),
        );
    }

    /// Copies in the values the view and the breaker own, before a scrape.
    pub fn sample(&self) {
        let m = &self.metrics;
        m.unpublished_dropped
            .inner()
            .store(self.view().stats().unpublished_lost, Ordering::Relaxed);
        m.breaker_open.set(i64::from(self.breaker_open()));
        m.regions
            .set(i64::try_from(self.regions()).unwrap_or(i64::MAX));
        m.alone.set(i64::from(self.alone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers of two calls on one key in flight at once arrive in any order: each carries the
    /// count it came with. Answered with the view's highest instead, the earlier call's answer
    /// paired a later count with its older own count, and the gateway counted the passes between
    /// twice (`concurrency::multi_limit_requests_racing_on_shared_keys_stay_within_every_limit`
    /// admitted as few as 121 of 200 under load).
    #[test]
    fn an_answer_carries_the_origin_count_it_came_with() {
        let d = strata_core::WindowDuration::from_ms(60_000).unwrap();
        let mut state = strata_core::WindowState::new(d, 0);
        let seq = d.sequence(0);
        assert_eq!(
            answered(&mut state, seq, 120).regional,
            120,
            "the later call's"
        );
        assert_eq!(
            answered(&mut state, seq, 100).regional,
            100,
            "the earlier call's"
        );
        let view = state.cell(seq).map(|c| c.counts().regional);
        assert_eq!(
            view,
            Some(120),
            "the view keeps the highest, which the flush publishes"
        );
    }

    #[test]
    fn a_sync_reads_every_row_first_and_each_interval_and_what_changed_between() {
        let mut plan = SyncPlan::new(60_000);
        assert_eq!(plan.next(0), SyncRead::Full, "the first read");
        plan.done(SyncRead::Full, 0, Some(40));
        let next = plan.next(1_000);
        assert_eq!(next, SyncRead::After(40));
        plan.done(next, 1_000, Some(45));
        assert_eq!(
            plan.next(2_000),
            SyncRead::After(45),
            "from the last cursor"
        );
        // A read that found nothing moves nothing; one whose cursor is lower (a flush registered
        // since) does not move it back.
        plan.done(SyncRead::After(45), 2_000, None);
        plan.done(SyncRead::After(45), 3_000, Some(41));
        assert_eq!(plan.next(30_000), SyncRead::After(45));
        assert_eq!(
            plan.next(60_000),
            SyncRead::Full,
            "a full read every full_every_ms"
        );
        plan.done(SyncRead::Full, 60_000, Some(50));
        assert_eq!(plan.next(61_000), SyncRead::After(50));
        // A full read of an empty table: the next is full again (it has no cursor to start from).
        let mut empty = SyncPlan::new(60_000);
        empty.done(SyncRead::Full, 0, None);
        assert_eq!(empty.next(1_000), SyncRead::Full);
        assert_eq!(
            SyncPlan::new(0).next(5),
            SyncRead::Full,
            "0: every sync full"
        );
        // Stale registrations: on the first sync, then once every STALE_FLUSH_MS.
        let mut plan = SyncPlan::new(60_000);
        assert!(plan.clear_due(0));
        assert!(!plan.clear_due(STALE_FLUSH_MS - 1));
        assert!(plan.clear_due(STALE_FLUSH_MS));
    }
}
