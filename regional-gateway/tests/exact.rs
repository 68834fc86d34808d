//! Exact near the limit, on real Redis: several gateways of one region (separate processes'
//! state in one test process, each on its own manual clock, replaying every 100 ms of
//! simulated time), a burst of 20x the limit, a paced client, an attack; Redis stopped during
//! a burst; and the Redis script agreeing with the embedded origin decision for decision.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation
)] // test code: a panic is the failure report

mod common;

use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::{TestGateway, with_settings};
use strata_core::table::LimitRequest;
use strata_core::{WindowDuration, WindowKeyRef};
use strata_gateway::config::Settings;
use strata_gateway::metrics::Source;
use strata_gateway::origin::DecideLimit;

const REPLAY_MS: u64 = 100;
/// A window boundary, so runs start at the beginning of a window.
const START: u64 = 1_700_000_040_000;

struct Region {
    gateways: Vec<TestGateway>,
    now: u64,
    /// Whether replays must succeed (false while the test has Redis stopped).
    origin_up: bool,
}

impl Region {
    async fn new(redis: &RedisServer, n: usize, band: bool) -> Self {
        let mut gateways = Vec::new();
        for _ in 0..n {
            let g = with_settings(Settings {
                redis_url: Some(redis.url()),
                band,
                ..Settings::default()
            })
            .await;
            g.clock.set(START);
            gateways.push(g);
        }
        // What each gateway's presence loop does every second: announce itself, learn the
        // region's live count (the peers prior of keys new at the origin).
        for g in &gateways {
            g.gateway
                .limiter
                .origin
                .presence(&g.gateway.limiter.instance, START)
                .await;
        }
        for g in &gateways {
            g.gateway
                .limiter
                .origin
                .presence(&g.gateway.limiter.instance, START)
                .await;
        }
        Self {
            gateways,
            now: START,
            origin_up: true,
        }
    }

    /// Moves every clock to `to`, running each gateway's replay on its own staggered cadence.
    async fn advance(&mut self, to: u64) {
        let n = self.gateways.len() as u64;
        while self.now < to {
            let next = (self.now + 1).max(to.min(self.now + 1));
            self.now = next;
            for (i, g) in self.gateways.iter().enumerate() {
                g.clock.set(self.now);
                if (self.now + i as u64 * REPLAY_MS / n) % REPLAY_MS == 0 {
                    let delivered = g.gateway.limiter.replay_once().await;
                    assert!(delivered || !self.origin_up, "replay failed with Redis up");
                }
            }
        }
    }

    fn decisions_at_origin(&self) -> u64 {
        self.gateways
            .iter()
            .map(|g| g.gateway.limiter.metrics.origin_calls("decide"))
            .sum()
    }
}

fn key(d: WindowDuration) -> WindowKeyRef<'static> {
    WindowKeyRef::new("default", "api", "client", d).unwrap()
}

/// Sends `n` requests evenly over `span` ms from the region's current time, round-robin over
/// the gateways; returns the admitted count.
async fn traffic(region: &mut Region, d: WindowDuration, limit: u64, n: u64, span: u64) -> u64 {
    traffic_by_window(region, d, limit, n, span)
        .await
        .values()
        .sum()
}

