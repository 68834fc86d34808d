//! A warm decision allocates nothing: counted with a global allocator that tallies every
//! allocation made on this test's thread.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use strata_core::table::Step;
use strata_core::{CounterTable, TableConfig, WindowDuration, WindowKeyRef};

mod counting;
mod support;

use counting::allocations;

/// A warm decision, including what it leaves for the replay buffer, allocates nothing.
#[test]
fn warm_decisions_do_not_allocate() {
    const NOW: u64 = 1_700_000_000_000;
    let d = WindowDuration::from_ms(60_000).unwrap();
    let ids: Vec<String> = (0..1_000).map(|i| format!("key-{i}")).collect();
    let mut table = CounterTable::new(TableConfig::default(), 9);
    for id in &ids {
        let key = WindowKeyRef::new("ws", "api", id, d).unwrap();
        support::warm(&mut table, key, 1_000_000, 100_000, NOW);
    }
    // One replay pass first, so the buffer's bookkeeping has grown to its size.
    let _ = table.take_replay(10_000, NOW);
    let before = allocations();
    assert!(
        before >= 1_000,
        "the counter sees the table's own key allocations: {before}"
    );
    let mut passed = 0;
    for round in 0..10 {
        for id in &ids {
            let key = WindowKeyRef::new("ws", "api", id, d).unwrap();
            if let Step::Decided(decision) = table.check(key, 1_000_000, 1, NOW + round) {
                passed += u64::from(decision.success);
            }
        }
    }
    assert_eq!(passed, 10_000, "every check was decided locally and passed");
    assert_eq!(allocations() - before, 0, "the warm path allocated");
    let batch = table.take_replay(10_000, NOW + 10);
    assert_eq!(batch.len(), 1_000, "every pass is waiting for replay");
    assert!(batch.events.iter().all(|e| e.used == 10));
}
