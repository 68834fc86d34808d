//! The global layer's G-Counter: one component per region and cell, merged with `max`, summed
//! for the global value; and the policy that decides which cells are worth publishing.
//!
//! A region publishes only its regional count. Reading the table back, its own component is a
//! lower bound on the regional count (it never freshens: the regional origin stays the truth),
//! and the foreign sum is kept apart in `global`, so nothing is ever counted twice or
//! republished by a region that does not own it.

use alloc::collections::BTreeMap;
use core::fmt;

use crate::cell::CellState;
use crate::identity::{Region, WindowKey};

/// Merges two observations of one component: it only grows within a cell.
pub const fn merge_component(a: u64, b: u64) -> u64 {
    if a > b { a } else { b }
}

/// One cell's components across regions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GCounter {
    components: BTreeMap<Region, u64>,
}

impl GCounter {
    /// An empty counter.
    pub const fn new() -> Self {
        Self {
            components: BTreeMap::new(),
        }
    }

    /// Records a region's observed count (a delayed, older value changes nothing).
    pub fn observe(&mut self, region: &Region, count: u64) {
        match self.components.get_mut(region) {
            Some(component) => *component = merge_component(*component, count),
            None => {
                self.components.insert(region.clone(), count);
            }
        }
    }

    /// Merges another replica of the same cell.
    pub fn merge(&mut self, other: &GCounter) {
        for (region, &count) in &other.components {
            self.observe(region, count);
        }
    }

    /// The global value: the sum of all components.
    pub fn value(&self) -> u64 {
        self.components
            .values()
            .fold(0_u64, |sum, &c| sum.saturating_add(c))
    }

    /// One region's component (0 if it never published).
    pub fn component(&self, region: &Region) -> u64 {
        self.components.get(region).copied().unwrap_or(0)
    }

    /// The sum of every component but `own`: what `own` imports as `global`.
    pub fn foreign_sum(&self, own: &Region) -> u64 {
        self.components
            .iter()
            .filter(|(region, _)| *region != own)
            .fold(0_u64, |sum, (_, &c)| sum.saturating_add(c))
    }
}

impl CellState {
    /// Imports this region's own published component: it can only raise the regional count,
    /// and it does not make the cell fresh. It also counts as flushed (the table already holds
    /// it), so the cell is not republished unchanged.
    pub fn import_own(&mut self, own_component: u64) {
        self.counts.regional = merge_component(self.counts.regional, own_component);
        self.last_flushed = merge_component(self.last_flushed, own_component);
    }

    /// Imports the sum of the other regions' components into `global` (never into `regional`,
    /// so it is never published again).
    pub fn import_foreign(&mut self, foreign_sum: u64) {
        self.counts.global = merge_component(self.counts.global, foreign_sum);
    }
}

/// The default publish floor: a cell is published once its region used 20% of the limit.
/// The reference system started at 50% and lowered it: with 50%, traffic spread evenly over
/// ten regions could reach about 5x the limit unseen; with 20% that free zone is 2x.
pub const DEFAULT_PUBLISH_FLOOR_PPM: u32 = 200_000;
const PPM: u64 = 1_000_000;

/// A publish floor outside `0.0 ..= 1.0`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FloorError(pub f64);

impl fmt::Display for FloorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "publish floor must be a fraction between 0 and 1, got {}",
            self.0
        )
    }
}

#[cfg(feature = "std")]
impl std::error::Error for FloorError {}

/// Which cells a flush writes to the global table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublishPolicy {
    floor_ppm: u32,
}

impl Default for PublishPolicy {
    fn default() -> Self {
        Self {
            floor_ppm: DEFAULT_PUBLISH_FLOOR_PPM,
        }
    }
}

