//! A private `redis-server` per test, on a free loopback port, never the shared one: tests
//! stop, restart and flush it freely. Fails loudly if `redis-server` is missing. A server is
//! only taken as started once the process answering on the port is the one it spawned (two
//! tests handed the same free port must not share a Redis unknowingly).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    /// Append-only file, fsynced on every write: a killed server restarts with every write
    /// it acknowledged.
    persistent: bool,
    /// A Redis Cluster node (its `nodes.conf` in `dir`: restarted, it rejoins with its slots).
    cluster: bool,
}

fn answers_ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = [0_u8; 16];
    s.write_all(b"PING\r\n").is_ok()
        && s.read(&mut buf)
            .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
}

/// Whether the Redis on `port` leaves a PING unanswered for 100 ms (it is in `DEBUG SLEEP`).
fn stalled(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let mut buf = [0_u8; 16];
    s.write_all(b"PING\r\n").is_ok() && s.read(&mut buf).is_err()
}

/// The process id of the Redis answering on `port`, from `INFO server`.
fn answering_pid(port: u16) -> Option<u32> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    s.write_all(b"INFO server\r\n").ok()?;
    let mut text = Vec::new();
    let mut buf = [0_u8; 4096];
    while !String::from_utf8_lossy(&text).contains("process_id:") || !text.ends_with(b"\r\n") {
        let n = s.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        text.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&text);
    let line = text.lines().find(|l| l.starts_with("process_id:"))?;
    line.trim_start_matches("process_id:").trim().parse().ok()
}

