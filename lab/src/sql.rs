//! The global store's side of the lab: a database per run on a MySQL server, and the SQL fault
//! (the store unavailable: every gateway's statement waits for its timeout and fails).

use std::sync::Mutex;
use std::time::Duration;

use sqlx::Connection;

use crate::Result;
use crate::stack::Sql;

/// The databases this process created and has not dropped yet (server, database): what an
/// interrupted run still has to drop.
static CREATED: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

fn created() -> std::sync::MutexGuard<'static, Vec<(String, String)>> {
    CREATED.lock().unwrap_or_else(|p| p.into_inner())
}

pub async fn create_database(server: &str, database: &str) -> Result<()> {
    let mut c = sqlx::MySqlConnection::connect(server)
        .await
        .map_err(|e| format!("cannot connect to {server}: {e}"))?;
    sqlx::query(&format!("CREATE DATABASE `{database}`"))
        .execute(&mut c)
        .await
        .map_err(|e| format!("CREATE DATABASE {database}: {e}"))?;
    created().push((server.to_string(), database.to_string()));
    Ok(())
}

pub async fn drop_database(server: &str, database: &str) {
    if let Ok(mut c) = sqlx::MySqlConnection::connect(server).await {
        let dropped = sqlx::query(&format!("DROP DATABASE IF EXISTS `{database}`"))
            .execute(&mut c)
            .await;
        if dropped.is_ok() {
            created().retain(|(s, d)| !(s == server && d == database));
        }
    }
}

/// Drops every database this process created and has not dropped (a run cut short).
pub async fn drop_created() {
    let left = std::mem::take(&mut *created());
    for (server, database) in left {
        drop_database(&server, &database).await;
    }
}

/// Holds the global table locked for `down`: on SQLite an exclusive lock taken in exclusive
/// locking mode (WAL readers are shut out too), on MySQL `LOCK TABLES … WRITE`.
pub async fn hold_down(sql: &Sql, down: Duration) -> Result<()> {
    match sql {
        Sql::Sqlite(path) => {
            let url = format!("sqlite://{}", path.display());
            let mut c = sqlx::SqliteConnection::connect(&url)
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            for statement in [
                "PRAGMA locking_mode = EXCLUSIVE",
                "BEGIN EXCLUSIVE",
                "UPDATE ratelimit_window_counts SET count = count WHERE 0",
            ] {
                sqlx::query(statement)
                    .execute(&mut c)
                    .await
                    .map_err(|e| format!("{statement}: {e}"))?;
            }
            tokio::time::sleep(down).await;
            let _ = sqlx::query("ROLLBACK").execute(&mut c).await;
            let _ = sqlx::query("PRAGMA locking_mode = NORMAL")
                .execute(&mut c)
                .await;
            // The lock is released when the connection closes.
            let _ = c.close().await;
        }
        Sql::Mysql { server, database } => {
            let url = format!("{server}/{database}");
            let mut c = sqlx::MySqlConnection::connect(&url)
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            sqlx::query("LOCK TABLES ratelimit_window_counts WRITE")
                .execute(&mut c)
                .await
                .map_err(|e| format!("LOCK TABLES: {e}"))?;
            tokio::time::sleep(down).await;
            let _ = sqlx::query("UNLOCK TABLES").execute(&mut c).await;
            let _ = c.close().await;
        }
    }
    Ok(())
}
