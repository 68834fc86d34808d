//! The throughput harness's baseline: a bare axum endpoint of `/v1/ratelimit`'s shape. It
//! parses the same JSON body and answers with the same fields, deciding nothing, so
//! `scripts/bench.sh` can show what the gateway's decision costs on top of answering at all.
//!
//! ```text
//! cargo run --release -p strata-gateway --example bare -- 127.0.0.1:8090
//! ```

use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
#[allow(dead_code)] // parsed like the gateway's request, then unused: parsing is the cost
struct Request {
    namespace: String,
    identifier: String,
    limit: u64,
    duration: u64,
    #[serde(default)]
    cost: Option<u64>,
}

#[derive(Serialize)]
struct Response {
    success: bool,
    limit: u64,
    remaining: u64,
    reset: u64,
}

async fn ratelimit(Json(r): Json<Request>) -> Json<Response> {
    Json(Response {
        success: true,
        limit: r.limit,
        remaining: r.limit.saturating_sub(r.cost.unwrap_or(1)),
        reset: r.duration,
    })
}

/// The endpoint (also the baseline of the gateway's allocation test, `tests/warm_alloc.rs`).
pub(crate) fn router() -> Router {
    Router::new().route("/v1/ratelimit", post(ratelimit))
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:8090".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    axum::serve(listener, router()).await
}
