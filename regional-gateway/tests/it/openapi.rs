//! The OpenAPI description of API v1: the gateway serves exactly the one checked in as
//! `docs/openapi.json`, it states the code's own bounds, every path it names is routed, and
//! Schemathesis, generating requests from it against live gateway processes (the embedded
//! origin, and Redis), finds no 5xx, no response that breaks the description and no
//! schema-violating request accepted.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::process::GatewayProcess;
use common::redis::RedisServer;
use serde_json::Value;
use strata_core::identity::{MAX_IDENTIFIER_BYTES, MAX_NAMESPACE_BYTES};
use strata_core::window::{MAX_DURATION_MS, MIN_DURATION_MS};
use strata_core::wire::{MAX_BATCH, MAX_COUNT, MAX_INSTANCE_BYTES, MAX_MULTI_LIMITS, MAX_SEQUENCE};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Rewrites `docs/openapi.json` from the code instead of comparing: set it after changing the
/// API, then review the diff.
const WRITE: &str = "STRATA_WRITE_OPENAPI";

#[tokio::test]
async fn the_served_description_is_the_checked_in_one() {
    let g = common::embedded(&[]).await;
    let reply = g.get("/openapi.json").await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body["openapi"], "3.1.0");
    let path = repository().join("docs/openapi.json");
    if std::env::var_os(WRITE).is_some() {
        let text = serde_json::to_string_pretty(&reply.body).unwrap() + "\n";
        std::fs::write(&path, text).unwrap();
    }
    let checked_in: Value = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null);
    assert!(
        checked_in == reply.body,
        "docs/openapi.json is not what the gateway serves: rewrite it with \
         `{WRITE}=1 cargo test -p strata-gateway --test it openapi::` and review the diff"
    );
}

