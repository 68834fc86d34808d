//! Load harness for `/v1/ratelimit`: C concurrent keep-alive connections for S seconds over K
//! keys, as fast as they go or at `--rate` requests/s in all; prints requests/s, latency percentiles and the origin round trips per 1,000 decisions
//! (from the gateway's `/metrics` before and after).
//!
//! ```text
//! cargo run --release -p strata-gateway &                       # or with --redis-url
//! cargo run --release -p strata-gateway --example loadgen -- --keys 1 --seconds 10
//! ```

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation
)] // a tool: a panic is the report

use std::time::{Duration, Instant};

use serde_json::json;

struct Args {
    url: String,
    keys: usize,
    concurrency: usize,
    seconds: u64,
    limit: u64,
    /// Requests/s over all connections; 0: as fast as they go.
    rate: u64,
}

fn args() -> Args {
    let mut a = Args {
        url: "http://127.0.0.1:8080".into(),
        keys: 1,
        concurrency: 32,
        seconds: 10,
        limit: 1_000_000_000,
        rate: 0,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let value = pair.get(1).cloned().unwrap_or_default();
        match pair[0].as_str() {
            "--url" => a.url = value,
            "--keys" => a.keys = value.parse().expect("--keys N"),
            "--concurrency" => a.concurrency = value.parse().expect("--concurrency N"),
            "--seconds" => a.seconds = value.parse().expect("--seconds N"),
            "--limit" => a.limit = value.parse().expect("--limit N"),
            "--rate" => a.rate = value.parse().expect("--rate N"),
            other => panic!(
                "unknown flag {other}; flags: --url --keys --concurrency --seconds --limit --rate"
            ),
        }
    }
    a
}

/// Sum of every sample of `name` whose labels contain `filter`.
fn metric(text: &str, name: &str, filter: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(filter))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

async fn scrape(http: &reqwest::Client, url: &str) -> (u64, u64, u64) {
    let text = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    (
        metric(&text, "strata_decisions_total", ""),
        metric(&text, "strata_origin_calls_total", "op=\"read\""),
        metric(&text, "strata_origin_calls_total", "op=\"replay\""),
    )
}

#[tokio::main]
async fn main() {
    let a = args();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(a.concurrency)
        .build()
        .unwrap();
    let before = scrape(&http, &a.url).await;
    let end = Instant::now() + Duration::from_secs(a.seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..a.concurrency {
        let (http, url, keys, limit) = (
            http.clone(),
            format!("{}/v1/ratelimit", a.url),
            a.keys,
            a.limit,
        );
        // Each connection's share of the rate, as one request per tick.
        let mut pace = (a.rate > 0).then(|| {
            let mut i = tokio::time::interval(Duration::from_secs_f64(
                a.concurrency as f64 / a.rate as f64,
            ));
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut n = t;
            while Instant::now() < end {
                if let Some(p) = pace.as_mut() {
                    p.tick().await;
                }
                let body = json!({"namespace":"load","identifier":format!("key-{}", n % keys),"limit":limit,"duration":60_000});
                let sent = Instant::now();
                let r = http.post(&url).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200);
                let _ = r.bytes().await.unwrap();
                latencies.push(sent.elapsed().as_micros() as u32);
                n += a_stride(keys);
            }
            latencies
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let elapsed = started.elapsed().as_secs_f64();
    let after = scrape(&http, &a.url).await;
    all.sort_unstable();
    let pct = |p: f64| {
        all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    let decisions = after.0 - before.0;
    let (reads, replays) = (after.1 - before.1, after.2 - before.2);
    println!(
        "keys {} concurrency {} | {} requests in {:.1} s = {:.0} req/s | p50 {} us p99 {} us p99.9 {} us | origin per 1000 decisions: {:.2} reads + {:.2} replay batches",
        a.keys,
        a.concurrency,
        all.len(),
        elapsed,
        all.len() as f64 / elapsed,
        pct(0.50),
        pct(0.99),
        pct(0.999),
        reads as f64 * 1000.0 / decisions.max(1) as f64,
        replays as f64 * 1000.0 / decisions.max(1) as f64,
    );
}

/// Step through keys so concurrent tasks spread over them.
fn a_stride(keys: usize) -> usize {
    if keys > 1 { 7919 } else { 1 }
}
