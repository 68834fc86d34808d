//! The replay buffer: what a process admitted locally reaches the origin in batches.
//!
//! Each cell keeps this process's cumulative own count (`CellState::own`) and the largest value
//! the origin acknowledged; a replay carries the cumulative value, which the origin merges
//! with `max` per process. So a batch that timed out after the origin applied it, or that is
//! sent twice, counts once; a batch that failed is not put back anywhere, because the values
//! it carried are still in the table and the next batch carries them (or larger ones); and a
//! cost in flight still counts wherever this process reports its own count (every origin
//! decision carries it too). The table's touched list finds the cells without a scan, and a
//! local pass adds nothing to it beyond a flag (no allocation: it grows with the slab).

use alloc::string::ToString;
use alloc::vec::Vec;

use crate::cell::WindowState;
use crate::decision::Counts;
use crate::gcounter::PublishPolicy;
use crate::identity::WindowKey;
use crate::policy::AHEAD_LIMIT_PER_COST;
use crate::slab::unacked;
use crate::table::CounterTable;
use crate::window::WindowDuration;
use crate::wire;

/// One cell's own cumulative count, to replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayEvent {
    /// The window key.
    pub key: WindowKey,
    /// The cell's sequence.
    pub sequence: u64,
    /// This process's cumulative admitted cost in the cell.
    pub used: u64,
    /// The latest limit of the key (the origin's publish floor follows it).
    pub limit: u64,
    /// The id of the lease this process gives back on the cell (0: none); it stopped using it
    /// first.
    pub release: u64,
    /// The id of the lease in use on the cell that this process asks the origin to keep
    /// reserving for another lease lifetime (0: none): a lease in use in the last quarter of
    /// its lifetime, renewed off the request path instead of by the next request's decision.
    pub renew: u64,
    /// The largest `used` the origin acknowledged for the cell (so an origin that agrees
    /// adds the difference without reading first).
    pub acked: u64,
    /// Undo what this process's decision call with this id counted on the cell (0: nothing):
    /// its answer was lost ([`WindowState::uncertain_from`]).
    pub undo_from: u64,
}

impl ReplayEvent {
    /// The event as an origin takes it: what a validated `/v1/origin/replay` event holds.
    pub fn replay_ref(&self) -> wire::ReplayRef<'_> {
        wire::ReplayRef {
            cell: wire::CellRef {
                key: self.key.as_ref(),
                sequence: self.sequence,
            },
            used: self.used,
            limit: self.limit,
            release: self.release,
            renew: self.renew,
            acked: self.acked,
            undo_from: self.undo_from,
        }
    }
}

/// Cells to replay in one call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayBatch {
    /// The cells, at most one event each.
    pub events: Vec<ReplayEvent>,
    /// Cells holding cost that the take held back for a later pass ([`QuietPace`]): a shell
    /// that replays only when its requests used a cell still owes them a pass.
    pub held: usize,
}

impl ReplayBatch {
    /// Whether there is nothing to send.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Cells in the batch.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// The `POST /v1/origin/replay` body.
    pub fn to_wire(&self, instance: &str) -> wire::ReplayRequest {
        wire::ReplayRequest {
            instance: instance.to_string(),
            events: self
                .events
                .iter()
                .map(|e| wire::ReplayEvent {
                    namespace: e.key.as_ref().namespace().to_string(),
                    identifier: e.key.as_ref().identifier().to_string(),
                    duration: e.key.duration().as_ms(),
                    sequence: e.sequence,
                    used: e.used,
                    limit: e.limit,
                    release: e.release,
                    acked: e.acked,
                    renew: e.renew,
                    undo_from: e.undo_from,
                })
                .collect(),
        }
    }
}

impl WindowState {
    /// Whether the current cell's count and lease stay within half the limit, with no recent
    /// denial: there a lease is kept the same whoever asks (it may be renewed off the request
    /// path, and nothing needs it back when it sits idle), while near the limit the next
    /// decision must size it afresh from the others' use.
    pub fn lease_is_far(&self, duration: WindowDuration, now_ms: u64) -> bool {
        self.current()
            .counts()
            .total()
            .saturating_add(self.lease_room(duration, now_ms))
            <= self.limit() / 2
            && now_ms >= self.strict_until()
    }

