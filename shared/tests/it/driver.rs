//! The driver natively, as event sequences on a manual clock: coalescing, deadlines with late
//! joiners, each failure mode, replay backoff and batch bounds. The gateway is scripted here;
//! the same behaviour through the real runtimes is the conformance table of
//! `regional-gateway/tests/common/conformance.rs`.

use serde_json::json;
use strata_core::driver::{
    DECIDE_PATH, DecidedBy, Driver, DriverConfig, LOG_EVERY_MS, REPLAY_PATH, Started, TableStore,
    Transmit, replay_backoff,
};
use strata_core::gate::Gate;
use strata_core::policy::AHEAD_LIMIT_PER_COST;
use strata_core::rules::ListRequest;
use strata_core::wire::{
    CellsResponse, DecideRequest, DecideResponse, DecideResult, MAX_BATCH, RenewedLease,
    ReplayPace, ReplayRequest,
};
use strata_core::{Counts, FailureMode, PublishPolicy, Reason};

const T0: u64 = 28_333_334 * 60_000; // a minute boundary
const TIMEOUT: u64 = 250;
const INTERVAL: u64 = 50;
/// A limit under `AHEAD_LIMIT_PER_COST` times the cost: a cold key's requests wait for the
/// gateway.
const NEAR: u64 = AHEAD_LIMIT_PER_COST - 1;

fn driver(mode: FailureMode, limit: u64) -> (Driver, TableStore) {
    let rules = json!({"rules": [{
        "name": "per-user", "namespace": "api", "limit": limit, "duration": 60_000,
        "actions": [{"request_headers": {"header_name": "x-user", "descriptor_key": "user"}}],
    }]});
    let options = json!({ "failure_mode": mode.as_str() }).to_string();
    let gate = Gate::from_json("edge", &rules.to_string(), &options).unwrap();
    let table = gate.table(7);
    let config = DriverConfig {
        timeout_ms: TIMEOUT,
        replay_interval_ms: INTERVAL,
        unaddressed_counter: "stats".into(),
    };
    let store = TableStore {
        table,
        instance: "edge-1".into(),
    };
    (Driver::new(gate, config), store)
}

fn user(name: &str) -> ListRequest {
    ListRequest {
        method: "GET".into(),
        host: "h".into(),
        path: "/".into(),
        headers: vec![("x-user".into(), name.as_bytes().to_vec())],
        peer: None,
    }
}

fn transmits(d: &mut Driver) -> Vec<Transmit> {
    std::iter::from_fn(|| d.poll_transmit()).collect()
}

/// The gateway's answer to a decide call: every limit passes, counted, with `lease` lent.
fn granted(t: &Transmit, lease: u64, now: u64) -> String {
    granted_for(t, lease, 5_000, now)
}

/// [`granted`], the lease lent for `lease_ms`.
fn granted_for(t: &Transmit, lease: u64, lease_ms: u64, now: u64) -> String {
    granted_over(t, lease, lease_ms, 0, now)
}

/// [`granted_for`], the cell holding `others` more than the cost (other processes' passes).
fn granted_over(t: &Transmit, lease: u64, lease_ms: u64, others: u64, now: u64) -> String {
    let request: DecideRequest = serde_json::from_str(&t.body).unwrap();
    let results = request
        .limits
        .iter()
        .map(|l| {
            let sequence = now / l.duration;
            DecideResult {
                success: true,
                limit: l.limit,
                remaining: l.limit - l.cost,
                reset: (sequence + 1) * l.duration,
                sequence,
                current: Counts {
                    regional: l.cost + others,
                    global: 0,
                },
                previous: Counts::default(),
                used: 0,
                lease,
                lease_id: 1,
                lease_ms,
                covers: false,
            }
        })
        .collect();
    let response = DecideResponse {
        success: true,
        sequence: now / 60_000,
        results,
    };
    serde_json::to_string(&response).unwrap()
}

/// Answers call `t` as [`granted`] says, at `now`.
fn grant(d: &mut Driver, store: &mut TableStore, t: &Transmit, lease: u64, now: u64) {
    d.answer(store, t.call, 200, granted(t, lease, now).as_bytes(), now);
}

/// The gateway's answer to a replay: each cell's count is what was replayed.
fn replayed(t: &Transmit) -> String {
    let request: ReplayRequest = serde_json::from_str(&t.body).unwrap();
    let cells = request
        .events
        .iter()
        .map(|e| Counts {
            regional: e.used,
            global: 0,
        })
        .collect();
    serde_json::to_string(&CellsResponse {
        cells,
        renewed: Vec::new(),
        pace: None,
    })
    .unwrap()
}

