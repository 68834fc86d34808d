//! Reading the examples out of the README: the shell blocks of its "Run" section, split into
//! commands, with what the README says each prints.

use std::io::Write;
use std::process::{Command, Stdio};

/// One code block of the "Run" section (its subsections included).
#[derive(Debug)]
pub(crate) struct Block {
    /// The nearest heading above the block.
    pub(crate) heading: String,
    /// `indented`, or the fence's language (empty when it has none).
    pub(crate) lang: String,
    pub(crate) lines: Vec<String>,
}

impl Block {
    /// `Heading (`first line` ...)`, as results name the example.
    pub(crate) fn label(&self, nth: usize) -> String {
        let mut filled = self.lines.iter().filter(|l| !l.trim().is_empty());
        let first = filled.next().map(|l| squeeze(l)).unwrap_or_default();
        let first = first.trim_end().trim_end_matches('\\').trim_end();
        let more = if filled.next().is_some() { " ..." } else { "" };
        format!("{}#{nth} (`{first}`{more})", self.heading)
    }
}

fn squeeze(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    for c in line.chars() {
        if !(c == ' ' && out.ends_with(' ')) {
            out.push(c);
        }
    }
    out
}

/// The blocks under `## Run`: 4-space indented blocks after a blank line, and fenced blocks.
pub(crate) fn blocks(readme: &str) -> Result<Vec<Block>, String> {
    let mut blocks = Vec::new();
    let (mut in_section, mut seen) = (false, false);
    let mut heading = String::new();
    let mut fence: Option<&str> = None;
    let mut open: Option<Block> = None;
    let mut blank_lines_pending = 0;
    let mut previous_blank = true;
    for raw in readme.lines() {
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        if let Some(marker) = fence {
            let trimmed = line.trim_start_matches(' ');
            let indent = line.len() - trimmed.len();
            if indent <= 3
                && trimmed.starts_with(marker)
                && trimmed.trim_end().chars().all(|c| c == '`' || c == '~')
            {
                fence = None;
                blocks.extend(open.take());
                previous_blank = false;
            } else if let Some(b) = open.as_mut() {
                b.lines.push(line.to_string());
            }
            continue;
        }
        let trimmed = line.trim_start_matches(' ');
        if line.len() - trimmed.len() <= 3
            && (trimmed.starts_with("```") || trimmed.starts_with("~~~"))
        {
            blocks.extend(open.take());
            let marker = if trimmed.starts_with("```") {
                "```"
            } else {
                "~~~"
            };
            fence = Some(marker);
            let lang = trimmed.trim_start_matches(['`', '~']).trim();
            let lang = lang.split_whitespace().next().unwrap_or("");
            if in_section {
                open = Some(Block {
                    heading: heading.clone(),
                    lang: lang.to_string(),
                    lines: Vec::new(),
                });
            }
            continue;
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if hashes > 0 && line[hashes..].starts_with([' ', '\t']) {
            blocks.extend(open.take());
            let title = line[hashes..].trim().trim_end_matches('#').trim();
            if hashes <= 2 {
                in_section = hashes == 2 && title == "Run";
                seen |= in_section;
            }
            if in_section {
                heading = title.to_string();
            }
            previous_blank = true;
            blank_lines_pending = 0;
            continue;
        }
        let indented = line
            .strip_prefix("    ")
            .or_else(|| line.strip_prefix('\t'));
        if let (true, Some(code)) = (in_section, indented)
            && (open.is_some() || previous_blank)
        {
            let block = open.get_or_insert_with(|| Block {
                heading: heading.clone(),
                lang: "indented".into(),
                lines: Vec::new(),
            });
            block
                .lines
                .extend(std::iter::repeat_n(String::new(), blank_lines_pending));
            blank_lines_pending = 0;
            block.lines.push(code.to_string());
            previous_blank = false;
            continue;
        }
        if line.trim().is_empty() {
            if open.is_some() {
                blank_lines_pending += 1;
            }
            previous_blank = true;
            continue;
        }
        blocks.extend(open.take());
        blank_lines_pending = 0;
        previous_blank = false;
    }
    blocks.extend(open.take());
    if !seen {
        return Err("no \"## Run\" section".into());
    }
    Ok(blocks)
}

/// How a command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Runs to its end; its exit status and output are checked.
    Foreground,
    /// Sent to the background by the README (`... &`).
    Background,
    /// Starts a gateway that keeps running: in the background here, polled until ready.
    Server,
}

