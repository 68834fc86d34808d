//! Envoy's rate-limit service on the gateway, called over gRPC on a real socket as Envoy's
//! `ratelimit` filter calls it: limits, all-or-nothing descriptors, shadow and unlimited
//! descriptors, tokens in metadata, and bad input answered with a status that says what is
//! wrong and counts nothing.

use crate::common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::google::protobuf::UInt64Value;
use serde_json::json;
use strata_gateway::config::{RlsSettings, Settings};
use strata_gateway::rls::wire::{Entry, RateLimitDescriptor, RateLimitRequest};
use strata_gateway::rls::{RlsConfig, UnknownDomain};
use strata_gateway::{Gateway, Listeners};
use tonic::transport::Channel;

const CONFIG: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1000}
  - key: path
    value: "/health*"
    rate_limit: {unlimited: true}
  - key: plan
    value: trial
    shadow_mode: true
    rate_limit: {name: trial, unit: hour, requests_per_unit: 2}
---
domain: other
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 1}
"#;

struct Served {
    gateway: Arc<Gateway>,
    client: tonic::client::Grpc<Channel>,
    common: common::TestGateway,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn serve(tokens: &[(&str, &str)]) -> Served {
    serve_with(tokens, UnknownDomain::default()).await
}

async fn serve_with(tokens: &[(&str, &str)], unknown_domain: UnknownDomain) -> Served {
    let mut config = RlsConfig::default();
    config.add_yaml(Path::new("rls.yaml"), CONFIG).unwrap();
    let (http, rls) = (
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    );
    let address = rls.local_addr().unwrap();
    let settings = Settings {
        tokens: tokens
            .iter()
            .map(|(t, w)| (t.to_string(), w.to_string()))
            .collect::<HashMap<_, _>>(),
        rls: Some(RlsSettings {
            listen: address,
            config: Arc::new(config),
            path: None,
            unknown_domain,
            ratelimit_headers: true,
        }),
        ..Settings::default()
    };
    let common = common::with_settings(settings).await;
    let gateway = common.gateway.clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(strata_gateway::run(
        gateway.clone(),
        Listeners {
            http,
            rls: Some(rls),
        },
        async {
            let _ = stopped.await;
        },
    ));
    // The messages Envoy sends, their text fields as bytes (a value need not be UTF-8).
    let channel = Channel::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = tonic::client::Grpc::new(channel);
    Served {
        gateway,
        client,
        common,
        _stop: stop,
    }
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    let entries: Vec<_> = entries
        .iter()
        .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
        .collect();
    descriptor_bytes(&entries)
}

fn descriptor_bytes(entries: &[(&[u8], &[u8])]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_vec(),
                value: v.to_vec(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

fn call(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.as_bytes().to_vec(),
        descriptors,
        hits_addend: 0,
    }
}

impl Served {
    async fn ask(&mut self, request: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
        self.ask_with(tonic::Request::new(request)).await
    }

    async fn ask_with(
        &mut self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<RateLimitResponse, tonic::Status> {
        self.client
            .ready()
            .await
            .map_err(|e| tonic::Status::unknown(e.to_string()))?;
        let codec = tonic_prost::ProstCodec::<RateLimitRequest, RateLimitResponse>::default();
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        );
        self.client
            .unary(request, path, codec)
            .await
            .map(tonic::Response::into_inner)
    }

    async fn ok(&mut self, request: RateLimitRequest) -> RateLimitResponse {
        self.ask(request).await.unwrap()
    }
}

fn code(status: &DescriptorStatus) -> Code {
    Code::try_from(status.code).unwrap()
}

fn overall(r: &RateLimitResponse) -> Code {
    Code::try_from(r.overall_code).unwrap()
}

#[tokio::test]
async fn a_descriptor_is_limited_exactly_with_its_limit_remaining_and_reset() {
    let mut s = serve(&[]).await;
    let ip = [("remote_address", "10.0.0.1")];
    let mut seen = Vec::new();
    for _ in 0..4 {
        let r = s.ok(call("edge", vec![descriptor(&ip)])).await;
        let status = &r.statuses[0];
        let limit = status.current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit), (3, 2), "3 a minute");
        let reset = status.duration_until_reset.unwrap().seconds;
        assert!((1..=60).contains(&reset), "{reset}");
        seen.push((overall(&r), code(status), status.limit_remaining));
        // The IETF headers for Envoy to add (`--rls-ratelimit-headers`), as the HTTP API's.
        let added: Vec<(&str, &str)> = r
            .response_headers_to_add
            .iter()
            .map(|h| (h.key.as_str(), h.value.as_str()))
            .collect();
        assert_eq!(
            added[0],
            ("ratelimit-policy", "\"remote_address\";q=3;w=60")
        );
        assert_eq!(added[1].0, "ratelimit");
        let retry_after = added.iter().any(|(k, _)| *k == "retry-after");
        assert_eq!(retry_after, overall(&r) == Code::OverLimit, "{added:?}");
    }
    assert_eq!(
        seen,
        [
            (Code::Ok, Code::Ok, 2),
            (Code::Ok, Code::Ok, 1),
            (Code::Ok, Code::Ok, 0),
            (Code::OverLimit, Code::OverLimit, 0),
        ]
    );
    // Another address has a limit of its own; another domain keys the same entries apart.
    let r = s
        .ok(call(
            "edge",
            vec![descriptor(&[("remote_address", "10.0.0.2")])],
        ))
        .await;
    assert_eq!((overall(&r), r.statuses[0].limit_remaining), (Code::Ok, 2));
    let r = s.ok(call("other", vec![descriptor(&ip)])).await;
    assert_eq!((overall(&r), r.statuses[0].limit_remaining), (Code::Ok, 0));
    // The window slides: a minute on, the old counts weigh nothing.
    s.common.clock.advance(120_000);
    let r = s.ok(call("edge", vec![descriptor(&ip)])).await;
    assert_eq!((overall(&r), r.statuses[0].limit_remaining), (Code::Ok, 2));
}

