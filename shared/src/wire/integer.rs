//! JSON integers as JSON Schema defines them: `1000` and `1000.0` are the same integer, so a
//! client whose JSON library writes integral floats (Python's `1000.0`, a JavaScript number
//! that went through arithmetic) is not rejected. A fraction, a negative number, or a float too
//! large to be exact (past 2^53) is still an error.

use core::fmt;

use serde::Deserializer;
use serde::de::{Error, Visitor};

/// The largest integer an `f64` holds exactly, and so the largest accepted in float form.
const EXACT_FLOAT: f64 = 9_007_199_254_740_992.0;

struct Integer;

impl Visitor<'_> for Integer {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a non-negative integer")
    }

    fn visit_u64<E: Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    fn visit_i64<E: Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
    }

    fn visit_f64<E: Error>(self, v: f64) -> Result<u64, E> {
        // `as` saturates and drops the fraction: equal after the round trip means integral.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let n = v as u64;
        if (0.0..=EXACT_FLOAT).contains(&v) && n as f64 == v {
            Ok(n)
        } else {
            Err(E::invalid_value(serde::de::Unexpected::Float(v), &self))
        }
    }
}

/// `deserialize_with` for a `u64` field.
pub(crate) fn integer<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(Integer)
}

struct OptionalInteger;

impl<'de> Visitor<'de> for OptionalInteger {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a non-negative integer or null")
    }

    fn visit_none<E: Error>(self) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_unit<E: Error>(self) -> Result<Option<u64>, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
        integer(d).map(Some)
    }
}

/// `deserialize_with` for an `Option<u64>` field (`null` or absent is `None`).
pub(crate) fn optional_integer<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    d.deserialize_option(OptionalInteger)
}
