//! The flow of groups of limits past the gateway, sans I/O: a group either decides from the
//! store at once or waits for a decision call (its own, or one in flight on one of its keys);
//! calls and replay batches go out as [`Dispatch`]es with their bound; answers, failures and
//! the shell's timer come back as events. Every shell runs its requests through one: the Wasm
//! shells through [`Driver`](super::Driver), which adds rules and replies, and the native
//! gateway directly, whose requests name their limits.

use alloc::collections::{BTreeMap, VecDeque};
use alloc::format;
use alloc::string::{String, ToString};
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::hash::BuildHasher;

use foldhash::quality::FixedState;

use super::store::{Home, Replays, Store};
use crate::decision::MultiDecision;
use crate::identity::WindowKey;
use crate::limit::LimitRequest;
use crate::policy::Reason;
use crate::replay::{QuietPace, ReplayBatch};
use crate::request::{Begin, OriginCall};
use crate::wire::{self, CellsResponse, DecideResponse};

/// The longest wait before a failed replay is sent again.
pub const MAX_REPLAY_BACKOFF_MS: u64 = 5_000;
/// The shortest bound on a replay call: a batch of a thousand cells may take a while.
pub const MIN_REPLAY_TIMEOUT_MS: u64 = 1_000;
/// A warning that repeats (the gateway failing every call) is logged at most this often,
/// with the number of the ones left out.
pub const LOG_EVERY_MS: u64 = 10_000;

/// A group of limits: the shell's request id, and which of its groups (a Wasm shell's request
/// has an enforced and a shadow group; a gateway request one).
pub type GroupId = (u64, usize);

/// The flow's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowConfig {
    /// The longest a request waits for the gateway, from its arrival.
    pub timeout_ms: u64,
    /// How long accepted cost gathers before a replay.
    pub replay_interval_ms: u64,
    /// The most cells a replay batch carries: [`wire::MAX_BATCH`] for a shell that sends
    /// them to the gateway; fewer for the gateway's own, which its origin runs without a
    /// yield (a batch holds a worker, or Redis, between two requests).
    pub replay_batch: usize,
}

impl FlowConfig {
    /// How long a replay batch may take: [`replay_timeout_ms`] of the timeout.
    pub fn replay_timeout_ms(&self) -> u64 {
        replay_timeout_ms(self.timeout_ms)
    }
}

/// How long a replay batch may take where a decision may take `timeout_ms`: that, and at least
/// [`MIN_REPLAY_TIMEOUT_MS`] (a batch is bigger than a decision, and nothing waits on it). One
/// bound for every shell's replay and for the gateway's origin taking one.
pub fn replay_timeout_ms(timeout_ms: u64) -> u64 {
    timeout_ms.max(MIN_REPLAY_TIMEOUT_MS)
}

/// What a call carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outgoing {
    /// A decision (`/v1/origin/decide`).
    Decide(Arc<OriginCall>),
    /// Accepted cost (`/v1/origin/replay`).
    Replay(Arc<ReplayBatch>),
}

/// A call for the shell to make, given up after `timeout_ms`: its answer goes to
/// [`Flow::decided`] or [`Flow::replayed`], a failure to [`Flow::failed`], with `call`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dispatch {
    /// The call's id.
    pub call: u64,
    /// The home it is made for (the store names its instance id).
    pub home: Home,
    /// What it carries.
    pub outgoing: Outgoing,
    /// How long the call may take, from `at_ms`.
    pub timeout_ms: u64,
    /// When the flow asked for it.
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
    /// Local memory, ahead of the gateway's answer: a key with no live answer, far from its
    /// limit (see [`crate::policy::AHEAD_LIMIT_PER_COST`]), whose pass the next replay
    /// delivers.
    Ahead,
}

impl DecidedBy {
    /// Its name in stats and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            DecidedBy::Local => "local",
            DecidedBy::Origin => "origin",
            DecidedBy::Fallback => "fallback",
            DecidedBy::Ahead => "ahead",
        }
    }
}

