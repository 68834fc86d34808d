//! The JSON wire types of gateway API v1, and their validation.
//!
//! Parsing is the shell's job (serde_json in the gateway and edges); validation is here, so
//! every shell rejects the same inputs with the same codes and messages. Counts and costs are
//! capped at 2^53 - 1 so they survive a JavaScript number unchanged.

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;

use serde::{Deserialize, Serialize};

mod integer;

use crate::decision::{Counts, Decision};
use crate::gcounter::PublishPolicy;
use crate::identity::{IdentityError, WindowKeyRef};
use crate::limit::LimitRequest;
use crate::window::WindowDuration;

/// Most limits in one multi-limit or origin-decide request.
pub const MAX_MULTI_LIMITS: usize = 32;
/// Most cells or events in one origin read or replay batch.
pub const MAX_BATCH: usize = 1_000;
/// Largest request body a gateway accepts, in bytes.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Longest instance id of an origin-decide caller, in bytes.
pub const MAX_INSTANCE_BYTES: usize = 64;
/// Largest limit, cost or count: the largest integer a JavaScript number holds exactly.
pub const MAX_COUNT: u64 = (1 << 53) - 1;
/// Largest window sequence: the next window of the longest duration still starts within `u64`
/// milliseconds (past the year 2195 for one-second windows: no real clock's).
pub const MAX_SEQUENCE: u64 = u64::MAX / crate::window::MAX_DURATION_MS - 2;

/// The error codes of the API, each with its HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    /// 400: the request is malformed or a value is out of bounds.
    InvalidRequest,
    /// 401: no or unknown credentials.
    Unauthorized,
    /// 403: the credentials may not do this.
    Forbidden,
    /// 404: no such endpoint.
    NotFound,
    /// 405: the endpoint exists but not for this method.
    MethodNotAllowed,
    /// 413: the body or batch is larger than allowed.
    PayloadTooLarge,
    /// 503: the regional origin could not be reached for a read.
    OriginUnavailable,
}

impl ErrorCode {
    /// The code as it appears in the error body.
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::OriginUnavailable => "origin_unavailable",
        }
    }

    /// The HTTP status that carries it.
    pub const fn status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::OriginUnavailable => 503,
        }
    }
}

/// A rejected request: a code and a message that names the offending field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireError {
    /// What kind of error.
    pub code: ErrorCode,
    /// For the caller: which field, and why.
    pub message: String,
}

impl WireError {
    /// An error with a code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    fn invalid(path: &str, message: impl fmt::Display) -> Self {
        Self::new(ErrorCode::InvalidRequest, format!("{path}: {message}"))
    }

    /// The JSON body that carries it.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code.as_str().to_string(),
                message: self.message.clone(),
            },
        }
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

#[cfg(feature = "std")]
impl std::error::Error for WireError {}

/// `{"error":{"code","message"}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The inside of [`ErrorBody`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// Machine-readable code.
    pub code: String,
    /// Human-readable reason.
    pub message: String,
}

const fn one() -> u64 {
    1
}

/// `POST /v1/ratelimit` body, and one limit of the multi and decide endpoints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RatelimitRequest {
    /// Group of limits: 1 to 255 bytes of UTF-8.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 255))]
    pub namespace: String,
    /// Subject being limited: 1 to 255 bytes of UTF-8.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 255))]
    pub identifier: String,
    /// Allowed cost per window.
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub limit: u64,
    /// Window length in milliseconds, 1 s to 30 days.
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 1_000_u64, maximum = 2_592_000_000_u64)
    )]
    #[serde(deserialize_with = "integer::integer")]
    pub duration: u64,
    /// Cost of this request (default 1; 0 only checks).
    #[cfg_attr(
        feature = "openapi",
        schema(maximum = 9_007_199_254_740_991_u64, default = 1)
    )]
    #[serde(default = "one")]
    #[serde(deserialize_with = "integer::integer")]
    pub cost: u64,
}

/// `POST /v1/ratelimit` answer, and one result of the multi endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RatelimitResponse {
    /// Whether the request may proceed.
    pub success: bool,
    /// The limit applied.
    pub limit: u64,
    /// What is left (see [`Decision::remaining`]).
    pub remaining: u64,
    /// Unix ms at which the current window ends.
    pub reset: u64,
}

