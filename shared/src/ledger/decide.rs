//! The origin's decision on one call, over the ledgers of its cells: the one home of what an
//! origin does with `/v1/origin/decide`. The embedded origin runs it under its lock, the
//! region model of the core's tests runs it on a map, and the Redis decide script is a port
//! of it that the gateway's parity test holds to it answer for answer.

use alloc::vec::Vec;

use super::{CellLedger, Counted, OriginView, origin_check, used_on};
use crate::decision::{Decision, LimitCheck, decide_all};
use crate::identity::WindowKeyRef;
use crate::lease;
use crate::wire::DecideRef;

/// Where an origin keeps its cells' ledgers.
pub trait Ledgers {
    /// The live ledger of cell `(key, sequence)`, made (or started again, if it expired) on
    /// first use.
    fn ledger(&mut self, key: WindowKeyRef<'_>, sequence: u64, now_ms: u64) -> &mut CellLedger;
}

/// One limit of a call, as the origin decides it.
#[derive(Clone, Copy, Debug)]
pub struct DecideLimit<'a> {
    /// The window key.
    pub key: WindowKeyRef<'a>,
    /// Allowed cost per window.
    pub limit: u64,
    /// The request's cost.
    pub cost: u64,
    /// The caller's own cumulative counts of the origin's current and previous cells
    /// (already mapped onto the origin's sequence: [`super::used_on`]).
    pub used: [u64; 2],
    /// What was passed here for the caller in those cells, as far as it knows (mapped the
    /// same way).
    pub decided: [u64; 2],
    /// The lease asked for beyond the cost.
    pub want: u64,
    /// The id of an expired lease the caller gives back (0: none).
    pub release: u64,
    /// This call's id (0: none): the origin remembers the last it counted per caller.
    pub call: u64,
    /// Undo what the caller's call with this id counted, if it is its last counted (0: nothing).
    pub undo_from: u64,
    /// The other regions' counts of the current and previous cells, as the gateway imported
    /// them from the global table.
    pub global: [u64; 2],
    /// This region's own counts of the current and previous cells as the global table holds
    /// them: a floor the origin's count is raised to (an origin that lost its data, or a new
    /// embedded one, counts from what the region already published).
    pub floor: [u64; 2],
    /// Whether the caller has left the origin's previous cell (its sequence is the origin's,
    /// or later): its own count there is final, and its lease there admits nothing more.
    pub left_previous: bool,
    /// Whether the caller may be lent a covering lease (`DecideRequest::shares`).
    pub shares: bool,
}

impl<'a> DecideLimit<'a> {
    /// A validated `/v1/origin/decide` limit as the origin decides it at `now_ms`: the
    /// caller's own counts mapped onto the origin's cells (clocks may straddle a boundary),
    /// with the other regions' counts and this region's published floor beside them.
    pub fn new(r: &DecideRef<'a>, now_ms: u64, global: [u64; 2], floor: [u64; 2]) -> Self {
        let key = r.limit.key;
        let sequence = key.duration().sequence(now_ms);
        let caller = r.sequence.unwrap_or(sequence);
        Self {
            key,
            limit: r.limit.limit,
            cost: r.limit.cost,
            used: used_on(sequence, caller, r.used),
            decided: used_on(sequence, caller, r.decided),
            want: r.want,
            release: r.release,
            call: r.call,
            undo_from: r.undo_from,
            global,
            floor,
            left_previous: r.sequence.is_some_and(|s| s >= sequence),
            shares: r.shares,
        }
    }
}

/// The origin's verdict on one limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecideOutcome {
    /// This limit's own verdict (counted only if the whole request passed).
    pub decision: Decision,
    /// The current sequence on the origin's clock.
    pub sequence: u64,
    /// The current cell's regional count after the decision.
    pub current: u64,
    /// The previous cell's regional count.
    pub previous: u64,
    /// The caller's own cumulative count of the current cell after the decision.
    pub used: u64,
    /// The lease granted.
    pub lease: u64,
    /// Its id (0: none).
    pub lease_id: u64,
    /// Whether it covers the caller's previous share.
    pub covers: bool,
}

