//! The regional origin: where the processes of one region converge. Redis in production, or
//! the gateway's own memory when embedded. Both count regional usage per cell; the gateway
//! wraps them with a timeout and a circuit breaker (`OriginClient`).

pub mod memory;
pub mod redis;

use std::time::{Duration, Instant};

use strata_core::WindowKeyRef;

use crate::breaker::Breaker;
use crate::metrics::Metrics;

pub use memory::{MemoryOrigin, PurgeCursor};
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
    /// The connection failed, or the backend could not be reached: transient.
    #[error("{0}")]
    Backend(String),
    /// The backend answered, with an error about this request's data (a cell holding a value
    /// of another type, say): the origin is up, so the breaker does not count it.
    #[error("{0}")]
    Rejected(String),
}

impl OriginError {
    /// Label for metrics and client messages.
    pub fn kind(&self) -> &'static str {
        match self {
            OriginError::Timeout(_) => "timeout",
            OriginError::CircuitOpen => "circuit_open",
            OriginError::Backend(_) => "backend",
            OriginError::Rejected(_) => "rejected",
        }
    }

    /// Whether it says the origin may be unavailable (the breaker counts these).
    pub fn is_transient(&self) -> bool {
        !matches!(self, OriginError::Rejected(_))
    }
}

/// One cell to read: a window key and a sequence.
pub type CellRead<'a> = (WindowKeyRef<'a>, u64);

pub use strata_core::ledger::{DecideAnswer, DecideLimit, DecideOutcome};

/// A process's own cumulative count of one cell, to merge with `max`.
#[derive(Clone, Copy, Debug)]
pub struct CellUsed<'a> {
    /// The window key.
    pub key: WindowKeyRef<'a>,
    /// The window's sequence.
    pub sequence: u64,
    /// The process's cumulative count of the cell.
    pub used: u64,
    /// The id of the lease the process gives back on the cell (0: none).
    pub release: u64,
    /// The id of the live lease the process asks to keep reserved for another lifetime (0:
    /// none).
    pub renew: u64,
    /// The largest count the process knows the origin acknowledged (0: unknown): Redis adds
    /// the difference at once when its record agrees.
    pub acked: u64,
    /// Undo what the process's last counted call did, if its id is this (0: nothing): its
    /// answer was lost.
    pub undo_from: u64,
}

