//! The shells users deploy, as a scenario's traffic sources: in front of each gateway a
//! `workerd` process running the built edge bundle (`--through edge`), or an Envoy (1.40,
//! `--concurrency 2`) running the built filter (`--through envoy`); their rule the scenario's
//! limit on the `x-api-key` header, passing to one loopback upstream. A request is a GET with
//! the key in that header; 200 is a pass, 429 a denial.
//!
//! The process launchers are the end-to-end tests' own, included by path (one copy): they stop
//! the lab with a message when workerd, Envoy or a build is missing (`scripts/test.sh` installs
//! and builds them).

use crate::scenario::Scenario;

/// The end-to-end tests' launchers, included by path.
#[allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    dead_code,
    unreachable_pub
)]
pub(crate) mod launchers;

pub use launchers::envoy::{Envoy, FilterStats};
pub use launchers::upstream::Upstream;
pub use launchers::workerd::Workerd;

/// The header the shells' rule keys on, and the descriptor it names the key by: key `k7` is
/// the cell `lab` / `key=k7`.
pub const KEY_HEADER: &str = "x-api-key";
const KEY_DESCRIPTOR: &str = "key";

/// Which shell a scenario's traffic goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Through {
    /// Straight to each gateway's API (`POST /v1/ratelimit`).
    Gateway,
    /// A workerd edge in front of each gateway.
    Edge,
    /// An Envoy with the Strata filter in front of each gateway.
    Envoy,
}

impl Through {
    /// `gateway`, `edge`, `envoy`: as the option spells it.
    pub fn name(self) -> &'static str {
        match self {
            Through::Gateway => "gateway",
            Through::Edge => "edge",
            Through::Envoy => "envoy",
        }
    }

    /// The cell identifier of key `key` (`k<n>`) as traffic through it names it: the gateway
    /// API's identifier itself, or the shells' rule's `descriptor=value`.
    pub fn identifier(self, key: &str) -> String {
        match self {
            Through::Gateway => key.to_string(),
            Through::Edge | Through::Envoy => format!("{KEY_DESCRIPTOR}={key}"),
        }
    }
}

/// A shell process in front of a gateway.
#[derive(Debug)]
pub enum Front {
    Edge(Workerd),
    Envoy(Envoy),
}

impl Front {
    /// `http://127.0.0.1:<port>`: where its traffic goes.
    pub fn base(&self) -> &str {
        match self {
            Front::Edge(w) => &w.base,
            Front::Envoy(e) => &e.base,
        }
    }

    /// The shell's counters, read once: the edge's `/__strata/stats`, Envoy's filter stats
    /// (summed over its VMs, once settled: its VMs bring them up to date on their ticks).
    /// Empty where the shell does not answer.
    pub async fn counters(&self, http: &reqwest::Client) -> Counters {
        match self {
            Front::Edge(w) => Counters::Edge(
                async {
                    let r = http.get(format!("{}/__strata/stats", w.base)).send().await;
                    r.ok()?.json::<serde_json::Value>().await.ok()
                }
                .await
                .unwrap_or_default(),
            ),
            Front::Envoy(e) => Counters::Envoy(e.filter_stats(http).await),
        }
    }
}

/// A shell's counters as [`Front::counters`] read them.
#[derive(Debug)]
pub enum Counters {
    /// The edge's stats object.
    Edge(serde_json::Value),
    /// Envoy's `wasmcustom.*` stats.
    Envoy(FilterStats),
}

impl Counters {
    /// The counts of `names` in `group` (zero where absent).
    pub fn of(&self, group: Counts, names: &[&str]) -> Vec<f64> {
        let (object, prefix) = match group {
            Counts::Decided => ("decided", "decided"),
            Counts::Reasons => ("origin_reasons", "origin.reason"),
        };
        names
            .iter()
            .map(|s| match self {
                Counters::Edge(stats) => stats[object][*s].as_f64().unwrap_or(0.0),
                Counters::Envoy(stats) => stats
                    .find(&format!("wasmcustom.strata.{prefix}.{s}"))
                    .map_or(0.0, |v| v as f64),
            })
            .collect()
    }
}

/// Which of a shell's counts [`Counters::of`] reads.
#[derive(Clone, Copy, Debug)]
pub enum Counts {
    /// Requests by the path that decided them.
    Decided,
    /// Decision calls by why they were sent.
    Reasons,
}

/// How long a shell waits for its gateway (`STRATA_TIMEOUT_MS`, `timeout_ms`), far above the
/// 250 ms default: five shells, five gateways and the load on two cores can queue a burst's
/// calls past a quarter second, and a call that times out is decided by the failure mode (from
/// memory, in `local`), which is not what the lab measures. `fallback` in the per-path line
/// shows any that still do.
pub const SHELL_TIMEOUT_MS: u64 = 2_000;

/// The shells' rules for scenario `s`: its limit and window, keyed on [`KEY_HEADER`], in the
/// lab's namespace.
pub fn rules(s: &Scenario) -> serde_json::Value {
    serde_json::json!([{
        "name": "lab", "namespace": "lab", "limit": s.limit,
        "duration": format!("{}ms", s.duration_ms),
        "actions": [{"request_headers": {"header_name": KEY_HEADER, "descriptor_key": KEY_DESCRIPTOR}}]
    }])
}

/// A `through` shell of region `region` in front of the gateway at `gateway`, passing to
/// `upstream`, with `rules`; ready. None for [`Through::Gateway`].
pub async fn front(
    through: Through,
    region: &str,
    gateway: &str,
    upstream: &Upstream,
    rules: &serde_json::Value,
    http: &reqwest::Client,
) -> Option<Front> {
    match through {
        Through::Gateway => None,
        Through::Edge => {
            let rules = serde_json::json!({ "rules": rules }).to_string();
            let timeout = SHELL_TIMEOUT_MS.to_string();
            let mut w = Workerd::proxy(&[
                ("STRATA_GATEWAY_URL", gateway),
                ("STRATA_UPSTREAM", &upstream.base),
                ("STRATA_RULES", &rules),
                ("STRATA_REGION", region),
                ("STRATA_TIMEOUT_MS", &timeout),
                // Its counters at /__strata/stats, read by the lab's probe.
                ("STRATA_DEBUG", "true"),
            ]);
            w.ready().await;
            Some(Front::Edge(w))
        }
        Through::Envoy => {
            let configuration = serde_json::json!({
                "gateway_cluster": "strata_gateway", "region": region, "rules": rules,
                "timeout_ms": SHELL_TIMEOUT_MS
            });
            let port = launchers::upstream::port_of(gateway);
            let mut e = Envoy::start(&configuration.to_string(), upstream.port(), Some(port));
            e.ready(http).await;
            Some(Front::Envoy(e))
        }
    }
}
