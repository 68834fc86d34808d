//! A run's report: the figures and what they cost, as a table row, a JSON document
//! (`<out>/<scenario>.json`) and a plot (`<out>/<scenario>.svg`).

use std::path::Path;

use serde_json::{Value, json};

use crate::analysis::{Figures, Latency, Spread};
use crate::probe::{CALL_KINDS, REASONS, Reading, SOURCES};
use crate::scenario::Scenario;
use crate::shells::Through;

/// What one run measured.
#[derive(Clone, Debug)]
pub struct Report {
    pub scenario: String,
    pub parameters: String,
    pub gateway_args: Vec<String>,
    pub figures: Figures,
    pub limit_rate: f64,
    pub seconds: f64,
    pub redis_commands_per_1000: f64,
    /// Redis commands per 1,000 requests by name (the lab's own polls included, which the
    /// total leaves out).
    pub redis_per_1000_by_name: std::collections::BTreeMap<String, f64>,
    pub origin_calls_per_1000: f64,
    /// Origin calls per 1,000 requests by kind ([`CALL_KINDS`]; the lab's own reads left out).
    pub calls_per_1000_by_kind: [f64; CALL_KINDS.len()],
    /// Decisions per 1,000 requests by the path that made them ([`SOURCES`]).
    pub decided_per_1000_by: [f64; SOURCES.len()],
    /// Requests sent to the origin per 1,000, by why ([`REASONS`]).
    pub asked_per_1000_for: [f64; REASONS.len()],
    pub sql_statements_per_gateway_second: f64,
    pub sql_statements_per_1000: f64,
    /// Flushes and syncs that failed (the SQL fault).
    pub sql_errors: f64,
    /// A successful sync's mean duration, ms (its round trips to the store).
    pub sync_ms_mean: f64,
    /// The simulated WAN between each region and the store, when the run had one.
    pub wan: Option<String>,
    /// What the traffic entered through.
    pub through: Through,
    pub gateway_cpu_seconds: f64,
    pub gateway_rss_mib_max: f64,
    /// Resident memory the gateways grew by, per window key they held.
    pub bytes_per_window: f64,
}

/// `values` under `names`, as a JSON object.
fn named(names: &[&str], values: &[f64]) -> Value {
    let pairs = names.iter().zip(values);
    Value::Object(pairs.map(|(k, n)| ((*k).to_string(), json!(n))).collect())
}

fn per_1000(n: f64, requests: u64) -> f64 {
    if requests == 0 {
        0.0
    } else {
        n * 1_000.0 / requests as f64
    }
}

