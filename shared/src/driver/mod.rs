//! The request path as a state machine without I/O, in the shape of quinn-proto's
//! connection. [`Flow`] moves groups of limits past the gateway (every shell's, the native
//! gateway's included); [`Driver`] is a Wasm shell's whole request path over it: the shell hands the [`Driver`] events with the current time (a request, a
//! gateway answer or failure for a call, its timer firing) and polls it for what to do (the
//! decisions ready, the calls to send with their timeout, when to wake it next). The driver
//! never reads a clock, sleeps or does I/O, and the window keys' states stay where the shell
//! keeps them, behind [`Store`].
//!
//! ```text
//! shell                          driver                               store
//! request(id, view, now) ──────► rules → limits → begin ────────────► Begin per group
//!   ◄── Started::Decided(reply)   (local memory decided it)
//!   ◄── Started::Waiting          (a call to send, or one in flight to wait for)
//! poll_transmit() ◄──────────── Transmit { call, path, body, timeout_ms }
//! answer(call, status, body) ──► finish / fail; waiters begin again ─► finish, fail, begin
//! poll_decision() ◄───────────── Decided { request, reply, by }
//! timeout(now) at poll_timeout() ► calls past their deadline fail; replay passes are sent
//! ```
//!
//! What the flow owns, once for every shell:
//! - **Coalescing.** A request one of whose limits has a decision call in flight does not
//!   send its own: it waits for that call, and for no longer than that call's deadline, then
//!   begins again (the answer usually brings a lease that decides it from memory; a failure
//!   leaves the cells in their retry delay, where the failure mode decides without a call).
//! - **Deadlines.** A request is answered by its arrival plus the timeout however many calls
//!   it waits on: a call made for it carries what is left of its time, and a call past its
//!   deadline fails on the next [`Flow::timeout`] (or when the shell's own bound on the call
//!   says so, through [`Flow::failed`]).
//! - **The failure modes**, as [`FailureMode`](crate::policy::FailureMode) defines them, through
//!   the store's `fail` and the cells' retry delay.
//! - **Replay.** Accepted cost gathers for the replay interval, then goes in batches of
//!   [`wire::MAX_BATCH`] cells; a failed batch is sent again after a backoff (doubling, at most
//!   [`MAX_REPLAY_BACKOFF_MS`]) on the driver's own deadline, whether or not requests come; a
//!   home others write to too is passed over every interval ([`Store::periodic`]), and what a
//!   pass takes from it is the store's to choose (the Envoy filter's: the slots this VM wrote,
//!   and a share of the rest).

mod flow;
mod store;

use alloc::collections::{BTreeMap, VecDeque};
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

pub use flow::{
    CallKind, DecidedBy, Dispatch, Flow, FlowConfig, FlowStats, GroupDone, GroupId, LOG_EVERY_MS,
    Log, MAX_REPLAY_BACKOFF_MS, MIN_REPLAY_TIMEOUT_MS, Outgoing, Quiet, replay_backoff,
    replay_timeout_ms,
};
pub use store::{Home, Replays, Store, TableStore, refused};

use crate::decision::{Decision, MultiDecision};
use crate::gate::{ENFORCED, Gate, Pending, Reply, SHADOW, Subject};
use crate::policy::Reason;
use crate::rules::{RequestError, RequestView};
use crate::wire::{CellsResponse, DecideResponse};

/// Where the gateway decides.
pub const DECIDE_PATH: &str = "/v1/origin/decide";
/// Where accepted cost is replayed.
pub const REPLAY_PATH: &str = "/v1/origin/replay";

impl Dispatch {
    /// Where the call goes: [`DECIDE_PATH`] or [`REPLAY_PATH`].
    pub fn path(&self) -> &'static str {
        match self.outgoing {
            Outgoing::Decide(_) => DECIDE_PATH,
            Outgoing::Replay(_) => REPLAY_PATH,
        }
    }

    /// The call as the gateway's HTTP API takes it, made under `instance`.
    pub fn to_json(&self, instance: &str) -> Result<String, serde_json::Error> {
        match &self.outgoing {
            Outgoing::Decide(call) => serde_json::to_string(&call.to_wire(instance)),
            Outgoing::Replay(batch) => serde_json::to_string(&batch.to_wire(instance)),
        }
    }
}

/// The driver's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverConfig {
    /// The longest a request waits for the gateway, from its arrival.
    pub timeout_ms: u64,
    /// How long accepted cost gathers before a replay.
    pub replay_interval_ms: u64,
    /// Where the shell counts requests a `remote_address` rule left out (for the warning).
    pub unaddressed_counter: String,
}

