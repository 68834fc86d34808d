//! Where a VM's window keys live, as the core's driver reads them ([`Store`]): a single
//! limit in its shared slot when the slot is free for it (so every VM of the Envoy decides it
//! as one process, under the Envoy's instance id), anything else in the VM's own table (under
//! the VM's). A shared slot is read, stepped and written back with the token it was read
//! with, a few times at most. If it went to another key while a call was out, the answer is
//! the decision (the gateway counted it), and a failed call is decided on the VM's table,
//! which counts and replays what it admits.
//!
//! Each VM replays the slots it wrote (it watches them until their state needs nothing more
//! of the replay), taking a slot's events under a claim so that the other VMs that wrote it
//! skip it while the batch travels; one VM at a time also sweeps a share of all the slots
//! each pass, for the events of a VM that went away. A pass reads what this VM touched plus
//! `slots / SWEEP_PASSES`, not every slot.

use strata_core::cell::WindowState;
use strata_core::decision::MultiDecision;
use strata_core::driver::{Home, Replays, Store, refused};
use strata_core::identity::WindowKeyRef;
use strata_core::origin::OriginAnswer;
use strata_core::replay::{QuietPace, ReplayBatch, ReplayEvent, Take};
use strata_core::request::{self, Begin, OriginCall};
use strata_core::table::{LimitRequest, TooManyLimits};
use strata_core::wire::CellsResponse;
use strata_core::{CounterTable, FailureMode, WindowDuration};

use crate::host::{Host, SetError};
use crate::shared::{CAS_TRIES, One, REPLAY_KEY, Slots, decode_slot};

/// Passes a sweep takes to read every slot once: at the 100 ms default interval, a slot whose
/// VM went away is replayed within 10 s, and 65,536 slots cost 656 reads a pass.
pub const SWEEP_PASSES: usize = 100;
/// Slots a replay batch of the shared home takes at most: each costs the worker a read and a
/// write of shared data now and the same again for the answer, so a pass over thousands of
/// keys goes in steps, each in its own callback, between requests (the gateway's replay is
/// paced the same way).
pub const SLOT_BATCH: usize = 128;
/// Passes between two looks at a watched slot that holds only a lease near the limit (the
/// replay gives it back once it sits idle for a second).
pub const QUIET_PASSES: u32 = 5;

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
    /// This VM among its Envoy's, for the sweep lease.
    pub vm_tag: u64,
    /// How long the sweep lease is held: three replay intervals.
    pub replay_lease_ms: u64,
    /// How long a replay claims a slot's events: the replay call's timeout.
    pub claim_ms: u64,
    /// The replay's view of the slots.
    pub replay: SlotReplay,
}

/// Which shared slots this VM's replay passes read.
#[derive(Debug, Default)]
pub struct SlotReplay {
    /// Per slot, the pass at which this VM next reads it (0: it does not watch it): a slot
    /// is watched from this VM's write until its state needs nothing more of the replay.
    due: Vec<u32>,
    /// The watched slots (and, until the next pass drops them, some no longer watched).
    watched: Vec<usize>,
    /// Passes begun.
    passes: u32,
    /// The slots of the pass in progress.
    pass: Vec<usize>,
    /// Where the next sweep begins.
    sweep_from: usize,
}

impl SlotReplay {
    /// The replay of `count` slots.
    pub fn new(count: usize) -> Self {
        Self {
            due: vec![0; count],
            ..Self::default()
        }
    }

    /// Slot `n` was written: read it on the next pass (or sooner, if it is due sooner).
    fn watch(&mut self, n: usize) {
        let next = self.passes.saturating_add(1);
        if let Some(due) = self.due.get(n).copied()
            && due != 0
            && due <= next
        {
            return;
        }
        self.set_due(n, next);
    }

    /// Reads slot `n` next at pass `at` (0: no more).
    fn set_due(&mut self, n: usize, at: u32) {
        let Some(due) = self.due.get_mut(n) else {
            return;
        };
        if *due == 0 && at != 0 {
            self.watched.push(n);
        }
        *due = at;
    }

