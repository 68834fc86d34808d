//! `strata-core`: every decision, merge and policy rule of the Strata rate limiter, as pure
//! functions of their inputs and `now_ms`.
//!
//! No I/O and no clock: the shells (the Workers edge, the Envoy filter, the regional gateway)
//! read the clock, move bytes and hold state; this crate decides. It is `no_std` + `alloc`
//! unless the additive `std` feature is on (which only adds `std::error::Error` impls), so the
//! same code runs natively and in `wasm32-unknown-unknown` / `wasm32-wasip1`.
//!
//! | module | holds |
//! | --- | --- |
//! | [`identity`] | window keys, cells, components, regions, and their bounds |
//! | [`window`] | fixed-window arithmetic: sequence, elapsed, reset, expiry, decay |
//! | [`decision`] | the sliding-window decision, single and all-or-nothing |
//! | [`cell`] | one window key's state: two cells, own counts, the lease, strict mode |
//! | [`origin`] | the decision order (local, or at the origin and why), merging origin answers |
//! | [`policy`] | region-wide origin settings and the reasons a decision goes there |
//! | [`lease`] | leases: the share of a limit a process may admit locally |
//! | [`limit`] | one limit of a request: key, limit, cost |
//! | [`ledger`] | the origin's side of a cell: own counts per process, live leases |
//! | [`request`] | the request path every shell drives: a decision or one origin call |
//! | [`replay`] | the replay buffer: own cumulative counts, delivered safely twice |
//! | [`table`] | the bounded single-threaded table of a process, and its decision API |
//! | [`snapshot`] | a window key's state as bytes, for states kept outside a table (Envoy's shared data) |
//! | [`slab`] | the table's storage: slots, hash index, CLOCK eviction |
//! | `chunks` | the slots' vector: grows in chunks to the capacity, never past it, never moved |
//! | [`memory`] | what a shell reports of its memory: table size, evictions, linear memory |
//! | [`rules`] | the rule model of the Wasm shells: match a request, build its identifier |
//! | [`gate`] | a Wasm shell's request path: rules → limits → origin calls → the reply |
//! | [`driver`] | the request path as events in, actions polled out: coalescing, deadlines, replay |
//! | [`gcounter`] | the global G-Counter, own/foreign imports and the publish policy |
//! | [`headers`] | `RateLimit-Policy`, `RateLimit`, `Retry-After`, `X-RateLimit-*` values |
//! | [`wire`] | the JSON types of gateway API v1 and their validation |
//!
//! A shell's request path, with the origin (`POST /v1/origin/decide`) answered by hand:
//!
//! ```
//! use strata_core::request::OriginCall;
//! use strata_core::table::{LimitRequest, Step};
//! use strata_core::wire::{DecideResponse, DecideResult};
//! use strata_core::{CounterTable, Counts, TableConfig, WindowDuration, WindowKeyRef};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut table = CounterTable::new(TableConfig::default(), 0x5eed); // seed from the host
//! let minute = WindowDuration::from_ms(60_000)?;
//! let key = WindowKeyRef::new("acme", "api", "user-42", minute)?;
//! let limit = LimitRequest { key, limit: 10, cost: 1 };
//! let now_ms = 1_700_000_000_000; // 20 s into its minute
//!
//! let decision = match table.check(key, 10, 1, now_ms) {
//!     // A local denial, or a pass the lease covers: no round trip. Or the origin failed
//!     // moments ago: the failure mode (`TableConfig::origin`) decides, with no call.
//!     Step::Decided(d) | Step::Fallback(d) => d,
//!     // Cold, stale, strict, or the lease is used up: the origin decides, atomically.
//!     Step::Origin(plan) => {
//!         let call = OriginCall::single(limit, plan);
//!         let body = call.to_wire("edge-7f3a"); // POST it; here the origin answers:
//!         assert_eq!(body.limits[0].want, 10); // a new key: as much as the origin will lend
//!         // It counted 3 in this minute and 6 in the last: 3 + floor(6 * 40/60) + 1 = 8 of
//!         // 10, so it passes, counts it, and lends one more: the last quarter of a limit is
//!         // lent in small shares.
//!         let response = DecideResponse {
//!             success: true,
//!             sequence: minute.sequence(now_ms),
//!             results: vec![DecideResult {
//!                 success: true,
//!                 limit: 10,
//!                 remaining: 2,
//!                 reset: minute.reset(minute.sequence(now_ms)),
//!                 sequence: minute.sequence(now_ms),
//!                 current: Counts { regional: 4, global: 0 },
//!                 previous: Counts { regional: 6, global: 0 },
//!                 used: 0, // our local passes the origin holds (this one it decided)
//!                 lease: 1,
//!                 lease_id: 1_700_000_006_000,
//!                 lease_ms: 5_000,
//!                 covers: false, // a plain lease: a limit of 10 is under 200 per holder
//!             }],
//!         };
//!         match call.answers(&response) {
//!             Ok(answers) => table.finish(&call, &answers, now_ms)?.decisions[0],
//!             // Unreachable or nonsense: not tried again for 300 ms; the failure mode
//!             // decides (`local` by default: from memory).
//!             Err(_) => table.fail(&call, now_ms)?.decisions[0],
//!         }
//!     }
//! };
//! assert!(decision.success);
//! assert_eq!(decision.remaining, 2);
//! // The lease covers the next request: decided locally, 1 left.
//! assert!(matches!(table.check(key, 10, 1, now_ms), Step::Decided(d) if d.remaining == 1));
//! // The one after goes to the origin again: the lease is used up.
//! assert!(matches!(table.check(key, 10, 1, now_ms), Step::Origin(_)));
//! // What the origin has not acknowledged goes out with the next replay.
//! assert_eq!(table.take_replay(1_000, now_ms).to_wire("edge-7f3a").events[0].used, 1);
//! # Ok(())
//! # }
//! ```

#![cfg_attr(not(feature = "std"), no_std)]
#![forbid(unsafe_code)]

extern crate alloc;

pub mod address;
pub mod cell;
mod chunks;
pub mod decision;
pub mod driver;
pub mod gate;
pub mod gcounter;
pub mod headers;
pub mod identity;
pub mod lease;
pub mod ledger;
pub mod limit;
pub mod memory;
pub mod origin;
pub mod policy;
pub mod replay;
pub mod request;
pub mod rules;
pub mod slab;
pub mod snapshot;
pub mod table;
pub mod window;
pub mod wire;

pub use cell::{CellState, WindowState};
pub use decision::{Counts, Decision, LimitCheck, MultiDecision, WindowCounts, decide_all};
pub use gcounter::{FlushRow, GCounter, PublishPolicy};
pub use identity::{Cell, Component, IdentityError, Region, WindowKey, WindowKeyRef};
pub use origin::{OriginAnswer, OriginPlan, OriginPolicy, Reason, Verdict};
pub use request::{Begin, FailureMode, OriginCall};
pub use table::{CounterTable, LimitRequest, Step, TableConfig};
pub use window::WindowDuration;
