//! A private `redis-server` per test, on a free loopback port, never the shared one: tests
//! stop, restart and flush it freely. Fails loudly if `redis-server` is missing.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
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

impl RedisServer {
    pub fn start() -> Self {
        let port = super::free_port();
        let dir = std::env::temp_dir().join(format!("strata-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir for redis");
        let mut server = Self {
            child: None,
            port,
            dir,
        };
        server.restart();
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
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
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start redis-server ({e}); ./scripts/test.sh installs it")
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !answers_ping(self.port) {
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not answer within 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
