//! The band: how much other processes of the region may have admitted on a key that this
//! process has not seen yet. A local pass is safe only if the budget left covers it.
//!
//! `band = min(limit, max(rate_band, peer_band))` (DESIGN 3a): `rate_band` is the region's
//! recent rate on the key from other processes, per replay interval, measured between origin
//! answers; `peer_band` is this process's own cost over the last replay interval times
//! `peers - 1`, each peer assumed to run at our rate. A fixed band (5% or 10% of the limit)
//! does not help a burst and sends a client paced at its limit to the origin on most requests;
//! an estimate costs nothing for a key far from its limit or served by one process.

/// Band state of one window key: 64 bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BandState {
    /// Own cost in the current cell that the origin has acknowledged (replayed, or decided
    /// there), so `origin count - own_at_origin` is the other processes' share.
    pub(crate) own_at_origin: u64,
    /// The other processes' share of the current cell at the last origin answer.
    pub(crate) others_at_answer: u64,
    /// When that answer was merged (0: none yet).
    pub(crate) answered_at: u64,
    /// Others' cost per replay interval, from the last two answers.
    pub(crate) others_per_interval: u64,
    /// Index of the replay interval `bucket_cost[0]` covers.
    pub(crate) bucket: u64,
    /// Own admitted cost in this replay interval and in the one before.
    pub(crate) bucket_cost: [u64; 2],
    /// Distinct processes the origin saw on the key recently (at least 1: us).
    pub(crate) peers: u32,
}

impl BandState {
    /// Distinct processes last reported by the origin.
    pub const fn peers(&self) -> u32 {
        if self.peers == 0 { 1 } else { self.peers }
    }

    /// Others' cost per replay interval, as last estimated.
    pub const fn others_per_interval(&self) -> u64 {
        self.others_per_interval
    }

    /// A new window began: the counts restart, the rates carry over.
    pub(crate) fn roll(&mut self) {
        self.own_at_origin = 0;
        self.others_at_answer = 0;
    }

    fn rotate(&mut self, now_ms: u64, interval_ms: u64) {
        let bucket = now_ms / interval_ms.max(1);
        match bucket.saturating_sub(self.bucket) {
            0 => {}
            1 => self.bucket_cost = [0, self.bucket_cost[0]],
            _ => self.bucket_cost = [0, 0],
        }
        self.bucket = self.bucket.max(bucket);
    }

    /// Records cost this process admitted at `now_ms`.
    pub(crate) fn record_own(&mut self, cost: u64, now_ms: u64, interval_ms: u64) {
        self.rotate(now_ms, interval_ms);
        self.bucket_cost[0] = self.bucket_cost[0].saturating_add(cost);
    }

    /// Own cost admitted over the last replay interval, in cost x ms: this interval's bucket
    /// in full, plus the part of the previous one still inside the sliding interval.
    fn own_recent_scaled(&self, now_ms: u64, interval_ms: u64) -> u128 {
        let interval = interval_ms.max(1);
        let bucket = now_ms / interval;
        let into = now_ms % interval;
        let (current, previous) = match bucket.saturating_sub(self.bucket) {
            0 => (self.bucket_cost[0], self.bucket_cost[1]),
            1 => (0, self.bucket_cost[0]),
            _ => (0, 0),
        };
        u128::from(current) * u128::from(interval)
            + u128::from(previous) * u128::from(interval - into)
    }

    /// What an origin decision must count as used beyond what the origin holds: the other
    /// peers' local passes not yet replayed, each assumed to pass at our local rate. A peer
    /// replays every interval, so what it holds back can be up to two intervals old when our
    /// own local passes have already stopped: this counts our last one to two intervals.
    pub fn reserve(&self, now_ms: u64, interval_ms: u64) -> u64 {
        let bucket = now_ms / interval_ms.max(1);
        let own = match bucket.saturating_sub(self.bucket) {
            0 => self.bucket_cost[0].saturating_add(self.bucket_cost[1]),
            1 => self.bucket_cost[0],
            _ => 0,
        };
        own.saturating_mul(u64::from(self.peers().saturating_sub(1)))
    }

    /// Own cost admitted over the last replay interval, rounded up.
    pub fn own_recent(&self, now_ms: u64, interval_ms: u64) -> u64 {
        let scaled = self.own_recent_scaled(now_ms, interval_ms);
        u64::try_from(scaled.div_ceil(u128::from(interval_ms.max(1)))).unwrap_or(u64::MAX)
    }

    /// Own cost of the current cell now counted by the origin (a replay delivered it, or the
    /// origin decided it).
    pub(crate) fn acknowledge_own(&mut self, cost: u64) {
        self.own_at_origin = self.own_at_origin.saturating_add(cost);
    }

