//! The edge end to end, every part a real process: the built bundle served by `workerd`, a
//! `strata-gateway` on a private Redis, and an upstream on loopback. Limits are enforced with
//! the right status and headers; replayed counts reach Redis and a second workerd (reaching the
//! gateway through a service binding) sees them;
//! a 20x burst across two workerd processes stays within 1.05x; shadow rules never deny; a
//! gateway stopped mid-run leaves local decisions and no error; a broken configuration gets a
//! clear 500; binding mode answers like Cloudflare's binding.

use crate::common;

use std::time::{Duration, Instant};

use common::hostile;
use common::stack::{
    RENEWING, Stack, admitted, admitted_by, assert_renewed, burst, conformance_rules, get, header,
    now_ms, paced_rule, per_key_rules, rivals_rule, stack, stack_with, steady_use,
};
use common::workerd::Workerd;
use serde_json::{Value, json};

/// The vars of a proxying edge in front of `s`.
fn edge_vars<'a>(s: &'a Stack, rules: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("STRATA_GATEWAY_URL", s.gateway()),
        ("STRATA_UPSTREAM", &s.upstream.base),
        ("STRATA_RULES", rules),
        ("STRATA_REPLAY_DELAY_MS", "20"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_is_enforced_replayed_to_redis_and_seen_by_a_second_workerd() {
    let s = stack().await;
    let rules = per_key_rules(10);
    let mut edge = Workerd::proxy(&edge_vars(&s, &rules));
    edge.ready().await;
    let alice = [("x-api-key", "alice")];
    for i in 0..15_u64 {
        let (status, h, body) = get(&s.http, &format!("{}/v1/things", edge.base), &alice).await;
        if i < 10 {
            assert_eq!(status, 200, "request {i}: {body}\n{}", edge.log());
            assert_eq!(body, "upstream ok");
            assert_eq!(
                header(&h, "ratelimit-policy"),
                Some("\"per-key\";q=10;w=86400")
            );
            let remaining = format!("\"per-key\";r={};", 9 - i);
            assert!(
                header(&h, "ratelimit").unwrap().starts_with(&remaining),
                "{h:?}"
            );
        } else {
            assert_eq!(status, 429, "request {i}");
            assert!(header(&h, "retry-after").unwrap().parse::<u64>().unwrap() >= 1);
            assert!(
                header(&h, "ratelimit")
                    .unwrap()
                    .starts_with("\"per-key\";r=0;")
            );
            assert_eq!(header(&h, "content-type"), Some("application/json"));
            let body: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(body["error"]["code"], "rate_limited");
        }
    }
    assert_eq!(s.upstream.hits(), 10, "only passes reach the upstream");
    // No x-api-key: the rule does not apply (as in Envoy), so nothing limits it.
    let (status, h, _) = get(&s.http, &format!("{}/", edge.base), &[]).await;
    assert_eq!((status, header(&h, "ratelimit")), (200, None));

    assert_eq!(
        s.settles_at("e2e", "key=alice", 10).await,
        10,
        "Redis holds every pass once"
    );

    // The second one reaches the gateway through a service binding rather than a URL.
    let vars: Vec<_> = edge_vars(&s, &rules)
        .into_iter()
        .filter(|(k, _)| *k != "STRATA_GATEWAY_URL")
        .collect();
    let address = s.gateway().trim_start_matches("http://").to_string();
    let mut second = Workerd::proxy_via_service(&vars, &address);
    second.ready().await;
    let (status, _, _) = get(&s.http, &second.base, &alice).await;
    assert_eq!(
        status, 429,
        "a second workerd process sees the first one's counts"
    );
    let (status, _, _) = get(&s.http, &second.base, &[("x-api-key", "bob")]).await;
    assert_eq!(status, 200);
}

/// The counters an edge run with `STRATA_DEBUG=true` serves at `/__strata/stats`.
async fn edge_stats(http: &reqwest::Client, edge: &Workerd) -> Value {
    let (_, _, stats) = get(http, &format!("{}/__strata/stats", edge.base), &[]).await;
    serde_json::from_str(&stats).unwrap()
}

/// Two workerd processes with `rules`, ready, with a generous call timeout: the tests that use
/// them measure the protocol, not a 2-core machine running the client, two workerd processes,
/// a debug gateway and Redis at once (a call timed out there is decided by the failure mode
/// and undone by the next). Their counters are served at `/__strata/stats`.
async fn two_edges(s: &Stack, rules: &str) -> (Workerd, Workerd) {
    let mut vars = edge_vars(s, rules);
    vars.extend([("STRATA_TIMEOUT_MS", "5000"), ("STRATA_DEBUG", "true")]);
    let mut a = Workerd::proxy(&vars);
    let mut b = Workerd::proxy(&vars);
    a.ready().await;
    b.ready().await;
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_20x_burst_across_two_workerd_processes_admits_at_most_1_05x() {
    let s = stack().await;
    let (a, b) = two_edges(&s, &per_key_rules(100)).await;
    let bases = [a.base.clone(), b.base.clone()];
    let admitted = burst(&s.http, &bases, 2_000, 32, "burst")
        .await
        .unwrap_or_else(|status| panic!("status {status}\n{}\n{}", a.log(), b.log()));
    let decides = s
        .gateway_metric("strata_origin_calls_total{op=\"decide\"")
        .await;
    println!(
        "20x burst over two workerd processes: admitted {admitted} of limit 100, \
         {decides} gateway decisions for 2000 requests"
    );
    s.assert_burst_counted(admitted).await;
}

/// The rivals row (`Stack::rivals_row`) through two workerd processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workerd_processes_over_a_limit_ask_about_once_per_freed_unit() {
    let s = stack().await;
    let (a, b) = two_edges(&s, &json!({"rules": [rivals_rule()]}).to_string()).await;
    s.rivals_row("workerd", [&a.base, &b.base]).await;
}

/// The paced row (`Stack::paced_row`) through two workerd processes: covering leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workerd_processes_paced_at_a_limit_keep_their_pace_from_covering_leases() {
    let s = stack().await;
    let (a, b) = two_edges(&s, &json!({"rules": [paced_rule()]}).to_string()).await;
    let counters = || async {
        let (x, y) = (edge_stats(&s.http, &a).await, edge_stats(&s.http, &b).await);
        let failed =
            x["origin_failures"].as_u64().unwrap() + y["origin_failures"].as_u64().unwrap();
        (failed, format!("{x} {y}"))
    };
    s.paced_row("workerd", [&a.base, &b.base], counters).await;
}

