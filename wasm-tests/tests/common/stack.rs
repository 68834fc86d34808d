//! The stack every end-to-end test stands on: a private Redis, a `strata-gateway` process on it
//! and a loopback upstream; and the requests and reads the tests make of it.

use std::time::{Duration, Instant};

use reqwest::header::HeaderMap;
use serde_json::{Value, json};

use super::process::GatewayProcess;
use super::redis::RedisServer;
use super::upstream::Upstream;

pub const DAY_MS: u64 = 86_400_000;

pub struct Stack {
    pub http: reqwest::Client,
    pub redis: RedisServer,
    pub gateway: Option<GatewayProcess>,
    pub upstream: Upstream,
}

/// A private Redis, a gateway process on it, and an upstream.
pub async fn stack() -> Stack {
    stack_with(&[]).await
}

/// [`stack`], the gateway started with `args` too.
pub async fn stack_with(args: &[&str]) -> Stack {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut gateway = GatewayProcess::start(&[&["--redis-url", url.as_str()], args].concat());
    let http = reqwest::Client::new();
    gateway.ready(&http).await;
    Stack {
        http,
        redis,
        gateway: Some(gateway),
        upstream: Upstream::start().await,
    }
}

impl Stack {
    pub fn gateway(&self) -> &str {
        &self.gateway.as_ref().unwrap().base
    }

