//! Who a request is counted as, the same table through workerd and Envoy: each
//! `client_address` setting with a `remote_address` rule of 5 a day, requests carrying the
//! headers a client invents (a new `X-Forwarded-For` and `CF-Connecting-IP` each time) and the
//! ones the setting's trusted proxies would add; identifiers of 300 and 4,000 bytes; and cost
//! headers that are not digits.
//!
//! The runtime connects to the client over loopback, so `peer` is `127.0.0.1`. Envoy runs
//! with `use_remote_address: true` and `skip_xff_append: true`: its `source.address` is the
//! connection's and the filter reads `X-Forwarded-For` as the proxies below wrote it, as
//! workerd does.

use std::future::Future;

use serde_json::{Value, json};

use super::stack::Stack;

/// The rule's limit.
pub const LIMIT: usize = 5;

/// One row: a setting, what each request carries, and what must follow.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// `client_address` (the edge's `STRATA_CLIENT_ADDRESS`).
    pub source: &'static str,
    /// `xff_num_trusted_hops`.
    pub hops: u32,
    /// Requests sent.
    pub sent: usize,
    /// The identifiers that must hold `LIMIT` each at the gateway (the addresses counted).
    pub counted: &'static [&'static str],
    /// Admitted in all.
    pub admitted: usize,
}

/// Request `i`'s headers under `case`: invented by the client, then those its trusted proxies
/// set or append (`203.0.113.9` is the client's real address as the first proxy saw it).
pub fn headers(case: &Case, i: usize) -> Vec<(String, String)> {
    let forged = format!("6.6.6.{}", i % 250);
    let mut h = vec![("cf-connecting-ip".to_string(), format!("7.7.7.{}", i % 250))];
    let xff = match (case.source, case.hops) {
        ("cf-connecting-ip", _) => {
            // Cloudflare overwrites the header with the client's address: two clients here.
            let client = if i < case.sent / 2 {
                "203.0.113.7"
            } else {
                "203.0.113.8"
            };
            h = vec![("cf-connecting-ip".to_string(), client.to_string())];
            forged
        }
        ("x-forwarded-for", 0) => format!("{forged}, 203.0.113.9"),
        ("x-forwarded-for", _) => format!("{forged}, 203.0.113.9, 10.0.0.1"),
        _ => forged,
    };
    h.push(("x-forwarded-for".to_string(), xff));
    h
}

/// The table.
pub const CASES: [Case; 5] = [
    Case {
        source: "peer",
        hops: 0,
        sent: 12,
        counted: &["127.0.0.1"],
        admitted: LIMIT,
    },
    Case {
        source: "cf-connecting-ip",
        hops: 0,
        sent: 16,
        counted: &["203.0.113.7", "203.0.113.8"],
        admitted: 2 * LIMIT,
    },
    Case {
        source: "x-forwarded-for",
        hops: 0,
        sent: 12,
        counted: &["203.0.113.9"],
        admitted: LIMIT,
    },
    Case {
        source: "x-forwarded-for",
        hops: 1,
        sent: 12,
        counted: &["203.0.113.9"],
        admitted: LIMIT,
    },
    // No trusted source: the rule never applies (counted and logged by the shell instead).
    Case {
        source: "none",
        hops: 0,
        sent: 12,
        counted: &[],
        admitted: 12,
    },
];

/// The namespace of `case`'s rule: its own counts.
pub fn namespace(case: &Case) -> String {
    format!("ip-{}-{}", case.source, case.hops)
}

/// `{"rules": [...]}`: 5 a day per client address, in `case`'s namespace.
pub fn rules(case: &Case) -> Value {
    json!({"rules": [{"name": "per-ip", "namespace": namespace(case), "limit": LIMIT,
        "duration": "1d", "actions": [{"remote_address": {}}]}]})
}

/// Sends `case`'s requests one after another through `send` (headers → status), checks how
/// many passed and which addresses the gateway counted, and that an invented one never was.
pub async fn check<F, Fut>(s: &Stack, runtime: &str, case: &Case, send: F)
where
    F: Fn(Vec<(String, String)>) -> Fut,
    Fut: Future<Output = u16>,
{
    let mut admitted = 0;
    for i in 0..case.sent {
        match send(headers(case, i)).await {
            200 => admitted += 1,
            429 => {}
            other => panic!("{runtime} {case:?}: request {i} answered {other}"),
        }
    }
    assert_eq!(admitted, case.admitted, "{runtime} {case:?}");
    let ns = namespace(case);
    for address in case.counted {
        let id = format!("remote_address={address}");
        let n = s.settles_at(&ns, &id, LIMIT as u64).await;
        assert_eq!(n, LIMIT as u64, "{runtime} {case:?}: {id} counted {n}");
    }
    for invented in ["remote_address=6.6.6.0", "remote_address=7.7.7.0"] {
        let n = s
            .regional_at(&ns, invented, super::stack::DAY_MS, super::stack::now_ms())
            .await;
        assert_eq!(n, 0, "{runtime} {case:?}: an invented address was counted");
    }
}

/// One GET of `base` with `x-api-key: key` (and `x-cost`): (status, body).
pub async fn get_key(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    cost: Option<&str>,
) -> (u16, String) {
    let mut headers = vec![("x-api-key", key)];
    headers.extend(cost.map(|c| ("x-cost", c)));
    let (status, _, body) = super::stack::get(http, base, &headers).await;
    (status, body)
}

/// `{"rules": [...]}`: 5 a day per `x-api-key` of any length, cost from `x-cost` (at most 10).
pub fn long_key_rules() -> Value {
    json!({"rules": [{"name": "per-key", "namespace": "long", "limit": LIMIT, "duration": "1d",
        "cost": {"header": "x-cost", "max": 10},
        "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}]}]})
}

/// Keys of 300 and 4,000 bytes are limited exactly, two 4,000-byte keys that differ in their
/// last byte are counted apart, and a cost that is not digits is a 400 naming the header.
/// `send(key, cost)` → (status, body).
pub async fn check_long_keys_and_costs<F, Fut>(runtime: &str, send: F)
where
    F: Fn(String, Option<&'static str>) -> Fut,
    Fut: Future<Output = (u16, String)>,
{
    let k300 = "k".repeat(300);
    let mut a = "t".repeat(3_999);
    let mut b = a.clone();
    a.push('a');
    b.push('b');
    for (name, key) in [
        ("300 bytes", &k300),
        ("4,000 bytes", &a),
        ("4,000, last byte", &b),
    ] {
        let mut statuses = Vec::new();
        for _ in 0..LIMIT + 2 {
            statuses.push(send(key.clone(), None).await.0);
        }
        let want: Vec<u16> = [200; LIMIT].into_iter().chain([429, 429]).collect();
        assert_eq!(statuses, want, "{runtime}: a key of {name}");
    }
    for junk in ["+3", "0x3", "3.0", "1e1", "-1", "3 3"] {
        let (status, body) = send("cost-key".to_string(), Some(junk)).await;
        assert_eq!(status, 400, "{runtime}: x-cost {junk:?}: {body}");
        assert!(body.contains("x-cost"), "{runtime}: {body}");
    }
    let (status, body) = send("cost-key".to_string(), Some("3")).await;
    assert_eq!(status, 200, "{runtime}: {body}");
}
