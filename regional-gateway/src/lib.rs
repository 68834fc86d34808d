//! `strata-gateway`: the native process each region runs. It is the regional origin the
//! edges talk to (over Redis, or its own memory when embedded), and decides for services that
//! call it directly, with the same layering as an edge. Every rule lives in `strata-core`.
//!
//! | module | holds |
//! | --- | --- |
//! | [`config`] | flags, environment, TOML file; validation |
//! | [`api`] | routes, the JSON body extractor, handlers, the OpenAPI description |
//! | [`auth`] | bearer tokens → workspaces |
//! | [`rls`] | Envoy's rate-limit service (gRPC) and its descriptor configuration |
//! | [`listener`] | the listeners' bounds: connections open at once, read and idle timeouts, accept backoff |
//! | [`limiter`] | the decision flow over the core's request path, and replay |
//! | [`local`] | the core's table, sharded behind mutexes |
//! | [`origin`] | the regional origin backends, with timeout, breaker and metrics |
//! | [`breaker`] | the failure-ratio circuit breaker |
//! | [`metrics`] | Prometheus metrics (`prometheus-client`), their handles kept for the request path |
//! | [`clock`] | system or manual time |
//! | [`error`] | the API error type |

pub mod api;
pub mod auth;
pub mod breaker;
pub mod clock;
pub mod config;
pub mod error;
pub mod global;
pub mod limiter;
pub mod listener;
pub mod local;
pub mod metrics;
pub mod origin;
pub mod rls;
pub mod steps;

use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use strata_core::origin::OriginPolicy;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::auth::Auth;
use crate::clock::Clock;
use crate::config::Settings;
use crate::global::{Global, Store, StoreError, create_sqlite_dir};
use crate::limiter::Limiter;
use crate::listener::BoundedListener;
use crate::local::LocalTables;
use crate::metrics::Metrics;
use crate::origin::{MemoryOrigin, Origin, OriginClient, RedisOrigin};
use crate::rls::RlsService;

/// How often expired cells leave local memory and the embedded origin.
const JANITOR_INTERVAL: Duration = Duration::from_secs(10);

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The origin could not be set up.
    #[error("cannot set up the regional origin: {0}")]
    Origin(String),
    /// The global table could not be set up.
    #[error("cannot set up the global table: {0}")]
    Database(String),
}

/// Everything a request handler needs.
#[derive(Debug)]
pub struct Gateway {
    /// Validated settings.
    pub settings: Settings,
    /// Token table.
    pub auth: Auth,
    /// The decision flow and the origin.
    pub limiter: Arc<Limiter>,
    /// Every metric `/metrics` exports: the limiter's and the global layer's.
    pub registry: prometheus_client::registry::Registry,
    origin_up: AtomicBool,
}