impl Report {
    pub fn new(
        s: &Scenario,
        gateway_args: &[String],
        figures: Figures,
        before: &Reading,
        after: &Reading,
        windows_held: usize,
        polled: u64,
    ) -> Self {
        let requests = figures.offered;
        let gateways = (s.regions * s.gateways).max(1) as f64;
        let grown: u64 = after
            .rss_kib
            .iter()
            .zip(&before.rss_kib)
            .map(|(a, b)| a.saturating_sub(*b))
            .sum();
        Self {
            scenario: s.name.to_string(),
            parameters: s.parameters(),
            gateway_args: gateway_args.to_vec(),
            limit_rate: s.limit_rate(),
            seconds: s.seconds,
            redis_commands_per_1000: per_1000(
                after
                    .redis_commands
                    .saturating_sub(before.redis_commands)
                    .saturating_sub(polled) as f64,
                requests,
            ),
            redis_per_1000_by_name: after
                .redis_by_command
                .iter()
                .map(|(name, n)| {
                    let was = before.redis_by_command.get(name).copied().unwrap_or(0);
                    (
                        name.clone(),
                        per_1000(n.saturating_sub(was) as f64, requests),
                    )
                })
                .filter(|(_, n)| *n > 0.0)
                .collect(),
            origin_calls_per_1000: per_1000(
                (after.origin_calls - before.origin_calls - polled as f64).max(0.0),
                requests,
            ),
            calls_per_1000_by_kind: core::array::from_fn(|i| {
                let own = if CALL_KINDS[i] == "read" {
                    polled as f64
                } else {
                    0.0
                };
                let made = after.calls_by_kind[i] - before.calls_by_kind[i] - own;
                per_1000(made.max(0.0), requests)
            }),
            decided_per_1000_by: core::array::from_fn(|i| {
                per_1000(after.decided_by[i] - before.decided_by[i], requests)
            }),
            asked_per_1000_for: core::array::from_fn(|i| {
                per_1000(after.asked_for[i] - before.asked_for[i], requests)
            }),
            sql_statements_per_gateway_second: (after.sql_statements - before.sql_statements)
                / gateways
                / s.seconds,
            sql_statements_per_1000: per_1000(
                after.sql_statements - before.sql_statements,
                requests,
            ),
            sql_errors: after.sql_errors - before.sql_errors,
            sync_ms_mean: {
                let syncs = after.syncs - before.syncs;
                if syncs > 0.0 {
                    (after.sync_seconds - before.sync_seconds) * 1e3 / syncs
                } else {
                    0.0
                }
            },
            wan: None,
            through: Through::Gateway,
            gateway_cpu_seconds: after.cpu_seconds - before.cpu_seconds,
            gateway_rss_mib_max: after.rss_kib.iter().copied().max().unwrap_or(0) as f64 / 1024.0,
            bytes_per_window: if windows_held == 0 {
                0.0
            } else {
                grown as f64 * 1024.0 / windows_held as f64
            },
            figures,
        }
    }

    pub fn to_json(&self) -> Value {
        let f = &self.figures;
        let latency = |l: &Option<Latency>| {
            l.map_or(
                Value::Null,
                |l| json!({"n": l.n, "p50": l.p50, "p99": l.p99, "p999": l.p999}),
            )
        };
        let spread = |s: &Option<Spread>| {
            s.map_or(
                Value::Null,
                |s| json!({"n": s.n, "p50": s.p50, "p95": s.p95, "max": s.max}),
            )
        };
        json!({
            "scenario": self.scenario,
            "parameters": self.parameters,
            "gateway_args": self.gateway_args,
            "wan": self.wan,
            "through": self.through.name(),
            "seconds": self.seconds,
            "limit_rate": self.limit_rate,
            "figures": {
                "offered": f.offered,
                "admitted": f.admitted,
                "denied": f.denied,
                "errors": f.errors,
                "allowed": f.allowed,
                "admitted_over_allowed": f.ratio(),
                "worst_window": f.worst_window,
                "wrongly_denied": f.wrongly_denied,
                "wrongly_admitted": f.wrongly_admitted,
                "propagation_ms": spread(&f.propagation_ms),
                "never_seen": f.never_seen,
                "latency_us": latency(&f.latency),
                "latency_us_by_region": f.latency_by_region.iter().map(latency).collect::<Vec<_>>(),
                "redis_commands_per_1000": self.redis_commands_per_1000,
                "redis_commands_per_1000_by_name": self.redis_per_1000_by_name,
                "origin_calls_per_1000": self.origin_calls_per_1000,
                "origin_calls_per_1000_by_kind": named(&CALL_KINDS, &self.calls_per_1000_by_kind),
                "asked_origin_per_1000_for": named(&REASONS, &self.asked_per_1000_for),
                "decided_per_1000_by": named(&SOURCES, &self.decided_per_1000_by),
                "sql_statements_per_gateway_second": self.sql_statements_per_gateway_second,
                "sql_statements_per_1000": self.sql_statements_per_1000,
                "sql_errors": self.sql_errors,
                "sync_ms_mean": self.sync_ms_mean,
                "gateway_cpu_seconds": self.gateway_cpu_seconds,
                "gateway_rss_mib_max": self.gateway_rss_mib_max,
                "bytes_per_window": self.bytes_per_window,
            },
            "admitted_per_second": f.admitted_per_second,
        })
    }