/// The quiet-holder row (`Stack::quiet_holder_row`) through two workerd processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_left_behind_by_a_quiet_workerd_process_goes_back_with_its_next_replay() {
    let s = stack().await;
    let (a, b) = two_edges(&s, &json!({"rules": [rivals_rule()]}).to_string()).await;
    s.quiet_holder_row("workerd", [&a.base, &b.base]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_rules_are_counted_and_reported_never_enforced() {
    let s = stack().await;
    let rules = json!({"rules": [{
        "name": "trial", "namespace": "shadow", "limit": 2, "duration": "1d", "shadow": true,
        "actions": [{"generic_key": {"descriptor_value": "everyone"}}]
    }]})
    .to_string();
    let mut edge = Workerd::proxy(&edge_vars(&s, &rules));
    edge.ready().await;
    for i in 0..6 {
        let (status, h, _) = get(&s.http, &edge.base, &[]).await;
        assert_eq!(status, 200, "request {i}: a shadow rule never denies");
        let shadow = header(&h, "strata-shadow").unwrap();
        if i >= 2 {
            assert!(
                shadow.starts_with("\"trial\";r=0;"),
                "request {i}: {shadow}"
            );
        }
        assert_eq!(
            header(&h, "ratelimit"),
            None,
            "shadow limits stay out of RateLimit"
        );
    }
    assert_eq!(s.upstream.hits(), 6);
    assert_eq!(s.settles_at("shadow", "generic_key=everyone", 2).await, 2);
    assert!(
        edge.log().contains("shadow rule would deny"),
        "{}",
        edge.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_stopped_mid_run_leaves_local_decisions_and_no_errors() {
    let mut s = stack().await;
    let rules = per_key_rules(20);
    let mut vars = edge_vars(&s, &rules);
    vars.extend([("STRATA_TIMEOUT_MS", "300"), ("STRATA_DEBUG", "true")]);
    let mut edge = Workerd::proxy(&vars);
    edge.ready().await;
    let key = [("x-api-key", "carol")];
    for _ in 0..5 {
        assert_eq!(get(&s.http, &edge.base, &key).await.0, 200);
    }
    s.gateway.take(); // killed
    let mut admitted = 5;
    let mut unavailable = 0;
    for i in 0..30 {
        let (status, h, body) = get(&s.http, &edge.base, &key).await;
        match status {
            200 => admitted += 1,
            429 => {}
            other => panic!("request {i}: {other} {body}\n{}", edge.log()),
        }
        unavailable += usize::from(header(&h, "strata-origin") == Some("unavailable"));
    }
    assert_eq!(admitted, 20, "one process decides exactly from memory");
    assert!(
        unavailable > 0,
        "debug mode says when the gateway is unreachable"
    );
    assert!(
        edge.log().contains("the gateway did not decide"),
        "{}",
        edge.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_configuration_answers_a_clear_500_and_bad_input_a_400() {
    let s = stack().await;
    let broken = r#"{"rules": [{"namespace": "a", "limit": "ten", "duration": "1m",
        "actions": [{"remote_address": {}}]}]}"#;
    let mut edge = Workerd::proxy(&edge_vars(&s, broken));
    edge.ready().await;
    for _ in 0..2 {
        let (status, _, body) = get(&s.http, &edge.base, &[]).await;
        assert_eq!(status, 500);
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["error"]["code"], "invalid_configuration");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("rules[0].limit"), "{message}");
    }
    assert!(
        edge.log().contains("invalid configuration"),
        "{}",
        edge.log()
    );
    assert_eq!(s.upstream.hits(), 0);

    let rules = per_key_rules(5);
    let mut vars = edge_vars(&s, &rules);
    vars.push(("STRATA_FAILURE_MODE", "sometimes"));
    let mut bad_mode = Workerd::proxy(&vars);
    bad_mode.ready().await;
    let (status, _, body) = get(&s.http, &bad_mode.base, &[]).await;
    assert_eq!(status, 500);
    assert!(body.contains("failure_mode"), "{body}");

    let costly = json!({"rules": [{
        "namespace": "cost", "limit": 100, "duration": "1h",
        "cost": {"header": "x-cost", "max": 10},
        "actions": [{"generic_key": {"descriptor_value": "all"}}]
    }]})
    .to_string();
    let mut edge = Workerd::proxy(&edge_vars(&s, &costly));
    edge.ready().await;
    let (status, _, body) = get(&s.http, &edge.base, &[("x-cost", "11")]).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("x-cost"), "{body}");
    let (status, h, _) = get(&s.http, &edge.base, &[("x-cost", "7")]).await;
    assert_eq!(status, 200);
    assert!(
        header(&h, "ratelimit")
            .unwrap()
            .starts_with("\"cost\";r=93;")
    );
}

