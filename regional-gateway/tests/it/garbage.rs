//! Whatever a client sends, the gateway answers with a 2xx or a 4xx in the error shape: never
//! a 5xx, never a panic. Bodies are valid requests mutated at random (seeded, so a failure
//! replays), plus hand-picked oddities.

use crate::common;

use axum::body::Body;
use common::embedded;

const SEEDS: [&str; 6] = [
    r#"{"namespace":"api","identifier":"u","limit":5,"duration":60000,"cost":1}"#,
    r#"{"limits":[{"namespace":"a","identifier":"b","limit":1,"duration":1000}]}"#,
    r#"{"cells":[{"namespace":"a","identifier":"b","duration":1000,"sequence":5}]}"#,
    r#"{"instance":"edge-1","events":[{"namespace":"a","identifier":"b","duration":1000,"sequence":5,"used":1,"limit":3,"release":1700000000000}]}"#,
    r#"{"instance":"edge-1","limits":[{"namespace":"a","identifier":"b","limit":5,"duration":1000,"cost":1,"sequence":1700000000,"used":2,"used_previous":1,"want":3}]}"#,
    r#"{"instance":"x","limits":[]}"#,
];
const PATHS: [&str; 5] = [
    "/v1/ratelimit",
    "/v1/ratelimit/multi",
    "/v1/origin/read",
    "/v1/origin/replay",
    "/v1/origin/decide",
];
const SPICE: [&[u8]; 12] = [
    b"-1",
    b"1e309",
    b"18446744073709551616",
    b"null",
    b"\"\"",
    b"[]",
    b"{}",
    b"\xff\xfe",
    b"\\u0000",
    b"9007199254740992",
    b"\"\\ud800\"",
    b"0",
];

/// xorshift64*: a small deterministic generator.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

fn mutate(seed: &[u8], rng: &mut u64) -> Vec<u8> {
    let mut body = seed.to_vec();
    for _ in 0..(next(rng) % 4 + 1) {
        let at = (next(rng) as usize) % (body.len() + 1);
        match next(rng) % 4 {
            0 => {
                let end = (at + (next(rng) as usize) % 8).min(body.len());
                body.drain(at..end);
            }
            1 => body.insert(at, (next(rng) % 256) as u8),
            2 => {
                let spice = SPICE[(next(rng) as usize) % SPICE.len()];
                body.splice(at..at, spice.iter().copied());
            }
            _ => body.truncate(at),
        }
    }
    body
}

#[tokio::test]
async fn no_input_gets_a_server_error() {
    let g = embedded(&[]).await;
    // The seeds are valid requests as they stand (so mutations start from what the handlers
    // accept, past validation), each for the path of the same index.
    for (seed, path) in SEEDS.iter().zip(PATHS) {
        let r = g.send("POST", path, None, Body::from(*seed)).await;
        assert!(
            r.status.is_success(),
            "{path} {seed} -> {} {}",
            r.status,
            r.text
        );
    }
    let mut rng = 0x5eed_u64;
    for i in 0..3_000 {
        let path = PATHS[i % PATHS.len()];
        let body = mutate(
            SEEDS[(next(&mut rng) as usize) % SEEDS.len()].as_bytes(),
            &mut rng,
        );
        let r = g.send("POST", path, None, Body::from(body.clone())).await;
        assert!(
            r.status.is_success() || r.status.is_client_error(),
            "{path} {:?} -> {} {}",
            String::from_utf8_lossy(&body),
            r.status,
            r.text
        );
        if r.status.is_client_error() {
            assert!(r.body["error"]["message"].is_string(), "{path}: {}", r.text);
        }
    }
    // Odd methods and paths too.
    for (method, path) in [
        ("PUT", "/v1/ratelimit"),
        ("DELETE", "/metrics"),
        ("POST", "/healthz"),
        ("GET", "/../etc"),
    ] {
        let r = g.send(method, path, None, Body::empty()).await;
        assert!(
            r.status.is_client_error(),
            "{method} {path} -> {}",
            r.status
        );
    }
    // The gateway still decides normally afterwards.
    assert_eq!(g.limit(None, "after-the-storm", 1).await, (true, 0));
}