    /// Merges an origin answer on the current cell: the origin's regional count, and `peers`
    /// if the answer carried it. The others' growth since the last answer, spread over at
    /// least one replay interval (replays land in batches, so a jump seen over a shorter time
    /// is one interval's worth, not a faster rate), gives their rate.
    pub(crate) fn observe(
        &mut self,
        regional: u64,
        peers: Option<u32>,
        now_ms: u64,
        interval_ms: u64,
    ) {
        let others = regional.saturating_sub(self.own_at_origin);
        if self.answered_at != 0 && now_ms > self.answered_at {
            let grew = others.saturating_sub(self.others_at_answer);
            let elapsed = (now_ms - self.answered_at).max(interval_ms);
            let per_interval =
                (u128::from(grew) * u128::from(interval_ms)).div_ceil(u128::from(elapsed.max(1)));
            self.others_per_interval = u64::try_from(per_interval).unwrap_or(u64::MAX);
        }
        self.others_at_answer = self.others_at_answer.max(others);
        self.answered_at = self.answered_at.max(now_ms);
        if let Some(p) = peers {
            self.peers = p.max(1);
        }
    }

    /// The band at `now_ms` for `limit`: never negative, never above the limit.
    pub fn band(&self, limit: u64, now_ms: u64, interval_ms: u64) -> u64 {
        self.rate_band(now_ms, interval_ms)
            .max(self.peer_band(now_ms, interval_ms))
            .min(limit)
    }

    /// `rate_band`: the others' rate times what we cannot have seen of it: everything since
    /// our last origin answer, plus one replay interval they may still be holding back; at
    /// most two intervals (a key we keep passing locally gets a replay answer every interval).
    pub fn rate_band(&self, now_ms: u64, interval_ms: u64) -> u64 {
        let interval = u128::from(interval_ms.max(1));
        let since = u128::from(now_ms.saturating_sub(self.answered_at)).min(interval);
        let unseen_for = since + interval;
        let scaled = u128::from(self.others_per_interval) * unseen_for;
        u64::try_from(scaled.div_ceil(interval)).unwrap_or(u64::MAX)
    }

    /// `peer_band`: our own local passes over the last replay interval times the other peers,
    /// each assumed to pass locally at our rate, none of it replayed yet.
    pub fn peer_band(&self, now_ms: u64, interval_ms: u64) -> u64 {
        // Scale before rounding: four peers at 0.4 each are 2, not 4 x ceil(0.4) = 4.
        let others = u128::from(self.peers().saturating_sub(1));
        let scaled = self.own_recent_scaled(now_ms, interval_ms) * others;
        u64::try_from(scaled.div_ceil(u128::from(interval_ms.max(1)))).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const I: u64 = 100;

    #[test]
    fn a_lone_process_has_no_band() {
        let mut b = BandState::default();
        for t in 0..50 {
            b.record_own(10, 1_000 + t * 20, I);
            b.acknowledge_own(10);
            b.observe(10 * (t + 1), Some(1), 1_000 + t * 20, I);
        }
        assert_eq!(b.others_per_interval(), 0);
        assert_eq!(b.band(1_000, 2_000, I), 0);
    }

    #[test]
    fn peers_scale_our_own_recent_rate() {
        let mut b = BandState::default();
        b.observe(0, Some(5), 1_000, I);
        b.record_own(3, 1_010, I);
        b.record_own(4, 1_120, I);
        // At 1,150: 4 in this interval, and half of the previous interval's 3 still inside
        // the sliding 100 ms: own 5.5; four other peers at our rate: 22.
        assert_eq!(b.band(1_000, 1_150, I), 22);
        assert_eq!(b.band(10, 1_150, I), 10, "capped at the limit");
        assert_eq!(
            b.band(1_000, 1_250, I),
            8,
            "half of the 4 left: 2, times four peers"
        );
        assert_eq!(b.band(1_000, 1_400, I), 0);
    }

    #[test]
    fn others_rate_comes_from_growth_between_answers() {
        let mut b = BandState::default();
        b.observe(100, None, 1_000, I);
        b.acknowledge_own(20);
        // 300 ms later the cell is at 400: 20 were ours, 280 others': 94 per interval.
        b.observe(400, None, 1_300, I);
        assert_eq!(b.others_per_interval(), 94);
        // A jump seen 1 ms after the last answer is one interval's worth, not 100x faster.
        b.observe(450, None, 1_301, I);
        assert_eq!(b.others_per_interval(), 50);
    }

    #[test]
    fn a_lower_or_lost_origin_count_never_makes_the_band_negative() {
        let mut b = BandState::default();
        b.acknowledge_own(50);
        b.observe(10, Some(0), 1_000, I);
        b.observe(0, Some(0), 1_200, I);
        assert_eq!(b.peers(), 1);
        assert_eq!(b.band(100, 1_200, I), 0);
    }
}
