//! What a scenario runs on, all real processes on loopback: per region a private `redis-server`
//! and its gateways (`strata-gateway` binaries), and one global SQL store they share (an SQLite
//! file, or a database of its own on a MariaDB/MySQL server, optionally across a simulated WAN:
//! `wan`). Everything started is stopped on drop.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Result;
use crate::shells::{Front, Through, Upstream};
use crate::wan::{DelayProxy, Link};

/// A loopback port nothing listens on, never handed out before by this run (the tests' own
/// definition: under `cargo nextest`, from the block of the slot of the test that started the
/// lab, so that labs and tests running side by side never race for one).
pub(crate) fn free_port() -> Result<u16> {
    crate::shells::launchers::port::try_free_port()
}

/// Sends one inline command to the Redis on `port` and reads its answer until `done` holds.
fn redis_command(port: u16, command: &str, done: impl Fn(&str) -> bool) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(1_000)))
        .ok()?;
    s.write_all(format!("{command}\r\n").as_bytes()).ok()?;
    let mut text = Vec::new();
    let mut buf = [0_u8; 8192];
    loop {
        let n = s.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        text.extend_from_slice(&buf[..n]);
        let so_far = String::from_utf8_lossy(&text);
        if done(&so_far) {
            return Some(so_far.into_owned());
        }
    }
    Some(String::from_utf8_lossy(&text).into_owned())
}

/// A bulk string answer is complete once it holds the length its header announced.
fn bulk_complete(text: &str) -> bool {
    let Some((header, body)) = text.split_once("\r\n") else {
        return false;
    };
    header
        .strip_prefix('$')
        .and_then(|n| n.parse::<usize>().ok())
        .is_some_and(|n| body.len() >= n + 2)
}

/// A private `redis-server` without persistence.
#[derive(Debug)]
pub struct Redis {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
}

impl Redis {
    fn spawn(port: u16, dir: &Path) -> Result<Child> {
        let mut child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start redis-server ({e}): scripts/test.sh installs it"))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("redis-server on port {port} exited: {status}"));
            }
            if redis_command(port, "PING", |t| t.contains("PONG"))
                .is_some_and(|t| t.contains("PONG"))
            {
                return Ok(child);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        Err(format!(
            "redis-server on port {port} did not answer within 10 s"
        ))
    }

