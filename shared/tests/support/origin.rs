//! The regional origin of the in-process models: one `CellLedger` per cell, deciding and
//! merging replays as the embedded origin does (regional-gateway/src/origin/memory.rs),
//! through the core's `ledger::decide`, over the wire types.

use std::collections::HashMap;

use strata_core::ledger::{self, CellLedger, DecideLimit, Ledgers};
use strata_core::wire::{
    CellsResponse, DecideRequest, DecideResponse, DecideResult, ReplayRequest,
};
use strata_core::{Counts, WindowKey, WindowKeyRef};

/// How long the model's origin lends a lease for.
pub const LEASE_MS: u64 = 5_000;

const fn regional(regional: u64) -> Counts {
    Counts {
        regional,
        global: 0,
    }
}

/// The ledgers of the model's origin, one per cell (none expire within a run).
#[derive(Default)]
pub struct Cells(pub HashMap<(WindowKey, u64), CellLedger>);

impl Ledgers for Cells {
    fn ledger(&mut self, key: WindowKeyRef<'_>, sequence: u64, _: u64) -> &mut CellLedger {
        self.0.entry((key.to_owned_key(), sequence)).or_default()
    }
}

/// The regional origin: one ledger per cell, and how many decisions it made.
#[derive(Default)]
pub struct Origin {
    pub cells: Cells,
    pub decisions: u64,
}

impl Origin {
    pub fn ledger(&mut self, key: &WindowKey, sequence: u64) -> &mut CellLedger {
        self.cells.ledger(key.as_ref(), sequence, 0)
    }

    /// `POST /v1/origin/decide`, answered by the core's origin decision, as the embedded
    /// origin answers it.
    pub fn decide(&mut self, req: &DecideRequest, now: u64) -> DecideResponse {
        self.decisions += 1;
        let limits = req.validate("ws").unwrap();
        let limits: Vec<DecideLimit<'_>> = limits
            .iter()
            .map(|l| DecideLimit::new(l, now, [0, 0], [0, 0]))
            .collect();
        let answer = ledger::decide(&mut self.cells, &req.instance, &limits, now, LEASE_MS);
        let results: Vec<DecideResult> = answer
            .limits
            .iter()
            .map(|o| DecideResult {
                success: o.decision.success,
                limit: o.decision.limit,
                remaining: o.decision.remaining,
                reset: o.decision.reset_ms,
                sequence: o.sequence,
                current: regional(o.current),
                previous: regional(o.previous),
                used: o.used,
                lease: o.lease,
                lease_id: o.lease_id,
                lease_ms: LEASE_MS,
                covers: o.covers,
            })
            .collect();
        DecideResponse {
            success: answer.success,
            sequence: results[0].sequence,
            results,
        }
    }

    /// `POST /v1/origin/replay`: own counts merged with `max`; a release drops the lease.
    pub fn replay(&mut self, req: &ReplayRequest) -> CellsResponse {
        let events = req.validate("ws").unwrap();
        let cells = events
            .iter()
            .map(|e| {
                let ledger = self.ledger(&e.cell.key.to_owned_key(), e.cell.sequence);
                ledger.merge_own(&req.instance, e.used);
                ledger.undo(&req.instance, e.undo_from);
                if e.release > 0 {
                    ledger.release(&req.instance, e.release);
                }
                regional(ledger.count())
            })
            .collect();
        CellsResponse {
            cells,
            renewed: Vec::new(),
            pace: None,
        }
    }
}
