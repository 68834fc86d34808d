//! The origin's side of one cell: the region's count, each process's cumulative own count,
//! and the live leases. The embedded origin keeps one per cell in memory; the Redis decide
//! and replay scripts keep the same fields in a hash and follow the same rules (a test runs
//! both side by side).
//!
//! - A process's own count merges with `max`: a replay or decision that arrives twice, late
//!   or after a timeout counts once, and a bad cell cannot make another grow.
//! - `count` is the sum of the own counts of local passes plus the passes decided here, which
//!   are also kept per process (`decided`): its own count and those make its part of the cell.
//! - A covering lease ([`crate::lease::covers`]) is a ceiling on its holder's own part of the
//!   window's weighted count: its own count of the cell plus its share of the previous
//!   window's weight ([`WindowDuration::previous_share`], rounded up) — the decay of its part
//!   of the previous cell, the passes decided here for it included (leaving those out, a
//!   holder paced at its share decayed slower than its traffic by what it was passed here,
//!   and asked here again for each of them in the next window). As the previous window
//!   decays, the holder's own part shrinks and the same lease admits more: a holder is lent
//!   the room its own past passes free, with no call, and several holders of a key paced at
//!   its limit each keep their own pace (the shares follow each one's recent rate, as
//!   Doorman's capacity leases follow each client's demand). A plain lease is a ceiling on
//!   the own count alone.
//! - `reserved` is what live leases may still admit: `ceiling - own` per lease. A decision
//!   counts every live lease as used (the caller's too: its in-flight local passes may be
//!   using it), and weighs only the previous count the current cell's covering leases do not
//!   cover. A live ceiling is only ever raised, so a holder may merge answers in any order.

use alloc::string::{String, ToString};
use alloc::vec::Vec;

use crate::decision::{Counts, LimitCheck, WindowCounts};
use crate::window::WindowDuration;

mod decide;

pub use decide::{DecideAnswer, DecideLimit, DecideOutcome, Ledgers, decide};

/// The most processes a cell keeps an entry for. Every decision reads the cell's entries, so
/// without a bound a caller inventing instance ids would make each decision on the key (and,
/// in Redis, every command behind it) slower. A new writer that finds the cell full makes
/// room for [`EVICT_BATCH`] ([`CellLedger::make_room`]); a legitimate cell seldom has more
/// than a few hundred writers (Worker isolates) at once.
pub const MAX_HOLDERS: usize = 1_024;
/// Entries a full cell drops at once: finding the ones that matter least reads them all, so
/// doing it once per this many new writers keeps an invented writer's cost flat (one at a
/// time, each cost Redis 0.85 ms at 1,024 writers).
pub const EVICT_BATCH: usize = MAX_HOLDERS / 8;

/// One process's lease on a cell: it may admit locally while its own count plus its share of
/// the previous window's weight stays within `ceiling`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// What the holder's own count plus its previous share may reach.
    pub ceiling: u64,
    /// Until when the origin reserves it (origin clock); also its id: each grant to a holder
    /// on a cell gets a larger one.
    pub until_ms: u64,
    /// Whether it covers the holder's share of the previous window's weight (a covering
    /// lease): its ceiling bounds the holder's own count plus that share, not the own count
    /// alone.
    pub covers: bool,
}

/// The origin's view of one cell.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CellLedger {
    count: u64,
    /// One entry per process that wrote to the cell (usually one or a few, so a short list
    /// beats a map: one allocation a cell, found by a scan of a cache line or two).
    holders: Vec<Holder>,
}

/// What the origin keeps for one process on one cell.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Holder {
    instance: String,
    /// Its cumulative own count.
    own: u64,
    /// What was passed here for it (counted in `count` too).
    decided: u64,
    /// Its lease, live or not yet found expired.
    lease: Option<Lease>,
    /// The last lease id granted to it, kept when its lease is dropped, so ids never repeat
    /// (a holder ignores an id it has seen).
    last_id: u64,
    /// Its last call counted here: the id, cost and the lease it granted (so a process that
    /// never learned the outcome can have it undone).
    counted: Option<Counted>,
}

