//! Real `strata-gateway` processes started from the built binary (`super::gateway_binary()`;
//! `wasm-tests` includes this file too), for claims about several
//! processes: the defaults a user would run (no `STRATA_*` setting leaks in from this
//! environment), a free loopback port, and a data dir of its own unless one is given.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// One gateway process: killed on drop, and its data dir removed if it made one.
pub struct GatewayProcess {
    child: Child,
    own_dir: Option<PathBuf>,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = &self.own_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl GatewayProcess {
    /// Spawns a gateway on a free port with `args` (a `--data-dir` among them, or one of its
    /// own is added).
    pub fn start(args: &[&str]) -> Self {
        Self::start_with_env(args, &[])
    }

    /// [`start`](Self::start) with `env` set for the process.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_logged(args, env, None)
    }

    /// [`start_with_env`](Self::start_with_env), its log (at `info`) written to `log` if given.
    pub fn start_logged(
        args: &[&str],
        env: &[(&str, &str)],
        log: Option<&std::path::Path>,
    ) -> Self {
        let port = super::free_port();
        let mut command = Command::new(super::gateway_binary());
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("STRATA_") {
                command.env_remove(key);
            }
        }
        command.args(["--listen", &format!("127.0.0.1:{port}")]);
        command.args(args);
        let own_dir = (!args.contains(&"--data-dir")).then(|| {
            let dir =
                std::env::temp_dir().join(format!("strata-process-{}-{port}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            command.arg("--data-dir").arg(&dir);
            dir
        });
        command.envs(env.iter().copied());
        let stderr = match log {
            Some(path) => {
                command.env("STRATA_LOG", "info");
                Stdio::from(std::fs::File::create(path).unwrap())
            }
            None => {
                command.env("STRATA_LOG", "warn");
                Stdio::inherit()
            }
        };
        let child = command
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        Self {
            child,
            own_dir,
            base: format!("http://127.0.0.1:{port}"),
        }
    }

    /// Stops the gateway as an operator would (SIGTERM: it drains its replays) and waits for
    /// it to exit; its exit code.
    pub fn terminate(&mut self) -> Option<i32> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Sends the gateway SIGHUP (it reloads `--rls-config`).
    pub fn hangup(&self) {
        let status = Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -HUP: {status}");
    }

    /// Waits until the gateway answers `/readyz` with 200 (30 s at most; fails at once if the
    /// process exits).
    pub async fn ready(&mut self, http: &reqwest::Client) {
        self.answers(http, "/readyz", "ready").await;
    }

    /// Waits until `/healthz` answers (30 s at most): the process serves, whether or not its
    /// origin answers in time (`/readyz` is a round trip to it).
    pub async fn alive(&mut self, http: &reqwest::Client) {
        self.answers(http, "/healthz", "serving").await;
    }

    /// Polls `path` until it answers 200 (30 s at most; fails at once if the process exits).
    async fn answers(&mut self, http: &reqwest::Client, path: &str, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let answer = http.get(format!("{}{path}", self.base)).send().await;
            if answer.is_ok_and(|r| r.status() == 200) {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("gateway {} exited before {what}: {status}", self.base);
            }
            assert!(
                Instant::now() < deadline,
                "gateway {} not {what} within 30 s",
                self.base
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

/// `GET <base>/metrics`: the Prometheus text of a gateway listening on a socket.
pub async fn metrics(http: &reqwest::Client, base: &str) -> String {
    http.get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The sum of the values of the metric lines `select` picks.
pub fn metric_sum(text: &str, select: impl Fn(&str) -> bool) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#') && select(l))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Decision calls a gateway made to its origin so far (one per decision it made itself, and
/// one per decide call an edge made to it).
pub async fn decide_calls(http: &reqwest::Client, base: &str) -> u64 {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // a count
    let calls = origin_calls(http, base, "decide").await as u64;
    calls
}

/// A gateway's origin calls of kind `op` (`decide`, `replay`, `read`) so far.
pub async fn origin_calls(http: &reqwest::Client, base: &str, op: &str) -> f64 {
    let text = metrics(http, base).await;
    let prefix = format!("strata_origin_calls_total{{op=\"{op}\"");
    metric_sum(&text, |l| l.starts_with(&prefix))
}

/// Polls a gateway's `/metrics` until the gauge `name` reads `want`; fails after `within`.
pub async fn await_gauge(
    http: &reqwest::Client,
    base: &str,
    name: &str,
    want: f64,
    within: Duration,
) {
    let deadline = Instant::now() + within;
    let line = format!("{name} ");
    loop {
        let seen = metric_sum(&metrics(http, base).await, |l| l.starts_with(&line));
        if seen == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{base}: {name} still {seen} after {within:?}, not {want}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The region's count of one cell, as a gateway's `POST /v1/origin/read` answers it, or what
/// it answered instead (its origin may be down, its breaker open).
pub async fn read_count(
    http: &reqwest::Client,
    base: &str,
    namespace: &str,
    identifier: &str,
    duration: u64,
    sequence: u64,
) -> Result<u64, String> {
    let counts = read_counts(http, base, namespace, &[identifier], duration, sequence).await?;
    counts
        .first()
        .copied()
        .ok_or_else(|| "no count".to_string())
}

/// [`read_count`] of the cells of `identifiers` (at most a batch, 1,000) in one call, in order.
pub async fn read_counts(
    http: &reqwest::Client,
    base: &str,
    namespace: &str,
    identifiers: &[&str],
    duration: u64,
    sequence: u64,
) -> Result<Vec<u64>, String> {
    let cells: Vec<serde_json::Value> = identifiers
        .iter()
        .map(|id| {
            serde_json::json!({"namespace": namespace, "identifier": id,
                "duration": duration, "sequence": sequence})
        })
        .collect();
    let r = http
        .post(format!("{base}/v1/origin/read"))
        .json(&serde_json::json!({ "cells": cells }))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let r: serde_json::Value = r.json().await.map_err(|e| e.to_string())?;
    let counts: Vec<u64> = r["cells"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["regional"].as_u64())
        .collect();
    if counts.len() == identifiers.len() {
        Ok(counts)
    } else {
        Err(format!("no count: {r}"))
    }
}

/// The wall clock in Unix ms, as the gateways read it.
pub fn unix_ms() -> u64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    u64::try_from(since.as_millis()).unwrap()
}

/// Waits until `ms` before a window of `window_ms` ends (windows are aligned to the Unix
/// epoch): a run that starts there has its first lease lent in a window about to roll over.
/// Returns when that window ends (Unix ms, what an answer in it gives as `reset`).
pub async fn before_window_ends(window_ms: u64, ms: u64) -> u64 {
    let now = unix_ms();
    let wait = window_ms - (now + ms) % window_ms;
    tokio::time::sleep(Duration::from_millis(wait)).await;
    now + wait + ms
}
