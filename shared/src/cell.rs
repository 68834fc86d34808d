//! What one process knows about a window key: its current and previous cells, the latest
//! limit and the strict-mode deadline, rolled forward by sequence as time passes.
//!
//! This is the unit every shell holds, whatever it keeps it in (the edge's table, a gateway
//! shard, Envoy shared data): the decision, merge and publish rules all act on it. It is kept
//! to 208 bytes (two cells of 80, the lease history, and what only the current cell needs) so
//! a table slot with its key is 256.

use crate::decision::{Counts, Decision, LimitCheck, WindowCounts};
use crate::lease::LeaseState;
use crate::window::WindowDuration;

/// The flag of [`WindowState::uncertain_from`] saying the lost call was on the previous cell.
pub const UNDO_PREVIOUS: u64 = 1 << 63;

/// One fixed window as a process sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellState {
    /// The region's count as last answered, plus this process's passes since (a lower bound
    /// of the truth), and the other regions' imported sum.
    pub(crate) counts: Counts,
    /// Until when (this process's clock) the lease may be used; 0 while no origin decision has
    /// been merged (cold).
    pub(crate) lease_until: u64,
    /// A failed origin call holds further calls for this cell off until then.
    pub(crate) read_retry_at: u64,
    /// The regional count of the last successful flush to the global table.
    pub(crate) last_flushed: u64,
    /// What this process admitted locally in the cell, cumulative: what a replay carries, so
    /// delivering it twice counts it once. (Passes decided at the origin were counted there.)
    pub(crate) own: u64,
    /// The largest `own` the origin has acknowledged.
    pub(crate) acked: u64,
    /// What the origin passed in the cell for this process's calls, cumulative: counted there,
    /// never replayed, but this process's traffic all the same, so with `own` it is the part
    /// of the window whose decay a covering lease lends back ([`WindowState::lease_share`]).
    /// Counted when a call starts and taken back when its answer says it did not pass: the
    /// origin may count a pass before this process hears of it (or never, if the answer is
    /// lost), and a share counted from less than the origin covers would admit too much.
    pub(crate) decided: u64,
    /// The lease as a ceiling on this process's own part of the weighted count: local passes
    /// while `own + share + cost <= grant`, the share being, for a covering lease, its own
    /// count of the previous cell decayed as the window goes, and for a plain one nothing
    /// ([`WindowState::own_part`]). The origin only ever raises a live ceiling, so answers can
    /// be merged in any order with `max`.
    pub(crate) grant: u64,
    /// The origin's id of the lease `grant` comes from (its reservation deadline, strictly
    /// increasing per process and cell): only a newer lease replaces it, and giving one back
    /// names it, so a late answer or a release crossing a new grant can do no harm.
    pub(crate) lease_id: u64,
}

impl CellState {
    /// A cell nothing is known about yet.
    pub const COLD: CellState = CellState {
        counts: Counts {
            regional: 0,
            global: 0,
        },
        lease_until: 0,
        read_retry_at: 0,
        last_flushed: 0,
        own: 0,
        acked: 0,
        grant: 0,
        lease_id: 0,
        decided: 0,
    };

