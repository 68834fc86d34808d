//! What the stores and the processes did, read before and after a run: Redis commands
//! (`INFO commandstats`), SQL statements and origin calls (each gateway's `/metrics`), gateway CPU
//! time and resident memory (`/proc`).

use crate::shells::Counts;
use crate::shells::launchers::cpu::{clock_ticks, cpu_ticks};
use crate::stack::Stack;

/// One reading of every counter the figures difference.
#[derive(Clone, Debug, Default)]
pub struct Reading {
    /// Commands run by every region's Redis.
    pub redis_commands: u64,
    /// The same by command name.
    pub redis_by_command: std::collections::BTreeMap<String, u64>,
    /// SQL statements every gateway issued (flushes and syncs, failed ones included).
    pub sql_statements: f64,
    /// Of those, the ones that failed.
    pub sql_errors: f64,
    /// Syncs that succeeded, and the seconds they took (every statement of each: its round
    /// trips to the store).
    pub syncs: f64,
    pub sync_seconds: f64,
    /// Origin calls (decisions, reads, replay batches) every gateway made.
    pub origin_calls: f64,
    /// Origin calls by kind, as [`CALL_KINDS`] names them.
    pub calls_by_kind: [f64; CALL_KINDS.len()],
    /// Decisions every gateway made, by the path that made them ([`SOURCES`]).
    pub decided_by: [f64; SOURCES.len()],
    /// Requests every gateway sent to the origin, by why ([`REASONS`]).
    pub asked_for: [f64; REASONS.len()],
    /// CPU seconds the gateways used (user + system).
    pub cpu_seconds: f64,
    /// Each gateway's resident memory, KiB.
    pub rss_kib: Vec<u64>,
}

/// The paths a gateway's decision is made by (`strata_decisions_total`'s `source`).
pub const SOURCES: [&str; 4] = ["local", "origin", "ahead", "fallback"];
/// Why a gateway or a shell sent a request to the origin (`strata_origin_reasons_total`'s
/// `reason`, the shells' `origin.reason.*`).
pub const REASONS: [&str; 4] = strata_core::Reason::LABELS;
/// The kinds of origin call (`strata_origin_calls_total`'s `op`).
pub const CALL_KINDS: [&str; 3] = ["decide", "replay", "read"];

/// The sum of the values of the metric lines whose name is `name` (labels and all).
fn metric_sum(text: &str, name: &str) -> f64 {
    labelled_sum(text, name, "")
}

/// [`metric_sum`] of the lines whose labels include `label` (`source="ahead"`).
fn labelled_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name).is_some_and(|rest| {
                rest.starts_with(' ') || (rest.starts_with('{') && rest.contains(label))
            })
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}

/// Adds to `sums[i]` the values of metric `name` whose label `label` is `values[i]`.
fn add_by_label(text: &str, name: &str, label: &str, values: &[&str], sums: &mut [f64]) {
    for (sum, value) in sums.iter_mut().zip(values) {
        *sum += labelled_sum(text, name, &format!("{label}=\"{value}\""));
    }
}

/// Reads every counter now.
pub async fn read(stack: &Stack, http: &reqwest::Client) -> Reading {
    let ticks = clock_ticks();
    let mut reading = Reading::default();
    for region in &stack.regions {
        for (name, n) in region.redis.commands_by_name() {
            reading.redis_commands += n;
            *reading.redis_by_command.entry(name).or_default() += n;
        }
    }
    for (_, g) in stack.gateways() {
        let text = match http.get(format!("{}/metrics", g.base)).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        reading.sql_statements += [
            "strata_global_writes_total",
            "strata_global_write_errors_total",
            "strata_global_syncs_total",
            "strata_global_sync_errors_total",
        ]
        .iter()
        .map(|name| metric_sum(&text, name))
        .sum::<f64>();
        reading.sql_errors += [
            "strata_global_write_errors_total",
            "strata_global_sync_errors_total",
        ]
        .iter()
        .map(|name| metric_sum(&text, name))
        .sum::<f64>();
        reading.syncs += metric_sum(&text, "strata_global_syncs_total");
        reading.sync_seconds += metric_sum(&text, "strata_global_sync_seconds_total");
        reading.origin_calls += metric_sum(&text, "strata_origin_calls_total");
        let calls = "strata_origin_calls_total";
        add_by_label(&text, calls, "op", &CALL_KINDS, &mut reading.calls_by_kind);
        let reasons = "strata_origin_reasons_total";
        add_by_label(&text, reasons, "reason", &REASONS, &mut reading.asked_for);
        let decisions = "strata_decisions_total";
        add_by_label(
            &text,
            decisions,
            "source",
            &SOURCES,
            &mut reading.decided_by,
        );
        // Requests a shell decided, and the calls it sent, never reach the gateway's own
        // decision counts.
        if let Some(front) = &g.front {
            let counters = front.counters(http).await;
            let decided = counters.of(Counts::Decided, &SOURCES);
            for (sum, n) in reading.decided_by.iter_mut().zip(decided) {
                *sum += n;
            }
            let asked = counters.of(Counts::Reasons, &REASONS);
            for (sum, n) in reading.asked_for.iter_mut().zip(asked) {
                *sum += n;
            }
        }
        reading.cpu_seconds += cpu_ticks(g.pid()) as f64 / ticks;
        reading.rss_kib.push(rss_kib(g.pid()));
    }
    reading
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sum_matches_the_name_exactly() {
        let text = "# TYPE x counter\nstrata_global_writes_total 3\nstrata_global_writes_total_x 9\nstrata_origin_calls_total{kind=\"decide\"} 2\nstrata_origin_calls_total{kind=\"read\"} 5\n";
        assert_eq!(metric_sum(text, "strata_global_writes_total"), 3.0);
        assert_eq!(metric_sum(text, "strata_origin_calls_total"), 7.0);
        assert_eq!(metric_sum(text, "strata_global_syncs_total"), 0.0);
        assert_eq!(
            labelled_sum(text, "strata_origin_calls_total", "kind=\"read\""),
            5.0
        );
    }

    #[test]
    fn this_process_has_cpu_time_and_memory() {
        let pid = std::process::id();
        let spin: u64 = (0..5_000_000_u64).fold(0, |a, b| a.wrapping_add(b * b));
        assert!(spin > 0);
        assert!(rss_kib(pid) > 0);
        assert!(cpu_ticks(pid) > 0);
    }
}
