//! The edge module compiled to `wasm32-unknown-unknown` and run under Node by
//! `wasm-bindgen-test-runner`: rule matching, header values, failure modes and replay
//! batching, through the same exported functions `worker.mjs` calls, with the gateway's answers
//! written by hand.
//!
//!     CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner \
//!       cargo test -p strata-wasm-tests --target wasm32-unknown-unknown

#![cfg(target_arch = "wasm32")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use serde_json::{Value, json};
use strata_edge::{Edge, EdgeReply, EdgeRequest};
use wasm_bindgen::JsValue;
use wasm_bindgen_test::wasm_bindgen_test;

const NOW: f64 = 1_700_000_030_000.0; // 50 s into a minute
const MINUTE: u64 = 60_000;

fn rules(limit: u64) -> String {
    json!({"rules": [
        {"name": "per-ip", "namespace": "api", "limit": limit, "duration": "1m",
         "match": {"path_prefix": "/api/"},
         "actions": [{"remote_address": {}}]},
        {"name": "trial", "namespace": "trial", "limit": 1, "duration": "1m", "shadow": true,
         "actions": [{"generic_key": {"descriptor_value": "all"}}]}
    ]})
    .to_string()
}

fn edge(limit: u64, options: &str) -> Edge {
    Edge::new(&rules(limit), options, "test").unwrap()
}

/// A request from `ip` as workerd reports the connection (`request.cf.clientIp`, with port);
/// the X-Forwarded-For a client wrote is not the address.
fn start(edge: &mut Edge, path: &str, ip: &str) -> EdgeRequest {
    edge.start(
        "GET",
        &format!("https://example.com{path}"),
        "x-forwarded-for\n6.6.6.6\n",
        Some(format!("{ip}:50123")),
        NOW,
    )
    .map_err(JsValue::from)
    .unwrap()
}

/// The gateway's answer to a call: every limit passes with `lease` to spend locally.
fn granted(body: &str, lease: u64) -> String {
    let call: Value = serde_json::from_str(body).unwrap();
    let sequence = 1_700_000_030_000 / MINUTE;
    let results: Vec<Value> = call["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            let limit = l["limit"].as_u64().unwrap();
            json!({"success": true, "limit": limit, "remaining": limit - 1,
                "reset": (sequence + 1) * MINUTE, "sequence": sequence,
                "current": {"regional": 1, "global": 0}, "previous": {"regional": 0, "global": 0},
                "used": 0, "lease": lease, "lease_id": 7, "lease_ms": 5_000})
        })
        .collect();
    json!({"success": true, "sequence": sequence, "results": results}).to_string()
}

fn header<'a>(reply: &'a EdgeReply, name: &str) -> Option<&'a str> {
    let lines: Vec<&str> = reply.headers.split('\n').collect();
    lines.chunks_exact(2).find(|h| h[0] == name).map(|h| h[1])
}

#[wasm_bindgen_test]
fn a_matching_request_calls_the_gateway_once_per_group_and_its_answer_decides() {
    let mut e = edge(10, "");
    let mut r = start(&mut e, "/api/users", "203.0.113.9");
    let body = e.call_body(&r, 0).expect("a cold key goes to the gateway");
    let call: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        call["limits"][0]["identifier"],
        "remote_address=203.0.113.9"
    );
    assert_eq!(
        call["limits"][0]["want"], 10,
        "a new key asks for the whole limit"
    );
    assert!(call["instance"].as_str().unwrap().starts_with("test-"));
    let shadow = e.call_body(&r, 1).expect("the shadow rule is its own call");
    assert!(e.answer(&mut r, 0, 200, &granted(&body, 5), NOW));
    assert!(e.answer(&mut r, 1, 200, &granted(&shadow, 0), NOW));
    let reply = e.reply(&r, NOW);
    assert!(reply.allowed);
    assert_eq!(
        header(&reply, "ratelimit-policy"),
        Some("\"per-ip\";q=10;w=60")
    );
    assert_eq!(header(&reply, "ratelimit"), Some("\"per-ip\";r=9;t=10"));
    assert!(
        header(&reply, "strata-shadow")
            .unwrap()
            .starts_with("\"trial\";")
    );

    // The lease decides the next requests from memory: no call.
    let r = start(&mut e, "/api/users", "203.0.113.9");
    assert!(e.call_body(&r, 0).is_none());
    assert!(e.reply(&r, NOW).allowed);
}

