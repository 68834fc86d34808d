//! The global table in SQL: MySQL in production (tested on MariaDB), SQLite when embedded.
//! Schema migrations, the flush upsert (`GREATEST`), the sync query (own and foreign sums per
//! live cell) and batched cleanup, one statement shape per dialect.

use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use sqlx::{MySql, QueryBuilder, Row, Sqlite};
use std::str::FromStr;
use std::time::Duration;
use strata_core::gcounter::FlushRow;
use strata_core::{Region, WindowDuration, WindowKey};

/// The newest schema this binary knows.
pub const SCHEMA_VERSION: i64 = 5;
const MYSQL: [&str; 5] = [
    include_str!("../../../migrations/mysql/0001_window_counts.sql"),
    include_str!("../../../migrations/mysql/0002_no_pad_keys.sql"),
    include_str!("../../../migrations/mysql/0003_regions.sql"),
    include_str!("../../../migrations/mysql/0004_updated_index.sql"),
    include_str!("../../../migrations/mysql/0005_flush_stamps.sql"),
];
const SQLITE: [&str; 5] = [
    include_str!("../../../migrations/sqlite/0001_window_counts.sql"),
    include_str!("../../../migrations/sqlite/0002_no_pad_keys.sql"),
    include_str!("../../../migrations/sqlite/0003_regions.sql"),
    include_str!("../../../migrations/sqlite/0004_updated_index.sql"),
    include_str!("../../../migrations/sqlite/0005_flush_stamps.sql"),
];
/// The database's clock in Unix ms, as each dialect spells it: what a flush writes as
/// `updated_at` and registers itself at, so the gateways' own clocks (which may disagree) never
/// decide which registration is stale.
const MYSQL_NOW_MS: &str = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS UNSIGNED)";
const SQLITE_NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";
/// Rows per upsert statement: on SQLite 9 placeholders each, far under its 32,766 a statement;
/// on MySQL (literals) about 250 bytes each.
pub const FLUSH_CHUNK_ROWS: usize = 1_000;

/// A database failure, or a schema this binary cannot use.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The URL is not `mysql://` or `sqlite://`, or the connection failed.
    #[error("cannot connect to the database: {0}")]
    Connect(String),
    /// The database is at a newer schema than this binary.
    #[error(
        "the database schema is version {found}, newer than this binary's {supported}: upgrade strata-gateway"
    )]
    Newer {
        /// Version found.
        found: i64,
        /// Newest version this binary knows.
        supported: i64,
    },
    /// A statement failed.
    #[error("database error: {0}")]
    Query(String),
}

fn query(e: sqlx::Error) -> StoreError {
    StoreError::Query(e.to_string())
}

/// The MySQL lock migrations run under, named for the database (at most 64 characters, as
/// `GET_LOCK` wants), and how long a migration waits for another's to end.
macro_rules! migrate_lock {
    () => {
        "LEFT(CONCAT('strata_schema.', COALESCE(DATABASE(), '')), 64)"
    };
}
const GET_MIGRATE_LOCK: &str = concat!("SELECT GET_LOCK(", migrate_lock!(), ", ?)");
const RELEASE_MIGRATE_LOCK: &str = concat!("SELECT RELEASE_LOCK(", migrate_lock!(), ")");
const MIGRATE_LOCK_SECS: i64 = 30;

/// The one connection a migration runs on (it holds the lock or the transaction).
enum Migrating {
    MySql(PoolConnection<MySql>),
    Sqlite(PoolConnection<Sqlite>),
}

impl Migrating {
    async fn run(&mut self, sql: &str) -> Result<(), StoreError> {
        let done = match self {
            Migrating::MySql(c) => sqlx::Executor::execute(&mut **c, sql).await.map(|_| ()),
            Migrating::Sqlite(c) => sqlx::Executor::execute(&mut **c, sql).await.map(|_| ()),
        };
        done.map_err(query)
    }

    /// Closes the connection instead of returning it to the pool.
    fn close(self) {
        match self {
            Migrating::MySql(c) => drop(c.detach()),
            Migrating::Sqlite(c) => drop(c.detach()),
        }
    }

