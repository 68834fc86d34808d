//! The API contract (v1) against the embedded origin and Redis: every endpoint, every
//! error status, auth and workspace isolation, and identities built to collide.

use crate::common;

use axum::body::Body;
use axum::http::StatusCode;
use common::{Backend, T0, TestGateway, gateway};
use serde_json::json;
use strata_core::Reason;
use strata_core::wire::{MAX_BATCH, MAX_BODY_BYTES, MAX_MULTI_LIMITS};
use strata_gateway::metrics::Source;

/// Runs each case against the embedded origin, a private Redis and a private Redis Cluster.
macro_rules! on_every_origin {
    ($($case:ident($tokens:expr)),* $(,)?) => {$(
        mod $case {
            #[tokio::test]
            async fn memory() {
                super::$case(super::gateway(super::Backend::Memory, $tokens).await).await;
            }
            #[tokio::test]
            async fn redis() {
                super::$case(super::gateway(super::Backend::Redis, $tokens).await).await;
            }
            #[tokio::test]
            async fn redis_cluster() {
                super::$case(super::gateway(super::Backend::RedisCluster, $tokens).await).await;
            }
        }
    )*};
}

on_every_origin! {
    origin_decide_is_atomic_all_or_nothing_and_counts_used(&[]),
    origin_decide_leases_far_from_the_limit_and_not_at_the_last_unit(&[]),
    ratelimit_counts_then_denies_with_headers(&[]),
    cost_defaults_to_one_and_cost_zero_only_checks(&[]),
    multi_is_all_or_nothing(&[]),
    every_bad_input_gets_its_status_and_the_error_shape(&[]),
    tokens_are_required_and_bind_one_workspace(&[("token-aaaaaaaa", "acme"), ("token-bbbbbbbb", "globex")]),
    identities_built_to_collide_stay_apart(&[]),
    replay_merges_cumulative_counts_and_answers_in_request_order(&[]),
    the_same_replay_posted_twice_counts_once(&[]),
    a_warm_key_is_decided_locally_under_its_lease(&[]),
    a_lease_in_use_is_renewed_by_the_replay_not_by_a_request(&[]),
    a_quiet_key_waits_for_its_turn_and_a_key_over_the_floor_goes_every_pass(&[]),
    a_replay_pass_yields_to_requests_between_batches(&[]),
    health_readiness_and_metrics_answer(&[]),
    a_limit_changed_mid_window_applies_at_once(&[]),
}

/// A limit lowered mid-window applies to the next request, whether the lease granted under the
/// old limit would still cover it or not (the local view, counting what was admitted, denies
/// first); raised again, the room comes back; the latest limit is the one kept (the publish
/// floor follows it).
async fn a_limit_changed_mid_window_applies_at_once(g: TestGateway) {
    for _ in 0..5 {
        assert!(g.limit(None, "moving", 100).await.0);
    }
    assert_eq!(g.limit(None, "moving", 6).await, (true, 0), "6th of 6");
    let (passed, remaining) = g.limit(None, "moving", 6).await;
    assert!(!passed && remaining == 0, "the lower limit holds");
    assert_eq!(
        g.limit(None, "moving", 8).await,
        (true, 1),
        "raised: room again"
    );
    let key = strata_core::WindowKeyRef::new(
        "default",
        "api",
        "moving",
        strata_core::WindowDuration::from_ms(60_000).unwrap(),
    )
    .unwrap();
    let local = g.gateway.limiter.local.lock(key);
    assert_eq!(
        local.get(key).unwrap().limit(),
        8,
        "the latest limit is kept"
    );
}

