//! The slab's slot storage: a vector that grows in chunks and never moves what it holds, up to
//! a bound it never passes.
//!
//! A `Vec` that doubles as it fills ends up to twice the size it needs (200,000 slots of 256
//! bytes reserved 262,144), and each doubling holds the old and the new buffer at once. In a
//! WebAssembly module that peak is for good: linear memory never shrinks. Here each chunk of
//! `CHUNK` slots (1 MiB) is allocated once at its size and the last is cut to the bound, so
//! the slots never take more than the bound's bytes and a growth copies nothing. Finding slot
//! `i` is a shift, a mask and one more load, from a short list of chunks that stays in cache:
//! chunks that double in size (fewer of them, for small tables) cost 24% more than one `Vec`
//! at 100,000 keys for finding a chunk by its leading zeros, fixed ones 8%
//! (`docs/BENCHMARKS.md`).

use alloc::vec::Vec;
use core::ops::{Index, IndexMut};

/// Slots a chunk holds (a power of two); the last is cut to the bound.
const CHUNK: usize = 4096;

/// Chunk and offset of slot `i`.
fn place(i: usize) -> (usize, usize) {
    (i / CHUNK, i % CHUNK)
}

/// Slots of chunk `k` for a vector bounded at `bound`.
fn chunk_len(k: usize, bound: usize) -> usize {
    CHUNK.min(bound.saturating_sub(k * CHUNK))
}

/// A growable vector of at most `bound` items whose items never move.
#[derive(Debug)]
pub(crate) struct Chunks<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
    bound: usize,
}

impl<T> Chunks<T> {
    /// An empty vector that will hold at most `bound` items.
    pub(crate) fn new(bound: usize) -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
            bound,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Items the allocated chunks have room for: every chunk holds `CHUNK` but the last,
    /// cut to the bound.
    pub(crate) fn allocated(&self) -> usize {
        self.bound.min(self.chunks.len() * CHUNK)
    }

    /// Bytes the chunks and their list take.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.allocated() * core::mem::size_of::<T>()
            + self.chunks.capacity() * core::mem::size_of::<Vec<T>>()
    }

    /// Appends `value` at index `len()`; gives it back when the vector is at its bound.
    pub(crate) fn push(&mut self, value: T) -> Result<usize, T> {
        if self.len >= self.bound {
            return Err(value);
        }
        let (k, _) = place(self.len);
        if k == self.chunks.len() {
            self.chunks
                .push(Vec::with_capacity(chunk_len(k, self.bound)));
        }
        match self.chunks.get_mut(k) {
            Some(chunk) => chunk.push(value),
            None => return Err(value),
        }
        self.len += 1;
        Ok(self.len - 1)
    }

    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        let (k, o) = place(i);
        self.chunks.get_mut(k)?.get_mut(o)
    }

    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }
}

impl<T> Index<usize> for Chunks<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        let (k, o) = place(i);
        &self.chunks[k][o]
    }
}

impl<T> IndexMut<usize> for Chunks<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        let (k, o) = place(i);
        &mut self.chunks[k][o]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_has_one_place_in_chunks_cut_to_the_bound() {
        assert_eq!(place(0), (0, 0));
        assert_eq!(place(CHUNK - 1), (0, CHUNK - 1));
        assert_eq!(place(CHUNK), (1, 0));
        assert_eq!(place(5 * CHUNK + 7), (5, 7));
        assert_eq!(chunk_len(0, 64), 64);
        assert_eq!(chunk_len(1, CHUNK + 10), 10);
        assert_eq!(chunk_len(2, 50_000), CHUNK);
    }

    /// Filled to its bound, the vector holds exactly the bound, where a doubling `Vec`
    /// would hold the next power of two; pushing past it gives the item back.
    #[test]
    fn it_never_allocates_past_its_bound_and_items_stay_put() {
        let bound = 50_000;
        let mut v = Chunks::new(bound);
        for i in 0..bound {
            assert_eq!(v.push(i), Ok(i));
        }
        assert_eq!(v.push(7), Err(7));
        assert_eq!((v.len(), v.allocated()), (bound, bound));
        let first: *const usize = &v[0];
        assert!((0..bound).all(|i| v[i] == i));
        assert_eq!(v.get_mut(bound), None);
        assert_eq!(v.iter().count(), bound);
        v[3] = 30;
        assert_eq!(v.get_mut(3).map(|x| *x), Some(30));
        assert!(core::ptr::eq(first, &v[0]));
    }
}
