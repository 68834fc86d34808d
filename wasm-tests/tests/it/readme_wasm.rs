//! README.md's sections "The edge" and "The Envoy filter", run as written: the workerd,
//! wrangler and Envoy examples, each with a fresh gateway on 127.0.0.1:8080 as the Run section
//! starts it (the commands are read from the README, run from
//! the repository root by bash, and their output compared with the README's), its rules JSON
//! parses, and its binding example is the file the workerd tests serve.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The README's section whose heading starts with `heading`, up to the next `## ` heading.
pub(crate) fn section_of(heading: &str) -> String {
    let readme = std::fs::read_to_string(common::root().join("README.md")).unwrap();
    let start = readme
        .find(&format!("\n## {heading}"))
        .unwrap_or_else(|| panic!("README.md has a section \"{heading}\""));
    let rest = &readme[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |i| i + 3);
    rest[..end].to_string()
}

/// The `### ` subsection of `section` whose heading starts with `heading`, up to the next.
pub(crate) fn subsection(section: &str, heading: &str) -> String {
    let start = section
        .find(&format!("\n### {heading}"))
        .unwrap_or_else(|| panic!("README.md has a subsection \"{heading}\""))
        + 1;
    let rest = &section[start..];
    let end = rest[4..].find("\n### ").map_or(rest.len(), |i| i + 4);
    rest[..end].to_string()
}

fn section() -> String {
    section_of("The edge")
}

/// The edge's section from the bundle built from a checkout on (workerd, wrangler with the
/// bundle as it is, the settings, binding mode), past the npm package's subsection.
fn from_source() -> String {
    let section = section();
    let start = section
        .find("\n### From source")
        .expect("README.md's edge section has a subsection \"From source\"");
    section[start..].to_string()
}

/// The indented (4-space) code blocks of `text`, in order, as lines.
pub(crate) fn indented_blocks(text: &str) -> Vec<Vec<String>> {
    let mut blocks = Vec::new();
    let mut current: Vec<String> = Vec::new();
    for line in text.lines() {
        match line.strip_prefix("    ") {
            Some(code) => current.push(code.to_string()),
            None if line.trim().is_empty() && !current.is_empty() => {
                blocks.push(std::mem::take(&mut current));
            }
            None => current.clear(),
        }
    }
    if !current.is_empty() {
        blocks.push(current);
    }
    blocks
}

/// The fenced block of `text` opened with "```lang".
pub(crate) fn fenced(text: &str, lang: &str) -> String {
    let open = format!("```{lang}\n");
    let start = text
        .find(&open)
        .unwrap_or_else(|| panic!("no ```{lang} block"))
        + open.len();
    let end = text[start..].find("```").unwrap() + start;
    text[start..end].to_string()
}

fn bash(command: &str) -> Command {
    let mut c = Command::new("bash");
    c.args(["-c", command]).current_dir(common::root());
    c
}

/// Kills a background command's process group on drop.
struct Background(Child);

impl Drop for Background {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["--", &format!("-{}", self.0.id())])
            .status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn background(command: &str) -> Background {
    // Its own process group (setsid), so the whole command stops with it.
    let child = Command::new("setsid")
        .args(["bash", "-c", command])
        .current_dir(common::root())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Background(child)
}

