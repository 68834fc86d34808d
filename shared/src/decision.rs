//! The sliding-window decision: one limit, and all-or-nothing over several.
//!
//! `effective = cur.regional + cur.global + floor((prev.regional + prev.global) * (1 - elapsed)) + cost`,
//! pass iff `effective <= limit`. These functions only compute; whoever holds the counts (the
//! local table, the embedded origin, the Redis script) applies the increment on a pass.

use alloc::vec::Vec;

use crate::window::WindowDuration;

/// The two separately kept counts of one cell: what this region counted, and what other
/// regions published (imported from the global table). Only `regional` is ever published.
/// It is also the `{"regional","global"}` object of the wire format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Counts {
    /// This region's count.
    pub regional: u64,
    /// The sum of the other regions' published components.
    pub global: u64,
}

impl Counts {
    /// Both counts together, as a decision sees them.
    pub const fn total(&self) -> u64 {
        self.regional.saturating_add(self.global)
    }

    /// Merges another view of the same cell: counts only grow within a cell, so the larger
    /// value of each field is the newer one.
    pub fn merge(&mut self, other: Counts) {
        self.regional = self.regional.max(other.regional);
        self.global = self.global.max(other.global);
    }
}

/// The counts of the current and the previous window of one window key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowCounts {
    /// The window containing `now`.
    pub current: Counts,
    /// The window before it.
    pub previous: Counts,
}

/// One limit to check: the counts it reads, and what the request asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitCheck {
    /// Counts of the window key at `now`.
    pub counts: WindowCounts,
    /// Window length.
    pub duration: WindowDuration,
    /// Allowed cost per window; 0 denies everything.
    pub limit: u64,
    /// What this request costs; 0 only checks.
    pub cost: u64,
}

/// The outcome of one limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request may proceed.
    pub success: bool,
    /// The limit that was applied.
    pub limit: u64,
    /// On a pass, what is left after this request; otherwise what the caller could still spend.
    pub remaining: u64,
    /// Unix ms at which the current fixed window ends.
    pub reset_ms: u64,
    /// Milliseconds until the same request would pass if nothing else arrived: 0 on a pass,
    /// `None` when it can never pass (its cost exceeds the limit).
    pub retry_after_ms: Option<u64>,
}

impl Decision {
    /// The same decision with its cost not counted (a multi-limit request another limit denied).
    pub fn uncounted(self, cost: u64) -> Self {
        if !self.success {
            return self;
        }
        Self {
            remaining: self.remaining.saturating_add(cost).min(self.limit),
            ..self
        }
    }
}

impl LimitCheck {
    /// Decides this limit at `now_ms`. `pending` is cost that earlier limits of the same
    /// request already placed on the same cell (it counts as if admitted).
    pub fn decide(&self, now_ms: u64, pending: u64) -> Decision {
        self.decide_in(self.duration.sequence(now_ms), now_ms, pending)
    }

    /// [`decide`](Self::decide) when the caller already knows `sequence = now / duration`
    /// (the local table does: it just rolled to it), saving a division on the hot path.
    pub fn decide_in(&self, sequence: u64, now_ms: u64, pending: u64) -> Decision {
        let d = self.duration;
        let elapsed = d.elapsed_ms(sequence, now_ms);
        let current = self.counts.current.total().saturating_add(pending);
        let previous = self.counts.previous.total();
        let used = current.saturating_add(d.previous_weight(previous, elapsed));
        let effective = used.saturating_add(self.cost);
        let reset_ms = d.reset(sequence);
        // Limit 0 denies everything, even a cost-0 check.
        let success = self.limit > 0 && effective <= self.limit;
        let (remaining, retry_after_ms) = if success {
            (self.limit - effective, Some(0))
        } else {
            let when = self.earliest_pass(sequence, current, previous, elapsed);
            (
                self.limit.saturating_sub(used),
                when.map(|at| at.saturating_sub(now_ms)),
            )
        };
        Decision {
            success,
            limit: self.limit,
            remaining,
            reset_ms,
            retry_after_ms,
        }
    }

    /// How much of the previous window's weight decays between `now_ms` and `span_ms` later
    /// (never past this window's end): room that frees up with no one's count changing.
    pub fn freed_within(&self, now_ms: u64, span_ms: u64) -> u64 {
        let d = self.duration;
        let elapsed = d.elapsed_ms(d.sequence(now_ms), now_ms);
        let later = elapsed.saturating_add(span_ms).min(d.as_ms());
        let previous = self.counts.previous.total();
        d.previous_weight(previous, elapsed)
            .saturating_sub(d.previous_weight(previous, later))
    }