/// A pass counted at the origin for a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counted {
    /// The call's id.
    pub call: u64,
    /// The cost counted.
    pub cost: u64,
    /// The lease it granted (0: none).
    pub lease_id: u64,
}

impl CellLedger {
    /// The region's count of the cell.
    pub const fn count(&self) -> u64 {
        self.count
    }

    fn holder(&self, instance: &str) -> Option<&Holder> {
        self.holders.iter().find(|h| h.instance == instance)
    }

    fn holder_mut(&mut self, instance: &str) -> Option<&mut Holder> {
        self.holders.iter_mut().find(|h| h.instance == instance)
    }

    /// `instance`'s entry, made on its first write.
    fn writer(&mut self, instance: &str) -> &mut Holder {
        let i = match self.holders.iter().position(|h| h.instance == instance) {
            Some(i) => i,
            None => {
                if self.holders.len() >= MAX_HOLDERS {
                    self.make_room();
                }
                // Exactly one more: most cells only ever have one or two writers.
                self.holders.reserve_exact(1);
                self.holders.push(Holder {
                    instance: instance.to_string(),
                    own: 0,
                    decided: 0,
                    lease: None,
                    last_id: 0,
                    counted: None,
                });
                self.holders.len() - 1
            }
        };
        &mut self.holders[i]
    }

    /// Drops the [`EVICT_BATCH`] entries that matter least, for a new writer: ones holding no
    /// lease before any that does (dropping a live lease would free room its holder may still
    /// use), then the smallest parts (own count and passes decided here), then the first
    /// instance ids. Their counts stay in the region's count; a process that writes again is
    /// counted again from zero (over, never under), so the smallest parts go.
    fn make_room(&mut self) {
        self.holders.sort_unstable_by(|x, y| {
            let rank = |h: &Holder| (h.lease.is_some(), h.own.saturating_add(h.decided));
            rank(x)
                .cmp(&rank(y))
                .then_with(|| x.instance.cmp(&y.instance))
        });
        let drop = EVICT_BATCH.min(self.holders.len());
        self.holders.drain(..drop);
    }

    /// How many processes the cell keeps an entry for (at most [`MAX_HOLDERS`]).
    pub fn writers(&self) -> usize {
        self.holders.len()
    }

    /// `instance`'s cumulative count as the origin holds it.
    pub fn own(&self, instance: &str) -> u64 {
        self.holder(instance).map_or(0, |h| h.own)
    }

    /// What was passed here for `instance`'s calls.
    pub fn decided(&self, instance: &str) -> u64 {
        self.holder(instance).map_or(0, |h| h.decided)
    }

    /// `instance`'s part of the cell: its own count and what was passed here for it.
    pub fn part(&self, instance: &str) -> u64 {
        self.holder(instance)
            .map_or(0, |h| h.own.saturating_add(h.decided))
    }

    /// Merges `instance`'s cumulative count with `max`; the count grows by the difference.
    pub fn merge_own(&mut self, instance: &str, used: u64) {
        self.merge_max(instance, used, |h| &mut h.own);
    }

    /// Merges what `instance` says was passed here for it with `max`; the count grows by the
    /// difference. Its word is an upper bound (it counts a call whose answer it lost), so
    /// this only ever counts more; it restores what an origin that lost its data forgot, and
    /// without it such an origin would lend the caller a share smaller than the one the caller
    /// counts against its ceiling, which would then run out on every request.
    pub fn merge_decided(&mut self, instance: &str, decided: u64) {
        self.merge_max(instance, decided, |h| &mut h.decided);
    }

