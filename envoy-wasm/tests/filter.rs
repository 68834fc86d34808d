//! The filter's logic natively, over a recording host double: what it dispatches, answers,
//! resumes and counts for each callback, with the gateway's answers written by hand and the
//! clock moved by hand.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use serde_json::{Value, json};
use strata_envoy::config::Config;
use strata_envoy::filter::{Verdict, Vm, apply};
use strata_envoy::host::{Host, SetError};
use strata_envoy::metrics::Metrics;
use strata_envoy::store::SWEEP_PASSES;

const NOW: u64 = 1_700_000_030_000;

/// Shared data of one `vm_id`: value and token per key.
type SharedData = Rc<RefCell<HashMap<String, (Vec<u8>, u32)>>>;

/// A local reply: status, headers, body.
type Sent = (u32, Vec<(String, String)>, String);

#[derive(Default)]
struct Fake {
    now: Cell<u64>,
    headers: RefCell<Vec<(String, Vec<u8>)>>,
    /// The request headers the filter read, in order.
    asked: RefCell<Vec<String>>,
    dispatched: RefCell<Vec<(String, Value)>>,
    refuse_dispatch: Cell<bool>,
    next_token: Cell<u32>,
    response: RefCell<(u16, Vec<u8>)>,
    sent: RefCell<Vec<Sent>>,
    resumed: Cell<u32>,
    added: RefCell<Vec<(String, String)>>,
    context: Cell<u32>,
    counters: RefCell<Vec<(String, i64)>>,
    logs: RefCell<Vec<String>>,
    /// Shared data, as Envoy keeps it for one `vm_id`: value and token per key (several
    /// doubles can hold the same map, like several VMs).
    shared: SharedData,
    random: Cell<u64>,
    /// Wake-ups of the root context asked for and not yet delivered.
    woken: Cell<u32>,
    /// Host calls made, of every kind.
    calls: Cell<u32>,
    /// Shared-data reads made.
    shared_reads: Cell<usize>,
}

impl Host for Fake {
    fn now_ms(&self) -> u64 {
        self.calls.set(self.calls.get() + 1);
        self.now.get()
    }
    fn log(&self, _: bool, message: &str) {
        self.calls.set(self.calls.get() + 1);
        self.logs.borrow_mut().push(message.to_string());
    }
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.calls.set(self.calls.get() + 1);
        self.asked.borrow_mut().push(name.to_string());
        self.headers
            .borrow()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }
    fn peer_address(&self) -> Option<String> {
        self.calls.set(self.calls.get() + 1);
        Some("192.0.2.7:51000".into())
    }
    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        body: &[u8],
        _: Duration,
    ) -> Result<u32, String> {
        self.calls.set(self.calls.get() + 1);
        if self.refuse_dispatch.get() {
            return Err("BadArgument".into());
        }
        let path = headers
            .iter()
            .find(|(k, _)| *k == ":path")
            .map(|(_, v)| (*v).to_string())
            .unwrap();
        assert_eq!(cluster, "gw");
        self.dispatched
            .borrow_mut()
            .push((path, serde_json::from_slice(body).unwrap()));
        self.next_token.set(self.next_token.get() + 1);
        Ok(self.next_token.get())
    }
    fn call_response(&self, _: usize) -> (u16, Vec<u8>) {
        self.calls.set(self.calls.get() + 1);
        self.response.borrow().clone()
    }
    fn send_response(&self, status: u32, headers: Vec<(&str, &str)>, body: &[u8]) {
        self.calls.set(self.calls.get() + 1);
        let headers = headers
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.sent
            .borrow_mut()
            .push((status, headers, String::from_utf8_lossy(body).into()));
    }
    fn resume(&self) {
        self.calls.set(self.calls.get() + 1);
        self.resumed.set(self.resumed.get() + 1);
    }
    fn add_response_header(&self, name: &str, value: &str) {
        self.calls.set(self.calls.get() + 1);
        self.added.borrow_mut().push((name.into(), value.into()));
    }
    fn set_context(&self, context_id: u32) -> bool {
        self.calls.set(self.calls.get() + 1);
        self.context.set(context_id);
        true
    }
    fn define_metric(&self, name: &str, _gauge: bool) -> Option<u32> {
        self.calls.set(self.calls.get() + 1);
        let mut c = self.counters.borrow_mut();
        c.push((name.to_string(), 0));
        u32::try_from(c.len() - 1).ok()
    }
    fn increment(&self, id: u32, by: i64) {
        self.calls.set(self.calls.get() + 1);
        self.counters.borrow_mut()[id as usize].1 += by;
    }
    fn random_u64(&self) -> u64 {
        self.calls.set(self.calls.get() + 1);
        self.random.set(self.random.get() + 1);
        self.random.get()
    }
    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.calls.set(self.calls.get() + 1);
        self.shared_reads.set(self.shared_reads.get() + 1);
        match self.shared.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.calls.set(self.calls.get() + 1);
        let mut map = self.shared.borrow_mut();
        let token = match map.get(key) {
            Some((_, current)) if cas.is_some_and(|c| c != *current) => {
                return Err(SetError::CasMismatch);
            }
            Some((_, current)) => current + 1,
            None => 1, // a missing key is written whatever the token, as Envoy does
        };
        map.insert(key.to_string(), (value.to_vec(), token));
        Ok(())
    }
    fn register_queue(&self, _: &str) -> Option<u32> {
        self.calls.set(self.calls.get() + 1);
        Some(1)
    }
    fn enqueue(&self, _: u32) -> bool {
        self.calls.set(self.calls.get() + 1);
        self.woken.set(self.woken.get() + 1);
        true
    }
    fn drain_queue(&self, _: u32) {
        self.calls.set(self.calls.get() + 1);
    }
}

