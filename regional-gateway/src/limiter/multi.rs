//! Multi-limit requests: all or nothing across the gateway's shards. Every involved shard is
//! locked (in shard order) for each step of the core's request path, never across an await.

use std::sync::MutexGuard;

use strata_core::request::{self, Begin, OriginCall, States};
use strata_core::table::LimitRequest;
use strata_core::{CounterTable, MultiDecision, WindowKeyRef, WindowState};

use super::{Limiter, keys};
use crate::metrics::Source;

/// The states of a request's limits in their locked shards.
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

impl Limiter {
    fn locked<'t, 'k>(&'t self, keys: Vec<WindowKeyRef<'k>>, now_ms: u64) -> Locked<'t, 'k> {
        let (tables, position) = self.local.lock_many(&keys);
        Locked {
            tables,
            position,
            keys,
            now_ms,
        }
    }

    /// Decides several limits, all or nothing: locally if the local view denies one or every
    /// lease covers its limit, otherwise all of them in one origin decision.
    pub async fn decide_all(&self, limits: &[LimitRequest<'_>]) -> MultiDecision {
        let now = self.clock.now_ms();
        let begun = request::begin(
            &mut self.locked(keys(limits), now),
            limits,
            now,
            self.local.policy(),
        );
        let (multi, source) = match begun {
            Begin::Decided(multi) => (multi, Source::Local),
            Begin::Fallback(multi) => (multi, Source::Fallback),
            // Boxed, as in `decide`: only a call to the origin pays for its future.
            Begin::Call(call) => Box::pin(self.decide_at_origin(&call)).await,
        };
        for d in &multi.decisions {
            self.metrics.decision(source, multi.success && d.success);
        }
        multi
    }

    /// Decides `call` at the origin and merges the answers into the shards of its limits, or,
    /// if the origin cannot decide, decides them per the failure mode.
    pub(super) async fn decide_at_origin(&self, call: &OriginCall) -> (MultiDecision, Source) {
        let Ok(answers) = self.ask_origin(call).await else {
            return (self.fail_call(call), Source::Fallback);
        };
        let now = self.clock.now_ms();
        let mut locked = self.locked(call_keys(call), now);
        (
            request::finish(&mut locked, call, &answers, now),
            Source::Origin,
        )
    }

    /// Decides `call` as failed, without sending it, per the failure mode (the failure is
    /// recorded on its cells).
    pub(super) fn fail_call(&self, call: &OriginCall) -> MultiDecision {
        let now = self.clock.now_ms();
        request::fail(
            &mut self.locked(call_keys(call), now),
            call,
            now,
            self.local.policy(),
        )
    }
}

/// The keys of `call`'s limits, in order.
fn call_keys(call: &OriginCall) -> Vec<WindowKeyRef<'_>> {
    call.limits().iter().map(|l| l.key.as_ref()).collect()
}
