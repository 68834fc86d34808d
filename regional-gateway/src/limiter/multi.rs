//! Multi-limit requests: all or nothing across the gateway's shards, decided locally when
//! every limit allows it (or one denies), otherwise at the origin as one request.

use strata_core::table::LimitRequest;
use strata_core::{
    LimitCheck, MultiDecision, OriginPlan, Reason, Verdict, WindowKeyRef, decide_all,
};

use super::Limiter;
use crate::metrics::Source;
use crate::origin::DecideLimit;

/// The locked table of limit `i`.
fn table_at<'a>(
    tables: &'a mut [std::sync::MutexGuard<'_, strata_core::CounterTable>],
    position: &[usize],
    i: usize,
) -> Option<&'a mut strata_core::CounterTable> {
    let p = *position.get(i)?;
    tables.get_mut(p).map(|t| &mut **t)
}

impl Limiter {
    /// Decides several limits, all or nothing: locally if every limit can be decided there
    /// (or any one denies there), otherwise all of them at the origin.
    pub async fn decide_all(&self, limits: &[LimitRequest<'_>]) -> MultiDecision {
        let mut refreshed = false;
        loop {
            let plans = self.classify_all(limits);
            let origin: Vec<(usize, OriginPlan)> = plans
                .iter()
                .enumerate()
                .filter_map(|(i, v)| match v {
                    Verdict::Origin(p) => Some((i, *p)),
                    Verdict::Local(_) => None,
                })
                .collect();
            let denied_here = plans
                .iter()
                .any(|v| matches!(v, Verdict::Local(d) if !d.success));
            if origin.is_empty() || denied_here {
                let multi = self.decide_all_locally(limits);
                self.account_all(limits, &multi, Source::Local);
                return multi;
            }
            let cold: Vec<(WindowKeyRef<'_>, u64)> = origin
                .iter()
                .filter(|(_, p)| matches!(p.reason, Reason::Cold | Reason::Stale))
                .filter_map(|(i, p)| limits.get(*i).map(|l| (l.key, p.sequence)))
                .collect();
            for (_, p) in &origin {
                self.metrics.origin_reason(p.reason, p.band);
            }
            if !cold.is_empty() && !refreshed {
                refreshed = true;
                if self.refresh_many(&cold).await == Source::Fallback {
                    let multi = self.decide_all_locally(limits);
                    self.account_all(limits, &multi, Source::Fallback);
                    return multi;
                }
                continue;
            }
            let (multi, source) = self.decide_all_at_origin(limits, &origin).await;
            self.account_all(limits, &multi, source);
            return multi;
        }
    }

    fn classify_all(&self, limits: &[LimitRequest<'_>]) -> Vec<Verdict> {
        let now = self.clock.now_ms();
        limits
            .iter()
            .map(|l| {
                let mut table = self.local.lock(l.key);
                let state = table.entry(l.key, now);
                let now = state.roll(l.key.duration(), now);
                state.observe_limit(l.limit);
                state.classify(l.key.duration(), l.limit, l.cost, now, &self.policy)
            })
            .collect()
    }

    /// Decides every limit from local memory with every involved table locked from the check
    /// to the increment: no other request can slip between them.
    fn decide_all_locally(&self, limits: &[LimitRequest<'_>]) -> MultiDecision {
        let now = self.clock.now_ms();
        let keys: Vec<WindowKeyRef<'_>> = limits.iter().map(|l| l.key).collect();
        let (mut tables, position) = self.local.lock_many(&keys);
        let checks: Vec<LimitCheck> = limits
            .iter()
            .enumerate()
            .filter_map(|(i, l)| {
                let state = table_at(&mut tables, &position, i)?.entry(l.key, now);
                Some(state.prepare(l.key.duration(), l.limit, l.cost, now))
            })
            .collect();
        let multi = decide_all(&checks, now, |i, j| keys.get(i) == keys.get(j));
        for (i, decision) in multi.to_apply() {
            if let (Some(l), Some(table)) = (limits.get(i), table_at(&mut tables, &position, i)) {
                table.entry(l.key, now).settle(
                    decision,
                    l.key.duration(),
                    l.cost,
                    now,
                    &self.policy,
                );
            }
        }
        multi
    }

    async fn decide_all_at_origin(
        &self,
        limits: &[LimitRequest<'_>],
        plans: &[(usize, OriginPlan)],
    ) -> (MultiDecision, Source) {
        let now = self.clock.now_ms();
        let request: Vec<DecideLimit<'_>> = limits
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let sequence = l.key.duration().sequence(now);
                let band = plans
                    .iter()
                    .find(|(j, _)| *j == i)
                    .map_or(0, |(_, p)| p.reserve());
                DecideLimit {
                    global: self.global.foreign(l.key, sequence),
                    key: l.key,
                    limit: l.limit,
                    cost: l.cost,
                    unseen: self
                        .replay
                        .pending(&l.key.to_owned_key(), sequence)
                        .saturating_add(band),
                }
            })
            .collect();
        match self.origin.decide(&self.instance, &request, now).await {
            Ok(answer) if answer.limits.len() == limits.len() => {
                let now = self.clock.now_ms();
                let decisions = limits
                    .iter()
                    .zip(&answer.limits)
                    .map(|(l, outcome)| {
                        let a =
                            self.answer_with_imports(l.key, outcome, answer.success, Some(l.limit));
                        self.local.lock(l.key).apply_decided(l.key, l.cost, &a, now)
                    })
                    .collect();
                (
                    MultiDecision {
                        success: answer.success,
                        decisions,
                    },
                    Source::Origin,
                )
            }
            _ => {
                for (i, p) in plans {
                    if let Some(l) = limits.get(*i) {
                        self.local.lock(l.key).fail_window(l.key, p.sequence, now);
                    }
                }
                (self.decide_all_locally(limits), Source::Fallback)
            }
        }
    }

    fn account_all(&self, limits: &[LimitRequest<'_>], multi: &MultiDecision, source: Source) {
        for (l, d) in limits.iter().zip(&multi.decisions) {
            let counted = multi.success && d.success;
            self.metrics.decision(source, counted);
            // The origin counted its own decisions; only local ones are replayed.
            if counted && source != Source::Origin {
                self.queue_replay(l, d);
            }
        }
    }
}
