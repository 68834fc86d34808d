//! A deterministic model of one region under leases: N processes, each with its own
//! `CounterTable`, and one origin keeping a `CellLedger` per cell, on a simulated clock.
//! Every request goes through the core request path (`check`; else `OriginCall`, sent over the
//! wire types to the origin, and `finish`), and every process replays its own counts every
//! 100 ms (`take_replay` / `ack_replay`). The origin decides as the embedded one does
//! (regional-gateway/src/origin/memory.rs): `origin_check`, `decide_all`, `lease::grant`,
//! `CellLedger::add/lease/merge_own`. No randomness: arrivals are evenly spread.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation
)] // test code: a panic is the failure report

use std::collections::HashMap;

use strata_core::ledger::{CellLedger, origin_check, used_on};
use strata_core::request::OriginCall;
use strata_core::table::{LimitRequest, Step};
use strata_core::wire::{
    CellsResponse, DecideRequest, DecideResponse, DecideResult, MAX_BATCH, ReplayRequest,
};
use strata_core::{
    CounterTable, Counts, LimitCheck, TableConfig, WindowDuration, WindowKey, WindowKeyRef,
    decide_all, lease,
};

const SECOND: u64 = 1_000;
const REPLAY_MS: u64 = 100;
const LEASE_MS: u64 = 5_000;
const T0: u64 = 28_333_334 * 60 * SECOND; // a minute boundary

const fn regional(regional: u64) -> Counts {
    Counts {
        regional,
        global: 0,
    }
}

/// The regional origin: one ledger per cell, and how many decisions it made.
#[derive(Default)]
struct Origin {
    cells: HashMap<(WindowKey, u64), CellLedger>,
    decisions: u64,
}

impl Origin {
    fn ledger(&mut self, key: &WindowKey, sequence: u64) -> &mut CellLedger {
        self.cells.entry((key.clone(), sequence)).or_default()
    }

    /// `POST /v1/origin/decide`, answered as the embedded origin answers it.
    fn decide(&mut self, req: &DecideRequest, now: u64) -> DecideResponse {
        self.decisions += 1;
        let limits = req.validate("ws").unwrap();
        let instance = req.instance.as_str();
        let keys: Vec<WindowKey> = limits.iter().map(|l| l.limit.key.to_owned_key()).collect();
        let mut mine = Vec::with_capacity(limits.len());
        let checks: Vec<LimitCheck> = limits
            .iter()
            .zip(&keys)
            .map(|(l, key)| {
                let d = key.duration();
                let seq = d.sequence(now);
                let used = used_on(seq, l.sequence.unwrap_or(seq), l.used);
                let mut previous = std::mem::take(self.ledger(key, seq - 1));
                previous.merge_own(instance, used[1]);
                let current = self.ledger(key, seq);
                current.merge_own(instance, used[0]);
                if l.release > 0 {
                    current.release(instance, l.release);
                }
                let (l, c) = (l.limit.limit, l.limit.cost);
                let (check, m) =
                    origin_check(current, &mut previous, instance, [0, 0], d, l, c, now);
                *self.ledger(key, seq - 1) = previous;
                mine.push(m);
                check
            })
            .collect();
        let multi = decide_all(&checks, now, |i, j| keys.get(i) == keys.get(j));
        let until = lease::reserved_until(now, LEASE_MS);
        let mut results = Vec::with_capacity(limits.len());
        for (i, (l, key)) in limits.iter().zip(&keys).enumerate() {
            let (decision, seq) = (multi.decisions[i], key.duration().sequence(now));
            let previous = self.ledger(key, seq - 1).count();
            let current = self.ledger(key, seq);
            let (mut granted, mut lease_id) = (0, 0);
            if multi.success {
                current.add(l.limit.cost);
                // The caller's live lease is raised, not added to: what it held is free.
                let available = decision.remaining.saturating_add(mine[i]);
                let holders = current.holders(instance, now);
                let grant = lease::grant(l.want, available, l.limit.limit, holders);
                (granted, lease_id) = current.lease(instance, grant, now, until);
            }
            results.push(DecideResult {
                success: decision.success,
                limit: decision.limit,
                remaining: decision.remaining,
                reset: decision.reset_ms,
                sequence: seq,
                current: regional(current.count()),
                previous: regional(previous),
                used: current.own(instance),
                lease: granted,
                lease_id,
                lease_ms: LEASE_MS,
            });
        }
        let (success, sequence) = (multi.success, results[0].sequence);
        DecideResponse {
            success,
            sequence,
            results,
        }
    }

