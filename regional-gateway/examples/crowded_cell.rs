//! What a caller inventing instance ids costs Redis: N invented writers replay one count each
//! to one cell, then decisions on that cell and on another tenant's quiet one are timed, one
//! at a time, through the gateway's Redis origin. Prints how long the writers took, each
//! cell's p50 and p99, and how many fields the crowded cell holds (a cell keeps at most
//! `ledger::MAX_HOLDERS` writers).
//!
//! ```text
//! cargo run --release -p strata-gateway --example crowded_cell -- redis://127.0.0.1:6379/ 100000
//! ```
//!
//! It writes keys under the `strata:` prefix in workspaces `crowd-attacker` and `crowd-victim`,
//! which expire with their day window (use a Redis of its own).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a tool: a panic is the report

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use strata_core::{WindowDuration, WindowKeyRef};
use strata_gateway::metrics::Metrics;
use strata_gateway::origin::{CellUsed, DecideLimit, Origin, OriginClient, RedisOrigin};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "redis://127.0.0.1:6379/".into());
    let writers: usize = args.next().map_or(100_000, |n| n.parse().unwrap());
    let redis = RedisOrigin::new(&url, Duration::from_secs(30)).unwrap();
    let origin = OriginClient::new(
        Origin::Redis(redis),
        Duration::from_secs(30),
        5_000,
        Arc::new(Metrics::default()),
    );
    let day = WindowDuration::from_ms(86_400_000).unwrap();
    let run = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let (now, tag) = (u64::try_from(run.as_millis()).unwrap(), run.as_nanos());
    let crowded_id = format!("crowded-{tag}");
    let crowded = WindowKeyRef::new("crowd-attacker", "api", &crowded_id, day).unwrap();
    let quiet_id = format!("quiet-{tag}");
    let quiet = WindowKeyRef::new("crowd-victim", "api", &quiet_id, day).unwrap();
    let sequence = day.sequence(now);
    let started = Instant::now();
    for i in 0..writers {
        let cell = CellUsed {
            key: crowded,
            sequence,
            used: 1,
            release: 0,
            renew: 0,
            acked: 0,
            undo_from: 0,
        };
        origin
            .replay(&format!("x{i:07}"), &[cell], now)
            .await
            .unwrap();
    }
    let took = started.elapsed();
    println!(
        "{writers} invented writers, one replay each: {took:?} ({:?} a replay)",
        took / u32::try_from(writers.max(1)).unwrap_or(u32::MAX)
    );
    let limit = |key| DecideLimit {
        key,
        limit: 1_000_000_000,
        cost: 1,
        used: [0, 0],
        decided: [0, 0],
        want: 0,
        release: 0,
        global: [0, 0],
        floor: [0, 0],
        call: 0,
        undo_from: 0,
        left_previous: true,
        shares: true,
    };
    for (name, key) in [("crowded cell", crowded), ("another tenant's cell", quiet)] {
        let mut took = Vec::new();
        for i in 0..1_000 {
            let at = Instant::now();
            origin
                .decide(&format!("decider-{i}"), &[limit(key)], now)
                .await
                .unwrap();
            took.push(at.elapsed());
        }
        took.sort();
        println!(
            "decisions on the {name}, one at a time: p50 {:?}, p99 {:?}",
            took[500], took[990]
        );
    }
}
