//! Real `strata-gateway` processes: two of one region on one Redis (what one admits, the other
//! counts, through Redis alone), and two regions sharing a global table, with the gateway's own
//! flush and sync loops (how soon one region sees the other's usage).

use crate::common;

use std::time::{Duration, Instant};

use common::process::GatewayProcess;
use common::redis::RedisServer;
use serde_json::{Value, json};

async fn start_gateway(redis: &RedisServer, http: &reqwest::Client) -> (GatewayProcess, String) {
    let mut g = GatewayProcess::start(&["--redis-url", &redis.url(), "--replay-interval", "20ms"]);
    g.ready(http).await;
    let base = g.base.clone();
    (g, base)
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> Value {
    common::post_json(http, url, &body).await
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

/// The real loops, in real processes: eu admits, and us sees it as the other regions' count
/// within one flush plus one sync interval and their jitter (1 s + 1 s, + 20% each), plus a
/// replay interval and some slack for a loaded machine. The flush and sync cadences once
/// skipped each other's firings, and a reader of the README saw `remaining: 9` instead of 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_region_sees_usage_within_a_flush_and_a_sync() {
    let dir = std::env::temp_dir().join(format!("strata-propagation-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = dir.to_string_lossy().to_string();
    let http = reqwest::Client::new();
    let intervals = ["--flush-interval", "1s", "--sync-interval", "1s"];
    let start = |region: &str| {
        let mut args = vec!["--region", region, "--data-dir", data.as_str()];
        args.extend(intervals);
        GatewayProcess::start(&args)
    };
    let (mut eu, mut us) = (start("eu"), start("us"));
    eu.ready(&http).await;
    us.ready(&http).await;
    const HOUR: u64 = 3_600_000;
    let bound = Duration::from_millis(100 + 1_200 + 1_200 + 800);
    let mut delays = Vec::new();
    for round in 0..5 {
        let id = format!("roamer-{}-{round}", std::process::id());
        let limit = json!({"namespace":"api","identifier":id,"limit":10,"duration":HOUR});
        for _ in 0..8 {
            let r = post(&http, format!("{}/v1/ratelimit", eu.base), limit.clone()).await;
            assert_eq!(r["success"], true);
        }
        let admitted = Instant::now();
        let seq = strata_gateway::clock::Clock::system().now_ms() / HOUR;
        let cell =
            json!({"cells":[{"namespace":"api","identifier":id,"duration":HOUR,"sequence":seq}]});
        let what = format!("round {round}: us did not see eu's 8");
        until_global(&http, &us.base, &cell, 8, admitted, bound, &what).await;
        delays.push(admitted.elapsed());
        // us now counts them: 2 left, then the limit.
        let r = post(&http, format!("{}/v1/ratelimit", us.base), limit.clone()).await;
        assert_eq!(
            (r["success"].clone(), r["remaining"].clone()),
            (json!(true), json!(1))
        );
    }
    delays.sort();
    println!(
        "eu -> us, flush and sync every 1 s: median {:?}, max {:?} (bound {bound:?})",
        delays[delays.len() / 2],
        delays[delays.len() - 1]
    );
    drop((eu, us));
    let _ = std::fs::remove_dir_all(&dir);
}

/// No count a region flushed is missed by another region's sync, however late the flush
/// commits, across processes: three region gateways on one MariaDB database; a session holds
/// eu's row of a key locked for 3 s (longer than the 2 s re-read of older builds, whose next
/// look was their full read a minute on) while eu's next flush of it waits and us's flushes go
/// on; once the lock goes, ap sees eu's count within a flush and a sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_that_commits_late_is_seen_by_another_region() {
    use common::mariadb::SharedDatabase;
    const HOUR: u64 = 3_600_000;
    let db = SharedDatabase::create(&format!("strata_late_flush_{}", std::process::id())).await;
    let url = db.url();
    let http = reqwest::Client::new();
    let start = |region: &str| {
        GatewayProcess::start(&[
            "--region",
            region,
            "--database-url",
            &url,
            "--flush-interval",
            "200ms",
            "--sync-interval",
            "200ms",
        ])
    };
    let (mut eu, mut us, mut ap) = (start("eu"), start("us"), start("ap"));
    for g in [&mut eu, &mut us, &mut ap] {
        g.ready(&http).await;
    }
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    let id = common::fresh("a-late");
    let limit = json!({"namespace":"api","identifier":id,"limit":100,"duration":HOUR});
    let seq = strata_gateway::clock::Clock::system().now_ms() / HOUR;
    let cell =
        json!({"cells":[{"namespace":"api","identifier":id,"duration":HOUR,"sequence":seq}]});
    let admit = |n: usize| {
        let (http, url, limit) = (
            http.clone(),
            format!("{}/v1/ratelimit", eu.base),
            limit.clone(),
        );
        async move {
            for _ in 0..n {
                assert_eq!(
                    post(&http, url.clone(), limit.clone()).await["success"],
                    true
                );
            }
        }
    };
    admit(30).await;
    let since = Instant::now();
    until_global(
        &http,
        &ap.base,
        &cell,
        30,
        since,
        Duration::from_secs(10),
        "ap: eu's 30",
    )
    .await;

    // By primary key: a locking read through a scan would lock every row it passed.
    let pk: u64 = sqlx::query_scalar(
        "SELECT pk FROM ratelimit_window_counts WHERE identifier = ? AND region = 'eu'",
    )
    .bind(&id)
    .fetch_one(&pool)
    .await
    .unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT count FROM ratelimit_window_counts WHERE pk = ? FOR UPDATE")
        .bind(pk)
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    admit(20).await;
    // eu's flush of the 20 registers, takes its stamp and waits on the lock.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM ratelimit_flushers WHERE flusher LIKE 'eu/%'")
                .fetch_one(&pool)
                .await
                .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "eu's flush never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // us's flushes go on meanwhile, and ap syncs them: its reads move on past eu's stamp's time.
    // Sorted after eu's key: eu's waiting upsert holds the unique index's gap before its row,
    // which would hold an insert there too (InnoDB's next-key lock), whatever the flush design.
    let busy = common::fresh("z-busy");
    let other = json!({"namespace":"api","identifier":busy,"limit":2_000,"duration":HOUR});
    let other_cell =
        json!({"cells":[{"namespace":"api","identifier":busy,"duration":HOUR,"sequence":seq}]});
    let held = Instant::now();
    let mut admitted = 0_u64;
    while held.elapsed() < Duration::from_secs(3) {
        for _ in 0..50 {
            let r = post(&http, format!("{}/v1/ratelimit", us.base), other.clone()).await;
            admitted += u64::from(r["success"] == true);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        admitted >= 400,
        "us's key past its floor of 400: {admitted}"
    );
    let since = Instant::now();
    until_global(
        &http,
        &ap.base,
        &other_cell,
        admitted,
        since,
        Duration::from_secs(10),
        "ap: us's",
    )
    .await;
    assert_eq!(
        post(&http, format!("{}/v1/origin/read", ap.base), cell.clone()).await["cells"][0]["global"],
        30,
        "eu's late flush is not committed yet"
    );
    holder.commit().await.unwrap();
    let released = Instant::now();
    until_global(
        &http,
        &ap.base,
        &cell,
        50,
        released,
        Duration::from_secs(5),
        "ap: eu's flush that committed 3 s late",
    )
    .await;
    println!(
        "eu's late flush seen by ap {:?} after it committed",
        released.elapsed()
    );
    drop((eu, us, ap));
    pool.close().await;
    db.drop().await;
}

/// The publish floor shared by the regions, across processes: three region processes on one
/// SQLite file, at their default cadences, announce themselves; then two requests in one
/// region (a third of the 20% floor of a limit of 30, where the floor of one region alone
/// would be 6) are published, early, and another region sees them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_share_the_floor_and_a_crossing_is_published_at_once() {
    let dir = std::env::temp_dir().join(format!("strata-shared-floor-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = dir.to_string_lossy().to_string();
    let http = reqwest::Client::new();
    let start = |region: &str| GatewayProcess::start(&["--region", region, "--data-dir", &data]);
    let mut a = start("a");
    a.ready(&http).await;
    let (mut b, mut c) = (start("b"), start("c"));
    b.ready(&http).await;
    c.ready(&http).await;
    // Each gateway announces at start, 2 s later and every 10 s: within two rounds, a counts
    // all three.
    let within = Duration::from_secs(25);
    common::process::await_gauge(&http, &a.base, "strata_global_regions", 3.0, within).await;
    const MONTH: u64 = 2_592_000_000;
    let id = format!("spread-{}", std::process::id());
    let limit = json!({"namespace":"api","identifier":id,"limit":30,"duration":MONTH});
    for _ in 0..2 {
        let r = post(&http, format!("{}/v1/ratelimit", a.base), limit.clone()).await;
        assert_eq!(r["success"], true, "{r}");
    }
    let admitted = Instant::now();
    let seq = strata_gateway::clock::Clock::system().now_ms() / MONTH;
    let cell =
        json!({"cells":[{"namespace":"api","identifier":id,"duration":MONTH,"sequence":seq}]});
    // One replay, an early flush and one sync (1 s, 20% jitter), with slack for a busy machine.
    let bound = Duration::from_millis(100 + 200 + 1_200 + 1_500);
    until_global(
        &http,
        &b.base,
        &cell,
        2,
        admitted,
        bound,
        "b did not see a's 2",
    )
    .await;
    println!("b saw a's 2 requests after {:?}", admitted.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Polls `base`'s `/v1/origin/read` of `cell` every 20 ms until its `global` is `n`; fails
/// with `what` once `bound` has passed since `since`.
async fn until_global(
    http: &reqwest::Client,
    base: &str,
    cell: &serde_json::Value,
    n: u64,
    since: Instant,
    bound: Duration,
    what: &str,
) {
    loop {
        let seen = post(http, format!("{base}/v1/origin/read"), cell.clone()).await;
        if seen["cells"][0]["global"] == n {
            return;
        }
        assert!(since.elapsed() < bound, "{what} within {bound:?}: {seen}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The replay loop's pacing in the built binary, measured from outside: twenty keys far from
/// their limit, each used every 50 ms for 2.5 s (about 25 replay passes), reach the origin
/// about once a second each instead of on every pass; and every admitted request is counted
/// there within the pace (read back through `/v1/origin/read`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_keys_are_replayed_about_once_a_second_and_nothing_is_lost() {
    const MONTH: u64 = 2_592_000_000;
    let http = reqwest::Client::new();
    let mut g = GatewayProcess::start(&[]);
    g.ready(&http).await;
    let ids: Vec<String> = (0..20)
        .map(|i| common::fresh(&format!("quiet-{i}")))
        .collect();
    let limit =
        |id: &str| json!({"namespace":"api","identifier":id,"limit":1_000_000,"duration":MONTH});
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < Duration::from_millis(2_500) {
        for id in &ids {
            let r = post(&http, format!("{}/v1/ratelimit", g.base), limit(id)).await;
            assert_eq!(r["success"], true);
        }
        sent += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = common::metrics(&http, &g.base).await;
    let decisions = common::metric_sum(&text, |l| l.starts_with("strata_decisions_total"));
    let replayed = common::metric_sum(&text, |l| l.starts_with("strata_replay_cells_total"));
    println!(
        "{decisions} decisions on 20 quiet keys over {:?}: {replayed} replayed cells",
        start.elapsed()
    );
    assert_eq!(decisions, (20 * sent) as f64);
    // Every pass would replay each key on each of the run's 25 passes (500 cells); paced, a
    // quiet cell goes on its turn, one pass in ten: 103-120 cells on an idle machine, 170
    // under the test command's load. Bounded by the run's length, not by the requests sent,
    // which a loaded client sends fewer of (560 against 660).
    let bound = 20.0 * 4.0 * start.elapsed().as_secs_f64();
    assert!(
        replayed <= bound,
        "{replayed} replayed cells for {decisions} decisions (bound {bound:.0})"
    );
    let seq = strata_gateway::clock::Clock::system().now_ms() / MONTH;
    let cells: Vec<Value> = ids
        .iter()
        .map(|id| json!({"namespace":"api","identifier":id,"duration":MONTH,"sequence":seq}))
        .collect();
    let read = json!({ "cells": cells });
    let stopped = Instant::now();
    loop {
        let seen = post(&http, format!("{}/v1/origin/read", g.base), read.clone()).await;
        let counts: Vec<u64> = seen["cells"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["regional"].as_u64().unwrap())
            .collect();
        if counts.iter().all(|&n| n == sent) {
            break;
        }
        // One quiet turn (1 s) and slack for a busy machine.
        assert!(
            stopped.elapsed() < Duration::from_secs(3),
            "not all {sent} requests per key reached the origin: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One request of the conformance table through the gateway's API (on a key of `limit`):
/// whether it was admitted.
async fn conformance_limit(
    http: reqwest::Client,
    base: String,
    key: String,
    limit: u64,
) -> Result<bool, String> {
    let limit = json!({"namespace": "conformance", "identifier": key,
        "limit": limit, "duration": 86_400_000});
    let r = http
        .post(format!("{base}/v1/ratelimit"))
        .json(&limit)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let body: Value = r.json().await.map_err(|e| e.to_string())?;
    body["success"]
        .as_bool()
        .ok_or(format!("no decision: {body}"))
}

/// Today's one-day window (the conformance limits' duration).
fn today() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    u64::try_from(now.unwrap().as_millis()).unwrap() / 86_400_000
}

/// The count at `base`'s origin of `identifier`'s one-day cell of day `day` (0 if it cannot be
/// read, as while the breaker is open).
async fn day_count(
    http: &reqwest::Client,
    base: &str,
    namespace: &str,
    identifier: &str,
    day: u64,
) -> u64 {
    let read = common::process::read_count(http, base, namespace, identifier, 86_400_000, day);
    read.await.unwrap_or(0)
}

/// A descriptor configuration of the conformance table's limits in a file of its own, for a
/// gateway process's `--rls-config` (removed when dropped): entry keys `conf`, `far` and
/// `late` limited to `LIMIT`, `BURST_LIMIT` and `LATE_LIMIT` a day.
struct RlsConfigFile(std::path::PathBuf);

impl RlsConfigFile {
    fn new(name: &str) -> Self {
        use common::conformance::{BURST_LIMIT, LATE_LIMIT, LIMIT};
        let path = std::env::temp_dir().join(format!("strata-{name}-{}.yaml", std::process::id()));
        let limits = [("conf", LIMIT), ("far", BURST_LIMIT), ("late", LATE_LIMIT)];
        std::fs::write(&path, common::rls::conformance_config(&limits)).unwrap();
        Self(path)
    }

    /// A gateway process started with `args` and its rate-limit service on this
    /// configuration, and the service's address.
    fn gateway(&self, args: &[&str]) -> (GatewayProcess, String) {
        let listen = format!("127.0.0.1:{}", common::free_port());
        let path = self.0.to_str().unwrap();
        let rls = ["--rls-listen", listen.as_str(), "--rls-config", path];
        (GatewayProcess::start(&[args, &rls].concat()), listen)
    }
}

impl Drop for RlsConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The conformance table's rows with the origin up, through a gateway process's HTTP API and
/// its rate-limit service: a burst on a cold key makes one Redis decision, a pass ahead
/// reaches Redis by the replay, and what the gateway admitted from memory while its Redis was
/// down reaches Redis once it is back, with no request to carry it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_makes_one_redis_decision_and_an_outages_passes_reach_redis_after() {
    let http = reqwest::Client::new();
    let mut redis = RedisServer::start();
    let url = redis.url();
    let config = RlsConfigFile::new("conformance-up");
    let (mut g, rls_listen) = config.gateway(&["--redis-url", &url, "--origin-timeout", "250ms"]);
    g.ready(&http).await;
    let base = g.base.clone();
    let send = |limit: u64| {
        let (http, base) = (http.clone(), base.clone());
        move |key| conformance_limit(http.clone(), base.clone(), key, limit)
    };
    let calls = || common::process::decide_calls(&http, &base);
    let tag = std::process::id();
    let runtime = "gateway, Redis up";
    let burst = send(common::conformance::BURST_LIMIT);
    common::conformance::one_call(runtime, &format!("burst-{tag}"), burst, calls).await;
    // A cell's count at Redis, read through the gateway (0 while the breaker is open).
    let today = today();
    let count = |namespace: &'static str, identifier: String| {
        let (http, base) = (http.clone(), base.clone());
        move || {
            let (http, base, identifier) = (http.clone(), base.clone(), identifier.clone());
            async move { day_count(&http, &base, namespace, &identifier, today).await }
        }
    };
    let far = format!("far-{tag}");
    let once = send(common::conformance::BURST_LIMIT);
    let counted = count("conformance", far.clone());
    common::conformance::replayed_not_decided(runtime, &far, once, calls, counted).await;

    // The same rows through the rate-limit service: its descriptor `far=<value>` is the key.
    let rls = common::rls::RlsClient::new(&rls_listen);
    let runtime = "RLS, Redis up";
    let burst = format!("rls-burst-{tag}");
    common::conformance::one_call(runtime, &burst, rls.sends("far"), calls).await;
    let value = format!("rls-far-{tag}");
    let counted = count(common::rls::DOMAIN, format!("far={value}"));
    common::conformance::replayed_not_decided(runtime, &value, rls.sends("far"), calls, counted)
        .await;

    // The pacing of passes ahead, through both.
    let paced = |prefix: &str| -> Vec<String> {
        (0..common::conformance::PACED_KEYS)
            .map(|i| format!("{prefix}paced-{tag}-{i}"))
            .collect()
    };
    let counts = |namespace: &'static str, identifiers: Vec<String>| {
        let (http, base) = (http.clone(), base.clone());
        move || {
            let (http, base, identifiers) = (http.clone(), base.clone(), identifiers.clone());
            async move {
                let ids: Vec<&str> = identifiers.iter().map(String::as_str).collect();
                let read =
                    common::process::read_counts(&http, &base, namespace, &ids, 86_400_000, today);
                read.await.unwrap_or_default()
            }
        }
    };
    let keys = paced("");
    let counted = counts("conformance", keys.clone());
    let far = send(common::conformance::BURST_LIMIT);
    common::conformance::passes_ahead_wait_for_their_turn("gateway", &keys, far, counted).await;
    let keys = paced("rls-");
    let counted = counts(
        common::rls::DOMAIN,
        keys.iter().map(|k| format!("far={k}")).collect(),
    );
    common::conformance::passes_ahead_wait_for_their_turn("RLS", &keys, rls.sends("far"), counted)
        .await;

    redis.stop();
    let (key, value) = (format!("outage-{tag}"), format!("rls-outage-{tag}"));
    let (mut admitted, mut admitted_rls) = (0, 0);
    let send = send(common::conformance::LIMIT);
    for _ in 0..common::conformance::REQUESTS {
        admitted += u64::from(send(key.clone()).await.unwrap());
        admitted_rls += u64::from(rls.admits("conf", &value).await.unwrap());
    }
    redis.restart();
    let http_count = count("conformance", key);
    common::conformance::replayed_after_outage("gateway, Redis", admitted, http_count).await;
    let rls_count = count(common::rls::DOMAIN, format!("conf={value}"));
    common::conformance::replayed_after_outage("RLS, Redis", admitted_rls, rls_count).await;
}

/// The conformance table's late-answer row through a gateway process whose Redis answers
/// every command 250 ms late: eight requests at once on a cold key, the ones the first answer
/// does not cover make a second call with what is left of their time, and every answer comes
/// within the origin timeout of its request's arrival.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_waited_on_a_late_call_answer_within_their_own_timeout() {
    use common::conformance::{LATE_DELAY, LATE_LIMIT, LATE_TIMEOUT_MS};
    let http = reqwest::Client::new();
    let redis = RedisServer::start();
    let slow = common::slow::SlowProxy::start(redis.port, LATE_DELAY).await;
    let url = format!("redis://127.0.0.1:{}", slow.port);
    let timeout = format!("{LATE_TIMEOUT_MS}ms");
    let config = RlsConfigFile::new("conformance-late");
    let (mut g, rls_listen) = config.gateway(&["--redis-url", &url, "--origin-timeout", &timeout]);
    g.ready(&http).await;
    let base = g.base.clone();
    let send = {
        let (http, base) = (http.clone(), base.clone());
        move |key| conformance_limit(http.clone(), base.clone(), key, LATE_LIMIT)
    };
    // Redis loads the decide script on the first call (two more late round trips than the
    // timeout allows): keys of their own until a decision comes back from Redis.
    let decided = || async {
        let text = common::process::metrics(&http, &base).await;
        common::process::metric_sum(&text, |l| {
            l.starts_with("strata_origin_calls_total{")
                && l.contains("op=\"decide\"")
                && l.contains("result=\"ok\"")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    for i in 0.. {
        assert!(
            Instant::now() < deadline,
            "no decision came back from Redis"
        );
        send(format!("warm-{i}-{}", std::process::id()))
            .await
            .unwrap();
        if decided().await >= 1.0 {
            break;
        }
    }
    let key = format!("late-{}", std::process::id());
    let calls = || common::process::decide_calls(&http, &base);
    common::conformance::late_answers("gateway", &key, send, calls).await;
    // The same row through the rate-limit service.
    let rls = common::rls::RlsClient::new(&rls_listen);
    let key = format!("rls-late-{}", std::process::id());
    common::conformance::late_answers("RLS", &key, rls.sends("late"), calls).await;
}

/// The conformance table's lost-answer row through a gateway process's HTTP API and its
/// rate-limit service: the gateway's Redis answers every command [`LATE_DELAY`] late, past its
/// `--origin-timeout` of [`LOST_TIMEOUT_MS`], so Redis counts each decision call while the
/// failure mode (`local`) admits its request from memory, and the replay's undo of those calls
/// leaves Redis counting each request once. The counts are read through a second gateway on
/// Redis directly (the slow one's reads time out too).
///
/// [`LATE_DELAY`]: common::conformance::LATE_DELAY
/// [`LOST_TIMEOUT_MS`]: common::conformance::LOST_TIMEOUT_MS
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_redis_answers_too_late_count_each_request_once() {
    use common::conformance::{LATE_DELAY, LATE_LIMIT, LOST_TIMEOUT_MS, lost_answers_count_once};
    let http = reqwest::Client::new();
    let redis = RedisServer::start();
    let tag = std::process::id();
    // The reader's first decision loads Redis's decide script, so each of the slow gateway's
    // decision calls is one late round trip (it finds the script), not a load and a retry.
    let (_reader, reader) = start_gateway(&redis, &http).await;
    let load = conformance_limit(http.clone(), reader.clone(), format!("load-{tag}"), 1);
    assert!(load.await.unwrap());
    let slow = common::slow::SlowProxy::start(redis.port, LATE_DELAY).await;
    let url = format!("redis://127.0.0.1:{}", slow.port);
    let timeout = format!("{LOST_TIMEOUT_MS}ms");
    let config = RlsConfigFile::new("conformance-lost");
    let (mut g, rls_listen) = config.gateway(&["--redis-url", &url, "--origin-timeout", &timeout]);
    // Alive, not ready: its readiness probe, a Redis round trip, outlasts the timeout.
    g.alive(&http).await;
    let base = g.base.clone();
    let today = today();
    let count = |namespace: &'static str, identifier: String| {
        let (http, reader) = (&http, &reader);
        move || {
            let identifier = identifier.clone();
            async move { day_count(http, reader, namespace, &identifier, today).await }
        }
    };
    let calls = || common::process::decide_calls(&http, &base);
    let send = {
        let (http, base) = (http.clone(), base.clone());
        move |key| conformance_limit(http.clone(), base.clone(), key, LATE_LIMIT)
    };
    let key = format!("lost-{tag}");
    let counted = count("conformance", key.clone());
    lost_answers_count_once("gateway", &key, send, calls, counted).await;
    // The same row through the rate-limit service: its descriptor `late=<value>` is the key.
    let rls = common::rls::RlsClient::new(&rls_listen);
    let value = format!("rls-lost-{tag}");
    let counted = count(common::rls::DOMAIN, format!("late={value}"));
    lost_answers_count_once("RLS", &value, rls.sends("late"), calls, counted).await;
}

/// The gateway's replay backs off while its Redis is away, by the core's rule the Wasm shells
/// follow too (`replay_backoff`: the interval, doubling, at most 5 s): over 3 s of outage with
/// a 100 ms interval it tries a handful of times, not thirty; once Redis is back, what it
/// admitted meanwhile reaches Redis with no request to carry it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replay_backs_off_while_redis_is_away() {
    let http = reqwest::Client::new();
    let mut redis = RedisServer::start();
    let url = redis.url();
    let mut g = GatewayProcess::start(&[
        "--redis-url",
        &url,
        "--replay-interval",
        "100ms",
        "--origin-timeout",
        "250ms",
    ]);
    g.ready(&http).await;
    let base = g.base.clone();
    let failed = || async {
        let text = common::process::metrics(&http, &base).await;
        common::process::metric_sum(&text, |l| {
            l.starts_with("strata_replay_failed_batches_total")
        }) as u64
    };
    redis.stop();
    let key = format!("backoff-{}", std::process::id());
    let admitted = conformance_limit(http.clone(), base.clone(), key.clone(), 5).await;
    assert_eq!(
        admitted,
        Ok(true),
        "decided from memory while Redis is away"
    );
    let before = failed().await;
    tokio::time::sleep(Duration::from_secs(3)).await; // the window the tries are counted in
    let tries = failed().await - before;
    println!("replay batches failed in 3 s of outage, 100 ms interval: {tries}");
    assert!(
        (1..=6).contains(&tries),
        "{tries} failed replay batches in 3 s: without a backoff about 30"
    );
    redis.restart();
    let day = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        / 86_400_000;
    let deadline = Instant::now() + common::conformance::REPLAY_BOUND;
    loop {
        let read = common::process::read_count(&http, &base, "conformance", &key, 86_400_000, day);
        match read.await {
            Ok(1) => break,
            Ok(n) => assert_eq!(n, 0, "Redis counts {n}, over the 1 admitted"),
            Err(_) => {} // the breaker may still be open
        }
        assert!(
            Instant::now() < deadline,
            "the withheld pass never reached Redis"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The failure-mode table (`common::conformance`) through gateway processes whose Redis is a
/// port nothing listens on, or one that never answers: each mode as named, no answer slower
/// than the origin timeout and a little, through the HTTP API and through Envoy's rate-limit
/// service (gRPC) of the same process, with the same expected figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_modes_decide_as_named_while_redis_is_unreachable() {
    let http = reqwest::Client::new();
    let (outages, held) = common::conformance::outages().await;
    let config = RlsConfigFile::new("conformance-down");
    for ((outage, port), (mode, admitted)) in outages
        .iter()
        .flat_map(|o| common::conformance::TABLE.map(|row| (*o, row)))
    {
        let url = match outage {
            common::conformance::Outage::NoEndpoints => {
                format!("redis://{}:6379", common::conformance::NO_ENDPOINTS)
            }
            _ => format!("redis://127.0.0.1:{port}"),
        };
        let (mut g, rls_listen) = config.gateway(&[
            "--redis-url",
            &url,
            "--failure-mode",
            mode,
            "--origin-timeout",
            "250ms",
        ]);
        g.alive(&http).await;
        let (client, base) = (http.clone(), g.base.clone());
        let runtime = format!("gateway, Redis {outage:?}");
        let far = |key| {
            conformance_limit(
                http.clone(),
                g.base.clone(),
                key,
                common::conformance::BURST_LIMIT,
            )
        };
        let send = move |key| {
            conformance_limit(
                client.clone(),
                base.clone(),
                key,
                common::conformance::LIMIT,
            )
        };
        common::conformance::check(&runtime, mode, 250, send, far).await;
        let text = common::metrics(&http, &g.base).await;
        let fallback = common::metric_sum(&text, |l| {
            l.starts_with("strata_decisions_total{source=\"fallback\"")
        });
        // Every pass is the failure mode's (a denial may be the local count's own).
        #[allow(clippy::cast_precision_loss)]
        let passes = (2 * admitted).max(1) as f64;
        assert!(
            fallback >= passes,
            "{mode}: the answers say the failure mode decided them ({fallback})"
        );
        let ahead = common::metric_sum(&text, |l| {
            l.starts_with("strata_decisions_total{source=\"ahead\"")
        });
        assert_eq!(
            ahead > 0.0,
            mode != "deny",
            "{mode}: decided ahead ({ahead})"
        );
        // The same rows through the rate-limit service (its keys are `conf=`/`far=` entries).
        let rls = common::rls::RlsClient::new(&rls_listen);
        let runtime = format!("RLS, Redis {outage:?}");
        common::conformance::check(&runtime, mode, 250, rls.sends("conf"), rls.sends("far")).await;
    }
    held.abort();
}

/// A connection to `base`'s address with one whole `POST /v1/ratelimit` answered on it (so
/// the gateway serves the connection), kept alive for more.
async fn served_connection(base: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let address = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(address).await.unwrap();
    let body = r#"{"namespace":"api","identifier":"held","limit":100,"duration":60000}"#;
    let request = format!(
        "POST /v1/ratelimit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).await.unwrap();
    // One answer: its headers, then the body its Content-Length gives.
    let answer = read_until(&mut s, |a| head_ends(a) && a.ends_with(b"}")).await;
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    s
}

/// Whether `said` holds a whole response head.
fn head_ends(said: &[u8]) -> bool {
    said.windows(4).any(|w| w == b"\r\n\r\n")
}

/// What the gateway writes on `s` until `done` says it is enough (10 s at most; the gateway
/// closing the connection first fails).
async fn read_until(s: &mut tokio::net::TcpStream, done: impl Fn(&[u8]) -> bool) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut said = Vec::new();
    let mut buf = [0_u8; 4096];
    while !done(&said) {
        let read = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await;
        let n = read.expect("no answer within 10 s").unwrap();
        assert!(n > 0, "the gateway closed the connection");
        said.extend_from_slice(&buf[..n]);
    }
    said
}

/// The headers of a `POST /v1/ratelimit` and 1 byte of its 100-byte body, then silence: a
/// stalled client.
async fn stall(s: &mut tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    // `Expect: 100-continue`: the gateway says `100 Continue` once its handler reads the body,
    // so the request is known to be in flight (a SIGTERM before the gateway read the head
    // found an idle connection, closed at once, and nothing to wait for).
    s.write_all(
        b"POST /v1/ratelimit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n",
    )
    .await
    .unwrap();
    let said = read_until(s, head_ends).await;
    assert!(
        said.starts_with(b"HTTP/1.1 100"),
        "{}",
        String::from_utf8_lossy(&said)
    );
    s.write_all(b"{").await.unwrap();
}

/// What the gateway wrote on `s` before closing it (the client reads the end of the stream, or
/// a reset), if it closes it within `within`.
async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut buf = [0_u8; 4096];
    let mut said = Vec::new();
    let end = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(end, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some(String::from_utf8_lossy(&said).into_owned()),
            Ok(Ok(n)) => said.extend_from_slice(&buf[..n]),
        }
    }
}

/// A client that sends half a request and waits cannot hold the gateway's shutdown: SIGTERM
/// stops it within `--shutdown-timeout`, and the replay and the last flush still happen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_client_does_not_hold_the_shutdown() {
    let http = reqwest::Client::new();
    let log = std::env::temp_dir().join(format!("strata-stalled-{}.log", std::process::id()));
    // A read timeout far past the test, so only the shutdown deadline can end the stall.
    let mut g = GatewayProcess::start_logged(
        &[
            "--shutdown-timeout",
            "2s",
            "--read-timeout",
            "1h",
            "--replay-interval",
            "1h",
        ],
        &[],
        Some(&log),
    );
    g.ready(&http).await;
    let mut held = served_connection(&g.base).await;
    stall(&mut held).await;
    let started = Instant::now();
    let code = g.terminate();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    assert_eq!(
        code,
        Some(0),
        "the gateway exited (in {:?})\n{text}",
        started.elapsed()
    );
    assert!(
        text.contains("shutdown: requests still open at --shutdown-timeout")
            && text.contains("shutdown: replay delivered"),
        "{text}"
    );
    drop(held);
}

/// A client silent in the middle of a request is disconnected after `--read-timeout`; a
/// kept-alive connection is not (it is idle, not stalled), until `--idle-timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_is_disconnected_after_the_read_timeout_an_idle_one_after_the_idle_timeout()
{
    let http = reqwest::Client::new();
    let mut g = GatewayProcess::start(&["--read-timeout", "1s", "--idle-timeout", "4s"]);
    g.ready(&http).await;
    let mut stalled = served_connection(&g.base).await;
    stall(&mut stalled).await;
    let mut idle = served_connection(&g.base).await;
    let started = Instant::now();
    let said = closed_within(&mut stalled, Duration::from_secs(10)).await;
    let said = said.expect("a stalled request is cut");
    assert!(
        said.starts_with("HTTP/1.1 400") && said.contains("request body not received whole"),
        "{said}"
    );
    let cut_after = started.elapsed();
    assert!(
        cut_after < Duration::from_secs(4),
        "cut by --read-timeout, not later: {cut_after:?}"
    );
    // The idle connection outlived the read timeout, and is closed at the idle timeout.
    assert!(
        closed_within(&mut idle, Duration::from_millis(1_500))
            .await
            .is_none(),
        "an idle connection is not cut at --read-timeout"
    );
    assert!(
        closed_within(&mut idle, Duration::from_secs(10))
            .await
            .is_some(),
        "an idle connection is cut at --idle-timeout"
    );
}

/// Past `--max-connections` the gateway accepts no more: a third connection is answered only
/// once one of the two held open closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_bound_wait_for_a_free_one() {
    // Readiness is checked on connections the client does not keep: both places free after.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut g = GatewayProcess::start(&["--max-connections", "2"]);
    g.ready(&http).await;
    let bounded = Duration::from_secs(10);
    let first = tokio::time::timeout(bounded, served_connection(&g.base))
        .await
        .unwrap();
    let _second = tokio::time::timeout(bounded, served_connection(&g.base))
        .await
        .unwrap();
    let base = g.base.clone();
    let third = tokio::spawn(async move { served_connection(&base).await });
    // While both places are held, the third is not served.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !third.is_finished(),
        "a third connection served past --max-connections 2"
    );
    drop(first);
    let served = tokio::time::timeout(Duration::from_secs(10), third).await;
    assert!(
        served.is_ok_and(|r| r.is_ok()),
        "the third served once a place is free"
    );
}

/// The lost-answer row through a gateway process: a decision Redis applies only after the
/// origin timeout (its clients paused half a second) is decided by the failure mode, and the
/// replay of that pass carries the undo of the lost call, so Redis counts the request once
/// with no further request on the key. A decision Redis answered in time (a machine that
/// stalled past the pause) is not the row: set up again on a fresh key, three times at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_lost_to_a_stalled_redis_counts_the_request_once() {
    let http = reqwest::Client::new();
    let redis = RedisServer::start();
    let url = redis.url();
    let mut g = GatewayProcess::start(&["--redis-url", &url, "--origin-timeout", "150ms"]);
    g.ready(&http).await;
    let base = g.base.clone();
    let send = |key: String| conformance_limit(http.clone(), base.clone(), key, 10);
    // The decide script is loaded by a first call, so the stalled call is one command.
    assert!(send(format!("warm-{}", std::process::id())).await.unwrap());
    let fallback = || async {
        let text = common::metrics(&http, &base).await;
        common::metric_sum(&text, |l| {
            l.starts_with("strata_decisions_total{source=\"fallback\"")
        })
    };
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let day = since.unwrap().as_secs() / 86_400;
    for attempt in 0..3 {
        let key = format!("lost-{}-{attempt}", std::process::id());
        let before = fallback().await;
        // Every command waits half a second from here (the pause is on once Redis answers).
        assert_eq!(redis.cli(&["CLIENT", "PAUSE", "500", "ALL"]), "OK");
        assert!(send(key.clone()).await.unwrap(), "admitted");
        if fallback().await == before {
            continue; // Redis answered in time: not the row
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut counted = 0;
        while Instant::now() < deadline {
            let read =
                common::process::read_count(&http, &base, "conformance", &key, 86_400_000, day);
            counted = read.await.unwrap_or(0);
            if counted == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(counted, 1, "one request admitted, counted once");
        return;
    }
    panic!("Redis answered within the timeout three times: the pause never caught a decision");
}

/// The edge's abandoned-request case through a gateway process: clients that hang up while
/// their requests wait on Redis (its clients paused half a second) leave the gateway deciding
/// exactly: a fresh key gets its limit and no more, with no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_abandoned_while_waiting_leave_the_gateway_deciding_exactly() {
    const ABANDONED: usize = 100;
    let http = reqwest::Client::new();
    let redis = RedisServer::start();
    let url = redis.url();
    let mut g = GatewayProcess::start(&["--redis-url", &url, "--origin-timeout", "1500ms"]);
    g.ready(&http).await;
    let base = g.base.clone();
    // The decide script is loaded by a first call.
    let warm = format!("warm-{}", std::process::id());
    assert!(
        conformance_limit(http.clone(), base.clone(), warm, 3)
            .await
            .unwrap()
    );
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "500", "ALL"]), "OK");
    let gone: Vec<_> = (0..ABANDONED)
        .map(|i| {
            let (http, base) = (impatient.clone(), base.clone());
            let key = format!("gone-{}-{i}", std::process::id());
            tokio::spawn(async move { conformance_limit(http, base, key, 3).await.is_err() })
        })
        .collect();
    let mut hung_up = 0;
    for h in gone {
        hung_up += usize::from(h.await.unwrap());
    }
    assert!(
        hung_up * 2 > ABANDONED,
        "{hung_up} of {ABANDONED} clients hung up"
    );
    let key = format!("after-{}", std::process::id());
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(
            conformance_limit(http.clone(), base.clone(), key.clone(), 3)
                .await
                .unwrap(),
        );
    }
    println!("{hung_up} of {ABANDONED} clients hung up while waiting on Redis; then {got:?}");
    assert_eq!(got, [true, true, true, false]);
}

/// The bound on a cell's writers from outside, through a gateway process's origin API: a
/// client replaying under more instance ids than a cell keeps (`ledger::MAX_HOLDERS`, each id
/// new) leaves the Redis hash within the bound, and every count it replayed counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invented_instance_ids_keep_a_cell_on_redis_within_its_bound() {
    use strata_core::ledger::{EVICT_BATCH, MAX_HOLDERS};
    let http = reqwest::Client::new();
    let redis = RedisServer::start();
    let (_g, base) = start_gateway(&redis, &http).await;
    let day: u64 = 86_400_000;
    let sequence = common::process::unix_ms() / day;
    let identifier = format!("crowded-{}", std::process::id());
    let writers = MAX_HOLDERS + EVICT_BATCH + 10;
    for i in 0..writers {
        let event = json!({"namespace": "api", "identifier": identifier, "duration": day,
            "sequence": sequence, "used": 1, "limit": 1_000_000});
        let body = json!({"instance": format!("invented-{i:05}"), "events": [event]});
        let answer = post(&http, format!("{base}/v1/origin/replay"), body).await;
        assert!(answer.get("error").is_none(), "writer {i}: {answer}");
    }
    let counted = common::process::read_count(&http, &base, "api", &identifier, day, sequence);
    assert_eq!(
        counted.await.unwrap(),
        writers as u64,
        "every replayed count counted"
    );
    let key = strata_core::WindowKeyRef::new(
        "default",
        "api",
        &identifier,
        strata_core::WindowDuration::from_ms(day).unwrap(),
    )
    .unwrap();
    let cell = strata_gateway::origin::redis::cell_key(key, sequence);
    let fields: usize = redis.cli(&["HLEN", &cell]).parse().unwrap();
    assert!(
        fields <= MAX_HOLDERS + 8,
        "{fields} fields for {writers} writers"
    );
}
