//! The API contract of DESIGN section 4 against the embedded origin: every endpoint, every
//! error status, auth and workspace isolation, and identities built to collide.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation
)] // test code: a panic is the failure report

mod common;

use axum::body::Body;
use axum::http::StatusCode;
use common::{Backend, T0, TestGateway, gateway};
use serde_json::json;
use strata_core::wire::{MAX_BATCH, MAX_BODY_BYTES, MAX_MULTI_LIMITS};
use strata_gateway::metrics::Source;

/// Runs each case against the embedded origin and against a private Redis.
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
        }
    )*};
}

on_every_origin! {
    origin_decide_is_atomic_all_or_nothing_and_counts_unseen(&[]),
    ratelimit_counts_then_denies_with_headers(&[]),
    cost_defaults_to_one_and_cost_zero_only_checks(&[]),
    multi_is_all_or_nothing(&[]),
    every_bad_input_gets_its_status_and_the_error_shape(&[]),
    tokens_are_required_and_bind_one_workspace(&[("token-aaaaaaaa", "acme"), ("token-bbbbbbbb", "globex")]),
    identities_built_to_collide_stay_apart(&[]),
    replay_sums_events_per_cell_and_answers_in_request_order(&[]),
    a_warm_key_is_decided_locally_after_one_cold_read(&[]),
    health_readiness_and_metrics_answer(&[]),
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
    assert_eq!(
        g.post("/v1/ratelimit", None, body(Some(4))).await.body["remaining"],
        0
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
        ("/v1/origin/replay", Body::from(r#"{"events":[{"namespace":"n","identifier":"i","duration":1000,"sequence":1,"cost":-5,"limit":1}]}"#), StatusCode::BAD_REQUEST, "malformed JSON body"),
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

    // globex can neither read acme's counters nor move them.
    let seq = T0 / 60_000;
    let cell = json!({"cells":[{"namespace":"api","identifier":"shared-id","duration":60_000,"sequence":seq}]});
    let replay = json!({"events":[{"namespace":"api","identifier":"shared-id","duration":60_000,"sequence":seq,"cost":50,"limit":2}]});
    assert_eq!(
        g.post("/v1/origin/replay", a, replay.clone()).await.body["cells"][0]["regional"],
        50
    );
    assert_eq!(
        g.post("/v1/origin/read", b, cell.clone()).await.body["cells"][0]["regional"],
        0
    );
    assert_eq!(
        g.post("/v1/origin/replay", b, replay).await.body["cells"][0]["regional"],
        50,
        "its own cell"
    );
    assert_eq!(
        g.post("/v1/origin/read", a, cell).await.body["cells"][0]["regional"],
        50,
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

async fn replay_sums_events_per_cell_and_answers_in_request_order(g: TestGateway) {
    let ev = |id: &str, cost: u64| json!({"namespace":"api","identifier":id,"duration":1_000,"sequence":7,"cost":cost,"limit":10});
    let r = g
        .post(
            "/v1/origin/replay",
            None,
            json!({"events":[ev("a",1), ev("b",5), ev("a",2)]}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(
        r.body,
        json!({"cells":[{"regional":3,"global":0},{"regional":5,"global":0},{"regional":3,"global":0}]})
    );
    let cell = |id: &str, seq: u64| json!({"namespace":"api","identifier":id,"duration":1_000,"sequence":seq});
    let r = g
        .post(
            "/v1/origin/read",
            None,
            json!({"cells":[cell("b",7), cell("a",7), cell("a",8)]}),
        )
        .await;
    assert_eq!(r.body["cells"][0]["regional"], 5);
    assert_eq!(r.body["cells"][1]["regional"], 3);
    assert_eq!(r.body["cells"][2]["regional"], 0);
    let empty = g.post("/v1/origin/read", None, json!({"cells":[]})).await;
    assert_eq!(empty.body, json!({"cells":[]}));
}

async fn a_warm_key_is_decided_locally_after_one_cold_read(g: TestGateway) {
    for _ in 0..50 {
        assert!(g.limit(None, "far-from-limit", 1_000).await.0);
        g.clock.advance(50); // 2.5 s in all: within the 5 s freshness
    }
    let m = &g.gateway.limiter.metrics;
    assert_eq!(m.origin_calls("read"), 1, "only the cold read");
    assert_eq!(m.decisions(Source::Origin), 1);
    assert_eq!(m.decisions(Source::Local), 49);
}

async fn health_readiness_and_metrics_answer(g: TestGateway) {
    assert_eq!(g.get("/healthz").await.body["status"], "ok");
    let ready = g.get("/readyz").await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.body["origin"], g.gateway.limiter.origin.kind());
    g.limit(None, "m", 1).await;
    g.limit(None, "m", 1).await;
    let m = g.get("/metrics").await;
    assert_eq!(m.status, StatusCode::OK);
    assert!(
        m.text
            .contains("strata_decisions_total{source=\"origin\",outcome=\"allowed\"} 1"),
        "{}",
        m.text
    );
    assert!(
        m.text
            .contains("strata_decisions_total{source=\"local\",outcome=\"denied\"} 1"),
        "{}",
        m.text
    );
    assert!(m.text.contains("strata_replay_queue_cells 1"));
    assert!(m.text.contains("strata_origin_up 1"));
}

async fn origin_decide_is_atomic_all_or_nothing_and_counts_unseen(g: TestGateway) {
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
    assert!(first["peers"].as_u64().unwrap() >= 1);

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

    // `unseen` counts as used: 2 held + 1 unseen + 1 > 3.
    let mut with_unseen = limit("d", 3, 1);
    with_unseen["unseen"] = json!(1);
    let r = g
        .post("/v1/origin/decide", None, decide(vec![with_unseen]))
        .await;
    assert_eq!(r.body["success"], false);
    let r = g
        .post("/v1/origin/decide", None, decide(vec![limit("d", 3, 1)]))
        .await;
    assert_eq!(r.body["success"], true, "without it, the last unit fits");

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
