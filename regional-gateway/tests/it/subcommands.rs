//! The built binary as an operator runs it: the `migrate` and `cleanup` subcommands on both
//! dialects, several processes migrating one database at once, a database at a newer schema
//! refused, and a gateway that starts while its global
//! table is unreachable (it decides; the loops count their failures and retry).

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::mariadb::SharedDatabase;
use common::process::GatewayProcess;
use strata_core::gcounter::FlushRow;
use strata_core::{Region, WindowDuration, WindowKey};
use strata_gateway::global::{SCHEMA_VERSION, Store};

/// `strata-gateway <args>` as an operator starts it (no database URL inherited).
fn gateway_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_strata-gateway"));
    command.args(args).env_remove("STRATA_DATABASE_URL");
    command
}

/// Runs `strata-gateway <args>`: exit success, stdout, stderr.
fn gateway(args: &[&str]) -> (bool, String, String) {
    let out = gateway_command(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{prefix}_{}_{nanos}", std::process::id())
}

/// A row of `id` in window `sequence` of a one-minute duration.
fn row(id: &str, sequence: u64) -> FlushRow {
    let d = WindowDuration::from_ms(60_000).unwrap();
    FlushRow {
        key: WindowKey::new("ws", "api", id, d).unwrap(),
        sequence,
        count: 5,
        expires_at: d.expires_at(sequence),
    }
}

/// `migrate` twice, `cleanup` of one expired row of two, and a newer schema refused.
async fn operator_tasks(url: &str, dialect: &str) {
    let (ok, out, err) = gateway(&["--database-url", url, "migrate"]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!(
            "applied {SCHEMA_VERSION} migration(s) ({dialect})"
        )),
        "{out}"
    );
    let (ok, out, _) = gateway(&["--database-url", url, "migrate"]);
    assert!(ok && out.contains("applied 0 migration(s)"), "{out}");

    let store = Store::connect(url, Duration::from_secs(5)).unwrap();
    let now = strata_gateway::clock::Clock::system().now_ms();
    let current = now / 60_000;
    let eu = Region::new("eu").unwrap();
    let mut rows = vec![row("expired", current - 10), row("live", current)];
    rows.sort();
    store.flush(&eu, &rows).await.unwrap();
    let (ok, out, err) = gateway(&["--database-url", url, "cleanup"]);
    assert!(ok, "{err}");
    assert!(out.contains("deleted 1 expired row(s)"), "{out}");
    let left = store.sync(&eu, now).await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].key.as_ref().identifier(), "live");

    let bump = "INSERT INTO strata_schema_version (version) VALUES (99)";
    match &store {
        Store::MySql(p) => sqlx::query(bump).execute(p).await.map(|_| ()).unwrap(),
        Store::Sqlite(p) => sqlx::query(bump).execute(p).await.map(|_| ()).unwrap(),
    }
    let (ok, _, err) = gateway(&["--database-url", url, "migrate"]);
    assert!(!ok, "a newer schema must be refused");
    assert!(err.contains("upgrade strata-gateway"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_and_cleanup_on_sqlite() {
    let path = std::env::temp_dir().join(format!("{}.db", unique("strata-subcommands")));
    operator_tasks(&format!("sqlite://{}", path.display()), "sqlite").await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_and_cleanup_on_mariadb() {
    let db = SharedDatabase::create(&unique("strata_subcommands")).await;
    operator_tasks(&db.url(), "mysql").await;
    db.drop().await;
}

/// Gateways of a fleet rolled out at once migrate one database at the same moment: each of
/// `PROCESSES` `migrate` processes succeeds, the migrations are applied once between them, and
/// each schema version is recorded once.
async fn migrations_at_once(url: &str) {
    const PROCESSES: usize = 4;
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            gateway_command(&["--database-url", url, "migrate"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut applied = 0;
    for child in children {
        let out = child.wait_with_output().unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "a migrate process failed: {stderr}");
        let n: i64 = stdout
            .split("applied ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no count of migrations applied: {stdout}"));
        applied += n;
    }
    assert_eq!(applied, SCHEMA_VERSION, "migrations applied between them");
    let store = Store::connect(url, Duration::from_secs(5)).unwrap();
    let versions = "SELECT CAST(version AS SIGNED), CAST(COUNT(*) AS SIGNED) FROM strata_schema_version \
                    GROUP BY version ORDER BY version";
    let recorded: Vec<(i64, i64)> = match &store {
        Store::MySql(p) => sqlx::query_as(versions).fetch_all(p).await.unwrap(),
        Store::Sqlite(p) => sqlx::query_as(versions).fetch_all(p).await.unwrap(),
    };
    let once: Vec<(i64, i64)> = (1..=SCHEMA_VERSION).map(|v| (v, 1)).collect();
    assert_eq!(recorded, once, "each version recorded once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_by_several_processes_at_once_apply_once_on_sqlite() {
    let path = std::env::temp_dir().join(format!("{}.db", unique("strata-migrate-race")));
    migrations_at_once(&format!("sqlite://{}", path.display())).await;
    let _ = std::fs::remove_file(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_by_several_processes_at_once_apply_once_on_mariadb() {
    let db = SharedDatabase::create(&unique("strata_migrate_race")).await;
    migrations_at_once(&db.url()).await;
    db.drop().await;
}

/// The global table is unreachable at start-up: the gateway starts, decides, and its flush and
/// sync loops count their failures (and keep trying) instead of stopping it. (Flushes need a
/// count worth publishing: 3 of 10 passes the 20% floor.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_starts_and_decides_while_its_database_is_down() {
    let nowhere = format!("mysql://root@127.0.0.1:{}/strata", common::free_port());
    let mut g = GatewayProcess::start(&[
        "--database-url",
        &nowhere,
        "--flush-interval",
        "200ms",
        "--sync-interval",
        "200ms",
    ]);
    let http = reqwest::Client::new();
    g.ready(&http).await;
    let body =
        serde_json::json!({"namespace":"api","identifier":"offline","limit":10,"duration":60_000});
    for _ in 0..3 {
        let r = common::post_json(&http, format!("{}/v1/ratelimit", g.base), &body).await;
        assert_eq!(r["success"], true);
    }
    // Each attempt waits out the pool's 2 s acquire timeout against the refused port.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let errors = common::metric_sum(&common::metrics(&http, &g.base).await, |l| {
            l.starts_with("strata_global_sync_errors_total")
                || l.starts_with("strata_global_write_errors_total")
        });
        if errors >= 2.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the flush and sync loops did not report their failures: {errors}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