impl DriverConfig {
    /// How long a replay batch may take: the timeout, and at least
    /// [`MIN_REPLAY_TIMEOUT_MS`] (a batch is bigger than a decision, and nothing waits on it).
    pub fn replay_timeout_ms(&self) -> u64 {
        self.flow().replay_timeout_ms()
    }

    fn flow(&self) -> FlowConfig {
        FlowConfig {
            timeout_ms: self.timeout_ms,
            replay_interval_ms: self.replay_interval_ms,
            replay_batch: crate::wire::MAX_BATCH,
        }
    }
}

/// A call for the shell to send: `POST path` with `body`, given up after `timeout_ms`; its
/// answer goes to [`Driver::answer`] and a failure to [`Driver::fail`] with `call`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    /// The call's id.
    pub call: u64,
    /// [`DECIDE_PATH`] or [`REPLAY_PATH`].
    pub path: &'static str,
    /// The JSON body.
    pub body: String,
    /// How long the call may take, from `at_ms`.
    pub timeout_ms: u64,
    /// When the driver asked for it.
    pub at_ms: u64,
}

/// A decided request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decided {
    /// The shell's id for it.
    pub request: u64,
    /// What to answer.
    pub reply: Reply,
    /// Which path decided it.
    pub by: DecidedBy,
    /// The first enforced limit's decision (a binding's answer).
    pub first: Option<Decision>,
    /// Whether any limit applied to it.
    pub limited: bool,
}

/// What [`Driver::request`] answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Started {
    /// Decided now.
    Decided(Decided),
    /// Waiting for the gateway: its decision comes out of [`Driver::poll_decision`].
    Waiting,
}

/// What the driver did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// Requests that came in (a refused one too).
    pub requests: u64,
    /// Requests some limit applied to, by the path that decided them.
    pub decided_local: u64,
    /// See `decided_local`.
    pub decided_origin: u64,
    /// See `decided_local`.
    pub decided_fallback: u64,
    /// See `decided_local`: passed ahead of the gateway's answer.
    pub decided_ahead: u64,
    /// Requests every enforced limit passed.
    pub ok: u64,
    /// Requests denied.
    pub enforced: u64,
    /// Requests a shadow limit would have denied.
    pub shadow: u64,
    /// Decision calls sent.
    pub origin_calls: u64,
    /// Decision calls sent, by why their first limit needed the gateway ([`Reason::index`]).
    pub origin_reasons: [u64; Reason::ALL.len()],
    /// Decision calls that failed (refused, error status, nonsense, timeout).
    pub origin_failures: u64,
    /// Request groups that waited for another request's call instead of sending one.
    pub coalesced: u64,
    /// Replay batches the gateway took.
    pub replays: u64,
    /// Replay batches that failed.
    pub replay_failures: u64,
    /// Requests a `remote_address` rule left out for want of a trusted client address.
    pub unaddressed: u64,
}

impl DriverStats {
    /// Decision calls sent for `reason`.
    pub fn origin_reason(&self, reason: Reason) -> u64 {
        self.origin_reasons
            .get(reason.index())
            .copied()
            .unwrap_or(0)
    }
}

/// A request group's progress.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Group {
    Empty,
    Decided(MultiDecision),
    Waiting,
}

/// A request not decided yet.
#[derive(Debug)]
struct Request {
    subjects: Vec<Subject>,
    groups: [Group; 2],
    failed: bool,
    answered: bool,
    ahead: bool,
    unaddressed: bool,
}

impl Request {
    fn is_done(&self) -> bool {
        !self.groups.iter().any(|g| matches!(g, Group::Waiting))
    }

    /// Group `g` is decided, by `by`.
    fn decide(&mut self, g: usize, decision: MultiDecision, by: DecidedBy) {
        self.failed |= by == DecidedBy::Fallback;
        self.answered |= by == DecidedBy::Origin;
        self.ahead |= by == DecidedBy::Ahead;
        if let Some(slot) = self.groups.get_mut(g) {
            *slot = Group::Decided(decision);
        }
    }
}

/// A Wasm shell's request path: rules, then its groups through the [`Flow`], then the reply.
#[derive(Debug)]
pub struct Driver {
    gate: Gate,
    config: DriverConfig,
    flow: Flow,
    requests: BTreeMap<u64, Request>,
    transmits: VecDeque<Transmit>,
    decided: VecDeque<Decided>,
    logs: VecDeque<Log>,
    stats: DriverStats,
}

