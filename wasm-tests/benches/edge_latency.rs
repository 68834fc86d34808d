//! What the edge adds to a request, in workerd on loopback: the same upstream reached through
//! a pass-through Worker and through the Strata edge (a warm key far from its limit), measured
//! in the same run with interleaved sequential requests, then in rounds of `CONNECTIONS`
//! requests in flight (requests/s, p50, p99, and workerd's CPU per request); then the bundle's
//! size and the cost of one warm decision inside the Wasm module (`bench/warm_decision.mjs`,
//! under Node).
//!
//! The sequential requests run twice: on new isolates, then after `SETTLE` more requests each.
//! V8 compiles a Wasm function with Liftoff when first called and recompiles it with TurboFan,
//! on a background thread, once it has run its tiering budget; the edge's hot functions reach
//! it over an isolate's first 25,000 or so requests, and each compile takes the CPU a request
//! would have had (all of it, with the workerd pinned to one core). Each part prints how many
//! functions each workerd tiered up while it was measured (`--trace-wasm-compilation-times`,
//! which only prints), so a settled figure shows it was settled. The throughput rounds end with
//! what each contender allocated in V8's heap a request, and how often it was collected
//! (`--trace-gc-nvp`, which only prints): with requests in flight, a young-generation
//! collection pauses all of them, so the p99 follows it.
//!
//! Beside the edge: the edge with `STRATA_HEADERS_ON_PASS=false` (a pass returns the upstream's
//! response as it came, without the copy that adding headers takes), and a second pass-through
//! Worker, the control: what it differs from the first by is the harness's own spread on this
//! machine.
//!
//! With requests in flight the load is a closed loop: the mean latency is `CONNECTIONS` over
//! the throughput (Little's law), so a contender at 0.85x of the pass-through's requests/s
//! waits 1/0.85 as long on average, and its percentiles grow with it. The CPU per request is
//! the cost that moves least with how the machine shares its cores.
//!
//!     ./scripts/build-edge.sh && cargo build --release -p strata-gateway
//!     cargo bench -p strata-wasm-tests --bench edge_latency
//!     EDGE_VARS="STRATA_REPLAY_DELAY_MS=5000" cargo bench -p strata-wasm-tests --bench edge_latency
//!     EDGE_CPUS=0 taskset -c 1 cargo bench -p strata-wasm-tests --bench edge_latency
//!     EDGE_ROUNDS=0 EDGE_V8_FLAGS=--no-liftoff EDGE_CPUS=0 taskset -c 1 cargo bench -p strata-wasm-tests --bench edge_latency
//!
//! `EDGE_ROUNDS` sets the number of throughput rounds (0: the sequential parts only).
//! `EDGE_CONTROL` (a path from the repository's root) runs another Worker as the fourth
//! contender: `wasm-tests/bench/passthrough_headers.mjs` is the pass-through that adds two
//! `RateLimit` headers to each response as the edge does, with no limiter at all.
//! `EDGE_SETTLE` sets the requests between the two sequential parts (0: the first only).
//! `EDGE_VARS` (`NAME=value` pairs, space-separated) sets more variables of both edges, or
//! replaces the bench's own (`STRATA_RULES`): what a part of the edge's path adds, by turning
//! it off in the same harness. `EDGE_CPUS` (a taskset list) pins the workerds; with the bench
//! itself under `taskset -c 1`, the client, the upstream and the gateway (which inherits the
//! bench's CPU) stay off the measured workerds' core. `EDGE_V8_FLAGS` sets every workerd's V8
//! flags (`--no-liftoff`: Wasm compiled by TurboFan up front, no tier-up while requests run).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a harness: a panic is the report

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::process::GatewayProcess;
use common::upstream::Upstream;
use common::workerd::{Heap, Workerd};

const REQUESTS: usize = 5_000;
/// Requests in flight in a throughput round.
const CONNECTIONS: usize = 8;
/// How long a throughput round lasts.
const ROUND: Duration = Duration::from_secs(4);
/// Requests each contender serves between the two sequential parts, `CONNECTIONS` in flight:
/// past what V8 takes to tier the edge's hot Wasm functions up (about 25,000 requests; its
/// tiering budget is 13 million bytes executed per function). `EDGE_SETTLE` sets another
/// number; 0 skips the settled part.
const SETTLE: usize = 40_000;
/// Throughput rounds, each running every contender once (`EDGE_ROUNDS` sets another number;
/// 0 measures the sequential requests only).
const ROUNDS: usize = 4;

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

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

