//! One VM's filter state and the callbacks' logic, over a [`Host`]: the rules applied to a
//! request, decided by the core's gate from the VM's table or by the gateway (the request
//! paused until the answer, or until the timeout the tick enforces), the reply, and the replay
//! of accepted cost on the tick. Nothing here panics: lookups use `get`, parse errors become
//! failures decided by the failure mode.

use std::collections::BTreeMap;
use std::time::Duration;

use strata_core::cell::WindowState;
use strata_core::gate::{ENFORCED, Pending, Reply, SHADOW};
use strata_core::identity::WindowKeyRef;
use strata_core::replay::{ReplayBatch, ReplayEvent};
use strata_core::request::{self, Begin};
use strata_core::rules::{ListRequest, Reads, host_of, path_of};
use strata_core::snapshot::decode_entry;
use strata_core::table::LimitRequest;
use strata_core::wire::{CellsResponse, DecideResponse, instance_id};
use strata_core::{CounterTable, TableConfig, WindowDuration};

use crate::config::Config;
use crate::host::{Host, SetError};
use crate::metrics::{Metric, Metrics};
use crate::shared::{CAS_TRIES, One, REPLAY_KEY, Slots};

/// The workspace of the filter's keys (the gateway binds the real one to the token).
const WORKSPACE: &str = "envoy";

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
    /// Per group: whether its state lives in a shared slot (else in the VM's table).
    shared: [bool; 2],
}

/// A replay batch in flight: of the VM's table, or of the shared slots.
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
    /// What the rules read of a request: the only headers fetched from Envoy.
    reads: Reads,
    /// Keys that found no shared slot (and multi-limit groups): this VM's own, under its own
    /// instance id, since the origin keeps one own count per instance.
    table: CounterTable,
    vm_instance: String,
    /// The shared slots and the Envoy's instance id (none when `shared_slots` is 0).
    slots: Option<(Slots, String)>,
    /// This VM among its Envoy's, for the replay lease.
    vm_tag: u64,
    metrics: Metrics,
    paused: BTreeMap<u32, Paused>,
    /// Call token → (HTTP context, group).
    calls: BTreeMap<u32, (u32, usize)>,
    /// Headers to add in the response phase of passed requests.
    pass_headers: BTreeMap<u32, Vec<(&'static str, String)>>,
    replay: Option<Replay>,
    replay_shared: Option<Replay>,
    next_replay_ms: u64,
    /// Whether this VM has logged a request without a trusted client address (once per VM;
    /// the `unaddressed` counter has them all).
    warned_unaddressed: bool,
}

/// The request as the rules read it: only the parts and headers they name (`reads`), one
/// host call each. Header values stay bytes; the pseudo-headers the matchers compare as text
/// are read lossily (a byte that is not UTF-8 matches no configured text).
fn envoy_request(host: &impl Host, reads: &Reads) -> ListRequest {
    let text = |wanted: bool, name: &str| -> String {
        let bytes = if wanted {
            host.request_header(name)
        } else {
            None
        };
        bytes.map_or_else(String::new, |b| String::from_utf8_lossy(&b).into_owned())
    };
    ListRequest {
        method: text(reads.method, ":method"),
        host: host_of(&text(reads.host, ":authority")).to_string(),
        path: path_of(&text(reads.path, ":path")).to_string(),
        peer: reads.peer.then(|| host.peer_address()).flatten(),
        headers: reads
            .headers
            .iter()
            .filter_map(|name| Some((name.clone(), host.request_header(name)?)))
            .collect(),
    }
}

impl Vm {
    /// A VM's state for `config`; defines its metrics.
    pub fn new(config: Config, host: &impl Host) -> Self {
        let metrics = Metrics::define(host, &config.stat_prefix);
        let vm_tag = host.random_u64();
        let vm_instance = instance_id(&config.region, "envoy", vm_tag);
        let slots = (config.shared_slots > 0).then(|| {
            let fresh = instance_id(&config.region, "envoy", host.random_u64());
            Slots::seed(host, config.shared_slots, &fresh)
        });
        Self {
            table: config.gate.table(TableConfig::default(), host.random_u64()),
            vm_instance,
            slots,
            vm_tag,
            metrics,
            paused: BTreeMap::new(),
            calls: BTreeMap::new(),
            pass_headers: BTreeMap::new(),
            replay: None,
            replay_shared: None,
            next_replay_ms: 0,
            warned_unaddressed: false,
            reads: config.gate.rules().reads(),
            config,
        }
    }

