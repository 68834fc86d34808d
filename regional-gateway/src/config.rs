//! Gateway settings: command-line flags, each with a `STRATA_*` environment fallback, over an
//! optional TOML file (`--config`), over documented defaults. Precedence: flag, environment,
//! file, default. Each setting is declared once, in [`Layer`]: clap reads it from the command
//! line and environment, serde from the file, and the two are merged field by field before the
//! defaults (the `DEFAULT_*` constants, which `--help` shows too) fill what is left. Every value
//! is validated before the gateway starts; a bad one stops it with one line naming the setting.

use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;
use strata_core::identity::validate_workspace;
use strata_core::{FailureMode, Region};

use crate::rls::{RlsConfig, UnknownDomain};

/// Default listen address: loopback only, so a fresh gateway is not reachable from outside.
pub const DEFAULT_LISTEN: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 8080));
/// Default region name.
pub const DEFAULT_REGION: &str = "local";
/// Default lifetime of a lease this origin grants: the core's.
pub const DEFAULT_FRESH_FOR: Duration =
    Duration::from_millis(strata_core::origin::DEFAULT_LEASE_MS);
/// Default local-only period after a failed origin call: the core's.
pub const DEFAULT_READ_RETRY: Duration =
    Duration::from_millis(strata_core::origin::DEFAULT_READ_RETRY_MS);
/// Default failure mode: decide from local memory.
pub const DEFAULT_FAILURE_MODE: &str = FailureMode::Local.as_str();
/// Default bound on one origin call (read, replay, ping).
pub const DEFAULT_ORIGIN_TIMEOUT: Duration = Duration::from_millis(300);
/// Default pause between replay passes (a pass sends every waiting cell, in batches).
pub const DEFAULT_REPLAY_INTERVAL: Duration = Duration::from_millis(100);
/// Default bound on window keys held in the gateway's local tables.
pub const DEFAULT_TABLE_CAPACITY: usize = 1_000_000;
/// Default data directory of the embedded default (relative to the working directory).
pub const DEFAULT_DATA_DIR: &str = "strata-data";
/// The global table's SQLite file under the data directory, when no `--database-url` is given.
pub const DEFAULT_DATABASE_FILE: &str = "global.db";
/// Default pause between flushes of this region's counts to the global table. With the sync
/// below, another region sees a count within about 1.5 s (p95 1.4 s in the accuracy lab), for
/// about two statements a second per gateway (`docs/LAB.md`).
pub const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_millis(500);
/// Default pause between syncs of the other regions' counts.
pub const DEFAULT_SYNC_INTERVAL: Duration = Duration::from_secs(1);
/// Default pause between syncs that read every live row (the others read what changed, and
/// miss no flush): a repair for a key the region view evicted while no region wrote it again.
pub const DEFAULT_SYNC_FULL_INTERVAL: Duration = Duration::from_secs(3_600);
/// Default random share of an interval added to each flush and sync.
pub const DEFAULT_SYNC_JITTER: f64 = 0.2;
/// Default publish floor as a fraction of the limit: the core's
/// [`PublishPolicy::default`](strata_core::PublishPolicy) (kept in millionths there).
pub const DEFAULT_PUBLISH_FLOOR: f64 =
    strata_core::gcounter::DEFAULT_PUBLISH_FLOOR_PPM as f64 / 1_000_000.0;
/// Default pause between deletions of expired global rows.
pub const DEFAULT_CLEANUP_INTERVAL: Duration = Duration::from_secs(60);
/// Default longest silence of a client in the middle of a request (or in taking an answer).
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default longest silence of a kept-alive connection between requests: longer than the idle
/// timeouts of the gateway's clients' pools, so the gateway is rarely the side that closes.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Default most connections open at once on each listener.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Default time a shutdown gives requests in flight before it closes their connections.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest accepted duration setting.
const MAX_DURATION: Duration = Duration::from_secs(3_600);

/// The global table's URL when only the data directory is known.
pub fn default_database_url(data_dir: &Path) -> String {
    format!(
        "sqlite://{}",
        data_dir.join(DEFAULT_DATABASE_FILE).display()
    )
}

/// A default as `--help` shows it: as an operator would write the value.
trait Shown {
    fn shown(&self) -> String;
}

impl Shown for Duration {
    /// `5s`, `300ms`: the humantime forms the settings accept (humantime itself writes `1m`).
    fn shown(&self) -> String {
        if self.subsec_nanos() == 0 {
            format!("{}s", self.as_secs())
        } else if self.subsec_nanos().is_multiple_of(1_000_000) {
            format!("{}ms", self.as_millis())
        } else {
            humantime::format_duration(*self).to_string()
        }
    }
}

macro_rules! shown_by_display {
    ($($ty:ty),+) => {
        $(impl Shown for $ty {
            fn shown(&self) -> String {
                self.to_string()
            }
        })+
    };
}
shown_by_display!(&str, String, SocketAddr, usize, f64, bool);

/// A setting's help: its doc comment in clap's style (no closing period), then its default.
fn help(doc: &str, default: &[String]) -> String {
    let doc = doc.trim().trim_end_matches('.');
    match default {
        [default] => format!("{doc} [default: {default}]"),
        _ => doc.to_string(),
    }
}