    /// Raises one of `instance`'s cumulative counts (`field`) to `value`, the region's count
    /// by the same difference.
    fn merge_max(&mut self, instance: &str, value: u64, field: fn(&mut Holder) -> &mut u64) {
        if value == 0 {
            return;
        }
        let held = field(self.writer(instance));
        if value > *held {
            let grown = value - *held;
            *held = value;
            self.count = self.count.saturating_add(grown);
        }
    }

    /// Raises the count to `floor` (this region's published count: an origin that lost its
    /// data, or a new embedded one, counts from what the region already published).
    pub fn raise(&mut self, floor: u64) {
        self.count = self.count.max(floor);
    }

    /// Counts `cost` passed here for `instance` (no local pass of its, so never replayed).
    pub fn pass(&mut self, instance: &str, cost: u64) {
        self.count = self.count.saturating_add(cost);
        let h = self.writer(instance);
        h.decided = h.decided.saturating_add(cost);
    }

    /// Remembers what `instance`'s call counted here (a call id of 0 is not remembered).
    pub fn record(&mut self, instance: &str, counted: Counted) {
        if counted.call != 0 {
            self.writer(instance).counted = Some(counted);
        }
    }

    /// Undoes what `instance`'s last counted call did, if its id is `from`: the process never
    /// learned that call's outcome and decided the request itself. A later call counted since
    /// is not undone (its answer may have arrived), so the lost one then stays counted: over,
    /// never under. Returns the cost taken back.
    pub fn undo(&mut self, instance: &str, from: u64) -> u64 {
        let Some(h) = self.holder_mut(instance) else {
            return 0;
        };
        let Some(c) = h.counted.filter(|c| from != 0 && c.call == from) else {
            return 0;
        };
        h.counted = None;
        h.decided = h.decided.saturating_sub(c.cost);
        self.count = self.count.saturating_sub(c.cost);
        if c.lease_id != 0 {
            self.release(instance, c.lease_id);
        }
        c.cost
    }

    /// What live leases may still admit at `now_ms` on the previous cell (its holders'
    /// shares of the window before it weigh nothing any more): the other processes' and
    /// `instance`'s own. Expired leases are dropped.
    pub fn reserved(&mut self, instance: &str, now_ms: u64) -> (u64, u64) {
        let r = self.reserved_with(instance, now_ms, |_| 0);
        (r.others, r.ceiling.saturating_sub(self.own(instance)))
    }

    /// The live leases of the current cell at `now_ms`: what the other processes' may still
    /// admit beyond their own counts, the own counts of the previous cell
    /// (`previous_own`) that their covering leases cover, and `instance`'s live lease.
    /// Expired leases are dropped.
    pub fn reserved_with(
        &mut self,
        instance: &str,
        now_ms: u64,
        previous_own: impl Fn(&str) -> u64,
    ) -> Reserved {
        let mut r = Reserved::default();
        for h in &mut self.holders {
            let Some(l) = h.lease else { continue };
            if now_ms >= l.until_ms {
                h.lease = None;
                continue;
            }
            if h.instance == instance {
                (r.ceiling, r.covers) = (l.ceiling, l.covers);
            } else {
                r.others = r.others.saturating_add(l.ceiling.saturating_sub(h.own));
                if l.covers {
                    r.previous = r.previous.saturating_add(previous_own(&h.instance));
                }
            }
        }
        r
    }

    /// Grants `instance` a lease of `lease` beyond its own part (its own count, plus
    /// `share`, its share of the previous window's weight now, if the lease `covers` it)
    /// until `until_ms`; a live ceiling is only raised (the holder may be passing under it
    /// while this answer travels), taken in the new lease's terms ([`in_terms`]). Returns
    /// the lease it holds now as the wire says it (its ceiling minus its own count) and its id
    /// (0: none).
    pub fn lease(
        &mut self,
        instance: &str,
        lease: u64,
        share: u64,
        covers: bool,
        now_ms: u64,
        until_ms: u64,
    ) -> (u64, u64) {
        let (own, live) = self.holder(instance).map_or((0, 0), |h| {
            let live = h
                .lease
                .filter(|l| now_ms < l.until_ms)
                .map_or(0, |l| in_terms(l.ceiling, l.covers, covers, share));
            (h.own, live)
        });
        let ceiling = live.max(own_part(own, share, covers).saturating_add(lease));
        if ceiling <= own {
            return (0, 0);
        }
        // Ids strictly increase per holder (across dropped leases too), so a release names
        // exactly one grant and a holder recognises a new one.
        let h = self.writer(instance);
        let until_ms = until_ms.max(h.last_id.saturating_add(1));
        h.last_id = until_ms;
        h.lease = Some(Lease {
            ceiling,
            until_ms,
            covers,
        });
        (ceiling - own, until_ms)
    }