    /// Regional and imported global counts.
    pub const fn counts(&self) -> Counts {
        self.counts
    }
    /// Whether an origin decision has ever been merged.
    pub const fn is_warm(&self) -> bool {
        self.lease_until != 0
    }
    /// Whether the lease may still be used at `now_ms`.
    pub const fn is_fresh(&self, now_ms: u64) -> bool {
        now_ms < self.lease_until
    }
    /// Deadline of the current lease (0 if never granted).
    pub const fn lease_until(&self) -> u64 {
        self.lease_until
    }
    /// This process's cumulative admitted cost in the cell.
    pub const fn own(&self) -> u64 {
        self.own
    }
    /// What the origin passed in the cell for this process's calls (and calls not answered).
    pub const fn decided(&self) -> u64 {
        self.decided
    }
    /// The id of the lease in use (0: none granted yet).
    pub const fn lease_id(&self) -> u64 {
        self.lease_id
    }
    /// The largest own count the origin acknowledged.
    pub const fn acked(&self) -> u64 {
        self.acked
    }
    /// This process's part of the cell: its local passes and what the origin passed for it.
    pub const fn part(&self) -> u64 {
        self.own.saturating_add(self.decided)
    }
    /// Own cost the origin has not acknowledged yet (what a replay must still deliver).
    pub const fn unacked(&self) -> u64 {
        self.own.saturating_sub(self.acked)
    }
    /// Cost this process may still admit locally under its lease once its share of the
    /// previous window's weight has decayed (ignoring its deadline): on the previous cell,
    /// what it may still admit there; on the current one, at most that
    /// ([`WindowState::lease_room`] is what it may admit now).
    pub const fn lease_left(&self) -> u64 {
        self.grant.saturating_sub(self.own)
    }
    /// The count of the last successful flush.
    pub const fn last_flushed(&self) -> u64 {
        self.last_flushed
    }
    /// Stops using the lease (no local pass under it from now on) and returns its id, which
    /// tells the origin which lease to drop.
    pub(crate) fn stop_lease(&mut self) -> u64 {
        self.grant = self.own;
        self.lease_id
    }
}

/// The state of one window key: two cells, the latest limit and the strict-mode deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowState {
    /// Sequence of the current cell; the previous cell is always `sequence - 1`.
    pub(crate) sequence: u64,
    /// Strict mode has no sequence, so it survives the rollover (a denial near the end of a
    /// window still weighs through the previous-window term of the next).
    pub(crate) strict_until: u64,
    /// The limit of the latest request (the publish floor is a share of it).
    pub(crate) limit: u64,
    pub(crate) current: CellState,
    pub(crate) previous: CellState,
    /// The size of the last lease, so the next ask grows with demand.
    pub(crate) lease: LeaseState,
    /// The latest origin call for the current cell whose outcome this process never learned
    /// (it timed out or failed, and the request was decided by the failure mode); 0: none.
    /// The next call or replay pass asks the origin to undo what that call counted, if it is
    /// the last the origin counted for this process there, so the request counts once. With
    /// [`UNDO_PREVIOUS`] set, the call was on the previous cell (the window rolled before the
    /// undo was taken), whose replay carries it.
    pub(crate) uncertain_from: u64,
    /// The last replay pass (this process's clock) that found the current cell's lease new
    /// or used (own cost waiting for acknowledgement); 0: none since the lease was granted.
    /// A lease is idle when passes found it unused for [`crate::lease::LEASE_IDLE_MS`] after
    /// that.
    pub(crate) idle_since: u64,
}

impl WindowState {
    /// A window key first seen at `now_ms`.
    pub const fn new(duration: WindowDuration, now_ms: u64) -> Self {
        Self {
            sequence: duration.sequence(now_ms),
            strict_until: 0,
            limit: 0,
            current: CellState::COLD,
            previous: CellState::COLD,
            lease: LeaseState::from_bits(0),
            uncertain_from: 0,
            idle_since: 0,
        }
    }

    /// Ages the cells to the window containing `now_ms` and returns the time to decide at.
    /// Time never runs backwards for a key: a clock behind the newest cell decides as at that
    /// cell's start, rather than reviving a window that already rolled over. A lease belongs
    /// to its cell: the previous cell takes no local passes.
    pub fn roll(&mut self, duration: WindowDuration, now_ms: u64) -> u64 {
        self.roll_counting_lost(duration, now_ms).0
    }

