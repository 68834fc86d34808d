//! Fixed-window arithmetic: sequences, elapsed time, reset and expiry.
//!
//! Every function is total: durations are bounded to 1 s ..= 30 days by construction, and every
//! product that could leave `u64` (a sequence times a duration near `u64::MAX` ms) saturates
//! instead of wrapping, so a hostile or broken clock gives a wrong answer, never a panic.

use core::fmt;

/// The shortest window a limit may use: 1 second.
pub const MIN_DURATION_MS: u64 = 1_000;
/// The longest window a limit may use: 30 days.
pub const MAX_DURATION_MS: u64 = 30 * 24 * 60 * 60 * 1_000;

/// A validated window length in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WindowDuration(u64);

/// A window length outside `MIN_DURATION_MS ..= MAX_DURATION_MS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DurationError {
    /// The rejected value, in milliseconds.
    pub duration_ms: u64,
}

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "duration must be between {MIN_DURATION_MS} ms (1 s) and {MAX_DURATION_MS} ms (30 days), got {} ms",
            self.duration_ms
        )
    }
}

#[cfg(feature = "std")]
impl std::error::Error for DurationError {}

impl WindowDuration {
    /// Validates a window length given in milliseconds.
    pub const fn from_ms(duration_ms: u64) -> Result<Self, DurationError> {
        if duration_ms < MIN_DURATION_MS || duration_ms > MAX_DURATION_MS {
            return Err(DurationError { duration_ms });
        }
        Ok(Self(duration_ms))
    }

    /// A length already validated (kept compactly by its owner).
    pub(crate) const fn from_valid_ms(duration_ms: u64) -> Self {
        Self(duration_ms)
    }

    /// The length in milliseconds.
    pub const fn as_ms(self) -> u64 {
        self.0
    }

    /// The fixed window that contains `now_ms`.
    pub const fn sequence(self, now_ms: u64) -> u64 {
        now_ms / self.0
    }

    /// Unix ms at which window `sequence` starts.
    pub const fn start(self, sequence: u64) -> u64 {
        sequence.saturating_mul(self.0)
    }

    /// Unix ms at which window `sequence` ends and the next begins (the `reset` of a decision).
    pub const fn reset(self, sequence: u64) -> u64 {
        self.start(sequence.saturating_add(1))
    }

    /// Milliseconds of window `sequence` that have passed at `now_ms`, clamped to the window.
    pub const fn elapsed_ms(self, sequence: u64, now_ms: u64) -> u64 {
        let elapsed = now_ms.saturating_sub(self.start(sequence));
        if elapsed > self.0 { self.0 } else { elapsed }
    }

    /// Unix ms after which a cell of window `sequence` can no longer affect a decision: it is
    /// read as the previous window through `sequence + 1`, and is useless from `sequence + 2`.
    /// This is the `expires_at` of the global table, independent of any region's clock.
    pub const fn expires_at(self, sequence: u64) -> u64 {
        self.start(sequence.saturating_add(2))
    }

    /// The part of the previous window's count that still weighs at `elapsed_ms` into the
    /// current one: `floor(previous * (duration - elapsed) / duration)`, in exact integer
    /// arithmetic so every runtime (native, Wasm, the Redis script) rounds the same way.
    pub const fn previous_weight(self, previous: u64, elapsed_ms: u64) -> u64 {
        let left = self.0.saturating_sub(elapsed_ms);
        // Fast paths: nothing to weigh, or a product that fits u64 (any count below about
        // 7 million against a 30-day window) skips the slow 128-bit division.
        if previous == 0 {
            return 0;
        }
        if let Some(product) = previous.checked_mul(left) {
            return product / self.0;
        }
        let left = left as u128;
        // left <= duration, so the quotient is at most `previous` and the cast is exact.
        #[allow(clippy::cast_possible_truncation)]
        let weight = ((previous as u128 * left) / self.0 as u128) as u64;
        weight
    }

    /// One writer's share of the previous window's weight at `elapsed_ms`, rounded up:
    /// `previous - floor(previous * elapsed / duration)`. The writers' shares of a cell add
    /// up to at least its [`previous_weight`](Self::previous_weight) (floors do not add up),
    /// so a lease held against a writer's own share never lets the region's weighted count
    /// pass what the holders were lent.
    pub const fn previous_share(self, previous: u64, elapsed_ms: u64) -> u64 {
        let elapsed = if elapsed_ms < self.0 {
            elapsed_ms
        } else {
            self.0
        };
        previous.saturating_sub(self.previous_weight(previous, self.0 - elapsed))
    }

