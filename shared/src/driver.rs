//! A Wasm shell's request path as a state machine without I/O, in the shape of quinn-proto's
//! connection: the shell hands the [`Driver`] events with the current time (a request, a
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
//! What it owns, once for every shell:
//! - **Coalescing.** A request one of whose limits has a decision call in flight does not
//!   send its own: it waits for that call, and for no longer than that call's deadline, then
//!   begins again (the answer usually brings a lease that decides it from memory; a failure
//!   leaves the cells in their retry delay, where the failure mode decides without a call).
//! - **Deadlines.** A request is answered by its arrival plus the timeout however many calls
//!   it waits on: a call made for it carries what is left of its time, and a call past its
//!   deadline fails on the next [`Driver::timeout`].
//! - **The failure modes**, as [`FailureMode`](crate::policy::FailureMode) defines them, through
//!   the store's `fail` and the cells' retry delay.
//! - **Replay.** Accepted cost gathers for the replay interval, then goes in batches of
//!   [`wire::MAX_BATCH`] cells; a failed batch is sent again after a backoff (doubling, at most
//!   [`MAX_REPLAY_BACKOFF_MS`]) on the driver's own deadline, whether or not requests come; a
//!   home others write to too is passed over every interval ([`Store::periodic`]), and what a
//!   pass takes from it is the store's to choose (the Envoy filter's: the slots this VM wrote,
//!   and a share of the rest).

use alloc::collections::{BTreeMap, VecDeque};
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::hash::BuildHasher;

use foldhash::quality::FixedState;

use crate::decision::{Counts, Decision, MultiDecision};
use crate::gate::{ENFORCED, Gate, Pending, Reply, SHADOW, Subject};
use crate::limit::LimitRequest;
use crate::origin::OriginAnswer;
use crate::replay::ReplayBatch;
use crate::request::{Begin, OriginCall};
use crate::rules::{RequestError, RequestView};
use crate::table::{CounterTable, TooManyLimits};
use crate::wire::{self, CellsResponse, DecideResponse};

/// Where the gateway decides.
pub const DECIDE_PATH: &str = "/v1/origin/decide";
/// Where accepted cost is replayed.
pub const REPLAY_PATH: &str = "/v1/origin/replay";
/// The longest wait before a failed replay is sent again.
pub const MAX_REPLAY_BACKOFF_MS: u64 = 5_000;
/// The shortest bound on a replay call: a batch of a thousand cells may take a while.
pub const MIN_REPLAY_TIMEOUT_MS: u64 = 1_000;
/// A warning that repeats (the gateway failing every call) is logged at most this often,
/// with the number of the ones left out.
pub const LOG_EVERY_MS: u64 = 10_000;

/// One place a store keeps states, with its own instance id at the gateway and its own
/// replay: a process's table, or the slots an Envoy's VMs share.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Home(pub u8);

