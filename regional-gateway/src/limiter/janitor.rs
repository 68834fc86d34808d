//! The janitor's pass: expired entries dropped from the local tables, the embedded origin and
//! the region view, in steps that each hold one lock briefly, with a yield to the requests
//! between two (at a million keys one sweep of everything held a worker for tens of
//! milliseconds, and the embedded origin's lock, which every origin decision takes, as long).

use super::Limiter;
use crate::origin::PurgeCursor;
use crate::steps::in_steps;

/// Slots each local shard's step looks at (a shard's scan goes on from where its last stopped,
/// so a large shard is swept over several passes).
pub const JANITOR_SCAN: usize = 20_000;

/// Buckets of one of the embedded origin's subtables a step looks at (a few hundred
/// microseconds; a pass takes at least one step per subtable).
pub const ORIGIN_PURGE_STEP: usize = 8_192;

/// What one janitor pass dropped, and in how many steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Purged {
    /// Entries of the local tables.
    pub local: usize,
    /// Cells of the embedded origin.
    pub origin: usize,
    /// Entries of the region view.
    pub view: usize,
    /// Steps, each one lock held once; the pass yielded between two.
    pub steps: usize,
}

impl Limiter {
    /// One janitor pass at the clock's time: each local shard, the embedded origin's subtables
    /// in steps of up to [`ORIGIN_PURGE_STEP`] buckets, then the region view, yielding
    /// between steps.
    pub async fn janitor_pass(&self) -> Purged {
        let now = self.clock.now_ms();
        let (mut local, mut origin) = (0, 0);
        let shards = self.local.shard_count();
        let mut steps = in_steps(0, |shard| {
            local += self.local.purge_expired(shard, now, JANITOR_SCAN);
            (shard + 1 < shards).then_some(shard + 1)
        })
        .await;
        steps += in_steps(PurgeCursor::default(), |at| {
            let (dropped, next) = self.origin.purge_expired(now, at, ORIGIN_PURGE_STEP);
            origin += dropped;
            next
        })
        .await;
        Purged {
            local,
            origin,
            view: self.global.purge_expired(now, JANITOR_SCAN),
            steps: steps + 1,
        }
    }
}
