//! The gateway on a real Redis: two gateways of one region sharing it, many tasks on one hot
//! key, and Redis stopped mid-run and restarted.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::redis::RedisServer;
use common::{T0, TestGateway};
use strata_core::table::LimitRequest;
use strata_core::{WindowDuration, WindowKeyRef};
use strata_gateway::Gateway;
use strata_gateway::metrics::Source;
use strata_gateway::origin::redis::cell_key;
use strata_gateway::origin::{CellUsed, Replayed};

fn key(identifier: &str) -> WindowKeyRef<'_> {
    WindowKeyRef::new(
        "default",
        "api",
        identifier,
        WindowDuration::from_ms(60_000).unwrap(),
    )
    .unwrap()
}

async fn on_redis(redis: &RedisServer) -> TestGateway {
    common::on_redis(redis, Duration::from_millis(250)).await
}

/// A limit under 64 times the cost: a cold key's request waits for Redis's decision (from 64
/// on it passes ahead of it, and the script runs after the answer).
const WAITS: u64 = strata_core::policy::AHEAD_LIMIT_PER_COST - 1;

async fn decide(g: &Arc<Gateway>, identifier: &str, limit: u64) -> bool {
    g.limiter
        .decide(LimitRequest {
            key: key(identifier),
            limit,
            cost: 1,
        })
        .await
        .success
}

