//! The local table's bookkeeping: eviction order, expiry, flush and memory.

use strata_core::lease::LEASE_IDLE_MS;
use strata_core::replay::QuietPace;
use strata_core::table::{BYTES_PER_ENTRY, LimitRequest, MIN_CAPACITY, Step};
use strata_core::{
    Begin, CounterTable, Counts, FailureMode, OriginAnswer, OriginCall, OriginPlan, PublishPolicy,
    Reason, TableConfig, WindowDuration, WindowKeyRef,
};

use crate::support;

const T0: u64 = 1_700_000_000_000;

fn second() -> WindowDuration {
    WindowDuration::from_ms(1_000).unwrap()
}

fn small(capacity: usize) -> CounterTable {
    CounterTable::new(
        TableConfig {
            capacity,
            ..TableConfig::default()
        },
        1,
    )
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("user-{i}")).collect()
}

fn key(id: &str) -> WindowKeyRef<'_> {
    WindowKeyRef::new("ws", "ns", id, second()).unwrap()
}

// Eviction order is tested with cost-0 checks: an entry holding unreplayed cost is passed
// over (tested below), which would hide the order.
#[test]
fn capacity_is_never_exceeded_and_an_unused_entry_goes_before_used_ones() {
    let ids = names(MIN_CAPACITY + 1);
    let mut t = small(MIN_CAPACITY);
    for id in &ids[..MIN_CAPACITY] {
        t.decide(key(id), 10, 0, T0);
    }
    // Use every entry again but user-7: it is the only one the eviction hand may take.
    for (i, id) in ids[..MIN_CAPACITY].iter().enumerate() {
        if i != 7 {
            t.decide(key(id), 10, 0, T0);
        }
    }
    t.decide(key(&ids[MIN_CAPACITY]), 10, 0, T0);
    assert_eq!(t.len(), MIN_CAPACITY);
    assert!(
        t.get(key(&ids[7])).is_none(),
        "the unused entry was evicted"
    );
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(t.get(key(id)).is_some(), i != 7, "{id}");
    }
    assert_eq!(t.stats().evicted, 1);
}

#[test]
fn a_flood_of_new_keys_evicts_itself_before_keys_in_use() {
    let ids = names(MIN_CAPACITY * 20);
    let mut t = small(MIN_CAPACITY);
    let hot = &ids[..MIN_CAPACITY / 2];
    for id in hot {
        t.decide(key(id), 10, 0, T0);
    }
    for flood in ids[MIN_CAPACITY..].chunks(8) {
        // The hot keys keep being used between bursts of one-off keys.
        for id in hot {
            t.decide(key(id), 1_000, 0, T0);
        }
        for id in flood {
            t.decide(key(id), 10, 0, T0);
        }
    }
    assert_eq!(t.len(), MIN_CAPACITY);
    let kept = hot.iter().filter(|id| t.get(key(id)).is_some()).count();
    assert_eq!(
        kept,
        hot.len(),
        "every hot key survived {} evictions",
        t.stats().evicted
    );
}

#[test]
fn an_evicted_key_comes_back_cold() {
    let ids = names(MIN_CAPACITY + 1);
    let mut t = small(MIN_CAPACITY);
    for id in &ids {
        t.decide(key(id), 10, 0, T0);
    }
    let gone: Vec<&String> = ids.iter().filter(|id| t.get(key(id)).is_none()).collect();
    assert_eq!(gone.len(), 1);
    assert!(matches!(t.check(key(gone[0]), 10, 0, T0), Step::Origin(_)));
}

#[test]
fn a_multi_limit_request_never_evicts_its_own_entries() {
    let ids = names(MIN_CAPACITY + MIN_CAPACITY / 2);
    let mut t = small(MIN_CAPACITY);
    // A full table of entries all in use.
    for _ in 0..2 {
        for id in &ids[..MIN_CAPACITY] {
            t.decide(key(id), 10, 1, T0);
        }
    }
    let limits: Vec<LimitRequest<'_>> = ids[MIN_CAPACITY..]
        .iter()
        .map(|id| LimitRequest {
            key: key(id),
            limit: 5,
            cost: 1,
        })
        .collect();
    let m = t.decide_all(&limits, T0).unwrap();
    assert!(m.success);
    for l in &limits {
        assert_eq!(t.get(l.key).unwrap().current().counts().regional, 1);
    }
}

/// What the README and the shells state: a full table holds at most `BYTES_PER_ENTRY` a key
/// (keys of typical length: the text inline). Its first eviction sizes the key index for
/// churn once; from then on nothing grows, however many more keys come.
#[test]
fn a_full_table_holds_at_most_its_stated_bytes_per_key_and_stays_there() {
    for capacity in [MIN_CAPACITY, 1_000, 50_000] {
        let mut t = small(capacity);
        let ids = names(4 * capacity);
        let mut bytes = Vec::new();
        for round in ids.chunks(capacity) {
            for id in round {
                t.decide(key(id), 10, 0, T0);
            }
            assert_eq!(t.len(), capacity);
            bytes.push(t.heap_bytes());
        }
        eprintln!("{capacity} keys: bytes after each round of as many new keys: {bytes:?}");
        assert_eq!(t.stats().evicted, 3 * capacity as u64);
        let most = bytes.iter().copied().max().unwrap_or(0);
        assert!(
            most <= capacity * BYTES_PER_ENTRY,
            "{capacity} keys: {most} bytes, {} a key",
            most / capacity
        );
        assert_eq!(bytes[1], bytes[3], "{capacity}: memory still grows");
    }
}

