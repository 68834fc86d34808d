//! Requests a hostile client could send, as raw HTTP/1.1 bytes, for the fuzz tests of both Wasm
//! shells in their real runtimes (`envoy_hostile.rs`, `workerd.rs`): random header names and
//! value bytes, odd methods and paths, very long and very many headers, against rules that read
//! those headers. `STRATA_FUZZ_REQUESTS` sets a run's length (the test command's: 2,000; the
//! README's long run: 10,000) and `STRATA_FUZZ_SEED` replays a run.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// xorshift64*: a run is replayed from its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap()
    }
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
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

/// The shells' `client_address` and `xff_num_trusted_hops` in the fuzz runs: the source that
/// parses most of a client's bytes (a list counted from the right, then an IP address).
pub const CLIENT_ADDRESS: (&str, u32) = ("x-forwarded-for", 1);

/// Rules reading every header above, with every matcher and action kind.
pub fn rules() -> serde_json::Value {
    serde_json::json!([
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
pub fn fuzz_request(rng: &mut Rng) -> Vec<u8> {
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
        .pick(&[
            "/", "/api/x", "/ip", "/api/", "/%ff/", "//api/", "/%61pi/", "/x/../ip",
        ])
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
    // Now and then a request the `tiers` rule applies to, with a cost that is rarely digits:
    // the filter's own 400s show the rules were read.
    if rng.chance(8) {
        out.clear();
        out.extend_from_slice(b"GET /api/x HTTP/1.1\r\nhost: x\r\nx-tier: gold\r\nx-cost: ");
        out.extend_from_slice(&value(rng));
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
pub async fn send_raw(addr: &str, bytes: &[u8]) -> (Option<u16>, String) {
    let mut socket = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to Envoy: {e}"));
    // Envoy may answer (431, 400) and close before it has read everything: a failed write is
    // not the verdict, the answer is.
    let _ = socket.write_all(bytes).await;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), async {
        let mut buf = [0_u8; 8192];
        while !super::message::is_whole(&answer) {
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

/// The run's length and seed, from the environment (printed, so a run can be replayed).
pub fn run_settings() -> (usize, u64) {
    let requests = std::env::var("STRATA_FUZZ_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    let seed = std::env::var("STRATA_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| super::stack::now_ms() | 1);
    println!("fuzz: {requests} requests, STRATA_FUZZ_SEED={seed}");
    (requests, seed)
}

/// What a run's answers were: `"<status> <by>"` counts (`by`: the upstream for a 200, the
/// Strata shell for its JSON replies, the runtime itself otherwise), and connections closed
/// without an answer.
#[derive(Debug, Default)]
pub struct Tally {
    pub statuses: BTreeMap<String, u64>,
    pub unanswered: u64,
}

impl Tally {
    pub fn count(&self, label: &str) -> u64 {
        self.statuses.get(label).copied().unwrap_or(0)
    }
}

/// A whole run against the shell at `base` (`http://<addr>`): `requests` from `seed` in
/// batches of 500, each followed by a normal client on a fresh key that must get exactly its
/// limit of 5 (the rules' `per-key`), then a `429`. A 5xx, or a normal client limited wrongly,
/// fails with `log()` (the runtime's log) in the report.
pub async fn run(base: &str, requests: usize, seed: u64, log: impl Fn() -> String) -> Tally {
    let addr = base.trim_start_matches("http://");
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut tally = Tally::default();
    let mut rng = Rng(seed);
    let size = 500;
    for (b, start) in (0..requests).step_by(size).enumerate() {
        let n = size.min(requests - start);
        if let Err((status, bytes)) = batch(addr, &mut rng, n, &mut tally).await {
            panic!(
                "{status} for {}\n{}",
                bytes[..bytes.len().min(600)].escape_ascii(),
                log()
            );
        }
        let key = format!("normal-{seed}-{b}");
        for i in 0..6 {
            let (status, _, body) = super::stack::get(&http, base, &[("x-api-key", &key)]).await;
            let want = if i < 5 { 200 } else { 429 };
            assert_eq!(status, want, "batch {b}, request {i}: {body}\n{}", log());
        }
    }
    tally
}

/// Sends `n` requests from `rng` to `addr`, 8 connections at a time, into `tally`; the first
/// 5xx stops the batch and comes back with the request that got it.
async fn batch(
    addr: &str,
    rng: &mut Rng,
    n: usize,
    tally: &mut Tally,
) -> Result<(), (u16, Vec<u8>)> {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(8));
    let unanswered = Arc::new(AtomicU64::new(0));
    // Dropped on a failure: the requests still out are cancelled with it.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let bytes = fuzz_request(rng);
        let (addr, in_flight) = (addr.to_string(), in_flight.clone());
        tasks.spawn(async move {
            let _permit = in_flight.acquire().await.unwrap();
            let (status, head) = send_raw(&addr, &bytes).await;
            (status, head, bytes)
        });
    }
    while let Some(done) = tasks.join_next().await {
        let (status, head, bytes) = done.unwrap();
        let Some(status) = status else {
            unanswered.fetch_add(1, Ordering::SeqCst);
            continue;
        };
        let by = if status == 200 {
            "upstream"
        } else if head.contains("content-type: application/json") {
            "filter"
        } else {
            "runtime"
        };
        // 501 is the runtime's own answer to a method it does not know (workerd's; Envoy
        // answers 400): HTTP's, not a failure. Every other 5xx is.
        if status >= 500 && (status, by) != (501, "runtime") {
            return Err((status, bytes));
        }
        *tally.statuses.entry(format!("{status} {by}")).or_default() += 1;
    }
    tally.unanswered += unanswered.load(Ordering::SeqCst);
    Ok(())
}