    /// `POST /v1/origin/replay`: own counts merged with `max`; a release drops the lease.
    fn replay(&mut self, req: &ReplayRequest) -> CellsResponse {
        let events = req.validate("ws").unwrap();
        let cells = events
            .iter()
            .map(|e| {
                let ledger = self.ledger(&e.cell.key.to_owned_key(), e.cell.sequence);
                ledger.merge_own(&req.instance, e.used);
                if e.release > 0 {
                    ledger.release(&req.instance, e.release);
                }
                regional(ledger.count())
            })
            .collect();
        CellsResponse { cells }
    }
}

struct Process {
    name: String,
    table: CounterTable,
    next_replay: u64,
}

/// One key with `limit` per minute, served by several processes.
struct Region {
    origin: Origin,
    procs: Vec<Process>,
    key: WindowKey,
    limit: u64,
    requests: u64,
    admitted: u64,
}

impl Region {
    fn new(processes: usize, limit: u64, start: u64) -> Self {
        let minute = WindowDuration::from_ms(60 * SECOND).unwrap();
        let procs = (0..processes)
            .map(|i| Process {
                name: format!("p{i}"),
                table: CounterTable::new(TableConfig::default(), i as u64),
                // Staggered, as independent processes are.
                next_replay: start + i as u64 * REPLAY_MS / processes as u64,
            })
            .collect();
        let key = WindowKeyRef::new("ws", "api", "client", minute).unwrap();
        Region {
            origin: Origin::default(),
            procs,
            key: key.to_owned_key(),
            limit,
            requests: 0,
            admitted: 0,
        }
    }

    /// Every process replays on its own cadence, up to `now`.
    fn replay_until(&mut self, now: u64) {
        for p in &mut self.procs {
            while p.next_replay <= now {
                let batch = p.table.take_replay(MAX_BATCH, p.next_replay);
                if !batch.is_empty() {
                    let answer = self.origin.replay(&batch.to_wire(&p.name));
                    p.table.ack_replay(&batch, &answer.cells);
                }
                p.next_replay += REPLAY_MS;
            }
        }
    }

    /// The first half of a request of cost 1 by process `pid`: decided locally (and applied),
    /// or the call to make.
    fn begin(&mut self, pid: usize, now: u64) -> Result<bool, OriginCall> {
        self.requests += 1;
        let (key, limit, cost) = (self.key.as_ref(), self.limit, 1);
        let decided = match self.procs[pid].table.check(key, limit, cost, now) {
            Step::Decided(d) | Step::Fallback(d) => Ok(d.success),
            Step::Origin(plan) => Err(OriginCall::single(LimitRequest { key, limit, cost }, plan)),
        };
        self.admitted += u64::from(decided == Ok(true));
        decided
    }

    /// The second half: the origin decides `call` and the process merges the answer.
    fn complete(&mut self, pid: usize, call: &OriginCall, now: u64) -> bool {
        let p = &mut self.procs[pid];
        let response = self.origin.decide(&call.to_wire(&p.name), now);
        let answers = call.answers(&response).unwrap();
        let success = p.table.finish(call, &answers, now).unwrap().success;
        self.admitted += u64::from(success);
        success
    }

    fn request(&mut self, pid: usize, now: u64) -> bool {
        self.replay_until(now);
        let begun = self.begin(pid, now);
        begun.unwrap_or_else(|call| self.complete(pid, &call, now))
    }

    /// After every process replayed once more, the origin's count of the cell at `now`.
    fn origin_count(&mut self, now: u64) -> u64 {
        self.replay_until(now + REPLAY_MS);
        let seq = self.key.duration().sequence(now);
        self.origin.ledger(&self.key.clone(), seq).count()
    }

