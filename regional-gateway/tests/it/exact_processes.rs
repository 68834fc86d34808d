//! Exact across real processes: several `strata-gateway` processes of one region on one private
//! Redis, started from the built binary with the defaults a user would run (default replay
//! interval, no `STRATA_*` settings inherited) but a 2 s origin timeout, driven over HTTP. Proves that
//! - five gateways under a burst of twenty times the limit, all at once, admit at most the limit
//!   (+5%) and not much less (the budget is used, nobody is wrongly denied a lot);
//! - two gateways hit at the same moment on a cold key of limit 1 admit it exactly once;
//! - a lone client on one gateway, while four others are live but idle, gets its whole budget,
//!   in order (no denial before the last admission);
//! - two gateways over a key's limit ask the origin about once per unit the window frees, not
//!   once per gateway (rivals);
//! - clients racing through one gateway on multi-limit requests that share a key get exactly
//!   that key's limit.

use crate::common;

use common::{client, fresh};

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::process::{GatewayProcess as Gateway, before_window_ends, unix_ms};
use common::redis::RedisServer;
use serde_json::{Value, json};
use tokio::sync::Barrier;

const HOUR_MS: u64 = 3_600_000;

/// How long the gateways here wait for Redis (300 ms by default). These tests measure how
/// exactly gateways decide while Redis answers; on two cores running the suite beside them a
/// call has taken longer than 300 ms, and the failure mode (tested on its own) then decided from
/// memory: 36 of a limit of 20 in a window, 121 of 100 in a burst.
const ORIGIN_TIMEOUT: [&str; 2] = ["--origin-timeout", "2s"];

/// A gateway process on `redis`, with the defaults a user would run but [`ORIGIN_TIMEOUT`].
fn start_gateway(redis: &RedisServer) -> Gateway {
    Gateway::start(&args(&redis.url(), &[]))
}

/// A gateway's arguments: Redis at `url`, `extra`, then [`ORIGIN_TIMEOUT`].
fn args<'a>(url: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    [&["--redis-url", url], extra, &ORIGIN_TIMEOUT].concat()
}

/// `n` gateways on `redis`, started together, each ready.
async fn start_gateways(redis: &RedisServer, n: usize) -> Vec<Gateway> {
    let mut gateways: Vec<Gateway> = (0..n).map(|_| start_gateway(redis)).collect();
    let http = client();
    for g in &mut gateways {
        g.ready(&http).await;
    }
    gateways
}

