//! Deciding at the origin: when a decision must be made there and why, and what an origin
//! decision, a replay answer or a failure does to a window key's state.
//!
//! Counts within a cell only grow, so answers merge with `max` and can arrive late, twice or
//! out of order without harm. Only an origin decision grants a lease (see [`crate::lease`]).

use crate::cell::WindowState;
use crate::decision::{Counts, Decision};
use crate::lease::{self, LEASE_IDLE_MS, SURPLUS_FLOOR, SURPLUS_FLOOR_DIVISOR};
use crate::window::WindowDuration;

pub use crate::policy::{DEFAULT_LEASE_MS, DEFAULT_READ_RETRY_MS, OriginPolicy, Reason};

/// A decision the local view cannot make safely: what to ask the origin, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OriginPlan {
    /// Sequence of the current cell on this process's clock.
    pub sequence: u64,
    /// When the plan was made (this process's clock): a granted lease runs from here, which
    /// is never later than the origin's start of it.
    pub at_ms: u64,
    /// Why.
    pub reason: Reason,
    /// The id of the lease this process gives back (0: none): whatever is left of it, the
    /// process stopped using when it made the plan (so no concurrent local pass can use it
    /// while the call travels); the origin drops it once `used` is merged, if no newer one
    /// replaced it, so it does not count against this very request.
    pub release: u64,
    /// This process's own cumulative local passes in the current and previous cells: the
    /// origin folds them in with `max`, so what no replay delivered yet still counts, once.
    pub used: [u64; 2],
    /// What the origin passed for this process in the same cells, as far as it knows
    /// ([`crate::cell::CellState::decided`]): the origin lends a covering lease the decay of
    /// at most that much of the previous cell beside `used`.
    pub decided: [u64; 2],
    /// The lease to ask for beyond the request's cost.
    pub want: u64,
    /// This call's id (per process, only growing; set by the table that plans it).
    pub call: u64,
    /// Undo what this process's call with this id counted, if the origin counted none of its
    /// calls since (0: nothing): its outcome was never learned, and the failure mode decided
    /// that request instead.
    pub undo_from: u64,
}

/// An origin's answer to a decision request, for one limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OriginAnswer {
    /// The limit applied.
    pub limit: u64,
    /// What is left, as the origin computed it.
    pub remaining: u64,
    /// Unix ms at which the current window ends.
    pub reset_ms: u64,
    /// The current sequence on the origin's clock.
    pub sequence: u64,
    /// Whether the origin added the cost (the whole request passed there).
    pub counted: bool,
    /// Whether this limit itself denied (starts strict mode).
    pub denied: bool,
    /// The current cell after the decision.
    pub current: Counts,
    /// The previous cell.
    pub previous: Counts,
    /// The caller's cumulative local passes in the current cell as the origin holds them.
    pub used: u64,
    /// The lease: the caller may admit locally until its local passes reach `used + lease`.
    pub lease: u64,
    /// The lease's id (0 with no lease).
    pub lease_id: u64,
    /// For how long from the request.
    pub lease_ms: u64,
    /// Whether the lease covers this process's share of the previous window's weight
    /// (its ceiling bounds [`WindowState::own_part`], not its own count alone).
    pub covers: bool,
}

/// Where a request's decision is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The local view decides: a denial (always safe: it is a lower bound), or a pass the
    /// lease covers.
    Local(Decision),
    /// The origin must decide.
    Origin(OriginPlan),
    /// The origin must decide, but a call on this cell failed moments ago (within
    /// [`OriginPolicy::read_retry_ms`]): no call now, the failure mode decides. The local
    /// view's decision, for [`FailureMode::Local`](crate::policy::FailureMode::Local).
    Unreachable(Decision),
}