/// The origin's answer to a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecideAnswer {
    /// Whether every limit passed and all were counted.
    pub success: bool,
    /// One outcome per limit, in request order.
    pub limits: Vec<DecideOutcome>,
}

/// Decides `instance`'s call at `now_ms`, all or nothing, on the ledgers: merges the caller's
/// own counts, undoes what it asks undone, raises each cell to the region's published floor,
/// takes back a lease it gives back, decides every limit with every live lease counted as
/// used, and on a pass counts the cost and lends each limit a lease (see
/// [`lease::available`] and [`lease::grant`]) reserved for `lease_ms` plus the grace; a limit
/// that denied records the caller as contending for its cell.
pub fn decide<L: Ledgers + ?Sized>(
    ledgers: &mut L,
    instance: &str,
    limits: &[DecideLimit<'_>],
    now_ms: u64,
    lease_ms: u64,
) -> DecideAnswer {
    let views: Vec<OriginView> = limits
        .iter()
        .map(|l| {
            let key = l.key;
            let sequence = key.duration().sequence(now_ms);
            let current = ledgers.ledger(key, sequence, now_ms);
            current.merge_own(instance, l.used[0]);
            current.undo(instance, l.undo_from);
            current.raise(l.floor[0]);
            if l.release > 0 {
                current.release(instance, l.release);
            }
            let prev = sequence.saturating_sub(1);
            let mut previous = core::mem::take(ledgers.ledger(key, prev, now_ms));
            previous.merge_own(instance, l.used[1]);
            // Only the previous cell's: what the caller's share decays (a call in flight on
            // the current cell must not be counted before it arrives).
            previous.merge_decided(instance, l.decided[1]);
            if l.left_previous {
                // Its count there, just merged, is final: a reservation would only hold back
                // room from the window that weighs it (every process would see room the
                // origin denies, and ask for it on every request).
                previous.retire(instance);
            }
            previous.raise(l.floor[1]);
            let current = ledgers.ledger(key, sequence, now_ms);
            let view = origin_check(
                current,
                &mut previous,
                instance,
                l.global,
                key.duration(),
                l.limit,
                l.cost,
                now_ms,
                l.shares,
                [l.used[1], l.decided[1]],
            );
            *ledgers.ledger(key, prev, now_ms) = previous;
            view
        })
        .collect();
    let checks: Vec<LimitCheck> = views.iter().map(|v| v.check).collect();
    let multi = decide_all(&checks, now_ms, |i, j| {
        limits.get(i).map(|l| l.key) == limits.get(j).map(|l| l.key)
    });
    let until = lease::reserved_until(now_ms, lease_ms);
    let outcomes = limits
        .iter()
        .zip(&multi.decisions)
        .zip(&views)
        .map(|((l, decision), view)| {
            let sequence = l.key.duration().sequence(now_ms);
            let previous = ledgers
                .ledger(l.key, sequence.saturating_sub(1), now_ms)
                .count();
            let current = ledgers.ledger(l.key, sequence, now_ms);
            let (mut granted, mut lease_id) = (0, 0);
            if multi.success {
                current.pass(instance, l.cost);
                let available = lease::available(decision.remaining, view, now_ms, lease_ms);
                let grant = lease::grant(l.want, available, l.limit, view.holders, view.alone);
                (granted, lease_id) =
                    current.lease(instance, grant, view.share, view.covers, now_ms, until);
                current.record(
                    instance,
                    Counted {
                        call: l.call,
                        cost: l.cost,
                        lease_id,
                    },
                );
            } else if !decision.success {
                current.contend(instance);
            }
            DecideOutcome {
                decision: *decision,
                sequence,
                current: current.count(),
                previous,
                used: current.own(instance),
                lease: granted,
                lease_id,
                covers: lease_id != 0 && view.covers,
            }
        })
        .collect();
    DecideAnswer {
        success: multi.success,
        limits: outcomes,
    }
}