    /// Writes `<out>/<scenario>.json` and `<out>/<scenario>.svg`.
    pub fn write(&self, out: &Path, s: &Scenario) -> crate::Result<()> {
        std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
        let json = out.join(format!("{}.json", self.scenario));
        let text = serde_json::to_string_pretty(&self.to_json()).map_err(|e| e.to_string())?;
        std::fs::write(&json, text + "\n").map_err(|e| format!("{}: {e}", json.display()))?;
        let svg = out.join(format!("{}.svg", self.scenario));
        let mut about = s.about.to_string();
        if self.through != Through::Gateway {
            let shell = self.through.name();
            about.push_str(&format!("; through {shell} in front of each gateway"));
        }
        if let Some(wan) = &self.wan {
            about.push_str(&format!("; the store {wan}"));
        }
        let chart = crate::plot::chart(
            s.name,
            &about,
            &self.figures.admitted_per_second,
            self.limit_rate,
        );
        std::fs::write(&svg, chart).map_err(|e| format!("{}: {e}", svg.display()))?;
        Ok(())
    }

    /// The table's header.
    pub fn header() -> String {
        format!(
            "{:<16} {:>8} {:>9} {:>7} {:>7} {:>7} {:>20} {:>20} {:>9} {:>9} {:>8} {:>6} {:>6}",
            "scenario",
            "offered",
            "adm/allow",
            "worst",
            "wr.deny",
            "wr.adm",
            "propag. p50/p95/max s",
            "lat. p50/p99/p99.9 ms",
            "redis/1k",
            "origin/1k",
            "sql/gw/s",
            "cpu s",
            "rss MB"
        )
    }

    /// Per 1,000 requests, the paths that decided them and the origin calls by kind: the line
    /// under a run's row.
    pub fn paths(&self) -> String {
        let list = |names: &[&str], values: &[f64]| {
            names
                .iter()
                .zip(values)
                .map(|(n, v)| format!("{n} {v:.1}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "  per 1,000 requests: decided by {}; origin calls {}; sent to the origin for {}\n  Redis commands per 1,000 requests: {}\n  a sync {:.1} ms on average{}",
            list(&SOURCES, &self.decided_per_1000_by),
            list(&CALL_KINDS, &self.calls_per_1000_by_kind),
            list(&REASONS, &self.asked_per_1000_for),
            self.redis_per_1000_by_name
                .iter()
                .map(|(name, n)| format!("{name} {n:.1}"))
                .collect::<Vec<_>>()
                .join(", "),
            self.sync_ms_mean,
            self.wan.as_ref().map_or(String::new(), |w| format!(
                ", the store {w} from each region"
            ))
        )
    }

    /// The run as a table row.
    pub fn row(&self) -> String {
        let f = &self.figures;
        let propagation = f.propagation_ms.map_or("-".to_string(), |p| {
            format!("{:.1}/{:.1}/{:.1}", p.p50 / 1e3, p.p95 / 1e3, p.max / 1e3)
        });
        let latency = f.latency.map_or("-".to_string(), |l| {
            format!("{:.2}/{:.2}/{:.2}", l.p50 / 1e3, l.p99 / 1e3, l.p999 / 1e3)
        });
        format!(
            "{:<16} {:>8} {:>9.3} {:>7.2} {:>7} {:>7} {:>20} {:>20} {:>9.1} {:>9.1} {:>8.2} {:>6.1} {:>6.0}",
            self.scenario,
            f.offered,
            f.ratio(),
            f.worst_window,
            f.wrongly_denied,
            f.wrongly_admitted,
            propagation,
            latency,
            self.redis_commands_per_1000,
            self.origin_calls_per_1000,
            self.sql_statements_per_gateway_second,
            self.gateway_cpu_seconds,
            self.gateway_rss_mib_max
        )
    }
}
