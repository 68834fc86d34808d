//! Leases: the share of a limit a process may admit from its own memory before it asks the
//! origin again.
//!
//! A local pass is only wrong when other processes admitted, unseen, what was left. Instead of
//! estimating their unseen traffic, every process asks the origin for a lease with each
//! decision there: the origin grants at most half of what the limit leaves after everything
//! it counted *and* every other live lease, and records it. Local passes consume the lease;
//! anything beyond it is decided at the origin. So the region never admits more than the
//! limit, however many processes serve a key and however they start (a cold key, two
//! processes at the same millisecond), and a process that holds no lease (idle, or serving
//! other keys) takes nothing from anyone's budget.
//!
//! Costs, on one key: a lone process far from its limit asks once for a large lease (the
//! origin lends up to half of what lies above the last quarter of the limit), then once per
//! lease lifetime (5 s by default) or when it ran out (asking twice the last grant); near the
//! limit leases shrink and, shared by several processes, the last units are decided at the
//! origin nearly one by one, except the room each holder's own past passes free as the
//! previous window decays: a lease counts the holder's share of that weight, so it lends that
//! room too ([`available`]), and processes paced at a key's limit, one or several, ask a few
//! times a window, not every few requests. An idle process's unused lease holds back at most
//! half of what was left, for at most the lease lifetime plus [`LEASE_GRACE_MS`].

use crate::ledger::OriginView;
use crate::policy::Reason;

/// How long the origin keeps reserving a lease after its holder must stop using it: the
/// holder's last local passes reach the origin with its next replay (every 100 ms by
/// default), and until they do, the reservation stands in for them.
pub const LEASE_GRACE_MS: u64 = 1_000;

/// How long a lease near the limit may go without a local pass before the replay gives it
/// back: long enough that a key's ordinary gaps between requests keep it (each return costs
/// the next request a round trip), short against the lease lifetime it would otherwise hold
/// back from other processes.
pub const LEASE_IDLE_MS: u64 = 1_000;

/// Whether a view that leaves `remaining` of `limit` is far from it (at least half left): a
/// pass may go ahead of the origin's answer there, and a process with no grant asks for the
/// limit.
pub const fn leaves_half(remaining: u64, limit: u64) -> bool {
    remaining >= limit / 2
}

/// A process's lease history on one window key: what it was granted last, so the next ask
/// grows with demand, whether the lease in use covers the previous share ([`covers`]), and
/// how many other processes it lost the key's freed room to (8 bytes, carried across windows
/// like a rate: the grant in the low 55 bits, saturating, the covering flag in bit 55, the
/// rivals in the high 8).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseState {
    bits: u64,
}

/// The largest grant [`LeaseState`] records; a larger one is recorded as this (it only sizes
/// the next ask).
const GRANT_MAX: u64 = (1 << 55) - 1;
/// The bit that says the lease in use covers the previous share.
const COVERS: u64 = 1 << 55;

/// At most this many rivals are counted, whatever the limit: each one keeps a request of this
/// process waiting for one more freed unit.
pub const MAX_RIVALS: u64 = 7;

impl LeaseState {
    /// The lease to ask for, beyond the request's own cost: for a key new to this process,
    /// the whole limit (the origin's grant rule decides how much of it is safe to lend: a key
    /// with a few requests then costs one round trip, not one per doubling), and the same for
    /// a key `far` from its limit (at least half of it left in the view) on which it holds no
    /// grant (its passes went ahead and replays answered them): not 2, 4, 8... one round trip
    /// each (near the limit the small start stays: a large ask there reserves what others need);
    /// twice the last grant when a lease ran out; the last grant again when one expired, or
    /// when one ran out after a recent denial (strict: no growth near the limit).
    pub fn want(&self, reason: Reason, cost: u64, limit: u64, far: bool) -> u64 {
        let last = self.last_grant();
        let base = last.max(cost).max(1);
        let want = match reason {
            Reason::Cold => limit,
            Reason::Lease | Reason::Stale if far && last == 0 => limit,
            Reason::Lease => base.saturating_mul(2),
            Reason::Stale | Reason::Strict => base,
        };
        want.min(limit)
    }

