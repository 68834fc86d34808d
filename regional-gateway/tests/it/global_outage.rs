//! The database stopped mid-run (a private MariaDB): decisions go on, flushes and syncs fail,
//! are counted and retried, and nothing is lost when it returns.

use crate::common;

use std::time::{Duration, Instant};

use common::mariadb::MariaDbServer;
use common::{T0, with_settings};
use strata_core::table::LimitRequest;
use strata_core::{Region, WindowDuration, WindowKeyRef};
use strata_gateway::config::Settings;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_loses_nothing() {
    let mut db = MariaDbServer::start();
    let admin = sqlx::MySqlPool::connect(&db.url("")).await.unwrap();
    sqlx::query("CREATE DATABASE strata")
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
    let g = with_settings(Settings {
        region: Region::new("eu").unwrap(),
        database_url: db.url("strata"),
        ..Settings::default()
    })
    .await;
    let key = WindowKeyRef::new(
        "default",
        "api",
        "k",
        WindowDuration::from_ms(3_600_000).unwrap(),
    )
    .unwrap();
    let limiter = &g.gateway.limiter;
    let admit = |n: u64| async move {
        let mut admitted = 0;
        for _ in 0..n {
            admitted += u64::from(
                limiter
                    .decide(LimitRequest {
                        key,
                        limit: 100,
                        cost: 1,
                    })
                    .await
                    .success,
            );
        }
        assert!(limiter.replay_once().await);
        admitted
    };
    assert_eq!(admit(30).await, 30);
    assert_eq!(limiter.global.flush_once(T0).await.unwrap(), 1);

    db.stop();
    assert_eq!(admit(20).await, 20, "decisions never wait on the database");
    assert!(limiter.global.flush_once(T0).await.is_err());
    assert!(limiter.global.sync_once(&limiter.local, T0).await.is_err());
    assert!(limiter.global.metrics.write_errors.get() >= 1);
    assert!(limiter.global.metrics.sync_errors.get() >= 1);

    db.restart();
    // The pool reconnects and the breaker (if it opened) probes on real time: retry the
    // flush, as the loop would on its next ticks, until it lands.
    let deadline = Instant::now() + Duration::from_secs(20);
    while limiter.global.flush_once(T0).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the flush never succeeded after the database returned"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rows = limiter
        .global
        .store
        .sync(&Region::new("other").unwrap(), T0)
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0].foreign, 50,
        "the 20 admitted during the outage were published after it"
    );
}
