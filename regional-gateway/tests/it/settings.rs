//! The settings as an operator meets them, in the built binary: README.md's settings table says
//! what `strata-gateway --help` says (the same flags, environment variables and defaults), and a
//! setting given by flag, environment and file at once is taken from the flag, then the
//! environment, then the file, then the default.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use strata_gateway::config::DEFAULT_REGION;

/// The binary, without the `STRATA_*` variables of this environment (`--help` shows their
/// values, and they would set what the tests mean to set).
fn gateway() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_strata-gateway"));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("STRATA_") {
            command.env_remove(key);
        }
    }
    command
}

/// What a source says of one flag: its environment variable and its default (`None`: none).
#[derive(Debug, PartialEq)]
struct Doc {
    env: Option<String>,
    default: Option<String>,
}

/// The text between `open` and the next `]` in `text`.
fn bracketed(text: &str, open: &str) -> Option<String> {
    let (_, rest) = text.split_once(open)?;
    Some(rest.split(']').next()?.to_string())
}

/// `--help`'s options: flag → its `[env: NAME=]` and `[default: VALUE]`.
fn help() -> BTreeMap<String, Doc> {
    let out = gateway().arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    // After `Options:`, a line starting (after its indent) with `-` opens an option; any other
    // indented line continues its help.
    let mut options: Vec<(String, String)> = Vec::new();
    for line in text.lines().skip_while(|l| *l != "Options:").skip(1) {
        let trimmed = line.trim_start();
        if trimmed.starts_with('-') {
            let long = trimmed
                .split_whitespace()
                .find(|w| w.starts_with("--"))
                .unwrap_or_else(|| panic!("an option without a long flag: {line}"));
            options.push((long.trim_end_matches(',').to_string(), line.to_string()));
        } else if let Some((_, help)) = options.last_mut() {
            help.push(' ');
            help.push_str(trimmed);
        }
    }
    assert!(!options.is_empty(), "no options in --help:\n{text}");
    options
        .into_iter()
        .map(|(flag, help)| {
            let env = bracketed(&help, "[env: ").map(|e| e.trim_end_matches('=').to_string());
            let default = bracketed(&help, "[default: ");
            (flag, Doc { env, default })
        })
        .collect()
}

/// The code spans of a table cell: `` `a`, `b` `` → `a`, `b`.
fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect()
}

/// README.md's "## Run" section, and its `| flag | environment | default |` table: flag → what
/// the row says. A row may list several flags: one variable each, and either `none...` (no
/// default for any) or one code span per flag first (`` `5s`, `5s` (region-wide) ``).
fn readme() -> (String, BTreeMap<String, Doc>) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md");
    let text = std::fs::read_to_string(path).unwrap();
    let run = text
        .split_once("\n## Run\n")
        .map(|(_, rest)| rest.split("\n## ").next().unwrap_or(rest))
        .expect("README.md has no `## Run` section")
        .to_string();
    let mut lines = run
        .lines()
        .skip_while(|l| l.trim() != "| flag | environment | default |");
    assert!(
        lines.next().is_some() && lines.next().is_some_and(|l| l.starts_with("| ---")),
        "README.md's `## Run` has no `| flag | environment | default |` table"
    );
    let mut table = BTreeMap::new();
    for row in lines.take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 5, "three cells: {row}");
        let flags = code_spans(cells[1]);
        let envs = code_spans(cells[2]);
        assert!(
            !flags.is_empty() && flags.iter().all(|f| f.starts_with("--")),
            "flags in code spans: {row}"
        );
        assert_eq!(flags.len(), envs.len(), "one variable per flag: {row}");
        let defaults: Vec<Option<String>> = if cells[3].starts_with("none") {
            vec![None; flags.len()]
        } else {
            let spans = code_spans(cells[3]);
            assert!(
                cells[3].starts_with('`') && spans.len() >= flags.len(),
                "a default per flag, first in the cell, or `none`: {row}"
            );
            spans.into_iter().take(flags.len()).map(Some).collect()
        };
        for ((flag, env), default) in flags.into_iter().zip(envs).zip(defaults) {
            let doc = Doc {
                env: Some(env),
                default,
            };
            assert!(table.insert(flag, doc).is_none(), "a flag twice: {row}");
        }
    }
    (run, table)
}

#[test]
fn the_readme_settings_table_says_what_help_says() {
    let (run, table) = readme();
    let mut help = help();
    for builtin in ["--help", "--version"] {
        assert!(help.remove(builtin).is_some(), "{builtin}");
    }
    // The file of settings, not a setting: the prose above the table names it.
    assert!(help.remove("--config").is_some());
    assert!(run.contains("`--config`"), "the README names --config");

    let mut wrong = Vec::new();
    for (flag, said) in &table {
        match help.get(flag) {
            None => wrong.push(format!("README lists {flag}; --help has no such flag")),
            Some(doc) if doc != said => {
                wrong.push(format!("{flag}: README says {said:?}, --help says {doc:?}"))
            }
            Some(_) => {}
        }
    }
    for flag in help.keys().filter(|f| !table.contains_key(*f)) {
        wrong.push(format!(
            "{flag} is in --help, not in README's settings table"
        ));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert_eq!(table.len(), 29, "every setting checked");
}

/// Starts the gateway with `args` and `env` (on a port of the system's choosing, data in
/// `data_dir`), and returns the region it logs once it listens.
fn started_region(args: &[&str], env: &[(&str, &str)], data_dir: &Path) -> String {
    let mut child = gateway()
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .args(args)
        .envs(env.iter().copied())
        .env("STRATA_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (lines, read) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    let region = loop {
        match read.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) if line.contains("strata-gateway listening") => {
                break line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("region="))
                    .map(String::from);
            }
            Ok(line) => seen.push(line),
            // It exited (the sender is gone) or took too long.
            Err(_) => break None,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    region.unwrap_or_else(|| panic!("{args:?} {env:?}: no start-up line with a region: {seen:?}"))
}

#[test]
fn a_flag_beats_its_environment_variable_which_beats_the_file_which_beats_the_default() {
    let dir = std::env::temp_dir().join(format!("strata-settings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("strata.toml");
    std::fs::write(&file, "region = \"from-file\"\n").unwrap();
    let data = dir.join("data");
    let config = ["--config", file.to_str().unwrap()];
    let env = [("STRATA_REGION", "from-env")];

    let all = [&config[..], &["--region", "from-flag"]].concat();
    assert_eq!(started_region(&all, &env, &data), "from-flag");
    assert_eq!(started_region(&config, &env, &data), "from-env");
    assert_eq!(started_region(&config, &[], &data), "from-file");
    assert_eq!(started_region(&[], &[], &data), DEFAULT_REGION);
    let _ = std::fs::remove_dir_all(dir);
}
