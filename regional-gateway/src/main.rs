//! `strata-gateway`: parse settings, set up logging, serve until SIGTERM or Ctrl-C.

use std::process::ExitCode;

use clap::Parser;
use strata_gateway::clock::Clock;
use strata_gateway::config::{Cli, Settings, Task};
use strata_gateway::global::{Store, create_sqlite_dir};
use strata_gateway::{Gateway, Listeners, run};
use tracing_subscriber::EnvFilter;

/// mimalloc, not glibc's malloc: at 10,000 keys glibc took 0.20 to 0.49 us a request from one
/// run to the next, as its free lists lay (it merges them before a kilobyte-sized allocation,
/// and a request makes some), mimalloc 0.13 to 0.21 us (`scripts/profile.sh`;
/// `docs/BENCHMARKS.md`, eighth pass).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    // Logs go to stderr (stdout stays free for a subcommand's output), coloured only on a
    // terminal.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            EnvFilter::try_from_env("STRATA_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let task = cli.task;
    let settings = match Settings::from_cli(cli) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("strata-gateway: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(task) = task {
        return run_task(task, &settings).await;
    }
    let listen = settings.listen;
    let listeners = match Listeners::bind(&settings).await {
        Ok(l) => l,
        Err((address, e)) => {
            eprintln!("strata-gateway: cannot listen on {address}: {e}");
            return ExitCode::from(1);
        }
    };
    let region = settings.region.clone();
    let gateway = match Gateway::new(settings, Clock::system()).await {
        Ok(g) => g,
        Err(e) => {
            eprintln!("strata-gateway: {e}");
            return ExitCode::from(1);
        }
    };
    let rls = gateway.settings.rls.as_ref().map(|r| r.listen.to_string());
    tracing::info!(%listen, rls = rls.as_deref().unwrap_or("off"), %region, origin = gateway.limiter.origin.kind(), "strata-gateway listening");
    match run(gateway, listeners, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("strata-gateway: server error: {e}");
            ExitCode::from(1)
        }
    }
}

/// `migrate` or `cleanup`, then exit (for a deploy step or an external scheduler).
async fn run_task(task: Task, settings: &Settings) -> ExitCode {
    if let Err(e) = create_sqlite_dir(&settings.database_url) {
        eprintln!("strata-gateway: {e}");
        return ExitCode::from(1);
    }
    let store = match Store::connect(&settings.database_url, std::time::Duration::from_secs(10)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("strata-gateway: {e}");
            return ExitCode::from(1);
        }
    };
    let result = match task {
        Task::Migrate => store
            .migrate()
            .await
            .map(|n| format!("applied {n} migration(s)")),
        Task::Cleanup => {
            let now = strata_gateway::clock::Clock::system().now_ms();
            store
                .cleanup(now, 10_000, 1_000)
                .await
                .map(|n| format!("deleted {n} expired row(s)"))
        }
    };
    match result {
        Ok(message) => {
            println!("strata-gateway: {message} ({})", store.dialect());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("strata-gateway: {e}");
            ExitCode::from(1)
        }
    }
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM; Ctrl-C only");
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutting down: finishing requests, draining replay");
}
