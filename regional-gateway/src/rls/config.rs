//! The rate-limit service's descriptor configuration, in envoyproxy/ratelimit's YAML shape:
//! one `domain` per document, nested `descriptors` with `key`/`value`, and a `rate_limit`
//! (`unit`, `requests_per_unit`, `unlimited`, `name`) where a limit applies. A file written for
//! that server loads unchanged where it uses these fields; a field Strata does not implement
//! (`replaces`, `quota_mode`, `share_threshold`, `metadata`) or does not know stops start-up,
//! named by its path, rather than being ignored and limiting differently than its author meant.
//!
//! Lookup follows that server: each entry of a request's descriptor is looked up as
//! `key_value`, then against the level's wildcard values in file order, then as `key` alone
//! (the default for any value); the limit is the one on the node the last entry reaches.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde::de::IgnoredAny;
use strata_core::WindowDuration;
use strata_core::identity::MAX_NAMESPACE_BYTES;

/// A window unit of envoyproxy/ratelimit, as its wire enum numbers it
/// (`RateLimitResponse.RateLimit.Unit`, `envoy.type.v3.RateLimitUnit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// 1 s.
    Second = 1,
    /// 60 s.
    Minute = 2,
    /// 1 h.
    Hour = 3,
    /// 24 h.
    Day = 4,
    /// 30 days, as envoyproxy/ratelimit counts a month; Strata's longest window.
    Month = 5,
    /// 7 days.
    Week = 7,
}

impl Unit {
    /// The unit of a wire enum value; `None` for `UNKNOWN`, `YEAR` (longer than any Strata
    /// window) and numbers the enum does not hold.
    pub fn from_wire(value: i32) -> Option<Self> {
        Some(match value {
            1 => Self::Second,
            2 => Self::Minute,
            3 => Self::Hour,
            4 => Self::Day,
            5 => Self::Month,
            7 => Self::Week,
            _ => return None,
        })
    }

    /// The unit a config names, in any case (`minute`, `MINUTE`).
    fn parse(name: &str) -> Result<Self, String> {
        Ok(match name.to_ascii_uppercase().as_str() {
            "SECOND" => Self::Second,
            "MINUTE" => Self::Minute,
            "HOUR" => Self::Hour,
            "DAY" => Self::Day,
            "WEEK" => Self::Week,
            "MONTH" => Self::Month,
            "YEAR" => {
                return Err(
                    "a year is longer than Strata's longest window (30 days, the unit month)"
                        .into(),
                );
            }
            _ => {
                return Err(format!(
                    "unknown unit `{name}`: second, minute, hour, day, week or month"
                ));
            }
        })
    }

    /// The window this unit is: a sliding window of the unit's length.
    pub fn duration(self) -> WindowDuration {
        match self {
            Self::Second => window::<1_000>(),
            Self::Minute => window::<60_000>(),
            Self::Hour => window::<3_600_000>(),
            Self::Day => window::<86_400_000>(),
            Self::Week => window::<{ 7 * 86_400_000 }>(),
            Self::Month => window::<{ 30 * 86_400_000 }>(),
        }
    }
}

/// A window of `MS` milliseconds, checked when the gateway is built: a length outside
/// Strata's bounds fails the build, never a request.
const fn window<const MS: u64>() -> WindowDuration {
    #[allow(clippy::panic)]
    const fn checked(ms: u64) -> WindowDuration {
        match WindowDuration::from_ms(ms) {
            Ok(d) => d,
            Err(_) => panic!("a unit's window lies outside 1 s to 30 days"),
        }
    }
    const { checked(MS) }
}

/// What a descriptor's node says of the requests that reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Limit {
    /// `unlimited: true`: never limited, never counted.
    Unlimited,
    /// A limit per unit.
    Limited(Rate),
}

/// A limit per unit, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rate {
    /// `rate_limit.name`, answered in `current_limit.name`.
    pub name: String,
    /// Requests (hits) per window.
    pub requests_per_unit: u32,
    /// The window.
    pub unit: Unit,
    /// `shadow_mode`: decided and counted, but never denies.
    pub shadow: bool,
    /// The descriptor's place in the configuration, as envoyproxy/ratelimit names its stats:
    /// each level's `key_value` (or `key` for a key's default), joined by `.`. Made of the
    /// file's text only, never of a request's, so it can label a metric. Empty for a limit a
    /// request carries.
    pub descriptor: String,
}