    /// The size of the last lease granted.
    pub const fn last_grant(&self) -> u64 {
        self.bits & GRANT_MAX
    }

    /// Whether the lease in use covers this process's share of the previous window's weight
    /// (its ceiling bounds [`crate::WindowState::own_part`]).
    pub const fn covers(&self) -> bool {
        self.bits & COVERS != 0
    }

    pub(crate) fn set_covers(&mut self, covers: bool) {
        self.bits = if covers {
            self.bits | COVERS
        } else {
            self.bits & !COVERS
        };
    }

    /// How many other processes this one lost the key's freed room to, as it learned from
    /// the origin's denials of requests its own view passed.
    pub const fn rivals(&self) -> u64 {
        (self.bits >> 56) & 0xf
    }

    /// Wins in a row that found the room left for the rivals untaken.
    const fn untaken(&self) -> u64 {
        self.bits >> 60
    }

    /// The state as one integer (a snapshot's field).
    pub const fn to_bits(self) -> u64 {
        self.bits
    }

    /// The state [`to_bits`](Self::to_bits) wrote.
    pub const fn from_bits(bits: u64) -> Self {
        Self { bits }
    }

    pub(crate) fn granted(&mut self, lease: u64) {
        self.bits = (self.bits & !GRANT_MAX) | lease.min(GRANT_MAX);
    }

    fn set_rivals(&mut self, rivals: u64, untaken: u64) {
        self.bits = self.last_grant()
            | (self.bits & COVERS)
            | (rivals.min(MAX_RIVALS) << 56)
            | (untaken.min(0xf) << 60);
    }

    /// The origin denied a request this process's view passed: another process took the room
    /// the view saw freed. One more rival (the first of a new strict spell if the last one
    /// had ended), at most [`max_rivals`] for the limit and cost.
    pub(crate) fn lost_race(&mut self, strict: bool, limit: u64, cost: u64) {
        let rivals = if strict { self.rivals() } else { 0 };
        self.set_rivals(rivals.saturating_add(1).min(max_rivals(limit, cost)), 0);
    }

    /// The origin passed a request asked in strict mode, leaving `remaining`: when the room
    /// this process left its rivals was still there [`UNTAKEN_WINS`] times in a row, they
    /// are taking less than it thinks, so one rival fewer. (With rivals still there, the
    /// first of several asking for the same room also finds it untaken, but rarely twice.)
    pub(crate) fn won_race(&mut self, remaining: u64, cost: u64) {
        let rivals = self.rivals();
        if rivals == 0 {
            return;
        }
        if remaining < rivals.saturating_mul(cost) {
            self.set_rivals(rivals, 0);
        } else if self.untaken() + 1 >= UNTAKEN_WINS {
            self.set_rivals(rivals - 1, 0);
        } else {
            self.set_rivals(rivals, self.untaken() + 1);
        }
    }
}

/// Wins in a row that found the rivals' room untaken before a process counts one rival fewer.
pub const UNTAKEN_WINS: u64 = 2;

/// How many rivals a process may count at a limit and cost: each leaves one more request's
/// cost of freed room to the others, and together they leave at most 1% of the limit (at
/// least one request), so a process whose rivals went quiet waits at most that for room the
/// others no longer take.
pub fn max_rivals(limit: u64, cost: u64) -> u64 {
    (limit / 100 / cost.max(1)).clamp(1, MAX_RIVALS)
}

/// The share of a limit kept for small leases: within it, a lease is at most
/// `limit / (20 x holders)`, so all the leases that can go unused there add up to about 5%
/// of the limit (a process whose traffic stops strands its lease until it expires or gives
/// it back). Above it, a lease is up to half of what lies above the zone.
pub const EXACT_ZONE_DIVISOR: u64 = 4;
/// Within the exact zone a lease is at most `limit / (SMALL_LEASE_DIVISOR x holders)`.
pub const SMALL_LEASE_DIVISOR: u64 = 20;