    /// Unix ms at which this request would first pass if nothing else arrived: later in this
    /// window once the previous window has decayed enough, else in the next window once this
    /// one has, else two windows on.
    fn earliest_pass(
        &self,
        sequence: u64,
        current: u64,
        previous: u64,
        elapsed: u64,
    ) -> Option<u64> {
        if self.limit == 0 || self.cost > self.limit {
            return None;
        }
        let d = self.duration;
        let budget = self.limit - self.cost;
        if current <= budget {
            if let Some(x) = d.decayed_by(previous, budget - current) {
                return Some(d.start(sequence).saturating_add(x.max(elapsed)));
            }
        }
        // Next window: this window's count becomes the previous one; the next starts empty.
        match d.decayed_by(current, budget) {
            Some(x) => Some(d.start(sequence.saturating_add(1)).saturating_add(x)),
            None => Some(d.start(sequence.saturating_add(2))),
        }
    }
}

/// The outcome of an all-or-nothing request over several limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MultiDecision {
    /// True only if every limit passed; then every limit counts the request.
    pub success: bool,
    /// One decision per limit, in request order.
    pub decisions: Vec<Decision>,
}

impl MultiDecision {
    /// The decisions whose effects must be applied, with their limit's index: every one when
    /// the request passed (each counts its cost), otherwise only the denials (each starts
    /// strict mode) and nothing is counted.
    pub fn to_apply(&self) -> impl Iterator<Item = (usize, &Decision)> + '_ {
        self.decisions
            .iter()
            .enumerate()
            .filter(move |(_, d)| self.success || !d.success)
    }
}