    async fn version(&mut self) -> Result<i64, StoreError> {
        let sql = "SELECT CAST(COALESCE(MAX(version), 0) AS SIGNED) FROM strata_schema_version";
        let version = match self {
            Migrating::MySql(c) => sqlx::query_scalar(sql).fetch_one(&mut **c).await,
            Migrating::Sqlite(c) => sqlx::query_scalar(sql).fetch_one(&mut **c).await,
        };
        version.map_err(query)
    }

    async fn record(&mut self, version: i64) -> Result<(), StoreError> {
        let sql = "INSERT INTO strata_schema_version (version) VALUES (?)";
        let done = match self {
            Migrating::MySql(c) => sqlx::query(sql)
                .bind(version)
                .execute(&mut **c)
                .await
                .map(|_| ()),
            Migrating::Sqlite(c) => sqlx::query(sql)
                .bind(version)
                .execute(&mut **c)
                .await
                .map(|_| ()),
        };
        done.map_err(query)
    }
}

/// Applies the migrations past the schema's version, each recorded as it lands.
async fn apply_migrations(conn: &mut Migrating) -> Result<usize, StoreError> {
    conn.run("CREATE TABLE IF NOT EXISTS strata_schema_version (version BIGINT NOT NULL)")
        .await?;
    let current = conn.version().await?;
    if current > SCHEMA_VERSION {
        return Err(StoreError::Newer {
            found: current,
            supported: SCHEMA_VERSION,
        });
    }
    let scripts: &[&str] = match conn {
        Migrating::MySql(_) => &MYSQL,
        Migrating::Sqlite(_) => &SQLITE,
    };
    let mut applied = 0;
    for (i, sql) in scripts.iter().enumerate() {
        let version = i64::try_from(i + 1).unwrap_or(i64::MAX);
        if version > current {
            conn.run(sql).await?;
            conn.record(version).await?;
            applied += 1;
        }
    }
    Ok(applied)
}

/// One row of a sync: a live cell's own-region and foreign sums.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncRow {
    /// The window key.
    pub key: WindowKey,
    /// The cell's sequence.
    pub sequence: u64,
    /// This region's component.
    pub own: u64,
    /// The sum of the other regions' components.
    pub foreign: u64,
}

/// Which rows a sync reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncRead {
    /// Every live row.
    Full,
    /// The rows of the cells with a row stamped after this (a cursor a read returned).
    After(u64),
}

/// How long a flush may stay registered before another gateway takes it for dead and deletes
/// its registration (the flush, if it still runs, then rolls back): far longer than a flush
/// takes, even across regions.
pub const STALE_FLUSH_MS: u64 = 60_000;

/// A sync row as the database returns it: workspace, namespace, identifier, duration,
/// sequence, own, foreign sum, the stamp counter, and the lowest registered flush (if any).
type RawSyncRow = (String, String, String, i64, i64, i64, i64, i64, Option<i64>);

/// A connection pool to the global table.
#[derive(Debug, Clone)]
pub enum Store {
    /// MySQL or MariaDB.
    MySql(MySqlPool),
    /// SQLite (the embedded default).
    Sqlite(SqlitePool),
}

fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn unsigned(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// Creates the directory of an `sqlite://` URL's file if it is missing (SQLite creates the
/// file, not its directory); any other URL has none. The error says which directory.
pub fn create_sqlite_dir(url: &str) -> Result<(), String> {
    match url
        .strip_prefix("sqlite://")
        .and_then(|p| std::path::Path::new(p).parent())
        .filter(|d| !d.as_os_str().is_empty())
    {
        Some(dir) => std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display())),
        None => Ok(()),
    }
}

/// Bytes of SQL one call of a MySQL flush carries at most: far under the 16 MiB (MariaDB) and
/// 64 MiB (MySQL) default `max_allowed_packet`.
const FLUSH_CALL_BYTES: usize = 4 << 20;

