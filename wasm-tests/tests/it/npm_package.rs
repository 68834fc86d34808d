//! The edge as an npm package, used the way the README's "In your Worker" shows a Workers
//! developer: the tarball `scripts/build-edge.sh` packs, installed by the README's `npm install`
//! line into a fresh Worker project in a temp folder, its TypeScript checked by `tsc`, bundled
//! by wrangler's esbuild (no `no_bundle`, no rules of ours) and served by `npx wrangler dev`
//! against a gateway process. The project's wrangler is the one the test command pins, linked
//! into the project as a developer's own `npm install -D wrangler` would put it; the ports are
//! the test's own instead of the README's 8787 and 8080.

use crate::common;
use crate::readme_wasm::{fenced, indented_blocks, section_of, subsection};

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::process::GatewayProcess;

fn npm_section() -> String {
    subsection(&section_of("The edge"), "In your Worker")
}

/// The README's block whose first line starts with `prefix`, as lines.
fn block_starting(section: &str, prefix: &str) -> Vec<String> {
    indented_blocks(section)
        .into_iter()
        .find(|b| b.first().is_some_and(|l| l.starts_with(prefix)))
        .unwrap_or_else(|| panic!("the README's npm section has a block starting `{prefix}`"))
}

/// A fresh Worker project: `package.json`, the `files` given, then the README's `npm install`
/// line run in it (the tarball's path made this checkout's).
struct Project {
    dir: PathBuf,
}

impl Drop for Project {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Project {
    fn new(name: &str, files: &[(&str, &str)]) -> Self {
        let dir = std::env::temp_dir().join(format!("strata-npm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::write(
            dir.join("package.json"),
            format!("{{ \"name\": \"{name}\", \"private\": true, \"type\": \"module\" }}\n"),
        )
        .unwrap();
        for (path, text) in files {
            std::fs::write(dir.join(path), text).unwrap();
        }
        let install = block_starting(&npm_section(), "npm install ").join("\n");
        let root = common::root();
        let install = install.replace("/path/to/strata", &root.display().to_string());
        let tarball = install.rsplit(' ').next().unwrap_or_default().to_string();
        assert!(
            Path::new(&tarball).exists(),
            "{tarball} is missing: run scripts/build-edge.sh (scripts/test.sh does); the README \
             names the version edge/package.json has"
        );
        let out = Command::new("bash")
            .args(["-c", &install])
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "`{install}` failed: {out:?}");
        // The developer's own wrangler, as `npm install -D wrangler` leaves it.
        let bin = dir.join("node_modules/.bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::os::unix::fs::symlink(
            root.join("wasm-tests/node_modules/wrangler/bin/wrangler.js"),
            bin.join("wrangler"),
        )
        .unwrap();
        Self { dir }
    }

    /// `tsc --noEmit` over `src/` (the test command's pinned TypeScript): its output, and
    /// whether it passed.
    fn typecheck(&self) -> (bool, String) {
        std::fs::write(
            self.dir.join("tsconfig.json"),
            r#"{ "compilerOptions": { "target": "es2022", "module": "es2022",
  "moduleResolution": "bundler", "lib": ["es2022", "webworker"], "types": [],
  "strict": true, "noEmit": true }, "include": ["src"] }
"#,
        )
        .unwrap();
        let tsc = common::root().join("wasm-tests/node_modules/.bin/tsc");
        let out = Command::new(&tsc)
            .args(["--noEmit", "-p", "."])
            .current_dir(&self.dir)
            .output()
            .unwrap_or_else(|e| panic!("{}: {e} (scripts/test.sh installs it)", tsc.display()));
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    }

    /// The README's `npx wrangler dev`, on a port of the test's, the gateway at `gateway`.
    fn serve(&self, gateway: &str) -> Wrangler {
        let line = block_starting(&npm_section(), "npx wrangler dev").join(" ");
        let port = common::free_port();
        let inspector = common::free_port();
        let log = self.dir.join("wrangler.log");
        let command = format!(
            "exec {line} --ip 127.0.0.1 --port {port} --inspector-port {inspector} \
             --var STRATA_GATEWAY_URL:{gateway} --var STRATA_UPSTREAM:{gateway}"
        );
        let child = Command::new("setsid")
            .args(["bash", "-c", &command])
            .current_dir(&self.dir)
            .env("WRANGLER_SEND_METRICS", "false")
            .env("XDG_CONFIG_HOME", self.dir.join(".config"))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(self.dir.join("wrangler.err")).unwrap())
            .spawn()
            .unwrap();
        let mut wrangler = Wrangler { child, port, log };
        wrangler.wait_ready();
        wrangler
    }
}

