//! `strata-edge`: the Workers-style edge. JavaScript (`worker.mjs`) reads the clock, does the
//! fetches, arms one timer and holds this object for the isolate's life; the request path is
//! the core's [`Driver`] (rules, coalescing, deadlines, failure modes, replay) over the
//! isolate's table. This crate only moves values between the two.
//!
//! An event goes in ([`Edge::start`], [`Edge::answer`], [`Edge::fail`], [`Edge::timeout`]),
//! then JavaScript drains what came out: [`Edge::poll_transmit`] (a call to POST),
//! [`Edge::poll_decision`] (a request that waited), [`Edge::poll_log`], and arms its timer for
//! [`Edge::next_deadline`]; [`Edge::wants_pump`] says whether there is anything to drain.
//!
//! A reply stays in the module: `start` and `poll_decision` make it the current one, and
//! JavaScript reads only the parts it needs through the `reply_*` getters. A warm request thus
//! crosses the boundary as numbers, with no object to wrap, register for finalization and
//! free. Its headers come out as a name JavaScript learned once (an index into
//! [`REPLY_HEADER_NAMES`]) and a value JavaScript decodes from the module's memory, or keeps
//! when it is the one it read last under that name (a `RateLimit-Policy` rarely changes): in
//! workerd every object a request leaves behind brings V8's next young-generation pause closer,
//! and all requests in flight wait through it.

mod view;

use strata_core::driver::{Decided, Driver, DriverConfig, Started, TableStore};
use strata_core::gate::{Gate, REPLY_HEADER_NAMES, Subject};
use strata_core::identity::identifier_for;
use strata_core::memory::MemoryReport;
use strata_core::{Reason, WindowDuration};
use wasm_bindgen::prelude::*;

pub use view::JsRequest;

/// The workspace of the local table's keys; the gateway binds the real one to the token.
const LOCAL_WORKSPACE: &str = "edge";
/// Room for a reply header's value without moving [`Edge::reply_value_ptr`]: one limit's
/// `RateLimit-Policy` with a long name.
const VALUE_OUT_CAPACITY: usize = 256;
/// Largest number JavaScript holds exactly (2^53 - 1).
const MAX_SAFE: f64 = 9_007_199_254_740_991.0;

/// [`Edge::start`]'s answer: the request waits (its reply comes from
/// [`Edge::poll_decision`]).
pub const WAITING: u8 = 0;
/// [`Edge::start`]'s answer: the request goes on (the current reply holds its headers).
pub const PASS: u8 = 1;
/// [`Edge::start`]'s answer: the request is denied (the current reply holds its answer).
pub const DENY: u8 = 2;
/// [`Edge::start`]'s answer: the request is refused, a client error ([`Edge::refusal`] says
/// why). A number rather than a thrown error: a `Result` crosses into JavaScript as an array,
/// one more allocation on every request.
pub const REFUSED: u8 = 3;

/// One isolate's limiter: the driver and the table it decides on.
#[wasm_bindgen]
#[derive(Debug)]
pub struct Edge {
    driver: Driver,
    store: TableStore,
    /// The reply `start` or `poll_decision` last produced.
    reply: EdgeReply,
    /// The deadline [`Edge::next_deadline`] last reported: JavaScript has a timer for it.
    seen_deadline: Option<u64>,
    /// Why the last request [`REFUSED`] was.
    refusal: String,
    /// Per name of [`REPLY_HEADER_NAMES`], the value JavaScript read last under it.
    values_read: [String; REPLY_HEADER_NAMES.len()],
    /// Where [`Edge::reply_header_value`] writes a value for JavaScript to decode: reused, so
    /// it keeps its address and JavaScript its views of it.
    value_out: Vec<u8>,
}