#[test]
fn eight_concurrent_requests_on_a_cold_key_make_one_call() {
    let (mut d, mut store) = driver(FailureMode::Local, NEAR);
    for id in 0..8 {
        let started = d.request(&mut store, id, &user("a"), T0).unwrap();
        assert_eq!(started, Started::Waiting);
    }
    let sent = transmits(&mut d);
    assert_eq!(sent.len(), 1, "one call for eight requests");
    assert_eq!((sent[0].path, sent[0].timeout_ms), (DECIDE_PATH, TIMEOUT));
    assert_eq!(d.stats().coalesced, 7);
    grant(&mut d, &mut store, &sent[0], 20, T0 + 5);
    let decided: Vec<_> = std::iter::from_fn(|| d.poll_decision()).collect();
    assert_eq!(decided.len(), 8);
    assert!(decided.iter().all(|x| x.reply.allowed));
    assert_eq!(decided[0].by, DecidedBy::Origin);
    assert!(
        decided[1..].iter().all(|x| x.by == DecidedBy::Local),
        "the lease decides the rest"
    );
    assert!(transmits(&mut d).iter().all(|t| t.path != DECIDE_PATH));
    assert_eq!(d.waiting(), 0);
}

/// Each decision call is counted once by why it was sent (the shells' `origin.reason.*`,
/// as the gateway's `strata_origin_reasons_total`): a cold key, a lease used up, a lease
/// expired; requests that join a call add nothing.
#[test]
fn decision_calls_are_counted_by_why_they_were_sent() {
    let (mut d, mut store) = driver(FailureMode::Local, NEAR);
    let reasons = |d: &Driver| Reason::ALL.map(|r| d.stats().origin_reason(r));
    for id in 0..3 {
        d.request(&mut store, id, &user("a"), T0).unwrap();
    }
    let sent = transmits(&mut d);
    assert_eq!(sent.len(), 1);
    assert_eq!(reasons(&d), [1, 0, 0, 0], "one cold call, two joined it");
    grant(&mut d, &mut store, &sent[0], 4, T0 + 1);
    // Requests until the lease is used up and one needs the gateway again.
    let mut id = 3;
    let sent = loop {
        d.request(&mut store, id, &user("a"), T0 + 10).unwrap();
        id += 1;
        let sent = transmits(&mut d);
        if let Some(t) = sent.into_iter().find(|t| t.path == DECIDE_PATH) {
            break t;
        }
        assert!(id < 20, "the lease of 4 was used up");
    };
    assert_eq!(reasons(&d), [1, 0, 0, 1], "then one for the lease used up");
    // A newer lease (id 2), with room left under it.
    let mut answer: serde_json::Value = serde_json::from_str(&granted(&sent, 40, T0 + 11)).unwrap();
    answer["results"][0]["lease_id"] = json!(2);
    d.answer(
        &mut store,
        sent.call,
        200,
        answer.to_string().as_bytes(),
        T0 + 11,
    );
    // After its 5 s lifetime.
    d.request(&mut store, id, &user("a"), T0 + 6_000).unwrap();
    assert!(transmits(&mut d).iter().any(|t| t.path == DECIDE_PATH));
    assert_eq!(reasons(&d), [1, 1, 0, 1], "then one for the lease expired");
    assert_eq!(d.stats().origin_calls, 3);
}

/// The replay transmits due at `now`, answered as [`replayed`]; returns their events.
fn replay_pass(
    d: &mut Driver,
    store: &mut TableStore,
    now: u64,
) -> Vec<strata_core::wire::ReplayEvent> {
    d.timeout(store, now);
    let mut events = Vec::new();
    for t in transmits(d) {
        assert_eq!(t.path, REPLAY_PATH, "only the replay is due");
        let request: ReplayRequest = serde_json::from_str(&t.body).unwrap();
        events.extend(request.events);
        d.answer(store, t.call, 200, replayed(&t).as_bytes(), now);
    }
    events
}

