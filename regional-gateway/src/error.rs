//! The gateway's one error type: every failure a client can cause or see, mapped to the API's
//! error shape and status. Bodies never carry internals; the log line does.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use strata_core::wire::{ErrorCode, WireError};

use crate::origin::OriginError;

/// An error answered to a client.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Rejected input (400, 401, 403, 404, 405, 413) with its message.
    #[error("{0}")]
    Wire(#[from] WireError),
    /// The regional origin failed a call the request needed (503).
    #[error("origin unavailable: {0}")]
    Origin(#[from] OriginError),
}

impl ApiError {
    /// A rejection with a code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError::Wire(WireError::new(code, message))
    }

    fn wire(&self) -> WireError {
        match self {
            ApiError::Wire(e) => e.clone(),
            ApiError::Origin(e) => WireError::new(
                ErrorCode::OriginUnavailable,
                format!("the regional origin is unavailable ({})", e.kind()),
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let wire = self.wire();
        match &self {
            ApiError::Origin(e) => tracing::warn!(error = %e, "origin call failed for a request"),
            ApiError::Wire(e) => {
                tracing::debug!(code = e.code.as_str(), message = %e.message, "request rejected")
            }
        }
        let status = StatusCode::from_u16(wire.code.status()).unwrap_or(StatusCode::BAD_REQUEST);
        (status, Json(wire.body())).into_response()
    }
}