impl WindowState {
    /// The decision order at `now_ms` (already rolled to): (1) the local view denies: deny
    /// locally, whatever the cells' state, so traffic over its limit costs no round trip;
    /// (2) cold, stale, or a lease too small: decide at the origin (while strict, asking for
    /// no larger lease than the last), giving back the lease in use (the caller stops using
    /// it: [`Self::begin_origin`]), unless a call failed moments ago: then the failure mode
    /// decides, with no call, until the retry delay has passed; (3) otherwise pass locally,
    /// from the lease: whatever else happened, the origin reserved it for this process.
    pub fn classify(
        &self,
        duration: WindowDuration,
        limit: u64,
        cost: u64,
        now_ms: u64,
    ) -> Verdict {
        let local = self
            .view(duration, limit, cost, now_ms)
            .decide_in(self.sequence, now_ms, 0);
        if !local.success {
            return Verdict::Local(local);
        }
        let reason = if !self.current.is_warm() {
            Reason::Cold
        } else if self.beyond_lease(duration, cost, now_ms) {
            if self.is_strict(now_ms) {
                Reason::Strict
            } else {
                Reason::Lease
            }
        } else if now_ms >= self.current.lease_until {
            Reason::Stale
        } else {
            return Verdict::Local(local);
        };
        if now_ms < self.current.read_retry_at {
            // The failure mode decides from the counts alone (nothing left to rivals).
            let known = self
                .check(duration, limit, cost)
                .decide_in(self.sequence, now_ms, 0);
            return Verdict::Unreachable(known);
        }
        Verdict::Origin(OriginPlan {
            sequence: self.sequence,
            at_ms: now_ms,
            reason,
            release: self.current.lease_id,
            used: [self.current.own, self.previous.own],
            decided: [self.current.decided, self.previous.decided],
            want: self.lease.want(
                reason,
                cost,
                limit,
                lease::leaves_half(local.remaining, limit),
            ),
            call: 0,
            undo_from: self.uncertain_from(),
        })
    }

