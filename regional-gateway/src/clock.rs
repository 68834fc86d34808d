//! The gateway's one source of time: the system clock in production, a manual clock in tests
//! (which advance it by hand instead of sleeping).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Unix milliseconds, from the system or from a test.
#[derive(Clone, Debug, Default)]
pub struct Clock {
    manual: Option<Arc<AtomicU64>>,
}

impl Clock {
    /// The system clock.
    pub fn system() -> Self {
        Self { manual: None }
    }

    /// A clock that stands at `now_ms` until moved with [`Clock::advance`] or [`Clock::set`].
    pub fn manual(now_ms: u64) -> Self {
        Self {
            manual: Some(Arc::new(AtomicU64::new(now_ms))),
        }
    }

    /// The current time in Unix milliseconds.
    pub fn now_ms(&self) -> u64 {
        match &self.manual {
            Some(t) => t.load(Ordering::Relaxed),
            None => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
                .unwrap_or(0),
        }
    }

    /// Moves a manual clock forward (no effect on the system clock).
    pub fn advance(&self, ms: u64) {
        if let Some(t) = &self.manual {
            t.fetch_add(ms, Ordering::Relaxed);
        }
    }

    /// Sets a manual clock (no effect on the system clock).
    pub fn set(&self, now_ms: u64) {
        if let Some(t) = &self.manual {
            t.store(now_ms, Ordering::Relaxed);
        }
    }
}
