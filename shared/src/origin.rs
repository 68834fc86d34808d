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
/// How often processes replay accepted cost to the origin by default: the lag the band covers.
pub const DEFAULT_REPLAY_INTERVAL_MS: u64 = 100;

/// Region-wide freshness settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OriginPolicy {
    /// An origin answer keeps a cell fresh this long.
    pub fresh_for_ms: u64,
    /// After a failed origin call, decisions on the cell stay local this long before the
    /// next read is tried (so a down origin costs one timeout per cell per interval, not one
    /// per request).
    pub read_retry_ms: u64,
    /// How often this process replays accepted cost: the window of unseen traffic the band
    /// estimates.
    pub replay_interval_ms: u64,
    /// Whether near-limit passes go to the origin (`false` measures the design without it).
    pub band: bool,
}

impl Default for OriginPolicy {
    fn default() -> Self {
        Self {
            fresh_for_ms: DEFAULT_FRESH_FOR_MS,
            read_retry_ms: DEFAULT_READ_RETRY_MS,
            replay_interval_ms: DEFAULT_REPLAY_INTERVAL_MS,
            band: true,
        }
    }
}

/// Why a decision goes to the origin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// No origin answer has ever been merged.
    Cold,
    /// The last answer is older than `fresh_for`.
    Stale,
    /// A recent denial on the window key: the current cell is re-read before a local pass.
    Strict,
    /// The budget left is within the band of what other processes may have admitted unseen.
    Band,
}

impl Reason {
    /// Label for logs and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Cold => "cold",
            Reason::Stale => "stale",
            Reason::Strict => "strict",
            Reason::Band => "band",
        }
    }
}

/// The cells of one window key a decision must read synchronously, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadPlan {
    /// Sequence of the current cell (the previous one is `sequence - 1`).
    pub sequence: u64,
    /// Why the current cell must be read.
    pub current: Option<Reason>,
    /// Why the previous cell must be read.
    pub previous: Option<Reason>,
}

impl ReadPlan {
    /// Nothing to read: the decision can be made locally.
    pub const fn is_empty(&self) -> bool {
        self.current.is_none() && self.previous.is_none()
    }

    /// The cells to read, as `(sequence, reason)`, current first.
    pub fn cells(&self) -> impl Iterator<Item = (u64, Reason)> + '_ {
        let current = self.current.map(|r| (self.sequence, r));
        let previous = self.previous.map(|r| (self.sequence.saturating_sub(1), r));
        current.into_iter().chain(previous)
    }
}

/// A decision the local view cannot make safely: make it at the origin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OriginPlan {
    /// Sequence of the current cell.
    pub sequence: u64,
    /// Why: the current cell's reason first, then the previous cell's, then the band.
    pub reason: Reason,
    /// The cells that are cold, stale or strict (a shell may refresh them and check again).
    pub reads: ReadPlan,
    /// The band at the time (local passes must leave this much of the limit).
    pub band: u64,
    /// What the origin should count as used beyond what it holds: other processes' local
    /// passes not yet replayed, estimated from ours (see [`crate::band::BandState::reserve`]).
    /// Not the rate band: that measures growth the origin already holds, and reserving it
    /// again denies a client paced at its limit what it is owed (measured 0.989 instead of
    /// 0.998 over five gateways).
    pub reserve: u64,
}

impl OriginPlan {
    /// What the origin should count as used beyond what it holds: the estimate of other
    /// processes' local passes it has not been told of yet. Without it an origin decision is
    /// exact only against what the origin holds, and a 20x burst over two processes admits
    /// 1.5x the limit (measured).
    pub const fn reserve(&self) -> u64 {
        self.reserve
    }
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
    /// Distinct processes the origin saw on the key recently.
    pub peers: u32,
}

/// Where a request's decision is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The local view decides: a denial (always safe: it is a lower bound), or a pass with
    /// the band covered.
    Local(crate::decision::Decision),
    /// The origin must decide.
    Origin(OriginPlan),
}

impl WindowState {
    /// The decision order of DESIGN 3 at `now_ms` (already rolled to): (1) the local view
    /// denies: deny locally, whatever the cells' state, so traffic over its limit costs no
    /// round trip; (2) warm, fresh, not strict and `effective + band <= limit`: pass locally;
    /// (3) otherwise decide at the origin. A cell whose last origin call failed within the
    /// retry delay is decided locally (the fallback) rather than tried again.
    pub fn classify(
        &self,
        duration: crate::window::WindowDuration,
        limit: u64,
        cost: u64,
        now_ms: u64,
        policy: &OriginPolicy,
    ) -> Verdict {
        let local = self
            .check(duration, limit, cost)
            .decide_in(self.sequence, now_ms, 0);
        if !local.success {
            return Verdict::Local(local);
        }
        let reads = self.plan_reads(now_ms);
        // The band and reserve only matter once there is a reason to ask the origin, or room to
        // doubt a pass: a lone process (peers 1, nobody else's growth seen) skips their math.
        let lone = self.band.peers() <= 1 && self.band.others_per_interval() == 0;
        let estimate = || {
            if !policy.band || lone {
                return (0, 0);
            }
            let i = policy.replay_interval_ms;
            (
                self.band.band(limit, now_ms, i),
                self.band.reserve(now_ms, i).min(limit),
            )
        };
        let plan = |reason, (band, reserve): (u64, u64)| OriginPlan {
            sequence: self.sequence,
            reason,
            reads,
            band,
            reserve,
        };
        if let Some(reason) = reads.current.or(reads.previous) {
            return Verdict::Origin(plan(reason, estimate()));
        }
        if now_ms < self.current.read_retry_at {
            return Verdict::Local(local);
        }
        let (band, reserve) = estimate();
        if local.remaining < band {
            return Verdict::Origin(plan(Reason::Band, (band, reserve)));
        }
        Verdict::Local(local)
    }