/// Polls `probe` until it holds or the deadline passes.
async fn eventually(what: &str, deadline: Duration, mut probe: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if probe().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("not within {deadline:?}: {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_of_one_region_converge_through_redis() {
    let redis = RedisServer::start();
    let (a, b) = (on_redis(&redis).await, on_redis(&redis).await);
    const LIMIT: u64 = 50;
    const REPLAY_EVERY: usize = 20; // requests between replays: 20 x 5 ms = the 100 ms interval
    let mut admitted = 0;
    for i in 0..400 {
        let g = if i % 2 == 0 { &a } else { &b };
        admitted += u64::from(decide(&g.gateway, "shared", LIMIT).await);
        a.clock.advance(5);
        b.clock.advance(5);
        if i % REPLAY_EVERY == REPLAY_EVERY - 1 {
            assert!(a.gateway.limiter.replay_once().await);
            assert!(b.gateway.limiter.replay_once().await);
        }
    }
    println!(
        "two gateways, limit {LIMIT}, 400 requests in 2 s, replay every 100 ms: admitted {admitted}"
    );
    // Each gateway passes locally only within the lease Redis granted it, which the other's
    // decisions count as used; the last units are decided at Redis: exactly the limit.
    assert_eq!(admitted, LIMIT);
    // Redis holds the region's whole count: what each gateway passed locally (replayed) and
    // what it decided there.
    let seq = T0 / 60_000;
    for g in [&a, &b] {
        let r = g
            .gateway
            .limiter
            .origin
            .read(&[(key("shared"), seq)], T0)
            .await
            .unwrap();
        assert_eq!(r, vec![admitted]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_tasks_on_one_hot_key_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let g = on_redis(&redis).await;
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let gw = g.gateway.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0_u64;
            for _ in 0..100 {
                n += u64::from(decide(&gw, "hot", 700).await);
            }
            n
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    assert_eq!(admitted, 700);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_run_falls_back_then_recovers_and_replays() {
    let mut redis = RedisServer::start();
    let g = on_redis(&redis).await;
    let gw = &g.gateway;
    for _ in 0..5 {
        assert!(decide(gw, "k", 100).await);
    }
    assert!(gw.limiter.replay_once().await);
    assert_eq!(g.get("/readyz").await.status, StatusCode::OK);

    redis.stop();
    // Stale now: the next decision tries Redis, fails within the timeout, decides locally.
    g.clock.advance(6_000);
    let started = Instant::now();
    for _ in 0..5 {
        assert!(
            decide(gw, "k", 100).await,
            "decisions go on from local memory"
        );
        g.clock.advance(400); // past the read retry delay: each one tries Redis again
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "each failed read is bounded by the timeout"
    );
    assert!(gw.limiter.metrics.decisions(Source::Fallback) >= 1);
    let ready = g.get("/readyz").await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ready.body["error"]["code"], "origin_unavailable");
    assert!(
        !gw.limiter.replay_once().await,
        "replay fails while Redis is down"
    );
    assert_eq!(
        gw.limiter.unreplayed(),
        1,
        "and keeps the cell unacknowledged"
    );
    let m = g.get("/metrics").await;
    assert!(m.text.contains("strata_origin_up 0"));

    redis.restart();
    eventually("readiness recovers", Duration::from_secs(10), async || {
        g.get("/readyz").await.status == StatusCode::OK
    })
    .await;
    eventually(
        "replay resumes and drains",
        Duration::from_secs(10),
        async || gw.limiter.replay_once().await && gw.limiter.unreplayed() == 0,
    )
    .await;
    // The restarted Redis lost everything (it keeps nothing on disk). The replay carries the
    // gateway's cumulative local count, so Redis learns every local pass again: the 5
    // accepted while it was down, and those passed under the lease before; only the passes
    // decided at the old Redis are gone with it.
    let seq = T0 / 60_000;
    let own = gw
        .limiter
        .local
        .lock(key("k"))
        .get(key("k"))
        .map(|s| s.current().own())
        .unwrap();
    let m = &gw.limiter.metrics;
    assert_eq!(
        own,
        m.decisions(Source::Local) + m.decisions(Source::Fallback) + m.decisions(Source::Ahead),
        "every pass not decided at Redis"
    );
    assert!(own >= 5, "{own}");
    let counts = gw
        .limiter
        .origin
        .read(&[(key("k"), seq)], g.clock.now_ms())
        .await
        .unwrap();
    assert_eq!(counts, vec![own]);
    // And decisions are made at Redis again (this one passes ahead, the replay having
    // answered the key; the next, before its replay, is decided there).
    g.clock.advance(6_000);
    let before = gw.limiter.metrics.origin_answers("decide");
    assert!(decide(gw, "k", 100).await);
    assert!(decide(gw, "k", 100).await);
    eventually(
        "Redis answers a decision",
        Duration::from_secs(5),
        async || gw.limiter.metrics.origin_answers("decide") == before + 1,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaying_the_same_batch_twice_counts_once() {
    let redis = RedisServer::start();
    let g = on_redis(&redis).await;
    let origin = &g.gateway.limiter.origin;
    let seq = T0 / 60_000;
    let cell = |id, used| CellUsed {
        key: key(id),
        sequence: seq,
        used,
        release: 0,
        renew: 0,
        acked: 0,
        undo_from: 0,
    };
    let batch = [cell("a", 3), cell("b", 5)];
    let first = counts(origin.replay("gw-1", &batch, T0).await.unwrap());
    assert_eq!(first, vec![Some(3), Some(5)]);
    // Delivered again (a timeout after Redis applied it, then the retry): counted once.
    let again = counts(origin.replay("gw-1", &batch, T0).await.unwrap());
    assert_eq!(again, first);
    // An older cumulative count arriving late changes nothing; a newer one adds the difference.
    let late = counts(origin.replay("gw-1", &[cell("a", 2)], T0).await.unwrap());
    assert_eq!(late, vec![Some(3)]);
    let newer = counts(origin.replay("gw-1", &[cell("a", 7)], T0).await.unwrap());
    assert_eq!(newer, vec![Some(7)]);
    // Another process's own count adds to the cell's.
    let other = counts(origin.replay("gw-2", &[cell("a", 2)], T0).await.unwrap());
    assert_eq!(other, vec![Some(9)]);
    let read = origin
        .read(&[(key("a"), seq), (key("b"), seq)], T0)
        .await
        .unwrap();
    assert_eq!(read, vec![9, 5]);
}

/// A burst of concurrent requests on a cold key, and again when its window rolls over, sends
/// Redis one decision each time (the others wait for its answer and pass under the lease it
/// brought), not one per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_on_a_cold_key_share_one_origin_call() {
    const TASKS: usize = 64;
    let redis = RedisServer::start();
    let g = on_redis(&redis).await;
    let m = &g.gateway.limiter.metrics;
    for round in 0..2 {
        let before = m.origin_calls("decide");
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let gw = g.gateway.clone();
                tokio::spawn(async move { decide(&gw, "burst", 1_000_000).await })
            })
            .collect();
        for t in tasks {
            assert!(
                t.await.unwrap(),
                "round {round}: far from the limit, every request passes"
            );
        }
        let calls = m.origin_calls("decide") - before;
        println!("round {round}: {TASKS} concurrent requests, {calls} origin decisions");
        assert!(
            (1..=2).contains(&calls),
            "round {round}: {calls} origin decisions for {TASKS} concurrent requests"
        );
        assert_eq!(g.gateway.limiter.flows.calls(), 0, "no call left in flight");
        assert_eq!(
            g.gateway.limiter.flows.waiting(),
            0,
            "no request left waiting"
        );
        g.clock.advance(60_000); // the next window: its cell is cold
    }
}

/// The counts of a replay answer.
fn counts(answer: Vec<Option<Replayed>>) -> Vec<Option<u64>> {
    answer.into_iter().map(|r| r.map(|r| r.count)).collect()
}

/// The commands Redis ran (scripts' own included), by name, from `INFO commandstats`.
fn commands(redis: &RedisServer) -> std::collections::HashMap<String, u64> {
    redis
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(":calls=")?;
            let calls = rest.split(',').next()?.parse().ok()?;
            Some((name.to_string(), calls))
        })
        .collect()
}

