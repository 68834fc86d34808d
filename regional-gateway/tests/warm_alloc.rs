//! A warm decision through the gateway's HTTP handler allocates no more than the bare axum
//! endpoint of the same JSON shape (`examples/bare.rs`, the throughput harness's baseline),
//! and above routing only what answering takes: counted with a global allocator that tallies
//! every allocation made on this test's thread (a current-thread runtime, so the handler runs
//! here).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

#[allow(dead_code)] // its main is the example's
#[path = "../examples/bare.rs"]
mod bare;
mod common;
#[path = "../../shared/tests/counting/mod.rs"]
mod counting;

use axum::Router;
use axum::body::Body;
use axum::http::Request;
use axum::routing::post;
use counting::{allocations, take_largest};
use http_body_util::BodyExt;
use tower::ServiceExt;

const BODY: &str =
    r#"{"namespace":"bench","identifier":"user-1","limit":1000000000,"duration":3600000}"#;
const ROUNDS: u64 = 200;

/// Allocations per request of `ROUNDS` requests through `router`, each answered and its body
/// read (and the remainder), and the largest of them in bytes. The requests are built before
/// counting starts.
async fn per_request(router: &Router) -> (u64, u64, usize) {
    let requests: Vec<_> = (0..ROUNDS)
        .map(|_| {
            Request::post("/v1/ratelimit")
                .header("content-type", "application/json")
                .body(Body::from(BODY))
                .unwrap()
        })
        .collect();
    let before = allocations();
    take_largest();
    let mut passed = 0;
    for request in requests {
        let response = router.clone().oneshot(request).await.unwrap();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        passed += u64::from(bytes.starts_with(br#"{"success":true"#));
    }
    assert_eq!(passed, ROUNDS, "every request passed");
    (
        (allocations() - before) / ROUNDS,
        (allocations() - before) % ROUNDS,
        take_largest(),
    )
}

#[tokio::test(flavor = "current_thread")]
async fn a_warm_decision_allocates_less_than_a_bare_endpoint_and_only_to_answer() {
    let g = common::embedded(&[]).await;
    let bare = bare::router();
    // What routing a request and reading a fixed answer cost, with no body parsed.
    let floor = Router::new().route("/v1/ratelimit", post(|| async { r#"{"success":true}"# }));
    // Warm: the gateway's first request is decided at the origin and brings a lease; the rest
    // pass under it, locally. The others grow whatever they keep.
    for router in [&g.router, &bare, &floor] {
        per_request(router).await;
    }
    let origin_calls = g.gateway.limiter.metrics.origin_calls("decide");

    let (gateway, rest, gateway_largest) = per_request(&g.router).await;
    let (baseline, _, baseline_largest) = per_request(&bare).await;
    let (routing, _, routing_largest) = per_request(&floor).await;
    eprintln!(
        "allocations per request: routing and a fixed answer {routing}, bare endpoint \
         {baseline}, gateway {gateway} (+{rest} in {ROUNDS}); the largest: \
         {routing_largest}, {baseline_largest} and {gateway_largest} bytes"
    );
    assert_eq!(
        g.gateway.limiter.metrics.origin_calls("decide"),
        origin_calls,
        "every measured request was decided locally"
    );
    assert!(
        gateway <= baseline,
        "a warm decision allocates {gateway} times a request, a bare endpoint {baseline}"
    );
    // A request's future holds only what deciding locally takes: with the origin call's state
    // in it (a few kilobytes), every request made an allocation three times the bare
    // endpoint's largest, though about one in a thousand calls the origin.
    assert!(
        gateway_largest <= baseline_largest * 5 / 4,
        "a warm decision's largest allocation is {gateway_largest} bytes, a bare endpoint's \
         {baseline_largest}"
    );
    // Above routing, the handler's own: the body read (1), the request's namespace and
    // identifier (2), the JSON answer (1), the headers' map (2) and their one text buffer,
    // shared by the values (2). The decision itself: the list of its one limit's decisions
    // (the core's request flow answers every request, of one limit or several, as a list).
    const ANSWERING: u64 = 8;
    const DECIDING: u64 = 1;
    assert!(
        gateway <= routing + ANSWERING + DECIDING,
        "a warm decision allocates {gateway} times a request: routing takes {routing}, \
         answering at most {ANSWERING}, deciding {DECIDING}"
    );
}