#[test]
fn capacity_below_the_minimum_is_raised() {
    let t = small(1);
    assert_eq!(t.config().capacity, MIN_CAPACITY);
}

#[test]
fn purge_drops_only_entries_whose_cells_expired() {
    let ids = names(10);
    let mut t = small(100);
    for id in &ids[..5] {
        t.decide(key(id), 10, 1, T0);
    }
    for id in &ids[5..] {
        t.decide(key(id), 10, 1, T0 + 1_500);
    }
    // At T0 + 2000 the first five (window T0) expire; the rest (window T0+1000) do not.
    assert_eq!(t.purge_expired(T0 + 2_000, 100), 5);
    assert_eq!(t.len(), 5);
    assert!(t.get(key(&ids[5])).is_some());
    assert_eq!(t.stats().expired, 5);
    // Freed slots are reused before the table grows.
    let before = t.heap_bytes();
    for id in &ids[..5] {
        t.decide(key(id), 10, 1, T0 + 2_000);
    }
    assert_eq!(t.len(), 10);
    assert!(t.heap_bytes() <= before + 64, "slots were recycled");
}

#[test]
fn flush_rows_are_sorted_and_commit_only_what_was_written() {
    let mut t = small(100);
    for id in ["c", "a", "b"] {
        for _ in 0..5 {
            t.decide(key(id), 10, 1, T0);
        }
    }
    let policy = PublishPolicy::default();
    let rows = t.flush_candidates(&policy, T0 + 10);
    let ids: Vec<&str> = rows.iter().map(|r| r.key.as_ref().identifier()).collect();
    assert_eq!(ids, ["a", "b", "c"]);
    assert!(
        rows.iter()
            .all(|r| r.count == 5 && r.expires_at == T0 + 2_000)
    );
    // Commit only the first two (as if the third chunk failed): it is offered again.
    t.commit_flush(&rows[..2]);
    t.decide(key("a"), 10, 1, T0 + 20);
    let again = t.flush_candidates(&policy, T0 + 30);
    let ids: Vec<(&str, u64)> = again
        .iter()
        .map(|r| (r.key.as_ref().identifier(), r.count))
        .collect();
    assert_eq!(ids, [("a", 6), ("c", 5)]);
}

/// A flush looked through in steps finds what one look at the whole table finds, each step
/// bounded, and says where to go on until the end.
#[test]
fn flush_candidates_in_steps_find_what_one_walk_finds() {
    let mut t = small(100);
    let ids: Vec<String> = (0..40).map(|i| format!("k{i:02}")).collect();
    for (i, id) in ids.iter().enumerate() {
        // Every other key over the floor.
        for _ in 0..if i % 2 == 0 { 5 } else { 1 } {
            t.decide(key(id), 10, 1, T0);
        }
    }
    let policy = PublishPolicy::default();
    let whole = t.flush_candidates(&policy, T0 + 10);
    assert_eq!(whole.len(), 20);
    let (mut rows, mut steps, mut from) = (Vec::new(), 0, Some(0));
    while let Some(at) = from {
        let before = rows.len();
        from = t.flush_candidates_from(&policy, T0 + 10, at, 7, &mut rows);
        assert!(rows.len() - before <= 7 * 2, "two cells a slot at most");
        steps += 1;
    }
    assert_eq!(steps, 40_usize.div_ceil(7));
    strata_core::gcounter::sort_flush_rows(&mut rows);
    assert_eq!(rows, whole);
}

#[test]
fn expired_cells_are_not_flushed() {
    let mut t = small(100);
    for _ in 0..5 {
        t.decide(key("late"), 10, 1, T0);
    }
    assert_eq!(
        t.flush_candidates(&PublishPolicy::default(), T0 + 1_999)
            .len(),
        1
    );
    assert!(
        t.flush_candidates(&PublishPolicy::default(), T0 + 2_000)
            .is_empty()
    );
}

#[test]
fn a_multi_limit_naming_one_key_twice_is_charged_twice() {
    let mut t = small(100);
    let k = key("twice");
    let limits = [
        LimitRequest {
            key: k,
            limit: 3,
            cost: 1,
        },
        LimitRequest {
            key: k,
            limit: 3,
            cost: 1,
        },
    ];
    assert!(t.decide_all(&limits, T0).unwrap().success);
    assert_eq!(t.get(k).unwrap().current().counts().regional, 2);
    assert!(!t.decide_all(&limits, T0).unwrap().success, "2 + 2 > 3");
    assert_eq!(t.get(k).unwrap().current().counts().regional, 2);
}

/// What an origin answers for a pass of `plan` that leaves `remaining`, with a lease.
fn granted(plan: &OriginPlan, limit: u64, regional: u64, lease: u64) -> OriginAnswer {
    OriginAnswer {
        limit,
        remaining: limit - regional,
        reset_ms: second().reset(plan.sequence),
        sequence: plan.sequence,
        counted: true,
        denied: false,
        current: Counts {
            regional,
            global: 0,
        },
        previous: Counts::default(),
        used: plan.used[0],
        lease,
        lease_id: u64::from(lease > 0),
        lease_ms: 5_000,
        covers: false,
    }
}