/// Of `ran`, the commands scripts ran: all but the script calls and the test's own.
fn script_commands(ran: &std::collections::HashMap<String, u64>) -> u64 {
    ran.iter()
        .filter(|(name, _)| {
            !matches!(
                name.as_str(),
                "evalsha" | "eval" | "script|load" | "config|resetstat" | "info"
            )
        })
        .map(|(_, calls)| calls)
        .sum()
}

/// Decides `cold-0` .. `cold-<keys>` on `gateway`, each a pass at the origin, and returns the
/// commands Redis ran for them, having checked what every such decision costs: one script
/// call, each cell read once (`HGETALL`, its leases with it), the current cell written once.
async fn decide_cold_keys(
    redis: &RedisServer,
    gateway: &Arc<Gateway>,
    keys: u64,
) -> std::collections::HashMap<String, u64> {
    // The script loaded first (the first call's NOSCRIPT and load are not the decision's).
    assert!(decide(gateway, "warm-up", WAITS).await);
    redis.cli(&["CONFIG", "RESETSTAT"]);
    for i in 0..keys {
        assert!(decide(gateway, &format!("cold-{i}"), WAITS).await);
    }
    let ran = commands(redis);
    println!("{keys} decisions at the origin: {ran:?}");
    let get = |name: &str| ran.get(name).copied().unwrap_or(0);
    assert_eq!(get("evalsha") + get("eval"), keys, "one script call each");
    assert_eq!(get("hgetall"), 2 * keys, "both cells, once");
    assert_eq!(get("hget"), 0, "no field read alone");
    assert_eq!(
        get("hset"),
        keys,
        "the cell, its count and the caller's lease, written once"
    );
    ran
}

