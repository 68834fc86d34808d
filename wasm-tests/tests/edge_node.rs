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
use strata_edge::{Edge, EdgeCall, EdgeReply};
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

/// A limit under 64 times the cost: a cold key's first request waits for the gateway (at 64 it
/// passes ahead of the answer).
const NEAR: u64 = strata_core::policy::AHEAD_LIMIT_PER_COST - 1;

fn edge(limit: u64, options: &str) -> Edge {
    Edge::new(&rules(limit), options, "test", 250.0, 50.0).unwrap()
}

/// A request from `ip` as workerd reports the connection (`request.cf.clientIp`, with port);
/// the X-Forwarded-For a client wrote is not the address. Its reply, if decided at once.
fn start(edge: &mut Edge, id: u32, path: &str, ip: &str) -> Option<EdgeReply> {
    let verdict = edge.start(
        id,
        "GET",
        &format!("https://example.com{path}"),
        "x-forwarded-for\n6.6.6.6\n",
        Some(format!("{ip}:50123")),
        NOW,
    );
    assert_ne!(verdict, strata_edge::REFUSED, "{}", edge.refusal());
    (verdict != strata_edge::WAITING).then(|| edge.take_reply())
}

fn calls(edge: &mut Edge) -> Vec<EdgeCall> {
    std::iter::from_fn(|| edge.poll_transmit()).collect()
}

fn decisions(edge: &mut Edge) -> Vec<EdgeReply> {
    std::iter::from_fn(|| (edge.poll_decision() >= 0.0).then(|| edge.take_reply())).collect()
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
    reply
        .headers
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.as_str())
}

#[wasm_bindgen_test]
fn a_matching_request_calls_the_gateway_once_per_group_and_its_answer_decides() {
    let mut e = edge(10, "");
    assert!(start(&mut e, 1, "/api/users", "203.0.113.9").is_none());
    let sent = calls(&mut e);
    assert_eq!(sent.len(), 2, "the enforced group and the shadow group");
    assert!(
        sent.iter()
            .all(|c| c.path == "/v1/origin/decide" && c.timeout_ms == 250.0)
    );
    let call: Value = serde_json::from_str(&sent[0].body).unwrap();
    assert_eq!(
        call["limits"][0]["identifier"],
        "remote_address=203.0.113.9"
    );
    assert_eq!(
        call["limits"][0]["want"], 10,
        "a new key asks for the whole limit"
    );
    assert!(call["instance"].as_str().unwrap().starts_with("test-"));
    e.answer(sent[0].call, 200, &granted(&sent[0].body, 5), NOW);
    assert!(
        decisions(&mut e).is_empty(),
        "the shadow group is still out"
    );
    e.answer(sent[1].call, 200, &granted(&sent[1].body, 0), NOW);
    let replies = decisions(&mut e);
    let reply = &replies[0];
    assert_eq!((reply.request, reply.by), (1, "origin"));
    assert!(reply.allowed);
    assert_eq!(
        header(reply, "ratelimit-policy"),
        Some("\"per-ip\";q=10;w=60")
    );
    assert_eq!(header(reply, "ratelimit"), Some("\"per-ip\";r=9;t=10"));
    assert!(
        header(reply, "strata-shadow")
            .unwrap()
            .starts_with("\"trial\";")
    );

    // The lease decides the next request from memory, and the shadow rule's count (1 of 1)
    // denies it there: no call.
    let reply = start(&mut e, 2, "/api/users", "203.0.113.9").expect("decided from memory");
    assert_eq!((reply.allowed, reply.by), (true, "local"));
    assert!(calls(&mut e).is_empty());
}