/// [`Store::flush`] on MySQL, in one round trip for up to a few thousand rows (across regions a
/// round trip is 50-150 ms): a text call of several statements that registers the flush
/// (committed), takes its stamp (committed after it, so above the registration's `low`), begins
/// the transaction and locks the registration for it (a gateway deleting stale registrations
/// passes over it), writes the rows with the stamp, deletes the registration, and commits only
/// if the registration was still there to delete (else the guard's duplicate key stops the
/// call, and the transaction is rolled back: a gateway took the flush for dead before it
/// began). Every value is a literal no input can break out of: identities as hex, numbers, and
/// a region of `[A-Za-z0-9._-]`.
async fn flush_mysql(
    pool: &MySqlPool,
    region: &Region,
    rows: &[FlushRow],
) -> Result<u64, StoreError> {
    use std::fmt::Write as _;
    let flusher = format!("'{}/{:032x}'", region.as_str(), rand::random::<u128>());
    let mut statements = vec![
        format!(
            "INSERT INTO ratelimit_flushers (flusher, low, since) \
             SELECT {flusher}, v, {MYSQL_NOW_MS} FROM ratelimit_stamp WHERE id = 1"
        ),
        "UPDATE ratelimit_stamp SET v = LAST_INSERT_ID(v + 1) WHERE id = 1".to_string(),
        "SET @strata_stamp = LAST_INSERT_ID()".to_string(),
        "START TRANSACTION".to_string(),
        format!("SELECT COUNT(*) FROM ratelimit_flushers WHERE flusher = {flusher} FOR UPDATE"),
    ];
    let hex = |bytes: &[u8]| {
        let mut text = String::with_capacity(3 + 2 * bytes.len());
        text.push_str("X'");
        for b in bytes {
            let _ = write!(text, "{b:02x}");
        }
        text.push('\'');
        text
    };
    for chunk in rows.chunks(FLUSH_CHUNK_ROWS) {
        let mut sql = String::from(
            "INSERT INTO ratelimit_window_counts (workspace_id, namespace, identifier, \
             duration_ms, sequence, region, count, expires_at, updated_at, stamp) VALUES ",
        );
        for (i, r) in chunk.iter().enumerate() {
            let k = r.key.as_ref();
            let _ = write!(
                sql,
                "{}({}, {}, {}, {}, {}, '{}', {}, {}, {MYSQL_NOW_MS}, @strata_stamp)",
                if i == 0 { "" } else { ", " },
                hex(k.workspace().as_bytes()),
                hex(k.namespace().as_bytes()),
                hex(k.identifier().as_bytes()),
                k.duration().as_ms(),
                signed(r.sequence),
                region.as_str(),
                r.count,
                r.expires_at,
            );
        }
        sql.push_str(
            " ON DUPLICATE KEY UPDATE count = GREATEST(count, VALUES(count)), \
             updated_at = VALUES(updated_at), stamp = VALUES(stamp)",
        );
        statements.push(sql);
    }
    statements.push(format!(
        "DELETE FROM ratelimit_flushers WHERE flusher = {flusher}"
    ));
    statements.push(
        "INSERT INTO ratelimit_stamp (id, v) SELECT 1, 0 FROM DUAL WHERE ROW_COUNT() = 0"
            .to_string(),
    );
    statements.push("COMMIT".to_string());

    let mut calls: Vec<String> = Vec::new();
    for statement in statements {
        match calls.last_mut() {
            Some(call) if call.len() + statement.len() < FLUSH_CALL_BYTES => {
                call.push_str("; ");
                call.push_str(&statement);
            }
            _ => calls.push(statement),
        }
    }
    let mut conn = pool.acquire().await.map_err(query)?;
    for call in &calls {
        // A text query without arguments: several statements in one call.
        if let Err(e) = sqlx::Executor::execute(&mut *conn, call.as_str()).await {
            // The transaction may be open: roll it back, or close the connection rather than
            // give it back to the pool inside one.
            if sqlx::Executor::execute(&mut *conn, "ROLLBACK")
                .await
                .is_err()
            {
                conn.close_on_drop();
            }
            let text = e.to_string();
            return Err(StoreError::Query(if text.contains("Duplicate entry '1'") {
                format!(
                    "another gateway took this flush for dead (registered over {STALE_FLUSH_MS} \
                     ms before it began): rolled back, the next flush writes its rows"
                )
            } else {
                text
            }));
        }
    }
    Ok(rows.len() as u64)
}

