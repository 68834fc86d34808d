//! Structured fuzzing on the stable toolchain (proptest): the wire parsers and validators take
//! arbitrary bytes and arbitrary JSON, the rule parser arbitrary rule-shaped JSON (and what it
//! accepts is applied to arbitrary requests through a gate), and the core's decision API takes
//! arbitrary sequences of operations with arbitrary origin answers; nothing may panic, and a
//! few invariants hold.
//!
//! The test command runs a short pass (`STRATA_FUZZ_CASES`, default 2,000 cases a property);
//! `docs/BENCHMARKS.md` records a run of 10^6:
//!
//!     STRATA_FUZZ_CASES=1000000 cargo test --release -p strata-core --test it fuzz::

use proptest::prelude::*;
use serde_json::Value;
use strata_core::FailureMode;
use strata_core::driver::TableStore;
use strata_core::gate::Gate;
use strata_core::rules::{ListRequest, RuleSet};
use strata_core::table::{LimitRequest, Step};
use strata_core::wire::{
    DecideRequest, MultiRequest, RatelimitRequest, ReadRequest, ReplayRequest,
};
use strata_core::{
    Begin, CounterTable, Counts, OriginAnswer, OriginCall, TableConfig, WindowDuration,
    WindowKeyRef,
};

use crate::support;

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

/// The API bodies' field names.
const API_FIELDS: &[&str] = &[
    "namespace",
    "identifier",
    "limit",
    "duration",
    "cost",
    "sequence",
    "used",
    "used_previous",
    "decided",
    "decided_previous",
    "want",
    "release",
    "instance",
    "limits",
    "cells",
    "events",
    "x",
];

/// JSON values shaped like the API's bodies: its field names, numbers at the edges (negative,
/// past 2^53, past u64), strings with any characters, nesting.
fn json() -> impl Strategy<Value = Value> {
    json_with(API_FIELDS)
}