/// A group that waited, decided: its limits' decisions, all or nothing, and which path
/// decided them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupDone {
    /// Which group.
    pub group: GroupId,
    /// Its decisions.
    pub decision: MultiDecision,
    /// Which path decided it.
    pub by: DecidedBy,
}

/// A group waiting for a call: its deadline, and the limits of one that joined another's
/// call, to begin it again when that call settles (empty for the group that made the call,
/// which its answer decides).
#[derive(Debug)]
struct Waiting {
    deadline: u64,
    again: Vec<OwnedLimit>,
}

/// A limit a waiting group holds past the request that named it.
#[derive(Debug)]
struct OwnedLimit {
    key: WindowKey,
    limit: u64,
    cost: u64,
}

/// A line for the shell's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Log {
    /// A warning (else information).
    pub warn: bool,
    /// The line.
    pub message: String,
}

/// What the flow did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowStats {
    /// Decision calls sent.
    pub origin_calls: u64,
    /// Decision calls sent, by why their first limit needed the gateway ([`Reason::index`]).
    pub origin_reasons: [u64; Reason::ALL.len()],
    /// Decision calls that failed (refused, error status, nonsense, timeout).
    pub origin_failures: u64,
    /// Groups that waited for another group's call instead of sending one.
    pub coalesced: u64,
    /// Replay batches the gateway took.
    pub replays: u64,
    /// Replay batches that failed.
    pub replay_failures: u64,
}

