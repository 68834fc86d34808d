//! Who a count belongs to: window keys, cells, components and regions, validated.
//!
//! The byte bounds come from the global table's unique index (MySQL caps an index at 3,072
//! bytes of utf8mb4): workspace 191, namespace and identifier 255, region 48. Any UTF-8 is
//! accepted inside those bounds; the Redis and SQL encodings, not the validation, are what keep
//! `:`, `{`, `}` and friends from forging another key.

use alloc::boxed::Box;
use alloc::string::String;
use core::cmp::Ordering;
use core::fmt;
use core::hash::BuildHasher;

use crate::window::{DurationError, WindowDuration};

/// Longest workspace id, in bytes.
pub const MAX_WORKSPACE_BYTES: usize = 191;
/// Longest namespace, in bytes.
pub const MAX_NAMESPACE_BYTES: usize = 255;
/// Longest identifier, in bytes.
pub const MAX_IDENTIFIER_BYTES: usize = 255;
/// Longest region name, in bytes.
pub const MAX_REGION_BYTES: usize = 48;

/// The identity field an [`IdentityError`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// The tenant that owns the counters.
    Workspace,
    /// The caller-chosen group of limits.
    Namespace,
    /// The subject being limited (an API key, a user, an address).
    Identifier,
    /// The region that owns a global component.
    Region,
}

impl Field {
    /// The name the wire format uses.
    pub const fn name(self) -> &'static str {
        match self {
            Field::Workspace => "workspace",
            Field::Namespace => "namespace",
            Field::Identifier => "identifier",
            Field::Region => "region",
        }
    }
}

/// Why an identity was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdentityError {
    /// The field is the empty string.
    Empty(Field),
    /// The field is longer than its bound.
    TooLong {
        /// Which field.
        field: Field,
        /// Its length in bytes.
        len: usize,
        /// The bound in bytes.
        max: usize,
    },
    /// A region name with a byte outside `[A-Za-z0-9._-]`.
    RegionCharacters,
    /// The window duration is out of bounds.
    Duration(DurationError),
}

impl fmt::Display for IdentityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdentityError::Empty(field) => write!(f, "{} must not be empty", field.name()),
            IdentityError::TooLong { field, len, max } => {
                write!(
                    f,
                    "{} is {len} bytes, at most {max} are allowed",
                    field.name()
                )
            }
            IdentityError::RegionCharacters => {
                f.write_str("region may contain only ASCII letters, digits, '.', '_' and '-'")
            }
            IdentityError::Duration(err) => err.fmt(f),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for IdentityError {}

impl From<DurationError> for IdentityError {
    fn from(err: DurationError) -> Self {
        IdentityError::Duration(err)
    }
}

fn check(field: Field, value: &str, max: usize) -> Result<(), IdentityError> {
    match value.len() {
        0 => Err(IdentityError::Empty(field)),
        len if len > max => Err(IdentityError::TooLong { field, len, max }),
        _ => Ok(()),
    }
}

/// The readable start an [`identifier_for`] digest keeps, in bytes at most.
pub const DIGEST_PREFIX_BYTES: usize = 128;
/// Between a digest's readable start and its hex. An encoded descriptor never holds `%s`
/// (its `%` always begins `%XX` in upper-case hex), and any other text that holds the marker
/// is digested too, so only a digest ever ends with it and its hex.
pub const DIGEST_MARKER: &str = "%sha256:";

/// The identifier of `text` (a descriptor, a binding's key) of any length: `text` itself when
/// it fits [`MAX_IDENTIFIER_BYTES`] and holds no [`DIGEST_MARKER`]; otherwise its first
/// [`DIGEST_PREFIX_BYTES`] (cut at a character, so the key stays readable in logs), the marker
/// and the SHA-256 of the whole text in hex: 200 bytes at most. Two texts that differ keep
/// identifiers that differ (as far as SHA-256 resists collisions), and every shell computes
/// the same one, so a long key is counted as one key everywhere.
pub fn identifier_for(text: String) -> String {
    use core::fmt::Write as _;
    use sha2::{Digest, Sha256};
    if text.len() <= MAX_IDENTIFIER_BYTES && !text.contains(DIGEST_MARKER) {
        return text;
    }
    let mut cut = DIGEST_PREFIX_BYTES.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out = String::with_capacity(cut + DIGEST_MARKER.len() + 64);
    out.push_str(text.get(..cut).unwrap_or_default());
    out.push_str(DIGEST_MARKER);
    for byte in Sha256::digest(text.as_bytes()) {
        let _ = write!(out, "{byte:02x}");
    }
    out
}