/// [`Store::flush`] on SQLite: the stamp is taken inside the write transaction, which SQLite
/// runs one at a time, so stamps are in commit order.
async fn flush_sqlite(
    pool: &SqlitePool,
    region: &Region,
    rows: &[FlushRow],
) -> Result<u64, StoreError> {
    let head = "INSERT INTO ratelimit_window_counts \
        (workspace_id, namespace, identifier, duration_ms, sequence, region, count, expires_at, updated_at, stamp) ";
    let mut tx = pool.begin().await.map_err(query)?;
    let stamp: i64 =
        sqlx::query_scalar("UPDATE ratelimit_stamp SET v = v + 1 WHERE id = 1 RETURNING v")
            .fetch_one(&mut *tx)
            .await
            .map_err(query)?;
    for chunk in rows.chunks(FLUSH_CHUNK_ROWS) {
        let mut q = QueryBuilder::<Sqlite>::new(head);
        q.push_values(chunk, |mut b, r| {
            let k = r.key.as_ref();
            b.push_bind(k.workspace())
                .push_bind(k.namespace())
                .push_bind(k.identifier())
                .push_bind(signed(k.duration().as_ms()))
                .push_bind(signed(r.sequence))
                .push_bind(region.as_str())
                .push_bind(signed(r.count))
                .push_bind(signed(r.expires_at))
                .push(SQLITE_NOW_MS)
                .push_bind(stamp);
        });
        q.push(
            " ON CONFLICT (workspace_id, namespace, identifier, duration_ms, sequence, region) \
                 DO UPDATE SET count = MAX(count, excluded.count), \
                 updated_at = excluded.updated_at, stamp = excluded.stamp",
        );
        q.build().execute(&mut *tx).await.map_err(query)?;
    }
    tx.commit().await.map_err(query)?;
    Ok(rows.len() as u64)
}