    /// Begins a pass: the watched slots due, and a sweep of `count / SWEEP_PASSES` from where
    /// the last one stopped when this VM sweeps.
    fn begin_pass(&mut self, count: usize, sweep: bool) {
        self.passes = self.passes.saturating_add(1);
        let (passes, due) = (self.passes, &self.due);
        // A slot forgotten and written again within a pass is listed twice.
        self.watched
            .retain(|n| due.get(*n).is_some_and(|d| *d != 0));
        self.watched.sort_unstable();
        self.watched.dedup();
        self.pass.clear();
        self.pass.extend(
            self.watched
                .iter()
                .filter(|n| due.get(**n).is_some_and(|d| *d <= passes)),
        );
        if sweep && count > 0 {
            let width = count.div_ceil(SWEEP_PASSES);
            let from = self.sweep_from;
            self.pass.extend((0..width).map(|i| (from + i) % count));
            self.sweep_from = (from + width) % count;
            self.pass.sort_unstable();
            self.pass.dedup();
        }
    }
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
    /// Runs `step` on `key`'s shared slot, written back with the token it was read with;
    /// `None` when the slot holds another key (it went to one while a call was out) or stays
    /// contended.
    fn on_slot<T>(
        &mut self,
        key: WindowKeyRef<'_>,
        now_ms: u64,
        release_claim: bool,
        mut step: impl FnMut(&mut One<'_, H>) -> T,
    ) -> Option<T> {
        if let Some((slots, _)) = &self.state.slots {
            for _ in 0..CAS_TRIES {
                let Some(mut loaded) = slots.load(self.host, key, now_ms) else {
                    break;
                };
                if release_claim {
                    loaded.claim = 0;
                }
                let mut one = One::new(loaded.state, self.host);
                let out = step(&mut one);
                loaded.state = one.state;
                match Slots::store(self.host, &loaded, key) {
                    Ok(()) => {
                        self.state.replay.watch(loaded.index);
                        return Some(out);
                    }
                    Err(SetError::CasMismatch) => continue,
                    Err(SetError::Refused) => break,
                }
            }
        }
        None
    }

    /// Begins one limit on its shared slot; `None` when the slot holds another live key or
    /// stays contended (the VM's table takes the request then).
    fn begin_shared(&mut self, limit: &LimitRequest<'_>, now_ms: u64) -> Option<Begin> {
        let (slots, _) = self.state.slots.as_ref()?;
        let policy = self.state.table.config().origin;
        for _ in 0..CAS_TRIES {
            let mut loaded = slots.load(self.host, limit.key, now_ms)?;
            let mut one = One::new(loaded.state, self.host);
            let begun = request::begin(&mut one, std::slice::from_ref(limit), now_ms, &policy);
            loaded.state = one.state;
            match Slots::store(self.host, &loaded, limit.key) {
                Ok(()) => {
                    self.state.replay.watch(loaded.index);
                    return Some(begun);
                }
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Refused) => return None,
            }
        }
        None
    }

    /// The replay events of the pass's slots from position `from` on (a pass begins at 0):
    /// each slot's events taken under a claim until the batch's answer is due, and its state
    /// written back (taking them may release an idle lease); a slot claimed by another VM's
    /// replay, or written meanwhile, waits for the next pass.
    fn take_shared(
        &mut self,
        max: usize,
        now_ms: u64,
        pace: Option<QuietPace>,
        from: usize,
    ) -> (ReplayBatch, Option<usize>) {
        let mut events: Vec<ReplayEvent> = Vec::new();
        let mut held = 0;
        let Some(count) = self.state.slots.as_ref().map(|(s, _)| s.count()) else {
            return (ReplayBatch { events, held }, None);
        };
        if from == 0 {
            let sweep = self.sweep_turn(now_ms);
            self.state.replay.begin_pass(count, sweep);
        }
        for i in from.. {
            let Some(n) = self.state.replay.pass.get(i).copied() else {
                break;
            };
            if events.len() >= max {
                return (ReplayBatch { events, held }, Some(i));
            }
            let slot = u32::try_from(n).unwrap_or(u32::MAX);
            let paced = pace.as_ref().map(|p| (p, slot));
            let wait = self.take_slot(n, now_ms, paced, &mut events, &mut held);
            let r = &mut self.state.replay;
            r.set_due(n, wait.map_or(0, |w| r.passes.saturating_add(w)));
        }
        (ReplayBatch { events, held }, None)
    }

