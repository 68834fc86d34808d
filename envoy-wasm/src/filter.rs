//! One VM's filter state and the callbacks' logic, over a [`Host`]: the rules applied to a
//! request, decided by the core's gate from the VM's table or by the gateway (the request
//! paused until the answer, or until the timeout the tick enforces), the reply, and the replay
//! of accepted cost on the tick. Nothing here panics: lookups use `get`, parse errors become
//! failures decided by the failure mode.

use std::collections::BTreeMap;
use std::time::Duration;

use strata_core::gate::{Pending, Reply};
use strata_core::replay::ReplayBatch;
use strata_core::request::FailureMode;
use strata_core::rules::RequestView;
use strata_core::wire::{CellsResponse, DecideResponse};
use strata_core::{CounterTable, TableConfig};

use crate::config::Config;
use crate::host::Host;
use crate::metrics::{Metric, Metrics};

/// What the request callback tells Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Go on to the upstream.
    Continue,
    /// Wait: a gateway call is out, or a local reply was sent.
    Pause,
}

/// A request waiting on gateway calls.
#[derive(Debug)]
struct Paused {
    pending: Pending,
    deadline_ms: u64,
}

/// A replay batch in flight.
#[derive(Debug)]
struct Replay {
    token: u32,
    batch: ReplayBatch,
    deadline_ms: u64,
}

/// Everything one VM holds.
#[derive(Debug)]
pub struct Vm {
    config: Config,
    table: CounterTable,
    instance: String,
    metrics: Metrics,
    paused: BTreeMap<u32, Paused>,
    /// Call token → (HTTP context, group).
    calls: BTreeMap<u32, (u32, usize)>,
    /// Headers to add in the response phase of passed requests.
    pass_headers: BTreeMap<u32, Vec<(&'static str, String)>>,
    replay: Option<Replay>,
    next_replay_ms: u64,
}

/// The request as Envoy's headers give it.
struct EnvoyRequest {
    headers: Vec<(String, String)>,
    peer: Option<String>,
}

impl EnvoyRequest {
    fn pseudo(&self, name: &str) -> &str {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map_or("", |(_, v)| v.as_str())
    }
}

impl RequestView for EnvoyRequest {
    fn method(&self) -> &str {
        self.pseudo(":method")
    }
    fn host(&self) -> &str {
        let authority = self.pseudo(":authority");
        if authority.starts_with('[') {
            return authority.split_inclusive(']').next().unwrap_or(authority);
        }
        authority.split(':').next().unwrap_or(authority)
    }
    fn path(&self) -> &str {
        let path = self.pseudo(":path");
        path.split(['?', '#']).next().unwrap_or(path)
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    fn peer_address(&self) -> Option<&str> {
        let peer = self.peer.as_deref()?;
        // `ip:port` or `[v6]:port`: the address without the port.
        Some(match peer.rsplit_once(':') {
            Some((ip, port)) if port.bytes().all(|b| b.is_ascii_digit()) => {
                ip.trim_start_matches('[').trim_end_matches(']')
            }
            _ => peer,
        })
    }
}

impl Vm {
    /// A VM's state for `config`; defines its metrics.
    pub fn new(config: Config, host: &impl Host) -> Self {
        let metrics = Metrics::define(host, &config.stat_prefix);
        let region: String = config
            .region
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
            .take(24)
            .collect();
        let instance = format!("{region}-{:016x}", host.random_u64());
        Self {
            table: CounterTable::new(TableConfig::default(), host.random_u64()),
            instance,
            metrics,
            paused: BTreeMap::new(),
            calls: BTreeMap::new(),
            pass_headers: BTreeMap::new(),
            replay: None,
            next_replay_ms: 0,
            config,
        }
    }

    /// The tick period the VM wants.
    pub fn tick_period(&self) -> Duration {
        Duration::from_millis(
            self.config
                .timeout_ms
                .min(self.config.replay_interval_ms)
                .clamp(10, 1_000)
                / 2,
        )
    }

    fn mode(&self) -> FailureMode {
        self.config.options().failure_mode.into()
    }

    fn call_headers(&self, path: &'static str) -> Vec<(&str, &str)> {
        let mut headers = vec![
            (":method", "POST"),
            (":path", path),
            (":authority", self.config.authority.as_str()),
            (":scheme", "http"),
            ("content-type", "application/json"),
        ];
        if let Some(auth) = &self.config.authorization {
            headers.push(("authorization", auth.as_str()));
        }
        headers
    }