#[test]
fn a_key_far_from_its_limit_passes_ahead_and_its_replay_answers_it() {
    for mode in [FailureMode::Local, FailureMode::Allow] {
        let (mut d, mut store) = driver(mode, AHEAD_LIMIT_PER_COST);
        let Started::Decided(first) = d.request(&mut store, 0, &user("a"), T0).unwrap() else {
            panic!("{mode:?}: the first request waited");
        };
        assert!(
            first.reply.allowed && first.by == DecidedBy::Ahead,
            "{mode:?}"
        );
        assert!(transmits(&mut d).is_empty(), "{mode:?}: no decision call");
        // The next replay pass carries it as the process's own count; its answer is the key's.
        let events = replay_pass(&mut d, &mut store, T0 + INTERVAL);
        assert_eq!(events.len(), 1, "{mode:?}");
        assert_eq!((events[0].used, events[0].acked), (1, 0), "{mode:?}");
        // Acknowledged: the next request passes ahead too, with no call.
        let t = T0 + INTERVAL + 1;
        let second = d.request(&mut store, 1, &user("a"), t).unwrap();
        assert!(
            matches!(second, Started::Decided(x) if x.by == DecidedBy::Ahead && x.reply.allowed),
            "{mode:?}"
        );
        // One that comes before that pass is acknowledged waits for a decision, which carries
        // the passes ahead and lends the key in demand a lease; the next joins that call.
        for id in 2..4 {
            let started = d.request(&mut store, id, &user("a"), t + 1).unwrap();
            assert_eq!(started, Started::Waiting, "{mode:?}");
        }
        let sent = transmits(&mut d);
        assert_eq!(sent.len(), 1, "{mode:?}");
        let call: DecideRequest = serde_json::from_str(&sent[0].body).unwrap();
        // A key a replay answered is no longer cold, but it holds no grant: it asks for the
        // limit as a cold key does (the origin's grant rule lends what is safe), rather than
        // 2, 4, 8... a round trip each while steady traffic outruns the doubling.
        let l = &call.limits[0];
        assert_eq!(
            (l.cost, l.used, l.want),
            (1, 2, AHEAD_LIMIT_PER_COST),
            "{mode:?}"
        );
        grant(&mut d, &mut store, &sent[0], 10, t + 2);
        let decided: Vec<_> = std::iter::from_fn(|| d.poll_decision()).collect();
        let by: Vec<_> = decided.iter().map(|x| (x.reply.allowed, x.by)).collect();
        assert_eq!(
            by,
            [(true, DecidedBy::Origin), (true, DecidedBy::Local)],
            "{mode:?}"
        );
        let s = d.stats();
        assert_eq!((s.decided_ahead, s.origin_calls), (2, 1), "{mode:?}");
    }
    // `deny` admits nothing the gateway did not answer; a limit under the share waits too.
    for (mode, limit) in [
        (FailureMode::Deny, AHEAD_LIMIT_PER_COST),
        (FailureMode::Local, NEAR),
    ] {
        let (mut d, mut store) = driver(mode, limit);
        let started = d.request(&mut store, 0, &user("a"), T0).unwrap();
        assert_eq!(started, Started::Waiting, "{mode:?}, limit {limit}");
        let sent = transmits(&mut d);
        let call: DecideRequest = serde_json::from_str(&sent[0].body).unwrap();
        assert_eq!((call.limits[0].cost, call.limits[0].used), (1, 0));
    }
}

#[test]
fn a_pass_ahead_whose_replay_fails_holds_the_next_request_for_a_decision() {
    let (mut d, mut store) = driver(FailureMode::Local, 1_000);
    let first = d.request(&mut store, 0, &user("a"), T0).unwrap();
    assert!(matches!(first, Started::Decided(x) if x.by == DecidedBy::Ahead));
    d.timeout(&mut store, T0 + INTERVAL);
    let sent = transmits(&mut d);
    assert_eq!(sent.len(), 1);
    d.fail(&mut store, sent[0].call, "refused", T0 + INTERVAL);
    // Unacknowledged: no second pass ahead; the decision carries the first.
    let t = T0 + INTERVAL + 1;
    let next = d.request(&mut store, 1, &user("a"), t).unwrap();
    assert_eq!(next, Started::Waiting);
    let sent = transmits(&mut d);
    let call: DecideRequest = serde_json::from_str(&sent[0].body).unwrap();
    assert_eq!((call.limits[0].cost, call.limits[0].used), (1, 1));
    // Its call fails too: decided by the failure mode, the pass ahead still counted for the
    // replay.
    d.fail(&mut store, sent[0].call, "refused", t + 1);
    let decided: Vec<_> = std::iter::from_fn(|| d.poll_decision()).collect();
    assert_eq!(decided.len(), 1);
    assert_eq!(decided[0].by, DecidedBy::Fallback);
    assert_eq!(store.table.unreplayed_cells(), 1);
}

/// Lends `name` a lease: a pass ahead, then a request before its replay that waits for the
/// decision, answered with `lease` for `lease_ms` over `others` passes of other processes;
/// then the replay that acknowledges the pass ahead.
fn lend(
    d: &mut Driver,
    store: &mut TableStore,
    name: &str,
    lease: u64,
    lease_ms: u64,
    others: u64,
    now: u64,
) {
    let first = d.request(store, 0, &user(name), now).unwrap();
    assert!(matches!(first, Started::Decided(x) if x.by == DecidedBy::Ahead));
    assert_eq!(
        d.request(store, 1, &user(name), now).unwrap(),
        Started::Waiting
    );
    let t = transmits(d);
    assert_eq!(t.len(), 1, "the second's call");
    let body = granted_over(&t[0], lease, lease_ms, others, now);
    d.answer(store, t[0].call, 200, body.as_bytes(), now + 1);
    assert!(d.poll_decision().is_some_and(|x| x.reply.allowed));
    assert_eq!(replay_pass(d, store, now + INTERVAL).len(), 1);
}

#[test]
fn a_lapsed_lease_far_from_the_limit_passes_ahead_near_it_waits() {
    let (mut d, mut store) = driver(FailureMode::Local, AHEAD_LIMIT_PER_COST);
    // Key "far" holds 2 of 64 when its lease is lent, "near" 41 (others' passes).
    lend(&mut d, &mut store, "far", 5, 1_000, 0, T0);
    lend(&mut d, &mut store, "near", 5, 1_000, 39, T0);
    // The leases lapse (1 s): "far" passes ahead, with no call; "near" (22 of 64 left after
    // it, under half) waits for the gateway.
    let later = T0 + 2_000;
    let far = d.request(&mut store, 2, &user("far"), later).unwrap();
    assert!(matches!(far, Started::Decided(x) if x.by == DecidedBy::Ahead && x.reply.allowed));
    assert!(transmits(&mut d).is_empty());
    let near = d.request(&mut store, 3, &user("near"), later).unwrap();
    assert_eq!(near, Started::Waiting);
    // One pass ahead an acknowledgement: the next on "far" waits for a decision.
    let again = d.request(&mut store, 4, &user("far"), later + 1).unwrap();
    assert_eq!(again, Started::Waiting);
}