/// Decides `key` once at a scripted origin that grants `lease`.
fn warm(t: &mut CounterTable, key: WindowKeyRef<'_>, limit: u64, lease: u64) {
    support::warm(t, key, limit, lease, T0);
}

#[test]
fn a_multi_limit_request_goes_to_the_origin_whole_and_counts_nothing_first() {
    let mut t = small(100);
    let (a, b) = (key("a"), key("b"));
    warm(&mut t, a, 3, 2);
    let limits = [
        LimitRequest {
            key: a,
            limit: 3,
            cost: 1,
        },
        LimitRequest {
            key: b,
            limit: 3,
            cost: 1,
        },
    ];
    let Begin::Call(call) = t.begin(&limits, T0).unwrap() else {
        panic!("b is cold");
    };
    let reasons: Vec<Reason> = call.limits().iter().map(|l| l.plan.reason).collect();
    assert_eq!(
        reasons,
        [Reason::Lease, Reason::Cold],
        "a's lease covers it, yet it goes too"
    );
    assert_eq!(
        t.get(a).unwrap().current().own(),
        0,
        "nothing counted locally"
    );
    let plans: Vec<OriginPlan> = call.limits().iter().map(|l| l.plan).collect();
    let answers = [granted(&plans[0], 3, 2, 0), granted(&plans[1], 3, 1, 1)];
    let multi = t.finish(&call, &answers, T0).unwrap();
    assert!(multi.success);
    assert_eq!(t.get(a).unwrap().current().counts().regional, 2);
    assert_eq!(t.get(b).unwrap().current().lease_left(), 1);
}

#[test]
fn a_failed_origin_call_falls_back_to_local_memory_all_or_nothing() {
    let mut t = small(100);
    let (a, b) = (key("a"), key("b"));
    let limits = [
        LimitRequest {
            key: a,
            limit: 1,
            cost: 1,
        },
        LimitRequest {
            key: b,
            limit: 5,
            cost: 1,
        },
    ];
    let Begin::Call(call) = t.begin(&limits, T0).unwrap() else {
        panic!("both cold");
    };
    let local = t.fail(&call, T0).unwrap();
    assert!(local.success, "the local view has room");
    let Begin::Decided(again) = t.begin(&limits, T0 + 1).unwrap() else {
        panic!("within the retry delay, and a's local view denies");
    };
    assert!(!again.success);
    assert_eq!(
        t.get(b).unwrap().current().counts().regional,
        1,
        "b not charged"
    );
    assert!(
        matches!(t.begin(&limits[1..], T0 + 300).unwrap(), Begin::Call(_)),
        "the retry delay passed"
    );
}

/// A table whose origin policy has failure mode `mode`.
fn with_mode(mode: FailureMode) -> CounterTable {
    let mut config = TableConfig::default();
    config.origin.failure_mode = mode;
    CounterTable::new(config, 1)
}

#[test]
fn each_failure_mode_decides_a_failed_call_and_the_calls_held_off_after_it() {
    for (mode, passes) in [
        (FailureMode::Local, true),
        (FailureMode::Allow, true),
        (FailureMode::Deny, false),
    ] {
        let mut t = with_mode(mode);
        let k = key("cold");
        let limit = LimitRequest {
            key: k,
            limit: 10,
            cost: 1,
        };
        let Begin::Call(call) = t.begin(&[limit], T0).unwrap() else {
            panic!("cold");
        };
        assert_eq!(t.fail(&call, T0).unwrap().success, passes, "{mode:?}");
        // Held off for the retry delay: no call, decided the same way, counted only if passed.
        for i in 1..=3 {
            let Begin::Fallback(d) = t.begin(&[limit], T0 + i).unwrap() else {
                panic!("{mode:?}: a call within the retry delay");
            };
            assert_eq!(d.success, passes, "{mode:?}");
            assert!(matches!(t.check(k, 10, 1, T0 + i), Step::Fallback(d) if d.success == passes));
        }
        let admitted = if passes { 7 } else { 0 };
        assert_eq!(t.get(k).unwrap().current().own(), admitted, "{mode:?}");
        // A denial the process's own count proves needs no origin: denied in every mode.
        assert!(matches!(t.check(k, 0, 1, T0 + 5), Step::Decided(d) if !d.success));
        assert!(matches!(
            t.begin(&[limit], T0 + 300).unwrap(),
            Begin::Call(_)
        ));
    }
}

#[test]
fn in_deny_mode_a_lease_granted_before_the_outage_still_covers_what_it_covers() {
    let mut t = with_mode(FailureMode::Deny);
    let (warm_key, cold) = (key("warm"), key("cold"));
    warm(&mut t, warm_key, 100, 2); // one pass at the origin, two more lent
    let Step::Origin(plan) = t.check(cold, 100, 1, T0 + 1) else {
        panic!("cold");
    };
    let request = LimitRequest {
        key: cold,
        limit: 100,
        cost: 1,
    };
    assert!(
        !t.fail(&OriginCall::single(request, plan), T0 + 1)
            .unwrap()
            .success
    );
    assert!(matches!(t.check(cold, 100, 1, T0 + 2), Step::Fallback(d) if !d.success));
    // The lease covers two: passed from memory, outage or not; the third needs the origin.
    assert!(matches!(t.check(warm_key, 100, 1, T0 + 3), Step::Decided(d) if d.success));
    assert!(matches!(t.check(warm_key, 100, 1, T0 + 4), Step::Decided(d) if d.success));
    assert!(matches!(t.check(warm_key, 100, 1, T0 + 5), Step::Origin(_)));
}

