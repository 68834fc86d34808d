//! Response header values for a decision: the IETF `RateLimit-Policy` and `RateLimit` fields
//! (draft-ietf-httpapi-ratelimit-headers), `Retry-After`, and the legacy `X-RateLimit-*` trio.
//!
//! Values only; the shells decide where they go. All times are whole seconds, rounded up so a
//! client that waits as told is never early.

use alloc::string::String;

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

/// One response header a decision sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// `RateLimit-Policy`: `"name";q=<limit>;w=<window seconds>`, one item per limit.
    Policy,
    /// `RateLimit`: `"name";r=<remaining>;t=<seconds>`, one item per limit.
    RateLimit,
    /// `Retry-After` in seconds, present when the request was denied and can pass later.
    RetryAfter,
    /// `X-RateLimit-Limit` of the most constraining limit.
    LegacyLimit,
    /// `X-RateLimit-Remaining` of the most constraining limit.
    LegacyRemaining,
    /// `X-RateLimit-Reset`: Unix seconds at which the most constraining limit's window ends.
    LegacyReset,
}

impl Field {
    /// Every field, in the order [`HeaderValues`] holds them.
    pub const ALL: [Field; 6] = [
        Field::Policy,
        Field::RateLimit,
        Field::RetryAfter,
        Field::LegacyLimit,
        Field::LegacyRemaining,
        Field::LegacyReset,
    ];

    /// The header name, lower case (as HTTP/2 and proxy-wasm want it).
    pub const fn name(self) -> &'static str {
        match self {
            Field::Policy => "ratelimit-policy",
            Field::RateLimit => "ratelimit",
            Field::RetryAfter => "retry-after",
            Field::LegacyLimit => "x-ratelimit-limit",
            Field::LegacyRemaining => "x-ratelimit-remaining",
            Field::LegacyReset => "x-ratelimit-reset",
        }
    }

    /// One of the legacy `X-RateLimit-*` trio.
    pub const fn is_legacy(self) -> bool {
        matches!(
            self,
            Field::LegacyLimit | Field::LegacyRemaining | Field::LegacyReset
        )
    }

    /// Whether a reply sends this field: all but the legacy trio, which only with `legacy`.
    pub const fn is_sent(self, legacy: bool) -> bool {
        legacy || !self.is_legacy()
    }
}

/// The header values of a (possibly multi-limit) decision, written one after another into one
/// string (one allocation per reply: a shell can hand out slices of it without copying).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderValues {
    text: String,
    /// Where each field of [`Field::ALL`] ends in `text` (each starts where the one before
    /// ends); an absent `Retry-After` is empty.
    ends: [usize; 6],
}

impl HeaderValues {
    /// Where `field`'s value lies in [`Self::text`], `None` if the reply has no such header.
    pub fn range(&self, field: Field) -> Option<core::ops::Range<usize>> {
        let i = field as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        let end = self.ends[i];
        (field != Field::RetryAfter || end > start).then_some(start..end)
    }

    /// `field`'s value, `None` if the reply has no such header.
    pub fn get(&self, field: Field) -> Option<&str> {
        self.range(field).and_then(|r| self.text.get(r))
    }

    /// The fields present, with their values.
    pub fn fields(&self) -> impl Iterator<Item = (Field, &str)> {
        Field::ALL
            .into_iter()
            .filter_map(|f| self.get(f).map(|v| (f, v)))
    }

    /// Every value, one after another ([`Self::range`] says where each lies).
    pub fn into_text(self) -> String {
        self.text
    }
}

/// Whole seconds in `ms`, rounded up.
pub const fn ceil_seconds(ms: u64) -> u64 {
    ms.div_ceil(1_000)
}