/// A call in flight.
#[derive(Debug)]
enum Call {
    Decide {
        call: Arc<OriginCall>,
        home: Home,
        deadline: u64,
        /// `(group, made it)`: the group that made it, then those that joined.
        waiters: Vec<(GroupId, bool)>,
    },
    Replay {
        home: Home,
        batch: Arc<ReplayBatch>,
        next: Option<usize>,
        /// When the batch was taken: a lease its answer renews runs from then.
        sent: u64,
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

/// Which kind of call an id is, while it is in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    /// A decision.
    Decide,
    /// A replay batch.
    Replay,
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
    /// Passes begun (a quiet cell's turn is staggered by it).
    pass: u32,
    /// Whether a take of the pass in flight held a cell back for a later pass.
    held: bool,
    /// The region's pace as the gateway's last replay answer stated it (`None`: not said;
    /// every cell holding cost goes on every pass).
    pace: Option<wire::ReplayPace>,
}

/// A warning that may repeat (every call failing, every call of a misconfigured client):
/// logged once per [`LOG_EVERY_MS`], with the number of the ones left out.
#[derive(Clone, Copy, Debug, Default)]
pub struct Quiet {
    next_at: u64,
    left_out: u64,
}

impl Quiet {
    /// The line to log for `message` at `now_ms`, or `None` if one was logged less than
    /// [`LOG_EVERY_MS`] ago (it is counted, and the next line says how many were left out).
    pub fn line(&mut self, now_ms: u64, message: String) -> Option<Log> {
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

/// Groups waiting, calls in flight, and replay lanes.
#[derive(Debug)]
pub struct Flow {
    config: FlowConfig,
    /// Groups waiting for a call.
    waiting: BTreeMap<GroupId, Waiting>,
    calls: BTreeMap<u64, Call>,
    /// Decision calls in flight by the hash of each of their window keys.
    in_flight: BTreeMap<u64, u64>,
    hasher: FixedState,
    next_call: u64,
    lanes: Vec<Lane>,
    dispatches: VecDeque<Dispatch>,
    done: VecDeque<GroupDone>,
    logs: VecDeque<Log>,
    call_failures: Quiet,
    replay_failures: Quiet,
    stats: FlowStats,
}

impl Flow {
    /// An idle flow.
    pub fn new(config: FlowConfig) -> Self {
        Self {
            config,
            waiting: BTreeMap::new(),
            calls: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            hasher: FixedState::default(),
            next_call: 0,
            lanes: Vec::new(),
            dispatches: VecDeque::new(),
            done: VecDeque::new(),
            logs: VecDeque::new(),
            call_failures: Quiet::default(),
            replay_failures: Quiet::default(),
            stats: FlowStats::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> FlowConfig {
        self.config
    }

    /// What happened so far.
    pub fn stats(&self) -> FlowStats {
        self.stats
    }

    /// Groups waiting for a call.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Calls in flight (decisions and replay batches).
    pub fn calls(&self) -> usize {
        self.calls.len()
    }

    /// Group `group` of `limits` begins, to be decided by `deadline`: joins a decision call
    /// in flight on one of its keys, or begins on the store and sends the call that may
    /// need. Decided now, or `None`: it waits, and what becomes of it comes out of
    /// [`poll_done`](Self::poll_done).
    pub fn begin<S: Store>(
        &mut self,
        store: &mut S,
        group: GroupId,
        limits: &[LimitRequest<'_>],
        deadline: u64,
        now_ms: u64,
    ) -> Option<(MultiDecision, DecidedBy)> {
        if let Some(call_id) = self.joinable(limits)
            && let Some(Call::Decide {
                deadline: call_deadline,
                waiters,
                ..
            }) = self.calls.get_mut(&call_id)
        {
            // A group that joins a call is answered by that call's deadline, at the latest,
            // and begins again when it settles (the answer usually brought a lease that
            // decides it from memory).
            waiters.push((group, false));
            let deadline = deadline.min(*call_deadline);
            self.stats.coalesced += 1;
            let again = limits
                .iter()
                .map(|l| OwnedLimit {
                    key: l.key.to_owned_key(),
                    limit: l.limit,
                    cost: l.cost,
                })
                .collect();
            self.waiting.insert(group, Waiting { deadline, again });
            return None;
        }
        let (begun, home) = match store.begin(limits, now_ms) {
            Ok(b) => b,
            // Only a group of more limits than the table holds: denied, counted nowhere.
            Err(_) => {
                let denied = MultiDecision {
                    success: false,
                    decisions: Vec::new(),
                };
                return Some((denied, DecidedBy::Local));
            }
        };
        let call = match begun {
            Begin::Call(call) => call,
            Begin::Decided(d) => {
                self.want_replay(store, home, now_ms);
                return Some((d, DecidedBy::Local));
            }
            Begin::Fallback(d) => {
                self.want_replay(store, home, now_ms);
                return Some((d, DecidedBy::Fallback));
            }
            Begin::Ahead(d) => {
                self.want_replay(store, home, now_ms);
                return Some((d, DecidedBy::Ahead));
            }
        };
        if now_ms >= deadline {
            // No time left for a call (a group that waited out its time on another's):
            // failed as a call that got no answer.
            let decided = store.fail(home, &call, now_ms);
            self.want_replay(store, home, now_ms);
            return Some((decided, DecidedBy::Fallback));
        }
        self.send_decide(call, home, deadline, alloc::vec![(group, true)], now_ms);
        let again = Vec::new();
        self.waiting.insert(group, Waiting { deadline, again });
        None
    }

    /// Puts decision call `call` out, in flight on each of its keys until it settles.
    fn send_decide(
        &mut self,
        call: OriginCall,
        home: Home,
        deadline: u64,
        waiters: Vec<(GroupId, bool)>,
        now_ms: u64,
    ) {
        let call_id = self.call_id();
        for l in call.limits() {
            let hash = self.hasher.hash_one(l.key.as_ref());
            self.in_flight.insert(hash, call_id);
        }
        let call = Arc::new(call);
        if let Some(n) = self.stats.origin_reasons.get_mut(call.reason().index()) {
            *n += 1;
        }
        self.dispatches.push_back(Dispatch {
            call: call_id,
            home,
            outgoing: Outgoing::Decide(call.clone()),
            timeout_ms: deadline.saturating_sub(now_ms),
            at_ms: now_ms,
        });
        self.calls.insert(
            call_id,
            Call::Decide {
                call,
                home,
                deadline,
                waiters,
            },
        );
        self.stats.origin_calls += 1;
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

    /// What call `call` is, if it is still in flight (past its deadline it failed already).
    pub fn call_kind(&self, call: u64) -> Option<CallKind> {
        self.calls.get(&call).map(|c| match c {
            Call::Decide { .. } => CallKind::Decide,
            Call::Replay { .. } => CallKind::Replay,
        })
    }

    /// Decision call `call` was answered with `response`, or got no usable answer (`None`,
    /// or an answer that does not fit the call; `why` says what happened, for the log).
    pub fn decided<S: Store>(
        &mut self,
        store: &mut S,
        call: u64,
        response: Option<&DecideResponse>,
        why: impl FnOnce() -> String,
        now_ms: u64,
    ) {
        self.settle_call(store, call, response, why, now_ms);
    }

    /// Call `call` failed without an answer (`why`: the transport's words).
    pub fn failed<S: Store>(&mut self, store: &mut S, call: u64, why: &str, now_ms: u64) {
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
    pub fn timeout<S: Replays>(&mut self, store: &mut S, now_ms: u64) {
        let expired: Vec<u64> = self
            .calls
            .iter()
            .filter(|(_, c)| c.deadline() <= now_ms)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.failed(store, id, "no answer within the timeout", now_ms);
        }
        self.replay_due(store, now_ms);
    }

    /// Group `group` is not wanted any more (its client hung up). A call it made still
    /// settles the groups that joined it.
    pub fn cancel(&mut self, group: GroupId) {
        self.waiting.remove(&group);
    }

    /// A group that waited, decided or to begin again.
    pub fn poll_done(&mut self) -> Option<GroupDone> {
        self.done.pop_front()
    }

    /// A call to make.
    pub fn poll_dispatch(&mut self) -> Option<Dispatch> {
        self.dispatches.pop_front()
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

    /// Call `id` is answered (`response`) or failed (`None`): its cells take the answer or
    /// the failure, the group that made it is decided, and those that joined it are to begin
    /// again.
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
        let (decided, by) = match &answers {
            Some(answers) => (
                store.finish(home, &call, answers, now_ms),
                DecidedBy::Origin,
            ),
            None => {
                self.stats.origin_failures += 1;
                let mode = store.failure_mode().as_str();
                let line = format!(
                    "the gateway did not decide ({}); the failure mode ({mode}) decides",
                    why()
                );
                self.logs.extend(self.call_failures.line(now_ms, line));
                // The store may count the failure mode's pass in another home than the
                // call's (a state out of reach): every home's replay looks.
                for other in (0..store.homes()).map(Home).filter(|h| *h != home) {
                    self.want_replay(store, other, now_ms);
                }
                (store.fail(home, &call, now_ms), DecidedBy::Fallback)
            }
        };
        self.want_replay(store, home, now_ms);
        for (group, made) in waiters {
            let Some(waiting) = self.waiting.remove(&group) else {
                continue; // cancelled
            };
            if made {
                let decision = decided.clone();
                self.done.push_back(GroupDone {
                    group,
                    decision,
                    by,
                });
                continue;
            }
            // It joined: it begins again by its deadline, now that the call is out of flight.
            let limits: Vec<LimitRequest<'_>> = waiting
                .again
                .iter()
                .map(|l| LimitRequest {
                    key: l.key.as_ref(),
                    limit: l.limit,
                    cost: l.cost,
                })
                .collect();
            if let Some((decision, by)) =
                self.begin(store, group, &limits, waiting.deadline, now_ms)
            {
                self.done.push_back(GroupDone {
                    group,
                    decision,
                    by,
                });
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

    /// Cost may have been accepted in `home`: a replay pass is due within the interval (if
    /// the flow replays that home).
    fn want_replay<S: Store>(&mut self, store: &S, home: Home, now_ms: u64) {
        if home.0 >= store.homes() {
            return;
        }
        let interval = self.config.replay_interval_ms;
        let lane = self.lane(home);
        lane.wanted = true;
        if lane.next_at.is_none() && lane.in_flight.is_none() {
            lane.next_at = Some(now_ms.saturating_add(interval));
        }
    }

    fn replay_due<S: Replays>(&mut self, store: &mut S, now_ms: u64) {
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
            lane.held = false;
            lane.pass = lane.pass.wrapping_add(1);
            self.send_replay(store, home, 0, now_ms);
        }
    }

    /// Takes the next batch of a replay pass of `home` and sends it, or ends the pass.
    fn send_replay<S: Replays>(&mut self, store: &mut S, home: Home, from: usize, now_ms: u64) {
        let interval = self.config.replay_interval_ms;
        let lane = self.lane(home);
        let pace = lane
            .pace
            .map(|p| QuietPace::stated(lane.pass, interval, store.lease_ms(home), &p));
        let (batch, next) = store.take_replay(home, self.config.replay_batch, now_ms, pace, from);
        let lane = self.lane(home);
        lane.held |= batch.held > 0;
        if batch.is_empty() {
            return self.pass_done(store, home, now_ms);
        }
        let id = self.call_id();
        let timeout_ms = self.config.replay_timeout_ms();
        let batch = Arc::new(batch);
        self.dispatches.push_back(Dispatch {
            call: id,
            home,
            outgoing: Outgoing::Replay(batch.clone()),
            timeout_ms,
            at_ms: now_ms,
        });
        self.calls.insert(
            id,
            Call::Replay {
                home,
                batch,
                next,
                sent: now_ms,
                deadline: now_ms.saturating_add(timeout_ms),
            },
        );
        self.lane(home).in_flight = Some(id);
    }

    fn pass_done<S: Replays>(&mut self, store: &S, home: Home, now_ms: u64) {
        let interval = self.config.replay_interval_ms;
        let periodic = store.periodic(home);
        let lane = self.lane(home);
        lane.in_flight = None;
        // A held cell waits for its turn or its lease's end, which only a pass finds.
        lane.next_at =
            (lane.wanted || lane.held || periodic).then(|| now_ms.saturating_add(interval));
    }

    /// Replay batch `call` was taken: `answer.cells[i]` is its event `i`'s cell after it.
    pub fn replayed<S: Replays>(
        &mut self,
        store: &mut S,
        call: u64,
        answer: &CellsResponse,
        now_ms: u64,
    ) {
        let Some(Call::Replay {
            home,
            batch,
            next,
            sent,
            ..
        }) = self.calls.remove(&call)
        else {
            return;
        };
        store.ack_replay(home, &batch, answer, sent, now_ms);
        self.stats.replays += 1;
        let lane = self.lane(home);
        if answer.pace.is_some() {
            lane.pace = answer.pace;
        }
        lane.failures = 0;
        lane.in_flight = None;
        match next {
            Some(from) => self.send_replay(store, home, from, now_ms),
            None => self.pass_done(store, home, now_ms),
        }
    }

    /// The region's pace for `home`'s replay, from a shell that knows it without asking (the
    /// gateway, whose own view states it): as a replay answer's `pace` sets it.
    pub fn set_pace(&mut self, home: Home, pace: wire::ReplayPace) {
        self.lane(home).pace = Some(pace);
    }

    /// The size of replay batch `call`, while it is in flight.
    pub fn replay_len(&self, call: u64) -> Option<usize> {
        match self.calls.get(&call) {
            Some(Call::Replay { batch, .. }) => Some(batch.len()),
            _ => None,
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