#[test]
fn the_replay_carries_cumulative_counts_and_a_repeat_is_harmless() {
    let mut t = small(100);
    let k = key("r");
    warm(&mut t, k, 100, 10);
    for _ in 0..3 {
        assert!(matches!(t.check(k, 100, 1, T0 + 1), Step::Decided(d) if d.success));
    }
    let batch = t.take_replay(1_000, T0 + 2);
    assert_eq!(batch.len(), 1);
    assert_eq!(
        batch.events[0].used, 3,
        "local passes only: the first was counted there"
    );
    let again = t.take_replay(1_000, T0 + 2);
    assert_eq!(
        again, batch,
        "nothing is removed before the origin acknowledges it"
    );
    let counts = [Counts {
        regional: 4,
        global: 0,
    }];
    t.ack_replay(&batch, &counts);
    t.ack_replay(&batch, &counts);
    assert_eq!(t.get(k).unwrap().current().unacked(), 0);
    assert!(t.take_replay(1_000, T0 + 3).is_empty());
    assert!(matches!(t.check(k, 100, 1, T0 + 4), Step::Decided(d) if d.success));
    assert_eq!(t.take_replay(1_000, T0 + 5).events[0].used, 4);
}

/// A key in use reaches a new window with a decision (the new cell is cold), whose call
/// carries this process's own count of the window before, merged at the origin: the replay
/// does not send that cell again. An answer for another window than the call's acknowledges
/// nothing of it.
#[test]
fn a_decision_in_a_new_window_delivers_the_last_ones_tail() {
    let setup = || {
        let mut t = small(100);
        let k = key("tail");
        warm(&mut t, k, 100, 10);
        for _ in 0..3 {
            assert!(matches!(t.check(k, 100, 1, T0 + 1), Step::Decided(d) if d.success));
        }
        let Step::Origin(plan) = t.check(k, 100, 1, T0 + 1_000) else {
            panic!("a new window is decided at the origin");
        };
        let tail = t.get(k).unwrap().previous().unacked();
        assert_eq!(tail, 3, "the local passes not replayed yet");
        assert_eq!(plan.used[1], 3, "the call carries them");
        (t, k, plan)
    };
    let request = |k| LimitRequest {
        key: k,
        limit: 100,
        cost: 1,
    };
    let (mut t, k, plan) = setup();
    let call = OriginCall::single(request(k), plan);
    assert!(
        t.finish(&call, &[granted(&plan, 100, 5, 10)], T0 + 1_001)
            .unwrap()
            .success
    );
    assert_eq!(t.get(k).unwrap().previous().unacked(), 0);
    let batch = t.take_replay(1_000, T0 + 1_002);
    assert!(
        batch.events.iter().all(|e| e.sequence == plan.sequence),
        "the last window's tail went with the decision: {batch:?}"
    );
    // Answered for the window after the call's (the origin's clock is ahead): what it calls
    // previous is the call's current cell, so the tail waits for the replay.
    let (mut t, k, plan) = setup();
    let call = OriginCall::single(request(k), plan);
    let ahead = OriginPlan {
        sequence: plan.sequence + 1,
        ..plan
    };
    assert!(
        t.finish(&call, &[granted(&ahead, 100, 5, 10)], T0 + 1_001)
            .is_ok()
    );
    assert_eq!(t.get(k).unwrap().previous().unacked(), 3);
}

#[test]
fn the_batches_of_one_pass_look_at_each_cell_once() {
    let mut t = small(100);
    let ids = names(10);
    for id in &ids {
        warm(&mut t, key(id), 100, 10);
        assert!(matches!(t.check(key(id), 100, 1, T0 + 1), Step::Decided(d) if d.success));
    }
    // Batches of three, each acknowledged before the next is taken, as the gateway does.
    let (mut from, mut seen) = (Some(0), Vec::new());
    while let Some(at) = from {
        let (batch, next) = t.take_replay_from(3, T0 + 2, None, at);
        assert!(batch.len() <= 3);
        t.ack_replay(&batch, &vec![Counts::default(); batch.len()]);
        seen.extend(
            batch
                .events
                .iter()
                .map(|e| e.key.as_ref().identifier().to_string()),
        );
        from = next;
    }
    seen.sort();
    let mut all = ids.clone();
    all.sort();
    assert_eq!(seen, all, "every cell once");
    // A cell used again behind the position waits for the next pass.
    let (none, next) = t.take_replay_from(1, T0 + 3, None, 0);
    assert!(none.is_empty() && next.is_none(), "all acknowledged");
    assert!(matches!(t.check(key(&ids[0]), 100, 1, T0 + 4), Step::Decided(d) if d.success));
    let (batch, next) = t.take_replay_from(1, T0 + 4, None, 0);
    assert_eq!(batch.len(), 1);
    t.ack_replay(&batch, &[Counts::default()]);
    let Some(at) = next else {
        panic!("a full batch says where to go on");
    };
    assert!(matches!(t.check(key(&ids[0]), 100, 1, T0 + 5), Step::Decided(d) if d.success));
    let (rest, _) = t.take_replay_from(10, T0 + 5, None, at);
    assert!(rest.is_empty(), "behind the position: {rest:?}");
    let (next_pass, _) = t.take_replay_from(10, T0 + 6, None, 0);
    assert_eq!(next_pass.len(), 1, "the next pass takes it");
}