    /// A server on a free port, its working directory under `dir`.
    pub fn start(dir: &Path) -> Result<Self> {
        let mut last = String::new();
        for _ in 0..5 {
            let port = free_port()?;
            let dir = dir.join(format!("redis-{port}"));
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            match Self::spawn(port, &dir) {
                Ok(child) => {
                    return Ok(Self {
                        child: Some(child),
                        port,
                        dir,
                    });
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// SIGKILL: everything it held is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.child = Some(Self::spawn(self.port, &self.dir)?);
        Ok(())
    }

    /// Commands the server has run since it started, by name (`eval`, `hincrby`, ...): `INFO
    /// commandstats`, the commands scripts run included, less the lab's own `INFO` calls.
    pub fn commands_by_name(&self) -> std::collections::BTreeMap<String, u64> {
        let Some(text) = redis_command(self.port, "INFO commandstats", bulk_complete) else {
            return Default::default();
        };
        text.lines()
            .filter(|l| !l.starts_with("cmdstat_info:"))
            .filter_map(|l| {
                let (name, stats) = l.strip_prefix("cmdstat_")?.split_once(':')?;
                let calls = stats.split_once("calls=")?.1;
                Some((
                    name.to_string(),
                    calls.split(',').next()?.parse::<u64>().ok()?,
                ))
            })
            .collect()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One gateway process, and the shell in front of it when the traffic goes through one.
#[derive(Debug)]
pub struct Gateway {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// The shell in front of it (`--through edge`, `--through envoy`).
    pub front: Option<Front>,
}

impl Gateway {
    /// Where the scenario's traffic for this gateway goes: its shell, or itself.
    pub fn entry(&self) -> &str {
        self.front.as_ref().map_or(&self.base, Front::base)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            _ => None,
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One region: its Redis, its gateways, and its link to the global store.
#[derive(Debug)]
pub struct Region {
    pub name: String,
    pub redis: Redis,
    pub gateways: Vec<Gateway>,
    /// The region's way to the global store across the simulated WAN (`--wan`); none on
    /// loopback.
    pub link: Option<DelayProxy>,
}

impl Region {
    /// The global store's URL as this region's gateways reach it.
    fn database_url(&self, sql: &Sql) -> String {
        match &self.link {
            Some(proxy) => crate::wan::through(&sql.url(), proxy.port),
            None => sql.url(),
        }
    }
}

/// The global store the regions share.
#[derive(Debug)]
pub enum Sql {
    /// An SQLite file in the run's directory.
    Sqlite(PathBuf),
    /// A database created for the run on a MySQL/MariaDB server (`server` without a path).
    Mysql { server: String, database: String },
}

impl Sql {
    pub fn url(&self) -> String {
        match self {
            Sql::Sqlite(path) => format!("sqlite://{}", path.display()),
            Sql::Mysql { server, database } => format!("{server}/{database}"),
        }
    }
}

/// Everything a scenario runs on.
#[derive(Debug)]
pub struct Stack {
    pub regions: Vec<Region>,
    pub sql: Sql,
    /// Where the shells in front of the gateways send passes (`--through edge`).
    pub upstream: Option<Upstream>,
    dir: PathBuf,
}

/// How to start the stack.
#[derive(Clone, Debug)]
pub struct StackOptions {
    /// The `strata-gateway` binary.
    pub gateway: PathBuf,
    /// Extra gateway arguments (a lever under test: `--flush-interval 1s`).
    pub gateway_args: Vec<String>,
    /// `mysql://user@host:port` for the global store; SQLite when absent.
    pub mysql: Option<String>,
    /// The simulated WAN between each region and the global store; loopback when absent.
    pub wan: Option<Link>,
    /// What the traffic enters through: each gateway's API, or a shell in front of each.
    pub through: Through,
}

impl Stack {
    /// Starts `regions` regions of `gateways` gateways each and waits until every gateway is
    /// ready.
    pub async fn start(
        options: &StackOptions,
        regions: usize,
        gateways: usize,
        http: &reqwest::Client,
    ) -> Result<Self> {
        // The WAN's far end, checked before anything is started.
        let server = match (&options.wan, &options.mysql) {
            (Some(_), Some(server)) => Some(crate::wan::server_address(server).await?),
            (Some(_), None) => {
                return Err(
                    "--wan needs --mysql: the global store must be a server to be across a link"
                        .into(),
                );
            }
            (None, _) => None,
        };
        let dir = std::env::temp_dir().join(format!(
            "strata-lab-{}-{}",
            std::process::id(),
            crate::now_ms()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let sql = match &options.mysql {
            None => Sql::Sqlite(dir.join("global.db")),
            Some(server) => {
                let database = format!("strata_lab_{}_{}", std::process::id(), crate::now_ms());
                crate::sql::create_database(server, &database).await?;
                Sql::Mysql {
                    server: server.trim_end_matches('/').to_string(),
                    database,
                }
            }
        };
        let mut stack = Self {
            regions: Vec::new(),
            sql,
            upstream: None,
            dir,
        };
        for r in 0..regions {
            let name = format!("r{r}");
            let redis = Redis::start(&stack.dir)?;
            let link = match (options.wan, server) {
                (Some(link), Some(server)) => {
                    Some(DelayProxy::start(server, link, r as u64 + 1).await?)
                }
                _ => None,
            };
            stack.regions.push(Region {
                name,
                redis,
                gateways: Vec::new(),
                link,
            });
            for g in 0..gateways {
                let gateway = stack.spawn_gateway(options, r, g)?;
                stack.regions[r].gateways.push(gateway);
                // The first gateway applies the schema; the others start once it did.
                if r == 0 && g == 0 {
                    stack.wait_ready(http).await?;
                }
            }
        }
        stack.wait_ready(http).await?;
        Ok(stack)
    }

    fn spawn_gateway(&self, options: &StackOptions, r: usize, g: usize) -> Result<Gateway> {
        let port = free_port()?;
        let region = &self.regions[r];
        let log_path = self.dir.join(format!("{}-g{g}.log", region.name));
        let log =
            std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
        let mut command = Command::new(&options.gateway);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("STRATA_") {
                command.env_remove(key);
            }
        }
        let child = command
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--region", &region.name])
            .args(["--redis-url", &region.redis.url()])
            .args(["--database-url", &region.database_url(&self.sql)])
            .arg("--data-dir")
            .arg(self.dir.join(format!("{}-g{g}", region.name)))
            .args(&options.gateway_args)
            .env("STRATA_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", options.gateway.display()))?;
        Ok(Gateway {
            child,
            base: format!("http://127.0.0.1:{port}"),
            front: None,
        })
    }

    async fn wait_ready(&mut self, http: &reqwest::Client) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        for region in &mut self.regions {
            for g in &mut region.gateways {
                loop {
                    let ready = http
                        .get(format!("{}/readyz", g.base))
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == 200);
                    if ready {
                        break;
                    }
                    if let Some(status) = g.exited() {
                        return Err(format!(
                            "gateway {} exited before it was ready ({status}); its log is in {}",
                            g.base,
                            self.dir.display()
                        ));
                    }
                    if Instant::now() > deadline {
                        return Err(format!("gateway {} not ready within 30 s", g.base));
                    }
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
            }
        }
        Ok(())
    }

    /// Puts a shell in front of every gateway (none for [`Through::Gateway`]), each with
    /// `rules`, passing to one upstream, and waits until each is ready.
    pub async fn front(
        &mut self,
        through: Through,
        rules: &serde_json::Value,
        http: &reqwest::Client,
    ) {
        if through == Through::Gateway {
            return;
        }
        let upstream = Upstream::start().await;
        for region in &mut self.regions {
            for g in &mut region.gateways {
                g.front =
                    crate::shells::front(through, &region.name, &g.base, &upstream, rules, http)
                        .await;
            }
        }
        self.upstream = Some(upstream);
    }

    /// Every gateway, with its region's index.
    pub fn gateways(&self) -> impl Iterator<Item = (usize, &Gateway)> {
        self.regions
            .iter()
            .enumerate()
            .flat_map(|(r, region)| region.gateways.iter().map(move |g| (r, g)))
    }

    /// Stops the gateways as an operator would (SIGTERM: each replays and flushes what is
    /// left) and waits for them, at most 15 s.
    pub fn terminate_gateways(&mut self) {
        for region in &mut self.regions {
            for g in &region.gateways {
                let _ = Command::new("kill")
                    .args(["-TERM", &g.child.id().to_string()])
                    .status();
            }
            let deadline = Instant::now() + Duration::from_secs(15);
            for g in &mut region.gateways {
                while Instant::now() < deadline && g.exited().is_none() {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    /// Drops the MySQL database (an SQLite file goes with the directory).
    pub async fn cleanup(&self) {
        if let Sql::Mysql { server, database } = &self.sql {
            crate::sql::drop_database(server, database).await;
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.regions.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
