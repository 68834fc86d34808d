//! The global table on both dialects, one test body each: SQLite (a temp file) and MariaDB (the
//! shared server, a database of this run's own, dropped afterwards).

use std::time::Duration;

use strata_core::gcounter::{FlushRow, sort_flush_rows};
use strata_core::{Region, WindowDuration, WindowKey};
use strata_gateway::global::{Store, StoreError, SyncRead};

use crate::common;
use common::mariadb::SharedDatabase;

const NOW: u64 = 1_700_000_000_000;

/// A store on a fresh database, and what to drop afterwards.
struct Fresh {
    store: Store,
    drop_db: Option<SharedDatabase>,
}

impl Fresh {
    async fn sqlite() -> Self {
        let path = std::env::temp_dir().join(format!(
            "strata-global-{}-{}.db",
            std::process::id(),
            rand_suffix()
        ));
        let store = Store::connect(
            &format!("sqlite://{}", path.display()),
            Duration::from_secs(5),
        )
        .unwrap();
        Self {
            store,
            drop_db: None,
        }
    }

    async fn mariadb() -> Self {
        let name = format!("strata_test_{}_{}", std::process::id(), rand_suffix());
        let db = SharedDatabase::create(&name).await;
        let store = Store::connect(&db.url(), Duration::from_secs(5)).unwrap();
        Self {
            store,
            drop_db: Some(db),
        }
    }

    async fn done(self) {
        if let Some(db) = self.drop_db {
            db.drop().await;
        }
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    u64::from(t) * 1_000 + N.fetch_add(1, Ordering::Relaxed)
}

fn row(id: &str, count: u64) -> FlushRow {
    let d = WindowDuration::from_ms(60_000).unwrap();
    let sequence = d.sequence(NOW);
    FlushRow {
        key: WindowKey::new("ws", "api", id, d).unwrap(),
        sequence,
        count,
        expires_at: d.expires_at(sequence),
    }
}

macro_rules! on_both_dialects {
    ($($case:ident),* $(,)?) => {$(
        mod $case {
            #[tokio::test]
            async fn sqlite() {
                let f = super::Fresh::sqlite().await;
                super::$case(&f.store).await;
                f.done().await;
            }
            #[tokio::test]
            async fn mariadb() {
                let f = super::Fresh::mariadb().await;
                super::$case(&f.store).await;
                f.done().await;
            }
        }
    )*};
}

on_both_dialects!(
    migrations_apply_once_and_a_newer_schema_refuses,
    regions_see_each_others_components_as_foreign_sums,
    greatest_keeps_the_larger_count,
    concurrent_flushers_of_one_region_converge_without_deadlock,
    cleanup_removes_only_expired_rows,
    keys_differing_in_case_are_distinct_rows,
    keys_are_compared_byte_for_byte,
    large_flushes_go_in_chunks,
    regions_announce_themselves_and_go_stale,
    a_sync_of_changes_reads_every_row_of_the_cells_written_since_and_no_other,
);

async fn migrations_apply_once_and_a_newer_schema_refuses(store: &Store) {
    assert_eq!(
        store.migrate().await.unwrap(),
        usize::try_from(strata_gateway::global::SCHEMA_VERSION).unwrap()
    );
    assert_eq!(store.migrate().await.unwrap(), 0, "idempotent");
    let bump = "INSERT INTO strata_schema_version (version) VALUES (99)";
    match store {
        Store::MySql(p) => sqlx::query(bump).execute(p).await.map(|_| ()).unwrap(),
        Store::Sqlite(p) => sqlx::query(bump).execute(p).await.map(|_| ()).unwrap(),
    }
    let err = store.migrate().await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Newer {
                found: 99,
                supported: strata_gateway::global::SCHEMA_VERSION
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("upgrade strata-gateway"));
}

async fn regions_see_each_others_components_as_foreign_sums(store: &Store) {
    store.migrate().await.unwrap();
    let (eu, us, ap) = (
        Region::new("eu").unwrap(),
        Region::new("us").unwrap(),
        Region::new("ap").unwrap(),
    );
    store
        .flush(&eu, &[row("a", 30), row("b", 5)])
        .await
        .unwrap();
    store.flush(&us, &[row("a", 12)]).await.unwrap();
    let mut seen_by_ap = store.sync(&ap, NOW).await.unwrap();
    seen_by_ap.sort_by(|x, y| x.key.cmp(&y.key));
    assert_eq!(seen_by_ap.len(), 2);
    assert_eq!((seen_by_ap[0].own, seen_by_ap[0].foreign), (0, 42));
    let seen_by_eu = store.sync(&eu, NOW).await.unwrap();
    let a = seen_by_eu
        .iter()
        .find(|r| r.key.as_ref().identifier() == "a")
        .unwrap();
    assert_eq!((a.own, a.foreign), (30, 12), "own and foreign kept apart");
    // Expired cells are not synced.
    let later = WindowDuration::from_ms(60_000)
        .unwrap()
        .expires_at(row("a", 0).sequence);
    assert!(store.sync(&eu, later).await.unwrap().is_empty());
}

async fn greatest_keeps_the_larger_count(store: &Store) {
    store.migrate().await.unwrap();
    let eu = Region::new("eu").unwrap();
    let other = Region::new("other").unwrap();
    for count in [10, 5, 12, 11] {
        store.flush(&eu, &[row("g", count)]).await.unwrap();
    }
    assert_eq!(store.sync(&other, NOW).await.unwrap()[0].foreign, 12);
}

async fn concurrent_flushers_of_one_region_converge_without_deadlock(store: &Store) {
    store.migrate().await.unwrap();
    let eu = Region::new("eu").unwrap();
    let mut a: Vec<FlushRow> = (0..300).map(|i| row(&format!("k{i}"), i)).collect();
    let mut b: Vec<FlushRow> = (0..300).map(|i| row(&format!("k{i}"), 300 - i)).collect();
    sort_flush_rows(&mut a);
    sort_flush_rows(&mut b);
    let (ra, rb) = tokio::join!(store.flush(&eu, &a), store.flush(&eu, &b));
    assert_eq!((ra.unwrap(), rb.unwrap()), (300, 300));
    let rows = store.sync(&eu, NOW).await.unwrap();
    assert_eq!(rows.len(), 300);
    for r in rows {
        let i: u64 = r.key.as_ref().identifier()[1..].parse().unwrap();
        assert_eq!(
            r.own,
            i.max(300 - i),
            "GREATEST kept the larger of the two writers"
        );
    }
}

async fn cleanup_removes_only_expired_rows(store: &Store) {
    store.migrate().await.unwrap();
    let eu = Region::new("eu").unwrap();
    let live = row("live", 1);
    let mut old = row("old", 1);
    old.sequence -= 5;
    old.expires_at = old.key.duration().expires_at(old.sequence);
    let old_rows: Vec<FlushRow> = (0..25)
        .map(|i| FlushRow {
            key: WindowKey::new("ws", "old", &format!("o{i}"), old.key.duration()).unwrap(),
            ..old.clone()
        })
        .collect();
    store.flush(&eu, &old_rows).await.unwrap();
    store.flush(&eu, std::slice::from_ref(&live)).await.unwrap();
    // Batches of 10, at most 2: 20 deleted now, the other 5 on the next run.
    assert_eq!(store.cleanup(NOW, 10, 2).await.unwrap(), 20);
    assert_eq!(store.cleanup(NOW, 10, 2).await.unwrap(), 5);
    assert_eq!(store.cleanup(NOW, 10, 2).await.unwrap(), 0);
    let left = store.sync(&Region::new("x").unwrap(), 0).await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].key, live.key);
}