#[test]
fn an_unused_lease_near_the_limit_goes_back_with_the_replay() {
    let mut t = small(100);
    // A minute window: the idle time passes within it.
    let minute = WindowDuration::from_ms(60_000).unwrap();
    let k = WindowKeyRef::new("ws", "ns", "idle", minute).unwrap();
    warm(&mut t, k, 10, 4);
    assert!(
        t.take_replay(1_000, T0 + 100).is_empty(),
        "first seen by a pass: kept"
    );
    assert!(matches!(t.check(k, 10, 1, T0 + 150), Step::Decided(d) if d.success));
    let used = t.take_replay(1_000, T0 + 200);
    assert_eq!(used.events[0].release, 0, "used since the last pass: kept");
    t.ack_replay(&used, &[Counts::default()]);
    assert!(
        t.take_replay(1_000, T0 + 300).is_empty(),
        "unused since one pass only: a gap between requests, kept"
    );
    assert!(
        t.take_replay(1_000, T0 + 200 + LEASE_IDLE_MS - 1)
            .is_empty(),
        "unused for just under the idle time since the pass that saw it used: kept"
    );
    let batch = t.take_replay(1_000, T0 + 200 + LEASE_IDLE_MS);
    assert_eq!(batch.len(), 1);
    assert_eq!(
        batch.events[0].release, 1,
        "3 unused of the 8 left, for the idle time"
    );
    assert_eq!(
        t.get(k).unwrap().current().lease_left(),
        0,
        "stopped using it first"
    );
    let far = WindowKeyRef::new("ws", "ns", "far", minute).unwrap();
    warm(&mut t, far, 1_000, 4);
    for at in [T0 + 400, T0 + 500 + LEASE_IDLE_MS] {
        assert!(
            t.take_replay(1_000, at).is_empty(),
            "far from the limit: kept"
        );
    }
}

/// A lease in use is renewed with the replay in the last quarter of its lifetime (when the table's
/// origin renews), so the key's requests stay local past the lease's first deadline.
#[test]
fn a_lease_in_use_is_renewed_by_the_replay_in_the_last_quarter_of_its_lifetime() {
    let mut t = CounterTable::new(
        TableConfig {
            capacity: 100,
            renew_leases: true,
            ..TableConfig::default()
        },
        1,
    );
    let minute = WindowDuration::from_ms(60_000).unwrap();
    let k = WindowKeyRef::new("ws", "ns", "renew", minute).unwrap();
    warm(&mut t, k, 1_000, 100); // a lease of 100 until T0 + 5 s, id 1
    let due_at = t.config().origin.lease_ms * 3 / 4;
    assert!(matches!(t.check(k, 1_000, 1, T0 + 100), Step::Decided(d) if d.success));
    let early = t.take_replay(1_000, T0 + 200);
    assert_eq!(early.events[0].renew, 0, "not in its last quarter yet");
    t.ack_replay(&early, &[Counts::default()]);
    assert!(matches!(t.check(k, 1_000, 1, T0 + due_at - 100), Step::Decided(d) if d.success));
    let before = t.take_replay(1_000, T0 + due_at - 1);
    assert_eq!(before.events[0].renew, 0, "just before its last quarter");
    t.ack_replay(&before, &[Counts::default()]);
    assert!(matches!(t.check(k, 1_000, 1, T0 + due_at), Step::Decided(d) if d.success));
    let due = t.take_replay(1_000, T0 + due_at);
    assert_eq!(due.events[0].renew, 1, "in use, in its last quarter");
    t.ack_replay(&due, &[Counts::default()]);
    t.renewed(&due.events[0], 7, T0 + due_at + 5_000);
    assert_eq!(t.get(k).unwrap().current().lease_id(), 7);
    // Past the first deadline: still local.
    assert!(matches!(t.check(k, 1_000, 1, T0 + 6_000), Step::Decided(d) if d.success));
    // A stale renewal answer (of a lease since replaced) changes nothing.
    t.renewed(&due.events[0], 9, T0 + 60_000);
    assert_eq!(t.get(k).unwrap().current().lease_id(), 7);
    // Used again, in the last quarter of its new lifetime: asked again; then unused since:
    // not renewed.
    let late = T0 + due_at + 4_000;
    assert!(matches!(t.check(k, 1_000, 1, late), Step::Decided(d) if d.success));
    let again = t.take_replay(1_000, late);
    assert_eq!(again.events[0].renew, 7);
    t.ack_replay(&again, &[Counts::default()]);
    let unused = t.take_replay(1_000, late + 100);
    assert!(unused.events.iter().all(|e| e.renew == 0), "{unused:?}");
}