/// Declares [`Layer`]: the struct itself, read by clap and serde alike; its merge, one field at a
/// time; and each field's help, which ends in the default named by `#[default = ...]` (clap's own
/// `default_value` would make an absent flag indistinguishable from one given, hiding the file).
/// Doc comments must be one paragraph: clap would show a longer one without the default.
macro_rules! layer {
    (
        $(#[$attr:meta])*
        pub struct $layer:ident {
            $(
                $(#[doc = $doc:literal])+
                #[arg($($arg:tt)*)]
                $(#[default = $default:expr])?
                pub $field:ident: Option<$ty:ty>,
            )+
        }
    ) => {
        $(#[$attr])*
        pub struct $layer {
            $(
                $(#[doc = $doc])+
                #[arg($($arg)*, help = help(concat!($($doc),+), &[$(Shown::shown(&$default)),*]))]
                pub $field: Option<$ty>,
            )+
        }

        impl $layer {
            /// Each setting from `self`, else from `lower`: `flags.or(file)`.
            pub fn or(self, lower: Self) -> Self {
                Self {
                    $($field: self.$field.or(lower.$field),)+
                }
            }
        }
    };
}

layer! {
    /// One source of settings, each optional: the command line with its environment fallbacks
    /// (clap), or the `--config` file (serde: keys are the flag names, unknown keys an error).
    #[derive(Debug, Default, Clone, PartialEq, clap::Args, Deserialize)]
    #[serde(rename_all = "kebab-case", deny_unknown_fields)]
    pub struct Layer {
        /// Address to listen on. A non-loopback address requires tokens.
        #[arg(long, env = "STRATA_LISTEN", value_name = "ADDR")]
        #[default = DEFAULT_LISTEN]
        pub listen: Option<String>,
        /// This gateway's region: 1-48 bytes of [A-Za-z0-9._-].
        #[arg(long, env = "STRATA_REGION")]
        #[default = DEFAULT_REGION]
        pub region: Option<String>,
        /// Redis URL of the regional origin (redis://host:port/db). Absent: the embedded
        /// in-memory origin.
        #[arg(long, env = "STRATA_REDIS_URL", value_name = "URL")]
        pub redis_url: Option<String>,
        /// Seed nodes of a Redis Cluster as the regional origin, comma-separated
        /// (redis://host:port,redis://host:port); instead of --redis-url.
        #[arg(long, env = "STRATA_REDIS_CLUSTER", value_name = "URLS")]
        pub redis_cluster: Option<String>,
        /// API tokens as `token=workspace` pairs, comma-separated. Each token can touch only its
        /// workspace.
        #[arg(long, env = "STRATA_TOKENS", value_name = "PAIRS", hide_env_values = true)]
        pub tokens: Option<String>,
        /// File of `token=workspace` pairs, one per line (`#` starts a comment).
        #[arg(long, env = "STRATA_TOKENS_FILE", value_name = "FILE")]
        pub tokens_file: Option<PathBuf>,
        /// How long a lease from an origin decision lets a process pass requests locally.
        #[arg(long, env = "STRATA_FRESH_FOR", value_name = "DURATION")]
        #[default = DEFAULT_FRESH_FOR]
        pub fresh_for: Option<String>,
        /// After a failed origin call, how long a cell is decided locally before the next try.
        #[arg(long, env = "STRATA_READ_RETRY", value_name = "DURATION")]
        #[default = DEFAULT_READ_RETRY]
        pub read_retry: Option<String>,
        /// What a request whose decision needs the origin gets when the origin gives no answer (and for --read-retry after): local (decide from memory), allow, or deny. A lease granted before covers what it covers, and a denial the process's own count proves denies, in every mode.
        #[arg(long, env = "STRATA_FAILURE_MODE", value_name = "MODE")]
        #[default = DEFAULT_FAILURE_MODE]
        pub failure_mode: Option<String>,
        /// Bound on one origin call; past it the call fails and the failure mode decides.
        #[arg(long, env = "STRATA_ORIGIN_TIMEOUT", value_name = "DURATION")]
        #[default = DEFAULT_ORIGIN_TIMEOUT]
        pub origin_timeout: Option<String>,
        /// Pause between replay passes of accepted requests to the origin.
        #[arg(long, env = "STRATA_REPLAY_INTERVAL", value_name = "DURATION")]
        #[default = DEFAULT_REPLAY_INTERVAL]
        pub replay_interval: Option<String>,
        /// Longest a client may stay silent in the middle of a request (its headers or body), or go without taking a byte of an answer; past it the connection is closed. On the rate-limit service, the bound on one call.
        #[arg(long, env = "STRATA_READ_TIMEOUT", value_name = "DURATION")]
        #[default = DEFAULT_READ_TIMEOUT]
        pub read_timeout: Option<String>,
        /// Longest a kept-alive HTTP connection may wait for its next request before it is closed.
        #[arg(long, env = "STRATA_IDLE_TIMEOUT", value_name = "DURATION")]
        #[default = DEFAULT_IDLE_TIMEOUT]
        pub idle_timeout: Option<String>,
        /// Most connections open at once on each listener (the HTTP API, the rate-limit service); past it the gateway accepts no more until one closes.
        #[arg(long, env = "STRATA_MAX_CONNECTIONS", value_name = "CONNECTIONS")]
        #[default = DEFAULT_MAX_CONNECTIONS]
        pub max_connections: Option<usize>,
        /// On SIGTERM, how long requests in flight get to finish before their connections are closed; the replay is drained and the last flush made after.
        #[arg(long, env = "STRATA_SHUTDOWN_TIMEOUT", value_name = "DURATION")]
        #[default = DEFAULT_SHUTDOWN_TIMEOUT]
        pub shutdown_timeout: Option<String>,
        /// Most window keys held in local memory.
        #[arg(long, env = "STRATA_TABLE_CAPACITY", value_name = "KEYS")]
        #[default = DEFAULT_TABLE_CAPACITY]
        pub table_capacity: Option<usize>,
        /// Global table: mysql://user@host/db, or sqlite://path.
        #[arg(long, env = "STRATA_DATABASE_URL", value_name = "URL", hide_env_values = true)]
        #[default = default_database_url(Path::new("<data-dir>"))]
        pub database_url: Option<String>,
        /// Where the embedded default keeps its files.
        #[arg(long, env = "STRATA_DATA_DIR", value_name = "DIR")]
        #[default = DEFAULT_DATA_DIR]
        pub data_dir: Option<PathBuf>,
        /// Pause between flushes of this region's counts to the global table. Region-wide.
        #[arg(long, env = "STRATA_FLUSH_INTERVAL", value_name = "DURATION")]
        #[default = DEFAULT_FLUSH_INTERVAL]
        pub flush_interval: Option<String>,
        /// Pause between syncs of the other regions' counts. Region-wide.
        #[arg(long, env = "STRATA_SYNC_INTERVAL", value_name = "DURATION")]
        #[default = DEFAULT_SYNC_INTERVAL]
        pub sync_interval: Option<String>,
        /// Pause between syncs that read every live row of the global table (and on start); the syncs between them read only the cells written since the last, and miss no flush however late it commits. The full read repairs a key the region view evicted while no region wrote it again.
        #[arg(long, env = "STRATA_SYNC_FULL_INTERVAL", value_name = "DURATION")]
        #[default = DEFAULT_SYNC_FULL_INTERVAL]
        pub sync_full_interval: Option<String>,
        /// Random share of an interval added to each flush and sync, 0 to 1. Region-wide.
        #[arg(long, env = "STRATA_SYNC_JITTER", value_name = "FRACTION")]
        #[default = DEFAULT_SYNC_JITTER]
        pub sync_jitter: Option<f64>,
        /// Share of the limit a cell must reach before it is published, 0 to 1. Region-wide.
        #[arg(long, env = "STRATA_PUBLISH_FLOOR", value_name = "FRACTION")]
        #[default = DEFAULT_PUBLISH_FLOOR]
        pub publish_floor: Option<f64>,
        /// Pause between deletions of expired global rows.
        #[arg(long, env = "STRATA_CLEANUP_INTERVAL", value_name = "DURATION")]
        #[default = DEFAULT_CLEANUP_INTERVAL]
        pub cleanup_interval: Option<String>,
        /// Address of Envoy's rate-limit service (gRPC), for Envoy's own `ratelimit` filter. Off unless set; needs --rls-config; a non-loopback address requires tokens.
        #[arg(long, env = "STRATA_RLS_LISTEN", value_name = "ADDR")]
        pub rls_listen: Option<String>,
        /// The rate-limit service's descriptors, in envoyproxy/ratelimit's YAML shape: a file (one domain per `---` document) or a directory of .yaml files.
        #[arg(long, env = "STRATA_RLS_CONFIG", value_name = "PATH")]
        pub rls_config: Option<PathBuf>,
        /// What the rate-limit service answers a call whose domain --rls-config does not hold: deny (OVER_LIMIT, so a mistyped domain is seen at once) or ok (nothing limited). Never an error, which Envoy's `failure_mode_deny: false` would let through.
        #[arg(long, env = "STRATA_RLS_UNKNOWN_DOMAIN", value_name = "ANSWER")]
        #[default = UnknownDomain::Deny.as_str()]
        pub rls_unknown_domain: Option<String>,
        /// Have the rate-limit service's answers add the IETF RateLimit-Policy and RateLimit headers (and Retry-After on a denial) to Envoy's responses, through response_headers_to_add (true or false). Off, Envoy's own X-RateLimit-* headers are all a client sees.
        #[arg(long, env = "STRATA_RLS_RATELIMIT_HEADERS", value_name = "BOOL")]
        #[default = false]
        pub rls_ratelimit_headers: Option<bool>,
        /// Also answer decisions with X-RateLimit-Limit, -Remaining and -Reset (true or false), as the edge and the Envoy filter can.
        #[arg(long, env = "STRATA_LEGACY_HEADERS", value_name = "BOOL")]
        #[default = false]
        pub legacy_headers: Option<bool>,
    }
}

/// The command line: `--config`, the settings (each also read from `STRATA_<NAME>`), and what
/// to do.
#[derive(Debug, Default, Parser)]
#[command(
    name = "strata-gateway",
    version,
    about = "Strata regional gateway: the regional origin (Redis, or embedded in memory) and a native rate-limit API",
    long_about = None
)]
pub struct Cli {
    /// TOML file with any of the settings below (keys as the flag names: `listen`, `redis-url`, ...).
    #[arg(long, env = "STRATA_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The settings given as flags or environment variables.
    #[command(flatten)]
    pub settings: Layer,
    /// What to do: serve (the default), or a one-off task.
    #[command(subcommand)]
    pub task: Option<Task>,
}

/// One-off tasks, for an external scheduler or a deploy step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Subcommand)]
pub enum Task {
    /// Apply the global table's migrations and exit.
    Migrate,
    /// Delete expired rows of the global table and exit.
    Cleanup,
}

/// A setting that stops start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The flag that names it (`--fresh-for`).
    pub setting: &'static str,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid setting {}: {}", self.setting, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn err(setting: &'static str, message: impl fmt::Display) -> ConfigError {
    ConfigError {
        setting,
        message: message.to_string(),
    }
}

/// Validated settings the gateway runs with.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Where to listen.
    pub listen: SocketAddr,
    /// This gateway's region.
    pub region: Region,
    /// Redis URL, or `None` for the embedded origin (or a cluster).
    pub redis_url: Option<String>,
    /// Seed nodes of a Redis Cluster; empty: not a cluster.
    pub redis_cluster: Vec<String>,
    /// Token → workspace. Empty: loopback-only, workspace `default`.
    pub tokens: HashMap<String, String>,
    /// How long a lease may be used.
    pub fresh_for: Duration,
    /// Period after a failed origin call during which the failure mode decides, with no call.
    pub read_retry: Duration,
    /// What requests get while the origin gives no answer.
    pub failure_mode: FailureMode,
    /// Bound on one origin call.
    pub origin_timeout: Duration,
    /// Pause between replay passes.
    pub replay_interval: Duration,
    /// Most window keys in local memory.
    pub table_capacity: usize,
    /// What a client connection may hold the gateway to.
    pub connections: crate::listener::ConnectionLimits,
    /// How long a shutdown waits for requests in flight.
    pub shutdown_timeout: Duration,
    /// The global table's URL.
    pub database_url: String,
    /// Pause between flushes.
    pub flush_interval: Duration,
    /// Pause between syncs.
    pub sync_interval: Duration,
    /// Pause between syncs that read every live row.
    pub sync_full_interval: Duration,
    /// Random share of an interval added to each flush and sync.
    pub sync_jitter: f64,
    /// Which cells are published.
    pub publish: strata_core::PublishPolicy,
    /// Pause between cleanups.
    pub cleanup_interval: Duration,
    /// Data directory of the embedded default.
    pub data_dir: PathBuf,
    /// Whether decisions also carry the legacy `X-RateLimit-*` trio.
    pub legacy_headers: bool,
    /// Envoy's rate-limit service: where it listens and its descriptors; `None`: off.
    pub rls: Option<RlsSettings>,
}

/// Envoy's rate-limit service, when it is on.
#[derive(Clone, Debug)]
pub struct RlsSettings {
    /// Where the gRPC service listens.
    pub listen: SocketAddr,
    /// The descriptors, loaded and checked at start.
    pub config: Arc<RlsConfig>,
    /// Where they were read from (`None`: given in memory, never reloaded).
    pub path: Option<PathBuf>,
    /// What a call for a domain the descriptors do not hold is answered.
    pub unknown_domain: UnknownDomain,
    /// Whether answers carry `RateLimit-Policy`, `RateLimit` and `Retry-After` for Envoy to add.
    pub ratelimit_headers: bool,
}

impl Default for Settings {
    /// The defaults layer: what a gateway runs with when neither flag, environment nor file
    /// sets a value.
    fn default() -> Self {
        Self {
            listen: DEFAULT_LISTEN,
            region: Region::new(DEFAULT_REGION).unwrap_or_else(|_| unreachable!()),
            redis_url: None,
            redis_cluster: Vec::new(),
            tokens: HashMap::new(),
            fresh_for: DEFAULT_FRESH_FOR,
            read_retry: DEFAULT_READ_RETRY,
            failure_mode: FailureMode::Local,
            origin_timeout: DEFAULT_ORIGIN_TIMEOUT,
            replay_interval: DEFAULT_REPLAY_INTERVAL,
            table_capacity: DEFAULT_TABLE_CAPACITY,
            connections: crate::listener::ConnectionLimits {
                max_connections: DEFAULT_MAX_CONNECTIONS,
                read_timeout: Some(DEFAULT_READ_TIMEOUT),
                idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
            },
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            database_url: default_database_url(Path::new(DEFAULT_DATA_DIR)),
            flush_interval: DEFAULT_FLUSH_INTERVAL,
            sync_interval: DEFAULT_SYNC_INTERVAL,
            sync_full_interval: DEFAULT_SYNC_FULL_INTERVAL,
            sync_jitter: DEFAULT_SYNC_JITTER,
            // DEFAULT_PUBLISH_FLOOR as a policy (a unit test holds them equal).
            publish: strata_core::PublishPolicy::default(),
            cleanup_interval: DEFAULT_CLEANUP_INTERVAL,
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            legacy_headers: false,
            rls: None,
        }
    }
}

fn duration(
    setting: &'static str,
    value: Option<String>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    let Some(text) = value else {
        return Ok(default);
    };
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        err(
            setting,
            format_args!("{text:?} is not a duration like 300ms or 5s ({e})"),
        )
    })?;
    if d.is_zero() || d > MAX_DURATION {
        return Err(err(
            setting,
            format_args!("{text:?} must be above 0 and at most 1h"),
        ));
    }
    Ok(d)
}

