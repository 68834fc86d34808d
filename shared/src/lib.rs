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
//! | [`cell`] | one window key's state: two cells and the strict-mode deadline |
//! | [`origin`] | which cells to read from the regional origin, and merging its answers |
//! | [`table`] | the bounded single-threaded LRU table of an edge process |
//! | [`gcounter`] | the global G-Counter, own/foreign imports and the publish policy |
//! | [`headers`] | `RateLimit-Policy`, `RateLimit`, `Retry-After`, `X-RateLimit-*` values |
//! | [`wire`] | the JSON types of gateway API v1 and their validation |

//!
//! A shell's request path, with the origin stubbed:
//!
//! ```
//! use strata_core::table::Step;
//! use strata_core::{CounterTable, Counts, TableConfig, WindowDuration, WindowKeyRef};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut table = CounterTable::new(TableConfig::default(), 0x5eed); // seed from the host
//! let minute = WindowDuration::from_ms(60_000)?;
//! let key = WindowKeyRef::new("acme", "api", "user-42", minute)?;
//! let now_ms = 1_700_000_000_000; // 20 s into its minute
//! // The region has counted 3 in this minute and 6 in the last one.
//! let read_origin = |sequence: u64| -> Result<Counts, ()> {
//!     let regional = if sequence == minute.sequence(now_ms) { 3 } else { 6 };
//!     Ok(Counts { regional, global: 0 })
//! };
//!
//! let decision = match table.check(key, 10, 1, now_ms) {
//!     Step::Decided(d) => d, // warm, fresh, not strict: no round trip
//!     Step::Read(plan) => {
//!         // Cold, stale or strict: read those cells first (one batched call in a real shell).
//!         for (sequence, _reason) in plan.cells() {
//!             match read_origin(sequence) {
//!                 Ok(counts) => table.apply_origin(key, sequence, counts, now_ms),
//!                 Err(()) => table.fail_origin(key, sequence, now_ms),
//!             };
//!         }
//!         table.decide(key, 10, 1, now_ms)
//!     }
//! };
//! assert!(decision.success);
//! // 3 + floor(6 * 40/60) + 1 = 8 of 10.
//! assert_eq!(decision.remaining, 2);
//! # Ok(())
//! # }
//! ```

#![cfg_attr(not(feature = "std"), no_std)]
#![forbid(unsafe_code)]

extern crate alloc;

pub mod cell;
pub mod decision;
pub mod gcounter;
pub mod headers;
pub mod identity;
pub mod origin;
pub mod table;
pub mod window;
pub mod wire;

pub use cell::{CellState, WindowState};
pub use decision::{Counts, Decision, LimitCheck, MultiDecision, WindowCounts, decide_all};
pub use gcounter::{FlushRow, GCounter, PublishPolicy};
pub use identity::{Cell, Component, IdentityError, Region, WindowKey, WindowKeyRef};
pub use origin::{OriginPolicy, ReadPlan, ReadReason};
pub use table::{CounterTable, LimitRequest, MultiStep, Step, TableConfig};
pub use window::WindowDuration;