/// What to answer a request: status, headers, body.
#[derive(Debug, Default)]
pub struct EdgeReply {
    /// The id JavaScript gave the request.
    pub request: u32,
    /// Whether the request goes on (to the upstream, or `success` in binding mode).
    pub allowed: bool,
    /// `429` on a denial, else `200`.
    pub status: u16,
    /// Its headers, names lower case.
    pub headers: Vec<(&'static str, String)>,
    /// The JSON body of a denial (empty on a pass).
    pub body: String,
    /// Which path decided it: `local`, `origin` or `fallback` (the failure mode).
    pub by: &'static str,
    /// The binding's answer: the limit of the first enforced limit.
    pub limit: f64,
    /// What is left of it.
    pub remaining: f64,
    /// When its window ends (Unix ms).
    pub reset: f64,
}

/// A call to the gateway: `POST path` with `body`, aborted after `timeout_ms`; its answer
/// goes to [`Edge::answer`], a failure to [`Edge::fail`], with `call`.
#[wasm_bindgen(getter_with_clone)]
#[derive(Debug)]
pub struct EdgeCall {
    /// The call's id.
    pub call: f64,
    /// `/v1/origin/decide` or `/v1/origin/replay`.
    pub path: String,
    /// The JSON body.
    pub body: String,
    /// How long it may take.
    pub timeout_ms: f64,
}

/// A line for the log.
#[wasm_bindgen(getter_with_clone)]
#[derive(Debug)]
pub struct EdgeLog {
    /// `warn` or `info`.
    pub level: String,
    /// The line.
    pub message: String,
}

/// Milliseconds from JavaScript, clamped to what the core takes.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // clamped first
fn whole(x: f64) -> u64 {
    if x.is_finite() && x > 0.0 {
        x.min(MAX_SAFE) as u64
    } else {
        0
    }
}

/// A non-negative whole number from JavaScript, or an error naming `what`.
fn count(x: f64, what: &str) -> Result<u64, String> {
    if x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x <= MAX_SAFE {
        Ok(whole(x))
    } else {
        Err(format!(
            "{what} must be a whole number from 0 to 2^53-1, not {x}"
        ))
    }
}

#[allow(clippy::cast_precision_loss)] // counts, ids and Unix ms stay below 2^53
fn js_number(x: u64) -> f64 {
    x as f64
}

fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // No randomness only weakens the hash seed and instance id; it does not stop the edge.
    let _ = getrandom::fill(&mut bytes);
    u64::from_le_bytes(bytes)
}

/// `names`, one a line (JavaScript splits them at `\n`: a header name holds none).
fn lines<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    names.into_iter().fold(String::new(), |mut out, name| {
        out.push_str(name);
        out.push('\n');
        out
    })
}