/// Every `$ref` in `value`, as `(where, target)`.
fn refs(value: &Value, at: &str, out: &mut Vec<(String, String)>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("$ref", Value::String(target)) => out.push((at.to_string(), target.clone())),
                    _ => refs(v, &format!("{at}/{k}"), out),
                }
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                refs(v, &format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

#[tokio::test]
async fn every_reference_in_the_description_resolves() {
    let g = common::embedded(&[]).await;
    let doc = g.get("/openapi.json").await.body;
    let mut found = Vec::new();
    refs(&doc, "", &mut found);
    assert!(found.len() > 20, "{found:?}");
    for (at, target) in found {
        let pointer = target.strip_prefix('#').unwrap_or(&target);
        assert!(
            doc.pointer(pointer).is_some(),
            "{at}: {target} resolves to nothing"
        );
    }
}

#[tokio::test]
async fn the_description_states_the_codes_bounds() {
    let g = common::embedded(&[]).await;
    let doc = g.get("/openapi.json").await.body;
    let schema = |name: &str| doc["components"]["schemas"][name]["properties"].clone();
    let limit = schema("RatelimitRequest");
    assert_eq!(limit["limit"]["maximum"], MAX_COUNT);
    assert_eq!(limit["cost"]["maximum"], MAX_COUNT);
    assert_eq!(limit["namespace"]["maxLength"], MAX_NAMESPACE_BYTES);
    assert_eq!(limit["identifier"]["maxLength"], MAX_IDENTIFIER_BYTES);
    assert_eq!(limit["duration"]["minimum"], MIN_DURATION_MS);
    assert_eq!(limit["duration"]["maximum"], MAX_DURATION_MS);
    assert_eq!(
        schema("MultiRequest")["limits"]["maxItems"],
        MAX_MULTI_LIMITS
    );
    assert_eq!(schema("ReadRequest")["cells"]["maxItems"], MAX_BATCH);
    let replay = schema("ReplayRequest");
    assert_eq!(replay["events"]["maxItems"], MAX_BATCH);
    assert_eq!(replay["instance"]["maxLength"], MAX_INSTANCE_BYTES);
    let decide = schema("DecideLimitRequest");
    for field in [
        "limit",
        "cost",
        "used",
        "used_previous",
        "decided",
        "decided_previous",
        "want",
    ] {
        assert_eq!(decide[field]["maximum"], MAX_COUNT, "{field}");
    }
    for name in ["CellRequest", "ReplayEvent", "DecideLimitRequest"] {
        assert_eq!(schema(name)["sequence"]["maximum"], MAX_SEQUENCE, "{name}");
    }
    assert_eq!(
        schema("DecideRequest")["limits"]["maxItems"],
        MAX_MULTI_LIMITS
    );
    // Every integer a client sends states its bound, so a generator that stays within the
    // description never meets a refusal it could not predict (ids: any u64).
    let mut unbounded = Vec::new();
    for (name, s) in doc["components"]["schemas"].as_object().unwrap() {
        if !(name.ends_with("Request") || name == "ReplayEvent") {
            continue;
        }
        for (field, p) in s["properties"].as_object().into_iter().flatten() {
            if p["type"] == "integer" && (p["maximum"].is_null() || p["minimum"].is_null()) {
                unbounded.push(format!("{name}.{field}"));
            }
        }
    }
    assert!(
        unbounded.is_empty(),
        "integers without bounds: {unbounded:?}"
    );
}

#[tokio::test]
async fn every_described_operation_is_routed() {
    let g = common::embedded(&[]).await;
    let doc = g.get("/openapi.json").await.body;
    let paths = doc["paths"].as_object().unwrap();
    assert!(paths.len() >= 9, "{:?}", paths.keys());
    for (path, operations) in paths {
        for method in operations.as_object().unwrap().keys() {
            let reply = g
                .send(
                    &method.to_uppercase(),
                    path,
                    None,
                    axum::body::Body::from("{}"),
                )
                .await;
            assert!(
                reply.status != 404 && reply.status != 405,
                "{method} {path}: {}",
                reply.status
            );
        }
    }
}

/// Runs Schemathesis (installed by the test command) against the gateway at `base`; the number
/// of generated cases.
fn schemathesis(base: &str, token: &str) -> u64 {
    let st = repository().join(".tools/schemathesis-venv/bin/st");
    assert!(
        st.exists(),
        "Schemathesis is not installed at {}: run ./scripts/test.sh, which installs it",
        st.display()
    );
    // Its crash cache (for `st replay <id>`) goes here, out of the repository.
    let work = std::env::temp_dir().join(format!(
        "strata-schemathesis-{}-{}",
        std::process::id(),
        base.rsplit(':').next().unwrap_or_default()
    ));
    std::fs::create_dir_all(&work).unwrap();
    let output = Command::new(&st)
        .current_dir(&work)
        .arg("--config-file")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/schemathesis.toml"))
        .args(["--no-color", "run", &format!("{base}/openapi.json")])
        .args(["--header", &format!("Authorization: Bearer {token}")])
        .args(["--seed", "1", "--generation-database", "none"])
        .output()
        .expect("run Schemathesis");
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "Schemathesis found failures against {base} (output above; replay a case with `st replay` \
         in {}); stderr: {}",
        work.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let cases = stdout
        .lines()
        .find_map(|l| l.trim().split_once(" generated"))
        .and_then(|(n, _)| n.trim().parse().ok())
        .expect("Schemathesis printed how many cases it generated");
    assert!(cases >= 100, "only {cases} cases generated");
    cases
}

const TOKEN: &str = "schemathesis-token";

#[tokio::test]
async fn schemathesis_finds_nothing_on_the_embedded_origin() {
    let http = reqwest::Client::new();
    let mut g = GatewayProcess::start(&["--tokens", &format!("{TOKEN}=acme")]);
    g.ready(&http).await;
    let cases = schemathesis(&g.base, TOKEN);
    println!("schemathesis, embedded origin: {cases} cases, no failure");
}

#[tokio::test]
async fn schemathesis_finds_nothing_on_redis() {
    let http = reqwest::Client::new();
    let redis = RedisServer::start();
    let mut g = GatewayProcess::start(&[
        "--tokens",
        &format!("{TOKEN}=acme"),
        "--redis-url",
        &redis.url(),
    ]);
    g.ready(&http).await;
    let cases = schemathesis(&g.base, TOKEN);
    println!("schemathesis, Redis origin: {cases} cases, no failure");
}
