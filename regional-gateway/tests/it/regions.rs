//! Two regions sharing one global table (SQLite file, then MariaDB): what one region
//! publishes reaches the other's decisions; the publish floor, the published-elsewhere rule and
//! the change filter; a region whose origin lost its counts still counts what it published.

use crate::common;

use common::mariadb::SharedDatabase;
use common::{T0, TestGateway, temp_database, with_settings};
use strata_core::table::LimitRequest;
use strata_core::{Region, WindowDuration, WindowKeyRef};
use strata_gateway::config::Settings;

async fn region(name: &str, database_url: &str) -> TestGateway {
    with_settings(Settings {
        region: Region::new(name).unwrap(),
        database_url: database_url.to_string(),
        ..Settings::default()
    })
    .await
}

fn key(id: &str) -> WindowKeyRef<'_> {
    WindowKeyRef::new(
        "default",
        "api",
        id,
        WindowDuration::from_ms(3_600_000).unwrap(),
    )
    .unwrap()
}

async fn admit(g: &TestGateway, id: &str, limit: u64, n: u64) -> u64 {
    let mut admitted = 0;
    for _ in 0..n {
        admitted += u64::from(
            g.gateway
                .limiter
                .decide(LimitRequest {
                    key: key(id),
                    limit,
                    cost: 1,
                })
                .await
                .success,
        );
    }
    assert!(g.gateway.limiter.replay_once().await);
    admitted
}

fn global(g: &TestGateway) -> &strata_gateway::global::Global {
    &g.gateway.limiter.global
}

fn rows_written(g: &TestGateway) -> u64 {
    g.gateway.limiter.global.metrics.rows_written.get()
}

