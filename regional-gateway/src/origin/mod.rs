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
    /// Regional counts of `cells`, in order (0 for a cell never written or expired).
    async fn read(&self, cells: &[CellRead<'_>], now_ms: u64) -> Result<Vec<u64>, OriginError> {
        match self {
            Origin::Memory(m) => Ok(m.read(cells, now_ms)),
            Origin::Redis(r) => r.read(cells).await,
        }
    }

    /// Adds each increment and returns each cell's count after it, in order.
    async fn replay(
        &self,
        cells: &[CellIncrement<'_>],
        now_ms: u64,
    ) -> Result<Vec<u64>, OriginError> {
        match self {
            Origin::Memory(m) => Ok(m.replay(cells, now_ms)),
            Origin::Redis(r) => r.replay(cells).await,
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
    pub async fn read(&self, cells: &[CellRead<'_>], now_ms: u64) -> Result<Vec<u64>, OriginError> {
        self.call("read", self.origin.read(cells, now_ms)).await
    }

    /// See [`Origin::replay`].
    pub async fn replay(
        &self,
        cells: &[CellIncrement<'_>],
        now_ms: u64,
    ) -> Result<Vec<u64>, OriginError> {
        self.call("replay", self.origin.replay(cells, now_ms)).await
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
        let started = Instant::now();
        if !self.breaker.allow(started) {
            self.metrics
                .origin_call(op, Err("circuit_open"), started.elapsed());
            return Err(OriginError::CircuitOpen);
        }
        let result = match tokio::time::timeout(self.timeout, fut).await {
            Ok(result) => result,
            Err(_) => Err(OriginError::Timeout(self.timeout)),
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