#[test]
fn an_answer_that_lends_nothing_holds_passes_ahead_off_for_a_lease_lifetime() {
    let (mut d, mut store) = driver(FailureMode::Local, AHEAD_LIMIT_PER_COST);
    // Two passes ahead; the second's call finds no room (others' leases hold it, which the
    // counts do not show): lease 0, lent for 5 s.
    lend(&mut d, &mut store, "held", 0, 5_000, 0, T0);
    let t = T0 + INTERVAL + 1;
    assert_eq!(
        d.request(&mut store, 2, &user("held"), t).unwrap(),
        Started::Waiting
    );
    let sent = transmits(&mut d);
    let call: DecideRequest = serde_json::from_str(&sent[0].body).unwrap();
    assert_eq!(
        call.limits[0].cost, 1,
        "decided at the gateway, not passed ahead"
    );
    d.answer(
        &mut store,
        sent[0].call,
        200,
        granted_for(&sent[0], 0, 5_000, t).as_bytes(),
        t,
    );
    assert!(d.poll_decision().is_some_and(|x| x.by == DecidedBy::Origin));
    // The lifetime over, the key passes ahead again.
    let later = t + 5_000;
    let again = d.request(&mut store, 3, &user("held"), later).unwrap();
    assert!(matches!(again, Started::Decided(x) if x.by == DecidedBy::Ahead));
}

/// Answers every transmit: decisions as [`granted_over`] with `lease` for a minute, replays as
/// [`replayed`]. Returns the replay events that gave a lease back.
fn answer_all(d: &mut Driver, store: &mut TableStore, lease: u64, now: u64) -> usize {
    let mut released = 0;
    for t in transmits(d) {
        let body = if t.path == DECIDE_PATH {
            granted_over(&t, lease, 60_000, 0, now)
        } else {
            let request: ReplayRequest = serde_json::from_str(&t.body).unwrap();
            released += request.events.iter().filter(|e| e.release > 0).count();
            replayed(&t)
        };
        d.answer(store, t.call, 200, body.as_bytes(), now);
    }
    released
}

#[test]
fn a_lease_given_back_idle_passes_ahead_of_the_next_call() {
    let (mut d, mut store) = driver(FailureMode::Local, AHEAD_LIMIT_PER_COST);
    lend(&mut d, &mut store, "sparse", 40, 60_000, 0, T0);
    // The replay that acknowledged the pass ahead started the lease's idle count; traffic on
    // another key brings a pass a second later, which gives the idle lease back (40 of the 62
    // left).
    let busy = T0 + INTERVAL + 1_000;
    d.request(&mut store, 1, &user("busy"), busy).unwrap();
    answer_all(&mut d, &mut store, 40, busy);
    d.timeout(&mut store, busy + INTERVAL);
    assert_eq!(answer_all(&mut d, &mut store, 40, busy + INTERVAL), 1);
    // The next request on the sparse key has no lease (given back, every own pass
    // acknowledged): it passes ahead, and the replay carries it.
    let t = busy + 200;
    let next = d.request(&mut store, 2, &user("sparse"), t).unwrap();
    assert!(matches!(next, Started::Decided(x) if x.by == DecidedBy::Ahead && x.reply.allowed));
    assert!(transmits(&mut d).is_empty(), "no decision call");
    let events = replay_pass(&mut d, &mut store, t + INTERVAL);
    assert_eq!(
        events.iter().map(|e| e.used).collect::<Vec<_>>(),
        [2],
        "the two passes ahead"
    );
}

#[test]
fn a_late_joiner_inherits_the_calls_deadline_and_nobody_waits_past_it() {
    let (mut d, mut store) = driver(FailureMode::Deny, 100);
    d.request(&mut store, 1, &user("a"), T0).unwrap();
    d.request(&mut store, 2, &user("a"), T0 + 200).unwrap();
    assert_eq!(transmits(&mut d).len(), 1);
    assert_eq!(d.poll_timeout(), Some(T0 + TIMEOUT));
    d.timeout(&mut store, T0 + TIMEOUT - 1);
    assert!(d.poll_decision().is_none(), "not before the deadline");
    d.timeout(&mut store, T0 + TIMEOUT);
    let decided: Vec<_> = std::iter::from_fn(|| d.poll_decision()).collect();
    assert_eq!(decided.len(), 2, "the joiner too, 50 ms after it came");
    for x in &decided {
        assert!(
            !x.reply.allowed,
            "deny denies what the gateway did not decide"
        );
        assert_eq!(x.by, DecidedBy::Fallback);
    }
    assert!(
        transmits(&mut d).iter().all(|t| t.path != DECIDE_PATH),
        "the joiner did not make a call of its own after the failure"
    );
    assert_eq!((d.stats().origin_calls, d.stats().origin_failures), (1, 1));
}

