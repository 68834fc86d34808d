//! The regional origin: where the processes of one region converge. Redis in production, or
//! the gateway's own memory when embedded. Both count regional usage per cell; the gateway
//! wraps them with a timeout and a circuit breaker (`OriginClient`).

pub mod memory;
pub mod redis;

use std::time::{Duration, Instant};

use strata_core::WindowKeyRef;

use crate::breaker::Breaker;
use crate::metrics::Metrics;

pub use memory::MemoryOrigin;
pub use redis::RedisOrigin;

/// Why an origin call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum OriginError {
    /// No answer within the origin timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The breaker is open after too many failures; calls fail fast until it probes again.
    #[error("circuit breaker open")]
    CircuitOpen,
    /// The backend answered with an error or the connection failed.
    #[error("{0}")]
    Backend(String),
}

impl OriginError {
    /// Label for metrics and client messages.
    pub fn kind(&self) -> &'static str {
        match self {
            OriginError::Timeout(_) => "timeout",
            OriginError::CircuitOpen => "circuit_open",
            OriginError::Backend(_) => "backend",
        }
    }
}

/// One cell to read: a window key and a sequence.
pub type CellRead<'a> = (WindowKeyRef<'a>, u64);

/// How long a process counts as a peer on a key after its last call (a few replay intervals).
pub const PEER_WINDOW_MS: u64 = 1_000;
/// Most distinct peers tracked per key.
pub const MAX_PEERS: usize = 64;

/// The processes recently seen on a key: a small bounded list with expiry, and since when the
/// key has been active (a key active for less than a peer window has not been seen by every
/// process that is about to hit it, so its count is raised to the region's live processes).
#[derive(Debug, Default, Clone)]
pub struct Peers {
    seen: Vec<(String, u64)>,
    born: u64,
}

/// The peers to report: the key's own count, or while the key is young (active for less than
/// a peer window) at least the region's live processes, any of which may be about to hit it.
pub fn peers_with_prior(on_key: u32, young: bool, prior: u32) -> u32 {
    if young {
        on_key.max(prior).max(1)
    } else {
        on_key.max(1)
    }
}

impl Peers {
    /// Records `instance` at `now_ms`, dropping the expired and, past `MAX_PEERS`, the oldest.
    pub fn see(&mut self, instance: &str, now_ms: u64) {
        if self.is_empty(now_ms) {
            self.born = now_ms;
        }
        self.seen
            .retain(|(_, at)| now_ms.saturating_sub(*at) < PEER_WINDOW_MS);
        match self.seen.iter_mut().find(|(id, _)| id == instance) {
            Some(entry) => entry.1 = entry.1.max(now_ms),
            None => {
                if self.seen.len() >= MAX_PEERS {
                    self.seen.sort_by_key(|(_, at)| std::cmp::Reverse(*at));
                    self.seen.truncate(MAX_PEERS - 1);
                }
                self.seen.push((instance.to_string(), now_ms));
            }
        }
    }

    /// Distinct processes seen within the window (at least 1: the asker).
    pub fn count(&self, now_ms: u64) -> u32 {
        let n = self
            .seen
            .iter()
            .filter(|(_, at)| now_ms.saturating_sub(*at) < PEER_WINDOW_MS)
            .count();
        u32::try_from(n).unwrap_or(u32::MAX).max(1)
    }

    /// Whether the key became active less than a peer window ago.
    pub fn young(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.born) < PEER_WINDOW_MS
    }

    /// Whether nobody was seen within the window.
    pub fn is_empty(&self, now_ms: u64) -> bool {
        !self
            .seen
            .iter()
            .any(|(_, at)| now_ms.saturating_sub(*at) < PEER_WINDOW_MS)
    }
}

/// One limit of an origin decision.
#[derive(Clone, Copy, Debug)]
pub struct DecideLimit<'a> {
    /// The window key.
    pub key: WindowKeyRef<'a>,
    /// Allowed cost per window.
    pub limit: u64,
    /// The request's cost.
    pub cost: u64,
    /// Cost the origin has not been told of but must count as used: the caller's own
    /// unreplayed passes and its reserve (the band) for other processes' unreplayed passes.
    pub unseen: u64,
    /// The other regions' counts of the current and previous cells, as the gateway imported
    /// them from the global table.
    pub global: [u64; 2],
}