#[tokio::test]
async fn descriptors_are_decided_all_or_nothing() {
    let mut s = serve(&[]).await;
    let ip = descriptor(&[("remote_address", "10.1.0.1")]);
    let tenant = descriptor(&[("tenant", "acme")]);
    for _ in 0..3 {
        let r = s.ok(call("edge", vec![ip.clone()])).await;
        assert_eq!(overall(&r), Code::Ok);
    }
    // The address is at its limit: the request is over, and the tenant is not charged.
    let r = s.ok(call("edge", vec![tenant.clone(), ip.clone()])).await;
    assert_eq!(overall(&r), Code::OverLimit);
    assert_eq!(
        (code(&r.statuses[0]), code(&r.statuses[1])),
        (Code::Ok, Code::OverLimit)
    );
    let r = s.ok(call("edge", vec![tenant])).await;
    assert_eq!(r.statuses[0].limit_remaining, 999, "only this call counted");
}

#[tokio::test]
async fn shadow_unlimited_and_unconfigured_descriptors_never_deny() {
    let mut s = serve(&[]).await;
    let trial = descriptor(&[("plan", "trial")]);
    for i in 0..5 {
        let r = s.ok(call("edge", vec![trial.clone()])).await;
        assert_eq!(overall(&r), Code::Ok, "call {i}");
        assert_eq!(code(&r.statuses[0]), Code::Ok);
        assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().name, "trial");
    }
    // Counted while the request passes: two of the hour's two were used.
    let shadow = strata_core::WindowKeyRef::new(
        "default",
        "edge",
        "plan=trial",
        strata_core::WindowDuration::from_ms(3_600_000).unwrap(),
    )
    .unwrap();
    let d = s
        .gateway
        .limiter
        .decide(strata_core::LimitRequest {
            key: shadow,
            limit: 2,
            cost: 0,
        })
        .await;
    assert_eq!(d.remaining, 0, "the shadow limit counted its passes: {d:?}");
    let metrics = s.common.get("/metrics").await.text;
    let over = common::metric_sum(&metrics, |l| {
        l.starts_with("strata_rls_shadow_over_limit_total ")
    });
    assert_eq!(
        over, 3.0,
        "three of the five calls were over the shadow limit"
    );
    let by_descriptor = |outcome: &str| {
        let series = format!(
            "strata_rls_decisions_total{{domain=\"edge\",descriptor=\"plan_trial\",outcome=\"{outcome}\"}}"
        );
        common::metric_sum(&metrics, |l| l.starts_with(&series))
    };
    assert_eq!(
        (by_descriptor("ok"), by_descriptor("shadow_over_limit")),
        (2.0, 3.0),
        "{metrics}"
    );
    let r = s
        .ok(call(
            "edge",
            vec![
                descriptor(&[("path", "/healthz")]),
                descriptor(&[("path", "/other")]),
                descriptor(&[("unknown", "x")]),
            ],
        ))
        .await;
    assert_eq!(overall(&r), Code::Ok);
    let unlimited = &r.statuses[0];
    assert_eq!(
        (
            code(unlimited),
            unlimited.limit_remaining,
            unlimited.current_limit.is_none()
        ),
        (Code::Ok, u32::MAX, true)
    );
    for free in &r.statuses[1..] {
        assert_eq!(
            (
                code(free),
                free.limit_remaining,
                free.current_limit.is_none()
            ),
            (Code::Ok, 0, true)
        );
    }
}

