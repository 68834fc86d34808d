//! Warm decisions per second: Strata's local table against governor's keyed limiters doing the
//! same work (look the key up, decide, record), on one hot key and on 100,000 keys.
//!
//! Both sides are given time instead of reading a clock (Strata takes `now_ms`; governor gets
//! its `FakeRelativeClock`), and every request passes, so each iteration is exactly one lookup,
//! one decision and one update. Run: `cargo bench -p strata-core --bench decision`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation
)] // test code: a panic is the failure report

use std::hint::black_box;
use std::num::NonZeroU32;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use governor::clock::FakeRelativeClock;
use governor::{Quota, RateLimiter};
use strata_core::table::Step;
use strata_core::wire::MAX_COUNT;
use strata_core::{CounterTable, TableConfig, WindowDuration, WindowKeyRef};

#[path = "../tests/support/mod.rs"]
mod support;

const NOW_MS: u64 = 1_700_000_000_000;

fn identifiers(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("api-key-{i:08}")).collect()
}

/// The order keys are hit in: a fixed pseudo-random permutation, the same for every
/// contender, so no side gains from walking its memory in insertion order.
fn visit_order(n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    order
}

/// A table where every key holds a lease far larger than the run, granted through the real
/// request path (a cold check answered by the origin), so `check` decides locally.
fn warm_table(ids: &[String], duration: WindowDuration) -> CounterTable {
    let mut table = CounterTable::new(TableConfig::default(), 0x5eed);
    for id in ids {
        let key = WindowKeyRef::new("ws", "api", id, duration).unwrap();
        support::warm(&mut table, key, MAX_COUNT, MAX_COUNT / 2, NOW_MS);
    }
    table
}

fn bench(c: &mut Criterion, name: &str, keys: usize) {
    let ids = identifiers(keys);
    let order = visit_order(keys);
    let duration = WindowDuration::from_ms(60_000).unwrap();
    let mut group = c.benchmark_group(format!("warm_decision/{name}"));
    group.measurement_time(std::time::Duration::from_secs(8));
    group.throughput(Throughput::Elements(1));

    let mut table = warm_table(&ids, duration);
    let mut i = 0;
    group.bench_function(BenchmarkId::new("strata_table", keys), |b| {
        b.iter(|| {
            i = (i + 1) % ids.len();
            // Validation of the identity is part of every request a shell serves.
            let key = WindowKeyRef::new("ws", "api", &ids[order[i]], duration).unwrap();
            match table.check(key, MAX_COUNT, 1, NOW_MS) {
                Step::Decided(d) => black_box(d.success),
                Step::Origin(_) | Step::Fallback(_) => {
                    panic!("the lease covers every decision of the run")
                }
            }
        })
    });

    let quota = Quota::per_minute(NonZeroU32::MAX);
    let dashmap = RateLimiter::dashmap_with_clock(quota, FakeRelativeClock::default());
    let hashmap = RateLimiter::hashmap_with_clock(quota, FakeRelativeClock::default());
    for id in &ids {
        let _ = dashmap.check_key(id);
        let _ = hashmap.check_key(id);
    }
    let mut i = 0;
    group.bench_function(BenchmarkId::new("governor_dashmap", keys), |b| {
        b.iter(|| {
            i = (i + 1) % ids.len();
            black_box(dashmap.check_key(&ids[order[i]]).is_ok())
        })
    });
    let mut i = 0;
    group.bench_function(BenchmarkId::new("governor_hashmap", keys), |b| {
        b.iter(|| {
            i = (i + 1) % ids.len();
            black_box(hashmap.check_key(&ids[order[i]]).is_ok())
        })
    });
    group.finish();

    println!(
        "memory: strata table with {keys} keys holds {} heap bytes ({} per key)",
        table.heap_bytes(),
        table.heap_bytes() / keys
    );
}

fn warm_decisions(c: &mut Criterion) {
    bench(c, "one_key", 1);
    bench(c, "100k_keys", 100_000);
}

criterion_group!(benches, warm_decisions);
criterion_main!(benches);