/// Load on `base`: `CONNECTIONS` clients each sending one request after another, for `length`
/// or `each` requests, whichever comes first; requests/s and the sorted latencies.
async fn load(
    http: &reqwest::Client,
    base: &str,
    length: Duration,
    each: usize,
) -> Result<(f64, Vec<Duration>), String> {
    let started = Instant::now();
    let deadline = started.checked_add(length);
    let clients: Vec<_> = (0..CONNECTIONS)
        .map(|_| {
            let (http, url) = (http.clone(), format!("{base}/items"));
            tokio::spawn(async move {
                let mut times = Vec::new();
                while times.len() < each && deadline.is_none_or(|d| Instant::now() < d) {
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

/// What a contender served over the throughput rounds, and what V8's collections logged
/// meanwhile.
#[derive(Default)]
struct Rounds {
    requests: u64,
    heap: Heap,
}

/// `REQUESTS` sequential requests to each contender in turn, after 500 each to warm up; each
/// contender's sorted latencies.
async fn sequential(
    http: &reqwest::Client,
    contenders: &[(&str, &Workerd); 4],
) -> [Vec<Duration>; 4] {
    let mut times: [Vec<Duration>; 4] = Default::default();
    for i in 0..(REQUESTS + 500) * contenders.len() {
        let which = i % contenders.len();
        let (name, workerd) = contenders[which];
        let took = warm_get(http, &format!("{}/items", workerd.base))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}\n{}", workerd.log()));
        if i >= 500 * contenders.len() {
            times[which].push(took);
        }
    }
    for t in &mut times {
        t.sort();
    }
    times
}

/// The sequential figures against the first contender, and how many Wasm functions V8 tiered
/// up in each workerd while they were measured.
fn print_sequential(
    what: &str,
    contenders: &[(&str, &Workerd); 4],
    times: &[Vec<Duration>; 4],
    tier_ups: [usize; 4],
) {
    println!(
        "edge latency in workerd on loopback, {REQUESTS} sequential requests each, interleaved: {what}"
    );
    let (p50, p99) = (
        common::percentile_us(&times[0], 0.5),
        common::percentile_us(&times[0], 0.99),
    );
    println!(
        "  {:<21} p50 {p50:7.0} us   p99 {p99:7.0} us                                   tier-ups {}",
        contenders[0].0, tier_ups[0]
    );
    for (((name, _), t), ups) in contenders.iter().zip(times).zip(tier_ups).skip(1) {
        let (e50, e99) = (
            common::percentile_us(t, 0.5),
            common::percentile_us(t, 0.99),
        );
        println!(
            "  {name:<21} p50 {e50:7.0} us   p99 {e99:7.0} us   added p50 {:+5.0} us   p99 {:+5.0} us   tier-ups {ups}",
            e50 - p50,
            e99 - p99
        );
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let http = reqwest::Client::new();
    common::workerd::trace_v8();
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
    let passthrough = common::root().join("wasm-tests/bench/passthrough.mjs");
    let plain_vars = [("STRATA_UPSTREAM", upstream.base.as_str())];
    let mut plain = Workerd::example_from(&passthrough, &plain_vars);
    // The control: a second pass-through, identical to the first. What it "adds" to the first
    // is the harness's own spread, the resolution every other figure is read against.
    // `EDGE_CONTROL` names another Worker in its place (one that only adds headers, say).
    let control =
        std::env::var("EDGE_CONTROL").map_or(passthrough.clone(), |p| common::root().join(p));
    let mut twin = Workerd::example_from(&control, &plain_vars);
    for w in [&mut edge, &mut bare_passes, &mut plain, &mut twin] {
        w.ready().await;
    }
    let contenders: [(&str, &Workerd); 4] = [
        ("pass-through", &plain),
        ("strata edge (warm)", &edge),
        ("without pass headers", &bare_passes),
        (
            if control == passthrough {
                "second pass-through"
            } else {
                "control (EDGE_CONTROL)"
            },
            &twin,
        ),
    ];

    let mut tier_ups = contenders.map(|(_, w)| w.tier_ups());
    let young = sequential(&http, &contenders).await;
    let tiered = |tier_ups: &mut [usize; 4]| {
        let now = contenders.map(|(_, w)| w.tier_ups());
        let during = std::array::from_fn(|i| now[i] - tier_ups[i]);
        *tier_ups = now;
        during
    };
    print_sequential(
        "a new isolate's first requests, while V8 tiers the module's hot functions up",
        &contenders,
        &young,
        tiered(&mut tier_ups),
    );
    let settle = std::env::var("EDGE_SETTLE")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(SETTLE);
    if settle > 0 {
        let started = Instant::now();
        for (name, workerd) in contenders {
            load(&http, &workerd.base, Duration::MAX, settle / CONNECTIONS)
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}\n{}", workerd.log()));
        }
        println!(
            "settled: {settle} more requests each, {CONNECTIONS} in flight ({:.0} s); tier-ups \
             meanwhile: {:?}",
            started.elapsed().as_secs_f64(),
            tiered(&mut tier_ups)
        );
        let steady = sequential(&http, &contenders).await;
        print_sequential(
            "the same isolates, settled",
            &contenders,
            &steady,
            tiered(&mut tier_ups),
        );
    }
    println!(
        "throughput, {CONNECTIONS} requests in flight, rounds of {} s, each contender in turn \
         (the order rotating), against the pass-through of the same round; CPU is workerd's \
         own per request:",
        ROUND.as_secs()
    );
    // Per contender after the first: each round's ratio and p99 added, for the medians.
    let mut ratios: [Vec<f64>; 4] = Default::default();
    let mut p99s: [Vec<f64>; 4] = Default::default();
    // Per contender: every round's latencies, for percentiles over all of them (a round's p99
    // rests on its slowest hundred requests, a few collections' worth).
    let mut pooled: [Vec<Duration>; 4] = Default::default();
    // Per contender over the rounds: requests, and what V8's collections logged meanwhile.
    let mut heaps: [Rounds; 4] = Default::default();
    let rounds = std::env::var("EDGE_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(ROUNDS);
    for n in 0..rounds {
        let mut results = Vec::new();
        for k in 0..contenders.len() {
            let which = (n + k) % contenders.len();
            let (name, workerd) = contenders[which];
            let (cpu, heap) = (workerd.cpu_time(), workerd.heap());
            let (rate, t) = load(&http, &workerd.base, ROUND, usize::MAX)
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}\n{}", workerd.log()));
            let cpu = workerd.cpu_time().saturating_sub(cpu);
            heaps[which].requests += t.len() as u64;
            heaps[which].heap.add_between(heap, workerd.heap());
            #[allow(clippy::cast_precision_loss)] // a request count
            let cpu_us = cpu.as_secs_f64() * 1e6 / t.len().max(1) as f64;
            results.push((which, rate, t, cpu_us));
        }
        results.sort_by_key(|r| r.0);
        let (base_rate, base_t) = (results[0].1, &results[0].2);
        let base_p99 = common::percentile_us(base_t, 0.99);
        let mut line = format!("  round {}:", n + 1);
        for (which, rate, t, cpu_us) in &results {
            let p99 = common::percentile_us(t, 0.99);
            line += &format!(
                "\n    {:<21} {rate:6.0} req/s {:.2}x  p50 {:5.0} us  p99 {p99:6.0} us ({:+6.0})  \
                 CPU {cpu_us:4.0} us/req",
                contenders[*which].0,
                rate / base_rate,
                common::percentile_us(t, 0.5),
                p99 - base_p99,
            );
            ratios[*which].push(rate / base_rate);
            p99s[*which].push(p99 - base_p99);
            pooled[*which].extend_from_slice(t);
        }
        println!("{line}");
    }
    println!("medians over the rounds (x the pass-through, p99 added):");
    for (which, (name, _)) in contenders.iter().enumerate().skip(1) {
        println!(
            "  {name:<21} {:.2}x  p99 {:+.0} us",
            median(&mut ratios[which]),
            median(&mut p99s[which])
        );
    }
    if rounds > 0 {
        for p in &mut pooled {
            p.sort();
        }
        let at = |which: usize, q: f64| common::percentile_us(&pooled[which], q);
        println!(
            "all rounds' requests together (the control's difference is the harness's spread):"
        );
        for (which, (name, _)) in contenders.iter().enumerate() {
            let added = |q: f64| at(which, q) - at(0, q);
            println!(
                "  {name:<21} {:6} requests  p50 {:5.0} us ({:+5.0})  p99 {:6.0} us ({:+6.0})  \
                 p99.9 {:6.0} us ({:+6.0})",
                pooled[which].len(),
                at(which, 0.5),
                added(0.5),
                at(which, 0.99),
                added(0.99),
                at(which, 0.999),
                added(0.999),
            );
        }
        println!(
            "V8's heap over the rounds (bytes allocated a request, to within a collection's \
             worth; young-generation collections, each a pause of every request in flight):"
        );
        for ((name, _), Rounds { requests, heap: h }) in contenders.iter().zip(&heaps) {
            #[allow(clippy::cast_precision_loss)] // counts
            let (requests, scavenges) = ((*requests).max(1) as f64, h.scavenges as f64);
            #[allow(clippy::cast_precision_loss)] // a byte count
            let allocated = h.allocated as f64;
            println!(
                "  {name:<21} {:5.0} B a request, {:4.1} scavenges per 10,000 requests, \
                 {:4.1} ms each, {:4.1} us of pause a request",
                allocated / requests,
                scavenges * 10_000.0 / requests,
                h.scavenge_ms / scavenges.max(1.0),
                h.scavenge_ms * 1_000.0 / requests,
            );
        }
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
