//! A deterministic model of one region: N processes, each with its own table, replaying to an
//! exact origin every replay interval and sending cold, stale, strict and near-limit decisions
//! to it, on a simulated clock. It checks what DESIGN 3a claims: a burst of 20x the limit spread
//! over the processes stays at the limit with the band, and over-admits without it; a client
//! paced at its limit gets its limit; attack traffic costs round trips by the passes, not by
//! the attack.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation
)] // test code: a panic is the failure report

use std::collections::HashMap;

use strata_core::origin::OriginPolicy;
use strata_core::table::Step;
use strata_core::{
    CounterTable, Counts, LimitCheck, OriginAnswer, TableConfig, WindowCounts, WindowDuration,
    WindowKeyRef,
};

const SECOND: u64 = 1_000;
const REPLAY_MS: u64 = 100;
const PEER_WINDOW_MS: u64 = 1_000;

/// The regional origin: exact counts per sequence, who was seen on the key when, and how
/// many processes are active in the region (they replay other keys all the time).
#[derive(Default)]
struct Origin {
    counts: HashMap<u64, u64>,
    seen: HashMap<usize, u64>,
    region_processes: u32,
    decisions: u64,
}

impl Origin {
    /// Distinct processes on the key recently; a key only the caller has touched gets the
    /// region's active process count as its prior (any of them may be about to start on it).
    fn peers(&mut self, pid: usize, now: u64) -> u32 {
        self.seen.insert(pid, now);
        self.seen
            .retain(|_, t| now.saturating_sub(*t) < PEER_WINDOW_MS);
        let on_key = self.seen.len() as u32;
        if on_key <= 1 {
            self.region_processes.max(1)
        } else {
            on_key
        }
    }

    /// Decides with the caller's unreplayed cost and its reserve for others' counted as used.
    fn decide(
        &mut self,
        pid: usize,
        d: WindowDuration,
        limit: u64,
        cost: u64,
        now: u64,
        unseen: u64,
    ) -> OriginAnswer {
        self.decisions += 1;
        let seq = d.sequence(now);
        let counts = WindowCounts {
            current: Counts {
                regional: self.counts.get(&seq).copied().unwrap_or(0),
                global: 0,
            },
            previous: Counts {
                regional: self.counts.get(&(seq - 1)).copied().unwrap_or(0),
                global: 0,
            },
        };
        let decision = LimitCheck {
            counts,
            duration: d,
            limit,
            cost,
        }
        .decide(now, unseen);
        if decision.success {
            *self.counts.entry(seq).or_default() += cost;
        }
        OriginAnswer {
            limit,
            remaining: decision.remaining,
            reset_ms: decision.reset_ms,
            sequence: seq,
            counted: decision.success,
            denied: !decision.success,
            current: Counts {
                regional: self.counts.get(&seq).copied().unwrap_or(0),
                global: 0,
            },
            previous: counts.previous,
            peers: self.peers(pid, now),
        }
    }
}

struct Process {
    table: CounterTable,
    /// Accepted locally, not yet replayed: (sequence, cost).
    pending: HashMap<u64, u64>,
    next_replay: u64,
}

struct Outcome {
    admitted_per_window: HashMap<u64, u64>,
    requests: u64,
    origin_decisions: u64,
}

/// Runs `arrivals` (time, process) on one key with `limit` per `duration`.
fn run(
    processes: usize,
    limit: u64,
    d: WindowDuration,
    arrivals: &[(u64, usize)],
    band: bool,
) -> Outcome {
    let key = WindowKeyRef::new("ws", "api", "client", d).unwrap();
    let policy = OriginPolicy {
        band,
        replay_interval_ms: REPLAY_MS,
        ..OriginPolicy::default()
    };
    let mut origin = Origin {
        region_processes: processes as u32,
        ..Origin::default()
    };
    let start = arrivals.first().map_or(0, |a| a.0);
    let mut procs: Vec<Process> = (0..processes)
        .map(|i| Process {
            table: CounterTable::new(
                TableConfig {
                    origin: policy,
                    ..TableConfig::default()
                },
                i as u64,
            ),
            pending: HashMap::new(),
            // Staggered, as independent processes are.
            next_replay: start + (i as u64 * REPLAY_MS) / processes as u64,
        })
        .collect();
    let mut admitted_per_window: HashMap<u64, u64> = HashMap::new();
    for &(now, pid) in arrivals {
        // Every process replays what it accepted, on its own cadence.
        for (i, p) in procs.iter_mut().enumerate() {
            while p.next_replay <= now {
                let at = p.next_replay;
                for (seq, cost) in p.pending.drain() {
                    let count = origin.counts.entry(seq).or_default();
                    *count += cost;
                    let regional = *count;
                    let peers = origin.peers(i, at);
                    p.table.apply_replay(
                        key,
                        seq,
                        Counts {
                            regional,
                            global: 0,
                        },
                        cost,
                        Some(peers),
                        at,
                    );
                }
                p.next_replay += REPLAY_MS;
            }
        }
        let p = &mut procs[pid];
        let success = match p.table.check(key, limit, 1, now) {
            Step::Decided(dec) => {
                if dec.success {
                    *p.pending.entry(d.sequence(now)).or_default() += 1;
                }
                dec.success
            }
            Step::Origin(plan) => {
                let pending = p.pending.get(&d.sequence(now)).copied().unwrap_or(0);
                let answer = origin.decide(pid, d, limit, 1, now, pending + plan.reserve());
                p.table.apply_decided(key, 1, &answer, now).success
            }
        };
        if success {
            *admitted_per_window.entry(d.sequence(now)).or_default() += 1;
        }
    }
    Outcome {
        admitted_per_window,
        requests: arrivals.len() as u64,
        origin_decisions: origin.decisions,
    }
}