/// One replayed cell as the origin answers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replayed {
    /// The cell's count after the merge.
    pub count: u64,
    /// The new id of the lease the replay asked to renew (0: not renewed: it was no longer
    /// live, or none was asked).
    pub renewed: u64,
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
    /// Regional counts of `cells` (0 for a cell never written or expired), in order.
    async fn read(&self, cells: &[CellRead<'_>], now_ms: u64) -> Result<Vec<u64>, OriginError> {
        match self {
            Origin::Memory(m) => Ok(m.read(cells, now_ms)),
            Origin::Redis(r) => r.read(cells).await,
        }
    }

    /// Merges `instance`'s own counts with `max`, renews the leases asked for (reserved for
    /// another `lease_ms`), and returns each cell's count after it (`None` for a cell that
    /// failed alone).
    async fn replay(
        &self,
        instance: &str,
        cells: &[CellUsed<'_>],
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<Vec<Option<Replayed>>, OriginError> {
        match self {
            Origin::Memory(m) => Ok(m
                .replay(instance, cells, now_ms, lease_ms)
                .into_iter()
                .map(Some)
                .collect()),
            Origin::Redis(r) => r.replay(instance, cells, lease_ms).await,
        }
    }

    /// Decides the limits atomically at the origin (all or nothing), counts on a pass and
    /// grants leases of `lease_ms`.
    async fn decide(
        &self,
        instance: &str,
        limits: &[DecideLimit<'_>],
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<DecideAnswer, OriginError> {
        match self {
            Origin::Memory(m) => Ok(m.decide(instance, limits, now_ms, lease_ms)),
            Origin::Redis(r) => r.decide(instance, limits, now_ms, lease_ms).await,
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

/// How long a replay may take where a decision may take `timeout`: the core's bound
/// ([`strata_core::driver::replay_timeout_ms`]), which the Wasm shells give theirs too.
pub fn replay_bound(timeout: Duration) -> Duration {
    let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    Duration::from_millis(strata_core::driver::replay_timeout_ms(timeout_ms))
}

/// The origin as the gateway calls it: bounded by a timeout, guarded by a breaker, measured.
#[derive(Debug)]
pub struct OriginClient {
    origin: Origin,
    timeout: Duration,
    /// How long the leases this origin grants may be used.
    lease_ms: u64,
    breaker: Breaker,
    metrics: std::sync::Arc<Metrics>,
}

impl OriginClient {
    /// Wraps a backend.
    pub fn new(
        origin: Origin,
        timeout: Duration,
        lease_ms: u64,
        metrics: std::sync::Arc<Metrics>,
    ) -> Self {
        Self {
            origin,
            timeout,
            lease_ms,
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

    /// See [`Origin::replay`]: bounded by [`replay_timeout`](Self::replay_timeout), as a
    /// Wasm shell bounds the replay it sends here.
    pub async fn replay(
        &self,
        instance: &str,
        cells: &[CellUsed<'_>],
        now_ms: u64,
    ) -> Result<Vec<Option<Replayed>>, OriginError> {
        let replay = self.origin.replay(instance, cells, now_ms, self.lease_ms);
        let bound = self.replay_timeout();
        self.bounded("replay", replay, bound, bound).await
    }

    /// How long a call may take before it counts as failed.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How long a replay may take: [`replay_bound`] of the timeout.
    pub fn replay_timeout(&self) -> Duration {
        replay_bound(self.timeout)
    }

    /// How long the leases this origin grants may be used.
    pub fn lease_ms(&self) -> u64 {
        self.lease_ms
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

    /// [`decide`](Self::decide) for requests that have only `bound` left of their time
    /// (at most the timeout).
    pub async fn decide_within(
        &self,
        instance: &str,
        limits: &[DecideLimit<'_>],
        now_ms: u64,
        bound: Duration,
    ) -> Result<DecideAnswer, OriginError> {
        let decide = self.origin.decide(instance, limits, now_ms, self.lease_ms);
        self.bounded("decide", decide, bound.min(self.timeout), self.timeout)
            .await
    }

    /// Drops expired cells held in process memory (the embedded origin), one step of a pass
    /// ([`MemoryOrigin::purge_expired`]); Redis expires its own.
    pub fn purge_expired(
        &self,
        now_ms: u64,
        from: PurgeCursor,
        max: usize,
    ) -> (usize, Option<PurgeCursor>) {
        match &self.origin {
            Origin::Memory(m) => m.purge_expired(now_ms, from, max),
            Origin::Redis(_) => (0, None),
        }
    }

    /// Whether the origin answers (for `/readyz`); bypasses the breaker so recovery shows.
    pub async fn ping(&self) -> Result<(), OriginError> {
        match tokio::time::timeout(self.timeout, self.origin.ping()).await {
            Ok(result) => result,
            Err(_) => Err(OriginError::Timeout(self.timeout)),
        }
    }

    /// One origin call: refused fast while the breaker is open, bounded by the timeout,
    /// recorded in the breaker and the metrics.
    async fn call<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, OriginError>>,
    ) -> Result<T, OriginError> {
        self.bounded(op, fut, self.timeout, self.timeout).await
    }

    /// [`call`](Self::call) bounded by `timeout`, where a call of its kind may take `full`. A
    /// call cut short by a bound below that fails as a timeout but does not move the breaker:
    /// it says how little time its requests had left, not that the origin is down.
    async fn bounded<T>(
        &self,
        op: &'static str,
        fut: impl std::future::Future<Output = Result<T, OriginError>>,
        timeout: Duration,
        full: Duration,
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
        // Only failures that say the origin may be down move the breaker: one poisoned cell
        // answered with an error must not send every other key to local fallback.
        let up = result.as_ref().map_or_else(|e| !e.is_transient(), |_| true);
        let cut_short = timeout < full && matches!(result, Err(OriginError::Timeout(_)));
        if !cut_short {
            self.breaker.record(up, Instant::now());
        }
        self.metrics.origin_call(
            op,
            result.as_ref().map(|_| ()).map_err(OriginError::kind),
            started.elapsed(),
        );
        result
    }
}