/// The window keys' states, held where the shell holds them. Each method is one step of the
/// core's request path (`crate::request`) run on the states of a group of limits.
pub trait Store {
    /// Begins one group of a request's limits, on states the store chooses (and says where).
    fn begin(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<(Begin, Home), TooManyLimits>;
    /// Merges the gateway's answers to `call`, begun in `home`.
    fn finish(
        &mut self,
        home: Home,
        call: &OriginCall,
        answers: &[OriginAnswer],
        now_ms: u64,
    ) -> MultiDecision;
    /// `call` got no answer: recorded on its cells, and decided per the failure mode.
    fn fail(&mut self, home: Home, call: &OriginCall, now_ms: u64) -> MultiDecision;
    /// The instance id calls for `home` are made under.
    fn instance(&self, home: Home) -> &str;
    /// How many homes there are (`Home(0)` to `Home(n - 1)`).
    fn homes(&self) -> u8 {
        1
    }
    /// Up to `max` cells of `home` holding cost the gateway has not acknowledged, from
    /// position `from` of a pass; where the pass goes on (`None`: done).
    fn take_replay(
        &mut self,
        home: Home,
        max: usize,
        now_ms: u64,
        from: usize,
    ) -> (ReplayBatch, Option<usize>);
    /// The gateway took `batch`: `counts[i]` is event `i`'s cell after it.
    fn ack_replay(&mut self, home: Home, batch: &ReplayBatch, counts: &[Counts], now_ms: u64);
    /// Whether `home` is replayed every interval, whether or not this process's own
    /// requests used it (a home others write to).
    fn periodic(&self, _home: Home) -> bool {
        false
    }
}

/// A process's own table as the one home: the edge's store.
#[derive(Debug)]
pub struct TableStore {
    /// The table.
    pub table: CounterTable,
    /// The instance id the gateway knows this process by.
    pub instance: String,
}

impl Store for TableStore {
    fn begin(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<(Begin, Home), TooManyLimits> {
        Ok((self.table.begin(limits, now_ms)?, Home(0)))
    }
    fn finish(
        &mut self,
        _: Home,
        call: &OriginCall,
        answers: &[OriginAnswer],
        now_ms: u64,
    ) -> MultiDecision {
        self.table
            .finish(call, answers, now_ms)
            .unwrap_or_else(|_| refused(call))
    }
    fn fail(&mut self, _: Home, call: &OriginCall, now_ms: u64) -> MultiDecision {
        self.table
            .fail(call, now_ms)
            .unwrap_or_else(|_| refused(call))
    }
    fn instance(&self, _: Home) -> &str {
        &self.instance
    }
    fn take_replay(
        &mut self,
        _: Home,
        max: usize,
        now_ms: u64,
        from: usize,
    ) -> (ReplayBatch, Option<usize>) {
        self.table.take_replay_from(max, now_ms, None, from)
    }
    fn ack_replay(&mut self, _: Home, batch: &ReplayBatch, counts: &[Counts], _: u64) {
        self.table.ack_replay(batch, counts);
    }
}

/// The denial of a call whose limits no longer fit the table (only a call larger than the
/// table, which `begin` refuses first).
pub fn refused(call: &OriginCall) -> MultiDecision {
    MultiDecision {
        success: false,
        decisions: call
            .limits()
            .iter()
            .map(|l| Decision {
                success: false,
                limit: l.limit,
                remaining: 0,
                reset_ms: 0,
                retry_after_ms: Some(1_000),
            })
            .collect(),
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
        self.timeout_ms.max(MIN_REPLAY_TIMEOUT_MS)
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

/// Which path decided a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecidedBy {
    /// Local memory: a lease, a local denial, or no limit at all.
    Local,
    /// The gateway's answer.
    Origin,
    /// The failure mode: a call failed or timed out, or one did moments ago.
    Fallback,
}

impl DecidedBy {
    /// Its name in stats and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            DecidedBy::Local => "local",
            DecidedBy::Origin => "origin",
            DecidedBy::Fallback => "fallback",
        }
    }
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

/// A line for the shell's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Log {
    /// A warning (else information).
    pub warn: bool,
    /// The line.
    pub message: String,
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
    /// Requests every enforced limit passed.
    pub ok: u64,
    /// Requests denied.
    pub enforced: u64,
    /// Requests a shadow limit would have denied.
    pub shadow: u64,
    /// Decision calls sent.
    pub origin_calls: u64,
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

/// A request group's progress.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Group {
    Empty,
    Decided(MultiDecision),
    /// Waiting for call `id`: its own, or one it joined.
    Waiting(u64),
}

/// A request not decided yet.
#[derive(Debug)]
struct Request {
    subjects: Vec<Subject>,
    deadline: u64,
    groups: [Group; 2],
    failed: bool,
    answered: bool,
    unaddressed: bool,
}

impl Request {
    fn is_done(&self) -> bool {
        !self.groups.iter().any(|g| matches!(g, Group::Waiting(_)))
    }
}

/// A call in flight.
#[derive(Debug)]
enum Call {
    Decide {
        call: OriginCall,
        home: Home,
        deadline: u64,
        /// `(request, group, made it)`: the request that made it, then those that joined.
        waiters: Vec<(u64, usize, bool)>,
    },
    Replay {
        home: Home,
        batch: ReplayBatch,
        next: Option<usize>,
        deadline: u64,
    },
}

impl Call {
    fn deadline(&self) -> u64 {
        match self {
            Call::Decide { deadline, .. } | Call::Replay { deadline, .. } => *deadline,
        }
    }
}

/// One home's replay.
#[derive(Clone, Copy, Debug, Default)]
struct Lane {
    /// When the next pass is due.
    next_at: Option<u64>,
    /// The batch in flight.
    in_flight: Option<u64>,
    /// Failed passes in a row.
    failures: u32,
    /// Whether cost was accepted since the last pass began.
    wanted: bool,
}

/// A warning that may repeat: logged once per [`LOG_EVERY_MS`].
#[derive(Clone, Copy, Debug, Default)]
struct Quiet {
    next_at: u64,
    left_out: u64,
}

impl Quiet {
    fn line(&mut self, now_ms: u64, message: String) -> Option<Log> {
        if now_ms < self.next_at {
            self.left_out += 1;
            return None;
        }
        self.next_at = now_ms.saturating_add(LOG_EVERY_MS);
        let left_out = core::mem::take(&mut self.left_out);
        let message = if left_out > 0 {
            format!("{message} ({left_out} more like it since the last line)")
        } else {
            message
        };
        Some(Log {
            warn: true,
            message,
        })
    }
}

/// A shell's request path: rules, calls in flight, requests waiting, replay.
#[derive(Debug)]
pub struct Driver {
    gate: Gate,
    config: DriverConfig,
    requests: BTreeMap<u64, Request>,
    calls: BTreeMap<u64, Call>,
    /// Decision calls in flight by the hash of each of their window keys.
    in_flight: BTreeMap<u64, u64>,
    hasher: FixedState,
    next_call: u64,
    lanes: Vec<Lane>,
    transmits: VecDeque<Transmit>,
    decided: VecDeque<Decided>,
    logs: VecDeque<Log>,
    call_failures: Quiet,
    replay_failures: Quiet,
    stats: DriverStats,
}

impl Driver {
    /// A driver for `gate`'s rules.
    pub fn new(gate: Gate, config: DriverConfig) -> Self {
        Self {
            gate,
            config,
            requests: BTreeMap::new(),
            calls: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            hasher: FixedState::default(),
            next_call: 0,
            lanes: Vec::new(),
            transmits: VecDeque::new(),
            decided: VecDeque::new(),
            logs: VecDeque::new(),
            call_failures: Quiet::default(),
            replay_failures: Quiet::default(),
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
        self.stats
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
            deadline: now_ms.saturating_add(self.config.timeout_ms),
            groups: [Group::Empty, Group::Empty],
            failed: false,
            answered: false,
            unaddressed,
        };
        for g in [ENFORCED, SHADOW] {
            self.step(store, id, &mut request, g, now_ms);
        }
        if request.is_done() {
            return Ok(Started::Decided(self.settle(id, request, now_ms)));
        }
        self.requests.insert(id, request);
        Ok(Started::Waiting)
    }