impl PublishPolicy {
    /// A policy with the floor given as a fraction of the limit, kept to a millionth.
    pub fn from_fraction(floor: f64) -> Result<Self, FloorError> {
        if !(0.0..=1.0).contains(&floor) {
            return Err(FloorError(floor));
        }
        // In range, so the product is within 0 ..= 1e6 and the cast is exact after rounding.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let floor_ppm = (floor * PPM as f64 + 0.5) as u32;
        Ok(Self { floor_ppm })
    }

    /// A policy with the floor given in millionths of the limit (more than a million is the
    /// whole limit).
    pub fn from_ppm(floor_ppm: u64) -> Self {
        // At most a million, so it fits.
        #[allow(clippy::cast_possible_truncation)]
        let floor_ppm = floor_ppm.min(PPM) as u32;
        Self { floor_ppm }
    }

    /// The floor in millionths of the limit.
    pub fn floor_ppm(&self) -> u32 {
        self.floor_ppm
    }

    /// The floor as a fraction.
    pub fn floor(&self) -> f64 {
        f64::from(self.floor_ppm) / PPM as f64
    }

    /// The policy each of `regions` live regions publishes by: the floor divided among them,
    /// so a client spreading its traffic over every region is published (and every region then
    /// publishes the cell in full, as published elsewhere) before the regions together hold
    /// more than the floor unseen. With the reference's per-region floor, ten regions could
    /// each stay under it and admit ten floors' worth between them.
    pub fn shared_by(&self, regions: u64) -> Self {
        let regions = u32::try_from(regions.max(1)).unwrap_or(u32::MAX);
        Self {
            floor_ppm: self.floor_ppm / regions,
        }
    }

    /// The count at which a cell becomes worth publishing: `ceil(floor * limit)`.
    pub fn threshold(&self, limit: u64) -> u64 {
        let scaled = u128::from(limit) * u128::from(self.floor_ppm);
        let ceil = scaled.div_ceil(u128::from(PPM));
        u64::try_from(ceil).unwrap_or(u64::MAX)
    }

    /// Whether a cell should be flushed: its regional count grew since the last successful
    /// flush, and either it reached the floor of `limit` (the latest limit seen on the key) or
    /// another region already published the cell (then every unit matters to the sum the
    /// others see).
    pub fn should_publish(&self, cell: &CellState, limit: u64) -> bool {
        let regional = cell.counts.regional;
        regional > cell.last_flushed
            && (regional >= self.threshold(limit) || cell.counts.global > 0)
    }

    /// Whether a cell is worth a flush now rather than at the next tick: it is publishable
    /// and this region never wrote it, so the other regions know nothing of it yet (it just
    /// crossed the floor, or another region holds it). Later growth waits for the tick.
    pub fn publish_early(&self, cell: &CellState, limit: u64) -> bool {
        cell.last_flushed == 0 && self.should_publish(cell, limit)
    }
}

/// One row a flush writes: this region's component of one cell.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FlushRow {
    /// The window key (first, so rows sort in the table's unique-key order).
    pub key: WindowKey,
    /// The cell's sequence.
    pub sequence: u64,
    /// The regional count to publish (`count = GREATEST(count, this)`).
    pub count: u64,
    /// `(sequence + 2) * duration`.
    pub expires_at: u64,
}