fn fraction(setting: &'static str, value: Option<f64>, default: f64) -> Result<f64, ConfigError> {
    match value {
        None => Ok(default),
        Some(f) if (0.0..=1.0).contains(&f) => Ok(f),
        Some(f) => Err(err(setting, format_args!("{f} must be between 0 and 1"))),
    }
}

/// Parses `token=workspace` pairs separated by commas or newlines; `#` starts a comment.
pub fn parse_tokens(
    setting: &'static str,
    text: &str,
) -> Result<HashMap<String, String>, ConfigError> {
    let mut tokens = HashMap::new();
    for pair in text
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default())
        .flat_map(|l| l.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let Some((token, workspace)) = pair.split_once('=') else {
            return Err(err(setting, "expected token=workspace pairs"));
        };
        let (token, workspace) = (token.trim(), workspace.trim());
        if token.len() < 8 || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(err(
                setting,
                "a token must be at least 8 printable ASCII characters",
            ));
        }
        validate_workspace(workspace).map_err(|e| err(setting, e))?;
        if tokens
            .insert(token.to_string(), workspace.to_string())
            .is_some()
        {
            return Err(err(setting, "a token appears twice"));
        }
    }
    Ok(tokens)
}

impl Settings {
    /// The flush interval in ms: what the replay paces published cells by.
    pub fn flush_ms(&self) -> u64 {
        u64::try_from(self.flush_interval.as_millis()).unwrap_or(u64::MAX)
    }