    /// The instance id calls for a group are made under.
    fn instance(&self, shared: bool) -> &str {
        match &self.slots {
            Some((_, instance)) if shared => instance,
            _ => &self.vm_instance,
        }
    }

    /// Begins one limit on its shared slot; `None` when the slot holds another live key or
    /// stays contended (the VM's table takes the request then).
    fn begin_shared(&self, host: &impl Host, limit: &LimitRequest<'_>, now: u64) -> Option<Begin> {
        let (slots, _) = self.slots.as_ref()?;
        let policy = self.table.config().origin;
        for _ in 0..CAS_TRIES {
            let mut loaded = slots.load(host, limit.key, now)?;
            let mut one = One::new(loaded.state, host);
            let begun = request::begin(&mut one, std::slice::from_ref(limit), now, &policy);
            loaded.state = one.state;
            match Slots::store(host, &loaded, limit.key) {
                Ok(()) => return Some(begun),
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Refused) => return None,
            }
        }
        None
    }

    /// Settles group `g` of a paused request with the gateway's answer, or (`None`) as failed.
    fn resolve(
        &mut self,
        host: &impl Host,
        paused: &mut Paused,
        g: usize,
        response: Option<&DecideResponse>,
        now: u64,
    ) {
        let shared = paused.shared.get(g).copied().unwrap_or(false);
        if !shared {
            match response {
                Some(r) => paused.pending.answer(&mut self.table, g, r, now),
                None => paused.pending.fail(&mut self.table, g, now),
            }
            return;
        }
        let policy = self.table.config().origin;
        let key = paused
            .pending
            .calls()
            .find(|(gg, _)| *gg == g)
            .and_then(|(_, call)| call.limits().first())
            .map(|l| l.key.clone());
        let (Some(key), Some((slots, _))) = (key, self.slots.as_ref()) else {
            return;
        };
        for _ in 0..CAS_TRIES {
            let Some(mut loaded) = slots.load(host, key.as_ref(), now) else {
                break;
            };
            let mut attempt = paused.pending.clone();
            let mut one = One::new(loaded.state, host);
            match response {
                Some(r) => attempt.answer_on(&mut one, g, r, now, &policy),
                None => attempt.fail_on(&mut one, g, now, &policy),
            }
            loaded.state = one.state;
            match Slots::store(host, &loaded, key.as_ref()) {
                Ok(()) => {
                    paused.pending = attempt;
                    return;
                }
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Refused) => break,
            }
        }
        // The slot went to another key or stays contended: decide on a copy, unrecorded (the
        // origin holds what it counted).
        let mut one = One::new(WindowState::new(key.as_ref().duration(), now), host);
        match response {
            Some(r) => paused.pending.answer_on(&mut one, g, r, now, &policy),
            None => paused.pending.fail_on(&mut one, g, now, &policy),
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
        let request = envoy_request(host, &self.reads);
        let begun = self.begin_request(host, &request, now);
        let (subjects, begun, shared) = match begun {
            Ok(b) => b,
            Err(message) => {
                host.log(true, &format!("strata: refused a request: {message}"));
                let body =
                    serde_json::json!({"error": {"code": "invalid_request", "message": message}});
                host.send_response(
                    400,
                    vec![("content-type", "application/json")],
                    body.to_string().as_bytes(),
                );
                return Verdict::Pause;
            }
        };
        let [enforced, shadow] = begun;
        let mut paused = Paused {
            pending: Pending::from_begun(subjects, enforced, shadow),
            deadline_ms: now.saturating_add(self.config.timeout_ms),
            shared,
        };
        let mut waiting = false;
        let calls: Vec<(usize, Vec<u8>)> = paused
            .pending
            .calls()
            .map(|(g, call)| {
                let instance = self.instance(shared.get(g).copied().unwrap_or(false));
                (
                    g,
                    serde_json::to_vec(&call.to_wire(instance)).unwrap_or_default(),
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
                    self.resolve(host, &mut paused, g, None, now);
                }
            }
        }
        if waiting {
            self.paused.insert(context, paused);
            return Verdict::Pause;
        }
        let source = if paused.pending.origin_failed {
            Metric::DecidedFallback
        } else {
            Metric::DecidedLocal
        };
        self.settle(host, context, &paused.pending, now, source)
    }

    /// Applies the rules and begins each group: a single limit on its shared slot where it
    /// can, otherwise on the VM's table. A client error is the message for the `400`.
    #[allow(clippy::type_complexity)]
    fn begin_request(
        &mut self,
        host: &impl Host,
        request: &ListRequest,
        now: u64,
    ) -> Result<
        (
            Vec<strata_core::gate::Subject>,
            [Option<Begin>; 2],
            [bool; 2],
        ),
        String,
    > {
        let subjects = self
            .config
            .gate
            .subjects(request)
            .map_err(|e| e.to_string())?;
        if subjects.unaddressed {
            self.unaddressed(host);
        }
        let subjects = subjects.limits;
        let mut begun: [Option<Begin>; 2] = [None, None];
        let mut shared = [false; 2];
        for (g, shadow) in [(ENFORCED, false), (SHADOW, true)] {
            let limits = self
                .config
                .gate
                .group_limits(&subjects, shadow)
                .map_err(|e| e.to_string())?;
            let (b, on_slot) = match limits.as_slice() {
                [] => continue,
                [limit] => match self.begin_shared(host, limit, now) {
                    Some(b) => (b, true),
                    None => (
                        self.table.begin(&limits, now).map_err(|e| e.to_string())?,
                        false,
                    ),
                },
                _ => (
                    self.table.begin(&limits, now).map_err(|e| e.to_string())?,
                    false,
                ),
            };
            if let (Some(slot), Some(flag)) = (begun.get_mut(g), shared.get_mut(g)) {
                *slot = Some(b);
                *flag = on_slot;
            }
        }
        Ok((subjects, begun, shared))
    }

    /// A `remote_address` rule left a request out: no trusted client address. Counted each
    /// time, logged once per VM.
    fn unaddressed(&mut self, host: &impl Host) {
        self.metrics.add(host, Metric::Unaddressed, 1);
        if !self.warned_unaddressed {
            self.warned_unaddressed = true;
            let source = self.config.gate.rules().client_address();
            let counter = format!("{}.unaddressed", self.config.stat_prefix);
            host.log(
                true,
                &format!("strata: {}", source.unaddressed_notice(&counter)),
            );
        }
    }

    /// `on_http_call_response` for `token`, delivered to HTTP context `context` (or to the
    /// root context for a replay).
    pub fn on_call_response(&mut self, host: &impl Host, token: u32, body_size: usize) {
        let now = host.now_ms();
        for shared in [false, true] {
            let slot = if shared {
                &self.replay_shared
            } else {
                &self.replay
            };
            if slot.as_ref().is_some_and(|r| r.token == token) {
                let (status, body) = host.call_response(body_size);
                self.on_replay_answer(host, shared, status, &body, now);
                return;
            }
        }
        let Some((context, g)) = self.calls.remove(&token) else {
            return; // a late answer to a request the timeout already settled
        };
        let (status, body) = host.call_response(body_size);
        let Some(mut paused) = self.paused.remove(&context) else {
            return;
        };
        let parsed = DecideResponse::from_answer(status, &body);
        if parsed.is_none() {
            host.log(
                true,
                &format!("strata: the gateway answered {status}; the failure mode decides"),
            );
        }
        let failed_before = paused.pending.origin_failed;
        self.resolve(host, &mut paused, g, parsed.as_ref(), now);
        if paused.pending.origin_failed && !failed_before {
            self.metrics.add(host, Metric::OriginFailures, 1);
        }
        if !paused.pending.is_done() {
            self.paused.insert(context, paused);
            return;
        }
        let source = if paused.pending.origin_failed {
            Metric::DecidedFallback
        } else {
            Metric::DecidedOrigin
        };
        if self.settle(host, context, &paused.pending, now, source) == Verdict::Continue {
            host.resume();
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
        for context in expired {
            let Some(mut paused) = self.paused.remove(&context) else {
                continue;
            };
            let groups: Vec<usize> = paused.pending.calls().map(|(g, _)| g).collect();
            for g in groups {
                self.resolve(host, &mut paused, g, None, now);
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
        for shared in [false, true] {
            let slot = if shared {
                &mut self.replay_shared
            } else {
                &mut self.replay
            };
            if slot.as_ref().is_some_and(|r| r.deadline_ms <= now) {
                *slot = None; // lost: its counts go with the next batch
                self.metrics.add(host, Metric::ReplayFailures, 1);
            }
        }
        if now < self.next_replay_ms {
            return;
        }
        self.next_replay_ms = now.saturating_add(self.config.replay_interval_ms);
        if self.replay.is_none() {
            let batch = self.table.take_replay(1_000, now);
            self.send_replay(host, batch, false, now);
        }
        if self.replay_shared.is_none() && self.slots.is_some() && self.replay_lease(host, now) {
            let batch = self.take_shared_replay(host, now);
            self.send_replay(host, batch, true, now);
        }
    }

    /// Whether this VM replays the shared slots now: it holds the lease in shared data, or
    /// takes it (free, expired, or its own), for three replay intervals.
    fn replay_lease(&self, host: &impl Host, now: u64) -> bool {
        let (bytes, cas) = host.shared_get(REPLAY_KEY);
        let text = bytes
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default();
        let me = format!("{:016x}", self.vm_tag);
        let free = match text.split_once(':') {
            Some((holder, until)) => {
                holder == me || until.parse::<u64>().map_or(true, |u| u <= now)
            }
            None => true,
        };
        let until = now.saturating_add(self.config.replay_interval_ms.saturating_mul(3));
        free && host
            .shared_set(REPLAY_KEY, format!("{me}:{until}").as_bytes(), cas)
            .is_ok()
    }

    /// The shared slots' replay events (each slot's state written back, as taking them may
    /// release an idle lease; a slot written meanwhile by another VM waits for the next pass).
    fn take_shared_replay(&self, host: &impl Host, now: u64) -> ReplayBatch {
        let mut events: Vec<ReplayEvent> = Vec::new();
        let Some((slots, _)) = &self.slots else {
            return ReplayBatch { events };
        };
        for (slot, bytes, cas) in slots.scan(host) {
            if events.len() >= 1_000 {
                break;
            }
            let Some((entry, mut state)) = decode_entry(&bytes) else {
                continue;
            };
            let Some(key) = WindowDuration::from_ms(entry.duration_ms)
                .ok()
                .and_then(|d| {
                    WindowKeyRef::new(WORKSPACE, entry.namespace, entry.identifier, d).ok()
                })
                .map(|k| k.to_owned_key())
            else {
                continue;
            };
            let before = events.len();
            let before_state = state;
            if !state.take_replay_events(&key, now, 0, &mut events) || state == before_state {
                continue;
            }
            let bytes = strata_core::snapshot::encode_entry(entry, &state);
            if host.shared_set(&slot, &bytes, cas).is_err() {
                events.truncate(before); // another VM wrote it: next pass
            }
        }
        ReplayBatch { events }
    }

    fn send_replay(&mut self, host: &impl Host, batch: ReplayBatch, shared: bool, now: u64) {
        if batch.is_empty() {
            return;
        }
        let Ok(body) = serde_json::to_vec(&batch.to_wire(self.instance(shared))) else {
            return;
        };
        let headers = self.call_headers("/v1/origin/replay");
        let timeout = Duration::from_millis(self.config.timeout_ms.max(1_000));
        match host.dispatch(&self.config.cluster, headers, &body, timeout) {
            Ok(token) => {
                let replay = Replay {
                    token,
                    batch,
                    deadline_ms: now
                        .saturating_add(timeout.as_millis().try_into().unwrap_or(u64::MAX)),
                };
                if shared {
                    self.replay_shared = Some(replay);
                } else {
                    self.replay = Some(replay);
                }
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

    fn on_replay_answer(
        &mut self,
        host: &impl Host,
        shared: bool,
        status: u16,
        body: &[u8],
        now: u64,
    ) {
        let taken = if shared {
            self.replay_shared.take()
        } else {
            self.replay.take()
        };
        let Some(replay) = taken else {
            return;
        };
        let Some(response) = CellsResponse::from_answer(status, body, replay.batch.len()) else {
            self.metrics.add(host, Metric::ReplayFailures, 1);
            host.log(
                true,
                &format!("strata: the gateway refused a replay ({status}); the next one carries the counts"),
            );
            return;
        };
        self.metrics.add(host, Metric::Replays, 1);
        if !shared {
            self.table.ack_replay(&replay.batch, &response.cells);
            return;
        }
        let Some((slots, _)) = &self.slots else {
            return;
        };
        for (event, counts) in replay.batch.events.iter().zip(&response.cells) {
            for _ in 0..CAS_TRIES {
                let Some(mut loaded) = slots.load(host, event.key.as_ref(), now) else {
                    break;
                };
                loaded
                    .state
                    .apply_replay(event.sequence, *counts, event.used);
                match Slots::store(host, &loaded, event.key.as_ref()) {
                    Err(SetError::CasMismatch) => continue,
                    _ => break,
                }
            }
        }
    }
}