    /// Merges the origin's decision for one limit: both cells' counts with `max`, both fresh,
    /// the peers it saw; the cost it counted is acknowledged as ours; a denial starts strict
    /// mode. Returns the decision to answer the client with: the origin's verdict and
    /// remaining, and (for a denial) a retry-after computed from the merged counts.
    pub fn apply_decided(
        &mut self,
        duration: crate::window::WindowDuration,
        answer: &OriginAnswer,
        cost: u64,
        now_ms: u64,
        policy: &OriginPolicy,
    ) -> crate::decision::Decision {
        let now_ms = self.roll(duration, now_ms);
        self.merge_fresh(answer.sequence, answer.current, now_ms, policy);
        self.merge_fresh(
            answer.sequence.saturating_sub(1),
            answer.previous,
            now_ms,
            policy,
        );
        if answer.sequence == self.sequence {
            if answer.counted {
                self.band.acknowledge_own(cost);
                self.band
                    .record_own(cost, now_ms, policy.replay_interval_ms);
            }
            self.band.observe(
                answer.current.regional,
                Some(answer.peers),
                now_ms,
                policy.replay_interval_ms,
            );
        }
        if answer.denied {
            self.strict_until = self
                .strict_until
                .max(now_ms.saturating_add(duration.as_ms()));
        }
        let success = answer.counted && !answer.denied;
        let retry_after_ms = if success {
            Some(0)
        } else {
            // On our clock, from what we now know; if clocks disagree and it would pass here,
            // tell the client to try again at once rather than claim it never passes.
            let local =
                self.check(duration, answer.limit, cost)
                    .decide_in(self.sequence, now_ms, 0);
            if local.success {
                Some(1)
            } else {
                local.retry_after_ms
            }
        };
        crate::decision::Decision {
            success,
            limit: answer.limit,
            remaining: answer.remaining,
            reset_ms: answer.reset_ms,
            retry_after_ms,
        }
    }

    /// Merges a replay answer: `counts` of cell `sequence` after the origin added
    /// `delivered`, which was this process's own accepted cost, and the peers it reports.
    pub fn apply_replay(
        &mut self,
        sequence: u64,
        counts: Counts,
        delivered: u64,
        peers: Option<u32>,
        now_ms: u64,
        policy: &OriginPolicy,
    ) -> bool {
        if sequence == self.sequence {
            self.band.acknowledge_own(delivered);
        }
        if let Some(p) = peers {
            self.observe_peers(p);
        }
        self.apply_origin(sequence, counts, now_ms, policy)
    }

    /// Records the number of processes the origin reports on this key.
    pub fn observe_peers(&mut self, peers: u32) {
        self.band.peers = peers.max(1);
    }

    /// The band state (for metrics and tests).
    pub const fn band(&self) -> &crate::band::BandState {
        &self.band
    }

    fn merge_fresh(
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

    /// Classifies both cells at `now_ms` (already rolled to). A cell whose last origin call
    /// failed less than `read_retry_ms` ago is not read again yet: it is decided locally.
    pub fn plan_reads(&self, now_ms: u64) -> ReadPlan {
        let reason = |cell: &crate::cell::CellState, strict: bool| {
            if now_ms < cell.read_retry_at {
                None
            } else if !cell.is_warm() {
                Some(Reason::Cold)
            } else if now_ms >= cell.fresh_until {
                Some(Reason::Stale)
            } else if strict && now_ms < self.strict_until {
                Some(Reason::Strict)
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
        if !self.merge_fresh(sequence, counts, now_ms, policy) {
            return false;
        }
        if sequence == self.sequence {
            self.band
                .observe(counts.regional, None, now_ms, policy.replay_interval_ms);
        }
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
        assert_eq!(plan.current, Some(Reason::Cold));
        assert_eq!(plan.previous, Some(Reason::Cold));
        assert_eq!(
            plan.cells().collect::<alloc::vec::Vec<_>>(),
            [(100, Reason::Cold), (99, Reason::Cold)]
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
        assert_eq!(s.plan_reads(T + 5_000).current, Some(Reason::Stale));
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
        assert_eq!(s.plan_reads(T + 300).current, Some(Reason::Cold));
    }

    #[test]
    fn strict_mode_reads_the_current_cell_only() {
        let p = OriginPolicy::default();
        let mut s = WindowState::new(minute(), T);
        s.apply_origin(100, Counts::default(), T, &p);
        s.apply_origin(99, Counts::default(), T, &p);
        s.strict_until = T + 60_000;
        let plan = s.plan_reads(T + 1);
        assert_eq!(plan.current, Some(Reason::Strict));
        assert_eq!(plan.previous, None);
    }

    #[test]
    fn strict_mode_survives_the_sequence_rollover() {
        let p = OriginPolicy::default();
        let mut s = WindowState::new(minute(), T);
        s.apply_origin(100, Counts::default(), T, &p);
        s.apply_origin(99, Counts::default(), T, &p);
        // Denied 10 s before the end of window 100.
        let d = s.decide(minute(), 0, 1, T + 50_000, &p);
        assert!(!d.success);
        let now = T + 61_000; // window 101
        s.roll(minute(), now);
        s.apply_origin(101, Counts::default(), now, &p);
        s.apply_origin(100, Counts::default(), now, &p);
        assert_eq!(s.plan_reads(now).current, Some(Reason::Strict));
        assert_ne!(
            s.plan_reads(T + 110_000).current,
            Some(Reason::Strict),
            "strict ends one duration after the denial"
        );
    }
}
