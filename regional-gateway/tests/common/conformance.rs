//! The failure-mode conformance table: one table, one set of expected figures, run through
//! every runtime (gateway processes, workerd, Envoy) by each runtime's own test, which only
//! supplies how a request is sent and how the origin is taken away. The origin gives no
//! answer (the gateway's Redis, or the edges' gateway, on a port nothing listens on, one that
//! accepts and never answers, or a name with no address behind it); a key of limit `LIMIT`
//! gets `REQUESTS` requests one after another, and another key `REQUESTS` at once. Two more
//! rows with the origin up: `REQUESTS` requests at once on a cold key make one decision call
//! ([`one_call`]), and what a process admitted while the origin was down reaches it once it
//! is back, with no request to carry it ([`replayed_after_outage`]).

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

/// Runs the table's row `mode`: `send(key)` sends one request on `key` and says whether it
/// was admitted (or what went wrong). Every answer must come within `timeout_ms + 150`.
pub async fn check<F, Fut>(runtime: &str, mode: &str, timeout_ms: u64, send: F)
where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<bool, String>> + Send,
{
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
    let at_once: Vec<_> = (0..REQUESTS)
        .map(|_| tokio::spawn(one(format!("burst-{mode}-{tag}"))))
        .collect();
    let mut concurrent = 0;
    for t in at_once {
        let (admitted, took) = t.await.unwrap();
        concurrent += u64::from(admitted);
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
    let at_once: Vec<_> = (0..REQUESTS)
        .map(|_| {
            let (send, key) = (send.clone(), key.to_string());
            tokio::spawn(async move { send(key).await })
        })
        .collect();
    let mut admitted = 0;
    for t in at_once {
        admitted += u64::from(
            t.await
                .unwrap()
                .unwrap_or_else(|e| panic!("{runtime}: {e}")),
        );
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
