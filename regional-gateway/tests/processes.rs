//! Two real `strata-gateway` processes of one region on one Redis: what one admits, the other
//! counts, through Redis alone.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation
)] // test code: a panic is the failure report

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::redis::RedisServer;
use serde_json::{Value, json};

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn start_gateway(redis: &RedisServer, http: &reqwest::Client) -> (Process, String) {
    let port = common::free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_strata-gateway"))
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--redis-url",
            &redis.url(),
        ])
        .args(["--replay-interval", "20ms"])
        .arg("--data-dir")
        .arg(std::env::temp_dir().join(format!("strata-processes-{}-{port}", std::process::id())))
        .env("STRATA_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(r) = http.get(format!("{base}/readyz")).send().await {
            if r.status() == 200 {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "gateway on {port} not ready within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    (Process(child), base)
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> Value {
    let r = http.post(url).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_one_gateway_admits_the_other_counts() {
    let redis = RedisServer::start();
    let http = reqwest::Client::new();
    let (_a, a) = start_gateway(&redis, &http).await;
    let (_b, b) = start_gateway(&redis, &http).await;
    let limit =
        json!({"namespace":"api","identifier":"roaming","limit":10,"duration":2_592_000_000_u64});
    for _ in 0..10 {
        assert_eq!(
            post(&http, format!("{a}/v1/ratelimit"), limit.clone()).await["success"],
            true
        );
    }
    // Wait for A's replay to land in Redis, watching through B's origin API.
    let seq = strata_gateway::clock::Clock::system().now_ms() / 2_592_000_000;
    let cell = json!({"cells":[{"namespace":"api","identifier":"roaming","duration":2_592_000_000_u64,"sequence":seq}]});
    let deadline = Instant::now() + Duration::from_secs(10);
    while post(&http, format!("{b}/v1/origin/read"), cell.clone()).await["cells"][0]["regional"]
        != 10
    {
        assert!(Instant::now() < deadline, "A's replay never reached Redis");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // B has never seen the key: it decides at Redis, which holds A's 10, and denies.
    let r = post(&http, format!("{b}/v1/ratelimit"), limit.clone()).await;
    assert_eq!(r["success"], false, "{r}");
    assert_eq!(r["remaining"], 0);
}
