//! `strata-gateway`: parse settings, set up logging, serve until SIGTERM or Ctrl-C.

use std::process::ExitCode;

use clap::Parser;
use strata_gateway::clock::Clock;
use strata_gateway::config::{Cli, Settings};
use strata_gateway::{Gateway, run};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("STRATA_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let settings = match Settings::from_cli(Cli::parse()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("strata-gateway: {e}");
            return ExitCode::from(2);
        }
    };
    let listen = settings.listen;
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("strata-gateway: cannot listen on {listen}: {e}");
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
    tracing::info!(%listen, %region, origin = gateway.limiter.origin.kind(), "strata-gateway listening");
    match run(gateway, listener, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("strata-gateway: server error: {e}");
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
