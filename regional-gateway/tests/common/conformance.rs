//! The failure-mode conformance table: one table, one set of expected figures, run through
//! every runtime (gateway processes, workerd, Envoy) by each runtime's own test, which only
//! supplies how a request is sent and how the origin is taken away. The origin gives no
//! answer (the gateway's Redis, or the edges' gateway, on a port nothing listens on, one that
//! accepts and never answers, or a name with no address behind it); a key of limit `LIMIT`
//! gets `REQUESTS` requests one after another, and another key `REQUESTS` at once. Two more
//! rows with the origin up: `REQUESTS` requests at once on a cold key make one decision call
//! ([`one_call`]), and what a process admitted while the origin was down reaches it once it
//! is back, with no request to carry it ([`replayed_after_outage`]), and a cold key far from
//! its limit passes with no decision call, the replay bringing it, and once in demand costs
//! one decision ([`replayed_not_decided`]).
//! With the origin down, a
//! cold key far from its limit ([`BURST_LIMIT`]) is answered ahead of the origin where the
//! mode decides from memory ([`AHEAD`]). One with the origin late:
//! a request that waited on another's call and then needs one of its own still answers by its
//! arrival plus the timeout ([`late_answers`]).

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;

/// The limit of the table's keys.
pub const LIMIT: u64 = 5;
/// Requests sent to each key.
pub const REQUESTS: usize = 8;
/// What each mode admits of `REQUESTS` on a cold key while the origin gives no answer: up to
/// the limit by the process's own count (`local`); every one until the passes it counted prove
/// the key over its limit (`allow`, so the same here); none (`deny`).
pub const TABLE: [(&str, u64); 3] = [("local", 5), ("allow", 5), ("deny", 0)];

/// What each mode does with the first request on a cold key of limit [`BURST_LIMIT`] while
/// the origin gives no answer: `local` and `allow` admit it from memory at once, ahead of the
/// answer (a key at least 64 times its cost from its limit); `deny` admits nothing the origin
/// did not answer.
pub const AHEAD: [(&str, bool); 3] = [("local", true), ("allow", true), ("deny", false)];

/// Runs the table's row `mode`: `send(key)` sends one request on `key` and says whether it
/// was admitted (or what went wrong); `send_far(key)` the same on a key of limit
/// [`BURST_LIMIT`]. Every answer must come within `timeout_ms + 150`, and one admitted ahead
/// within half the timeout.
pub async fn check<F, Fut, G, GFut>(
    runtime: &str,
    mode: &str,
    timeout_ms: u64,
    send: F,
    send_far: G,
) where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<bool, String>> + Send,
    G: Fn(String) -> GFut,
    GFut: Future<Output = Result<bool, String>>,
{
    let ahead = AHEAD.iter().any(|(m, a)| *m == mode && *a);
    let want = TABLE
        .iter()
        .find(|(m, _)| *m == mode)
        .map(|(_, n)| *n)
        .unwrap_or_else(|| panic!("no row {mode}"));
    let bound = Duration::from_millis(timeout_ms + 150);
    let tag = std::process::id();
    let label = format!("{runtime} {mode}");
    let one = |key: String| {
        let (send, label) = (send.clone(), label.clone());
        async move {
            let started = Instant::now();
            let admitted = send(key).await.unwrap_or_else(|e| panic!("{label}: {e}"));
            (admitted, started.elapsed())
        }
    };
    let mut sequential = 0;
    let mut slowest = Duration::ZERO;
    for _ in 0..REQUESTS {
        let (admitted, took) = one(format!("seq-{mode}-{tag}")).await;
        sequential += u64::from(admitted);
        slowest = slowest.max(took);
    }
    let mut concurrent = 0;
    for (answer, took) in at_once(&format!("burst-{mode}-{tag}"), send).await {
        concurrent += u64::from(answer.unwrap_or_else(|e| panic!("{label}: {e}")));
        slowest = slowest.max(took);
    }
    println!(
        "conformance {runtime} {mode}: admitted {sequential} of {REQUESTS} one after another, \
         {concurrent} of {REQUESTS} at once, slowest answer {slowest:?}"
    );
    assert_eq!(
        (sequential, concurrent),
        (want, want),
        "{runtime} {mode}: admitted (one after another, at once)"
    );
    assert!(
        slowest <= bound,
        "{runtime} {mode}: an answer took {slowest:?}, over {bound:?}"
    );
    let started = Instant::now();
    let far = send_far(format!("far-{mode}-{tag}"))
        .await
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    let took = started.elapsed();
    println!(
        "conformance {runtime} {mode}: a cold key far from its limit: admitted {far} in {took:?}"
    );
    assert_eq!(
        far, ahead,
        "{runtime} {mode}: a cold key far from its limit"
    );
    let half = Duration::from_millis(timeout_ms / 2);
    assert!(
        !ahead || took < half,
        "{runtime} {mode}: admitted ahead of the origin, but after {took:?}"
    );
}