    /// Adds to `events` what a replay pass takes from this state (of window key `key`) at
    /// `now_ms`: an event per cell holding own cost the origin has not acknowledged, and the
    /// lease, released, if it sat idle near the limit for a pass (see
    /// [`WindowState::idle_lease`]). The current cell's event is held back while `pace`
    /// holds it ([`QuietPace::holds`]; the state in the table's slot `slot`). Returns
    /// [`Take::Done`] when nothing of it concerns the replay any more (no unacknowledged
    /// cost, no lease to watch).
    ///
    /// With `renew_within` above 0, a lease in use (own cost unacknowledged) that ends within
    /// that many ms, on a cell whose count and lease stay within half the limit, is asked to
    /// be renewed ([`ReplayEvent::renew`]).
    pub fn take_replay_events(
        &mut self,
        key: &WindowKey,
        now_ms: u64,
        renew_within: u64,
        pace: Option<(&QuietPace, u32)>,
        events: &mut Vec<ReplayEvent>,
    ) -> Take {
        let idle = self.idle_lease(now_ms) || self.lease_surplus(key.duration(), now_ms);
        let holds = self.current().lease_left() > 0 && self.current().is_fresh(now_ms);
        // A lease lent on the previous cell after this process left it (`apply_decided`).
        let left_behind = self.previous.lease_left() > 0;
        // Calls whose answers were lost: the undo goes with this pass, whatever else does.
        let (undo_from, undo_previous) = (self.uncertain_from(), self.uncertain_previous());
        if !(idle
            || holds
            || left_behind
            || unacked(self) > 0
            || undo_from != 0
            || undo_previous != 0)
        {
            return Take::Done;
        }
        let previous_release = if left_behind {
            self.previous.stop_lease()
        } else {
            0
        };
        // The current cell's window is over on this process's clock (no request came since):
        // its lease admits nothing more, as a request now would roll the state first, so
        // what is left of it goes back with this pass rather than weigh, reserved, in the
        // next window's previous term until it expires.
        let ended = holds && key.duration().sequence(now_ms) > self.sequence();
        let released = if idle {
            self.give_back_idle(now_ms)
        } else if ended {
            self.release_lease()
        } else {
            0
        };
        let current = self.current();
        let far = self.lease_is_far(key.duration(), now_ms);
        let renew = if renew_within > 0
            && far
            && !idle
            && current.unacked() > 0
            && current.lease_left() > 0
            && current.is_fresh(now_ms)
            && current.lease_until() <= now_ms.saturating_add(renew_within)
        {
            current.lease_id()
        } else {
            0
        };
        let wait = released == 0
            && renew == 0
            && pace.is_some_and(|(p, slot)| p.holds(self, key.duration(), now_ms, slot));
        let mut take = Take::Taken;
        for (sequence, cell) in self.cells() {
            let (release, renew, undo_from) = if sequence == self.sequence() {
                (released, renew, undo_from)
            } else {
                (previous_release, 0, undo_previous)
            };
            if wait && sequence == self.sequence() && undo_from == 0 {
                if cell.unacked() > 0 {
                    take = Take::Held;
                }
                continue;
            }
            if cell.unacked() > 0 || release > 0 || undo_from != 0 {
                events.push(ReplayEvent {
                    key: key.clone(),
                    sequence,
                    used: cell.own(),
                    limit: self.limit(),
                    release,
                    renew,
                    acked: cell.acked(),
                    undo_from,
                });
            }
        }
        take
    }
}

/// What a replay take did with one entry's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Nothing of it concerns the replay any more (no unacknowledged cost, no lease to watch).
    Done,
    /// Its events, if any, were taken; it stays watched.
    Taken,
    /// Its current cell's cost was held back by the pace; it stays watched.
    Held,
}

impl WindowState {
    /// Whether the current cell's unreplayed own cost may wait for a later replay pass: all of
    /// it lies under a live lease (the origin keeps reserving it for this process, so no other
    /// process of the region can spend it meanwhile) that is not within the pace's margin of
    /// its end, and no other region needs the count yet: none published the cell, and either
    /// no other region is live to import it (`pace.publish` is `None`) or the region's count
    /// as this process knows it (its waiting cost included) is under the publish threshold,
    /// so the cost waiting here makes no count publishable.
    ///
    /// A lease far from the limit keeps the renewal window in its margin (its renewal rides on
    /// a replay); one near the limit is not renewed, and its cost only has to reach the origin
    /// before the reservation's grace runs out, which the first pass after the lease's end
    /// does: its margin is one pass.
    pub fn is_quiet(&self, duration: WindowDuration, now_ms: u64, pace: &QuietPace) -> bool {
        self.is_covered(duration, now_ms, pace) && self.is_unread(pace)
    }