impl Gateway {
    /// Builds a gateway from settings, with the given clock.
    pub async fn new(settings: Settings, clock: Clock) -> Result<Arc<Self>, StartError> {
        let metrics = Arc::new(Metrics::default());
        // The connection's own bound is the longest a call may take, a replay's: the origin
        // client bounds each call by its own (a decision by the origin timeout), and a call
        // given up on leaves the connection, and the commands of others on it, as they are.
        let link = origin::replay_bound(settings.origin_timeout);
        let origin = match (&settings.redis_url, settings.redis_cluster.as_slice()) {
            (Some(url), _) => Origin::Redis(
                RedisOrigin::new(url, link).map_err(|e| StartError::Origin(e.to_string()))?,
            ),
            (None, []) => Origin::Memory(MemoryOrigin::new()),
            (None, seeds) => Origin::Redis(
                RedisOrigin::cluster(seeds, link).map_err(|e| StartError::Origin(e.to_string()))?,
            ),
        };
        let policy = OriginPolicy {
            lease_ms: u64::try_from(settings.fresh_for.as_millis()).unwrap_or(u64::MAX),
            read_retry_ms: u64::try_from(settings.read_retry.as_millis()).unwrap_or(u64::MAX),
            failure_mode: settings.failure_mode,
        };
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let store = Store::connect(
            &settings.database_url,
            settings.origin_timeout.max(Duration::from_secs(2)),
        )
        .map_err(|e| StartError::Database(e.to_string()))?;
        create_sqlite_dir(&settings.database_url).map_err(StartError::Database)?;
        match store.migrate().await {
            Ok(_) => {}
            Err(e @ StoreError::Newer { .. }) => return Err(StartError::Database(e.to_string())),
            // Decisions never wait on the database: start, and let the loops retry.
            Err(e) => {
                tracing::warn!(error = %e, "global table not reachable at start-up; flush and sync will retry")
            }
        }
        let global = Global::new(
            store,
            settings.region.clone(),
            settings.publish,
            settings.table_capacity,
            settings.sync_full_interval,
        );
        let limiter = Limiter::new(
            LocalTables::new(settings.table_capacity, threads * 8, policy),
            OriginClient::new(
                origin,
                settings.origin_timeout,
                policy.lease_ms,
                metrics.clone(),
            ),
            metrics,
            clock,
            global,
            threads * 4,
        );
        let mut registry = prometheus_client::registry::Registry::default();
        limiter.metrics.register(&mut registry);
        limiter.global.register(&mut registry);
        Ok(Arc::new(Self {
            auth: Auth::new(settings.tokens.clone()),
            settings,
            limiter,
            registry,
            origin_up: AtomicBool::new(true),
        }))
    }

    fn set_origin_up(&self, up: bool) {
        self.origin_up.store(up, Ordering::Relaxed);
    }

    fn origin_up(&self) -> bool {
        self.origin_up.load(Ordering::Relaxed)
    }
}

/// The router over a gateway (for tests that drive it without a socket).
pub fn app(gateway: Arc<Gateway>) -> axum::Router {
    api::router(gateway)
}

/// Where a gateway serves: the HTTP API, and Envoy's rate-limit service when it is on.
#[derive(Debug)]
pub struct Listeners {
    /// The HTTP API.
    pub http: TcpListener,
    /// The rate-limit service (gRPC), with `--rls-listen`.
    pub rls: Option<TcpListener>,
}

impl Listeners {
    /// Binds what `settings` ask for; an error names the address that could not be bound.
    pub async fn bind(settings: &Settings) -> Result<Self, (SocketAddr, std::io::Error)> {
        let http = TcpListener::bind(settings.listen)
            .await
            .map_err(|e| (settings.listen, e))?;
        let rls = match &settings.rls {
            Some(r) => Some(
                TcpListener::bind(r.listen)
                    .await
                    .map_err(|e| (r.listen, e))?,
            ),
            None => None,
        };
        Ok(Self { http, rls })
    }
}