    /// The smallest elapsed time (ms into the window) at which `previous` has decayed to at
    /// most `budget`, or `None` if it is still above `budget` at the last millisecond.
    pub const fn decayed_by(self, previous: u64, budget: u64) -> Option<u64> {
        if previous <= budget {
            return Some(0);
        }
        // floor(p * (d - x) / d) <= b  <=>  p * (d - x) <= (b + 1) * d - 1.
        let d = self.0 as u128;
        let allowed = (budget as u128 + 1) * d - 1;
        let max_left = allowed / previous as u128; // < d because previous > budget
        let x = d - max_left;
        // x < d <= MAX_DURATION_MS, so the cast is exact.
        #[allow(clippy::cast_possible_truncation)]
        if x >= d { None } else { Some(x as u64) }
    }
}

impl fmt::Display for WindowDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ms", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: WindowDuration = match WindowDuration::from_ms(60_000) {
        Ok(d) => d,
        Err(_) => unreachable!(),
    };

    #[test]
    fn bounds_are_inclusive() {
        assert!(WindowDuration::from_ms(MIN_DURATION_MS).is_ok());
        assert!(WindowDuration::from_ms(MAX_DURATION_MS).is_ok());
        assert_eq!(
            WindowDuration::from_ms(999),
            Err(DurationError { duration_ms: 999 })
        );
        assert!(WindowDuration::from_ms(MAX_DURATION_MS + 1).is_err());
        assert!(WindowDuration::from_ms(0).is_err());
    }

    #[test]
    fn sequence_start_reset_and_expiry() {
        let now = 1_700_000_030_000;
        let seq = MINUTE.sequence(now);
        assert_eq!(seq, 28_333_333);
        assert_eq!(MINUTE.start(seq), 1_699_999_980_000);
        assert_eq!(MINUTE.reset(seq), 1_700_000_040_000);
        assert_eq!(MINUTE.elapsed_ms(seq, now), 50_000);
        assert_eq!(MINUTE.expires_at(seq), MINUTE.start(seq) + 120_000);
    }

    #[test]
    fn arithmetic_saturates_at_the_end_of_time() {
        let month = WindowDuration::from_ms(MAX_DURATION_MS).unwrap();
        let seq = month.sequence(u64::MAX);
        assert_eq!(month.expires_at(seq), u64::MAX);
        assert_eq!(month.reset(seq), u64::MAX);
        assert!(month.elapsed_ms(seq, u64::MAX) <= MAX_DURATION_MS);
        assert_eq!(month.previous_weight(u64::MAX, 0), u64::MAX);
    }

    #[test]
    fn previous_weight_floors_the_decayed_count() {
        // 8 of 10 at 25% into the next window: floor(8 * 0.75) = 6.
        assert_eq!(MINUTE.previous_weight(8, 15_000), 6);
        assert_eq!(MINUTE.previous_weight(8, 0), 8);
        assert_eq!(MINUTE.previous_weight(8, 60_000), 0);
        assert_eq!(MINUTE.previous_weight(7, 30_000), 3);
    }

    #[test]
    fn a_share_of_the_previous_weight_rounds_up_so_shares_cover_the_whole() {
        // 7 and 1 of 8 at 25% into the next window: ceil(5.25) + ceil(0.75) = 7 >= 6.
        assert_eq!(MINUTE.previous_share(7, 15_000), 6);
        assert_eq!(MINUTE.previous_share(1, 15_000), 1);
        assert_eq!(MINUTE.previous_share(8, 0), 8);
        assert_eq!(MINUTE.previous_share(8, 60_000), 0);
        assert_eq!(
            MINUTE.previous_share(8, 90_000),
            0,
            "past the window: nothing"
        );
        for (a, b, elapsed) in [(3_u64, 4_u64, 1_u64), (100, 1, 59_999), (5, 5, 30_000)] {
            let whole = MINUTE.previous_weight(a + b, elapsed);
            let shares = MINUTE.previous_share(a, elapsed) + MINUTE.previous_share(b, elapsed);
            assert!(shares >= whole && shares <= whole + 2, "{a} {b} {elapsed}");
        }
    }

    #[test]
    fn decayed_by_is_the_first_millisecond_within_budget() {
        for previous in [1_u64, 7, 8, 100, 59_999, 60_000, 1_000_000] {
            for budget in [0_u64, 1, 3, 50] {
                match MINUTE.decayed_by(previous, budget) {
                    Some(x) => {
                        assert!(MINUTE.previous_weight(previous, x) <= budget);
                        if x > 0 {
                            assert!(MINUTE.previous_weight(previous, x - 1) > budget);
                        }
                    }
                    None => assert!(MINUTE.previous_weight(previous, 59_999) > budget),
                }
            }
        }
    }
}