/// Waits until something answers HTTP on `port` (30 s at most).
fn wait_for_http(port: u16, what: &str) {
    use std::io::{Read, Write};
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let mut buf = [0_u8; 5];
            if s.write_all(b"GET / HTTP/1.0\r\n\r\n").is_ok()
                && s.read_exact(&mut buf).is_ok()
                && &buf == b"HTTP/"
            {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{what} not answering on {port} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_until_free(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
        assert!(
            Instant::now() < deadline,
            "port {port} still taken 15 s after stopping"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs a section's examples: each block that starts a server (with the lines before it),
/// against a fresh gateway on 8080, then the block of requests, whose lines are commands each
/// followed by the output the README shows.
/// How the README starts a gateway of this checkout.
const GATEWAY_RUN: &str = "cargo run --release -p strata-gateway --";

fn run_examples(section: &str, is_server: impl Fn(&str) -> bool, ports: &[u16], servers: usize) {
    let blocks = indented_blocks(section);
    let server_blocks: Vec<&Vec<String>> = blocks
        .iter()
        .filter(|b| b.iter().any(|l| is_server(l)))
        .collect();
    assert_eq!(server_blocks.len(), servers, "blocks that start a server");
    let try_it = blocks
        .iter()
        .find(|b| b.iter().any(|l| l.starts_with("for ")))
        .expect("a block that sends requests");
    let steps: Vec<(&String, &String)> = try_it.chunks_exact(2).map(|p| (&p[0], &p[1])).collect();
    assert!(
        !steps.is_empty() && try_it.len() % 2 == 0,
        "commands each with their output"
    );

    // The ports are the README's: the README examples' lock keeps runs apart.
    let _held = common::readme_lock();
    for block in server_blocks {
        for port in ports.iter().copied().chain([8080]) {
            assert!(
                std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
                "port {port} is taken: the README's example needs it"
            );
        }
        // A fresh gateway for each, as the Run section starts it, unless the block starts its
        // own (with flags of its own): then that line runs this build's binary, with a data
        // directory of the test's.
        let data = std::env::temp_dir().join(format!("strata-readme-wasm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data);
        let binary = format!(
            "{} --data-dir {}",
            common::gateway_binary().display(),
            data.display()
        );
        let own_gateway = block.iter().any(|l| l.starts_with(GATEWAY_RUN));
        let mut servers = Vec::new();
        if !own_gateway {
            servers.push(background(&format!(
                "exec {binary} --listen 127.0.0.1:8080"
            )));
            wait_for_http(8080, "the gateway");
        }
        for line in block {
            if let Some(args) = line.strip_prefix(GATEWAY_RUN) {
                servers.push(background(&format!("exec {binary}{args}")));
                wait_for_http(8080, "the gateway");
            } else if is_server(line) {
                servers.push(background(&format!("exec {line}")));
            } else {
                let out = bash(line).output().unwrap();
                assert!(out.status.success(), "`{line}` failed: {out:?}");
            }
        }
        for port in ports {
            wait_for_http(*port, &format!("{block:?}"));
        }
        for (command, expected) in &steps {
            let out = bash(command).output().unwrap();
            assert!(out.status.success(), "`{command}` failed: {out:?}");
            let printed = String::from_utf8_lossy(&out.stdout);
            assert_eq!(
                printed.trim(),
                expected.trim(),
                "`{command}` served by {block:?}"
            );
        }
        drop(servers);
        for port in ports.iter().copied().chain([8080]) {
            wait_until_free(port);
        }
        let _ = std::fs::remove_dir_all(&data);
    }
}

#[test]
fn the_workerd_and_wrangler_examples_run_as_written() {
    let is_server = |l: &str| l.contains("workerd serve") || l.contains("wrangler dev");
    run_examples(&from_source(), is_server, &[8787], 2);
}

#[test]
fn the_envoy_example_runs_as_written() {
    let is_server = |l: &str| l.contains("envoy -c");
    run_examples(
        &section_of("The Envoy filter"),
        is_server,
        &[10000, 9901],
        1,
    );
}

#[test]
fn the_envoy_without_wasm_example_runs_as_written() {
    let is_server = |l: &str| l.contains("envoy -c") || l.starts_with(GATEWAY_RUN);
    run_examples(
        &section_of("Envoy without Wasm"),
        is_server,
        &[10000, 9901],
        1,
    );
}

#[test]
fn the_rules_example_is_valid() {
    let rules = fenced(&section(), "json");
    let gate = strata_core::gate::Gate::from_json("edge", &rules, "")
        .unwrap_or_else(|e| panic!("the README's rules: {e}"));
    assert_eq!(gate.rules().rules().len(), 3);
    assert!(gate.rules().rules()[2].shadow);
}

#[test]
fn the_binding_example_is_the_file_the_tests_serve() {
    let js = fenced(&from_source(), "js");
    let file = std::fs::read_to_string(common::root().join("edge/examples/binding.mjs")).unwrap();
    assert!(
        file.ends_with(&js),
        "README's binding example differs from edge/examples/binding.mjs"
    );
}