/// The worker reads a header value out of the module only when it changed under its name:
/// two rules' policies, alternated, each reply still carries its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alternating_rules_each_answer_with_their_own_policy_and_count() {
    let s = stack().await;
    let rule = |name: &str, limit: u64| {
        json!({"name": name, "namespace": format!("alt-{name}"), "limit": limit, "duration": "1h",
            "match": {"path_prefix": format!("/{name}/")},
            "actions": [{"generic_key": {"descriptor_value": "all"}}]})
    };
    let rules = json!({"rules": [rule("a", 100), rule("bb", 20)]}).to_string();
    let mut edge = Workerd::proxy(&edge_vars(&s, &rules));
    edge.ready().await;
    let mut sent = std::collections::HashMap::new();
    for name in ["a", "bb", "a", "a", "bb", "a", "bb", "bb"] {
        let (status, h, body) = get(&s.http, &format!("{}/{name}/x", edge.base), &[]).await;
        assert_eq!(status, 200, "{body}\n{}", edge.log());
        let n: &mut u64 = sent.entry(name).or_default();
        *n += 1;
        let limit = if name == "a" { 100 } else { 20 };
        let policy = format!("\"{name}\";q={limit};w=3600");
        assert_eq!(
            header(&h, "ratelimit-policy"),
            Some(policy.as_str()),
            "{h:?}"
        );
        let remaining = format!("\"{name}\";r={};", limit - *n);
        assert!(
            header(&h, "ratelimit").unwrap().starts_with(&remaining),
            "{h:?}"
        );
    }
}