impl From<&Decision> for RatelimitResponse {
    fn from(d: &Decision) -> Self {
        Self {
            success: d.success,
            limit: d.limit,
            remaining: d.remaining,
            reset: d.reset_ms,
        }
    }
}

/// `POST /v1/ratelimit/multi` body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MultiRequest {
    /// The limits, decided all or nothing.
    #[cfg_attr(feature = "openapi", schema(min_items = 1, max_items = 32))]
    pub limits: Vec<RatelimitRequest>,
}

/// `POST /v1/ratelimit/multi` answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MultiResponse {
    /// True only if every limit passed (and then all were counted).
    pub success: bool,
    /// One result per limit, in request order.
    pub results: Vec<RatelimitResponse>,
}

/// One cell of an origin read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CellRequest {
    /// Group of limits: 1 to 255 bytes of UTF-8.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 255))]
    pub namespace: String,
    /// Subject being limited: 1 to 255 bytes of UTF-8.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 255))]
    pub identifier: String,
    /// Window length in milliseconds, 1 s to 30 days.
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 1_000_u64, maximum = 2_592_000_000_u64)
    )]
    #[serde(deserialize_with = "integer::integer")]
    pub duration: u64,
    /// The window's sequence.
    #[cfg_attr(feature = "openapi", schema(maximum = 7_116_799_409_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub sequence: u64,
}

/// `POST /v1/origin/read` body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReadRequest {
    /// Cells to read.
    #[cfg_attr(feature = "openapi", schema(max_items = 1000))]
    pub cells: Vec<CellRequest>,
}

/// `POST /v1/origin/read` and `/v1/origin/replay` answer: counts in request order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CellsResponse {
    /// One entry per requested cell or event.
    pub cells: Vec<Counts>,
    /// The leases the replay renewed, one per event whose `renew` the origin granted (a
    /// replay only; absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub renewed: Vec<RenewedLease>,
    /// How the caller may pace the replay of cells its leases cover, as the region stood
    /// when the origin answered (a replay only; absent when the origin does not say: then
    /// every cell holding cost goes on every pass).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pace: Option<ReplayPace>,
}

/// Who reads the region's counts, as the gateway knows when it answers a replay: what a
/// caller paces its quiet cells by (`replay::QuietPace`). A cell's cost under a live lease
/// is reserved at the origin already, so only the global layer waits for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReplayPace {
    /// No other region is live to import this one's counts: a cell a lease covers need not
    /// be replayed before its lease nears its end.
    pub alone: bool,
    /// The region's count at which a cell is published to the other regions, in millionths
    /// of its limit (the live regions' share of the publish floor): a covered cell under it
    /// is replayed about once a second, one over it on every pass.
    #[cfg_attr(feature = "openapi", schema(maximum = 1_000_000_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub publish_floor_ppm: u64,
    /// How often the region publishes its counts, in ms (its flush interval; default 0:
    /// unknown): a covered cell whose count the other regions read already is replayed about
    /// this often, since they see it no sooner than the flush.
    #[cfg_attr(feature = "openapi", schema(maximum = 3_600_000_u64))]
    #[serde(default, deserialize_with = "integer::integer")]
    pub flush_ms: u64,
}

impl ReplayPace {
    /// The pace of a region that is `alone` or publishes by `policy` every `flush_ms`.
    pub fn new(alone: bool, policy: PublishPolicy, flush_ms: u64) -> Self {
        Self {
            alone,
            publish_floor_ppm: u64::from(policy.floor_ppm()),
            flush_ms,
        }
    }

    /// The publish policy quiet cells are held under (`None`: no other region is live).
    pub fn publish(&self) -> Option<PublishPolicy> {
        (!self.alone).then(|| PublishPolicy::from_ppm(self.publish_floor_ppm))
    }
}

/// A lease a replay renewed: the lease event `event` named in `renew`, now under `lease_id`
/// and reserved for the caller for `lease_ms` more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RenewedLease {
    /// The index of the event in the replay's `events`.
    #[cfg_attr(feature = "openapi", schema(maximum = 999_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub event: u64,
    /// The lease's new id: later answers about the old one no longer concern it.
    #[cfg_attr(feature = "openapi", schema(maximum = 18_446_744_073_709_551_615_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub lease_id: u64,
    /// How long the caller may keep using it, from when it sent the replay (the origin's
    /// lease lifetime, `--fresh-for`).
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub lease_ms: u64,
}

