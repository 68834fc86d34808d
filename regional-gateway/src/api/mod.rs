//! The HTTP API v1: routes, authorization and the JSON body (our error shape for every
//! malformed or oversized body), and thin handlers that validate, call the limiter or
//! the origin, and answer. Each handler carries its OpenAPI description ([`openapi`]).

pub mod openapi;

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderName};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use serde::de::DeserializeOwned;
use strata_core::headers::{Field, HeaderLimit, header_values};
use strata_core::wire::{
    CellsResponse, DecideRequest, DecideResponse, ErrorCode, MAX_BODY_BYTES, MultiRequest,
    MultiResponse, RatelimitRequest, RatelimitResponse, ReadRequest, ReplayRequest,
};

use crate::Gateway;
use crate::error::ApiError;
use crate::metrics::Gauges;
use crate::origin::{DecideLimit, OriginError};

/// The gateway's routes over shared state.
pub fn router(gateway: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/ratelimit", post(ratelimit))
        .route("/v1/ratelimit/multi", post(ratelimit_multi))
        .route("/v1/origin/read", post(origin_read))
        .route("/v1/origin/replay", post(origin_replay))
        .route("/v1/origin/decide", post(origin_decide))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi::serve))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(gateway)
}

/// The workspace the request's bearer token binds, checked before the body is read (an
/// unauthenticated caller gets a 401 without making the gateway read up to 1 MiB), and the JSON
/// body, read with the API's size bound; failures answer in the API's error shape. The
/// workspace is borrowed from the token table: nothing is copied per request.
async fn authorized<T: DeserializeOwned>(
    gw: &Gateway,
    req: Request,
) -> Result<(&str, T), ApiError> {
    let workspace = gw.auth.workspace(req.headers())?;
    let too_large = || {
        ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("request body exceeds {MAX_BODY_BYTES} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES) {
        return Err(too_large());
    }
    let bytes = axum::body::to_bytes(req.into_body(), MAX_BODY_BYTES)
        .await
        .map_err(|e| {
            // Past the bound, or the connection failed mid-body (a client silent past
            // --read-timeout): only the first is the body's size.
            let failed_io =
                std::iter::successors(Some(&e as &(dyn std::error::Error + 'static)), |e| {
                    e.source()
                })
                .any(|e| e.is::<std::io::Error>());
            if failed_io {
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("request body not received whole: {e}"),
                )
            } else {
                too_large()
            }
        })?;
    let body = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidRequest,
            format!("malformed JSON body: {e}"),
        )
    })?;
    Ok((workspace, body))
}

/// `body` as JSON with the rate-limit headers of `limits` (the legacy trio only if `legacy`).
fn limited_json<T: Serialize>(
    body: T,
    limits: &[HeaderLimit<'_>],
    now_ms: u64,
    legacy: bool,
) -> Response {
    let Ok(bytes) = serde_json::to_vec(&body) else {
        // Unreachable for these bodies (plain fields); axum's own answer to such a failure.
        return Json(body).into_response();
    };
    let mut response = Response::new(Body::from(bytes));
    *response.headers_mut() = limit_headers(limits, now_ms, legacy);
    response
}

/// The content type and the rate-limit response headers for the decisions (the policy is named
/// by its namespace), in a map sized for exactly these. The core writes every value into one
/// buffer; each header value is a slice of it, so a reply allocates once for all of them and
/// copies nothing. A map sized for every header it could hold took 1,248 bytes a reply, a
/// kilobyte-sized allocation on every request (`docs/BENCHMARKS.md`, eighth pass).
fn limit_headers(limits: &[HeaderLimit<'_>], now_ms: u64, legacy: bool) -> HeaderMap {
    let values = header_values(limits, now_ms);
    let ranges = Field::ALL.map(|f| {
        if f.is_sent(legacy) {
            values.range(f)
        } else {
            None
        }
    });
    // Room for the content type, the content length axum adds on the way out, and these.
    let mut headers = HeaderMap::with_capacity(2 + ranges.iter().flatten().count());
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let text = Bytes::from(values.into_text());
    for (name, range) in LIMIT_HEADERS.iter().zip(ranges) {
        let Some(range) = range else { continue };
        // Always valid: the core writes printable ASCII only.
        if let Ok(value) = HeaderValue::from_maybe_shared(text.slice(range)) {
            headers.insert(name.clone(), value);
        }
    }
    headers
}

/// The names of [`Field::ALL`], built once (a `HeaderName` made at run time is checked).
const LIMIT_HEADERS: [HeaderName; 6] = [
    HeaderName::from_static(Field::Policy.name()),
    HeaderName::from_static(Field::RateLimit.name()),
    HeaderName::from_static(Field::RetryAfter.name()),
    HeaderName::from_static(Field::LegacyLimit.name()),
    HeaderName::from_static(Field::LegacyRemaining.name()),
    HeaderName::from_static(Field::LegacyReset.name()),
];

/// Decides one request against one limit, from local memory when it can.
///
/// A denial is also a 200, with `"success": false`.
#[utoipa::path(post, path = "/v1/ratelimit", tag = "decisions", request_body = RatelimitRequest,
    responses(
        (status = 200, description = "The decision", body = RatelimitResponse, headers(
            ("RateLimit-Policy" = String, description = "Each limit: `\"namespace\";q=<limit>;w=<window seconds>`"),
            ("RateLimit" = String, description = "Each limit: `\"namespace\";r=<remaining>;t=<seconds until reset, or retry-after when denied>`"),
            ("X-RateLimit-Limit" = String, description = "With `--legacy-headers true`: the most constraining limit"),
            ("X-RateLimit-Remaining" = String, description = "With `--legacy-headers true`: what is left of it"),
            ("X-RateLimit-Reset" = String, description = "With `--legacy-headers true`: Unix seconds at which its window ends"),
            ("Retry-After" = String, description = "Seconds to wait, when denied and a later request can pass"),
        )),
        openapi::Rejected,
    ),
)]
async fn ratelimit(State(gw): State<Arc<Gateway>>, req: Request) -> Result<Response, ApiError> {
    let (workspace, req): (&str, RatelimitRequest) = authorized(&gw, req).await?;
    let limit = req.validate(workspace)?;
    let decision = gw.limiter.decide(limit).await;
    let now = gw.limiter.clock.now_ms();
    let described = HeaderLimit {
        policy: limit.key.namespace(),
        duration: limit.key.duration(),
        decision: &decision,
    };
    Ok(limited_json(
        RatelimitResponse::from(&decision),
        &[described],
        now,
        gw.settings.legacy_headers,
    ))
}