/// One level of a descriptor tree: its nodes by `key_value` (or `key` alone, the default for
/// any value), and the nodes whose value holds `*`, in file order. Names are bytes: a request's
/// entries are the bytes Envoy sends, UTF-8 or not.
#[derive(Clone, Debug, Default)]
struct Level {
    nodes: HashMap<Vec<u8>, Node>,
    wildcards: Vec<Vec<u8>>,
}

#[derive(Clone, Debug, Default)]
struct Node {
    limit: Option<Limit>,
    children: Level,
}

/// Every domain's descriptor tree.
#[derive(Clone, Debug, Default)]
pub struct RlsConfig {
    domains: HashMap<String, Level>,
}

impl RlsConfig {
    /// Whether `domain` is configured.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The domains configured, sorted.
    pub fn domains(&self) -> Vec<&str> {
        let mut d: Vec<_> = self.domains.keys().map(String::as_str).collect();
        d.sort_unstable();
        d
    }

    /// The limit a descriptor of `domain` with `entries` (key, value, as bytes) falls under, if
    /// any.
    pub fn limit_for<'a, 'e>(
        &'a self,
        domain: &str,
        entries: impl IntoIterator<Item = (&'e [u8], &'e [u8])>,
    ) -> Option<&'a Limit> {
        let mut level = self.domains.get(domain)?;
        let mut entries = entries.into_iter().peekable();
        while let Some((key, value)) = entries.next() {
            let node = level.find(key, value)?;
            if entries.peek().is_none() {
                return node.limit.as_ref();
            }
            if node.children.nodes.is_empty() {
                // More entries than the tree is deep: no limit, as in envoyproxy/ratelimit.
                return None;
            }
            level = &node.children;
        }
        None
    }

    /// Loads `path`: a YAML file of one or more documents (`---` between them), or a directory
    /// whose `*.yaml` and `*.yml` files are read in name order. Each document is a domain; a
    /// domain given twice is an error.
    pub fn load(path: &Path) -> Result<Self, RlsConfigError> {
        Self::from_files(path, &Self::read(path)?)
    }

    /// The name and text of every file [`load`](Self::load) reads at `path`, in its order: what
    /// a reload compares with the last to see whether anything changed.
    pub fn read(path: &Path) -> Result<Vec<(PathBuf, String)>, RlsConfigError> {
        let files = if path.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| RlsConfigError::file(path, format!("cannot read: {e}")))?
                .filter_map(|entry| entry.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(RlsConfigError::file(path, "holds no .yaml or .yml file"));
            }
            files
        } else {
            vec![path.to_path_buf()]
        };
        files
            .into_iter()
            .map(|file| match std::fs::read_to_string(&file) {
                Ok(text) => Ok((file, text)),
                Err(e) => Err(RlsConfigError::file(&file, format!("cannot read: {e}"))),
            })
            .collect()
    }

    /// The configuration of `files` as [`read`](Self::read) gave them for `path`.
    pub fn from_files(path: &Path, files: &[(PathBuf, String)]) -> Result<Self, RlsConfigError> {
        let mut config = Self::default();
        for (file, text) in files {
            config.add_yaml(file, text)?;
        }
        if config.domains.is_empty() {
            return Err(RlsConfigError::file(path, "configures no domain"));
        }
        Ok(config)
    }

    /// Adds the domains of one YAML text (`file` names it in errors).
    pub fn add_yaml(&mut self, file: &Path, text: &str) -> Result<(), RlsConfigError> {
        for (n, document) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
            let root: YamlRoot = serde_path_to_error::deserialize(document).map_err(|e| {
                let path = e.path().to_string();
                let path = if path == "." { String::new() } else { path };
                // The YAML error may begin with its own (shorter) path: say it once.
                let message = e.into_inner().to_string();
                let message = match message.split_once(": ") {
                    Some((own, rest)) if !own.is_empty() && path.starts_with(own) => {
                        rest.to_string()
                    }
                    _ => message,
                };
                RlsConfigError::at(file, n, path, message)
            })?;
            let at = |path: String, message: String| RlsConfigError::at(file, n, path, message);
            if root.domain.is_empty() {
                return Err(at("domain".into(), "must not be empty".into()));
            }
            if root.domain.len() > MAX_NAMESPACE_BYTES {
                return Err(at(
                    "domain".into(),
                    format!("is a namespace: at most {MAX_NAMESPACE_BYTES} bytes"),
                ));
            }
            if self.domains.contains_key(&root.domain) {
                return Err(at(
                    "domain".into(),
                    format!("`{}` is configured twice", root.domain),
                ));
            }
            let level = Level::build(root.descriptors, "descriptors", "", &at)?;
            self.domains.insert(root.domain, level);
        }
        Ok(())
    }
}

