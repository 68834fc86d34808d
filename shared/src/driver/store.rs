//! Where a shell keeps the window keys' states, as the driver's flow reaches them: one step of
//! the core's request path (`crate::request`) per method, run on the states of one group of
//! limits.

use alloc::string::String;

use crate::decision::{Decision, MultiDecision};
use crate::limit::LimitRequest;
use crate::origin::OriginAnswer;
use crate::policy::FailureMode;
use crate::replay::{QuietPace, ReplayBatch};
use crate::request::{Begin, OriginCall};
use crate::table::{CounterTable, TooManyLimits};
use crate::wire::CellsResponse;

/// One place a store keeps states, with its own instance id at the gateway and its own
/// replay: a process's table, or the slots an Envoy's VMs share.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Home(pub u8);

/// The window keys' states, held where the shell holds them: the steps of a request's
/// decision (the replay's are [`Replays`]).
pub trait Store {
    /// Begins one group of a request's limits, on states the store chooses (and says where).
    fn begin(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<(Begin, Home), TooManyLimits>;
    /// Merges the gateway's answers to `call`, begun in `home`.
    fn finish(
        &mut self,
        home: Home,
        call: &OriginCall,
        answers: &[OriginAnswer],
        now_ms: u64,
    ) -> MultiDecision;
    /// `call` got no answer: recorded on its cells, and decided per the failure mode.
    fn fail(&mut self, home: Home, call: &OriginCall, now_ms: u64) -> MultiDecision;
    /// The failure mode `fail` decides by (named in the flow's log).
    fn failure_mode(&self) -> FailureMode;
    /// The instance id calls for `home` are made under.
    fn instance(&self, home: Home) -> &str;
    /// How many homes the flow replays (`Home(0)` to `Home(n - 1)`, through [`Replays`]);
    /// none for a shell that replays its states itself (the gateway, which paces its replay
    /// by the region's view).
    fn homes(&self) -> u8 {
        1
    }
}

/// The replay side of a [`Store`]: what the flow's replay lanes take from each home and give
/// back. A shell whose replay is not the flow's (the gateway) implements only [`Store`].
pub trait Replays: Store {
    /// Up to `max` cells of `home` holding cost the gateway has not acknowledged, from
    /// position `from` of a pass, quiet ones held back as `pace` says (`None`: none held);
    /// where the pass goes on (`None`: done).
    fn take_replay(
        &mut self,
        home: Home,
        max: usize,
        now_ms: u64,
        pace: Option<QuietPace>,
        from: usize,
    ) -> (ReplayBatch, Option<usize>);
    /// The lifetime of the leases the gateway lent `home` last: a quiet cell's lease far
    /// from the limit goes within its renewal window.
    fn lease_ms(&self, home: Home) -> u64;
    /// The gateway took `batch`, sent at `sent_ms`: `answer.cells[i]` is event `i`'s cell
    /// after it, and `answer.renewed` the leases it renewed (each from `sent_ms`).
    fn ack_replay(
        &mut self,
        home: Home,
        batch: &ReplayBatch,
        answer: &CellsResponse,
        sent_ms: u64,
        now_ms: u64,
    );
    /// Whether `home` is replayed every interval, whether or not this process's own
    /// requests used it (a home others write to).
    fn periodic(&self, _home: Home) -> bool {
        false
    }
}

/// A process's own table as the one home: the edge's store.
#[derive(Debug)]
pub struct TableStore {
    /// The table.
    pub table: CounterTable,
    /// The instance id the gateway knows this process by.
    pub instance: String,
}

impl Store for TableStore {
    fn begin(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<(Begin, Home), TooManyLimits> {
        Ok((self.table.begin(limits, now_ms)?, Home(0)))
    }
    fn finish(
        &mut self,
        _: Home,
        call: &OriginCall,
        answers: &[OriginAnswer],
        now_ms: u64,
    ) -> MultiDecision {
        self.table
            .finish(call, answers, now_ms)
            .unwrap_or_else(|_| refused(call))
    }
    fn fail(&mut self, _: Home, call: &OriginCall, now_ms: u64) -> MultiDecision {
        self.table
            .fail(call, now_ms)
            .unwrap_or_else(|_| refused(call))
    }
    fn failure_mode(&self) -> FailureMode {
        self.table.config().origin.failure_mode
    }
    fn instance(&self, _: Home) -> &str {
        &self.instance
    }
}

impl Replays for TableStore {
    fn take_replay(
        &mut self,
        _: Home,
        max: usize,
        now_ms: u64,
        pace: Option<QuietPace>,
        from: usize,
    ) -> (ReplayBatch, Option<usize>) {
        self.table.take_replay_from(max, now_ms, pace, from)
    }
    fn lease_ms(&self, _: Home) -> u64 {
        self.table.lease_ms()
    }
    fn ack_replay(
        &mut self,
        _: Home,
        batch: &ReplayBatch,
        answer: &CellsResponse,
        sent_ms: u64,
        _: u64,
    ) {
        self.table.ack_replay(batch, &answer.cells);
        self.table.renewed_all(batch, &answer.renewed, sent_ms);
    }
}

/// The denial of a call whose limits no longer fit the table (only a call larger than the
/// table, which `begin` refuses first).
pub fn refused(call: &OriginCall) -> MultiDecision {
    MultiDecision {
        success: false,
        decisions: call
            .limits()
            .iter()
            .map(|l| Decision {
                success: false,
                limit: l.limit,
                remaining: 0,
                reset_ms: 0,
                retry_after_ms: Some(1_000),
            })
            .collect(),
    }
}