    /// [`roll`](Self::roll), also returning own cost dropped unacknowledged with cells that
    /// aged out (only when a window passed without a successful replay).
    pub fn roll_counting_lost(&mut self, duration: WindowDuration, now_ms: u64) -> (u64, u64) {
        let start = duration.start(self.sequence);
        if now_ms >= start && now_ms - start < duration.as_ms() {
            return (now_ms, 0); // still in the current window: no division on the hot path
        }
        let now_ms = now_ms.max(start);
        let sequence = duration.sequence(now_ms);
        if sequence == self.sequence {
            return (now_ms, 0);
        }
        let mut lost = self.previous.unacked();
        self.previous = if sequence == self.sequence.saturating_add(1) {
            CellState {
                grant: 0,
                ..self.current
            }
        } else {
            lost = lost.saturating_add(self.current.unacked());
            CellState::COLD
        };
        self.current = CellState::COLD;
        // A lost call's undo follows its cell into the previous slot, once; call ids stay
        // far below the flag (they count calls, or milliseconds times a thousand).
        self.uncertain_from = match self.uncertain_from {
            u if u != 0
                && u & UNDO_PREVIOUS == 0
                && sequence == self.sequence.saturating_add(1) =>
            {
                u | UNDO_PREVIOUS
            }
            _ => 0,
        };
        self.idle_since = 0;
        self.sequence = sequence;
        (now_ms, lost)
    }

    /// Sequence of the current cell.
    pub const fn sequence(&self) -> u64 {
        self.sequence
    }
    /// The current cell.
    pub const fn current(&self) -> &CellState {
        &self.current
    }
    /// The previous cell (sequence `sequence() - 1`).
    pub const fn previous(&self) -> &CellState {
        &self.previous
    }
    /// The limit of the latest request.
    pub const fn limit(&self) -> u64 {
        self.limit
    }
    /// Until when decisions that would pass locally go to the origin.
    pub const fn strict_until(&self) -> u64 {
        self.strict_until
    }
    /// The latest origin call for the current cell whose outcome was never learned (0: none).
    pub const fn uncertain_from(&self) -> u64 {
        if self.uncertain_from & UNDO_PREVIOUS == 0 {
            self.uncertain_from
        } else {
            0
        }
    }
    /// The same for the previous cell: a call lost before the window rolled, whose undo the
    /// origin has not taken yet (0: none).
    pub const fn uncertain_previous(&self) -> u64 {
        if self.uncertain_from & UNDO_PREVIOUS == 0 {
            0
        } else {
            self.uncertain_from & !UNDO_PREVIOUS
        }
    }
    /// Both cells' counts, as a decision reads them.
    pub const fn counts(&self) -> WindowCounts {
        WindowCounts {
            current: self.current.counts,
            previous: self.previous.counts,
        }
    }

    /// The cell of `sequence`, if this state holds it.
    pub fn cell(&self, sequence: u64) -> Option<&CellState> {
        if sequence == self.sequence {
            Some(&self.current)
        } else if sequence.checked_add(1) == Some(self.sequence) {
            Some(&self.previous)
        } else {
            None
        }
    }

    pub(crate) fn cell_mut(&mut self, sequence: u64) -> Option<&mut CellState> {
        if sequence == self.sequence {
            Some(&mut self.current)
        } else if sequence.checked_add(1) == Some(self.sequence) {
            Some(&mut self.previous)
        } else {
            None
        }
    }

    /// Both cells with their sequences, current first.
    pub fn cells(&self) -> [(u64, &CellState); 2] {
        [
            (self.sequence, &self.current),
            (self.sequence.saturating_sub(1), &self.previous),
        ]
    }

    /// Whether neither cell can affect a decision at `now_ms` any more.
    pub const fn is_expired(&self, duration: WindowDuration, now_ms: u64) -> bool {
        now_ms >= duration.expires_at(self.sequence)
    }

    /// The limit check this state gives for a request, at a `now_ms` already rolled to.
    pub const fn check(&self, duration: WindowDuration, limit: u64, cost: u64) -> LimitCheck {
        LimitCheck {
            counts: self.counts(),
            duration,
            limit,
            cost,
        }
    }