impl Fake {
    /// Delivers the root context's wake-up, if one was asked for (Envoy's `on_queue_ready`).
    fn wake(&self, vm: &mut Vm) {
        if self.woken.replace(0) > 0 {
            vm.on_wake(self);
            settle(self, vm, 1);
        }
    }

    fn new() -> Self {
        let f = Self::default();
        f.now.set(NOW);
        f
    }
    fn request(&self, key: &str) {
        *self.headers.borrow_mut() = vec![
            (":method".into(), "GET".into()),
            (":path".into(), "/api/x?y=1".into()),
            (":authority".into(), "example.com:10000".into()),
            ("x-api-key".into(), key.into()),
        ];
    }
    fn counter(&self, name: &str) -> i64 {
        self.counters
            .borrow()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
            .unwrap()
    }
    /// The gateway answers `vm`'s call `token` as [`grant`](Self::grant) says, and the
    /// decisions it makes are applied.
    fn answer(&self, vm: &mut Vm, token: u32, lease: u64) {
        self.grant(lease);
        vm.on_call_response(self, token, 0);
        settle(self, vm, token);
    }

    /// The gateway passes every limit of the last decide call and lends `lease`.
    fn grant(&self, lease: u64) {
        let dispatched = self.dispatched.borrow();
        let decide = dispatched
            .iter()
            .rev()
            .find(|(p, _)| p == "/v1/origin/decide");
        let call = decide.unwrap().1.clone();
        let results: Vec<Value> = call["limits"].as_array().unwrap().iter().map(|l| {
            let limit = l["limit"].as_u64().unwrap();
            let d = l["duration"].as_u64().unwrap();
            let seq = NOW / d;
            json!({"success": true, "limit": limit, "remaining": limit - 1, "reset": (seq + 1) * d,
                "sequence": seq, "current": {"regional": 1, "global": 0},
                "previous": {"regional": 0, "global": 0}, "used": 0, "lease": lease,
                "lease_id": 3, "lease_ms": 5000})
        }).collect();
        let body = json!({"success": true, "sequence": 0, "results": results}).to_string();
        *self.response.borrow_mut() = (200, body.into_bytes());
    }
}

