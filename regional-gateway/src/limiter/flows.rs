//! The core's request flow ([`Flow`]) in a multi-threaded process: one flow per shard of
//! window keys (a request goes to the flow of its first key, so a burst on a key meets its
//! call in flight), each behind a mutex held for the steps of one event, never across an
//! await; and the gateway's sharded tables as the flow's store.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard};

use foldhash::fast::RandomState;
use strata_core::driver::{Dispatch, Flow, FlowConfig, GroupDone, Home, Store};
use strata_core::origin::OriginAnswer;
use strata_core::request::{self, Begin, OriginCall, States};
use strata_core::table::{LimitRequest, TooManyLimits};
use strata_core::{CounterTable, FailureMode, MultiDecision, WindowKeyRef, WindowState};
use tokio::sync::oneshot;

use crate::local::LocalTables;

/// One flow, and the wake-ups of the requests waiting in it.
#[derive(Debug)]
pub(crate) struct FlowShard {
    pub(crate) flow: Flow,
    pub(crate) waiting: HashMap<u64, oneshot::Sender<GroupDone>>,
}

impl FlowShard {
    /// Wakes the requests the flow settled (decided, or to begin again), and returns the
    /// calls it wants made.
    pub(crate) fn drain(&mut self) -> Vec<Dispatch> {
        while let Some(done) = self.flow.poll_done() {
            if let Some(wake) = self.waiting.remove(&done.group.0) {
                // A receiver gone is a request whose client hung up: nothing to answer.
                let _ = wake.send(done);
            }
        }
        while let Some(line) = self.flow.poll_log() {
            if line.warn {
                tracing::warn!("{}", line.message);
            } else {
                tracing::info!("{}", line.message);
            }
        }
        std::iter::from_fn(|| self.flow.poll_dispatch()).collect()
    }
}

/// The flows, by a hash of a request's first window key.
#[derive(Debug)]
pub struct Flows {
    shards: Box<[Mutex<FlowShard>]>,
    hasher: RandomState,
    config: FlowConfig,
}

impl Flows {
    /// `n` flows (at least one), each bounding a request's wait by `config.timeout_ms`.
    pub fn new(n: usize, config: FlowConfig) -> Self {
        let shards = (0..n.max(1))
            .map(|_| {
                Mutex::new(FlowShard {
                    flow: Flow::new(config),
                    waiting: HashMap::new(),
                })
            })
            .collect();
        Self {
            shards,
            hasher: RandomState::default(),
            config,
        }
    }

    /// How long a request may wait for the origin, from its arrival.
    pub fn timeout_ms(&self) -> u64 {
        self.config.timeout_ms
    }

    /// The flow a request of `limits` goes to.
    pub(crate) fn shard_of(&self, limits: &[LimitRequest<'_>]) -> usize {
        let hash = limits.first().map_or(0, |l| self.hasher.hash_one(l.key));
        // The low bits pick the flow (truncation is the point).
        #[allow(clippy::cast_possible_truncation)]
        let low = hash as usize;
        low % self.shards.len()
    }

    /// Flow `i`, locked.
    pub(crate) fn lock(&self, i: usize) -> MutexGuard<'_, FlowShard> {
        let shard = &self.shards[i % self.shards.len()]; // in range: never empty
        // Each event leaves a flow consistent: a lock poisoned by a panicking holder is usable.
        shard.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decision calls in flight, over every flow.
    pub fn calls(&self) -> usize {
        (0..self.shards.len())
            .map(|i| self.lock(i).flow.calls())
            .sum()
    }

    /// Requests waiting for a call, over every flow.
    pub fn waiting(&self) -> usize {
        (0..self.shards.len())
            .map(|i| self.lock(i).flow.waiting())
            .sum()
    }
}

/// The gateway's tables as the flow's store: one home, which the gateway's own replay loop
/// replays (paced by the region's view), so the flow replays none (a [`Store`], not a
/// [`Replays`](strata_core::driver::Replays)).
pub(crate) struct Tables<'a> {
    pub(crate) local: &'a LocalTables,
    pub(crate) instance: &'a str,
}

impl Store for Tables<'_> {
    fn begin(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<(Begin, Home), TooManyLimits> {
        // One limit, the common case: one shard, no lists.
        let begun = match limits {
            [one] => self.local.lock(one.key).begin(limits, now_ms)?,
            _ => request::begin(
                &mut self.locked(limits.iter().map(|l| l.key).collect(), now_ms),
                limits,
                now_ms,
                self.local.policy(),
            ),
        };
        Ok((begun, Home(0)))
    }
    fn finish(
        &mut self,
        _: Home,
        call: &OriginCall,
        answers: &[OriginAnswer],
        now_ms: u64,
    ) -> MultiDecision {
        request::finish(
            &mut self.locked(call_keys(call), now_ms),
            call,
            answers,
            now_ms,
        )
    }
    fn fail(&mut self, _: Home, call: &OriginCall, now_ms: u64) -> MultiDecision {
        let mut locked = self.locked(call_keys(call), now_ms);
        request::fail(&mut locked, call, now_ms, self.local.policy())
    }
    fn failure_mode(&self) -> FailureMode {
        self.local.policy().failure_mode
    }
    fn instance(&self, _: Home) -> &str {
        self.instance
    }
    fn homes(&self) -> u8 {
        0 // the gateway's replay loop replays its tables, paced by the region's view
    }
}

impl Tables<'_> {
    fn locked<'t, 'k>(&'t self, keys: Vec<WindowKeyRef<'k>>, now_ms: u64) -> Locked<'t, 'k> {
        let (tables, position) = self.local.lock_many(&keys);
        Locked {
            tables,
            position,
            keys,
            now_ms,
        }
    }
}

/// The states of a request's limits in their locked shards (locked in shard order, so
/// concurrent multi-limit requests cannot deadlock).
struct Locked<'t, 'k> {
    tables: Vec<MutexGuard<'t, CounterTable>>,
    position: Vec<usize>,
    keys: Vec<WindowKeyRef<'k>>,
    now_ms: u64,
}

impl States for Locked<'_, '_> {
    fn state(&mut self, i: usize) -> Option<&mut WindowState> {
        let key = *self.keys.get(i)?;
        let table = self.tables.get_mut(*self.position.get(i)?)?;
        Some(table.entry(key, self.now_ms))
    }
    fn same(&self, i: usize, j: usize) -> bool {
        self.keys.get(i) == self.keys.get(j)
    }
    fn next_call(&mut self, i: usize) -> u64 {
        let position = self.position.get(i).copied().unwrap_or(0);
        self.tables.get_mut(position).map_or(0, |t| t.next_call())
    }
}

/// The keys of `call`'s limits, in order.
fn call_keys(call: &OriginCall) -> Vec<WindowKeyRef<'_>> {
    call.limits().iter().map(|l| l.key.as_ref()).collect()
}
