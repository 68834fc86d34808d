//! Every example of README.md's "Run" section (and its subsections), run the way a reader runs
//! it, and checked against what the README says it prints. The examples are read from the README
//! at run time, so this test follows the README as it changes.
//!
//! How a block is read (`markdown`): a command is a line plus continuation lines until `bash -n`
//! accepts it (with `$ ` prompts only prompted lines are commands); a line starting with `{"` or
//! `[` after a command is its expected output; a comment holding a JSON fragment
//! (`# {"success":true,...}: prose`) is an expectation on the command before it, `...` meaning
//! "more fields", and a clause "next N requests: X left, then denied" in the prose runs the
//! command N more times and checks each answer (`expect`).
//!
//! How it runs (`shell`): each block is one bash process, as a reader pasting it, in a process
//! group of its own, with a clean environment (no `STRATA_*` settings) and a scratch working
//! directory where `./strata-data` starts empty and `target/release` points at the profile the
//! examples run on: the debug build the test command already made, with `--release` dropped
//! from the README's cargo commands (`README_EXAMPLES_PROFILE=release` builds and runs the
//! release profile the README names). A gateway the README starts runs until the next block
//! that starts one (or the end), is polled until `/readyz` answers 200 (and, on SQLite, until
//! its global table's file exists), and must exit within 15 s of SIGTERM. A block that only
//! starts a gateway (the Redis variant) is sent the requests of the latest earlier block aimed
//! at its port, `remaining` compared as an upper bound (the shared Redis keeps counts across
//! runs). A `--redis-url` must answer PING first (fail, never skip); an absolute `--data-dir`
//! (the README's `/tmp/strata`) must not exist beforehand and is removed at the end; the ports
//! the README uses must be free: runs on one machine take turns on a lock file.
//!
//! Settings: `README_EXAMPLES_PROFILE` (debug or release), `README_EXAMPLES_BUILD_TIMEOUT` (s,
//! default 1800: cargo's build and lock waits), `README_EXAMPLES_READY_TIMEOUT` (s, default 30),
//! `README_EXAMPLES_KEEP=1` keeps the scratch directory (kept anyway when an example fails),
//! `README_EXAMPLES_README=<file>` reads another copy of the README.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod expect;
mod markdown;
#[path = "../common/port.rs"]
#[allow(dead_code, unreachable_pub)] // the README's lock; its ports are the README's own
mod port;
mod shell;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use expect::Mode;
use markdown::{Block, Kind, Step};
use shell::{Line, Shell};

/// Slack for a command beyond its own sleeps (and cargo's build time, when it runs cargo).
const STEP_SLACK: Duration = Duration::from_secs(120);
const DATA_TIMEOUT: Duration = Duration::from_secs(10);

fn setting(name: &str, default: u64) -> Duration {
    Duration::from_secs(
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

/// A gateway a command starts, as its flags (or the README's defaults) say.
#[derive(Debug)]
struct Server {
    host: String,
    port: u16,
    /// Started through cargo, which may build first.
    build: bool,
    /// Where its SQLite global table goes (none with `--database-url` on a server).
    data_dir: Option<String>,
    redis: Option<(String, u16)>,
}

fn server(text: &str, defaults: &Defaults) -> Server {
    let listen = markdown::flag_value(text, "--listen")
        .or_else(|| {
            text.split_whitespace()
                .find_map(|w| w.strip_prefix("STRATA_LISTEN=").map(str::to_string))
        })
        .unwrap_or_else(|| defaults.listen.clone());
    let (host, port) = listen.rsplit_once(':').unwrap_or((&listen, "8080"));
    let host = match host {
        "" | "0.0.0.0" | "[::]" | "localhost" => "127.0.0.1".to_string(),
        h => h.to_string(),
    };
    let sqlite =
        markdown::flag_value(text, "--database-url").is_none_or(|url| url.starts_with("sqlite:"));
    let data_dir = sqlite.then(|| {
        markdown::flag_value(text, "--data-dir").unwrap_or_else(|| defaults.data_dir.clone())
    });
    let redis = markdown::flag_value(text, "--redis-url").map(|url| {
        let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
        let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
        let hostport = rest.split('/').next().unwrap_or_default();
        match hostport.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), p.parse().unwrap_or(6379)),
            None => (hostport.to_string(), 6379),
        }
    });
    Server {
        host,
        port: port.parse().unwrap_or(0),
        build: markdown::command_words(text).0 == "cargo",
        data_dir,
        redis,
    }
}