/// One `/v1/ratelimit` call: its answer (a 200 is asserted).
async fn ratelimit(http: &reqwest::Client, base: &str, body: &Value) -> Value {
    let r = http
        .post(format!("{base}/v1/ratelimit"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{base}: {body}");
    r.json().await.unwrap()
}

/// One `/v1/ratelimit` call for `identifier` at `limit` per hour: admitted or not.
async fn admit(http: &reqwest::Client, base: &str, identifier: &str, limit: u64) -> bool {
    let body = json!({"namespace":"api","identifier":identifier,"limit":limit,"duration":HOUR_MS});
    let answer = ratelimit(http, base, &body).await;
    answer["success"]
        .as_bool()
        .unwrap_or_else(|| panic!("{base}: no success in {answer}"))
}

/// The gateway's origin decide calls so far (all results), from `/metrics`.
async fn origin_decides(http: &reqwest::Client, base: &str) -> f64 {
    common::process::origin_calls(http, base, "decide").await
}

/// One client per gateway sending `/v1/ratelimit` for `identifier` (`limit` per `window_ms`)
/// every `every` for `run`: the requests sent, and the admissions by the window the gateway
/// counted each in (its `reset`, the window's end).
async fn paced_clients(
    gateways: &[Gateway],
    identifier: &str,
    limit: u64,
    window_ms: u64,
    every: Duration,
    run: Duration,
) -> (u64, std::collections::BTreeMap<u64, u64>) {
    let tasks: Vec<_> = gateways
        .iter()
        .map(|g| {
            let (base, identifier) = (g.base.clone(), identifier.to_string());
            tokio::spawn(async move {
                let http = client();
                let body = json!({"namespace":"api","identifier":identifier,"limit":limit,"duration":window_ms});
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let end = tokio::time::Instant::now() + run;
                let (mut sent, mut admitted_at) = (0_u64, Vec::new());
                while tokio::time::Instant::now() < end {
                    tick.tick().await;
                    let answer = ratelimit(&http, &base, &body).await;
                    sent += 1;
                    if answer["success"].as_bool() == Some(true) {
                        admitted_at.push(answer["reset"].as_u64().unwrap());
                    }
                }
                (sent, admitted_at)
            })
        })
        .collect();
    let (mut sent, mut by_window) = (0, std::collections::BTreeMap::<u64, u64>::new());
    for task in tasks {
        let (n, admitted_at) = task.await.unwrap();
        sent += n;
        for reset in admitted_at {
            *by_window.entry(reset).or_default() += 1;
        }
    }
    (sent, by_window)
}

/// The decide calls every one of `gateways` made to its origin so far.
async fn decides_at(http: &reqwest::Client, gateways: &[Gateway]) -> f64 {
    calls_at(http, gateways, "decide").await
}

/// The origin calls of kind `op` every gateway of `gateways` made so far.
async fn calls_at(http: &reqwest::Client, gateways: &[Gateway], op: &str) -> f64 {
    let mut sum = 0.0;
    for g in gateways {
        sum += common::process::origin_calls(http, &g.base, op).await;
    }
    sum
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_gateways_hold_a_burst_of_twenty_times_the_limit() {
    const GATEWAYS: usize = 5;
    const PER_GATEWAY: usize = 4;
    const LIMIT: u64 = 100;
    const EACH: usize = 100;
    const REPETITIONS: usize = 10;
    let requests = GATEWAYS * PER_GATEWAY * EACH;
    let redis = RedisServer::start();
    let gateways = start_gateways(&redis, GATEWAYS).await;
    // Four connections per gateway, each set up (one request on an unrelated key) beforehand.
    let connections: Vec<(reqwest::Client, String)> = (0..GATEWAYS * PER_GATEWAY)
        .map(|i| (client(), gateways[i % GATEWAYS].base.clone()))
        .collect();
    for (i, (http, base)) in connections.iter().enumerate() {
        admit(http, base, &fresh(&format!("warm-{i}")), 1_000).await;
    }
    let metrics = client();
    let mut runs = Vec::new();
    for rep in 0..REPETITIONS {
        let identifier = fresh(&format!("burst-{rep}"));
        let before = decides_at(&metrics, &gateways).await;
        let start = Arc::new(Barrier::new(connections.len()));
        let tasks: Vec<_> = connections
            .iter()
            .map(|(http, base)| {
                let (http, base) = (http.clone(), base.clone());
                let (identifier, start) = (identifier.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    let mut admitted = 0_u64;
                    for _ in 0..EACH {
                        admitted += u64::from(admit(&http, &base, &identifier, LIMIT).await);
                    }
                    admitted
                })
            })
            .collect();
        let mut admitted = 0;
        for task in tasks {
            admitted += task.await.unwrap();
        }
        let after = decides_at(&metrics, &gateways).await;
        let per_1000 = (after - before) * 1_000.0 / requests as f64;
        println!(
            "burst {rep}: admitted {admitted} of {requests} (limit {LIMIT}), origin decisions {per_1000:.1} per 1,000 requests"
        );
        runs.push((admitted, per_1000));
    }
    let min = runs.iter().map(|r| r.0).min().unwrap();
    let max = runs.iter().map(|r| r.0).max().unwrap();
    let decides = runs.iter().map(|r| r.1).sum::<f64>() / runs.len() as f64;
    println!(
        "burst: admitted min {min} / max {max} over {REPETITIONS} repetitions, origin decisions {decides:.1} per 1,000 requests"
    );
    for (rep, (admitted, _)) in runs.iter().enumerate() {
        assert!(
            *admitted <= LIMIT + LIMIT / 20,
            "repetition {rep}: {admitted} admitted, limit {LIMIT}"
        );
        assert!(
            *admitted >= LIMIT - LIMIT / 20,
            "repetition {rep}: only {admitted} admitted, limit {LIMIT}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_never_both_admit_a_cold_key_of_limit_one() {
    const KEYS: usize = 50;
    let redis = RedisServer::start();
    let gateways = start_gateways(&redis, 2).await;
    let (a, b) = (gateways[0].base.as_str(), gateways[1].base.as_str());
    // One client (one connection) per gateway, set up beforehand on an unrelated key.
    let (to_a, to_b) = (client(), client());
    admit(&to_a, a, &fresh("warm-a"), 1_000).await;
    admit(&to_b, b, &fresh("warm-b"), 1_000).await;
    let mut outcomes = Vec::with_capacity(KEYS);
    for k in 0..KEYS {
        let identifier = fresh(&format!("cold-{k}"));
        let (x, y) = tokio::join!(
            admit(&to_a, a, &identifier, 1),
            admit(&to_b, b, &identifier, 1)
        );
        outcomes.push((x, y));
    }
    let exactly_one = outcomes.iter().filter(|(x, y)| x != y).count();
    let both = outcomes.iter().filter(|(x, y)| *x && *y).count();
    let neither = outcomes.iter().filter(|(x, y)| !*x && !*y).count();
    println!(
        "cold key of limit 1, two gateways at once: exactly one admitted on {exactly_one} of {KEYS} keys, both on {both}, neither on {neither}"
    );
    for (k, (x, y)) in outcomes.iter().enumerate() {
        assert!(!(*x && *y), "key {k}: both gateways admitted (limit 1)");
        assert!(*x || *y, "key {k}: neither gateway admitted (limit 1)");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_client_gets_its_whole_budget_while_other_gateways_idle() {
    const LIMIT: u64 = 100;
    const REQUESTS: usize = 200;
    let redis = RedisServer::start();
    let gateways = start_gateways(&redis, 5).await;
    let http = client();
    // The four idle gateways are live and known at the origin: each has served a few requests.
    for (i, g) in gateways.iter().enumerate().skip(1) {
        for j in 0..3 {
            admit(&http, &g.base, &fresh(&format!("idle-{i}-{j}")), LIMIT).await;
        }
    }
    let identifier = fresh("lone");
    let mut outcomes = Vec::with_capacity(REQUESTS);
    for _ in 0..REQUESTS {
        outcomes.push(admit(&http, &gateways[0].base, &identifier, LIMIT).await);
    }
    let admitted = outcomes.iter().filter(|x| **x).count();
    let first_denial = outcomes.iter().position(|x| !*x);
    let pattern: String = outcomes
        .iter()
        .map(|x| if *x { '+' } else { '.' })
        .collect();
    println!("lone client, in order (+ admitted, . denied): {pattern}");
    println!(
        "lone client: admitted {admitted} of {REQUESTS} (limit {LIMIT}), first denial at request {}",
        first_denial.map_or_else(|| "none".to_string(), |i| (i + 1).to_string())
    );
    assert_eq!(admitted as u64, LIMIT, "admitted {admitted}, limit {LIMIT}");
    assert_eq!(
        first_denial,
        Some(LIMIT as usize),
        "a denial before the {LIMIT}th admission"
    );
}

/// Two gateway processes whose clients keep one key over its limit (20 per 2 s, about 150
/// requests a second through each for 8 s): each unit the sliding window frees shows in both
/// gateways' views at once. Before rivals both asked the origin for it and one was denied, so
/// there were about two decisions per admission; a gateway that lost such a race leaves the
/// next unit to the other, so about one. No fixed window admits more than the limit, and the
/// budget is used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_over_a_limit_ask_about_once_per_freed_unit() {
    const LIMIT: u64 = 20;
    const WINDOW_MS: u64 = 2_000;
    const RUN: Duration = Duration::from_secs(8);
    let redis = RedisServer::start();
    let gateways = start_gateways(&redis, 2).await;
    let identifier = fresh("rivals");
    let metrics = client();
    let before = decides_at(&metrics, &gateways).await;
    // Start 20 ms before a window ends, so the first lease is lent in a window about to roll
    // over and goes mostly unused: until the origin dropped such a lease once its holder asked
    // from the next window, both gateways asked on every request there (493 decisions for 85
    // admissions).
    before_window_ends(WINDOW_MS, 20).await;
    let every = Duration::from_millis(7);
    let (sent, by_window) =
        paced_clients(&gateways, &identifier, LIMIT, WINDOW_MS, every, RUN).await;
    let after = decides_at(&metrics, &gateways).await;
    let admitted: u64 = by_window.values().sum();
    let decides = after - before;
    println!(
        "two gateways over the limit: {sent} requests, {admitted} admitted ({by_window:?} by window end), {decides} origin decisions"
    );
    for (reset, n) in &by_window {
        assert!(
            *n <= LIMIT,
            "the window ending at {reset} admitted {n} of {LIMIT}"
        );
    }
    // Four windows at least, every one full but the first two (cold, then the previous
    // window's weight): at least 3 of the 4 windows' budget.
    let windows = RUN.as_millis() as u64 / WINDOW_MS;
    assert!(
        admitted >= LIMIT * (windows - 1),
        "only {admitted} admitted"
    );
    // About one decision per admission (two before rivals), with room for a loaded machine.
    assert!(
        decides <= 1.5 * admitted as f64,
        "{decides} origin decisions for {admitted} admissions"
    );
}

/// Three gateway processes sharing a key paced at its limit keep their pace from covering
/// leases: each is lent the room its own past passes free as the previous window decays, so
/// most requests pass from memory and no window admits more than the limit. The region is
/// alone (no other region announced), so what each lease covers is replayed as the lease
/// ends or with the holder's next decision, not on a turn every second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_paced_at_a_limit_keep_their_pace_from_covering_leases() {
    const GATEWAYS: usize = 3;
    // 200 costs per gateway, the least a covering lease needs (`lease::COVER_FACTOR`).
    const LIMIT: u64 = 600;
    const WINDOW_MS: u64 = 2_000;
    const RUN: Duration = Duration::from_secs(8);
    let redis = RedisServer::start();
    let gateways = start_gateways(&redis, GATEWAYS).await;
    let identifier = fresh("paced");
    let metrics = client();
    // Alone once two announcements, the second 2 s after the first, found no other region
    // (a second announcement an interval, 10 s, after the first would miss this deadline).
    for g in &gateways {
        let within = Duration::from_secs(8);
        common::process::await_gauge(&metrics, &g.base, "strata_global_alone", 1.0, within).await;
    }
    let before = decides_at(&metrics, &gateways).await;
    let replays_before = calls_at(&metrics, &gateways, "replay").await;
    // Each gateway's client at a third of the limit's rate: one request every 10 ms.
    let every = Duration::from_millis(10);
    let (sent, by_window) =
        paced_clients(&gateways, &identifier, LIMIT, WINDOW_MS, every, RUN).await;
    let after = decides_at(&metrics, &gateways).await;
    let replays = calls_at(&metrics, &gateways, "replay").await - replays_before;
    let admitted: u64 = by_window.values().sum();
    let decides = after - before;
    let per_1000 = decides * 1_000.0 / sent as f64;
    let replays_per_second = replays / (GATEWAYS as f64 * RUN.as_secs_f64());
    println!(
        "{GATEWAYS} gateways paced at a limit of {LIMIT} per 2 s: {sent} requests, {admitted} admitted ({by_window:?} by window end), {decides} origin decisions ({per_1000:.1} per 1,000), {replays} replay calls ({replays_per_second:.2} a gateway a second)"
    );
    for (reset, n) in &by_window {
        assert!(
            *n <= LIMIT,
            "the window ending at {reset} admitted {n} of {LIMIT}"
        );
    }
    // At (or, on a loaded machine, under) the limit's rate: nearly everything passes.
    assert!(admitted * 100 >= sent * 95, "{admitted} of {sent} admitted");
    assert!(
        per_1000 <= 100.0,
        "{per_1000:.1} origin decisions per 1,000"
    );
    // With a quiet turn each gateway replayed 1.5 cells a second (a turn a second, and the
    // lease ends); without, 0.38-0.58, and 0.04-0.33 once a decision in a new window delivers
    // the last one's tail.
    assert!(
        replays_per_second <= 0.75,
        "{replays} replay calls: {replays_per_second:.2} a gateway a second"
    );
}

/// A gateway lent a lease just before a window ends, then quiet: its next replay pass gives
/// back what is left (its clock left the window, so it admits nothing more under it). Kept
/// until it expired, the reservation weighed in the next window's previous term, which no
/// view sees, so the other gateway asked on every request there until the idle lease went
/// back a second later: 146 and 154 decisions for 32 admissions before, 11 and 21 for 31-33
/// since. Under load the lease's answer may be merged after the window ended; it is given
/// back all the same (`WindowState::apply_decided` keeps it on the previous cell for that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_left_behind_by_a_quiet_gateway_goes_back_with_its_next_replay() {
    const LIMIT: u64 = 20;
    const WINDOW_MS: u64 = 2_000;
    let redis = RedisServer::start();
    let gateways = start_gateways(&redis, 2).await;
    let http = client();
    // The first gateway's one request, 20 ms before the window ends, is lent a lease in that
    // window (its answer may be merged after the window ended, on a loaded machine). If the
    // request itself reached the gateway after the window ended, its lease is the new
    // window's, another case (an idle lease, given back after a second): the setup is made
    // again on a new key at the next window's end.
    let mut attempts = 0;
    let (body, before, window_end) = loop {
        attempts += 1;
        assert!(
            attempts <= 5,
            "no request reached the gateway before its window ended"
        );
        let identifier = fresh("left-behind");
        let body =
            json!({"namespace":"api","identifier":identifier,"limit":LIMIT,"duration":WINDOW_MS});
        let before = decides_at(&http, &gateways).await;
        let window_end = before_window_ends(WINDOW_MS, 20).await;
        let first = ratelimit(&http, &gateways[0].base, &body).await;
        assert_eq!(first["success"], true, "{first}");
        if first["reset"].as_u64() == Some(window_end) {
            break (body, before, window_end);
        }
    };
    // The second gateway's client keeps the key over its limit for 3 s from the next
    // window's start.
    tokio::time::sleep(Duration::from_millis(window_end.saturating_sub(unix_ms()))).await;
    let mut tick = tokio::time::interval(Duration::from_millis(7));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let end = tokio::time::Instant::now() + Duration::from_secs(3);
    let mut admitted = 1;
    while tokio::time::Instant::now() < end {
        tick.tick().await;
        let answer = ratelimit(&http, &gateways[1].base, &body).await;
        admitted += u64::from(answer["success"].as_bool() == Some(true));
    }
    let after = decides_at(&http, &gateways).await;
    let decides = after - before;
    println!(
        "a lease left behind by a quiet gateway: {admitted} admitted, {decides} origin decisions"
    );
    assert!(admitted >= LIMIT, "only {admitted} admitted");
    assert!(
        decides <= 1.3 * admitted as f64,
        "{decides} origin decisions for {admitted} admissions"
    );
}

/// Where Debian's libfaketime puts the preload library (the test command installs it).
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// Two gateway processes whose clocks disagree by 7 s (one runs under libfaketime) admit
/// exactly the limit: Redis keeps leases on its own clock, so the gateway ahead still counts
/// the lease the one behind holds (on the callers' clocks it would see it as expired while it
/// is in use).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_whose_clocks_disagree_by_seconds_admit_the_limit() {
    assert!(
        std::path::Path::new(FAKETIME).exists(),
        "{FAKETIME} is missing; ./scripts/test.sh installs libfaketime"
    );
    let redis = RedisServer::start();
    let url = redis.url();
    let args = args(&url, &[]);
    let mut behind = Gateway::start(&args);
    let skew = [
        ("LD_PRELOAD", FAKETIME),
        ("FAKETIME", "+7s"),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ];
    let mut ahead = Gateway::start_with_env(&args, &skew);
    let http = client();
    behind.ready(&http).await;
    ahead.ready(&http).await;
    // The skew is real: a cell 5 s ahead of the true time (one-second windows) is more than a
    // window ahead of the gateway behind, and within one of the gateway ahead.
    let now_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let replay = json!({"instance":"probe","events":[{"namespace":"skew","identifier":"probe","duration":1_000,"sequence":now_s + 6,"used":1,"limit":10}]});
    let status = |base: String| {
        let (http, replay) = (http.clone(), replay.clone());
        async move {
            let r = http
                .post(format!("{base}/v1/origin/replay"))
                .json(&replay)
                .send();
            r.await.unwrap().status().as_u16()
        }
    };
    assert_eq!(
        status(behind.base.clone()).await,
        400,
        "behind: too far ahead"
    );
    assert_eq!(
        status(ahead.base.clone()).await,
        200,
        "ahead: its clock is 7 s on"
    );

    const MONTH_MS: u64 = 2_592_000_000;
    // Under 64 times the cost: the first request waits for Redis's decision and its lease (at
    // 64 and over it would pass ahead, and the gateway behind, answered by its replay alone,
    // could pass one more ahead on that count: the bound the README states).
    const LIMIT: u64 = strata_core::policy::AHEAD_LIMIT_PER_COST - 1;
    let id = fresh("skewed");
    let body = json!({"namespace":"api","identifier":id,"limit":LIMIT,"duration":MONTH_MS});
    let admit = |base: String| {
        let (http, body) = (http.clone(), body.clone());
        async move {
            let r = http.post(format!("{base}/v1/ratelimit")).json(&body).send();
            let answer: Value = r.await.unwrap().json().await.unwrap();
            u64::from(answer["success"] == true)
        }
    };
    // The gateway behind takes a lease on the fresh key; the one ahead spends what is left;
    // then the one behind spends its lease.
    let mut admitted = admit(behind.base.clone()).await;
    for _ in 0..200 {
        admitted += admit(ahead.base.clone()).await;
    }
    for _ in 0..200 {
        admitted += admit(behind.base.clone()).await;
    }
    println!("clocks 7 s apart, 2 gateway processes: admitted {admitted} of 401 (limit {LIMIT})");
    assert_eq!(admitted, LIMIT);
}

/// Strict mode and the window rollover across processes: three gateways under a sustained
/// overload (eight clients, each sending as fast as it is answered) on a limit of 20 per
/// second for five seconds. Each pass is attributed to the fixed window its answer names
/// (`reset`); no window may admit more than the limit (+5%), and the sliding window must not
/// starve the clients either (at least half the limit per window on average).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_hold_the_limit_across_window_rollovers() {
    const LIMIT: u64 = 20;
    const SECOND_MS: u64 = 1_000;
    let redis = RedisServer::start();
    let gateways = start_gateways(&redis, 3).await;
    let identifier = fresh("rollover");
    let until = std::time::Instant::now() + Duration::from_secs(5);
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let (http, base) = (client(), gateways[i % gateways.len()].base.clone());
            let identifier = identifier.clone();
            tokio::spawn(async move {
                let mut passes = Vec::new();
                let body = json!({"namespace": "api", "identifier": identifier,
                    "limit": LIMIT, "duration": SECOND_MS});
                while std::time::Instant::now() < until {
                    let answer = ratelimit(&http, &base, &body).await;
                    if answer["success"] == true {
                        passes.push(answer["reset"].as_u64().unwrap());
                    }
                }
                passes
            })
        })
        .collect();
    let mut per_window = std::collections::BTreeMap::<u64, u64>::new();
    for t in tasks {
        for reset in t.await.unwrap() {
            *per_window.entry(reset / SECOND_MS).or_default() += 1;
        }
    }
    println!("passes per one-second window (limit {LIMIT}): {per_window:?}");
    let worst = per_window.values().copied().max().unwrap_or(0);
    assert!(
        worst <= LIMIT + 1,
        "a window admitted {worst} > limit {LIMIT} (+5%)"
    );
    // The first and last windows are partial.
    let full: Vec<u64> = per_window
        .values()
        .copied()
        .skip(1)
        .take(per_window.len().saturating_sub(2))
        .collect();
    assert!(full.len() >= 3, "{per_window:?}");
    let mean = full.iter().sum::<u64>() as f64 / full.len() as f64;
    assert!(
        mean >= LIMIT as f64 / 2.0,
        "only {mean:.1} a window: {per_window:?}"
    );
}

