//! What the edge adds to a request, in workerd on loopback: the same upstream reached through
//! a pass-through Worker and through the Strata edge (a warm key far from its limit), measured
//! in the same run with interleaved sequential requests (the edge without pass headers too),
//! then in alternating rounds of
//! `CONNECTIONS` requests in flight (requests/s, p50, p99), where a third contender is the edge
//! with `STRATA_HEADERS_ON_PASS=false` (a pass returns the upstream's response as it came,
//! without the copy that adding headers takes); then the bundle's size and the cost of one warm
//! decision inside the Wasm module (`bench/warm_decision.mjs`, under Node).
//!
//!     ./scripts/build-edge.sh && cargo build --release -p strata-gateway
//!     cargo bench -p strata-wasm-tests --bench edge_latency
//!     EDGE_VARS="STRATA_REPLAY_DELAY_MS=5000" cargo bench -p strata-wasm-tests --bench edge_latency
//!
//! `EDGE_VARS` (`NAME=value` pairs, space-separated) sets more variables of both edges, or
//! replaces the bench's own (`STRATA_RULES`): what a part of the edge's path adds, by turning
//! it off in the same harness.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a harness: a panic is the report

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::process::GatewayProcess;
use common::upstream::Upstream;
use common::workerd::Workerd;

const REQUESTS: usize = 5_000;
/// Requests in flight in a throughput round.
const CONNECTIONS: usize = 8;
/// How long a throughput round lasts.
const ROUND: Duration = Duration::from_secs(4);

/// One GET of `url` on the warm key: how long it took, or what came instead of a 200.
async fn warm_get(http: &reqwest::Client, url: &str) -> Result<Duration, String> {
    let t0 = Instant::now();
    let r = http
        .get(url)
        .header("x-api-key", "warm-key")
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = r.status();
    let body = r.text().await.map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("{url}: {status} {body}"));
    }
    Ok(t0.elapsed())
}