#[test]
fn each_failure_mode_decides_a_cold_key_as_named() {
    for (mode, admitted) in [
        (FailureMode::Local, 3),
        (FailureMode::Allow, 3),
        (FailureMode::Deny, 0),
    ] {
        let (mut d, mut store) = driver(mode, 3);
        // A call that fails with an error status, then requests within the retry delay.
        d.request(&mut store, 0, &user("k"), T0).unwrap();
        let t = transmits(&mut d);
        d.answer(
            &mut store,
            t[0].call,
            503,
            b"upstream connect error",
            T0 + 3,
        );
        let mut passed = usize::from(d.poll_decision().unwrap().reply.allowed);
        for id in 1..10 {
            match d.request(&mut store, id, &user("k"), T0 + 10).unwrap() {
                // A pass is the failure mode's; a denial the own count proves is memory's.
                Started::Decided(x) if x.reply.allowed => {
                    assert_eq!(x.by, DecidedBy::Fallback, "{mode:?}");
                    passed += 1;
                }
                Started::Decided(x) => assert_ne!(x.by, DecidedBy::Origin, "{mode:?}"),
                Started::Waiting => panic!("{mode:?}: a call within the retry delay"),
            }
        }
        assert_eq!(passed, admitted, "{mode:?}");
        assert_eq!(d.stats().origin_calls, 1, "{mode:?}");
    }
}

#[test]
fn an_answer_that_does_not_fit_is_a_failure() {
    let (mut d, mut store) = driver(FailureMode::Deny, 10);
    d.request(&mut store, 0, &user("k"), T0).unwrap();
    let t = transmits(&mut d);
    d.answer(
        &mut store,
        t[0].call,
        200,
        br#"{"success":true,"sequence":1,"results":[]}"#,
        T0,
    );
    let x = d.poll_decision().unwrap();
    assert!(!x.reply.allowed);
    assert_eq!(x.by, DecidedBy::Fallback);
    let log = d.poll_log().unwrap();
    assert!(
        log.warn && log.message.contains("(deny)"),
        "{}",
        log.message
    );
}

#[test]
fn a_cancelled_request_is_not_answered_and_its_call_still_settles_the_joiners() {
    let (mut d, mut store) = driver(FailureMode::Local, NEAR);
    d.request(&mut store, 1, &user("a"), T0).unwrap();
    d.request(&mut store, 2, &user("a"), T0).unwrap();
    d.cancel(1);
    let t = transmits(&mut d);
    grant(&mut d, &mut store, &t[0], 10, T0 + 1);
    let decided: Vec<_> = std::iter::from_fn(|| d.poll_decision()).collect();
    assert_eq!(decided.iter().map(|x| x.request).collect::<Vec<_>>(), [2]);
    assert!(decided[0].reply.allowed);
}

#[test]
fn a_failed_replay_is_sent_again_after_a_backoff_without_new_requests() {
    let (mut d, mut store) = driver(FailureMode::Local, NEAR);
    d.request(&mut store, 0, &user("a"), T0).unwrap();
    let t = transmits(&mut d);
    grant(&mut d, &mut store, &t[0], 10, T0);
    for id in 1..4 {
        assert!(matches!(
            d.request(&mut store, id, &user("a"), T0 + 1).unwrap(),
            Started::Decided(x) if x.by == DecidedBy::Local
        ));
    }
    // The replay is due one interval after the cost was accepted.
    let mut now = d.poll_timeout().unwrap();
    assert_eq!(now, T0 + INTERVAL);
    let mut waits = Vec::new();
    for _ in 0..4 {
        d.timeout(&mut store, now);
        let sent = transmits(&mut d);
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].path, REPLAY_PATH);
        d.fail(&mut store, sent[0].call, "connection refused", now);
        let next = d.poll_timeout().unwrap();
        waits.push(next - now);
        now = next;
    }
    assert_eq!(waits, [1, 2, 3, 4].map(|f| replay_backoff(INTERVAL, f)));
    assert_eq!(waits, [100, 200, 400, 800]);
    d.timeout(&mut store, now);
    let sent = transmits(&mut d);
    let request: ReplayRequest = serde_json::from_str(&sent[0].body).unwrap();
    assert_eq!(request.events[0].used, 3, "the three local passes");
    d.answer(
        &mut store,
        sent[0].call,
        200,
        replayed(&sent[0]).as_bytes(),
        now,
    );
    assert_eq!(
        d.poll_timeout(),
        None,
        "nothing left to replay: the shell may sleep"
    );
    assert_eq!((d.stats().replays, d.stats().replay_failures), (1, 4));
    assert!(replay_backoff(INTERVAL, 30) <= 5_000);
}

