//! Region-wide origin settings and the reasons a decision goes to the origin: plain data that
//! the window state, the lease rules and the request path all read (kept apart so none of
//! them imports another for it).

use serde::{Deserialize, Serialize};

/// How long a lease may be used by default (the origin's `--fresh-for`).
pub const DEFAULT_LEASE_MS: u64 = 5_000;
/// How long a failed origin call holds off the next call for the same cell by default.
pub const DEFAULT_READ_RETRY_MS: u64 = 300;
/// A request with no live answer (a cold cell, no live lease) passes ahead of the origin's
/// answer only if its limit is at least this many times its cost (and half of it is left in
/// the process's view): what it can admit over the limit (one request per process and
/// answer, at a key others spent meanwhile) stays under 1/64 of the limit per process.
pub const AHEAD_LIMIT_PER_COST: u64 = 64;

/// What a request whose decision needs the origin gets when the origin gives no answer (the
/// call failed, timed out or was refused, or a failure moments ago holds calls off: see
/// [`OriginPolicy::read_retry_ms`]). One meaning in every shell. A denial the process's own
/// counts prove, and a pass a lease granted before the outage covers, are decided from memory
/// in every mode: they need no origin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Decide from local memory: the counts known so far plus this process's own passes.
    #[default]
    Local,
    /// Let it through, counted locally, unless this process's own count proves a limit
    /// exceeded at that moment: in effect the local view, as `Local`.
    Allow,
    /// Deny it.
    Deny,
}

impl FailureMode {
    /// Every mode, in the order configuration lists them.
    pub const ALL: [FailureMode; 3] = [FailureMode::Local, FailureMode::Allow, FailureMode::Deny];

    /// As configuration spells it (serde's spelling too).
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureMode::Local => "local",
            FailureMode::Allow => "allow",
            FailureMode::Deny => "deny",
        }
    }

    /// Whether the mode decides from memory (`local`, and `allow`, which passes unless the
    /// process's own count proves a limit exceeded); `deny` denies instead. The same modes let
    /// a request with no live answer pass ahead of the origin's (see
    /// [`AHEAD_LIMIT_PER_COST`]): it is decided as an outage would decide it, and the replay
    /// answer that acknowledges it brings the region's count; `deny` admits nothing the
    /// origin did not answer.
    pub const fn from_memory(self) -> bool {
        !matches!(self, FailureMode::Deny)
    }
}

/// A word that names no failure mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownFailureMode;

impl core::fmt::Display for UnknownFailureMode {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("not one of local, allow, deny")
    }
}

impl core::str::FromStr for FailureMode {
    type Err = UnknownFailureMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s.trim())
            .ok_or(UnknownFailureMode)
    }
}

/// Region-wide origin settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OriginPolicy {
    /// How long a lease the origin grants may be used (it reserves it
    /// [`crate::lease::LEASE_GRACE_MS`] longer).
    pub lease_ms: u64,
    /// After a failed origin call, decisions on the cell stay local this long before the
    /// next call is tried (so a down origin costs one timeout per cell per interval, not one
    /// per request).
    pub read_retry_ms: u64,
    /// What requests get while the origin gives no answer.
    pub failure_mode: FailureMode,
}

impl Default for OriginPolicy {
    fn default() -> Self {
        Self {
            lease_ms: DEFAULT_LEASE_MS,
            read_retry_ms: DEFAULT_READ_RETRY_MS,
            failure_mode: FailureMode::Local,
        }
    }
}

/// Why a decision goes to the origin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// No origin decision has been merged for the window yet.
    Cold,
    /// The lease expired.
    Stale,
    /// A recent denial on the window key: every pass is decided at the origin meanwhile.
    Strict,
    /// The lease left does not cover the cost.
    Lease,
}

impl Reason {
    /// Every reason, in the order of [`index`](Self::index).
    pub const ALL: [Reason; 4] = [Reason::Cold, Reason::Stale, Reason::Strict, Reason::Lease];

    /// Their labels ([`as_str`](Self::as_str)), in the same order: the gateway's metric labels,
    /// the shells' stat names and the lab's columns.
    pub const LABELS: [&'static str; 4] = [
        Self::ALL[0].as_str(),
        Self::ALL[1].as_str(),
        Self::ALL[2].as_str(),
        Self::ALL[3].as_str(),
    ];

    /// This reason's place in [`ALL`](Self::ALL): an array of counts by reason is indexed so.
    pub const fn index(self) -> usize {
        match self {
            Reason::Cold => 0,
            Reason::Stale => 1,
            Reason::Strict => 2,
            Reason::Lease => 3,
        }
    }

    /// Label for logs and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Cold => "cold",
            Reason::Stale => "stale",
            Reason::Strict => "strict",
            Reason::Lease => "lease",
        }
    }
}
