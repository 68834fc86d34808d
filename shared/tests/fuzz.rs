//! Structured fuzzing on the stable toolchain (proptest): the wire parsers and validators take
//! arbitrary bytes and arbitrary JSON, and the core's decision API takes arbitrary sequences
//! of operations with arbitrary origin answers; nothing may panic, and a few invariants hold.
//!
//! The test command runs a short pass (`STRATA_FUZZ_CASES`, default 2,000 cases a property);
//! `docs/BENCHMARKS.md` records a run of 10^6:
//!
//!     STRATA_FUZZ_CASES=1000000 cargo test --release -p strata-core --test fuzz

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use proptest::prelude::*;
use serde_json::Value;
use strata_core::request::FailureMode;
use strata_core::table::{LimitRequest, Step};
use strata_core::wire::{
    DecideRequest, MultiRequest, RatelimitRequest, ReadRequest, ReplayRequest,
};
use strata_core::{
    Begin, CounterTable, Counts, OriginAnswer, OriginCall, TableConfig, WindowDuration,
    WindowKeyRef,
};

fn cases() -> u32 {
    std::env::var("STRATA_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

/// Every body type, parsed and (if it parsed) validated: an error is fine, a panic is not.
fn parse_all(bytes: &[u8]) {
    macro_rules! each {
        ($($t:ty),*) => {$(
            if let Ok(req) = serde_json::from_slice::<$t>(bytes) {
                let _ = req.validate("ws");
            }
        )*};
    }
    each!(
        RatelimitRequest,
        MultiRequest,
        ReadRequest,
        ReplayRequest,
        DecideRequest
    );
}

/// JSON values shaped like the API's bodies: its field names, numbers at the edges (negative,
/// past 2^53, past u64), strings with any characters, nesting.
fn json() -> impl Strategy<Value = Value> {
    let field = prop_oneof![
        Just("namespace"),
        Just("identifier"),
        Just("limit"),
        Just("duration"),
        Just("cost"),
        Just("sequence"),
        Just("used"),
        Just("used_previous"),
        Just("want"),
        Just("release"),
        Just("instance"),
        Just("limits"),
        Just("cells"),
        Just("events"),
        Just("x"),
    ];
    let number = prop_oneof![
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0_u64..70_000).prop_map(Value::from),
        Just(Value::from(9_007_199_254_740_993_u64)),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number,
        ".{0,300}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 64, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec((field.clone(), inner), 0..10).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

/// One operation on a table, with arbitrary values.
#[derive(Clone, Debug)]
enum Op {
    Check {
        key: u8,
        limit: u64,
        cost: u64,
        dt: u64,
    },
    Answer {
        lease: u64,
        used: u64,
        counted: bool,
        denied: bool,
        regional: u64,
        seq_shift: i8,
    },
    Fail {
        mode: u8,
    },
    Multi {
        keys: Vec<u8>,
        limit: u64,
        cost: u64,
    },
    Replay {
        regional: u64,
    },
    Sync {
        key: u8,
        own: u64,
        foreign: u64,
    },
    Purge {
        dt: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let count = prop_oneof![0_u64..20, any::<u64>(), Just(u64::MAX)];
    prop_oneof![
        (0_u8..6, count.clone(), 0_u64..5, 0_u64..120_000).prop_map(|(key, limit, cost, dt)| {
            Op::Check {
                key,
                limit,
                cost,
                dt,
            }
        }),
        (
            count.clone(),
            count.clone(),
            any::<bool>(),
            any::<bool>(),
            count.clone(),
            -2_i8..3
        )
            .prop_map(
                |(lease, used, counted, denied, regional, seq_shift)| Op::Answer {
                    lease,
                    used,
                    counted,
                    denied,
                    regional,
                    seq_shift,
                }
            ),
        (0_u8..3).prop_map(|mode| Op::Fail { mode }),
        (
            prop::collection::vec(0_u8..6, 1..5),
            count.clone(),
            0_u64..3
        )
            .prop_map(|(keys, limit, cost)| Op::Multi { keys, limit, cost }),
        count.clone().prop_map(|regional| Op::Replay { regional }),
        (0_u8..6, count.clone(), count).prop_map(|(key, own, foreign)| Op::Sync {
            key,
            own,
            foreign
        }),
        (0_u64..400_000).prop_map(|dt| Op::Purge { dt }),
    ]
}

const IDS: [&str; 6] = ["a", "b", "c", "d", "e", "f"];

fn key(i: u8) -> WindowKeyRef<'static> {
    let d = WindowDuration::from_ms(if i % 2 == 0 { 1_000 } else { 60_000 }).unwrap();
    WindowKeyRef::new("ws", "api", IDS[usize::from(i) % IDS.len()], d).unwrap()
}

/// Runs `ops` on a small table (so eviction happens), answering origin calls as `Answer` ops
/// say, with a clock that only moves forward.
fn drive(ops: &[Op]) {
    let mut table = CounterTable::new(
        TableConfig {
            capacity: 64,
            ..TableConfig::default()
        },
        7,
    );
    let mut now = 1_700_000_000_000_u64;
    let mut pending: Option<OriginCall> = None;
    for op in ops {
        match op {
            Op::Check {
                key: k,
                limit,
                cost,
                dt,
            } => {
                now += dt;
                if let Step::Origin(plan) = table.check(key(*k), *limit, *cost, now) {
                    let l = LimitRequest {
                        key: key(*k),
                        limit: *limit,
                        cost: *cost,
                    };
                    pending = Some(OriginCall::single(l, plan));
                }
            }
            Op::Multi { keys, limit, cost } => {
                let limits: Vec<LimitRequest<'_>> = keys
                    .iter()
                    .map(|k| LimitRequest {
                        key: key(*k),
                        limit: *limit,
                        cost: *cost,
                    })
                    .collect();
                if let Ok(Begin::Call(call)) = table.begin(&limits, now) {
                    pending = Some(call);
                }
            }
            Op::Answer {
                lease,
                used,
                counted,
                denied,
                regional,
                seq_shift,
            } => {
                if let Some(call) = pending.take() {
                    let answers: Vec<OriginAnswer> = call
                        .limits()
                        .iter()
                        .map(|l| OriginAnswer {
                            limit: l.limit,
                            remaining: 0,
                            reset_ms: now,
                            sequence: l.plan.sequence.saturating_add_signed(i64::from(*seq_shift)),
                            counted: *counted,
                            denied: *denied,
                            current: Counts {
                                regional: *regional,
                                global: *used,
                            },
                            previous: Counts {
                                regional: *used,
                                global: 0,
                            },
                            used: *used,
                            lease: *lease,
                            lease_id: now,
                            lease_ms: 5_000,
                        })
                        .collect();
                    let _ = table.finish(&call, &answers, now);
                }
            }
            Op::Fail { mode } => {
                if let Some(call) = pending.take() {
                    let mode = [FailureMode::Local, FailureMode::Allow, FailureMode::Deny]
                        [usize::from(*mode) % 3];
                    let _ = table.fail(&call, mode, now);
                }
            }
            Op::Replay { regional } => {
                let batch = table.take_replay(1_000, now);
                let counts = vec![
                    Counts {
                        regional: *regional,
                        global: 0
                    };
                    batch.len()
                ];
                let _ = batch.to_wire("fuzz");
                table.ack_replay(&batch, &counts);
            }
            Op::Sync {
                key: k,
                own,
                foreign,
            } => {
                let seq = key(*k).duration().sequence(now);
                table.apply_sync(key(*k), seq, *own, *foreign, now);
            }
            Op::Purge { dt } => {
                now += dt;
                table.purge_expired(now, 16);
            }
        }
        assert!(table.len() <= 64, "capacity exceeded");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_a_parser(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        parse_all(&bytes);
    }

    #[test]
    fn arbitrary_json_never_panics_a_parser_or_a_validator(v in json()) {
        parse_all(v.to_string().as_bytes());
        // The same value as each body's inner shapes, too.
        parse_all(serde_json::json!({"limits": [v.clone()]}).to_string().as_bytes());
        parse_all(serde_json::json!({"instance": "e", "events": [v.clone()]}).to_string().as_bytes());
        parse_all(serde_json::json!({"cells": [v]}).to_string().as_bytes());
    }

    #[test]
    fn arbitrary_operations_never_panic_the_decision_api(ops in prop::collection::vec(op(), 1..60)) {
        drive(&ops);
    }
}
