//! Many tasks on one hot key in one process, on a multi-threaded runtime: exactly `limit` are
//! admitted per window, whether the key starts cold (many tasks at the origin at once) or
//! warm, and across a window rollover.

use crate::common;

use std::sync::Arc;

use common::{T0, embedded};
use strata_core::WindowDuration;
use strata_core::table::LimitRequest;
use strata_gateway::Gateway;

const TASKS: usize = 64;
const PER_TASK: usize = 100;

async fn burst(gateway: &Arc<Gateway>, identifier: &'static str, limit: u64) -> u64 {
    let mut handles = Vec::new();
    for _ in 0..TASKS {
        let gw = gateway.clone();
        handles.push(tokio::spawn(async move {
            let d = WindowDuration::from_ms(60_000).unwrap();
            let key = strata_core::WindowKeyRef::new("default", "api", identifier, d).unwrap();
            let mut admitted = 0_u64;
            for _ in 0..PER_TASK {
                let decision = gw
                    .limiter
                    .decide(LimitRequest {
                        key,
                        limit,
                        cost: 1,
                    })
                    .await;
                admitted += u64::from(decision.success);
                tokio::task::yield_now().await;
            }
            admitted
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await.unwrap();
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hot_cold_key_admits_exactly_the_limit() {
    let g = embedded(&[]).await;
    let admitted = burst(&g.gateway, "hot", 1_000).await;
    assert_eq!(admitted, 1_000, "{} requests on one key", TASKS * PER_TASK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_cold_requests_then_pass_under_the_lease() {
    let g = embedded(&[]).await;
    let admitted = burst(&g.gateway, "cold-crowd", 1_000_000).await;
    let requests = (TASKS * PER_TASK) as u64;
    assert_eq!(admitted, requests);
    let m = &g.gateway.limiter.metrics;
    let at_origin = m.origin_calls("decide");
    println!(
        "{TASKS} tasks on a cold key far from its limit: {at_origin} origin decisions for {requests} requests"
    );
    // Every task's first request may find the key cold at the same moment (each asks the
    // origin once); after that, leases cover the passes: decisions grow with the tasks, not
    // with the requests.
    {
        use strata_gateway::metrics::Source;
        let decided = [Source::Local, Source::Ahead, Source::Origin].map(|s| m.decisions(s));
        assert_eq!(decided.iter().sum::<u64>(), requests, "{decided:?}");
    }
    assert!(
        at_origin <= 2 * TASKS as u64,
        "{at_origin} origin decisions for {TASKS} tasks"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_next_window_admits_what_the_previous_window_leaves() {
    let g = embedded(&[]).await;
    assert_eq!(burst(&g.gateway, "rolling", 500).await, 500);
    // Halfway into the next window, half of the previous window's 500 still weighs.
    let next_half = (T0 / 60_000 + 1) * 60_000 + 30_000;
    g.clock.set(next_half);
    assert_eq!(burst(&g.gateway, "rolling", 500).await, 250);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn multi_limit_requests_racing_on_shared_keys_stay_within_every_limit() {
    let g = embedded(&[]).await;
    let mut handles = Vec::new();
    for t in 0..32_u64 {
        let gw = g.gateway.clone();
        handles.push(tokio::spawn(async move {
            let d = WindowDuration::from_ms(60_000).unwrap();
            let own = format!("user-{}", t % 4);
            let mut admitted = 0_u64;
            for _ in 0..50 {
                let limits = [
                    LimitRequest {
                        key: strata_core::WindowKeyRef::new("default", "user", &own, d).unwrap(),
                        limit: 60,
                        cost: 1,
                    },
                    LimitRequest {
                        key: strata_core::WindowKeyRef::new("default", "org", "acme", d).unwrap(),
                        limit: 200,
                        cost: 1,
                    },
                ];
                admitted += u64::from(gw.limiter.decide_all(&limits).await.success);
                tokio::task::yield_now().await;
            }
            admitted
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await.unwrap();
    }
    // 4 users x 60 = 240 would pass the user limits; the org limit caps it at exactly 200.
    assert_eq!(total, 200);
}
