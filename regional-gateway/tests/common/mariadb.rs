//! A private `mariadbd` per test, on a free loopback port with its own data directory, never
//! the shared one: tests stop and restart it freely. Fails loudly if MariaDB is missing.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct MariaDbServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
}

impl MariaDbServer {
    pub fn start() -> Self {
        let port = super::free_port();
        let dir =
            std::env::temp_dir().join(format!("strata-mariadb-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir for mariadb");
        // mariadbd runs as the `mysql` user when started by root: let it write here.
        let _ = Command::new("chmod").arg("777").arg(&dir).status();
        let status = Command::new("mariadb-install-db")
            .args([
                "--no-defaults",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--user=mysql",
            ])
            .arg(format!("--datadir={}", dir.join("data").display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap_or_else(|e| {
                panic!("cannot run mariadb-install-db ({e}); ./scripts/test.sh installs MariaDB")
            });
        assert!(
            status.success(),
            "mariadb-install-db failed in {}",
            dir.display()
        );
        let mut server = Self {
            child: None,
            port,
            dir,
        };
        server.restart();
        server
    }

    pub fn url(&self, database: &str) -> String {
        format!("mysql://root@127.0.0.1:{}/{database}", self.port)
    }

    fn answers(&self) -> bool {
        Command::new("mysqladmin")
            .args(["-uroot", "-h127.0.0.1", "--connect-timeout=1", "ping"])
            .arg(format!("-P{}", self.port))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts (again) on the same port and data, and waits until it answers.
    pub fn restart(&mut self) {
        self.stop();
        let child = Command::new("mariadbd")
            .args([
                "--no-defaults",
                "--bind-address=127.0.0.1",
                "--user=mysql",
                "--skip-log-bin",
            ])
            .arg(format!("--port={}", self.port))
            .arg(format!("--datadir={}", self.dir.join("data").display()))
            .arg(format!("--socket={}", self.dir.join("sock").display()))
            .arg(format!("--pid-file={}", self.dir.join("pid").display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start mariadbd ({e}); ./scripts/test.sh installs MariaDB")
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.answers() {
            assert!(
                Instant::now() < deadline,
                "mariadbd on port {} did not answer within 30 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for MariaDbServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The shared MariaDB the test command starts (root, no password): tests make databases of
/// their own on it and drop them, never touching another's.
pub const SHARED: &str = "mysql://root@127.0.0.1:3306";

/// A database of one test's own on the shared server.
pub struct SharedDatabase {
    pub name: String,
}

async fn admin() -> sqlx::MySqlPool {
    sqlx::MySqlPool::connect(SHARED).await.unwrap_or_else(|e| {
        panic!("MariaDB is not reachable at {SHARED} ({e}); ./scripts/test.sh starts it")
    })
}

impl SharedDatabase {
    /// Creates `name` afresh (dropping a leftover of an interrupted run).
    pub async fn create(name: &str) -> Self {
        let admin = admin().await;
        for sql in [
            format!("DROP DATABASE IF EXISTS {name}"),
            format!("CREATE DATABASE {name}"),
        ] {
            sqlx::query(&sql).execute(&admin).await.unwrap();
        }
        Self {
            name: name.to_string(),
        }
    }

    pub fn url(&self) -> String {
        format!("{SHARED}/{}", self.name)
    }

    pub async fn drop(self) {
        sqlx::query(&format!("DROP DATABASE {}", self.name))
            .execute(&admin().await)
            .await
            .unwrap();
    }
}
