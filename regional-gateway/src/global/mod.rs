//! The global layer: regions share usage through a G-Counter of per-region components in SQL.

pub mod store;

pub use store::{Store, StoreError, SyncRow};