#[derive(Debug)]
struct Defaults {
    listen: String,
    data_dir: String,
}

/// One example's result; the first failure is the one kept.
#[derive(Debug)]
struct Outcome {
    label: String,
    failure: Option<String>,
    /// How long the block took (where this test's time goes).
    took: Duration,
}

impl Outcome {
    fn fail(&mut self, why: impl Into<String>) {
        self.failure.get_or_insert_with(|| why.into());
    }
}

/// The commands of a block as the shell runs them: each rerun the README's prose asks for is a
/// command of its own, checked against its own answer.
fn lines(steps: &[Step], prefix: &str, mode: Mode, defaults: &Defaults) -> Vec<(Line, Check)> {
    let mut out = Vec::new();
    for (k, step) in steps.iter().enumerate() {
        let id = format!("{prefix}{}", k + 1);
        let check = match step.kind {
            Kind::Server => Check::Server(server(&step.text, defaults)),
            Kind::Background => Check::Nothing,
            Kind::Foreground => Check::Answers(step.expected.clone(), mode),
        };
        let report = match &check {
            Check::Server(Server {
                data_dir: Some(dir),
                ..
            }) => Some(dir.clone()),
            _ => None,
        };
        let detach = step.kind == Kind::Server && !markdown::is_background(&step.text);
        out.push((
            Line {
                id: id.clone(),
                text: step.text.clone(),
                detach,
                report,
            },
            check,
        ));
        for (j, rerun) in step.reruns.iter().enumerate() {
            let line = Line {
                id: format!("{id}.r{}", j + 1),
                text: step.text.clone(),
                detach: false,
                report: None,
            };
            out.push((line, Check::Answers(vec![rerun.clone()], mode)));
        }
    }
    out
}

/// What the runner checks after a command.
#[derive(Debug)]
enum Check {
    Nothing,
    Answers(Vec<String>, Mode),
    Server(Server),
}

/// Runs one block's commands; a failure stops the block there.
fn run_block(
    shell: &mut Shell,
    lines: &[(Line, Check)],
    timeouts: &Timeouts,
) -> Result<(), String> {
    let mut background: Vec<(String, u32)> = Vec::new();
    for (line, check) in lines {
        let what = what(&line.text);
        let mut deadline = STEP_SLACK + Duration::from_secs(markdown::sleeps(&line.text));
        if line.text.contains("cargo ") {
            deadline += timeouts.build;
        }
        let event = shell.next(deadline).map_err(|e| format!("{what}: {e}"))?;
        if event.id != line.id {
            return Err(format!(
                "{what}: the shell reported {} out of turn",
                event.id
            ));
        }
        let meanwhile = || {
            background
                .iter()
                .filter(|(_, pid)| !shell::alive(*pid))
                .map(|(id, _)| format!("; meanwhile `{id}` had exited: {}", shell.tail(id)))
                .collect::<String>()
        };
        match check {
            Check::Nothing => background.extend(event.pid.map(|p| (line.id.clone(), p))),
            Check::Answers(expected, mode) => {
                if event.status != 0 {
                    let hint = match event.status {
                        7 => " (curl: could not connect)",
                        28 => " (curl: timed out)",
                        _ => "",
                    };
                    return Err(format!(
                        "{what} exited with status {}{hint}: {}{}",
                        event.status,
                        shell.tail(&line.id),
                        meanwhile()
                    ));
                }
                let out = shell.output(&line.id);
                let checked = if expected.is_empty() {
                    expect::error_answer(&out).map_or(Ok(()), Err)
                } else {
                    expect::compare(&out, expected, *mode)
                };
                checked
                    .map_err(|e| format!("{what}{}: {e}{}", rerun_label(&line.id), meanwhile()))?;
            }
            Check::Server(server) => {
                let pid = event.pid.ok_or_else(|| format!("{what}: no process"))?;
                ready(shell, &line.id, &what, server, pid, &event.report, timeouts)?;
                background.push((line.id.clone(), pid));
            }
        }
        shell.go()?;
    }
    Ok(())
}