impl Level {
    /// The level of `descriptors`, found at `path` of the file, under the nodes named
    /// `prefix`.
    fn build(
        descriptors: Vec<YamlDescriptor>,
        path: &str,
        prefix: &str,
        at: &impl Fn(String, String) -> RlsConfigError,
    ) -> Result<Self, RlsConfigError> {
        let mut level = Self::default();
        for (i, d) in descriptors.into_iter().enumerate() {
            let here = format!("{path}[{i}]");
            for (field, present) in [
                ("quota_mode", d.quota_mode.is_some()),
                ("share_threshold", d.share_threshold.is_some()),
                ("metadata", d.metadata.is_some()),
            ] {
                if present {
                    return Err(at(format!("{here}.{field}"), UNSUPPORTED.into()));
                }
            }
            if d.key.is_empty() {
                return Err(at(format!("{here}.key"), "must not be empty".into()));
            }
            let name = match d.value.as_deref() {
                Some(v) if !v.is_empty() => format!("{}_{v}", d.key),
                _ => d.key.clone(),
            };
            let descriptor = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}.{name}")
            };
            let limit = match d.rate_limit {
                None => None,
                Some(r) => Some(r.limit(
                    d.shadow_mode,
                    descriptor.clone(),
                    &format!("{here}.rate_limit"),
                    at,
                )?),
            };
            let name = name.into_bytes();
            if level.nodes.contains_key(&name) {
                return Err(at(
                    here,
                    format!(
                        "`{}` is configured twice at this level",
                        String::from_utf8_lossy(&name)
                    ),
                ));
            }
            if d.value.as_deref().is_some_and(|v| v.contains('*')) {
                level.wildcards.push(name.clone());
            }
            let children = Self::build(
                d.descriptors,
                &format!("{here}.descriptors"),
                &descriptor,
                at,
            )?;
            level.nodes.insert(name, Node { limit, children });
        }
        Ok(level)
    }

    /// The node of `key`/`value`: exact, then the first wildcard value that matches, then the
    /// key's default.
    fn find(&self, key: &[u8], value: &[u8]) -> Option<&Node> {
        let mut exact = Vec::with_capacity(key.len() + 1 + value.len());
        exact.extend_from_slice(key);
        exact.push(b'_');
        exact.extend_from_slice(value);
        if let Some(node) = self.nodes.get(&exact) {
            return Some(node);
        }
        self.wildcards
            .iter()
            .find(|pattern| glob(pattern, &exact))
            .and_then(|pattern| self.nodes.get(pattern))
            .or_else(|| self.nodes.get(key))
    }
}

const UNSUPPORTED: &str = "a field of envoyproxy/ratelimit that Strata does not implement; remove it (ignoring it would limit differently than the file says)";

/// Whether `text` matches `pattern`, where each `*` stands for any run of bytes (none too).
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    // The classic two-pointer match with one backtrack point: linear in practice, and no
    // recursion a long pattern could exhaust.
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(&c) if text.get(t) == Some(&c) => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern
        .get(p..)
        .is_some_and(|rest| rest.iter().all(|&c| c == b'*'))
}