/// A process's own cumulative count of one cell, replayed to the origin.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReplayEvent {
    /// Group of limits: 1 to 255 bytes of UTF-8.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 255))]
    pub namespace: String,
    /// Subject being limited: 1 to 255 bytes of UTF-8.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 255))]
    pub identifier: String,
    /// Window length in milliseconds, 1 s to 30 days.
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 1_000_u64, maximum = 2_592_000_000_u64)
    )]
    #[serde(deserialize_with = "integer::integer")]
    pub duration: u64,
    /// The window's sequence.
    #[cfg_attr(feature = "openapi", schema(maximum = 7_116_799_409_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub sequence: u64,
    /// Everything the process admitted in the cell so far (not a delta): the origin keeps
    /// the largest value per process, so a repeated or late replay counts once.
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub used: u64,
    /// The limit it was admitted under (the origin's publish floor follows it).
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub limit: u64,
    /// The id of a lease the process gives back on the cell (default 0: none); it stopped
    /// using it before sending this. Dropped only if no newer lease replaced it.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[cfg_attr(feature = "openapi", schema(maximum = 18_446_744_073_709_551_615_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub release: u64,
    /// The largest `used` the origin has acknowledged for the cell (default 0: unknown). An
    /// origin whose own record agrees adds the difference without reading first; any other
    /// value only costs it that read.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[cfg_attr(feature = "openapi", schema(maximum = 18_446_744_073_709_551_615_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub acked: u64,
    /// The id of a lease in use on the cell, far from the limit and near its end, that the
    /// process asks to keep (default 0: none): the origin renews it for a lease lifetime if
    /// it is still that process's current lease and the cell still far from the limit, and
    /// says so in the answer's `renewed`.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[cfg_attr(feature = "openapi", schema(maximum = 18_446_744_073_709_551_615_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub renew: u64,
    /// Undo what the process's decision call with this id counted on the cell (default 0:
    /// nothing), as a decision's `undo_from` does. Sent with the replay too, so a key that
    /// makes no more calls is not left counted twice.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[cfg_attr(feature = "openapi", schema(maximum = 18_446_744_073_709_551_615_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub undo_from: u64,
}

/// `POST /v1/origin/replay` body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReplayRequest {
    /// The replaying process's random id: own counts are kept per process.
    #[cfg_attr(
        feature = "openapi",
        schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9_-]+$")
    )]
    pub instance: String,
    /// One event per cell (for a cell named twice, the larger value counts).
    #[cfg_attr(feature = "openapi", schema(max_items = 1000))]
    pub events: Vec<ReplayEvent>,
}

/// One limit of a `POST /v1/origin/decide` request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DecideLimitRequest {
    /// Group of limits: 1 to 255 bytes of UTF-8.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 255))]
    pub namespace: String,
    /// Subject being limited: 1 to 255 bytes of UTF-8.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 255))]
    pub identifier: String,
    /// Allowed cost per window.
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub limit: u64,
    /// Window length in milliseconds, 1 s to 30 days.
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 1_000_u64, maximum = 2_592_000_000_u64)
    )]
    #[serde(deserialize_with = "integer::integer")]
    pub duration: u64,
    /// Cost of this request (default 1).
    #[cfg_attr(
        feature = "openapi",
        schema(maximum = 9_007_199_254_740_991_u64, default = 1)
    )]
    #[serde(default = "one")]
    #[serde(deserialize_with = "integer::integer")]
    pub cost: u64,
    /// The caller's current sequence for this window (default: the origin's), which `used`
    /// and `used_previous` refer to.
    #[cfg_attr(feature = "openapi", schema(maximum = 7_116_799_409_u64))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "integer::optional_integer")]
    pub sequence: Option<u64>,
    /// The caller's own cumulative count in its current cell (default 0): merged with `max`,
    /// so local passes no replay delivered yet count, once.
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(default)]
    #[serde(deserialize_with = "integer::integer")]
    pub used: u64,
    /// The same for its previous cell.
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(default)]
    #[serde(deserialize_with = "integer::integer")]
    pub used_previous: u64,
    /// What the origin passed for the caller's calls in its current cell, as far as the
    /// caller knows (default 0): with `used`, its part of the cell.
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(default, skip_serializing_if = "is_zero")]
    #[serde(deserialize_with = "integer::integer")]
    pub decided: u64,
    /// The same for its previous cell: a covering lease lends the caller the decay of at most
    /// `used_previous + decided_previous` (and of no more than the origin counted for it).
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(default, skip_serializing_if = "is_zero")]
    #[serde(deserialize_with = "integer::integer")]
    pub decided_previous: u64,
    /// The lease the caller asks for beyond `cost` (default 0: decide this request only).
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(default)]
    #[serde(deserialize_with = "integer::integer")]
    pub want: u64,
    /// The id of an expired lease the caller gives back (default 0: none): the origin drops
    /// it, once `used` is merged and if no newer lease replaced it, before deciding.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[cfg_attr(feature = "openapi", schema(maximum = 18_446_744_073_709_551_615_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub release: u64,
    /// This call's id for the cell (default 0: none), growing per caller: the origin keeps the
    /// last it counted, so a later call can ask it to undo that.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[cfg_attr(feature = "openapi", schema(maximum = 18_446_744_073_709_551_615_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub call: u64,
    /// Undo what the caller's call with this id counted, if it is the last the origin counted
    /// for the caller on the cell (default 0: nothing): its answer never arrived, and the
    /// caller decided that request itself. A later call counted since is never undone (its
    /// answer may have come); the lost one then stays counted, over and never under.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[cfg_attr(feature = "openapi", schema(maximum = 18_446_744_073_709_551_615_u64))]
    #[serde(deserialize_with = "integer::integer")]
    pub undo_from: u64,
}