#[test]
fn a_replay_pass_goes_in_batches_of_the_wire_bound() {
    let (mut d, mut store) = driver(FailureMode::Local, NEAR);
    // The gateway fails every call: each key is decided from memory, its cost unreplayed.
    let keys = MAX_BATCH * 2 + 500;
    for id in 0..keys {
        let name = format!("u{id}");
        d.request(&mut store, id as u64, &user(&name), T0).unwrap();
        for t in transmits(&mut d) {
            d.fail(&mut store, t.call, "refused", T0);
        }
    }
    assert_eq!(std::iter::from_fn(|| d.poll_decision()).count(), keys);
    let now = T0 + 1_000;
    d.timeout(&mut store, now);
    let mut sizes = Vec::new();
    while let Some(t) = d.poll_transmit() {
        assert_eq!(t.path, REPLAY_PATH);
        let request: ReplayRequest = serde_json::from_str(&t.body).unwrap();
        sizes.push(request.events.len());
        d.answer(&mut store, t.call, 200, replayed(&t).as_bytes(), now);
    }
    assert_eq!(sizes, [MAX_BATCH, MAX_BATCH, 500]);
    assert_eq!(store.table.unreplayed_cells(), 0);
}

#[test]
fn a_repeated_failure_is_logged_once_per_interval() {
    let (mut d, mut store) = driver(FailureMode::Local, NEAR);
    for id in 0..100 {
        // Past each retry delay, so every request calls and fails.
        let now = T0 + id * 1_000;
        let name = format!("u{id}");
        d.request(&mut store, id, &user(&name), now).unwrap();
        for t in transmits(&mut d)
            .into_iter()
            .filter(|t| t.path == DECIDE_PATH)
        {
            d.fail(&mut store, t.call, "refused", now);
        }
    }
    let lines: Vec<_> = std::iter::from_fn(|| d.poll_log()).collect();
    let expected = (100 * 1_000 / LOG_EVERY_MS) as usize;
    assert_eq!(lines.len(), expected);
    assert!(
        lines[1].message.contains("9 more like it"),
        "{}",
        lines[1].message
    );
    assert_eq!(d.stats().origin_failures, 100);
}

/// Drives requests on user "a" every 100 ms from `T0` to `until`, answering every call: a
/// decision lends 100 for 5 s (lease 1), a replay counts what it carries and, with `renew`,
/// renews the lease an event asks to renew (under the next id, for 5 s). Returns the decide
/// calls made after the first and the replay events that asked for a renewal.
fn steady_use(renew: bool, until: u64) -> (usize, usize) {
    let (mut d, mut store) = driver(FailureMode::Local, 1_000);
    let (mut decides, mut asked) = (0, 0);
    let mut now = T0;
    while now <= until {
        d.request(&mut store, now, &user("a"), now).unwrap();
        d.timeout(&mut store, now);
        for t in transmits(&mut d) {
            if t.path == DECIDE_PATH {
                decides += 1;
                grant(&mut d, &mut store, &t, 100, now);
                continue;
            }
            let request: ReplayRequest = serde_json::from_str(&t.body).unwrap();
            let mut answer: CellsResponse = serde_json::from_str(&replayed(&t)).unwrap();
            for (i, e) in request.events.iter().enumerate() {
                if e.renew > 0 {
                    asked += 1;
                    if renew {
                        answer.renewed.push(RenewedLease {
                            event: i as u64,
                            lease_id: e.renew + 1,
                            lease_ms: 5_000,
                        });
                    }
                }
            }
            let body = serde_json::to_string(&answer).unwrap();
            d.answer(&mut store, t.call, 200, body.as_bytes(), now);
        }
        std::iter::from_fn(|| d.poll_decision()).for_each(drop);
        now += 100;
    }
    (decides - 1, asked)
}

#[test]
fn a_lease_in_steady_use_is_renewed_by_the_replay_so_no_request_waits_when_it_ends() {
    // Lease 1 ends at T0 + 5 s; the run goes on to T0 + 8 s at 10 requests a second (80 of the
    // 100 it lends).
    let (decides, asked) = steady_use(true, T0 + 8_000);
    assert!(
        asked >= 1,
        "a replay in the lease's last quarter asks to renew it"
    );
    assert_eq!(decides, 0, "the renewed lease decides every later request");
    // The same run with a gateway that renews nothing: the lease ends, and a request waits
    // for a decision.
    let (decides, asked) = steady_use(false, T0 + 8_000);
    assert!(asked >= 1);
    assert!(decides >= 1, "without the renewal the lease runs out");
}