/// Serves `gateway` on `listeners` until `shutdown` completes, with the replay and janitor
/// loops alongside; on shutdown, stops accepting and gives in-flight requests up to
/// `--shutdown-timeout` (a client that stalls cannot hold the process: its connection is
/// closed then), drains the replay buffer to the origin, then flushes to the global table a last
/// time (after the drain, so what it delivered is published too).
pub async fn run(
    gateway: Arc<Gateway>,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (stop, stopped) = watch::channel(false);
    let (quit, quitting) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = quit.send(true);
    });
    let replay = tokio::spawn(replay_loop(gateway.clone(), stopped.clone()));
    let janitor = tokio::spawn(janitor_loop(gateway.clone(), stopped.clone()));
    let publish = tokio::spawn(publish_loop(gateway.clone(), stopped.clone()));
    let sync = tokio::spawn(sync_loop(gateway.clone(), stopped.clone()));
    let limits = gateway.settings.connections;
    let rls = match (listeners.rls, &gateway.settings.rls) {
        (Some(listener), Some(settings)) => {
            let service = RlsService::new(gateway.clone(), settings);
            if let Some(path) = &settings.path {
                tokio::spawn(rls::reload::reload_loop(
                    service.clone(),
                    path.clone(),
                    stopped.clone(),
                ));
            }
            // gRPC keeps Envoy's connections open and multiplexes calls on them: a call is
            // bounded as a whole (`--read-timeout`), idle connections are kept (pinged, so a
            // peer that vanished is dropped), and only the bound on connections is the
            // listener's.
            let incoming = BoundedListener::new(
                listener,
                listener::ConnectionLimits {
                    read_timeout: None,
                    idle_timeout: None,
                    ..limits
                },
            )
            .incoming();
            let mut server = tonic::transport::Server::builder()
                .http2_keepalive_interval(Some(Duration::from_secs(30)));
            if let Some(t) = limits.read_timeout {
                server = server.timeout(t);
            }
            Some(tokio::spawn(
                server
                    .add_service(RlsService::server(service))
                    .serve_with_incoming_shutdown(incoming, changed(quitting.clone())),
            ))
        }
        _ => None,
    };
    let http = tokio::spawn(
        axum::serve(
            BoundedListener::new(listeners.http, limits),
            app(gateway.clone()),
        )
        .with_graceful_shutdown(changed(quitting.clone()))
        .into_future(),
    );
    changed(quitting).await;
    // In-flight requests get the rest of the deadline; connections still open past it (a
    // client that stalls mid-request, or never reads its answer) are closed.
    let deadline = tokio::time::Instant::now() + gateway.settings.shutdown_timeout;
    let served = match finish_by(http, deadline, "the HTTP API").await {
        Some(Ok(served)) => served,
        Some(Err(e)) => {
            tracing::error!(error = %e, "the HTTP API ended abnormally");
            Ok(())
        }
        None => Ok(()),
    };
    if let Some(rls) = rls {
        match finish_by(rls, deadline, "the rate-limit service").await {
            Some(Ok(Ok(()))) | None => {}
            Some(Ok(Err(e))) => tracing::error!(error = %e, "the rate-limit service failed"),
            Some(Err(e)) => tracing::error!(error = %e, "the rate-limit service ended abnormally"),
        }
    }
    let _ = stop.send(true);
    let _ = janitor.await;
    if replay.await.is_err() {
        tracing::error!("replay loop ended abnormally");
    }
    let _ = publish.await;
    let _ = sync.await;
    if let Err(e) = gateway
        .limiter
        .global
        .flush_once(gateway.limiter.clock.now_ms())
        .await
    {
        tracing::warn!(error = %e, "shutdown: last global flush failed");
    }
    served
}

/// `server`'s end, awaited until `deadline`; past it the server's task is aborted and `None`
/// returned. Connections it spawned still open are no longer waited for: the process closes them
/// as it exits, after the replay drain and the last flush.
async fn finish_by<T>(
    mut server: tokio::task::JoinHandle<T>,
    deadline: tokio::time::Instant,
    what: &str,
) -> Option<Result<T, tokio::task::JoinError>> {
    match tokio::time::timeout_at(deadline, &mut server).await {
        Ok(joined) => Some(joined),
        Err(_) => {
            server.abort();
            tracing::warn!(
                server = what,
                "shutdown: requests still open at --shutdown-timeout; their connections are closed"
            );
            None
        }
    }
}

/// Completes when `flag` turns true (or its sender is gone).
async fn changed(mut flag: watch::Receiver<bool>) {
    let _ = flag.wait_for(|&set| set).await;
}

