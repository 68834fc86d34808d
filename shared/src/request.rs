//! The request path every shell drives, sans I/O: a request (one or several limits and
//! `now_ms`) is answered either with a decision or with exactly one origin call to make. The
//! shell performs the call and hands back the answers (or says it failed); the core merges
//! them and answers the decision.
//!
//! ```text
//! begin(states, limits, now) ─┬─ Begin::Decided(decision)          no round trip
//!                             └─ Begin::Call(call) ── shell sends call.to_wire(instance)
//!                                    ├─ answer: call.answers(&response) → finish(…) → decision
//!                                    └─ failure: fail(…) → decision per the failure mode
//!                             └─ Begin::Fallback(decision)         the origin failed moments ago
//!                             └─ Begin::Ahead(decision)            no live answer, far from the limit:
//!                                                                  passed; the replay delivers it
//! ```
//!
//! A call owns everything it needs, so a driver can hold it across an await (a Worker), in a
//! paused stream's context until a later callback (an Envoy VM), or with no lock held (the
//! multi-threaded gateway, whose states live in several locked shards: [`States`]).

use alloc::string::ToString;
use alloc::vec::Vec;
use core::fmt;

use crate::cell::WindowState;
use crate::decision::{Decision, LimitCheck, MultiDecision, decide_all};
use crate::identity::WindowKey;
use crate::lease;
use crate::limit::LimitRequest;
use crate::origin::{OriginAnswer, OriginPlan, OriginPolicy, Reason, Verdict};
use crate::policy::AHEAD_LIMIT_PER_COST;
use crate::wire;

/// One limit of an origin call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallLimit {
    /// The window key.
    pub key: WindowKey,
    /// Allowed cost per window.
    pub limit: u64,
    /// This request's cost.
    pub cost: u64,
    /// What to tell the origin, and why.
    pub plan: OriginPlan,
}

impl CallLimit {
    /// The limit as a request (borrowing the key).
    pub fn request(&self) -> LimitRequest<'_> {
        LimitRequest {
            key: self.key.as_ref(),
            limit: self.limit,
            cost: self.cost,
        }
    }

    /// The limit as an origin takes it: what a validated `/v1/origin/decide` limit holds, so
    /// an origin in the same process decides a call exactly as one it received.
    pub fn decide_ref(&self) -> wire::DecideRef<'_> {
        wire::DecideRef {
            limit: self.request(),
            sequence: Some(self.plan.sequence),
            used: self.plan.used,
            decided: self.plan.decided,
            want: self.plan.want,
            release: self.plan.release,
            call: self.plan.call,
            undo_from: self.plan.undo_from,
            shares: true,
        }
    }
}

/// A decision to make at the origin: every limit of the request, all or nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OriginCall {
    limits: Vec<CallLimit>,
}

/// What [`begin`] answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Begin {
    /// Decided from local memory and applied: a denial, or passes every lease covers.
    Decided(MultiDecision),
    /// Make this call; nothing was counted yet.
    Call(OriginCall),
    /// Decided by the failure mode without a call: the request needs the origin, and a call
    /// on one of its cells failed within [`OriginPolicy::read_retry_ms`].
    Fallback(MultiDecision),
    /// Passed ahead of the origin's answer and applied (no limit has a live answer, each is
    /// far from its limit, and the failure mode decides from memory): no call; the pass is
    /// the process's own count, which the next replay pass delivers, and the replay's answer
    /// (the region's count) is the answer the next request on the key goes by.
    Ahead(MultiDecision),
}

pub use crate::policy::FailureMode;

/// An origin answer that does not fit its call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnswerMismatch {
    /// Limits asked.
    pub asked: usize,
    /// Results answered.
    pub answered: usize,
}

impl fmt::Display for AnswerMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the origin answered {} results for {} limits",
            self.answered, self.asked
        )
    }
}

#[cfg(feature = "std")]
impl std::error::Error for AnswerMismatch {}