impl Driver {
    /// A driver for `gate`'s rules.
    pub fn new(gate: Gate, config: DriverConfig) -> Self {
        Self {
            gate,
            flow: Flow::new(config.flow()),
            config,
            requests: BTreeMap::new(),
            transmits: VecDeque::new(),
            decided: VecDeque::new(),
            logs: VecDeque::new(),
            stats: DriverStats::default(),
        }
    }

    /// The rules and options.
    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    /// The settings.
    pub fn config(&self) -> &DriverConfig {
        &self.config
    }

    /// What happened so far.
    pub fn stats(&self) -> DriverStats {
        let f = self.flow.stats();
        DriverStats {
            origin_calls: f.origin_calls,
            origin_reasons: f.origin_reasons,
            origin_failures: f.origin_failures,
            coalesced: f.coalesced,
            replays: f.replays,
            replay_failures: f.replay_failures,
            ..self.stats
        }
    }

    /// Requests waiting for the gateway.
    pub fn waiting(&self) -> usize {
        self.requests.len()
    }

    /// A request arrives; `id` is the shell's name for it (unique among those waiting). A
    /// request the rules cannot be applied to (a cost out of bounds) is a client error.
    pub fn request<S: Store>(
        &mut self,
        store: &mut S,
        id: u64,
        view: &impl RequestView,
        now_ms: u64,
    ) -> Result<Started, RequestError> {
        self.stats.requests += 1;
        let subjects = self.gate.subjects(view)?;
        self.start(store, id, subjects.limits, subjects.unaddressed, now_ms)
    }

    /// A request of the given limits (a binding's key), as [`request`](Self::request).
    pub fn request_limits<S: Store>(
        &mut self,
        store: &mut S,
        id: u64,
        subjects: Vec<Subject>,
        now_ms: u64,
    ) -> Result<Started, RequestError> {
        self.stats.requests += 1;
        self.start(store, id, subjects, false, now_ms)
    }

    fn start<S: Store>(
        &mut self,
        store: &mut S,
        id: u64,
        subjects: Vec<Subject>,
        unaddressed: bool,
        now_ms: u64,
    ) -> Result<Started, RequestError> {
        // Every key is checked before anything is counted: a refused request counts nowhere.
        self.gate.check_keys(&subjects)?;
        if unaddressed {
            if self.stats.unaddressed == 0 {
                let source = self.gate.rules().client_address();
                self.logs.push_back(Log {
                    warn: true,
                    message: source.unaddressed_notice(&self.config.unaddressed_counter),
                });
            }
            self.stats.unaddressed += 1;
        }
        let mut request = Request {
            subjects,
            groups: [Group::Empty, Group::Empty],
            failed: false,
            answered: false,
            ahead: false,
            unaddressed,
        };
        let deadline = now_ms.saturating_add(self.config.timeout_ms);
        for g in [ENFORCED, SHADOW] {
            let Ok(limits) = self.gate.group_limits(&request.subjects, g == SHADOW) else {
                continue; // checked above
            };
            if limits.is_empty() {
                continue;
            }
            match self.flow.begin(store, (id, g), &limits, deadline, now_ms) {
                Some((decision, by)) => request.decide(g, decision, by),
                None => {
                    if let Some(slot) = request.groups.get_mut(g) {
                        *slot = Group::Waiting;
                    }
                }
            }
        }
        if request.is_done() {
            return Ok(Started::Decided(self.settle(id, request, now_ms)));
        }
        self.requests.insert(id, request);
        self.collect(store, now_ms);
        Ok(Started::Waiting)
    }

    /// Moves what the flow put out to the shell's queues: its calls as JSON (one that cannot
    /// be written fails at once), its decided groups into their requests, its log lines.
    fn collect<S: Store>(&mut self, store: &mut S, now_ms: u64) {
        loop {
            while let Some(d) = self.flow.poll_dispatch() {
                match d.to_json(store.instance(d.home)) {
                    Ok(body) => self.transmits.push_back(Transmit {
                        call: d.call,
                        path: d.path(),
                        body,
                        timeout_ms: d.timeout_ms,
                        at_ms: d.at_ms,
                    }),
                    Err(e) => self.flow.failed(store, d.call, &e.to_string(), now_ms),
                }
            }
            let Some(done) = self.flow.poll_done() else {
                break;
            };
            let (id, g) = done.group;
            let Some(request) = self.requests.get_mut(&id) else {
                continue; // cancelled
            };
            request.decide(g, done.decision, done.by);
            if request.is_done()
                && let Some(request) = self.requests.remove(&id)
            {
                let decided = self.settle(id, request, now_ms);
                self.decided.push_back(decided);
            }
        }
        self.logs
            .extend(core::iter::from_fn(|| self.flow.poll_log()));
    }

