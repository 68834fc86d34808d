//! `strata-lab <scenario>...`: runs scenarios on real gateway processes and prints their
//! figures; `strata-lab list` names them, `all` runs every one, `quick` the test command's.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use strata_lab::scenario::{self, QUICK};
use strata_lab::shells::Through;
use strata_lab::stack::StackOptions;
use strata_lab::wan::Link;
use strata_lab::{Options, report::Report};

/// The Strata accuracy lab: regions of real gateway processes on loopback, driven and measured.
#[derive(Debug, Parser)]
#[command(name = "strata-lab")]
struct Cli {
    /// Scenario names, `all` (every scenario), `quick` (the test command's, shortened) or
    /// `list`.
    #[arg(required = true)]
    scenarios: Vec<String>,
    /// Run the scenarios with their traffic shortened (the test command's run).
    #[arg(long)]
    quick: bool,
    /// Where the JSON results and SVG plots are written.
    #[arg(long, default_value = "lab-results")]
    out: PathBuf,
    /// The gateway binary [default: strata-gateway beside this binary].
    #[arg(long)]
    gateway: Option<PathBuf>,
    /// An argument for every gateway (repeat it: `--gateway-arg=--flush-interval=1s`).
    #[arg(long = "gateway-arg", allow_hyphen_values = true)]
    gateway_args: Vec<String>,
    /// The global store on a MySQL/MariaDB server (`mysql://root@127.0.0.1:3306`; the lab
    /// creates a database per run and drops it) instead of an SQLite file.
    #[arg(long)]
    mysql: Option<String>,
    /// Puts the global store across a simulated WAN from every region: each region's gateways
    /// reach it through a proxy that holds each chunk this long each way (`50ms`; needs
    /// `--mysql`).
    #[arg(long, value_parser = humantime::parse_duration)]
    wan: Option<Duration>,
    /// The WAN's jitter: each chunk's delay is `--wan` plus or minus up to this [default: a
    /// tenth of `--wan`].
    #[arg(long, value_parser = humantime::parse_duration, requires = "wan")]
    wan_jitter: Option<Duration>,
    /// What the traffic enters through: each gateway's API, or a workerd edge (the built
    /// bundle, `scripts/build-edge.sh`) in front of each gateway.
    #[arg(long, value_enum, default_value = "gateway")]
    through: Through,
    /// The publish floor the gateways run with, where the propagation delay is measured from.
    #[arg(long, default_value_t = 0.2)]
    floor: f64,
}

fn default_gateway() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("strata-gateway")))
        .unwrap_or_else(|| PathBuf::from("strata-gateway"))
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut names: Vec<String> = Vec::new();
    let mut quick = cli.quick;
    for name in &cli.scenarios {
        match name.as_str() {
            "list" => {
                // A closed pipe (`| head`) ends the listing quietly.
                let mut out = std::io::stdout().lock();
                for s in scenario::all() {
                    let line = format!("{:<16} {}\n{:<16} {}", s.name, s.about, "", s.parameters());
                    if writeln!(out, "{line}").is_err() {
                        break;
                    }
                }
                return ExitCode::SUCCESS;
            }
            "all" => names.extend(scenario::all().iter().map(|s| s.name.to_string())),
            "quick" => {
                quick = true;
                names.extend(QUICK.iter().map(|s| s.to_string()));
            }
            other => names.push(other.to_string()),
        }
    }
    let mut scenarios = Vec::new();
    for name in &names {
        match scenario::named(name, quick) {
            Some(s) => scenarios.push(s),
            None => {
                eprintln!("strata-lab: no scenario named {name:?} (strata-lab list names them)");
                return ExitCode::from(2);
            }
        }
    }
    let gateway = cli.gateway.unwrap_or_else(default_gateway);
    if !gateway.exists() {
        eprintln!(
            "strata-lab: {} is missing: build it (cargo build --release -p strata-gateway) or pass --gateway",
            gateway.display()
        );
        return ExitCode::from(2);
    }
    let options = Options {
        stack: StackOptions {
            gateway,
            gateway_args: cli.gateway_args,
            mysql: cli.mysql,
            through: cli.through,
            wan: cli.wan.map(|delay| Link {
                delay,
                jitter: cli.wan_jitter.unwrap_or(delay / 10),
            }),
        },
        out: cli.out,
        floor: cli.floor,
    };
    // Ctrl-C or SIGTERM drops the run: every process, proxy and directory it started goes with the stack
    // (`Drop`). Whatever ended it, the databases it created and did not drop go here (a run
    // that failed midway leaves one too).
    let mut work = Box::pin(run_all(scenarios, options));
    let code = tokio::select! {
        code = &mut work => code,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("\nstrata-lab: interrupted; stopping everything it started");
            ExitCode::from(130)
        }
        _ = terminated() => {
            eprintln!("strata-lab: terminated; stopping everything it started");
            ExitCode::from(143)
        }
    };
    drop(work);
    strata_lab::sql::drop_created().await;
    code
}

/// Resolves on SIGTERM (`kill`), which stops a run as Ctrl-C does; never where it cannot be
/// listened for.
async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            term.recv().await;
        }
        Err(_) => std::future::pending::<()>().await,
    }
}

/// Runs `scenarios` one after the other and prints their table.
async fn run_all(scenarios: Vec<strata_lab::scenario::Scenario>, options: Options) -> ExitCode {
    let mut rows = Vec::new();
    for s in scenarios {
        eprintln!("==> {}: {}\n    {}", s.name, s.about, s.parameters());
        match strata_lab::run(s, &options).await {
            Ok(report) => {
                eprintln!("{}\n{}\n{}", Report::header(), report.row(), report.paths());
                rows.push(report.row());
            }
            Err(e) => {
                eprintln!("strata-lab: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("{}", Report::header());
    for row in rows {
        println!("{row}");
    }
    println!("results and plots in {}", options.out.display());
    ExitCode::SUCCESS
}
