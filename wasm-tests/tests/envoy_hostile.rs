//! The Envoy filter against clients that send whatever bytes Envoy lets through, every part a
//! real process (Envoy 1.40 running the built filter, a gateway on a private Redis, an
//! upstream): random header names and value bytes, odd methods and paths, very long and very
//! many headers, against rules that read those headers. No 5xx, no VM failure in Envoy's own
//! wasm stats, and a normal request after each batch is limited exactly. And when a VM does
//! fail (a test build traps on purpose), a request it held paused is answered within the
//! connection manager's `request_timeout`, not left hanging.
//!
//! `STRATA_FUZZ_REQUESTS` sets the fuzz run's length (the test command's: 2,000; the README's
//! long run: 10,000) and `STRATA_FUZZ_SEED` replays a run.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::envoy::{Envoy, Filters, Options, faulty_filter};
use common::stack::{get, stack};
use common::upstream::{Upstream, port_of};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// xorshift64*: a run is replayed from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap()
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// The headers the rules below read (and `:authority`, from the one `host` line).
const READ: [&str; 6] = [
    "x-api-key",
    "x-tier",
    "x-user",
    "x-cost",
    "cf-connecting-ip",
    "x-forwarded-for",
];

/// Characters of a header name (RFC 9110 `tchar`).
const TCHAR: &[u8] =
    b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";

/// Rules reading every header above, with every matcher and action kind.
fn rules() -> serde_json::Value {
    json!([
        {"name": "per-key", "namespace": "fuzz", "limit": 5, "duration": "1d",
         "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}]},
        {"name": "tiers", "namespace": "tiers", "limit": 1_000_000, "duration": "1m",
         "cost": {"header": "x-cost", "max": 1000},
         "match": {"methods": ["GET", "POST"], "path_prefix": "/api",
                   "headers": [{"name": "x-tier", "prefix_match": "gold"}]},
         "actions": [
            {"request_headers": {"header_name": "x-user", "descriptor_key": "user", "skip_if_absent": true}},
            {"header_value_match": {"descriptor_value": "gold", "expect_match": false,
              "headers": [{"name": "x-tier", "exact_match": "gold-trial"}]}}]},
        {"name": "by-ip", "namespace": "ip", "limit": 1_000_000, "duration": "1m",
         "match": {"hosts": ["fuzz.example"], "path_prefix": "/ip"},
         "actions": [{"remote_address": {}}]}
    ])
}

/// A header value of bytes Envoy's codec takes (HTAB, visible ASCII, space, obs-text), or now
/// and then any bytes at all (Envoy refuses those itself).
fn value(rng: &mut Rng) -> Vec<u8> {
    let len = match rng.below(100) {
        0..=79 => rng.below(40),
        80..=96 => rng.below(600),
        _ => 1_000 + rng.below(20_000),
    };
    let any = rng.chance(1);
    (0..len)
        .map(|_| {
            loop {
                let b = u8::try_from(rng.below(256)).unwrap();
                if any || b == b'\t' || (b' '..=b'~').contains(&b) || b >= 0x80 {
                    break b;
                }
            }
        })
        .collect()
}

fn name(rng: &mut Rng) -> Vec<u8> {
    if rng.chance(55) {
        let n = rng.pick(&READ);
        // Envoy lower-cases names; a client may not.
        return if rng.chance(20) {
            n.to_ascii_uppercase().into_bytes()
        } else {
            n.as_bytes().to_vec()
        };
    }
    let len = 1 + rng.below(30);
    let mut n = b"x-".to_vec();
    n.extend((0..len).map(|_| *rng.pick(TCHAR)));
    n
}

/// One request: odd method and path, some headers (now and then very many, or very long).
fn fuzz_request(rng: &mut Rng) -> Vec<u8> {
    // Envoy refuses a method it does not know, and bytes past ASCII in a path, with a 400 of
    // its own: now and then, so most requests reach the filter.
    let method: Vec<u8> = if rng.chance(5) {
        (0..1 + rng.below(12)).map(|_| *rng.pick(TCHAR)).collect()
    } else {
        let known = [
            "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "get",
        ];
        rng.pick(&known).as_bytes().to_vec()
    };
    let mut path = rng
        .pick(&["/", "/api/x", "/ip", "/api/", "/%ff/"])
        .as_bytes()
        .to_vec();
    let odd_path = rng.chance(3);
    for _ in 0..rng.below(30) {
        let b = u8::try_from(rng.below(256)).unwrap();
        if b > b' ' && b < 0x7f || odd_path {
            path.push(b);
        }
    }
    let count = if rng.chance(3) {
        90 + rng.below(60) // around Envoy's limit of 100
    } else {
        rng.below(10)
    };
    let mut out = Vec::new();
    out.extend_from_slice(&method);
    out.push(b' ');
    out.extend_from_slice(&path);
    out.extend_from_slice(b" HTTP/1.1\r\n");
    if rng.chance(97) {
        let host: &[u8] = if rng.chance(30) {
            b"fuzz.example"
        } else {
            b"x"
        };
        out.extend_from_slice(b"host: ");
        out.extend_from_slice(host);
        out.extend_from_slice(b"\r\n");
    }
    for _ in 0..count {
        out.extend_from_slice(&name(rng));
        out.extend_from_slice(b": ");
        out.extend_from_slice(&value(rng));
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"connection: close\r\ncontent-length: 0\r\n\r\n");
    out
}

/// Sends raw bytes on a new connection; the answer's status (none: closed without one) and
/// its head. The answer ends where its `content-length` says (Envoy keeps a connection
/// it refused open for a second, waiting for the client to close first).
async fn send_raw(addr: &str, bytes: &[u8]) -> (Option<u16>, String) {
    let mut socket = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to Envoy: {e}"));
    // Envoy may answer (431, 400) and close before it has read everything: a failed write is
    // not the verdict, the answer is.
    let _ = socket.write_all(bytes).await;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), async {
        let mut buf = [0_u8; 8192];
        while !complete(&answer) {
            match socket.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    });
    if read.await.is_err() {
        panic!(
            "no answer within 20 s to {}",
            bytes[..bytes.len().min(600)].escape_ascii()
        );
    }
    let status = answer
        .get(9..12)
        .and_then(|s| std::str::from_utf8(s).ok()?.parse().ok());
    let end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(answer.len());
    let head = &answer[..end];
    (status, String::from_utf8_lossy(head).to_ascii_lowercase())
}

