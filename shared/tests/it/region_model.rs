//! A deterministic model of one region under leases: N processes, each with its own
//! `CounterTable`, and one origin keeping a `CellLedger` per cell, on a simulated clock.
//! Every request goes through the core request path (`check`; else `OriginCall`, sent over the
//! wire types to the origin, and `finish`), and every process replays its own counts every
//! 100 ms (`take_replay` / `ack_replay`). The origin decides as the embedded one does
//! (regional-gateway/src/origin/memory.rs), through the core's `ledger::decide`. No randomness:
//! arrivals are evenly spread.

use crate::support;

use std::collections::HashMap;

use strata_core::request::OriginCall;
use strata_core::table::{LimitRequest, Step};
use strata_core::wire::MAX_BATCH;
use strata_core::{CounterTable, Counts, TableConfig, WindowDuration, WindowKey, WindowKeyRef};
use support::origin::{Cells, Origin};

const SECOND: u64 = 1_000;
const REPLAY_MS: u64 = 100;
const T0: u64 = 28_333_334 * 60 * SECOND; // a minute boundary

const fn regional(regional: u64) -> Counts {
    Counts {
        regional,
        global: 0,
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

/// Whether one exact limiter admits a request at `t`, given what it admitted per window.
fn exact_pass(per_window: &HashMap<u64, u64>, t: u64, d: WindowDuration, limit: u64) -> bool {
    let seq = d.sequence(t);
    let count = |s: u64| per_window.get(&s).copied().unwrap_or(0);
    let check = strata_core::LimitCheck {
        counts: strata_core::WindowCounts {
            current: regional(count(seq)),
            previous: regional(count(seq - 1)),
        },
        duration: d,
        limit,
        cost: 1,
    };
    check.decide(t, 0).success
}

/// Where an admission at `t` broke the limit, if one did: the exact limiter's own check
/// (both fixed windows, the previous one weighted) over everything admitted before it.
fn first_over_limit(admitted: &[u64], d: WindowDuration, limit: u64) -> Option<u64> {
    let mut per_window: HashMap<u64, u64> = HashMap::new();
    for &t in admitted {
        if !exact_pass(&per_window, t, d, limit) {
            return Some(t);
        }
        *per_window.entry(d.sequence(t)).or_default() += 1;
    }
    None
}

/// How many of `times` one exact limiter would admit.
fn exact_admits(times: &[u64], d: WindowDuration, limit: u64) -> u64 {
    let mut per_window: HashMap<u64, u64> = HashMap::new();
    let mut admitted = 0;
    for &t in times {
        if exact_pass(&per_window, t, d, limit) {
            *per_window.entry(d.sequence(t)).or_default() += 1;
            admitted += 1;
        }
    }
    admitted
}

/// No admission broke the limit at its instant, and no more than 1% fewer of `times` were
/// admitted than an exact limiter admits.
fn assert_exact(admitted: &[u64], times: &[u64], d: WindowDuration, limit: u64) {
    assert_eq!(first_over_limit(admitted, d, limit), None);
    let exact = exact_admits(times, d, limit);
    assert!(
        admitted.len() as u64 + exact / 100 >= exact,
        "admitted {} of the {exact} an exact limiter admits",
        admitted.len()
    );
}

/// A process alone on a key paced at its limit is lent the room the previous window frees
/// during its lease, and decides from memory: no admission breaks the limit at its instant,
/// it admits what an exact limiter admits, and it goes to the origin a few times a window
/// rather than every few requests (the room freed between two of them).
#[test]
fn a_lone_process_paced_at_its_limit_decides_from_memory_and_stays_exact() {
    let limit = 600; // a minute: 10 a second at 1x
    let mut r = Region::new(1, limit, T0);
    let d = r.key.duration();
    let times: Vec<u64> = (0..1_800).map(|k| T0 + k * 100 + 7).collect();
    let admitted: Vec<u64> = times.iter().copied().filter(|&t| r.request(0, t)).collect();
    r.report("lone process at 1x for three windows");
    assert_exact(&admitted, &times, d, limit);
    let per_1000 = r.origin.decisions * 1_000 / r.requests;
    // 676 before such leases; each now lasts until the room it lent is used (25 of a
    // minute window's 600 freed in 5 s, at 10 a second).
    assert!(per_1000 <= 60, "{per_1000} origin decisions per 1,000");
}

/// A second process arriving while the first holds a lease lent on the room still to come
/// shares the key without anyone breaking the limit, and gets what an exact limiter gives it:
/// the first paces at the limit alone for two windows, then both at half of it.
#[test]
fn a_second_process_joining_a_lone_holder_at_its_limit_stays_exact() {
    let limit = 600;
    let mut r = Region::new(2, limit, T0);
    let d = r.key.duration();
    let (mut admitted, mut times) = (Vec::new(), Vec::new());
    let (mut second, mut second_offered) = (0, 0);
    for k in 0..1_800_u64 {
        let t = T0 + k * 100 + 7;
        let (pid, offered) = match k {
            ..1_500 => (0, true),
            _ => ((k % 2) as usize, true),
        };
        if offered {
            times.push(t);
            second_offered += u64::from(pid == 1);
            if r.request(pid, t) {
                admitted.push(t);
                second += u64::from(pid == 1);
            }
        }
    }
    r.report("second process joining a lone holder");
    println!("the second process admitted {second} of {second_offered}");
    assert_exact(&admitted, &times, d, limit);
    let end = T0 + 179_907;
    let in_last = admitted
        .iter()
        .filter(|&&t| d.sequence(t) == d.sequence(end))
        .count() as u64;
    assert_eq!(r.origin_count(end), in_last, "the origin counted each once");
}

/// A lease lent just before a window ends is mostly unused when it rolls over. Its holder's
/// count in the old cell is final once its clock left it, so the lease goes then: with the
/// holder's first decision from the next window, or with its next replay pass if it goes
/// quiet. Kept until it expired, its unused part weighed in the next window's previous term,
/// where no process's view sees it: each view showed room the origin denied, so every
/// request asked. Before: 397 origin decisions for the 401 requests of the first case, and 13
/// admitted of the 21 an exact limiter admits; 98 decisions for the 401 of the second (7 now).
#[test]
fn a_lease_lent_as_a_window_ends_holds_nothing_back_once_its_holder_moved_on() {
    let limit = 20;
    for holder_asks_again in [true, false] {
        let mut r = Region::new(2, limit, T0);
        let d = r.key.duration();
        let end = T0 + 60 * SECOND;
        let (mut times, mut admitted) = (Vec::new(), Vec::new());
        // Process 0's first request is lent a lease 50 ms before the window ends; then a
        // request every 10 ms, far over the limit: taking turns with process 1, or all on it.
        let next = (0..400).map(|k| end + 10 + k * 10);
        for t in core::iter::once(end - 50).chain(next) {
            times.push(t);
            let pid = usize::from(t >= end && (!holder_asks_again || t % 20 == 0));
            if r.request(pid, t) {
                admitted.push(t);
            }
        }
        r.report(&format!(
            "a lease lent as the window ends, then over the limit (holder asks again: {holder_asks_again})"
        ));
        assert_exact(&admitted, &times, d, limit);
        let per_admission = r.origin.decisions as f64 / admitted.len() as f64;
        assert!(
            per_admission <= 1.5,
            "{} origin decisions for {} admissions",
            r.origin.decisions,
            admitted.len()
        );
    }
}

/// An answer merged after its process's clock left the window it was decided in (a slow
/// call at a window's end) lends a lease the process cannot use there: it is held only to go
/// back with the next replay, so the origin stops reserving it. Before, it held no cell at
/// all, and the origin reserved it until it expired (a loaded gateway's quiet key kept the
/// next window's other processes asking on every request).
#[test]
fn a_lease_whose_answer_comes_after_its_window_goes_back_with_the_next_replay() {
    let mut r = Region::new(2, 20, T0);
    let end = T0 + 60 * SECOND;
    let key = r.key.clone();
    let sequence = key.duration().sequence(end - 5);
    let call = r
        .begin(0, end - 5)
        .expect_err("cold: decided at the origin");
    let response = r.origin.decide(&call.to_wire("p0"), end - 5);
    let answers = call.answers(&response).unwrap();
    let p = &mut r.procs[0];
    assert!(p.table.finish(&call, &answers, end + 5).unwrap().success);
    assert!(
        r.origin.ledger(&key, sequence).reserved("p1", end + 5).0 > 0,
        "lent, and reserved"
    );
    r.replay_until(end + REPLAY_MS);
    assert_eq!(
        r.origin
            .ledger(&key, sequence)
            .reserved("p1", end + REPLAY_MS),
        (0, 0),
        "given back by the replay"
    );
}

/// Random arrivals at `rate_x` times the limit (100 per 10 s unless given) over `procs`
/// processes for 60 s; from `alone_after_s` on, only process 0's clients remain. Returns the
/// region, the request times and the admitted ones.
fn random_traffic(
    procs: usize,
    rate_x: u64,
    limit: u64,
    alone_after_s: u64,
) -> (Region, Vec<u64>, Vec<u64>) {
    let mut r = Region::new(procs, limit, T0);
    let d = WindowDuration::from_ms(10 * SECOND).unwrap();
    r.key = WindowKeyRef::new("ws", "api", "client", d)
        .unwrap()
        .to_owned_key();
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mean_gap_us = 1_000_000 / (rate_x * limit / 10);
    let (mut times, mut admitted) = (Vec::new(), Vec::new());
    let mut t_us = 0_u64;
    while t_us < 60_000_000 {
        t_us += rnd() % (2 * mean_gap_us);
        let now = T0 + t_us / 1_000;
        let pid = if t_us >= alone_after_s * 1_000_000 {
            0
        } else {
            (rnd() % procs as u64) as usize
        };
        times.push(now);
        if r.request(pid, now) {
            admitted.push(now);
        }
    }
    (r, times, admitted)
}

/// Processes over a key's limit each ask the origin for every unit the window frees that
/// their view shows, and all but one are denied: main made 62 decisions per 1,000 requests
/// with two processes at 27x and 590 with five at 5x. A process that lost such races leaves
/// room for its rivals before it asks again, and when the rivals leave it takes the whole
/// limit again. Nothing breaks the limit and what an exact limiter admits is admitted within
/// 1% (the room left for rivals is at most 1% of the limit).
#[test]
fn processes_over_the_limit_ask_once_for_most_freed_units() {
    for (procs, rate_x, limit, most) in [(2, 27, 100, 40), (2, 3, 100, 350), (5, 5, 1_000, 200)] {
        let (r, times, admitted) = random_traffic(procs, rate_x, limit, 60);
        r.report(&format!("{procs} processes at {rate_x}x, random arrivals"));
        let d = r.key.duration();
        assert_exact(&admitted, &times, d, limit);
        let per_1000 = r.origin.decisions * 1_000 / r.requests;
        assert!(per_1000 <= most, "{per_1000} origin decisions per 1,000");
    }
    // Five share the key at 5x for 30 s; then one process's clients alone, still at 5x.
    let (r, times, admitted) = random_traffic(5, 5, 1_000, 30);
    r.report("five processes at 5x, then one alone");
    let d = r.key.duration();
    assert_exact(&admitted, &times, d, 1_000);
    // Alone, it passes from its covering lease (which counts what the origin passed for it
    // too) and seldom asks, so rivals it counted may stay counted: only a strict call that
    // finds their room untaken forgets one. What matters is that their room is its own again:
    // a rival still counted holds back one request's room while it is strict and beyond its
    // lease (at most 1% of the limit, `lease::max_rivals`).
    let state = r.procs[0].table.get(r.key.as_ref()).unwrap();
    let last = admitted.iter().filter(|&&t| t >= T0 + 40_000).count();
    assert!(
        (1_998..=2_000).contains(&last),
        "the last two windows, alone: the whole limit but a rival's room, {last} ({} rivals \
         counted)",
        state.lease().rivals()
    );
}

/// Five processes sharing a key paced at its limit (random arrivals) keep their pace from
/// covering leases: each is lent the room its own past passes free as the previous window
/// decays, so most requests pass from memory (494 origin decisions per 1,000 when every
/// lease lent only what was free at the instant); nothing breaks the limit, and what an exact
/// limiter admits is admitted within 1%. A key whose limit is under `lease::COVER_FACTOR`
/// costs per holder is lent plain leases, and decides as before.
#[test]
fn processes_paced_at_a_limit_keep_their_pace_from_covering_leases() {
    let (r, times, admitted) = random_traffic(5, 1, 1_000, 60);
    r.report("five processes at 1x, random arrivals");
    assert_exact(&admitted, &times, r.key.duration(), 1_000);
    let per_1000 = r.origin.decisions * 1_000 / r.requests;
    assert!(per_1000 <= 200, "{per_1000} origin decisions per 1,000");
    let covering = |r: &Region| {
        r.procs
            .iter()
            .filter(|p| {
                p.table
                    .get(r.key.as_ref())
                    .is_some_and(|s| s.lease().covers())
            })
            .count()
    };
    assert!(covering(&r) > 0, "their leases cover");
    let (r, times, admitted) = random_traffic(2, 1, 100, 60);
    r.report("two processes at 1x, limit 100, random arrivals");
    assert_exact(&admitted, &times, r.key.duration(), 100);
    assert_eq!(
        covering(&r),
        0,
        "100 is under 200 costs per holder: plain leases"
    );
}

/// Five processes sharing a limit of 1,000 per 10 s, each sending `per_second` requests a
/// second, evenly, at its own phase, for 90 s (the lab's `five-paced`). Returns the region, the
/// request times and the admitted ones.
fn paced_five(per_second: u64) -> (Region, Vec<u64>, Vec<u64>) {
    paced_five_losing_data_at(per_second, u64::MAX)
}

/// [`paced_five`], the origin losing every cell at `lost_at_us` (an origin restarted empty).
fn paced_five_losing_data_at(per_second: u64, lost_at_us: u64) -> (Region, Vec<u64>, Vec<u64>) {
    let mut r = Region::new(5, 1_000, T0);
    let d = WindowDuration::from_ms(10 * SECOND).unwrap();
    r.key = WindowKeyRef::new("ws", "api", "client", d)
        .unwrap()
        .to_owned_key();
    let gap_us = 1_000_000 / per_second;
    let mut next: Vec<u64> = (0..5).map(|i| i * gap_us / 5 + 7_000 * i).collect();
    let (mut times, mut admitted) = (Vec::new(), Vec::new());
    loop {
        let (pid, t_us) = next
            .iter()
            .copied()
            .enumerate()
            .min_by_key(|(_, t)| *t)
            .unwrap();
        if t_us >= 90_000_000 {
            break;
        }
        next[pid] += gap_us;
        if t_us >= lost_at_us && !r.origin.cells.0.is_empty() && r.origin.decisions > 0 {
            r.origin.cells = Cells::default();
        }
        let now = T0 + t_us / 1_000;
        times.push(now);
        if r.request(pid, now) {
            admitted.push(now);
        }
    }
    (r, times, admitted)
}

/// Five processes each paced at 0.95x its share of a limit of 1,000 (19 requests a second):
/// covering leases keep them from the origin, and a lease whose room crosses what it was lent
/// by a unit of phase is kept, not given back as surplus. Giving it back at once made 28
/// origin decisions per 1,000 here, most of them in the second after the window's first
/// leases were renewed; a unit more kept, 15. Everything is admitted, as an exact limiter
/// would. (Keeping up to twice the lent room instead made the same 15 here, but admitted 1.2%
/// under an exact limiter with random arrivals at 1x, the test above.)
#[test]
fn processes_paced_under_a_limit_keep_their_covering_leases() {
    let (r, times, admitted) = paced_five(19);
    r.report("five processes at 0.95x, paced");
    assert_exact(&admitted, &times, r.key.duration(), 1_000);
    assert_eq!(admitted.len(), times.len(), "all under the limit");
    let per_1000 = r.origin.decisions * 1_000 / r.requests;
    assert!(per_1000 <= 20, "{per_1000} origin decisions per 1,000");
}

/// The same five paced at exactly their shares (20 a second each): the windows' few denials
/// leave a process short of its share, and the passes the origin decides for it in the next
/// window made it short again in the one after, when its covering lease counted its local
/// passes alone: its share decayed slower than its traffic by what the origin passed it, and
/// it asked the origin once for each of those units, 77 decisions per 1,000. Counted as its
/// part of the window (`CellState::decided`), 22; the admitted stay within 1% of an exact
/// limiter's, and the origin's per-process ledger holds what it passed for each.
#[test]
fn processes_paced_at_a_limit_count_what_the_origin_passed_them() {
    let (mut r, times, admitted) = paced_five(20);
    r.report("five processes at 1x, paced");
    let d = r.key.duration();
    assert_exact(&admitted, &times, d, 1_000);
    let per_1000 = r.origin.decisions * 1_000 / r.requests;
    assert!(per_1000 <= 35, "{per_1000} origin decisions per 1,000");
    // What each process knows was passed for it at the origin is what the origin counted
    // (no call is in flight or lost here).
    let now = times[times.len() - 1];
    let seq = d.sequence(now);
    for p in &r.procs {
        let state = p.table.get(r.key.as_ref()).unwrap();
        let ledger = r.origin.ledger(&r.key.clone(), seq - 1);
        assert_eq!(
            (state.previous().own(), state.previous().decided()),
            (ledger.own(&p.name), ledger.decided(&p.name)),
            "{}",
            p.name
        );
    }
}

/// An origin that loses its data (a Redis restarted empty) forgets what it passed for each
/// process, while each process still counts those passes in its share: unless the origin takes
/// the process's word for them (`CellLedger::merge_decided`), it lends a share smaller than
/// the one the process counts against its ceiling, and the process runs out of its lease on
/// nearly every request until the window holding those passes has decayed. Five processes at
/// 3x their shares, the data lost 45 s in: 155 decisions per 1,000 with the word taken, 370
/// without (270 with no loss at all: the lost counts are admitted again, which this model,
/// with no published floor, does not bound; the lab's `fault-redis` measures a real restart).
#[test]
fn an_origin_that_lost_its_data_takes_the_processes_word_for_what_it_passed_them() {
    let (r, _, _) = paced_five(60);
    let (lost, _, _) = paced_five_losing_data_at(60, 45_000_000);
    lost.report("five processes at 3x, the origin's data lost 45 s in");
    let per_1000 = |r: &Region| r.origin.decisions * 1_000 / r.requests;
    assert!(
        per_1000(&lost) <= per_1000(&r),
        "{} decisions per 1,000, {} without the loss",
        per_1000(&lost),
        per_1000(&r)
    );
}

/// A call begun just before a window ends and decided by the origin just after it (a slow
/// call at the boundary) is counted in the origin's new cell. The process counts it there
/// too, and only there: its next call's word for what was passed for it in the window it
/// left must not count the pass again in that window.
#[test]
fn a_call_that_straddles_a_boundary_is_counted_once_in_the_cell_the_origin_chose() {
    let mut r = Region::new(1, 1_000, T0);
    let key = r.key.clone();
    let end = T0 + 60 * SECOND;
    let before = key.duration().sequence(end - 1);
    // Warm in the window that ends, then the straddling call: planned there, decided after.
    assert!(r.request(0, end - 2_000));
    let call = loop {
        match r.begin(0, end - 2) {
            Err(call) => break call,
            // Passed from the lease; its end comes with the window's.
            Ok(passed) => assert!(passed),
        }
    };
    assert!(r.complete(0, &call, end + 1));
    // The next window's requests go to the origin too (cold there), carrying the process's
    // word for what was passed for it in the cell it left.
    for k in 0..20 {
        assert!(r.request(0, end + 10 + k * 100));
    }
    let after = r.origin_count(end + 2_100);
    let left = r.origin.ledger(&key, before).count();
    assert_eq!(
        left + after,
        r.admitted,
        "counted once each: {left} in the window left, {after} in the next"
    );
}

/// Two decision calls of one process on one key in flight at once (an Envoy's VMs share the
/// key's state but not their calls), the origin deciding them in one order and the answers
/// arriving in the other, with a pass on the first answer's lease between them: the process's
/// count of the cell still holds every pass it knows of (what the origin counted, plus its own
/// passes the origin has not heard of), so a failure mode deciding from it admits no more than
/// the limit. Merged with `max` alone, the late answer's count swallowed that pass.
#[test]
fn answers_arriving_out_of_order_leave_no_known_pass_out_of_the_count() {
    let mut r = Region::new(1, 20, T0);
    let now = T0 + 10 * SECOND;
    r.replay_until(now);
    let mut t = now;
    // Passes until the lease runs out and a request must ask.
    let first = loop {
        t += 1;
        match r.begin(0, t) {
            Ok(passed) => assert!(passed),
            Err(call) => {
                if r.procs[0]
                    .table
                    .get(r.key.as_ref())
                    .unwrap()
                    .current()
                    .is_warm()
                {
                    break call;
                }
                assert!(r.complete(0, &call, t));
            }
        }
    };
    let second = r
        .begin(0, t)
        .expect_err("the lease went back with the first call");
    let p = &mut r.procs[0];
    // The origin decides the second call first; its answer arrives first.
    let second_answer = r.origin.decide(&second.to_wire(&p.name), t);
    let first_answer = r.origin.decide(&first.to_wire(&p.name), t);
    let answers = second.answers(&second_answer).unwrap();
    assert!(p.table.finish(&second, &answers, t).unwrap().success);
    let passed_between = r.begin(0, t + 1) == Ok(true);
    let p = &mut r.procs[0];
    let answers = first.answers(&first_answer).unwrap();
    assert!(p.table.finish(&first, &answers, t + 1).unwrap().success);
    let cell = *p.table.get(r.key.as_ref()).unwrap().current();
    let seq = r.key.duration().sequence(t);
    let origin = r.origin.ledger(&r.key.clone(), seq);
    let known = origin.count() + cell.own() - origin.own("p0");
    assert!(passed_between, "the second answer lent a lease");
    assert_eq!(cell.counts().regional, known, "{cell:?}");
}

/// A decision call whose answer is lost: the origin counted it, and the process decided the
/// request itself (failure mode `local`) and replays that pass. The replay carries the undo
/// of the lost call, so the origin counts the request once with no later call on the key (a
/// key that went quiet stayed counted twice), and the process stops asking once it is taken.
#[test]
fn a_lost_answer_is_undone_by_the_replay_and_the_request_counts_once() {
    let mut r = Region::new(1, 20, T0);
    let now = T0 + 10 * SECOND;
    r.replay_until(now);
    let call = r.begin(0, now).expect_err("a cold key asks");
    let p = &mut r.procs[0];
    let lost = r.origin.decide(&call.to_wire(&p.name), now);
    assert!(
        lost.success,
        "counted at the origin; the answer never arrives"
    );
    assert!(
        p.table.fail(&call, now).unwrap().success,
        "the failure mode admits it"
    );
    let state = *p.table.get(r.key.as_ref()).unwrap();
    assert_eq!(state.uncertain_from(), call.limits()[0].plan.call);
    let seq = r.key.duration().sequence(now);
    r.replay_until(now + REPLAY_MS);
    assert_eq!(
        r.origin.ledger(&r.key.clone(), seq).count(),
        1,
        "counted once"
    );
    let state = *r.procs[0].table.get(r.key.as_ref()).unwrap();
    assert_eq!(state.uncertain_from(), 0, "the undo was taken");
    assert_eq!(state.current().unacked(), 0);
    // Nothing more to send: the next passes carry no event for the key.
    let batch = r.procs[0].table.take_replay(MAX_BATCH, now + 2 * REPLAY_MS);
    assert!(batch.is_empty(), "{batch:?}");
}

/// The same with the window rolling between the lost answer and the next replay pass (a
/// request of the next window came first): the undo follows its cell, and the replay of the
/// previous cell carries it.
#[test]
fn a_lost_answer_is_undone_in_its_own_window_after_the_window_rolls() {
    let mut r = Region::new(1, 20, T0);
    let late = T0 + 60 * SECOND - 10; // the last moments of a minute window
    r.replay_until(late);
    let call = r.begin(0, late).expect_err("a cold key asks");
    let p = &mut r.procs[0];
    assert!(r.origin.decide(&call.to_wire(&p.name), late).success);
    assert!(p.table.fail(&call, late).unwrap().success);
    let next = T0 + 60 * SECOND + 5;
    // Before any replay pass: the request rolls the state to the new window.
    let first = r.begin(0, next).expect_err("a new window's cell is cold");
    assert!(
        r.complete(0, &first, next),
        "the next window's first request"
    );
    let state = *r.procs[0].table.get(r.key.as_ref()).unwrap();
    assert_eq!(state.uncertain_from(), 0, "nothing lost in this window");
    assert_eq!(state.uncertain_previous(), call.limits()[0].plan.call);
    r.replay_until(next + REPLAY_MS);
    let old = r.key.duration().sequence(late);
    assert_eq!(
        r.origin.ledger(&r.key.clone(), old).count(),
        1,
        "counted once"
    );
    let state = *r.procs[0].table.get(r.key.as_ref()).unwrap();
    assert_eq!(state.uncertain_previous(), 0, "the undo was taken");
}

/// Found by the protocol model (`tests/it/protocol_model.rs`): two calls of one process out at
/// once, the later one counted and answered, the earlier given up on before the origin took
/// it. The replay's undo names the lost call, and the origin takes back only that call's count:
/// it once undid its last counted call whenever that was as late as the lost one, and so took
/// back the answered pass.
#[test]
fn the_undo_of_a_lost_call_never_takes_back_a_later_answered_one() {
    let mut r = Region::new(1, 20, T0);
    let now = T0 + 10 * SECOND;
    r.replay_until(now);
    let lost = r.begin(0, now).expect_err("a cold key asks");
    let answered = r.begin(0, now).expect_err("still cold: a second call");
    assert!(answered.limits()[0].plan.call > lost.limits()[0].plan.call);
    assert!(r.complete(0, &answered, now), "counted and answered");
    let p = &mut r.procs[0];
    assert!(
        p.table.fail(&lost, now + 250).unwrap().success,
        "the failure mode admits it"
    );
    r.replay_until(now + 300);
    let seq = r.key.duration().sequence(now);
    assert_eq!(
        r.origin.ledger(&r.key.clone(), seq).count(),
        2,
        "both passes counted once"
    );
}