    /// Adds slot `n`'s replay events to `events` (its current cell held back as `pace` says,
    /// counted in `held`), writing the slot back claimed until the batch's answer is due;
    /// the passes until it is read again (`None`: it needs nothing more of the replay, or
    /// holds only a lease far from its limit, which nothing needs back; the sweep comes by
    /// meanwhile).
    fn take_slot(
        &self,
        n: usize,
        now_ms: u64,
        pace: Option<(&QuietPace, u32)>,
        events: &mut Vec<ReplayEvent>,
        held: &mut usize,
    ) -> Option<u32> {
        let (bytes, cas) = Slots::read(self.host, n)?;
        let (claim, entry, mut state) = decode_slot(&bytes)?;
        if claim > now_ms {
            return Some(1); // another VM's batch is out
        }
        let key = WindowDuration::from_ms(entry.duration_ms)
            .ok()
            .and_then(|d| WindowKeyRef::new(WORKSPACE, entry.namespace, entry.identifier, d).ok())?
            .to_owned_key();
        let (before, before_state) = (events.len(), state);
        let take = state.take_replay_events(&key, now_ms, 0, pace, events);
        if take == Take::Done {
            return None;
        }
        if take == Take::Held {
            *held += 1;
        }
        if state == before_state && events.len() == before {
            // A held cell is read on every pass (its turn or its lease's margin may come); a
            // lease is watched until it sits idle near the limit.
            return if take == Take::Held {
                Some(1)
            } else {
                (!state.lease_is_far(key.duration(), now_ms)).then_some(QUIET_PASSES)
            };
        }
        let claim = if events.len() > before {
            now_ms.saturating_add(self.state.claim_ms)
        } else {
            0
        };
        if Slots::write(self.host, n, claim, entry, &state, cas).is_err() {
            events.truncate(before); // written meanwhile: the next pass
        }
        Some(1)
    }

    /// Whether this VM sweeps this pass: it holds the sweep lease in shared data, or takes it
    /// (free, expired, or its own), for three replay intervals.
    fn sweep_turn(&self, now_ms: u64) -> bool {
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
            (SHARED, [limit]) => {
                let key = limit.key.as_ref();
                let merged = self.on_slot(key, now_ms, false, |one| {
                    request::finish(one, call, answers, now_ms)
                });
                // The slot is out of reach: the origin counted what it decided, so the answer
                // is the decision; the lease it lent goes unused until it ends.
                merged.unwrap_or_else(|| {
                    let cold = WindowState::new(key.duration(), now_ms);
                    request::finish(&mut One::new(cold, self.host), call, answers, now_ms)
                })
            }
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
            (SHARED, [limit]) => {
                let failed = self.on_slot(limit.key.as_ref(), now_ms, false, |one| {
                    request::fail(one, call, now_ms, &policy)
                });
                // The slot is out of reach: the failure mode decides on the VM's table, which
                // counts what it admits and replays it (a pass decided on a copy would be
                // counted nowhere).
                failed.unwrap_or_else(|| {
                    let limits = [limit.request()];
                    self.state
                        .table
                        .decide_failed(&limits, policy.failure_mode, now_ms)
                        .unwrap_or_else(|_| refused(call))
                })
            }
            _ => self
                .state
                .table
                .fail(call, now_ms)
                .unwrap_or_else(|_| refused(call)),
        }
    }

    fn failure_mode(&self) -> FailureMode {
        self.state.table.config().origin.failure_mode
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
}

impl<H: Host> Replays for Homes<'_, H> {
    fn take_replay(
        &mut self,
        home: Home,
        max: usize,
        now_ms: u64,
        pace: Option<QuietPace>,
        from: usize,
    ) -> (ReplayBatch, Option<usize>) {
        if home == SHARED {
            return self.take_shared(max.min(SLOT_BATCH), now_ms, pace, from);
        }
        self.state.table.take_replay_from(max, now_ms, pace, from)
    }

    fn lease_ms(&self, _: Home) -> u64 {
        // The slots' leases come from the same origin as the table's.
        self.state.table.lease_ms()
    }

    fn ack_replay(
        &mut self,
        home: Home,
        batch: &ReplayBatch,
        answer: &CellsResponse,
        sent_ms: u64,
        now_ms: u64,
    ) {
        if home != SHARED {
            self.state.table.ack_replay(batch, &answer.cells);
            return self
                .state
                .table
                .renewed_all(batch, &answer.renewed, sent_ms);
        }
        // The shared slots ask for no renewal (their replay takes no renew window).
        for (event, counts) in batch.events.iter().zip(&answer.cells) {
            // A slot out of reach keeps its events: the next pass sends them again.
            let _ = self.on_slot(event.key.as_ref(), now_ms, true, |one| {
                one.state
                    .apply_replay(event.sequence, *counts, event.used, event.undo_from);
            });
        }
    }

    fn periodic(&self, home: Home) -> bool {
        home == SHARED
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_watched_pass_after_pass_is_listed_once() {
        let mut r = SlotReplay::new(8);
        r.watch(3);
        for _ in 0..1_000 {
            r.begin_pass(8, false);
            assert_eq!(r.pass, [3]);
            r.set_due(3, r.passes.saturating_add(1)); // events taken again
            r.watch(3); // and a request wrote it
        }
        r.set_due(3, 0); // forgotten, then written again within one pass
        r.watch(3);
        r.begin_pass(8, false);
        assert_eq!((r.watched.len(), r.pass.len()), (1, 1));
    }
}