    /// Resolves the command line (with its environment fallbacks) over the optional file, over
    /// the defaults.
    pub fn from_cli(cli: Cli) -> Result<Self, ConfigError> {
        let file = match &cli.config {
            Some(path) => read_file(path)?,
            None => Layer::default(),
        };
        Self::resolve(cli.settings.or(file))
    }

    /// Validates the merged `layer`, taking what it leaves from [`Settings::default`].
    pub fn resolve(layer: Layer) -> Result<Self, ConfigError> {
        let d = Settings::default();
        let listen = match layer.listen {
            Some(text) => address("--listen", &text, "127.0.0.1:8080")?,
            None => d.listen,
        };
        let region = match layer.region {
            Some(name) => Region::new(name.trim()).map_err(|e| err("--region", e))?,
            None => d.region,
        };
        let redis_url = layer.redis_url.map(|u| u.trim().to_string());
        if let Some(url) = &redis_url
            && !(url.starts_with("redis://")
                || url.starts_with("rediss://")
                || url.starts_with("unix://"))
        {
            return Err(err(
                "--redis-url",
                "must start with redis://, rediss:// or unix://",
            ));
        }
        let redis_cluster: Vec<String> = layer
            .redis_cluster
            .iter()
            .flat_map(|seeds| seeds.split(','))
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_string)
            .collect();
        if let Some(bad) = redis_cluster
            .iter()
            .find(|u| !(u.starts_with("redis://") || u.starts_with("rediss://")))
        {
            return Err(err(
                "--redis-cluster",
                format_args!("{bad:?} must start with redis:// or rediss://"),
            ));
        }
        if layer.redis_cluster.is_some() && redis_cluster.is_empty() {
            return Err(err("--redis-cluster", "names no seed node"));
        }
        if redis_url.is_some() && !redis_cluster.is_empty() {
            return Err(err(
                "--redis-cluster",
                "a gateway has one regional origin: give --redis-url or --redis-cluster, not both",
            ));
        }
        let mut tokens = match layer.tokens {
            Some(text) => parse_tokens("--tokens", &text)?,
            None => d.tokens,
        };
        if let Some(path) = layer.tokens_file {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                err(
                    "--tokens-file",
                    format_args!("cannot read {}: {e}", path.display()),
                )
            })?;
            for (token, workspace) in parse_tokens("--tokens-file", &text)? {
                if tokens.insert(token, workspace).is_some() {
                    return Err(err("--tokens-file", "a token is also in --tokens"));
                }
            }
        }
        open_only_with_tokens("--listen", listen, &tokens)?;
        let rls = rls(
            layer.rls_listen,
            layer.rls_config,
            layer.rls_unknown_domain,
            layer.rls_ratelimit_headers.unwrap_or(false),
            &tokens,
        )?;
        let data_dir = layer.data_dir.unwrap_or(d.data_dir);
        let database_url = match layer.database_url.map(|u| u.trim().to_string()) {
            Some(url) if url.starts_with("mysql://") || url.starts_with("sqlite:") => url,
            Some(_) => {
                return Err(err(
                    "--database-url",
                    "must start with mysql:// or sqlite://",
                ));
            }
            None => default_database_url(&data_dir),
        };
        let floor = fraction(
            "--publish-floor",
            layer.publish_floor,
            DEFAULT_PUBLISH_FLOOR,
        )?;
        let publish = strata_core::PublishPolicy::from_fraction(floor)
            .map_err(|e| err("--publish-floor", e))?;
        // Checked in this order: the first bad value is the one reported.
        Ok(Settings {
            flush_interval: duration("--flush-interval", layer.flush_interval, d.flush_interval)?,
            sync_interval: duration("--sync-interval", layer.sync_interval, d.sync_interval)?,
            sync_full_interval: duration(
                "--sync-full-interval",
                layer.sync_full_interval,
                d.sync_full_interval,
            )?,
            sync_jitter: fraction("--sync-jitter", layer.sync_jitter, d.sync_jitter)?,
            publish,
            cleanup_interval: duration(
                "--cleanup-interval",
                layer.cleanup_interval,
                d.cleanup_interval,
            )?,
            fresh_for: duration("--fresh-for", layer.fresh_for, d.fresh_for)?,
            read_retry: duration("--read-retry", layer.read_retry, d.read_retry)?,
            origin_timeout: duration("--origin-timeout", layer.origin_timeout, d.origin_timeout)?,
            replay_interval: duration(
                "--replay-interval",
                layer.replay_interval,
                d.replay_interval,
            )?,
            table_capacity: match layer.table_capacity {
                Some(0) => return Err(err("--table-capacity", "must be at least 1")),
                Some(n) => n,
                None => d.table_capacity,
            },
            connections: crate::listener::ConnectionLimits {
                max_connections: match layer.max_connections {
                    Some(0) => return Err(err("--max-connections", "must be at least 1")),
                    Some(n) => n,
                    None => d.connections.max_connections,
                },
                read_timeout: Some(duration(
                    "--read-timeout",
                    layer.read_timeout,
                    DEFAULT_READ_TIMEOUT,
                )?),
                idle_timeout: Some(duration(
                    "--idle-timeout",
                    layer.idle_timeout,
                    DEFAULT_IDLE_TIMEOUT,
                )?),
            },
            shutdown_timeout: duration(
                "--shutdown-timeout",
                layer.shutdown_timeout,
                d.shutdown_timeout,
            )?,
            legacy_headers: layer.legacy_headers.unwrap_or(d.legacy_headers),
            failure_mode: match layer.failure_mode {
                None => d.failure_mode,
                Some(text) => text
                    .parse()
                    .map_err(|e| err("--failure-mode", format_args!("{text:?} is {e}")))?,
            },
            listen,
            region,
            redis_url,
            redis_cluster,
            tokens,
            database_url,
            data_dir,
            rls,
        })
    }
}

