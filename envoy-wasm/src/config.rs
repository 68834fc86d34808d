//! The filter's JSON `configuration`: where the gateway is, how to fail, and the rules (the
//! same JSON as the edge's, parsed by `strata-core`). Parsed once per VM in `on_configure`;
//! an error names the field, and Envoy refuses the configuration.

use serde::Deserialize;
use strata_core::gate::{Gate, GateOptions};

/// The configuration as written.
/// Unknown fields fall into `options`, where `GateOptions` refuses them by name.
#[derive(Debug, Deserialize)]
struct Raw {
    /// The Envoy cluster of the regional gateway.
    gateway_cluster: String,
    /// `:authority` of calls to it.
    #[serde(default = "default_authority")]
    gateway_authority: String,
    /// Bearer token (none: a loopback gateway without tokens).
    #[serde(default)]
    token: Option<String>,
    /// This proxy's region: the prefix of its instance id.
    #[serde(default = "default_region")]
    region: String,
    /// Bound on one gateway call, milliseconds.
    #[serde(default = "default_timeout")]
    timeout_ms: u64,
    /// How often accepted cost is replayed, milliseconds.
    #[serde(default = "default_replay")]
    replay_interval_ms: u64,
    /// Prefix of the filter's stats (`<prefix>.ok`, `.rate_limited`, …).
    #[serde(default = "default_prefix")]
    stat_prefix: String,
    /// Slots of shared data for the window keys the VMs share (0: each VM keeps its own).
    #[serde(default = "default_slots")]
    shared_slots: u64,
    /// The rules, as `{"rules": [...]}` takes them.
    rules: serde_json::Value,
    /// The rest: `GateOptions` (failure_mode, legacy_headers, headers_on_pass, debug,
    /// client_address, xff_num_trusted_hops).
    #[serde(flatten)]
    options: serde_json::Map<String, serde_json::Value>,
}

fn default_authority() -> String {
    "strata-gateway".into()
}
fn default_region() -> String {
    "envoy".into()
}
const fn default_timeout() -> u64 {
    250
}
const fn default_replay() -> u64 {
    100
}
/// Enough that 10,000 keys an Envoy serves at once seldom find their slot taken (such a key
/// is decided at the gateway each time): about 7.5 MB of shared data when empty, per Envoy.
const fn default_slots() -> u64 {
    65_536
}

/// The most shared slots: about 30 MB empty.
const MAX_SHARED_SLOTS: u64 = 262_144;
fn default_prefix() -> String {
    "strata".into()
}

/// The validated configuration.
#[derive(Debug)]
pub struct Config {
    /// Rules and options.
    pub gate: Gate,
    /// The gateway's cluster.
    pub cluster: String,
    /// `:authority` of gateway calls.
    pub authority: String,
    /// `authorization` header value, if any.
    pub authorization: Option<String>,
    /// Instance id prefix.
    pub region: String,
    /// Bound on a gateway call.
    pub timeout_ms: u64,
    /// Replay period.
    pub replay_interval_ms: u64,
    /// Stats prefix.
    pub stat_prefix: String,
    /// Shared-data slots (0: none).
    pub shared_slots: usize,
}

impl Config {
    /// Parses the filter configuration; the error names the field.
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let raw: Raw = serde_path_to_error::deserialize(&mut de)
            .map_err(|e| format!("{}: {}", e.path(), e.inner()))?;
        let within = |v: u64, lo: u64, hi: u64, what: &str| {
            if (lo..=hi).contains(&v) {
                Ok(v)
            } else {
                Err(format!("{what}: {v} is outside {lo}..={hi}"))
            }
        };
        if raw.gateway_cluster.is_empty() {
            return Err("gateway_cluster: must name the gateway's cluster".into());
        }
        if raw.stat_prefix.is_empty() || !raw.stat_prefix.bytes().all(stat_char) {
            return Err("stat_prefix: use letters, digits, '_' and '.'".into());
        }
        let options = serde_json::Value::Object(raw.options).to_string();
        let rules = serde_json::json!({ "rules": raw.rules }).to_string();
        let gate = Gate::from_json("envoy", &rules, &options).map_err(|e| e.to_string())?;
        Ok(Self {
            gate,
            cluster: raw.gateway_cluster,
            authority: raw.gateway_authority,
            authorization: raw.token.map(|t| format!("Bearer {t}")),
            region: raw.region,
            timeout_ms: within(raw.timeout_ms, 1, 60_000, "timeout_ms")?,
            replay_interval_ms: within(raw.replay_interval_ms, 10, 60_000, "replay_interval_ms")?,
            stat_prefix: raw.stat_prefix,
            shared_slots: usize::try_from(within(
                raw.shared_slots,
                0,
                MAX_SHARED_SLOTS,
                "shared_slots",
            )?)
            .unwrap_or(0),
        })
    }

    /// The gate's options.
    pub fn options(&self) -> &GateOptions {
        self.gate.options()
    }
}

fn stat_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'.'
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: &str = r#"[{"name": "per-ip", "namespace": "api", "limit": 10,
        "duration": "1m", "actions": [{"remote_address": {}}]}]"#;

    #[test]
    fn a_full_configuration_parses() {
        let json = format!(
            r#"{{"gateway_cluster": "gw", "token": "t", "timeout_ms": 300,
                "failure_mode": "deny", "legacy_headers": true, "rules": {RULES}}}"#
        );
        let c = Config::from_json(json.as_bytes()).unwrap();
        assert_eq!(c.cluster, "gw");
        assert_eq!(c.authorization.as_deref(), Some("Bearer t"));
        assert_eq!(c.timeout_ms, 300);
        assert!(c.options().legacy_headers);
        assert_eq!(c.gate.rules().rules()[0].name, "per-ip");
        assert_eq!(c.shared_slots, 65_536, "the default");
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#"{"rules": []}"#.to_string(), "gateway_cluster"),
            (
                format!(r#"{{"gateway_cluster": "gw", "timeout_ms": 0, "rules": {RULES}}}"#),
                "timeout_ms",
            ),
            (
                format!(r#"{{"gateway_cluster": "gw", "failure_mode": "maybe", "rules": {RULES}}}"#),
                "failure_mode",
            ),
            (
                r#"{"gateway_cluster": "gw", "rules": [{"namespace": "a", "limit": "x", "duration": 1000, "actions": []}]}"#.to_string(),
                "rules[0].limit",
            ),
            (
                format!(r#"{{"gateway_cluster": "gw", "shared_slots": 262145, "rules": {RULES}}}"#),
                "shared_slots",
            ),
            ("not json".to_string(), "expected"),
        ];
        for (json, field) in cases {
            let e = Config::from_json(json.as_bytes()).unwrap_err();
            assert!(e.contains(field), "{json}: {e}");
        }
    }
}