/// How the origin gives no answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outage {
    /// Nothing listens on its port: every call fails at once.
    Closed,
    /// It accepts connections and never answers: every call runs out its timeout.
    Silent,
    /// Its name has no address behind it (`NO_ENDPOINTS`), or Envoy's cluster has no
    /// endpoint: no connection is even tried (the port given is 0).
    NoEndpoints,
}

/// A host name that resolves to nothing (`.invalid` is reserved for that, RFC 2606).
pub const NO_ENDPOINTS: &str = "no-endpoints.invalid";

/// How long what a process admitted while the origin was down may take to reach it once it
/// is back: the replay's longest backoff (5 s) and a margin.
pub const REPLAY_BOUND: Duration = Duration::from_secs(12);

/// The limit of the coalescing row's key: far enough that the first answer's lease covers the
/// burst (near its limit a key is decided at the origin nearly request by request, by
/// design, coalesced or not).
pub const BURST_LIMIT: u64 = 1_000;

/// The coalescing row: `REQUESTS` requests at once on the cold key `key` of limit
/// [`BURST_LIMIT`], the origin up, are decided with one decision call (`calls()` reads how
/// many the origin has seen) and all admitted.
pub async fn one_call<F, Fut, C, CFut>(runtime: &str, key: &str, send: F, calls: C)
where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<bool, String>> + Send,
    C: Fn() -> CFut,
    CFut: Future<Output = u64>,
{
    let before = calls().await;
    let mut admitted = 0;
    for (answer, _) in at_once(key, send).await {
        admitted += u64::from(answer.unwrap_or_else(|e| panic!("{runtime}: {e}")));
    }
    let made = calls().await - before;
    println!(
        "conformance {runtime}: {REQUESTS} requests at once on a cold key: {made} decision \
         call(s), {admitted} admitted"
    );
    assert_eq!(
        (made, admitted),
        (1, REQUESTS as u64),
        "{runtime}: decision calls, admitted"
    );
}

/// The late-answer row's key's limit: the first answer's lease (3 of 10: half of what lies
/// above the last quarter) covers 3 of the 7 requests that waited for it, and the other 4 need
/// a call of their own (the local view, 4 of 10, denies none of them).
pub const LATE_LIMIT: u64 = 10;
/// How late the origin answers in the late-answer row ([`SlowProxy`](super::slow::SlowProxy)).
pub const LATE_DELAY: Duration = Duration::from_millis(300);
/// The timeout of the late-answer row: a call alone is answered within it, a second call
/// after the first is not.
pub const LATE_TIMEOUT_MS: u64 = 400;
/// How far past its timeout a late-answer row's answer may come: a timer that fires late on a
/// busy 2-core machine (workerd's answered 87 ms late once, with 80 allowed), well short of the
/// 600 ms of a waiter that starts its call again with the whole timeout.
pub const LATE_SLACK_MS: u64 = 120;