/// The socket address `text` of `setting` (`example` shows the form).
fn address(setting: &'static str, text: &str, example: &str) -> Result<SocketAddr, ConfigError> {
    text.trim().parse::<SocketAddr>().map_err(|_| {
        err(
            setting,
            format_args!("{text:?} is not an address like {example}"),
        )
    })
}

/// Refuses a listener off loopback when no token guards it: every listener serves workspaces.
fn open_only_with_tokens(
    setting: &'static str,
    listen: SocketAddr,
    tokens: &HashMap<String, String>,
) -> Result<(), ConfigError> {
    if tokens.is_empty() && !listen.ip().is_loopback() {
        return Err(err(
            setting,
            format_args!(
                "refusing to listen on {listen} without tokens: set --tokens or --tokens-file, or listen on loopback"
            ),
        ));
    }
    Ok(())
}

/// The rate-limit service's settings: both or neither of `--rls-listen` and `--rls-config`.
fn rls(
    listen: Option<String>,
    config: Option<PathBuf>,
    unknown_domain: Option<String>,
    ratelimit_headers: bool,
    tokens: &HashMap<String, String>,
) -> Result<Option<RlsSettings>, ConfigError> {
    let (listen, path) = match (listen, config) {
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(err(
                "--rls-listen",
                "needs --rls-config, the descriptors it serves",
            ));
        }
        (None, Some(_)) => {
            return Err(err(
                "--rls-config",
                "is read only by the service --rls-listen starts: set both",
            ));
        }
        (Some(listen), Some(path)) => (listen, path),
    };
    let listen = address("--rls-listen", &listen, "127.0.0.1:8081")?;
    open_only_with_tokens("--rls-listen", listen, tokens)?;
    let config = RlsConfig::load(&path).map_err(|e| err("--rls-config", e))?;
    let unknown_domain = match unknown_domain {
        None => UnknownDomain::default(),
        Some(text) => text.parse().map_err(|()| {
            err(
                "--rls-unknown-domain",
                format_args!("{text:?} is neither `deny` nor `ok`"),
            )
        })?,
    };
    Ok(Some(RlsSettings {
        listen,
        config: Arc::new(config),
        path: Some(path),
        unknown_domain,
        ratelimit_headers,
    }))
}

