//! A region on a real Redis Cluster (three primaries on loopback, made with `redis-cli --cluster
//! create`), driven through real gateway processes started with `--redis-cluster`: two
//! gateways converge and stay exact, a multi-limit whose keys live on different nodes is all or
//! nothing, a slot moved to another node mid-run (the gateway's slot map goes stale) loses no
//! count, and a node killed and restarted mid-run stops no decision and loses none of the
//! other nodes' counts. (The API contract on a cluster runs in `api.rs`.)

use crate::common;

use common::{client, fresh};

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::process::GatewayProcess;
use common::redis::RedisCluster;
use serde_json::{Value, json};
use strata_core::{WindowDuration, WindowKeyRef};
use strata_gateway::origin::redis::cell_key;
use tokio::sync::Barrier;

/// The window of every limit here: the longest there is (30 days), so a run never crosses a
/// window boundary (with 1 h windows a run at hh:59:55 read the next hour's cell, which held only
/// the requests sent after the boundary, and failed).
const WINDOW_MS: u64 = 30 * 24 * 3_600_000;

async fn start(cluster: &RedisCluster, http: &reqwest::Client, extra: &[&str]) -> GatewayProcess {
    let seeds = cluster.seeds();
    let mut args = vec!["--redis-cluster", seeds.as_str()];
    args.extend_from_slice(extra);
    let mut g = GatewayProcess::start(&args);
    g.ready(http).await;
    g
}