/// The origin's grant after a pass that leaves `available` for the caller (what is left,
/// plus the caller's own lease left over, which the grant replaces), with `holders` live
/// leases on the cell (the caller's included): what was asked, at most half of what lies
/// above the last quarter of the limit, plus a small share that keeps what can go unused in
/// that last quarter near 5% of the limit. So a process arriving next always finds room,
/// and a burst that stops leaves little reserved. A caller `alone` on the key (see
/// [`OriginView::alone`]) whose available room is within one small share gets all of it (up to its
/// ask): halving that last share cost a lone process paced at its limit a round trip for each
/// halving, and what it may strand stays within the same 5% of the limit.
pub fn grant(want: u64, available: u64, limit: u64, holders: u64, alone: bool) -> u64 {
    let share = limit / SMALL_LEASE_DIVISOR.saturating_mul(holders.max(1));
    if alone && available <= share {
        return want.min(available);
    }
    let zone = limit / EXACT_ZONE_DIVISOR;
    let small = share.min(available / 2);
    let above = available.saturating_sub(zone) / 2;
    want.min(above.saturating_add(small))
}

/// A covering lease holding more unused room than it was lent goes back as surplus
/// ([`crate::WindowState::lease_surplus`]); the lent room counts as at least this many units...
pub const SURPLUS_FLOOR: u64 = 3;
/// ...and at least the limit divided by this.
pub const SURPLUS_FLOOR_DIVISOR: u64 = 400;

/// A covering lease needs a limit of at least this many costs per holder of the key.
/// Holders round their previous shares up ([`crate::WindowDuration::previous_share`]), so
/// each may leave up to one unit of what the window's formula would admit unused (half on
/// average, when several shares decay out of step); with at most one covering holder per
/// `COVER_FACTOR` costs of the limit, that stays within 0.5% of it.
pub const COVER_FACTOR: u64 = 200;

/// Whether a lease lent on a key of `limit` to a caller among `holders` live holders (the
/// caller included) covers the caller's share of the previous window's weight
/// ([`crate::ledger`]): lent so, a process paced near the limit keeps its pace from the room
/// its own past passes free, with no call; a smaller limit is lent plain leases, where the
/// rounding would cost more than 0.5% of the limit.
pub fn covers(limit: u64, cost: u64, holders: u64) -> bool {
    limit
        >= COVER_FACTOR
            .saturating_mul(cost.max(1))
            .saturating_mul(holders.max(1))
}

/// What the origin may lend a caller after a pass that leaves `remaining`: that, plus the
/// caller's own live lease (the grant replaces it, so what it held is free), plus, for a
/// plain lease to a caller alone on the key ([`OriginView::alone`]: the only writer of its
/// cells in every region), the room the previous window's decay frees before the lease ends.
///
/// A covering lease's ceiling counts the holder's share of the previous window's weight
/// beside its own count ([`covers`]), so on top of this the holder is lent the room its own
/// past passes free as the previous window decays, for as long as the lease lives: a process
/// paced at its limit, alone or beside others, keeps its pace from memory. Only a holder's
/// own share is lent that way: the room other processes' past passes free goes to whoever
/// asks the origin first.
///
/// Lending a lone plain holder room that is not there yet is safe too: each of its local
/// passes is also checked against its own view of the window (the region's count when the
/// lease was granted plus its own passes since), which for it is the whole truth, so it
/// cannot admit that room before the decay frees it; and every other process decides here,
/// against the holder's whole reservation.
pub fn available(remaining: u64, view: &OriginView, now_ms: u64, lease_ms: u64) -> u64 {
    let freed = if view.alone && !view.covers {
        view.check.freed_within(now_ms, lease_ms)
    } else {
        0
    };
    remaining.saturating_add(view.mine).saturating_add(freed)
}