/// `n` requests evenly spread over `[start, start + span)`, round-robin over the processes.
fn spread(start: u64, span: u64, n: u64, processes: usize) -> Vec<(u64, usize)> {
    (0..n)
        .map(|k| (start + k * span / n, (k as usize) % processes))
        .collect()
}

fn minute() -> WindowDuration {
    WindowDuration::from_ms(60 * SECOND).unwrap()
}

const T0: u64 = 28_333_334 * 60 * SECOND; // a minute boundary

#[test]
fn a_burst_of_20x_over_five_processes_stays_at_the_limit_with_the_band() {
    let limit = 100;
    for processes in [2, 5] {
        let arrivals = spread(T0 + 10 * SECOND, SECOND, 20 * limit, processes);
        let with = run(processes, limit, minute(), &arrivals, true);
        let without = run(processes, limit, minute(), &arrivals, false);
        let admitted = |o: &Outcome| o.admitted_per_window.values().sum::<u64>();
        println!(
            "{processes} processes, 20x burst: band on {} admitted ({} origin decisions / 1000 requests), band off {} admitted ({} / 1000)",
            admitted(&with),
            with.origin_decisions * 1000 / with.requests,
            admitted(&without),
            without.origin_decisions * 1000 / without.requests,
        );
        assert!(
            admitted(&with) <= limit + limit / 50,
            "band on: {} > limit + 2%",
            admitted(&with)
        );
        assert!(
            admitted(&with) >= limit,
            "band on under-admits: {}",
            admitted(&with)
        );
        assert!(
            admitted(&without) > admitted(&with),
            "the band must matter for a burst"
        );
        assert!(
            with.origin_decisions * 10 < with.requests,
            "round trips stay well under 1 per 10 requests"
        );
    }
}

#[test]
fn a_client_paced_at_its_limit_gets_its_limit() {
    let (limit, windows, processes) = (600, 5, 5);
    let arrivals = spread(T0, windows * 60 * SECOND, windows * limit, processes);
    let o = run(processes, limit, minute(), &arrivals, true);
    let admitted: u64 = o.admitted_per_window.values().sum();
    let ratio = admitted as f64 / (windows * limit) as f64;
    println!(
        "paced at the limit over {processes} processes: admitted/allowed {ratio:.4}, {} origin decisions / 1000",
        o.origin_decisions * 1000 / o.requests
    );
    assert!((0.99..=1.0).contains(&ratio), "{ratio}");
    assert!(o.admitted_per_window.values().all(|&w| w <= limit));
}

#[test]
fn an_attack_costs_round_trips_by_the_passes_not_by_the_attack() {
    let (limit, processes, windows) = (100, 5, 5);
    let mut decisions = Vec::new();
    for load in [10, 100] {
        let arrivals = spread(T0, windows * 60 * SECOND, windows * load * limit, processes);
        let o = run(processes, limit, minute(), &arrivals, true);
        let admitted: u64 = o.admitted_per_window.values().sum();
        let per_request = o.origin_decisions as f64 / o.requests as f64;
        println!(
            "{load}x attack over {processes} processes: admitted {admitted} of {} allowed, {} origin decisions ({per_request:.3} per request)",
            windows * limit,
            o.origin_decisions
        );
        assert!(
            admitted <= windows * limit + windows * limit / 50,
            "{admitted}"
        );
        assert!(admitted >= windows * limit * 98 / 100, "{admitted}");
        assert!(per_request < 0.75, "{per_request} round trips per request");
        decisions.push(o.origin_decisions);
    }
    // Ten times the attack, about the same number of round trips: they follow the passes.
    assert!(decisions[1] < decisions[0] * 3 / 2, "{decisions:?}");
}

#[test]
fn a_single_process_far_from_its_limit_never_asks_the_origin_after_the_cold_request() {
    let arrivals = spread(T0, 4 * SECOND, 400, 1);
    let o = run(1, 1_000_000, minute(), &arrivals, true);
    assert_eq!(o.origin_decisions, 1, "only the cold request");
}