    /// Keeps `instance`'s live lease `id` reserved until `until_ms` (its holder is using it and
    /// asked with a replay): the same ceiling under a new, larger id. Returns the new id, or 0
    /// if `id` is no longer the holder's live lease (expired, released or replaced: the
    /// holder then asks with its next decision, as it would have).
    pub fn renew(&mut self, instance: &str, id: u64, now_ms: u64, until_ms: u64) -> u64 {
        let Some(h) = self.holder_mut(instance) else {
            return 0;
        };
        let Some(lease) = h
            .lease
            .as_mut()
            .filter(|l| l.until_ms == id && now_ms < l.until_ms)
        else {
            return 0;
        };
        let until_ms = until_ms
            .max(h.last_id.saturating_add(1))
            .max(id.saturating_add(1));
        h.last_id = until_ms;
        lease.until_ms = until_ms;
        until_ms
    }

    /// Drops `instance`'s lease `id` (it stopped using it first), unless a newer grant
    /// replaced it.
    pub fn release(&mut self, instance: &str, id: u64) {
        if let Some(h) = self.holder_mut(instance)
            && h.lease.is_some_and(|l| l.until_ms == id)
        {
            h.lease = None;
        }
    }

    /// Drops `instance`'s lease, whatever its id: it left the cell (its clock is in a later
    /// window), so it admits nothing more under it.
    pub fn retire(&mut self, instance: &str) {
        if let Some(h) = self.holder_mut(instance) {
            h.lease = None;
        }
    }

    /// Whether a process other than `instance` wrote to the cell: counted a pass, held a
    /// lease, or was denied here ([`contend`](Self::contend)).
    pub fn written_by_others(&self, instance: &str) -> bool {
        self.holders.iter().any(|h| h.instance != instance)
    }

    /// Records that `instance` wants the cell though it was denied here, so no other process
    /// is lent future room on it as if alone.
    pub fn contend(&mut self, instance: &str) {
        self.writer(instance);
    }

    /// Leases held, live or not yet found expired.
    pub fn leases(&self) -> usize {
        self.holders.iter().filter(|h| h.lease.is_some()).count()
    }

    /// Live leases at `now_ms`, counting `instance` as one whether it holds one or not (the
    /// grant it is about to get).
    pub fn holders(&self, instance: &str, now_ms: u64) -> u64 {
        let others = self
            .holders
            .iter()
            .filter(|h| h.instance != instance && h.lease.is_some_and(|l| now_ms < l.until_ms))
            .count();
        u64::try_from(others).unwrap_or(u64::MAX).saturating_add(1)
    }
}

/// The live leases of a cell, as a decision counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reserved {
    /// What the other processes' leases may still admit beyond their own counts.
    pub others: u64,
    /// The own counts of the previous cell their covering leases cover.
    pub previous: u64,
    /// The caller's live ceiling (0: none)...
    pub ceiling: u64,
    /// ...and whether it covers.
    pub covers: bool,
}