async fn ratelimit(http: &reqwest::Client, base: &str, identifier: &str, limit: u64) -> Value {
    let r = http
        .post(format!("{base}/v1/ratelimit"))
        .json(
            &json!({"namespace":"api","identifier":identifier,"limit":limit,"duration":WINDOW_MS}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{base}");
    r.json().await.unwrap()
}

/// One request on every key (limit 1,000 an hour), in order, each pass added to `admitted`.
async fn one_each(http: &reqwest::Client, base: &str, keys: &[String], admitted: &mut [u64]) {
    for (id, n) in keys.iter().zip(admitted) {
        *n += u64::from(ratelimit(http, base, id, 1_000).await["success"] == true);
    }
}

/// Polls `read` every 50 ms until it returns `want`; fails after `limit`, naming `what` and the
/// last value read.
async fn until_equal<T: PartialEq + std::fmt::Debug>(
    what: &str,
    limit: Duration,
    want: T,
    read: impl Fn() -> T,
) {
    let deadline = Instant::now() + limit;
    loop {
        let got = read();
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {got:?}, expected {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The Redis key of `identifier`'s current cell (workspace `default`, namespace `api`, 30 days).
fn current_cell(identifier: &str) -> String {
    let key = WindowKeyRef::new(
        "default",
        "api",
        identifier,
        WindowDuration::from_ms(WINDOW_MS).unwrap(),
    )
    .unwrap();
    let now = u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    cell_key(key, now / WINDOW_MS)
}

/// The region's count of `identifier`'s current cell, as the node that holds it says.
fn count_in_redis(cluster: &RedisCluster, identifier: &str) -> u64 {
    let cell = current_cell(identifier);
    let node = &cluster.nodes[cluster.node_of(&cell)];
    node.cli(&["HGET", &cell, "n"]).parse().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_a_cluster_hold_a_burst_and_a_cold_key_of_limit_one() {
    let cluster = RedisCluster::start();
    let http = client();
    let gateways = [
        start(&cluster, &http, &[]).await,
        start(&cluster, &http, &[]).await,
    ];
    // A cold key of limit 1, hit by both at once: admitted once.
    for round in 0..5 {
        let identifier = fresh(&format!("cold-{round}"));
        let start = Arc::new(Barrier::new(2));
        let tasks: Vec<_> = gateways
            .iter()
            .map(|g| {
                let (http, base, id, start) = (
                    http.clone(),
                    g.base.clone(),
                    identifier.clone(),
                    start.clone(),
                );
                tokio::spawn(async move {
                    start.wait().await;
                    ratelimit(&http, &base, &id, 1).await["success"] == true
                })
            })
            .collect();
        let mut admitted = 0;
        for t in tasks {
            admitted += u32::from(t.await.unwrap());
        }
        assert_eq!(admitted, 1, "round {round}: a cold key of limit 1");
    }
    // A burst of 10x the limit over both gateways, 8 connections: exactly the limit.
    const LIMIT: u64 = 50;
    let identifier = fresh("burst");
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let (http, base, id) = (client(), gateways[i % 2].base.clone(), identifier.clone());
            tokio::spawn(async move {
                let mut admitted = 0_u64;
                for _ in 0..(LIMIT * 10 / 8) {
                    admitted +=
                        u64::from(ratelimit(&http, &base, &id, LIMIT).await["success"] == true);
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    println!(
        "cluster burst: admitted {admitted} of {} (limit {LIMIT})",
        LIMIT * 10
    );
    assert_eq!(admitted, LIMIT);
    // Every admitted request reaches the node that holds the key, once.
    until_equal(
        "the burst key in Redis",
        Duration::from_secs(10),
        LIMIT,
        || count_in_redis(&cluster, &identifier),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_limit_across_nodes_is_all_or_nothing() {
    let cluster = RedisCluster::start();
    let http = client();
    let g = start(&cluster, &http, &[]).await;
    // Two identifiers whose cells live on different nodes.
    let wide = fresh("wide");
    let narrow = (0..)
        .map(|i| fresh(&format!("narrow-{i}")))
        .find(|id| cluster.node_of(&current_cell(id)) != cluster.node_of(&current_cell(&wide)))
        .unwrap();
    let multi = |limits: Value| {
        let (http, base) = (http.clone(), g.base.clone());
        async move {
            let r = http
                .post(format!("{base}/v1/ratelimit/multi"))
                .json(&json!({"limits": limits}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.json::<Value>().await.unwrap()
        }
    };
    let both = json!([
        {"namespace":"api","identifier":wide,"limit":5,"duration":WINDOW_MS},
        {"namespace":"api","identifier":narrow,"limit":1,"duration":WINDOW_MS},
    ]);
    assert_eq!(multi(both.clone()).await["success"], true);
    // The narrow limit denies: the wide one, on another node, must not count this request.
    for _ in 0..3 {
        assert_eq!(multi(both.clone()).await["success"], false);
    }
    let wide_alone = ratelimit(&http, &g.base, &wide, 5).await;
    assert_eq!(wide_alone["success"], true);
    assert_eq!(
        wide_alone["remaining"], 3,
        "counted: the first multi and this request only"
    );
    until_equal("wide in Redis", Duration::from_secs(10), 2, || {
        count_in_redis(&cluster, &wide)
    })
    .await;
    assert_eq!(count_in_redis(&cluster, &narrow), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_starts_with_the_cluster_down_and_connects_when_it_comes_up() {
    let mut cluster = RedisCluster::start();
    for node in &mut cluster.nodes {
        node.stop();
    }
    let http = client();
    let seeds = cluster.seeds();
    let g = GatewayProcess::start(&["--redis-cluster", seeds.as_str()]);
    // Serving, deciding from local memory, and not ready.
    let deadline = Instant::now() + Duration::from_secs(30);
    let ready = loop {
        if let Ok(r) = http.get(format!("{}/readyz", g.base)).send().await {
            break r.status();
        }
        assert!(Instant::now() < deadline, "the gateway did not start");
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!(ready, 503);
    let id = fresh("while-down");
    assert_eq!(ratelimit(&http, &g.base, &id, 10).await["success"], true);
    for node in &mut cluster.nodes {
        node.restart();
    }
    cluster.wait_until_ok();
    let deadline = Instant::now() + Duration::from_secs(30);
    while http
        .get(format!("{}/readyz", g.base))
        .send()
        .await
        .map(|r| r.status())
        .ok()
        != Some(reqwest::StatusCode::OK)
    {
        assert!(
            Instant::now() < deadline,
            "not ready after the cluster came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The pass decided while the cluster was down reaches it too, with the next one.
    assert_eq!(ratelimit(&http, &g.base, &id, 10).await["success"], true);
    until_equal(
        "the key's passes in Redis",
        Duration::from_secs(10),
        2,
        || count_in_redis(&cluster, &id),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moved_mid_run_loses_no_count() {
    let cluster = RedisCluster::start();
    let http = client();
    let g = start(&cluster, &http, &["--replay-interval", "20ms"]).await;
    let keys: Vec<String> = (0..6).map(|i| fresh(&format!("moving-{i}"))).collect();
    let mut admitted = vec![0_u64; keys.len()];
    for _ in 0..3 {
        one_each(&http, &g.base, &keys, &mut admitted).await;
    }
    // Every key's replays delivered, then its slot moves to another node.
    let counts = || {
        keys.iter()
            .map(|id| count_in_redis(&cluster, id))
            .collect::<Vec<_>>()
    };
    until_equal(
        "counts before the move",
        Duration::from_secs(10),
        vec![3; keys.len()],
        &counts,
    )
    .await;
    let cell = current_cell(&keys[0]);
    let from = cluster.node_of(&cell);
    cluster.move_slot(cluster.slot_of(&cell), (from + 1) % 3);
    assert_ne!(cluster.node_of(&cell), from);
    for _ in 3..8 {
        one_each(&http, &g.base, &keys, &mut admitted).await;
    }
    assert!(admitted.iter().all(|&n| n == 8), "{admitted:?}");
    until_equal(
        "counts after a slot moved",
        Duration::from_secs(10),
        admitted,
        &counts,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_and_restarted_stops_no_decision_and_loses_no_other_nodes_counts() {
    let mut cluster = RedisCluster::start();
    let http = client();
    let g = start(&cluster, &http, &["--replay-interval", "20ms"]).await;
    // Twelve keys, at least one on every node.
    let keys: Vec<String> = (0..12).map(|i| fresh(&format!("spread-{i}"))).collect();
    let mut admitted = vec![0_u64; keys.len()];
    for _ in 0..3 {
        one_each(&http, &g.base, &keys, &mut admitted).await;
        // Each round's passes acknowledged before the next: every request passes ahead (none
        // is decided at the origin, whose count the node's restart would lose).
        let metrics = || common::metrics(&http, &g.base);
        let deadline = Instant::now() + Duration::from_secs(10);
        while common::metric_sum(&metrics().await, |l| {
            l.starts_with("strata_replay_queue_cells")
        }) > 0.0
        {
            assert!(Instant::now() < deadline, "the replay never caught up");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // No decision call: the keys' requests passed ahead, and the replay carried them.
    let decided = common::metric_sum(&common::metrics(&http, &g.base).await, |l| {
        l.starts_with("strata_origin_calls_total")
            && l.contains("op=\"decide\"")
            && l.contains("result=\"ok\"")
    });
    assert_eq!(decided, 0.0, "{decided} decision calls");
    let victim = cluster.node_of(&current_cell(&keys[0]));
    cluster.nodes[victim].stop();
    // Decisions go on while the node is down (from local memory for its keys).
    for _ in 3..6 {
        one_each(&http, &g.base, &keys, &mut admitted).await;
    }
    cluster.nodes[victim].restart();
    cluster.wait_until_ok();
    for _ in 6..8 {
        one_each(&http, &g.base, &keys, &mut admitted).await;
    }
    assert!(
        admitted.iter().all(|&n| n == 8),
        "every request under the limit passed: {admitted:?}"
    );
    // Every node holds every request on its keys, once, the restarted one too: each pass here
    // is the gateway's own (passed ahead, far from the limit, or by the failure mode while the
    // node was down, and went as the own count a replay or a call carried), and the keys
    // were used again after the
    // restart, so their replays carry the gateway's whole cumulative count (merged with max).
    // Only a pass the origin itself decided would be lost with the node's memory.
    let expected = |_node: usize, admitted: u64| admitted;
    let placed = || {
        keys.iter()
            .map(|id| {
                (
                    cluster.node_of(&current_cell(id)),
                    count_in_redis(&cluster, id),
                )
            })
            .collect::<Vec<_>>()
    };
    let want: Vec<(usize, u64)> = placed()
        .iter()
        .zip(&admitted)
        .map(|(&(node, _), &a)| (node, expected(node, a)))
        .collect();
    until_equal(
        &format!(
            "counts per key (node, count) after node {victim} restarted, admitted {admitted:?}"
        ),
        Duration::from_secs(15),
        want,
        placed,
    )
    .await;
    println!(
        "after node {victim} restarted: counts per key (node, count) {:?}, admitted {admitted:?}",
        placed()
    );
}
