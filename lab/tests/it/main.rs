//! The lab's binary run as a user runs it, one test binary for all of it: each module holds
//! one kind of run.

#![allow(clippy::expect_used, clippy::panic, clippy::unwrap_used)] // test code: a panic is the failure report

#[path = "../common/mod.rs"]
mod common;

mod interrupt;
mod quick;
mod shells;
mod wan;