/// The replay on the core's flow (`limiter::ReplayPump`): a pass when the flow says one is
/// due (every interval; after a failed batch, the core's backoff: the interval doubling, at
/// most 5 s, as in the Wasm shells), then, on shutdown, whatever is left, in full.
async fn replay_loop(gateway: Arc<Gateway>, mut stopped: watch::Receiver<bool>) {
    let limiter = &gateway.limiter;
    let interval = gateway.settings.replay_interval;
    let interval_ms = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
    let mut pump = limiter::ReplayPump::new(limiter, interval_ms, gateway.settings.flush_ms());
    loop {
        // The flow's times are the limiter's clock's; the wait is real time, at most an
        // interval (a clock set by hand moves on its own schedule).
        let now = limiter.clock.now_ms();
        let wait = pump
            .next_at()
            .map_or(interval_ms, |at| at.saturating_sub(now))
            .min(interval_ms);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
            _ = stopped.changed() => break,
        }
        pump.pass(limiter).await;
    }
    let pending = gateway.limiter.unreplayed();
    while gateway.limiter.unreplayed() > 0 {
        if !gateway.limiter.replay_once().await {
            break;
        }
    }
    let left = gateway.limiter.unreplayed();
    if left > 0 {
        tracing::error!(
            cells = left,
            "shutdown: replay could not be delivered; these counts are lost"
        );
    } else {
        tracing::info!(cells = pending, "shutdown: replay delivered");
    }
}

/// A cadence anchored to absolute targets: the target advances by whole intervals (a slow run
/// does not drift it), and each firing adds a fresh random share of `jitter` so a fleet's
/// gateways do not flush in lockstep. Each cadence keeps its own pending firing: computing it
/// again on every loop pass would skip one cadence's firing whenever another's fired first.
struct Cadence {
    target: tokio::time::Instant,
    interval: Duration,
    jitter: f64,
    due: tokio::time::Instant,
}

impl Cadence {
    fn new(start: tokio::time::Instant, interval: Duration, jitter: f64) -> Self {
        let mut c = Self {
            target: start,
            interval,
            jitter,
            due: start,
        };
        c.advance(start);
        c
    }

    /// Schedules the firing after the one that just happened at `now` (or after the start).
    fn advance(&mut self, now: tokio::time::Instant) {
        while self.target <= now {
            self.target += self.interval;
        }
        self.due = self.target + self.interval.mul_f64(self.jitter * rand::random::<f64>());
    }
}

/// How long an early flush waits for other cells crossing the floor, to write them together.
const EARLY_FLUSH_GATHER: Duration = Duration::from_millis(5);
/// The least time between two flushes when one is early: a stream of cells crossing the floor
/// costs at most two statements a second more.
const EARLY_FLUSH_SPACING: Duration = Duration::from_millis(500);
/// How often a gateway says its region publishes and counts the regions that do (two short
/// statements); a region unseen for three times as long no longer shares the floor.
const ANNOUNCE_INTERVAL: Duration = Duration::from_secs(10);
/// The second announcement's delay after the first: a region started beside this one has
/// announced by then, and two announcements finding none make the region alone
/// (`Global::alone`) within seconds of the start rather than an interval.
const ANNOUNCE_RECHECK: Duration = Duration::from_secs(2);

