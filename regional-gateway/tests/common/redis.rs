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
fn spawn(port: u16, dir: &std::path::Path, persistent: bool) -> Option<Child> {
    let aof: &[&str] = if persistent {
        &["--appendonly", "yes", "--appendfsync", "always"]
    } else {
        &["--appendonly", "no"]
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
        Self::start_with(false)
    }

    /// A server that keeps every acknowledged write across a kill (append-only, fsync always).
    pub fn start_persistent() -> Self {
        Self::start_with(true)
    }

    fn start_with(persistent: bool) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        for _ in 0..5 {
            let port = super::free_port();
            if answers_ping(port) {
                continue;
            }
            let dir = std::env::temp_dir().join(format!(
                "strata-redis-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).expect("temp dir for redis");
            match spawn(port, &dir, persistent) {
                Some(child) => {
                    return Self {
                        child: Some(child),
                        port,
                        dir,
                        persistent,
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
        Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "DEBUG", "SLEEP", seconds])
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run redis-cli ({e})"))
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
        let child = spawn(self.port, &self.dir, self.persistent);
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