/// The late-answer row: the origin answers every call [`LATE_DELAY`] after it is made;
/// `REQUESTS` requests at once on the cold key `key` of limit [`LATE_LIMIT`] wait for the first
/// request's call; its answer covers some, and the others make a second call with only what is
/// left of their time ([`LATE_TIMEOUT_MS`] from their arrival). Every answer comes within that
/// and a little ([`LATE_SLACK_MS`]): a waiter that began a call of its own with the whole
/// timeout again answered at twice the delay (600 ms). `calls()` reads the decision calls the
/// origin saw: at least two, or the row did not test what it says.
pub async fn late_answers<F, Fut, C, CFut>(runtime: &str, key: &str, send: F, calls: C)
where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<bool, String>> + Send,
    C: Fn() -> CFut,
    CFut: Future<Output = u64>,
{
    // A machine that stalls past the timeout before the first answer comes makes every
    // request time out at once: bounded and limited still, but with one call the row did not
    // set up what it tests. It is set up again on a fresh key then, three times at most.
    let mut made = 0;
    for attempt in 0..3 {
        let key = format!("{key}-{attempt}");
        let before = calls().await;
        let (mut admitted, mut slowest) = (0, Duration::ZERO);
        for (answer, took) in at_once(&key, send.clone()).await {
            admitted += u64::from(answer.unwrap_or_else(|e| panic!("{runtime}: {e}")));
            slowest = slowest.max(took);
        }
        // The origin may still be answering the second call (the requests gave up on it).
        let deadline = Instant::now() + Duration::from_secs(5);
        made = calls().await - before;
        while made < 2 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            made = calls().await - before;
        }
        println!(
            "conformance {runtime}: {REQUESTS} requests at once on a cold key, the origin \
             {LATE_DELAY:?} late: {made} decision calls, {admitted} admitted, slowest answer \
             {slowest:?}"
        );
        let bound = Duration::from_millis(LATE_TIMEOUT_MS + LATE_SLACK_MS);
        assert!(
            slowest <= bound,
            "{runtime}: an answer took {slowest:?}, over {bound:?}"
        );
        assert!(admitted <= LATE_LIMIT, "{runtime}: {admitted} admitted");
        if made >= 2 {
            break;
        }
    }
    assert!(
        made >= 2,
        "{runtime}: {made} decision calls in three tries; the row needs a second"
    );
}

/// The timeout of the lost-answer row: under [`LATE_DELAY`], so every decision call's answer
/// comes after its request was decided by the failure mode, while a replay (bound at least
/// 1 s) is answered.
pub const LOST_TIMEOUT_MS: u64 = 150;
/// Requests of the lost-answer row, one after another.
pub const LOST_REQUESTS: u64 = 3;

/// The lost-answer row: the origin answers every call [`LATE_DELAY`] late and the shell gives
/// up on it after [`LOST_TIMEOUT_MS`], so each decision call on the cold key `key` (limit
/// [`LATE_LIMIT`]) is counted at the origin while the failure mode (`local`) admits its request
/// from memory. [`LOST_REQUESTS`] requests, each after the retry delay so each makes its call,
/// are all admitted, and once the replay has run the origin's count of the key (`count()`) is
/// what was admitted: each later call and the replay carry the undo of the lost calls' counts,
/// so no request is counted twice, also with no further call on the key.
pub async fn lost_answers_count_once<F, Fut, C, CFut, K, KFut>(
    runtime: &str,
    key: &str,
    send: F,
    calls: K,
    count: C,
) where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<bool, String>>,
    K: Fn() -> KFut,
    KFut: Future<Output = u64>,
    C: Fn() -> CFut,
    CFut: Future<Output = u64>,
{
    let before = calls().await;
    let mut admitted = 0;
    for _ in 0..LOST_REQUESTS {
        let started = Instant::now();
        admitted += u64::from(
            send(key.to_string())
                .await
                .unwrap_or_else(|e| panic!("{runtime}: {e}")),
        );
        // The next request comes after the retry delay, so it makes a call of its own.
        let spacing = Duration::from_millis(strata_core::origin::DEFAULT_READ_RETRY_MS + 100);
        tokio::time::sleep(spacing.saturating_sub(started.elapsed())).await;
    }
    assert_eq!(
        admitted, LOST_REQUESTS,
        "{runtime}: the failure mode (local) admits each"
    );
    // Every call reached the origin, which counted it; each answer came too late.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut made = calls().await - before;
    while made < LOST_REQUESTS && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        made = calls().await - before;
    }
    assert!(
        made >= 2,
        "{runtime}: {made} decision calls; the row needs each request's"
    );
    let mut counted = count().await;
    while counted != admitted && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        counted = count().await;
    }
    println!(
        "conformance {runtime}: {LOST_REQUESTS} requests whose decision calls were answered \
         {LATE_DELAY:?} late (timeout {LOST_TIMEOUT_MS} ms): {made} calls, {admitted} admitted, \
         {counted} counted"
    );
    assert_eq!(
        counted, admitted,
        "{runtime}: each admitted request counted once"
    );
}