    fn report(&self, what: &str) {
        let per_1000 = self.origin.decisions * 1_000 / self.requests.max(1);
        println!(
            "{what}: {} of {} requests admitted (limit {}), {per_1000} origin decisions / 1000 requests",
            self.admitted, self.requests, self.limit
        );
    }
}

#[test]
fn a_burst_of_20x_over_five_processes_stays_within_the_limit() {
    let (limit, processes) = (100, 5);
    let mut r = Region::new(processes, limit, T0);
    let n = 20 * limit;
    let start = T0 + 10 * SECOND;
    for k in 0..n {
        r.request(k as usize % processes, start + k * SECOND / n);
    }
    r.report("5 processes, 20x burst in 1 s");
    let admitted = r.admitted;
    assert!((95..=limit).contains(&admitted), "admitted {admitted}");
    assert_eq!(
        r.origin_count(start),
        admitted,
        "the origin counted it once"
    );
}

#[test]
fn a_lone_client_on_one_of_five_processes_gets_exactly_its_limit() {
    for limit in [1, 10, 100, 1_000] {
        let mut r = Region::new(5, limit, T0);
        // Twice the limit, one after another over 20 s of one window, all on process 0.
        let n = 2 * limit;
        let outcomes: Vec<bool> = (0..n)
            .map(|k| r.request(0, T0 + k * 20 * SECOND / n))
            .collect();
        r.report(&format!("lone client, 4 idle processes, limit {limit}"));
        let first_denied = outcomes.iter().position(|ok| !ok);
        assert_eq!(
            first_denied,
            Some(limit as usize),
            "all up to the limit pass"
        );
        assert_eq!(r.admitted, limit, "and none after it");
        assert_eq!(r.origin_count(T0), limit);
    }
}

#[test]
fn two_processes_on_a_cold_key_of_limit_1_at_the_same_ms_admit_one() {
    let mut r = Region::new(2, 1, T0);
    let now = T0 + 10 * SECOND;
    r.replay_until(now);
    // Both are cold: both calls are in flight before either answer is merged.
    let a = r.begin(0, now).expect_err("cold: decided at the origin");
    let b = r.begin(1, now).expect_err("cold: decided at the origin");
    let (first, second) = (r.complete(0, &a, now), r.complete(1, &b, now));
    assert!(first && !second, "one after the other: {first} {second}");
    // Both know now: the rest of the window is denied, wherever it arrives.
    for k in 0..10 {
        assert!(!r.request(k % 2, now + 1 + k as u64 * 50));
    }
    r.report("2 processes, cold key of limit 1, same ms");
    assert_eq!((r.admitted, r.origin_count(now)), (1, 1));
}

#[test]
fn a_replay_batch_delivered_twice_counts_once() {
    let mut r = Region::new(1, 100, T0);
    // Passes at the origin grow the lease, then pass locally; no replay tick in between.
    let now = T0 + 10 * SECOND;
    r.replay_until(now);
    let passed = (0..20).filter(|&k| r.request(0, now + k)).count() as u64;
    assert_eq!(passed, 20);
    let p = &mut r.procs[0];
    let own = p.table.get(r.key.as_ref()).unwrap().current().own();
    assert!(own > 0, "some passes were local");
    let batch = p.table.take_replay(MAX_BATCH, now + 20);
    assert_eq!(batch.events[0].used, own);
    let wire = batch.to_wire(&p.name);
    let once = r.origin.replay(&wire);
    let twice = r.origin.replay(&wire);
    assert_eq!(once.cells[0].regional, 20, "each pass counted once");
    assert_eq!(twice, once, "the second delivery adds nothing");
    p.table.ack_replay(&batch, &once.cells);
    p.table.ack_replay(&batch, &twice.cells);
    let cell = *p.table.get(r.key.as_ref()).unwrap().current();
    assert_eq!((cell.unacked(), cell.counts().regional), (0, 20));
    // A late copy of the old batch after a newer one takes nothing back.
    let more = (20..30).filter(|&k| r.request(0, now + k)).count() as u64;
    r.replay_until(now + REPLAY_MS);
    assert_eq!(r.origin.replay(&wire), r.origin.replay(&wire));
    assert_eq!(r.origin_count(now), 20 + more);
    r.report("replay delivered twice");
}