    /// The check a request is decided by at `now_ms` (already rolled to): the cells' counts,
    /// and for a request beyond its lease in strict mode, one request's cost of freed room left
    /// to each rival ([`LeaseState::rivals`]). Without it, each process whose view shows a unit
    /// the window freed asks the origin for it, and all but one of those calls are denied; a
    /// process that lost to `r` others asks once its view shows room for `r + 1` requests, so
    /// near the limit most freed units cost one call. Only a lower bound of the region's use
    /// is raised, so this can deny what an exact limiter admits (at most
    /// [`crate::lease::max_rivals`] requests' worth of room, 1% of the limit or one request,
    /// for as long as no other process takes it), never admit more.
    pub fn view(&self, duration: WindowDuration, limit: u64, cost: u64, now_ms: u64) -> LimitCheck {
        let mut check = self.check(duration, limit, cost);
        if self.current.is_warm()
            && self.beyond_lease(duration, cost, now_ms)
            && self.is_strict(now_ms)
        {
            let held = self.lease.rivals().saturating_mul(cost);
            let current = &mut check.counts.current.regional;
            *current = current.saturating_add(held);
        }
        check
    }

    /// This process's own part of the window's weighted count at `now_ms` (already rolled
    /// to), what its lease's ceiling bounds: its own count of the current cell plus its share
    /// of the previous window's weight ([`WindowDuration::previous_share`]), which shrinks as
    /// that window decays, so the same lease admits more.
    pub fn own_part(&self, duration: WindowDuration, now_ms: u64) -> u64 {
        self.current
            .own
            .saturating_add(self.lease_share(duration, now_ms))
    }

    /// This process's share of the previous window's weight at `now_ms` (already rolled to),
    /// as its lease counts it: the room its past passes still hold (its part of the previous
    /// cell: local ones, and those the origin passed for it), freed as the window goes, if
    /// the lease in use covers it ([`LeaseState::covers`]), else none.
    pub fn lease_share(&self, duration: WindowDuration, now_ms: u64) -> u64 {
        self.share_if(self.lease.covers(), duration, now_ms)
    }

    /// [`lease_share`](Self::lease_share) for a lease that `covers` or not.
    pub(crate) fn share_if(&self, covers: bool, duration: WindowDuration, now_ms: u64) -> u64 {
        if !covers {
            return 0;
        }
        let elapsed = duration.elapsed_ms(self.sequence, now_ms);
        duration.previous_share(self.previous.part(), elapsed)
    }

    /// What this process may still admit locally under its lease at `now_ms` (already
    /// rolled to), ignoring its deadline.
    pub fn lease_room(&self, duration: WindowDuration, now_ms: u64) -> u64 {
        self.current
            .grant
            .saturating_sub(self.own_part(duration, now_ms))
    }

    /// Whether `cost` more at `now_ms` would pass the current cell's lease ceiling.
    pub(crate) fn beyond_lease(&self, duration: WindowDuration, cost: u64, now_ms: u64) -> bool {
        self.own_part(duration, now_ms).saturating_add(cost) > self.current.grant
    }

    /// Whether a recent denial keeps passes beyond the lease at the origin at `now_ms`.
    pub(crate) const fn is_strict(&self, now_ms: u64) -> bool {
        now_ms < self.strict_until
    }

    /// Records the request's limit (the latest one wins: the publish floor follows it).
    pub fn observe_limit(&mut self, limit: u64) {
        self.limit = limit;
    }

    /// Applies a decision made from this state at `now_ms` (already rolled to): a pass adds
    /// the cost to the regional count and to this process's own local count (which the
    /// replay delivers); a denial adds nothing and starts strict mode.
    pub fn apply(&mut self, decision: &Decision, duration: WindowDuration, cost: u64, now_ms: u64) {
        if decision.success {
            self.current.counts.regional = self.current.counts.regional.saturating_add(cost);
            self.current.own = self.current.own.saturating_add(cost);
        } else {
            self.strict_until = self
                .strict_until
                .max(now_ms.saturating_add(duration.as_ms()));
        }
    }

