//! One replay pass over a table of 50,000 keys that each hold unreplayed cost, sent in batches
//! of 128 cells (the gateway's `REPLAY_STEP`), every batch acknowledged before the next is
//! taken: each take going on from where the previous stopped (`take_replay_from` with the
//! position it returned) against each take walking the table's touched cells from the start
//! (what a pass did before the position existed). Run:
//! `cargo bench -p strata-core --bench replay_pass`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use strata_core::table::Step;
use strata_core::wire::MAX_COUNT;
use strata_core::{CounterTable, Counts, TableConfig, WindowDuration, WindowKeyRef};

#[path = "../tests/support/mod.rs"]
mod support;

const NOW_MS: u64 = 1_700_000_000_000;
const KEYS: usize = 50_000;
const STEP: usize = 128;

/// Every key warm under a lease, then used once more: one unreplayed cell each.
fn dirty(table: &mut CounterTable, ids: &[String], duration: WindowDuration) {
    for id in ids {
        let key = WindowKeyRef::new("ws", "api", id, duration).unwrap();
        match table.check(key, MAX_COUNT, 1, NOW_MS) {
            Step::Decided(d) => assert!(d.success),
            Step::Origin(_) | Step::Fallback(_) => panic!("the lease covers the run"),
        }
    }
}

/// One pass in batches of `STEP`; `resume`: each take goes on from the previous position.
fn pass(table: &mut CounterTable, resume: bool) -> usize {
    let (mut from, mut cells) = (0, 0);
    loop {
        let (batch, next) = table.take_replay_from(STEP, NOW_MS, None, from);
        table.ack_replay(&batch, &vec![Counts::default(); batch.len()]);
        cells += batch.len();
        match next {
            Some(at) if resume => from = at,
            Some(_) => from = 0,
            None => return cells,
        }
    }
}

fn replay_pass(c: &mut Criterion) {
    let ids: Vec<String> = (0..KEYS).map(|i| format!("api-key-{i:08}")).collect();
    let duration = WindowDuration::from_ms(60_000).unwrap();
    let mut table = CounterTable::new(TableConfig::default(), 0x5eed);
    for id in &ids {
        let key = WindowKeyRef::new("ws", "api", id, duration).unwrap();
        support::warm(&mut table, key, MAX_COUNT, MAX_COUNT / 2, NOW_MS);
    }
    let mut group = c.benchmark_group("replay_pass");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    for (name, resume) in [("from_last_position", true), ("from_the_start", false)] {
        group.bench_function(BenchmarkId::new(name, KEYS), |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    dirty(&mut table, &ids, duration);
                    let started = Instant::now();
                    let cells = black_box(pass(&mut table, resume));
                    spent += started.elapsed();
                    assert_eq!(cells, KEYS, "every cell once");
                }
                spent
            })
        });
    }
    group.finish();
}

criterion_group!(benches, replay_pass);
criterion_main!(benches);
