//! The accuracy lab: starts regions of real `strata-gateway` processes on loopback (a private
//! Redis per region, one global SQL store, optionally across a simulated WAN), offers a
//! scenario's traffic through the gateway API or a shell in front of each gateway, injects its
//! faults, and measures how close the regions together stay to the limit, how fast they learn
//! of each other, and what that costs the stores and the gateways.

pub mod analysis;
pub mod load;
pub mod plot;
pub mod probe;
pub mod report;
pub mod scenario;
pub mod shells;
pub mod sql;
pub mod stack;
pub mod wan;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use load::{KeyPicker, Recorder};
use scenario::{Fault, Scenario};
use stack::{Stack, StackOptions};

/// The lab's errors are messages for the person running it.
pub type Result<T> = std::result::Result<T, String>;

/// Unix time in milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// How a run is made.
#[derive(Clone, Debug)]
pub struct Options {
    pub stack: StackOptions,
    /// Where the JSON results and plots go.
    pub out: PathBuf,
    /// The publish floor the propagation delay is measured from (the gateways' setting).
    pub floor: f64,
}

/// Waits for the next window boundary of `duration_ms` (plus 200 ms, so no request of the
/// run falls in the window before).
async fn align(duration_ms: u64) {
    let now = now_ms();
    let next = (now / duration_ms + 1) * duration_ms + 200;
    tokio::time::sleep(Duration::from_millis(next - now)).await;
}

async fn inject(stack: &mut Stack, start: Instant, faults: &[(f64, Fault)]) -> Result<()> {
    for (at, fault) in faults {
        let wait = at - start.elapsed().as_secs_f64();
        if wait > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        }
        match *fault {
            Fault::RedisKilled { region, down } => {
                let r = stack
                    .regions
                    .get_mut(region)
                    .ok_or_else(|| format!("no region {region}"))?;
                r.redis.kill();
                tokio::time::sleep(Duration::from_secs_f64(down)).await;
                r.redis.restart()?;
            }
            Fault::SqlDown { down } => {
                sql::hold_down(&stack.sql, Duration::from_secs_f64(down)).await?;
            }
        }
    }
    Ok(())
}

/// Runs scenario `s` on a stack of its own and returns its report (also written to
/// `options.out`).
pub async fn run(s: Scenario, options: &Options) -> Result<report::Report> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(256)
        .build()
        .map_err(|e| e.to_string())?;
    let mut stack = Stack::start(&options.stack, s.regions, s.gateways, &http).await?;
    let through = options.stack.through;
    stack.front(through, &shells::rules(&s), &http).await;
    let s = Arc::new(s);
    let picker = Arc::new(KeyPicker::new(s.keys));
    if s.aligned {
        align(s.duration_ms).await;
    }
    let before = probe::read(&stack, &http).await;
    let recorder = Arc::new(Recorder::default());
    let start = Instant::now();
    let start_ms = now_ms();
    let mut tasks = Vec::new();
    for (i, (region, g)) in stack.gateways().enumerate() {
        tasks.push(tokio::spawn(load::send(
            s.clone(),
            (region, i),
            (through, g.entry().to_string()),
            i as u64 + 1,
            start,
            start_ms,
            http.clone(),
            recorder.clone(),
            picker.clone(),
        )));
    }
    if s.poll {
        for (region, r) in stack.regions.iter().enumerate() {
            if let Some(g) = r.gateways.first() {
                tasks.push(tokio::spawn(load::poll(
                    s.clone(),
                    (region, through.identifier(&load::key_name(0))),
                    g.base.clone(),
                    start,
                    http.clone(),
                    recorder.clone(),
                )));
            }
        }
    }
    tasks.push(tokio::spawn(load::progress(
        s.clone(),
        start,
        recorder.clone(),
    )));
    let injected = inject(&mut stack, start, &s.faults).await;
    for t in tasks {
        let _ = t.await;
    }
    injected?;
    let after = probe::read(&stack, &http).await;
    stack.terminate_gateways();
    stack.cleanup().await;

    let mut samples =
        std::mem::take(&mut *recorder.samples.lock().unwrap_or_else(|p| p.into_inner()));
    let polls = std::mem::take(&mut *recorder.polls.lock().unwrap_or_else(|p| p.into_inner()));
    let windows_held: usize = {
        let seen: HashSet<(u16, u32)> = samples.iter().map(|x| (x.gateway, x.key)).collect();
        seen.len()
    };
    let figures = analysis::figures(&s, start_ms, &mut samples, &polls, options.floor);
    let mut report = report::Report::new(
        &s,
        &options.stack.gateway_args,
        figures,
        &before,
        &after,
        windows_held,
        recorder.polled.load(std::sync::atomic::Ordering::Relaxed),
    );
    report.wan = options.stack.wan.map(|l| l.describe());
    report.through = through;
    report.write(&options.out, &s)?;
    Ok(report)
}
