//! The figures of a run, from what the lab recorded: how the admitted requests compare with what
//! one exact limiter would have admitted (the core's own decision on the same requests, in the
//! order they were sent), the worst fixed window, requests wrongly denied or wrongly admitted
//! against the true usage of every region together, and how long a region took to see the
//! others' counts.

use std::collections::HashMap;

use strata_core::{Counts, LimitCheck, WindowCounts, WindowDuration};

use crate::load::{Outcome, Poll, Sample};
use crate::scenario::Scenario;

/// A key's current and previous cell, as one exact counter holds them.
#[derive(Clone, Copy, Debug, Default)]
struct Cells {
    sequence: u64,
    current: u64,
    previous: u64,
}

impl Cells {
    fn roll(&mut self, sequence: u64) {
        if sequence == self.sequence + 1 {
            self.previous = self.current;
        } else if sequence > self.sequence + 1 {
            self.previous = 0;
        }
        if sequence > self.sequence {
            self.current = 0;
            self.sequence = sequence;
        }
    }

    /// The count a request at `now_ms` is weighed against: the current cell and the
    /// previous one's weighted share, as the core computes it.
    fn effective(&self, duration: WindowDuration, now_ms: u64) -> u64 {
        let elapsed = duration.elapsed_ms(self.sequence, now_ms);
        self.current + duration.previous_weight(self.previous, elapsed)
    }

    /// Whether one more request passes at `now_ms`, by the core's rule.
    fn passes(&self, duration: WindowDuration, limit: u64, now_ms: u64) -> bool {
        let counts = |n| Counts {
            regional: n,
            global: 0,
        };
        LimitCheck {
            counts: WindowCounts {
                current: counts(self.current),
                previous: counts(self.previous),
            },
            duration,
            limit,
            cost: 1,
        }
        .decide_in(self.sequence, now_ms, 0)
        .success
    }
}

/// p50, p95 and the maximum of a sample, in its unit.
#[derive(Clone, Copy, Debug, Default)]
pub struct Spread {
    pub n: usize,
    pub p50: f64,
    pub p95: f64,
    pub max: f64,
}

/// The `q` quantile (0 to 1) of `sorted`, by the nearest rank; `None` for no values.
fn quantile<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    // q is within 0..=1, so the rounded index is within the sample.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let at = (sorted.len().saturating_sub(1) as f64 * q).round() as usize;
    sorted.get(at).copied()
}

impl Spread {
    pub fn of(mut values: Vec<f64>) -> Option<Self> {
        values.sort_by(f64::total_cmp);
        Some(Self {
            n: values.len(),
            p50: quantile(&values, 0.5)?,
            p95: quantile(&values, 0.95)?,
            max: quantile(&values, 1.0)?,
        })
    }
}

/// Client-observed decision latency: p50, p99 and p99.9, in microseconds, of the requests that
/// got a decision.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Latency {
    pub n: usize,
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
}

impl Latency {
    pub fn of(mut values: Vec<u32>) -> Option<Self> {
        values.sort_unstable();
        let at = |q| quantile(&values, q).map(f64::from);
        Some(Self {
            n: values.len(),
            p50: at(0.5)?,
            p99: at(0.99)?,
            p999: at(0.999)?,
        })
    }
}

/// What a run shows.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    pub offered: u64,
    pub admitted: u64,
    pub denied: u64,
    pub errors: u64,
    /// What one exact limiter would have admitted of the same requests.
    pub allowed: u64,
    /// The most any key admitted in one fixed window, over its limit.
    pub worst_window: f64,
    /// Denied while every region's admitted requests together left room for it and 1% of
    /// the limit more (the margin absorbs the order requests sent at the same moment arrive in).
    pub wrongly_denied: u64,
    /// Admitted while every region's admitted requests together were already 1% of the limit
    /// over it.
    pub wrongly_admitted: u64,
    /// Milliseconds from a count being admitted in other regions to a region seeing it, for
    /// each 2% of the limit from the publish floor up.
    pub propagation_ms: Option<Spread>,
    /// Such counts a region never saw before their window ended.
    pub never_seen: u64,
    /// Admitted per second of the run, per region.
    pub admitted_per_second: Vec<Vec<u64>>,
    /// Decision latency as the clients saw it, over every region.
    pub latency: Option<Latency>,
    /// The same, per region.
    pub latency_by_region: Vec<Option<Latency>>,
}

impl Figures {
    pub fn ratio(&self) -> f64 {
        if self.allowed == 0 {
            return 0.0;
        }
        self.admitted as f64 / self.allowed as f64
    }
}

