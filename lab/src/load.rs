//! The traffic: one open-loop sender per gateway, offering the scenario's rate over time through
//! the gateway API (`POST /v1/ratelimit`), and one poller per region reading its view of the hot
//! cell (`POST /v1/origin/read`), for the propagation delay. Every answer is recorded with the
//! time its request was sent.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Semaphore;

use crate::scenario::{Keys, Scenario};
use crate::shells::{KEY_HEADER, Through};

/// What a request got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Pass,
    Deny,
    /// No decision: a transport error or a status other than 200.
    Error,
}

/// One request.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// Unix ms when it was sent.
    pub at_ms: u64,
    pub region: u16,
    /// The gateway's index in the stack (regions in order).
    pub gateway: u16,
    pub key: u32,
    pub outcome: Outcome,
    /// Microseconds from sending the request to reading its answer: the decision's latency
    /// as the client sees it.
    pub latency_us: u32,
}

/// One look at a region's view of the hot cell.
#[derive(Clone, Copy, Debug)]
pub struct Poll {
    pub at_ms: u64,
    pub region: u16,
    pub sequence: u64,
    /// The other regions' sum, as this region imported it.
    pub global: u64,
}

/// Everything the run recorded.
#[derive(Debug, Default)]
pub struct Recorder {
    pub samples: Mutex<Vec<Sample>>,
    pub polls: Mutex<Vec<Poll>>,
    pub sent: AtomicU64,
    pub passed: AtomicU64,
    /// Polls sent: each is one origin read of one cell (one `HGET`), taken out of the
    /// figures' origin and Redis costs.
    pub polled: AtomicU64,
}

impl Recorder {
    fn record(&self, sample: Sample) {
        if sample.outcome == Outcome::Pass {
            self.passed.fetch_add(1, Ordering::Relaxed);
        }
        self.samples
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(sample);
    }
}

/// Requests a gateway may have in flight; past it, the sender waits (and sends late).
const IN_FLIGHT: u32 = 128;
/// How often a sender catches up with its schedule.
const TICK: Duration = Duration::from_millis(5);
/// How often a region's view is polled.
pub const POLL_EVERY: Duration = Duration::from_millis(100);

/// Ranks drawn by Zipf's law over `1..=n`: the cumulative weights, searched by bisection.
#[derive(Debug)]
pub struct KeyPicker {
    cumulative: Vec<f64>,
}

impl KeyPicker {
    pub fn new(keys: Keys) -> Self {
        let cumulative = match keys {
            Keys::One => vec![1.0],
            Keys::Zipf { n, s } => {
                let mut total = 0.0;
                (1..=n)
                    .map(|rank| {
                        total += 1.0 / f64::from(rank).powf(s);
                        total
                    })
                    .collect()
            }
        };
        Self { cumulative }
    }

    /// A key index, 0 the most frequent.
    pub fn pick(&self, rng: &mut StdRng) -> u32 {
        let total = self.cumulative.last().copied().unwrap_or(1.0);
        let x = rng.random::<f64>() * total;
        let i = self.cumulative.partition_point(|c| *c < x);
        u32::try_from(i.min(self.cumulative.len().saturating_sub(1))).unwrap_or(0)
    }
}

/// The body of a decision request on key `key`.
pub fn decide_body(s: &Scenario, key: u32) -> String {
    format!(
        r#"{{"namespace":"lab","identifier":"{}","limit":{},"duration":{}}}"#,
        key_name(key),
        s.limit,
        s.duration_ms
    )
}

/// The requests per second each gateway of region `region` is offered `t` seconds in.
fn rate_at(s: &Scenario, region: usize, t: f64) -> f64 {
    s.phases
        .iter()
        .filter(|p| p.from <= t && t < p.to)
        .map(|p| p.rate * p.shares.get(region).copied().unwrap_or(0.0) / s.gateways as f64)
        .sum()
}

/// Key number `key`'s name (`k7`): the gateway API's identifier, the shells' header value.
pub fn key_name(key: u32) -> String {
    format!("k{key}")
}