/// One throughput round against `base`: `CONNECTIONS` clients sending one request after
/// another for `ROUND`; requests/s and the sorted latencies.
async fn round(http: &reqwest::Client, base: &str) -> Result<(f64, Vec<Duration>), String> {
    let started = Instant::now();
    let deadline = started + ROUND;
    let clients: Vec<_> = (0..CONNECTIONS)
        .map(|_| {
            let (http, url) = (http.clone(), format!("{base}/items"));
            tokio::spawn(async move {
                let mut times = Vec::new();
                while Instant::now() < deadline {
                    times.push(warm_get(&http, &url).await?);
                }
                Ok::<_, String>(times)
            })
        })
        .collect();
    let mut times = Vec::new();
    for c in clients {
        times.extend(c.await.unwrap()?);
    }
    times.sort();
    #[allow(clippy::cast_precision_loss)] // a request count
    let rate = times.len() as f64 / started.elapsed().as_secs_f64();
    Ok((rate, times))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let http = reqwest::Client::new();
    let upstream = Upstream::start().await;
    let mut gateway = GatewayProcess::start(&[]);
    gateway.ready(&http).await;
    let rules = r#"{"rules": [{"name": "per-key", "namespace": "bench", "limit": 1000000000,
        "duration": "1h", "actions": [{"request_headers": {"header_name": "x-api-key",
        "descriptor_key": "key"}}]}]}"#;
    let extra = std::env::var("EDGE_VARS").unwrap_or_default();
    let vars = |more: &[(&'static str, &'static str)]| {
        let mut vars: Vec<(&str, &str)> = vec![
            ("STRATA_GATEWAY_URL", &gateway.base),
            ("STRATA_UPSTREAM", &upstream.base),
            ("STRATA_RULES", rules),
        ];
        vars.extend_from_slice(more);
        for pair in extra.split_whitespace() {
            let (name, value) = pair.split_once('=').expect("EDGE_VARS: NAME=value pairs");
            vars.retain(|(n, _)| *n != name);
            vars.push((name, value));
        }
        vars
    };
    let mut edge = Workerd::proxy(&vars(&[]));
    let mut bare_passes = Workerd::proxy(&vars(&[("STRATA_HEADERS_ON_PASS", "false")]));
    let mut plain = Workerd::example_from(
        &common::root().join("wasm-tests/bench/passthrough.mjs"),
        &[("STRATA_UPSTREAM", &upstream.base)],
    );
    edge.ready().await;
    bare_passes.ready().await;
    plain.ready().await;

    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    let targets = [
        plain.base.clone(),
        edge.base.clone(),
        bare_passes.base.clone(),
    ];
    for i in 0..(REQUESTS + 500) * targets.len() {
        let which = i % targets.len();
        let url = format!("{}/items", targets[which]);
        let took = warm_get(&http, &url)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", edge.log()));
        if i >= 500 * targets.len() {
            times[which].push(took); // the first 500 of each warm up
        }
    }
    for t in &mut times {
        t.sort();
    }
    let [p, e, b] = &times;
    println!(
        "edge latency in workerd on loopback, {REQUESTS} sequential requests each, interleaved:"
    );
    let (p50, p99) = (
        common::percentile_us(p, 0.5),
        common::percentile_us(p, 0.99),
    );
    println!("  pass-through worker   p50 {p50:7.0} us   p99 {p99:7.0} us");
    for (name, t) in [("strata edge (warm)", e), ("without pass headers", b)] {
        let (e50, e99) = (
            common::percentile_us(t, 0.5),
            common::percentile_us(t, 0.99),
        );
        println!(
            "  {name:<21} p50 {e50:7.0} us   p99 {e99:7.0} us   added p50 {:+5.0} us   p99 {:+5.0} us",
            e50 - p50,
            e99 - p99
        );
    }
    println!(
        "throughput, {CONNECTIONS} requests in flight, alternating rounds of {} s:",
        ROUND.as_secs()
    );
    for n in 1..=3 {
        let rounds = (
            round(&http, &plain.base).await,
            round(&http, &edge.base).await,
            round(&http, &bare_passes.base).await,
        );
        let (Ok((pr, pt)), Ok((er, et)), Ok((br, bt))) = rounds else {
            panic!("{rounds:?}\n{}\n{}", plain.log(), edge.log());
        };
        println!(
            "  round {n}: pass-through {pr:6.0} req/s p50 {:5.0} us p99 {:5.0} us | strata edge \
             {er:6.0} req/s p50 {:5.0} us p99 {:5.0} us | {:.2}x, p99 {:+.0} us | without pass \
             headers {br:6.0} req/s | {:.2}x, p99 {:+.0} us",
            common::percentile_us(&pt, 0.5),
            common::percentile_us(&pt, 0.99),
            common::percentile_us(&et, 0.5),
            common::percentile_us(&et, 0.99),
            er / pr,
            common::percentile_us(&et, 0.99) - common::percentile_us(&pt, 0.99),
            br / pr,
            common::percentile_us(&bt, 0.99) - common::percentile_us(&pt, 0.99),
        );
    }
    let dist = common::root().join("edge/dist");
    let wasm = std::fs::metadata(dist.join("strata_edge_bg.wasm"))
        .unwrap()
        .len();
    let glue = std::fs::metadata(dist.join("strata_edge.js"))
        .unwrap()
        .len();
    let worker = std::fs::metadata(dist.join("worker.mjs")).unwrap().len();
    println!(
        "bundle: strata_edge_bg.wasm {wasm} B, strata_edge.js {glue} B, worker.mjs {worker} B"
    );
    let node = std::process::Command::new("node")
        .arg("wasm-tests/bench/warm_decision.mjs")
        .current_dir(common::root())
        .output()
        .unwrap();
    print!("{}", String::from_utf8_lossy(&node.stdout));
    assert!(node.status.success(), "{node:?}");
}