    /// Begins group `g` of `request`: joins a call in flight on one of its keys, or begins
    /// it on the store and sends the call that may need.
    fn step<S: Store>(
        &mut self,
        store: &mut S,
        id: u64,
        request: &mut Request,
        g: usize,
        now_ms: u64,
    ) {
        let Ok(limits) = self.gate.group_limits(&request.subjects, g == SHADOW) else {
            return; // checked when the request came
        };
        if limits.is_empty() {
            return;
        }
        if let Some(call_id) = self.joinable(&limits)
            && let Some(Call::Decide {
                deadline, waiters, ..
            }) = self.calls.get_mut(&call_id)
        {
            waiters.push((id, g, false));
            request.deadline = request.deadline.min(*deadline);
            set(&mut request.groups, g, Group::Waiting(call_id));
            self.stats.coalesced += 1;
            return;
        }
        let (begun, home) = match store.begin(&limits, now_ms) {
            Ok(b) => b,
            Err(_) => {
                // Only a request of more limits than the table holds: denied, counted nowhere.
                let decided = MultiDecision {
                    success: false,
                    decisions: Vec::new(),
                };
                set(&mut request.groups, g, Group::Decided(decided));
                return;
            }
        };
        let call = match begun {
            Begin::Call(call) => call,
            Begin::Decided(d) => {
                self.want_replay(home, now_ms);
                return set(&mut request.groups, g, Group::Decided(d));
            }
            Begin::Fallback(d) => {
                self.want_replay(home, now_ms);
                request.failed = true;
                return set(&mut request.groups, g, Group::Decided(d));
            }
        };
        let body = serde_json::to_string(&call.to_wire(store.instance(home)));
        let (Ok(body), true) = (body, now_ms < request.deadline) else {
            // No time left for a call (a request that waited out its time on another's):
            // failed as a call that got no answer.
            request.failed = true;
            let decided = store.fail(home, &call, now_ms);
            self.want_replay(home, now_ms);
            return set(&mut request.groups, g, Group::Decided(decided));
        };
        let call_id = self.call_id();
        for l in call.limits() {
            let hash = self.hasher.hash_one(l.key.as_ref());
            self.in_flight.insert(hash, call_id);
        }
        self.transmits.push_back(Transmit {
            call: call_id,
            path: DECIDE_PATH,
            body,
            timeout_ms: request.deadline.saturating_sub(now_ms),
            at_ms: now_ms,
        });
        self.calls.insert(
            call_id,
            Call::Decide {
                call,
                home,
                deadline: request.deadline,
                waiters: alloc::vec![(id, g, true)],
            },
        );
        self.stats.origin_calls += 1;
        set(&mut request.groups, g, Group::Waiting(call_id));
    }