/// `POST /v1/origin/decide` body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DecideRequest {
    /// The caller's random instance id: own counts and leases are kept per instance.
    #[cfg_attr(
        feature = "openapi",
        schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9_-]+$")
    )]
    pub instance: String,
    /// The limits, decided all or nothing at the origin.
    #[cfg_attr(feature = "openapi", schema(min_items = 1, max_items = 32))]
    pub limits: Vec<DecideLimitRequest>,
    /// Whether the caller counts its share of the previous window's weight against a
    /// lease's ceiling, so it may be lent covering leases (see `DecideResult::covers`); a
    /// caller that does not is lent plain ones.
    #[serde(default)]
    pub shares: bool,
}

/// One limit of a `POST /v1/origin/decide` answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DecideResult {
    /// This limit's own verdict (it was counted only if the whole request passed).
    pub success: bool,
    /// The limit applied.
    pub limit: u64,
    /// What is left.
    pub remaining: u64,
    /// Unix ms at which the current window ends.
    pub reset: u64,
    /// The current window's sequence on the gateway's clock (limits of different durations
    /// have different sequences, so each result carries its own).
    pub sequence: u64,
    /// The current cell after the decision.
    pub current: Counts,
    /// The previous cell.
    pub previous: Counts,
    /// The caller's own cumulative count in the current cell at the origin, after this.
    pub used: u64,
    /// The lease: the caller may admit this much more from its own memory...
    pub lease: u64,
    /// ...under this id (0 with no lease; a newer lease has a larger id)...
    #[serde(default)]
    pub lease_id: u64,
    /// ...for this long from its request (milliseconds)...
    pub lease_ms: u64,
    /// ...and whether it covers the caller's share of the previous window's weight: the
    /// caller's own count plus that share (its own count of the previous cell, decayed and
    /// rounded up) may reach `used + lease`, rather than its own count alone.
    #[serde(default)]
    pub covers: bool,
}

/// `POST /v1/origin/decide` answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DecideResponse {
    /// True only if every limit passed (and then all were counted).
    pub success: bool,
    /// The first limit's sequence (kept for the contract; each result has its own).
    pub sequence: u64,
    /// One result per limit, in request order.
    pub results: Vec<DecideResult>,
}

/// A validated cell: a window key and a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CellRef<'a> {
    /// The window key.
    pub key: WindowKeyRef<'a>,
    /// The window's sequence.
    pub sequence: u64,
}

/// A validated limit of an origin decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecideRef<'a> {
    /// The limit.
    pub limit: LimitRequest<'a>,
    /// The caller's sequence, if it named one.
    pub sequence: Option<u64>,
    /// The caller's own cumulative counts of its current and previous cells.
    pub used: [u64; 2],
    /// What the origin passed for the caller in those cells, as far as it knows.
    pub decided: [u64; 2],
    /// The lease asked for.
    pub want: u64,
    /// The id of the lease the caller gives back (0: none).
    pub release: u64,
    /// This call's id (0: none).
    pub call: u64,
    /// Undo what the caller's call with this id counted, if the origin counted none since (0:
    /// nothing).
    pub undo_from: u64,
    /// Whether the caller may be lent a covering lease (`DecideRequest::shares`).
    pub shares: bool,
}

