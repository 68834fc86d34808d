//! Gateway settings: command-line flags, each with a `STRATA_*` environment fallback, over an
//! optional TOML file (`--config`), over documented defaults. Precedence: flag, environment,
//! file, default. Every value is validated before the gateway starts; a bad one stops it with
//! one line naming the setting.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;
use strata_core::Region;
use strata_core::identity::validate_workspace;

/// Default listen address: loopback only, so a fresh gateway is not reachable from outside.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// Default region name.
pub const DEFAULT_REGION: &str = "local";
/// Default bound on one origin call (read, replay, ping).
pub const DEFAULT_ORIGIN_TIMEOUT: Duration = Duration::from_millis(300);
/// Default pause between replay batches.
pub const DEFAULT_REPLAY_INTERVAL: Duration = Duration::from_millis(100);
/// Default bound on window keys held in the gateway's local tables.
pub const DEFAULT_TABLE_CAPACITY: usize = 1_000_000;

/// The command line. Every flag also reads `STRATA_<NAME>` from the environment.
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
    /// Address to listen on [default: 127.0.0.1:8080]. A non-loopback address requires tokens.
    #[arg(long, env = "STRATA_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,
    /// This gateway's region: 1-48 bytes of [A-Za-z0-9._-] [default: local].
    #[arg(long, env = "STRATA_REGION")]
    pub region: Option<String>,
    /// Redis URL of the regional origin (redis://host:port/db). Absent: the embedded in-memory origin.
    #[arg(long, env = "STRATA_REDIS_URL", value_name = "URL")]
    pub redis_url: Option<String>,
    /// API tokens as `token=workspace` pairs, comma-separated. Each token can touch only its workspace.
    #[arg(
        long,
        env = "STRATA_TOKENS",
        value_name = "PAIRS",
        hide_env_values = true
    )]
    pub tokens: Option<String>,
    /// File of `token=workspace` pairs, one per line (`#` starts a comment).
    #[arg(long, env = "STRATA_TOKENS_FILE", value_name = "FILE")]
    pub tokens_file: Option<PathBuf>,
    /// How long a lease from an origin decision lets a process pass requests locally [default: 5s].
    #[arg(long, env = "STRATA_FRESH_FOR", value_name = "DURATION")]
    pub fresh_for: Option<String>,
    /// After a failed origin call, how long a cell is decided locally before the next try [default: 300ms].
    #[arg(long, env = "STRATA_READ_RETRY", value_name = "DURATION")]
    pub read_retry: Option<String>,
    /// Bound on one origin call; past it the call fails and decisions fall back to local [default: 300ms].
    #[arg(long, env = "STRATA_ORIGIN_TIMEOUT", value_name = "DURATION")]
    pub origin_timeout: Option<String>,
    /// Pause between replay batches of accepted requests to the origin [default: 100ms].
    #[arg(long, env = "STRATA_REPLAY_INTERVAL", value_name = "DURATION")]
    pub replay_interval: Option<String>,
    /// Most window keys held in local memory [default: 1000000].
    #[arg(long, env = "STRATA_TABLE_CAPACITY", value_name = "KEYS")]
    pub table_capacity: Option<usize>,
    /// Global table: mysql://user@host/db, or sqlite://path [default: sqlite://<data-dir>/global.db].
    #[arg(
        long,
        env = "STRATA_DATABASE_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    pub database_url: Option<String>,
    /// Where the embedded default keeps its files [default: ./strata-data].
    #[arg(long, env = "STRATA_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Pause between flushes of this region's counts to the global table [default: 5s]. Region-wide.
    #[arg(long, env = "STRATA_FLUSH_INTERVAL", value_name = "DURATION")]
    pub flush_interval: Option<String>,
    /// Pause between syncs of the other regions' counts [default: 5s]. Region-wide.
    #[arg(long, env = "STRATA_SYNC_INTERVAL", value_name = "DURATION")]
    pub sync_interval: Option<String>,
    /// Random share of an interval added to each flush and sync, 0 to 1 [default: 0.2]. Region-wide.
    #[arg(long, env = "STRATA_SYNC_JITTER", value_name = "FRACTION")]
    pub sync_jitter: Option<f64>,
    /// Share of the limit a cell must reach before it is published, 0 to 1 [default: 0.2]. Region-wide.
    #[arg(long, env = "STRATA_PUBLISH_FLOOR", value_name = "FRACTION")]
    pub publish_floor: Option<f64>,
    /// Pause between deletions of expired global rows [default: 60s].
    #[arg(long, env = "STRATA_CLEANUP_INTERVAL", value_name = "DURATION")]
    pub cleanup_interval: Option<String>,
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