/// One command of a block, with what the README says it prints.
#[derive(Debug, Clone)]
pub(crate) struct Step {
    pub(crate) text: String,
    pub(crate) kind: Kind,
    /// JSON answers as the README shows them (`...` for "more fields").
    pub(crate) expected: Vec<String>,
    /// Answers of the same command run again, from "next N requests: ..." in the README's prose.
    pub(crate) reruns: Vec<String>,
}

/// Splits a block into commands: a command is a line plus continuation lines until `bash -n`
/// accepts it; with `$ ` prompts only prompted lines are commands; a line starting with `{"`
/// or `[` after a command is its output; a comment holding a JSON fragment
/// (`# {"success":true,...}: prose`) is an expectation on the command before it.
pub(crate) fn steps(block: &Block) -> Result<Vec<Step>, String> {
    if !matches!(
        block.lang.as_str(),
        "indented" | "" | "sh" | "bash" | "shell" | "console" | "zsh"
    ) {
        return Err(format!(
            "a {} block: the README runner (regional-gateway/tests/readme) only runs shell blocks; teach it",
            block.lang
        ));
    }
    let prompted = block.lines.iter().any(|l| l.starts_with("$ "));
    let mut steps: Vec<Step> = Vec::new();
    let mut i = 0;
    while i < block.lines.len() {
        let line = &block.lines[i];
        i += 1;
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        if (prompted && !line.starts_with("$ ")) || (!prompted && is_output(line)) {
            let step = steps
                .last_mut()
                .ok_or_else(|| format!("output shown before any command: {line}"))?;
            step.expected.push(trimmed.to_string());
            continue;
        }
        if !prompted && trimmed.starts_with('#') {
            let comment = trimmed.trim_start_matches('#').trim();
            if comment.starts_with(['{', '[']) {
                let step = steps
                    .last_mut()
                    .ok_or_else(|| format!("expected output shown before any command: {line}"))?;
                let (fragment, prose) = split_fragment(comment)
                    .ok_or_else(|| format!("cannot read the expected output in: {line}"))?;
                step.expected.push(fragment.to_string());
                step.reruns = reruns(prose).ok_or_else(|| {
                    format!("cannot check the README's claim \"{prose}\"; teach regional-gateway/tests/readme how")
                })?;
            }
            continue;
        }
        let mut text = line.strip_prefix("$ ").unwrap_or(line).to_string();
        while (text.ends_with('\\') || !parses(&text)) && i < block.lines.len() {
            let next = &block.lines[i];
            i += 1;
            text.push('\n');
            text.push_str(if prompted {
                next.strip_prefix("> ").unwrap_or(next)
            } else {
                next
            });
        }
        if !parses(&text) {
            return Err(format!(
                "not valid shell: {}",
                text.lines().next().unwrap_or_default()
            ));
        }
        if text.contains("scripts/test.sh") {
            return Err(format!(
                "runs the test command (would recurse): {}",
                text.lines().next().unwrap_or_default()
            ));
        }
        let kind = if is_server(&text) {
            Kind::Server
        } else if is_background(&text) {
            Kind::Background
        } else {
            Kind::Foreground
        };
        steps.push(Step {
            text,
            kind,
            expected: Vec::new(),
            reruns: Vec::new(),
        });
    }
    if steps.is_empty() {
        return Err("no command in the block".into());
    }
    Ok(steps)
}

/// A line that is expected output (JSON) rather than a command.
fn is_output(line: &str) -> bool {
    let t = line.trim_start().as_bytes();
    match t {
        [b'{', b'"' | b'}', ..] => true,
        [b'[', next, ..] => matches!(
            next,
            b']' | b'"' | b'{' | b'0'..=b'9' | b't' | b'f' | b'n' | b'-'
        ),
        _ => false,
    }
}

/// Whether bash reads `text` as complete commands (a trailing backslash counts as complete).
fn parses(text: &str) -> bool {
    let Ok(mut bash) = Command::new("bash")
        .arg("-n")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    else {
        return false;
    };
    let written = bash
        .stdin
        .take()
        .is_some_and(|mut stdin| stdin.write_all(text.as_bytes()).is_ok());
    bash.wait().is_ok_and(|status| status.success()) && written
}

/// `{...}: prose` → the leading balanced fragment and the prose after it.
fn split_fragment(s: &str) -> Option<(&str, &str)> {
    let (mut depth, mut quoted, mut escaped) = (0usize, false, false);
    for (i, c) in s.char_indices() {
        if quoted {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => quoted = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => quoted = true,
            '{' | '[' => depth += 1,
            '}' | ']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    let prose = s[i + 1..].trim();
                    return Some((&s[..=i], prose.strip_prefix(':').unwrap_or(prose).trim()));
                }
            }
            _ => {}
        }
    }
    None
}

