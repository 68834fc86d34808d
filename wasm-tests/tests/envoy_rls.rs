//! Stock Envoy (no Wasm) limited by Strata: Envoy 1.40's `ratelimit` filter calling the
//! rate-limit service of two gateway processes on one private Redis, round robin. Limits hold
//! exactly across both gateways, answers carry the headers Envoy emits for them, the filter's
//! `failure_mode_deny` decides when the gateways are down, and shadow descriptors never deny.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

mod common;

use std::time::{Duration, Instant};

use common::envoy::{Envoy, Filters};
use common::process::GatewayProcess;
use common::redis::RedisServer;
use common::stack::{burst, get, header};
use common::upstream::Upstream;

const LIMIT: u64 = 20;
const REQUESTS: usize = 200;

/// envoyproxy/ratelimit's shape: `LIMIT` an hour per `key`, and a shadow limit of 1 an hour on
/// `plan: trial`.
fn rls_config(domain: &str) -> String {
    format!(
        "domain: {domain}\ndescriptors:\n  - key: key\n    rate_limit:\n      unit: hour\n      requests_per_unit: {LIMIT}\n  - key: plan\n    value: trial\n    shadow_mode: true\n    rate_limit:\n      unit: hour\n      requests_per_unit: 1\n"
    )
}

struct Rls {
    http: reqwest::Client,
    _redis: RedisServer,
    gateways: Vec<GatewayProcess>,
    rls_ports: Vec<u16>,
    domain: String,
    _config: TempFile,
}