/// The optional TOML file: the same settings, kebab-case; unknown keys are an error.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    region: Option<String>,
    redis_url: Option<String>,
    tokens: Option<String>,
    tokens_file: Option<PathBuf>,
    fresh_for: Option<String>,
    read_retry: Option<String>,
    origin_timeout: Option<String>,
    replay_interval: Option<String>,
    table_capacity: Option<usize>,
    database_url: Option<String>,
    data_dir: Option<PathBuf>,
    flush_interval: Option<String>,
    sync_interval: Option<String>,
    sync_jitter: Option<f64>,
    publish_floor: Option<f64>,
    cleanup_interval: Option<String>,
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
    /// Redis URL, or `None` for the embedded origin.
    pub redis_url: Option<String>,
    /// Token → workspace. Empty: loopback-only, workspace `default`.
    pub tokens: HashMap<String, String>,
    /// How long a lease may be used.
    pub fresh_for: Duration,
    /// Local-only period after a failed read.
    pub read_retry: Duration,
    /// Bound on one origin call.
    pub origin_timeout: Duration,
    /// Pause between replay batches.
    pub replay_interval: Duration,
    /// Most window keys in local memory.
    pub table_capacity: usize,
    /// The global table's URL.
    pub database_url: String,
    /// Pause between flushes.
    pub flush_interval: Duration,
    /// Pause between syncs.
    pub sync_interval: Duration,
    /// Random share of an interval added to each flush and sync.
    pub sync_jitter: f64,
    /// Which cells are published.
    pub publish: strata_core::PublishPolicy,
    /// Pause between cleanups.
    pub cleanup_interval: Duration,
    /// Data directory of the embedded default.
    pub data_dir: PathBuf,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            region: Region::new(DEFAULT_REGION).unwrap_or_else(|_| unreachable!()),
            redis_url: None,
            tokens: HashMap::new(),
            fresh_for: Duration::from_millis(strata_core::origin::DEFAULT_LEASE_MS),
            read_retry: Duration::from_millis(strata_core::origin::DEFAULT_READ_RETRY_MS),
            origin_timeout: DEFAULT_ORIGIN_TIMEOUT,
            replay_interval: DEFAULT_REPLAY_INTERVAL,
            table_capacity: DEFAULT_TABLE_CAPACITY,
            database_url: "sqlite://strata-data/global.db".into(),
            flush_interval: Duration::from_secs(5),
            sync_interval: Duration::from_secs(5),
            sync_jitter: 0.2,
            publish: strata_core::PublishPolicy::default(),
            cleanup_interval: Duration::from_secs(60),
            data_dir: PathBuf::from("strata-data"),
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
    if d.is_zero() || d > Duration::from_secs(3_600) {
        return Err(err(
            setting,
            format_args!("{text:?} must be above 0 and at most 1h"),
        ));
    }
    Ok(d)
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
    /// Resolves the command line (with its environment fallbacks) over the optional file.
    pub fn from_cli(cli: Cli) -> Result<Self, ConfigError> {
        let file = match &cli.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let d = Settings::default();
        let listen_text = cli.listen.or(file.listen);
        let listen = match listen_text {
            Some(text) => text.trim().parse::<SocketAddr>().map_err(|_| {
                err(
                    "--listen",
                    format_args!("{text:?} is not an address like 127.0.0.1:8080"),
                )
            })?,
            None => d.listen,
        };
        let region = match cli.region.or(file.region) {
            Some(name) => Region::new(name.trim()).map_err(|e| err("--region", e))?,
            None => d.region,
        };
        let redis_url = cli
            .redis_url
            .or(file.redis_url)
            .map(|u| u.trim().to_string());
        if let Some(url) = &redis_url {
            if !(url.starts_with("redis://")
                || url.starts_with("rediss://")
                || url.starts_with("unix://"))
            {
                return Err(err(
                    "--redis-url",
                    "must start with redis://, rediss:// or unix://",
                ));
            }
        }
        let mut tokens = match cli.tokens.or(file.tokens) {
            Some(text) => parse_tokens("--tokens", &text)?,
            None => HashMap::new(),
        };
        if let Some(path) = cli.tokens_file.or(file.tokens_file) {
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
        if tokens.is_empty() && !listen.ip().is_loopback() {
            return Err(err(
                "--listen",
                format_args!(
                    "refusing to listen on {listen} without tokens: set --tokens or --tokens-file, or listen on loopback"
                ),
            ));
        }
        let positive = |setting: &'static str, value: Option<usize>, default: usize| match value {
            Some(0) => Err(err(setting, "must be at least 1")),
            Some(n) => Ok(n),
            None => Ok(default),
        };
        let data_dir = cli
            .data_dir
            .or(file.data_dir)
            .unwrap_or_else(|| d.data_dir.clone());
        let database_url = match cli
            .database_url
            .or(file.database_url)
            .map(|u| u.trim().to_string())
        {
            Some(url) if url.starts_with("mysql://") || url.starts_with("sqlite:") => url,
            Some(_) => {
                return Err(err(
                    "--database-url",
                    "must start with mysql:// or sqlite://",
                ));
            }
            None => format!("sqlite://{}", data_dir.join("global.db").display()),
        };
        let fraction = |setting: &'static str, value: Option<f64>, default: f64| match value {
            None => Ok(default),
            Some(f) if (0.0..=1.0).contains(&f) => Ok(f),
            Some(f) => Err(err(setting, format_args!("{f} must be between 0 and 1"))),
        };
        let floor = fraction(
            "--publish-floor",
            cli.publish_floor.or(file.publish_floor),
            0.2,
        )?;
        Ok(Settings {
            database_url,
            data_dir,
            flush_interval: duration(
                "--flush-interval",
                cli.flush_interval.or(file.flush_interval),
                d.flush_interval,
            )?,
            sync_interval: duration(
                "--sync-interval",
                cli.sync_interval.or(file.sync_interval),
                d.sync_interval,
            )?,
            sync_jitter: fraction(
                "--sync-jitter",
                cli.sync_jitter.or(file.sync_jitter),
                d.sync_jitter,
            )?,
            publish: strata_core::PublishPolicy::from_fraction(floor)
                .map_err(|e| err("--publish-floor", e))?,
            cleanup_interval: duration(
                "--cleanup-interval",
                cli.cleanup_interval.or(file.cleanup_interval),
                d.cleanup_interval,
            )?,
            listen,
            region,
            redis_url,
            tokens,
            fresh_for: duration("--fresh-for", cli.fresh_for.or(file.fresh_for), d.fresh_for)?,
            read_retry: duration(
                "--read-retry",
                cli.read_retry.or(file.read_retry),
                d.read_retry,
            )?,
            origin_timeout: duration(
                "--origin-timeout",
                cli.origin_timeout.or(file.origin_timeout),
                d.origin_timeout,
            )?,
            replay_interval: duration(
                "--replay-interval",
                cli.replay_interval.or(file.replay_interval),
                d.replay_interval,
            )?,
            table_capacity: positive(
                "--table-capacity",
                cli.table_capacity.or(file.table_capacity),
                d.table_capacity,
            )?,
        })
    }
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        err(
            "--config",
            format_args!("cannot read {}: {e}", path.display()),
        )
    })?;
    toml::from_str(&text).map_err(|e| {
        let reason = e.message().to_string();
        err("--config", format_args!("{}: {reason}", path.display()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        let mut all = vec!["strata-gateway"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).unwrap()
    }

    #[test]
    fn defaults_are_the_embedded_loopback_gateway() {
        let s = Settings::from_cli(Cli::default()).unwrap();
        assert_eq!(s.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(s.region.as_str(), "local");
        assert!(s.redis_url.is_none() && s.tokens.is_empty());
        assert_eq!(s.fresh_for, Duration::from_secs(5));
        assert_eq!(s.origin_timeout, Duration::from_millis(300));
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
            (vec!["--region", "eu west"], "--region"),
            (vec!["--listen", "localhost"], "--listen"),
            (vec!["--redis-url", "http://x"], "--redis-url"),
            (vec!["--tokens", "short=acme"], "--tokens"),
            (vec!["--tokens", "long-enough-token"], "--tokens"),
            (vec!["--table-capacity", "0"], "--table-capacity"),
        ] {
            let e = Settings::from_cli(cli(&args)).unwrap_err();
            assert_eq!(e.setting, setting, "{args:?}: {e}");
        }
    }

    #[test]
    fn the_file_fills_what_flags_leave_and_rejects_unknown_keys() {
        let dir = std::env::temp_dir().join(format!("strata-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
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