    /// Whether no other region reads the current cell's count yet, its waiting cost included
    /// ([`is_quiet`](Self::is_quiet)'s second half).
    fn is_unread(&self, pace: &QuietPace) -> bool {
        let cell = self.current();
        cell.counts().global == 0
            && pace
                .publish
                .is_none_or(|p| cell.counts().regional < p.threshold(self.limit()))
    }

    /// Whether the current cell's own cost is a pass ahead of the origin that may wait: the
    /// origin answered the cell before (a cold cell's first pass goes at once, so the key's
    /// next request passes ahead on its answer), no lease lifetime runs (a lease's end is
    /// [`is_covered`](Self::is_covered)'s), what waits is within what may pass ahead (1/64 of
    /// the limit, [`AHEAD_LIMIT_PER_COST`]), and the count stays within half the limit with no
    /// recent denial. A request on the key meanwhile (a key in demand) waits for a decision,
    /// which carries the pass and lends the lease; with none, the pass goes on its turn.
    fn waits_ahead(&self, duration: WindowDuration, now_ms: u64) -> bool {
        let cell = self.current();
        cell.is_warm()
            && !cell.is_fresh(now_ms)
            && cell.unacked().saturating_mul(AHEAD_LIMIT_PER_COST) <= self.limit()
            && self.lease_is_far(duration, now_ms)
    }

    /// Whether all of the current cell's own cost lies under a live lease not within the
    /// pace's margin of its end ([`is_quiet`](Self::is_quiet)'s first half).
    fn is_covered(&self, duration: WindowDuration, now_ms: u64, pace: &QuietPace) -> bool {
        let cell = self.current();
        let margin = if self.lease_is_far(duration, now_ms) {
            pace.margin_ms
        } else {
            pace.interval_ms
        };
        cell.own() <= cell.grant && now_ms.saturating_add(margin) < cell.lease_until()
    }

    /// One pass in how many the current cell's cost goes under `pace` (0: none; `None`: on
    /// every pass). A quiet cell goes on its turn ([`QuietPace::passes`]); a pass ahead of the
    /// origin on a key far from its limit and under no lease on its turn of
    /// [`QuietPace::ahead_passes`]. Either goes once per
    /// [`QuietPace::publish_passes`] if the other regions read its count already (the
    /// origin's count of it, its waiting cost left out, reached the publish threshold, or
    /// another region published it): the region publishes only once a flush interval, so a
    /// replay every pass brought it to the others no sooner than the flush. A cell whose
    /// waiting cost would make it publishable goes at once (its first flush is an early one).
    pub fn paced_every(
        &self,
        duration: WindowDuration,
        now_ms: u64,
        pace: &QuietPace,
    ) -> Option<u32> {
        let every = if self.is_covered(duration, now_ms, pace) {
            pace.passes
        } else if self.waits_ahead(duration, now_ms) {
            pace.ahead_passes
        } else {
            return None;
        };
        if self.is_unread(pace) {
            return Some(every);
        }
        let cell = self.current();
        let known = cell.counts().regional.saturating_sub(cell.unacked());
        let published = cell.counts().global > 0
            || pace
                .publish
                .is_some_and(|p| known >= p.threshold(self.limit()));
        (published && pace.publish_passes > 1).then_some(pace.publish_passes)
    }
}

/// How a paced replay pass treats quiet cells ([`WindowState::is_quiet`]): each waits for its
/// turn, one pass in `passes` (staggered over the table, so every pass carries a share), and
/// goes at once when it stops being quiet. A key under the publish floor then costs the origin
/// one replayed cell per `passes` passes, not one per pass that found it used. While no other
/// region is live, a quiet cell has no turn: nothing outside the region reads its count, the
/// origin reserves its cost under the lease, and the cost goes with the holder's next decision
/// or once the lease nears its end (a key in steady use then costs the origin about one call
/// per lease, not one a second).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuietPace {
    /// A quiet cell is replayed on one pass in this many (1: every pass; 0: on none, it
    /// waits until it stops being quiet).
    pub passes: u32,
    /// Which pass this is (the shell counts its replay ticks; batches sent back to back in
    /// one tick are one pass, so a full batch does not bring the next turn early).
    pub pass: u32,
    /// The publish policy the region flushes by now (its floor shared by the live regions);
    /// `None` while no other region is live to import this one's counts.
    pub publish: Option<PublishPolicy>,
    /// A cell whose lease far from the limit ends within this many ms goes at once: the
    /// renewal window and one pass interval, so its renewal is sent and its cost reaches the
    /// origin before its lease stops reserving it there.
    pub margin_ms: u64,
    /// The time between two passes: the margin of a lease near the limit.
    pub interval_ms: u64,
    /// A covered cell the other regions read already goes on one pass in this many (the
    /// region's flush interval in passes; 1: every pass).
    pub publish_passes: u32,
    /// A pass ahead of the origin on a key far from its limit, under no lease, goes on one
    /// pass in this many ([`QUIET_REPLAY_MS`] in passes, whether or not another region is
    /// live: no lease end brings it). A key in steady use sends its next request to the
    /// origin meanwhile, which lends it a lease, rather than a replay per request.
    pub ahead_passes: u32,
}

