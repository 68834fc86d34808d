//! A window key's state as bytes, for shells that keep states outside a table: Envoy's shared
//! data, which every worker's VM reads and writes back with compare-and-swap. An entry names
//! its window key (namespace, identifier, duration), so a slot that several keys hash to
//! is never read as another key's state.
//!
//! The layout is fixed little-endian (version byte first); bytes that do not decode give
//! `None`, and the shell starts the key cold (a lower bound, as after an eviction).

use alloc::vec::Vec;

use crate::cell::{CellState, WindowState};
use crate::decision::Counts;
use crate::lease::LeaseState;

/// 2: a cell holds what the origin passed for the process, and the undo marker and idle
/// mark are the window's (version 1 bytes decode as `None`: the key starts cold).
const VERSION: u8 = 2;
/// Bytes of an encoded [`WindowState`].
pub const STATE_BYTES: usize = 1 + 8 * 26;

fn put(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn u64(&mut self) -> Option<u64> {
        let (head, rest) = self.0.split_first_chunk::<8>()?;
        self.0 = rest;
        Some(u64::from_le_bytes(*head))
    }
    fn u16(&mut self) -> Option<u16> {
        let (head, rest) = self.0.split_first_chunk::<2>()?;
        self.0 = rest;
        Some(u16::from_le_bytes(*head))
    }
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
}

fn put_cell(out: &mut Vec<u8>, c: &CellState) {
    for v in [
        c.counts.regional,
        c.counts.global,
        c.lease_until,
        c.read_retry_at,
        c.last_flushed,
        c.own,
        c.acked,
        c.grant,
        c.lease_id,
        c.decided,
    ] {
        put(out, v);
    }
}

fn read_cell(r: &mut Reader<'_>) -> Option<CellState> {
    Some(CellState {
        counts: Counts {
            regional: r.u64()?,
            global: r.u64()?,
        },
        lease_until: r.u64()?,
        read_retry_at: r.u64()?,
        last_flushed: r.u64()?,
        own: r.u64()?,
        acked: r.u64()?,
        grant: r.u64()?,
        lease_id: r.u64()?,
        decided: r.u64()?,
    })
}

impl WindowState {
    /// Appends the state's bytes ([`STATE_BYTES`] of them) to `out`.
    pub fn write_bytes(&self, out: &mut Vec<u8>) {
        out.push(VERSION);
        for v in [
            self.sequence,
            self.strict_until,
            self.limit,
            self.lease.to_bits(),
            self.uncertain_from,
            self.idle_since,
        ] {
            put(out, v);
        }
        put_cell(out, &self.current);
        put_cell(out, &self.previous);
    }

    /// A state from [`write_bytes`](Self::write_bytes)' output; `None` for anything else.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let (&version, rest) = bytes.split_first()?;
        if version != VERSION || rest.len() != STATE_BYTES - 1 {
            return None;
        }
        let mut r = Reader(rest);
        Some(Self {
            sequence: r.u64()?,
            strict_until: r.u64()?,
            limit: r.u64()?,
            lease: LeaseState::from_bits(r.u64()?),
            uncertain_from: r.u64()?,
            idle_since: r.u64()?,
            current: read_cell(&mut r)?,
            previous: read_cell(&mut r)?,
        })
    }
}

/// Which window key an entry holds (the shell's one workspace is implied).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryKey<'a> {
    /// Namespace.
    pub namespace: &'a str,
    /// Identifier.
    pub identifier: &'a str,
    /// Window length in milliseconds.
    pub duration_ms: u64,
}

/// The bytes of `key`'s entry.
pub fn entry_len(key: EntryKey<'_>) -> usize {
    13 + key.namespace.len() + key.identifier.len() + STATE_BYTES
}

/// Appends the entry of `key` and `state` to `out` (after a shell's own header, say):
/// [`entry_len`] bytes.
pub fn write_entry(out: &mut Vec<u8>, key: EntryKey<'_>, state: &WindowState) {
    let (ns, id) = (key.namespace.as_bytes(), key.identifier.as_bytes());
    out.push(VERSION);
    put(out, key.duration_ms);
    for part in [ns, id] {
        // Namespaces and identifiers are at most 255 bytes (identity bounds).
        out.extend_from_slice(&u16::try_from(part.len()).unwrap_or(u16::MAX).to_le_bytes());
    }
    out.extend_from_slice(ns);
    out.extend_from_slice(id);
    state.write_bytes(out);
}

/// The key and state of an entry, or `None` if the bytes are not one.
pub fn decode_entry(bytes: &[u8]) -> Option<(EntryKey<'_>, WindowState)> {
    let (&version, rest) = bytes.split_first()?;
    if version != VERSION {
        return None;
    }
    let mut r = Reader(rest);
    let duration_ms = r.u64()?;
    let (ns_len, id_len) = (usize::from(r.u16()?), usize::from(r.u16()?));
    let namespace = core::str::from_utf8(r.bytes(ns_len)?).ok()?;
    let identifier = core::str::from_utf8(r.bytes(id_len)?).ok()?;
    let state = WindowState::from_bytes(r.0)?;
    Some((
        EntryKey {
            namespace,
            identifier,
            duration_ms,
        },
        state,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::window::WindowDuration;

    #[test]
    fn an_entry_round_trips_and_garbage_does_not_decode() {
        let d = WindowDuration::from_ms(60_000).unwrap();
        let mut state = WindowState::new(d, 1_700_000_000_000);
        state.current.own = 7;
        state.current.grant = 12;
        state.current.lease_id = 99;
        state.current.decided = 3;
        state.previous.decided = 8;
        state.uncertain_from = 4;
        state.idle_since = 1_700_000_000_100;
        state.previous.counts.regional = 41;
        state.lease.granted(5);
        state.limit = 100;
        let key = EntryKey {
            namespace: "api",
            identifier: "key=a&b%3D",
            duration_ms: 60_000,
        };
        let mut bytes = Vec::new();
        write_entry(&mut bytes, key, &state);
        assert_eq!(bytes.len(), entry_len(key));
        let (k, s) = decode_entry(&bytes).unwrap();
        assert_eq!((k, s), (key, state));
        for n in 0..bytes.len() {
            assert!(decode_entry(&bytes[..n]).is_none(), "a prefix of {n} bytes");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode_entry(&longer).is_none());
        assert!(WindowState::from_bytes(&[1; STATE_BYTES]).is_none());
    }
}
