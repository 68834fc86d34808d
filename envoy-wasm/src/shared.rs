//! Counts shared by an Envoy's worker VMs, in proxy-wasm shared data (scoped by `vm_id`), so
//! `--concurrency N` decides as one process: one instance id, one lease per key, and every
//! VM's local passes visible to the others, also while the gateway is away.
//!
//! Each window key's state lives in one of a fixed number of slots (shared data never shrinks
//! in ABI 0.2: the key space is bounded by the slot count), `strata.slot.<n>`, as an entry that
//! names its key (`strata_core::snapshot`) after the time until which a VM's replay holds it
//! (its claim). A VM reads the slot, runs the core's request path on the state, and writes it
//! back with the token it read (compare-and-swap), trying again on a mismatch, a few times at
//! most. Slots are created empty at configuration, so every write is a compare-and-swap (a
//! write to a missing key is not). A slot holding another key that is still live sends the
//! request to the VM's own table instead (as does a multi-limit group): still exact with the
//! gateway, only not shared while it is away.

use strata_core::cell::WindowState;
use strata_core::identity::WindowKeyRef;
use strata_core::request::States;
use strata_core::snapshot::{EntryKey, decode_entry, entry_len, write_entry};

use crate::host::{Host, SetError};

/// The instance id every VM of this Envoy uses.
pub const INSTANCE_KEY: &str = "strata.instance";
/// The last origin call id (they only grow, per instance).
pub const CALLS_KEY: &str = "strata.calls";
/// Which VM sweeps the shared slots for replay events no VM watches, until when:
/// `<vm>:<unix ms>`.
pub const REPLAY_KEY: &str = "strata.replay";
/// Compare-and-swap attempts before giving up on a slot.
pub const CAS_TRIES: usize = 8;

/// The slot space.
#[derive(Debug, Clone)]
pub struct Slots {
    count: usize,
}

/// A slot read for a window key: its state (cold if the slot was free) and the token.
#[derive(Debug)]
pub struct Loaded {
    /// The slot's number.
    pub index: usize,
    /// The key's state.
    pub state: WindowState,
    /// Until when a replay holds the slot's events (unix ms; 0: none), kept by other writes.
    pub claim: u64,
    /// The token to write it back with.
    pub cas: Option<u32>,
}

/// A slot's bytes: the replay claim, then the core's entry.
pub fn encode_slot(claim: u64, key: EntryKey<'_>, state: &WindowState) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + entry_len(key));
    out.extend_from_slice(&claim.to_le_bytes());
    write_entry(&mut out, key, state);
    out
}

/// The claim, key and state of a slot's bytes, or `None` if they are not a slot's entry.
pub fn decode_slot(bytes: &[u8]) -> Option<(u64, EntryKey<'_>, WindowState)> {
    let (claim, entry) = bytes.split_first_chunk::<8>()?;
    let (key, state) = decode_entry(entry)?;
    Some((u64::from_le_bytes(*claim), key, state))
}

/// A slot's shared-data key.
pub fn slot_name(n: usize) -> String {
    format!("strata.slot.{n}")
}

/// The entry identity of a window key.
pub fn entry_key<'a>(key: WindowKeyRef<'a>) -> EntryKey<'a> {
    EntryKey {
        namespace: key.namespace(),
        identifier: key.identifier(),
        duration_ms: key.duration().as_ms(),
    }
}

/// FNV-1a: the same slot for a key in every VM (no per-process seed).
fn hash(key: EntryKey<'_>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(key.namespace.as_bytes());
    eat(&[0]);
    eat(key.identifier.as_bytes());
    eat(&[0]);
    eat(&key.duration_ms.to_le_bytes());
    h
}