/// Applies the decisions the last callbacks made, as the glue does once the VM is released.
fn settle(host: &Fake, vm: &mut Vm, current: u32) {
    apply(host, vm.take_settled(), current);
}

/// A request callback with its decisions applied, and the root context woken for the calls
/// it left (as Envoy does right after).
fn request(host: &Fake, vm: &mut Vm, context: u32) -> Verdict {
    let verdict = vm.on_request(host, context);
    settle(host, vm, context);
    host.wake(vm);
    verdict
}

/// Whether a request went on: at once, or resumed once the root context settled it.
fn admitted(host: &Fake, vm: &mut Vm, context: u32) -> bool {
    let resumed = host.resumed.get();
    request(host, vm, context) == Verdict::Continue || host.resumed.get() > resumed
}

fn vm(host: &Fake, extra: &str) -> Vm {
    let config = format!(
        r#"{{"gateway_cluster": "gw", "token": "t" {extra}, "rules": [{{"name": "per-key",
            "namespace": "api", "limit": 5, "duration": "1h",
            "actions": [{{"request_headers": {{"header_name": "x-api-key", "descriptor_key": "key"}}}}]}}]}}"#
    );
    Vm::new(Config::from_json(config.as_bytes()).unwrap(), host)
}

#[test]
fn a_cold_key_pauses_for_the_gateway_then_resumes_with_headers() {
    let host = Fake::new();
    let mut vm = vm(&host, "");
    host.request("alice");
    assert_eq!(request(&host, &mut vm, 7), Verdict::Pause);
    let (path, body) = host.dispatched.borrow()[0].clone();
    assert_eq!(path, "/v1/origin/decide");
    assert_eq!(body["limits"][0]["identifier"], "key=alice");
    let instance = body["instance"].as_str().unwrap();
    assert!(
        instance.starts_with("envoy-") && instance.len() == 22,
        "{instance}"
    );
    host.answer(&mut vm, 1, 3);
    assert_eq!(host.resumed.get(), 1);
    vm.on_response(&host, 7);
    let added = host.added.borrow().clone();
    assert!(
        added
            .iter()
            .any(|(k, v)| k == "ratelimit" && v.starts_with("\"per-key\";r=4;")),
        "{added:?}"
    );
    assert_eq!(host.counter("strata.decided.origin"), 1);
    // The lease covers the next three: no call, no pause.
    for _ in 0..3 {
        assert_eq!(request(&host, &mut vm, 8), Verdict::Continue);
    }
    assert_eq!(host.dispatched.borrow().len(), 1);
    // A warm pass's counters wait for the root's tick; the gateway's pass went out at once.
    assert_eq!(host.counter("strata.decided.local"), 0);
    assert_eq!(host.counter("strata.ok"), 1);
    vm.on_tick(&host);
    assert_eq!(host.counter("strata.decided.local"), 3);
    assert_eq!(host.counter("strata.ok"), 4);
}

#[test]
fn a_warm_request_makes_a_handful_of_host_calls() {
    let host = Fake::new();
    let mut vm = vm(&host, "");
    host.request("warm");
    assert_eq!(request(&host, &mut vm, 7), Verdict::Pause);
    host.answer(&mut vm, 1, 100);
    vm.on_response(&host, 7);
    host.calls.set(0);
    assert_eq!(request(&host, &mut vm, 8), Verdict::Continue);
    vm.on_response(&host, 8);
    let calls = host.calls.get();
    println!("host calls of a warm request: {calls}");
    // The clock, the one header the rule names, the shared slot read and written back, two
    // response headers; its two counters wait for the root's tick.
    assert!(calls <= 6, "{calls} host calls");
}

