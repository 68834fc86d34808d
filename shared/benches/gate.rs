//! A Wasm shell's warm request, natively, through the driver the shells run
//! (`Driver::request`): the rules applied to a request, its limit decided from a lease, and
//! the reply's headers built, the work the edge's Wasm module does per request besides moving
//! strings across the JavaScript boundary. Also with a 4,000-byte key, keyed by its digest
//! each time. Run: `cargo bench -p strata-core --bench gate`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // bench code: a panic is the report

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use strata_core::driver::{Started, TableStore};
use strata_core::gate::Gate;
use strata_core::rules::RequestView;
use strata_core::wire::MAX_COUNT;
use strata_core::{CounterTable, TableConfig, WindowDuration, WindowKeyRef};

#[path = "../tests/support/mod.rs"]
mod support;

const NOW_MS: u64 = 1_700_000_000_000;

/// A request with this `x-api-key`.
struct Req(Vec<u8>);

impl RequestView for Req {
    fn method(&self) -> &str {
        "GET"
    }
    fn host(&self) -> &str {
        "example.com"
    }
    fn path(&self) -> &str {
        "/api/items"
    }
    fn header(&self, name: &str) -> Option<&[u8]> {
        match name {
            "x-api-key" => Some(&self.0),
            "accept" => Some(b"*/*"),
            _ => None,
        }
    }
    fn peer_address(&self) -> Option<&str> {
        None
    }
}

/// `name`: the request `request` through a driver whose table holds `identifier`'s key warm,
/// far from its limit.
fn warm_request(c: &mut Criterion, name: &str, request: &Req, identifier: &str) {
    let rules = r#"{"rules": [{"name": "per-key", "namespace": "bench", "limit": 1000000000000,
        "duration": "1h", "actions": [{"request_headers": {"header_name": "x-api-key",
        "descriptor_key": "key"}}]}]}"#;
    let gate = Gate::from_json("edge", rules, "").unwrap();
    let mut store = TableStore {
        table: CounterTable::new(TableConfig::default(), 0x5eed),
        instance: "edge-1".into(),
    };
    let hour = WindowDuration::from_ms(3_600_000).unwrap();
    let key = WindowKeyRef::new("edge", "bench", identifier, hour).unwrap();
    support::warm(&mut store.table, key, MAX_COUNT, MAX_COUNT / 2, NOW_MS);
    let mut driver = support::driver(&gate);
    let mut id = 0;
    c.bench_function(name, |b| {
        b.iter(|| {
            id += 1;
            let started = driver.request(&mut store, id, request, NOW_MS).unwrap();
            let Started::Decided(d) = started else {
                panic!("a warm key is decided from memory");
            };
            assert!(d.reply.allowed);
            black_box(d)
        });
    });
}

fn driver_request(c: &mut Criterion) {
    warm_request(
        c,
        "driver/warm_request",
        &Req(b"warm-key".to_vec()),
        "key=warm-key",
    );
    // A 4,000-byte key (a JWT, say): keyed by its SHA-256 digest each time.
    let id = strata_core::identity::identifier_for(format!("key={}", "k".repeat(4_000)));
    warm_request(
        c,
        "driver/warm_request_4000_byte_key",
        &Req(vec![b'k'; 4_000]),
        &id,
    );
}

criterion_group!(benches, driver_request);
criterion_main!(benches);