#[wasm_bindgen_test]
fn a_request_no_rule_matches_passes_without_headers_or_calls() {
    let mut e = edge(10, r#"{"headers_on_pass": true}"#);
    let rules_without_shadow = json!({"rules": [{"namespace": "api", "limit": 1, "duration": 60_000,
        "match": {"methods": ["POST"]}, "actions": [{"remote_address": {}}]}]});
    let mut only_posts = Edge::new(&rules_without_shadow.to_string(), "", "t").unwrap();
    let r = start(&mut only_posts, "/api/x", "198.51.100.1");
    assert!(only_posts.call_body(&r, 0).is_none() && only_posts.call_body(&r, 1).is_none());
    let reply = only_posts.reply(&r, NOW);
    assert!(reply.allowed && reply.headers.is_empty());
    // /health is outside the per-ip rule's path prefix: only the shadow rule applies.
    let r = start(&mut e, "/health", "198.51.100.1");
    assert!(e.call_body(&r, 0).is_none());
    assert!(e.call_body(&r, 1).is_some());
}

#[wasm_bindgen_test]
fn failure_modes_decide_when_the_gateway_cannot() {
    for (mode, allowed) in [("local", true), ("allow", true), ("deny", false)] {
        let mut e = edge(
            10,
            &format!(r#"{{"failure_mode": "{mode}", "debug": true}}"#),
        );
        let mut r = start(&mut e, "/api/a", "192.0.2.1");
        e.fail(&mut r, 0, NOW);
        e.fail(&mut r, 1, NOW);
        assert!(r.origin_failed());
        let reply = e.reply(&r, NOW);
        assert_eq!(reply.allowed, allowed, "{mode}");
        assert_eq!(reply.status, if allowed { 200 } else { 429 }, "{mode}");
        assert_eq!(header(&reply, "strata-origin"), Some("unavailable"));
        // The same key moments later: no call (the origin failed within the retry delay),
        // decided by the same mode.
        let again = start(&mut e, "/api/a", "192.0.2.1");
        assert!(e.call_body(&again, 0).is_none() && e.call_body(&again, 1).is_none());
        assert!(again.origin_failed(), "{mode}");
        assert_eq!(e.reply(&again, NOW).allowed, allowed, "{mode}");
    }
    // An error status or a body that is not a decision is a failure too.
    let mut e = edge(10, r#"{"failure_mode": "deny"}"#);
    let mut r = start(&mut e, "/api/a", "192.0.2.2");
    assert!(!e.answer(&mut r, 0, 503, "", NOW));
    assert!(!e.answer(&mut r, 1, 200, "{\"not\": \"a decision\"}", NOW));
    assert!(!e.reply(&r, NOW).allowed);
}

#[wasm_bindgen_test]
fn local_mode_enforces_the_limit_from_memory() {
    let mut e = edge(3, "");
    let mut passed = 0;
    for _ in 0..6 {
        let mut r = start(&mut e, "/api/a", "192.0.2.3");
        e.fail(&mut r, 0, NOW);
        e.fail(&mut r, 1, NOW);
        let reply = e.reply(&r, NOW);
        if reply.allowed {
            passed += 1;
        } else {
            assert_eq!(reply.status, 429);
            assert!(header(&reply, "retry-after").is_some());
            let body: Value = serde_json::from_str(&reply.body).unwrap();
            assert_eq!(body["error"]["code"], "rate_limited");
        }
    }
    assert_eq!(passed, 3);
}

#[wasm_bindgen_test]
fn local_passes_are_replayed_in_one_batch_and_acknowledged() {
    let mut e = edge(100, "");
    for ip in ["192.0.2.10", "192.0.2.11"] {
        let mut r = start(&mut e, "/api/a", ip);
        let body = e.call_body(&r, 0).unwrap();
        let shadow = e.call_body(&r, 1);
        assert!(e.answer(&mut r, 0, 200, &granted(&body, 50), NOW));
        if let Some(shadow) = shadow {
            e.answer(&mut r, 1, 200, &granted(&shadow, 50), NOW);
        }
        for _ in 0..4 {
            let r = start(&mut e, "/api/a", ip);
            assert!(e.call_body(&r, 0).is_none(), "the lease covers it");
        }
    }
    let batch = e
        .take_replay(NOW + 50.0, 1000)
        .expect("own passes to replay");
    let body: Value = serde_json::from_str(&batch.body()).unwrap();
    let events = body["events"].as_array().unwrap();
    let api: Vec<&Value> = events.iter().filter(|e| e["namespace"] == "api").collect();
    assert_eq!(api.len(), 2, "one event per cell: {body}");
    assert!(
        api.iter().all(|e| e["used"] == 4),
        "cumulative own passes: {body}"
    );
    let cells: Vec<Value> = events
        .iter()
        .map(|_| json!({"regional": 5, "global": 0}))
        .collect();
    assert!(
        !e.ack_replay(&batch, 500, "",),
        "an error status is not an acknowledgement"
    );
    assert!(
        e.take_replay(NOW + 60.0, 1000).is_some(),
        "unacknowledged: sent again"
    );
    assert!(e.ack_replay(&batch, 200, &json!({ "cells": cells }).to_string()));
    assert!(
        e.take_replay(NOW + 70.0, 1000).is_none(),
        "nothing left to send"
    );
}

#[wasm_bindgen_test]
fn invalid_configuration_and_bad_requests_are_errors_not_traps() {
    let message = |e: wasm_bindgen::JsError| -> String {
        let v: JsValue = e.into();
        js_sys::Error::from(v).message().into()
    };
    let broken = Edge::new(r#"{"rules": [{"namespace": "a"}]}"#, "", "t").unwrap_err();
    assert!(message(broken).contains("rules[0]"));
    let bad_mode = Edge::new(&rules(1), r#"{"failure_mode": "maybe"}"#, "t").unwrap_err();
    assert!(message(bad_mode).contains("failure_mode"));

    let costly = json!({"rules": [{"namespace": "c", "limit": 9, "duration": "1m",
        "cost": {"header": "x-cost", "max": 5}, "actions": [{"generic_key": {"descriptor_value": "k"}}]}]});
    let mut e = Edge::new(&costly.to_string(), "", "t").unwrap();
    let err = e
        .start("GET", "https://h/", "x-cost\n6\n", None, NOW)
        .unwrap_err();
    assert!(message(err).contains("x-cost"));
    let err = e
        .start_key("login", "k", 3.0, 60_000.0, -1.0, NOW)
        .unwrap_err();
    assert!(message(err).contains("cost"));
}

#[wasm_bindgen_test]
fn a_binding_key_of_any_length_is_keyed_by_its_digest() {
    let mut e = edge(10, "");
    let long = "k".repeat(4_000);
    let r = e
        .start_key("login", &long, 3.0, 60_000.0, 1.0, NOW)
        .map_err(JsValue::from)
        .unwrap();
    let call: Value = serde_json::from_str(&e.call_body(&r, 0).unwrap()).unwrap();
    let id = call["limits"][0]["identifier"].as_str().unwrap();
    assert_eq!(id, strata_core::identity::identifier_for(long));
    assert!(id.len() <= 255 && id.starts_with("kkkk") && id.contains("%sha256:"));
}
