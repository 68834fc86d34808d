//! A global allocator that tallies every allocation (and reallocation) made on the calling
//! thread, for tests that assert a path allocates nothing, or no more than a peer. Shared by
//! path with the gateway's tests.

#![allow(unsafe_code)] // a GlobalAlloc impl is unsafe by definition; it only forwards to System

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn tally(size: usize) {
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
    let _ = LARGEST.try_with(|n| n.set(n.get().max(size)));
}

struct Counting;

// SAFETY: forwards every call unchanged to the system allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        tally(layout.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        tally(new_size);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations and reallocations made on this thread so far.
pub(crate) fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// The largest allocation (or reallocation's new size) made on this thread since the last
/// call, in bytes; starts the next tally.
#[allow(dead_code)] // not every test that counts asks for sizes
pub(crate) fn take_largest() -> usize {
    LARGEST.with(|n| n.replace(0))
}