/// Decides one request against several limits, all or nothing: it is counted against every
/// limit only if every limit passes.
#[utoipa::path(post, path = "/v1/ratelimit/multi", tag = "decisions", request_body = MultiRequest,
    responses(
        (status = 200, description = "The decisions, in request order", body = MultiResponse, headers(
            ("RateLimit-Policy" = String, description = "Each limit: `\"namespace\";q=<limit>;w=<window seconds>`"),
            ("RateLimit" = String, description = "Each limit: `\"namespace\";r=<remaining>;t=<seconds until reset, or retry-after when denied>`"),
            ("X-RateLimit-Limit" = String, description = "With `--legacy-headers true`: the most constraining limit"),
            ("X-RateLimit-Remaining" = String, description = "With `--legacy-headers true`: what is left of it"),
            ("X-RateLimit-Reset" = String, description = "With `--legacy-headers true`: Unix seconds at which its window ends"),
            ("Retry-After" = String, description = "Seconds to wait, when denied and a later request can pass"),
        )),
        openapi::Rejected,
    ),
)]
async fn ratelimit_multi(
    State(gw): State<Arc<Gateway>>,
    req: Request,
) -> Result<Response, ApiError> {
    let (workspace, req): (&str, MultiRequest) = authorized(&gw, req).await?;
    let limits = req.validate(workspace)?;
    let multi = gw.limiter.decide_all(&limits).await;
    let now = gw.limiter.clock.now_ms();
    let described: Vec<_> = limits
        .iter()
        .zip(&multi.decisions)
        .map(|(l, decision)| HeaderLimit {
            policy: l.key.namespace(),
            duration: l.key.duration(),
            decision,
        })
        .collect();
    let body = MultiResponse {
        success: multi.success,
        results: multi
            .decisions
            .iter()
            .map(RatelimitResponse::from)
            .collect(),
    };
    Ok(limited_json(
        body,
        &described,
        now,
        gw.settings.legacy_headers,
    ))
}

/// The origin's counts of cells, for an edge's cold or stale cells.
#[utoipa::path(post, path = "/v1/origin/read", tag = "origin", request_body = ReadRequest,
    responses(
        (status = 200, description = "Counts in request order", body = CellsResponse),
        openapi::Rejected,
        openapi::Unavailable,
    ),
)]
async fn origin_read(
    State(gw): State<Arc<Gateway>>,
    req: Request,
) -> Result<Json<CellsResponse>, ApiError> {
    let (workspace, req): (&str, ReadRequest) = authorized(&gw, req).await?;
    let cells = req.validate(workspace)?;
    let reads: Vec<_> = cells.iter().map(|c| (c.key, c.sequence)).collect();
    let now = gw.limiter.clock.now_ms();
    let answers = gw.limiter.origin.read(&reads, now).await?;
    let read = cells
        .iter()
        .zip(answers)
        .map(|(c, regional)| (c.key, c.sequence, regional, None));
    let cells = gw.limiter.global.record_cells(read, now);
    Ok(Json(CellsResponse {
        cells,
        renewed: Vec::new(),
        pace: None,
    }))
}