/// "next N requests: 3 left, then denied" clauses (`;`-separated) → the answers expected.
fn reruns(prose: &str) -> Option<Vec<String>> {
    let mut expected = Vec::new();
    for clause in prose.split(';') {
        let Some(at) = clause.find("next ") else {
            continue;
        };
        let rest = &clause[at + 5..];
        let Some((count, outcomes)) = rest.split_once(':') else {
            continue;
        };
        let mut words = count.split_whitespace();
        let (Some(n), Some(unit)) = (words.next(), words.next()) else {
            continue;
        };
        if !unit.starts_with("request") || words.next().is_some() {
            continue;
        }
        let n = number(n)?;
        let before = expected.len();
        for outcome in outcomes.split(',') {
            let o = outcome.trim();
            let o = o.strip_prefix("then ").unwrap_or(o);
            let o = o
                .strip_prefix("and ")
                .unwrap_or(o)
                .trim()
                .trim_end_matches('.');
            if let Some(left) = o
                .strip_suffix(" left")
                .filter(|l| l.bytes().all(|b| b.is_ascii_digit()))
            {
                expected.push(format!("{{\"success\":true,\"remaining\":{left},...}}"));
            } else if matches!(o, "denied" | "rejected" | "refused") {
                expected.push("{\"success\":false,...}".into());
            } else if matches!(o, "passes" | "passed" | "pass" | "allowed" | "admitted") {
                expected.push("{\"success\":true,...}".into());
            } else {
                return None;
            }
        }
        if expected.len() - before != n {
            return None;
        }
    }
    Some(expected)
}

fn number(word: &str) -> Option<usize> {
    const WORDS: [&str; 10] = [
        "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    ];
    WORDS
        .iter()
        .position(|w| *w == word)
        .map(|i| i + 1)
        .or_else(|| word.parse().ok())
}

/// The first two words of a command, `VAR=value` assignments skipped.
pub(crate) fn command_words(text: &str) -> (String, String) {
    let mut words = text
        .split_whitespace()
        .filter(|w| !w.split_once('=').is_some_and(|(name, _)| is_name(name)));
    (
        words.next().unwrap_or_default().into(),
        words.next().unwrap_or_default().into(),
    )
}

fn is_name(s: &str) -> bool {
    let mut b = s.bytes();
    b.next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// A command that starts a gateway and keeps running.
fn is_server(text: &str) -> bool {
    let one_off = [
        " --help",
        " --version",
        " -V",
        " migrate",
        " cleanup",
        " -h ",
    ];
    if one_off.iter().any(|f| text.contains(f)) || text.ends_with(" -h") {
        return false;
    }
    let (w1, w2) = command_words(text);
    if w1 == "cargo" && w2 == "run" {
        return text.contains("strata-gateway");
    }
    w1.ends_with("strata-gateway")
}

/// Ends with a single `&` (a trailing comment allowed).
pub(crate) fn is_background(text: &str) -> bool {
    let last = text.lines().last().unwrap_or_default();
    let code = match last.find(" #").or_else(|| last.find("\t#")) {
        Some(at) if !last[at..].contains(['"', '\'']) => &last[..at],
        _ => last,
    };
    let code = code.trim();
    code.ends_with('&') && !code.ends_with("&&")
}

/// The value of `flag` in a command (`--flag v` or `--flag=v`).
pub(crate) fn flag_value(text: &str, flag: &str) -> Option<String> {
    let mut words = text.split_whitespace();
    while let Some(w) = words.next() {
        if w == flag {
            return words.next().filter(|v| *v != "\\").map(str::to_string);
        }
        if let Some(v) = w.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            return Some(v.to_string());
        }
    }
    None
}

/// The first `value` in the default column of the settings table's row for `flag`.
pub(crate) fn table_default(readme: &str, flag: &str) -> Option<String> {
    let name = format!("`{flag}`");
    readme.lines().find_map(|line| {
        let cells: Vec<&str> = line.split('|').collect();
        let first = cells.get(1)?.trim();
        if first != name && !first.starts_with(&format!("{name},")) {
            return None;
        }
        let default = cells.get(3)?;
        let start = default.find('`')? + 1;
        let len = default[start..].find('`')?;
        Some(default[start..start + len].to_string())
    })
}

/// Seconds the command sleeps for (`sleep N`), which its deadline must allow.
pub(crate) fn sleeps(text: &str) -> u64 {
    let words: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || c == ';')
        .collect();
    words
        .windows(2)
        .filter(|w| w[0] == "sleep")
        .filter_map(|w| w[1].split('.').next()?.parse::<u64>().ok())
        .sum()
}