/// A live ceiling of a lease that covers (`was`) or not, in the terms of one that `covers`
/// or not, its holder's previous share being `share`: a lease that comes to cover the share
/// must keep room for what the holder may have passed under the plain one (its ceiling plus
/// the share), and one that stops covering must keep what the holder may have passed under
/// the covering one (its ceiling less the share, which the holder counted against it).
pub fn in_terms(ceiling: u64, was: bool, covers: bool, share: u64) -> u64 {
    match (was, covers) {
        (false, true) if ceiling > 0 => ceiling.saturating_add(share),
        (true, false) => ceiling.saturating_sub(share),
        _ => ceiling,
    }
}

/// What a lease that `covers` the holder's previous `share` or not bounds: its own count,
/// plus that share if it covers it.
fn own_part(own: u64, share: u64, covers: bool) -> u64 {
    if covers {
        own.saturating_add(share)
    } else {
        own
    }
}

/// What an origin decides one limit of a caller with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OriginView {
    /// Both cells' counts with every live lease as used, and the other regions' imported
    /// counts.
    pub check: LimitCheck,
    /// The caller's own live lease left on the current cell: a new grant raises it rather
    /// than adding to it.
    pub mine: u64,
    /// The caller's share of the previous window's weight now (its own count there, decayed
    /// and rounded up), which a covering lease's ceiling counts beside its own count.
    pub share: u64,
    /// Whether the lease this call lends covers the caller's share
    /// ([`crate::lease::covers`]).
    pub covers: bool,
    /// Live leases on the current cell, the caller counted as one whether it holds one or not
    /// ([`CellLedger::holders`]).
    pub holders: u64,
    /// Whether no other process wrote to either cell (passed, held a lease, or was denied
    /// there) and no other region counted any: then whatever the others admit is decided
    /// here, against the caller's whole reservation, and none of them is likely to be waiting
    /// (a key several processes served last window is shared from the start of the next).
    pub alone: bool,
}

/// The [`OriginView`] of one limit of `instance`, live leases found expired dropped on the
/// way; the lease this call may lend covers the caller's previous share if it `shares` and the
/// limit allows it ([`crate::lease::covers`]), the share of its part of the previous cell
/// (its own count and what was passed here for it), each at most what `said` (the same two
/// as its call says them) holds: a process that lost its state, an evicted table entry,
/// counts from 0, so its share is what it counts, never what the origin remembers.
#[allow(clippy::too_many_arguments)]
pub fn origin_check(
    current: &mut CellLedger,
    previous: &mut CellLedger,
    instance: &str,
    global: [u64; 2],
    duration: WindowDuration,
    limit: u64,
    cost: u64,
    now_ms: u64,
    shares: bool,
    said: [u64; 2],
) -> OriginView {
    let holders = current.holders(instance, now_ms);
    let covers = shares && crate::lease::covers(limit, cost, holders);
    // A covering lease bounds its holder's own count and its share of the previous window's
    // weight (its own count there, decayed): the origin counts each such holder at its
    // ceiling, exactly, and weighs only the rest of the previous cell. Each holder checks its
    // part in exact arithmetic (rounding its share up is the same for whole units), so
    // together they never pass what this counts. The caller counts at its live ceiling (in
    // the terms of the lease this call lends) or its own part now, whichever is more: the
    // lease this call grants it must fit beside the others.
    let elapsed = duration.elapsed_ms(duration.sequence(now_ms), now_ms);
    let counted = previous
        .own(instance)
        .min(said[0])
        .saturating_add(previous.decided(instance).min(said[1]));
    let share = duration.previous_share(counted, elapsed);
    let r = current.reserved_with(instance, now_ms, |holder| previous.part(holder));
    let own = current.own(instance);
    let live = in_terms(r.ceiling, r.covers, covers, share);
    let base = own_part(own, share, covers);
    let hold = live.max(base);
    let (prev_others, prev_mine) = previous.reserved(instance, now_ms);
    let covered = r.previous.saturating_add(if covers { counted } else { 0 });
    let check = LimitCheck {
        counts: WindowCounts {
            current: Counts {
                regional: current
                    .count()
                    .saturating_add(r.others)
                    .saturating_add(hold - own),
                global: global[0],
            },
            previous: Counts {
                regional: previous
                    .count()
                    .saturating_add(prev_others)
                    .saturating_add(prev_mine)
                    .saturating_sub(covered),
                global: global[1],
            },
        },
        duration,
        limit,
        cost,
    };
    OriginView {
        check,
        mine: hold - base,
        share,
        covers,
        holders,
        alone: global == [0, 0]
            && r.others == 0
            && prev_others == 0
            && !current.written_by_others(instance)
            && !previous.written_by_others(instance),
    }
}