fn rerun_label(id: &str) -> String {
    id.split_once(".r")
        .map(|(_, j)| format!(" (repeat {j}, README: next requests)"))
        .unwrap_or_default()
}

fn what(text: &str) -> String {
    let first = text.lines().next().unwrap_or_default();
    let cut: String = first.chars().take(70).collect();
    format!(
        "`{cut}{}`",
        if cut.len() < first.len() { "..." } else { "" }
    )
}

#[derive(Debug)]
struct Timeouts {
    build: Duration,
    ready: Duration,
}

/// Waits for a gateway: cargo done building (it prints `Running`), `/readyz` 200, and on SQLite
/// its global table's file.
fn ready(
    shell: &Shell,
    id: &str,
    what: &str,
    server: &Server,
    pid: u32,
    data_dir: &str,
    timeouts: &Timeouts,
) -> Result<(), String> {
    if server.build {
        let mut exited = false;
        let built = shell::poll(timeouts.build, || {
            exited = !shell::alive(pid);
            exited || shell.errors(id).contains("Running")
        });
        if exited || !shell::alive(pid) {
            return Err(format!(
                "{what} exited before the gateway ran: {}",
                shell.tail(id)
            ));
        }
        if !built {
            return Err(format!(
                "{what}: cargo did not finish within {}s: {}",
                timeouts.build.as_secs(),
                shell.tail(id)
            ));
        }
    }
    let mut last = None;
    let up = shell::poll(timeouts.ready, || {
        last = shell::http_get(&server.host, server.port, "/readyz");
        !shell::alive(pid) || last.as_ref().is_some_and(|(code, _)| *code == 200)
    });
    if !shell::alive(pid) {
        return Err(format!(
            "{what} exited before /readyz answered 200: {}",
            shell.tail(id)
        ));
    }
    if !up {
        let (code, body) = last.map_or(("no answer".to_string(), String::new()), |(c, b)| {
            (c.to_string(), b)
        });
        return Err(format!(
            "{what}: /readyz on {}:{} answered {code}, not 200, for {}s: {}",
            server.host,
            server.port,
            timeouts.ready.as_secs(),
            expect::short(&body)
        ));
    }
    // The data directory as the shell expanded it (none without SQLite).
    if data_dir.is_empty() {
        return Ok(());
    }
    let dir = shell.cwd.join(data_dir);
    let has_file = || {
        std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| e.file_type().is_ok_and(|t| t.is_file()))
    };
    if !shell::poll(DATA_TIMEOUT, has_file) {
        return Err(format!(
            "{what}: no global-table file under its data dir {} within {}s of /readyz 200",
            dir.display(),
            DATA_TIMEOUT.as_secs()
        ));
    }
    Ok(())
}