impl DecideLimit<'_> {
    /// The check an origin decides this limit with, from the regional counts it holds for
    /// the current and previous cells: what the caller has not told it yet counts as used, and
    /// the other regions' imported counts are added.
    pub fn check(&self, current: u64, previous: u64) -> strata_core::LimitCheck {
        strata_core::LimitCheck {
            counts: strata_core::WindowCounts {
                current: strata_core::Counts {
                    regional: current.saturating_add(self.unseen),
                    global: self.global[0],
                },
                previous: strata_core::Counts {
                    regional: previous,
                    global: self.global[1],
                },
            },
            duration: self.key.duration(),
            limit: self.limit,
            cost: self.cost,
        }
    }
}

/// The origin's verdict on one limit.
#[derive(Clone, Copy, Debug)]
pub struct DecideOutcome {
    /// This limit's own verdict (counted only if the whole request passed).
    pub decision: strata_core::Decision,
    /// The current sequence on the gateway's clock.
    pub sequence: u64,
    /// The current cell's regional count after the decision.
    pub current: u64,
    /// The previous cell's regional count.
    pub previous: u64,
    /// Distinct processes recently seen on the key.
    pub peers: u32,
}

/// The origin's answer to a decision request.
#[derive(Clone, Debug)]
pub struct DecideAnswer {
    /// Whether every limit passed and all were counted.
    pub success: bool,
    /// One outcome per limit, in request order.
    pub limits: Vec<DecideOutcome>,
}

/// Accepted cost to add to one cell (events of a cell already summed).
#[derive(Clone, Copy, Debug)]
pub struct CellIncrement<'a> {
    /// The window key.
    pub key: WindowKeyRef<'a>,
    /// The window's sequence.
    pub sequence: u64,
    /// Cost to add.
    pub cost: u64,
}

/// The origin backends.
#[derive(Debug)]
pub enum Origin {
    /// In-process memory (the embedded default).
    Memory(MemoryOrigin),
    /// Redis, shared by the gateways of a region.
    Redis(RedisOrigin),
}