/// Spawns `redis-server` on `port` and waits until it answers; `None` if another process
/// holds the port.
fn spawn(port: u16, dir: &std::path::Path, persistent: bool, cluster: bool) -> Option<Child> {
    let aof: &[&str] = if persistent {
        &["--appendonly", "yes", "--appendfsync", "always"]
    } else {
        &["--appendonly", "no"]
    };
    let cluster: &[&str] = if cluster {
        &[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
        ]
    } else {
        &[]
    };
    let mut child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            // Fault injection (`DEBUG SLEEP`) from loopback only.
            "--enable-debug-command",
            "local",
        ])
        .args(aof)
        .args(cluster)
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start redis-server ({e}); ./scripts/test.sh installs it")
        });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return None; // it could not listen: the port is someone else's
        }
        if answers_ping(port) {
            if answering_pid(port) == Some(child.id()) {
                return Some(child);
            }
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        assert!(
            Instant::now() < deadline,
            "redis-server on port {port} did not answer within 10 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(false, false)
    }

    /// A server that keeps every acknowledged write across a kill (append-only, fsync always).
    pub fn start_persistent() -> Self {
        Self::start_with(true, false)
    }

    fn start_with(persistent: bool, cluster: bool) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        for _ in 0..5 {
            let port = if cluster {
                free_cluster_port()
            } else {
                super::free_port()
            };
            if answers_ping(port) {
                continue;
            }
            let dir = std::env::temp_dir().join(format!(
                "strata-redis-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).expect("temp dir for redis");
            match spawn(port, &dir, persistent, cluster) {
                Some(child) => {
                    return Self {
                        child: Some(child),
                        port,
                        dir,
                        persistent,
                        cluster,
                    };
                }
                None => {
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
        }
        panic!("could not start a private redis-server on a free port in 5 tries");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Stalls the server for `seconds` (`DEBUG SLEEP`, from another connection, in the
    /// background); wait on the child for the stall to end.
    pub fn stall(&self, seconds: &str) -> Child {
        let child = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "DEBUG", "SLEEP", seconds])
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run redis-cli ({e})"));
        // Returns once the stall has begun: a PING on another connection goes unanswered.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !stalled(self.port) {
            assert!(
                Instant::now() < deadline,
                "Redis on {} never stalled",
                self.port
            );
        }
        child
    }

    /// Runs one command with `redis-cli` against this server; returns its output, trimmed.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli ({e})"));
        assert!(out.status.success(), "redis-cli {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Stops the server (its data is gone: it keeps nothing on disk).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while answers_ping(self.port) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts (or starts again) on the same port, and waits until it answers.
    pub fn restart(&mut self) {
        self.stop();
        let child = spawn(self.port, &self.dir, self.persistent, self.cluster);
        assert!(
            child.is_some(),
            "redis-server could not listen on port {} again",
            self.port
        );
        self.child = child;
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A free port whose cluster bus port (the port + 10000) is a port, and free too.
fn free_cluster_port() -> u16 {
    loop {
        let port = super::free_port();
        if port <= 55_535 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// A private three-node Redis Cluster (three primaries, no replicas) on free loopback ports,
/// made with `redis-cli --cluster create` as an operator would.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::start_with(false, true))
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli ({e})"));
        assert!(out.status.success(), "redis-cli --cluster create: {out:?}");
        let cluster = Self { nodes };
        cluster.wait_until_ok();
        cluster
    }

    /// Waits until every node reports `cluster_state:ok` and knows all three primaries.
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = self.nodes.iter().all(|n| {
                let info = n.cli(&["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:3")
            });
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not become ok within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The seed list a gateway is given (`--redis-cluster`).
    pub fn seeds(&self) -> String {
        self.seed_list().join(",")
    }

    /// The same, one URL per node.
    pub fn seed_list(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The node that holds `key` now.
    pub fn node_of(&self, key: &str) -> usize {
        let slot: u16 = self.nodes[0]
            .cli(&["CLUSTER", "KEYSLOT", key])
            .parse()
            .unwrap();
        let owner = self.owner(slot);
        self.nodes
            .iter()
            .position(|n| n.cli(&["CLUSTER", "MYID"]) == owner)
            .unwrap_or_else(|| panic!("no node of this cluster owns slot {slot}"))
    }

    /// Moves `slot`, with its keys, to node `to`, as `redis-cli --cluster reshard` does it:
    /// importing and migrating states, `MIGRATE` of every key, then the new owner announced to
    /// every node. Clients that still route the slot to its old node get `MOVED`.
    pub fn move_slot(&self, slot: u16, to: usize) {
        let owner = self.owner(slot);
        let from = self
            .nodes
            .iter()
            .position(|n| n.cli(&["CLUSTER", "MYID"]) == owner)
            .unwrap();
        assert_ne!(from, to, "slot {slot} is on node {to} already");
        let (src, dst) = (&self.nodes[from], &self.nodes[to]);
        let dst_id = dst.cli(&["CLUSTER", "MYID"]);
        let slot_text = slot.to_string();
        dst.cli(&["CLUSTER", "SETSLOT", &slot_text, "IMPORTING", &owner]);
        src.cli(&["CLUSTER", "SETSLOT", &slot_text, "MIGRATING", &dst_id]);
        loop {
            let keys = src.cli(&["CLUSTER", "GETKEYSINSLOT", &slot_text, "100"]);
            if keys.is_empty() {
                break;
            }
            let port = dst.port.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(keys.lines());
            assert_eq!(src.cli(&args), "OK");
        }
        for n in &self.nodes {
            n.cli(&["CLUSTER", "SETSLOT", &slot_text, "NODE", &dst_id]);
        }
    }

    /// The slot of `key`.
    pub fn slot_of(&self, key: &str) -> u16 {
        self.nodes[0]
            .cli(&["CLUSTER", "KEYSLOT", key])
            .parse()
            .unwrap()
    }

    /// The id of the primary that owns `slot`, read from `CLUSTER NODES`.
    fn owner(&self, slot: u16) -> String {
        let nodes = self.nodes[0].cli(&["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            for range in fields.iter().skip(8) {
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                let bounds = (lo.parse::<u16>(), hi.parse::<u16>());
                if matches!(bounds, (Ok(lo), Ok(hi)) if (lo..=hi).contains(&slot)) {
                    return fields[0].to_string();
                }
            }
        }
        panic!("no primary owns slot {slot}")
    }
}
