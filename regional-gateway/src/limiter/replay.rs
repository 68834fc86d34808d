//! The gateway's replay on the core's flow, as a Wasm shell's: one lane over the sharded tables,
//! passed over every replay interval (a periodic home), in batches of [`REPLAY_STEP`] cells,
//! quiet cells and passes ahead paced by the region's view as this gateway states it to its
//! callers, a failed batch sent again after the core's backoff. What is the gateway's own: its
//! origin is called in process (no HTTP), a yield follows each batch, and a pass's wall time
//! goes to `strata_replay_pass_seconds`.

use std::time::{Duration, Instant};

use strata_core::driver::{Flow, FlowConfig, Home, Outgoing, Replays, Store};
use strata_core::origin::OriginAnswer;
use strata_core::replay::{QuietPace, ReplayBatch, ReplayEvent};
use strata_core::request::{Begin, OriginCall};
use strata_core::table::{LimitRequest, TooManyLimits};
use strata_core::wire::{CellsResponse, ReplayRef};
use strata_core::{FailureMode, MultiDecision};

use super::flows::Tables;
use super::{Limiter, REPLAY_STEP};
use crate::local::ReplayCursor;

/// The one home of the gateway's tables.
const HOME: Home = Home(0);

/// What one pass of the replay did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayPass {
    /// Batches sent.
    pub batches: usize,
    /// Cells they carried.
    pub cells: usize,
    /// Batches that failed (no answer, or a cell the origin could not merge).
    pub failed: usize,
}

/// The replay's flow, and the flush interval the pace it states follows.
#[derive(Debug)]
pub struct ReplayPump {
    flow: Flow,
    flush_ms: u64,
}

impl ReplayPump {
    /// A pump replaying `limiter`'s tables every `interval_ms` (the first pass one interval
    /// from now); the pace of quiet cells follows a flush every `flush_ms`.
    pub fn new(limiter: &Limiter, interval_ms: u64, flush_ms: u64) -> Self {
        let config = FlowConfig {
            timeout_ms: limiter.flows.timeout_ms(),
            replay_interval_ms: interval_ms,
            replay_batch: REPLAY_STEP,
        };
        let mut flow = Flow::new(config);
        // The periodic lane's first pass is armed by the flow's first look at the time.
        flow.timeout(&mut GatewayReplays { limiter }, limiter.clock.now_ms());
        Self { flow, flush_ms }
    }

    /// When the next pass is due, on the limiter's clock.
    pub fn next_at(&self) -> Option<u64> {
        self.flow.poll_timeout()
    }

    /// Runs the pass due now, if one is: each batch sent to the origin and answered before
    /// the next is taken, with a yield between two.
    pub async fn pass(&mut self, limiter: &Limiter) -> ReplayPass {
        let started = Instant::now();
        let mut store = GatewayReplays { limiter };
        self.flow.set_pace(HOME, limiter.replay_pace(self.flush_ms));
        self.flow.timeout(&mut store, limiter.clock.now_ms());
        let mut pass = ReplayPass::default();
        while let Some(d) = self.flow.poll_dispatch() {
            let Outgoing::Replay(batch) = &d.outgoing else {
                continue; // no decision goes through this flow
            };
            pass.batches += 1;
            pass.cells += batch.len();
            let bound = Duration::from_millis(d.timeout_ms);
            let answer = send(limiter, batch, d.at_ms, bound, self.flush_ms).await;
            let now = limiter.clock.now_ms();
            match answer {
                Ok(answer) => self.flow.replayed(&mut store, d.call, &answer, now),
                Err(why) => {
                    pass.failed += 1;
                    limiter.metrics.replay_failed();
                    self.flow.failed(&mut store, d.call, &why, now);
                }
            }
            tokio::task::yield_now().await;
        }
        while let Some(line) = self.flow.poll_log() {
            if line.warn {
                tracing::warn!("{}", line.message);
            } else {
                tracing::info!("{}", line.message);
            }
        }
        if pass.batches > 0 {
            limiter.metrics.replay_pass(started.elapsed().as_secs_f64());
        }
        pass
    }
}