/// Why a configuration did not load: the file, the document, the field's path, and what is
/// wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RlsConfigError {
    /// The file.
    pub file: PathBuf,
    /// Which document of the file (from 0), if the error is inside one.
    pub document: Option<usize>,
    /// The field's path (`descriptors[0].rate_limit.unit`); empty for the document itself.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl RlsConfigError {
    fn file(file: &Path, message: impl Into<String>) -> Self {
        Self {
            file: file.to_path_buf(),
            document: None,
            path: String::new(),
            message: message.into(),
        }
    }

    fn at(file: &Path, document: usize, path: String, message: String) -> Self {
        Self {
            file: file.to_path_buf(),
            document: Some(document),
            path,
            message,
        }
    }
}

impl fmt::Display for RlsConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(n) = self.document.filter(|&n| n > 0) {
            write!(f, " (document {})", n + 1)?;
        }
        if !self.path.is_empty() {
            write!(f, ": {}", self.path)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for RlsConfigError {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRoot {
    domain: String,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlDescriptor {
    key: String,
    value: Option<String>,
    rate_limit: Option<YamlRateLimit>,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
    #[serde(default)]
    shadow_mode: bool,
    /// Adds the request's value to the descriptor's stats there. Strata labels its
    /// per-descriptor metrics by the configuration only (a request's value would make their
    /// number unbounded), and the decision does not change: accepted, and changes nothing.
    #[serde(default, rename = "detailed_metric")]
    _detailed_metric: bool,
    /// As `detailed_metric`.
    #[serde(default, rename = "value_to_metric")]
    _value_to_metric: bool,
    quota_mode: Option<IgnoredAny>,
    share_threshold: Option<IgnoredAny>,
    metadata: Option<IgnoredAny>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRateLimit {
    unit: Option<String>,
    /// Absent is 0, as in envoyproxy/ratelimit: every hit is over the limit.
    #[serde(default)]
    requests_per_unit: u32,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: String,
    replaces: Option<IgnoredAny>,
}

impl YamlRateLimit {
    fn limit(
        self,
        shadow: bool,
        descriptor: String,
        path: &str,
        at: &impl Fn(String, String) -> RlsConfigError,
    ) -> Result<Limit, RlsConfigError> {
        if self.replaces.is_some() {
            return Err(at(format!("{path}.replaces"), UNSUPPORTED.into()));
        }
        if self.unlimited {
            if self.unit.is_some() {
                return Err(at(
                    format!("{path}.unit"),
                    "an unlimited rate limit takes no unit".into(),
                ));
            }
            return Ok(Limit::Unlimited);
        }
        let unit = self
            .unit
            .as_deref()
            .ok_or_else(|| {
                at(
                    format!("{path}.unit"),
                    "missing: a limited rate limit needs a unit".into(),
                )
            })
            .and_then(|u| Unit::parse(u).map_err(|m| at(format!("{path}.unit"), m)))?;
        Ok(Limit::Limited(Rate {
            name: self.name,
            requests_per_unit: self.requests_per_unit,
            unit,
            shadow,
            descriptor,
        }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn load(text: &str) -> Result<RlsConfig, RlsConfigError> {
        let mut c = RlsConfig::default();
        c.add_yaml(Path::new("rls.yaml"), text).map(|()| c)
    }

    fn rate(c: &RlsConfig, domain: &str, entries: &[(&str, &str)]) -> Option<(u32, Unit)> {
        let entries = entries.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes()));
        match c.limit_for(domain, entries)? {
            Limit::Limited(r) => Some((r.requests_per_unit, r.unit)),
            Limit::Unlimited => Some((u32::MAX, Unit::Second)),
        }
    }

    /// The example of envoyproxy/ratelimit's README, in two documents (two domains).
    const NESTED: &str = r#"
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500
  - key: database
    value: default
    rate_limit:
      unit: second
      requests_per_unit: 500
---
domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 2000
  - key: to_number
    descriptors:
      - key: from_number
        rate_limit:
          unit: day
          requests_per_unit: 10
      - key: from_number
        value: "2061111111"
        rate_limit:
          name: vip
          unit: Day
          requests_per_unit: 100
  - key: path
    value: "/api/*"
    rate_limit:
      unit: MINUTE
      requests_per_unit: 60
  - key: path
    value: "/*/health"
    rate_limit:
      unlimited: true
  - key: category
    value: shadowed
    shadow_mode: true
    detailed_metric: true
    rate_limit:
      unit: hour
      requests_per_unit: 1
"#;

    #[test]
    fn nested_descriptors_in_several_domains_limit_as_envoyproxy_ratelimit_documents() {
        let c = load(NESTED).unwrap();
        assert_eq!(c.domains(), ["edge_proxy_per_ip", "mongo_cps"]);
        type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], Option<(u32, Unit)>);
        let cases: &[Case<'_>] = &[
            (
                "mongo_cps",
                &[("database", "users")],
                Some((500, Unit::Second)),
            ),
            // No default for `database`: another value is not limited.
            ("mongo_cps", &[("database", "orders")], None),
            // The default of `remote_address`, and its exact override.
            (
                "edge_proxy_per_ip",
                &[("remote_address", "10.0.0.1")],
                Some((10, Unit::Second)),
            ),
            (
                "edge_proxy_per_ip",
                &[("remote_address", "50.0.0.5")],
                Some((2000, Unit::Second)),
            ),
            // Two levels: the limit is on the node the last entry reaches.
            (
                "edge_proxy_per_ip",
                &[("to_number", "1"), ("from_number", "9")],
                Some((10, Unit::Day)),
            ),
            (
                "edge_proxy_per_ip",
                &[("to_number", "1"), ("from_number", "2061111111")],
                Some((100, Unit::Day)),
            ),
            // Fewer entries than the tree: `to_number` alone has no limit of its own.
            ("edge_proxy_per_ip", &[("to_number", "1")], None),
            // More entries than the tree is deep.
            (
                "edge_proxy_per_ip",
                &[("remote_address", "1"), ("x", "y")],
                None,
            ),
            // Wildcard values, first match in file order.
            (
                "edge_proxy_per_ip",
                &[("path", "/api/users")],
                Some((60, Unit::Minute)),
            ),
            (
                "edge_proxy_per_ip",
                &[("path", "/api/health")],
                Some((60, Unit::Minute)),
            ),
            (
                "edge_proxy_per_ip",
                &[("path", "/web/health")],
                Some((u32::MAX, Unit::Second)),
            ),
            ("edge_proxy_per_ip", &[("path", "/web")], None),
            ("unknown_domain", &[("remote_address", "1")], None),
            ("edge_proxy_per_ip", &[], None),
        ];
        for (domain, entries, want) in cases {
            assert_eq!(rate(&c, domain, entries), *want, "{domain} {entries:?}");
        }
        let Some(Limit::Limited(vip)) = c.limit_for(
            "edge_proxy_per_ip",
            [
                (&b"to_number"[..], &b"1"[..]),
                (b"from_number", b"2061111111"),
            ],
        ) else {
            panic!("vip is limited");
        };
        assert_eq!(vip.name, "vip");
        let Some(Limit::Limited(shadow)) =
            c.limit_for("edge_proxy_per_ip", [(&b"category"[..], &b"shadowed"[..])])
        else {
            panic!("shadowed is limited");
        };
        assert!(shadow.shadow && !vip.shadow);
    }

    #[test]
    fn fields_strata_does_not_implement_stop_loading_named_by_their_path() {
        let cases = [
            (
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: x}]}\n",
                "descriptors[0].rate_limit.replaces",
            ),
            (
                "domain: d\ndescriptors:\n  - key: k\n    quota_mode: true\n",
                "descriptors[0].quota_mode",
            ),
            (
                "domain: d\ndescriptors:\n  - key: k\n    descriptors:\n      - key: j\n        share_threshold: 5\n",
                "descriptors[0].descriptors[0].share_threshold",
            ),
            (
                "domain: d\ndescriptors:\n  - key: k\n    metadata: {a: b}\n",
                "descriptors[0].metadata",
            ),
            (
                "domain: d\ndescriptors:\n  - key: k\n    ratelimit: {}\n",
                "descriptors[0].ratelimit",
            ),
            ("domain: d\nrate_limit: {}\n", "rate_limit"),
        ];
        for (text, path) in cases {
            let e = load(text).unwrap_err();
            assert_eq!(e.path, path, "{text}: {e}");
            let shown = e.to_string();
            assert!(shown.starts_with("rls.yaml"), "{shown}");
        }
        let e = load("domain: d\ndescriptors:\n  - key: k\n    ratelimit: {}\n").unwrap_err();
        assert!(e.message.starts_with("unknown field `ratelimit`"), "{e}");
        let e = load(cases[0].0).unwrap_err();
        assert!(e.message.contains("does not implement"), "{e}");
    }

    #[test]
    fn bad_values_stop_loading_with_what_is_wrong() {
        let cases = [
            ("domain: ''\n", "domain", "must not be empty"),
            ("descriptors: []\n", "", "missing field `domain`"),
            (
                "domain: d\ndescriptors:\n  - key: ''\n",
                "descriptors[0].key",
                "must not be empty",
            ),
            (
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
                "descriptors[0].rate_limit.unit",
                "unknown unit `fortnight`",
            ),
            (
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: year, requests_per_unit: 1}\n",
                "descriptors[0].rate_limit.unit",
                "30 days",
            ),
            (
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 1}\n",
                "descriptors[0].rate_limit.unit",
                "needs a unit",
            ),
            (
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, unit: second}\n",
                "descriptors[0].rate_limit.unit",
                "takes no unit",
            ),
            (
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: -1}\n",
                "descriptors[0].rate_limit.requests_per_unit",
                "",
            ),
            (
                "domain: d\ndescriptors:\n  - key: k\n    value: v\n  - key: k\n    value: v\n",
                "descriptors[1]",
                "`k_v` is configured twice",
            ),
            (
                "domain: d\n---\ndomain: d\n",
                "domain",
                "`d` is configured twice",
            ),
        ];
        for (text, path, message) in cases {
            let e = load(text).unwrap_err();
            assert_eq!(e.path, path, "{text}: {e}");
            assert!(e.message.contains(message), "{text}: {e}");
        }
        let long = format!("domain: {}\n", "d".repeat(MAX_NAMESPACE_BYTES + 1));
        assert_eq!(load(&long).unwrap_err().path, "domain");
    }

    #[test]
    fn a_missing_requests_per_unit_is_zero_as_in_envoyproxy_ratelimit() {
        let c =
            load("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second}\n").unwrap();
        assert_eq!(rate(&c, "d", &[("k", "v")]), Some((0, Unit::Second)));
    }

    #[test]
    fn a_directory_loads_every_yaml_file_and_refuses_a_domain_twice() {
        let dir = std::env::temp_dir().join(format!("strata-rls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.yaml"), "domain: a\n").unwrap();
        std::fs::write(dir.join("b.yml"), "domain: b\n").unwrap();
        std::fs::write(dir.join("notes.txt"), "not yaml").unwrap();
        let c = RlsConfig::load(&dir).unwrap();
        assert_eq!(c.domains(), ["a", "b"]);
        std::fs::write(dir.join("c.yaml"), "domain: a\n").unwrap();
        let e = RlsConfig::load(&dir).unwrap_err();
        assert!(
            e.file.ends_with("c.yaml") && e.message.contains("twice"),
            "{e}"
        );
        let e = RlsConfig::load(&dir.join("missing.yaml")).unwrap_err();
        assert!(e.message.contains("cannot read"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn globs_match_any_run_of_bytes() {
        for (pattern, text, want) in [
            ("a*", "a", true),
            ("a*", "abc", true),
            ("*c", "abc", true),
            ("a*c", "abbbc", true),
            ("a*c", "abcd", false),
            ("*", "", true),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "axxbyy", false),
            ("abc", "abc", true),
            ("abc", "ab", false),
        ] {
            assert_eq!(
                glob(pattern.as_bytes(), text.as_bytes()),
                want,
                "{pattern} {text}"
            );
        }
    }
}