/// Three gateway processes serving one key steadily, far from its limit, for four lease
/// lifetimes (`--fresh-for 1s`): their replays renew the leases in use, so requests after each
/// gateway's first stay local; Redis counts every admitted request once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_in_steady_use_are_renewed_across_gateway_processes() {
    const GATEWAYS: usize = 3;
    const LIMIT: u64 = 100_000;
    let redis = RedisServer::start();
    let url = redis.url();
    let http = client();
    let mut gateways: Vec<Gateway> = (0..GATEWAYS)
        .map(|_| Gateway::start(&args(&url, &["--fresh-for", "1s"])))
        .collect();
    for g in &mut gateways {
        g.ready(&http).await;
    }
    let id = fresh("steady");
    let start = std::time::Instant::now();
    let (mut sent, mut admitted) = (0u64, 0u64);
    // One request per gateway every 50 ms for 4 s: 4 lifetimes of a 1 s lease.
    while start.elapsed() < Duration::from_secs(4) {
        for g in &gateways {
            sent += 1;
            admitted += u64::from(admit(&http, &g.base, &id, LIMIT).await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut decides = 0.0;
    let mut renewals = 0.0;
    for g in &gateways {
        let text = common::metrics(&http, &g.base).await;
        decides += common::metric_sum(&text, |l| {
            l.starts_with("strata_origin_calls_total") && l.contains("op=\"decide\"")
        });
        renewals += common::metric_sum(&text, |l| l.starts_with("strata_lease_renewals_total"));
    }
    println!(
        "3 gateway processes, steady for 4 lease lifetimes: {admitted} admitted, {decides} origin decisions, {renewals} renewals"
    );
    assert_eq!(admitted, sent, "far from the limit, all pass");
    assert!(renewals >= GATEWAYS as f64, "{renewals} renewals");
    // Without renewal each gateway would ask again every lifetime (at least 4 each). With it,
    // one each: 3 here, under two busy loops too. (A gateway whose first passes went ahead
    // used to ask for a lease of 2, then 4, 8, 16, 32 as steady traffic used each up: 11 to
    // 15 decisions on a loaded machine; such a key now asks for the limit.)
    assert!(
        decides <= 2.0 * GATEWAYS as f64,
        "{decides} origin decisions for {admitted} requests"
    );
    // Every admitted request counted once at Redis, read from outside once the replays are in.
    let sequence = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        / HOUR_MS;
    let read = json!({"cells":[{"namespace":"api","identifier":id,"duration":HOUR_MS,"sequence":sequence}]});
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let counted = loop {
        let url = format!("{}/v1/origin/read", gateways[0].base);
        let r = common::post_json(&http, url, &read).await;
        let n = r["cells"][0]["regional"].as_u64().unwrap_or(0);
        if n == admitted || std::time::Instant::now() > deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(counted, admitted, "counted once each");
}

/// A gateway process alone on a key paced over its limit is lent the room its window frees
/// during a lease (issue 36); a second process joining it shares the key. Measured from
/// outside (what it saves in origin calls is the lab's to measure, at larger limits): Redis's count of every fixed window, read through
/// the gateways, never passes the limit (the sliding window keeps each window within it), and
/// holds every admitted request once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_gateway_at_its_limit_then_a_second_stay_within_it() {
    const WINDOW_MS: u64 = 2_000;
    const LIMIT: u64 = 20;
    let redis = RedisServer::start();
    let gateways = start_gateways(&redis, 2).await;
    let http = client();
    let id = fresh("lone-then-two");
    let body = json!({"namespace":"api","identifier":id,"limit":LIMIT,"duration":WINDOW_MS});
    let now_ms = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    let read = async |sequence: u64| {
        let cell =
            json!({"namespace":"api","identifier":id,"duration":WINDOW_MS,"sequence":sequence});
        let url = format!("{}/v1/origin/read", gateways[1].base);
        let r = common::post_json(&http, url, &json!({ "cells": [cell] })).await;
        r["cells"][0]["regional"].as_u64().unwrap_or(0)
    };
    let first = now_ms() / WINDOW_MS;
    let decides_before = origin_decides(&http, &gateways[0].base).await;
    // 20 a second, twice the limit's rate: three windows on the first gateway alone, then
    // two more taking turns. A window's count is read two windows on (its replays are in;
    // Redis keeps it three).
    let (mut admitted, mut alone) = (0_u64, 0_u64);
    let mut per_window = Vec::new();
    for k in 0..200_u64 {
        let g = if k < 120 { 0 } else { (k % 2) as usize };
        let url = format!("{}/v1/ratelimit", gateways[g].base);
        let r = common::post_json(&http, url, &body).await;
        let ok = r["success"].as_bool().unwrap();
        admitted += u64::from(ok);
        alone += u64::from(ok && k < 120);
        let ended = now_ms() / WINDOW_MS - 2;
        while first + (per_window.len() as u64) <= ended {
            per_window.push(read(first + per_window.len() as u64).await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let lone_decides = origin_decides(&http, &gateways[0].base).await - decides_before;
    // The last windows, once every admitted request is counted.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let last = now_ms() / WINDOW_MS;
    let tail = loop {
        let mut counts = Vec::new();
        for sequence in first + per_window.len() as u64..=last {
            counts.push(read(sequence).await);
        }
        let sum = per_window.iter().chain(&counts).sum::<u64>();
        if sum == admitted || std::time::Instant::now() > deadline {
            break counts;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    per_window.extend(tail);
    println!(
        "lone then two gateways: admitted {admitted} (alone {alone}), Redis per window {per_window:?} (limit {LIMIT}), {lone_decides} origin decisions at the first gateway"
    );
    assert_eq!(
        per_window.iter().sum::<u64>(),
        admitted,
        "counted once each"
    );
    assert!(
        per_window.iter().all(|&n| n <= LIMIT),
        "a window over the limit"
    );
    assert!(alone >= 2 * LIMIT, "the lone gateway admitted {alone}");
}

/// One gateway process, many clients at once, each request two limits all or nothing: its
/// client's own key first (so requests go to different flows) and one key they all share.
/// Two decisions on the shared key can then be in flight together; an answer that came back
/// after a later one once counted the passes between twice, and the gateway denied the
/// shared key below its limit until the window's end (121-198 of 200 in process). Admitted:
/// exactly the shared limit, and Redis holds that count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_racing_on_a_shared_key_through_one_gateway_get_exactly_its_limit() {
    const CLIENTS: usize = 32;
    const USERS: usize = 8;
    const EACH: usize = 50;
    const SHARED: u64 = 200;
    // 30 days, the longest window: a run never straddles two.
    const WINDOW_MS: u64 = 2_592_000_000;
    let redis = RedisServer::start();
    let gateways = start_gateways(&redis, 1).await;
    let base = gateways[0].base.clone();
    let org = fresh("racing-org");
    let barrier = Arc::new(Barrier::new(CLIENTS));
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (base, org, barrier) = (base.clone(), org.clone(), barrier.clone());
            let user = format!("{org}-user-{}", c % USERS);
            tokio::spawn(async move {
                let http = client();
                let body = json!({"limits": [
                    {"namespace":"user","identifier":user,"limit":100,"duration":WINDOW_MS},
                    {"namespace":"org","identifier":org,"limit":SHARED,"duration":WINDOW_MS},
                ]});
                barrier.wait().await;
                let mut admitted = 0_u64;
                for _ in 0..EACH {
                    let url = format!("{base}/v1/ratelimit/multi");
                    let answer = common::post_json(&http, url, &body).await;
                    admitted += u64::from(answer["success"] == true);
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    // 8 users x 100 would pass the user limits; the shared one caps them at exactly 200.
    assert_eq!(admitted, SHARED, "admitted through one gateway");
    let http = client();
    let sequence = unix_ms() / WINDOW_MS;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let read = common::process::read_count(&http, &base, "org", &org, WINDOW_MS, sequence);
        let counted = read.await;
        if counted == Ok(SHARED) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "Redis holds {counted:?} for the shared key, admitted {SHARED}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