/// A validated replay event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayRef<'a> {
    /// The cell it counts on.
    pub cell: CellRef<'a>,
    /// The process's cumulative count of the cell.
    pub used: u64,
    /// The limit it was admitted under.
    pub limit: u64,
    /// The id of the lease the process gives back (0: none).
    pub release: u64,
    /// The id of the lease in use the process asks to have renewed (0: none).
    pub renew: u64,
    /// The largest count the origin acknowledged for the cell, as the process knows it (0:
    /// unknown); only a hint.
    pub acked: u64,
    /// Undo what the process's call with this id counted on the cell, if the origin counted
    /// none since (0: nothing).
    pub undo_from: u64,
}

/// For `skip_serializing_if`: a zero id is left out.
#[allow(clippy::trivially_copy_pass_by_ref)] // serde passes a reference
const fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn key<'a>(
    path: &str,
    workspace: &'a str,
    namespace: &'a str,
    identifier: &'a str,
    duration_ms: u64,
) -> Result<WindowKeyRef<'a>, WireError> {
    let duration = WindowDuration::from_ms(duration_ms)
        .map_err(|e| WireError::invalid(&format!("{path}duration"), e))?;
    WindowKeyRef::new(workspace, namespace, identifier, duration).map_err(|e| {
        let field = match e {
            IdentityError::Empty(f) | IdentityError::TooLong { field: f, .. } => f.name(),
            _ => "key",
        };
        WireError::invalid(&format!("{path}{field}"), e)
    })
}

fn count(path: &str, field: &str, value: u64) -> Result<u64, WireError> {
    if value > MAX_COUNT {
        return Err(WireError::invalid(
            &format!("{path}{field}"),
            format_args!("must be at most {MAX_COUNT}, got {value}"),
        ));
    }
    Ok(value)
}

fn sequence(path: &str, sequence: u64) -> Result<u64, WireError> {
    if sequence > MAX_SEQUENCE {
        return Err(WireError::invalid(
            &format!("{path}sequence"),
            format_args!("must be at most {MAX_SEQUENCE}, got {sequence}"),
        ));
    }
    Ok(sequence)
}

fn batch<T>(what: &str, items: &[T], min: usize, max: usize) -> Result<(), WireError> {
    if items.len() < min {
        return Err(WireError::invalid(
            what,
            format_args!("needs at least {min} entry"),
        ));
    }
    if items.len() > max {
        return Err(WireError::new(
            ErrorCode::PayloadTooLarge,
            format!("{what}: {} entries, at most {max} are allowed", items.len()),
        ));
    }
    Ok(())
}

impl RatelimitRequest {
    /// Validates one limit for `workspace` (the one the caller's token binds).
    pub fn validate<'a>(&'a self, workspace: &'a str) -> Result<LimitRequest<'a>, WireError> {
        self.validate_at("", workspace)
    }

    fn validate_at<'a>(
        &'a self,
        path: &str,
        workspace: &'a str,
    ) -> Result<LimitRequest<'a>, WireError> {
        Ok(LimitRequest {
            key: key(
                path,
                workspace,
                &self.namespace,
                &self.identifier,
                self.duration,
            )?,
            limit: count(path, "limit", self.limit)?,
            cost: count(path, "cost", self.cost)?,
        })
    }
}

fn validate_limits<'a>(
    limits: &'a [RatelimitRequest],
    workspace: &'a str,
) -> Result<Vec<LimitRequest<'a>>, WireError> {
    batch("limits", limits, 1, MAX_MULTI_LIMITS)?;
    limits
        .iter()
        .enumerate()
        .map(|(i, l)| l.validate_at(&format!("limits[{i}]."), workspace))
        .collect()
}

impl MultiRequest {
    /// Validates every limit (1 ..= `MAX_MULTI_LIMITS`).
    pub fn validate<'a>(&'a self, workspace: &'a str) -> Result<Vec<LimitRequest<'a>>, WireError> {
        validate_limits(&self.limits, workspace)
    }
}

