//! The Envoy filter against clients that send whatever bytes Envoy lets through, every part a
//! real process (Envoy 1.40 running the built filter, a gateway on a private Redis, an
//! upstream): random header names and value bytes, odd methods and paths, very long and very
//! many headers, against rules that read those headers. No 5xx, no VM failure in Envoy's own
//! wasm stats, and a normal request after each batch is limited exactly. And when a VM does
//! fail (a test build traps on purpose), a request it held paused is answered within the
//! connection manager's `request_timeout`, not left hanging. The built module crosses the
//! boundary only where it must: the stream callbacks it needs, host calls and WASI.
//!
//! The requests come from `common::hostile` (its settings: `STRATA_FUZZ_REQUESTS`,
//! `STRATA_FUZZ_SEED`).

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::envoy::{Envoy, Filters, Options, faulty_filter};
use common::hostile;
use common::stack::{DAY_MS, get, stack};
use common::upstream::{Upstream, port_of};
use serde_json::json;

/// Envoy's counters of VMs made and failed, with their values (the names differ across Envoy
/// versions: every `wasm` counter that is not the filter's own).
async fn vm_stats(e: &Envoy, http: &reqwest::Client) -> BTreeMap<String, u64> {
    e.stats(http, "wasm")
        .await
        .into_iter()
        .filter(|(n, _)| !n.starts_with("wasmcustom."))
        .collect()
}

/// Envoy's counters that move when a VM fails and is made again
/// (`wasm.envoy.wasm.runtime.v8.created`, `wasm.<plugin>.vm_reload_success`, ...).
fn failures(stats: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    stats
        .iter()
        .filter(|(n, _)| n.ends_with(".created") || n.contains("vm_reload") || n.contains("fail"))
        .map(|(n, v)| (n.clone(), *v))
        .collect()
}

