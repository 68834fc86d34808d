//! What the filter costs in Envoy on loopback, in one run: the same Envoy 1.40
//! (`--concurrency 2`) with no rate-limit filter, with Strata's filter (a warm key far from its
//! limit, decided from the VM's lease), and with Envoy's own `local_ratelimit` on the same
//! descriptor (the peer an Envoy operator would otherwise pick). Latency: sequential requests
//! on a kept-alive connection, interleaved over the three; throughput: 32 requests in flight
//! for 5 s each. Then the filter's size.
//!
//!     ./scripts/build-envoy.sh && cargo build --release -p strata-gateway
//!     cargo bench -p strata-wasm-tests --bench envoy_latency

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a harness: a panic is the report

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::envoy::{Envoy, Filters};
use common::process::GatewayProcess;
use common::upstream::{Upstream, port_of};

const REQUESTS: usize = 5_000;

async fn throughput(http: &reqwest::Client, base: &str) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs(5);
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (http, base, done) = (http.clone(), base.to_string(), done.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < until {
                let r = http
                    .get(&base)
                    .header("x-api-key", "warm-key")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                r.bytes().await.unwrap();
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    #[allow(clippy::cast_precision_loss)]
    let rate = done.load(Ordering::Relaxed) as f64 / 5.0;
    rate
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let http = reqwest::Client::new();
    let upstream = Upstream::start().await;
    let mut gateway = GatewayProcess::start(&[]);
    gateway.ready(&http).await;
    let config = r#"{"gateway_cluster": "strata_gateway", "region": "bench", "rules": [{
        "name": "per-key", "namespace": "bench", "limit": 1000000000, "duration": "1h",
        "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}]}]}"#;
    let filters = [
        ("no rate-limit filter", Filters::None),
        ("strata filter", Filters::Strata(config.to_string())),
        (
            "local_ratelimit",
            Filters::LocalRatelimit {
                tokens: 1_000_000_000,
                fill_s: 3600,
            },
        ),
    ];
    let mut envoys = Vec::new();
    for (_, f) in &filters {
        let mut e = Envoy::start_with(f, upstream.port(), Some(port_of(&gateway.base)));
        e.ready(&http).await;
        envoys.push(e);
    }
    let mut times = vec![Vec::new(); envoys.len()];
    for i in 0..(REQUESTS + 500) * envoys.len() {
        let which = i % envoys.len();
        let t0 = Instant::now();
        let r = http
            .get(format!("{}/items", envoys[which].base))
            .header("x-api-key", "warm-key")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", envoys[which].log());
        r.bytes().await.unwrap();
        if i >= 500 * envoys.len() {
            times[which].push(t0.elapsed());
        }
    }
    println!(
        "Envoy 1.40 --concurrency 2 on loopback, {REQUESTS} sequential requests each (interleaved), then 32 in flight for 5 s:"
    );
    let base = {
        let t = &mut times[0];
        t.sort();
        (
            common::percentile_us(t, 0.5),
            common::percentile_us(t, 0.99),
        )
    };
    for (((name, _), e), t) in filters.iter().zip(&envoys).zip(&mut times) {
        t.sort();
        let (p50, p99) = (
            common::percentile_us(t, 0.5),
            common::percentile_us(t, 0.99),
        );
        let rate = throughput(&http, &format!("{}/items", e.base)).await;
        println!(
            "  {name:22} p50 {p50:6.0} us (+{:4.0})   p99 {p99:6.0} us (+{:5.0})   {rate:7.0} req/s",
            p50 - base.0,
            p99 - base.1
        );
    }
    let size = std::fs::metadata(common::envoy::filter()).unwrap().len();
    println!("filter: strata_envoy.wasm {size} B");
}