    /// The first half of a decision: rolls to `now_ms`, records the request's limit, and
    /// returns the check to decide: the [`view`](Self::view) a request is decided by when the
    /// origin is there, or the counts alone when the failure mode decides from memory (what
    /// this process knows, with no room left to rivals). The second half,
    /// [`settle`](Self::settle), may wait for the other limits of an all-or-nothing request.
    pub fn prepare(
        &mut self,
        duration: WindowDuration,
        limit: u64,
        cost: u64,
        now_ms: u64,
        from_memory: bool,
    ) -> LimitCheck {
        let now_ms = self.roll(duration, now_ms);
        self.observe_limit(limit);
        if from_memory {
            self.check(duration, limit, cost)
        } else {
            self.view(duration, limit, cost, now_ms)
        }
    }

    /// The second half: applies a decision made at `now_ms` (see [`apply`](Self::apply)).
    pub fn settle(
        &mut self,
        decision: &Decision,
        duration: WindowDuration,
        cost: u64,
        now_ms: u64,
    ) {
        let now_ms = self.roll(duration, now_ms);
        self.apply(decision, duration, cost, now_ms);
    }

    /// Decides one limit locally, whatever the cells' freshness, and applies the result.
    pub fn decide(
        &mut self,
        duration: WindowDuration,
        limit: u64,
        cost: u64,
        now_ms: u64,
    ) -> Decision {
        let now_ms = self.roll(duration, now_ms);
        self.observe_limit(limit);
        let decision = self
            .check(duration, limit, cost)
            .decide_in(self.sequence, now_ms, 0);
        self.apply(&decision, duration, cost, now_ms);
        decision
    }

    /// The lease history (for metrics and tests).
    pub const fn lease(&self) -> &LeaseState {
        &self.lease
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn second() -> WindowDuration {
        WindowDuration::from_ms(1_000).unwrap()
    }

    #[test]
    fn rolling_by_one_window_keeps_the_count_as_previous() {
        let mut s = WindowState::new(second(), 10_500);
        s.current.counts.regional = 4;
        s.roll(second(), 11_200);
        assert_eq!(s.sequence(), 11);
        assert_eq!(s.cell(10).unwrap().counts().regional, 4);
        assert_eq!(s.current().counts(), Counts::default());
        assert!(!s.current().is_warm(), "a new window is cold");
    }

    #[test]
    fn rolling_past_two_windows_forgets_both() {
        let mut s = WindowState::new(second(), 10_500);
        s.current.counts.regional = 4;
        s.roll(second(), 12_000);
        assert_eq!(s.sequence(), 12);
        assert!(s.cell(10).is_none());
        assert_eq!(s.counts(), WindowCounts::default());
    }

    #[test]
    fn a_clock_that_steps_back_does_not_revive_an_old_window() {
        let mut s = WindowState::new(second(), 10_500);
        s.current.counts.regional = 4;
        assert_eq!(s.roll(second(), 9_000), 10_000);
        assert_eq!(s.sequence(), 10);
        assert_eq!(s.current().counts().regional, 4);
    }

    #[test]
    fn denial_counts_nothing_and_starts_strict_mode() {
        let mut s = WindowState::new(second(), 10_000);
        assert!(s.decide(second(), 2, 2, 10_100).success);
        let d = s.decide(second(), 2, 1, 10_200);
        assert!(!d.success);
        assert_eq!(s.current().counts().regional, 2);
        assert_eq!(s.strict_until(), 11_200);
    }

    #[test]
    fn expiry_follows_the_current_sequence() {
        let s = WindowState::new(second(), 10_000);
        assert!(!s.is_expired(second(), 11_999));
        assert!(s.is_expired(second(), 12_000));
    }

    #[test]
    fn a_window_state_is_208_bytes() {
        assert_eq!(core::mem::size_of::<WindowState>(), 208);
    }
}