/// Flush, announce and cleanup of the global table, each on its own cadence, and a flush soon
/// after a cell becomes worth publishing (other regions should not wait a tick to learn of it);
/// errors are logged, counted and retried on the next tick. (`run` flushes a last time after
/// the replay drain.) The sync runs beside it ([`sync_loop`]): across regions each statement is
/// a round trip, and a sync waiting behind a flush would delay what the region learns.
async fn publish_loop(gateway: Arc<Gateway>, mut stopped: watch::Receiver<bool>) {
    let s = &gateway.settings;
    let start = tokio::time::Instant::now();
    let mut flush = Cadence::new(start, s.flush_interval, s.sync_jitter);
    let mut clean = Cadence::new(start, s.cleanup_interval, 0.0);
    let mut announce = Cadence::new(start, ANNOUNCE_INTERVAL, s.sync_jitter);
    announce.due = start;
    let mut announced = false;
    let mut last_flush = start;
    let mut migrated = false;
    loop {
        let limiter = &gateway.limiter;
        let global = &limiter.global;
        if !migrated {
            migrated = global.store.migrate().await.is_ok();
        }
        tokio::select! {
            _ = tokio::time::sleep_until(flush.due) => {
                if let Err(e) = global.flush_once(limiter.clock.now_ms()).await {
                    tracing::warn!(error = %e, "global flush failed; retrying next tick");
                }
                last_flush = tokio::time::Instant::now();
                flush.advance(tokio::time::Instant::now());
            }
            _ = global.publish_soon.notified() => {
                let at = (last_flush + EARLY_FLUSH_SPACING)
                    .max(tokio::time::Instant::now() + EARLY_FLUSH_GATHER);
                tokio::select! {
                    _ = tokio::time::sleep_until(at) => {}
                    _ = stopped.changed() => break,
                }
                if let Err(e) = global.flush_once(limiter.clock.now_ms()).await {
                    tracing::warn!(error = %e, "early global flush failed; retrying next tick");
                }
                last_flush = tokio::time::Instant::now();
            }
            _ = tokio::time::sleep_until(announce.due), if migrated => {
                let live_ms = 3 * u64::try_from(ANNOUNCE_INTERVAL.as_millis()).unwrap_or(u64::MAX);
                match global.announce(limiter.clock.now_ms(), live_ms).await {
                    Ok(regions) => tracing::debug!(regions, "regions sharing the publish floor"),
                    Err(e) => tracing::warn!(error = %e, "announcing the region failed"),
                }
                announce.advance(tokio::time::Instant::now());
                if !announced {
                    announce.due = announce.due.min(tokio::time::Instant::now() + ANNOUNCE_RECHECK);
                    announced = true;
                }
            }
            _ = tokio::time::sleep_until(clean.due) => {
                match global.store.cleanup(limiter.clock.now_ms(), 1_000, 10).await {
                    Ok(n) if n > 0 => tracing::debug!(rows = n, "global cleanup"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "global cleanup failed"),
                }
                clean.advance(tokio::time::Instant::now());
            }
            _ = stopped.changed() => break,
        }
    }
}

/// Imports the other regions' counts on the sync cadence; errors are logged, counted and
/// retried on the next tick.
async fn sync_loop(gateway: Arc<Gateway>, mut stopped: watch::Receiver<bool>) {
    let s = &gateway.settings;
    let mut sync = Cadence::new(tokio::time::Instant::now(), s.sync_interval, s.sync_jitter);
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(sync.due) => {}
            _ = stopped.changed() => break,
        }
        let limiter = &gateway.limiter;
        if let Err(e) = limiter
            .global
            .sync_once(&limiter.local, limiter.clock.now_ms())
            .await
        {
            tracing::warn!(error = %e, "global sync failed; retrying next tick");
        }
        sync.advance(tokio::time::Instant::now());
    }
}

async fn janitor_loop(gateway: Arc<Gateway>, mut stopped: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(JANITOR_INTERVAL);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped.changed() => break,
        }
        let p = gateway.limiter.janitor_pass().await;
        if p.local + p.origin + p.view > 0 {
            tracing::debug!(
                local = p.local,
                origin = p.origin,
                view = p.view,
                steps = p.steps,
                "janitor dropped expired cells"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Flush and sync share an interval by default: each must fire every period (recomputing
    /// both deadlines on every loop pass skipped one whenever the other fired first).
    #[test]
    fn cadences_sharing_an_interval_each_fire_every_period() {
        let start = tokio::time::Instant::now();
        let second = Duration::from_secs(1);
        let (mut flush, mut sync) = (
            Cadence::new(start, second, 0.2),
            Cadence::new(start, second, 0.2),
        );
        let (mut flushes, mut syncs) = (0, 0);
        // The loop's `select!` on a clock of the test's: wake at the earlier deadline, run that
        // branch alone, schedule it again from then.
        let mut now = start;
        while now < start + 10 * second {
            now = flush.due.min(sync.due);
            if flush.due <= sync.due {
                flushes += 1;
                flush.advance(now);
            } else {
                syncs += 1;
                sync.advance(now);
            }
        }
        assert!(
            flushes >= 9 && syncs >= 9,
            "flushes {flushes}, syncs {syncs}"
        );
    }
}