/// Four limits of `user` through the binding example (3 a minute), and the gateway's count;
/// an error describes the first answer that was not as documented.
async fn bind_four(s: &Stack, edge: &Workerd, user: &str) -> Result<(), String> {
    let url = format!("{}/login?user={user}", edge.base);
    let started = now_ms();
    for i in 0..4_u64 {
        let (status, _, body) = get(&s.http, &url, &[]).await;
        let r: Value =
            serde_json::from_str(&body).map_err(|_| format!("{body}\n{}", edge.log()))?;
        let want = if i < 3 {
            (200, true, 2 - i)
        } else {
            (429, false, 0)
        };
        let got = (
            status,
            r["success"] == true,
            r["remaining"].as_u64().unwrap_or(99),
        );
        if got != want || r["limit"] != 3 {
            return Err(format!("request {i}: {status} {r}"));
        }
        let reset = r["reset"].as_u64().unwrap_or(0);
        if reset <= started || reset > started + 60_000 {
            return Err(format!("reset {reset} is not the end of the minute"));
        }
    }
    // Binding mode counts at the gateway like proxy mode.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = s.regional_at("login", user, 60_000, started).await;
        if n == 3 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("the gateway counts {n} for {user}, not 3"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_mode_answers_like_the_cloudflare_binding() {
    let s = stack().await;
    let mut edge = Workerd::example(
        "binding.mjs",
        &[
            ("STRATA_GATEWAY_URL", s.gateway()),
            ("STRATA_REPLAY_DELAY_MS", "20"),
        ],
    );
    edge.ready().await;
    // The example's window is a minute; a run that straddles a minute's end (the sliding
    // window then counts differently) is run again, once, with a fresh key.
    for attempt in 0..2 {
        let minute = now_ms() / 60_000;
        match bind_four(&s, &edge, &format!("ann-{attempt}")).await {
            Ok(()) => break,
            Err(e) if attempt == 0 && now_ms() / 60_000 != minute => {
                println!("a minute ended mid-run ({e}); again");
            }
            Err(e) => panic!("{e}"),
        }
    }
    let (status, _, _) = get(&s.http, &format!("{}/login?user=ben", edge.base), &[]).await;
    assert_eq!(status, 200, "another key has its own limit");
}

/// A binding call the module refuses (a cost that is no whole number) throws a `RangeError`
/// naming the binding and the field, for the Worker to catch; nothing is counted, and the
/// next call goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binding_call_the_module_refuses_throws_a_range_error() {
    let s = stack().await;
    let dir = std::env::temp_dir().join(format!("strata-binding-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let main = dir.join("costly.mjs");
    std::fs::write(
        &main,
        r#"import { withLimiters } from "./worker.mjs";
export default withLimiters({ LOGIN: { namespace: "login", limit: 3, period: 60 } }, {
  async fetch(request, env) {
    const params = new URL(request.url).searchParams;
    try {
      const r = await env.LOGIN.limit({ key: params.get("user"), cost: Number(params.get("cost")) });
      return Response.json(r, { status: r.success ? 200 : 429 });
    } catch (e) {
      return Response.json({ kind: e.constructor.name, message: e.message }, { status: 400 });
    }
  },
});
"#,
    )
    .unwrap();
    let mut edge = Workerd::example_from(&main, &[("STRATA_GATEWAY_URL", s.gateway())]);
    edge.ready().await;
    let user = format!("refused-{}", now_ms());
    let url = |cost: &str| format!("{}/?user={user}&cost={cost}", edge.base);
    for cost in ["-1", "1.5", "NaN"] {
        let (status, _, body) = get(&s.http, &url(cost), &[]).await;
        assert_eq!(status, 400, "cost {cost}: {body}");
        let r: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(r["kind"], "RangeError", "cost {cost}: {body}");
        let message = r["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with("LOGIN.limit: cost must be a whole number"),
            "cost {cost}: {message}"
        );
    }
    let (status, _, body) = get(&s.http, &url("3"), &[]).await;
    assert_eq!(status, 200, "the whole limit is left: {body}");
    let r: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(r["remaining"], 0, "{body}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The failure-mode table (`common::conformance`, the same figures as the gateway's and
/// Envoy's) through workerd whose gateway URL is a port nothing listens on, or one that never
/// answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_modes_decide_as_named_while_the_gateway_is_unreachable() {
    let s = stack().await;
    let (outages, held) = common::conformance::outages().await;
    let rules = json!({"rules": conformance_rules()}).to_string();
    for ((outage, port), (mode, _)) in outages
        .iter()
        .flat_map(|o| common::conformance::TABLE.map(|row| (*o, row)))
    {
        let url = match outage {
            common::conformance::Outage::NoEndpoints => {
                format!("http://{}", common::conformance::NO_ENDPOINTS)
            }
            _ => format!("http://127.0.0.1:{port}"),
        };
        let mut vars = edge_vars(&s, &rules);
        vars.retain(|(k, _)| *k != "STRATA_GATEWAY_URL");
        vars.push(("STRATA_GATEWAY_URL", &url));
        vars.push(("STRATA_FAILURE_MODE", mode));
        vars.push(("STRATA_TIMEOUT_MS", "250"));
        let mut edge = Workerd::proxy(&vars);
        edge.ready().await;
        let (http, base) = (s.http.clone(), edge.base.clone());
        let runtime = format!("workerd, gateway {outage:?}");
        let (far_http, far_base) = (http.clone(), base.clone());
        let far = move |key: String| {
            let (http, base) = (far_http.clone(), far_base.clone());
            async move { admitted_by(&http, &base, "x-far-key", &key).await }
        };
        let send = move |key: String| {
            let (http, base) = (http.clone(), base.clone());
            async move { admitted(&http, &base, &key).await }
        };
        common::conformance::check(&runtime, mode, 250, send, far).await;
    }
    held.abort();
}

/// The conformance table's rows with the gateway up (the same as the gateway's and Envoy's):
/// eight requests at once on a cold key make one decision call; a pass ahead waits for its
/// key's replay turn (the pacing row); what the edge admitted
/// from memory while the gateway's Redis was down reaches Redis once it is back, with no
/// request to carry it (the edge's own timer sends it again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_makes_one_call_and_an_outages_passes_reach_redis_after() {
    let mut s = stack().await;
    let rules = per_key_rules(common::conformance::BURST_LIMIT);
    let mut edge = Workerd::proxy(&edge_vars(&s, &rules));
    edge.ready().await;
    let (http, base) = (s.http.clone(), edge.base.clone());
    let key = format!("burst-{}", now_ms());
    let send = move |key: String| {
        let (http, base) = (http.clone(), base.clone());
        async move { admitted(&http, &base, &key).await }
    };
    common::conformance::one_call("workerd", &key, send, || s.decide_calls()).await;
    s.pass_ahead_row("workerd", &edge.base).await;
    s.pacing_row("workerd", &edge.base).await;

    let rules = per_key_rules(common::conformance::LIMIT);
    let mut vars = edge_vars(&s, &rules);
    vars.push(("STRATA_TIMEOUT_MS", "250"));
    let mut edge = Workerd::proxy(&vars);
    edge.ready().await;
    let base = edge.base.clone();
    s.replay_row("workerd", &base).await;
}

/// The conformance table's late-answer row (the same as the gateway's and Envoy's): the
/// gateway behind a proxy that holds its answers 250 ms, eight requests at once on a cold key
/// in one isolate; those the first answer does not cover make a second call with what is left
/// of their time, and every answer comes within the timeout of its request's arrival.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_waited_on_a_late_call_answer_within_their_own_timeout() {
    use common::conformance::{LATE_DELAY, LATE_LIMIT, LATE_TIMEOUT_MS};
    let s = stack().await;
    let slow =
        common::slow::SlowProxy::start(common::upstream::port_of(s.gateway()), LATE_DELAY).await;
    let gateway = format!("http://127.0.0.1:{}", slow.port);
    let timeout = LATE_TIMEOUT_MS.to_string();
    let rules = per_key_rules(LATE_LIMIT);
    let mut vars = edge_vars(&s, &rules);
    vars.retain(|(name, _)| *name != "STRATA_GATEWAY_URL");
    vars.extend([
        ("STRATA_GATEWAY_URL", gateway.as_str()),
        ("STRATA_TIMEOUT_MS", timeout.as_str()),
    ]);
    let mut edge = Workerd::proxy(&vars);
    edge.ready().await;
    let (http, base) = (s.http.clone(), edge.base.clone());
    let key = format!("late-{}", now_ms());
    let send = move |key: String| {
        let (http, base) = (http.clone(), base.clone());
        async move { admitted(&http, &base, &key).await }
    };
    common::conformance::late_answers("workerd", &key, send, || s.decide_calls()).await;
    drop(edge);
    // The lost-answer row on the same late gateway, with a timeout under its delay.
    let timeout = common::conformance::LOST_TIMEOUT_MS.to_string();
    vars.retain(|(name, _)| *name != "STRATA_TIMEOUT_MS");
    vars.push(("STRATA_TIMEOUT_MS", timeout.as_str()));
    let mut edge = Workerd::proxy(&vars);
    edge.ready().await;
    s.lost_answer_row("workerd", &edge.base).await;
}

/// The edge in workerd against a hostile client (`common::hostile`, the same requests and
/// rules as the Envoy filter's fuzz test): no 5xx, every connection answered, and a normal
/// client right after each batch limited exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_headers_methods_and_paths_never_break_the_edge() {
    let (requests, seed) = hostile::run_settings();
    let s = stack().await;
    let rules = json!({ "rules": hostile::rules() }).to_string();
    let (source, hops) = hostile::CLIENT_ADDRESS;
    let hops = hops.to_string();
    let mut vars = edge_vars(&s, &rules);
    vars.extend([
        ("STRATA_CLIENT_ADDRESS", source),
        ("STRATA_XFF_NUM_TRUSTED_HOPS", hops.as_str()),
    ]);
    let mut edge = Workerd::proxy(&vars);
    edge.ready().await;
    let tally = hostile::run(&edge.base, requests, seed, || edge.log()).await;
    println!(
        "fuzz (workerd): statuses {:?}, closed without an answer {}",
        tally.statuses, tally.unanswered
    );
    assert_eq!(tally.unanswered, 0, "connections closed without an answer");
    assert!(
        tally.count("400 filter") > 0,
        "the edge refused no bad cost header: the rules were not read"
    );
    assert!(
        tally.count("200 upstream") * 4 >= requests as u64,
        "too few fuzz requests reached the upstream: the run tests workerd's codec, not the edge"
    );
}

/// A pass reaches the upstream as the client sent it: method, path and query, headers and
/// body (the edge hands workerd the client's request as the upstream request's init).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_reaches_the_upstream_with_its_method_path_headers_and_body() {
    let s = stack().await;
    let rules = per_key_rules(5);
    let mut edge = Workerd::proxy(&edge_vars(&s, &rules));
    edge.ready().await;
    let r = s
        .http
        .post(format!("{}/v1/things?page=2&q=a%20b", edge.base))
        .header("x-api-key", "alice")
        .header("x-trace", "t-42")
        .body("name=strata&n=1")
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let policy = r.headers().contains_key("ratelimit-policy");
    let body = r.text().await.unwrap();
    assert_eq!(
        (status, body.as_str()),
        (200, "upstream ok"),
        "{}",
        edge.log()
    );
    assert!(policy, "a pass carries its RateLimit headers");
    let seen = s.upstream.last();
    let (head, sent) = seen.split_once("\r\n\r\n").unwrap();
    assert!(
        head.starts_with("POST /v1/things?page=2&q=a%20b HTTP/1.1\r\n"),
        "{seen}"
    );
    let head = format!("{}\r\n", head.to_ascii_lowercase());
    for header in ["x-api-key: alice", "x-trace: t-42"] {
        assert!(
            head.contains(&format!("\r\n{header}\r\n")),
            "{header}: {seen}"
        );
    }
    assert_eq!(sent, "name=strata&n=1", "{seen}");
}

