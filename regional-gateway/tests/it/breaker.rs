//! The origin breaker under a real slow Redis (`DEBUG SLEEP`): it opens, and closes again even
//! when the client carrying its half-open probe hangs up before the probe reports.

use crate::common;

use std::time::{Duration, Instant};

use common::redis::RedisServer;
use serde_json::json;
use strata_core::table::LimitRequest;
use strata_core::{WindowDuration, WindowKeyRef};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_closes_again_after_a_probe_whose_client_hung_up() {
    let redis = RedisServer::start();
    let g = common::on_redis(&redis, Duration::from_millis(100)).await;
    let request =
        |id: String| json!({"namespace":"api","identifier":id,"limit":10,"duration":60_000});
    let mut first = Vec::new();
    for i in 0..3 {
        first.push(
            g.post("/v1/ratelimit", None, request(format!("warm-{i}")))
                .await
                .status,
        );
    }
    assert!(
        first.iter().all(|s| s.is_success()),
        "Redis answers at first"
    );
    // Redis stalls: cold requests time out (and fall back to local memory) until the breaker
    // opens on the failure ratio.
    let mut stall = redis.stall("1.5");
    let mut cold = tokio::task::JoinSet::new();
    for n in 0..30 {
        let gw = g.gateway.clone();
        cold.spawn(async move {
            let id = format!("cold-{n}");
            let d = WindowDuration::from_ms(60_000).unwrap();
            let key = WindowKeyRef::new("default", "api", &id, d).unwrap();
            gw.limiter
                .decide(LimitRequest {
                    key,
                    limit: 10,
                    cost: 1,
                })
                .await
                .success
        });
    }
    let passed = cold.join_all().await;
    assert!(
        passed.iter().all(|p| *p),
        "fallback decisions from local memory"
    );
    let origin = &g.gateway.limiter.origin;
    assert!(origin.breaker_open(), "30 timeouts of 33 calls open it");
    stall.wait().unwrap();
    // The cooldown passes; Redis stalls again, and the request that carries the half-open
    // probe is dropped by its client before the probe can report.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let mut stall = redis.stall("0.5");
    let hung_up = tokio::time::timeout(
        Duration::from_millis(20),
        g.post("/v1/ratelimit", None, request("probe".into())),
    )
    .await;
    assert!(
        hung_up.is_err(),
        "the client hung up while the probe waited on Redis"
    );
    stall.wait().unwrap();
    // Redis answers again: some later request probes, and the breaker closes.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut k = 0;
    while origin.breaker_open() {
        assert!(
            Instant::now() < deadline,
            "the breaker stayed open after its probe was dropped"
        );
        let r = g
            .post("/v1/ratelimit", None, request(format!("after-{k}")))
            .await;
        assert_eq!(r.status, 200);
        k += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = g
        .post("/v1/ratelimit", None, request("closed".into()))
        .await;
    assert_eq!(r.body["success"], true);
    assert!(!origin.breaker_open());
}