/// A `wrangler dev` process group, stopped on drop.
struct Wrangler {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Drop for Wrangler {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Wrangler {
    /// Waits until wrangler says it is ready and answers on its port (60 s at most: the first
    /// start bundles).
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            if log.contains("Ready on")
                && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("wrangler dev exited ({status}):\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "wrangler dev not ready within 60 s:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typescript_worker_limits_through_the_installed_package() {
    let section = npm_section();
    let project = Project::new(
        "my-worker",
        &[
            ("src/index.ts", &fenced(&section, "ts")),
            ("wrangler.toml", &fenced(&section, "toml")),
        ],
    );
    let (passed, output) = project.typecheck();
    assert!(passed, "tsc on the README's Worker:\n{output}");

    // The declarations are not `any`: a limiter not passed, a misspelt option and a wrong
    // type are each an error.
    std::fs::write(
        project.dir.join("src/misuse.ts"),
        r#"import { withLimiters } from "strata-edge";
export default withLimiters({ LOGIN: { limit: 3, period: 60 } }, {
  async fetch(request, env) {
    await env.SIGNUP.limit({ key: "a" });
    await env.LOGIN.limit({ kee: "a" });
    const success: string = (await env.LOGIN.limit({ key: "a" })).success;
    return new Response(success);
  },
});
"#,
    )
    .unwrap();
    let (passed, output) = project.typecheck();
    assert!(!passed, "tsc passed a misuse:\n{output}");
    for error in [
        "'SIGNUP'",
        "'kee'",
        "'boolean' is not assignable to type 'string'",
    ] {
        assert!(
            output.contains(error),
            "tsc did not name {error}:\n{output}"
        );
    }
    std::fs::remove_file(project.dir.join("src/misuse.ts")).unwrap();

    let mut gateway = GatewayProcess::start(&[]);
    let http = reqwest::Client::new();
    gateway.ready(&http).await;
    let wrangler = project.serve(&gateway.base);
    let try_it = block_starting(&section, "for ");
    let [command, expected] = &try_it[..] else {
        panic!("the README's requests: a command and its output, {try_it:?}");
    };
    let command = command.replace("localhost:8787", &format!("localhost:{}", wrangler.port));
    let out = Command::new("bash")
        .args(["-c", &command])
        .output()
        .unwrap();
    assert!(out.status.success(), "`{command}`: {out:?}");
    let log = std::fs::read_to_string(&wrangler.log).unwrap_or_default();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        expected.trim(),
        "`{command}` through wrangler:\n{log}"
    );
    // Another user has a count of their own, and the answer is the handler's.
    let answer = http
        .get(format!("http://127.0.0.1:{}/?user=bob", wrangler.port))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.text().await.unwrap(), "2 left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_from_the_installed_package_limits_by_rule() {
    let section = npm_section();
    let rules = r#"{"rules":[{"name":"per-key","namespace":"npm-proxy","limit":2,"duration":"1h","actions":[{"request_headers":{"header_name":"x-api-key","descriptor_key":"key"}}]}]}"#;
    let toml = format!(
        "name = \"my-proxy\"\nmain = \"src/index.js\"\ncompatibility_date = \"2026-04-01\"\n\n\
         [vars]\nSTRATA_RULES = '{rules}'\n"
    );
    let project = Project::new(
        "my-proxy",
        &[
            ("src/index.js", &fenced(&section, "js")),
            ("wrangler.toml", &toml),
        ],
    );
    let mut gateway = GatewayProcess::start(&[]);
    let http = reqwest::Client::new();
    gateway.ready(&http).await;
    let wrangler = project.serve(&gateway.base);
    let url = format!("http://127.0.0.1:{}/healthz", wrangler.port);
    let mut statuses = Vec::new();
    for key in ["alice", "alice", "alice", "bob"] {
        let answer = http
            .get(&url)
            .header("x-api-key", key)
            .send()
            .await
            .unwrap();
        statuses.push(answer.status().as_u16());
        if answer.status() == 429 {
            assert!(answer.headers().contains_key("retry-after"));
            let body = answer.text().await.unwrap();
            assert!(body.contains("rate_limited"), "{body}");
        }
    }
    let log = std::fs::read_to_string(&wrangler.log).unwrap_or_default();
    assert_eq!(statuses, [200, 200, 429, 200], "through wrangler:\n{log}");
}