/// A pass goes to the configured upstream whatever its path: `//host/…` and `/\host/…` (which
/// URL parsing makes `//host/…`) once named another host for the edge to fetch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_cannot_name_another_host_to_forward_to() {
    let s = stack().await;
    let rules = per_key_rules(5);
    let mut edge = Workerd::proxy(&edge_vars(&s, &rules));
    edge.ready().await;
    let addr = edge.base.trim_start_matches("http://").to_string();
    for (i, path) in ["//elsewhere.invalid/x", "/\\elsewhere.invalid/x"]
        .iter()
        .enumerate()
    {
        let raw = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
        let (status, _) = hostile::send_raw(&addr, raw.as_bytes()).await;
        assert_eq!(status, Some(200), "{path}\n{}", edge.log());
        assert_eq!(
            s.upstream.hits(),
            i as u64 + 1,
            "{path} reached the upstream"
        );
    }
}

/// The client-address table (`common::identity`, the same rows as Envoy's): whatever a client
/// invents, each setting counts the address it names, and `none` limits no one while saying so
/// (the isolate's stats, one log line).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_address_counts_the_trusted_address_whatever_a_client_invents() {
    let s = stack().await;
    for case in &common::identity::CASES {
        let rules = common::identity::rules(case).to_string();
        let hops = case.hops.to_string();
        let mut vars = edge_vars(&s, &rules);
        vars.extend([
            ("STRATA_CLIENT_ADDRESS", case.source),
            ("STRATA_XFF_NUM_TRUSTED_HOPS", hops.as_str()),
            ("STRATA_DEBUG", "true"),
        ]);
        let mut edge = Workerd::proxy(&vars);
        edge.ready().await;
        let (http, base) = (s.http.clone(), edge.base.clone());
        common::identity::check(&s, "workerd", case, |headers| {
            let (http, url) = (http.clone(), format!("{base}/v1/things"));
            async move {
                let headers: Vec<(&str, &str)> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                get(&http, &url, &headers).await.0
            }
        })
        .await;
        let stats = edge_stats(&s.http, &edge).await;
        let unaddressed = if case.source == "none" { case.sent } else { 0 };
        assert_eq!(
            stats["requests_unaddressed"], unaddressed,
            "{case:?}: {stats}"
        );
        let noticed = edge
            .log()
            .matches("a remote_address rule did not apply")
            .count();
        assert_eq!(noticed, usize::from(unaddressed > 0), "{}", edge.log());
    }
    let mut vars = edge_vars(&s, "{\"rules\": []}");
    vars.push(("STRATA_XFF_NUM_TRUSTED_HOPS", "1"));
    let mut bad = Workerd::proxy(&vars);
    bad.ready().await;
    let (status, _, body) = get(&s.http, &bad.base, &[]).await;
    assert_eq!(status, 500, "hops without x-forwarded-for: {body}");
    assert!(body.contains("xff_num_trusted_hops"), "{body}");
}