/// `REQUESTS` requests at once on `key`: each one's answer, and how long it took.
async fn at_once<F, Fut>(key: &str, send: F) -> Vec<(Result<bool, String>, Duration)>
where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<bool, String>> + Send,
{
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|_| {
            let (send, key) = (send.clone(), key.to_string());
            tokio::spawn(async move {
                let started = Instant::now();
                let answer = send(key).await;
                (answer, started.elapsed())
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(tasks.len());
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    answers
}

/// Requests sent, one after another, on the pass-ahead row's key once its pass is replayed.
pub const IN_DEMAND: usize = 40;

/// The pass-ahead row, with the origin up: one request on a cold key of limit [`BURST_LIMIT`]
/// (`send(key)`) is admitted with no decision call (`calls()` unchanged), and its pass
/// reaches the origin by the replay (`count()`, the origin's count of its cell, becomes 1).
/// Then the key comes into demand: [`IN_DEMAND`] more requests, one after another, are all
/// admitted with one decision call. The process holds no grant on the key, which is far from
/// its limit, so it asks for the limit, not for 2, then 4, 8, 16 (five calls).
pub async fn replayed_not_decided<S, SFut, C, CFut, R, RFut>(
    runtime: &str,
    key: &str,
    send: S,
    calls: C,
    count: R,
) where
    S: Fn(String) -> SFut,
    SFut: Future<Output = Result<bool, String>>,
    C: Fn() -> CFut,
    CFut: Future<Output = u64>,
    R: Fn() -> RFut,
    RFut: Future<Output = u64>,
{
    let before = calls().await;
    let admitted = send(key.to_string()).await;
    assert_eq!(
        admitted,
        Ok(true),
        "{runtime}: a cold key far from its limit"
    );
    let started = Instant::now();
    while count().await != 1 {
        assert!(
            started.elapsed() < REPLAY_BOUND,
            "{runtime}: the pass ahead never reached the origin"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        calls().await - before,
        0,
        "{runtime}: a pass ahead makes no decision call (the replay carried it)"
    );
    let mut admitted = 0;
    for _ in 0..IN_DEMAND {
        admitted += usize::from(send(key.to_string()).await == Ok(true));
    }
    let made = calls().await - before;
    println!(
        "conformance {runtime}: a key whose pass went ahead, then {IN_DEMAND} requests: {made} \
         decision call(s), {admitted} admitted"
    );
    assert_eq!(
        (made, admitted),
        (1, IN_DEMAND),
        "{runtime}: decision calls, admitted, once the key is in demand"
    );
}

/// The replay row: `admitted` requests were decided from memory while the origin was down;
/// once it is back, with no request since, `count()` (the origin's count of their cell)
/// reaches `admitted` within [`REPLAY_BOUND`].
pub async fn replayed_after_outage<C, Fut>(runtime: &str, admitted: u64, count: C)
where
    C: Fn() -> Fut,
    Fut: Future<Output = u64>,
{
    assert_eq!(
        admitted, LIMIT,
        "{runtime}: local mode admits the limit from memory"
    );
    let started = Instant::now();
    loop {
        let counted = count().await;
        if counted == admitted {
            println!(
                "conformance {runtime}: {admitted} passes admitted during the outage reached \
                 the origin {:?} after it came back",
                started.elapsed()
            );
            return;
        }
        assert!(
            counted < admitted,
            "{runtime}: the origin counts {counted}, over the {admitted} admitted"
        );
        assert!(
            started.elapsed() < REPLAY_BOUND,
            "{runtime}: the origin counts {counted} of {admitted} after {REPLAY_BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The table's outages: the origin's port for each, and what keeps the silent one open (drop
/// it at the end).
pub async fn outages() -> (Vec<(Outage, u16)>, tokio::task::JoinHandle<()>) {
    let closed = super::free_port();
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            open.push(socket); // never read, never answered
        }
    });
    let outages = vec![
        (Outage::Closed, closed),
        (Outage::Silent, port),
        (Outage::NoEndpoints, 0),
    ];
    (outages, held)
}

/// Keys of the pass-ahead pacing row.
pub const PACED_KEYS: usize = 40;
/// How soon after it is admitted a pass ahead would reach the origin on the next replay pass
/// (the shells' default interval is 100 ms) and a little.
pub const NEXT_PASS: Duration = Duration::from_millis(150);
/// The longest a pacing round may take, from its first send to the end of its read, and
/// still measure the pace: within it at most four or five passes go, each taking about a
/// tenth of the keys, fewer than half of them in all.
const ON_TIME: Duration = Duration::from_millis(350);
/// Rounds the pacing row tries before it gives up on a machine too loaded to measure it.
const PACED_ROUNDS: u64 = 6;

/// The pass-ahead pacing row, with the origin up: on each of the cold keys of limit
/// [`BURST_LIMIT`] (`keys`, [`PACED_KEYS`] of them; the last one a marker), one request passes
/// ahead and reaches the origin by the replay (a cold cell's first pass goes at once), which
/// `counts()` (the origin's counts of the keys' cells, in order) shows as 1. The marker's own
/// first pass then reaches the origin too: a shell replays one batch at a time, so by then it
/// has taken the answer to the others' (the origin counts a batch before the shell hears back).
/// Then one more request on each, all at once: admitted, and their passes wait for each key's
/// replay turn (one pass in ten at the default interval, staggered over the table) instead of
/// the next pass: fewer than half reach the origin within [`NEXT_PASS`] (on the next pass,
/// nearly all would), and every one within [`REPLAY_BOUND`]. A round that did not run on time
/// ([`ON_TIME`]) is sent again.
pub async fn passes_ahead_wait_for_their_turn<F, Fut, C, CFut>(
    runtime: &str,
    keys: &[String],
    send: F,
    counts: C,
) where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<bool, String>> + Send + 'static,
    C: Fn() -> CFut,
    CFut: Future<Output = Vec<u64>>,
{
    let (paced, marker) = keys.split_at(keys.len().saturating_sub(1));
    // How long until the counts of the keys `which` are all `n` (from now), within REPLAY_BOUND.
    let all_at = |n: u64, which: std::ops::Range<usize>| {
        let counts = &counts;
        async move {
            let started = Instant::now();
            loop {
                let now = counts().await;
                if now
                    .get(which.clone())
                    .is_some_and(|c| c.iter().all(|&c| c == n))
                {
                    return started.elapsed();
                }
                assert!(
                    started.elapsed() < REPLAY_BOUND,
                    "{runtime}: passes ahead never reached the origin: {now:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let at_once = |send: F, keys: &[String]| {
        let tasks: Vec<_> = keys
            .iter()
            .map(|key| tokio::spawn(send.clone()(key.clone())))
            .collect();
        async move {
            for t in tasks {
                assert_eq!(
                    t.await.unwrap(),
                    Ok(true),
                    "{runtime}: a key far from its limit"
                );
            }
        }
    };
    let (n, all) = (paced.len(), 0..paced.len());
    at_once(send.clone(), paced).await;
    all_at(1, all.clone()).await;
    at_once(send.clone(), marker).await;
    all_at(1, n..n + 1).await;
    // A round measures only if it ran on time: on a machine loaded enough to stall the sends or
    // the read, the passes between them carry more turns than the next pass would (a turn is
    // a tenth of the keys a pass), and the round proves nothing either way; another is sent.
    for round in 2..2 + PACED_ROUNDS {
        let started = Instant::now();
        at_once(send.clone(), paced).await;
        tokio::time::sleep_until((Instant::now() + NEXT_PASS).into()).await;
        let read = counts().await;
        let window = started.elapsed();
        let early = read
            .get(all.clone())
            .map_or(0, |c| c.iter().filter(|&&c| c >= round).count());
        let took = all_at(round, all.clone()).await + NEXT_PASS;
        println!(
            "conformance {runtime}: {n} keys' passes ahead (round {round}): {early} at the \
             origin within {window:?} of the first send, all within {took:?}"
        );
        if window <= ON_TIME {
            assert!(
                early * 2 < n,
                "{runtime}: {early} of {n} passes ahead went on the next replay pass"
            );
            return;
        }
    }
    panic!("{runtime}: no round of the pacing row ran within {ON_TIME:?} ({PACED_ROUNDS} tried)");
}
