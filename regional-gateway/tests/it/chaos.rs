//! Chaos, every part a real process: two `strata-gateway` processes of one region under steady
//! load, on a private Redis (append-only, fsync always: what production should run) and a
//! private MariaDB. Redis is killed and restarted, the database is stopped for 20 s, and one
//! gateway is restarted (SIGTERM, then a new process). Afterwards:
//! - no client saw anything but a 200;
//! - every accepted request is counted exactly once in Redis (the region's count of each cell
//!   equals the passes the clients saw), and in the global table once it flushed;
//! - the origin breaker closed again on both gateways (`strata_origin_up 1`, `/readyz` 200).

use crate::common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::mariadb::MariaDbServer;
use common::process::GatewayProcess;
use common::redis::RedisServer;
use serde_json::{Value, json};

const DAY_MS: u64 = 86_400_000;
const KEYS: usize = 4;
// Never reached: every request should pass, and count.
const LIMIT: u64 = 1_000_000;

fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// What the clients saw.
#[derive(Default)]
struct Seen {
    accepted: BTreeMap<String, u64>,
    requests: u64,
    errors: Vec<String>,
    /// The gateway the request in flight went to.
    in_flight: Option<String>,
}

/// Sends requests to the live gateways, one after another, until `stop`; records passes per
/// key and anything that was not a 200.
async fn load(live: Arc<Mutex<Vec<String>>>, seen: Arc<Mutex<Seen>>, stop: Arc<Mutex<bool>>) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let mut i = 0_usize;
    while !*stop.lock().unwrap() {
        let base = {
            let live = live.lock().unwrap();
            live[i % live.len()].clone()
        };
        seen.lock().unwrap().in_flight = Some(base.clone());
        let id = format!("k{}", i % KEYS);
        i += 1;
        let body =
            json!({"namespace": "chaos", "identifier": id, "limit": LIMIT, "duration": DAY_MS});
        let outcome = match http
            .post(format!("{base}/v1/ratelimit"))
            .json(&body)
            .send()
            .await
        {
            Ok(r) if r.status() == 200 => r.json::<Value>().await.map_err(|e| e.to_string()),
            Ok(r) => Err(format!("status {}", r.status())),
            Err(e) => Err(e.to_string()),
        };
        let mut seen = seen.lock().unwrap();
        seen.in_flight = None;
        seen.requests += 1;
        match outcome {
            Ok(v) if v["success"] == true => *seen.accepted.entry(id).or_default() += 1,
            Ok(_) => {}
            Err(e) => seen.errors.push(format!("{base}: {e}")),
        }
    }
}

/// The region's count of `id`'s cells (today's and, should the day end mid-test, the next
/// one's) as Redis holds it.
fn redis_count(redis: &RedisServer, id: &str, sequence: u64) -> u64 {
    (sequence..=sequence + 1)
        .map(|seq| {
            let key = format!("strata:{{default:chaos:{id}:{DAY_MS}}}:{seq}");
            redis.cli(&["HGET", &key, "n"]).parse::<u64>().unwrap_or(0)
        })
        .sum()
}

async fn metric(http: &reqwest::Client, base: &str, name: &str) -> f64 {
    common::metric_sum(&common::metrics(http, base).await, |l| l.starts_with(name))
}

fn gateway(redis: &RedisServer, db: &MariaDbServer) -> GatewayProcess {
    GatewayProcess::start(&[
        "--redis-url",
        &redis.url(),
        "--database-url",
        &db.url("strata_chaos"),
        "--region",
        "chaos",
        "--flush-interval",
        "1s",
        "--sync-interval",
        "1s",
        // Publish from 100 (0.01% of the limit): the test's cells pass it in their first
        // seconds (about 40 requests a second each), before the database stops, so flushes
        // fail while it is down however slowly a loaded machine sends. From 1,000 a cell
        // passed it only as the database came back on a loaded machine, and no flush failed.
        "--publish-floor",
        "0.0001",
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_under_load_lose_no_count_and_double_none() {
    let mut redis = RedisServer::start_persistent();
    let mut db = MariaDbServer::start();
    let admin = sqlx::MySqlPool::connect(&db.url("")).await.unwrap();
    sqlx::query("CREATE DATABASE strata_chaos")
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
    let http = reqwest::Client::new();
    let mut a = gateway(&redis, &db);
    let mut b = gateway(&redis, &db);
    a.ready(&http).await;
    b.ready(&http).await;
    let sequence = now_ms() / DAY_MS;

    let live = Arc::new(Mutex::new(vec![a.base.clone(), b.base.clone()]));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let stop = Arc::new(Mutex::new(false));
    let load = tokio::spawn(load(live.clone(), seen.clone(), stop.clone()));
    let phase = |d: u64| tokio::time::sleep(Duration::from_secs(d));

    phase(3).await;
    redis.stop(); // killed: SIGKILL
    phase(2).await;
    redis.restart();
    phase(3).await;
    db.stop();
    phase(20).await;
    db.restart();
    phase(2).await;
    // Restart b as an operator would: traffic off it (no request to it in flight: one sent
    // as the signal lands may meet a connection closing), SIGTERM (it drains), a new process.
    live.lock().unwrap().retain(|base| *base != b.base);
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.lock().unwrap().in_flight.as_deref() == Some(b.base.as_str()) {
        assert!(Instant::now() < deadline, "a request to b never ended");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(b.terminate(), Some(0), "b stops cleanly");
    let mut b2 = gateway(&redis, &db);
    b2.ready(&http).await;
    live.lock().unwrap().push(b2.base.clone());
    phase(3).await;
    *stop.lock().unwrap() = true;
    load.await.unwrap();

    let (accepted, requests, errors) = {
        let seen = seen.lock().unwrap();
        (seen.accepted.clone(), seen.requests, seen.errors.clone())
    };
    let total: u64 = accepted.values().sum();
    println!("chaos: {requests} requests, {total} accepted, errors {errors:?}");
    assert!(errors.is_empty(), "clients saw errors: {errors:?}");
    assert_eq!(total, requests, "every request passed (the limit is far)");
    assert!(total > 4_000, "the load ran: {total} requests");

    // Exactly once in Redis: polled until the replays settle (10 s at most).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let counts: BTreeMap<String, u64> = accepted
            .keys()
            .map(|id| (id.clone(), redis_count(&redis, id, sequence)))
            .collect();
        if counts == accepted {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Redis counts {counts:?}, the clients saw {accepted:?} accepted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The breaker closed again, and both saw the faults.
    for g in [&a, &b2] {
        let up = Duration::from_secs(10);
        common::process::await_gauge(&http, &g.base, "strata_origin_up", 1.0, up).await;
        assert_eq!(
            http.get(format!("{}/readyz", g.base))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
    }
    assert!(metric(&http, &a.base, "strata_global_write_errors_total").await > 0.0);

    // The global table holds the region's component of each cell once the flushes caught up.
    let pool = sqlx::MySqlPool::connect(&db.url("strata_chaos"))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let rows: Vec<(Vec<u8>, u64)> = sqlx::query_as(
            "SELECT identifier, CAST(SUM(count) AS UNSIGNED) FROM ratelimit_window_counts \
             WHERE region = 'chaos' GROUP BY identifier",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        let flushed: BTreeMap<String, u64> = rows
            .into_iter()
            .map(|(id, n)| (String::from_utf8(id).unwrap(), n))
            .collect();
        if flushed == accepted {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the global table holds {flushed:?}, the clients saw {accepted:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    pool.close().await;
}