/// What a cold decision costs Redis (the usual one for a key seen less often than a lease
/// lasts): each cell read once, whole, its leases with it, and the current one written once;
/// an expiry set only on a cell it made (on a new key, none on a key Redis holds); no field
/// read or written by a command of its own. It was about 25 commands, twelve of them `HGET`s,
/// then 7 (9 on a new key) while the leases had hashes of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_decision_reads_and_writes_each_hash_once() {
    const KEYS: u64 = 50;
    let redis = RedisServer::start();
    let g = on_redis(&redis).await;
    let ran = decide_cold_keys(&redis, &g.gateway, KEYS).await;
    assert_eq!(ran.get("pexpire"), Some(&KEYS), "the cell, made");
    let in_scripts = script_commands(&ran);
    assert!(
        in_scripts <= 5 * KEYS,
        "{in_scripts} commands for {KEYS} decisions"
    );
    let cell = cell_key(key("cold-7"), T0 / 60_000);
    let ttl: i64 = redis.cli(&["PTTL", &cell]).parse().unwrap();
    assert!(
        ttl > 0 && ttl <= 180_000,
        "{cell} expires three windows on: {ttl} ms"
    );

    // The same keys, cold for a second gateway but not for Redis (the usual decision on a key
    // seen less often than a lease lasts): none given a new expiry.
    let other = on_redis(&redis).await;
    let ran = decide_cold_keys(&redis, &other.gateway, KEYS).await;
    assert_eq!(ran.get("pexpire"), None, "the cell keeps its expiry");
    let in_scripts = script_commands(&ran);
    assert!(
        in_scripts <= 4 * KEYS,
        "{in_scripts} commands for {KEYS} decisions"
    );
    assert_eq!(redis.cli(&["HGET", &cell, "n"]), "2", "both passes counted");
    assert_eq!(leases(&redis, &cell).len(), 2, "both gateways hold a lease");
    let ttl: i64 = redis.cli(&["PTTL", &cell]).parse().unwrap();
    assert!(ttl > 0 && ttl <= 180_000, "{cell} still expires: {ttl} ms");
}

/// The lease records in `cell` (its `l:<instance>` fields).
fn leases(redis: &RedisServer, cell: &str) -> Vec<String> {
    let all = redis.cli(&["HGETALL", cell]);
    let all: Vec<&str> = all.lines().map(str::trim).collect();
    all.chunks_exact(2)
        .filter(|fv| fv[0].starts_with("l:"))
        .map(|fv| fv[1].to_string())
        .collect()
}

/// Passes ahead on `keys` keys far from their limit (`sparse-0` ..), one each on `gateway`,
/// then one replay pass: the commands Redis ran for them, having checked that no decision was
/// made and one script call carried them all.
async fn pass_ahead_and_replay(
    redis: &RedisServer,
    g: &TestGateway,
    keys: u64,
) -> std::collections::HashMap<String, u64> {
    // The replay script loaded first (its first call's NOSCRIPT and load are not the pass's).
    assert!(decide(&g.gateway, "warm-up", 1_000).await);
    assert!(g.gateway.limiter.replay_once().await);
    redis.cli(&["CONFIG", "RESETSTAT"]);
    for i in 0..keys {
        assert!(decide(&g.gateway, &format!("sparse-{i}"), 1_000).await);
    }
    assert!(g.gateway.limiter.replay_once().await);
    let ran = commands(redis);
    println!("{keys} passes ahead, replayed: {ran:?}");
    let get = |name: &str| ran.get(name).copied().unwrap_or(0);
    assert_eq!(
        get("evalsha") + get("eval"),
        1,
        "one replay call, no decision"
    );
    assert_eq!(get("hgetall") + get("hget"), 0, "nothing read");
    assert_eq!(
        get("script|load"),
        0,
        "the batch carries its script (EVAL), not a SCRIPT LOAD beside it"
    );
    ran
}