async fn keys_differing_in_case_are_distinct_rows(store: &Store) {
    store.migrate().await.unwrap();
    let eu = Region::new("eu").unwrap();
    store
        .flush(&eu, &[row("Key", 7), row("key", 3), row("kéy", 1)])
        .await
        .unwrap();
    assert_eq!(store.sync(&eu, NOW).await.unwrap().len(), 3);
}

/// Identifiers are bytes: a trailing space, case, or another Unicode normalisation of the
/// same text is another key (a PAD SPACE collation merged "victim" and "victim ", so one
/// client's use hid behind another's row).
async fn keys_are_compared_byte_for_byte(store: &Store) {
    store.migrate().await.unwrap();
    let eu = Region::new("eu").unwrap();
    let ids = [
        ("victim", 3),
        ("victim ", 10),
        ("victim  ", 2),
        ("Victim", 4),
        ("caf\u{e9}", 5),   // é, composed (NFC)
        ("cafe\u{301}", 6), // e + combining acute (NFD)
    ];
    let mut rows: Vec<FlushRow> = ids.iter().map(|(id, n)| row(id, *n)).collect();
    rows.sort();
    store.flush(&eu, &rows).await.unwrap();
    let synced = store.sync(&eu, NOW).await.unwrap();
    assert_eq!(synced.len(), ids.len(), "{synced:?}");
    for (id, n) in ids {
        let found = synced
            .iter()
            .find(|r| r.key.as_ref().identifier() == id)
            .unwrap_or_else(|| panic!("{id:?} has no row of its own"));
        assert_eq!(found.own, n, "{id:?}");
    }
}

async fn large_flushes_go_in_chunks(store: &Store) {
    store.migrate().await.unwrap();
    let eu = Region::new("eu").unwrap();
    let mut rows: Vec<FlushRow> = (0..2_500)
        .map(|i| row(&format!("c{i:05}"), 1 + i % 7))
        .collect();
    sort_flush_rows(&mut rows);
    assert_eq!(store.flush(&eu, &rows).await.unwrap(), 2_500);
    assert_eq!(store.sync(&eu, NOW).await.unwrap().len(), 2_500);
}

