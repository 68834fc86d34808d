//! Who a request acts for. Each token binds one workspace and reaches only its counters; a
//! gateway with no tokens (allowed only on loopback, see `config`) serves workspace `default`.

use std::collections::HashMap;

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use strata_core::wire::ErrorCode;

use crate::error::ApiError;

/// The workspace of a gateway without tokens.
pub const DEFAULT_WORKSPACE: &str = "default";

/// The token table.
#[derive(Clone, Debug, Default)]
pub struct Auth {
    tokens: HashMap<String, String>,
}

impl Auth {
    /// A table of token → workspace; empty means open loopback mode.
    pub fn new(tokens: HashMap<String, String>) -> Self {
        Self { tokens }
    }

    /// The workspace the request's bearer token binds.
    pub fn workspace<'a>(&'a self, headers: &HeaderMap) -> Result<&'a str, ApiError> {
        self.workspace_of(headers.get(AUTHORIZATION).map(|v| v.as_bytes()))
    }

    /// The workspace an `Authorization` value binds (an HTTP header or gRPC metadata).
    pub fn workspace_of<'a>(&'a self, authorization: Option<&[u8]>) -> Result<&'a str, ApiError> {
        if self.tokens.is_empty() {
            return Ok(DEFAULT_WORKSPACE);
        }
        let Some(value) = authorization else {
            return Err(ApiError::new(
                ErrorCode::Unauthorized,
                "missing Authorization: Bearer <token>",
            ));
        };
        let token = std::str::from_utf8(value)
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::Unauthorized,
                    "Authorization must be Bearer <token>",
                )
            })?;
        self.tokens
            .get(token)
            .map(String::as_str)
            .ok_or_else(|| ApiError::new(ErrorCode::Unauthorized, "unknown token"))
    }
}