/// Decides a new `key` of limit 1,000 at `T0` at a scripted origin that answers a count of
/// `regional` and grants `lease`.
fn counted_at_origin(t: &mut CounterTable, key: WindowKeyRef<'_>, regional: u64, lease: u64) {
    let Step::Origin(plan) = t.check(key, 1_000, 1, T0) else {
        panic!("a new key is decided at the origin");
    };
    let request = LimitRequest {
        key,
        limit: 1_000,
        cost: 1,
    };
    let call = OriginCall::single(request, plan);
    let answer = granted(&plan, 1_000, regional, lease);
    assert!(t.finish(&call, &[answer], T0).unwrap().success);
}

/// A paced replay holds a quiet cell's cost back until its turn (one pass in `passes`,
/// staggered over the table), and sends at once a cell near the publish floor or near its
/// lease's end; an unpaced replay sends everything.
#[test]
fn a_quiet_cell_waits_for_its_turn_and_a_cell_someone_needs_goes_at_once() {
    let mut t = small(100);
    let minute = WindowDuration::from_ms(60_000).unwrap();
    let quiet = ["q0", "q1", "q2"].map(|id| WindowKeyRef::new("ws", "ns", id, minute).unwrap());
    let near = WindowKeyRef::new("ws", "ns", "near", minute).unwrap();
    for k in quiet {
        warm(&mut t, k, 1_000_000, 100); // a count of 1: far under 20% of 1,000,000
    }
    // A count of 300: over 20% of 1,000, the publish floor.
    counted_at_origin(&mut t, near, 300, 100);
    // Every 100 ms under 5 s leases: one pass in ten, never within 1.35 s of a lease's end.
    let mut pace = QuietPace::new(0, 100, Some(PublishPolicy::default()), 5_000, 0);
    assert_eq!((pace.passes, pace.margin_ms), (10, 1_350));
    let mut seen = std::collections::HashMap::<String, Vec<u64>>::new();
    for pass in 1..=10 {
        let now = T0 + 100 * pass;
        for (k, limit) in quiet.iter().map(|k| (k, 1_000_000)).chain([(&near, 1_000)]) {
            assert!(matches!(t.check(*k, limit, 1, now), Step::Decided(d) if d.success));
        }
        pace.pass = pass as u32;
        let batch = t.take_replay_from(1_000, now, Some(pace), 0).0;
        let counts = vec![Counts::default(); batch.len()];
        // A second take in the same pass finds nothing more.
        t.ack_replay(&batch, &counts);
        assert!(t.take_replay_from(1_000, now, Some(pace), 0).0.is_empty());
        for e in &batch.events {
            seen.entry(e.key.as_ref().identifier().to_string())
                .or_default()
                .push(pass);
        }
    }
    assert_eq!(
        seen["near"],
        (1..=10).collect::<Vec<_>>(),
        "near the floor: every pass"
    );
    let mut turns: Vec<u64> = ["q0", "q1", "q2"]
        .iter()
        .map(|id| {
            assert_eq!(seen[*id].len(), 1, "{id}: one pass in ten: {seen:?}");
            seen[*id][0]
        })
        .collect();
    turns.sort_unstable();
    turns.dedup();
    assert_eq!(turns.len(), 3, "staggered: {seen:?}");
    // What waited was carried whole: each quiet key's event holds all its passes so far.
    let all = t.take_replay(1_000, T0 + 1_100);
    assert!(all.events.iter().all(|e| e.used > 0));

    // Near its lease's end (granted until T0 + 5 s), a quiet cell goes at once.
    let mut t = small(100);
    warm(&mut t, quiet[0], 1_000_000, 100);
    let late = T0 + 5_000 - 1_350;
    assert!(matches!(
        t.check(quiet[0], 1_000_000, 1, late - 100),
        Step::Decided(_)
    ));
    pace.pass = 1;
    let held = t.take_replay_from(1_000, late - 100, Some(pace), 0).0;
    pace.pass = 2;
    let gone = if held.is_empty() {
        t.take_replay_from(1_000, late, Some(pace), 0).0
    } else {
        held
    };
    assert_eq!(gone.len(), 1, "within the margin of its lease's end");
    assert!(!t.get(quiet[0]).unwrap().is_quiet(minute, late, &pace));
    assert!(t.get(quiet[0]).unwrap().is_quiet(minute, late - 1, &pace));
}

