//! The cases the reference documents call out, each pinned by name, driven through the
//! table as an edge process would drive it.

use strata_core::origin::Reason;
use strata_core::request::OriginCall;
use strata_core::table::{LimitRequest, Step};
use strata_core::{
    CounterTable, Counts, LimitCheck, OriginAnswer, OriginPlan, PublishPolicy, TableConfig,
    WindowCounts, WindowDuration, WindowKeyRef,
};

const MINUTE_MS: u64 = 60_000;
const T0: u64 = 28_333_333 * MINUTE_MS; // start of a minute window

fn minute() -> WindowDuration {
    WindowDuration::from_ms(MINUTE_MS).unwrap()
}

fn key(id: &str) -> WindowKeyRef<'_> {
    WindowKeyRef::new("ws", "api", id, minute()).unwrap()
}

fn table() -> CounterTable {
    CounterTable::new(TableConfig::default(), 42)
}

/// The origin's answer to `plan` when it holds `current` and `previous` for the key (after
/// counting the request, if it passed) and grants `lease`.
fn answer(
    plan: &OriginPlan,
    limit: u64,
    current: u64,
    previous: u64,
    lease: u64,
    now: u64,
) -> OriginAnswer {
    let counts = WindowCounts {
        current: Counts {
            regional: current,
            global: 0,
        },
        previous: Counts {
            regional: previous,
            global: 0,
        },
    };
    let after = LimitCheck {
        counts,
        duration: minute(),
        limit,
        cost: 0,
    }
    .decide(now, 0);
    OriginAnswer {
        limit,
        remaining: after.remaining,
        reset_ms: after.reset_ms,
        sequence: plan.sequence,
        counted: true,
        denied: false,
        current: counts.current,
        previous: counts.previous,
        used: plan.used[0],
        lease,
        lease_id: u64::from(lease > 0),
        lease_ms: 5_000,
        covers: false,
    }
}

/// Decides a cost-0 check at an origin that holds nothing yet and leases nothing, through
/// the table's request path, so the key's current cell is warm.
fn warm_up(t: &mut CounterTable, k: WindowKeyRef<'_>, limit: u64, now: u64) {
    if let Step::Origin(plan) = t.check(k, limit, 0, now) {
        let call = OriginCall::single(
            LimitRequest {
                key: k,
                limit,
                cost: 0,
            },
            plan,
        );
        let a = answer(&plan, limit, 0, 0, 0, now);
        assert!(t.finish(&call, &[a], now).unwrap().success);
        assert!(t.get(k).unwrap().current().is_warm());
    }
}

#[test]
fn cold_oversized_request_consumes_and_propagates_nothing() {
    let mut t = table();
    let k = key("big-spender");
    // The local view is a lower bound, and it already denies: no origin round trip.
    let Step::Decided(d) = t.check(k, 10, 11, T0) else {
        panic!("a request over the limit on its own is denied locally, cold or not");
    };
    assert!(!d.success);
    assert_eq!(d.remaining, 10, "nothing was spent");
    assert_eq!(
        d.retry_after_ms, None,
        "a cost above the limit never passes"
    );
    assert_eq!(t.get(k).unwrap().current().counts().regional, 0);
    let policy = PublishPolicy::from_fraction(0.0).unwrap();
    assert!(
        t.flush_candidates(&policy, T0).is_empty(),
        "nothing to publish, even at floor 0"
    );
}

#[test]
fn previous_window_bleed_in_of_8_of_10_is_not_pinned_globally() {
    let mut t = table();
    let k = key("steady");
    warm_up(&mut t, k, 10, T0);
    for i in 0..8 {
        assert!(t.decide(k, 10, 1, T0 + 1_000 * i).success);
    }
    let policy = PublishPolicy::default();
    let rows = t.flush_candidates(&policy, T0 + 30_000);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].count, 8);
    t.commit_flush(&rows);

    // Start of window N+1: floor(8 * 0.99) = 7 still weighs; a cost-4 request is denied.
    let now = T0 + MINUTE_MS + 600;
    let d = t.decide(k, 10, 4, now);
    assert!(!d.success);
    assert_eq!(d.remaining, 3);
    // The denial counts nothing and publishes nothing: window N+1 is at 0, not pinned at 10.
    let state = t.get(k).unwrap();
    assert_eq!(state.current().counts().regional, 0);
    assert!(t.flush_candidates(&policy, now).is_empty());

    // Another region that imported window N's 8 sees the same decay, not a verdict.
    let mut other = table();
    let seq_n = minute().sequence(T0);
    assert!(other.apply_sync(k, seq_n, 0, 8, now));
    warm_up(&mut other, k, 10, now);
    assert!(other.decide(k, 10, 3, now).success, "7 + 3 <= 10");
}

#[test]
fn cost_zero_checks_without_counting() {
    let mut t = table();
    let k = key("peek");
    warm_up(&mut t, k, 5, T0);
    for _ in 0..5 {
        assert!(t.decide(k, 5, 1, T0).success);
    }
    let d = t.decide(k, 5, 0, T0);
    assert!(d.success, "at the limit, a check still fits");
    assert_eq!(d.remaining, 0);
    assert_eq!(t.get(k).unwrap().current().counts().regional, 5);
    assert!(!t.decide(k, 5, 1, T0).success);
}

#[test]
fn limit_zero_denies_everything() {
    let mut t = table();
    let k = key("blocked");
    warm_up(&mut t, k, 0, T0);
    for cost in [0, 1, 100] {
        let d = t.decide(k, 0, cost, T0);
        assert!(!d.success);
        assert_eq!(d.retry_after_ms, None);
    }
    assert_eq!(t.get(k).unwrap().current().counts().regional, 0);
}