/// Merges a process's own cumulative counts into the origin (safe to resend: a repeated or
/// late event counts once) and answers the cells' counts after the merge.
#[utoipa::path(post, path = "/v1/origin/replay", tag = "origin", request_body = ReplayRequest,
    responses(
        (status = 200, description = "Counts after the merge, in request order", body = CellsResponse),
        openapi::Rejected,
        openapi::Unavailable,
    ),
)]
async fn origin_replay(
    State(gw): State<Arc<Gateway>>,
    req: Request,
) -> Result<Json<CellsResponse>, ApiError> {
    let (workspace, req): (&str, ReplayRequest) = authorized(&gw, req).await?;
    let events = req.validate(workspace)?;
    let now = gw.limiter.clock.now_ms();
    // A clock may be a window ahead of this one, not more: a cell further on is no real clock's.
    for (i, e) in events.iter().enumerate() {
        let current = e.cell.key.duration().sequence(now);
        if e.cell.sequence > current.saturating_add(1) {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                format!(
                    "events[{i}].sequence: {} is more than one window ahead of this gateway's {current}",
                    e.cell.sequence
                ),
            ));
        }
    }
    let after = gw.limiter.replay_refs(&req.instance, &events, now).await?;
    let answer = gw
        .limiter
        .replay_answer(&after, gw.settings.flush_ms())
        .map_err(|i| {
            let cell = events.get(i).map_or_else(String::new, |e| {
                let key = e.cell.key;
                format!(
                    " {}:{} sequence {}",
                    key.namespace(),
                    key.identifier(),
                    e.cell.sequence
                )
            });
            ApiError::Origin(OriginError::Backend(format!(
                "the origin could not merge{cell}"
            )))
        })?;
    gw.limiter.metrics.leases_renewed(answer.renewed.len());
    Ok(Json(answer))
}

/// Decides at the origin, atomically and exactly, for a caller's cold, stale, strict or
/// used-up cells, and grants it a lease to decide locally for a while.
#[utoipa::path(post, path = "/v1/origin/decide", tag = "origin", request_body = DecideRequest,
    responses(
        (status = 200, description = "The decision and the caller's lease", body = DecideResponse),
        openapi::Rejected,
        openapi::Unavailable,
    ),
)]
async fn origin_decide(
    State(gw): State<Arc<Gateway>>,
    req: Request,
) -> Result<Json<DecideResponse>, ApiError> {
    let (workspace, req): (&str, DecideRequest) = authorized(&gw, req).await?;
    let limits = req.validate(workspace)?;
    let now = gw.limiter.clock.now_ms();
    let request: Vec<DecideLimit<'_>> = limits
        .iter()
        .map(|l| gw.limiter.origin_limit(l, now))
        .collect();
    let answer = gw
        .limiter
        .origin
        .decide(&req.instance, &request, now)
        .await?;
    Ok(Json(gw.limiter.respond(&request, &answer)))
}

/// `GET /healthz` answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Health {
    /// Always `ok`: the process serves.
    pub status: &'static str,
}

/// `GET /readyz` answer while the origin answers.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Ready {
    /// Always `ready`.
    pub status: &'static str,
    /// The origin's kind: `memory` or `redis`.
    pub origin: &'static str,
}

/// Liveness: the process serves requests.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "Serving", body = Health)))]
async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

/// Readiness: the regional origin answers a ping.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "Ready", body = Ready),
        openapi::Unavailable,
    ),
)]
async fn readyz(State(gw): State<Arc<Gateway>>) -> Response {
    match gw.limiter.origin.ping().await {
        Ok(()) => {
            gw.set_origin_up(true);
            Json(Ready {
                status: "ready",
                origin: gw.limiter.origin.kind(),
            })
            .into_response()
        }
        Err(e) => {
            gw.set_origin_up(false);
            ApiError::Origin(e).into_response()
        }
    }
}

/// Prometheus metrics.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "The OpenMetrics text exposition", body = String,
        content_type = "application/openmetrics-text")))]
async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    let (local_windows, local_evictions) = gw.limiter.local.stats();
    let (unreplayed, replay_lost) = gw.limiter.local.replay_state();
    gw.limiter.metrics.sample(Gauges {
        replay_queue_cells: unreplayed,
        replay_lost,
        local_windows,
        local_evictions,
        breaker_open: gw.limiter.origin.breaker_open(),
        origin_up: gw.origin_up(),
    });
    gw.limiter.global.sample();
    (
        [(
            CONTENT_TYPE,
            HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
        )],
        crate::metrics::render(&gw.registry),
    )
        .into_response()
}

async fn not_found() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "no such endpoint")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        "method not allowed on this endpoint",
    )
}