/// With no other region live to import the region's count, a cell over the publish floor and
/// near its limit is held back like a quiet one, with no turn, up to one pass before its lease
/// ends (it is not renewed; the pass after the end delivers within the origin's grace); with
/// another region live it goes on every pass.
#[test]
fn alone_a_cell_near_its_limit_is_paced_until_one_pass_before_its_lease_ends() {
    let minute = WindowDuration::from_ms(60_000).unwrap();
    let k = WindowKeyRef::new("ws", "ns", "near", minute).unwrap();
    // 800 of 1,000 counted, a lease of 100, one local pass since: over the floor, near the
    // limit, with cost to replay.
    let setup = || {
        let mut t = small(100);
        counted_at_origin(&mut t, k, 800, 100);
        assert!(matches!(t.check(k, 1_000, 1, T0 + 1), Step::Decided(d) if d.success));
        t
    };
    let state = *setup().get(k).unwrap();
    assert!(!state.lease_is_far(minute, T0 + 1));
    let alone = QuietPace::new(1, 100, None, 5_000, 0);
    let shared = QuietPace::new(1, 100, Some(PublishPolicy::default()), 5_000, 0);
    let end = state.current().lease_until();
    assert!(state.is_quiet(minute, T0 + 100, &alone));
    assert!(
        !state.is_quiet(minute, T0 + 100, &shared),
        "another region imports it"
    );
    assert!(state.is_quiet(minute, end - 101, &alone));
    assert!(
        !state.is_quiet(minute, end - 100, &alone),
        "within one pass of the end"
    );
    // On a pass that is not the slot's turn: held back alone, sent with another region.
    let passes_held = |pace: QuietPace| {
        (1..=10)
            .filter(|&pass| {
                let mut t = setup();
                let paced = Some(QuietPace { pass, ..pace });
                t.take_replay_from(1_000, T0 + 100, paced, 0).0.is_empty()
            })
            .count()
    };
    assert_eq!(alone.passes, 0);
    assert_eq!(
        passes_held(alone),
        10,
        "no turn: it waits for its lease's end"
    );
    assert_eq!(passes_held(shared), 0, "every pass");
    // Held on every pass up to one pass before the end, then sent whole.
    let mut t = setup();
    let mut sent = Vec::new();
    for (pass, now) in (T0 + 100..end).step_by(100).enumerate() {
        let paced = Some(QuietPace {
            pass: u32::try_from(pass).unwrap(),
            ..alone
        });
        let batch = t.take_replay_from(1_000, now, paced, 0).0;
        if !batch.is_empty() {
            sent.push((now, batch.events[0].used));
        }
    }
    assert_eq!(sent.len(), 1, "one replay for the whole lease: {sent:?}");
    assert!(sent[0].0 + 100 >= end, "within a pass of the end: {sent:?}");
    assert_eq!(sent[0].1, state.current().own(), "what waited, whole");
}

/// With another region live, a covered cell whose count the others read already (the
/// origin's count of it over the publish threshold) goes once per flush interval, since the
/// region publishes no more often; one whose waiting cost makes it publishable goes at once
/// (its first flush is an early one).
#[test]
fn a_covered_cell_the_other_regions_read_goes_once_per_flush() {
    let minute = WindowDuration::from_ms(60_000).unwrap();
    let setup = |id: &'static str, regional: u64| {
        let k = WindowKeyRef::new("ws", "ns", id, minute).unwrap();
        let mut t = small(100);
        counted_at_origin(&mut t, k, regional, 100);
        assert!(matches!(t.check(k, 1_000, 1, T0 + 1), Step::Decided(d) if d.success));
        t
    };
    // Flushes every 500 ms, passes every 100 ms: one pass in five.
    let flush = QuietPace::new(1, 100, Some(PublishPolicy::default()), 5_000, 500);
    assert_eq!(flush.publish_passes, 5);
    let passes_sent = |id: &'static str, regional: u64, pace: QuietPace| {
        (1..=10)
            .filter(|&pass| {
                let mut t = setup(id, regional);
                let paced = Some(QuietPace { pass, ..pace });
                !t.take_replay_from(1_000, T0 + 100, paced, 0).0.is_empty()
            })
            .count()
    };
    // The origin's count, 800 of 1,000, is over the threshold (200).
    assert_eq!(passes_sent("published", 800, flush), 2, "one pass in five");
    let unknown = QuietPace::new(1, 100, Some(PublishPolicy::default()), 5_000, 0);
    assert_eq!(
        passes_sent("published", 800, unknown),
        10,
        "no flush interval"
    );
    // 199 at the origin, and the waiting pass makes 200: it goes on every pass.
    assert_eq!(passes_sent("crossing", 199, flush), 10);
}

/// A table three quarters full may soon evict, and a held cell's cost would go with its
/// entry: the pace holds nothing back there (a flood of keys through an edge lost thousands
/// of passes to eviction while the pace held them).
#[test]
fn a_table_that_may_soon_evict_holds_no_cell_back() {
    let minute = WindowDuration::from_ms(60_000).unwrap();
    let k = WindowKeyRef::new("ws", "ns", "near", minute).unwrap();
    let alone = Some(QuietPace::new(1, 100, None, 5_000, 0));
    let filled = |others: usize| {
        let mut t = small(MIN_CAPACITY);
        counted_at_origin(&mut t, k, 800, 100);
        assert!(matches!(t.check(k, 1_000, 1, T0 + 1), Step::Decided(d) if d.success));
        for id in &names(others) {
            t.decide(key(id), 100, 0, T0);
        }
        t
    };
    let under = MIN_CAPACITY * 3 / 4 - 2; // with the paced key: one short of three quarters
    let batch = filled(under).take_replay_from(1_000, T0 + 100, alone, 0).0;
    assert_eq!((batch.len(), batch.held), (0, 1), "held back");
    let batch = filled(under + 1)
        .take_replay_from(1_000, T0 + 100, alone, 0)
        .0;
    assert_eq!(
        (batch.len(), batch.held),
        (1, 0),
        "three quarters full: sent"
    );
}

