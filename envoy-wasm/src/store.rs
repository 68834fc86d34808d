//! Where a VM's window keys live, as the core's driver reads them ([`Store`]): a single
//! limit in its shared slot when the slot is free for it (so every VM of the Envoy decides it
//! as one process, under the Envoy's instance id), anything else in the VM's own table (under
//! the VM's). A shared slot is read, stepped and written back with the token it was read
//! with, a few times at most; one that goes to another key meanwhile leaves the step to a
//! copy (what the gateway counted stays counted there).

use strata_core::cell::WindowState;
use strata_core::decision::{Counts, MultiDecision};
use strata_core::driver::{Home, Store, refused};
use strata_core::identity::WindowKeyRef;
use strata_core::origin::OriginAnswer;
use strata_core::replay::{ReplayBatch, ReplayEvent};
use strata_core::request::{self, Begin, OriginCall};
use strata_core::snapshot::{decode_entry, encode_entry};
use strata_core::table::{LimitRequest, TooManyLimits};
use strata_core::{CounterTable, WindowDuration};

use crate::host::{Host, SetError};
use crate::shared::{CAS_TRIES, One, REPLAY_KEY, Slots};

/// The VM's table.
pub const TABLE: Home = Home(0);
/// The slots the Envoy's VMs share.
pub const SHARED: Home = Home(1);
/// The workspace of the filter's keys (the gateway binds the real one to the token).
pub const WORKSPACE: &str = "envoy";

/// What a VM keeps between callbacks.
#[derive(Debug)]
pub struct VmState {
    /// Keys that found no shared slot, and multi-limit groups.
    pub table: CounterTable,
    /// The VM's own instance id.
    pub vm_instance: String,
    /// The shared slots and the Envoy's instance id (none when `shared_slots` is 0).
    pub slots: Option<(Slots, String)>,
    /// This VM among its Envoy's, for the replay lease.
    pub vm_tag: u64,
    /// How long the replay lease is held: three replay intervals.
    pub replay_lease_ms: u64,
}

/// The state and the host, for one callback.
#[allow(missing_debug_implementations)] // a borrow for one callback
pub struct Homes<'a, H: Host> {
    /// The host.
    pub host: &'a H,
    /// The VM's state.
    pub state: &'a mut VmState,
}

impl<H: Host> Homes<'_, H> {
    /// Runs `step` on `key`'s shared slot, written back with the token it was read with; on
    /// a copy when the slot holds another key or stays contended.
    fn on_slot<T>(
        &mut self,
        key: WindowKeyRef<'_>,
        now_ms: u64,
        mut step: impl FnMut(&mut One<'_, H>) -> T,
    ) -> T {
        if let Some((slots, _)) = &self.state.slots {
            for _ in 0..CAS_TRIES {
                let Some(mut loaded) = slots.load(self.host, key, now_ms) else {
                    break;
                };
                let mut one = One::new(loaded.state, self.host);
                let out = step(&mut one);
                loaded.state = one.state;
                match Slots::store(self.host, &loaded, key) {
                    Ok(()) => return out,
                    Err(SetError::CasMismatch) => continue,
                    Err(SetError::Refused) => break,
                }
            }
        }
        let mut one = One::new(WindowState::new(key.duration(), now_ms), self.host);
        step(&mut one)
    }

    /// Begins one limit on its shared slot; `None` when the slot holds another live key or
    /// stays contended (the VM's table takes the request then).
    fn begin_shared(&self, limit: &LimitRequest<'_>, now_ms: u64) -> Option<Begin> {
        let (slots, _) = self.state.slots.as_ref()?;
        let policy = self.state.table.config().origin;
        for _ in 0..CAS_TRIES {
            let mut loaded = slots.load(self.host, limit.key, now_ms)?;
            let mut one = One::new(loaded.state, self.host);
            let begun = request::begin(&mut one, std::slice::from_ref(limit), now_ms, &policy);
            loaded.state = one.state;
            match Slots::store(self.host, &loaded, limit.key) {
                Ok(()) => return Some(begun),
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Refused) => return None,
            }
        }
        None
    }

    /// The shared slots' replay events from slot `from` on (each slot's state written back,
    /// as taking them may release an idle lease; a slot written meanwhile by another VM waits
    /// for the next pass).
    fn take_shared(&self, max: usize, now_ms: u64, from: usize) -> (ReplayBatch, Option<usize>) {
        let mut events: Vec<ReplayEvent> = Vec::new();
        let Some((slots, _)) = &self.state.slots else {
            return (ReplayBatch { events }, None);
        };
        for (n, slot, bytes, cas) in slots.scan(self.host, from) {
            if events.len() >= max {
                return (ReplayBatch { events }, Some(n));
            }
            let Some((entry, mut state)) = decode_entry(&bytes) else {
                continue;
            };
            let Some(key) = WindowDuration::from_ms(entry.duration_ms)
                .ok()
                .and_then(|d| {
                    WindowKeyRef::new(WORKSPACE, entry.namespace, entry.identifier, d).ok()
                })
                .map(|k| k.to_owned_key())
            else {
                continue;
            };
            let before = events.len();
            let before_state = state;
            if !state.take_replay_events(&key, now_ms, 0, &mut events) || state == before_state {
                continue;
            }
            if self
                .host
                .shared_set(&slot, &encode_entry(entry, &state), cas)
                .is_err()
            {
                events.truncate(before); // another VM wrote it: next pass
            }
        }
        (ReplayBatch { events }, None)
    }
}