    /// The reply of a request whose every group is decided.
    fn settle(&mut self, id: u64, request: Request, now_ms: u64) -> Decided {
        let [enforced, shadow] = request.groups;
        let decision = |g: Group| match g {
            Group::Decided(d) => Some(d),
            _ => None,
        };
        let first = match &enforced {
            Group::Decided(d) => d.decisions.first().copied(),
            _ => None,
        };
        let pending = Pending::settled(
            request.subjects,
            [decision(enforced), decision(shadow)],
            request.failed,
            request.unaddressed,
        );
        let reply = pending.reply(self.gate.options(), now_ms);
        let by = if request.failed {
            DecidedBy::Fallback
        } else if request.answered {
            DecidedBy::Origin
        } else if request.ahead {
            DecidedBy::Ahead
        } else {
            DecidedBy::Local
        };
        let limited = !pending.subjects().is_empty();
        let s = &mut self.stats;
        if limited {
            match by {
                DecidedBy::Local => s.decided_local += 1,
                DecidedBy::Origin => s.decided_origin += 1,
                DecidedBy::Fallback => s.decided_fallback += 1,
                DecidedBy::Ahead => s.decided_ahead += 1,
            }
        }
        if reply.allowed {
            s.ok += 1;
        } else {
            s.enforced += 1;
        }
        if !reply.shadow_denied.is_empty() {
            s.shadow += 1;
            self.logs.push_back(Log {
                warn: false,
                message: format!("shadow rule would deny: {}", reply.shadow_denied.join(",")),
            });
        }
        Decided {
            request: id,
            reply,
            by,
            first,
            limited,
        }
    }

    /// The gateway answered call `call` with `status` and `body`. Anything but a `200`
    /// whose body fits the call is a failure.
    pub fn answer<S: Replays>(
        &mut self,
        store: &mut S,
        call: u64,
        status: u16,
        body: &[u8],
        now_ms: u64,
    ) {
        match self.flow.call_kind(call) {
            Some(CallKind::Decide) => {
                let response = DecideResponse::from_answer(status, body);
                let why = || match response {
                    Some(_) => "an answer that does not fit the call".to_string(),
                    None => status_text(status, body),
                };
                self.flow
                    .decided(store, call, response.as_ref(), why, now_ms);
            }
            Some(CallKind::Replay) => {
                let cells = self.flow.replay_len(call).unwrap_or(0);
                match CellsResponse::from_answer(status, body, cells) {
                    Some(r) => self.flow.replayed(store, call, &r, now_ms),
                    None => self
                        .flow
                        .failed(store, call, &status_text(status, body), now_ms),
                }
            }
            None => {} // past its deadline: failed already
        }
        self.collect(store, now_ms);
    }

    /// Call `call` failed without an answer (`why`: the transport's words).
    pub fn fail<S: Store>(&mut self, store: &mut S, call: u64, why: &str, now_ms: u64) {
        self.flow.failed(store, call, why, now_ms);
        self.collect(store, now_ms);
    }

    /// The shell's timer fired (or any time after [`poll_timeout`](Self::poll_timeout)):
    /// calls past their deadline fail, replay passes due are sent.
    pub fn timeout<S: Replays>(&mut self, store: &mut S, now_ms: u64) {
        self.flow.timeout(store, now_ms);
        self.collect(store, now_ms);
    }

    /// The request `id` is gone (its client hung up): its decision is not wanted. A call it
    /// made still settles the requests that joined it.
    pub fn cancel(&mut self, id: u64) {
        self.requests.remove(&id);
        for g in [ENFORCED, SHADOW] {
            self.flow.cancel((id, g));
        }
    }

    /// Whether a decision, a call or a log line waits to be polled.
    pub fn has_output(&self) -> bool {
        !(self.decided.is_empty() && self.transmits.is_empty() && self.logs.is_empty())
    }

    /// A decision ready, of a request that waited.
    pub fn poll_decision(&mut self) -> Option<Decided> {
        self.decided.pop_front()
    }

    /// A call to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// A line to log.
    pub fn poll_log(&mut self) -> Option<Log> {
        self.logs.pop_front()
    }

    /// When to call [`timeout`](Self::timeout) next, if anything waits for time.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.flow.poll_timeout()
    }
}

/// A failed answer in a few words: its status, and the start of its body.
fn status_text(status: u16, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body.get(..body.len().min(120)).unwrap_or_default());
    format!("status {status}: {}", text.trim())
}