    /// Merges the origin's decision for one limit, made for `plan`: both cells' counts with
    /// `max` (a pass was counted there, in the region's count); the own count the origin holds
    /// (an entry evicted and created again learns what it had replayed); a newer lease sets
    /// the ceiling on local passes until `plan.at_ms + lease_ms`; a denial starts strict mode. Returns the decision to answer
    /// the client with: the origin's verdict and remaining, and (for a denial) a retry-after
    /// computed from the merged counts.
    pub fn apply_decided(
        &mut self,
        duration: WindowDuration,
        plan: &OriginPlan,
        answer: &OriginAnswer,
        cost: u64,
        now_ms: u64,
    ) -> Decision {
        let now_ms = self.roll(duration, now_ms);
        self.merge_counts(answer.sequence, answer.current);
        self.merge_counts(answer.sequence.saturating_sub(1), answer.previous);
        // The call counted its cost as decided in its cell when it started: taken back if it
        // did not pass. If the origin counted it in another cell (a call that straddled a
        // boundary), it moves there: the next call's word for the cell it left would count
        // it a second time there (the origin merges that word with `max`). Only when this
        // process has no cell of the origin's yet (its clock behind) does it stay where it
        // was: more than the origin counts is safe for the share, less is not.
        let passed = answer.counted && !answer.denied;
        if !passed {
            if let Some(cell) = self.cell_mut(plan.sequence) {
                cell.decided = cell.decided.saturating_sub(cost);
            }
        } else if answer.sequence != plan.sequence
            && let Some(cell) = self.cell_mut(answer.sequence)
        {
            cell.decided = cell.decided.saturating_add(cost);
            if let Some(planned) = self.cell_mut(plan.sequence) {
                planned.decided = planned.decided.saturating_sub(cost);
            }
        }
        if let Some(previous) = self.cell_mut(answer.sequence.saturating_sub(1)) {
            previous.lease_until = previous.lease_until.max(1);
            if plan.sequence == answer.sequence {
                // The call carried this process's own count of that cell, which the origin
                // merged: the replay need not carry it again (a key in use reaches a new
                // window with a decision, which so delivers the last one's tail).
                previous.acked = previous.acked.max(plan.used[1]);
            }
        }
        if answer.sequence == self.sequence {
            // This process's previous share now: the room its own past passes free as the
            // previous window decays, which a covering lease's ceiling counts beside its own
            // count.
            let share = self.share_if(answer.covers, duration, now_ms);
            let cell = &mut self.current;
            cell.own = cell.own.max(answer.used);
            cell.acked = cell.acked.max(answer.used);
            // The origin's count holds `answer.used` of this process's own passes; those it
            // had not heard of come on top. Merged with `max` alone, an answer counted after
            // passes this process made meanwhile (another call's lease, answered first) would
            // swallow as many of the origin's passes, and a failure mode deciding from this
            // count would admit them again.
            let unheard = cell.own.saturating_sub(answer.used);
            let known = answer.current.regional.saturating_add(unheard);
            cell.counts.regional = cell.counts.regional.max(known);
            cell.read_retry_at = 0;
            // This call carried the undo of every call since `uncertain_from`.
            if plan.undo_from != 0 && plan.undo_from == self.uncertain_from {
                self.uncertain_from = 0;
            }
            // Only a newer lease replaces the one in use (answers to concurrent calls arrive
            // in any order); the origin's newer lease always covers the older one.
            if answer.lease > 0 && answer.lease_id > cell.lease_id {
                self.idle_since = 0;
                cell.grant = answer.used.saturating_add(answer.lease);
                cell.lease_id = answer.lease_id;
                cell.lease_until = plan.at_ms.saturating_add(answer.lease_ms);
                // Demand is the grant beyond that share: the next ask grows from it.
                self.lease.granted(answer.lease.saturating_sub(share));
                self.lease.set_covers(answer.covers);
            } else if answer.lease == 0 && plan.want > 0 && cell.grant <= cell.own {
                // Asked and lent nothing (others' leases hold what the counts leave): a lease
                // of 0 for a lifetime, so no request passes ahead of the origin's answer
                // meanwhile (see `request::begin`). Nothing can be admitted under it.
                cell.lease_until = cell
                    .lease_until
                    .max(plan.at_ms.saturating_add(answer.lease_ms));
            }
            // Never 0 once answered: 0 means cold.
            cell.lease_until = cell.lease_until.max(1);
        } else if answer.sequence.checked_add(1) == Some(self.sequence)
            && answer.lease > 0
            && answer.lease_id > self.previous.lease_id
        {
            // Lent on a cell this process's clock left before the answer came: it passes
            // nothing there, so the lease is held only to go back with the next replay
            // (`take_replay_events`); kept unnamed, the origin would reserve it until it
            // expired.
            let cell = &mut self.previous;
            cell.lease_id = answer.lease_id;
            cell.grant = answer.used.saturating_add(answer.lease);
        }
        if answer.denied {
            // The view passed it: another process took the room this one saw freed.
            self.lease
                .lost_race(self.is_strict(now_ms), answer.limit, cost);
            self.strict_until = self
                .strict_until
                .max(now_ms.saturating_add(duration.as_ms()));
        } else if answer.counted && plan.reason == Reason::Strict {
            self.lease.won_race(answer.remaining, cost);
        }
        let success = answer.counted && !answer.denied;
        let retry_after_ms = if success {
            Some(0)
        } else {
            // On our clock, from what we now know; if clocks disagree and it would pass here,
            // tell the client to try again at once rather than claim it never passes.
            let local =
                self.view(duration, answer.limit, cost, now_ms)
                    .decide_in(self.sequence, now_ms, 0);
            if local.success {
                Some(1)
            } else {
                local.retry_after_ms
            }
        };
        Decision {
            success,
            limit: answer.limit,
            remaining: answer.remaining,
            reset_ms: answer.reset_ms,
            retry_after_ms,
        }
    }

    /// Called by each replay pass: whether the current cell's lease should go back to the
    /// origin. It must be live, at least a quarter of what the limit leaves in this process's
    /// view, and unused for [`LEASE_IDLE_MS`] as the passes saw it (a lease just granted, or
    /// one with own cost unacknowledged, only starts the count). An unused lease near the limit denies other
    /// processes what this one does not need; giving back one that is only between a key's
    /// requests costs a round trip per request (10,000 keys at 5 requests a second each).
    pub fn idle_lease(&mut self, now_ms: u64) -> bool {
        let limit = self.limit;
        let cell = &mut self.current;
        let left = cell.lease_left();
        let near = left.saturating_mul(4) >= limit.saturating_sub(cell.counts.total());
        if left == 0 || !cell.is_fresh(now_ms) || !near {
            self.idle_since = 0;
            return false;
        }
        // Own cost still unacknowledged: used since the last pass's replay (or that replay
        // is not through yet); either way not idle.
        if self.idle_since == 0 || cell.unacked() > 0 {
            self.idle_since = now_ms.max(1);
            return false;
        }
        now_ms.saturating_sub(self.idle_since) >= LEASE_IDLE_MS
    }

