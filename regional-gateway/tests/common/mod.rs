//! Shared test helpers: a gateway on a manual clock, driven through its router without a
//! socket, and JSON calls that return status, headers and body.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use strata_gateway::Gateway;
use strata_gateway::clock::Clock;
use strata_gateway::config::Settings;
use tower::ServiceExt;

pub mod conformance;
pub mod mariadb;
mod port;
pub mod process;
pub mod redis;
pub mod rls;
pub mod slow;

pub use port::free_port;
#[allow(unused_imports)] // each test crate uses what it needs
pub use process::{metric_sum, metrics};

use redis::{RedisCluster, RedisServer};

/// Which regional origin a gateway under test uses.
pub enum Backend {
    Memory,
    /// A private redis-server started for the test.
    Redis,
    /// A private three-node Redis Cluster started for the test.
    RedisCluster,
}

/// The built `strata-gateway` binary.
pub fn gateway_binary() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_strata-gateway"))
}

/// An identifier no earlier run used: `prefix`, this process's id and the time in ns.
pub fn fresh(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// An HTTP client for gateway processes, with a generous timeout (a test fails, never hangs).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()
        .unwrap()
}

/// 20 s into a minute, on a 1 s boundary.
pub const T0: u64 = 1_700_000_000_000;

pub struct TestGateway {
    pub gateway: Arc<Gateway>,
    pub router: Router,
    pub clock: Clock,
    /// Kept alive for the gateway's lifetime.
    pub redis: Option<RedisServer>,
    /// The same, for a cluster.
    pub cluster: Option<RedisCluster>,
}

pub async fn embedded(tokens: &[(&str, &str)]) -> TestGateway {
    gateway(Backend::Memory, tokens).await
}

pub async fn gateway(backend: Backend, tokens: &[(&str, &str)]) -> TestGateway {
    let redis = matches!(backend, Backend::Redis).then(RedisServer::start);
    let cluster = matches!(backend, Backend::RedisCluster).then(RedisCluster::start);
    let settings = Settings {
        tokens: tokens
            .iter()
            .map(|(t, w)| (t.to_string(), w.to_string()))
            .collect::<HashMap<_, _>>(),
        redis_url: redis.as_ref().map(RedisServer::url),
        redis_cluster: cluster
            .as_ref()
            .map(RedisCluster::seed_list)
            .unwrap_or_default(),
        ..Settings::default()
    };
    let mut g = with_settings(settings).await;
    g.redis = redis;
    g.cluster = cluster;
    g
}

/// A SQLite file of this gateway's own for the global table.
pub fn temp_database() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "strata-test-{}-{}.db",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    format!("sqlite://{}", path.display())
}

pub async fn with_settings(mut settings: Settings) -> TestGateway {
    if settings.database_url == Settings::default().database_url {
        settings.database_url = temp_database();
    }
    let clock = Clock::manual(T0);
    let gateway = Gateway::new(settings, clock.clone()).await.unwrap();
    let router = strata_gateway::app(gateway.clone());
    TestGateway {
        gateway,
        router,
        clock,
        redis: None,
        cluster: None,
    }
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
    pub text: String,
}

impl TestGateway {
    pub async fn send(&self, method: &str, path: &str, token: Option<&str>, body: Body) -> Reply {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json");
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let response = self
            .router
            .clone()
            .oneshot(req.body(body).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&bytes).to_string();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply {
            status,
            headers,
            body,
            text,
        }
    }

    pub async fn post(&self, path: &str, token: Option<&str>, json: Value) -> Reply {
        self.send("POST", path, token, Body::from(json.to_string()))
            .await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send("GET", path, None, Body::empty()).await
    }

    /// One `/v1/ratelimit` call: (success, remaining).
    pub async fn limit(&self, token: Option<&str>, identifier: &str, limit: u64) -> (bool, u64) {
        let r = self
            .post(
                "/v1/ratelimit",
                token,
                serde_json::json!({"namespace": "api", "identifier": identifier, "limit": limit, "duration": 60_000}),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        (
            r.body["success"].as_bool().unwrap(),
            r.body["remaining"].as_u64().unwrap(),
        )
    }
}

/// POSTs `body` as JSON to `url` (a running gateway); asserts a 200 and returns the answer.
pub async fn post_json(http: &reqwest::Client, url: String, body: &Value) -> Value {
    let r = http.post(url).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// A gateway on `redis` whose origin calls time out after `origin_timeout`.
pub async fn on_redis(redis: &RedisServer, origin_timeout: std::time::Duration) -> TestGateway {
    with_settings(Settings {
        redis_url: Some(redis.url()),
        origin_timeout,
        ..Settings::default()
    })
    .await
}
