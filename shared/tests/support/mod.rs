//! Shared by tests, benches and examples: a key made warm through the real request path, with
//! a lease from a scripted origin, so the next requests are decided locally.

#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::panic)] // test support: a panic is the report

use strata_core::driver::{Decided, Driver, DriverConfig, Started, Store};
use strata_core::gate::Gate;
use strata_core::rules::{RequestError, RequestView};
use strata_core::table::{LimitRequest, Step};
use strata_core::{CounterTable, Counts, OriginAnswer, OriginCall, WindowKeyRef};

pub mod origin;

/// Sends `key`'s first request to a scripted origin that counts it (the region's count is
/// then 1) and lends `lease` for 5 s; panics if the table did not ask the origin.
pub fn warm(table: &mut CounterTable, key: WindowKeyRef<'_>, limit: u64, lease: u64, now_ms: u64) {
    let Step::Origin(plan) = table.check(key, limit, 1, now_ms) else {
        panic!("a new key is decided at the origin");
    };
    let request = LimitRequest {
        key,
        limit,
        cost: 1,
    };
    let call = OriginCall::single(request, plan);
    let answer = OriginAnswer {
        limit,
        remaining: limit - 1,
        reset_ms: key.duration().reset(plan.sequence),
        sequence: plan.sequence,
        counted: true,
        denied: false,
        current: Counts {
            regional: 1,
            global: 0,
        },
        previous: Counts::default(),
        used: plan.used[0],
        lease,
        lease_id: u64::from(lease > 0),
        lease_ms: 5_000,
        covers: false,
    };
    assert!(table.finish(&call, &[answer], now_ms).unwrap().success);
}

/// The shells' request path for `gate`'s rules: a 250 ms timeout, replays gathered 100 ms.
pub fn driver(gate: &Gate) -> Driver {
    let config = DriverConfig {
        timeout_ms: 250,
        replay_interval_ms: 100,
        unaddressed_counter: "stats".into(),
    };
    Driver::new(gate.clone(), config)
}

/// `request` through `driver` at `now_ms` with no gateway behind it: every call it makes
/// fails at once, so what needs the gateway is decided per the store's failure mode. Its
/// decision, or the client error the request is.
pub fn without_gateway<S: Store>(
    driver: &mut Driver,
    store: &mut S,
    id: u64,
    request: &impl RequestView,
    now_ms: u64,
) -> Result<Decided, RequestError> {
    let started = driver.request(store, id, request, now_ms)?;
    let calls: Vec<u64> = std::iter::from_fn(|| driver.poll_transmit())
        .map(|t| t.call)
        .collect();
    for call in calls {
        driver.fail(store, call, "no gateway here", now_ms);
    }
    match started {
        Started::Decided(d) => Ok(d),
        Started::Waiting => Ok(driver
            .poll_decision()
            .expect("decided once its calls failed")),
    }
}

/// The rule model's field names (rules, matches, actions, header matchers, costs).
pub const RULE_FIELDS: &[&str] = &[
    "rules",
    "name",
    "namespace",
    "limit",
    "duration",
    "cost",
    "shadow",
    "match",
    "actions",
    "methods",
    "hosts",
    "path_prefix",
    "headers",
    "request_headers",
    "header_name",
    "descriptor_key",
    "skip_if_absent",
    "remote_address",
    "generic_key",
    "descriptor_value",
    "header_value_match",
    "expect_match",
    "exact_match",
    "prefix_match",
    "present_match",
    "invert_match",
    "header",
    "default",
    "max",
];