impl DecideResponse {
    /// A gateway's answer to a decide call, if it is one: a `200` whose body parses. Anything
    /// else (an error status, a proxy's page, a truncated body) is a failed call.
    pub fn from_answer(status: u16, body: &[u8]) -> Option<Self> {
        (status == 200)
            .then(|| serde_json::from_slice(body).ok())
            .flatten()
    }
}

impl CellsResponse {
    /// A gateway's answer to a replay of `cells` cells, if it is one: a `200` whose body
    /// parses and holds one entry per cell.
    pub fn from_answer(status: u16, body: &[u8], cells: usize) -> Option<Self> {
        (status == 200)
            .then(|| serde_json::from_slice::<Self>(body).ok())
            .flatten()
            .filter(|r| r.cells.len() == cells)
    }
}

/// A process's instance id: its region's letters, digits and `-` (at most 24; `fallback` when
/// none), then 64 random bits in hex. Always passes [`validate_instance`].
pub fn instance_id(region: &str, fallback: &str, bits: u64) -> String {
    let prefix: String = region
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(24)
        .collect();
    let prefix = if prefix.is_empty() { fallback } else { &prefix };
    format!("{prefix}-{bits:016x}")
}

/// Validates an instance id: 1–64 bytes of `[A-Za-z0-9_-]`.
pub fn validate_instance(instance: &str) -> Result<(), WireError> {
    let ok = (1..=MAX_INSTANCE_BYTES).contains(&instance.len())
        && instance
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !ok {
        return Err(WireError::invalid(
            "instance",
            format_args!("must be 1 to {MAX_INSTANCE_BYTES} bytes of letters, digits, '-' and '_'"),
        ));
    }
    Ok(())
}

impl DecideRequest {
    /// Validates the instance id and every limit (1 ..= `MAX_MULTI_LIMITS`).
    pub fn validate<'a>(&'a self, workspace: &'a str) -> Result<Vec<DecideRef<'a>>, WireError> {
        validate_instance(&self.instance)?;
        batch("limits", &self.limits, 1, MAX_MULTI_LIMITS)?;
        self.limits
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let path = format!("limits[{i}].");
                let key = key(&path, workspace, &l.namespace, &l.identifier, l.duration)?;
                Ok(DecideRef {
                    limit: LimitRequest {
                        key,
                        limit: count(&path, "limit", l.limit)?,
                        cost: count(&path, "cost", l.cost)?,
                    },
                    sequence: l.sequence.map(|s| sequence(&path, s)).transpose()?,
                    used: [
                        count(&path, "used", l.used)?,
                        count(&path, "used_previous", l.used_previous)?,
                    ],
                    decided: [
                        count(&path, "decided", l.decided)?,
                        count(&path, "decided_previous", l.decided_previous)?,
                    ],
                    want: count(&path, "want", l.want)?,
                    release: l.release,
                    call: l.call,
                    undo_from: l.undo_from,
                    shares: self.shares,
                })
            })
            .collect()
    }
}

impl ReadRequest {
    /// Validates every cell (0 ..= `MAX_BATCH`).
    pub fn validate<'a>(&'a self, workspace: &'a str) -> Result<Vec<CellRef<'a>>, WireError> {
        batch("cells", &self.cells, 0, MAX_BATCH)?;
        self.cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let path = format!("cells[{i}].");
                let key = key(&path, workspace, &c.namespace, &c.identifier, c.duration)?;
                let sequence = sequence(&path, c.sequence)?;
                Ok(CellRef { key, sequence })
            })
            .collect()
    }
}

impl ReplayRequest {
    /// Validates every event (0 ..= `MAX_BATCH`).
    pub fn validate<'a>(&'a self, workspace: &'a str) -> Result<Vec<ReplayRef<'a>>, WireError> {
        validate_instance(&self.instance)?;
        batch("events", &self.events, 0, MAX_BATCH)?;
        self.events
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let path = format!("events[{i}].");
                let key = key(&path, workspace, &e.namespace, &e.identifier, e.duration)?;
                Ok(ReplayRef {
                    cell: CellRef {
                        key,
                        sequence: sequence(&path, e.sequence)?,
                    },
                    used: count(&path, "used", e.used)?,
                    limit: count(&path, "limit", e.limit)?,
                    release: e.release,
                    renew: e.renew,
                    acked: e.acked,
                    undo_from: e.undo_from,
                })
            })
            .collect()
    }
}