/// A `path_prefix` limit holds for every spelling of its path (`//x`, `/%78`, `/X/../x`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_prefix_limit_holds_for_every_spelling_of_its_path() {
    let s = stack().await;
    let rules = common::paths::rules().to_string();
    let mut edge = Workerd::proxy(&edge_vars(&s, &rules));
    edge.ready().await;
    common::paths::check("workerd", edge.base.trim_start_matches("http://")).await;
}

/// Keys of 300 and 4,000 bytes limited exactly and apart; a cost that is not digits is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_any_length_are_limited_exactly_and_costs_are_digits() {
    let s = stack().await;
    let rules = common::identity::long_key_rules().to_string();
    let mut edge = Workerd::proxy(&edge_vars(&s, &rules));
    edge.ready().await;
    let (http, base) = (s.http.clone(), edge.base.clone());
    common::identity::check_long_keys_and_costs("workerd", |key, cost| {
        let (http, base) = (http.clone(), base.clone());
        async move { common::identity::get_key(&http, &base, &key, cost).await }
    })
    .await;
}

/// The memory table (`common::memory`): an isolate's table of 2,000 keys under 8,000 distinct
/// keys stays at its bound, the hot key exact, every admitted request counted at the gateway
/// or reported dropped; and a capacity out of bounds is refused naming the var.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_keys_stays_within_the_table_capacity_and_loses_no_count() {
    use common::memory::{Figures, LIMIT, TIMEOUT_MS, Tables, capacity, flood};
    let mut s = stack().await;
    let rules = per_key_rules(LIMIT);
    let (capacity, timeout) = (capacity().to_string(), TIMEOUT_MS.to_string());
    let mut vars = edge_vars(&s, &rules);
    vars.extend([
        ("STRATA_TABLE_CAPACITY", capacity.as_str()),
        ("STRATA_TIMEOUT_MS", timeout.as_str()),
        ("STRATA_DEBUG", "true"),
    ]);
    let mut edge = Workerd::proxy(&vars);
    edge.ready().await;
    let (http, stats) = (s.http.clone(), format!("{}/__strata/stats", edge.base));
    let figures = || async {
        let (_, _, stats) = get(&http, &stats, &[]).await;
        let stats: Value = serde_json::from_str(&stats).unwrap();
        let table = &stats["table"];
        Figures {
            entries: table["entries"].as_u64().unwrap(),
            capacity: table["capacity"].as_u64().unwrap(),
            evicted: table["evicted"].as_u64().unwrap(),
            replay_dropped: table["replay_dropped"].as_u64().unwrap(),
            linear_bytes: stats["memory_bytes"].as_u64().unwrap(),
            decided_origin: stats["decided"]["origin"].as_u64().unwrap(),
            origin_failures: stats["origin_failures"].as_u64().unwrap(),
        }
    };
    let tables = Tables {
        reporting: 1,
        serving: 1,
    };
    flood(&mut s, "workerd", &edge.base, tables, figures).await;

    for bad in ["10", "2000000", "lots"] {
        let mut vars = edge_vars(&s, &rules);
        vars.push(("STRATA_TABLE_CAPACITY", bad));
        let mut edge = Workerd::proxy(&vars);
        edge.ready().await;
        let (status, _, body) = get(&s.http, &edge.base, &[]).await;
        assert_eq!(status, 500, "STRATA_TABLE_CAPACITY={bad}: {body}");
        assert!(body.contains("table_capacity"), "{bad}: {body}");
    }
}