/// The `--config` file as a [`Layer`]; an error names the file, and the key when one is at fault.
fn read_file(path: &Path) -> Result<Layer, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        err(
            "--config",
            format_args!("cannot read {}: {e}", path.display()),
        )
    })?;
    let invalid =
        |reason: &dyn fmt::Display| err("--config", format_args!("{}: {reason}", path.display()));
    let document = toml::Deserializer::parse(&text).map_err(|e| invalid(&e.message()))?;
    serde_path_to_error::deserialize(document).map_err(|e| {
        let (key, reason) = (e.path().to_string(), e.inner().message());
        // `.` is the document itself; an unknown key's message names the key already.
        if key == "." || reason.contains(&format!("`{key}`")) {
            invalid(&reason)
        } else {
            invalid(&format_args!("{key}: {reason}"))
        }
    })
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn cli(args: &[&str]) -> Cli {
        let mut all = vec!["strata-gateway"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).unwrap()
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("strata-config-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn defaults_are_the_embedded_loopback_gateway() {
        let s = Settings::from_cli(Cli::default()).unwrap();
        assert_eq!(s.listen, DEFAULT_LISTEN);
        assert_eq!(s.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(s.region.as_str(), "local");
        assert!(s.redis_url.is_none() && s.tokens.is_empty());
        assert_eq!(s.fresh_for, Duration::from_secs(5));
        assert_eq!(s.origin_timeout, Duration::from_millis(300));
        assert_eq!(s.database_url, "sqlite://strata-data/global.db");
        assert_eq!(
            strata_core::PublishPolicy::from_fraction(DEFAULT_PUBLISH_FLOOR).unwrap(),
            strata_core::PublishPolicy::default()
        );
        assert_eq!(
            format!("{s:?}"),
            format!("{:?}", Settings::default()),
            "an empty layer resolves to Settings::default()"
        );
    }

    /// Every default `--help` shows, given back as that flag, resolves to what the gateway runs
    /// with by default: the help and the code read the same constants.
    #[test]
    fn the_defaults_help_shows_are_the_defaults_the_gateway_runs_with() {
        let command = Cli::command();
        let mut checked = 0;
        for arg in command.get_arguments() {
            let (Some(long), Some(help)) = (arg.get_long(), arg.get_help()) else {
                continue;
            };
            let help = help.to_string();
            let Some((_, rest)) = help.split_once("[default: ") else {
                continue;
            };
            let shown = rest.split(']').next().unwrap();
            if shown.contains('<') {
                // A placeholder (`sqlite://<data-dir>/global.db`), checked in the test above.
                continue;
            }
            let flag = format!("--{long}");
            let s = Settings::from_cli(cli(&[&flag, shown])).unwrap();
            assert_eq!(
                format!("{s:?}"),
                format!("{:?}", Settings::default()),
                "{flag} {shown}"
            );
            checked += 1;
        }
        assert_eq!(checked, 22, "every setting with a plain default");
    }

    #[test]
    fn the_failure_mode_is_one_of_three_words() {
        for (word, mode) in [
            ("local", FailureMode::Local),
            ("allow", FailureMode::Allow),
            ("deny", FailureMode::Deny),
        ] {
            let s = Settings::from_cli(cli(&["--failure-mode", word])).unwrap();
            assert_eq!(s.failure_mode, mode);
            assert_eq!(mode.as_str(), word);
        }
        let e = Settings::from_cli(cli(&["--failure-mode", "open"])).unwrap_err();
        assert_eq!(e.setting, "--failure-mode");
        assert!(e.to_string().contains("local, allow, deny"), "{e}");
    }

    #[test]
    fn cluster_seeds_are_a_comma_separated_list() {
        let s = Settings::from_cli(cli(&[
            "--redis-cluster",
            "redis://10.0.0.1:6379, redis://10.0.0.2:6379,",
        ]))
        .unwrap();
        assert_eq!(
            s.redis_cluster,
            ["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"]
        );
        assert!(s.redis_url.is_none());
    }

    #[test]
    fn the_rate_limit_service_needs_both_its_settings_and_tokens_off_loopback() {
        let dir = std::env::temp_dir().join(format!("strata-rls-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("rls.yaml");
        std::fs::write(&good, "domain: d\n").unwrap();
        let bad = dir.join("bad.yaml");
        std::fs::write(
            &bad,
            "domain: d\ndescriptors:\n  - key: k\n    quota_mode: true\n",
        )
        .unwrap();
        let (good, bad) = (good.to_str().unwrap(), bad.to_str().unwrap());
        assert!(
            Settings::from_cli(cli(&[])).unwrap().rls.is_none(),
            "off by default"
        );
        let on = Settings::from_cli(cli(&[
            "--rls-listen",
            "127.0.0.1:8081",
            "--rls-config",
            good,
        ]))
        .unwrap()
        .rls
        .unwrap();
        assert_eq!(on.listen.to_string(), "127.0.0.1:8081");
        assert!(on.config.has_domain("d"));
        for (args, setting, says) in [
            (
                vec!["--rls-listen", "127.0.0.1:8081"],
                "--rls-listen",
                "needs --rls-config",
            ),
            (vec!["--rls-config", good], "--rls-config", "set both"),
            (
                vec!["--rls-listen", "nowhere", "--rls-config", good],
                "--rls-listen",
                "not an address",
            ),
            (
                vec!["--rls-listen", "0.0.0.0:8081", "--rls-config", good],
                "--rls-listen",
                "without tokens",
            ),
            (
                vec!["--rls-listen", "127.0.0.1:8081", "--rls-config", bad],
                "--rls-config",
                "descriptors[0].quota_mode",
            ),
        ] {
            let e = Settings::from_cli(cli(&args)).unwrap_err();
            assert_eq!(e.setting, setting, "{args:?}: {e}");
            assert!(e.to_string().contains(says), "{args:?}: {e}");
        }
        let public = Settings::from_cli(cli(&[
            "--rls-listen",
            "0.0.0.0:8081",
            "--rls-config",
            good,
            "--tokens",
            "s3cret-token=acme",
        ]));
        assert!(public.is_ok(), "tokens allow a public listener");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_public_listener_without_tokens_refuses_to_start() {
        let e = Settings::from_cli(cli(&["--listen", "0.0.0.0:8080"])).unwrap_err();
        assert_eq!(e.setting, "--listen");
        assert!(e.to_string().contains("without tokens"), "{e}");
        let ok = Settings::from_cli(cli(&[
            "--listen",
            "0.0.0.0:8080",
            "--tokens",
            "s3cret-token=acme",
        ]))
        .unwrap();
        assert_eq!(
            ok.tokens.get("s3cret-token").map(String::as_str),
            Some("acme")
        );
    }

    #[test]
    fn bad_values_name_their_setting() {
        for (args, setting) in [
            (vec!["--fresh-for", "soon"], "--fresh-for"),
            (vec!["--origin-timeout", "0s"], "--origin-timeout"),
            (vec!["--cleanup-interval", "2h"], "--cleanup-interval"),
            (vec!["--region", "eu west"], "--region"),
            (vec!["--listen", "localhost"], "--listen"),
            (vec!["--redis-url", "http://x"], "--redis-url"),
            (
                vec!["--redis-cluster", "redis://a:1,http://b:2"],
                "--redis-cluster",
            ),
            (vec!["--redis-cluster", " , "], "--redis-cluster"),
            (
                vec![
                    "--redis-url",
                    "redis://a:1",
                    "--redis-cluster",
                    "redis://b:2",
                ],
                "--redis-cluster",
            ),
            (vec!["--database-url", "postgres://x"], "--database-url"),
            (vec!["--tokens", "short=acme"], "--tokens"),
            (vec!["--tokens", "long-enough-token"], "--tokens"),
            (vec!["--table-capacity", "0"], "--table-capacity"),
            (vec!["--sync-jitter", "1.5"], "--sync-jitter"),
            (vec!["--publish-floor=-0.1"], "--publish-floor"),
        ] {
            let e = Settings::from_cli(cli(&args)).unwrap_err();
            assert_eq!(e.setting, setting, "{args:?}: {e}");
        }
        // Not a number at all: clap's own error, which names the flag (and exits with 2).
        let e = Cli::try_parse_from(["strata-gateway", "--table-capacity", "many"]).unwrap_err();
        assert!(e.to_string().contains("--table-capacity"), "{e}");
        assert_eq!(e.exit_code(), 2);
    }

    #[test]
    fn the_file_fills_what_flags_leave_and_rejects_unknown_keys() {
        let dir = temp_dir("fill");
        let good = dir.join("good.toml");
        std::fs::write(&good, "region = \"eu-west\"\nfresh-for = \"2s\"\n").unwrap();
        let s = Settings::from_cli(cli(&[
            "--config",
            good.to_str().unwrap(),
            "--region",
            "us-east",
        ]))
        .unwrap();
        assert_eq!(s.region.as_str(), "us-east", "the flag wins");
        assert_eq!(
            s.fresh_for,
            Duration::from_secs(2),
            "the file fills the rest"
        );
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "fresh_for_typo = \"2s\"\n").unwrap();
        let e = Settings::from_cli(cli(&["--config", bad.to_str().unwrap()])).unwrap_err();
        assert_eq!(e.setting, "--config");
        assert!(e.message.contains("unknown field"), "{e}");
        assert!(e.message.contains("fresh_for_typo"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_bad_value_in_the_file_names_the_file_and_its_key() {
        let dir = temp_dir("bad-value");
        let file = dir.join("strata.toml");
        std::fs::write(&file, "region = \"eu\"\ntable-capacity = \"many\"\n").unwrap();
        let e = Settings::from_cli(cli(&["--config", file.to_str().unwrap()])).unwrap_err();
        assert_eq!(e.setting, "--config");
        assert!(
            e.message
                .starts_with(&format!("{}: table-capacity: ", file.display())),
            "{e}"
        );
        assert!(!e.to_string().contains('\n'), "one line: {e}");
        std::fs::write(&file, "table-capacity = \n").unwrap();
        let e = Settings::from_cli(cli(&["--config", file.to_str().unwrap()])).unwrap_err();
        assert!(e.message.starts_with(&file.display().to_string()), "{e}");
        assert!(!e.to_string().contains('\n'), "one line: {e}");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Flag over file over default, field by field; the environment sits between flag and file
    /// inside clap (tests/it/settings.rs runs the binary with all four).
    #[test]
    fn layers_merge_field_by_field() {
        let flags = Layer {
            region: Some("from-flag".into()),
            ..Layer::default()
        };
        let file = Layer {
            region: Some("from-file".into()),
            fresh_for: Some("2s".into()),
            ..Layer::default()
        };
        let s = Settings::resolve(flags.or(file)).unwrap();
        assert_eq!(s.region.as_str(), "from-flag");
        assert_eq!(s.fresh_for, Duration::from_secs(2));
        assert_eq!(s.read_retry, DEFAULT_READ_RETRY);
    }

    #[test]
    fn tokens_parse_from_pairs_and_lines_with_comments() {
        let t = parse_tokens(
            "--tokens",
            "aaaaaaaa=one, bbbbbbbb=two\n# note\ncccccccc=one # trailing",
        )
        .unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t["cccccccc"], "one");
        assert!(parse_tokens("--tokens", "aaaaaaaa=one,aaaaaaaa=two").is_err());
    }
}
