//! The filter's own work for a warm request, natively over a host that answers at once: the
//! request callback (the named header read, the rules, the shared slot read, stepped and
//! written back, the decision) and the response callback (the rate-limit headers), the part
//! of a request's cost in Envoy that is the filter's code rather than V8's and Envoy's
//! plumbing. Run: `cargo bench -p strata-envoy --bench warm_request`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench code: a panic is the report

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use strata_envoy::config::Config;
use strata_envoy::filter::{Verdict, Vm, apply};
use strata_envoy::host::{Host, SetError};

const NOW: u64 = 1_700_000_030_000;

/// A host whose calls cost what a map lookup costs: shared data in a map, one request's
/// headers, every other call a no-op.
#[derive(Default)]
struct Quick {
    shared: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    key: Vec<u8>,
    answer: RefCell<Vec<u8>>,
    random: Cell<u64>,
}

impl Host for Quick {
    fn now_ms(&self) -> u64 {
        NOW
    }
    fn log(&self, _: bool, _: &str) {}
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        (name == "x-api-key").then(|| self.key.clone())
    }
    fn peer_address(&self) -> Option<String> {
        None
    }
    fn dispatch(
        &self,
        _: &str,
        _: Vec<(&str, &str)>,
        _: &[u8],
        _: Duration,
    ) -> Result<u32, String> {
        Ok(1)
    }
    fn call_response(&self, _: usize) -> (u16, Vec<u8>) {
        (200, self.answer.borrow().clone())
    }
    fn send_response(&self, _: u32, _: Vec<(&str, &str)>, _: &[u8]) {}
    fn resume(&self) {}
    fn add_response_header(&self, name: &str, value: &str) {
        black_box((name, value));
    }
    fn set_context(&self, _: u32) -> bool {
        true
    }
    fn define_metric(&self, _: &str, _: bool) -> Option<u32> {
        Some(0)
    }
    fn increment(&self, id: u32, by: i64) {
        black_box((id, by));
    }
    fn random_u64(&self) -> u64 {
        self.random.set(self.random.get() + 1);
        self.random.get()
    }
    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.shared.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        let mut map = self.shared.borrow_mut();
        let token = match map.get(key) {
            Some((_, current)) if cas.is_some_and(|c| c != *current) => {
                return Err(SetError::CasMismatch);
            }
            Some((_, current)) => current + 1,
            None => 1,
        };
        map.insert(key.to_string(), (value.to_vec(), token));
        Ok(())
    }
    fn register_queue(&self, _: &str) -> Option<u32> {
        None
    }
    fn enqueue(&self, _: u32) -> bool {
        false
    }
    fn drain_queue(&self, _: u32) {}
}

/// A VM with a warm key (a lease of a billion) in its `shared_slots`.
fn warm_vm(host: &Quick, shared_slots: u32) -> Vm {
    let config = format!(
        r#"{{"gateway_cluster": "gw", "shared_slots": {shared_slots}, "rules": [{{"name": "per-key",
            "namespace": "bench", "limit": 1000000000, "duration": "1h",
            "actions": [{{"request_headers": {{"header_name": "x-api-key", "descriptor_key": "key"}}}}]}}]}}"#
    );
    let mut vm = Vm::new(Config::from_json(config.as_bytes()).unwrap(), host);
    assert_eq!(vm.on_request(host, 1), Verdict::Pause);
    vm.on_tick(host); // the call goes out from the root context
    let d = 3_600_000;
    let seq = NOW / d;
    *host.answer.borrow_mut() = format!(
        r#"{{"success": true, "sequence": 0, "results": [{{"success": true, "limit": 1000000000,
            "remaining": 999999999, "reset": {}, "sequence": {seq},
            "current": {{"regional": 1, "global": 0}}, "previous": {{"regional": 0, "global": 0}},
            "used": 0, "lease": 500000000, "lease_id": 3, "lease_ms": 3600000}}]}}"#,
        (seq + 1) * d
    )
    .into_bytes();
    vm.on_call_response(host, 1, 0);
    apply(host, vm.take_settled(), 0);
    vm.on_response(host, 1);
    vm
}

fn warm(c: &mut Criterion) {
    for (name, slots) in [("shared_slot", 1024), ("vm_table", 0)] {
        let host = Quick {
            key: b"warm-key".to_vec(),
            ..Quick::default()
        };
        let mut vm = warm_vm(&host, slots);
        let mut context = 10;
        c.bench_function(&format!("envoy_filter/warm_request/{name}"), |b| {
            b.iter(|| {
                context += 1;
                let verdict = vm.on_request(&host, context);
                debug_assert_eq!(verdict, Verdict::Continue);
                vm.on_response(&host, context);
                vm.on_done(context);
                black_box(verdict)
            });
        });
    }
}

criterion_group!(benches, warm);
criterion_main!(benches);
