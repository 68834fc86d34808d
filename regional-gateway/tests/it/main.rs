//! The gateway's integration tests, one binary for all of them (one link instead of twenty):
//! each module holds the tests of one subject. `warm_alloc` (a counting global allocator) and
//! `readme` (the README's examples) are binaries of their own.

#![allow(
    clippy::expect_used,
    clippy::panic,
    clippy::unwrap_used,
    clippy::cast_possible_truncation,
    clippy::cast_precision_loss
)] // test code: a panic is the failure report

#[path = "../common/mod.rs"]
mod common;

mod api;
mod breaker;
mod chaos;
mod cluster;
mod concurrency;
mod exact;
mod exact_processes;
mod garbage;
mod global_outage;
mod global_store;
mod metrics;
mod openapi;
mod processes;
mod propagation;
mod redis_origin;
mod regions;
mod rls;
mod serve;
mod settings;
mod subcommands;