/// A request on a key far from its limit that the process has no answer for passes ahead and
/// costs Redis its replayed cell alone: three commands where it makes the cell (both counts
/// added, the expiry set), three on a cell another gateway made (both counts added, the
/// cell's writers bounded: its size looked at); a decision on a cold key costs four or five.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_ahead_costs_redis_its_replayed_cell_alone() {
    const KEYS: u64 = 50;
    let redis = RedisServer::start();
    let a = on_redis(&redis).await;
    let ran = pass_ahead_and_replay(&redis, &a, KEYS).await;
    assert_eq!(ran.get("hincrby"), Some(&(2 * KEYS)), "{ran:?}");
    assert_eq!(ran.get("pexpire"), Some(&KEYS), "the cell, made");
    assert_eq!(script_commands(&ran), 3 * KEYS);
    let cell = cell_key(key("sparse-7"), T0 / 60_000);
    let ttl: i64 = redis.cli(&["PTTL", &cell]).parse().unwrap();
    assert!(ttl > 0 && ttl <= 180_000, "{cell} expires: {ttl} ms");

    let b = on_redis(&redis).await;
    let ran = pass_ahead_and_replay(&redis, &b, KEYS).await;
    assert_eq!(ran.get("pexpire"), None, "the cell keeps its expiry");
    // Both counts added, and the cell's size looked at (a new writer within the bound).
    assert_eq!(ran.get("hlen"), Some(&KEYS), "{ran:?}");
    assert_eq!(script_commands(&ran), 3 * KEYS);
    assert_eq!(redis.cli(&["HGET", &cell, "n"]), "2", "both passes counted");
}

/// A decision drops another gateway's run-out lease from the cell (one `HDEL` beside the
/// cell's one write) and replaces the caller's own run-out lease in place (one `HSET`, no
/// `HDEL`); the cell keeps its expiry throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_out_lease_is_dropped_and_the_callers_own_replaced_in_place() {
    let redis = RedisServer::start();
    let short = || {
        common::with_settings(strata_gateway::config::Settings {
            redis_url: Some(redis.url()),
            fresh_for: Duration::from_millis(100),
            ..strata_gateway::config::Settings::default()
        })
    };
    let (a, b) = (short().await, short().await);
    assert!(decide(&a.gateway, "handed-on", WAITS).await);
    let cell = cell_key(key("handed-on"), T0 / 60_000);
    let record = match &leases(&redis, &cell)[..] {
        [one] => one.clone(),
        other => panic!("one lease record: {other:?}"),
    };
    let until: u64 = record
        .split_once(':')
        .and_then(|(_, id)| id.parse().ok())
        .unwrap_or_else(|| panic!("a lease record: {record:?}"));
    // The lease runs out on Redis's clock.
    eventually(
        "the first lease expires",
        Duration::from_secs(5),
        async || {
            let time = redis.cli(&["TIME"]);
            let mut parts = time.lines().map(|p| p.trim().parse::<u64>().unwrap());
            let now_ms = parts.next().unwrap() * 1000 + parts.next().unwrap() / 1000;
            now_ms > until
        },
    )
    .await;
    // b decides at the origin; the commands Redis ran for it, and the one lease left
    let decide_on_b = async || {
        redis.cli(&["CONFIG", "RESETSTAT"]);
        assert!(decide(&b.gateway, "handed-on", WAITS).await);
        let ran = commands(&redis);
        assert_eq!(
            ran.get("evalsha"),
            Some(&1),
            "decided at the origin: {ran:?}"
        );
        let left = leases(&redis, &cell);
        assert_eq!(left.len(), 1, "only the new lease: {left:?}");
        let ttl: i64 = redis.cli(&["PTTL", &cell]).parse().unwrap();
        assert!(ttl > 0 && ttl <= 180_000, "{cell} expires: {ttl} ms");
        (ran, left[0].clone())
    };
    let (ran, first) = decide_on_b().await;
    println!("a decision that drops another's run-out lease: {ran:?}");
    assert_eq!(ran.get("hdel"), Some(&1), "the expired lease dropped");
    assert_ne!(first, record, "b's lease in place of a's");

    // The caller's own lease, run out and given back, is replaced by its next one in place.
    b.clock.advance(1_000);
    let (ran, next) = decide_on_b().await;
    println!("the caller's next lease in place of its last: {ran:?}");
    assert_eq!(ran.get("hdel"), None, "replaced, not dropped");
    assert_eq!(ran.get("hset"), Some(&1), "the cell's one write");
    assert_eq!(ran.get("pexpire"), None, "the cell kept its expiry");
    assert_ne!(next, first, "a new lease");
}

