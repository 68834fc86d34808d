//! A circuit breaker that opens on a failure *ratio*, not an absolute count: over a rolling
//! window of recent calls, at least `min_calls` of them and a failure share of `ratio` or more
//! opens it for `cooldown`; then one probe call decides whether it closes again. A busy gateway
//! with a handful of timeouts among thousands of calls stays closed; a quiet one whose few
//! calls all fail opens.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Breaker settings.
#[derive(Clone, Copy, Debug)]
pub struct BreakerConfig {
    /// Calls counted per window.
    pub window: Duration,
    /// Fewest calls in a window before the ratio is trusted.
    pub min_calls: u32,
    /// Failure share that opens the breaker.
    pub ratio: f64,
    /// How long it stays open before a probe.
    pub cooldown: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(10),
            min_calls: 20,
            ratio: 0.5,
            cooldown: Duration::from_secs(1),
        }
    }
}

#[derive(Debug)]
enum State {
    Closed {
        since: Instant,
        calls: u32,
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// One probe is out since `since`; everything else fails fast until it reports, or until
    /// a cooldown passed without a report (the call carrying it was dropped, e.g. its client
    /// hung up): then the next call probes, so the breaker can never stay open for good.
    Probing {
        since: Instant,
    },
}

/// The breaker.
#[derive(Debug)]
pub struct Breaker {
    config: BreakerConfig,
    state: Mutex<State>,
}

impl Default for Breaker {
    fn default() -> Self {
        Self::new(BreakerConfig::default())
    }
}

impl Breaker {
    /// A closed breaker.
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            state: Mutex::new(State::Closed {
                since: Instant::now(),
                calls: 0,
                failures: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a call may go out at `now` (an open breaker past its cooldown lets one probe).
    pub fn allow(&self, now: Instant) -> bool {
        let mut state = self.lock();
        match *state {
            State::Closed { .. } => true,
            State::Open { until } if now >= until => {
                *state = State::Probing { since: now };
                true
            }
            State::Probing { since } if now >= since + self.config.cooldown => {
                *state = State::Probing { since: now };
                true
            }
            State::Open { .. } | State::Probing { .. } => false,
        }
    }

    /// Records a call's outcome.
    pub fn record(&self, ok: bool, now: Instant) {
        let c = self.config;
        let mut state = self.lock();
        *state = match *state {
            State::Probing { .. } if ok => State::Closed {
                since: now,
                calls: 0,
                failures: 0,
            },
            State::Probing { .. } => State::Open {
                until: now + c.cooldown,
            },
            State::Open { until } => State::Open { until },
            State::Closed {
                since,
                calls,
                failures,
            } => {
                let (since, calls, failures) = if now.duration_since(since) > c.window {
                    (now, 0, 0)
                } else {
                    (since, calls, failures)
                };
                let (calls, failures) = (calls + 1, failures + u32::from(!ok));
                if calls >= c.min_calls && f64::from(failures) >= c.ratio * f64::from(calls) {
                    State::Open {
                        until: now + c.cooldown,
                    }
                } else {
                    State::Closed {
                        since,
                        calls,
                        failures,
                    }
                }
            }
        };
    }

    /// Whether calls are currently refused.
    pub fn is_open(&self, now: Instant) -> bool {
        match *self.lock() {
            State::Closed { .. } => false,
            State::Open { until } => now < until,
            State::Probing { .. } => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(BreakerConfig {
            window: Duration::from_secs(10),
            min_calls: 10,
            ratio: 0.5,
            cooldown: Duration::from_secs(1),
        })
    }

    #[test]
    fn a_few_failures_among_many_calls_keep_it_closed() {
        let (b, t) = (breaker(), Instant::now());
        for i in 0..100 {
            b.record(i % 10 != 0, t);
        }
        assert!(b.allow(t));
    }

    #[test]
    fn too_few_calls_never_open_it() {
        let (b, t) = (breaker(), Instant::now());
        for _ in 0..9 {
            b.record(false, t);
        }
        assert!(b.allow(t), "9 failures are below min_calls");
        b.record(false, t);
        assert!(!b.allow(t), "the 10th makes the ratio count");
    }

    #[test]
    fn it_probes_after_the_cooldown_and_closes_on_success() {
        let (b, t) = (breaker(), Instant::now());
        for _ in 0..10 {
            b.record(false, t);
        }
        assert!(!b.allow(t + Duration::from_millis(999)));
        assert!(b.allow(t + Duration::from_secs(1)), "one probe");
        assert!(!b.allow(t + Duration::from_secs(1)), "only one");
        b.record(true, t + Duration::from_secs(1));
        assert!(b.allow(t + Duration::from_secs(1)));
    }

    #[test]
    fn a_probe_that_never_reports_is_replaced_after_a_cooldown() {
        let (b, t) = (breaker(), Instant::now());
        for _ in 0..10 {
            b.record(false, t);
        }
        let probe = t + Duration::from_secs(1);
        assert!(
            b.allow(probe),
            "a probe goes out, and its caller hangs up: no report"
        );
        assert!(!b.allow(probe + Duration::from_millis(999)));
        assert!(
            b.allow(probe + Duration::from_secs(1)),
            "a new probe after a cooldown"
        );
        b.record(true, probe + Duration::from_secs(1));
        assert!(!b.is_open(probe + Duration::from_secs(1)), "and it closes");
    }

    #[test]
    fn a_failed_probe_opens_it_again() {
        let (b, t) = (breaker(), Instant::now());
        for _ in 0..10 {
            b.record(false, t);
        }
        let later = t + Duration::from_secs(1);
        assert!(b.allow(later));
        b.record(false, later);
        assert!(!b.allow(later + Duration::from_millis(500)));
        assert!(b.is_open(later + Duration::from_millis(500)));
    }
}