/// The figures of a run of `s` started at `start_ms`, `floor` being the publish floor the
/// propagation delay is measured from.
pub fn figures(
    s: &Scenario,
    start_ms: u64,
    samples: &mut [Sample],
    polls: &[Poll],
    floor: f64,
) -> Figures {
    samples.sort_by_key(|x| x.at_ms);
    let Ok(duration) = WindowDuration::from_ms(s.duration_ms) else {
        return Figures::default();
    };
    // A run lasts seconds to minutes: its length in whole seconds fits any integer.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let seconds = s.seconds.ceil() as usize;
    let mut f = Figures {
        admitted_per_second: vec![vec![0; seconds + 1]; s.regions],
        ..Figures::default()
    };
    let mut ideal: HashMap<u32, Cells> = HashMap::new();
    let mut truth: HashMap<u32, Cells> = HashMap::new();
    let mut windows: HashMap<(u32, u64), u64> = HashMap::new();
    let margin = (s.limit / 100).max(1);
    for x in samples.iter() {
        f.offered += 1;
        let sequence = duration.sequence(x.at_ms);
        let exact = ideal.entry(x.key).or_default();
        exact.roll(sequence);
        if exact.passes(duration, s.limit, x.at_ms) {
            exact.current += 1;
            f.allowed += 1;
        }
        let true_cells = truth.entry(x.key).or_default();
        true_cells.roll(sequence);
        let after = true_cells.effective(duration, x.at_ms) + 1;
        match x.outcome {
            Outcome::Pass => {
                f.admitted += 1;
                f.wrongly_admitted += u64::from(after > s.limit + margin);
                true_cells.current += 1;
                *windows.entry((x.key, sequence)).or_default() += 1;
                let second = (x.at_ms.saturating_sub(start_ms) / 1_000) as usize;
                if let Some(n) = f
                    .admitted_per_second
                    .get_mut(usize::from(x.region))
                    .and_then(|r| r.get_mut(second))
                {
                    *n += 1;
                }
            }
            Outcome::Deny => {
                f.denied += 1;
                f.wrongly_denied += u64::from(after + margin <= s.limit);
            }
            Outcome::Error => f.errors += 1,
        }
    }
    f.worst_window = windows.values().copied().max().unwrap_or(0) as f64 / s.limit as f64;
    let (delays, never) = propagation(s, samples, polls, floor);
    f.propagation_ms = Spread::of(delays);
    f.never_seen = never;
    let decided = |region: Option<u16>| {
        samples
            .iter()
            .filter(|x| x.outcome != Outcome::Error && region.is_none_or(|r| x.region == r))
            .map(|x| x.latency_us)
            .collect::<Vec<_>>()
    };
    f.latency = Latency::of(decided(None));
    f.latency_by_region = (0..s.regions)
        .map(|r| Latency::of(decided(u16::try_from(r).ok())))
        .collect();
    f
}