    /// A decision call in flight on one of `limits`' keys.
    fn joinable(&self, limits: &[LimitRequest<'_>]) -> Option<u64> {
        if self.in_flight.is_empty() {
            return None;
        }
        limits.iter().find_map(|l| {
            self.in_flight
                .get(&self.hasher.hash_one(l.key))
                .copied()
                .filter(|c| self.calls.contains_key(c))
        })
    }

    fn call_id(&mut self) -> u64 {
        self.next_call = self.next_call.wrapping_add(1);
        self.next_call
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
    pub fn answer<S: Store>(
        &mut self,
        store: &mut S,
        call: u64,
        status: u16,
        body: &[u8],
        now_ms: u64,
    ) {
        match self.calls.get(&call) {
            Some(Call::Decide { .. }) => {
                let response = DecideResponse::from_answer(status, body);
                let why = || match response {
                    Some(_) => "an answer that does not fit the call".to_string(),
                    None => status_text(status, body),
                };
                self.settle_call(store, call, response.as_ref(), why, now_ms);
            }
            Some(Call::Replay { batch, .. }) => {
                match CellsResponse::from_answer(status, body, batch.len()) {
                    Some(r) => self.replayed(store, call, &r.cells, now_ms),
                    None => self.replay_failed(call, &status_text(status, body), now_ms),
                }
            }
            None => {} // past its deadline: failed already
        }
    }

    /// Call `call` failed without an answer (`why`: the transport's words).
    pub fn fail<S: Store>(&mut self, store: &mut S, call: u64, why: &str, now_ms: u64) {
        match self.calls.get(&call) {
            Some(Call::Decide { .. }) => {
                self.settle_call(store, call, None, || why.to_string(), now_ms);
            }
            Some(Call::Replay { .. }) => self.replay_failed(call, why, now_ms),
            None => {}
        }
    }

    /// The shell's timer fired (or any time after [`poll_timeout`](Self::poll_timeout)):
    /// calls past their deadline fail, replay passes due are sent.
    pub fn timeout<S: Store>(&mut self, store: &mut S, now_ms: u64) {
        let expired: Vec<(u64, bool)> = self
            .calls
            .iter()
            .filter(|(_, c)| c.deadline() <= now_ms)
            .map(|(id, c)| (*id, matches!(c, Call::Decide { .. })))
            .collect();
        for (id, decide) in expired {
            let why = "no answer within the timeout";
            if decide {
                self.settle_call(store, id, None, || why.to_string(), now_ms);
            } else {
                self.replay_failed(id, why, now_ms);
            }
        }
        self.replay_due(store, now_ms);
    }

    /// The request `id` is gone (its client hung up): its decision is not wanted. A call it
    /// made still settles the requests that joined it.
    pub fn cancel(&mut self, id: u64) {
        self.requests.remove(&id);
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
        let calls = self.calls.values().map(Call::deadline);
        let lanes = self
            .lanes
            .iter()
            .filter(|l| l.in_flight.is_none())
            .filter_map(|l| l.next_at);
        calls.chain(lanes).min()
    }

    /// Call `id` is answered (`response`) or failed (`None`; `why` says how, for the log):
    /// its cells take the answer or the failure, the request that made it is decided, and
    /// those that joined it begin again.
    fn settle_call<S: Store>(
        &mut self,
        store: &mut S,
        id: u64,
        response: Option<&DecideResponse>,
        why: impl FnOnce() -> String,
        now_ms: u64,
    ) {
        let Some(Call::Decide {
            call,
            home,
            waiters,
            ..
        }) = self.calls.remove(&id)
        else {
            return;
        };
        for l in call.limits() {
            let hash = self.hasher.hash_one(l.key.as_ref());
            if self.in_flight.get(&hash) == Some(&id) {
                self.in_flight.remove(&hash);
            }
        }
        let answers = response.and_then(|r| call.answers(r).ok());
        let failed = answers.is_none();
        let decided = match &answers {
            Some(answers) => store.finish(home, &call, answers, now_ms),
            None => {
                self.stats.origin_failures += 1;
                let mode = self.gate.options().failure_mode.as_str();
                let line = format!(
                    "the gateway did not decide ({}); the failure mode ({mode}) decides",
                    why()
                );
                self.logs.extend(self.call_failures.line(now_ms, line));
                store.fail(home, &call, now_ms)
            }
        };
        self.want_replay(home, now_ms);
        for (rid, g, made) in waiters {
            let Some(mut request) = self.requests.remove(&rid) else {
                continue; // cancelled
            };
            if made {
                request.failed |= failed;
                request.answered |= !failed;
                set(&mut request.groups, g, Group::Decided(decided.clone()));
            } else {
                self.step(store, rid, &mut request, g, now_ms);
            }
            if request.is_done() {
                let decided = self.settle(rid, request, now_ms);
                self.decided.push_back(decided);
            } else {
                self.requests.insert(rid, request);
            }
        }
    }

    fn lane(&mut self, home: Home) -> &mut Lane {
        let i = usize::from(home.0);
        if self.lanes.len() <= i {
            self.lanes.resize(i + 1, Lane::default());
        }
        &mut self.lanes[i]
    }

    /// Cost may have been accepted in `home`: a replay pass is due within the interval.
    fn want_replay(&mut self, home: Home, now_ms: u64) {
        let interval = self.config.replay_interval_ms;
        let lane = self.lane(home);
        lane.wanted = true;
        if lane.next_at.is_none() && lane.in_flight.is_none() {
            lane.next_at = Some(now_ms.saturating_add(interval));
        }
    }

    fn replay_due<S: Store>(&mut self, store: &mut S, now_ms: u64) {
        let interval = self.config.replay_interval_ms;
        for h in 0..store.homes() {
            let home = Home(h);
            let periodic = store.periodic(home);
            let lane = self.lane(home);
            if lane.in_flight.is_some() {
                continue;
            }
            match lane.next_at {
                Some(at) if at <= now_ms => {}
                None if periodic => {
                    lane.next_at = Some(now_ms.saturating_add(interval));
                    continue;
                }
                _ => continue,
            }
            lane.next_at = None;
            lane.wanted = false;
            self.send_replay(store, home, 0, now_ms);
        }
    }

    /// Takes the next batch of a replay pass of `home` and sends it, or ends the pass.
    fn send_replay<S: Store>(&mut self, store: &mut S, home: Home, from: usize, now_ms: u64) {
        let (batch, next) = store.take_replay(home, wire::MAX_BATCH, now_ms, from);
        let body = serde_json::to_string(&batch.to_wire(store.instance(home)));
        let (false, Ok(body)) = (batch.is_empty(), body) else {
            return self.pass_done(store, home, now_ms);
        };
        let id = self.call_id();
        let timeout_ms = self.config.replay_timeout_ms();
        self.transmits.push_back(Transmit {
            call: id,
            path: REPLAY_PATH,
            body,
            timeout_ms,
            at_ms: now_ms,
        });
        self.calls.insert(
            id,
            Call::Replay {
                home,
                batch,
                next,
                deadline: now_ms.saturating_add(timeout_ms),
            },
        );
        self.lane(home).in_flight = Some(id);
    }

    fn pass_done<S: Store>(&mut self, store: &S, home: Home, now_ms: u64) {
        let interval = self.config.replay_interval_ms;
        let periodic = store.periodic(home);
        let lane = self.lane(home);
        lane.in_flight = None;
        lane.next_at = (lane.wanted || periodic).then(|| now_ms.saturating_add(interval));
    }

    fn replayed<S: Store>(&mut self, store: &mut S, id: u64, counts: &[Counts], now_ms: u64) {
        let Some(Call::Replay {
            home, batch, next, ..
        }) = self.calls.remove(&id)
        else {
            return;
        };
        store.ack_replay(home, &batch, counts, now_ms);
        self.stats.replays += 1;
        let lane = self.lane(home);
        lane.failures = 0;
        lane.in_flight = None;
        match next {
            Some(from) => self.send_replay(store, home, from, now_ms),
            None => self.pass_done(store, home, now_ms),
        }
    }

    /// A replay batch failed: its counts stay in the store, and the pass is tried again
    /// after a backoff.
    fn replay_failed(&mut self, id: u64, why: &str, now_ms: u64) {
        let Some(Call::Replay { home, .. }) = self.calls.remove(&id) else {
            return;
        };
        self.stats.replay_failures += 1;
        let interval = self.config.replay_interval_ms;
        let lane = self.lane(home);
        lane.failures = lane.failures.saturating_add(1);
        lane.in_flight = None;
        lane.wanted = true;
        let backoff = replay_backoff(interval, lane.failures);
        lane.next_at = Some(now_ms.saturating_add(backoff));
        let line = format!("a replay failed ({why}); its counts go again in {backoff} ms");
        self.logs.extend(self.replay_failures.line(now_ms, line));
    }
}

/// The wait before the pass after `failures` failed ones: the interval, doubling, at most
/// [`MAX_REPLAY_BACKOFF_MS`] (or the interval, if longer).
pub fn replay_backoff(interval_ms: u64, failures: u32) -> u64 {
    let doubled = interval_ms.saturating_mul(1_u64 << failures.min(16));
    doubled.min(MAX_REPLAY_BACKOFF_MS.max(interval_ms))
}

/// A failed answer in a few words: its status, and the start of its body.
fn status_text(status: u16, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body.get(..body.len().min(120)).unwrap_or_default());
    format!("status {status}: {}", text.trim())
}

fn set(groups: &mut [Group; 2], g: usize, to: Group) {
    if let Some(slot) = groups.get_mut(g) {
        *slot = to;
    }
}