/// Until when (origin clock) the origin reserves a lease granted at `now_ms` for
/// `lease_ms`.
pub const fn reserved_until(now_ms: u64, lease_ms: u64) -> u64 {
    now_ms
        .saturating_add(lease_ms)
        .saturating_add(LEASE_GRACE_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_grow_by_doubling_and_stop_while_strict() {
        let mut l = LeaseState::default();
        assert_eq!(
            l.want(Reason::Cold, 1, 100, false),
            100,
            "a new key asks for what it can get"
        );
        for reason in [Reason::Stale, Reason::Lease] {
            assert_eq!(
                l.want(reason, 1, 100, true),
                100,
                "no grant held (passes went ahead), far from the limit: as a new key"
            );
        }
        assert_eq!(l.want(Reason::Stale, 1, 100, false), 1, "near it: small");
        assert_eq!(l.want(Reason::Lease, 1, 100, false), 2, "near it: doubling");
        assert_eq!(l.want(Reason::Strict, 1, 100, true), 1, "strict: no growth");
        l.granted(1);
        assert_eq!(l.want(Reason::Stale, 1, 100, false), 1);
        assert_eq!(l.want(Reason::Lease, 1, 100, false), 2);
        l.granted(40);
        assert_eq!(l.want(Reason::Lease, 1, 100, false), 80);
        assert_eq!(
            l.want(Reason::Lease, 1, 50, false),
            50,
            "never above the limit"
        );
        assert_eq!(l.want(Reason::Stale, 1, 100, false), 40);
        assert_eq!(
            l.want(Reason::Strict, 1, 100, false),
            40,
            "no growth after a denial"
        );
    }

    #[test]
    fn lost_races_count_rivals_within_a_share_of_the_limit_and_untaken_room_forgets_them() {
        assert_eq!((max_rivals(100, 1), max_rivals(1_000, 1)), (1, MAX_RIVALS));
        assert_eq!(
            (max_rivals(1_000, 5), max_rivals(10, 1), max_rivals(5, 0)),
            (2, 1, 1)
        );
        let mut l = LeaseState::default();
        l.granted(40);
        for _ in 0..3 {
            l.lost_race(true, 500, 1);
        }
        assert_eq!(
            (l.rivals(), l.last_grant()),
            (3, 40),
            "packed beside the grant"
        );
        l.lost_race(true, 500, 1);
        l.lost_race(true, 500, 1);
        l.lost_race(true, 500, 1);
        assert_eq!(l.rivals(), 5, "at most 1% of the limit");
        l.lost_race(false, 500, 1);
        assert_eq!(l.rivals(), 1, "a new strict spell starts over");
        l.lost_race(true, 500, 1);
        l.won_race(1, 1);
        assert_eq!(l.rivals(), 2, "their room was taken: they are there");
        l.won_race(2, 1);
        assert_eq!(l.rivals(), 2, "untaken once: maybe the first of several");
        l.won_race(0, 1);
        l.won_race(5, 1);
        assert_eq!(l.rivals(), 2, "not twice in a row");
        l.won_race(5, 1);
        assert_eq!(l.rivals(), 1, "untaken twice in a row: one fewer");
        l.granted(u64::MAX);
        assert_eq!((l.last_grant(), l.rivals()), (GRANT_MAX, 1));
        assert_eq!(LeaseState::from_bits(l.to_bits()), l);
        l.set_covers(true);
        l.lost_race(true, 500, 1);
        l.granted(7);
        assert!(l.covers(), "kept beside the grant and the rivals");
        assert_eq!((l.last_grant(), l.rivals()), (7, 2));
        l.set_covers(false);
        assert!(!l.covers());
    }

    #[test]
    fn a_grant_leaves_half_of_what_lies_above_the_last_quarter() {
        assert_eq!(grant(10, 100, 100, 1, false), 10);
        assert_eq!(grant(80, 100, 100, 1, false), 37 + 5);
        assert_eq!(
            grant(80, 20, 100, 1, false),
            5,
            "the last quarter: small leases"
        );
        assert_eq!(grant(80, 20, 100, 5, false), 1, "shared by five holders");
        assert_eq!(
            grant(5, 1, 100, 1, false),
            0,
            "the last unit is decided at the origin"
        );
        assert_eq!(
            grant(80, 20, 100, 1, true),
            5,
            "alone, above one small share"
        );
        assert_eq!(grant(80, 5, 100, 1, true), 5, "alone, within it: all of it");
        assert_eq!(grant(3, 5, 100, 1, true), 3, "never more than asked");
    }
}