impl OriginCall {
    /// A call for one limit.
    pub fn single(limit: LimitRequest<'_>, plan: OriginPlan) -> Self {
        Self {
            limits: alloc::vec![CallLimit {
                key: limit.key.to_owned_key(),
                limit: limit.limit,
                cost: limit.cost,
                plan,
            }],
        }
    }

    /// Asks for no lease on any limit, so each pass the caller makes stays decided at the
    /// origin: for a copy of a key the caller's siblings under other instance ids also serve
    /// (an unused lease of one copy is held back from the others).
    pub fn ask_no_lease(&mut self) {
        for l in &mut self.limits {
            l.plan.want = 0;
        }
    }

    /// The limits, in request order.
    pub fn limits(&self) -> &[CallLimit] {
        &self.limits
    }

    /// Why the call is made: the first limit's reason.
    pub fn reason(&self) -> Reason {
        self.limits.first().map_or(Reason::Cold, |l| l.plan.reason)
    }

    /// The `POST /v1/origin/decide` body.
    pub fn to_wire(&self, instance: &str) -> wire::DecideRequest {
        wire::DecideRequest {
            instance: instance.to_string(),
            limits: self
                .limits
                .iter()
                .map(|l| wire::DecideLimitRequest {
                    namespace: l.key.as_ref().namespace().to_string(),
                    identifier: l.key.as_ref().identifier().to_string(),
                    limit: l.limit,
                    duration: l.key.duration().as_ms(),
                    cost: l.cost,
                    sequence: Some(l.plan.sequence),
                    used: l.plan.used[0],
                    used_previous: l.plan.used[1],
                    decided: l.plan.decided[0],
                    decided_previous: l.plan.decided[1],
                    want: l.plan.want,
                    release: l.plan.release,
                    call: l.plan.call,
                    undo_from: l.plan.undo_from,
                })
                .collect(),
            shares: true,
        }
    }

    /// The core's answers from a `/v1/origin/decide` response to this call.
    pub fn answers(
        &self,
        response: &wire::DecideResponse,
    ) -> Result<Vec<OriginAnswer>, AnswerMismatch> {
        if response.results.len() != self.limits.len() {
            return Err(AnswerMismatch {
                asked: self.limits.len(),
                answered: response.results.len(),
            });
        }
        Ok(response
            .results
            .iter()
            .map(|r| OriginAnswer {
                limit: r.limit,
                remaining: r.remaining,
                reset_ms: r.reset,
                sequence: r.sequence,
                counted: response.success,
                denied: !r.success,
                current: r.current,
                previous: r.previous,
                used: r.used,
                lease: r.lease,
                lease_id: r.lease_id,
                lease_ms: r.lease_ms,
                covers: r.covers,
            })
            .collect())
    }
}

/// The states of a request's limits, however a shell holds them (one table, or locked
/// shards). Limits naming the same key share one state.
pub trait States {
    /// The state of limit `i`, rolled or not (the core rolls it).
    fn state(&mut self, i: usize) -> Option<&mut WindowState>;
    /// Whether limits `i` and `j` share one state (a key named twice is charged twice).
    fn same(&self, i: usize, j: usize) -> bool;
    /// A new origin call id for limit `i`'s state: only growing within the table that holds
    /// it (see [`crate::CounterTable::next_call`]).
    fn next_call(&mut self, i: usize) -> u64;
}