#[test]
fn multi_limit_rolls_back_when_a_later_limit_denies() {
    let mut t = table();
    let (a, b) = (key("per-user"), key("per-org"));
    warm_up(&mut t, a, 100, T0);
    warm_up(&mut t, b, 2, T0);
    let req = |cost| {
        [
            LimitRequest {
                key: a,
                limit: 100,
                cost,
            },
            LimitRequest {
                key: b,
                limit: 2,
                cost,
            },
        ]
    };
    assert!(t.decide_all(&req(1), T0).unwrap().success);
    assert!(t.decide_all(&req(1), T0).unwrap().success);
    let m = t.decide_all(&req(1), T0).unwrap();
    assert!(!m.success);
    assert!(m.decisions[0].success && !m.decisions[1].success);
    assert_eq!(
        m.decisions[0].remaining, 98,
        "the passing limit was not charged"
    );
    assert_eq!(t.get(a).unwrap().current().counts().regional, 2);
    assert_eq!(t.get(b).unwrap().current().counts().regional, 2);
    assert_eq!(
        t.get(a).unwrap().strict_until(),
        0,
        "only the denying limit turns strict"
    );
    assert!(t.get(b).unwrap().strict_until() > T0);
}

#[test]
fn own_row_import_never_freshens_and_only_raises() {
    let mut t = table();
    let k = key("recovered");
    let seq = minute().sequence(T0);
    // The regional origin lost its data, but this region had published 40.
    assert!(t.apply_sync(k, seq, 40, 0, T0));
    let cell = *t.get(k).unwrap().current();
    assert_eq!(
        cell.counts(),
        Counts {
            regional: 40,
            global: 0
        }
    );
    assert!(
        !cell.is_warm() && !cell.is_fresh(T0),
        "still read from the origin first"
    );
    assert!(matches!(t.check(k, 100, 1, T0), Step::Origin(p) if p.reason == Reason::Cold));
    assert!(t.apply_sync(k, seq, 10, 0, T0));
    assert_eq!(
        t.get(k).unwrap().current().counts().regional,
        40,
        "a lower value is ignored"
    );
    assert_eq!(t.stats().created_by_sync, 1);
    assert!(
        t.flush_candidates(&PublishPolicy::default(), T0).is_empty(),
        "the imported value is already in the table: no republish"
    );
}

#[test]
fn foreign_counts_are_never_published() {
    let mut t = table();
    let k = key("shared");
    let seq = minute().sequence(T0);
    warm_up(&mut t, k, 100, T0);
    assert!(t.apply_sync(k, seq, 0, 50, T0));
    assert!(t.flush_candidates(&PublishPolicy::default(), T0).is_empty());
    assert!(t.decide(k, 100, 1, T0).success);
    let rows = t.flush_candidates(&PublishPolicy::default(), T0);
    assert_eq!(
        rows.len(),
        1,
        "another region published: every unit is worth writing"
    );
    assert_eq!(rows[0].count, 1, "our count only, never the 50 we imported");
    assert_eq!(t.get(k).unwrap().current().counts().global, 50);
}

#[test]
fn strict_mode_survives_the_sequence_rollover() {
    let mut t = table();
    let k = key("hammer");
    warm_up(&mut t, k, 10, T0);
    assert!(t.decide(k, 10, 10, T0 + 50_000).success);
    assert!(!t.decide(k, 10, 1, T0 + 55_000).success);
    // Next window, halfway: window N's 10 weigh 5, so a request of 1 would pass locally. The
    // new cell is cold: the origin decides.
    let now = T0 + MINUTE_MS + 30_000;
    let Step::Origin(plan) = t.check(k, 10, 1, now) else {
        panic!("a cold cell must not pass locally");
    };
    assert_eq!((plan.reason, plan.want), (Reason::Cold, 10));
    let call = OriginCall::single(
        LimitRequest {
            key: k,
            limit: 10,
            cost: 1,
        },
        plan,
    );
    let a = answer(&plan, 10, 1, 10, 0, now);
    assert!(t.finish(&call, &[a], now).unwrap().success);
    // The new window has its origin answer (no lease), and the key is still strict: the next
    // pass is decided at the origin too, asking for no more than its last lease.
    let Step::Origin(plan) = t.check(k, 10, 1, now + 1) else {
        panic!("a strict key must not pass locally");
    };
    assert_eq!((plan.reason, plan.want), (Reason::Strict, 1));
    assert_eq!(
        t.get(k).unwrap().current().counts().regional,
        1,
        "only the origin's pass"
    );
}

#[test]
fn a_failed_origin_call_is_not_fresh() {
    let mut t = table();
    let k = key("origin-down");
    let Step::Origin(plan) = t.check(k, 10, 1, T0) else {
        panic!("cold");
    };
    let call = OriginCall::single(
        LimitRequest {
            key: k,
            limit: 10,
            cost: 1,
        },
        plan,
    );
    let d = t.fail(&call, T0).unwrap();
    assert!(d.success, "falls back to the local count");
    let state = t.get(k).unwrap();
    assert!(!state.current().is_fresh(T0) && !state.current().is_warm());
    assert_eq!(state.current().counts().regional, 1);
    // Within the retry delay no call is made: the failure mode (`local`) decides from memory;
    // after it the origin is tried again.
    assert!(matches!(t.check(k, 10, 1, T0 + 299), Step::Fallback(d) if d.success));
    assert!(matches!(t.check(k, 10, 1, T0 + 300), Step::Origin(p) if p.reason == Reason::Cold));
    assert_eq!(t.get(k).unwrap().current().counts().regional, 2);
}
