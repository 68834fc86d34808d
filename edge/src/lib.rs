//! `strata-edge`: the Workers-style edge. JavaScript (`worker.mjs`) reads the clock, does the
//! fetches and holds this object for the isolate's life; everything else is the core's
//! [`Gate`] (rules, the request path, the reply) and its replay buffer. This crate only moves
//! bytes between the two.
//!
//! A request: [`Edge::start`] (or [`Edge::start_key`] in binding mode) → for each group with
//! a call, [`Edge::call_body`] is POSTed to `/v1/origin/decide` and the answer handed to
//! [`Edge::answer`] (or [`Edge::fail`]) → [`Edge::reply`]. After the response,
//! [`Edge::take_replay`] → `/v1/origin/replay` → [`Edge::ack_replay`].

mod view;

use strata_core::gate::{Gate, Pending, Subject};
use strata_core::identity::identifier_for;
use strata_core::replay::ReplayBatch;
use strata_core::wire::{CellsResponse, DecideResponse};
use strata_core::{CounterTable, TableConfig, WindowDuration};
use wasm_bindgen::prelude::*;

pub use view::JsRequest;

/// The workspace of the local table's keys; the gateway binds the real one to the token.
const LOCAL_WORKSPACE: &str = "edge";
/// Largest number JavaScript holds exactly (2^53 - 1).
const MAX_SAFE: f64 = 9_007_199_254_740_991.0;

/// What happened so far, for logs and the debug header.
#[derive(Clone, Copy, Debug, Default)]
struct Stats {
    requests: u64,
    origin_calls: u64,
    origin_failures: u64,
    replays: u64,
    replay_failures: u64,
    /// Requests a `remote_address` rule did not apply to: no trusted client address.
    unaddressed: u64,
}

/// One isolate's limiter: rules, options, table, instance id.
#[wasm_bindgen]
#[derive(Debug)]
pub struct Edge {
    gate: Gate,
    table: CounterTable,
    instance: String,
    stats: Stats,
}

/// A request between [`Edge::start`] and [`Edge::reply`].
#[wasm_bindgen]
#[derive(Debug)]
pub struct EdgeRequest {
    pending: Pending,
}

/// What to answer: status, headers, body; `log` names shadow rules that would have denied.
#[wasm_bindgen(getter_with_clone)]
#[derive(Debug)]
pub struct EdgeReply {
    /// Whether the request goes on (to the upstream, or `success` in binding mode).
    pub allowed: bool,
    /// `429` on a denial, else `200`.
    pub status: u16,
    /// `name\nvalue\n` per header (one string: one copy out of Wasm).
    pub headers: String,
    /// The JSON body of a denial (empty on a pass).
    pub body: String,
    /// Shadow rules that would have denied, comma-separated (empty if none).
    pub shadow_denied: String,
    /// The binding's answer: the limit of the first enforced limit.
    pub limit: f64,
    /// What is left of it.
    pub remaining: f64,
    /// When its window ends (Unix ms).
    pub reset: f64,
    /// A warning to log, once per isolate (empty otherwise): the first request a
    /// `remote_address` rule could not apply to for want of a trusted client address.
    pub notice: String,
}

#[wasm_bindgen]
impl EdgeRequest {
    /// Whether an origin call of this request failed (the failure mode decided it).
    #[wasm_bindgen(getter)]
    pub fn origin_failed(&self) -> bool {
        self.pending.origin_failed
    }
}

/// A replay batch in flight.
#[wasm_bindgen]
#[derive(Debug)]
pub struct ReplayOut {
    batch: ReplayBatch,
    body: String,
}