struct TempFile(std::path::PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Two gateway processes on one private Redis, each serving the rate-limit service.
async fn gateways() -> Rls {
    let redis = RedisServer::start();
    let domain = format!("rls-{}-{}", std::process::id(), common::stack::now_ms());
    let path = std::env::temp_dir().join(format!("{domain}.yaml"));
    std::fs::write(&path, rls_config(&domain)).unwrap();
    let http = reqwest::Client::new();
    let mut gateways = Vec::new();
    let mut rls_ports = Vec::new();
    for _ in 0..2 {
        let port = common::free_port();
        let mut g = GatewayProcess::start(&[
            "--redis-url",
            &redis.url(),
            "--rls-listen",
            &format!("127.0.0.1:{port}"),
            "--rls-config",
            path.to_str().unwrap(),
        ]);
        g.ready(&http).await;
        gateways.push(g);
        rls_ports.push(port);
    }
    Rls {
        http,
        _redis: redis,
        gateways,
        rls_ports,
        domain,
        _config: TempFile(path),
    }
}

impl Rls {
    async fn envoy(&self, failure_mode_deny: bool, upstream: &Upstream) -> Envoy {
        let filters = Filters::Ratelimit {
            domain: self.domain.clone(),
            failure_mode_deny,
            rls_ports: self.rls_ports.clone(),
        };
        let mut envoy = Envoy::start_with(&filters, upstream.port(), None);
        envoy.ready(&self.http).await;
        envoy
    }
}

/// Envoy's count of successful calls to each rate-limit service host (`/clusters`).
async fn calls_per_gateway(http: &reqwest::Client, envoy: &Envoy) -> Vec<(String, u64)> {
    let text = envoy.admin_text(http, "/clusters").await;
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("strata_rls::")?;
            let (host, value) = rest.split_once("::rq_success::")?;
            Some((host.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

#[tokio::test]
async fn envoys_ratelimit_filter_limits_exactly_across_two_gateways() {
    let s = gateways().await;
    let upstream = Upstream::start().await;
    let envoy = s.envoy(false, &upstream).await;
    let bases = vec![envoy.base.clone()];
    for round in 0..3 {
        let key = format!("burst-{round}");
        let admitted = burst(&s.http, &bases, REQUESTS, 32, &key)
            .await
            .unwrap_or_else(|status| panic!("a request got {status}\n{}", envoy.log()));
        assert_eq!(admitted, LIMIT, "round {round}: exactly the limit");
    }
    let calls = calls_per_gateway(&s.http, &envoy).await;
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(
        calls.iter().all(|(_, n)| *n > 50),
        "both gateways decided: {calls:?}"
    );
    assert_eq!(
        upstream.hits(),
        3 * LIMIT,
        "only admitted requests went upstream"
    );
}

#[tokio::test]
async fn answers_carry_the_headers_envoy_emits_for_the_service() {
    let s = gateways().await;
    let upstream = Upstream::start().await;
    let envoy = s.envoy(false, &upstream).await;
    let (status, headers, _) = get(&s.http, &envoy.base, &[("x-api-key", "headers")]).await;
    assert_eq!(status, 200);
    let limit = format!("{LIMIT}, {LIMIT};w=3600");
    assert_eq!(header(&headers, "x-ratelimit-limit"), Some(limit.as_str()));
    let remaining = (LIMIT - 1).to_string();
    assert_eq!(
        header(&headers, "x-ratelimit-remaining"),
        Some(remaining.as_str())
    );
    let reset: u64 = header(&headers, "x-ratelimit-reset")
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=3600).contains(&reset), "{reset}");
    assert_eq!(header(&headers, "x-envoy-ratelimited"), None);
    for _ in 1..LIMIT {
        get(&s.http, &envoy.base, &[("x-api-key", "headers")]).await;
    }
    let (status, headers, _) = get(&s.http, &envoy.base, &[("x-api-key", "headers")]).await;
    assert_eq!(status, 429);
    assert_eq!(header(&headers, "x-envoy-ratelimited"), Some("true"));
    assert_eq!(header(&headers, "x-ratelimit-remaining"), Some("0"));
    // No x-api-key: no descriptor, so no call and no limit.
    let (status, headers, _) = get(&s.http, &envoy.base, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "x-ratelimit-limit"), None);
}

#[tokio::test]
async fn shadow_descriptors_never_deny() {
    let s = gateways().await;
    let upstream = Upstream::start().await;
    let envoy = s.envoy(false, &upstream).await;
    for i in 0..10 {
        let key = format!("shadow-{i}");
        let (status, _, body) = get(
            &s.http,
            &envoy.base,
            &[("x-api-key", &key), ("x-plan", "trial")],
        )
        .await;
        assert_eq!(status, 200, "request {i}: {body}");
    }
    let (status, _, _) = get(&s.http, &envoy.base, &[("x-plan", "trial")]).await;
    assert_eq!(status, 200);
}

/// Envoy's `failure_mode_deny`, with both gateways stopped: false lets requests through (and
/// counts `failure_mode_allowed`), true answers them with an error.
#[tokio::test]
async fn failure_mode_deny_decides_when_the_gateways_are_down() {
    let mut s = gateways().await;
    let upstream = Upstream::start().await;
    let allow = s.envoy(false, &upstream).await;
    let deny = s.envoy(true, &upstream).await;
    for envoy in [&allow, &deny] {
        let (status, _, _) = get(&s.http, &envoy.base, &[("x-api-key", "down")]).await;
        assert_eq!(status, 200, "gateways up");
    }
    for g in &mut s.gateways {
        assert_eq!(g.terminate(), Some(0));
    }
    // Poll with a deadline: Envoy notices the closed connections on its next call.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut allowed, mut denied) = (0, 0);
    while Instant::now() < deadline && (allowed < 5 || denied < 5) {
        let (a, _, _) = get(&s.http, &allow.base, &[("x-api-key", "down")]).await;
        let (d, _, _) = get(&s.http, &deny.base, &[("x-api-key", "down")]).await;
        assert_eq!(a, 200, "failure_mode_deny: false lets requests through");
        if d == 500 {
            denied += 1;
        } else {
            assert_eq!(d, 200, "before Envoy sees the gateways gone");
        }
        allowed += 1;
    }
    assert!(denied >= 5, "failure_mode_deny: true denied {denied}");
    let failed_open: u64 = allow
        .stats(&s.http, "ratelimit.failure_mode_allowed")
        .await
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert!(failed_open >= 5, "failure_mode_allowed: {failed_open}");
}