    /// Called by each replay pass: whether the current cell's covering lease, near the limit,
    /// holds more room unused than it was lent (the lent room being at least
    /// [`SURPLUS_FLOOR`] units and 0.25% of the limit) and one unit more: the room this process's own past passes freed as the
    /// previous window decayed, which a covering lease lends it ([`crate::lease::covers`]),
    /// piles up when its traffic slows, and the origin keeps it from the others until the
    /// lease ends. Given back, the next request asks for a lease sized afresh. The unit more:
    /// a holder paced at its share's decay sees its room cross the lent room by a unit now and
    /// then (its requests and its share's steps do not fall at the same instants), and giving
    /// the lease back each time cost it a call for a unit it was about to use. The floor is
    /// small: several holders of a key each keep up to that much unused, which the origin
    /// denies to the others (at 0.5% of the limit, five holders with random arrivals at the
    /// limit admitted 1.2% under an exact limiter, once their shares counted what the origin
    /// passed for them; at 3 units of 1,000, 1.0%, as before those were counted).
    pub fn lease_surplus(&self, duration: WindowDuration, now_ms: u64) -> bool {
        let lent = self
            .lease
            .last_grant()
            .max(self.limit / SURPLUS_FLOOR_DIVISOR)
            .max(SURPLUS_FLOOR);
        self.lease.covers()
            && self.current.is_fresh(now_ms)
            && !self.lease_is_far(duration, now_ms)
            && self.lease_room(duration, now_ms) > lent.saturating_add(1)
    }

    /// Starts the origin call of `plan` for a request of `cost`: stops using the lease it
    /// gives back, and counts the cost as decided there until the answer says otherwise
    /// ([`CellState::decided`]).
    pub fn begin_origin(&mut self, plan: &OriginPlan, cost: u64) {
        if plan.release > 0 && plan.release == self.current.lease_id {
            self.release_lease();
        }
        if let Some(cell) = self.cell_mut(plan.sequence) {
            cell.decided = cell.decided.saturating_add(cost);
        }
    }

    /// Gives back the current cell's lease the replay found idle ([`Self::idle_lease`]): stops
    /// using it and ends its lifetime now, so the key has no live answer (its next request may
    /// pass ahead of the decision that follows). Returns its id.
    pub fn give_back_idle(&mut self, now_ms: u64) -> u64 {
        self.current.lease_until = self.current.lease_until.min(now_ms).max(1);
        self.release_lease()
    }

    /// Stops using the current cell's lease (before telling the origin it may drop it);
    /// returns its id. Answers about this lease or older ones no longer revive it.
    pub fn release_lease(&mut self) -> u64 {
        self.current.stop_lease()
    }

    /// Merges a replay answer: `counts` of cell `sequence` after the origin took this
    /// process's own cumulative count `delivered` (and undid its calls from `undone` on, if
    /// not 0). An acknowledged pass is an answer: the cell is no longer cold (its count is the
    /// region's, as of the replay), though it holds no lease, so a pass ahead of the origin's
    /// answer needs no decision of its own.
    pub fn apply_replay(
        &mut self,
        sequence: u64,
        counts: Counts,
        delivered: u64,
        undone: u64,
    ) -> bool {
        let pending = if sequence == self.sequence {
            self.uncertain_from()
        } else if sequence.checked_add(1) == Some(self.sequence) {
            self.uncertain_previous()
        } else {
            0
        };
        if undone != 0 && undone == pending {
            self.uncertain_from = 0;
        }
        let Some(cell) = self.cell_mut(sequence) else {
            return false;
        };
        cell.counts.merge(counts);
        cell.acked = cell.acked.max(delivered);
        if delivered > 0 {
            cell.lease_until = cell.lease_until.max(1);
        }
        true
    }