/// JSON values whose objects use `fields` as keys, with edge-case numbers and any strings.
fn json_with(fields: &'static [&'static str]) -> impl Strategy<Value = Value> {
    let field = prop::sample::select(fields);
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
        prop_oneof![
            Just("1m"),
            Just("500ms"),
            Just("x-key"),
            Just("/api"),
            Just("GET")
        ]
        .prop_map(|s| Value::String(s.to_string())),
    ];
    leaf.prop_recursive(5, 96, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec((field.clone(), inner), 0..10).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

/// Rules in the schema's shape with arbitrary values, so most parse and reach the gate.
fn shaped_rule() -> impl Strategy<Value = Value> {
    // Mostly valid values (so most rules parse and reach the gate), sometimes not.
    let header = prop_oneof![
        3 => Just("x-key".to_string()),
        3 => Just("x-cost".to_string()),
        3 => "[a-z-]{1,10}",
        1 => ".{0,12}",
    ];
    let matcher = (
        header.clone(),
        prop_oneof![
            ".{0,20}".prop_map(|v| serde_json::json!({"exact_match": v})),
            ".{0,20}".prop_map(|v| serde_json::json!({"prefix_match": v})),
            any::<bool>().prop_map(|v| serde_json::json!({"present_match": v})),
        ],
        any::<bool>(),
    )
        .prop_map(|(name, mut test, invert)| {
            test["name"] = Value::String(name);
            test["invert_match"] = Value::Bool(invert);
            test
        });
    let action = prop_oneof![
        (header.clone(), "[a-z]{1,8}|.{0,12}", any::<bool>()).prop_map(
            |(h, k, skip)| serde_json::json!(
                {"request_headers": {"header_name": h, "descriptor_key": k, "skip_if_absent": skip}}
            )
        ),
        Just(serde_json::json!({"remote_address": {}})),
        ".{0,40}".prop_map(|v| serde_json::json!({"generic_key": {"descriptor_value": v}})),
        (
            ".{0,12}",
            any::<bool>(),
            prop::collection::vec(matcher.clone(), 0..3)
        )
            .prop_map(
                |(v, expect, headers)| serde_json::json!({"header_value_match": {
                "descriptor_value": v, "expect_match": expect, "headers": headers}})
            ),
    ];
    let cost = prop_oneof![
        (0_u64..10).prop_map(Value::from),
        (header, 0_u64..5, 0_u64..20)
            .prop_map(|(h, d, m)| serde_json::json!({"header": h, "default": d, "max": m})),
    ];
    (
        ".{0,20}",
        0_u64..50,
        prop_oneof![
            Just(Value::from("1s")),
            Just(Value::from(60_000)),
            Just(Value::from("0s"))
        ],
        cost,
        any::<bool>(),
        prop::collection::vec(action, 1..4),
        prop::option::of(".{0,10}"),
        prop::collection::vec(matcher, 0..2),
    )
        .prop_map(
            |(namespace, limit, duration, cost, shadow, actions, prefix, headers)| {
                let mut m = serde_json::json!({"headers": headers});
                if let Some(p) = prefix {
                    m["path_prefix"] = Value::String(format!("/{p}"));
                }
                serde_json::json!({"namespace": namespace, "limit": limit, "duration": duration,
                    "cost": cost, "shadow": shadow, "actions": actions, "match": m})
            },
        )
}

/// A request with arbitrary parts, as the rules read it.
fn request() -> impl Strategy<Value = ListRequest> {
    let name = prop_oneof![
        Just("x-key".to_string()),
        Just("x-cost".to_string()),
        Just("x-forwarded-for".to_string()),
        Just("cf-connecting-ip".to_string()),
        "[a-z-]{1,12}",
    ];
    (
        prop_oneof![Just("GET".to_string()), ".{0,8}"],
        ".{0,40}",
        prop_oneof![Just("/api/x".to_string()), ".{0,80}"],
        prop::collection::vec(
            (
                name,
                prop_oneof![
                    ".{0,300}".prop_map(String::into_bytes),
                    prop::collection::vec(any::<u8>(), 0..300),
                ],
            ),
            0..6,
        ),
        prop::option::of(".{0,40}"),
    )
        .prop_map(|(method, host, path, headers, peer)| ListRequest {
            method,
            host,
            path,
            headers,
            peer,
        })
}

/// Rules from arbitrary JSON: parsed, and if valid, applied to requests through a gate and a
/// table (the origin failing, so every request is decided from memory).
fn rules_and_requests(rules: &Value, requests: &[ListRequest]) {
    let _ = RuleSet::from_json(&rules.to_string());
    let Ok(gate) = Gate::from_json("ws", &rules.to_string(), "") else {
        return;
    };
    let mut store = TableStore {
        table: CounterTable::new(TableConfig::default(), 3),
        instance: "fuzz".into(),
    };
    let mut driver = support::driver(&gate);
    for (i, r) in requests.iter().enumerate() {
        let now = 1_700_000_000_000 + i as u64 * 250;
        let Ok(decided) = support::without_gateway(&mut driver, &mut store, i as u64, r, now)
        else {
            continue;
        };
        assert!(decided.reply.status == 200 || decided.reply.status == 429);
        let subjects = gate.subjects(r).expect("the driver took it");
        for s in &subjects.limits {
            assert!(!s.identifier.is_empty() && s.identifier.len() <= 255);
        }
    }
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
    Fail,
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
        Just(Op::Fail),
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

/// Runs `ops` on a small table (so eviction happens) whose failure mode is `mode`, answering
/// origin calls as `Answer` ops say, with a clock that only moves forward.
fn drive(ops: &[Op], mode: FailureMode) {
    let mut config = TableConfig {
        capacity: 64,
        ..TableConfig::default()
    };
    config.origin.failure_mode = mode;
    let mut table = CounterTable::new(config, 7);
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
                            covers: *lease % 2 == 1,
                        })
                        .collect();
                    let _ = table.finish(&call, &answers, now);
                }
            }
            Op::Fail => {
                if let Some(call) = pending.take() {
                    let _ = table.fail(&call, now);
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
    fn arbitrary_operations_never_panic_the_decision_api(
        ops in prop::collection::vec(op(), 1..60),
        mode in prop::sample::select(vec![FailureMode::Local, FailureMode::Allow, FailureMode::Deny]),
    ) {
        drive(&ops, mode);
    }

    #[test]
    fn arbitrary_rules_never_panic_the_parser_or_the_gate(
        rule in json_with(support::RULE_FIELDS),
        requests in prop::collection::vec(request(), 0..8),
    ) {
        rules_and_requests(&rule, &requests);
        rules_and_requests(&serde_json::json!({"rules": [rule]}), &requests);
    }

    #[test]
    fn shaped_rules_with_arbitrary_values_never_panic_the_gate(
        rules in prop::collection::vec(shaped_rule(), 1..3),
        requests in prop::collection::vec(request(), 0..8),
    ) {
        rules_and_requests(&serde_json::json!({ "rules": rules }), &requests);
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_rule_parser(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(text) = std::str::from_utf8(&bytes) {
            let _ = RuleSet::from_json(text);
            let _ = Gate::from_json("ws", "{\"rules\": []}", text);
        }
    }
}