/// Validates a workspace id on its own (1–191 bytes), as a gateway does for its token table.
pub fn validate_workspace(workspace: &str) -> Result<(), IdentityError> {
    check(Field::Workspace, workspace, MAX_WORKSPACE_BYTES)
}

/// A borrowed, validated window key: `(workspace, namespace, identifier, duration)`. Lookups
/// use this form so the warm path never allocates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WindowKeyRef<'a> {
    workspace: &'a str,
    namespace: &'a str,
    identifier: &'a str,
    duration: WindowDuration,
}

impl<'a> WindowKeyRef<'a> {
    /// Validates the parts of a window key.
    pub fn new(
        workspace: &'a str,
        namespace: &'a str,
        identifier: &'a str,
        duration: WindowDuration,
    ) -> Result<Self, IdentityError> {
        check(Field::Workspace, workspace, MAX_WORKSPACE_BYTES)?;
        check(Field::Namespace, namespace, MAX_NAMESPACE_BYTES)?;
        check(Field::Identifier, identifier, MAX_IDENTIFIER_BYTES)?;
        Ok(Self {
            workspace,
            namespace,
            identifier,
            duration,
        })
    }

    /// The owning workspace.
    pub const fn workspace(&self) -> &'a str {
        self.workspace
    }
    /// The namespace.
    pub const fn namespace(&self) -> &'a str {
        self.namespace
    }
    /// The identifier.
    pub const fn identifier(&self) -> &'a str {
        self.identifier
    }
    /// The window length.
    pub const fn duration(&self) -> WindowDuration {
        self.duration
    }

    /// An owned copy: the three strings in one piece of text, inside the key when they fit
    /// ([`INLINE_KEY_BYTES`]), else in one allocation.
    pub fn to_owned_key(&self) -> WindowKey {
        WindowKey {
            text: Text::new([self.workspace, self.namespace, self.identifier]),
            // Validation bounds both lengths to 255 bytes, so they fit in a u8.
            workspace_len: u8::try_from(self.workspace.len()).unwrap_or(u8::MAX),
            namespace_len: u8::try_from(self.namespace.len()).unwrap_or(u8::MAX),
            duration_ms: u32::try_from(self.duration.as_ms()).unwrap_or(u32::MAX),
        }
    }

    /// The key's hash under `state`; equal for a key and its owned copy.
    pub fn hash_with(&self, state: &impl BuildHasher) -> u64 {
        // `str` hashes with a terminator, so the three parts cannot run into each other.
        state.hash_one((
            self.workspace,
            self.namespace,
            self.identifier,
            self.duration.as_ms(),
        ))
    }

    fn sort_tuple(&self) -> (&'a str, &'a str, &'a str, u64) {
        (
            self.workspace,
            self.namespace,
            self.identifier,
            self.duration.as_ms(),
        )
    }
}

/// Window keys order like the global table's unique key: workspace, namespace, identifier,
/// duration, each compared byte-wise (the SQL columns use a binary collation to match).
impl Ord for WindowKeyRef<'_> {
    fn cmp(&self, other: &Self) -> Ordering {
        self.sort_tuple().cmp(&other.sort_tuple())
    }
}

impl PartialOrd for WindowKeyRef<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Key text up to this many bytes (workspace, namespace and identifier together) is held
/// inside the key. A table lookup then compares it on the slot's own cache lines: at 10,000
/// keys, reading text from the heap was one more cache miss a request (`docs/BENCHMARKS.md`).
pub const INLINE_KEY_BYTES: usize = 38;

/// A key's text: inline when short (no allocation), else on the heap. The same text is always
/// held the same way, so the derived equality and hash agree with the text's.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Text {
    Inline {
        len: u8,
        bytes: [u8; INLINE_KEY_BYTES],
    },
    Heap(Box<str>),
}

