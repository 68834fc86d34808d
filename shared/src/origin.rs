//! Merging the regional origin into local state: which cells a decision must read first, and
//! what a read, replay or decision answer (or a failure) does to a cell.
//!
//! Counts within a cell only grow, so an answer merges with `max` and can arrive late, twice or
//! out of order without harm. Only a successful answer makes a cell fresh.

use crate::cell::WindowState;
use crate::decision::Counts;

/// How long an origin answer is trusted by default.
pub const DEFAULT_FRESH_FOR_MS: u64 = 5_000;
/// How long a failed origin call holds off the next read of the same cell by default.
pub const DEFAULT_READ_RETRY_MS: u64 = 300;

/// Region-wide freshness settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OriginPolicy {
    /// An origin answer keeps a cell fresh this long.
    pub fresh_for_ms: u64,
    /// After a failed origin call, decisions on the cell stay local this long before the
    /// next read is tried (so a down origin costs one timeout per cell per interval, not one
    /// per request).
    pub read_retry_ms: u64,
}

impl Default for OriginPolicy {
    fn default() -> Self {
        Self {
            fresh_for_ms: DEFAULT_FRESH_FOR_MS,
            read_retry_ms: DEFAULT_READ_RETRY_MS,
        }
    }
}

/// Why a cell must be read from the origin before deciding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReadReason {
    /// No origin answer has ever been merged.
    Cold,
    /// The last answer is older than `fresh_for`.
    Stale,
    /// A recent denial on the window key: the current cell is re-read before a local pass.
    Strict,
}

impl ReadReason {
    /// Label for logs and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            ReadReason::Cold => "cold",
            ReadReason::Stale => "stale",
            ReadReason::Strict => "strict",
        }
    }
}

/// The cells of one window key a decision must read synchronously, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadPlan {
    /// Sequence of the current cell (the previous one is `sequence - 1`).
    pub sequence: u64,
    /// Why the current cell must be read.
    pub current: Option<ReadReason>,
    /// Why the previous cell must be read.
    pub previous: Option<ReadReason>,
}

impl ReadPlan {
    /// Nothing to read: the decision can be made locally.
    pub const fn is_empty(&self) -> bool {
        self.current.is_none() && self.previous.is_none()
    }

    /// The cells to read, as `(sequence, reason)`, current first.
    pub fn cells(&self) -> impl Iterator<Item = (u64, ReadReason)> + '_ {
        let current = self.current.map(|r| (self.sequence, r));
        let previous = self.previous.map(|r| (self.sequence.saturating_sub(1), r));
        current.into_iter().chain(previous)
    }
}

impl WindowState {
    /// Classifies both cells at `now_ms` (already rolled to). A cell whose last origin call
    /// failed less than `read_retry_ms` ago is not read again yet: it is decided locally.
    pub fn plan_reads(&self, now_ms: u64) -> ReadPlan {
        let reason = |cell: &crate::cell::CellState, strict: bool| {
            if now_ms < cell.read_retry_at {
                None
            } else if !cell.is_warm() {
                Some(ReadReason::Cold)
            } else if now_ms >= cell.fresh_until {
                Some(ReadReason::Stale)
            } else if strict && now_ms < self.strict_until {
                Some(ReadReason::Strict)
            } else {
                None
            }
        };
        ReadPlan {
            sequence: self.sequence,
            current: reason(&self.current, true),
            // Strict mode refreshes the current window only: the previous one takes no new
            // increments, so cold and stale cover it.
            previous: reason(&self.previous, false),
        }
    }

    /// Merges an origin answer for cell `sequence` (read, replay or decision) with `max` and
    /// marks it fresh. Returns false if the state no longer holds that cell.
    pub fn apply_origin(
        &mut self,
        sequence: u64,
        counts: Counts,
        now_ms: u64,
        policy: &OriginPolicy,
    ) -> bool {
        let Some(cell) = self.cell_mut(sequence) else {
            return false;
        };
        cell.counts.merge(counts);
        // Never 0 once answered: 0 means cold.
        cell.fresh_until = cell
            .fresh_until
            .max(now_ms.saturating_add(policy.fresh_for_ms))
            .max(1);
        cell.read_retry_at = 0;
        true
    }