#[test]
fn a_lease_is_renewed_in_the_last_quarter_of_the_lifetime_the_gateway_lent_it_for() {
    // The table's own lease lifetime is 5 s (renewal in its last 1.25 s); this gateway lends
    // for 2 s, so the renewal is asked in the last 500 ms of the lease, not from its 750th ms.
    let (mut d, mut store) = driver(FailureMode::Local, 1_000);
    let mut first_ask = None;
    let mut now = T0;
    while now <= T0 + 2_000 && first_ask.is_none() {
        d.request(&mut store, now, &user("a"), now).unwrap();
        d.timeout(&mut store, now);
        for t in transmits(&mut d) {
            if t.path == DECIDE_PATH {
                let body = granted_for(&t, 100, 2_000, now);
                d.answer(&mut store, t.call, 200, body.as_bytes(), now);
                continue;
            }
            let request: ReplayRequest = serde_json::from_str(&t.body).unwrap();
            if request.events.iter().any(|e| e.renew > 0) {
                first_ask.get_or_insert(now);
            }
            d.answer(&mut store, t.call, 200, replayed(&t).as_bytes(), now);
        }
        std::iter::from_fn(|| d.poll_decision()).for_each(drop);
        now += 50;
    }
    let asked = first_ask.expect("a renewal asked before the lease ends") - T0;
    assert!(
        (1_500..2_000).contains(&asked),
        "asked {asked} ms into a 2 s lease"
    );
}

/// A replay call [`drive`] answered: when (ms after `T0`), the most own cost one of its events
/// carried, and the cost it carried that the gateway had not acknowledged.
struct Replayed {
    at: u64,
    used: u64,
    carried: u64,
}

/// Requests on user "a" under `limit` at `T0 + t` for each `t` of `times`, every decision
/// answered with a lease of 40 for 5 s and every replay answer stating `pace`; the shell wakes
/// only at the driver's deadlines and the requests' times, until `T0 + until`. Returns the
/// driver's stats and the replay calls.
fn drive(
    limit: u64,
    times: &[u64],
    pace: Option<ReplayPace>,
    until: u64,
) -> (strata_core::driver::DriverStats, Vec<Replayed>) {
    let (mut d, mut store) = driver(FailureMode::Local, limit);
    let mut replays = Vec::new();
    let mut pending = times.iter().map(|&at| T0 + at).peekable();
    let mut now = T0;
    while now <= T0 + until {
        while pending.next_if(|&at| at == now).is_some() {
            d.request(&mut store, now, &user("a"), now).unwrap();
        }
        d.timeout(&mut store, now);
        for t in transmits(&mut d) {
            if t.path == DECIDE_PATH {
                grant(&mut d, &mut store, &t, 40, now);
                continue;
            }
            let request: ReplayRequest = serde_json::from_str(&t.body).unwrap();
            replays.push(Replayed {
                at: now - T0,
                used: request.events.iter().map(|e| e.used).max().unwrap_or(0),
                carried: request.events.iter().map(|e| e.used - e.acked).sum(),
            });
            let mut answer: CellsResponse = serde_json::from_str(&replayed(&t)).unwrap();
            answer.pace = pace;
            let body = serde_json::to_string(&answer).unwrap();
            d.answer(&mut store, t.call, 200, body.as_bytes(), now);
        }
        std::iter::from_fn(|| d.poll_decision()).for_each(drop);
        // The shell's one timer: the driver's deadline or the next request.
        let next = [d.poll_timeout(), pending.peek().copied()];
        let Some(at) = next.into_iter().flatten().min() else {
            break;
        };
        now = at.max(now + 1);
    }
    (d.stats(), replays)
}

/// Requests on user "a" every 100 ms from `T0` to `T0 + 2 s` (a key that waits for the
/// gateway, whose decision lends 40 for 5 s), then none, until `T0 + 8 s`, every replay answer
/// stating `pace`. Returns the times of the replay calls and the cost they delivered in all
/// (the largest `used` the gateway saw).
fn paced_use(pace: Option<ReplayPace>) -> (Vec<u64>, u64) {
    let times: Vec<u64> = (0..=20).map(|i| i * 100).collect();
    let (_, replays) = drive(NEAR, &times, pace, 8_000);
    let delivered = replays.iter().map(|r| r.used).max().unwrap_or(0);
    (replays.iter().map(|r| r.at).collect(), delivered)
}

#[test]
fn a_region_alone_holds_a_covered_cell_until_its_lease_nears_its_end() {
    // Unpaced (an origin that does not say): every pass that finds new cost replays it.
    // The first request's cost was counted by its decision; the other 20 are the process's own.
    let (unpaced, delivered) = paced_use(None);
    assert_eq!(delivered, 20);
    assert!(unpaced.len() >= 15, "a replay per pass: {unpaced:?}");
    // Alone: the first replay learns it; then the cost under the 5 s lease (near the limit:
    // not renewed) waits until one pass before the lease ends, and goes once, whole, with no
    // request to wake the shell.
    let alone = PublishPolicy::default();
    let (paced, delivered) = paced_use(Some(ReplayPace::new(true, alone, 0)));
    assert_eq!(
        delivered, 20,
        "the held cost reached the gateway: {paced:?}"
    );
    assert_eq!(paced.len(), 2, "{paced:?}");
    assert!(
        (5_000 - INTERVAL..5_000).contains(&paced[1]),
        "the held cost went as the lease neared its end: {paced:?}"
    );
    // Another region live: a covered cell under the publish floor (half the limit here)
    // goes on its turn, about once a second; over it, on every pass.
    let half = PublishPolicy::from_fraction(0.5).unwrap();
    let (shared, delivered) = paced_use(Some(ReplayPace::new(false, half, 0)));
    assert_eq!(delivered, 20);
    assert!((2..=4).contains(&shared.len()), "once a second: {shared:?}");
    let (published, _) = paced_use(Some(ReplayPace::new(false, alone, 0)));
    assert!(published.len() >= 10, "over the floor: {published:?}");
}