#[test]
fn unreplayed_entries_are_evicted_last_and_their_loss_is_counted() {
    let ids = names(MIN_CAPACITY * 2);
    let mut t = small(MIN_CAPACITY);
    let held = key("held");
    assert!(
        t.decide(held, 100, 5, T0).success,
        "a local pass waiting for replay"
    );
    for id in &ids {
        t.decide(key(id), 100, 0, T0);
    }
    assert_eq!(t.get(held).unwrap().current().unacked(), 5, "passed over");
    assert_eq!(t.stats().replay_lost, 0);
    let busy: Vec<String> = (0..MIN_CAPACITY * 2).map(|i| format!("busy-{i}")).collect();
    for id in &busy {
        t.decide(key(id), 100, 1, T0);
    }
    assert!(
        t.stats().replay_lost > 0,
        "a table full of unreplayed keys loses some, counted"
    );
}

#[test]
fn too_many_limits_for_the_table_is_an_error_not_a_panic() {
    let ids = names(MIN_CAPACITY + 1);
    let mut t = small(MIN_CAPACITY);
    let limits: Vec<LimitRequest<'_>> = ids
        .iter()
        .map(|id| LimitRequest {
            key: key(id),
            limit: 1,
            cost: 1,
        })
        .collect();
    assert!(t.decide_all(&limits, T0).is_err());
}

#[test]
fn a_full_table_holds_its_memory_flat() {
    let ids = names(5_000);
    let mut t = small(1_000);
    // Full, and one eviction: it sized the key index for churn.
    for id in &ids[..1_001] {
        t.decide(key(id), 10, 1, T0);
    }
    let full = t.heap_bytes();
    for id in &ids[1_001..] {
        t.decide(key(id), 10, 1, T0);
    }
    assert_eq!(t.len(), 1_000);
    // The later keys are up to 3 bytes longer ("user-4999" vs "user-0"); slots and index,
    // about 200 bytes an entry, do not grow at all.
    assert!(
        t.heap_bytes() <= full + 3 * 1_000,
        "{} > {}",
        t.heap_bytes(),
        full
    );
}

#[test]
fn a_table_full_of_unreplayed_keys_still_takes_new_ones_and_counts_the_loss() {
    // The origin is down and every key holds a local pass it could not replay: a new key
    // still gets a slot (after a bounded search), and the cost it displaces is counted.
    let ids = names(4_096);
    let mut t = small(2_048);
    for id in &ids[..2_048] {
        assert!(t.decide(key(id), 10, 1, T0).success);
    }
    assert_eq!(t.stats().replay_lost, 0);
    for id in &ids[2_048..] {
        assert!(t.decide(key(id), 10, 1, T0).success);
    }
    assert_eq!(t.len(), 2_048);
    assert_eq!(t.stats().evicted, 2_048);
    assert_eq!(
        t.stats().replay_lost,
        2_048,
        "every displaced pass is counted"
    );
}

/// A region view: counts merged from origin answers, published by flushes.
fn view(capacity: usize) -> CounterTable {
    CounterTable::new(
        TableConfig {
            capacity,
            keep_unpublished: true,
            ..TableConfig::default()
        },
        1,
    )
}

/// Merges a regional count of `n` into `id`'s current cell, as an origin answer would.
fn merge(t: &mut CounterTable, id: &str, n: u64) {
    let k = key(id);
    let sequence = k.duration().sequence(T0);
    t.merge_counts(
        k,
        sequence,
        Counts {
            regional: n,
            global: 0,
        },
        T0,
    );
}

#[test]
fn a_region_view_evicts_published_keys_before_unpublished_ones() {
    let half = MIN_CAPACITY / 2;
    for keep in [true, false] {
        let mut t = if keep {
            view(MIN_CAPACITY)
        } else {
            small(MIN_CAPACITY)
        };
        let unpublished: Vec<String> = (0..half).map(|i| format!("pending-{i}")).collect();
        for id in &unpublished {
            merge(&mut t, id, 7);
        }
        // The other half published: a flush wrote them all.
        let published: Vec<String> = (0..half).map(|i| format!("done-{i}")).collect();
        for id in &published {
            merge(&mut t, id, 3);
        }
        let policy = PublishPolicy::from_fraction(0.0).unwrap();
        let rows: Vec<_> = t
            .flush_candidates(&policy, T0)
            .into_iter()
            .filter(|r| r.key.as_ref().identifier().starts_with("done-"))
            .collect();
        t.commit_flush(&rows);
        // Pressure: new keys, with nothing to publish yet (a read of zero).
        for i in 0..half {
            merge(&mut t, &format!("new-{i}"), 0);
        }
        let kept = unpublished
            .iter()
            .filter(|id| t.get(key(id)).is_some())
            .count();
        if keep {
            assert_eq!(kept, half, "every unpublished count survives");
            assert_eq!(t.stats().unpublished_lost, 0);
        } else {
            assert!(kept < half, "a plain table evicts them alike ({kept} kept)");
        }
    }
    // Full of unpublished counts, a view still makes room, and counts what it lost.
    let mut t = view(MIN_CAPACITY);
    for i in 0..MIN_CAPACITY * 2 {
        merge(&mut t, &format!("flood-{i}"), 2);
    }
    assert!(t.stats().unpublished_lost > 0);
    assert!(t.len() <= MIN_CAPACITY);
}