    /// The gateway's (Redis's) count of a cell: window `duration` at Unix ms `at`.
    pub async fn regional_at(
        &self,
        namespace: &str,
        identifier: &str,
        duration: u64,
        at: u64,
    ) -> u64 {
        self.read_cell(namespace, identifier, duration, at)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`regional_at`](Self::regional_at), or what the gateway answered instead (its Redis
    /// may be down).
    pub async fn read_cell(
        &self,
        namespace: &str,
        identifier: &str,
        duration: u64,
        at: u64,
    ) -> Result<u64, String> {
        let sequence = at / duration;
        super::process::read_count(
            &self.http,
            self.gateway(),
            namespace,
            identifier,
            duration,
            sequence,
        )
        .await
    }

    /// Decision calls the gateway made to Redis so far: one per decision call an edge made.
    pub async fn decide_calls(&self) -> u64 {
        super::process::decide_calls(&self.http, self.gateway()).await
    }

    /// Replay calls the gateway made to Redis so far: one per replay batch the shells sent
    /// it, and its own (none: nothing passes at the gateway itself here).
    pub async fn replay_calls(&self) -> f64 {
        super::process::origin_calls(&self.http, self.gateway(), "replay").await
    }

    /// The conformance table's pass-ahead row (`conformance::replayed_not_decided`) through the
    /// shell at `base` (rules `per_key_rules(conformance::BURST_LIMIT)`, the gateway up): a
    /// cold key's request is admitted with no decision call, the replay brings it to Redis,
    /// and the key in demand then costs one decision call.
    pub async fn pass_ahead_row(&self, runtime: &str, base: &str) {
        let key = format!("far-{}-{}", std::process::id(), now_ms());
        let (at, identifier) = (now_ms(), format!("key={key}"));
        let (http, url) = (self.http.clone(), base.to_string());
        let send = move |key: String| {
            let (http, url) = (http.clone(), url.clone());
            async move { admitted(&http, &url, &key).await }
        };
        let count = || async {
            self.read_cell("e2e", &identifier, DAY_MS, at)
                .await
                .unwrap_or(0)
        };
        let calls = || self.decide_calls();
        super::conformance::replayed_not_decided(runtime, &key, send, calls, count).await;
    }

    /// The conformance table's pass-ahead pacing row
    /// (`conformance::passes_ahead_wait_for_their_turn`) through the shell at `base` (rules
    /// `per_key_rules(conformance::BURST_LIMIT)`, the gateway up), on keys of its own.
    pub async fn pacing_row(&self, runtime: &str, base: &str) {
        let at = now_ms();
        let keys: Vec<String> = (0..super::conformance::PACED_KEYS)
            .map(|i| format!("paced-{}-{at}-{i}", std::process::id()))
            .collect();
        let identifiers: Vec<String> = keys.iter().map(|k| format!("key={k}")).collect();
        let (http, url) = (self.http.clone(), base.to_string());
        let send = move |key: String| {
            let (http, url) = (http.clone(), url.clone());
            async move { admitted(&http, &url, &key).await }
        };
        let counts = || async {
            let ids: Vec<&str> = identifiers.iter().map(String::as_str).collect();
            let read = super::process::read_counts(
                &self.http,
                self.gateway(),
                "e2e",
                &ids,
                DAY_MS,
                at / DAY_MS,
            );
            read.await.unwrap_or_default()
        };
        super::conformance::passes_ahead_wait_for_their_turn(runtime, &keys, send, counts).await;
    }

    /// The conformance table's replay row (`conformance::replayed_after_outage`) through the
    /// edge at `base` (rules `per_key_rules(conformance::LIMIT)`, failure mode `local`):
    /// Redis stopped, `REQUESTS` requests on a cold key decided from memory, Redis back, and
    /// no request since.
    pub async fn replay_row(&mut self, runtime: &str, base: &str) {
        use super::conformance::{REQUESTS, replayed_after_outage};
        let key = format!("outage-{}-{}", std::process::id(), now_ms());
        let at = now_ms();
        self.redis.stop();
        let mut passed = 0;
        for _ in 0..REQUESTS {
            passed += u64::from(admitted(&self.http, base, &key).await.unwrap());
        }
        self.redis.restart();
        let identifier = format!("key={key}");
        let count = || async {
            self.read_cell("e2e", &identifier, DAY_MS, at)
                .await
                .unwrap_or(0)
        };
        replayed_after_outage(runtime, passed, count).await;
    }

    /// The conformance table's lost-answer row (`conformance::lost_answers_count_once`)
    /// through the shell at `base` (rules `per_key_rules(conformance::LATE_LIMIT)`, timeout
    /// `conformance::LOST_TIMEOUT_MS`, the gateway behind a proxy `LATE_DELAY` late).
    pub async fn lost_answer_row(&self, runtime: &str, base: &str) {
        let (key, at) = (
            format!("lost-{}-{}", std::process::id(), now_ms()),
            now_ms(),
        );
        let (http, url) = (self.http.clone(), base.to_string());
        let send = move |key: String| {
            let (http, url) = (http.clone(), url.clone());
            async move { admitted(&http, &url, &key).await }
        };
        let identifier = format!("key={key}");
        let count = || async {
            let read = self.read_cell("e2e", &identifier, DAY_MS, at);
            read.await.unwrap_or(0)
        };
        let calls = || self.decide_calls();
        super::conformance::lost_answers_count_once(runtime, &key, send, calls, count).await;
    }

    /// Polls the gateway until its count of a one-day cell is `want` (10 s at most); returns
    /// the last count.
    pub async fn settles_at(&self, namespace: &str, identifier: &str, want: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = self
                .regional_at(namespace, identifier, DAY_MS, now_ms())
                .await;
            if n == want || Instant::now() > deadline {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Checks a 20x burst on `e2e`/`key=burst` (limit 100) from outside: within 5% of the
    /// limit, every admitted request reached the upstream, and the gateway counted each once.
    pub async fn assert_burst_counted(&self, admitted: u64) {
        assert!(admitted <= 105, "admitted {admitted} > 1.05x the limit");
        assert!(
            admitted >= 95,
            "admitted only {admitted}: the edge denies what it should pass"
        );
        assert_eq!(self.upstream.hits(), admitted);
        assert_eq!(
            self.settles_at("e2e", "key=burst", admitted).await,
            admitted,
            "counted once each"
        );
    }

    /// The sum of the gateway's `/metrics` samples whose line starts with `prefix`.
    pub async fn gateway_metric(&self, prefix: &str) -> u64 {
        let text = super::process::metrics(&self.http, self.gateway()).await;
        // Counter samples are whole numbers.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let sum = super::process::metric_sum(&text, |l| l.starts_with(prefix)) as u64;
        sum
    }
}

pub async fn get(
    http: &reqwest::Client,
    url: &str,
    headers: &[(&str, &str)],
) -> (u16, HeaderMap, String) {
    let mut request = http.get(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let r = request.send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.text().await.unwrap())
}

/// One GET with `x-api-key: <key>`: whether it passed (200) or was limited (429); any other
/// answer is the error.
pub async fn admitted(http: &reqwest::Client, base: &str, key: &str) -> Result<bool, String> {
    admitted_by(http, base, "x-api-key", key).await
}

/// [`admitted`], the key in header `header`.
pub async fn admitted_by(
    http: &reqwest::Client,
    base: &str,
    header: &str,
    key: &str,
) -> Result<bool, String> {
    let (status, _, body) = get(http, base, &[(header, key)]).await;
    match status {
        200 => Ok(true),
        429 => Ok(false),
        other => Err(format!("{other} {body}")),
    }
}

pub fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// One rule: `limit` a day per `x-api-key`, namespace `e2e`.
pub fn per_key_rules(limit: u64) -> String {
    json!({"rules": [{
        "name": "per-key", "namespace": "e2e", "limit": limit, "duration": "1d",
        "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}]
    }]})
    .to_string()
}

/// The conformance table's rules (`conformance`): `LIMIT` a day per `x-api-key`, and
/// `BURST_LIMIT` a day per `x-far-key` (a key far from its limit).
pub fn conformance_rules() -> Value {
    use super::conformance::{BURST_LIMIT, LIMIT};
    let rule = |name: &str, limit: u64, header: &str| {
        json!({"name": name, "namespace": "e2e", "limit": limit, "duration": "1d",
            "actions": [{"request_headers": {"header_name": header, "descriptor_key": "key"}}]})
    };
    json!([
        rule("per-key", LIMIT, "x-api-key"),
        rule("far", BURST_LIMIT, "x-far-key")
    ])
}

/// The rivals row's rule: [`RIVALS_LIMIT`] per 2 s per `x-api-key`, namespace `e2e`: a key
/// over it frees a unit every 100 ms.
pub fn rivals_rule() -> Value {
    let duration = format!("{}ms", RIVALS_WINDOW_MS);
    json!({"name": "rivals", "namespace": "e2e", "limit": RIVALS_LIMIT, "duration": duration,
        "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}]})
}

/// The rivals row's limit (see [`rivals_rule`]).
pub const RIVALS_LIMIT: u64 = 20;
/// The rivals row's window (see [`rivals_rule`]).
pub const RIVALS_WINDOW_MS: u64 = 2_000;

impl Stack {
    /// One client per shell process of `bases`, each sending `key` every `every` for `run`
    /// (a tick missed waits, it is not made up): the requests sent and admitted, all clients
    /// together.
    async fn paced_clients(
        &self,
        bases: [&str; 2],
        key: &str,
        every: Duration,
        run: Duration,
    ) -> (u64, u64) {
        let clients = bases.map(|base| {
            let (http, url, key) = (self.http.clone(), base.to_string(), key.to_string());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let (started, mut sent, mut passed) = (Instant::now(), 0_u64, 0_u64);
                while started.elapsed() < run {
                    tick.tick().await;
                    sent += 1;
                    passed += u64::from(admitted(&http, &url, &key).await.unwrap());
                }
                (sent, passed)
            })
        });
        let (mut sent, mut passed) = (0, 0);
        for client in clients {
            let (s, p) = client.await.unwrap();
            (sent, passed) = (sent + s, passed + p);
        }
        (sent, passed)
    }

    /// The rivals row, as `regional-gateway/tests/it/exact_processes.rs` runs it on two gateway
    /// processes: through two processes of a shell (`bases`, rules [`rivals_rule`]), one client
    /// each keeps one key over its limit for 8 s (a request every 7 ms). Each unit the window
    /// frees shows in both processes' views at once; a process that lost one to the other
    /// leaves it the next, so there is about one decision call per admission (two processes
    /// each asking for every unit made about two). The budget is used and no more. The run
    /// starts just before a window ends, so the first lease outlives its window mostly unused
    /// (held back from the next window, it made both processes ask on every request).
    pub async fn rivals_row(&self, runtime: &str, bases: [&str; 2]) {
        const RUN: Duration = Duration::from_secs(8);
        let key = format!("rivals-{}-{}", std::process::id(), now_ms());
        let before = self.decide_calls().await;
        // Start 20 ms before a window ends: the first lease is lent in a window about to roll
        // over, mostly unused, and the next window is where both processes decide.
        super::process::before_window_ends(RIVALS_WINDOW_MS, 20).await;
        let (_, passed) = self
            .paced_clients(bases, &key, Duration::from_millis(7), RUN)
            .await;
        let decides = self.decide_calls().await - before;
        println!(
            "{runtime}: two processes over a limit of {RIVALS_LIMIT} per 2 s: {passed} admitted, {decides} decision calls"
        );
        // The run touches at most five 2 s windows and fills at least three.
        assert!(passed <= RIVALS_LIMIT * 5, "{runtime}: {passed} admitted");
        assert!(
            passed >= RIVALS_LIMIT * 3,
            "{runtime}: only {passed} admitted"
        );
        assert!(
            decides as f64 <= 1.5 * passed as f64,
            "{runtime}: {decides} decision calls for {passed} admissions"
        );
    }

    /// The quiet-holder row, as `regional-gateway/tests/it/exact_processes.rs` runs it on two
    /// gateway processes, through two processes of a shell (`bases`, rules [`rivals_rule`]):
    /// the first is sent one request 20 ms before a window ends, then nothing; the second's
    /// client keeps the key over its limit for 3 s from the next window's start. What the
    /// first was lent there goes back with its next replay pass (its clock left the window,
    /// so it admits nothing more under it), whether its answer came before the window ended or
    /// after: kept, it weighed in the next window's previous term, which no view sees, and the
    /// second process asked on every request (146-154 decisions for 32 admissions through
    /// gateway processes) until an idle lease went back a second later.
    pub async fn quiet_holder_row(&self, runtime: &str, bases: [&str; 2]) {
        let mut attempts = 0;
        let (key, before, window_end) = loop {
            attempts += 1;
            assert!(
                attempts <= 5,
                "{runtime}: no request was decided before its window ended"
            );
            let key = format!("quiet-{}-{}", std::process::id(), now_ms());
            let before = self.decide_calls().await;
            let window_end = super::process::before_window_ends(RIVALS_WINDOW_MS, 20).await;
            let (status, headers, body) = get(&self.http, bases[0], &[("x-api-key", &key)]).await;
            assert_eq!(status, 200, "{runtime}: {body}");
            // `t` is the seconds left of the window it was decided in, rounded up: 1 there,
            // 2 in the next one (2 s windows). Decided in the next, its lease is the next
            // window's, another case (an idle lease, given back after a second): again, on a
            // new key at the next window's end.
            let ratelimit = header(&headers, "ratelimit").unwrap_or_default();
            if ratelimit.ends_with(";t=1") {
                break (key, before, window_end);
            }
        };
        tokio::time::sleep(Duration::from_millis(window_end.saturating_sub(now_ms()))).await;
        let mut tick = tokio::time::interval(Duration::from_millis(7));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let started = Instant::now();
        let mut passed = 1;
        while started.elapsed() < Duration::from_secs(3) {
            tick.tick().await;
            passed += u64::from(admitted(&self.http, bases[1], &key).await.unwrap());
        }
        let decides = self.decide_calls().await - before;
        println!(
            "{runtime}: a lease left behind by a quiet process: {passed} admitted, {decides} decision calls"
        );
        assert!(passed >= RIVALS_LIMIT, "{runtime}: only {passed} admitted");
        assert!(
            decides as f64 <= 1.3 * passed as f64,
            "{runtime}: {decides} decision calls for {passed} admissions"
        );
    }
}

/// The paced row's rule: [`PACED_LIMIT`] per 2 s per `x-api-key`, namespace `e2e`.
pub fn paced_rule() -> Value {
    json!({"name": "paced", "namespace": "e2e", "limit": PACED_LIMIT, "duration": "2000ms",
        "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}]})
}

/// The paced row's limit: 200 costs for each of two holders, the least on which a lease covers
/// its holder's share of the previous window (`strata_core::lease::COVER_FACTOR`).
pub const PACED_LIMIT: u64 = 400;
const PACED_WINDOW_MS: u64 = 2_000;

impl Stack {
    /// The paced row, as `regional-gateway/tests/it/exact_processes.rs` runs it on gateway
    /// processes: through two processes of a shell (`bases`, rules [`paced_rule`]), one
    /// client each sends a request every 10 ms for 6 s, together the limit's rate. Each
    /// process is lent leases that cover its share of the previous window (the room its own
    /// past passes free as that window decays), so most requests pass from memory: at most
    /// 150 decision calls per 1,000 requests (82-86 through workerd, 56-77 through Envoy; plain
    /// leases, on a limit of 398, made 314 and 356). No window admits more than the limit, read from
    /// the gateway's count of each window once its replays are in, and every pass is counted
    /// there once and reached the upstream. The region is alone, so the shells pace their
    /// replays by the gateway's answers: at most 2 replay calls a process a second.
    ///
    /// A decision call whose answer is lost is decided by the failure mode from memory, which
    /// counts that pass again until the process's next call or replay pass for the cell undoes
    /// it (docs/ARCHITECTURE.md, "A decision whose answer is lost"): a window read before that
    /// may exceed the passes by one per failed call, and never falls short of them.
    /// `counters` reads the two processes' failed decision calls so far, and all their
    /// counters as text for a failure's report.
    pub async fn paced_row<F, Fut>(&self, runtime: &str, bases: [&str; 2], counters: F)
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = (u64, String)>,
    {
        const RUN: Duration = Duration::from_secs(6);
        let key = format!("paced-{}-{}", std::process::id(), now_ms());
        let identifier = format!("key={key}");
        // The region alone (no other is live): the shells learn it from the replay answers.
        super::process::await_gauge(
            &self.http,
            self.gateway(),
            "strata_global_alone",
            1.0,
            Duration::from_secs(15),
        )
        .await;
        let (before, hits) = (self.decide_calls().await, self.upstream.hits());
        let replays_before = self.replay_calls().await;
        let (failed_before, _) = counters().await;
        let first = now_ms() / PACED_WINDOW_MS;
        // When the clients' last request was answered (0: still running).
        let ended = std::sync::atomic::AtomicU64::new(0);
        let clients = async {
            let run = self.paced_clients(bases, &key, Duration::from_millis(10), RUN);
            let sent_passed = run.await;
            ended.store(now_ms(), std::sync::atomic::Ordering::Relaxed);
            sent_passed
        };
        // Each window's count, read a second after it ends (a held cell's replay went a pass
        // before its lease's end, or with the window's rollover; Redis keeps a cell three
        // windows), up to the window the clients ended in: a run that starts at a window's
        // end reaches into one window more than its length spans.
        let windows = async {
            let mut counts = Vec::new();
            for seq in first.. {
                let read_at = (seq + 1) * PACED_WINDOW_MS + 1_000;
                tokio::time::sleep(Duration::from_millis(read_at.saturating_sub(now_ms()))).await;
                let at = seq * PACED_WINDOW_MS;
                counts.push(
                    self.regional_at("e2e", &identifier, PACED_WINDOW_MS, at)
                        .await,
                );
                let ended = ended.load(std::sync::atomic::Ordering::Relaxed);
                if ended > 0 && ended < (seq + 1) * PACED_WINDOW_MS {
                    break;
                }
            }
            counts
        };
        let ((sent, passed), counts) = tokio::join!(clients, windows);
        let decides = self.decide_calls().await - before;
        let replays = self.replay_calls().await - replays_before;
        let (failed, shells) = counters().await;
        let failed = failed - failed_before;
        let per_1000 = decides as f64 * 1_000.0 / sent as f64;
        let replays_per_s = replays / 2.0 / RUN.as_secs_f64();
        println!(
            "{runtime}: two processes paced at a limit of {PACED_LIMIT} per 2 s: {sent} sent, {passed} admitted ({counts:?} by window), {decides} decision calls ({per_1000:.1} per 1,000, {failed} failed), {replays} replay calls ({replays_per_s:.2} a process a second)"
        );
        for n in &counts {
            assert!(
                *n <= PACED_LIMIT,
                "{runtime}: a window admitted {n}: {counts:?}"
            );
        }
        let counted = counts.iter().sum::<u64>();
        let report = format!(
            "{runtime}: counted once each: {counted} counted, {passed} admitted, {failed} decision calls failed; the processes' counters: {shells}"
        );
        // Exact but for failed calls, a call that straddled a window's end included: its pass
        // counts in the cell the gateway chose, and only there (`WindowState::apply_decided`).
        assert!(counted >= passed && counted <= passed + failed, "{report}");
        assert_eq!(
            self.upstream.hits() - hits,
            passed,
            "{runtime}: each pass went upstream"
        );
        // At (or, on a loaded machine, under) the limit's rate: nearly everything passes.
        assert!(
            passed * 100 >= sent * 95,
            "{runtime}: {passed} of {sent} admitted"
        );
        assert!(
            per_1000 <= 150.0,
            "{runtime}: {per_1000:.1} decision calls per 1,000 requests"
        );
        // Alone, a cell its lease covers waits for the holder's next decision or its lease's
        // end (the pace each replay answer states): 0.3-0.9 calls a process a second; a
        // replay of every cell holding cost on every pass made 9-34.
        assert!(
            replays_per_s <= 2.0,
            "{runtime}: {replays_per_s:.2} replay calls a process a second"
        );
    }
}

/// Unix milliseconds.
pub fn now_ms() -> u64 {
    super::process::unix_ms()
}

/// Sends `requests` GETs with `x-api-key: <key>`, `in_flight` at a time, spread in turn over
/// `bases`; the number that passed (200), or the first other status than 429.
pub async fn burst(
    http: &reqwest::Client,
    bases: &[String],
    requests: usize,
    in_flight: usize,
    key: &str,
) -> Result<u64, u16> {
    let bases = std::sync::Arc::new(bases.to_vec());
    let limit = std::sync::Arc::new(tokio::sync::Semaphore::new(in_flight));
    let mut tasks = Vec::new();
    for i in 0..requests {
        let (http, bases, limit, key) =
            (http.clone(), bases.clone(), limit.clone(), key.to_string());
        tasks.push(tokio::spawn(async move {
            let _permit = limit.acquire().await.unwrap();
            let base = &bases[i % bases.len()];
            let r = http
                .get(base)
                .header("x-api-key", key)
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        match t.await.unwrap() {
            200 => admitted += 1,
            429 => {}
            other => return Err(other),
        }
    }
    Ok(admitted)
}

/// The gateway's arguments of the renewal row: leases lent for 2 s.
pub const RENEWING: [&str; 2] = ["--fresh-for", "2s"];

/// The renewal row: one key (`x-api-key: steady`) requested at `url` every 40 ms for 6.5 s,
/// three of [`RENEWING`]'s lease lifetimes, each request passing. Returns how many were sent.
pub async fn steady_use(s: &Stack, url: &str) -> u64 {
    let started = Instant::now();
    let mut sent = 0_u64;
    while started.elapsed() < Duration::from_millis(6_500) {
        let (status, _, body) = get(&s.http, url, &[("x-api-key", "steady")]).await;
        assert_eq!(status, 200, "{body}");
        sent += 1;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    sent
}

/// The renewal row's check at the gateway: it renewed the lease at least once a lifetime.
pub async fn assert_renewed(s: &Stack) {
    let metrics = super::process::metrics(&s.http, s.gateway()).await;
    let renewed = super::process::metric_sum(&metrics, |l| l.starts_with("strata_lease_renewals"));
    assert!(
        renewed >= 2.0,
        "one renewal per lease lifetime at least: {renewed}"
    );
}

/// `n` requests at once through the shell at `base`, each on a key of its own under `tag`,
/// from clients that hang up after 100 ms (while the requests wait on a slow gateway): how
/// many hung up before their answer.
pub async fn abandoned(base: &str, n: usize, tag: u64) -> usize {
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let gone: Vec<_> = (0..n)
        .map(|i| {
            let (http, url) = (impatient.clone(), base.to_string());
            tokio::spawn(async move {
                let r = http
                    .get(&url)
                    .header("x-api-key", format!("gone-{tag}-{i}"));
                r.send().await.is_err()
            })
        })
        .collect();
    let mut hung_up = 0;
    for g in gone {
        hung_up += usize::from(g.await.unwrap());
    }
    hung_up
}
