//! A deterministic companion to the criterion bench: runs N warm decisions on one key with
//! either Strata's table or governor's keyed limiter, for `valgrind --tool=callgrind` to count
//! instructions (repeatable to the instruction, unlike wall time on a shared machine).
//!
//! ```text
//! cargo build --release -p strata-core --example instructions
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/instructions strata 100000
//! ```
//! Instructions per decision = (count at N - count at 0) / N.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a probe: a panic is the report

use std::hint::black_box;
use std::num::NonZeroU32;

use governor::clock::FakeRelativeClock;
use governor::{Quota, RateLimiter};
use strata_core::table::Step;
use strata_core::wire::MAX_COUNT;
use strata_core::{CounterTable, TableConfig, WindowDuration, WindowKeyRef};

#[path = "../tests/support/mod.rs"]
mod support;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (which, n) = match args.as_slice() {
        [_, which, n] => (which.as_str(), n.parse::<usize>().unwrap()),
        _ => panic!("usage: instructions <strata|governor> <decisions>"),
    };
    let now = 1_700_000_000_000_u64;
    let duration = WindowDuration::from_ms(60_000).unwrap();
    let id = String::from("api-key-00000001");
    match which {
        "strata" => {
            let mut table = CounterTable::new(TableConfig::default(), 1);
            let key = WindowKeyRef::new("ws", "api", &id, duration).unwrap();
            // Warm through the real path: the cold check is decided at the origin, which
            // leases far more than the run uses, so every decision below is local.
            support::warm(&mut table, key, MAX_COUNT, MAX_COUNT / 2, now);
            for _ in 0..n {
                let key = WindowKeyRef::new("ws", "api", black_box(&id), duration).unwrap();
                match table.check(key, MAX_COUNT, 1, now) {
                    Step::Decided(d) => black_box(d.success),
                    Step::Origin(_) | Step::Fallback(_) => panic!("warm key went to the origin"),
                };
            }
        }
        "governor" => {
            let quota = Quota::per_minute(NonZeroU32::MAX);
            let limiter = RateLimiter::hashmap_with_clock(quota, FakeRelativeClock::default());
            for _ in 0..n {
                black_box(limiter.check_key(black_box(&id)).is_ok());
            }
        }
        other => panic!("unknown contender {other}"),
    }
}
