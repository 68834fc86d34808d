//! strata-core's integration tests, one binary for all of them: each module holds the tests of
//! one subject. `no_alloc` (a counting global allocator) is a binary of its own.

#![allow(
    clippy::expect_used,
    clippy::panic,
    clippy::unwrap_used,
    clippy::cast_possible_truncation
)] // test code: a panic is the failure report

#[path = "../support/mod.rs"]
mod support;

mod accuracy;
mod driver;
mod fuzz;
mod properties;
mod protocol_model;
mod reference_cases;
mod region_model;
mod rules;
mod table;
mod wire;