/// Sends `batch`, taken at `at_ms`, to the origin within `bound`: every cell's answer, with
/// the pace of a flush every `flush_ms`, or why the batch failed. A cell the origin could not
/// merge fails the batch, as `/v1/origin/replay` answers a Wasm shell; the cells it merged are
/// acknowledged first, so only that cell and the ones after it go again.
async fn send(
    limiter: &Limiter,
    batch: &ReplayBatch,
    at_ms: u64,
    bound: Duration,
    flush_ms: u64,
) -> Result<CellsResponse, String> {
    let refs: Vec<ReplayRef<'_>> = batch.events.iter().map(ReplayEvent::replay_ref).collect();
    let answers = tokio::time::timeout(bound, limiter.replay_refs(&limiter.instance, &refs, at_ms))
        .await
        .map_err(|_| format!("no answer within {bound:?}"))?
        .map_err(|e| e.to_string())?;
    limiter.replay_answer(&answers, flush_ms).map_err(|_| {
        limiter.ack_delivered(batch, &answers, at_ms);
        "the origin could not merge a cell".to_string()
    })
}

/// The gateway's tables as the replay's store: the decision steps as the request flows take
/// them ([`Tables`]), and the replay's over every shard, on the limiter's clock.
struct GatewayReplays<'a> {
    limiter: &'a Limiter,
}

impl GatewayReplays<'_> {
    fn tables(&self) -> Tables<'_> {
        self.limiter.tables()
    }
}

impl Store for GatewayReplays<'_> {
    fn begin(
        &mut self,
        limits: &[LimitRequest<'_>],
        now_ms: u64,
    ) -> Result<(Begin, Home), TooManyLimits> {
        self.tables().begin(limits, now_ms)
    }
    fn finish(
        &mut self,
        home: Home,
        call: &OriginCall,
        answers: &[OriginAnswer],
        now_ms: u64,
    ) -> MultiDecision {
        self.tables().finish(home, call, answers, now_ms)
    }
    fn fail(&mut self, home: Home, call: &OriginCall, now_ms: u64) -> MultiDecision {
        self.tables().fail(home, call, now_ms)
    }
    fn failure_mode(&self) -> FailureMode {
        self.limiter.local.policy().failure_mode
    }
    fn instance(&self, _: Home) -> &str {
        &self.limiter.instance
    }
}

impl Replays for GatewayReplays<'_> {
    fn take_replay(
        &mut self,
        _: Home,
        max: usize,
        now_ms: u64,
        pace: Option<QuietPace>,
        from: usize,
    ) -> (ReplayBatch, Option<usize>) {
        let shards = self.limiter.local.shard_count().max(1);
        let from = ReplayCursor {
            shard: from % shards,
            at: from / shards,
        };
        let (batch, next) = self.limiter.local.take_replay(max, now_ms, pace, from);
        // A pass's position, one number: the place in a shard's touched list, then the shard.
        let next = next.map(|c| c.at.saturating_mul(shards).saturating_add(c.shard));
        (batch, next)
    }
    fn lease_ms(&self, _: Home) -> u64 {
        self.limiter.origin.lease_ms()
    }
    fn ack_replay(
        &mut self,
        _: Home,
        batch: &ReplayBatch,
        answer: &CellsResponse,
        sent_ms: u64,
        _: u64,
    ) {
        // The answer back in `replay_refs`'s shape (every cell merged; the leases it renewed
        // by event, each for the origin's lifetime, which `ack_delivered` applies).
        let mut renewed = answer.renewed.iter().peekable();
        let answers: Vec<_> = (0_u64..)
            .zip(&answer.cells)
            .map(|(i, counts)| {
                let lease_id = renewed.next_if(|r| r.event == i).map_or(0, |r| r.lease_id);
                Some((*counts, lease_id))
            })
            .collect();
        self.limiter.ack_delivered(batch, &answers, sent_ms);
    }
    fn periodic(&self, _: Home) -> bool {
        true
    }
}