impl Text {
    fn new(parts: [&str; 3]) -> Self {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        match u8::try_from(len) {
            Ok(short) if len <= INLINE_KEY_BYTES => {
                let mut bytes = [0; INLINE_KEY_BYTES];
                let mut at = 0;
                for part in parts {
                    if let Some(to) = bytes.get_mut(at..at + part.len()) {
                        to.copy_from_slice(part.as_bytes());
                    }
                    at += part.len();
                }
                Self::Inline { len: short, bytes }
            }
            _ => Self::Heap(parts.concat().into_boxed_str()),
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => bytes.get(..usize::from(*len)).unwrap_or_default(),
            Self::Heap(text) => text.as_bytes(),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            // Copied from three `&str`s, so always UTF-8 (the check only costs a scan).
            Self::Inline { .. } => core::str::from_utf8(self.as_bytes()).unwrap_or_default(),
            Self::Heap(text) => text,
        }
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Self::Inline { .. } => 0,
            Self::Heap(text) => text.len(),
        }
    }
}

/// An owned window key, its text inline when short: 48 bytes.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct WindowKey {
    text: Text,
    /// Durations are at most 30 days, 2.6e9 ms: a u32 holds them.
    duration_ms: u32,
    workspace_len: u8,
    namespace_len: u8,
}

impl WindowKey {
    /// Validates and copies the parts of a window key.
    pub fn new(
        workspace: &str,
        namespace: &str,
        identifier: &str,
        duration: WindowDuration,
    ) -> Result<Self, IdentityError> {
        WindowKeyRef::new(workspace, namespace, identifier, duration).map(|k| k.to_owned_key())
    }

    /// The borrowed form.
    pub fn as_ref(&self) -> WindowKeyRef<'_> {
        let ws = usize::from(self.workspace_len);
        let ns = ws + usize::from(self.namespace_len);
        let text = self.text.as_str();
        // The lengths were measured on char boundaries when the key was built.
        WindowKeyRef {
            workspace: text.get(..ws).unwrap_or_default(),
            namespace: text.get(ws..ns).unwrap_or_default(),
            identifier: text.get(ns..).unwrap_or_default(),
            duration: self.duration(),
        }
    }

    /// The window length.
    pub const fn duration(&self) -> WindowDuration {
        WindowDuration::from_valid_ms(self.duration_ms as u64)
    }

    /// Whether this is the key `other` borrows: compares bytes without re-deriving the
    /// borrowed form (no char-boundary checks on the lookup path).
    pub fn matches(&self, other: WindowKeyRef<'_>) -> bool {
        let ws = usize::from(self.workspace_len);
        let ns = ws + usize::from(self.namespace_len);
        let text = self.text.as_bytes();
        u64::from(self.duration_ms) == other.duration.as_ms()
            && ws == other.workspace.len()
            && ns - ws == other.namespace.len()
            && text.len() - ns == other.identifier.len()
            && text.get(ns..) == Some(other.identifier.as_bytes())
            && text.get(ws..ns) == Some(other.namespace.as_bytes())
            && text.get(..ws) == Some(other.workspace.as_bytes())
    }

    /// Heap bytes this key holds (for memory accounting).
    pub fn heap_bytes(&self) -> usize {
        self.text.heap_bytes()
    }
}

impl Ord for WindowKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.as_ref().cmp(&other.as_ref())
    }
}

impl PartialOrd for WindowKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Debug for WindowKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_ref().fmt(f)
    }
}

/// One fixed window of a window key: the unit the regional origin counts.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cell {
    /// The window key.
    pub key: WindowKey,
    /// `now_ms / duration_ms` of the window.
    pub sequence: u64,
}

impl Cell {
    /// When the cell stops mattering: `(sequence + 2) * duration`.
    pub fn expires_at(&self) -> u64 {
        self.key.duration().expires_at(self.sequence)
    }
}

/// A validated region name: 1–48 bytes of `[A-Za-z0-9._-]`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Region(Box<str>);