/// Requests on user "a" (limit 1,000,000) at `T0 + t` for each `t` of `times`, as [`drive`]
/// with every replay answer stating a region alone, until 2 s after the last. Returns the
/// driver's stats and, per replay call, when it went and the passes it carried that the
/// gateway had not acknowledged.
fn far_key_use(times: &[u64]) -> (strata_core::driver::DriverStats, Vec<(u64, u64)>) {
    let alone = Some(ReplayPace::new(true, PublishPolicy::default(), 0));
    let until = times.last().copied().unwrap_or(0) + 2_000;
    let (stats, replays) = drive(1_000_000, times, alone, until);
    (stats, replays.iter().map(|r| (r.at, r.carried)).collect())
}

/// A key far from its limit with no lease, between sparse requests (one every 2 s): each
/// passes ahead, and its replay waits for the key's turn, within a second and a pass, rather
/// than going on the next pass (a key in steady use would send its next request to the
/// gateway meanwhile, and take a lease).
#[test]
fn a_pass_ahead_on_a_far_key_waits_up_to_a_second_for_its_replay() {
    let times: Vec<u64> = (0..6).map(|i| i * 2_000).collect();
    let (stats, replays) = far_key_use(&times);
    assert_eq!((stats.decided_ahead, stats.origin_calls), (6, 0));
    assert_eq!(replays.len(), 6, "one replay a pass ahead: {replays:?}");
    assert!(
        replays.iter().all(|&(_, carried)| carried == 1),
        "{replays:?}"
    );
    let delays: Vec<u64> = replays.iter().zip(&times).map(|(r, t)| r.0 - t).collect();
    // The first, on a cold cell, goes on the next pass: its answer lets the next pass ahead.
    assert!(delays[0] <= INTERVAL, "{delays:?}");
    assert!(
        delays.iter().all(|&d| d <= 1_000 + INTERVAL),
        "within a second and a pass: {delays:?}"
    );
    assert!(
        delays[1..].iter().any(|&d| d > INTERVAL),
        "held past the next pass: {delays:?}"
    );
}

/// The same key in steady use (10 requests a second for 3 s): the request after a pass
/// ahead, its replay held, asks the gateway, which lends a lease; the lease covers the rest,
/// and alone its cost waits for the lease's end: two replays in all, not one per pass.
#[test]
fn a_far_key_in_steady_use_takes_a_lease_instead_of_a_replay_per_request() {
    let times: Vec<u64> = (0..30).map(|i| i * 100).collect();
    let (stats, replays) = far_key_use(&times);
    assert_eq!(stats.origin_calls, 1, "one decision: {stats:?}");
    assert_eq!(stats.decided_ahead, 2, "{stats:?}");
    assert_eq!(stats.ok, 30);
    assert!(replays.len() <= 3, "{replays:?}");
    let carried: u64 = replays.iter().map(|r| r.1).sum();
    assert_eq!(
        carried,
        30 - 1,
        "every pass but the decided one's replayed once: {replays:?}"
    );
}

/// Requests that joined a call are begun again by the flow when it settles, with no event
/// from the shell: one the answer's lease covers is decided from memory, and one it does not
/// cover makes the next call itself.
#[test]
fn requests_that_joined_a_call_begin_again_when_it_settles() {
    let (mut d, mut store) = driver(FailureMode::Local, NEAR);
    for id in 0..3 {
        assert_eq!(
            d.request(&mut store, id, &user("a"), T0).unwrap(),
            Started::Waiting
        );
    }
    let sent = transmits(&mut d);
    assert_eq!(sent.len(), 1, "the two others joined the first's call");
    // A lease of 1: the first joiner's pass; the second needs the gateway again.
    grant(&mut d, &mut store, &sent[0], 1, T0 + 5);
    let decided: Vec<_> = std::iter::from_fn(|| d.poll_decision())
        .map(|x| (x.request, x.by))
        .collect();
    assert_eq!(decided, [(0, DecidedBy::Origin), (1, DecidedBy::Local)]);
    let again = transmits(&mut d);
    assert_eq!(again.len(), 1, "the second joiner's own call");
    assert_eq!(again[0].path, DECIDE_PATH);
    assert!(
        again[0].timeout_ms <= TIMEOUT - 5,
        "what is left of its time"
    );
    grant(&mut d, &mut store, &again[0], 0, T0 + 10);
    let last: Vec<_> = std::iter::from_fn(|| d.poll_decision())
        .map(|x| (x.request, x.by, x.reply.allowed))
        .collect();
    assert_eq!(last, [(2, DecidedBy::Origin, true)]);
    assert_eq!(d.waiting(), 0);
}
