//! Running a block as a reader pastes it: one bash process for the whole block (so that a
//! variable one command sets is there for the next), in a process group of its own (so that the
//! gateways it starts can be stopped together), each command's output in files of its own, and
//! after each command a line to the runner, which checks the command (or waits until the
//! gateway it started is ready) before it lets the next one run.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

/// One command as the script runs it.
#[derive(Debug, Clone)]
pub(crate) struct Line {
    /// The name of its output files (`3.out`, `3.err`) and of its event.
    pub(crate) id: String,
    pub(crate) text: String,
    /// Started in the background by the runner (a gateway the README runs in the foreground).
    pub(crate) detach: bool,
    /// An expression the shell expands for the runner (a gateway's data directory).
    pub(crate) report: Option<String>,
}

/// What the shell says after a command.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) id: String,
    pub(crate) status: i32,
    /// The last background process (`$!`).
    pub(crate) pid: Option<u32>,
    pub(crate) report: String,
}

/// The block's bash process.
#[derive(Debug)]
pub(crate) struct Shell {
    child: Child,
    stdin: ChildStdin,
    events: Receiver<String>,
    pub(crate) pgid: u32,
    /// Where the block's output files go.
    pub(crate) dir: PathBuf,
    /// The working directory the block's commands run in.
    pub(crate) cwd: PathBuf,
}

/// The reader's shell: output to the block's log, the runner's channel on fd 4 (closed for the
/// commands themselves), and `cargo` acting on this checkout as if run from its root while the
/// working directory stays the scratch one; `--release` is dropped when the examples run on the
/// debug build the test command already made.
const PRELUDE: &str = r#"exec 4>&1 >"$__EX/shell.log" 2>&1
__sync() { printf '%s %s %s %s\n' "$1" "$2" "${3:--}" "$4" >&4; IFS= read -r __go; [ "$__go" = go ] || exit 1; }
cargo() {
  local args=()
  for a in "$@"; do
    if [ "$a" = --release ] && [ "$README_EXAMPLES_PROFILE" = debug ]; then continue; fi
    args+=("$a")
  done
  if [ ${#args[@]} -gt 0 ] && [[ ${args[0]} != -* ]]; then
    command cargo "${args[0]}" --manifest-path "$__REPO/Cargo.toml" "${args[@]:1}"
  else
    command cargo "${args[@]}"
  fi
}
"#;

impl Shell {
    pub(crate) fn start(
        dir: &Path,
        cwd: &Path,
        repo: &Path,
        lines: &[Line],
        env: &[(String, String)],
    ) -> Result<Self, String> {
        let mut script = format!(
            "__EX={}\n__REPO={}\n{PRELUDE}cd {} || exit 1\n",
            quote(&dir.to_string_lossy()),
            quote(&repo.to_string_lossy()),
            quote(&cwd.to_string_lossy())
        );
        for line in lines {
            let id = &line.id;
            let detach = if line.detach { " &" } else { "" };
            script.push_str(&format!(
                "{{\n{}\n}} >\"$__EX/{id}.out\" 2>\"$__EX/{id}.err\" </dev/null 4>&-{detach}\n__sync {id} \"$?\" \"$!\" \"{}\"\n",
                line.text,
                line.report.as_deref().unwrap_or("")
            ));
        }
        script.push_str("exit 0\n");
        let path = dir.join("run.sh");
        std::fs::write(&path, script)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let mut child = Command::new("bash")
            .arg(&path)
            .current_dir(cwd)
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start bash: {e}"))?;
        let (stdin, stdout) = match (child.stdin.take(), child.stdout.take()) {
            (Some(i), Some(o)) => (i, o),
            _ => return Err("bash without pipes".into()),
        };
        let (tx, events) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let pgid = child.id();
        Ok(Self {
            child,
            stdin,
            events,
            pgid,
            dir: dir.to_path_buf(),
            cwd: cwd.to_path_buf(),
        })
    }

    /// The next command's event, within `deadline`.
    pub(crate) fn next(&mut self, deadline: Duration) -> Result<Event, String> {
        match self.events.recv_timeout(deadline) {
            Ok(line) => {
                let mut parts = line.splitn(4, ' ');
                let id = parts.next().unwrap_or_default().to_string();
                let status = parts.next().and_then(|s| s.parse().ok()).unwrap_or(-1);
                let pid = parts.next().and_then(|p| p.parse().ok());
                let report = parts.next().unwrap_or_default().to_string();
                Ok(Event {
                    id,
                    status,
                    pid,
                    report,
                })
            }
            Err(RecvTimeoutError::Timeout) => {
                Err(format!("timed out after {}s", deadline.as_secs()))
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                Err(format!(
                    "the shell ended early ({status}): {}",
                    self.log_tail()
                ))
            }
        }
    }

    /// Lets the next command run.
    pub(crate) fn go(&mut self) -> Result<(), String> {
        self.stdin
            .write_all(b"go\n")
            .map_err(|e| format!("the shell is gone: {e}"))
    }

    /// Waits for the shell to exit once its last command is done (its gateways keep running).
    pub(crate) fn finish(mut self) -> Result<u32, String> {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            match self.child.try_wait() {
                Ok(Some(s)) if s.success() => return Ok(self.pgid),
                Ok(Some(s)) => {
                    return Err(format!("the shell exited with {s}: {}", self.log_tail()));
                }
                Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(20)),
                _ => return Err("the shell did not exit after its last command".into()),
            }
        }
    }

    /// Stops the shell where it is (its process group with it).
    pub(crate) fn abandon(mut self) {
        let _ = self.stdin.write_all(b"stop\n");
        stop_group(self.pgid);
        let _ = self.child.wait();
    }

    /// The first line of the command's stderr that says what went wrong, else its last line
    /// (stdout when stderr is empty).
    pub(crate) fn tail(&self, id: &str) -> String {
        for name in [format!("{id}.err"), format!("{id}.out")] {
            let text = std::fs::read_to_string(self.dir.join(name)).unwrap_or_default();
            let text = strip_ansi(&text);
            let telling = text
                .lines()
                .find(|l| {
                    l.starts_with("error")
                        || l.starts_with("fatal")
                        || l.starts_with("strata-gateway:")
                })
                .or_else(|| text.lines().rfind(|l| !l.trim().is_empty()));
            if let Some(line) = telling {
                return line.chars().take(240).collect();
            }
        }
        "no output".into()
    }

    pub(crate) fn output(&self, id: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{id}.out"))).unwrap_or_default()
    }

    pub(crate) fn errors(&self, id: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{id}.err"))).unwrap_or_default()
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("shell.log")).unwrap_or_default();
        log.lines().rev().take(3).collect::<Vec<_>>().join(" | ")
    }
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The state, parent and process group of a process, from `/proc/<pid>/stat`.
fn stat(pid: &str) -> Option<(char, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &text[text.rfind(')')? + 2..];
    let mut fields = after.split(' ');
    let state = fields.next()?.chars().next()?;
    let _parent = fields.next()?;
    Some((state, fields.next()?.parse().ok()?))
}

