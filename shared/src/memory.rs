//! What a shell reports of its memory: its table's size against its capacity, what eviction
//! did, and the WebAssembly module's linear memory, which never shrinks (one burst of distinct
//! keys leaves it at its high-water mark), so a shell says where it stands rather than leave
//! an operator to infer it from the process's resident size.

use crate::table::CounterTable;

/// A table's and a module's memory, as the shells report it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Window keys held.
    pub entries: u64,
    /// The most it holds.
    pub capacity: u64,
    /// Heap bytes the table holds ([`CounterTable::heap_bytes`]).
    pub table_bytes: u64,
    /// Entries evicted to make room for others (each such key is decided at the origin when
    /// it comes back).
    pub evicted: u64,
    /// Own admitted cost evicted before the origin acknowledged it (only when the table is
    /// full of such entries, as with the origin away under a flood of keys): counts the
    /// region never learns of.
    pub replay_dropped: u64,
    /// The module's linear memory in bytes (0 outside WebAssembly).
    pub linear_bytes: u64,
}

impl MemoryReport {
    /// The figures of `table`, and of the running module.
    pub fn of(table: &CounterTable) -> Self {
        let stats = table.stats();
        let wide = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        Self {
            entries: wide(table.len()),
            capacity: wide(table.config().capacity),
            table_bytes: wide(table.heap_bytes()),
            evicted: stats.evicted,
            replay_dropped: stats.replay_lost,
            linear_bytes: linear_bytes(),
        }
    }
}

/// The running module's linear memory in bytes; 0 outside WebAssembly.
pub fn linear_bytes() -> u64 {
    #[cfg(target_arch = "wasm32")]
    {
        let pages = core::arch::wasm32::memory_size::<0>();
        u64::try_from(pages)
            .unwrap_or(u64::MAX)
            .saturating_mul(65_536)
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        0
    }
}