/// The renewal row ([`common::stack::steady_use`]): a key in steady use keeps its lease, so
/// over three of the gateway's 2 s lease lifetimes the edge decides it at the gateway once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_in_steady_use_is_renewed_by_the_replay_not_by_a_waiting_request() {
    let s = stack_with(&RENEWING).await;
    let rules = per_key_rules(1_000_000);
    let mut vars = edge_vars(&s, &rules);
    vars.push(("STRATA_DEBUG", "true"));
    // `deny`: no request passes ahead (a key answered by replays alone holds no lease to
    // renew), so the first is decided at the gateway, which lends the lease.
    vars.push(("STRATA_FAILURE_MODE", "deny"));
    // It may take 2 s: a call past the timeout would be denied (beside the suite's other tests
    // the first one was, 429 for a key of a million), and the row is about renewal.
    vars.push(("STRATA_TIMEOUT_MS", "2000"));
    let mut edge = Workerd::proxy(&vars);
    edge.ready().await;
    let sent = steady_use(&s, &format!("{}/items", edge.base)).await;
    let stats = edge_stats(&s.http, &edge).await;
    assert_eq!(stats["requests"], sent, "{stats}");
    assert_eq!(
        stats["decided"]["origin"], 1,
        "no request after the first waited for the gateway: {stats}"
    );
    assert_eq!(
        stats["origin_reasons"],
        json!({"cold": 1, "stale": 0, "strict": 0, "lease": 0}),
        "its one call was the cold key's, none for a lease that ran out or expired: {stats}"
    );
    assert_renewed(&s).await;
}