#[wasm_bindgen]
impl ReplayOut {
    /// The `/v1/origin/replay` body.
    #[wasm_bindgen(getter)]
    pub fn body(&self) -> String {
        self.body.clone()
    }
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
fn count(x: f64, what: &str) -> Result<u64, JsError> {
    if x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x <= MAX_SAFE {
        Ok(whole(x))
    } else {
        Err(JsError::new(&format!(
            "{what} must be a whole number from 0 to 2^53-1, not {x}"
        )))
    }
}

#[allow(clippy::cast_precision_loss)] // counts and Unix ms stay below 2^53
fn js_number(x: u64) -> f64 {
    x as f64
}

fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // No randomness only weakens the hash seed and instance id; it does not stop the edge.
    let _ = getrandom::fill(&mut bytes);
    u64::from_le_bytes(bytes)
}

#[wasm_bindgen]
impl Edge {
    /// An edge from the rules JSON (`{"rules": [...]}`), the options JSON (may be empty) and
    /// the region name (the instance id's prefix). Throws an error naming the bad field.
    #[wasm_bindgen(constructor)]
    pub fn new(rules: &str, options: &str, region: &str) -> Result<Edge, JsError> {
        let gate = Gate::from_json(LOCAL_WORKSPACE, rules, options)
            .map_err(|e| JsError::new(&e.to_string()))?;
        let instance = strata_core::wire::instance_id(region, "edge", random_u64());
        Ok(Edge {
            table: gate.table(TableConfig::default(), random_u64()),
            gate,
            instance,
            stats: Stats::default(),
        })
    }

    /// This isolate's random instance id.
    #[wasm_bindgen(getter)]
    pub fn instance(&self) -> String {
        self.instance.clone()
    }

    /// Applies the rules to a request and begins its limits. `headers` is `name\nvalue\n` per
    /// header, names in lower case. Throws (a client error, `400`) when a cost header is out of
    /// bounds or a descriptor is too long.
    pub fn start(
        &mut self,
        method: &str,
        url: &str,
        headers: &str,
        peer: Option<String>,
        now_ms: f64,
    ) -> Result<EdgeRequest, JsError> {
        self.stats.requests += 1;
        let request = JsRequest::new(method, url, headers, peer.as_deref());
        let pending = self
            .gate
            .start(&mut self.table, &request, whole(now_ms))
            .map_err(|e| JsError::new(&e.to_string()))?;
        Ok(EdgeRequest { pending })
    }

    /// Binding mode: begins one limit on `key` (Cloudflare's `limit({ key, cost })`).
    pub fn start_key(
        &mut self,
        namespace: &str,
        key: &str,
        limit: f64,
        duration_ms: f64,
        cost: f64,
        now_ms: f64,
    ) -> Result<EdgeRequest, JsError> {
        self.stats.requests += 1;
        let duration = WindowDuration::from_ms(count(duration_ms, "period")?)
            .map_err(|e| JsError::new(&format!("period: {e}")))?;
        let subject = Subject {
            name: namespace.to_string(),
            namespace: namespace.to_string(),
            identifier: identifier_for(key.to_string()),
            limit: count(limit, "limit")?,
            duration,
            cost: count(cost, "cost")?,
            shadow: false,
        };
        let pending = self
            .gate
            .begin(&mut self.table, vec![subject], whole(now_ms))
            .map_err(|e| JsError::new(&e.message))?;
        Ok(EdgeRequest { pending })
    }

    /// The `/v1/origin/decide` body of group `group` (0 enforced, 1 shadow), if it needs one.
    pub fn call_body(&self, request: &EdgeRequest, group: usize) -> Option<String> {
        let (_, call) = request.pending.calls().find(|(g, _)| *g == group)?;
        serde_json::to_string(&call.to_wire(&self.instance)).ok()
    }

    /// A name for group `group`'s call: requests whose calls share it wait for one answer.
    pub fn call_key(&self, request: &EdgeRequest, group: usize) -> Option<String> {
        let (_, call) = request.pending.calls().find(|(g, _)| *g == group)?;
        let mut key = String::new();
        for l in call.limits() {
            let k = l.key.as_ref();
            key.push_str(&format!(
                "{}:{}:{}:{};",
                k.namespace().len(),
                k.namespace(),
                k.duration().as_ms(),
                k.identifier()
            ));
        }
        Some(key)
    }