#[test]
fn the_run_sections_examples_work_as_written() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repository root")
        .to_path_buf();
    let readme_path = std::env::var("README_EXAMPLES_README")
        .map_or_else(|_| repo.join("README.md"), PathBuf::from);
    let readme = std::fs::read_to_string(&readme_path).expect("README");
    let profile = std::env::var("README_EXAMPLES_PROFILE").unwrap_or_else(|_| "debug".into());
    assert!(
        matches!(profile.as_str(), "debug" | "release"),
        "README_EXAMPLES_PROFILE must be debug or release"
    );
    // The gateway this test was built with sits in <target>/debug: the examples' cargo builds
    // there too (a no-op on the debug profile).
    let gateway = Path::new(env!("CARGO_BIN_EXE_strata-gateway"));
    let target = gateway
        .parent()
        .and_then(Path::parent)
        .expect("target directory")
        .to_path_buf();
    let timeouts = Timeouts {
        build: setting("README_EXAMPLES_BUILD_TIMEOUT", 1800),
        ready: setting("README_EXAMPLES_READY_TIMEOUT", 30),
    };

    let _lock = port::readme_lock();
    let work = std::env::temp_dir().join(format!("strata-readme-run-{}", std::process::id()));
    let reader = work.join("reader");
    let tmp = work.join("tmp");
    for dir in [reader.join("target"), tmp.clone(), work.join("examples")] {
        std::fs::create_dir_all(&dir).expect("scratch directory");
    }
    std::os::unix::fs::symlink(target.join(&profile), reader.join("target/release"))
        .expect("target/release link");

    let mut env: Vec<(String, String)> = [
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LC_ALL",
        "TERM",
        "CARGO_HOME",
        "RUSTUP_HOME",
        "RUSTUP_TOOLCHAIN",
    ]
    .into_iter()
    .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
    .collect();
    env.extend([
        (
            "CARGO_TARGET_DIR".into(),
            target.to_string_lossy().into_owned(),
        ),
        // Temporary directories the README makes (`mktemp -d`) go with the scratch directory.
        ("TMPDIR".into(), tmp.to_string_lossy().into_owned()),
        ("NO_PROXY".into(), "localhost,127.0.0.1".into()),
        ("no_proxy".into(), "localhost,127.0.0.1".into()),
        ("README_EXAMPLES_PROFILE".into(), profile.clone()),
    ]);
    // Under nextest, the lab an example starts takes its ports from this test's slot.
    env.extend(
        std::env::var("NEXTEST_TEST_GLOBAL_SLOT")
            .ok()
            .map(|v| ("NEXTEST_TEST_GLOBAL_SLOT".into(), v)),
    );

    let defaults = Defaults {
        listen: markdown::table_default(&readme, "--listen")
            .expect("the settings table's --listen default"),
        data_dir: markdown::table_default(&readme, "--data-dir")
            .expect("the settings table's --data-dir default"),
    };
    let blocks: Vec<Block> = markdown::blocks(&readme).expect("README");
    assert!(!blocks.is_empty(), "no example blocks under \"## Run\"");

    let mut outcomes: Vec<Outcome> = Vec::new();
    let mut sessions: Vec<(u32, usize)> = Vec::new();
    let mut created: Vec<PathBuf> = Vec::new();
    let mut client_for_port: HashMap<u16, Vec<Step>> = HashMap::new();
    let mut per_heading: HashMap<String, usize> = HashMap::new();
    let stop_sessions = |sessions: &mut Vec<(u32, usize)>, outcomes: &mut Vec<Outcome>| {
        for (pgid, index) in sessions.drain(..) {
            if !shell::stop_group(pgid) {
                outcomes[index].fail(
                    "a gateway did not exit within 15s of SIGTERM (README: \"SIGTERM or Ctrl-C stops accepting, finishes in-flight requests\"); killed",
                );
            }
        }
    };

    for block in &blocks {
        let nth = per_heading.entry(block.heading.clone()).or_default();
        *nth += 1;
        let index = outcomes.len();
        outcomes.push(Outcome {
            label: block.label(*nth),
            failure: None,
            took: Duration::ZERO,
        });
        let began = Instant::now();
        let steps = match markdown::steps(block) {
            Ok(steps) => steps,
            Err(e) => {
                outcomes[index].fail(e);
                continue;
            }
        };
        let servers: Vec<Server> = steps
            .iter()
            .filter(|s| s.kind == Kind::Server)
            .map(|s| server(&s.text, &defaults))
            .collect();
        let client_ports: Vec<u16> = steps
            .iter()
            .filter(|s| s.kind != Kind::Server)
            .flat_map(|s| markdown::client_ports(&s.text))
            .collect();
        // A block that starts a gateway ends the earlier ones, as a reader stops them first.
        if !servers.is_empty() {
            stop_sessions(&mut sessions, &mut outcomes);
        }
        if let Err(why) = preconditions(&servers, &mut created) {
            outcomes[index].fail(why);
            continue;
        }
        let mut script = lines(&steps, "", Mode::Exact, &defaults);
        // A block that only starts a gateway: send it the requests of the latest block aimed at its port.
        if let (Some(last), true) = (servers.last(), client_ports.is_empty())
            && let Some(client) = client_for_port.get(&last.port)
        {
            script.extend(lines(client, "c", Mode::Relaxed, &defaults));
        }
        let dir = work.join("examples").join(format!("{:02}", index + 1));
        std::fs::create_dir_all(&dir).expect("example directory");
        let commands: Vec<Line> = script.iter().map(|(l, _)| l.clone()).collect();
        let mut shell = match Shell::start(&dir, &reader, &repo, &commands, &env) {
            Ok(shell) => shell,
            Err(e) => {
                outcomes[index].fail(e);
                continue;
            }
        };
        match run_block(&mut shell, &script, &timeouts) {
            Ok(()) => match shell.finish() {
                Ok(pgid) if !servers.is_empty() => sessions.push((pgid, index)),
                Ok(pgid) => {
                    shell::stop_group(pgid);
                }
                Err(e) => outcomes[index].fail(format!("{e} (logs: {})", dir.display())),
            },
            Err(e) => {
                outcomes[index].fail(format!("{e} (logs: {})", dir.display()));
                shell.abandon();
            }
        }
        if servers.is_empty() {
            for port in client_ports {
                client_for_port.insert(port, steps.clone());
            }
        }
        outcomes[index].took = began.elapsed();
    }
    stop_sessions(&mut sessions, &mut outcomes);
    for dir in &created {
        let _ = std::fs::remove_dir_all(dir);
    }

    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| o.failure.is_some()).collect();
    for o in &outcomes {
        match &o.failure {
            None => println!("ok   {} ({:.1} s)", o.label, o.took.as_secs_f64()),
            Some(why) => println!("FAIL {} ({:.1} s): {why}", o.label, o.took.as_secs_f64()),
        }
    }
    if failed.is_empty() && std::env::var("README_EXAMPLES_KEEP").as_deref() != Ok("1") {
        let _ = std::fs::remove_dir_all(&work);
    }
    assert!(
        failed.is_empty(),
        "{} of {} README examples failed (scratch directory kept: {}):\n{}",
        failed.len(),
        outcomes.len(),
        work.display(),
        failed
            .iter()
            .map(|o| format!(
                "FAIL {}: {}",
                o.label,
                o.failure.as_deref().unwrap_or_default()
            ))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Free ports, a Redis that answers, README data directories that start out clean.
fn preconditions(servers: &[Server], created: &mut Vec<PathBuf>) -> Result<(), String> {
    for s in servers {
        if shell::listening(&s.host, s.port) {
            return Err(format!(
                "port {}:{} is already in use by another process; the README's example needs it",
                s.host, s.port
            ));
        }
        if let Some((host, port)) = &s.redis
            && !shell::redis_answers(host, *port)
        {
            return Err(format!(
                "no Redis answering PING on {host}:{port} (./scripts/test.sh starts one): the README's Redis example cannot run"
            ));
        }
        let Some(dir) = s
            .data_dir
            .as_deref()
            .map(Path::new)
            .filter(|d| d.is_absolute())
        else {
            continue;
        };
        if created.iter().any(|c| c == dir) {
            continue;
        }
        if dir.exists() {
            return Err(format!(
                "{} already exists (an earlier run?): the README's example would reuse its counts; remove it and rerun",
                dir.display()
            ));
        }
        created.push(dir.to_path_buf());
    }
    Ok(())
}