/// Whether `answer` holds a whole response: its head and `content-length` bytes of body.
fn complete(answer: &[u8]) -> bool {
    let Some(end) = answer.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&answer[..end]).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    answer.len() >= end + 4 + length
}

/// Envoy's counters of VMs made and failed, with their values (the names differ across Envoy
/// versions: every `wasm` counter that is not the filter's own).
async fn vm_stats(e: &Envoy, http: &reqwest::Client) -> BTreeMap<String, u64> {
    e.stats(http, "wasm")
        .await
        .into_iter()
        .filter(|(n, _)| !n.starts_with("wasmcustom."))
        .collect()
}

/// Envoy's counters that move when a VM fails and is made again
/// (`wasm.envoy.wasm.runtime.v8.created`, `wasm.<plugin>.vm_reload_success`, ...).
fn failures(stats: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    stats
        .iter()
        .filter(|(n, _)| n.ends_with(".created") || n.contains("vm_reload") || n.contains("fail"))
        .map(|(n, v)| (n.clone(), *v))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_headers_methods_and_paths_never_break_the_filter() {
    let requests: usize = std::env::var("STRATA_FUZZ_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    let seed: u64 = std::env::var("STRATA_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| common::stack::now_ms() | 1);
    println!("fuzz: {requests} requests, STRATA_FUZZ_SEED={seed}");
    let s = stack().await;
    let config = json!({"gateway_cluster": "strata_gateway", "region": "fuzz",
        "timeout_ms": 5000, "rules": rules()});
    let mut e = Envoy::start(
        &config.to_string(),
        s.upstream.port(),
        Some(port_of(s.gateway())),
    );
    e.ready(&s.http).await;
    let addr = e.base.trim_start_matches("http://").to_string();
    let before = vm_stats(&e, &s.http).await;
    assert!(
        !failures(&before).is_empty(),
        "Envoy shows no VM counters: {before:?}"
    );

    let statuses: Arc<std::sync::Mutex<BTreeMap<String, u64>>> = Arc::default();
    let unanswered = Arc::new(AtomicU64::new(0));
    let mut rng = Rng(seed);
    let batch = 500;
    let unpooled = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    for (b, start) in (0..requests).step_by(batch).enumerate() {
        let in_flight = Arc::new(tokio::sync::Semaphore::new(8));
        // Dropped on a failure: the requests still out are cancelled with it.
        let mut tasks = tokio::task::JoinSet::new();
        for _ in start..requests.min(start + batch) {
            let bytes = fuzz_request(&mut rng);
            let (addr, statuses, unanswered, in_flight) = (
                addr.clone(),
                statuses.clone(),
                unanswered.clone(),
                in_flight.clone(),
            );
            tasks.spawn(async move {
                let _permit = in_flight.acquire().await.unwrap();
                let (status, head) = send_raw(&addr, &bytes).await;
                match status {
                    Some(status) => {
                        // The filter's replies are JSON; Envoy's own, plain text.
                        let by = if status == 200 {
                            "upstream"
                        } else if head.contains("content-type: application/json") {
                            "filter"
                        } else {
                            "envoy"
                        };
                        let mut seen = statuses.lock().unwrap();
                        *seen.entry(format!("{status} {by}")).or_default() += 1;
                    }
                    None => {
                        unanswered.fetch_add(1, Ordering::SeqCst);
                    }
                }
                (status, bytes)
            });
        }
        while let Some(done) = tasks.join_next().await {
            let (status, bytes) = done.unwrap();
            if status.is_some_and(|s| s >= 500) {
                panic!(
                    "{status:?} for {}\n{}",
                    bytes[..bytes.len().min(600)].escape_ascii(),
                    e.log()
                );
            }
        }
        // A normal client right after: exactly its limit, then a 429.
        let key = format!("normal-{seed}-{b}");
        for i in 0..6 {
            let (status, _, body) = get(&unpooled, &e.base, &[("x-api-key", &key)]).await;
            let want = if i < 5 { 200 } else { 429 };
            assert_eq!(status, want, "batch {b}, request {i}: {body}\n{}", e.log());
        }
    }
    let after = vm_stats(&e, &s.http).await;
    let statuses = statuses.lock().unwrap().clone();
    let passed = e.stat(&s.http, "strata.ok").await;
    let limited = e.stat(&s.http, "strata.rate_limited").await;
    println!(
        "fuzz: statuses {statuses:?}, closed without an answer {}, filter passed {passed} and \
         limited {limited}; VM counters {:?}",
        unanswered.load(Ordering::SeqCst),
        failures(&after)
    );
    assert_eq!(
        failures(&before),
        failures(&after),
        "a VM failed or was rebuilt\n{}",
        e.log()
    );
    assert!(
        !e.log().contains("panicked") && !e.log().contains("Wasm VM failed"),
        "{}",
        e.log()
    );
    assert_eq!(
        unanswered.load(Ordering::SeqCst),
        0,
        "connections closed without an answer"
    );
    let ok = statuses.get("200 upstream").copied().unwrap_or(0);
    assert!(
        statuses.get("400 filter").copied().unwrap_or(0) > 0,
        "the filter refused no bad cost header or overlong key: the rules were not read"
    );
    assert!(
        ok * 4 >= requests as u64,
        "too few fuzz requests reached the upstream ({ok}): the run tests Envoy's codec, not \
         the filter"
    );
    assert!(passed >= ok, "the filter saw every pass: {passed} of {ok}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_paused_when_its_vm_fails_is_answered_within_the_request_timeout() {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let upstream = Upstream::start().await;
    // A gateway that accepts and never answers: the request stays paused on its call.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway_port = silent.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicU64::new(0));
    let seen = accepted.clone();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            open.push(socket);
        }
    });
    // The filter's own timeout far away, so only Envoy's request_timeout can answer.
    let config = json!({"gateway_cluster": "strata_gateway", "timeout_ms": 60_000,
        "rules": [{"name": "per-key", "namespace": "e2e", "limit": 5, "duration": "1d",
            "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}]}]});
    let options = Options {
        concurrency: 1,
        wasm: faulty_filter(),
        request_timeout_ms: 2_000,
    };
    let mut e = Envoy::start_opts(
        &Filters::Strata(config.to_string()),
        &options,
        upstream.port(),
        Some(gateway_port),
    );
    e.ready(&http).await;
    let before = failures(&vm_stats(&e, &http).await);

    let started = Instant::now();
    let (client, base) = (http.clone(), e.base.clone());
    let paused = tokio::spawn(async move {
        let (status, _, body) = get(&client, &base, &[("x-api-key", "stranded")]).await;
        (status, body)
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while accepted.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "no gateway call\n{}", e.log());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!paused.is_finished(), "the request waits on the gateway");

    let trap = get(&http, &e.base, &[("x-strata-fault", "trap")]).await.0;
    let (status, body) = paused.await.unwrap();
    let took = started.elapsed();
    println!(
        "VM trapped: the trapping request got {trap}; the paused one {status} {body:?} after \
         {took:?}"
    );
    assert!(status >= 400, "answered by Envoy, not passed: {status}");
    assert!(
        took < Duration::from_millis(2_000 + 1_500),
        "answered after {took:?}\n{}",
        e.log()
    );
    // The worker serves again once Envoy has rebuilt the VM (a request no rule applies to).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, _, _) = get(&http, &e.base, &[]).await;
        if status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {status} 15 s after the VM failed\n{}",
            e.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = failures(&vm_stats(&e, &http).await);
    println!("VM counters {before:?} -> {after:?}");
    assert_ne!(before, after, "Envoy counts the failed VM\n{}", e.log());
    held.abort();
}