/// Ports a client command sends to (`localhost:N`, `127.0.0.1:N`).
pub(crate) fn client_ports(text: &str) -> Vec<u16> {
    let mut ports = Vec::new();
    for host in ["localhost:", "127.0.0.1:"] {
        for (at, _) in text.match_indices(host) {
            let digits: String = text[at + host.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            ports.extend(digits.parse::<u16>().ok());
        }
    }
    ports
}

#[cfg(test)]
mod tests {
    use super::*;

    const README: &str = "# Title\n\n    not run\n\n## Run\n\n    cargo run -p strata-gateway\n\nthen\n\n    curl -s localhost:8080/x \\\n      -d '{}'\n    {\"a\":1}\n\n### Sub\n\n```sh\nfor i in 1 2; do\n  echo {}\ndone\ncurl -s localhost:8081/y\n# {\"success\":true,...}: next two requests: 0 left, then denied\nstrata-gateway --listen 127.0.0.1:8082 &\n```\n\n## Test\n\n    ./scripts/test.sh\n";

    #[test]
    fn the_run_section_splits_into_blocks_and_commands() {
        let blocks = blocks(README).unwrap();
        assert_eq!(blocks.len(), 3, "{blocks:?}");
        assert_eq!(blocks[0].label(1), "Run#1 (`cargo run -p strata-gateway`)");
        let first = steps(&blocks[0]).unwrap();
        assert_eq!(first[0].kind, Kind::Server);
        let second = steps(&blocks[1]).unwrap();
        assert_eq!(second.len(), 1);
        assert_eq!(second[0].text, "curl -s localhost:8080/x \\\n  -d '{}'");
        assert_eq!(second[0].expected, ["{\"a\":1}"]);
        assert_eq!(blocks[2].heading, "Sub");
        let third = steps(&blocks[2]).unwrap();
        assert_eq!(third.len(), 3, "{third:?}");
        assert!(third[0].text.starts_with("for i in 1 2; do") && third[0].text.ends_with("done"));
        assert_eq!(third[1].expected, ["{\"success\":true,...}"]);
        assert_eq!(
            third[1].reruns,
            [
                "{\"success\":true,\"remaining\":0,...}",
                "{\"success\":false,...}"
            ]
        );
        assert_eq!(third[2].kind, Kind::Server);
        assert!(is_background(&third[2].text));
    }

    #[test]
    fn what_cannot_be_checked_is_an_error_not_a_pass() {
        let block = |lang: &str, text: &str| Block {
            heading: "Run".into(),
            lang: lang.into(),
            lines: text.lines().map(str::to_string).collect(),
        };
        assert!(steps(&block("toml", "a = 1")).unwrap_err().contains("toml"));
        assert!(
            steps(&block("indented", "{\"a\":1}"))
                .unwrap_err()
                .contains("before any command")
        );
        assert!(
            steps(&block(
                "indented",
                "curl x\n# {\"a\":1}: next two requests: maybe"
            ))
            .is_err()
        );
        assert!(
            steps(&block("indented", "./scripts/test.sh"))
                .unwrap_err()
                .contains("recurse")
        );
        assert!(
            steps(&block("indented", "echo 'unclosed"))
                .unwrap_err()
                .contains("not valid shell")
        );
    }

    #[test]
    fn flags_and_defaults_are_read_as_written() {
        assert_eq!(
            flag_value("x --listen 127.0.0.1:9 --data-dir=/d", "--listen").as_deref(),
            Some("127.0.0.1:9")
        );
        assert_eq!(
            flag_value("x --listen 127.0.0.1:9 --data-dir=/d", "--data-dir").as_deref(),
            Some("/d")
        );
        let table = "| flag | env | default |\n| --- | --- | --- |\n| `--listen` | `STRATA_LISTEN` | `127.0.0.1:8080`; more |\n";
        assert_eq!(
            table_default(table, "--listen").as_deref(),
            Some("127.0.0.1:8080")
        );
        assert_eq!(sleeps("a; sleep 3   # wait\nsleep 1.5"), 4);
        assert_eq!(
            client_ports("curl localhost:8081/a; curl 127.0.0.1:8082"),
            [8081, 8082]
        );
    }
}