/// The last quarter of a lease of `lease_ms`, in which a lease in use is renewed (1.25 s of
/// 5 s: a dozen replay passes to get it through; a key in steady use costs one renewal per
/// 3.75 s).
const fn renewal_window(lease_ms: u64) -> u64 {
    lease_ms / 4
}

/// How long a quiet cell's replay may wait: short enough that the region's count follows
/// within about a second.
pub const QUIET_REPLAY_MS: u64 = 1_000;

impl QuietPace {
    /// The pace of the `pass`-th replay pass of a shell that replays every `interval_ms` and
    /// whose origin grants leases of `lease_ms`: a quiet cell goes on one pass in
    /// [`QUIET_REPLAY_MS`] (on none while no other region is live: `publish` is `None`), and
    /// never waits within the renewal window (the last quarter of a lease) plus one pass of
    /// its lease's end. A covered cell the other regions read goes once per `flush_ms`, the
    /// region's flush interval (0: on every pass).
    pub fn new(
        pass: u32,
        interval_ms: u64,
        publish: Option<PublishPolicy>,
        lease_ms: u64,
        flush_ms: u64,
    ) -> Self {
        let passes_in = |ms: u64| {
            u32::try_from(ms / interval_ms.max(1))
                .unwrap_or(u32::MAX)
                .max(1)
        };
        Self {
            passes: publish.map_or(0, |_| passes_in(QUIET_REPLAY_MS)),
            pass,
            publish,
            margin_ms: renewal_window(lease_ms).saturating_add(interval_ms),
            interval_ms,
            publish_passes: passes_in(flush_ms),
            ahead_passes: passes_in(QUIET_REPLAY_MS),
        }
    }

    /// [`new`](Self::new) with what the gateway stated of its region (`stated`): the pace of
    /// the gateway's own replay and, through its replay answers, of the Wasm shells'.
    pub fn stated(pass: u32, interval_ms: u64, lease_ms: u64, stated: &wire::ReplayPace) -> Self {
        Self::new(
            pass,
            interval_ms,
            stated.publish(),
            lease_ms,
            stated.flush_ms,
        )
    }

    /// The pace of part `part` of a table a shell keeps in several (the gateway's shards),
    /// all replayed in one pass: each part numbers its slots from 0, so without an offset of
    /// its own the few keys of each part would all take their turns on the same passes, and a
    /// pass would carry a third of the quiet keys, the next ones none.
    pub fn for_part(self, part: u32) -> Self {
        Self {
            pass: self.pass.wrapping_add(part),
            ..self
        }
    }

    /// Whether this pass is slot `slot`'s turn among one pass in `every` (0: never).
    fn turn(&self, every: u32, slot: u32) -> bool {
        every > 0 && slot.wrapping_add(self.pass) % every == 0
    }

    /// Whether `state`, in the table's slot `slot`, waits for a later pass.
    pub fn holds(
        &self,
        state: &WindowState,
        duration: WindowDuration,
        now_ms: u64,
        slot: u32,
    ) -> bool {
        state
            .paced_every(duration, now_ms, self)
            .is_some_and(|every| !self.turn(every, slot))
    }
}

impl CounterTable {
    /// Up to `max` cells holding own cost the origin has not acknowledged, and leases near
    /// the limit that went unused for a replay interval, released (see
    /// [`WindowState::idle_lease`]). Cells stay in the table as they are:
    /// [`ack_replay`](Self::ack_replay) records the answer, and a failed batch needs nothing
    /// (the next one carries the same values or larger; a released lease stays released).
    pub fn take_replay(&mut self, max: usize, now_ms: u64) -> ReplayBatch {
        self.take_replay_from(max, now_ms, None, 0).0
    }