impl Origin {
    /// Regional counts of `cells` (0 for a cell never written or expired) and the peers on
    /// each one's key, in order; a reader naming its instance counts as a peer.
    async fn read(
        &self,
        instance: Option<&str>,
        cells: &[CellRead<'_>],
        now_ms: u64,
    ) -> Result<Vec<(u64, u32)>, OriginError> {
        match self {
            Origin::Memory(m) => Ok(m.read(instance, cells, now_ms)),
            Origin::Redis(r) => r.read(instance, cells, now_ms).await,
        }
    }

    /// Adds each increment and returns each cell's count after it and the peers on its key.
    async fn replay(
        &self,
        instance: Option<&str>,
        cells: &[CellIncrement<'_>],
        now_ms: u64,
    ) -> Result<Vec<(u64, u32)>, OriginError> {
        match self {
            Origin::Memory(m) => Ok(m.replay(instance, cells, now_ms)),
            Origin::Redis(r) => r.replay(instance, cells, now_ms).await,
        }
    }

    /// Decides the limits atomically at the origin (all or nothing) and counts on a pass.
    async fn decide(
        &self,
        instance: &str,
        limits: &[DecideLimit<'_>],
        now_ms: u64,
    ) -> Result<DecideAnswer, OriginError> {
        match self {
            Origin::Memory(m) => Ok(m.decide(instance, limits, now_ms)),
            Origin::Redis(r) => r.decide(instance, limits, now_ms).await,
        }
    }

    async fn ping(&self) -> Result<(), OriginError> {
        match self {
            Origin::Memory(_) => Ok(()),
            Origin::Redis(r) => r.ping().await,
        }
    }

    /// `memory` or `redis`.
    pub fn kind(&self) -> &'static str {
        match self {
            Origin::Memory(_) => "memory",
            Origin::Redis(_) => "redis",
        }
    }
}

/// The origin as the gateway calls it: bounded by a timeout, guarded by a breaker, measured.
#[derive(Debug)]
pub struct OriginClient {
    origin: Origin,
    timeout: Duration,
    breaker: Breaker,
    metrics: std::sync::Arc<Metrics>,
}

impl OriginClient {
    /// Wraps a backend.
    pub fn new(origin: Origin, timeout: Duration, metrics: std::sync::Arc<Metrics>) -> Self {
        Self {
            origin,
            timeout,
            breaker: Breaker::default(),
            metrics,
        }
    }

    /// The backend's kind.
    pub fn kind(&self) -> &'static str {
        self.origin.kind()
    }

    /// Whether the breaker currently lets calls through.
    pub fn breaker_open(&self) -> bool {
        self.breaker.is_open(Instant::now())
    }

    /// See [`Origin::read`].
    pub async fn read(
        &self,
        instance: Option<&str>,
        cells: &[CellRead<'_>],
        now_ms: u64,
    ) -> Result<Vec<(u64, u32)>, OriginError> {
        self.call("read", self.origin.read(instance, cells, now_ms))
            .await
    }

    /// See [`Origin::replay`].
    pub async fn replay(
        &self,
        instance: Option<&str>,
        cells: &[CellIncrement<'_>],
        now_ms: u64,
    ) -> Result<Vec<(u64, u32)>, OriginError> {
        self.call("replay", self.origin.replay(instance, cells, now_ms))
            .await
    }

    /// See [`Origin::decide`].
    pub async fn decide(
        &self,
        instance: &str,
        limits: &[DecideLimit<'_>],
        now_ms: u64,
    ) -> Result<DecideAnswer, OriginError> {
        self.decide_within(instance, limits, now_ms, self.timeout)
            .await
    }

    /// [`decide`](Self::decide) bounded by what is left of a request's budget (a request that
    /// already waited for a read must not wait a full timeout again).
    pub async fn decide_within(
        &self,
        instance: &str,
        limits: &[DecideLimit<'_>],
        now_ms: u64,
        budget: Duration,
    ) -> Result<DecideAnswer, OriginError> {
        self.call_within(
            "decide",
            budget.min(self.timeout),
            self.origin.decide(instance, limits, now_ms),
        )
        .await
    }

    /// The origin timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Announces this process to the region (Redis) and refreshes the live-process count.
    pub async fn presence(&self, instance: &str, now_ms: u64) {
        if let Origin::Redis(r) = &self.origin {
            if let Err(e) = r.presence(instance, now_ms).await {
                tracing::debug!(error = %e, "presence update failed");
            }
        }
    }

    /// Drops expired cells held in process memory (the embedded origin); Redis expires its own.
    pub fn purge_expired(&self, now_ms: u64) -> usize {
        match &self.origin {
            Origin::Memory(m) => m.purge_expired(now_ms),
            Origin::Redis(_) => 0,
        }
    }

    /// Whether the origin answers (for `/readyz`); bypasses the breaker so recovery shows.
    pub async fn ping(&self) -> Result<(), OriginError> {
        match tokio::time::timeout(self.timeout, self.origin.ping()).await {
            Ok(result) => result,
            Err(_) => Err(OriginError::Timeout(self.timeout)),
        }
    }

    async fn call<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, OriginError>>,
    ) -> Result<T, OriginError> {
        self.call_within(op, self.timeout, fut).await
    }

    async fn call_within<T>(
        &self,
        op: &'static str,
        timeout: Duration,
        fut: impl std::future::Future<Output = Result<T, OriginError>>,
    ) -> Result<T, OriginError> {
        let started = Instant::now();
        if !self.breaker.allow(started) {
            self.metrics
                .origin_call(op, Err("circuit_open"), started.elapsed());
            return Err(OriginError::CircuitOpen);
        }
        let result = match tokio::time::timeout(timeout, fut).await {
            Ok(result) => result,
            Err(_) => Err(OriginError::Timeout(timeout)),
        };
        self.breaker.record(result.is_ok(), Instant::now());
        self.metrics.origin_call(
            op,
            result.as_ref().map(|_| ()).map_err(OriginError::kind),
            started.elapsed(),
        );
        result
    }
}