/// Header `i` of `headers`: its name's index in [`REPLY_HEADER_NAMES`], and its value.
fn header_at<'a>(headers: &'a [(&'static str, String)], i: u32) -> Option<(usize, &'a str)> {
    let (name, value) = headers.get(usize::try_from(i).ok()?)?;
    let index = REPLY_HEADER_NAMES.iter().position(|n| n == name)?;
    Some((index, value))
}

fn reply(d: Decided) -> EdgeReply {
    let first = d.first;
    EdgeReply {
        // The driver hands back the id JavaScript gave, which was a u32.
        request: u32::try_from(d.request).unwrap_or(u32::MAX),
        allowed: d.reply.allowed,
        status: d.reply.status,
        headers: d.reply.headers,
        body: d.reply.body.unwrap_or_default(),
        by: d.by.as_str(),
        limit: js_number(first.map_or(0, |d| d.limit)),
        remaining: js_number(first.map_or(0, |d| d.remaining)),
        reset: js_number(first.map_or(0, |d| d.reset_ms)),
    }
}

impl Edge {
    /// A decided request's reply becomes the current one.
    fn verdict(&mut self, started: Started) -> u8 {
        match started {
            Started::Decided(d) => {
                self.reply = reply(d);
                if self.reply.allowed { PASS } else { DENY }
            }
            Started::Waiting => WAITING,
        }
    }

    /// A request's outcome: its verdict, or [`REFUSED`] with the reason kept.
    fn outcome(&mut self, started: Result<Started, String>) -> u8 {
        match started {
            Ok(started) => self.verdict(started),
            Err(why) => {
                self.refusal = why;
                REFUSED
            }
        }
    }

    /// What [`reply_header_value`](Edge::reply_header_value) wrote last (for Rust callers,
    /// which cannot read at [`reply_value_ptr`](Edge::reply_value_ptr) as JavaScript does).
    pub fn value_out(&self) -> &[u8] {
        &self.value_out
    }

    /// The current reply, whole (for Rust callers: the tests).
    pub fn take_reply(&mut self) -> EdgeReply {
        core::mem::take(&mut self.reply)
    }

    fn subject(
        namespace: &str,
        key: &str,
        limit: f64,
        duration_ms: f64,
        cost: f64,
    ) -> Result<Subject, String> {
        let duration = WindowDuration::from_ms(count(duration_ms, "period")?)
            .map_err(|e| format!("period: {e}"))?;
        Ok(Subject {
            name: namespace.to_string(),
            namespace: namespace.to_string(),
            identifier: identifier_for(key.to_string()),
            limit: count(limit, "limit")?,
            duration,
            cost: count(cost, "cost")?,
            shadow: false,
        })
    }
}

#[wasm_bindgen]
impl Edge {
    /// An edge from the rules JSON (`{"rules": [...]}`), the options JSON (may be empty), the
    /// region name (the instance id's prefix), the bound on a request's wait for the gateway
    /// and how long accepted cost gathers before a replay. Throws an error naming the bad
    /// field.
    #[wasm_bindgen(constructor)]
    pub fn new(
        rules: &str,
        options: &str,
        region: &str,
        timeout_ms: f64,
        replay_delay_ms: f64,
    ) -> Result<Edge, JsError> {
        let gate = Gate::from_json(LOCAL_WORKSPACE, rules, options)
            .map_err(|e| JsError::new(&e.to_string()))?;
        let config = DriverConfig {
            timeout_ms: count(timeout_ms, "timeout")
                .map_err(|e| JsError::new(&e))?
                .max(1),
            replay_interval_ms: count(replay_delay_ms, "replay delay")
                .map_err(|e| JsError::new(&e))?
                .max(1),
            unaddressed_counter: "/__strata/stats requests_unaddressed".to_string(),
        };
        let store = TableStore {
            table: gate.table(random_u64()),
            instance: strata_core::wire::instance_id(region, "edge", random_u64()),
        };
        Ok(Edge {
            driver: Driver::new(gate, config),
            store,
            reply: EdgeReply::default(),
            seen_deadline: None,
            refusal: String::new(),
            values_read: Default::default(),
            value_out: Vec::with_capacity(VALUE_OUT_CAPACITY),
        })
    }

    /// This isolate's random instance id.
    #[wasm_bindgen(getter)]
    pub fn instance(&self) -> String {
        self.store.instance.clone()
    }

    /// The request headers the rules read, `name\n` each (with `host` when a rule matches
    /// the host): the only ones [`start`](Self::start) needs, so JavaScript copies no other.
    #[wasm_bindgen(getter)]
    pub fn header_names(&self) -> String {
        let reads = self.driver.gate().rules().reads();
        let host = reads.host.then_some("host");
        let names = reads.headers.iter().map(String::as_str);
        lines(host.into_iter().chain(names))
    }

    /// A request arrives, `id` JavaScript's name for it: [`PASS`] or [`DENY`] if decided now
    /// (the reply is then the current one), else [`WAITING`] (the reply comes out of
    /// [`poll_decision`](Self::poll_decision)). `headers` is
    /// `name\nvalue\n` per header, names in lower case (those of
    /// [`header_names`](Self::header_names) suffice). [`REFUSED`] (a client error, `400`)
    /// when a cost header is out of bounds or a descriptor is too long.
    pub fn start(
        &mut self,
        id: u32,
        method: &str,
        url: &str,
        headers: &str,
        peer: Option<String>,
        now_ms: f64,
    ) -> u8 {
        let request = JsRequest::new(method, url, headers, peer.as_deref());
        let started = self
            .driver
            .request(&mut self.store, u64::from(id), &request, whole(now_ms))
            .map_err(|e| e.to_string());
        self.outcome(started)
    }

    /// Binding mode: a request of one limit on `key` (Cloudflare's `limit({ key, cost })`),
    /// as [`start`](Self::start).
    #[allow(clippy::too_many_arguments)] // the binding's fields, as JavaScript has them
    pub fn start_key(
        &mut self,
        id: u32,
        namespace: &str,
        key: &str,
        limit: f64,
        duration_ms: f64,
        cost: f64,
        now_ms: f64,
    ) -> u8 {
        let started = Self::subject(namespace, key, limit, duration_ms, cost).and_then(|s| {
            self.driver
                .request_limits(&mut self.store, u64::from(id), vec![s], whole(now_ms))
                .map_err(|e| e.message)
        });
        self.outcome(started)
    }

    /// Why the last request [`REFUSED`] was.
    #[wasm_bindgen(getter)]
    pub fn refusal(&self) -> String {
        self.refusal.clone()
    }

    /// The gateway answered call `call` with `status` and `body`.
    pub fn answer(&mut self, call: f64, status: u16, body: &str, now_ms: f64) {
        self.driver.answer(
            &mut self.store,
            whole(call),
            status,
            body.as_bytes(),
            whole(now_ms),
        );
    }

    /// Call `call` failed without an answer (`why`: the fetch's error).
    pub fn fail(&mut self, call: f64, why: &str, now_ms: f64) {
        self.driver
            .fail(&mut self.store, whole(call), why, whole(now_ms));
    }

    /// The timer fired: calls past their deadline fail, a replay due is sent.
    pub fn timeout(&mut self, now_ms: f64) {
        self.driver.timeout(&mut self.store, whole(now_ms));
    }

    /// The request `id` is gone: its decision is not wanted.
    pub fn cancel(&mut self, id: u32) {
        self.driver.cancel(u64::from(id));
    }

    /// A call to send.
    pub fn poll_transmit(&mut self) -> Option<EdgeCall> {
        self.driver.poll_transmit().map(|t| EdgeCall {
            call: js_number(t.call),
            path: t.path.to_string(),
            body: t.body,
            timeout_ms: js_number(t.timeout_ms),
        })
    }

    /// The id of a request that waited, now decided, or -1; its reply becomes the current
    /// one.
    pub fn poll_decision(&mut self) -> f64 {
        match self.driver.poll_decision() {
            Some(d) => {
                self.reply = reply(d);
                f64::from(self.reply.request)
            }
            None => -1.0,
        }
    }

    /// A line to log.
    pub fn poll_log(&mut self) -> Option<EdgeLog> {
        self.driver.poll_log().map(|l| EdgeLog {
            level: if l.warn { "warn" } else { "info" }.to_string(),
            message: l.message,
        })
    }

    /// When to call [`timeout`](Self::timeout) next (Unix ms), or -1: nothing waits for time.
    pub fn next_deadline(&mut self) -> f64 {
        self.seen_deadline = self.driver.poll_timeout();
        self.seen_deadline.map_or(-1.0, js_number)
    }

    /// Whether there is anything to drain or a timer to arm: a call, a decision or a log line
    /// queued, or a deadline other than the one [`next_deadline`](Self::next_deadline) last
    /// reported. One call instead of the four a drain makes, on the warm path where there is
    /// nothing.
    pub fn wants_pump(&self) -> bool {
        self.driver.has_output() || self.driver.poll_timeout() != self.seen_deadline
    }

    /// Whether the rules read the connection's address (`remote_address` with the `peer`
    /// source): JavaScript reads `request.cf` only then.
    #[wasm_bindgen(getter)]
    pub fn reads_peer(&self) -> bool {
        self.driver.gate().rules().reads().peer
    }

    /// Whether the current reply lets its request go on.
    #[wasm_bindgen(getter)]
    pub fn reply_allowed(&self) -> bool {
        self.reply.allowed
    }

    /// The current reply's status: `429` on a denial, else `200`.
    #[wasm_bindgen(getter)]
    pub fn reply_status(&self) -> u16 {
        self.reply.status
    }

    /// Every name a reply's header can have, `name\n` each: what
    /// [`reply_header_name`](Self::reply_header_name) indexes.
    #[wasm_bindgen(getter)]
    pub fn reply_header_names(&self) -> String {
        lines(REPLY_HEADER_NAMES)
    }

    /// How many headers the current reply has.
    #[wasm_bindgen(getter)]
    pub fn reply_header_count(&self) -> u32 {
        u32::try_from(self.reply.headers.len()).unwrap_or(0)
    }

    /// The name of the current reply's header `i`, as its index in
    /// [`reply_header_names`](Self::reply_header_names).
    pub fn reply_header_name(&self, i: u32) -> u32 {
        header_at(&self.reply.headers, i)
            .and_then(|(n, _)| u32::try_from(n).ok())
            .unwrap_or(u32::MAX)
    }

    /// The value of the current reply's header `i`: its length in bytes, written at
    /// [`reply_value_ptr`](Self::reply_value_ptr) for JavaScript to decode; or -1 when it is
    /// the value this method gave last under the same name, which JavaScript still holds.
    pub fn reply_header_value(&mut self, i: u32) -> i32 {
        let Some((n, value)) = header_at(&self.reply.headers, i) else {
            return -1;
        };
        // Empty is also "nothing read yet", and JavaScript holds nothing for it.
        let read = &mut self.values_read[n];
        if read == value && !read.is_empty() {
            return -1;
        }
        value.clone_into(read);
        self.value_out.clear();
        self.value_out.extend_from_slice(value.as_bytes());
        i32::try_from(value.len()).unwrap_or(0)
    }

    /// Where [`reply_header_value`](Self::reply_header_value) wrote its value in the module's
    /// memory.
    #[wasm_bindgen(getter)]
    pub fn reply_value_ptr(&self) -> u32 {
        // Wasm32 addresses are 32 bits.
        u32::try_from(self.value_out.as_ptr() as usize).unwrap_or(0)
    }

    /// The JSON body of the current reply, a denial (empty on a pass).
    #[wasm_bindgen(getter)]
    pub fn reply_body(&self) -> String {
        self.reply.body.clone()
    }

    /// Which path decided the current reply: `local`, `origin` or `fallback`.
    #[wasm_bindgen(getter)]
    pub fn reply_by(&self) -> String {
        self.reply.by.to_string()
    }

    /// The binding's answer: the limit of the current reply's first enforced limit.
    #[wasm_bindgen(getter)]
    pub fn reply_limit(&self) -> f64 {
        self.reply.limit
    }

    /// What is left of it.
    #[wasm_bindgen(getter)]
    pub fn reply_remaining(&self) -> f64 {
        self.reply.remaining
    }

    /// When its window ends (Unix ms).
    #[wasm_bindgen(getter)]
    pub fn reply_reset(&self) -> f64 {
        self.reply.reset
    }

    /// Counters as JSON: requests and how each was decided, gateway calls, replays, the
    /// table's size and what eviction did, and the module's linear memory.
    pub fn stats(&self) -> String {
        let s = self.driver.stats();
        let m = MemoryReport::of(&self.store.table);
        serde_json::json!({
            "instance": self.store.instance,
            "requests": s.requests,
            "decided": {
                "local": s.decided_local,
                "origin": s.decided_origin,
                "fallback": s.decided_fallback,
                "ahead": s.decided_ahead,
            },
            "origin_calls": s.origin_calls,
            "origin_reasons": Reason::ALL
                .iter()
                .map(|r| (r.as_str().to_owned(), s.origin_reason(*r).into()))
                .collect::<serde_json::Map<_, _>>(),
            "origin_failures": s.origin_failures,
            "coalesced": s.coalesced,
            "replays": s.replays,
            "replay_failures": s.replay_failures,
            "requests_unaddressed": s.unaddressed,
            "waiting": self.driver.waiting(),
            "unreplayed_cells": self.store.table.unreplayed_cells(),
            "table": {
                "entries": m.entries,
                "capacity": m.capacity,
                "bytes": m.table_bytes,
                "evicted": m.evicted,
                "replay_dropped": m.replay_dropped,
            },
            "memory_bytes": m.linear_bytes,
        })
        .to_string()
    }
}
