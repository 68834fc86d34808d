//! The gateway on a real Redis: two gateways of one region sharing it, many tasks on one hot
//! key, and Redis stopped mid-run and restarted.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation
)] // test code: a panic is the failure report

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::redis::RedisServer;
use common::{T0, TestGateway, with_settings};
use strata_core::table::LimitRequest;
use strata_core::{WindowDuration, WindowKeyRef};
use strata_gateway::Gateway;
use strata_gateway::config::Settings;
use strata_gateway::metrics::Source;

fn key(identifier: &str) -> WindowKeyRef<'_> {
    WindowKeyRef::new(
        "default",
        "api",
        identifier,
        WindowDuration::from_ms(60_000).unwrap(),
    )
    .unwrap()
}

async fn on_redis(redis: &RedisServer) -> TestGateway {
    with_settings(Settings {
        redis_url: Some(redis.url()),
        origin_timeout: Duration::from_millis(250),
        ..Settings::default()
    })
    .await
}

async fn decide(g: &Arc<Gateway>, identifier: &str, limit: u64) -> bool {
    g.limiter
        .decide(LimitRequest {
            key: key(identifier),
            limit,
            cost: 1,
        })
        .await
        .success
}

/// Polls `probe` until it holds or the deadline passes.
async fn eventually(what: &str, deadline: Duration, mut probe: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if probe().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("not within {deadline:?}: {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_of_one_region_converge_through_redis() {
    let redis = RedisServer::start();
    let (a, b) = (on_redis(&redis).await, on_redis(&redis).await);
    // What each gateway's presence loop does every second: the region's live count is the
    // peers prior of keys new at the origin.
    for g in [&a, &b, &a] {
        let limiter = &g.gateway.limiter;
        limiter.origin.presence(&limiter.instance, T0).await;
    }
    const LIMIT: u64 = 50;
    const REPLAY_EVERY: usize = 20; // requests between replays: 20 x 5 ms = the 100 ms interval
    let mut admitted = 0;
    for i in 0..400 {
        let g = if i % 2 == 0 { &a } else { &b };
        admitted += u64::from(decide(&g.gateway, "shared", LIMIT).await);
        a.clock.advance(5);
        b.clock.advance(5);
        if i % REPLAY_EVERY == REPLAY_EVERY - 1 {
            assert!(a.gateway.limiter.replay_once().await);
            assert!(b.gateway.limiter.replay_once().await);
        }
    }
    println!(
        "two gateways, limit {LIMIT}, 400 requests in 2 s, replay every 100 ms: admitted {admitted}"
    );
    // Near the limit each gateway decides at Redis, counting the other's possible unreplayed
    // passes as used: exact, give or take what the estimate misses.
    assert!(admitted >= LIMIT - 2, "under-admitted: {admitted}");
    assert!(admitted <= LIMIT + 2, "over-admitted: {admitted}");
    // Both now see the region's whole count.
    let seq = T0 / 60_000;
    for g in [&a, &b] {
        let r = g
            .gateway
            .limiter
            .origin
            .read(None, &[(key("shared"), seq)], T0)
            .await
            .unwrap();
        assert_eq!(r[0].0, admitted);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_tasks_on_one_hot_key_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let g = on_redis(&redis).await;
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let gw = g.gateway.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0_u64;
            for _ in 0..100 {
                n += u64::from(decide(&gw, "hot", 700).await);
            }
            n
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    assert_eq!(admitted, 700);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_run_falls_back_then_recovers_and_replays() {
    let mut redis = RedisServer::start();
    let g = on_redis(&redis).await;
    let gw = &g.gateway;
    for _ in 0..5 {
        assert!(decide(gw, "k", 100).await);
    }
    assert!(gw.limiter.replay_once().await);
    assert_eq!(g.get("/readyz").await.status, StatusCode::OK);

    redis.stop();
    // Stale now: the next decision tries Redis, fails within the timeout, decides locally.
    g.clock.advance(6_000);
    let started = Instant::now();
    for _ in 0..5 {
        assert!(
            decide(gw, "k", 100).await,
            "decisions go on from local memory"
        );
        g.clock.advance(400); // past the read retry delay: each one tries Redis again
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "each failed read is bounded by the timeout"
    );
    assert!(gw.limiter.metrics.decisions(Source::Fallback) >= 1);
    let ready = g.get("/readyz").await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ready.body["error"]["code"], "origin_unavailable");
    assert!(
        !gw.limiter.replay_once().await,
        "replay fails while Redis is down"
    );
    assert_eq!(gw.limiter.replay.len(), 1, "and keeps the cell queued");
    let m = g.get("/metrics").await;
    assert!(m.text.contains("strata_origin_up 0"));

    redis.restart();
    eventually("readiness recovers", Duration::from_secs(10), async || {
        g.get("/readyz").await.status == StatusCode::OK
    })
    .await;
    eventually(
        "replay resumes and drains",
        Duration::from_secs(10),
        async || gw.limiter.replay_once().await && gw.limiter.replay.is_empty(),
    )
    .await;
    // The restarted Redis lost the first 5 (it keeps nothing on disk); the 5 accepted while it
    // was down were queued and delivered.
    let seq = T0 / 60_000;
    let counts = gw
        .limiter
        .origin
        .read(None, &[(key("k"), seq)], g.clock.now_ms())
        .await
        .unwrap();
    assert_eq!(counts[0].0, 5);
    // And decisions read from Redis again.
    g.clock.advance(6_000);
    let before = gw.limiter.metrics.decisions(Source::Origin);
    assert!(decide(gw, "k", 100).await);
    assert_eq!(gw.limiter.metrics.decisions(Source::Origin), before + 1);
}