/// For each region polled and each window, the delay from the other regions' admitted count
/// reaching X to the region's view showing at least X, for X every 2% of the limit from the
/// publish floor to the count they reached.
fn propagation(s: &Scenario, samples: &[Sample], polls: &[Poll], floor: f64) -> (Vec<f64>, u64) {
    let mut delays = Vec::new();
    let mut never = 0;
    let step = (s.limit / 50).max(1);
    // The floor is a fraction: the product is within 0..=limit.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let first = ((s.limit as f64 * floor).ceil() as u64).max(1);
    for region in 0..s.regions {
        let region16 = u16::try_from(region).unwrap_or(u16::MAX);
        let mine: Vec<&Poll> = polls.iter().filter(|p| p.region == region16).collect();
        if mine.is_empty() {
            continue;
        }
        let mut sequences: Vec<u64> = mine.iter().map(|p| p.sequence).collect();
        sequences.dedup();
        for sequence in sequences {
            // When the other regions' n-th pass of this window was sent, n = 1, 2, ...
            let foreign: Vec<u64> = samples
                .iter()
                .filter(|x| {
                    x.key == 0
                        && x.region != region16
                        && x.outcome == Outcome::Pass
                        && x.at_ms / s.duration_ms == sequence
                })
                .map(|x| x.at_ms)
                .collect();
            let views: Vec<&&Poll> = mine.iter().filter(|p| p.sequence == sequence).collect();
            let mut x = first;
            while let Some(&reached) = usize::try_from(x - 1).ok().and_then(|i| foreign.get(i)) {
                match views.iter().find(|p| p.at_ms >= reached && p.global >= x) {
                    Some(p) => delays.push((p.at_ms - reached) as f64),
                    None => never += 1,
                }
                x += step;
            }
        }
    }
    (delays, never)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::{Keys, Phase};

    fn scenario(regions: usize) -> Scenario {
        Scenario {
            name: "t",
            about: "",
            regions,
            gateways: 1,
            limit: 10,
            duration_ms: 10_000,
            keys: Keys::One,
            phases: vec![Phase {
                from: 0.0,
                to: 1.0,
                rate: 1.0,
                shares: vec![1.0],
            }],
            faults: Vec::new(),
            seconds: 30.0,
            aligned: true,
            poll: false,
        }
    }

    fn sample(at_ms: u64, region: u16, outcome: Outcome) -> Sample {
        Sample {
            at_ms,
            region,
            gateway: region,
            key: 0,
            outcome,
            latency_us: u32::try_from(at_ms % 1_000).unwrap_or(0) + 100 * u32::from(region),
        }
    }

    #[test]
    fn latency_is_taken_over_the_decided_requests_and_per_region() {
        let s = scenario(2);
        let mut samples: Vec<Sample> = (0..1_000)
            .map(|i| sample(i, 0, Outcome::Pass))
            .chain((0..10).map(|i| sample(i, 1, Outcome::Deny)))
            .chain([Sample {
                latency_us: 9_999_999,
                ..sample(5, 1, Outcome::Error)
            }])
            .collect();
        let f = figures(&s, 0, &mut samples, &[], 0.2);
        let region0 = f.latency_by_region[0].unwrap();
        assert_eq!(
            (region0.n, region0.p50, region0.p99, region0.p999),
            (1_000, 500.0, 989.0, 998.0)
        );
        let region1 = f.latency_by_region[1].unwrap();
        assert_eq!(
            (region1.n, region1.p50, region1.p999),
            (10, 105.0, 109.0),
            "errors left out"
        );
        assert_eq!(f.latency.unwrap().n, 1_010);
    }

    #[test]
    fn an_exact_run_scores_one_and_a_leaky_one_more() {
        let s = scenario(1);
        let t0 = 1_000_000; // a window boundary
        let mut exact: Vec<Sample> = (0..30)
            .map(|i| {
                sample(
                    t0 + i * 100,
                    0,
                    if i < 10 { Outcome::Pass } else { Outcome::Deny },
                )
            })
            .collect();
        let f = figures(&s, t0, &mut exact, &[], 0.2);
        assert_eq!((f.offered, f.admitted, f.allowed), (30, 10, 10));
        assert_eq!(f.ratio(), 1.0);
        assert_eq!(f.worst_window, 1.0);
        assert_eq!((f.wrongly_admitted, f.wrongly_denied), (0, 0));

        // Two more passes than the limit, and one early denial.
        let mut leaky: Vec<Sample> = (0..30)
            .map(|i| {
                let pass = (i < 12 && i != 3) || i == 13;
                sample(
                    t0 + i * 100,
                    0,
                    if pass { Outcome::Pass } else { Outcome::Deny },
                )
            })
            .collect();
        let f = figures(&s, t0, &mut leaky, &[], 0.2);
        assert_eq!((f.admitted, f.allowed), (12, 10));
        assert_eq!(f.worst_window, 1.2);
        assert_eq!(
            f.wrongly_denied, 1,
            "request 3 was denied with 3 of 10 used"
        );
        assert_eq!(
            f.wrongly_admitted, 1,
            "request 13 passed with 11 used (request 11, with 10, is within the margin)"
        );
        assert_eq!(f.admitted_per_second[0][0], 9);
        assert_eq!(f.admitted_per_second[0][1], 3);
    }

    #[test]
    fn the_previous_window_weighs_in_as_the_core_says() {
        let s = scenario(1);
        let t0 = 1_000_000;
        // 10 passes at the end of one window; in the next, at 50% elapsed, 5 still weigh.
        let mut v: Vec<Sample> = (0..10)
            .map(|i| sample(t0 + 9_000 + i, 0, Outcome::Pass))
            .chain((0..6).map(|_| sample(t0 + 15_000, 0, Outcome::Pass)))
            .collect();
        let f = figures(&s, t0, &mut v, &[], 0.2);
        assert_eq!(
            f.allowed, 15,
            "5 weigh from the previous window, 5 are left"
        );
        assert_eq!(f.wrongly_admitted, 0, "one over: within the margin");
    }

    #[test]
    fn propagation_is_the_time_a_region_took_to_see_a_count() {
        let s = scenario(2);
        let t0 = 1_000_000;
        // r0 admits 10 at 100 ms intervals; r1 sees 2 at +500 ms, 6 at +1,100 ms, never 10.
        let mut v: Vec<Sample> = (0..10)
            .map(|i| sample(t0 + i * 100, 0, Outcome::Pass))
            .collect();
        let poll = |at_ms, global| Poll {
            at_ms,
            region: 1,
            sequence: t0 / 10_000,
            global,
        };
        let polls = [poll(t0 + 600, 2), poll(t0 + 1_100, 6)];
        let f = figures(&s, t0, &mut v, &polls, 0.2);
        // X = 2 (reached at +100): seen at +600; X = 3..6 (reached +200..+500): seen at +1,100;
        // X = 7..10 never.
        let p = f.propagation_ms.unwrap_or_default();
        assert_eq!(p.n, 5);
        assert_eq!(p.max, 900.0);
        assert_eq!(p.p50, 700.0);
        assert_eq!(f.never_seen, 4);
    }
}