async fn two_regions_share_usage(url: &str) {
    let eu = region("eu", url).await;
    let us = region("us", url).await;

    // eu uses 60 of 100 and publishes it; us imports it and has 40 left.
    assert_eq!(admit(&eu, "shared", 100, 60).await, 60);
    assert_eq!(global(&eu).flush_once(T0).await.unwrap(), 1);
    assert!(
        global(&us)
            .sync_once(&us.gateway.limiter.local, T0)
            .await
            .unwrap()
            >= 1
    );
    assert_eq!(
        admit(&us, "shared", 100, 50).await,
        40,
        "the sum reached the limit"
    );
    // An edge asking us's origin gets the imported count in the answer, and in the decision.
    let decide = serde_json::json!({"instance":"edge-1","limits":[
        {"namespace":"api","identifier":"shared","limit":100,"duration":3_600_000_u64,"cost":0}]});
    let r = us.post("/v1/origin/decide", None, decide).await;
    assert_eq!(r.body["results"][0]["current"]["global"], 60, "{}", r.text);
    assert_eq!(r.body["results"][0]["current"]["regional"], 40);
    assert_eq!(r.body["results"][0]["remaining"], 0);
    assert_eq!(
        global(&us).metrics.entries_created.get(),
        1,
        "us had not seen the key"
    );

    // An unchanged cell is not written again.
    let before = rows_written(&eu);
    global(&eu).flush_once(T0).await.unwrap();
    assert_eq!(rows_written(&eu), before);

    // Below the floor (20% of 100) nothing is written; at the floor it is.
    assert_eq!(admit(&eu, "quiet", 100, 19).await, 19);
    assert_eq!(global(&eu).flush_once(T0).await.unwrap(), 0);
    assert_eq!(admit(&eu, "quiet", 100, 1).await, 1);
    assert_eq!(global(&eu).flush_once(T0).await.unwrap(), 1);

    // A cell another region published is written even below the floor: us's 40 on "shared"
    // is above the floor anyway, so use a fresh key us published and eu touches once.
    assert_eq!(admit(&us, "theirs", 100, 25).await, 25);
    global(&us).flush_once(T0).await.unwrap();
    global(&eu)
        .sync_once(&eu.gateway.limiter.local, T0)
        .await
        .unwrap();
    let before = rows_written(&eu);
    assert_eq!(admit(&eu, "theirs", 100, 1).await, 1);
    assert_eq!(
        global(&eu).flush_once(T0).await.unwrap(),
        1,
        "1 of 100, written because us published"
    );
    assert_eq!(rows_written(&eu), before + 1);

    // A cold oversized request is denied locally and publishes nothing.
    let d = eu
        .gateway
        .limiter
        .decide(LimitRequest {
            key: key("oversized"),
            limit: 10,
            cost: 11,
        })
        .await;
    assert!(!d.success);
    assert_eq!(global(&eu).flush_once(T0).await.unwrap(), 0);

    // eu's origin loses its counts (a new gateway with a fresh embedded origin): the sync
    // brings back what eu had published as a lower bound, so it does not admit 100 again.
    let eu_again = region("eu", url).await;
    global(&eu_again)
        .sync_once(&eu_again.gateway.limiter.local, T0)
        .await
        .unwrap();
    // 60 own (published) + 40 us's (imported) = 100: nothing left.
    assert_eq!(
        admit(&eu_again, "shared", 100, 10).await,
        0,
        "own published count and foreign count both apply"
    );
    // And its own component is not counted twice: a key where only eu published 20.
    assert_eq!(
        admit(&eu_again, "quiet", 100, 100).await,
        80,
        "20 own + 80 new = the limit, not 60"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_regions_on_sqlite() {
    two_regions_share_usage(&temp_database()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_regions_on_mariadb() {
    let db = SharedDatabase::create(&format!("strata_regions_{}", std::process::id())).await;
    two_regions_share_usage(&db.url()).await;
    db.drop().await;
}

/// A region's Redis loses its data (FLUSHDB) after the region published: a gateway of that
/// region that has not seen the key still counts the published component, once, as a lower
/// bound on the regional count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_published_count_survives_a_flushed_redis() {
    let redis = common::redis::RedisServer::start();
    let url = temp_database();
    let on_redis = || {
        with_settings(Settings {
            region: Region::new("eu").unwrap(),
            database_url: url.clone(),
            redis_url: Some(redis.url()),
            ..Settings::default()
        })
    };
    let first = on_redis().await;
    assert_eq!(admit(&first, "k", 100, 60).await, 60);
    assert_eq!(global(&first).flush_once(T0).await.unwrap(), 1);

    let flushed = std::process::Command::new("redis-cli")
        .args(["-p", &redis.port.to_string(), "FLUSHDB"])
        .output()
        .unwrap();
    assert!(flushed.status.success());

    let second = on_redis().await;
    global(&second)
        .sync_once(&second.gateway.limiter.local, T0)
        .await
        .unwrap();
    assert_eq!(
        admit(&second, "k", 100, 100).await,
        40,
        "60 published + 40 = the limit, counted once"
    );
    let cell = second
        .gateway
        .limiter
        .local
        .lock(key("k"))
        .get(key("k"))
        .copied()
        .unwrap();
    assert_eq!(
        cell.current().counts().global,
        0,
        "own rows never land in global"
    );
}

/// The region view forgets cells once they expired (as the global table does), so it does not
/// grow for good with every key ever seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_region_view_drops_expired_cells() {
    let eu = region("eu", &common::temp_database()).await;
    assert_eq!(admit(&eu, "short-lived", 10, 3).await, 3);
    let global = &eu.gateway.limiter.global;
    assert_eq!(global.view_len(), 1, "the origin's answers are recorded");
    const HOUR: u64 = 3_600_000;
    assert_eq!(global.purge_expired(T0 + HOUR, 1_000), 0, "still live");
    // Three hours on, both cells of the one-hour window expired.
    assert_eq!(global.purge_expired(T0 + 3 * HOUR, 1_000), 1);
    assert_eq!(global.view_len(), 0);
}