/// Waits until the worker serves again, once Envoy has rebuilt a VM that failed (a request no
/// rule applies to); 15 s at most.
async fn serves_again(e: &Envoy, http: &reqwest::Client) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, _, _) = get(http, &e.base, &[]).await;
        if status == 200 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still {status} 15 s after the VM failed\n{}",
            e.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_headers_methods_and_paths_never_break_the_filter() {
    let (requests, seed) = hostile::run_settings();
    let s = stack().await;
    let (source, hops) = hostile::CLIENT_ADDRESS;
    let config = json!({"gateway_cluster": "strata_gateway", "region": "fuzz",
        "timeout_ms": 5000, "client_address": source, "xff_num_trusted_hops": hops,
        "rules": hostile::rules()});
    let mut e = Envoy::start(
        &config.to_string(),
        s.upstream.port(),
        Some(port_of(s.gateway())),
    );
    e.ready(&s.http).await;
    let before = vm_stats(&e, &s.http).await;
    assert!(
        !failures(&before).is_empty(),
        "Envoy shows no VM counters: {before:?}"
    );

    let tally = hostile::run(&e.base, requests, seed, || e.log()).await;
    let after = vm_stats(&e, &s.http).await;
    let stats = e.filter_stats(&s.http).await;
    let (passed, limited) = (stats.get("strata.ok"), stats.get("strata.rate_limited"));
    println!(
        "fuzz: statuses {:?}, closed without an answer {}, filter passed {passed} and limited \
         {limited}; VM counters {:?}",
        tally.statuses,
        tally.unanswered,
        failures(&after)
    );
    assert_eq!(
        failures(&before),
        failures(&after),
        "a VM failed or was rebuilt\n{}",
        e.log()
    );
    assert!(
        !e.log().contains("panicked") && !e.log().contains("Wasm VM failed"),
        "{}",
        e.log()
    );
    assert_eq!(tally.unanswered, 0, "connections closed without an answer");
    let ok = tally.count("200 upstream");
    assert!(
        tally.count("400 filter") > 0,
        "the filter refused no bad cost header: the rules were not read"
    );
    assert!(
        ok * 4 >= requests as u64,
        "too few fuzz requests reached the upstream ({ok}): the run tests Envoy's codec, not \
         the filter"
    );
    assert!(passed >= ok, "the filter saw every pass: {passed} of {ok}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_paused_when_its_vm_fails_is_answered_within_the_request_timeout() {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let upstream = Upstream::start().await;
    // A gateway that accepts and never answers: the request stays paused on its call.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway_port = silent.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicU64::new(0));
    let seen = accepted.clone();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            open.push(socket);
        }
    });
    // The filter's own timeout far away, so only Envoy's request_timeout can answer.
    let config = json!({"gateway_cluster": "strata_gateway", "timeout_ms": 60_000,
        "rules": [{"name": "per-key", "namespace": "e2e", "limit": 5, "duration": "1d",
            "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}]}]});
    let options = Options {
        concurrency: 1,
        wasm: faulty_filter(),
        request_timeout_ms: 2_000,
        ..Options::default()
    };
    let mut e = Envoy::start_opts(
        &Filters::Strata(config.to_string()),
        &options,
        upstream.port(),
        Some(gateway_port),
    );
    e.ready(&http).await;
    let before = failures(&vm_stats(&e, &http).await);

    let started = Instant::now();
    let (client, base) = (http.clone(), e.base.clone());
    let paused = tokio::spawn(async move {
        let (status, _, body) = get(&client, &base, &[("x-api-key", "stranded")]).await;
        (status, body)
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while accepted.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "no gateway call\n{}", e.log());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!paused.is_finished(), "the request waits on the gateway");

    let trap = get(&http, &e.base, &[("x-strata-fault", "trap")]).await.0;
    let (status, body) = paused.await.unwrap();
    let took = started.elapsed();
    println!(
        "VM trapped: the trapping request got {trap}; the paused one {status} {body:?} after \
         {took:?}"
    );
    assert!(status >= 400, "answered by Envoy, not passed: {status}");
    assert!(
        took < Duration::from_millis(2_000 + 1_500),
        "answered after {took:?}\n{}",
        e.log()
    );
    serves_again(&e, &http).await;
    let after = failures(&vm_stats(&e, &http).await);
    println!("VM counters {before:?} -> {after:?}");
    assert_ne!(before, after, "Envoy counts the failed VM\n{}", e.log());
    held.abort();
}

/// What a VM admitted from its lease and had not replayed when it failed reaches the gateway:
/// the VM's list of the slots it wrote goes with it, and the sweep (one VM at a time reads a
/// share of all the slots each pass) finds the counts in shared data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_failed_vm_admitted_from_its_lease_reaches_the_gateway() {
    let s = stack().await;
    // Four slots and a 500 ms interval: the sweep reads every slot within four passes, once
    // the failed VM's hold on it (three intervals) has run out.
    let config = json!({"gateway_cluster": "strata_gateway", "region": "fault",
        "shared_slots": 4, "replay_interval_ms": 500,
        "rules": [{"name": "per-key", "namespace": "e2e", "limit": 1000, "duration": "1d",
            "actions": [{"request_headers": {"header_name": "x-api-key", "descriptor_key": "key"}}]}]});
    let options = Options {
        concurrency: 1,
        wasm: faulty_filter(),
        ..Options::default()
    };
    let mut e = Envoy::start_opts(
        &Filters::Strata(config.to_string()),
        &options,
        s.upstream.port(),
        Some(port_of(s.gateway())),
    );
    e.ready(&s.http).await;
    // The first request is decided at the gateway (counted there) and brings a lease; the
    // next four pass from it. A replay pass may fall between them and the trap: then the
    // counts are already there and another key tries again.
    let mut trapped = None;
    for attempt in 0..5 {
        let key = format!("failed-vm-{}-{attempt}", std::process::id());
        for _ in 0..5 {
            assert_eq!(get(&s.http, &e.base, &[("x-api-key", &key)]).await.0, 200);
        }
        let identifier = format!("key={key}");
        if s.regional_at("e2e", &identifier, DAY_MS, common::stack::now_ms())
            .await
            < 5
        {
            let _ = get(&s.http, &e.base, &[("x-strata-fault", "trap")]).await;
            trapped = Some(identifier);
            break;
        }
    }
    let identifier = trapped.expect("five tries, and every time the VM replayed before the trap");
    serves_again(&e, &s.http).await;
    let counted = s.settles_at("e2e", &identifier, 5).await;
    assert_eq!(
        counted,
        5,
        "the gateway holds the failed VM's local passes\n{}",
        e.log()
    );
}

/// The names a module imports (`module.name`) and exports, read from its import and export
/// sections.
fn boundary(wasm: &[u8]) -> (Vec<String>, Vec<String>) {
    fn leb(b: &[u8], i: &mut usize) -> usize {
        let (mut n, mut shift) = (0_usize, 0);
        loop {
            let byte = b[*i];
            *i += 1;
            n |= usize::from(byte & 0x7f) << shift;
            shift += 7;
            if byte < 0x80 {
                return n;
            }
        }
    }
    fn name(b: &[u8], i: &mut usize) -> String {
        let len = leb(b, i);
        *i += len;
        String::from_utf8(b[*i - len..*i].to_vec()).unwrap()
    }
    let (mut imports, mut exports) = (Vec::new(), Vec::new());
    let mut i = 8; // magic and version
    while i < wasm.len() {
        let id = wasm[i];
        i += 1;
        let size = leb(wasm, &mut i);
        let (mut j, end) = (i, i + size);
        match id {
            2 => {
                for _ in 0..leb(wasm, &mut j) {
                    let module = name(wasm, &mut j);
                    let field = name(wasm, &mut j);
                    assert_eq!(wasm[j], 0, "{module}.{field}: only functions are imported");
                    j += 1;
                    leb(wasm, &mut j);
                    imports.push(format!("{module}.{field}"));
                }
            }
            7 => {
                for _ in 0..leb(wasm, &mut j) {
                    exports.push(name(wasm, &mut j));
                    j += 1;
                    leb(wasm, &mut j);
                }
            }
            _ => {}
        }
        i = end;
    }
    (imports, exports)
}

/// Envoy enters a filter for every stream callback it exports, and each entry crosses V8's C
/// API: the module exports the four a stream needs and no SDK's others (`proxy_on_log`,
/// `proxy_on_done`, the body and trailer callbacks), and imports only host calls and WASI.
#[test]
fn the_module_exports_the_callbacks_it_needs_and_imports_only_the_abi() {
    for wasm in [common::envoy::filter(), faulty_filter()] {
        let (imports, exports) = boundary(&std::fs::read(&wasm).unwrap());
        let mut stream: Vec<&str> = exports
            .iter()
            .map(String::as_str)
            .filter(|e| {
                e.starts_with("proxy_on_")
                    && ![
                        "proxy_on_memory_allocate",
                        "proxy_on_vm_start",
                        "proxy_on_configure",
                        "proxy_on_tick",
                        "proxy_on_queue_ready",
                        "proxy_on_http_call_response",
                    ]
                    .contains(e)
            })
            .collect();
        stream.sort_unstable();
        assert_eq!(
            stream,
            [
                "proxy_on_context_create",
                "proxy_on_delete",
                "proxy_on_request_headers",
                "proxy_on_response_headers"
            ],
            "{}",
            wasm.display()
        );
        let foreign: Vec<&String> = imports
            .iter()
            .filter(|i| !i.starts_with("env.proxy_") && !i.starts_with("wasi_snapshot_preview1."))
            .collect();
        assert!(foreign.is_empty(), "{foreign:?}");
    }
}