/// Decides several limits together. `same_cell(i, j)` says whether limits `i` and `j` count on
/// the same window key, so a request that names one key twice is charged twice. If any limit
/// denies, no decision counts its cost (the caller applies nothing).
pub fn decide_all(
    checks: &[LimitCheck],
    now_ms: u64,
    same_cell: impl Fn(usize, usize) -> bool,
) -> MultiDecision {
    let mut decisions: Vec<Decision> = Vec::with_capacity(checks.len());
    for (i, check) in checks.iter().enumerate() {
        let pending = checks
            .iter()
            .take(i)
            .enumerate()
            .filter(|&(j, _)| same_cell(i, j))
            .fold(0_u64, |sum, (_, earlier)| sum.saturating_add(earlier.cost));
        decisions.push(check.decide(now_ms, pending));
    }
    let success = decisions.iter().all(|d| d.success);
    if !success {
        for (decision, check) in decisions.iter_mut().zip(checks) {
            *decision = decision.uncounted(check.cost);
        }
    }
    MultiDecision { success, decisions }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE_MS: u64 = 60_000;
    const T0: u64 = 1_000 * MINUTE_MS; // start of window 1000

    fn check(cur: u64, prev: u64, limit: u64, cost: u64) -> LimitCheck {
        LimitCheck {
            counts: WindowCounts {
                current: Counts {
                    regional: cur,
                    global: 0,
                },
                previous: Counts {
                    regional: prev,
                    global: 0,
                },
            },
            duration: WindowDuration::from_ms(MINUTE_MS).unwrap(),
            limit,
            cost,
        }
    }

    #[test]
    fn pass_reports_remaining_after_the_cost() {
        let d = check(3, 0, 10, 2).decide(T0 + 1_000, 0);
        assert!(d.success);
        assert_eq!(d.remaining, 5);
        assert_eq!(d.reset_ms, T0 + MINUTE_MS);
        assert_eq!(d.retry_after_ms, Some(0));
    }

    #[test]
    fn previous_window_bleeds_in_8_of_10() {
        // 8 of 10 used in window N; 10% into N+1, floor(8 * 0.9) = 7 still weighs, so a
        // cost-4 request is denied with 3 left to spend.
        let c = check(0, 8, 10, 4);
        let d = c.decide(T0 + 6_000, 0);
        assert!(!d.success);
        assert_eq!(d.remaining, 3);
        // It passes once floor(8 * (1 - x)) <= 6, first at 7,501 ms into the window.
        assert_eq!(d.retry_after_ms, Some(7_501 - 6_000));
        assert!(c.decide(T0 + 7_501, 0).success);
        assert!(!c.decide(T0 + 7_500, 0).success);
    }

    #[test]
    fn cost_zero_only_checks() {
        let d = check(10, 0, 10, 0).decide(T0, 0);
        assert!(d.success);
        assert_eq!(d.remaining, 0);
        let d = check(11, 0, 10, 0).decide(T0, 0);
        assert!(!d.success);
        assert_eq!(d.remaining, 0);
    }

    #[test]
    fn limit_zero_denies_everything_forever() {
        for cost in [0, 1] {
            let d = check(0, 0, 0, cost).decide(T0, 0);
            assert!(!d.success);
            assert_eq!(d.remaining, 0);
            assert_eq!(d.retry_after_ms, None);
        }
    }

    #[test]
    fn cold_oversized_request_is_denied_without_hope() {
        let d = check(0, 0, 10, 11).decide(T0, 0);
        assert!(!d.success);
        assert_eq!(d.remaining, 10, "it consumed nothing");
        assert_eq!(d.retry_after_ms, None);
    }

    #[test]
    fn full_window_retries_when_its_count_has_decayed_in_the_next() {
        // 10 of 10 in this window, nothing before: the next window starts with 10 weighing,
        // and a cost-1 request passes once floor(10 * (1 - x)) <= 9: one ms into it.
        let c = check(10, 0, 10, 1);
        let d = c.decide(T0 + 30_000, 0);
        assert!(!d.success);
        assert_eq!(d.retry_after_ms, Some(30_000 + 1));
        // A cost-5 request waits until floor(10 * (1 - x)) <= 5, i.e. x > 40%.
        let d = check(10, 0, 10, 5).decide(T0 + 30_000, 0);
        assert_eq!(d.retry_after_ms, Some(30_000 + 24_001));
        let mut next = c;
        next.cost = 5;
        next.counts.previous = next.counts.current;
        next.counts.current = Counts::default();
        assert!(next.decide(T0 + MINUTE_MS + 24_001, 0).success);
        assert!(!next.decide(T0 + MINUTE_MS + 24_000, 0).success);
    }

    #[test]
    fn counts_beyond_the_limit_wait_two_windows() {
        // A current count far above the limit (imported from other regions) still weighs at
        // the last millisecond of the next window; the request passes when it has aged out.
        let d = check(1_000_000, 0, 10, 1).decide(T0, 0);
        assert_eq!(d.retry_after_ms, Some(2 * MINUTE_MS));
    }

    #[test]
    fn global_counts_weigh_like_regional_ones() {
        let mut c = check(4, 0, 10, 1);
        c.counts.current.global = 5;
        assert!(c.decide(T0, 0).success);
        c.counts.current.global = 6;
        assert!(!c.decide(T0, 0).success);
        c.counts.previous.global = 4;
        c.counts.current.global = 0;
        // 4 + floor(4 * 0.5) + 1 = 7
        assert_eq!(c.decide(T0 + 30_000, 0).remaining, 3);
    }

    #[test]
    fn multi_limit_rolls_back_when_one_denies() {
        let checks = [check(0, 0, 10, 1), check(5, 0, 5, 1)];
        let m = decide_all(&checks, T0, |_, _| false);
        assert!(!m.success);
        assert!(m.decisions[0].success, "the first limit alone would pass");
        assert_eq!(m.decisions[0].remaining, 10, "but nothing was counted");
        assert!(!m.decisions[1].success);
    }

    #[test]
    fn multi_limit_charges_a_repeated_key_twice() {
        let checks = [check(8, 0, 10, 1), check(8, 0, 10, 1), check(8, 0, 10, 1)];
        let m = decide_all(&checks, T0, |_, _| true);
        assert!(!m.success, "three units on 8 of 10 must not fit");
        let m = decide_all(&checks[..2], T0, |_, _| true);
        assert!(m.success);
        assert_eq!(m.decisions[1].remaining, 0);
    }

    #[test]
    fn saturates_instead_of_overflowing() {
        let d = check(u64::MAX, u64::MAX, u64::MAX, u64::MAX).decide(u64::MAX, u64::MAX);
        assert!(d.success, "u64::MAX <= u64::MAX after saturation");
        let d = check(u64::MAX, u64::MAX, 10, 1).decide(u64::MAX, 0);
        assert!(!d.success);
    }
}