#[test]
fn a_local_denial_is_one_local_reply_with_the_headers() {
    let host = Fake::new();
    let mut vm = vm(&host, r#", "failure_mode": "local""#);
    host.request("bob");
    host.refuse_dispatch.set(true); // decided from memory: 5 pass, then denials
    let passed = (0..7).filter(|c| admitted(&host, &mut vm, *c)).count();
    assert_eq!(passed, 5);
    let sent = host.sent.borrow();
    assert_eq!(sent.len(), 2, "one local reply per denied request");
    let (status, headers, body) = &sent[0];
    assert_eq!(*status, 429);
    assert!(headers.iter().any(|(k, _)| k == "retry-after"));
    assert!(
        headers
            .iter()
            .any(|(k, v)| k == "ratelimit-policy" && v == "\"per-key\";q=5;w=3600")
    );
    let body: Value = serde_json::from_str(body).unwrap();
    assert_eq!(body["error"]["code"], "rate_limited");
    assert_eq!(host.counter("strata.enforced"), 2);
    // The failed call holds calls on the key off for the retry delay: the passes meanwhile
    // are the failure mode's (no call made), the denials the local count's own.
    assert_eq!(host.counter("strata.decided.fallback"), 5);
    assert_eq!(host.counter("strata.decided.local"), 2);
    assert_eq!(host.counter("strata.origin.failures"), 1);
}

#[test]
fn error_statuses_and_nonsense_are_failures_decided_by_the_mode() {
    for (status, body) in [
        (503_u16, ""),
        (504, ""),
        (200, "{\"nope\": 1}"),
        (401, "{\"error\":{}}"),
    ] {
        let host = Fake::new();
        let mut vm = vm(&host, r#", "failure_mode": "deny""#);
        host.request("carol");
        assert_eq!(request(&host, &mut vm, 3), Verdict::Pause);
        *host.response.borrow_mut() = (status, body.as_bytes().to_vec());
        vm.on_call_response(&host, 1, body.len());
        settle(&host, &mut vm, 1);
        assert_eq!(
            host.sent.borrow().len(),
            1,
            "{status}: denied by the failure mode"
        );
        assert_eq!(host.resumed.get(), 0);
        assert_eq!(host.counter("strata.origin.failures"), 1, "{status}");
    }
}

#[test]
fn the_tick_settles_requests_whose_call_outlived_the_timeout() {
    let host = Fake::new();
    let mut vm = vm(&host, r#", "timeout_ms": 200"#);
    host.request("dave");
    assert_eq!(request(&host, &mut vm, 11), Verdict::Pause);
    host.now.set(NOW + 100);
    vm.on_tick(&host);
    settle(&host, &mut vm, 1);
    assert_eq!(host.resumed.get(), 0, "not yet");
    host.now.set(NOW + 250);
    vm.on_tick(&host);
    settle(&host, &mut vm, 1);
    assert_eq!(host.resumed.get(), 1, "decided from memory and resumed");
    assert_eq!(host.context.get(), 1, "the root context is current again");
    assert_eq!(host.counter("strata.decided.fallback"), 1);
    // The late answer changes nothing.
    host.answer(&mut vm, 1, 3);
    assert_eq!(host.resumed.get(), 1);
}

#[test]
fn accepted_cost_is_replayed_on_the_tick_and_acknowledged() {
    let host = Fake::new();
    let mut vm = vm(&host, r#", "replay_interval_ms": 100"#);
    host.request("erin");
    request(&host, &mut vm, 5);
    host.answer(&mut vm, 1, 3);
    for c in 0..3 {
        assert_eq!(request(&host, &mut vm, 20 + c), Verdict::Continue);
    }
    host.now.set(NOW + 100); // one replay interval after the cost was accepted
    vm.on_tick(&host);
    settle(&host, &mut vm, 1);
    let (path, body) = host.dispatched.borrow().last().unwrap().clone();
    assert_eq!(path, "/v1/origin/replay");
    assert_eq!(
        body["events"][0]["used"], 3,
        "cumulative local passes: {body}"
    );
    *host.response.borrow_mut() = (200, br#"{"cells":[{"regional":4,"global":0}]}"#.to_vec());
    vm.on_call_response(&host, 2, 0);
    settle(&host, &mut vm, 1);
    assert_eq!(host.counter("strata.replay.ok"), 1);
    host.now.set(NOW + 200);
    vm.on_tick(&host);
    settle(&host, &mut vm, 1);
    assert_eq!(host.dispatched.borrow().len(), 2, "nothing left to replay");
}

#[test]
fn a_bad_cost_header_gets_a_400_and_counts_nothing() {
    let host = Fake::new();
    let config = r#"{"gateway_cluster": "gw", "rules": [{"namespace": "c", "limit": 9,
        "duration": "1m", "cost": {"header": "x-cost", "max": 5},
        "actions": [{"generic_key": {"descriptor_value": "k"}}]}]}"#;
    let mut vm = Vm::new(Config::from_json(config.as_bytes()).unwrap(), &host);
    *host.headers.borrow_mut() = vec![
        (":method".into(), "GET".into()),
        ("x-cost".into(), "9".into()),
    ];
    assert_eq!(request(&host, &mut vm, 1), Verdict::Pause);
    let sent = host.sent.borrow();
    assert_eq!(sent[0].0, 400);
    assert!(sent[0].2.contains("x-cost"));
    assert!(host.dispatched.borrow().is_empty());
}

#[test]
fn only_the_named_headers_are_read_and_any_bytes_key_a_limit_of_their_own() {
    let host = Fake::new();
    let mut vm = vm(&host, "");
    for (i, value) in [
        &b"caf\xc3\xa9"[..],
        b"caf\xe9",
        b"\xff\xfe\x00",
        b"%FF\xfe\x00",
    ]
    .into_iter()
    .enumerate()
    {
        host.request("unused");
        host.headers.borrow_mut()[3].1 = value.to_vec();
        host.headers
            .borrow_mut()
            .push(("x-other".into(), b"\x80\x81 not read".to_vec()));
        host.asked.borrow_mut().clear();
        let context = u32::try_from(i).unwrap() + 10;
        assert_eq!(request(&host, &mut vm, context), Verdict::Pause);
        assert_eq!(
            *host.asked.borrow(),
            ["x-api-key"],
            "one host call, the rule's header"
        );
    }
    let identifiers: Vec<String> = host
        .dispatched
        .borrow()
        .iter()
        .map(|(_, body)| {
            body["limits"][0]["identifier"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        identifiers,
        [
            "key=café",
            "key=caf%E9",
            "key=%FF%FE\u{0}",
            "key=%25FF%FE\u{0}"
        ],
        "UTF-8 text is kept as it is; other bytes are spelled %XX, apart from a client's own `%`"
    );
}

#[test]
fn every_metric_is_defined_under_the_prefix() {
    let host = Fake::new();
    let _vm = vm(&host, r#", "stat_prefix": "edge.rl""#);
    let defined: Vec<String> = host
        .counters
        .borrow()
        .iter()
        .map(|(n, _)| n.clone())
        .collect();
    assert_eq!(defined, Metrics::names("edge.rl"));
    assert!(defined.contains(&"edge.rl.rate_limited".to_string()));
}

/// A second VM of the same Envoy: its own context, the same shared data.
fn sibling(host: &Fake) -> Fake {
    let f = Fake::new();
    f.shared.replace(HashMap::new());
    let f = Fake {
        shared: host.shared.clone(),
        ..f
    };
    f.random.set(1_000);
    f
}

#[test]
fn two_vms_share_one_limit_while_the_gateway_is_away() {
    let a_host = Fake::new();
    let mut a = vm(&a_host, r#", "failure_mode": "local""#);
    let b_host = sibling(&a_host);
    let mut b = vm(&b_host, r#", "failure_mode": "local""#);
    for host in [&a_host, &b_host] {
        host.request("frank");
        host.refuse_dispatch.set(true);
    }
    let mut passed = 0;
    for i in 0..12 {
        let (vm, host) = if i % 2 == 0 {
            (&mut a, &a_host)
        } else {
            (&mut b, &b_host)
        };
        if admitted(host, vm, 100 + i) {
            passed += 1;
        }
    }
    assert_eq!(
        passed, 5,
        "one limit for both VMs (each alone would admit 5)"
    );
    // One instance id for the Envoy: what both VMs call the gateway with.
    a_host.refuse_dispatch.set(false);
    b_host.refuse_dispatch.set(false);
    a_host.now.set(NOW + 1_000); // past the retry delay
    b_host.now.set(NOW + 1_000);
    a_host.request("grace");
    b_host.request("heidi");
    request(&a_host, &mut a, 1);
    request(&b_host, &mut b, 2);
    let ia = a_host.dispatched.borrow()[0].1["instance"].clone();
    let ib = b_host.dispatched.borrow()[0].1["instance"].clone();
    assert_eq!(ia, ib);
}

#[test]
fn a_slot_two_vms_wrote_is_replayed_by_one_of_them() {
    let a_host = Fake::new();
    let mut a = vm(&a_host, r#", "replay_interval_ms": 100"#);
    let b_host = sibling(&a_host);
    let mut b = vm(&b_host, r#", "replay_interval_ms": 100"#);
    a_host.request("ivan");
    request(&a_host, &mut a, 5);
    a_host.answer(&mut a, 1, 3);
    b_host.request("ivan");
    assert_eq!(
        request(&b_host, &mut b, 6),
        Verdict::Continue,
        "b uses a's lease"
    );
    assert!(b_host.dispatched.borrow().is_empty());
    a_host.now.set(NOW + 100);
    b_host.now.set(NOW + 100);
    a.on_tick(&a_host);
    settle(&a_host, &mut a, 1);
    b.on_tick(&b_host);
    settle(&b_host, &mut b, 1);
    let replays = |h: &Fake| {
        h.dispatched
            .borrow()
            .iter()
            .filter(|(p, _)| p == "/v1/origin/replay")
            .count()
    };
    assert_eq!(
        replays(&a_host) + replays(&b_host),
        1,
        "one VM replays: the other finds the slot claimed"
    );
    let (_, body) = a_host.dispatched.borrow().last().unwrap().clone();
    assert_eq!(
        body["events"][0]["used"], 1,
        "b's local pass, from the shared slot: {body}"
    );
}

/// Shared-data reads of one tick of `vm` at `at`.
fn reads_of_a_tick(host: &Fake, vm: &mut Vm, at: u64) -> usize {
    host.now.set(at);
    host.calls.set(0);
    let reads = host.shared_reads.get();
    vm.on_tick(host);
    settle(host, vm, 1);
    host.shared_reads.get() - reads
}

#[test]
fn a_pass_reads_the_slots_the_vm_wrote_and_a_share_of_the_rest() {
    let host = Fake::new();
    let mut vm = vm(
        &host,
        r#", "shared_slots": 5000, "replay_interval_ms": 100"#,
    );
    let idle = reads_of_a_tick(&host, &mut vm, NOW + 100);
    // The sweep lease, then 5,000 / SWEEP_PASSES slots.
    assert!(
        idle <= 1 + 5_000 / SWEEP_PASSES,
        "an idle pass read {idle} of 5,000 slots"
    );
    host.request("quinn");
    request(&host, &mut vm, 3);
    host.answer(&mut vm, 1, 3);
    assert_eq!(request(&host, &mut vm, 4), Verdict::Continue);
    reads_of_a_tick(&host, &mut vm, NOW + 200);
    let replay = host.dispatched.borrow().last().cloned().unwrap();
    assert_eq!(replay.0, "/v1/origin/replay");
    assert_eq!(
        replay.1["events"][0]["identifier"], "key=quinn",
        "{}",
        replay.1
    );
}

#[test]
fn the_sweep_replays_the_slots_of_a_vm_that_went_away() {
    let a_host = Fake::new();
    let config = r#", "shared_slots": 100, "replay_interval_ms": 100, "failure_mode": "local""#;
    let mut a = vm(&a_host, config);
    let b_host = sibling(&a_host);
    let mut b = vm(&b_host, config);
    a_host.refuse_dispatch.set(true);
    a_host.request("rita");
    assert!(admitted(&a_host, &mut a, 1), "decided from memory");
    drop(a); // its watch list goes with it; the pass stays in the slot
    let mut at = NOW;
    for _ in 0..=SWEEP_PASSES {
        at += 100;
        reads_of_a_tick(&b_host, &mut b, at);
        if !b_host.dispatched.borrow().is_empty() {
            break;
        }
    }
    let dispatched = b_host.dispatched.borrow();
    let (path, body) = dispatched.first().expect("the sweep found rita's pass");
    assert_eq!(path, "/v1/origin/replay");
    assert_eq!(body["events"][0]["identifier"], "key=rita", "{body}");
    assert_eq!(body["events"][0]["used"], 1, "{body}");
}

#[test]
fn a_slot_held_by_another_live_key_sends_the_request_to_the_vms_table() {
    let host = Fake::new();
    let mut vm = vm(&host, r#", "shared_slots": 1, "failure_mode": "local""#);
    host.refuse_dispatch.set(true);
    host.request("judy");
    assert!(admitted(&host, &mut vm, 1));
    host.request("kim"); // the one slot holds judy's unreplayed pass
    for c in 0..5 {
        assert!(admitted(&host, &mut vm, 2 + c));
    }
    assert_eq!(
        request(&host, &mut vm, 9),
        Verdict::Pause,
        "kim's limit holds in the table"
    );
}

/// A call whose shared slot went to another key while it was out, and then failed: the
/// failure mode's pass is counted in the VM's table and replayed (decided on a copy of the
/// slot, it was counted nowhere).
#[test]
fn a_failed_call_whose_slot_went_to_another_key_is_counted_and_replayed() {
    let host = Fake::new();
    let mut vm = vm(
        &host,
        r#", "shared_slots": 1, "failure_mode": "local", "replay_interval_ms": 100"#,
    );
    host.request("ann");
    assert_eq!(request(&host, &mut vm, 1), Verdict::Pause);
    host.request("bob"); // ann's slot holds nothing worth keeping yet: bob's takes it
    assert_eq!(request(&host, &mut vm, 2), Verdict::Pause);
    *host.response.borrow_mut() = (503, Vec::new());
    for token in [2, 1] {
        // bob's pass by the failure mode stays in the slot, unreplayed; then ann's call fails
        vm.on_call_response(&host, token, 0);
        settle(&host, &mut vm, token);
    }
    assert_eq!(host.resumed.get(), 2, "both passed by the failure mode");
    for at in [100, 200, 300] {
        host.now.set(NOW + at);
        vm.on_tick(&host);
        settle(&host, &mut vm, 1);
        host.wake(&mut vm);
    }
    let replayed: Vec<(String, Value)> = host
        .dispatched
        .borrow()
        .iter()
        .filter(|(path, _)| path == "/v1/origin/replay")
        .flat_map(|(_, body)| body["events"].as_array().cloned().unwrap_or_default())
        .map(|e| {
            (
                e["identifier"].as_str().unwrap_or("").to_string(),
                e["used"].clone(),
            )
        })
        .collect();
    for key in ["key=ann", "key=bob"] {
        assert!(
            replayed.iter().any(|(k, used)| k == key && *used == 1),
            "{key} replayed: {replayed:?}"
        );
    }
}

#[test]
fn a_key_in_the_vms_table_asks_for_no_lease_the_other_vms_could_not_use() {
    let host = Fake::new();
    let mut vm = vm(&host, r#", "shared_slots": 1"#);
    host.request("judy");
    assert_eq!(request(&host, &mut vm, 1), Verdict::Pause);
    host.answer(&mut vm, 1, 2);
    host.request("kim"); // the one slot holds judy's live lease
    for (context, token) in [(2, 2), (3, 3)] {
        assert_eq!(
            request(&host, &mut vm, context),
            Verdict::Pause,
            "every pass of kim's is decided at the gateway"
        );
        host.answer(&mut vm, token, 0);
    }
    let wants: Vec<u64> = host
        .dispatched
        .borrow()
        .iter()
        .filter(|(p, _)| p == "/v1/origin/decide")
        .map(|(_, body)| body["limits"][0]["want"].as_u64().unwrap())
        .collect();
    assert_eq!(
        wants,
        [5, 0, 0],
        "judy's slot asks for the limit, kim's table copy for nothing"
    );
    host.request("judy");
    assert_eq!(
        request(&host, &mut vm, 4),
        Verdict::Continue,
        "judy's lease holds"
    );
}

#[test]
fn concurrent_requests_on_a_cold_key_wait_for_one_call_and_are_all_settled() {
    let host = Fake::new();
    let mut vm = vm(&host, r#", "timeout_ms": 200"#);
    host.request("zed");
    for c in 0..8 {
        assert_eq!(request(&host, &mut vm, 30 + c), Verdict::Pause);
    }
    assert_eq!(host.dispatched.borrow().len(), 1, "one call for eight");
    assert_eq!(host.counter("strata.origin.coalesced"), 7);
    // The gateway counts one and lends four: five go on, and the count the VM now holds
    // (5 of 5) denies the other three from memory.
    host.answer(&mut vm, 1, 4);
    assert_eq!(host.resumed.get(), 5);
    assert_eq!(host.dispatched.borrow().len(), 1);
    assert_eq!(
        host.context.get(),
        1,
        "the callback's context is current again"
    );
    let sent = host.sent.borrow();
    assert_eq!(sent.len(), 3);
    assert!(sent.iter().all(|(status, _, _)| *status == 429));
}

#[test]
fn calls_are_dispatched_from_the_root_context_a_stream_wakes() {
    let host = Fake::new();
    let mut vm = vm(&host, "");
    host.request("root");
    // Envoy cancels a call with the context that made it: a stream's callback only wakes the
    // root context, which sends the call and gets its answer, whatever happens to the stream.
    assert_eq!(vm.on_request(&host, 7), Verdict::Pause);
    assert!(host.dispatched.borrow().is_empty());
    assert_eq!(host.woken.get(), 1);
    assert_eq!(vm.on_request(&host, 8), Verdict::Pause);
    assert_eq!(host.woken.get(), 1, "one wake-up for what is waiting");
    host.wake(&mut vm);
    assert_eq!(
        host.dispatched.borrow().len(),
        1,
        "one call: the second joined it"
    );
    vm.on_done(7); // the first client hangs up: its call still settles the second
    host.answer(&mut vm, 1, 3);
    assert_eq!(host.resumed.get(), 1);
}

/// The VM reports its table on the tick: entries up to `table_capacity`, the capacity, the
/// table's bytes and what was evicted, as changes to the host's stats (so Envoy sums the
/// VMs); a second tick with nothing new leaves them as they are.
#[test]
fn the_tick_reports_the_tables_size_capacity_and_evictions() {
    let host = Fake::new();
    let mut vm = vm(&host, r#", "shared_slots": 0, "table_capacity": 64"#);
    for i in 0..100 {
        host.request(&format!("key-{i}"));
        assert_eq!(request(&host, &mut vm, 10 + i), Verdict::Pause);
    }
    assert_eq!(
        host.counter("strata.table.entries"),
        0,
        "reported on the tick only"
    );
    // The second tick finds nothing new: the stats stay as the first set them.
    for _ in 0..2 {
        vm.on_tick(&host);
        assert_eq!(host.counter("strata.table.entries"), 64);
        assert_eq!(host.counter("strata.table.capacity"), 64);
        assert_eq!(host.counter("strata.table.evicted"), 36);
        assert_eq!(host.counter("strata.replay.dropped"), 0);
        let bytes = host.counter("strata.table.bytes");
        assert!(bytes > 64 * 256 && bytes <= 64 * 304, "{bytes}");
        // Natively there is no linear memory.
        assert_eq!(host.counter("strata.memory.bytes"), 0);
    }
}
