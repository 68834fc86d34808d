//! Property tests: the CRDT laws of the global counter, the bounds of the decision, and the
//! bounds of a lease.

use proptest::prelude::*;
use strata_core::{Counts, GCounter, Region, WindowDuration, WindowKeyRef, WindowState};

fn regions() -> Vec<Region> {
    ["eu", "us", "ap", "sa", "af"]
        .iter()
        .map(|r| Region::new(r).unwrap())
        .collect()
}

fn gcounter() -> impl Strategy<Value = GCounter> {
    prop::collection::vec((0..5_usize, 0..1_000_000_u64), 0..12).prop_map(|obs| {
        let regions = regions();
        let mut g = GCounter::new();
        for (r, c) in obs {
            g.observe(&regions[r], c);
        }
        g
    })
}

fn merged(a: &GCounter, b: &GCounter) -> GCounter {
    let mut m = a.clone();
    m.merge(b);
    m
}

proptest! {
    #[test]
    fn gcounter_merge_is_monotonic(a in gcounter(), b in gcounter()) {
        let m = merged(&a, &b);
        for r in regions() {
            prop_assert!(m.component(&r) >= a.component(&r));
            prop_assert!(m.component(&r) >= b.component(&r));
        }
        prop_assert!(m.value() >= a.value().max(b.value()));
    }

    #[test]
    fn gcounter_merge_is_idempotent(a in gcounter(), b in gcounter()) {
        prop_assert_eq!(merged(&a, &a), a.clone());
        let m = merged(&a, &b);
        prop_assert_eq!(merged(&m, &b), m);
    }

    #[test]
    fn gcounter_merge_is_commutative(a in gcounter(), b in gcounter()) {
        prop_assert_eq!(merged(&a, &b), merged(&b, &a));
    }

    #[test]
    fn gcounter_merge_is_associative(a in gcounter(), b in gcounter(), c in gcounter()) {
        prop_assert_eq!(merged(&merged(&a, &b), &c), merged(&a, &merged(&b, &c)));
    }

    #[test]
    fn foreign_sum_plus_own_is_the_value(a in gcounter(), r in 0..5_usize) {
        let own = &regions()[r];
        prop_assert_eq!(a.foreign_sum(own) + a.component(own), a.value());
    }

    #[test]
    fn counts_merge_is_a_join(a in (0..100_u64, 0..100_u64), b in (0..100_u64, 0..100_u64)) {
        let (a, b) = (Counts { regional: a.0, global: a.1 }, Counts { regional: b.0, global: b.1 });
        let mut ab = a; ab.merge(b);
        let mut ba = b; ba.merge(a);
        prop_assert_eq!(ab, ba);
        let mut aba = ab; aba.merge(a);
        prop_assert_eq!(aba, ab);
        prop_assert!(ab.regional >= a.regional && ab.global >= b.global);
    }
}

