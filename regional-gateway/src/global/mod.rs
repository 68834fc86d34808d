//! The global layer: regions share usage through a G-Counter of per-region components in SQL.

pub mod layer;
pub mod store;

pub use layer::Global;
pub use store::{SCHEMA_VERSION, Store, StoreError, SyncRead, SyncRow, create_sqlite_dir};