    /// The gateway answered group `group`'s call with `status` and `body`. Anything but a
    /// `200` with a decide answer that fits the call is a failure (decided per the mode);
    /// returns whether the answer was taken.
    pub fn answer(
        &mut self,
        request: &mut EdgeRequest,
        group: usize,
        status: u16,
        body: &str,
        now_ms: f64,
    ) -> bool {
        self.stats.origin_calls += 1;
        let Some(response) = DecideResponse::from_answer(status, body.as_bytes()) else {
            self.fail(request, group, now_ms);
            return false;
        };
        request
            .pending
            .answer(&mut self.table, group, &response, whole(now_ms));
        let taken = !request.pending.origin_failed;
        if !taken {
            self.stats.origin_failures += 1;
        }
        taken
    }

    /// Group `group`'s call failed (unreachable, timed out): decided per the failure mode.
    pub fn fail(&mut self, request: &mut EdgeRequest, group: usize, now_ms: f64) {
        self.stats.origin_failures += 1;
        request.pending.fail(&mut self.table, group, whole(now_ms));
    }

    /// The reply, once every call is answered or failed.
    pub fn reply(&mut self, request: &EdgeRequest, now_ms: f64) -> EdgeReply {
        let reply = request.pending.reply(self.gate.options(), whole(now_ms));
        let mut notice = String::new();
        if request.pending.unaddressed {
            if self.stats.unaddressed == 0 {
                let source = self.gate.rules().client_address();
                notice = source.unaddressed_notice("/__strata/stats requests_unaddressed");
            }
            self.stats.unaddressed += 1;
        }
        let first = request
            .pending
            .decision(strata_core::gate::ENFORCED)
            .and_then(|d| d.decisions.first().copied());
        EdgeReply {
            allowed: reply.allowed,
            status: reply.status,
            headers: reply.headers.iter().fold(String::new(), |mut out, (k, v)| {
                out.push_str(k);
                out.push('\n');
                out.push_str(v);
                out.push('\n');
                out
            }),
            body: reply.body.unwrap_or_default(),
            shadow_denied: reply.shadow_denied.join(","),
            limit: js_number(first.map_or(0, |d| d.limit)),
            remaining: js_number(first.map_or(0, |d| d.remaining)),
            reset: js_number(first.map_or(0, |d| d.reset_ms)),
            notice,
        }
    }

    /// Up to `max` cells of own counts the gateway has not acknowledged, as a batch to POST
    /// to `/v1/origin/replay`; none when there is nothing to send.
    pub fn take_replay(&mut self, now_ms: f64, max: usize) -> Option<ReplayOut> {
        let batch = self.table.take_replay(max.max(1), whole(now_ms));
        if batch.is_empty() {
            return None;
        }
        let body = serde_json::to_string(&batch.to_wire(&self.instance)).ok()?;
        Some(ReplayOut { batch, body })
    }

    /// The gateway answered a replay: merges the counts it returned. A failure needs nothing
    /// (the next batch carries the same cumulative counts); returns whether it was taken.
    pub fn ack_replay(&mut self, batch: &ReplayOut, status: u16, body: &str) -> bool {
        match CellsResponse::from_answer(status, body.as_bytes(), batch.batch.len()) {
            Some(response) => {
                self.stats.replays += 1;
                self.table.ack_replay(&batch.batch, &response.cells);
                true
            }
            None => {
                self.stats.replay_failures += 1;
                false
            }
        }
    }

    /// Counters as JSON: requests, origin calls and failures, replays, table entries.
    pub fn stats(&self) -> String {
        let s = self.stats;
        serde_json::json!({
            "instance": self.instance,
            "requests": s.requests,
            "origin_calls": s.origin_calls,
            "origin_failures": s.origin_failures,
            "replays": s.replays,
            "replay_failures": s.replay_failures,
            "requests_unaddressed": s.unaddressed,
            "entries": self.table.len(),
            "unreplayed_cells": self.table.unreplayed_cells(),
        })
        .to_string()
    }
}
