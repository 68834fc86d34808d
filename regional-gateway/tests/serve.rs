//! The gateway over a real socket: `run` serves, the replay loop delivers accepted cost to the
//! origin in the background, and shutdown drains it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation
)] // test code: a panic is the failure report

use std::time::{Duration, Instant};

use serde_json::{Value, json};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_replays_in_the_background_and_drains_on_shutdown() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let settings = Settings {
        replay_interval: Duration::from_millis(20),
        database_url: format!(
            "sqlite://{}",
            std::env::temp_dir()
                .join(format!("strata-serve-{}.db", std::process::id()))
                .display()
        ),
        ..Settings::default()
    };
    let gateway = Gateway::new(settings, Clock::system()).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(strata_gateway::run(gateway.clone(), listener, async {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::new();
    let decide = |id: &'static str| {
        let http = http.clone();
        let url = format!("{base}/v1/ratelimit");
        async move {
            let r = http
                .post(url)
                .json(&json!({"namespace":"api","identifier":id,"limit":100,"duration":60_000}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.json::<Value>().await.unwrap()
        }
    };
    for _ in 0..5 {
        assert_eq!(decide("e2e").await["success"], true);
    }
    let metrics_url = format!("{base}/metrics");
    eventually(
        "the 5 accepted requests reach the origin",
        Duration::from_secs(5),
        async || {
            let text = http
                .get(&metrics_url)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            text.contains("strata_replay_queue_cells 0")
                && gateway.limiter.metrics.origin_calls("replay") > 0
        },
    )
    .await;
    let seq = Clock::system().now_ms() / 60_000;
    let read = http
        .post(format!("{base}/v1/origin/read"))
        .json(&json!({"cells":[{"namespace":"api","identifier":"e2e","duration":60_000,"sequence":seq}]}))
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(
        read["cells"][0]["regional"], 5,
        "the origin counted what was replayed"
    );

    // Accepted just before shutdown: drained by the shutdown, not lost.
    decide("late").await;
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    assert!(
        gateway.limiter.replay.is_empty(),
        "shutdown drained the queue"
    );
}
