//! The global table on both dialects, one test body each: SQLite (a temp file) and MariaDB (the
//! shared server, a database of this run's own, dropped afterwards).

use std::time::Duration;

use strata_core::gcounter::{FlushRow, sort_flush_rows};
use strata_core::{Region, WindowDuration, WindowKey};
use strata_gateway::global::{Store, StoreError, SyncRead, SyncRow};

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

/// The cells `region` reads with a sync of changes after `cursor`.
async fn changed(store: &Store, region: &Region, now: u64, cursor: u64) -> Vec<SyncRow> {
    store
        .sync_cells(region, now, SyncRead::After(cursor))
        .await
        .unwrap()
        .0
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
    let (all, c0) = store.sync_cells(&ap, NOW, SyncRead::Full).await.unwrap();
    assert_eq!(all.len(), 201, "a full sync reads every cell");
    assert_eq!(c0, Some(2), "two flushes, two stamps, none in flight");
    let c0 = 2;
    assert!(
        changed(store, &ap, NOW, c0).await.is_empty(),
        "nothing written since"
    );
    // One region writes one cell: the sync reads that cell, with every region's component.
    store.flush(&eu, &[row("busy", 5)]).await.unwrap();
    let (rows, c1) = store
        .sync_cells(&ap, NOW, SyncRead::After(c0))
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].key.as_ref().identifier(), "busy");
    assert_eq!((rows[0].own, rows[0].foreign), (0, 35));
    assert_eq!(c1, Some(c0 + 1), "the cursor moves to the stamp read");
    let by_us = changed(store, &us, NOW, c0).await;
    assert_eq!((by_us[0].own, by_us[0].foreign), (30, 5));
    // A write that changes no count still stamps the row: it is read again (harmless: sums
    // merge by maximum).
    store.flush(&eu, &[row("quiet-7", 3)]).await.unwrap();
    let rows = changed(store, &ap, NOW, c0 + 1).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].key.as_ref().identifier(), "quiet-7");
    // Expired cells are not read, changed or not.
    let later = WindowDuration::from_ms(60_000)
        .unwrap()
        .expires_at(row("busy", 0).sequence);
    assert!(changed(store, &ap, later, c0).await.is_empty());
    // No cursor when no row came back: the next read starts where this one did.
    let (none, no_cursor) = store
        .sync_cells(&ap, NOW, SyncRead::After(c0 + 100))
        .await
        .unwrap();
    assert!(
        none.is_empty() && no_cursor.is_none(),
        "{none:?} {no_cursor:?}"
    );
}

/// The cursor a full read by `region` returns (the table holds rows).
async fn full_read_cursor(store: &Store, region: &Region) -> u64 {
    store
        .sync_cells(region, NOW, SyncRead::Full)
        .await
        .unwrap()
        .1
        .expect("a cursor: the table holds rows")
}

fn eu_us_ap() -> (Region, Region, Region) {
    (
        Region::new("eu").unwrap(),
        Region::new("us").unwrap(),
        Region::new("ap").unwrap(),
    )
}

/// The MariaDB pool of a store made by `Fresh::mariadb`.
fn pool(store: &Store) -> &sqlx::MySqlPool {
    match store {
        Store::MySql(p) => p,
        Store::Sqlite(_) => panic!("a MariaDB store"),
    }
}

