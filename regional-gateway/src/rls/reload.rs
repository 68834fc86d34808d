//! Hot reload of `--rls-config`, as envoyproxy/ratelimit users expect: the file (or every file
//! of the directory) is read again each second and on SIGHUP; what changed is loaded and put in
//! force for the calls after. A text that does not load leaves the last good configuration in
//! force, and is logged with the field at fault and counted
//! (`strata_rls_config_reloads_total{result="failed"}`, `strata_rls_config_broken`) once per
//! change, not once per second.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::watch;

use super::{RlsConfig, RlsService};

/// How often the files are compared with what was last read.
pub const RELOAD_POLL: Duration = Duration::from_secs(1);

/// Reloads `path` into `service` until `stopped` turns true. The text read first is taken for
/// the one the configuration in force was loaded from at start.
pub async fn reload_loop(
    service: Arc<RlsService>,
    path: PathBuf,
    mut stopped: watch::Receiver<bool>,
) {
    let mut seen = RlsConfig::read(&path).map_err(|e| e.to_string());
    let mut hangup = match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP: --rls-config reloads only when it changes");
            None
        }
    };
    let mut tick = tokio::time::interval(RELOAD_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let forced = tokio::select! {
            _ = tick.tick() => false,
            () = hangup_of(&mut hangup) => true,
            _ = stopped.wait_for(|&s| s) => return,
        };
        let now = RlsConfig::read(&path).map_err(|e| e.to_string());
        if now == seen && !forced {
            continue;
        }
        let loaded = match &now {
            Ok(files) => RlsConfig::from_files(&path, files).map_err(|e| e.to_string()),
            Err(e) => Err(e.clone()),
        };
        seen = now;
        let metrics = &service.gateway.limiter.metrics;
        match loaded {
            Ok(config) => {
                let domains = config.domains().join(",");
                service.replace_config(Arc::new(config));
                metrics.rls_reload(true);
                tracing::info!(path = %path.display(), %domains, forced, "--rls-config reloaded");
            }
            Err(error) => {
                metrics.rls_reload(false);
                tracing::warn!(%error, "--rls-config does not load: the last good configuration stays in force");
            }
        }
    }
}

/// The next SIGHUP; never, without a handler.
async fn hangup_of(hangup: &mut Option<Signal>) {
    match hangup {
        Some(s) => {
            if s.recv().await.is_none() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending::<()>().await,
    }
}
