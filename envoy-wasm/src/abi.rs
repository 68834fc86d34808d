//! The proxy-wasm 0.2.1 ABI as Envoy implements it, without an SDK: the host functions the
//! filter imports, each wrapped so that whatever status or bytes the host gives back become a
//! value (never a trap), and the memory the host copies values into.
//!
//! Why not the SDK (`proxy-wasm` 0.2.5): its host calls `panic!` on any status they do not
//! expect and declare the imports as returning its `Status` enum (a status it does not list is
//! undefined behaviour), and its dispatcher panics on a context or call token it does not know,
//! so a host that answers differently kills the VM; it also allocates, registers and looks up a
//! boxed context per stream. Here a stream is its context id and nothing else.

/// A header map (`proxy_get_header_map_value` and friends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Map {
    /// The downstream request's headers.
    RequestHeaders = 0,
    /// The response's headers.
    ResponseHeaders = 2,
    /// The headers of the call answer being delivered.
    CallResponseHeaders = 6,
}

/// A buffer (`proxy_get_buffer_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Buffer {
    /// The body of the call answer being delivered.
    CallResponseBody = 4,
    /// The plugin's configuration, in `proxy_on_configure`.
    PluginConfiguration = 7,
}

/// A status the host returned that is not success (its ABI number).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status(pub u32);

impl Status {
    /// There is nothing to take (a shared queue).
    pub const EMPTY: Status = Status(7);
    /// The key's value changed since it was read (shared data).
    pub const CAS_MISMATCH: Status = Status(8);
}

/// A log line's level (`proxy_log`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Level {
    /// Info.
    Info = 2,
    /// Warning.
    Warn = 3,
}

impl core::fmt::Display for Status {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let name = match self.0 {
            1 => "NotFound",
            2 => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            7 => "Empty",
            8 => "CasMismatch",
            10 => "InternalFailure",
            12 => "Unimplemented",
            _ => return write!(f, "status {}", self.0),
        };
        f.write_str(name)
    }
}

/// A header list in the ABI's encoding: the count, each name's and value's length, then each
/// name and value followed by a NUL (all lengths little-endian u32).
pub fn encode_map(pairs: &[(&str, &str)]) -> Vec<u8> {
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    let text: usize = pairs.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    let mut out = Vec::with_capacity(4 + 8 * pairs.len() + text);
    out.extend_from_slice(&len(pairs.len()));
    for (k, v) in pairs {
        out.extend_from_slice(&len(k.len()));
        out.extend_from_slice(&len(v.len()));
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

#[cfg(target_arch = "wasm32")]
pub mod calls;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_list_is_counted_sized_then_nul_terminated() {
        let bytes = encode_map(&[(":path", "/a"), ("x", "")]);
        let mut want = Vec::new();
        for n in [2_u32, 5, 2, 1, 0] {
            want.extend_from_slice(&n.to_le_bytes());
        }
        want.extend_from_slice(b":path\0/a\0x\0\0");
        assert_eq!(bytes, want);
        assert_eq!(encode_map(&[]), 0_u32.to_le_bytes());
    }

    #[test]
    fn a_status_names_itself_or_its_number() {
        assert_eq!(Status::CAS_MISMATCH.to_string(), "CasMismatch");
        assert_eq!(Status(99).to_string(), "status 99");
    }
}
