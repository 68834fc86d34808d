//! How long one region's usage takes to reach another's decisions, under steady load, with
//! flush and sync every 5 s (slower than the defaults; jitter 0.2) on a simulated clock, the
//! loops driven by the test itself (the gateway's own, early flushes included, are measured
//! on real processes by the accuracy lab, `docs/LAB.md`): from the moment a
//! key's count in region eu crosses the publish floor to the first us sync that imports it.
//! Prints p50 / p95 / max and the SQL statements and rows per second per gateway.

use crate::common;

use common::{T0, temp_database, with_settings};
use strata_core::table::LimitRequest;
use strata_core::{Region, WindowDuration, WindowKeyRef};
use strata_gateway::config::Settings;

const KEYS: u64 = 40;
const LIMIT: u64 = 1_000;
const STEP_MS: u64 = 100;
const RUN_MS: u64 = 120_000;
const INTERVAL_MS: u64 = 5_000;

/// The next firing of a jittered cadence anchored to absolute targets (as the gateway's loops).
fn next_firing(anchor: &mut u64, rng: &mut u64) -> u64 {
    *anchor += INTERVAL_MS;
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    *anchor + *rng % (INTERVAL_MS / 5)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_reaches_the_other_region_within_a_flush_and_a_sync() {
    let url = temp_database();
    let eu = with_settings(Settings {
        region: Region::new("eu").unwrap(),
        database_url: url.clone(),
        ..Settings::default()
    })
    .await;
    let us = with_settings(Settings {
        region: Region::new("us").unwrap(),
        database_url: url,
        ..Settings::default()
    })
    .await;
    let d = WindowDuration::from_ms(3_600_000).unwrap();
    let ids: Vec<String> = (0..KEYS).map(|i| format!("client-{i}")).collect();
    let threshold = LIMIT / 5;
    let (mut crossed, mut seen) = (vec![None::<u64>; ids.len()], vec![None::<u64>; ids.len()]);
    let mut admitted = vec![0_u64; ids.len()];
    let (mut rng_eu, mut rng_us) = (0x1111_u64, 0x2222_u64);
    let (mut flush_anchor, mut sync_anchor) = (T0, T0);
    let mut next_flush = next_firing(&mut flush_anchor, &mut rng_eu);
    let mut next_sync = next_firing(&mut sync_anchor, &mut rng_us);
    let (mut flushes, mut syncs) = (0_u64, 0_u64);
    let mut now = T0;
    while now < T0 + RUN_MS {
        now += STEP_MS;
        eu.clock.set(now);
        us.clock.set(now);
        // Key i receives (i + 1) requests a second: keys cross the floor at spread-out times.
        for (i, id) in ids.iter().enumerate() {
            let n =
                (now - T0) * (i as u64 + 1) / 1_000 - (now - T0 - STEP_MS) * (i as u64 + 1) / 1_000;
            for _ in 0..n {
                let key = WindowKeyRef::new("default", "api", id, d).unwrap();
                if eu
                    .gateway
                    .limiter
                    .decide(LimitRequest {
                        key,
                        limit: LIMIT,
                        cost: 1,
                    })
                    .await
                    .success
                {
                    admitted[i] += 1;
                }
            }
            if admitted[i] >= threshold && crossed[i].is_none() {
                crossed[i] = Some(now);
            }
        }
        assert!(eu.gateway.limiter.replay_once().await);
        if now >= next_flush {
            eu.gateway.limiter.global.flush_once(now).await.unwrap();
            flushes += 1;
            next_flush = next_firing(&mut flush_anchor, &mut rng_eu);
        }
        if now >= next_sync {
            us.gateway
                .limiter
                .global
                .sync_once(&us.gateway.limiter.local, now)
                .await
                .unwrap();
            syncs += 1;
            next_sync = next_firing(&mut sync_anchor, &mut rng_us);
            for (i, id) in ids.iter().enumerate() {
                let key = WindowKeyRef::new("default", "api", id, d).unwrap();
                let global = us
                    .gateway
                    .limiter
                    .local
                    .lock(key)
                    .get(key)
                    .map_or(0, |s| s.current().counts().global);
                if global > 0 && seen[i].is_none() {
                    seen[i] = Some(now);
                }
            }
        }
    }
    let mut delays: Vec<u64> = crossed
        .iter()
        .zip(&seen)
        .filter_map(|(c, s)| Some(s.as_ref()? - c.as_ref()?))
        .collect();
    delays.sort_unstable();
    let crossed_count = crossed.iter().filter(|c| c.is_some()).count();
    assert!(
        crossed_count >= 30,
        "most keys crossed the floor: {crossed_count}"
    );
    assert_eq!(
        delays.len(),
        crossed_count,
        "every key that crossed the floor reached us"
    );
    let (p50, p95, max) = (
        percentile(&delays, 0.5),
        percentile(&delays, 0.95),
        delays[delays.len() - 1],
    );
    let seconds = RUN_MS as f64 / 1_000.0;
    let rows = eu.gateway.limiter.global.metrics.rows_written.get();
    println!(
        "propagation over {crossed_count} keys: p50 {p50} ms, p95 {p95} ms, max {max} ms; \
         eu: {:.2} flush statements/s, {:.1} rows/s; us: {:.2} sync queries/s",
        flushes as f64 / seconds,
        rows as f64 / seconds,
        syncs as f64 / seconds
    );
    // A flush and a sync, each at most one interval plus 20% jitter apart, plus a step.
    assert!(
        max <= 2 * (INTERVAL_MS + INTERVAL_MS / 5) + STEP_MS,
        "{max} ms"
    );
}