/// A request arriving `gap` ms after the previous one with `cost`.
fn arrivals() -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((0..700_u64, 0..4_u64), 1..300)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// However requests arrive, a single table never admits more than `limit` within one
    /// fixed window, and after every pass the sliding estimate it decided on is within limit.
    #[test]
    fn a_single_table_never_admits_more_than_the_limit_in_a_window(
        limit in 0..20_u64,
        duration_s in 1..4_u64,
        start in 0..10_000_u64,
        arrivals in arrivals(),
    ) {
        let d = WindowDuration::from_ms(duration_s * 1_000).unwrap();
        let mut state = WindowState::new(d, start);
        let mut now = start;
        let mut admitted_in: std::collections::BTreeMap<u64, u64> = Default::default();
        for (gap, cost) in arrivals {
            now += gap;
            let mut rolled = state;
            rolled.roll(d, now);
            let decision = state.decide(d, limit, cost, now);
            if decision.success {
                let w = admitted_in.entry(d.sequence(now)).or_default();
                *w += cost;
                prop_assert!(*w <= limit, "window {} admitted {} > {}", d.sequence(now), w, limit);
                prop_assert_eq!(state.counts().current.regional, rolled.counts().current.regional + cost);
            } else {
                prop_assert_eq!(state.counts(), rolled.counts(), "a denial counts nothing");
            }
            prop_assert!(decision.remaining <= limit);
        }
    }

    /// Retry-After is honest: waiting exactly that long, the same request passes, and a
    /// millisecond less is not enough.
    #[test]
    fn retry_after_is_the_earliest_pass(
        limit in 1..30_u64,
        cost in 0..35_u64,
        current in 0..60_u64,
        previous in 0..60_u64,
        at in 0..60_000_u64,
    ) {
        let d = WindowDuration::from_ms(60_000).unwrap();
        let t0 = 60_000 * 1_000;
        let mut state = WindowState::new(d, t0);
        let merged = [
            state.merge_counts(1_000, Counts { regional: current, global: 0 }),
            state.merge_counts(999, Counts { regional: previous, global: 0 }),
        ];
        prop_assert_eq!(merged, [true, true]);
        let now = t0 + at;
        let decision = state.decide(d, limit, cost, now);
        match (decision.success, decision.retry_after_ms) {
            (true, retry) => prop_assert_eq!(retry, Some(0)),
            (false, None) => prop_assert!(cost > limit),
            (false, Some(wait)) => {
                prop_assert!(wait > 0);
                prop_assert!(state.decide(d, limit, cost, now + wait).success);
                prop_assert!(!state.decide(d, limit, cost, now + wait - 1).success);
            }
        }
    }

    /// A key's hash and equality do not depend on whether it is borrowed or owned.
    #[test]
    fn owned_and_borrowed_keys_agree(ns in "\\PC{1,20}", id in "\\PC{1,40}") {
        let d = WindowDuration::from_ms(1_000).unwrap();
        let k = WindowKeyRef::new("ws", &ns, &id, d).unwrap();
        let state = foldhash::quality::FixedState::with_seed(3);
        let owned = k.to_owned_key();
        prop_assert_eq!(owned.as_ref(), k);
        prop_assert_eq!(owned.as_ref().hash_with(&state), k.hash_with(&state));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A lease is never more than was asked or than is left, and in the last quarter of the
    /// limit it is a small share split between the holders (all of what is left for a caller
    /// alone, once that is within its share), so what can go unused there stays near 5% of
    /// the limit.
    #[test]
    fn a_lease_never_exceeds_what_is_left(
        want in 0..2_000_u64,
        limit in 0..1_000_u64,
        left in 0..1_100_u64,
        holders in 0..8_u64,
        alone in any::<bool>(),
    ) {
        let available = left.min(limit);
        let lease = strata_core::lease::grant(want, available, limit, holders, alone);
        prop_assert!(lease <= want && lease <= available, "{lease} of {available} (asked {want})");
        if available <= limit / strata_core::lease::EXACT_ZONE_DIVISOR {
            prop_assert!(lease <= limit / (20 * holders.max(1)), "{lease} in the last quarter");
        }
    }

    /// A request the local view (a lower bound of the truth) denies is denied locally: never
    /// sent to the origin, never turned into a pass.
    #[test]
    fn a_local_denial_is_never_turned_into_a_pass(
        limit in 0..50_u64,
        cost in 0..20_u64,
        current in 0..60_u64,
        previous in 0..60_u64,
        at in 0..60_000_u64,
        warm in any::<bool>(),
        lease in 0..60_u64,
        strict in any::<bool>(),
    ) {
        use strata_core::origin::{OriginAnswer, OriginPlan, Reason, Verdict};
        let d = WindowDuration::from_ms(60_000).unwrap();
        let t0 = 60_000 * 1_000;
        let mut state = WindowState::new(d, t0);
        if warm {
            // An origin decision merged: both cells' counts, and a lease for 5 s.
            let plan = OriginPlan { sequence: 1_000, at_ms: t0 + at, reason: Reason::Cold, release: 0, used: [0, 0], decided: [0, 0], want: lease, call: 0, undo_from: 0 };
            let answer = OriginAnswer {
                limit, remaining: 0, reset_ms: d.reset(1_000), sequence: 1_000, counted: true, denied: false,
                current: Counts { regional: current, global: 0 },
                previous: Counts { regional: previous, global: 0 },
                used: 0, lease, lease_id: 1, lease_ms: 5_000, covers: false,
            };
            state.apply_decided(d, &plan, &answer, 0, t0 + at);
        }
        if strict {
            state.decide(d, 0, 1, t0); // a denial: strict mode
        }
        let local = state.check(d, limit, cost).decide(t0 + at, 0);
        match state.classify(d, limit, cost, t0 + at) {
            Verdict::Local(decision) => {
                if !local.success { prop_assert!(!decision.success); }
                if decision.success {
                    // No origin call failed: only a live lease that covers the cost passes locally.
                    let cell = state.current();
                    prop_assert!(cell.is_fresh(t0 + at) && cell.lease_left() >= cost, "{cell:?}");
                }
            }
            Verdict::Origin(_) => prop_assert!(local.success, "a local denial went to the origin"),
            Verdict::Unreachable(_) => prop_assert!(false, "no call failed, yet calls are held off"),
        }
    }
}
