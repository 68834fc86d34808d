//! Origin calls in flight, per window key: concurrent requests whose key needs the origin wait
//! for the call one of them already made (its answer usually brings a lease that covers
//! them), instead of each sending its own. Only the origin path touches this; a request its
//! lease covers never does.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard};

use strata_core::WindowKeyRef;
use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;

const SHARDS: usize = 64;

/// One shard: key hash → the wake-up of its call's followers.
type Calls = HashMap<u64, Arc<Notify>>;

/// Calls in flight, by a hash of their window key (two keys sharing a hash only make one
/// wait for the other's call, then decide again).
#[derive(Debug)]
pub struct InFlight {
    shards: Box<[Mutex<Calls>]>,
    hasher: RandomState,
}

/// What a request on the origin path does.
pub(crate) enum Turn<'a> {
    /// Make the call; dropping this (answered, failed or cancelled) wakes the followers.
    Lead(Lead<'a>),
    /// Wait for the call in flight, then decide again.
    Follow(OwnedNotified),
}

/// The request whose call the others wait for.
pub(crate) struct Lead<'a> {
    calls: &'a InFlight,
    hash: u64,
    done: Arc<Notify>,
}

impl Default for InFlight {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
        }
    }
}

impl InFlight {
    fn shard(&self, hash: u64) -> MutexGuard<'_, Calls> {
        // The low bits pick the shard (truncation is the point).
        #[allow(clippy::cast_possible_truncation)]
        let shard = &self.shards[hash as usize % self.shards.len()];
        // The map is consistent after every operation: a poisoned lock is still usable.
        shard.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leads the call for `key`, or follows the one in flight.
    pub(crate) fn turn(&self, key: WindowKeyRef<'_>) -> Turn<'_> {
        let hash = self.hasher.hash_one(key);
        let mut shard = self.shard(hash);
        if let Some(done) = shard.get(&hash) {
            // Registered before the lock is released: the leader's wake-up cannot be missed.
            return Turn::Follow(done.clone().notified_owned());
        }
        let done = Arc::new(Notify::new());
        shard.insert(hash, done.clone());
        Turn::Lead(Lead {
            calls: self,
            hash,
            done,
        })
    }

    /// Calls in flight (for tests).
    pub fn len(&self) -> usize {
        (0..SHARDS).map(|i| self.shard(i as u64).len()).sum()
    }

    /// Whether no call is in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        let mut shard = self.calls.shard(self.hash);
        if shard
            .get(&self.hash)
            .is_some_and(|d| Arc::ptr_eq(d, &self.done))
        {
            shard.remove(&self.hash);
        }
        drop(shard);
        self.done.notify_waiters();
    }
}