#[tokio::test]
async fn hits_addend_costs_per_call_and_per_descriptor() {
    let mut s = serve(&[]).await;
    let mut r = call("edge", vec![descriptor(&[("tenant", "hits")])]);
    r.hits_addend = 10;
    assert_eq!(s.ok(r).await.statuses[0].limit_remaining, 990);
    // The descriptor's own addend wins; 0 only checks.
    let mut d = descriptor(&[("tenant", "hits")]);
    d.hits_addend = Some(UInt64Value { value: 0 });
    assert_eq!(
        s.ok(call("edge", vec![d])).await.statuses[0].limit_remaining,
        990
    );
    let mut d = descriptor(&[("tenant", "hits")]);
    d.hits_addend = Some(UInt64Value { value: 991 });
    let r = s.ok(call("edge", vec![d])).await;
    assert_eq!(overall(&r), Code::OverLimit);
}

#[tokio::test]
async fn a_limit_carried_by_the_request_applies_to_its_entries() {
    let mut s = serve(&[]).await;
    let mut d = descriptor(&[("anything", "x")]);
    d.limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: 1, // SECOND
    });
    let mut seen = Vec::new();
    for _ in 0..2 {
        seen.push(overall(&s.ok(call("edge", vec![d.clone()])).await));
    }
    assert_eq!(seen, [Code::Ok, Code::OverLimit]);
}

/// No call a client can shape is answered with an error status: Envoy lets those through
/// under `failure_mode_deny: false`. A call the service cannot decide as sent is answered
/// (`OVER_LIMIT`, or per `--rls-unknown-domain`) and counts nothing.
#[tokio::test]
async fn calls_that_cannot_be_decided_are_answered_and_count_nothing() {
    let mut s = serve(&[]).await;
    let ip = [("remote_address", "10.9.9.9")];
    let huge = {
        let mut d = descriptor(&ip);
        d.hits_addend = Some(UInt64Value { value: u64::MAX });
        d
    };
    let negative = {
        let mut d = descriptor(&ip);
        d.is_negative_hits = true;
        d
    };
    let year = {
        let mut d = descriptor(&ip);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 5,
            unit: 6, // YEAR
        });
        d
    };
    let thousands: Vec<_> = (0..5_000).map(|_| descriptor(&ip)).collect();
    let mut not_utf8 = call("edge", vec![descriptor(&ip)]);
    not_utf8.domain = b"ed\xffge".to_vec();
    let cases: Vec<(&str, RateLimitRequest, Code)> = vec![
        (
            "an empty domain",
            call("", vec![descriptor(&ip)]),
            Code::OverLimit,
        ),
        (
            "an unknown domain",
            call("nope", vec![descriptor(&ip)]),
            Code::OverLimit,
        ),
        ("a domain that is not UTF-8", not_utf8, Code::OverLimit),
        (
            "no descriptor: nothing to limit",
            call("edge", vec![]),
            Code::Ok,
        ),
        (
            "5,000 descriptors",
            call("edge", thousands),
            Code::OverLimit,
        ),
        // Clamped to the largest count: more than any limit, so denied, and not counted.
        (
            "a cost over 2^53",
            call("edge", vec![descriptor(&ip), huge]),
            Code::OverLimit,
        ),
        // A refund: counts only grow, so it returns nothing.
        ("is_negative_hits", call("edge", vec![negative]), Code::Ok),
        (
            "a limit in years",
            call("edge", vec![year]),
            Code::OverLimit,
        ),
    ];
    for (case, request, want) in cases {
        let r = s
            .ask(request)
            .await
            .unwrap_or_else(|e| panic!("{case}: {e:?}"));
        assert_eq!(overall(&r), want, "{case}");
    }
    // A message over the API's 1 MiB bound is refused before it is decoded (Envoy sends no
    // header that long: its own bound is 96 KiB).
    let big = descriptor(&[("remote_address", &"x".repeat(1 << 20))]);
    let e = s.ask(call("edge", vec![big])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{e:?}");
    // Nothing was counted: the address still has its whole minute.
    let r = s.ok(call("edge", vec![descriptor(&ip)])).await;
    assert_eq!(r.statuses[0].limit_remaining, 2);
    let metrics = s.common.get("/metrics").await.text;
    let calls = |result: &str| {
        let series = format!("strata_rls_calls_total{{result=\"{result}\"}}");
        common::metric_sum(&metrics, |l| l.starts_with(&series))
    };
    assert_eq!(
        (calls("refused"), calls("ok"), calls("over_limit")),
        (5.0, 3.0, 1.0)
    );
}