/// Starts a request: decides it locally where that is safe (a denial by the local lower
/// bound, or passes every lease covers), per `policy`'s failure mode where it needs an origin
/// that failed moments ago, otherwise returns the one origin call that decides all its
/// limits, all or nothing.
pub fn begin<S: States>(
    states: &mut S,
    limits: &[LimitRequest<'_>],
    now_ms: u64,
    policy: &OriginPolicy,
) -> Begin {
    // Listed only once a limit needs the origin: a request decided locally allocates nothing.
    let mut plans: Vec<Option<OriginPlan>> = Vec::new();
    let mut denied = false;
    let mut unreachable = false;
    for (i, l) in limits.iter().enumerate() {
        // A shell without the state: decided with the others.
        let plan = states.state(i).and_then(|state| {
            let d = l.key.duration();
            let now_ms = state.roll(d, now_ms);
            state.observe_limit(l.limit);
            match state.classify(d, l.limit, l.cost, now_ms) {
                Verdict::Local(decision) => {
                    denied |= !decision.success;
                    None
                }
                Verdict::Origin(plan) => Some(plan),
                Verdict::Unreachable(_) => {
                    unreachable = true;
                    None
                }
            }
        });
        if plan.is_some() {
            plans.resize(i, None); // the limits before it: none needed the origin
            plans.push(plan);
        }
    }
    if unreachable && !denied {
        return Begin::Fallback(decide_failed(states, limits, policy.failure_mode, now_ms));
    }
    // A key named twice is charged twice, which one lease check per limit does not see.
    let repeated = (0..limits.len()).any(|i| (0..i).any(|j| states.same(i, j)));
    if denied || (!repeated && plans.iter().all(Option::is_none)) {
        return Begin::Decided(decide_locally(states, limits, now_ms));
    }
    if !repeated && policy.failure_mode.from_memory() && ahead(states, limits, &plans, now_ms) {
        let decided = decide_locally(states, limits, now_ms);
        if !decided.success {
            return Begin::Decided(decided); // the local view passed each: never
        }
        return Begin::Ahead(decided);
    }
    Begin::Call(call(states, limits, plans, now_ms))
}

/// The one origin call of a request, all or nothing: limits the lease covers go too, asking
/// the same lease; every limit gives back the lease it holds (see `OriginPlan::release`).
fn call<S: States>(
    states: &mut S,
    limits: &[LimitRequest<'_>],
    mut plans: Vec<Option<OriginPlan>>,
    now_ms: u64,
) -> OriginCall {
    plans.resize(limits.len(), None);
    let limits = limits
        .iter()
        .zip(plans)
        .enumerate()
        .map(|(i, (l, plan))| {
            let mut plan = plan.unwrap_or_else(|| covered_plan(states, i, l, now_ms));
            plan.call = states.next_call(i);
            if let Some(s) = states.state(i) {
                s.begin_origin(&plan, l.cost);
            }
            CallLimit {
                key: l.key.to_owned_key(),
                limit: l.limit,
                cost: l.cost,
                plan,
            }
        })
        .collect();
    OriginCall { limits }
}

/// Whether a request may pass ahead of the origin's answer: every limit needs the origin
/// because it has no live answer (its cell is cold and this process knows no count of it, or
/// no lease lifetime runs: lapsed, given back idle, or never lent to a key answered by replays
/// alone) and every own pass on it is acknowledged (by a decision or a replay); its limit is at
/// least [`AHEAD_LIMIT_PER_COST`] times its cost; and its local view (the previous window's
/// count included) leaves at least half the limit after it. It makes no call: a key between
/// sparse requests costs the origin one replayed cell a request and no decision. A request
/// before that pass is acknowledged (a key in demand) waits for a decision, which lends the
/// lease. What that can admit over the limit is one request per process and cell for each
/// answer, at a key others spent or reserved past half its limit since this process last heard
/// its count.
fn ahead<S: States>(
    states: &mut S,
    limits: &[LimitRequest<'_>],
    plans: &[Option<OriginPlan>],
    now_ms: u64,
) -> bool {
    plans.len() == limits.len()
        && limits.iter().zip(plans).enumerate().all(|(i, (l, plan))| {
            let (Some(plan), Some(s)) = (plan, states.state(i)) else {
                return false;
            };
            let c = s.current();
            let unknown = match plan.reason {
                // No count a sync or an answer brought either: an origin that lost its data
                // raises its count to the region's published one with `max`, which would
                // swallow a pass counted before it.
                Reason::Cold => c.own() == 0 && c.counts().total() == 0,
                // No lease lifetime running: it lapsed, went back idle (which ends it), or
                // was never lent (a key answered by replays alone). A lease used up within its
                // lifetime waits, and so does an answer that lent nothing though asked (a
                // lease of 0 for a lifetime: others' leases hold what the counts leave), and a
                // key just denied.
                Reason::Stale | Reason::Lease => !c.is_fresh(now_ms),
                Reason::Strict => false,
            };
            let far = l.cost > 0 && l.cost.saturating_mul(AHEAD_LIMIT_PER_COST) <= l.limit;
            unknown && far && c.unacked() == 0 && {
                let view = s.check(l.key.duration(), l.limit, l.cost);
                lease::leaves_half(view.decide_in(s.sequence(), now_ms, 0).remaining, l.limit)
            }
        })
}

/// The plan of a limit its lease covers, sent along with the others of its request.
fn covered_plan<S: States>(
    states: &mut S,
    i: usize,
    l: &LimitRequest<'_>,
    now_ms: u64,
) -> OriginPlan {
    let (sequence, used, decided, want, release, undo_from) =
        states.state(i).map_or((0, [0, 0], [0, 0], 0, 0, 0), |s| {
            (
                s.sequence(),
                [s.current().own(), s.previous().own()],
                [s.current().decided(), s.previous().decided()],
                // Covered: the process holds a grant here, so how far the limit is does not
                // change the ask (only a process with none asks for the limit).
                s.lease().want(Reason::Stale, l.cost, l.limit, false),
                s.current().lease_id(),
                s.uncertain_from(),
            )
        });
    OriginPlan {
        sequence,
        at_ms: now_ms,
        reason: Reason::Lease,
        release,
        used,
        decided,
        want,
        call: 0,
        undo_from,
    }
}

/// Decides every limit by its local view (see [`WindowState::view`]), all or nothing, and
/// applies the result: requests the local view can decide.
pub fn decide_locally<S: States>(
    states: &mut S,
    limits: &[LimitRequest<'_>],
    now_ms: u64,
) -> MultiDecision {
    decide_from(states, limits, now_ms, false)
}

/// Decides every limit from what the process knows (the counts alone, nothing left to
/// rivals) whatever the cells' state, all or nothing, and applies the result: a failure mode
/// deciding from memory, or a shell with no origin.
pub fn decide_from_memory<S: States>(
    states: &mut S,
    limits: &[LimitRequest<'_>],
    now_ms: u64,
) -> MultiDecision {
    decide_from(states, limits, now_ms, true)
}

fn decide_from<S: States>(
    states: &mut S,
    limits: &[LimitRequest<'_>],
    now_ms: u64,
    from_memory: bool,
) -> MultiDecision {
    let mut check = |i: usize, l: &LimitRequest<'_>| match states.state(i) {
        Some(s) => s.prepare(l.key.duration(), l.limit, l.cost, now_ms, from_memory),
        None => LimitCheck {
            counts: crate::decision::WindowCounts::default(),
            duration: l.key.duration(),
            limit: 0,
            cost: l.cost,
        },
    };
    let multi = match limits {
        // One limit, the common case: no list of checks.
        [one] => decide_all(core::slice::from_ref(&check(0, one)), now_ms, |_, _| true),
        _ => {
            let checks: Vec<LimitCheck> = limits
                .iter()
                .enumerate()
                .map(|(i, l)| check(i, l))
                .collect();
            decide_all(&checks, now_ms, |i, j| states.same(i, j))
        }
    };
    for (i, decision) in multi.to_apply() {
        if let (Some(l), Some(s)) = (limits.get(i), states.state(i)) {
            s.settle(decision, l.key.duration(), l.cost, now_ms);
        }
    }
    multi
}

/// Merges the origin's answers to `call` and returns the decision.
pub fn finish<S: States>(
    states: &mut S,
    call: &OriginCall,
    answers: &[OriginAnswer],
    now_ms: u64,
) -> MultiDecision {
    let decisions = call
        .limits
        .iter()
        .zip(answers)
        .enumerate()
        .map(|(i, (l, a))| match states.state(i) {
            Some(s) => s.apply_decided(l.key.duration(), &l.plan, a, l.cost, now_ms),
            None => Decision {
                success: false,
                limit: a.limit,
                remaining: a.remaining,
                reset_ms: a.reset_ms,
                retry_after_ms: Some(1),
            },
        })
        .collect();
    MultiDecision {
        success: answers.len() == call.limits.len()
            && answers.iter().all(|a| a.counted && !a.denied),
        decisions,
    }
}

/// The origin could not decide `call`: no call is tried on its cells for the retry delay,
/// and the request is decided per `policy`'s failure mode.
pub fn fail<S: States>(
    states: &mut S,
    call: &OriginCall,
    now_ms: u64,
    policy: &OriginPolicy,
) -> MultiDecision {
    for (i, l) in call.limits.iter().enumerate() {
        if let Some(s) = states.state(i) {
            s.fail_origin(&l.plan, now_ms, policy);
        }
    }
    let limits: Vec<LimitRequest<'_>> = call.limits.iter().map(CallLimit::request).collect();
    decide_failed(states, &limits, policy.failure_mode, now_ms)
}

/// The denial `deny` gives one limit the origin gave no answer for.
pub(crate) fn failed_denial(
    duration: crate::window::WindowDuration,
    limit: u64,
    now_ms: u64,
) -> Decision {
    Decision {
        success: false,
        limit,
        remaining: 0,
        reset_ms: duration.reset(duration.sequence(now_ms)),
        retry_after_ms: Some(1_000),
    }
}

/// Decides a request the origin gave no answer for, per `mode`, and applies it.
pub fn decide_failed<S: States>(
    states: &mut S,
    limits: &[LimitRequest<'_>],
    mode: FailureMode,
    now_ms: u64,
) -> MultiDecision {
    // `allow` passes unless the process's own count, as it stands now (other requests may
    // have passed while this one's call was out), proves a limit exceeded: the local view.
    if mode.from_memory() {
        return decide_from_memory(states, limits, now_ms);
    }
    MultiDecision {
        success: false,
        decisions: limits
            .iter()
            .map(|l| failed_denial(l.key.duration(), l.limit, now_ms))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::Counts;
    use crate::identity::WindowKeyRef;
    use crate::window::WindowDuration;

    fn call() -> OriginCall {
        let d = WindowDuration::from_ms(60_000).unwrap();
        let key = WindowKeyRef::new("ws", "api", "u-1", d).unwrap();
        let plan = OriginPlan {
            sequence: 7,
            at_ms: 420_000,
            reason: Reason::Lease,
            release: 0,
            used: [5, 2],
            decided: [1, 4],
            want: 8,
            call: 3,
            undo_from: 0,
        };
        OriginCall::single(
            LimitRequest {
                key,
                limit: 50,
                cost: 2,
            },
            plan,
        )
    }

    #[test]
    fn the_wire_body_carries_own_counts_and_the_lease_wanted() {
        let body = call().to_wire("edge-1");
        assert_eq!(body.instance, "edge-1");
        let l = &body.limits[0];
        assert_eq!(
            (l.namespace.as_str(), l.identifier.as_str()),
            ("api", "u-1")
        );
        assert_eq!((l.limit, l.duration, l.cost), (50, 60_000, 2));
        assert_eq!(
            (l.sequence, l.used, l.used_previous, l.want),
            (Some(7), 5, 2, 8)
        );
    }

    #[test]
    fn answers_follow_the_response_and_a_short_one_is_refused() {
        let result = wire::DecideResult {
            success: true,
            limit: 50,
            remaining: 30,
            reset: 480_000,
            sequence: 7,
            current: Counts {
                regional: 20,
                global: 1,
            },
            previous: Counts::default(),
            used: 5,
            lease: 6,
            lease_id: 9,
            lease_ms: 5_000,
            covers: false,
        };
        let response = wire::DecideResponse {
            success: true,
            sequence: 7,
            results: alloc::vec![result],
        };
        let answers = call().answers(&response).unwrap();
        assert!(answers[0].counted && !answers[0].denied);
        assert_eq!((answers[0].used, answers[0].lease), (5, 6));
        let empty = wire::DecideResponse {
            results: alloc::vec![],
            ..response
        };
        let e = call().answers(&empty).unwrap_err();
        assert_eq!((e.asked, e.answered), (1, 0));
    }
}
