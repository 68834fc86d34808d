//! What one process knows about a window key: its current and previous cells and the
//! strict-mode deadline, rolled forward by sequence as time passes.
//!
//! This is the unit every shell holds, whatever it keeps it in (the edge's table, a gateway
//! shard, Envoy shared data): the decision, merge and publish rules all act on it.

use crate::decision::{Counts, Decision, LimitCheck, WindowCounts};
use crate::window::WindowDuration;

/// One fixed window as a process sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellState {
    pub(crate) sequence: u64,
    pub(crate) counts: Counts,
    /// Set once an origin answer (read, replay or decision) has been merged.
    pub(crate) warm: bool,
    /// Until when the last origin answer is trusted without another read.
    pub(crate) fresh_until: u64,
    /// A failed origin call holds further reads of this cell off until then.
    pub(crate) read_retry_at: u64,
    /// The limit of the latest request on this cell (the publish floor is a share of it).
    pub(crate) limit: u64,
    /// The regional count of the last successful flush to the global table.
    pub(crate) last_flushed: u64,
}

impl CellState {
    /// A cell nothing is known about yet.
    pub const fn cold(sequence: u64) -> Self {
        Self {
            sequence,
            counts: Counts {
                regional: 0,
                global: 0,
            },
            warm: false,
            fresh_until: 0,
            read_retry_at: 0,
            limit: 0,
            last_flushed: 0,
        }
    }

    /// The window's sequence.
    pub const fn sequence(&self) -> u64 {
        self.sequence
    }
    /// Regional and imported global counts.
    pub const fn counts(&self) -> Counts {
        self.counts
    }
    /// Whether an origin answer has ever been merged.
    pub const fn is_warm(&self) -> bool {
        self.warm
    }
    /// Whether the last origin answer is still trusted at `now_ms`.
    pub const fn is_fresh(&self, now_ms: u64) -> bool {
        self.warm && now_ms < self.fresh_until
    }
    /// Deadline of the current freshness (0 if never fresh).
    pub const fn fresh_until(&self) -> u64 {
        self.fresh_until
    }
    /// The latest limit seen on this cell.
    pub const fn limit(&self) -> u64 {
        self.limit
    }
    /// The count of the last successful flush.
    pub const fn last_flushed(&self) -> u64 {
        self.last_flushed
    }
}

/// The state of one window key: two cells and the strict-mode deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowState {
    pub(crate) current: CellState,
    pub(crate) previous: CellState,
    /// Strict mode has no sequence, so it survives the rollover (a denial near the end of a
    /// window still weighs through the previous-window term of the next).
    pub(crate) strict_until: u64,
}

impl WindowState {
    /// A window key first seen at `now_ms`.
    pub const fn new(duration: WindowDuration, now_ms: u64) -> Self {
        let sequence = duration.sequence(now_ms);
        Self {
            current: CellState::cold(sequence),
            previous: CellState::cold(sequence.saturating_sub(1)),
            strict_until: 0,
        }
    }

    /// Ages the cells to the window containing `now_ms` and returns the time to decide at.
    /// Time never runs backwards for a key: a clock behind the newest cell decides as at that
    /// cell's start, rather than reviving a window that already rolled over.
    pub fn roll(&mut self, duration: WindowDuration, now_ms: u64) -> u64 {
        let now_ms = now_ms.max(duration.start(self.current.sequence));
        let sequence = duration.sequence(now_ms);
        if sequence == self.current.sequence.saturating_add(1) {
            self.previous = self.current;
            self.current = CellState::cold(sequence);
        } else if sequence != self.current.sequence {
            self.previous = CellState::cold(sequence.saturating_sub(1));
            self.current = CellState::cold(sequence);
        }
        now_ms
    }

    /// The current cell.
    pub const fn current(&self) -> &CellState {
        &self.current
    }
    /// The previous cell.
    pub const fn previous(&self) -> &CellState {
        &self.previous
    }
    /// Until when decisions that would pass locally go to the origin.
    pub const fn strict_until(&self) -> u64 {
        self.strict_until
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
        [&self.current, &self.previous]
            .into_iter()
            .find(|c| c.sequence == sequence)
    }

    pub(crate) fn cell_mut(&mut self, sequence: u64) -> Option<&mut CellState> {
        if self.current.sequence == sequence {
            Some(&mut self.current)
        } else if self.previous.sequence == sequence {
            Some(&mut self.previous)
        } else {
            None
        }
    }

    /// Both cells, current first.
    pub fn cells(&self) -> [&CellState; 2] {
        [&self.current, &self.previous]
    }

    /// Whether neither cell can affect a decision at `now_ms` any more.
    pub const fn is_expired(&self, duration: WindowDuration, now_ms: u64) -> bool {
        now_ms >= duration.expires_at(self.current.sequence)
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

    /// Records the request's limit (the latest one wins: the publish floor follows it).
    pub fn observe_limit(&mut self, limit: u64) {
        self.current.limit = limit;
    }

    /// Applies a decision made from this state at `now_ms` (already rolled to): a pass adds
    /// the cost to the regional count; a denial adds nothing and starts strict mode.
    pub fn apply(&mut self, decision: &Decision, duration: WindowDuration, cost: u64, now_ms: u64) {
        if decision.success {
            self.current.counts.regional = self.current.counts.regional.saturating_add(cost);
        } else {
            self.strict_until = self
                .strict_until
                .max(now_ms.saturating_add(duration.as_ms()));
        }
    }

    /// Decides one limit locally and applies the result.
    pub fn decide(
        &mut self,
        duration: WindowDuration,
        limit: u64,
        cost: u64,
        now_ms: u64,
    ) -> Decision {
        let now_ms = self.roll(duration, now_ms);
        self.observe_limit(limit);
        let decision = self.check(duration, limit, cost).decide(now_ms, 0);
        self.apply(&decision, duration, cost, now_ms);
        decision
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
        assert_eq!(s.current().sequence(), 11);
        assert_eq!(s.previous().sequence(), 10);
        assert_eq!(s.previous().counts().regional, 4);
        assert_eq!(s.current().counts(), Counts::default());
        assert!(!s.current().is_warm(), "a new window is cold");
    }

    #[test]
    fn rolling_past_two_windows_forgets_both() {
        let mut s = WindowState::new(second(), 10_500);
        s.current.counts.regional = 4;
        s.roll(second(), 12_000);
        assert_eq!(s.previous().sequence(), 11);
        assert_eq!(s.counts(), WindowCounts::default());
    }

    #[test]
    fn a_clock_that_steps_back_does_not_revive_an_old_window() {
        let mut s = WindowState::new(second(), 10_500);
        s.current.counts.regional = 4;
        assert_eq!(s.roll(second(), 9_000), 10_000);
        assert_eq!(s.current().sequence(), 10);
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
}
