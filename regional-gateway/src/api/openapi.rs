//! The OpenAPI 3.1 description of API v1, generated from the handlers' annotations and the wire
//! types' schemas (`strata-core`'s `openapi` feature), served at `GET /openapi.json` and checked
//! in as `docs/openapi.json`.

use axum::Json;
use strata_core::wire::ErrorBody;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{IntoResponses, Modify, OpenApi};

/// The API's description.
#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "Strata regional gateway API",
        version = "1",
        description = "Rate-limit decisions from the regional gateway, and the regional origin that edges \
            (Workers, Envoy) call for cold, stale, strict and near-limit cells. With tokens configured \
            (`--tokens`), every `/v1` call needs `Authorization: Bearer <token>` and reaches only the \
            token's workspace; a gateway on loopback without tokens serves workspace `default` without one. \
            Errors are `{\"error\":{\"code\",\"message\"}}`. Counts, limits and costs are integers up to \
            2^53 - 1, so they survive a JavaScript number.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    paths(
        super::ratelimit,
        super::ratelimit_multi,
        super::origin_read,
        super::origin_replay,
        super::origin_decide,
        super::healthz,
        super::readyz,
        super::metrics,
        serve,
    ),
    // Named here because the error responses come from `IntoResponses`, which does not collect
    // the schemas it refers to.
    components(schemas(ErrorBody, strata_core::wire::ErrorDetail)),
    modifiers(&BearerToken),
    security((), ("bearer" = [])),
    tags(
        (name = "decisions", description = "Rate-limit decisions for clients of the gateway"),
        (name = "origin", description = "The regional origin, for edges and Envoy filters"),
        (name = "operations", description = "Health, readiness, metrics and this description"),
    ),
)]
pub struct ApiDoc;

/// The rejections every `/v1` operation can answer (described, never built).
#[derive(Debug, IntoResponses)]
#[allow(dead_code)]
pub(super) enum Rejected {
    /// Malformed JSON, or a value out of bounds (the message names the field)
    #[response(status = 400)]
    Invalid(ErrorBody),
    /// Tokens are configured and the bearer token is missing or unknown
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// Body over 1 MiB, or more entries than allowed
    #[response(status = 413)]
    TooLarge(ErrorBody),
}

/// The answer of an operation that needs the regional origin when it cannot reach it.
#[derive(Debug, IntoResponses)]
#[allow(dead_code)]
pub(super) enum Unavailable {
    /// The regional origin is unavailable
    #[response(status = 503)]
    Origin(ErrorBody),
}

/// Declares the `bearer` scheme the operations' `security` names.
#[derive(Debug)]
struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// This description (OpenAPI 3.1).
#[utoipa::path(get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 description of this API",
        content_type = "application/json")))]
pub(super) async fn serve() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
