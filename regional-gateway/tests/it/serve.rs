//! The gateway over a real socket: `run` serves, the replay loop delivers accepted cost to the
//! origin in the background, and shutdown drains what it has not delivered yet.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use strata_core::{WindowDuration, WindowKeyRef};
use strata_gateway::Gateway;
use strata_gateway::clock::Clock;
use strata_gateway::config::Settings;

/// Polls `probe` until it returns true or the deadline passes.
async fn eventually(what: &str, deadline: Duration, mut probe: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if probe().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("not within {deadline:?}: {what}");
}

/// A served gateway on the system clock, its base URL, and the sender that stops it.
struct Served {
    gateway: Arc<Gateway>,
    base: String,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn serve(replay_interval: Duration) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let settings = Settings {
        replay_interval,
        database_url: common::temp_database(),
        ..Settings::default()
    };
    let gateway = Gateway::new(settings, Clock::system()).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(strata_gateway::run(
        gateway.clone(),
        strata_gateway::Listeners {
            http: listener,
            rls: None,
        },
        async {
            let _ = stopped.await;
        },
    ));
    Served {
        gateway,
        base,
        stop,
        server,
    }
}

async fn decide(base: &str, id: &str) -> Value {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/ratelimit"))
        .json(&json!({"namespace":"api","identifier":id,"limit":100,"duration":60_000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json::<Value>().await.unwrap()
}

/// The embedded origin's count of `id`'s current cell and the one before (a test that
/// straddles a minute boundary counts the same).
async fn counted(gateway: &Gateway, id: &str) -> u64 {
    let key = WindowKeyRef::new(
        "default",
        "api",
        id,
        WindowDuration::from_ms(60_000).unwrap(),
    )
    .unwrap();
    let now = Clock::system().now_ms();
    let seq = now / 60_000;
    let read = gateway
        .limiter
        .origin
        .read(&[(key, seq), (key, seq - 1)], now)
        .await
        .unwrap();
    read.iter().sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_and_replays_in_the_background() {
    let s = serve(Duration::from_millis(20)).await;
    let base = &s.base;
    for _ in 0..5 {
        assert_eq!(decide(base, "e2e").await["success"], true);
    }
    let http = reqwest::Client::new();
    eventually(
        "the 5 accepted requests reach the origin",
        Duration::from_secs(5),
        async || {
            let text = common::metrics(&http, base).await;
            text.contains("strata_replay_queue_cells 0")
                && s.gateway.limiter.metrics.origin_calls("replay") > 0
        },
    )
    .await;
    let seq = Clock::system().now_ms() / 60_000;
    let cell =
        |seq: u64| json!({"namespace":"api","identifier":"e2e","duration":60_000,"sequence":seq});
    let read = http
        .post(format!("{base}/v1/origin/read"))
        .json(&json!({"cells":[cell(seq), cell(seq - 1)]}))
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    let regional = |i: usize| read["cells"][i]["regional"].as_u64().unwrap();
    assert_eq!(
        regional(0) + regional(1),
        5,
        "the origin counted what was decided there and what was replayed: {read}"
    );
    assert_eq!(
        regional(0) + regional(1),
        counted(&s.gateway, "e2e").await,
        "the endpoint reads the origin"
    );
    s.stop.send(()).unwrap();
    s.server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_what_the_replay_loop_has_not_delivered() {
    // The replay loop's first pass is an interval, an hour, after the start: only the
    // shutdown delivers.
    let s = serve(Duration::from_secs(3_600)).await;
    for _ in 0..3 {
        assert_eq!(decide(&s.base, "late").await["success"], true);
    }
    let passed_locally = s
        .gateway
        .limiter
        .metrics
        .decisions(strata_gateway::metrics::Source::Local);
    assert!(
        passed_locally > 0,
        "some passes were local, under the lease"
    );
    assert_eq!(s.gateway.limiter.unreplayed(), 1, "not delivered yet");
    assert_eq!(s.gateway.limiter.metrics.origin_calls("replay"), 0);
    s.stop.send(()).unwrap();
    s.server.await.unwrap().unwrap();
    assert_eq!(s.gateway.limiter.unreplayed(), 0, "shutdown drained it");
    assert_eq!(
        counted(&s.gateway, "late").await,
        3,
        "the origin counts every accepted request"
    );
}

/// The last global flush runs after the replay drain, so what the drain delivered is published
/// too (it raced the drain and could publish an older count).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_global_flush_follows_the_replay_drain() {
    let s = serve(Duration::from_secs(3_600)).await;
    let http = reqwest::Client::new();
    for _ in 0..6 {
        let body = json!({"namespace":"api","identifier":"pub","limit":10,"duration":60_000});
        let r = common::post_json(&http, format!("{}/v1/ratelimit", s.base), &body).await;
        assert_eq!(r["success"], true);
    }
    assert!(
        s.gateway.limiter.unreplayed() > 0,
        "local passes wait for the drain"
    );
    s.stop.send(()).unwrap();
    s.server.await.unwrap().unwrap();
    let global = &s.gateway.limiter.global;
    let now = Clock::system().now_ms();
    let rows = global
        .store
        .sync(&s.gateway.settings.region, now)
        .await
        .unwrap();
    let published: u64 = rows
        .iter()
        .filter(|r| r.key.as_ref().identifier() == "pub")
        .map(|r| r.own)
        .sum();
    assert_eq!(
        published, 6,
        "every accepted request reached the global table"
    );
}