/// Offers one gateway its share of the scenario's load from `start` for `s.seconds`, through
/// `through` at `base` (the gateway's API or the shell in front of it).
#[allow(clippy::too_many_arguments)] // one task's whole context, passed once
pub async fn send(
    s: Arc<Scenario>,
    (region, gateway): (usize, usize),
    (through, base): (Through, String),
    seed: u64,
    start: Instant,
    start_ms: u64,
    http: reqwest::Client,
    recorder: Arc<Recorder>,
    picker: Arc<KeyPicker>,
) {
    let url = match through {
        Through::Gateway => format!("{base}/v1/ratelimit"),
        Through::Edge | Through::Envoy => format!("{base}/"),
    };
    let slots = Arc::new(Semaphore::new(IN_FLIGHT as usize));
    let mut rng = StdRng::seed_from_u64(seed);
    let mut due = 0.0_f64;
    let mut last = 0.0_f64;
    let region16 = u16::try_from(region).unwrap_or(u16::MAX);
    let gateway16 = u16::try_from(gateway).unwrap_or(u16::MAX);
    loop {
        let t = start.elapsed().as_secs_f64();
        if t >= s.seconds {
            break;
        }
        due += rate_at(&s, region, t) * (t - last);
        last = t;
        while due >= 1.0 {
            due -= 1.0;
            let Ok(permit) = slots.clone().acquire_owned().await else {
                return;
            };
            let key = picker.pick(&mut rng);
            let body = match through {
                Through::Gateway => Some(decide_body(&s, key)),
                Through::Edge | Through::Envoy => None,
            };
            let (http, url, recorder) = (http.clone(), url.clone(), recorder.clone());
            let at_ms = start_ms + u64::try_from(start.elapsed().as_millis()).unwrap_or(0);
            recorder.sent.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(async move {
                let sent = Instant::now();
                let outcome = match body {
                    Some(body) => decide(&http, &url, body).await,
                    None => pass(&http, &url, key).await,
                };
                let latency_us = u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX);
                drop(permit);
                recorder.record(Sample {
                    at_ms,
                    region: region16,
                    gateway: gateway16,
                    key,
                    outcome,
                    latency_us,
                });
            });
        }
        tokio::time::sleep(TICK).await;
    }
    // Wait for the answers still in flight.
    let _ = slots.acquire_many(IN_FLIGHT).await;
}

async fn decide(http: &reqwest::Client, url: &str, body: String) -> Outcome {
    let Ok(response) = http
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
    else {
        return Outcome::Error;
    };
    if response.status() != 200 {
        return Outcome::Error;
    }
    let Ok(bytes) = response.bytes().await else {
        return Outcome::Error;
    };
    match serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["success"].as_bool())
    {
        Some(true) => Outcome::Pass,
        Some(false) => Outcome::Deny,
        None => Outcome::Error,
    }
}

/// A GET through a shell with the key in [`KEY_HEADER`]: 200 passed, 429 denied.
async fn pass(http: &reqwest::Client, url: &str, key: u32) -> Outcome {
    match http.get(url).header(KEY_HEADER, key_name(key)).send().await {
        Ok(r) if r.status() == 200 => Outcome::Pass,
        Ok(r) if r.status() == 429 => Outcome::Deny,
        _ => Outcome::Error,
    }
}

/// Reads region `region`'s view of the hot cell (named `identifier`) every [`POLL_EVERY`]
/// until `s.seconds`.
pub async fn poll(
    s: Arc<Scenario>,
    (region, identifier): (usize, String),
    base: String,
    start: Instant,
    http: reqwest::Client,
    recorder: Arc<Recorder>,
) {
    let url = format!("{base}/v1/origin/read");
    let region16 = u16::try_from(region).unwrap_or(u16::MAX);
    while start.elapsed().as_secs_f64() < s.seconds {
        let at_ms = crate::now_ms();
        let sequence = at_ms / s.duration_ms;
        let body = format!(
            r#"{{"cells":[{{"namespace":"lab","identifier":"{identifier}","duration":{},"sequence":{sequence}}}]}}"#,
            s.duration_ms
        );
        recorder.polled.fetch_add(1, Ordering::Relaxed);
        let global = async {
            let r = http
                .post(&url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .ok()?;
            let v: serde_json::Value = r.json().await.ok()?;
            v["cells"][0]["global"].as_u64()
        }
        .await;
        if let Some(global) = global {
            recorder
                .polls
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Poll {
                    at_ms,
                    region: region16,
                    sequence,
                    global,
                });
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// Prints a progress line every second until `s.seconds`: on a terminal in place, otherwise
/// every 5 s.
pub async fn progress(s: Arc<Scenario>, start: Instant, recorder: Arc<Recorder>) {
    use std::io::IsTerminal;
    let tty = std::io::stderr().is_terminal();
    let mut n = 0_u64;
    while start.elapsed().as_secs_f64() < s.seconds {
        tokio::time::sleep(Duration::from_secs(1)).await;
        n += 1;
        let line = format!(
            "  {}: {:>3.0}/{:.0} s, {} sent, {} passed",
            s.name,
            start.elapsed().as_secs_f64().min(s.seconds),
            s.seconds,
            recorder.sent.load(Ordering::Relaxed),
            recorder.passed.load(Ordering::Relaxed)
        );
        if tty {
            eprint!("\r{line}   ");
        } else if n % 5 == 0 {
            eprintln!("{line}");
        }
    }
    if tty {
        eprintln!();
    }
}