impl Region {
    /// Validates a region name.
    pub fn new(name: &str) -> Result<Self, IdentityError> {
        check(Field::Region, name, MAX_REGION_BYTES)?;
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(IdentityError::RegionCharacters);
        }
        Ok(Self(name.into()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One region's share of a cell in the global G-Counter.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Component {
    /// The cell.
    pub cell: Cell,
    /// The region that owns (and alone writes) this component.
    pub region: Region,
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    fn minute() -> WindowDuration {
        WindowDuration::from_ms(60_000).unwrap()
    }

    #[test]
    fn bounds_are_bytes_not_chars() {
        let id = "é".repeat(127); // 254 bytes
        assert!(WindowKeyRef::new("ws", "ns", &id, minute()).is_ok());
        let id = "é".repeat(128); // 256 bytes
        assert_eq!(
            WindowKeyRef::new("ws", "ns", &id, minute()),
            Err(IdentityError::TooLong {
                field: Field::Identifier,
                len: 256,
                max: 255
            })
        );
        assert!(WindowKeyRef::new(&"w".repeat(191), "ns", "id", minute()).is_ok());
        assert!(WindowKeyRef::new(&"w".repeat(192), "ns", "id", minute()).is_err());
        assert!(WindowKeyRef::new("ws", &"n".repeat(256), "id", minute()).is_err());
    }

    #[test]
    fn empty_parts_are_named_in_the_error() {
        let err = WindowKeyRef::new("ws", "", "id", minute()).unwrap_err();
        assert_eq!(err, IdentityError::Empty(Field::Namespace));
        assert_eq!(err.to_string(), "namespace must not be empty");
    }

    #[test]
    fn owned_key_round_trips_and_hashes_like_the_borrowed_one() {
        let state = foldhash::quality::FixedState::with_seed(7);
        let key = WindowKeyRef::new("wörk", "a:b{c}", "ü:{}", minute()).unwrap();
        let owned = key.to_owned_key();
        assert_eq!(owned.as_ref(), key);
        assert_eq!(owned.as_ref().hash_with(&state), key.hash_with(&state));
    }

    #[test]
    fn short_keys_are_held_inline_long_ones_on_the_heap_and_both_read_back() {
        let state = foldhash::quality::FixedState::with_seed(7);
        // 38 bytes of text fit inside the key (a two-byte char ends exactly at the bound).
        let fits = "i".repeat(INLINE_KEY_BYTES - "wö".len() - "ns".len() - 2) + "é";
        let over = fits.clone() + "x";
        for (id, heap) in [(fits.as_str(), 0), (over.as_str(), INLINE_KEY_BYTES + 1)] {
            let key = WindowKeyRef::new("wö", "ns", id, minute()).unwrap();
            let owned = key.to_owned_key();
            assert_eq!(owned.heap_bytes(), heap, "{id}");
            assert_eq!(owned.as_ref(), key);
            assert!(owned.matches(key));
            assert_eq!(owned.as_ref().hash_with(&state), key.hash_with(&state));
            assert_eq!(owned, owned.as_ref().to_owned_key());
        }
        let a = WindowKeyRef::new("wö", "ns", &fits, minute()).unwrap();
        let b = WindowKeyRef::new("wö", "ns", &over, minute()).unwrap();
        assert!(!a.to_owned_key().matches(b) && !b.to_owned_key().matches(a));
        assert_ne!(a.to_owned_key(), b.to_owned_key());
    }

    #[test]
    fn parts_cannot_run_into_each_other() {
        let state = foldhash::quality::FixedState::with_seed(7);
        let a = WindowKeyRef::new("ws", "ab", "c", minute()).unwrap();
        let b = WindowKeyRef::new("ws", "a", "bc", minute()).unwrap();
        assert_ne!(a, b);
        assert_ne!(a.to_owned_key(), b.to_owned_key());
        assert_ne!(a.hash_with(&state), b.hash_with(&state));
    }

    #[test]
    fn keys_sort_like_the_unique_index() {
        let k = |ns: &str, id: &str, d: u64| {
            WindowKey::new("ws", ns, id, WindowDuration::from_ms(d).unwrap()).unwrap()
        };
        let mut keys = alloc::vec![
            k("b", "a", 1000),
            k("a", "b", 1000),
            k("a", "a", 2000),
            k("a", "a", 1000)
        ];
        keys.sort();
        assert_eq!(
            keys,
            alloc::vec![
                k("a", "a", 1000),
                k("a", "a", 2000),
                k("a", "b", 1000),
                k("b", "a", 1000)
            ]
        );
    }

    #[test]
    fn regions_are_restricted_to_a_safe_alphabet() {
        assert!(Region::new("eu-west-1").is_ok());
        assert!(Region::new("us_east.2").is_ok());
        assert_eq!(Region::new("eu west"), Err(IdentityError::RegionCharacters));
        assert_eq!(Region::new(""), Err(IdentityError::Empty(Field::Region)));
        assert!(Region::new(&"r".repeat(49)).is_err());
    }
}