    /// Records a failed origin call for cell `sequence`: the cell stays as fresh as it was
    /// (a failure proves nothing) and is not read again for `read_retry_ms`.
    pub fn fail_origin(&mut self, sequence: u64, now_ms: u64, policy: &OriginPolicy) -> bool {
        let Some(cell) = self.cell_mut(sequence) else {
            return false;
        };
        cell.read_retry_at = now_ms.saturating_add(policy.read_retry_ms);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::window::WindowDuration;

    fn minute() -> WindowDuration {
        WindowDuration::from_ms(60_000).unwrap()
    }
    const T: u64 = 60_000 * 100;

    #[test]
    fn a_new_key_reads_both_cells_cold() {
        let s = WindowState::new(minute(), T);
        let plan = s.plan_reads(T);
        assert_eq!(plan.current, Some(ReadReason::Cold));
        assert_eq!(plan.previous, Some(ReadReason::Cold));
        assert_eq!(
            plan.cells().collect::<alloc::vec::Vec<_>>(),
            [(100, ReadReason::Cold), (99, ReadReason::Cold)]
        );
    }

    #[test]
    fn an_answer_merges_with_max_and_freshens() {
        let p = OriginPolicy::default();
        let mut s = WindowState::new(minute(), T);
        s.current.counts.regional = 7;
        assert!(s.apply_origin(
            100,
            Counts {
                regional: 5,
                global: 2
            },
            T,
            &p
        ));
        assert!(s.apply_origin(
            99,
            Counts {
                regional: 1,
                global: 0
            },
            T,
            &p
        ));
        assert_eq!(
            s.current().counts(),
            Counts {
                regional: 7,
                global: 2
            }
        );
        assert!(s.plan_reads(T + 4_999).is_empty());
        assert_eq!(s.plan_reads(T + 5_000).current, Some(ReadReason::Stale));
        assert!(!s.apply_origin(98, Counts::default(), T, &p), "not held");
    }

    #[test]
    fn a_failed_read_is_not_fresh_and_retries_after_the_delay() {
        let p = OriginPolicy::default();
        let mut s = WindowState::new(minute(), T);
        assert!(s.fail_origin(100, T, &p));
        assert!(!s.current().is_fresh(T));
        assert!(!s.current().is_warm());
        assert_eq!(
            s.plan_reads(T + 299).current,
            None,
            "decided locally meanwhile"
        );
        assert_eq!(s.plan_reads(T + 300).current, Some(ReadReason::Cold));
    }

    #[test]
    fn strict_mode_reads_the_current_cell_only() {
        let p = OriginPolicy::default();
        let mut s = WindowState::new(minute(), T);
        s.apply_origin(100, Counts::default(), T, &p);
        s.apply_origin(99, Counts::default(), T, &p);
        s.strict_until = T + 60_000;
        let plan = s.plan_reads(T + 1);
        assert_eq!(plan.current, Some(ReadReason::Strict));
        assert_eq!(plan.previous, None);
    }

    #[test]
    fn strict_mode_survives_the_sequence_rollover() {
        let p = OriginPolicy::default();
        let mut s = WindowState::new(minute(), T);
        s.apply_origin(100, Counts::default(), T, &p);
        s.apply_origin(99, Counts::default(), T, &p);
        // Denied 10 s before the end of window 100.
        let d = s.decide(minute(), 0, 1, T + 50_000);
        assert!(!d.success);
        let now = T + 61_000; // window 101
        s.roll(minute(), now);
        s.apply_origin(101, Counts::default(), now, &p);
        s.apply_origin(100, Counts::default(), now, &p);
        assert_eq!(s.plan_reads(now).current, Some(ReadReason::Strict));
        assert_ne!(
            s.plan_reads(T + 110_000).current,
            Some(ReadReason::Strict),
            "strict ends one duration after the denial"
        );
    }
}
