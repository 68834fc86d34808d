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
//! | [`origin`] | the decision order (local, or at the origin and why), merging origin answers |
//! | [`band`] | the estimate of other processes' unseen traffic that guards local passes |
//! | [`table`] | the bounded single-threaded LRU table of an edge process |
//! | [`gcounter`] | the global G-Counter, own/foreign imports and the publish policy |
//! | [`headers`] | `RateLimit-Policy`, `RateLimit`, `Retry-After`, `X-RateLimit-*` values |
//! | [`wire`] | the JSON types of gateway API v1 and their validation |

//!
//! A shell's request path, with the origin stubbed:
//!
//! ```
//! use strata_core::table::Step;
//! use strata_core::{CounterTable, Counts, OriginAnswer, TableConfig, WindowDuration, WindowKeyRef};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut table = CounterTable::new(TableConfig::default(), 0x5eed); // seed from the host
//! let minute = WindowDuration::from_ms(60_000)?;
//! let key = WindowKeyRef::new("acme", "api", "user-42", minute)?;
//! let now_ms = 1_700_000_000_000; // 20 s into its minute
//! // The origin (`POST /v1/origin/decide`) has counted 3 in this minute and 6 in the last:
//! // 3 + floor(6 * 40/60) + 1 = 8 of 10, so it passes and counts this request.
//! let decide_at_origin = || -> Result<OriginAnswer, ()> {
//!     Ok(OriginAnswer {
//!         limit: 10,
//!         remaining: 2,
//!         reset_ms: minute.reset(minute.sequence(now_ms)),
//!         sequence: minute.sequence(now_ms),
//!         counted: true,
//!         denied: false,
//!         current: Counts { regional: 4, global: 0 },
//!         previous: Counts { regional: 6, global: 0 },
//!         peers: 1,
//!     })
//! };
//!
//! let decision = match table.check(key, 10, 1, now_ms) {
//!     // A local denial, or a pass with room to spare: no round trip.
//!     Step::Decided(d) => d,
//!     // Cold, stale, strict or near the limit: the origin decides, atomically.
//!     Step::Origin(plan) => match decide_at_origin() {
//!         Ok(answer) => table.apply_decided(key, 1, &answer, now_ms),
//!         Err(()) => {
//!             // Unreachable origin: not fresh, retried later; decide from local memory.
//!             for (sequence, _) in plan.reads.cells() {
//!                 table.fail_origin(key, sequence, now_ms);
//!             }
//!             table.decide(key, 10, 1, now_ms)
//!         }
//!     },
//! };
//! assert!(decision.success);
//! assert_eq!(decision.remaining, 2);
//! // The key is warm now: the next request is decided locally (2 left, no other process).
//! assert!(matches!(table.check(key, 10, 1, now_ms), Step::Decided(d) if d.remaining == 1));
//! # Ok(())
//! # }
//! ```

#![cfg_attr(not(feature = "std"), no_std)]
#![forbid(unsafe_code)]

extern crate alloc;

pub mod band;
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
pub use origin::{OriginAnswer, OriginPlan, OriginPolicy, ReadPlan, Reason, Verdict};
pub use table::{CounterTable, LimitRequest, MultiStep, Step, TableConfig};
pub use window::WindowDuration;