/// What a replay costs Redis: one script call per batch; per cell, two commands when the
/// caller's acknowledged count agrees with Redis's record (its first write, acknowledged as 0,
/// too, plus the expiry where it makes the cell), three without that hint; the expiry set
/// once per cell.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_batch_is_one_script_call_and_sets_expiry_once_per_cell() {
    const CELLS: u64 = 200;
    let redis = RedisServer::start();
    let g = on_redis(&redis).await;
    let origin = &g.gateway.limiter.origin;
    let seq = T0 / 60_000;
    let ids: Vec<String> = (0..CELLS).map(|i| format!("cost-{i}")).collect();
    let batch = |used, acked| -> Vec<CellUsed<'_>> {
        ids.iter()
            .map(|id| CellUsed {
                key: key(id),
                sequence: seq,
                used,
                release: 0,
                renew: 0,
                acked,
                undo_from: 0,
            })
            .collect()
    };
    redis.cli(&["CONFIG", "RESETSTAT"]);
    for used in 1..=5 {
        // As the gateway sends them: each batch knows the last one's count was acknowledged.
        let answer = origin.replay("gw-1", &batch(used, used - 1), T0).await;
        let counts = counts(answer.unwrap());
        assert!(counts.iter().all(|c| *c == Some(used)), "{counts:?}");
    }
    let ran = commands(&redis);
    let get = |name: &str| ran.get(name).copied().unwrap_or(0);
    let in_scripts = script_commands(&ran);
    println!("5 replays of {CELLS} cells: {ran:?}");
    assert_eq!(get("evalsha") + get("eval"), 5, "one script call per batch");
    assert_eq!(get("pexpire"), CELLS, "expiry set once per cell");
    assert_eq!(get("hget"), 0, "no write reads");
    assert_eq!(
        in_scripts,
        3 * CELLS + 2 * 4 * CELLS,
        "first write: add to both, expire; then add to both"
    );
    // Without the hint (an older edge), with a wrong one, or delivered twice: the same counts.
    for (used, acked, what) in [(6, 0, "no hint"), (7, 2, "a wrong hint"), (7, 6, "twice")] {
        let after = counts(
            origin
                .replay("gw-1", &batch(used, acked), T0)
                .await
                .unwrap(),
        );
        assert!(after.iter().all(|c| *c == Some(used)), "{what}: {after:?}");
    }
    let ttl: i64 = redis
        .cli(&["PTTL", &cell_key(key("cost-7"), seq)])
        .parse()
        .unwrap();
    assert!(
        ttl > 0 && ttl <= 180_000,
        "a cell created by a replay expires three windows on: {ttl} ms"
    );
    // A process with nothing of its own on the cells (it gives back leases on keys the origin
    // decided): the region's count, one read a cell.
    redis.cli(&["CONFIG", "RESETSTAT"]);
    let after = counts(origin.replay("gw-2", &batch(0, 0), T0).await.unwrap());
    assert!(after.iter().all(|c| *c == Some(7)), "{after:?}");
    let ran = commands(&redis);
    println!("a replay of nothing own on {CELLS} cells: {ran:?}");
    assert_eq!(
        ran.get("hget").copied(),
        Some(CELLS),
        "the count, read once"
    );
    assert!(
        ran.keys().all(|c| matches!(
            c.as_str(),
            "hget" | "evalsha" | "eval" | "script|load" | "config|resetstat"
        )),
        "nothing written: {ran:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cell_holding_a_foreign_value_fails_alone() {
    let redis = RedisServer::start();
    let g = on_redis(&redis).await;
    let limiter = &g.gateway.limiter;
    let seq = T0 / 60_000;
    // Something else wrote a plain string at one cell's key.
    assert_eq!(
        redis.cli(&["SET", &cell_key(key("bad"), seq), "not a hash"]),
        "OK"
    );
    let cell = |id, used| CellUsed {
        key: key(id),
        sequence: seq,
        used,
        release: 0,
        renew: 0,
        acked: 0,
        undo_from: 0,
    };
    let batch = [cell("a", 2), cell("bad", 3), cell("c", 4)];
    let counts = counts(limiter.origin.replay("gw-1", &batch, T0).await.unwrap());
    assert_eq!(counts, vec![Some(2), None, Some(4)]);
    let read = limiter
        .origin
        .read(&[(key("a"), seq), (key("c"), seq)], T0)
        .await
        .unwrap();
    assert_eq!(read, vec![2, 4], "the other cells of the batch were merged");
    assert_eq!(
        redis.cli(&["GET", &cell_key(key("bad"), seq)]),
        "not a hash",
        "the foreign value is left alone"
    );

    // Through the gateway's replay: the good cell is acknowledged, the bad one stays
    // unacknowledged and goes out with the next batch.
    for id in ["good", "bad"] {
        let d = limiter.local.lock(key(id)).decide(key(id), 100, 1, T0);
        assert!(d.success);
    }
    assert_eq!(limiter.unreplayed(), 2);
    assert!(!limiter.replay_once().await, "one cell failed");
    assert_eq!(limiter.unreplayed(), 1);
    let read = limiter
        .origin
        .read(&[(key("good"), seq)], T0)
        .await
        .unwrap();
    assert_eq!(read, vec![1]);
    assert_eq!(redis.cli(&["DEL", &cell_key(key("bad"), seq)]), "1");
    assert!(limiter.replay_once().await);
    assert_eq!(limiter.unreplayed(), 0);
    let read = limiter.origin.read(&[(key("bad"), seq)], T0).await.unwrap();
    assert_eq!(read, vec![1]);
}