/// Running and not a zombie.
pub(crate) fn alive(pid: u32) -> bool {
    stat(&pid.to_string()).is_some_and(|(state, _)| !matches!(state, 'Z' | 'X'))
}

/// Whether a live process is left in the group.
fn group_alive(pgid: u32) -> bool {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .any(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            name.bytes().all(|b| b.is_ascii_digit())
                && stat(&name)
                    .is_some_and(|(state, group)| group == pgid && !matches!(state, 'Z' | 'X'))
        })
}

fn signal(pgid: u32, name: &str) {
    let _ = Command::new("kill")
        .args([name, "--", &format!("-{pgid}")])
        .stderr(Stdio::null())
        .status();
}

/// SIGTERM to the group; true if it was gone within 15 s (the README: "SIGTERM or Ctrl-C stops
/// accepting, finishes in-flight requests"), else it is killed.
pub(crate) fn stop_group(pgid: u32) -> bool {
    if !group_alive(pgid) {
        return true;
    }
    signal(pgid, "-TERM");
    if poll(Duration::from_secs(15), || !group_alive(pgid)) {
        return true;
    }
    signal(pgid, "-KILL");
    poll(Duration::from_secs(5), || !group_alive(pgid));
    false
}

/// Polls `done` every 100 ms until it holds or `deadline` passes.
pub(crate) fn poll(deadline: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The status of `GET path` on `host:port` (HTTP/1.1, 2 s), with the body's start.
pub(crate) fn http_get(host: &str, port: u16, path: &str) -> Option<(u16, String)> {
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .ok()?
        .next()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = Vec::new();
    let _ = s.take(8192).read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((code, body))
}

/// Whether something listens on `host:port`.
pub(crate) fn listening(host: &str, port: u16) -> bool {
    std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|addr| {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
        })
}

/// Whether a Redis on `host:port` answers PING within 3 s.
pub(crate) fn redis_answers(host: &str, port: u16) -> bool {
    let Some(addr) = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .ok()
        .and_then(|mut a| a.next())
    else {
        return false;
    };
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
    let mut reply = [0u8; 5];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut reply).is_ok() && &reply == b"+PONG"
}