    /// Merges the renewal of lease `renewed` on cell `sequence`: it goes on under `lease_id`
    /// until `until_ms`, if it is still the current cell's lease in use.
    pub fn apply_renewal(&mut self, sequence: u64, renewed: u64, lease_id: u64, until_ms: u64) {
        let cell = &mut self.current;
        if sequence == self.sequence && cell.lease_id == renewed && lease_id > renewed {
            cell.lease_id = lease_id;
            cell.lease_until = cell.lease_until.max(until_ms);
        }
    }

    /// Merges counts of cell `sequence` seen elsewhere (a read, the region view) with `max`;
    /// grants nothing. Returns false if the state no longer holds that cell.
    pub fn merge_counts(&mut self, sequence: u64, counts: Counts) -> bool {
        let Some(cell) = self.cell_mut(sequence) else {
            return false;
        };
        cell.counts.merge(counts);
        true
    }

    /// Records that origin call `plan` failed: the lease stays as it was (a failure proves
    /// nothing), no call is tried again for `read_retry_ms` (decisions are local meanwhile),
    /// and the next call asks the origin to undo what this one may have counted.
    pub fn fail_origin(&mut self, plan: &OriginPlan, now_ms: u64, policy: &OriginPolicy) {
        self.current.read_retry_at = now_ms.saturating_add(policy.read_retry_ms);
        // The latest lost call is the one the origin may hold as this process's last counted
        // one (it undoes only that); it also takes the place of one lost on the previous cell
        // (whose undo the next replay pass would have carried).
        if plan.sequence == self.sequence && plan.call > self.uncertain_from() {
            self.uncertain_from = plan.call;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minute() -> WindowDuration {
        WindowDuration::from_ms(60_000).unwrap()
    }
    const T: u64 = 60_000 * 100;

    fn answer(plan: &OriginPlan, counted: bool, current: u64, lease: u64) -> OriginAnswer {
        OriginAnswer {
            limit: 10,
            remaining: 0,
            reset_ms: T + 60_000,
            sequence: plan.sequence,
            counted,
            denied: !counted,
            current: Counts {
                regional: current,
                global: 0,
            },
            previous: Counts::default(),
            used: plan.used[0],
            lease,
            lease_id: u64::from(lease > 0),
            lease_ms: DEFAULT_LEASE_MS,
            covers: false,
        }
    }

    fn plan(s: &WindowState, now: u64) -> OriginPlan {
        match s.classify(minute(), 10, 1, now) {
            Verdict::Origin(p) => p,
            Verdict::Local(d) => panic!("decided locally: {d:?}"),
            Verdict::Unreachable(d) => panic!("held off after a failure: {d:?}"),
        }
    }

    #[test]
    fn a_call_counts_as_decided_from_its_start_until_its_answer_says_it_did_not_pass() {
        let mut s = WindowState::new(minute(), T);
        let p = plan(&s, T);
        assert_eq!(p.decided, [0, 0]);
        s.begin_origin(&p, 3);
        assert_eq!(s.current().decided(), 3, "in flight: maybe counted there");
        s.apply_decided(minute(), &p, &answer(&p, false, 0, 0), 3, T);
        assert_eq!(s.current().decided(), 0, "denied: taken back");
        let p = plan(&s, T + 1);
        s.begin_origin(&p, 2);
        s.apply_decided(minute(), &p, &answer(&p, true, 2, 0), 2, T + 1);
        assert_eq!(s.current().decided(), 2, "passed: kept");
        let lost = plan(&s, T + 2);
        s.begin_origin(&lost, 1);
        s.fail_origin(&lost, T + 2, &OriginPolicy::default());
        assert_eq!(
            s.current().decided(),
            3,
            "no answer: kept (the origin may have counted it)"
        );
        // The next window's share counts both kinds of the cell's passes.
        s.decide(minute(), 100, 4, T + 3);
        s.roll(minute(), T + 60_000);
        assert_eq!((s.previous().own(), s.previous().part()), (4, 7));
    }

    #[test]
    fn a_pass_the_origin_counted_in_another_cell_moves_there_when_this_process_holds_it() {
        let end = T + 60_000;
        // Planned in the window that ends, counted in the next; merged after it began.
        let mut s = WindowState::new(minute(), end - 1);
        let p = plan(&s, end - 1);
        s.begin_origin(&p, 2);
        let next = OriginAnswer {
            sequence: p.sequence + 1,
            ..answer(&p, true, 2, 0)
        };
        s.apply_decided(minute(), &p, &next, 2, end + 1);
        assert_eq!((s.previous().decided(), s.current().decided()), (0, 2));
        // Merged while this process's clock is still in the window that ends: it holds no
        // cell of the origin's, so the pass stays where it was (more is safe, less is not).
        let mut s = WindowState::new(minute(), end - 2);
        let p = plan(&s, end - 2);
        s.begin_origin(&p, 2);
        s.apply_decided(minute(), &p, &next, 2, end - 1);
        assert_eq!(s.current().decided(), 2);
    }

    #[test]
    fn a_new_key_is_decided_at_the_origin() {
        let s = WindowState::new(minute(), T);
        let p = plan(&s, T);
        assert_eq!(p.reason, Reason::Cold);
        assert_eq!(p.used, [0, 0]);
        assert_eq!(p.want, 10, "as much as the origin will lend");
    }

    #[test]
    fn a_lease_covers_local_passes_until_it_runs_out_or_expires() {
        let mut s = WindowState::new(minute(), T);
        let p = plan(&s, T);
        let d = s.apply_decided(minute(), &p, &answer(&p, true, 1, 2), 1, T);
        assert!(d.success);
        assert_eq!(s.current().counts().regional, 1, "counted at the origin");
        assert_eq!((s.current().own(), s.current().lease_left()), (0, 2));
        let later = T + DEFAULT_LEASE_MS;
        assert_eq!(
            plan(&s, later).reason,
            Reason::Stale,
            "expired, though not used up"
        );
        for _ in 0..2 {
            assert!(matches!(s.classify(minute(), 10, 1, T + 1), Verdict::Local(d) if d.success));
            s.decide(minute(), 10, 1, T + 1);
        }
        let p = plan(&s, T + 2);
        assert_eq!(p.reason, Reason::Lease);
        assert_eq!(p.used, [2, 0]);
        assert_eq!(p.want, 4, "slow start: twice the last grant");
    }

    #[test]
    fn a_denial_keeps_the_lease_and_strict_mode_stops_its_growth() {
        let mut s = WindowState::new(minute(), T);
        let p = plan(&s, T);
        s.apply_decided(minute(), &p, &answer(&p, true, 1, 2), 1, T);
        let p = OriginPlan {
            reason: Reason::Lease,
            ..p
        };
        // Denied for others' leases, which the local view does not see.
        let d = s.apply_decided(minute(), &p, &answer(&p, false, 1, 0), 3, T + 1);
        assert!(!d.success);
        assert_eq!(s.current().lease_left(), 2, "the origin keeps it too");
        assert_eq!(s.strict_until(), T + 1 + 60_000);
        for _ in 0..2 {
            assert!(matches!(s.classify(minute(), 10, 1, T + 2), Verdict::Local(d) if d.success));
            s.decide(minute(), 10, 1, T + 2);
        }
        let p = plan(&s, T + 2);
        assert_eq!(
            (p.reason, p.want),
            (Reason::Strict, 2),
            "no growth while strict"
        );
    }

    #[test]
    fn a_process_that_lost_a_race_asks_once_room_shows_for_it_and_its_rival() {
        let lost_at = |current: u64| {
            let mut s = WindowState::new(minute(), T);
            let p = plan(&s, T);
            s.apply_decided(minute(), &p, &answer(&p, true, 5, 0), 1, T);
            let p = plan(&s, T + 1);
            assert_eq!(p.reason, Reason::Lease, "5 of 10: the view passes");
            // Another process took the room: the origin denies what the view passed.
            let d = s.apply_decided(minute(), &p, &answer(&p, false, current, 0), 1, T + 1);
            assert!(!d.success);
            assert_eq!(s.lease().rivals(), 1);
            s
        };
        let s = lost_at(9);
        let d = s
            .view(minute(), 10, 1, T + 2)
            .decide_in(s.sequence(), T + 2, 0);
        assert!(
            !d.success,
            "9 of 10 and a rival: its unit is left to the rival"
        );
        assert!(
            s.check(minute(), 10, 1).decide(T + 2, 0).success,
            "without the rival: a pass"
        );
        assert!(matches!(s.classify(minute(), 10, 1, T + 2), Verdict::Local(d) if !d.success));
        let s = lost_at(8);
        assert_eq!(plan(&s, T + 2).reason, Reason::Strict, "room for both: ask");
    }

    #[test]
    fn only_a_newer_lease_replaces_the_one_in_use() {
        let mut s = WindowState::new(minute(), T);
        let p = plan(&s, T);
        // The origin answered a first call with lease 1 (ceiling 0 + 8), then a second, after
        // a replay of 2 local passes, with lease 2 (it kept the live ceiling: 2 + 6). The
        // answers arrive reversed: the older one changes nothing.
        let later = OriginAnswer {
            used: 2,
            lease_id: 2,
            ..answer(&p, true, 2, 6)
        };
        s.apply_decided(minute(), &p, &later, 1, T);
        s.apply_decided(minute(), &p, &answer(&p, true, 2, 8), 1, T);
        assert_eq!((s.current().own(), s.current().lease_id()), (2, 2));
        assert_eq!(s.current().lease_left(), 6);
        // Given back, it stays given back, whatever answer about it arrives late.
        assert_eq!(s.release_lease(), 2);
        s.apply_decided(minute(), &p, &later, 1, T);
        assert_eq!(s.current().lease_left(), 0);
    }

    #[test]
    fn the_origins_own_count_wins_over_a_forgotten_local_one() {
        // An entry evicted and created again starts at own 0; the origin remembers 30.
        let mut s = WindowState::new(minute(), T);
        let p = plan(&s, T);
        let a = OriginAnswer {
            used: 31,
            ..answer(&p, true, 31, 4)
        };
        s.apply_decided(minute(), &p, &a, 1, T);
        assert_eq!(s.current().own(), 31);
        assert_eq!(s.current().lease_left(), 4);
    }

    #[test]
    fn a_failed_call_holds_calls_off_until_the_retry_delay_then_asks_for_its_undo() {
        let policy = OriginPolicy::default();
        let mut s = WindowState::new(minute(), T);
        let failed = OriginPlan {
            call: 4,
            ..plan(&s, T)
        };
        s.fail_origin(&failed, T, &policy);
        // Cold within the delay: no call, the failure mode decides (from this local view).
        assert!(matches!(
            s.classify(minute(), 10, 1, T + 299),
            Verdict::Unreachable(d) if d.success
        ));
        // A denial the local view proves needs no origin, delay or not.
        assert!(matches!(
            s.classify(minute(), 0, 1, T + 299),
            Verdict::Local(d) if !d.success
        ));
        let next = plan(&s, T + 300);
        assert_eq!((next.reason, next.undo_from), (Reason::Cold, 4));
        // Its answer arrives: the undo was carried, nothing is uncertain any more.
        s.apply_decided(minute(), &next, &answer(&next, true, 1, 0), 1, T + 300);
        assert_eq!(s.uncertain_from(), 0);
    }

    #[test]
    fn strict_mode_survives_the_sequence_rollover() {
        let mut s = WindowState::new(minute(), T);
        let p = plan(&s, T);
        s.apply_decided(minute(), &p, &answer(&p, true, 1, 5), 1, T);
        // Denied 10 s before the end of window 100.
        let d = s.decide(minute(), 0, 1, T + 50_000);
        assert!(!d.success);
        let now = T + 61_000; // window 101
        s.roll(minute(), now);
        let p = plan(&s, now);
        s.apply_decided(minute(), &p, &answer(&p, true, 1, 0), 1, now);
        assert_eq!(plan(&s, now + 1).reason, Reason::Strict);
    }

    #[test]
    fn a_replay_answer_acknowledges_the_own_count_once() {
        let mut s = WindowState::new(minute(), T);
        s.decide(minute(), 10, 3, T);
        assert_eq!(s.current().unacked(), 3);
        let c = Counts {
            regional: 5,
            global: 0,
        };
        assert!(s.apply_replay(100, c, 3, 0));
        assert!(s.apply_replay(100, c, 3, 0), "twice is harmless");
        assert_eq!(s.current().unacked(), 0);
        assert_eq!(s.current().counts().regional, 5);
        assert!(!s.apply_replay(98, c, 1, 0), "not held");
    }
}