/// Where a caller's own counts of its cells `caller_sequence` and the one before fall on the
/// origin's cells `origin_sequence` and the one before (clocks may straddle a boundary).
pub fn used_on(origin_sequence: u64, caller_sequence: u64, used: [u64; 2]) -> [u64; 2] {
    if caller_sequence == origin_sequence {
        used
    } else if caller_sequence.checked_add(1) == Some(origin_sequence) {
        [0, used[0]]
    } else if origin_sequence.checked_add(1) == Some(caller_sequence) {
        [used[1], 0]
    } else {
        [0, 0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Everything the origin keeps for one writer of a cell (own count, lease, last id, last
    /// call) is one entry of one allocation: an embedded origin holds millions of cells.
    #[test]
    fn one_writer_is_one_entry_of_one_allocation() {
        let mut c = CellLedger::default();
        c.merge_own("a", 2);
        let (_, id) = c.lease("a", 10, 0, false, 0, 5_000);
        c.record(
            "a",
            Counted {
                call: 1,
                cost: 1,
                lease_id: id,
            },
        );
        assert!(c.renew("a", id, 1, 6_000) > id);
        c.merge_own("a", 4);
        assert_eq!((c.holders.len(), c.holders.capacity()), (1, 1));
        c.merge_own("b", 1);
        assert_eq!((c.holders.len(), c.holders.capacity()), (2, 2));
        assert_eq!((c.count(), c.own("a"), c.own("b")), (5, 4, 1));
    }

    #[test]
    fn own_counts_merge_with_max_so_a_repeat_counts_once() {
        let mut c = CellLedger::default();
        c.merge_own("a", 5);
        c.merge_own("a", 5);
        c.merge_own("a", 3);
        c.merge_own("b", 2);
        assert_eq!(c.count(), 7);
        c.pass("a", 1);
        assert_eq!(
            (c.count(), c.own("a"), c.decided("a"), c.part("a")),
            (8, 5, 1, 6),
            "a pass decided here is no one's own count, but the caller's part"
        );
        c.merge_own("a", 5);
        assert_eq!(
            c.count(),
            8,
            "a replay of the own count does not take it back"
        );
    }

    #[test]
    fn a_live_lease_is_renewed_under_a_new_id_and_only_by_its_id() {
        let mut c = CellLedger::default();
        c.merge_own("a", 4);
        assert_eq!(c.lease("a", 10, 0, false, 0, 1_000), (10, 1_000));
        assert_eq!(c.renew("a", 999, 500, 2_000), 0, "not the lease held");
        assert_eq!(c.renew("b", 1_000, 500, 2_000), 0, "b holds none");
        assert_eq!(c.renew("a", 1_000, 500, 2_000), 2_000);
        assert_eq!(
            c.reserved("b", 1_500),
            (10, 0),
            "the same ceiling, still reserved"
        );
        c.release("a", 1_000);
        assert_eq!(
            c.reserved("b", 1_500),
            (10, 0),
            "the old id no longer names it"
        );
        let (_, id) = c.lease("a", 1, 0, false, 1_600, 1_500);
        assert_eq!(
            id, 2_001,
            "a later grant's id is still larger than the renewal's"
        );
        assert_eq!(c.renew("a", 2_001, 2_001, 3_000), 0, "expired: not renewed");
    }

    #[test]
    fn a_holder_that_left_the_cell_reserves_nothing_there() {
        let mut c = CellLedger::default();
        c.merge_own("a", 1);
        let (_, id) = c.lease("a", 8, 0, false, 0, 1_000);
        c.lease("b", 2, 0, false, 0, 1_000);
        assert_eq!(c.reserved("b", 10), (8, 2));
        c.retire("a");
        assert_eq!(
            c.reserved("b", 10),
            (0, 2),
            "a's lease went, whatever its id"
        );
        assert_eq!(c.own("a"), 1, "its count stays");
        assert!(c.lease("a", 1, 0, false, 20, 500).1 > id, "ids still grow");
    }

    #[test]
    fn live_leases_are_reserved_until_they_expire() {
        let mut c = CellLedger::default();
        c.merge_own("a", 4);
        assert_eq!(c.lease("a", 10, 0, false, 0, 1_000), (10, 1_000));
        assert_eq!(c.lease("b", 3, 0, false, 0, 2_000), (3, 2_000));
        assert_eq!(c.reserved("b", 0), (10, 3));
        c.merge_own("a", 9); // five of a's lease were used and replayed
        assert_eq!(c.reserved("a", 0), (3, 5));
        assert_eq!(
            c.lease("a", 2, 0, false, 0, 1_000),
            (5, 1_001),
            "never lowered; a new id"
        );
        c.release("a", 1_000);
        assert_eq!(c.reserved("a", 0), (3, 5), "an older id releases nothing");
        assert_eq!(c.reserved("a", 1_001), (3, 0), "a's lease expired");
        c.release("b", 2_000);
        assert_eq!((c.reserved("a", 0), c.leases()), ((0, 0), 0));
        // A clock that did not move (or moved back) still gives a new grant a new id.
        assert_eq!(
            c.lease("b", 3, 0, false, 0, 1_500),
            (3, 2_001),
            "ids never repeat"
        );
    }

    #[test]
    fn a_full_cell_drops_the_entries_that_matter_least_for_a_new_writer() {
        let mut c = CellLedger::default();
        c.merge_own("leased", 1);
        c.lease("leased", 5, 0, false, 0, 1_000);
        c.merge_own("small", 1);
        for i in 0..MAX_HOLDERS - 2 {
            c.merge_own(&format!("h{i:04}"), 2);
        }
        assert_eq!(c.writers(), MAX_HOLDERS);
        let before = c.count();
        c.merge_own("new", 3);
        assert_eq!(
            c.writers(),
            MAX_HOLDERS - EVICT_BATCH + 1,
            "room made at once"
        );
        assert_eq!(
            c.count(),
            before + 3,
            "the dropped entries' counts stay counted"
        );
        assert_eq!(
            (c.own("small"), c.own("new")),
            (0, 3),
            "the smallest part went"
        );
        assert_eq!(c.own("leased"), 1, "a lease holder stays");
        // Then, on equal parts, the first instance ids.
        let last = EVICT_BATCH - 2;
        let kept = format!("h{:04}", last + 1);
        assert_eq!((c.own(&format!("h{last:04}")), c.own(&kept)), (0, 2));
        for i in 0..EVICT_BATCH - 1 {
            c.merge_own(&format!("n{i:04}"), 1);
        }
        assert_eq!(c.writers(), MAX_HOLDERS, "full again, and no more");
    }

    #[test]
    fn a_call_whose_answer_was_lost_is_undone_once() {
        let mut c = CellLedger::default();
        c.pass("a", 2);
        let (_, id) = c.lease("a", 5, 0, false, 0, 1_000);
        c.record(
            "a",
            Counted {
                call: 7,
                cost: 2,
                lease_id: id,
            },
        );
        assert_eq!(
            c.undo("a", 8),
            0,
            "an older call is not undone by a later marker"
        );
        assert_eq!(
            c.undo("a", 6),
            0,
            "nor a later call by an earlier one's (its answer may have come)"
        );
        assert_eq!(c.undo("a", 7), 2, "undone: the count and its lease");
        assert_eq!(
            (c.count(), c.decided("a"), c.reserved("a", 0)),
            (0, 0, (0, 0))
        );
        assert_eq!(c.undo("a", 7), 0, "once");
    }

    /// 15 s into a minute window.
    const NOW: u64 = 60_000 * 100 + 15_000;

    /// `instance`'s view of a key of 1,000 a minute at [`NOW`], its call saying `said`.
    fn view_at_now(
        current: &mut CellLedger,
        previous: &mut CellLedger,
        instance: &str,
        said: [u64; 2],
    ) -> OriginView {
        let minute = WindowDuration::from_ms(60_000).unwrap();
        origin_check(
            current,
            previous,
            instance,
            [0, 0],
            minute,
            1_000,
            1,
            NOW,
            true,
            said,
        )
    }

    #[test]
    fn a_caller_that_forgot_its_previous_count_is_lent_no_share_of_it() {
        let mut previous = CellLedger::default();
        previous.merge_own("a", 30);
        let mut current = CellLedger::default();
        // a's 30 weigh 22.5, its share rounded up 23.
        let mut check = |said| view_at_now(&mut current, &mut previous, "a", said);
        let (told, forgot) = (check([30, 0]), check([0, 0]));
        assert_eq!((told.share, forgot.share), (23, 0));
        let counts = |v: &OriginView| {
            let c = v.check.counts;
            (c.current.regional, c.previous.regional)
        };
        assert_eq!(counts(&told), (23, 0), "its share, counted for it");
        assert_eq!(
            counts(&forgot),
            (0, 30),
            "an evicted entry counts from 0: the 30 stay in the previous term"
        );
    }

    #[test]
    fn passes_decided_here_are_part_of_a_callers_share_as_far_as_it_knows_them() {
        let mut previous = CellLedger::default();
        previous.merge_own("a", 20);
        previous.pass("a", 10);
        previous.merge_own("b", 40);
        // a's part of 30 weighs 22.5, its share rounded up 23.
        let mut current = CellLedger::default();
        let mut check = |said| view_at_now(&mut current, &mut previous, "a", said);
        let (told, short, over) = (check([20, 10]), check([20, 4]), check([20, 99]));
        assert_eq!(
            (told.share, short.share, over.share),
            (23, 18, 23),
            "the decay of its part, at most what it says and what was counted here"
        );
        let previous_term = |v: &OriginView| v.check.counts.previous.regional;
        assert_eq!(previous_term(&told), 40, "only b's count stays in the term");
        assert_eq!(previous_term(&short), 46);
        // A covering lease of a's counts its whole part as covered when b decides.
        current.lease("a", 5, 23, true, NOW, NOW + 5_000);
        let b = view_at_now(&mut current, &mut previous, "b", [40, 0]);
        assert_eq!(b.check.counts.previous.regional, 0, "a's 30 and b's own 40");
    }

    #[test]
    fn what_a_caller_says_was_passed_for_it_merges_with_max_and_counts() {
        let mut c = CellLedger::default();
        c.pass("a", 3);
        c.merge_decided("a", 2);
        assert_eq!(
            (c.count(), c.decided("a")),
            (3, 3),
            "less than counted: nothing"
        );
        c.merge_decided("a", 5);
        assert_eq!(
            (c.count(), c.decided("a"), c.part("a")),
            (5, 5, 5),
            "more (an origin that lost its data): counted"
        );
    }

    #[test]
    fn own_counts_map_across_a_window_boundary() {
        assert_eq!(used_on(7, 7, [3, 2]), [3, 2]);
        assert_eq!(used_on(8, 7, [3, 2]), [0, 3], "caller behind");
        assert_eq!(used_on(7, 8, [3, 2]), [2, 0], "caller ahead");
        assert_eq!(used_on(9, 7, [3, 2]), [0, 0]);
    }
}