    /// `on_http_request_headers` of HTTP context `context`.
    pub fn on_request(&mut self, host: &impl Host, context: u32) -> Verdict {
        let now = host.now_ms();
        let request = EnvoyRequest {
            headers: host.request_headers(),
            peer: host.peer_address(),
        };
        let mut pending = match self.config.gate.start(&mut self.table, &request, now) {
            Ok(p) => p,
            Err(e) => {
                host.log(true, &format!("strata: refused a request: {e}"));
                let body = serde_json::json!({"error": {"code": "invalid_request", "message": e.to_string()}});
                host.send_response(
                    400,
                    vec![("content-type", "application/json")],
                    body.to_string().as_bytes(),
                );
                return Verdict::Pause;
            }
        };
        let mut waiting = false;
        let calls: Vec<(usize, Vec<u8>)> = pending
            .calls()
            .map(|(g, call)| {
                (
                    g,
                    serde_json::to_vec(&call.to_wire(&self.instance)).unwrap_or_default(),
                )
            })
            .collect();
        for (g, body) in calls {
            let timeout = Duration::from_millis(self.config.timeout_ms);
            let headers = self.call_headers("/v1/origin/decide");
            match host.dispatch(&self.config.cluster, headers, &body, timeout) {
                Ok(token) => {
                    self.calls.insert(token, (context, g));
                    self.metrics.add(host, Metric::OriginCalls, 1);
                    waiting = true;
                }
                Err(e) => {
                    host.log(
                        true,
                        &format!("strata: cannot call the gateway ({e}); the failure mode decides"),
                    );
                    self.metrics.add(host, Metric::OriginFailures, 1);
                    let mode = self.mode();
                    pending.fail(&mut self.table, g, mode, now);
                }
            }
        }
        if waiting {
            let deadline_ms = now.saturating_add(self.config.timeout_ms);
            self.paused.insert(
                context,
                Paused {
                    pending,
                    deadline_ms,
                },
            );
            return Verdict::Pause;
        }
        let source = if pending.origin_failed {
            Metric::DecidedFallback
        } else {
            Metric::DecidedLocal
        };
        self.settle(host, context, &pending, now, source)
    }

    /// `on_http_call_response` for `token`, delivered to HTTP context `context` (or to the
    /// root context for a replay).
    pub fn on_call_response(&mut self, host: &impl Host, token: u32, body_size: usize) {
        let now = host.now_ms();
        if self.replay.as_ref().is_some_and(|r| r.token == token) {
            let (status, body) = host.call_response(body_size);
            self.on_replay_answer(host, status, &body);
            return;
        }
        let Some((context, g)) = self.calls.remove(&token) else {
            return; // a late answer to a request the timeout already settled
        };
        let (status, body) = host.call_response(body_size);
        let mode = self.mode();
        let Some(paused) = self.paused.get_mut(&context) else {
            return;
        };
        let parsed = (status == 200)
            .then(|| serde_json::from_slice::<DecideResponse>(&body).ok())
            .flatten();
        match parsed {
            Some(response) => paused
                .pending
                .answer(&mut self.table, g, &response, mode, now),
            None => {
                host.log(
                    true,
                    &format!("strata: the gateway answered {status}; the failure mode decides"),
                );
                paused.pending.fail(&mut self.table, g, mode, now);
            }
        }
        if paused.pending.origin_failed {
            self.metrics.add(host, Metric::OriginFailures, 1);
        }
        if paused.pending.is_done() {
            if let Some(done) = self.paused.remove(&context) {
                let source = if done.pending.origin_failed {
                    Metric::DecidedFallback
                } else {
                    Metric::DecidedOrigin
                };
                if self.settle(host, context, &done.pending, now, source) == Verdict::Continue {
                    host.resume();
                }
            }
        }
    }

    /// Decides what the request gets; sends the local reply of a denial.
    /// `source` says where it was decided: from memory, by the gateway, or by the failure mode.
    fn settle(
        &mut self,
        host: &impl Host,
        context: u32,
        pending: &Pending,
        now: u64,
        source: Metric,
    ) -> Verdict {
        let reply: Reply = pending.reply(self.config.options(), now);
        if !pending.subjects().is_empty() {
            self.metrics.add(host, source, 1);
        }
        if !reply.shadow_denied.is_empty() {
            self.metrics.add(host, Metric::Shadow, 1);
            self.metrics.add(host, Metric::RateLimited, 1);
            host.log(
                false,
                &format!(
                    "strata: shadow rule would deny: {}",
                    reply.shadow_denied.join(",")
                ),
            );
        }
        if reply.allowed {
            self.metrics.add(host, Metric::Ok, 1);
            if !reply.headers.is_empty() {
                self.pass_headers.insert(context, reply.headers);
            }
            return Verdict::Continue;
        }
        self.metrics.add(host, Metric::RateLimited, 1);
        self.metrics.add(host, Metric::Enforced, 1);
        let mut headers: Vec<(&str, &str)> = reply
            .headers
            .iter()
            .map(|(k, v)| (*k, v.as_str()))
            .collect();
        headers.push(("content-type", "application/json"));
        let body = reply.body.unwrap_or_default();
        host.send_response(u32::from(reply.status), headers, body.as_bytes());
        Verdict::Pause
    }