async fn ratelimit_counts_then_denies_with_headers(g: TestGateway) {
    for expected in [2, 1, 0] {
        assert_eq!(g.limit(None, "user-1", 3).await, (true, expected));
    }
    let r = g
        .post(
            "/v1/ratelimit",
            None,
            json!({"namespace":"api","identifier":"user-1","limit":3,"duration":60_000}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "a denial is a 200");
    assert_eq!(r.body["success"], false);
    assert_eq!(r.body["limit"], 3);
    assert_eq!(r.body["reset"], T0 - T0 % 60_000 + 60_000);
    assert_eq!(r.headers["ratelimit-policy"], "\"api\";q=3;w=60");
    assert!(
        r.headers["ratelimit"]
            .to_str()
            .unwrap()
            .starts_with("\"api\";r=0;t=")
    );
    let retry: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    // The legacy trio is off unless asked for (as on the edge and in the Envoy filter).
    assert!(!r.headers.contains_key("x-ratelimit-limit"));
}

/// With `legacy_headers`, decisions (single and multi) also carry `X-RateLimit-Limit`,
/// `-Remaining` and `-Reset`, of the most constraining limit.
#[tokio::test]
async fn legacy_headers_come_when_asked_for() {
    let g = common::with_settings(strata_gateway::config::Settings {
        legacy_headers: true,
        ..Default::default()
    })
    .await;
    let one = json!({"namespace":"api","identifier":"user-1","limit":3,"duration":60_000});
    let r = g.post("/v1/ratelimit", None, one.clone()).await;
    assert_eq!(r.headers["x-ratelimit-limit"], "3");
    assert_eq!(r.headers["x-ratelimit-remaining"], "2");
    let reset = (T0 - T0 % 60_000 + 60_000) / 1_000;
    assert_eq!(r.headers["x-ratelimit-reset"], reset.to_string().as_str());
    let two = json!({"namespace":"api","identifier":"user-2","limit":10,"duration":60_000});
    let r = g
        .post("/v1/ratelimit/multi", None, json!({"limits": [one, two]}))
        .await;
    assert_eq!(r.body["success"], true);
    assert_eq!(r.headers["x-ratelimit-limit"], "3");
    assert_eq!(r.headers["x-ratelimit-remaining"], "1");
}

async fn cost_defaults_to_one_and_cost_zero_only_checks(g: TestGateway) {
    let body = |cost: Option<u64>| {
        let mut v = json!({"namespace":"api","identifier":"c","limit":5,"duration":1_000});
        if let Some(c) = cost {
            v["cost"] = json!(c);
        }
        v
    };
    assert_eq!(
        g.post("/v1/ratelimit", None, body(None)).await.body["remaining"],
        4
    );
    assert_eq!(
        g.post("/v1/ratelimit", None, body(Some(0))).await.body["remaining"],
        4
    );
    // 4 left, as the check just answered: a request of cost 4 fits exactly.
    let r = g.post("/v1/ratelimit", None, body(Some(4))).await;
    assert_eq!(
        (r.body["success"].clone(), r.body["remaining"].clone()),
        (json!(true), json!(0)),
        "{}",
        r.text
    );
}

async fn multi_is_all_or_nothing(g: TestGateway) {
    let multi = |cost: u64| {
        json!({"limits":[
            {"namespace":"user","identifier":"u1","limit":10,"duration":60_000,"cost":cost},
            {"namespace":"org","identifier":"o1","limit":3,"duration":60_000,"cost":cost}
        ]})
    };
    let r = g.post("/v1/ratelimit/multi", None, multi(2)).await;
    assert_eq!(r.body["success"], true);
    assert_eq!(r.body["results"][0]["remaining"], 8);
    assert_eq!(r.body["results"][1]["remaining"], 1);
    let r = g.post("/v1/ratelimit/multi", None, multi(2)).await;
    assert_eq!(r.body["success"], false);
    assert_eq!(r.body["results"][0]["success"], true);
    assert_eq!(
        r.body["results"][0]["remaining"], 8,
        "the passing limit was not charged"
    );
    assert_eq!(r.body["results"][1]["success"], false);
    assert!(r.headers.contains_key("retry-after"));
    // The user limit still has its 8: a request of cost 1 on both passes.
    assert_eq!(
        g.post("/v1/ratelimit/multi", None, multi(1)).await.body["success"],
        true
    );
}

async fn every_bad_input_gets_its_status_and_the_error_shape(g: TestGateway) {
    let ok_limit = json!({"namespace":"n","identifier":"i","limit":1,"duration":1_000});
    let cases: Vec<(&str, Body, StatusCode, &str)> = vec![
        ("/v1/ratelimit", Body::from("{not json"), StatusCode::BAD_REQUEST, "malformed JSON body"),
        ("/v1/ratelimit", Body::from(r#"{"namespace":"n","limit":1,"duration":1000}"#), StatusCode::BAD_REQUEST, "missing field `identifier`"),
        ("/v1/ratelimit", Body::from(r#"{"namespace":"n","identifier":"i","limit":-1,"duration":1000}"#), StatusCode::BAD_REQUEST, "invalid value"),
        ("/v1/ratelimit", Body::from(r#"{"namespace":"n","identifier":"","limit":1,"duration":1000}"#), StatusCode::BAD_REQUEST, "identifier: identifier must not be empty"),
        ("/v1/ratelimit", Body::from(r#"{"namespace":"n","identifier":"i","limit":1,"duration":10}"#), StatusCode::BAD_REQUEST, "duration: duration must be between"),
        ("/v1/ratelimit", Body::from(vec![b' '; MAX_BODY_BYTES + 1]), StatusCode::PAYLOAD_TOO_LARGE, "request body exceeds"),
        ("/v1/ratelimit/multi", Body::from(json!({"limits": vec![ok_limit.clone(); MAX_MULTI_LIMITS + 1]}).to_string()), StatusCode::PAYLOAD_TOO_LARGE, "limits: 33 entries"),
        ("/v1/ratelimit/multi", Body::from(r#"{"limits":[]}"#), StatusCode::BAD_REQUEST, "limits: needs at least 1"),
        ("/v1/origin/read", Body::from(json!({"cells": vec![json!({"namespace":"n","identifier":"i","duration":1000,"sequence":1}); MAX_BATCH + 1]}).to_string()), StatusCode::PAYLOAD_TOO_LARGE, "cells: 1001 entries"),
        ("/v1/origin/replay", Body::from(r#"{"instance":"e","events":[{"namespace":"n","identifier":"i","duration":1000,"sequence":1,"used":-5,"limit":1}]}"#), StatusCode::BAD_REQUEST, "malformed JSON body"),
        ("/v1/origin/replay", Body::from(r#"{"events":[]}"#), StatusCode::BAD_REQUEST, "missing field `instance`"),
        ("/v1/origin/replay", Body::from(r#"{"instance":"not ok","events":[]}"#), StatusCode::BAD_REQUEST, "instance: must be"),
        ("/v1/origin/replay", Body::from(r#"{"instance":"e","events":[{"namespace":"n","identifier":"i","duration":1000,"sequence":1,"cost":5,"limit":1}]}"#), StatusCode::BAD_REQUEST, "missing field `used`"),
        ("/v1/origin/replay", Body::from(json!({"instance":"e","events":[{"namespace":"n","identifier":"i","duration":1000,"sequence":T0 / 1_000 + 2,"used":1,"limit":1}]}).to_string()), StatusCode::BAD_REQUEST, "events[0].sequence: 1700000002 is more than one window ahead"),
        ("/v1/nope", Body::from("{}"), StatusCode::NOT_FOUND, "no such endpoint"),
    ];
    for (path, body, status, message) in cases {
        let r = g.send("POST", path, None, body).await;
        assert_eq!(r.status, status, "{path}: {}", r.text);
        let got = r.body["error"]["message"].as_str().unwrap_or_default();
        assert!(got.contains(message), "{path}: {got:?} lacks {message:?}");
        assert!(r.body["error"]["code"].is_string());
    }
    let r = g.get("/v1/ratelimit").await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.body["error"]["code"], "method_not_allowed");
    // Nothing above counted anything.
    assert_eq!(g.limit(None, "i", 1).await, (true, 0));
}

async fn tokens_are_required_and_bind_one_workspace(g: TestGateway) {
    let body = json!({"namespace":"api","identifier":"shared-id","limit":2,"duration":60_000});
    let r = g.post("/v1/ratelimit", None, body.clone()).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.body["error"]["code"], "unauthorized");
    // The token is checked before the body is read: garbage or an oversized body from a
    // caller without one is a 401, not a 400 or 413.
    for path in ["/v1/ratelimit", "/v1/origin/replay", "/v1/origin/decide"] {
        for garbage in [
            Body::from("{not json"),
            Body::from(vec![b' '; MAX_BODY_BYTES + 1]),
        ] {
            let r = g.send("POST", path, None, garbage).await;
            assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{path}: {}", r.text);
        }
    }
    assert_eq!(
        g.post("/v1/ratelimit", Some("token-zzzzzzzz"), body.clone())
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );

    // acme exhausts the key; globex, same namespace and identifier, is untouched.
    let (a, b) = (Some("token-aaaaaaaa"), Some("token-bbbbbbbb"));
    assert!(g.limit(a, "shared-id", 2).await.0);
    assert!(g.limit(a, "shared-id", 2).await.0);
    assert!(!g.limit(a, "shared-id", 2).await.0);
    assert_eq!(g.limit(b, "shared-id", 2).await, (true, 1));

    // globex can neither read acme's counters nor move them. (Local passes delivered first,
    // so the origin holds each workspace's whole count.)
    assert!(g.gateway.limiter.replay_once().await);
    let seq = T0 / 60_000;
    let cell = json!({"cells":[{"namespace":"api","identifier":"shared-id","duration":60_000,"sequence":seq}]});
    let replay = json!({"instance":"edge-1","events":[{"namespace":"api","identifier":"shared-id","duration":60_000,"sequence":seq,"used":50,"limit":2}]});
    assert_eq!(
        g.post("/v1/origin/replay", a, replay.clone()).await.body["cells"][0]["regional"],
        52,
        "acme's 2 passes and the edge's 50"
    );
    assert_eq!(
        g.post("/v1/origin/read", b, cell.clone()).await.body["cells"][0]["regional"],
        1,
        "its own cell: its one pass"
    );
    assert_eq!(
        g.post("/v1/origin/replay", b, replay).await.body["cells"][0]["regional"],
        51,
        "its own cell"
    );
    assert_eq!(
        g.post("/v1/origin/read", a, cell).await.body["cells"][0]["regional"],
        52,
        "acme's unchanged"
    );
}

async fn identities_built_to_collide_stay_apart(g: TestGateway) {
    let long = "x".repeat(255);
    let ids = [
        "a:b", "a", "b", "a:b:", ":a:b", "{a}", "}{", "a}:{b", "ü", "u\u{308}", "a b", "%7B", &long,
    ];
    for id in ids {
        assert_eq!(
            g.limit(None, id, 1).await,
            (true, 0),
            "{id:?} was charged by another"
        );
    }
    for id in ids {
        assert!(
            !g.limit(None, id, 1).await.0,
            "{id:?} second request passed"
        );
    }
    // Namespace and identifier cannot trade characters either.
    let r1 = g
        .post(
            "/v1/ratelimit",
            None,
            json!({"namespace":"n:x","identifier":"y","limit":1,"duration":1_000}),
        )
        .await;
    let r2 = g
        .post(
            "/v1/ratelimit",
            None,
            json!({"namespace":"n","identifier":"x:y","limit":1,"duration":1_000}),
        )
        .await;
    assert_eq!(
        (r1.body["success"].clone(), r2.body["success"].clone()),
        (json!(true), json!(true))
    );
}

async fn replay_merges_cumulative_counts_and_answers_in_request_order(g: TestGateway) {
    let ev = |id: &str, used: u64| json!({"namespace":"api","identifier":id,"duration":1_000,"sequence":7,"used":used,"limit":10});
    let replay = |instance: &str, events: Vec<serde_json::Value>| json!({"instance":instance,"events":events});
    // `used` is the instance's cumulative count: merged with max, so a's 1 then 2 is 2.
    let r = g
        .post(
            "/v1/origin/replay",
            None,
            replay("edge-1", vec![ev("a", 1), ev("b", 5), ev("a", 2)]),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(
        r.body["cells"],
        json!([{"regional":1,"global":0},{"regional":5,"global":0},{"regional":2,"global":0}])
    );
    // The answer states the pace the caller may replay its covered cells at.
    let pace = &r.body["pace"];
    assert!(pace["alone"].is_boolean(), "{}", r.text);
    assert!(
        pace["publish_floor_ppm"]
            .as_u64()
            .is_some_and(|ppm| (1..=1_000_000).contains(&ppm)),
        "{}",
        r.text
    );
    // Another instance's count adds to the cell's.
    let r = g
        .post(
            "/v1/origin/replay",
            None,
            replay("edge-2", vec![ev("a", 3)]),
        )
        .await;
    assert_eq!(r.body["cells"][0]["regional"], 5);
    let cell = |id: &str, seq: u64| json!({"namespace":"api","identifier":id,"duration":1_000,"sequence":seq});
    let r = g
        .post(
            "/v1/origin/read",
            None,
            json!({"cells":[cell("b",7), cell("a",7), cell("a",8)]}),
        )
        .await;
    assert_eq!(r.body["cells"][0]["regional"], 5);
    assert_eq!(r.body["cells"][1]["regional"], 5);
    assert_eq!(r.body["cells"][2]["regional"], 0);
    let empty = g.post("/v1/origin/read", None, json!({"cells":[]})).await;
    assert_eq!(empty.body, json!({"cells":[]}));
    let none = g
        .post("/v1/origin/replay", None, replay("edge-1", vec![]))
        .await;
    assert_eq!(none.body["cells"], json!([]));
}

/// A replay that timed out after the origin applied it is sent again: it counts once.
async fn the_same_replay_posted_twice_counts_once(g: TestGateway) {
    let seq = T0 / 60_000;
    let body = json!({"instance":"edge-1","events":[
        {"namespace":"api","identifier":"twice","duration":60_000,"sequence":seq,"used":4,"limit":10},
        {"namespace":"api","identifier":"other","duration":60_000,"sequence":seq,"used":1,"limit":10}]});
    let first = g.post("/v1/origin/replay", None, body.clone()).await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.text);
    assert_eq!(first.body["cells"][0]["regional"], 4);
    let again = g.post("/v1/origin/replay", None, body).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text);
    assert_eq!(again.body, first.body, "the count did not change");
    let read = g
        .post(
            "/v1/origin/read",
            None,
            json!({"cells":[{"namespace":"api","identifier":"twice","duration":60_000,"sequence":seq}]}),
        )
        .await;
    assert_eq!(read.body["cells"][0]["regional"], 4);
    // And decisions see 4 of 10 used: 6 left, less this request.
    assert_eq!(g.limit(None, "twice", 10).await, (true, 5));
}

async fn a_warm_key_is_decided_locally_under_its_lease(g: TestGateway) {
    let fresh_for = g.gateway.settings.fresh_for.as_millis() as u64;
    let requests = 50;
    for _ in 0..requests {
        assert!(g.limit(None, "far-from-limit", 1_000).await.0);
        g.clock.advance(50); // 2.5 s in all: within the lease lifetime
    }
    assert!(requests * 50 < fresh_for);
    let m = &g.gateway.limiter.metrics;
    let at_origin = m.decisions(Source::Origin);
    // Cold: the first passed ahead with no call (the replay delivers it); the second, before
    // that replay, waited for the decision that lends the lease.
    assert_eq!(m.decisions(Source::Ahead), 1, "cold: passed ahead");
    assert_eq!(m.origin_calls("read"), 0, "decisions never read");
    assert_eq!(m.origin_calls("decide"), at_origin);
    assert_eq!(m.origin_reasons(Reason::Cold), 1);
    assert_eq!(
        m.origin_reasons(Reason::Lease),
        at_origin - 1,
        "only when a lease ran out"
    );
    // A lease at least twice the last each time: at most log2(50) + 1 decisions.
    assert!((1..=6).contains(&at_origin), "{at_origin}");
    assert_eq!(m.decisions(Source::Local), requests - at_origin - 1);
    // Once the lease expired, the next request asks the origin again.
    g.clock.advance(fresh_for);
    assert!(g.limit(None, "far-from-limit", 1_000).await.0);
    assert_eq!(m.origin_reasons(Reason::Stale), 1);
    assert_eq!(m.decisions(Source::Origin), at_origin + 1);
}

/// A key in steady use keeps its lease: the replay renews it from half its lifetime on, so no
/// request waits on the origin for it after the first (an idle key's lease still expires).
async fn a_lease_in_use_is_renewed_by_the_replay_not_by_a_request(g: TestGateway) {
    let fresh_for = g.gateway.settings.fresh_for.as_millis() as u64;
    let m = &g.gateway.limiter.metrics;
    // The first passes ahead; the second, before the replay, waits for the lease.
    assert!(g.limit(None, "steady", 1_000_000).await.0);
    assert!(g.limit(None, "steady", 1_000_000).await.0);
    assert_eq!(
        (m.decisions(Source::Ahead), m.decisions(Source::Origin)),
        (1, 1),
        "cold: passed ahead, then the lease"
    );
    // Four lease lifetimes, a request and a replay pass every 100 ms.
    let steps = 4 * fresh_for / 100;
    for step in 0..steps {
        g.clock.advance(100);
        assert!(g.limit(None, "steady", 1_000_000).await.0, "step {step}");
        assert!(g.gateway.limiter.replay_once().await, "step {step}: replay");
    }
    assert_eq!(
        m.decisions(Source::Origin),
        1,
        "every request after the first two decided locally"
    );
    assert_eq!(m.origin_reasons(Reason::Stale), 0);
    let renewals = common::metric_sum(&g.get("/metrics").await.text, |l| {
        l.starts_with("strata_lease_renewals_total")
    });
    assert!(
        (4.0..=steps as f64).contains(&renewals),
        "{renewals} renewals over {steps} replay passes"
    );
    // Idle for a lifetime: the lease is not renewed, and the next request asks again.
    for _ in 0..(fresh_for / 100 + 1) {
        g.clock.advance(100);
        assert!(g.gateway.limiter.replay_once().await);
    }
    let calls = m.origin_calls("decide");
    assert!(g.limit(None, "steady", 1_000_000).await.0);
    // An idle key's lease ran out (or went back idle): the next request passes ahead (far
    // from the limit, every own pass acknowledged), and the replay delivers it.
    assert_eq!(m.decisions(Source::Ahead), 2, "an idle key's lease ran out");
    assert_eq!(m.decisions(Source::Origin), 1);
    assert_eq!(m.origin_calls("decide"), calls, "no decision call");
    let replayed = m.origin_calls("replay");
    assert!(g.gateway.limiter.replay_once().await);
    assert_eq!(
        m.origin_calls("replay"),
        replayed + 1,
        "the replay carried it"
    );
}

/// The replay loop's pacing, with another region live: keys far under the publish floor,
/// their cost under a live lease, reach the origin on one pass in ten (each once, on its own
/// turn); a key over the floor on every pass; nothing is lost: a full replay afterwards leaves
/// the origin holding every pass. (Alone, the floor holds nothing back: see
/// `shared/tests/it/table.rs`.)
async fn a_quiet_key_waits_for_its_turn_and_a_key_over_the_floor_goes_every_pass(g: TestGateway) {
    let global = &g.gateway.limiter.global;
    // Alone only once two announcements in a row found no other region.
    assert!(!global.alone());
    assert_eq!(global.announce(T0, 30_000).await.unwrap(), 1);
    assert!(
        !global.alone(),
        "another may have started and not announced yet"
    );
    global.announce(T0 + 1, 30_000).await.unwrap();
    assert!(global.alone());
    let other = strata_core::Region::new("elsewhere").unwrap();
    global.store.announce(&other, T0 + 2, 0).await.unwrap();
    assert_eq!(global.announce(T0 + 2, 30_000).await.unwrap(), 2);
    assert!(!global.alone());
    let quiet: Vec<String> = (0..5).map(|i| format!("quiet-{i}")).collect();
    // 20% of 100 is the floor: 25 passes put "busy" over it.
    for _ in 0..25 {
        assert!(g.limit(None, "busy", 100).await.0);
    }
    // Two requests each: the first passes ahead, the second is decided at the origin, which
    // lends the lease.
    for id in &quiet {
        for _ in 0..2 {
            assert!(g.limit(None, id, 1_000_000).await.0);
        }
    }
    assert!(g.gateway.limiter.replay_once().await);
    let cells = async || {
        common::metric_sum(&g.get("/metrics").await.text, |l| {
            l.starts_with("strata_replay_cells_total")
        })
    };
    let before = cells().await;
    let seq = T0 / 60_000;
    let read = |id: &str| json!({"cells":[{"namespace":"api","identifier":id,"duration":60_000,"sequence":seq}]});
    let mut waited = 0;
    // Passes every 100 ms; no flush interval: a cell over the floor is not held for the flush.
    let limiter = &g.gateway.limiter;
    let mut pump = strata_gateway::limiter::ReplayPump::new(limiter, 100, 0);
    for pass in 1..=10_u32 {
        g.clock.advance(100);
        assert!(g.limit(None, "busy", 100).await.0);
        for id in &quiet {
            assert!(g.limit(None, id, 1_000_000).await.0);
        }
        let tick = pump.pass(limiter).await;
        assert!(tick.failed == 0 && tick.batches == 1, "{tick:?}");
        let busy = g.post("/v1/origin/read", None, read("busy")).await;
        assert_eq!(
            busy.body["cells"][0]["regional"],
            25 + pass,
            "pass {pass}: over the floor, replayed every pass"
        );
        for id in &quiet {
            let n = g.post("/v1/origin/read", None, read(id)).await.body["cells"][0]["regional"]
                .as_u64()
                .unwrap();
            waited += u64::from(n < 2 + u64::from(pass));
        }
    }
    // Ten passes of "busy", and each quiet key once in the ten.
    assert_eq!(cells().await - before, 10.0 + quiet.len() as f64);
    assert!(waited > 0, "some quiet key's cost waited for its turn");
    assert!(g.gateway.limiter.replay_once().await);
    for id in &quiet {
        let r = g.post("/v1/origin/read", None, read(id)).await;
        assert_eq!(
            r.body["cells"][0]["regional"], 12,
            "{id}: every pass counted"
        );
    }
}

/// A replay pass over many cells goes in batches of at most `REPLAY_STEP` cells, every cell
/// once, and other tasks run between two batches: on the embedded origin nothing in a batch
/// waits, so without the yield a pass would hold the worker for all of them.
async fn a_replay_pass_yields_to_requests_between_batches(g: TestGateway) {
    use strata_gateway::limiter::REPLAY_STEP;
    // The first request of a key passes ahead, the second is decided at the origin (which
    // lends the lease), the third passes locally under it: one cell of unreplayed cost per
    // key.
    let keys = 3 * REPLAY_STEP + 10;
    for i in 0..keys {
        for _ in 0..3 {
            assert!(g.limit(None, &format!("k{i}"), 1_000_000).await.0);
        }
    }
    assert_eq!(g.gateway.limiter.unreplayed(), keys);
    // Passes a second apart: every cell's turn comes on every pass (`QuietPace`).
    let limiter = &g.gateway.limiter;
    let mut pump = strata_gateway::limiter::ReplayPump::new(limiter, 1_000, 0);
    g.clock.advance(1_000);
    let (tick, during) = polled_during(pump.pass(limiter)).await;
    assert_eq!(tick.failed, 0, "{tick:?}");
    assert_eq!(tick.cells, keys, "every cell once: {tick:?}");
    assert!(
        tick.batches >= keys.div_ceil(REPLAY_STEP),
        "batches of at most {REPLAY_STEP}: {tick:?}"
    );
    assert!(
        during >= tick.batches - 1,
        "the other task ran {during} times in {} batches",
        tick.batches
    );
    assert_eq!(g.gateway.limiter.unreplayed(), 0);
    let m = g.get("/metrics").await.text;
    assert!(m.contains("strata_replay_pass_seconds_count 1"), "{m}");
}

/// Runs `work` beside a task that counts the times it is polled, on the test's one worker:
/// what `work` returns, and how often the other task ran meanwhile (only when `work` yields).
async fn polled_during<T>(work: impl std::future::Future<Output = T>) -> (T, usize) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let polls = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = polls.clone();
    let other = tokio::spawn(async move {
        loop {
            counter.fetch_add(1, Ordering::Relaxed);
            tokio::task::yield_now().await;
        }
    });
    tokio::task::yield_now().await;
    let before = polls.load(Ordering::Relaxed);
    let out = work.await;
    let during = polls.load(Ordering::Relaxed) - before;
    other.abort();
    (out, during)
}

/// A janitor pass drops what expired from the local tables and the embedded origin, in steps
/// (a shard at a time, the origin's subtables a bounded run of buckets at a time), and other tasks
/// run between two: at a million keys one sweep of everything held a worker for tens of
/// milliseconds.
#[tokio::test]
async fn a_janitor_pass_drops_what_expired_in_steps_that_yield() {
    use strata_core::table::LimitRequest;
    let g = gateway(Backend::Memory, &[]).await;
    let limiter = &g.gateway.limiter;
    // Each cold key is decided at the origin (a limit under the share that passes ahead),
    // which keeps two cells for it (its window's and the one before).
    let keys = 2_000;
    let ids: Vec<String> = (0..keys).map(|i| format!("j{i}")).collect();
    for id in &ids {
        let key = strata_core::WindowKeyRef::new(
            "default",
            "api",
            id,
            strata_core::WindowDuration::from_ms(60_000).unwrap(),
        )
        .unwrap();
        let d = limiter
            .decide(LimitRequest {
                key,
                limit: strata_core::policy::AHEAD_LIMIT_PER_COST - 1,
                cost: 1,
            })
            .await;
        assert!(d.success);
    }
    assert!(limiter.replay_once().await);
    let live = limiter.janitor_pass().await;
    assert_eq!(
        (live.local, live.origin),
        (0, 0),
        "nothing expired yet: {live:?}"
    );
    // Past every cell's expiry: the origin's three windows, the tables' two.
    g.clock.advance(4 * 60_000);
    let (purged, during) = polled_during(limiter.janitor_pass()).await;
    assert_eq!(purged.local, keys, "{purged:?}");
    assert_eq!(purged.origin, 2 * keys, "{purged:?}");
    let shards = limiter.local.shard_count();
    assert!(
        purged.steps >= shards + 3,
        "a step per shard, one or more per subtable of the origin, one for the view: {purged:?}"
    );
    assert!(
        during >= purged.steps - 1,
        "the other task ran {during} times in {} steps",
        purged.steps
    );
    assert_eq!(limiter.janitor_pass().await.origin, 0, "all gone");
}

async fn health_readiness_and_metrics_answer(g: TestGateway) {
    assert_eq!(g.get("/healthz").await.body["status"], "ok");
    let ready = g.get("/readyz").await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.body["origin"], g.gateway.limiter.origin.kind());
    // Limit 1: the cold request passes at the origin (with no lease: nothing is left), the
    // next is denied from local memory.
    g.limit(None, "m", 1).await;
    g.limit(None, "m", 1).await;
    // Limit 1,000: the cold request passes ahead, with no call; the second, before the
    // replay delivered the first, is decided at the origin, which lends the lease; the third
    // passes locally under it. Its own passes (the first and the third) wait for the replay.
    g.limit(None, "q", 1_000).await;
    g.limit(None, "q", 1_000).await;
    g.limit(None, "q", 1_000).await;
    let m = g.get("/metrics").await;
    assert_eq!(m.status, StatusCode::OK);
    assert!(
        m.text
            .contains("strata_decisions_total{source=\"origin\",outcome=\"allowed\"} 2"),
        "{}",
        m.text
    );
    assert!(
        m.text
            .contains("strata_decisions_total{source=\"ahead\",outcome=\"allowed\"} 1"),
        "{}",
        m.text
    );
    assert!(
        m.text
            .contains("strata_decisions_total{source=\"local\",outcome=\"denied\"} 1"),
        "{}",
        m.text
    );
    assert!(
        m.text
            .contains("strata_decisions_total{source=\"local\",outcome=\"allowed\"} 1"),
        "{}",
        m.text
    );
    assert!(
        m.text
            .contains("strata_origin_reasons_total{reason=\"cold\"} 2")
    );
    assert!(m.text.contains("strata_lease_size_count 2"));
    assert!(m.text.contains("strata_replay_queue_cells 1"), "{}", m.text);
    assert!(m.text.contains("strata_replay_cells_total 0"));
    assert!(m.text.contains("strata_origin_up 1"));
    assert!(g.gateway.limiter.replay_once().await);
    let m = g.get("/metrics").await;
    assert!(m.text.contains("strata_replay_queue_cells 0"), "{}", m.text);
    assert!(m.text.contains("strata_replay_cells_total 1"));
}

async fn origin_decide_is_atomic_all_or_nothing_and_counts_used(g: TestGateway) {
    let lease_ms = g.gateway.settings.fresh_for.as_millis() as u64;
    let limit = |id: &str, limit: u64, cost: u64| json!({"namespace":"api","identifier":id,"limit":limit,"duration":60_000,"cost":cost});
    let decide = |limits: Vec<serde_json::Value>| json!({"instance":"edge-7f3a","limits":limits});
    let r = g
        .post("/v1/origin/decide", None, decide(vec![limit("d", 3, 2)]))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["success"], true);
    assert_eq!(r.body["sequence"], T0 / 60_000);
    let first = &r.body["results"][0];
    assert_eq!(first["success"], true);
    assert_eq!(first["remaining"], 1);
    assert_eq!(first["current"]["regional"], 2, "counted at the origin");
    assert_eq!(first["previous"]["regional"], 0);
    assert_eq!(
        first["used"], 0,
        "a pass decided there is no local pass of the caller's"
    );
    assert_eq!(first["lease"], 0, "none asked for");
    assert_eq!(first["lease_ms"], lease_ms);

    // Denied: nothing counted.
    let r = g
        .post("/v1/origin/decide", None, decide(vec![limit("d", 3, 2)]))
        .await;
    assert_eq!(r.body["success"], false);
    assert_eq!(r.body["results"][0]["success"], false);
    assert_eq!(r.body["results"][0]["current"]["regional"], 2);

    // All or nothing: the second limit denies, so the first is not counted either.
    let r = g
        .post(
            "/v1/origin/decide",
            None,
            decide(vec![limit("e", 10, 1), limit("d", 3, 2)]),
        )
        .await;
    assert_eq!(r.body["success"], false);
    assert_eq!(r.body["results"][0]["success"], true);
    assert_eq!(
        r.body["results"][0]["current"]["regional"], 0,
        "rolled back"
    );
    assert_eq!(r.body["results"][0]["remaining"], 10);

    // `used` is the caller's cumulative local count, not replayed yet: merged into the count
    // before deciding. 2 decided + 1 used + 1 > 3.
    let mut with_used = limit("d", 3, 1);
    with_used["used"] = json!(1);
    let r = g
        .post("/v1/origin/decide", None, decide(vec![with_used.clone()]))
        .await;
    assert_eq!(r.body["success"], false, "{}", r.text);
    assert_eq!(r.body["results"][0]["current"]["regional"], 3);
    assert_eq!(r.body["results"][0]["used"], 1);
    // Reported again, it counts once: a cost-0 check still fits.
    let mut check = with_used;
    check["cost"] = json!(0);
    let r = g.post("/v1/origin/decide", None, decide(vec![check])).await;
    assert_eq!(r.body["success"], true, "{}", r.text);
    assert_eq!(r.body["results"][0]["current"]["regional"], 3);
    assert_eq!(r.body["results"][0]["remaining"], 0);

    // Validation like every other endpoint.
    let bad = json!({"instance":"not ok","limits":[limit("d", 3, 1)]});
    assert_eq!(
        g.post("/v1/origin/decide", None, bad).await.status,
        StatusCode::BAD_REQUEST
    );
    let many = decide(vec![limit("d", 3, 1); MAX_MULTI_LIMITS + 1]);
    assert_eq!(
        g.post("/v1/origin/decide", None, many).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    let none = decide(vec![]);
    assert_eq!(
        g.post("/v1/origin/decide", None, none).await.status,
        StatusCode::BAD_REQUEST
    );
}

async fn origin_decide_leases_far_from_the_limit_and_not_at_the_last_unit(g: TestGateway) {
    let lease_ms = g.gateway.settings.fresh_for.as_millis() as u64;
    let decide = |instance: &str, id: &str, limit: u64, cost: u64, want: u64, used: u64| {
        json!({"instance":instance,"limits":[{"namespace":"api","identifier":id,"limit":limit,
            "duration":60_000,"cost":cost,"want":want,"used":used}]})
    };
    // Far from the limit, the lease asked for is granted, for the lease lifetime.
    let r = g
        .post(
            "/v1/origin/decide",
            None,
            decide("edge-a", "far", 1_000, 1, 10, 0),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let far = &r.body["results"][0];
    assert_eq!(far["success"], true);
    let lease = far["lease"].as_u64().unwrap();
    assert_eq!(lease, 10, "{}", r.text);
    assert_eq!(far["lease_ms"], lease_ms);
    assert_eq!(far["used"], 0);
    let lease_id = far["lease_id"].as_u64().unwrap();
    assert!(lease_id > 0, "a lease has an id: {}", r.text);
    // A live lease counts as used for everyone else: another edge has the limit less the first
    // pass, the lease and its own cost.
    let r = g
        .post(
            "/v1/origin/decide",
            None,
            decide("edge-b", "far", 1_000, 1, 0, 0),
        )
        .await;
    assert_eq!(r.body["results"][0]["remaining"], 1_000 - 1 - lease - 1);
    // The holder reports its lease used up: the local passes are counted, and no longer
    // reserved on top.
    let r = g
        .post(
            "/v1/origin/decide",
            None,
            decide("edge-a", "far", 1_000, 1, 0, lease),
        )
        .await;
    let used = &r.body["results"][0];
    assert_eq!(used["success"], true);
    assert_eq!(used["used"], lease);
    assert_eq!(used["current"]["regional"], 1 + 1 + lease + 1);
    assert_eq!(used["remaining"], 1_000 - (1 + 1 + lease + 1));

    // A lease given back with the replay stops being reserved; an id naming an older grant
    // gives nothing back.
    let r = g
        .post(
            "/v1/origin/decide",
            None,
            decide("edge-c", "back", 1_000, 1, 10, 0),
        )
        .await;
    let (held, id) = (
        r.body["results"][0]["lease"].as_u64().unwrap(),
        r.body["results"][0]["lease_id"].as_u64().unwrap(),
    );
    assert!(held > 0 && id > 0, "{}", r.text);
    let left = async |g: &TestGateway| {
        let r = g
            .post(
                "/v1/origin/decide",
                None,
                decide("edge-d", "back", 1_000, 0, 0, 0),
            )
            .await;
        r.body["results"][0]["remaining"].as_u64().unwrap()
    };
    assert_eq!(left(&g).await, 1_000 - 1 - held);
    let replay = |release: u64| {
        json!({"instance":"edge-c","events":[{"namespace":"api","identifier":"back",
            "duration":60_000,"sequence":T0 / 60_000,"used":0,"limit":1_000,"release":release}]})
    };
    let r = g.post("/v1/origin/replay", None, replay(id - 1)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(
        left(&g).await,
        1_000 - 1 - held,
        "an older id releases nothing"
    );
    g.post("/v1/origin/replay", None, replay(id)).await;
    assert_eq!(left(&g).await, 1_000 - 1, "given back");

    // At the last unit: it passes, and nothing is left to lease.
    let r = g
        .post(
            "/v1/origin/decide",
            None,
            decide("edge-a", "last", 5, 4, 0, 0),
        )
        .await;
    assert_eq!(r.body["results"][0]["remaining"], 1);
    let r = g
        .post(
            "/v1/origin/decide",
            None,
            decide("edge-b", "last", 5, 1, 10, 0),
        )
        .await;
    let last = &r.body["results"][0];
    assert_eq!(last["success"], true, "{}", r.text);
    assert_eq!(last["remaining"], 0);
    assert_eq!(last["lease"], 0);
    assert_eq!(last["lease_id"], 0);
}

/// Passes ahead on keys far from their limit wait for their turn, one pass in ten, and the
/// turns of the gateway's shards are spread over the passes: with two keys a shard, every
/// shard's first slots took their turns on the same two passes (a third of the keys or more
/// on one pass, none on the others), which made each of those passes a burst for the origin.
#[tokio::test]
async fn passes_ahead_on_every_shard_take_their_turns_spread_over_the_passes() {
    let g = common::embedded(&[]).await;
    let limiter = &g.gateway.limiter;
    let keys: Vec<String> = (0..2 * limiter.local.shard_count())
        .map(|i| format!("spread-{i}"))
        .collect();
    // The first pass ahead on a cold key goes with the next replay; the second waits its turn.
    for id in &keys {
        assert!(g.limit(None, id, 1_000_000).await.0);
    }
    assert!(limiter.replay_once().await);
    for id in &keys {
        assert!(g.limit(None, id, 1_000_000).await.0);
    }
    let seq = T0 / 60_000;
    let counted = async |id: &str| {
        let read =
            json!({"cells":[{"namespace":"api","identifier":id,"duration":60_000,"sequence":seq}]});
        g.post("/v1/origin/read", None, read).await.body["cells"][0]["regional"]
            .as_u64()
            .unwrap()
    };
    let mut pump = strata_gateway::limiter::ReplayPump::new(limiter, 100, 0);
    let (mut per_pass, mut gone) = (Vec::new(), 0);
    for _ in 0..10 {
        g.clock.advance(100);
        assert_eq!(pump.pass(limiter).await.failed, 0);
        let mut now_gone = 0;
        for id in &keys {
            now_gone += usize::from(counted(id).await == 2);
        }
        per_pass.push(now_gone - gone);
        gone = now_gone;
    }
    println!("passes ahead of {} keys by pass: {per_pass:?}", keys.len());
    assert_eq!(
        gone,
        keys.len(),
        "every pass reached the origin: {per_pass:?}"
    );
    assert!(
        per_pass.iter().all(|&n| n * 3 <= keys.len()),
        "passes ahead of {} keys by pass: {per_pass:?}",
        keys.len()
    );
}