/// Requests whose clients hang up while they wait on a slow gateway leave nothing behind in
/// the isolate: once their calls settle, no reply waits for a request that is gone
/// (`ready`), the module holds no waiting request, no timer entry of a request that went
/// away keeps later timers from being armed (`timers`), and a fresh key is limited exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_abandoned_while_waiting_leave_nothing_behind() {
    const ABANDONED: usize = 100;
    let s = stack().await;
    let slow = common::slow::SlowProxy::start(
        common::upstream::port_of(s.gateway()),
        Duration::from_millis(500),
    )
    .await;
    let gateway = format!("http://127.0.0.1:{}", slow.port);
    let rules = per_key_rules(3);
    let mut vars = edge_vars(&s, &rules);
    vars.retain(|(name, _)| *name != "STRATA_GATEWAY_URL");
    vars.extend([
        ("STRATA_GATEWAY_URL", gateway.as_str()),
        ("STRATA_TIMEOUT_MS", "1500"),
        ("STRATA_DEBUG", "true"),
    ]);
    let mut edge = Workerd::proxy(&vars);
    edge.ready().await;
    let tag = now_ms();
    let hung = common::stack::abandoned(&edge.base, ABANDONED, tag).await;
    assert!(
        hung * 2 > ABANDONED,
        "most clients hung up before their answer: {hung}"
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    let stats = loop {
        let stats = edge_stats(&s.http, &edge).await;
        let settled = stats["waiting"] == 0 && stats["ready"] == 0;
        if settled || Instant::now() > deadline {
            break stats;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("{hung} of {ABANDONED} clients hung up while waiting; then {stats}");
    assert_eq!(
        (&stats["waiting"], &stats["ready"]),
        (&json!(0), &json!(0)),
        "{stats}\n{}",
        edge.log()
    );
    assert!(stats["timers"].as_u64().unwrap() <= 2, "{stats}");
    let key = format!("after-{tag}");
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(admitted(&s.http, &edge.base, &key).await.unwrap());
    }
    assert_eq!(got, [true, true, true, false], "{}", edge.log());
}