    /// `on_http_response_headers`: the rate-limit headers of a passed request.
    pub fn on_response(&mut self, host: &impl Host, context: u32) {
        if let Some(headers) = self.pass_headers.remove(&context) {
            for (name, value) in headers {
                host.add_response_header(name, &value);
            }
        }
    }

    /// The HTTP context is gone (the client hung up): forget it.
    pub fn on_done(&mut self, context: u32) {
        self.paused.remove(&context);
        self.pass_headers.remove(&context);
        self.calls.retain(|_, (c, _)| *c != context);
    }

    /// The root context's tick: settles requests whose calls outlived the timeout (a cluster
    /// with no healthy host may never answer), and replays accepted cost.
    pub fn on_tick(&mut self, host: &impl Host, root: u32) {
        let now = host.now_ms();
        let expired: Vec<u32> = self
            .paused
            .iter()
            .filter(|(_, p)| p.deadline_ms <= now)
            .map(|(c, _)| *c)
            .collect();
        let mode = self.mode();
        for context in expired {
            let Some(mut paused) = self.paused.remove(&context) else {
                continue;
            };
            let groups: Vec<usize> = paused.pending.calls().map(|(g, _)| g).collect();
            for g in groups {
                paused.pending.fail(&mut self.table, g, mode, now);
            }
            self.calls.retain(|_, (c, _)| *c != context);
            self.metrics.add(host, Metric::OriginFailures, 1);
            host.log(
                true,
                "strata: the gateway did not answer within the timeout; the failure mode decides",
            );
            if host.set_context(context)
                && self.settle(host, context, &paused.pending, now, Metric::DecidedFallback)
                    == Verdict::Continue
            {
                host.resume();
            }
            host.set_context(root);
        }
        self.replay_tick(host, now);
    }

    fn replay_tick(&mut self, host: &impl Host, now: u64) {
        if let Some(r) = &self.replay {
            if r.deadline_ms > now {
                return;
            }
            self.replay = None; // lost: its counts go with the next batch
            self.metrics.add(host, Metric::ReplayFailures, 1);
        }
        if now < self.next_replay_ms {
            return;
        }
        self.next_replay_ms = now.saturating_add(self.config.replay_interval_ms);
        let batch = self.table.take_replay(1_000, now);
        if batch.is_empty() {
            return;
        }
        let Ok(body) = serde_json::to_vec(&batch.to_wire(&self.instance)) else {
            return;
        };
        let headers = self.call_headers("/v1/origin/replay");
        let timeout = Duration::from_millis(self.config.timeout_ms.max(1_000));
        match host.dispatch(&self.config.cluster, headers, &body, timeout) {
            Ok(token) => {
                self.replay = Some(Replay {
                    token,
                    batch,
                    deadline_ms: now
                        .saturating_add(timeout.as_millis().try_into().unwrap_or(u64::MAX)),
                });
            }
            Err(e) => {
                self.metrics.add(host, Metric::ReplayFailures, 1);
                host.log(
                    true,
                    &format!("strata: cannot replay ({e}); the next replay carries the counts"),
                );
            }
        }
    }

    fn on_replay_answer(&mut self, host: &impl Host, status: u16, body: &[u8]) {
        let Some(replay) = self.replay.take() else {
            return;
        };
        let parsed = (status == 200)
            .then(|| serde_json::from_slice::<CellsResponse>(body).ok())
            .flatten()
            .filter(|r| r.cells.len() == replay.batch.len());
        match parsed {
            Some(response) => {
                self.table.ack_replay(&replay.batch, &response.cells);
                self.metrics.add(host, Metric::Replays, 1);
            }
            None => {
                self.metrics.add(host, Metric::ReplayFailures, 1);
                host.log(true, &format!("strata: the gateway refused a replay ({status}); the next one carries the counts"));
            }
        }
    }
}