/// A multi-limit decision that fails at Redis after its first limit counted takes that count
/// back: the local fallback counts the request, and its replay is the only count of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_limit_error_midway_is_taken_back_before_the_fallback_counts() {
    let redis = RedisServer::start();
    let g = on_redis(&redis).await;
    let seq = T0 / 60_000;
    // The second limit's cell holds a foreign value: its script fails (WRONGTYPE).
    redis.cli(&["SET", &cell_key(key("b"), seq), "poison"]);
    let limits = [
        LimitRequest {
            key: key("a"),
            limit: 10,
            cost: 1,
        },
        LimitRequest {
            key: key("b"),
            limit: 10,
            cost: 1,
        },
    ];
    let multi = g.gateway.limiter.decide_all(&limits).await;
    assert!(multi.success, "decided from local memory");
    assert_eq!(g.gateway.limiter.metrics.decisions(Source::Fallback), 2);
    let origin = &g.gateway.limiter.origin;
    let read = |id| [(key(id), seq)];
    assert_eq!(
        origin.read(&read("a"), T0).await.unwrap(),
        vec![0],
        "the first limit's count was taken back"
    );
    redis.cli(&["DEL", &cell_key(key("b"), seq)]);
    assert!(g.gateway.limiter.replay_once().await);
    for id in ["a", "b"] {
        assert_eq!(
            origin.read(&read(id), T0).await.unwrap(),
            vec![1],
            "{id}: counted once, by its replay"
        );
    }
}