#[tokio::test]
async fn an_unknown_domain_passes_with_rls_unknown_domain_ok() {
    let mut s = serve_with(&[], UnknownDomain::Ok).await;
    let r = s
        .ok(call(
            "nope",
            vec![descriptor(&[("remote_address", "1.2.3.4")])],
        ))
        .await;
    assert_eq!(overall(&r), Code::Ok);
}

/// Envoy passes a header's bytes on as they came: a value or key that is not UTF-8 is limited
/// like any other, under the `%XX` spelling the Wasm filter gives it, and a value of thousands
/// of bytes under its digest; the HTTP API sees each count under that identifier.
#[tokio::test]
async fn entries_that_are_not_utf8_or_are_long_are_limited_exactly() {
    let mut s = serve(&[]).await;
    let long = "v".repeat(3_000);
    let cases: [(&[u8], &[u8], String); 3] = [
        (
            b"remote_address",
            b"10.0.0.\xff",
            "remote_address=10.0.0.%FF".into(),
        ),
        (b"k\xc3", b"\xfe\xff", "k%C3=%FE%FF".into()),
        (
            b"remote_address",
            long.as_bytes(),
            strata_core::identity::identifier_for(format!("remote_address={long}")),
        ),
    ];
    for (key, value, identifier) in cases {
        let mut d = descriptor_bytes(&[(key, value)]);
        // 3 a minute, carried by the request: a key the configuration names or not.
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 3,
            unit: 2, // MINUTE
        });
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(overall(&s.ok(call("edge", vec![d.clone()])).await));
        }
        assert_eq!(
            seen,
            [Code::Ok, Code::Ok, Code::Ok, Code::OverLimit],
            "{identifier}"
        );
        let reply = s
            .common
            .post(
                "/v1/ratelimit",
                None,
                json!({"namespace": "edge", "identifier": identifier,
                       "limit": 3, "duration": 60_000, "cost": 0}),
            )
            .await;
        assert_eq!(reply.body["remaining"], 0, "{identifier}: {}", reply.text);
    }
}

#[tokio::test]
async fn tokens_come_as_metadata_and_keep_workspaces_apart() {
    let mut s = serve(&[("token-aaaaaaaa", "acme"), ("token-bbbbbbbb", "globex")]).await;
    let ask = |token: Option<&str>| {
        let mut r = tonic::Request::new(call(
            "edge",
            vec![descriptor(&[("remote_address", "1.1.1.1")])],
        ));
        if let Some(t) = token {
            r.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        r
    };
    for token in [None, Some("wrong-token")] {
        let e = s.ask_with(ask(token)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    }
    for _ in 0..3 {
        s.ask_with(ask(Some("token-aaaaaaaa"))).await.unwrap();
    }
    let acme = s.ask_with(ask(Some("token-aaaaaaaa"))).await.unwrap();
    let globex = s.ask_with(ask(Some("token-bbbbbbbb"))).await.unwrap();
    assert_eq!(
        (overall(&acme), overall(&globex)),
        (Code::OverLimit, Code::Ok)
    );
}

/// The service keys a descriptor as the Wasm filter's rules do (namespace: the domain): the
/// HTTP API sees the same count under `remote_address=<address>`.
#[tokio::test]
async fn a_descriptor_counts_under_the_identifier_the_wasm_rules_give_it() {
    let mut s = serve(&[]).await;
    s.ok(call(
        "edge",
        vec![descriptor(&[("remote_address", "10.7.0.1")])],
    ))
    .await;
    let reply = s
        .common
        .post(
            "/v1/ratelimit",
            None,
            json!({"namespace": "edge", "identifier": "remote_address=10.7.0.1",
                   "limit": 3, "duration": 60_000}),
        )
        .await;
    assert_eq!(reply.body["remaining"], 1, "{}", reply.text);
}

/// A configuration written for envoyproxy/ratelimit with a field Strata does not implement
/// stops the gateway process at start, naming the field.
#[test]
fn an_unsupported_field_stops_the_gateway_at_start_naming_it() {
    let path = std::env::temp_dir().join(format!("strata-rls-bad-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      replaces: [{name: other}]\n",
    )
    .unwrap();
    let out = std::process::Command::new(common::gateway_binary())
        .args(["--listen", "127.0.0.1:0", "--rls-listen", "127.0.0.1:0"])
        .arg("--rls-config")
        .arg(&path)
        .env_remove("STRATA_RLS_CONFIG")
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--rls-config") && stderr.contains("descriptors[0].rate_limit.replaces"),
        "{stderr}"
    );
}