impl Store {
    /// Connects (lazily: the gateway starts even if the database is down) to `mysql://…` or
    /// `sqlite://…` (the SQLite file is created if missing).
    pub fn connect(url: &str, timeout: Duration) -> Result<Self, StoreError> {
        if url.starts_with("mysql://") {
            // No ping before each statement: across regions a ping is a round trip of its own
            // (50-150 ms), doubling every flush and sync; a dead connection fails its statement,
            // which the next cadence retries on a new one.
            let pool = MySqlPoolOptions::new()
                .max_connections(4)
                .test_before_acquire(false)
                .acquire_timeout(timeout)
                .connect_lazy(url)
                .map_err(|e| StoreError::Connect(e.to_string()))?;
            Ok(Store::MySql(pool))
        } else if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)
                .map_err(|e| StoreError::Connect(e.to_string()))?
                .create_if_missing(true)
                .busy_timeout(timeout);
            let pool = SqlitePoolOptions::new()
                .max_connections(2)
                .acquire_timeout(timeout)
                .connect_lazy_with(options);
            Ok(Store::Sqlite(pool))
        } else {
            Err(StoreError::Connect(
                "the URL must start with mysql:// or sqlite://".into(),
            ))
        }
    }

    /// `mysql` or `sqlite`.
    pub fn dialect(&self) -> &'static str {
        match self {
            Store::MySql(_) => "mysql",
            Store::Sqlite(_) => "sqlite",
        }
    }

    /// Brings the schema to this binary's version; refuses a newer one. Returns how many
    /// migrations it applied. Gateways rolled out together migrate one database at once, so
    /// one migrates at a time: on MySQL under a named lock of the database's
    /// ([`MIGRATE_LOCK_SECS`] to get it), on SQLite in one write transaction (DDL is
    /// transactional there); the others then find the schema current and apply nothing.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        match self {
            Store::MySql(p) => {
                let mut conn = p.acquire().await.map_err(query)?;
                let got: Option<i64> = sqlx::query_scalar(GET_MIGRATE_LOCK)
                    .bind(MIGRATE_LOCK_SECS)
                    .fetch_one(conn.as_mut())
                    .await
                    .map_err(query)?;
                if got != Some(1) {
                    return Err(StoreError::Query(format!(
                        "another process held the schema migration lock for {MIGRATE_LOCK_SECS} s"
                    )));
                }
                let mut migrating = Migrating::MySql(conn);
                let applied = apply_migrations(&mut migrating).await;
                let released = migrating.run(RELEASE_MIGRATE_LOCK).await;
                if released.is_err() {
                    // A session's locks end with it: the connection is closed, not pooled.
                    migrating.close();
                }
                applied
            }
            Store::Sqlite(p) => {
                let mut migrating = Migrating::Sqlite(p.acquire().await.map_err(query)?);
                migrating.run("BEGIN IMMEDIATE").await?;
                let applied = apply_migrations(&mut migrating).await;
                let end = if applied.is_ok() {
                    "COMMIT"
                } else {
                    "ROLLBACK"
                };
                match migrating.run(end).await {
                    Ok(()) => applied,
                    Err(e) => {
                        migrating.close();
                        applied.and(Err(e))
                    }
                }
            }
        }
    }

    /// Writes this region's components (`count = GREATEST(count, new)`), in the rows' order
    /// (unique-key order, so concurrent flushers lock rows alike), in bounded chunks, as one
    /// transaction whose rows carry one stamp that no sync can pass before the transaction ends
    /// (migration 0005 says how). MySQL: the flush registers, takes its stamp, then writes in a
    /// transaction that holds its registration locked and deletes it ([`flush_mysql`]); SQLite:
    /// the stamp is taken inside the write transaction, which SQLite runs one at a time.
    /// Returns the rows written.
    pub async fn flush(&self, region: &Region, rows: &[FlushRow]) -> Result<u64, StoreError> {
        match self {
            Store::MySql(p) => flush_mysql(p, region, rows).await,
            Store::Sqlite(p) => flush_sqlite(p, region, rows).await,
        }
    }

    /// Deletes the registrations of flushes older than [`STALE_FLUSH_MS`] (the database's
    /// clock) that no running flush holds locked: a flusher that died leaves one, which would
    /// hold every sync's cursor below its stamp for good. A flush that registered but had not
    /// locked its registration yet stops when it finds it gone, so nothing commits behind a
    /// cursor. Returns how many it deleted.
    pub async fn clear_stale_flushes(&self) -> Result<u64, StoreError> {
        match self {
            Store::MySql(p) => {
                let mut tx = p.begin().await.map_err(query)?;
                // A registration a running flush holds locked is skipped, never waited on.
                let stale: Vec<Vec<u8>> = sqlx::query_scalar(&format!(
                    "SELECT flusher FROM ratelimit_flushers WHERE since < {MYSQL_NOW_MS} - ? \
                     FOR UPDATE SKIP LOCKED"
                ))
                .bind(STALE_FLUSH_MS)
                .fetch_all(&mut *tx)
                .await
                .map_err(query)?;
                for name in &stale {
                    sqlx::query("DELETE FROM ratelimit_flushers WHERE flusher = ?")
                        .bind(name)
                        .execute(&mut *tx)
                        .await
                        .map_err(query)?;
                }
                tx.commit().await.map_err(query)?;
                Ok(stale.len() as u64)
            }
            // No registrations: SQLite's stamps are in commit order.
            Store::Sqlite(_) => Ok(0),
        }
    }

    /// The database's clock, Unix ms (what a flush writes as `updated_at`).
    pub async fn clock_ms(&self) -> Result<u64, StoreError> {
        let ms: i64 = match self {
            Store::MySql(p) => {
                sqlx::query_scalar(&format!("SELECT CAST({MYSQL_NOW_MS} AS SIGNED)"))
                    .fetch_one(p)
                    .await
                    .map_err(query)?
            }
            Store::Sqlite(p) => sqlx::query_scalar(&format!("SELECT {SQLITE_NOW_MS}"))
                .fetch_one(p)
                .await
                .map_err(query)?,
        };
        Ok(unsigned(ms))
    }

    /// One query: for every live cell, this region's component and the others' sum.
    pub async fn sync(&self, region: &Region, now_ms: u64) -> Result<Vec<SyncRow>, StoreError> {
        Ok(self.sync_cells(region, now_ms, SyncRead::Full).await?.0)
    }

    /// The rows `read` says, with the cursor the next read of changes starts after (none when
    /// it returned no row): one statement, so one round trip and one consistent view of the
    /// rows, the stamp counter and the flushes in flight. The cursor is the counter, held below
    /// the lowest registration of a flush in flight: every stamp at or under it is committed
    /// and was read by now, whatever a flush's commit delay.
    pub async fn sync_cells(
        &self,
        region: &Region,
        now_ms: u64,
        read: SyncRead,
    ) -> Result<(Vec<SyncRow>, Option<u64>), StoreError> {
        let after = match read {
            SyncRead::Full => None,
            SyncRead::After(stamp) => Some(stamp),
        };
        let cells = "c.workspace_id, c.namespace, c.identifier, c.duration_ms, c.sequence";
        let from = match after {
            None => "ratelimit_window_counts AS c".to_string(),
            // The cells changed since, through the `stamp` index; then each one's rows. In that
            // order, always (MySQL's STRAIGHT_JOIN, SQLite's CROSS JOIN): with index statistics
            // a bulk write left stale, MariaDB chose to scan the whole table and look each row
            // up in the changed cells, reading every row every second.
            Some(_) => {
                "(SELECT DISTINCT workspace_id, namespace, identifier, duration_ms, sequence \
                 FROM ratelimit_window_counts WHERE stamp > ? AND expires_at > ?) AS ch \
                 CROSS JOIN ratelimit_window_counts AS c ON c.workspace_id = ch.workspace_id \
                 AND c.namespace = ch.namespace AND c.identifier = ch.identifier \
                 AND c.duration_ms = ch.duration_ms AND c.sequence = ch.sequence"
                    .to_string()
            }
        };
        let live = if after.is_none() {
            "WHERE c.expires_at > ?"
        } else {
            ""
        };
        let sql = |cast: &str, order: &str| {
            format!(
                "SELECT {order}{cells}, \
                 CAST(SUM(CASE WHEN c.region = ? THEN c.count ELSE 0 END) AS {cast}) AS own, \
                 CAST(SUM(CASE WHEN c.region <> ? THEN c.count ELSE 0 END) AS {cast}) AS foreign_sum, \
                 CAST(MAX(m.top) AS {cast}) AS top, CAST(MIN(m.held) AS {cast}) AS held \
                 FROM {from} CROSS JOIN (SELECT (SELECT v FROM ratelimit_stamp WHERE id = 1) AS top, \
                 (SELECT MIN(low) FROM ratelimit_flushers) AS held) AS m \
                 {live} GROUP BY {cells}"
            )
        };
        let rows: Vec<RawSyncRow> = match self {
            Store::MySql(p) => {
                let text = sql("SIGNED", "STRAIGHT_JOIN ");
                let mut q = sqlx::query(&text)
                    .bind(region.as_str())
                    .bind(region.as_str());
                if let Some(after) = after {
                    q = q.bind(after);
                }
                q.bind(now_ms)
                    .fetch_all(p)
                    .await
                    .map_err(query)?
                    .iter()
                    .map(|r| {
                        // VARBINARY (and the first schema's utf8mb4_bin) columns arrive as bytes.
                        let text = |i: usize| -> Result<String, sqlx::Error> {
                            let bytes: Vec<u8> = r.try_get(i)?;
                            String::from_utf8(bytes).map_err(|e| sqlx::Error::Decode(Box::new(e)))
                        };
                        Ok((
                            text(0)?,
                            text(1)?,
                            text(2)?,
                            r.try_get::<u64, _>(3).map(signed)?,
                            r.try_get(4)?,
                            r.try_get(5)?,
                            r.try_get(6)?,
                            r.try_get(7)?,
                            r.try_get(8)?,
                        ))
                    })
                    .collect::<Result<_, sqlx::Error>>()
                    .map_err(query)?
            }
            Store::Sqlite(p) => {
                let text = sql("INTEGER", "");
                let mut q = sqlx::query(&text)
                    .bind(region.as_str())
                    .bind(region.as_str());
                if let Some(after) = after {
                    q = q.bind(signed(after));
                }
                q.bind(signed(now_ms))
                    .fetch_all(p)
                    .await
                    .map_err(query)?
                    .iter()
                    .map(|r| {
                        Ok((
                            r.try_get(0)?,
                            r.try_get(1)?,
                            r.try_get(2)?,
                            r.try_get(3)?,
                            r.try_get(4)?,
                            r.try_get(5)?,
                            r.try_get(6)?,
                            r.try_get(7)?,
                            r.try_get(8)?,
                        ))
                    })
                    .collect::<Result<_, sqlx::Error>>()
                    .map_err(query)?
            }
        };
        // A registered flush's stamps are above its `low`: the cursor stays at or under it.
        let cursor = rows.first().map(|r| {
            let top = unsigned(r.7);
            r.8.map_or(top, |held| top.min(unsigned(held)))
        });
        let rows = rows
            .into_iter()
            .filter_map(|(ws, ns, id, duration, sequence, own, foreign, _, _)| {
                let d = WindowDuration::from_ms(unsigned(duration)).ok()?;
                let key = WindowKey::new(&ws, &ns, &id, d).ok()?;
                Some(SyncRow {
                    key,
                    sequence: unsigned(sequence),
                    own: unsigned(own),
                    foreign: unsigned(foreign),
                })
            })
            .collect();
        Ok((rows, cursor))
    }

    /// Records that `region` publishes, at `now_ms`, and returns how many regions did since
    /// `since_ms` (this one included).
    pub async fn announce(
        &self,
        region: &Region,
        now_ms: u64,
        since_ms: u64,
    ) -> Result<u64, StoreError> {
        let count = "SELECT COUNT(*) FROM ratelimit_regions WHERE seen_at >= ?";
        let live: i64 = match self {
            Store::MySql(p) => {
                sqlx::query(
                    "INSERT INTO ratelimit_regions (region, seen_at) VALUES (?, ?) \
                     ON DUPLICATE KEY UPDATE seen_at = GREATEST(seen_at, VALUES(seen_at))",
                )
                .bind(region.as_str())
                .bind(now_ms)
                .execute(p)
                .await
                .map_err(query)?;
                sqlx::query_scalar(count)
                    .bind(since_ms)
                    .fetch_one(p)
                    .await
                    .map_err(query)?
            }
            Store::Sqlite(p) => {
                sqlx::query(
                    "INSERT INTO ratelimit_regions (region, seen_at) VALUES (?, ?) \
                     ON CONFLICT (region) DO UPDATE SET seen_at = MAX(seen_at, excluded.seen_at)",
                )
                .bind(region.as_str())
                .bind(signed(now_ms))
                .execute(p)
                .await
                .map_err(query)?;
                sqlx::query_scalar(count)
                    .bind(signed(since_ms))
                    .fetch_one(p)
                    .await
                    .map_err(query)?
            }
        };
        Ok(unsigned(live).max(1))
    }

    /// Deletes rows whose cells expired at `now_ms`, at most `batch` per statement and
    /// `max_batches` statements. Safe with several gateways at once (each delete is its own
    /// statement on whatever is still there). Returns the rows deleted.
    pub async fn cleanup(
        &self,
        now_ms: u64,
        batch: u32,
        max_batches: u32,
    ) -> Result<u64, StoreError> {
        let mut deleted = 0;
        for _ in 0..max_batches {
            let n = match self {
                Store::MySql(p) => sqlx::query("DELETE FROM ratelimit_window_counts WHERE expires_at <= ? ORDER BY expires_at LIMIT ?")
                    .bind(now_ms)
                    .bind(batch)
                    .execute(p)
                    .await
                    .map_err(query)?
                    .rows_affected(),
                Store::Sqlite(p) => sqlx::query(
                    "DELETE FROM ratelimit_window_counts WHERE pk IN \
                     (SELECT pk FROM ratelimit_window_counts WHERE expires_at <= ? ORDER BY expires_at LIMIT ?)",
                )
                .bind(signed(now_ms))
                .bind(i64::from(batch))
                .execute(p)
                .await
                .map_err(query)?
                .rows_affected(),
            };
            deleted += n;
            if n < u64::from(batch) {
                break;
            }
        }
        Ok(deleted)
    }
}