impl<H: Host> Store for Homes<'_, H> {
    fn begin(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<(Begin, Home), TooManyLimits> {
        if let [limit] = limits
            && let Some(begun) = self.begin_shared(limit, now_ms)
        {
            return Ok((begun, SHARED));
        }
        let mut begun = self.state.table.begin(limits, now_ms)?;
        // A single limit its slot cannot hold asks for no lease: a lease in this VM's table
        // is this VM's alone, and the origin holds it back from the Envoy's other VMs, where
        // the client's next connections land (a limit of 5 denied its fifth request).
        if let ([_], Some(_), Begin::Call(call)) = (limits, &self.state.slots, &mut begun) {
            call.ask_no_lease();
        }
        Ok((begun, TABLE))
    }

    fn finish(
        &mut self,
        home: Home,
        call: &OriginCall,
        answers: &[OriginAnswer],
        now_ms: u64,
    ) -> MultiDecision {
        match (home, call.limits()) {
            (SHARED, [limit]) => self.on_slot(limit.key.as_ref(), now_ms, |one| {
                request::finish(one, call, answers, now_ms)
            }),
            _ => self
                .state
                .table
                .finish(call, answers, now_ms)
                .unwrap_or_else(|_| refused(call)),
        }
    }

    fn fail(&mut self, home: Home, call: &OriginCall, now_ms: u64) -> MultiDecision {
        let policy = self.state.table.config().origin;
        match (home, call.limits()) {
            (SHARED, [limit]) => self.on_slot(limit.key.as_ref(), now_ms, |one| {
                request::fail(one, call, now_ms, &policy)
            }),
            _ => self
                .state
                .table
                .fail(call, now_ms)
                .unwrap_or_else(|_| refused(call)),
        }
    }

    fn instance(&self, home: Home) -> &str {
        match &self.state.slots {
            Some((_, instance)) if home == SHARED => instance,
            _ => &self.state.vm_instance,
        }
    }

    fn homes(&self) -> u8 {
        if self.state.slots.is_some() { 2 } else { 1 }
    }

    fn take_replay(
        &mut self,
        home: Home,
        max: usize,
        now_ms: u64,
        from: usize,
    ) -> (ReplayBatch, Option<usize>) {
        if home == SHARED {
            return self.take_shared(max, now_ms, from);
        }
        self.state.table.take_replay_from(max, now_ms, None, from)
    }

    fn ack_replay(&mut self, home: Home, batch: &ReplayBatch, counts: &[Counts], now_ms: u64) {
        if home != SHARED {
            return self.state.table.ack_replay(batch, counts);
        }
        for (event, counts) in batch.events.iter().zip(counts) {
            self.on_slot(event.key.as_ref(), now_ms, |one| {
                one.state.apply_replay(event.sequence, *counts, event.used);
            });
        }
    }

    /// The shared slots are replayed by the VM that holds the lease in shared data (or takes
    /// it: free, expired, or its own), for three replay intervals.
    fn replay_turn(&mut self, home: Home, now_ms: u64) -> bool {
        if home != SHARED {
            return true;
        }
        let (bytes, cas) = self.host.shared_get(REPLAY_KEY);
        let text = bytes
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default();
        let me = format!("{:016x}", self.state.vm_tag);
        let free = match text.split_once(':') {
            Some((holder, until)) => {
                holder == me || until.parse::<u64>().map_or(true, |u| u <= now_ms)
            }
            None => true,
        };
        let until = now_ms.saturating_add(self.state.replay_lease_ms);
        free && self
            .host
            .shared_set(REPLAY_KEY, format!("{me}:{until}").as_bytes(), cas)
            .is_ok()
    }

    fn periodic(&self, home: Home) -> bool {
        home == SHARED
    }
}