/// Waits until `n` flushes are registered (in flight), polled with a deadline.
async fn registered(store: &Store, n: i64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM ratelimit_flushers")
            .fetch_one(pool(store))
            .await
            .unwrap();
        if now == n {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{now} flushes registered, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A session that holds eu's row of `id` locked (as a slow transaction on it would), so that
/// eu's next flush of `id` waits inside its transaction, registered and stamped.
async fn hold_row(store: &Store, id: &str) -> sqlx::Transaction<'static, sqlx::MySql> {
    // By primary key: a locking read through a scan would lock every row it passed.
    let pk: u64 = sqlx::query_scalar(
        "SELECT pk FROM ratelimit_window_counts WHERE identifier = ? AND region = 'eu'",
    )
    .bind(id)
    .fetch_one(pool(store))
    .await
    .unwrap();
    let mut holder = pool(store).begin().await.unwrap();
    sqlx::query("SELECT count FROM ratelimit_window_counts WHERE pk = ? FOR UPDATE")
        .bind(pk)
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    holder
}

/// No count a region flushed is missed by another region's sync of changes, however late the
/// flush commits: eu's flush waits on a lock for 3 s (longer than any re-read overlap a clock
/// stamp would need) while us flushes and ap syncs again and again; ap's cursor stays below eu's
/// stamp, and its first sync after eu commits reads eu's count.
#[tokio::test]
async fn a_flush_that_commits_late_is_read_by_the_next_sync_of_changes() {
    let f = Fresh::mariadb().await;
    let store = &f.store;
    store.migrate().await.unwrap();
    let (eu, us, ap) = eu_us_ap();
    store.flush(&eu, &[row("late", 1)]).await.unwrap();
    store.flush(&us, &[row("other", 1)]).await.unwrap();
    let mut cursor = full_read_cursor(store, &ap).await;
    let holder = hold_row(store, "late").await;
    let late = tokio::spawn({
        let (store, eu) = (store.clone(), eu.clone());
        async move { store.flush(&eu, &[row("late", 9)]).await }
    });
    registered(store, 1).await;
    let held_from = std::time::Instant::now();
    let mut other = 1;
    // The lock is held for 3 s of us's flushes and ap's syncs (the fault's length, not a wait).
    while held_from.elapsed() < Duration::from_secs(3) {
        other += 1;
        store.flush(&us, &[row("other", other)]).await.unwrap();
        let (rows, c) = store
            .sync_cells(&ap, NOW, SyncRead::After(cursor))
            .await
            .unwrap();
        let seen = rows
            .iter()
            .find(|r| r.key.as_ref().identifier() == "other")
            .map(|r| r.foreign);
        assert_eq!(seen, Some(other), "us's flush: {rows:?}");
        cursor = cursor.max(c.unwrap());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!late.is_finished(), "eu's flush was held");
    holder.commit().await.unwrap();
    assert_eq!(late.await.unwrap().unwrap(), 1);
    let rows = changed(store, &ap, NOW, cursor).await;
    let late = rows.iter().find(|r| r.key.as_ref().identifier() == "late");
    assert_eq!(
        late.map(|r| r.foreign),
        Some(9),
        "eu's late flush, read after {other} flushes of us: {rows:?}"
    );
    f.done().await;
}

/// A flusher that died registered holds every cursor below its stamp until a gateway deletes
/// the stale registration; a running flush holds its registration locked, and the deletion
/// passes over it without waiting (the flush commits).
#[tokio::test]
async fn a_stale_registration_is_deleted_and_a_running_flush_is_not_waited_on() {
    let f = Fresh::mariadb().await;
    let store = &f.store;
    store.migrate().await.unwrap();
    let (eu, us, ap) = eu_us_ap();
    store.flush(&eu, &[row("held", 1)]).await.unwrap();
    let cursor = full_read_cursor(store, &ap).await;
    let register = |since: &str| {
        format!("INSERT INTO ratelimit_flushers (flusher, low, since) VALUES ('dead', 1, {since})")
    };
    // A flusher that registered at stamp 1 and died, just now: it holds the cursor.
    sqlx::query(&register("CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS UNSIGNED)"))
        .execute(pool(store))
        .await
        .unwrap();
    store.flush(&us, &[row("x", 4)]).await.unwrap();
    let (rows, c) = store
        .sync_cells(&ap, NOW, SyncRead::After(cursor))
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(c, Some(1), "held at the registration's low");
    assert_eq!(
        store.clear_stale_flushes().await.unwrap(),
        0,
        "a fresh registration stays"
    );
    sqlx::query("DELETE FROM ratelimit_flushers WHERE flusher = 'dead'")
        .execute(pool(store))
        .await
        .unwrap();

    // The same, long ago, beside eu's flush waiting on a lock with its registration held.
    sqlx::query(&register("0"))
        .execute(pool(store))
        .await
        .unwrap();
    let holder = hold_row(store, "held").await;
    let slow = tokio::spawn({
        let (store, eu) = (store.clone(), eu.clone());
        async move { store.flush(&eu, &[row("held", 7)]).await }
    });
    registered(store, 2).await;
    let cleared = tokio::time::timeout(Duration::from_secs(5), store.clear_stale_flushes())
        .await
        .expect("the deletion waits on no running flush")
        .unwrap();
    assert_eq!(cleared, 1, "the dead one only");
    registered(store, 1).await;
    holder.commit().await.unwrap();
    assert_eq!(slow.await.unwrap().unwrap(), 1);
    registered(store, 0).await;
    let count = store
        .sync(&ap, NOW)
        .await
        .unwrap()
        .into_iter()
        .find(|r| r.key.as_ref().identifier() == "held")
        .map(|r| r.foreign);
    assert_eq!(count, Some(7));
    let (_, c) = store.sync_cells(&ap, NOW, SyncRead::Full).await.unwrap();
    let top: i64 = sqlx::query_scalar("SELECT CAST(v AS SIGNED) FROM ratelimit_stamp")
        .fetch_one(pool(store))
        .await
        .unwrap();
    assert_eq!(
        c,
        u64::try_from(top).ok(),
        "nothing holds the cursor any more"
    );
    f.done().await;
}

/// A flush whose registration a gateway deleted as stale before the flush locked it (here: the
/// flush waits between registering and taking its stamp, and its registration is made old)
/// writes nothing: its call stops before the commit, and the next flush writes the rows.
#[tokio::test]
async fn a_flush_taken_for_dead_before_it_began_commits_nothing() {
    let f = Fresh::mariadb().await;
    let store = &f.store;
    store.migrate().await.unwrap();
    let (eu, _, ap) = eu_us_ap();
    store.flush(&eu, &[row("k", 1)]).await.unwrap();
    // A shared lock on the counter: a registration reads it, a stamp must wait.
    let mut holder = pool(store).begin().await.unwrap();
    sqlx::query("SELECT v FROM ratelimit_stamp WHERE id = 1 LOCK IN SHARE MODE")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    let slow = tokio::spawn({
        let (store, eu) = (store.clone(), eu.clone());
        async move { store.flush(&eu, &[row("k", 6)]).await }
    });
    registered(store, 1).await;
    sqlx::query("UPDATE ratelimit_flushers SET since = 0")
        .execute(pool(store))
        .await
        .unwrap();
    assert_eq!(store.clear_stale_flushes().await.unwrap(), 1);
    holder.commit().await.unwrap();
    let err = slow.await.unwrap().unwrap_err();
    assert!(
        err.to_string().contains("took this flush for dead"),
        "{err}"
    );
    let count = |rows: Vec<SyncRow>| rows.first().map(|r| r.foreign);
    assert_eq!(
        count(store.sync(&ap, NOW).await.unwrap()),
        Some(1),
        "nothing of it"
    );
    store.flush(&eu, &[row("k", 6)]).await.unwrap();
    assert_eq!(count(store.sync(&ap, NOW).await.unwrap()), Some(6));
    registered(store, 0).await;
    f.done().await;
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