impl Slots {
    /// `count` slots; creates the ones missing and the instance id (the main thread's VMs
    /// configure before any worker's, so this runs before requests). Returns the instance id.
    pub fn seed(host: &impl Host, count: usize, fresh_instance: &str) -> (Self, String) {
        for key in [CALLS_KEY, REPLAY_KEY] {
            if host.shared_get(key).1.is_none() {
                let _ = host.shared_set(key, b"", None);
            }
        }
        // The first VM creates them all, in order: once the last exists, the rest do too, and
        // the other VMs skip the walk.
        let last = slot_name(count.saturating_sub(1));
        if host.shared_get(&last).1.is_none() {
            for n in 0..count {
                let key = slot_name(n);
                if host.shared_get(&key).1.is_none() {
                    let _ = host.shared_set(&key, b"", None);
                }
            }
        }
        if host.shared_get(INSTANCE_KEY).0.is_none_or(|v| v.is_empty()) {
            let _ = host.shared_set(INSTANCE_KEY, fresh_instance.as_bytes(), None);
        }
        let instance = host
            .shared_get(INSTANCE_KEY)
            .0
            .and_then(|v| String::from_utf8(v).ok())
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| fresh_instance.to_string());
        (Self { count }, instance)
    }

    /// Slots in the space.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The slot a key lives in.
    pub fn index_of(&self, key: EntryKey<'_>) -> usize {
        let n = hash(key) % u64::try_from(self.count.max(1)).unwrap_or(1);
        usize::try_from(n).unwrap_or(0)
    }

    /// Reads `key`'s state: the slot's if it holds `key`, a cold one if the slot is free or
    /// its key is done with; `None` when another live key holds it.
    pub fn load(&self, host: &impl Host, key: WindowKeyRef<'_>, now_ms: u64) -> Option<Loaded> {
        let index = self.index_of(entry_key(key));
        let (bytes, cas) = host.shared_get(&slot_name(index));
        let (claim, state) = match bytes.as_deref().and_then(decode_slot) {
            Some((claim, held, state)) if held == entry_key(key) => (claim, state),
            Some((_, held, state)) if !reusable(held, &state, now_ms) => return None,
            _ => (0, WindowState::new(key.duration(), now_ms)),
        };
        Some(Loaded {
            index,
            state,
            claim,
            cas,
        })
    }

    /// Writes `state` back as `key`'s, if nobody wrote the slot since it was read.
    pub fn store(host: &impl Host, loaded: &Loaded, key: WindowKeyRef<'_>) -> Result<(), SetError> {
        let (n, claim, cas) = (loaded.index, loaded.claim, loaded.cas);
        Self::write(host, n, claim, entry_key(key), &loaded.state, cas)
    }

    /// Writes slot `n`: `claim`, `key` and `state`, if its token is still `cas`.
    pub fn write(
        host: &impl Host,
        n: usize,
        claim: u64,
        key: EntryKey<'_>,
        state: &WindowState,
        cas: Option<u32>,
    ) -> Result<(), SetError> {
        host.shared_set(&slot_name(n), &encode_slot(claim, key, state), cas)
    }

    /// Slot `n`'s bytes and token, if it holds an entry.
    pub fn read(host: &impl Host, n: usize) -> Option<(Vec<u8>, Option<u32>)> {
        let (bytes, cas) = host.shared_get(&slot_name(n));
        Some((bytes.filter(|b| !b.is_empty())?, cas))
    }
}

/// Whether a slot's entry can make way for another key: its windows are over, or it holds
/// nothing the origin lacks, no live lease and no strict mode.
fn reusable(held: EntryKey<'_>, state: &WindowState, now_ms: u64) -> bool {
    let expired = strata_core::WindowDuration::from_ms(held.duration_ms)
        .map_or(true, |d| state.is_expired(d, now_ms));
    let settled = state.current().unacked() == 0
        && state.previous().unacked() == 0
        && !state.current().is_fresh(now_ms)
        && state.strict_until() <= now_ms;
    expired || settled
}

/// A new origin call id, shared by the instance's VMs (only growing).
pub fn next_call(host: &impl Host) -> u64 {
    for _ in 0..CAS_TRIES {
        let (bytes, cas) = host.shared_get(CALLS_KEY);
        let last: u64 = bytes
            .and_then(|b| String::from_utf8(b).ok())
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let next = last.saturating_add(1);
        if host
            .shared_set(CALLS_KEY, next.to_string().as_bytes(), cas)
            .is_ok()
        {
            return next;
        }
    }
    // Contended beyond reason: a time-based id, still growing in practice.
    host.now_ms().saturating_mul(1_000)
}

/// One state as the core's request path reads it (a single-limit group).
pub struct One<'h, H: Host> {
    /// The state.
    pub state: WindowState,
    host: &'h H,
}

impl<'h, H: Host> One<'h, H> {
    /// Wraps `state`; call ids come from `host`'s shared counter.
    pub fn new(state: WindowState, host: &'h H) -> Self {
        Self { state, host }
    }
}

impl<H: Host> States for One<'_, H> {
    fn state(&mut self, i: usize) -> Option<&mut WindowState> {
        (i == 0).then_some(&mut self.state)
    }
    fn same(&self, i: usize, j: usize) -> bool {
        i == j
    }
    fn next_call(&mut self, _: usize) -> u64 {
        next_call(self.host)
    }
}

impl<H: Host> core::fmt::Debug for One<'_, H> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("One").field("state", &self.state).finish()
    }
}