#[wasm_bindgen_test]
fn concurrent_requests_on_a_cold_key_wait_for_one_call() {
    let mut e = edge(NEAR, "");
    for id in 0..8 {
        assert!(start(&mut e, id, "/api/a", "192.0.2.50").is_none());
    }
    let sent = calls(&mut e);
    assert_eq!(sent.len(), 2, "one call per group for eight requests");
    for c in &sent {
        e.answer(c.call, 200, &granted(&c.body, 50), NOW);
    }
    let replies = decisions(&mut e);
    assert_eq!(replies.len(), 8);
    assert!(replies.iter().all(|r| r.allowed));
    let stats: Value = serde_json::from_str(&e.stats()).unwrap();
    assert_eq!(stats["origin_calls"], 2);
    assert_eq!(stats["origin_reasons"]["cold"], 2, "{stats}");
    assert_eq!(stats["coalesced"], 14);
}

#[wasm_bindgen_test]
fn a_request_no_rule_matches_passes_without_headers_or_calls() {
    let mut e = edge(10, r#"{"headers_on_pass": true}"#);
    let rules_without_shadow = json!({"rules": [{"namespace": "api", "limit": 1, "duration": 60_000,
        "match": {"methods": ["POST"]}, "actions": [{"remote_address": {}}]}]});
    let mut only_posts =
        Edge::new(&rules_without_shadow.to_string(), "", "t", 250.0, 50.0).unwrap();
    let reply = start(&mut only_posts, 1, "/api/x", "198.51.100.1").expect("decided at once");
    assert!(reply.allowed && reply.headers.is_empty());
    assert!(calls(&mut only_posts).is_empty());
    // /health is outside the per-ip rule's path prefix: only the shadow rule applies.
    assert!(start(&mut e, 1, "/health", "198.51.100.1").is_none());
    let sent = calls(&mut e);
    assert_eq!(sent.len(), 1);
    assert!(sent[0].body.contains("\"trial\""));
}

#[wasm_bindgen_test]
fn failure_modes_decide_when_the_gateway_cannot() {
    for (mode, allowed) in [("local", true), ("allow", true), ("deny", false)] {
        let mut e = edge(
            10,
            &format!(r#"{{"failure_mode": "{mode}", "debug": true}}"#),
        );
        assert!(start(&mut e, 1, "/api/a", "192.0.2.1").is_none());
        for c in calls(&mut e) {
            e.fail(c.call, "connection refused", NOW);
        }
        let reply = &decisions(&mut e)[0];
        assert_eq!(reply.allowed, allowed, "{mode}");
        assert_eq!(reply.by, "fallback", "{mode}");
        assert_eq!(reply.status, if allowed { 200 } else { 429 }, "{mode}");
        assert_eq!(header(reply, "strata-origin"), Some("unavailable"));
        let log = e.poll_log().expect("the failure is logged");
        assert!(log.message.contains(mode), "{}", log.message);
        // The same key moments later: no call (the origin failed within the retry delay),
        // decided by the same mode.
        let again = start(&mut e, 2, "/api/a", "192.0.2.1").expect("no call");
        assert!(calls(&mut e).iter().all(|c| c.path != "/v1/origin/decide"));
        assert_eq!(again.by, "fallback", "{mode}");
        assert_eq!(again.allowed, allowed, "{mode}");
    }
    // An error status, a body that is not a decision, or no answer by the deadline is a
    // failure too.
    let mut e = edge(10, r#"{"failure_mode": "deny"}"#);
    assert!(start(&mut e, 1, "/api/a", "192.0.2.2").is_none());
    let sent = calls(&mut e);
    e.answer(sent[0].call, 503, "", NOW);
    e.answer(sent[1].call, 200, "{\"not\": \"a decision\"}", NOW);
    assert!(!decisions(&mut e)[0].allowed);
    assert!(start(&mut e, 2, "/api/b", "192.0.2.3").is_none());
    assert!(
        e.next_deadline() <= NOW + 250.0,
        "woken by the deadline at the latest"
    );
    e.timeout(NOW + 250.0);
    let reply = &decisions(&mut e)[0];
    assert_eq!((reply.request, reply.allowed), (2, false));
}

#[wasm_bindgen_test]
fn local_mode_enforces_the_limit_from_memory() {
    let mut e = edge(3, "");
    let mut passed = 0;
    for id in 0..6 {
        let reply = match start(&mut e, id, "/api/a", "192.0.2.3") {
            Some(reply) => reply,
            None => {
                for c in calls(&mut e) {
                    e.fail(c.call, "refused", NOW);
                }
                decisions(&mut e).remove(0)
            }
        };
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
fn local_passes_are_replayed_in_one_batch_after_the_delay_and_again_after_a_failure() {
    let mut e = edge(NEAR, "");
    for (n, ip) in ["192.0.2.10", "192.0.2.11"].into_iter().enumerate() {
        let base = 10 * u32::try_from(n).unwrap();
        assert!(start(&mut e, base, "/api/a", ip).is_none());
        for c in calls(&mut e) {
            e.answer(c.call, 200, &granted(&c.body, 50), NOW);
        }
        assert_eq!(decisions(&mut e).len(), 1);
        for id in 1..5 {
            let reply = start(&mut e, base + id, "/api/a", ip).expect("the lease covers it");
            assert_eq!(reply.by, "local");
        }
    }
    assert_eq!(e.next_deadline(), NOW + 50.0, "the replay delay");
    e.timeout(NOW + 50.0);
    let sent = calls(&mut e);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].path, "/v1/origin/replay");
    let body: Value = serde_json::from_str(&sent[0].body).unwrap();
    let events = body["events"].as_array().unwrap();
    let api: Vec<&Value> = events.iter().filter(|e| e["namespace"] == "api").collect();
    assert_eq!(api.len(), 2, "one event per cell: {body}");
    assert!(
        api.iter().all(|e| e["used"] == 4),
        "cumulative own passes: {body}"
    );
    e.answer(sent[0].call, 500, "", NOW + 60.0);
    assert_eq!(e.next_deadline(), NOW + 160.0, "sent again after a backoff");
    e.timeout(NOW + 160.0);
    let again = calls(&mut e);
    assert_eq!(again[0].body, sent[0].body, "the same cumulative counts");
    let cells: Vec<Value> = events
        .iter()
        .map(|_| json!({"regional": 5, "global": 0}))
        .collect();
    e.answer(
        again[0].call,
        200,
        &json!({ "cells": cells }).to_string(),
        NOW + 170.0,
    );
    assert_eq!(e.next_deadline(), -1.0, "nothing left to send");
    let stats: Value = serde_json::from_str(&e.stats()).unwrap();
    assert_eq!(
        (&stats["replays"], &stats["replay_failures"]),
        (&json!(1), &json!(1))
    );
}

#[wasm_bindgen_test]
fn a_cold_key_far_from_its_limit_passes_ahead_with_no_call_and_the_next_asks_for_the_lease() {
    let per_ip = json!({"rules": [{"name": "per-ip", "namespace": "api", "limit": NEAR + 1,
        "duration": "1m", "actions": [{"remote_address": {}}]}]});
    let mut e = Edge::new(&per_ip.to_string(), "", "test", 250.0, 50.0).unwrap();
    let reply = start(&mut e, 1, "/api/a", "192.0.2.30").expect("decided at once");
    assert!(reply.allowed);
    assert_eq!(reply.by, "ahead");
    assert!(calls(&mut e).is_empty(), "no call: the replay delivers it");
    // The next, before that replay, waits for a decision, which carries the pass ahead and
    // lends the lease.
    assert!(start(&mut e, 2, "/api/a", "192.0.2.30").is_none());
    let sent = calls(&mut e);
    assert_eq!(sent.len(), 1);
    let body: Value = serde_json::from_str(&sent[0].body).unwrap();
    assert_eq!(
        (&body["limits"][0]["cost"], &body["limits"][0]["used"]),
        (&json!(1), &json!(1))
    );
    e.answer(sent[0].call, 200, &granted(&sent[0].body, 50), NOW);
    let decided = decisions(&mut e);
    assert_eq!(decided.len(), 1);
    assert_eq!(decided[0].by, "origin");
    let next = start(&mut e, 3, "/api/a", "192.0.2.30").expect("the lease covers it");
    assert_eq!(next.by, "local");
    let stats: Value = serde_json::from_str(&e.stats()).unwrap();
    assert_eq!(stats["decided"]["ahead"], 1);
}

#[wasm_bindgen_test]
fn a_warm_pass_asks_for_a_drain_only_when_something_came_out() {
    // One rule (a shadow rule's would-be denials are log lines: something to drain).
    let per_ip = json!({"rules": [{"name": "per-ip", "namespace": "api", "limit": NEAR,
        "duration": "1m", "actions": [{"remote_address": {}}]}]});
    let mut e = Edge::new(&per_ip.to_string(), "", "test", 250.0, 50.0).unwrap();
    assert!(start(&mut e, 1, "/api/a", "192.0.2.20").is_none());
    assert!(e.wants_pump(), "a call to send");
    for c in calls(&mut e) {
        e.answer(c.call, 200, &granted(&c.body, 50), NOW);
    }
    assert!(e.wants_pump(), "a decision to pick up");
    assert_eq!(decisions(&mut e).len(), 1);
    assert_eq!(
        e.next_deadline(),
        NOW + 50.0,
        "the replay delay: JavaScript arms its timer"
    );
    assert!(!e.wants_pump());
    // Passes from memory under the same deadline leave JavaScript nothing to do.
    for id in 2..10 {
        assert!(start(&mut e, id, "/api/a", "192.0.2.20").is_some());
        assert!(!e.wants_pump(), "request {id}");
    }
    e.timeout(NOW + 50.0);
    assert!(e.wants_pump(), "the replay to send");
    assert_eq!(calls(&mut e).len(), 1);
    assert!(e.wants_pump(), "its deadline, not yet reported");
    assert!(e.next_deadline() > NOW + 50.0);
    assert!(!e.wants_pump());
}

#[wasm_bindgen_test]
fn the_connection_address_is_asked_for_only_when_a_rule_reads_it() {
    assert!(
        edge(1, "").reads_peer(),
        "remote_address with the peer source"
    );
    let by_header = Edge::new(
        &rules(1),
        r#"{"client_address": "x-forwarded-for"}"#,
        "t",
        250.0,
        50.0,
    )
    .unwrap();
    assert!(!by_header.reads_peer(), "the address comes from a header");
    assert_eq!(by_header.header_names(), "x-forwarded-for\n");
    let keyed = json!({"rules": [{"namespace": "k", "limit": 1, "duration": "1m",
        "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}]}]});
    assert!(
        !Edge::new(&keyed.to_string(), "", "t", 250.0, 50.0)
            .unwrap()
            .reads_peer()
    );
}

#[wasm_bindgen_test]
fn invalid_configuration_and_bad_requests_are_errors_not_traps() {
    let message = |e: wasm_bindgen::JsError| -> String {
        let v: JsValue = e.into();
        js_sys::Error::from(v).message().into()
    };
    let broken = Edge::new(r#"{"rules": [{"namespace": "a"}]}"#, "", "t", 250.0, 50.0).unwrap_err();
    assert!(message(broken).contains("rules[0]"));
    let bad_mode =
        Edge::new(&rules(1), r#"{"failure_mode": "maybe"}"#, "t", 250.0, 50.0).unwrap_err();
    assert!(message(bad_mode).contains("failure_mode"));

    let costly = json!({"rules": [{"namespace": "c", "limit": 9, "duration": "1m",
        "cost": {"header": "x-cost", "max": 5}, "actions": [{"generic_key": {"descriptor_value": "k"}}]}]});
    let mut e = Edge::new(&costly.to_string(), "", "t", 250.0, 50.0).unwrap();
    let refused = e.start(1, "GET", "https://h/", "x-cost\n6\n", None, NOW);
    assert_eq!(refused, strata_edge::REFUSED);
    assert!(e.refusal().contains("x-cost"), "{}", e.refusal());
    let refused = e.start_key(2, "login", "k", 3.0, 60_000.0, -1.0, NOW);
    assert_eq!(refused, strata_edge::REFUSED);
    assert!(e.refusal().contains("cost"), "{}", e.refusal());
    // A refusal is the request's, not the edge's: the next one within bounds goes on.
    let first = e.start(3, "GET", "https://h/", "x-cost\n1\n", None, NOW);
    assert_ne!(first, strata_edge::REFUSED, "{}", e.refusal());
}

#[wasm_bindgen_test]
fn a_binding_key_of_any_length_is_keyed_by_its_digest() {
    let mut e = edge(10, "");
    let long = "k".repeat(4_000);
    let r = e.start_key(1, "login", &long, 3.0, 60_000.0, 1.0, NOW);
    assert_eq!(r, strata_edge::WAITING, "{}", e.refusal());
    let call: Value = serde_json::from_str(&calls(&mut e)[0].body).unwrap();
    let id = call["limits"][0]["identifier"].as_str().unwrap();
    assert_eq!(id, strata_core::identity::identifier_for(long));
    assert!(id.len() <= 255 && id.starts_with("kkkk") && id.contains("%sha256:"));
}

/// The current reply's headers read as `worker.mjs` reads them: each name by its index in
/// `reply_header_names`, each value copied out of the module only when it is not the one read
/// last under its name (`held`). Also the names whose values were copied.
fn read_headers(e: &mut Edge, held: &mut [String]) -> (Vec<(String, String)>, Vec<String>) {
    let names: Vec<String> = e
        .reply_header_names()
        .split('\n')
        .map(str::to_owned)
        .collect();
    let (mut read, mut copied) = (Vec::new(), Vec::new());
    for i in 0..e.reply_header_count() {
        let n = e.reply_header_name(i) as usize;
        if let Ok(len) = usize::try_from(e.reply_header_value(i)) {
            held[n] = String::from_utf8(e.value_out()[..len].to_vec()).unwrap();
            copied.push(names[n].clone());
        }
        read.push((names[n].clone(), held[n].clone()));
    }
    (read, copied)
}

#[wasm_bindgen_test]
fn reply_headers_read_by_index_match_the_reply_and_an_unchanged_value_is_not_copied_again() {
    let rules = json!({"rules": [
        {"name": "a", "namespace": "a", "limit": 10, "duration": "1m",
         "match": {"path_prefix": "/a/"}, "actions": [{"remote_address": {}}]},
        {"name": "b", "namespace": "b", "limit": 20, "duration": "1m",
         "match": {"path_prefix": "/b/"}, "actions": [{"remote_address": {}}]}
    ]});
    let mut e = Edge::new(&rules.to_string(), "", "test", 250.0, 50.0).unwrap();
    let mut held = vec![String::new(); strata_core::gate::REPLY_HEADER_NAMES.len()];
    let mut copied = Vec::new();
    for (id, path) in [
        (1, "/a/x"),
        (2, "/b/x"),
        (3, "/a/x"),
        (4, "/a/x"),
        (5, "/b/x"),
    ] {
        let verdict = e.start(
            id,
            "GET",
            &format!("https://example.com{path}"),
            "",
            Some("203.0.113.9:50123".to_string()),
            NOW,
        );
        if verdict == strata_edge::WAITING {
            // A cold key: the gateway lends 5, and its answer decides the request.
            let sent = calls(&mut e);
            e.answer(sent[0].call, 200, &granted(&sent[0].body, 5), NOW);
            assert_eq!(e.poll_decision(), f64::from(id));
        } else {
            assert_eq!(verdict, strata_edge::PASS, "request {id}");
        }
        let (read, fresh) = read_headers(&mut e, &mut held);
        let reply = e.take_reply();
        let expected: Vec<(String, String)> = reply
            .headers
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.clone()))
            .collect();
        assert_eq!(read, expected, "request {id}");
        copied.push(fresh);
    }
    let both = ["ratelimit-policy", "ratelimit"];
    assert_eq!(copied[0], both, "the first reply copies every value");
    assert_eq!(copied[1], both, "another rule's policy under the same name");
    assert_eq!(copied[2], both, "the first policy again after the other");
    assert_eq!(
        copied[3],
        ["ratelimit"],
        "the same policy is not copied again"
    );
    assert_eq!(copied[4], both);
}