async fn regions_announce_themselves_and_go_stale(store: &Store) {
    store.migrate().await.unwrap();
    let (eu, us, ap) = (
        Region::new("eu").unwrap(),
        Region::new("us").unwrap(),
        Region::new("ap").unwrap(),
    );
    assert_eq!(store.announce(&eu, NOW, NOW - 30_000).await.unwrap(), 1);
    assert_eq!(store.announce(&us, NOW + 1, NOW - 30_000).await.unwrap(), 2);
    // Twice from one region counts once; an older time never lowers a newer one.
    assert_eq!(store.announce(&eu, NOW + 2, NOW - 30_000).await.unwrap(), 2);
    assert_eq!(store.announce(&ap, NOW + 3, NOW - 30_000).await.unwrap(), 3);
    assert_eq!(
        store
            .announce(&us, NOW - 50_000, NOW - 30_000)
            .await
            .unwrap(),
        3
    );
    // 40 s on, the others were last seen more than 30 s before: only the announcer is live.
    assert_eq!(
        store
            .announce(&ap, NOW + 40_000, NOW + 10_000)
            .await
            .unwrap(),
        1
    );
}

/// Waits until the database's clock has moved past `t` (a flush stamped after a read began must
/// not share its millisecond): polled, with a deadline.
async fn clock_past(store: &Store, t: u64) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let now = store.clock_ms().await.unwrap();
        if now > t {
            return now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the database clock stands still"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

async fn a_sync_of_changes_reads_every_row_of_the_cells_written_since_and_no_other(store: &Store) {
    store.migrate().await.unwrap();
    let (eu, us, ap) = (
        Region::new("eu").unwrap(),
        Region::new("us").unwrap(),
        Region::new("ap").unwrap(),
    );
    let wall = stack_now();
    let quiet: Vec<_> = (0..200).map(|i| row(&format!("quiet-{i}"), 3)).collect();
    store.flush(&eu, &quiet).await.unwrap();
    store.flush(&us, &[row("busy", 30)]).await.unwrap();
    let t0 = store.clock_ms().await.unwrap();
    assert!(
        t0.abs_diff(wall) < 60_000,
        "the database clock is Unix ms: {t0} vs {wall}"
    );
    clock_past(store, t0).await;
    assert_eq!(
        store.sync(&ap, NOW).await.unwrap().len(),
        201,
        "a full sync reads every cell"
    );
    assert!(
        store.sync_changed(&ap, NOW, t0).await.unwrap().is_empty(),
        "nothing written since"
    );
    // One region writes one cell: the sync reads that cell, with every region's component.
    store.flush(&eu, &[row("busy", 5)]).await.unwrap();
    let changed = store.sync_changed(&ap, NOW, t0).await.unwrap();
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0].key.as_ref().identifier(), "busy");
    assert_eq!((changed[0].own, changed[0].foreign), (0, 35));
    let by_us = store.sync_changed(&us, NOW, t0).await.unwrap();
    assert_eq!((by_us[0].own, by_us[0].foreign), (30, 5));
    // A write that changes no count still stamps the row: it is read again (harmless: sums
    // merge by maximum).
    let t1 = clock_past(store, store.clock_ms().await.unwrap()).await;
    store.flush(&eu, &[row("quiet-7", 3)]).await.unwrap();
    let changed = store.sync_changed(&ap, NOW, t1 - 1).await.unwrap();
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0].key.as_ref().identifier(), "quiet-7");
    // Expired cells are not read, changed or not.
    let later = WindowDuration::from_ms(60_000)
        .unwrap()
        .expires_at(row("busy", 0).sequence);
    assert!(store.sync_changed(&ap, later, t0).await.unwrap().is_empty());
    // One statement brings the database's clock with the rows (what the next sync reads
    // changes against): at or after the last write, at or before a clock read after it; no
    // clock when no row came back.
    let t2 = clock_past(store, store.clock_ms().await.unwrap()).await;
    store.flush(&us, &[row("busy", 31)]).await.unwrap();
    let (rows, db_now) = store
        .sync_cells(&ap, NOW, SyncRead::Since(t2 - 1))
        .await
        .unwrap();
    let after = store.clock_ms().await.unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert!(
        db_now.is_some_and(|t| t >= t2 && t <= after),
        "{db_now:?} in {t2}..={after}"
    );
    let (none, no_clock) = store
        .sync_cells(&ap, NOW, SyncRead::Since(after + 60_000))
        .await
        .unwrap();
    assert!(
        none.is_empty() && no_clock.is_none(),
        "{none:?} {no_clock:?}"
    );
}

fn stack_now() -> u64 {
    u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}
