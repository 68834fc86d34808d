//! Response header values for a decision: the IETF `RateLimit-Policy` and `RateLimit` fields
//! (draft-ietf-httpapi-ratelimit-headers), `Retry-After`, and the legacy `X-RateLimit-*` trio.
//!
//! Values only; the shells decide where they go. All times are whole seconds, rounded up so a
//! client that waits as told is never early.

use alloc::format;
use alloc::string::String;
use core::fmt::Write;

use crate::decision::Decision;
use crate::window::WindowDuration;

/// One limit as the headers describe it.
#[derive(Clone, Copy, Debug)]
pub struct HeaderLimit<'a> {
    /// Policy name shown to clients (a rule or namespace name).
    pub policy: &'a str,
    /// The window the limit counts over.
    pub duration: WindowDuration,
    /// The decision for this limit.
    pub decision: &'a Decision,
}

/// The header values of a (possibly multi-limit) decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderValues {
    /// `RateLimit-Policy`: `"name";q=<limit>;w=<window seconds>`, one item per limit.
    pub policy: String,
    /// `RateLimit`: `"name";r=<remaining>;t=<seconds>`, one item per limit.
    pub ratelimit: String,
    /// `Retry-After` in seconds, present when the request was denied and can pass later.
    pub retry_after: Option<String>,
    /// `X-RateLimit-Limit` of the most constraining limit.
    pub legacy_limit: String,
    /// `X-RateLimit-Remaining` of the most constraining limit.
    pub legacy_remaining: String,
    /// `X-RateLimit-Reset`: Unix seconds at which the most constraining limit's window ends.
    pub legacy_reset: String,
}

/// Whole seconds in `ms`, rounded up.
pub const fn ceil_seconds(ms: u64) -> u64 {
    ms.div_ceil(1_000)
}

/// Writes `name` as a structured-field string (RFC 9651): printable ASCII with `"` and `\`
/// escaped; anything else becomes `_`, so a hostile namespace cannot break the header.
fn write_sf_string(out: &mut String, name: &str) {
    out.push('"');
    for c in name.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out.push('"');
}

/// Builds every header value for the limits of one request at `now_ms`. The `t` of a denied
/// limit is its retry-after; of a passed one, the seconds until its window resets.
pub fn header_values(limits: &[HeaderLimit<'_>], now_ms: u64) -> HeaderValues {
    let mut policy = String::new();
    let mut ratelimit = String::new();
    let mut retry_after: Option<u64> = None;
    let mut tightest: Option<&HeaderLimit<'_>> = None;
    for (i, l) in limits.iter().enumerate() {
        if i > 0 {
            policy.push_str(", ");
            ratelimit.push_str(", ");
        }
        let d = l.decision;
        write_sf_string(&mut policy, l.policy);
        let _ = write!(
            policy,
            ";q={};w={}",
            d.limit,
            ceil_seconds(l.duration.as_ms())
        );
        let reset_in = ceil_seconds(d.reset_ms.saturating_sub(now_ms));
        let t = match (d.success, d.retry_after_ms) {
            (false, Some(ms)) => ceil_seconds(ms),
            _ => reset_in,
        };
        write_sf_string(&mut ratelimit, l.policy);
        let _ = write!(ratelimit, ";r={};t={}", d.remaining, t);
        if !d.success {
            if let Some(ms) = d.retry_after_ms {
                // The request passes only once every limit allows it.
                retry_after = Some(retry_after.unwrap_or(0).max(ceil_seconds(ms).max(1)));
            }
        }
        let tighter = match tightest {
            None => true,
            Some(t) => (d.success, d.remaining) < (t.decision.success, t.decision.remaining),
        };
        if tighter {
            tightest = Some(l);
        }
    }
    let (legacy_limit, legacy_remaining, legacy_reset) = match tightest {
        Some(l) => (
            format!("{}", l.decision.limit),
            format!("{}", l.decision.remaining),
            format!("{}", ceil_seconds(l.decision.reset_ms)),
        ),
        None => (String::new(), String::new(), String::new()),
    };
    HeaderValues {
        policy,
        ratelimit,
        retry_after: retry_after.map(|s| format!("{s}")),
        legacy_limit,
        legacy_remaining,
        legacy_reset,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(success: bool, limit: u64, remaining: u64, retry: Option<u64>) -> Decision {
        Decision {
            success,
            limit,
            remaining,
            reset_ms: 1_700_000_060_000,
            retry_after_ms: retry,
        }
    }

    #[test]
    fn a_pass_describes_policy_and_remaining() {
        let d = decision(true, 100, 42, Some(0));
        let minute = WindowDuration::from_ms(60_000).unwrap();
        let h = header_values(
            &[HeaderLimit {
                policy: "api",
                duration: minute,
                decision: &d,
            }],
            1_700_000_030_500,
        );
        assert_eq!(h.policy, "\"api\";q=100;w=60");
        assert_eq!(h.ratelimit, "\"api\";r=42;t=30");
        assert_eq!(h.retry_after, None);
        assert_eq!(h.legacy_limit, "100");
        assert_eq!(h.legacy_remaining, "42");
        assert_eq!(h.legacy_reset, "1700000060");
    }

    #[test]
    fn a_denial_waits_for_the_slowest_limit_rounded_up() {
        let minute = WindowDuration::from_ms(60_000).unwrap();
        let a = decision(false, 10, 0, Some(1_200));
        let b = decision(false, 1_000, 3, Some(4_001));
        let c = decision(true, 5, 4, Some(0));
        let h = header_values(
            &[
                HeaderLimit {
                    policy: "a",
                    duration: minute,
                    decision: &a,
                },
                HeaderLimit {
                    policy: "b",
                    duration: minute,
                    decision: &b,
                },
                HeaderLimit {
                    policy: "c",
                    duration: minute,
                    decision: &c,
                },
            ],
            1_700_000_000_000,
        );
        assert_eq!(h.retry_after.as_deref(), Some("5"));
        assert_eq!(h.ratelimit, "\"a\";r=0;t=2, \"b\";r=3;t=5, \"c\";r=4;t=60");
        assert_eq!(h.legacy_limit, "10", "the denied limit with least left");
    }

    #[test]
    fn hostile_policy_names_cannot_break_the_field() {
        let d = decision(true, 1, 0, Some(0));
        let minute = WindowDuration::from_ms(60_000).unwrap();
        let h = header_values(
            &[HeaderLimit {
                policy: "a\"b\\c\r\nX: é",
                duration: minute,
                decision: &d,
            }],
            0,
        );
        assert!(
            h.policy.starts_with("\"a\\\"b\\\\c__X: _\";"),
            "{}",
            h.policy
        );
        assert!(h.policy.bytes().all(|b| (b' '..=b'~').contains(&b)));
    }

    #[test]
    fn a_request_that_can_never_pass_gets_no_retry_after() {
        let d = decision(false, 1, 1, None);
        let minute = WindowDuration::from_ms(60_000).unwrap();
        let h = header_values(
            &[HeaderLimit {
                policy: "p",
                duration: minute,
                decision: &d,
            }],
            0,
        );
        assert_eq!(h.retry_after, None);
    }
}