/// Cells answered with an error about their data (here a value of another type at their key)
/// fail alone: the origin is up, so the breaker stays closed and other keys are decided there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisoned_cells_do_not_open_the_breaker_for_everyone() {
    let redis = RedisServer::start();
    let g = on_redis(&redis).await;
    let seq = T0 / 60_000;
    let ids: Vec<String> = (0..30).map(|i| format!("poisoned-{i}")).collect();
    for id in &ids {
        redis.cli(&["SET", &cell_key(key(id), seq), "not a hash"]);
    }
    for id in &ids {
        assert!(
            decide(&g.gateway, id, 10).await,
            "decided from local memory"
        );
    }
    let limiter = &g.gateway.limiter;
    assert_eq!(limiter.metrics.decisions(Source::Fallback), 30);
    assert!(
        !limiter.origin.breaker_open(),
        "30 rejected calls say nothing of Redis's health"
    );
    assert!(decide(&g.gateway, "healthy", 10).await);
    assert_eq!(
        limiter.metrics.decisions(Source::Origin),
        1,
        "decided at Redis"
    );
}

/// A replay batch that times out while Redis is stalled is applied when Redis wakes up; the
/// gateway, not knowing, sends the same counts again with its next batch: counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_timed_out_mid_apply_counts_once() {
    let redis = RedisServer::start();
    // A 250 ms origin timeout: a replay may take 1 s (`OriginClient::replay_timeout`), which
    // the stall outlasts.
    let g = on_redis(&redis).await;
    let limiter = &g.gateway.limiter;
    for _ in 0..5 {
        assert!(decide(&g.gateway, "stalled", 100).await);
    }
    assert_eq!(
        limiter.unreplayed(),
        1,
        "local passes under the lease, not replayed yet"
    );
    let mut stall = redis.stall("1.3");
    assert!(!limiter.replay_once().await, "timed out");
    stall.wait().unwrap();
    let seq = T0 / 60_000;
    let read = || async {
        limiter
            .origin
            .read(&[(key("stalled"), seq)], T0)
            .await
            .unwrap()[0]
    };
    // Redis applied the queued batch after its stall: 1 decided there + 4 local passes.
    let deadline = Instant::now() + Duration::from_secs(5);
    while read().await != 5 {
        assert!(Instant::now() < deadline, "the stalled batch never applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        limiter.unreplayed(),
        1,
        "the gateway still thinks it undelivered"
    );
    assert!(limiter.replay_once().await, "sent again");
    assert_eq!(limiter.unreplayed(), 0);
    assert_eq!(read().await, 5, "counted once");
}

/// A decision that times out while Redis is stalled is applied when Redis wakes up, but the
/// gateway already decided that request from local memory (and replays its local pass). The
/// replay of that pass asks Redis to undo what the lost call counted, with no further request
/// needed: every admitted request counts once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_whose_answer_was_lost_is_undone_by_the_replay() {
    let redis = RedisServer::start();
    let g = common::on_redis(&redis, Duration::from_millis(100)).await;
    let limiter = &g.gateway.limiter;
    let seq = T0 / 60_000;
    let count = || async {
        limiter
            .origin
            .read(&[(key("late"), seq)], T0)
            .await
            .unwrap()[0]
    };
    // The decide script is loaded (a first call), so the stalled call is one command.
    assert!(decide(&g.gateway, "warm-up", 10).await);
    let mut stall = redis.stall("0.5");
    assert!(
        decide(&g.gateway, "late", 10).await,
        "decided from local memory"
    );
    assert_eq!(limiter.metrics.decisions(Source::Fallback), 1);
    stall.wait().unwrap();
    // Redis applied the lost call after its stall; the local pass is replayed on top.
    let deadline = Instant::now() + Duration::from_secs(5);
    while count().await != 1 {
        assert!(Instant::now() < deadline, "the stalled call never applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(limiter.replay_once().await);
    assert_eq!(
        count().await,
        1,
        "the replay carried the local pass and the lost call's undo"
    );
    // After the retry delay, the next request is decided at Redis, with nothing to undo.
    g.clock.set(T0 + 300);
    assert!(decide(&g.gateway, "late", 10).await);
    assert_eq!(
        limiter.metrics.decisions(Source::Origin),
        2,
        "the warm-up and this one"
    );
    assert!(limiter.replay_once().await);
    assert_eq!(count().await, 2, "two requests admitted, two counted");
}