    /// One of the takes of a replay pass that sends its cells in several batches: up to `max`
    /// cells as [`take_replay`](Self::take_replay) gives them (quiet ones paced by `pace`, if
    /// any, while the table is under three quarters full), walking the table's touched cells
    /// from `from`, the position the pass's previous take returned (0 for its first). Returns
    /// where the next take of the pass goes on, or `None` once every touched cell was looked
    /// at. A pass so looks at each cell once,
    /// however many batches it sends; a cell used again behind that position goes with the
    /// next pass.
    pub fn take_replay_from(
        &mut self,
        max: usize,
        now_ms: u64,
        pace: Option<QuietPace>,
        from: usize,
    ) -> (ReplayBatch, Option<usize>) {
        let mut events = Vec::new();
        let mut held = 0;
        // A table that may soon evict holds nothing back: an evicted cell's held cost would
        // be lost (eviction passes over unreplayed cells only so far).
        let pace = pace.filter(|_| self.len().saturating_mul(4) < self.config().capacity * 3);
        let renew_within = if self.config().renew_leases {
            renewal_window(self.lease_ms)
        } else {
            0
        };
        let slab = &mut self.slab;
        // Only this walk removes from the list, by swapping its last entry into the place
        // it looks at next, and a use adds at the end: the entries before `from` are the
        // ones an earlier take of the pass looked at.
        let mut j = from;
        while j < slab.touched.len() {
            if events.len() >= max {
                return (ReplayBatch { events, held }, Some(j));
            }
            let turn = slab.touched[j];
            let i = turn as usize;
            let live = slab.is_live(i);
            let slot = &mut slab.slots[i];
            let take = if live {
                slot.state.take_replay_events(
                    &slot.key,
                    now_ms,
                    renew_within,
                    pace.as_ref().map(|p| (p, turn)),
                    &mut events,
                )
            } else {
                Take::Done
            };
            match take {
                Take::Done => {
                    slab.untouch(i);
                    slab.touched.swap_remove(j);
                    continue;
                }
                Take::Held => held += 1,
                Take::Taken => {}
            }
            j += 1;
        }
        (ReplayBatch { events, held }, None)
    }

    /// Merges a replay answer: `counts[i]` is the origin's count of event `i`'s cell after it
    /// took the event. Entries evicted or rolled away since are skipped.
    pub fn ack_replay(&mut self, batch: &ReplayBatch, counts: &[Counts]) {
        for (e, c) in batch.events.iter().zip(counts) {
            self.ack_one(e, *c);
        }
    }

    /// [`ack_replay`](Self::ack_replay) for one event (a shell that delivered cells apart).
    pub fn ack_one(&mut self, event: &ReplayEvent, counts: Counts) {
        if let Some(i) = self.slab.find(event.key.as_ref()) {
            self.slab.slots[i].state.apply_replay(
                event.sequence,
                counts,
                event.used,
                event.undo_from,
            );
        }
    }

    /// Merges the origin's renewal of the lease `event` asked to renew: the same ceiling, now
    /// under `lease_id`, usable until `until_ms` (this process's clock: the time the batch was
    /// taken plus the lease lifetime). Ignored unless that lease is still the one in use.
    pub fn renewed(&mut self, event: &ReplayEvent, lease_id: u64, until_ms: u64) {
        if event.renew == 0 || lease_id <= event.renew {
            return;
        }
        if let Some(i) = self.slab.find(event.key.as_ref()) {
            self.slab.slots[i]
                .state
                .apply_renewal(event.sequence, event.renew, lease_id, until_ms);
        }
    }

    /// [`renewed`](Self::renewed) for each lease a replay answer renewed: `renewed[i].event`
    /// indexes `batch`'s events, and each lease runs `lease_ms` from `sent_ms`, when the
    /// batch was sent (this process's clock). An index outside the batch is ignored.
    pub fn renewed_all(
        &mut self,
        batch: &ReplayBatch,
        renewed: &[wire::RenewedLease],
        sent_ms: u64,
    ) {
        for r in renewed {
            let event = usize::try_from(r.event)
                .ok()
                .and_then(|i| batch.events.get(i));
            if let Some(event) = event {
                self.renewed(event, r.lease_id, sent_ms.saturating_add(r.lease_ms));
            }
        }
        self.lent_for(renewed.iter().map(|r| r.lease_ms));
    }

    /// Cells holding own cost the origin has not acknowledged (for metrics).
    pub fn unreplayed_cells(&self) -> usize {
        let slab = &self.slab;
        slab.touched
            .iter()
            .map(|&i| i as usize)
            .filter(|&i| slab.is_live(i))
            .map(|i| {
                let s = &slab.slots[i].state;
                usize::from(s.current().unacked() > 0) + usize::from(s.previous().unacked() > 0)
            })
            .sum()
    }
}