/// Appends `n` in decimal: every reply writes half a dozen numbers of up to ten digits,
/// and `core::fmt` (or a digit at a time) costs several times `itoa`'s two at a time.
fn push_u64(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
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
    // Room for one limit's fields with a short name, so the usual reply allocates once.
    let names: usize = limits.iter().map(|l| l.policy.len()).sum();
    let mut text = String::with_capacity(96 + 2 * names + 64 * limits.len().saturating_sub(1));
    let mut ends = [0; 6];
    let mut retry_after: Option<u64> = None;
    let mut tightest: Option<&HeaderLimit<'_>> = None;
    for (i, l) in limits.iter().enumerate() {
        if i > 0 {
            text.push_str(", ");
        }
        write_sf_string(&mut text, l.policy);
        text.push_str(";q=");
        push_u64(&mut text, l.decision.limit);
        text.push_str(";w=");
        push_u64(&mut text, ceil_seconds(l.duration.as_ms()));
    }
    ends[0] = text.len();
    for (i, l) in limits.iter().enumerate() {
        if i > 0 {
            text.push_str(", ");
        }
        let d = l.decision;
        let reset_in = ceil_seconds(d.reset_ms.saturating_sub(now_ms));
        let t = match (d.success, d.retry_after_ms) {
            (false, Some(ms)) => ceil_seconds(ms),
            _ => reset_in,
        };
        write_sf_string(&mut text, l.policy);
        text.push_str(";r=");
        push_u64(&mut text, d.remaining);
        text.push_str(";t=");
        push_u64(&mut text, t);
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
    ends[1] = text.len();
    if let Some(s) = retry_after {
        push_u64(&mut text, s);
    }
    ends[2] = text.len();
    if let Some(l) = tightest {
        push_u64(&mut text, l.decision.limit);
        ends[3] = text.len();
        push_u64(&mut text, l.decision.remaining);
        ends[4] = text.len();
        push_u64(&mut text, ceil_seconds(l.decision.reset_ms));
    } else {
        ends[3] = text.len();
        ends[4] = text.len();
    }
    ends[5] = text.len();
    HeaderValues { text, ends }
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
        assert_eq!(h.get(Field::Policy), Some("\"api\";q=100;w=60"));
        assert_eq!(h.get(Field::RateLimit), Some("\"api\";r=42;t=30"));
        assert_eq!(h.get(Field::RetryAfter), None);
        assert_eq!(h.get(Field::LegacyLimit), Some("100"));
        assert_eq!(h.get(Field::LegacyRemaining), Some("42"));
        assert_eq!(h.get(Field::LegacyReset), Some("1700000060"));
        assert_eq!(h.fields().count(), 5);
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
        assert_eq!(h.get(Field::RetryAfter), Some("5"));
        assert_eq!(
            h.get(Field::RateLimit),
            Some("\"a\";r=0;t=2, \"b\";r=3;t=5, \"c\";r=4;t=60")
        );
        assert_eq!(
            h.get(Field::Policy),
            Some("\"a\";q=10;w=60, \"b\";q=1000;w=60, \"c\";q=5;w=60")
        );
        assert_eq!(
            h.get(Field::LegacyLimit),
            Some("10"),
            "the denied limit with least left"
        );
        assert_eq!(h.get(Field::LegacyRemaining), Some("0"));
        assert_eq!(h.fields().count(), 6);
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
        let policy = h.get(Field::Policy).unwrap_or_default();
        assert!(policy.starts_with("\"a\\\"b\\\\c__X: _\";"), "{policy}");
        assert!(h.into_text().bytes().all(|b| (b' '..=b'~').contains(&b)));
    }

    #[test]
    fn numbers_are_written_in_decimal_from_zero_to_the_largest() {
        for n in [0, 1, 9, 10, 99, 100, 12_345, u64::MAX / 10, u64::MAX] {
            let mut out = String::from("x");
            push_u64(&mut out, n);
            assert_eq!(out, alloc::format!("x{n}"));
        }
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
        assert_eq!(h.get(Field::RetryAfter), None);
        assert_eq!(h.range(Field::RetryAfter), None);
    }
}