/// Sorts flush rows into unique-key order, so concurrent flushers lock rows in the same order
/// and cannot deadlock.
pub fn sort_flush_rows(rows: &mut [FlushRow]) {
    rows.sort_unstable_by(|a, b| (&a.key, a.sequence).cmp(&(&b.key, b.sequence)));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(regional: u64, global: u64, last_flushed: u64) -> CellState {
        let mut c = CellState::COLD;
        c.counts.regional = regional;
        c.counts.global = global;
        c.last_flushed = last_flushed;
        c
    }

    #[test]
    fn floor_threshold_rounds_up() {
        let p = PublishPolicy::default();
        assert_eq!(p.threshold(10), 2);
        assert_eq!(p.threshold(11), 3);
        assert_eq!(p.threshold(0), 0);
        assert_eq!(p.threshold(u64::MAX), u64::MAX / 5); // 2^64 - 1 is a multiple of 5
        assert_eq!(PublishPolicy::from_fraction(0.5).unwrap().threshold(7), 4);
        assert!(PublishPolicy::from_fraction(1.5).is_err());
        assert!(PublishPolicy::from_fraction(f64::NAN).is_err());
    }

    #[test]
    fn below_the_floor_nothing_is_published_at_the_floor_it_is() {
        let p = PublishPolicy::default();
        assert!(!p.should_publish(&cell(19, 0, 0), 100));
        assert!(p.should_publish(&cell(20, 0, 0), 100));
    }

    #[test]
    fn a_cell_another_region_published_is_written_below_the_floor() {
        let p = PublishPolicy::default();
        assert!(p.should_publish(&cell(1, 30, 0), 100));
    }

    #[test]
    fn the_floor_is_divided_among_the_live_regions() {
        let p = PublishPolicy::default();
        assert_eq!(p.shared_by(0), p, "no region seen yet: this one alone");
        assert_eq!(p.shared_by(1), p);
        assert_eq!(p.shared_by(10).threshold(1_000), 20);
        assert_eq!(p.shared_by(3).threshold(1_000), 67, "rounded up");
        // Ten regions each just under their share hold at most the floor together.
        let ten = p.shared_by(10);
        assert!(!ten.should_publish(&cell(19, 0, 0), 1_000));
        assert!(10 * 19 < p.threshold(1_000));
        assert_eq!(p.shared_by(u64::MAX).threshold(1_000), 0);
    }

    #[test]
    fn only_a_first_write_is_early() {
        let p = PublishPolicy::default();
        assert!(!p.publish_early(&cell(19, 0, 0), 100), "under the floor");
        assert!(p.publish_early(&cell(20, 0, 0), 100), "crossed it");
        assert!(
            p.publish_early(&cell(1, 30, 0), 100),
            "another region holds it"
        );
        assert!(
            !p.publish_early(&cell(60, 0, 20), 100),
            "written before: the tick"
        );
    }

    #[test]
    fn an_unchanged_cell_is_not_rewritten() {
        let p = PublishPolicy::default();
        assert!(!p.should_publish(&cell(50, 30, 50), 100));
        assert!(p.should_publish(&cell(51, 30, 50), 100));
    }

    #[test]
    fn own_row_import_only_raises_and_never_freshens() {
        let mut c = cell(10, 0, 0);
        c.import_own(4);
        assert_eq!(c.counts.regional, 10);
        c.import_own(25);
        assert_eq!(c.counts.regional, 25);
        assert_eq!(c.counts.global, 0, "own rows never land in global");
        assert!(!c.is_warm() && !c.is_fresh(0));
        assert!(
            !PublishPolicy::default().should_publish(&c, 100),
            "already in the table"
        );
    }

    #[test]
    fn foreign_counts_are_never_published() {
        let p = PublishPolicy::default();
        let mut c = cell(0, 0, 0);
        c.import_foreign(90);
        assert_eq!(c.counts.global, 90);
        assert_eq!(c.counts.regional, 0);
        assert!(!p.should_publish(&c, 100), "nothing of ours to publish");
        c.import_foreign(40);
        assert_eq!(c.counts.global, 90, "an older sum does not lower it");
    }

    #[test]
    fn gcounter_sums_components_and_separates_foreign() {
        let (a, b, c) = (
            Region::new("a").unwrap(),
            Region::new("b").unwrap(),
            Region::new("c").unwrap(),
        );
        let mut g = GCounter::new();
        g.observe(&a, 5);
        g.observe(&b, 7);
        g.observe(&a, 3);
        g.observe(&c, 1);
        assert_eq!(g.component(&a), 5);
        assert_eq!(g.value(), 13);
        assert_eq!(g.foreign_sum(&a), 8);
    }
}
