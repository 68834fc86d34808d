//! A real `workerd serve` process running the built edge bundle (`edge/dist`, from
//! `scripts/build-edge.sh`) on a free loopback port, with the given vars as text bindings and
//! loopback reachable for its fetches. Killed on drop; its log is kept for failure reports.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Workerd {
    child: Child,
    dir: PathBuf,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
}

/// The workerd binary the test command installs (npm, pinned in wasm-tests/package.json).
pub fn binary() -> PathBuf {
    let bin = super::root().join("wasm-tests/node_modules/workerd/bin/workerd");
    assert!(
        bin.exists(),
        "{} is missing: run scripts/test.sh (or npm install in wasm-tests/)",
        bin.display()
    );
    bin
}

fn bundle() -> PathBuf {
    let dir = super::root().join("edge/dist");
    assert!(
        dir.join("strata_edge_bg.wasm").exists(),
        "{} has no bundle: run scripts/build-edge.sh (scripts/test.sh does)",
        dir.display()
    );
    dir
}

/// A Cap'n Proto text literal.
fn capnp_text(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Whether workerds started from now on log V8's compiles and collections.
static TRACE_V8: AtomicBool = AtomicBool::new(false);

/// Workerds started after this call log each Wasm function V8 compiles, with its tier
/// (`--trace-wasm-compilation-times`), and each collection, with what was allocated since the
/// last (`--trace-gc-nvp`); both only print. A benchmark reads, with [`Workerd::tier_ups`] and
/// [`Workerd::heap`], what V8 did while it measured.
pub fn trace_v8() {
    TRACE_V8.store(true, Ordering::Relaxed);
}

/// What V8's collections have logged so far in one workerd (all its isolates).
#[derive(Clone, Copy, Debug, Default)]
pub struct Heap {
    /// Bytes allocated up to the last collection.
    pub allocated: u64,
    /// Young-generation collections (scavenges).
    pub scavenges: u64,
    /// How long the scavenges paused the isolate, in all (ms).
    pub scavenge_ms: f64,
}

impl Heap {
    /// Adds what was logged between reading `before` and reading `now`.
    pub fn add_between(&mut self, before: Heap, now: Heap) {
        self.allocated += now.allocated - before.allocated;
        self.scavenges += now.scavenges - before.scavenges;
        self.scavenge_ms += now.scavenge_ms - before.scavenge_ms;
    }
}

/// EDGE_V8_FLAGS (space-separated, as `--no-liftoff --trace-gc`) sets a benchmark's V8 flags,
/// workerd's `v8Flags`: what a part of V8 (its tiers, its collector) costs, turned off in the
/// same harness.
fn v8_flags() -> String {
    let traced: &[&str] = if TRACE_V8.load(Ordering::Relaxed) {
        &["--trace-wasm-compilation-times", "--trace-gc-nvp"]
    } else {
        &[]
    };
    let env = std::env::var("EDGE_V8_FLAGS").unwrap_or_default();
    env.split_whitespace()
        .chain(traced.iter().copied())
        .map(capnp_text)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Workerd {
    /// Serves the proxy Worker (`worker.mjs`) with `vars`.
    pub fn proxy(vars: &[(&str, &str)]) -> Self {
        Self::start(None, vars, None)
    }

    /// Serves the proxy Worker with `vars`, reaching the gateway at `address` (`host:port`)
    /// through a `STRATA_GATEWAY` service binding instead of a URL.
    pub fn proxy_via_service(vars: &[(&str, &str)], address: &str) -> Self {
        Self::start(None, vars, Some(address))
    }

    /// Serves `example` (a module from `edge/examples/`) as the main module, with the bundle
    /// beside it.
    pub fn example(example: &str, vars: &[(&str, &str)]) -> Self {
        Self::example_from(&super::root().join("edge/examples").join(example), vars)
    }

    /// Serves the module at `main` as the main module, with the bundle beside it.
    pub fn example_from(main: &std::path::Path, vars: &[(&str, &str)]) -> Self {
        Self::start(Some(main), vars, None)
    }

    fn start(main: Option<&std::path::Path>, vars: &[(&str, &str)], gateway: Option<&str>) -> Self {
        let port = super::free_port();
        let dir =
            std::env::temp_dir().join(format!("strata-workerd-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for file in ["worker.mjs", "strata_edge.js", "strata_edge_bg.wasm"] {
            std::fs::copy(bundle().join(file), dir.join(file)).unwrap();
        }
        let mut modules = String::new();
        if let Some(main) = main {
            let example = main.file_name().unwrap().to_string_lossy();
            std::fs::copy(main, dir.join(&*example)).unwrap();
            modules.push_str(&format!(
                "(name = \"{example}\", esModule = embed \"{example}\"),\n"
            ));
        }
        modules.push_str(
            "(name = \"worker.mjs\", esModule = embed \"worker.mjs\"),\n\
             (name = \"strata_edge.js\", esModule = embed \"strata_edge.js\"),\n\
             (name = \"strata_edge_bg.wasm\", wasm = embed \"strata_edge_bg.wasm\"),\n",
        );
        let mut bindings: Vec<String> = vars
            .iter()
            .map(|(k, v)| format!("(name = \"{k}\", text = {})", capnp_text(v)))
            .collect();
        let mut services = String::new();
        if let Some(address) = gateway {
            services =
                format!("(name = \"gateway\", external = (address = \"{address}\", http = ())),\n");
            bindings.push("(name = \"STRATA_GATEWAY\", service = \"gateway\")".to_string());
        }
        let config = format!(
            "using Workerd = import \"/workerd/workerd.capnp\";\n\
             const config :Workerd.Config = (\n\
               services = [\n\
                 (name = \"main\", worker = .edge),\n\
                 (name = \"net\", network = (allow = [\"public\", \"private\", \"local\"])),\n\
                 {services}\
               ],\n\
               sockets = [(name = \"http\", address = \"127.0.0.1:{port}\", http = (), service = \"main\")],\n\
               v8Flags = [{}],\n\
             );\n\
             const edge :Workerd.Worker = (\n\
               modules = [\n{modules}],\n\
               compatibilityDate = \"2026-04-01\",\n\
               globalOutbound = \"net\",\n\
               bindings = [{}],\n\
             );\n",
            v8_flags(),
            bindings.join(", ")
        );
        std::fs::write(dir.join("config.capnp"), config).unwrap();
        let log = std::fs::File::create(dir.join("workerd.log")).unwrap();
        // EDGE_CPUS (a taskset list, as in scripts/bench-edge.sh) pins a benchmark's workerds;
        // taskset and stdbuf exec what they run, so the child's pid stays workerd's.
        let mut argv: Vec<std::ffi::OsString> = Vec::new();
        if let Ok(cpus) = std::env::var("EDGE_CPUS").map(|c| c.trim().to_string())
            && !cpus.is_empty()
        {
            argv.extend(["taskset".into(), "-c".into(), cpus.into()]);
        }
        if TRACE_V8.load(Ordering::Relaxed) {
            // V8 prints the trace to stdout, a file here: line-buffered, a count is current.
            argv.extend(["stdbuf".into(), "-oL".into()]);
        }
        argv.push(binary().into());
        let mut command = Command::new(&argv[0]);
        command.args(&argv[1..]);
        let child = command
            .arg("serve")
            .arg(dir.join("config.capnp"))
            .arg("--verbose")
            .current_dir(&dir)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start workerd ({e})"));
        Self {
            child,
            dir,
            base: format!("http://127.0.0.1:{port}"),
        }
    }

    /// The CPU time workerd has used so far, all its threads, user and system: what a
    /// benchmark divides by the requests it sent, the cost that moves least with how the
    /// machine shares its cores.
    pub fn cpu_time(&self) -> Duration {
        super::cpu::cpu_time(self.child.id())
    }

    /// How many Wasm functions V8 has tiered up to TurboFan in this workerd so far (0 unless
    /// started after [`trace_v8`]).
    pub fn tier_ups(&self) -> usize {
        self.log().matches(" using TurboFan").count()
    }

    /// What V8's collections in this workerd have logged so far (nothing unless started after
    /// [`trace_v8`]). A collection reports what was allocated since the one before, so a
    /// difference of two readings is short by what the last collection has not yet seen.
    pub fn heap(&self) -> Heap {
        // One line a collection: `... GC: {"pause":2.0,...,"gc":"s",...,"allocated":1462948,...}`.
        let mut heap = Heap::default();
        for line in self.log().lines() {
            let Some((_, fields)) = line.split_once("GC: ") else {
                continue;
            };
            let Ok(gc) = serde_json::from_str::<serde_json::Value>(fields) else {
                continue;
            };
            heap.allocated += gc["allocated"].as_u64().unwrap_or(0);
            if gc["gc"] == "s" {
                heap.scavenges += 1;
                heap.scavenge_ms += gc["pause"].as_f64().unwrap_or(0.0);
            }
        }
        heap
    }

    /// What workerd and the Worker's `console.log` wrote.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("workerd.log")).unwrap_or_default()
    }

    /// Waits until workerd accepts connections (30 s at most; fails at once if it exits).
    pub async fn ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = self.base.trim_start_matches("http://").to_string();
        loop {
            if tokio::net::TcpStream::connect(&addr).await.is_ok() {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("workerd exited before listening: {status}\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "workerd not listening within 30 s\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for Workerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
