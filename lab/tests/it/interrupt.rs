//! Ctrl-C (or `kill`) stops a run and leaves nothing behind: a run on the test command's
//! MariaDB, sent SIGINT (SIGTERM in the second test) once its gateways are up, exits 130 (143)
//! with none of the gateway and Redis processes it started still running, no database and no
//! directory of its own left.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use sqlx::Connection;

const MARIADB: &str = "mysql://root@127.0.0.1:3306";

/// The processes whose parent is `pid` (its gateways and Redis servers; Redis rewrites its
/// command line, so it is found by parent, not by arguments).
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let child: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).ok()?;
            // Fields after the command name (which may hold spaces): state, then the parent.
            let ppid: u32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (ppid == pid).then_some(child)
        })
        .collect()
}

/// Whether process `pid` still runs (a zombie does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s.rsplit_once(')')?.1.split_whitespace().next()? != "Z"))
        .unwrap_or(false)
}

async fn databases_like(prefix: &str) -> Vec<String> {
    let mut c = sqlx::MySqlConnection::connect(MARIADB).await.unwrap();
    let rows: Vec<(String,)> = sqlx::query_as("SHOW DATABASES")
        .fetch_all(&mut c)
        .await
        .unwrap();
    rows.into_iter()
        .map(|(d,)| d)
        .filter(|d| d.starts_with(prefix))
        .collect()
}

fn directories_like(prefix: &str) -> Vec<String> {
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

#[tokio::test]
async fn an_interrupted_run_leaves_no_process_database_or_directory() {
    stopped_by("-INT", 130).await;
}

/// `kill` stops a run as Ctrl-C does.
#[tokio::test]
async fn a_terminated_run_leaves_no_process_database_or_directory() {
    stopped_by("-TERM", 143).await;
}

/// Sends `signal` to a run once its gateways are up and checks it exits `code`, leaving
/// nothing it started.
async fn stopped_by(signal: &str, code: i32) {
    let (lab, gateway) = common::binaries();
    let out = std::env::temp_dir().join(format!("lab-stopped{signal}-{}", std::process::id()));
    let mut child = Command::new(&lab)
        .args(["two-split-10x", "--quick", "--mysql", MARIADB])
        .arg("--gateway")
        .arg(&gateway)
        .arg("--out")
        .arg(&out)
        .spawn()
        .unwrap();
    let pid = child.id();
    // The run's directory is `strata-lab-<pid>-<ms>`, its database `strata_lab_<pid>_<ms>`;
    // two regions of one gateway each: two gateways and two Redis servers.
    let (dir, database) = (format!("strata-lab-{pid}-"), format!("strata_lab_{pid}_"));
    let deadline = Instant::now() + Duration::from_secs(60);
    let started = loop {
        let children = children_of(pid);
        if children.len() >= 4 && !databases_like(&database).await.is_empty() {
            break children;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it was interrupted"
        );
        assert!(
            Instant::now() < deadline,
            "the run's gateways never started"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let kill = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(code), "{status}");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let left: Vec<u32> = started.iter().copied().filter(|p| alive(*p)).collect();
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "processes left: {left:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(databases_like(&database).await, Vec::<String>::new());
    assert_eq!(directories_like(&dir), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&out);
}