/// [`traffic`], admitted per fixed window (sequence).
async fn traffic_by_window(
    region: &mut Region,
    d: WindowDuration,
    limit: u64,
    n: u64,
    span: u64,
) -> std::collections::BTreeMap<u64, u64> {
    let start = region.now;
    let mut admitted = std::collections::BTreeMap::new();
    for k in 0..n {
        let at = start + k * span / n;
        region.advance(at).await;
        let g = &region.gateways[(k as usize) % region.gateways.len()];
        let decision = g
            .gateway
            .limiter
            .decide(LimitRequest {
                key: key(d),
                limit,
                cost: 1,
            })
            .await;
        if decision.success {
            *admitted.entry(d.sequence(at)).or_default() += 1;
        }
    }
    region.advance(start + span).await;
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_20x_burst_over_two_and_five_gateways_stays_at_the_limit() {
    let d = WindowDuration::from_ms(60_000).unwrap();
    let limit = 100;
    for n in [2, 5] {
        let mut with = Vec::new();
        for band in [true, false] {
            let redis = RedisServer::start();
            let mut region = Region::new(&redis, n, band).await;
            let admitted = traffic(&mut region, d, limit, 20 * limit, 1_000).await;
            let per_1000 = region.decisions_at_origin() * 1_000 / (20 * limit);
            println!(
                "{n} gateways, 20x burst in 1 s, band {}: admitted {admitted} of {limit}, {per_1000} origin decisions / 1000 requests",
                if band { "on" } else { "off" }
            );
            with.push(admitted);
        }
        assert!(with[0] <= limit + 2, "band on over-admitted: {}", with[0]);
        assert!(with[0] >= limit - 2, "band on under-admitted: {}", with[0]);
        assert!(with[1] > with[0], "the band must matter: {with:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_paced_at_its_limit_over_five_gateways_gets_it_within_one_percent() {
    let d = WindowDuration::from_ms(10_000).unwrap();
    let (limit, windows) = (200, 4);
    for band in [true, false] {
        let redis = RedisServer::start();
        let mut region = Region::new(&redis, 5, band).await;
        let per_window =
            traffic_by_window(&mut region, d, limit, windows * limit, windows * 10_000).await;
        let admitted: u64 = per_window.values().sum();
        let ratio = admitted as f64 / (windows * limit) as f64;
        let worst = per_window.values().max().copied().unwrap_or(0) as f64 / limit as f64;
        let per_1000 = region.decisions_at_origin() * 1_000 / (windows * limit);
        println!(
            "paced at the limit over 5 gateways, band {}: admitted/allowed {ratio:.4}, worst window {worst:.3}, {per_1000} origin decisions / 1000",
            if band { "on" } else { "off" }
        );
        if band {
            assert!((0.99..=1.0).contains(&ratio), "{ratio}");
            assert!(worst <= 1.0, "a window admitted {worst}x its limit");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attack_at_10x_costs_round_trips_by_the_passes() {
    let redis = RedisServer::start();
    let d = WindowDuration::from_ms(10_000).unwrap();
    let limit = 50;
    let mut region = Region::new(&redis, 5, true).await;
    let requests = 3 * 10 * limit;
    let admitted = traffic(&mut region, d, limit, requests, 3 * 10_000).await;
    let per_request = region.decisions_at_origin() as f64 / requests as f64;
    println!(
        "10x attack over 5 gateways: admitted {admitted} of {}, {per_request:.3} origin decisions per request",
        3 * limit
    );
    assert!(admitted <= 3 * limit + 3, "{admitted}");
    assert!(
        per_request < 0.75,
        "{per_request} origin decisions per request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_gateway_far_from_the_limit_never_decides_at_the_origin() {
    let redis = RedisServer::start();
    let d = WindowDuration::from_ms(60_000).unwrap();
    let mut region = Region::new(&redis, 1, true).await;
    let admitted = traffic(&mut region, d, 1_000_000, 500, 4_000).await;
    assert_eq!(admitted, 500);
    let g = &region.gateways[0].gateway;
    assert_eq!(
        g.limiter.metrics.origin_calls("decide"),
        0,
        "the cold request was a shared read"
    );
    assert_eq!(g.limiter.metrics.origin_calls("read"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_during_a_burst_falls_back_then_origin_decisions_resume() {
    let mut redis = RedisServer::start();
    let d = WindowDuration::from_ms(60_000).unwrap();
    let mut region = Region::new(&redis, 3, true).await;
    let before = traffic(&mut region, d, 1_000, 300, 300).await;
    assert_eq!(before, 300);
    redis.stop();
    region.origin_up = false;
    // Past the freshness: every gateway's next request needs Redis, which is gone.
    region.advance(region.now + 6_000).await;
    let started = Instant::now();
    let during = traffic(&mut region, d, 1_000, 60, 600).await;
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "every failed call is bounded by the timeout"
    );
    assert_eq!(during, 60, "decisions go on from local memory");
    let fallbacks: u64 = region
        .gateways
        .iter()
        .map(|g| g.gateway.limiter.metrics.decisions(Source::Fallback))
        .sum();
    assert!(
        fallbacks >= 3,
        "each gateway's first stale request fell back: {fallbacks}"
    );
    redis.restart();
    // Reconnection and the breaker's cooldown run on real time: poll, with a deadline, until
    // the queued replays are delivered.
    let deadline = Instant::now() + Duration::from_secs(15);
    while !region
        .gateways
        .iter()
        .all(|g| g.gateway.limiter.replay.is_empty())
    {
        assert!(
            Instant::now() < deadline,
            "queued replays were not delivered after Redis came back"
        );
        region.advance(region.now + REPLAY_MS).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    region.origin_up = true;
    // The restarted Redis lost the decide script: the call by hash falls back to loading it.
    let limiter = &region.gateways[0].gateway.limiter;
    let probe = [DecideLimit {
        key: key(d),
        limit: 1_000_000,
        cost: 0,
        unseen: 0,
        global: [0, 0],
    }];
    let answer = limiter
        .origin
        .decide(&limiter.instance, &probe, region.now)
        .await;
    assert!(answer.is_ok(), "decide after a restart: {answer:?}");
    let at_origin: u64 = region
        .gateways
        .iter()
        .map(|g| g.gateway.limiter.metrics.decisions(Source::Origin))
        .sum();
    region.advance(region.now + 6_000).await;
    assert_eq!(traffic(&mut region, d, 1_000, 60, 600).await, 60);
    let after: u64 = region
        .gateways
        .iter()
        .map(|g| g.gateway.limiter.metrics.decisions(Source::Origin))
        .sum();
    assert!(after > at_origin, "the origin answers again");
}

/// The same sequence of decisions against the embedded origin and against Redis's script:
/// identical verdicts, remaining counts and cells, including counts and windows large enough
/// that a naive floating-point product would round differently.
#[tokio::test]
async fn the_redis_script_and_the_embedded_origin_agree() {
    let redis = RedisServer::start();
    let memory = with_settings(Settings::default()).await;
    let on_redis = with_settings(Settings {
        redis_url: Some(redis.url()),
        ..Settings::default()
    })
    .await;
    let month = WindowDuration::from_ms(30 * 24 * 3_600_000).unwrap();
    let minute = WindowDuration::from_ms(60_000).unwrap();
    let mut rng = 0x1234_5678_u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut now = 2_592_000_000 * 700 + 1; // just past a 30-day boundary
    for step in 0..400 {
        now += next() % 3_000_000;
        let (d, limit, cost) = if step % 2 == 0 {
            (
                month,
                9_000_000_000_000 + next() % 1_000,
                next() % 4_000_000_000_000,
            )
        } else {
            (minute, 1 + next() % 20, next() % 4)
        };
        let id = format!("k{}", next() % 3);
        let keys = [
            WindowKeyRef::new("default", "ns", &id, d).unwrap(),
            WindowKeyRef::new("default", "other", &id, minute).unwrap(),
        ];
        let limits: Vec<DecideLimit<'_>> = keys
            .iter()
            .take(1 + (step % 3 == 0) as usize)
            .map(|&key| DecideLimit {
                key,
                limit,
                cost,
                unseen: next() % 3,
                global: [next() % 5, next() % 5],
            })
            .collect();
        let a = memory
            .gateway
            .limiter
            .origin
            .decide("one", &limits, now)
            .await
            .unwrap();
        let b = on_redis
            .gateway
            .limiter
            .origin
            .decide("one", &limits, now)
            .await
            .unwrap();
        assert_eq!(a.success, b.success, "step {step}");
        for (x, y) in a.limits.iter().zip(&b.limits) {
            assert_eq!(x.decision, y.decision, "step {step}");
            assert_eq!(
                (x.sequence, x.current, x.previous),
                (y.sequence, y.current, y.previous),
                "step {step}"
            );
        }
    }
}
