//! The rule model both Wasm shells share: which requests a rule limits, and under which
//! identifier.
//!
//! A rule matches a request (method, host, path prefix, headers) and builds a descriptor from
//! ordered actions in Envoy's rate-limit vocabulary (`request_headers`, `remote_address`,
//! `generic_key`, `header_value_match`), so Envoy users read it as they would Envoy's own. As
//! in Envoy, an action that cannot produce its entry means the rule does not apply to the
//! request (except `request_headers` with `skip_if_absent`, which drops just that entry). The
//! descriptor, encoded so no value can forge another, is the identifier of the rule's limit.
//!
//! Rules are parsed once ([`RuleSet::from_json`]); every error names the field at fault, as
//! `rules[2].actions[0].request_headers.header_name: …`.

use alloc::borrow::Cow;
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;

use serde::Deserialize;

use crate::address::ClientAddress;
use crate::identity::{MAX_NAMESPACE_BYTES, identifier_for};
use crate::window::WindowDuration;

/// Most rules in one set: every matching rule is a limit of one all-or-nothing decision.
pub const MAX_RULES: usize = 32;
/// Most actions in one rule.
pub const MAX_ACTIONS: usize = 8;

/// A request as the rules see it. Header names are asked in lower case.
///
/// Header values are bytes, as clients send them: HTTP allows any octet but control characters
/// in a value, and Envoy passes them on. The rules compare bytes, a cost must be ASCII digits,
/// and a descriptor spells each byte that is not UTF-8 as `%XX`, so no value is lost, borrowed
/// or confused with another.
pub trait RequestView {
    /// The method, upper case (`GET`).
    fn method(&self) -> &str;
    /// The host the request is for, without the port.
    fn host(&self) -> &str;
    /// The path, without the query.
    fn path(&self) -> &str;
    /// A header's value, by lower-case name.
    fn header(&self, name: &str) -> Option<&[u8]>;
    /// The address of the peer that connected, as the runtime gives it (a port may follow),
    /// if known: Envoy's `source.address`, workerd's `request.cf.clientIp`.
    fn peer_address(&self) -> Option<&str>;
}

/// A request held as its parts, with the headers as a list of lower-case `(name, value)`
/// pairs: how a shell that gets headers as a list (Envoy) hands a request to the rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListRequest {
    /// Upper-case method.
    pub method: String,
    /// Host without port (see [`host_of`]).
    pub host: String,
    /// Path without query (see [`path_of`]).
    pub path: String,
    /// Lower-case names and their values' bytes; the first pair of a name wins.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The peer's address as the runtime gives it (see [`RequestView::peer_address`]).
    pub peer: Option<String>,
}

impl RequestView for ListRequest {
    fn method(&self) -> &str {
        &self.method
    }
    fn host(&self) -> &str {
        &self.host
    }
    fn path(&self) -> &str {
        &self.path
    }
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
    fn peer_address(&self) -> Option<&str> {
        self.peer.as_deref()
    }
}

/// The host of an authority (`Host` header, `:authority`, a URL's): without user info or
/// port; a `[v6]` literal keeps its brackets.
pub fn host_of(authority: &str) -> &str {
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if host.starts_with('[') {
        return host.split_inclusive(']').next().unwrap_or(host);
    }
    host.split(':').next().unwrap_or(host)
}

/// A request target's path, without query or fragment (`/` when empty).
pub fn path_of(target: &str) -> &str {
    let path = target.split(['?', '#']).next().unwrap_or("");
    if path.is_empty() { "/" } else { path }
}

/// The path as the rules match it, as Envoy's `normalize_path` and `merge_slashes` make it and
/// as an upstream that normalizes would route it: `%XX` of an unreserved character (or of
/// `/`) decoded, runs of `/` merged, and `.` and `..` segments removed (RFC 3986 §5.2.4). So
/// `//login`, `/%6Cogin` and `/x/../login` all meet a `path_prefix` of `/login`. Borrowed when
/// the path is already normal, as nearly every path is.
pub fn normalized_path(path: &str) -> Cow<'_, str> {
    let normal = !path.contains('%')
        && !path.contains("//")
        && !path.split('/').any(|s| s == "." || s == "..");
    if normal || !path.starts_with('/') {
        return Cow::Borrowed(path);
    }
    let decoded = percent_decode_unreserved(path);
    let mut kept: Vec<&str> = Vec::new();
    let mut trailing_slash = false;
    // The first piece is the empty one before the leading `/`; empty pieces after it are the
    // merged runs of `/`.
    let pieces: Vec<&str> = decoded.split('/').skip(1).collect();
    for (i, piece) in pieces.iter().enumerate() {
        let last = i + 1 == pieces.len();
        match *piece {
            "" | "." => trailing_slash |= last,
            ".." => {
                kept.pop();
                trailing_slash |= last;
            }
            segment => {
                kept.push(segment);
                trailing_slash = false;
            }
        }
    }
    let mut out = String::with_capacity(path.len());
    for segment in &kept {
        out.push('/');
        out.push_str(segment);
    }
    if out.is_empty() || trailing_slash {
        out.push('/');
    }
    Cow::Owned(out)
}

/// `path` with each `%XX` of an unreserved character (RFC 3986: letters, digits, `-._~`) or of
/// `/` decoded; every other escape kept, in upper-case hex.
fn percent_decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let escaped = (b == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .filter(|hex| hex.iter().all(u8::is_ascii_hexdigit))
            .and_then(|hex| core::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(c) if c.is_ascii_alphanumeric() || b"-._~/".contains(&c) => {
                out.push(char::from(c));
                i += 3;
            }
            Some(c) => {
                use core::fmt::Write as _;
                let _ = write!(out, "%{c:02X}");
                i += 3;
            }
            None => {
                // A whole UTF-8 character (the path is a `str`): copy it as it is.
                let len = path
                    .get(i..)
                    .and_then(|rest| rest.chars().next())
                    .map_or(1, char::len_utf8);
                out.push_str(path.get(i..i + len).unwrap_or_default());
                i += len;
            }
        }
    }
    out
}

/// A peer address (`ip:port`, `[v6]:port`, or a bare address) without its port.
pub fn address_of(peer: &str) -> &str {
    match peer.rsplit_once(':') {
        Some((ip, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
            if ip.starts_with('[') {
                ip.trim_start_matches('[').trim_end_matches(']')
            } else if ip.contains(':') {
                peer // a bare IPv6 address: its last group is not a port
            } else {
                ip
            }
        }
        _ => peer,
    }
}

/// A configuration error: the field at fault and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleError {
    /// Where, as `rules[1].limit`.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl fmt::Display for RuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for RuleError {}

fn bad(field: impl Into<String>, message: impl Into<String>) -> RuleError {
    RuleError {
        field: field.into(),
        message: message.into(),
    }
}

/// A request the rules cannot be applied to: a client error (`400`), not a configuration one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestError {
    /// The rule that could not be applied.
    pub rule: String,
    /// Why.
    pub message: String,
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rule {:?}: {}", self.rule, self.message)
    }
}

#[cfg(feature = "std")]
impl std::error::Error for RequestError {}

// ---- The JSON shape -----------------------------------------------------------------------

/// `{"rules": [...]}` as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRuleSet {
    rules: Vec<RawRule>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Option<String>,
    namespace: String,
    limit: u64,
    duration: RawDuration,
    #[serde(default)]
    cost: Option<RawCost>,
    #[serde(default)]
    shadow: bool,
    #[serde(default, rename = "match")]
    matcher: RawMatch,
    actions: Vec<RawAction>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum RawDuration {
    Ms(u64),
    Text(String),
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum RawCost {
    Constant(u64),
    Header(RawHeaderCost),
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeaderCost {
    header: String,
    #[serde(default = "one")]
    default: u64,
    max: u64,
}

const fn one() -> u64 {
    1
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    #[serde(default)]
    methods: Vec<String>,
    #[serde(default)]
    hosts: Vec<String>,
    #[serde(default)]
    path_prefix: Option<String>,
    #[serde(default)]
    headers: Vec<RawHeaderMatcher>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeaderMatcher {
    name: String,
    #[serde(default)]
    exact_match: Option<String>,
    #[serde(default)]
    prefix_match: Option<String>,
    #[serde(default)]
    present_match: Option<bool>,
    #[serde(default)]
    invert_match: bool,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
enum RawAction {
    RequestHeaders {
        header_name: String,
        descriptor_key: String,
        #[serde(default)]
        skip_if_absent: bool,
    },
    RemoteAddress {},
    GenericKey {
        descriptor_value: String,
        #[serde(default)]
        descriptor_key: Option<String>,
    },
    HeaderValueMatch {
        descriptor_value: String,
        #[serde(default)]
        descriptor_key: Option<String>,
        #[serde(default = "yes")]
        expect_match: bool,
        headers: Vec<RawHeaderMatcher>,
    },
}

const fn yes() -> bool {
    true
}

// ---- The validated model ------------------------------------------------------------------

/// How much one request costs under a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cost {
    /// The same for every request.
    Constant(u64),
    /// Read from a request header (lower-case name): `default` when absent, at most `max`.
    Header {
        /// Lower-case header name.
        name: String,
        /// Cost when the header is absent.
        default: u64,
        /// Largest cost accepted; a larger one is a client error.
        max: u64,
    },
}

/// How a header is matched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeaderTest {
    /// Equal to the value.
    Exact(String),
    /// Starts with the value.
    Prefix(String),
    /// Present (`true`) or absent (`false`).
    Present(bool),
}

/// One header condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderMatcher {
    /// Lower-case header name.
    pub name: String,
    /// The test.
    pub test: HeaderTest,
    /// Whether the result is inverted.
    pub invert: bool,
}

impl HeaderMatcher {
    /// Whether the request's headers satisfy this condition.
    pub fn matches(&self, request: &impl RequestView) -> bool {
        let value = request.header(&self.name);
        let hit = match &self.test {
            HeaderTest::Exact(v) => value == Some(v.as_bytes()),
            HeaderTest::Prefix(p) => value.is_some_and(|v| v.starts_with(p.as_bytes())),
            HeaderTest::Present(want) => value.is_some() == *want,
        };
        hit != self.invert
    }
}

/// Which requests a rule applies to; an empty list matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Match {
    /// Upper-case methods.
    pub methods: Vec<String>,
    /// Lower-case hosts, without port.
    pub hosts: Vec<String>,
    /// The path starts with this.
    pub path_prefix: Option<String>,
    /// Every condition holds.
    pub headers: Vec<HeaderMatcher>,
}

impl Match {
    /// Whether `request` is one of the rule's.
    pub fn matches(&self, request: &impl RequestView) -> bool {
        self.matches_with(request, &mut None)
    }

    /// [`matches`](Self::matches), with the request's [`normalized_path`] made at most once
    /// for all the rules of a set (`path`: `None` until a rule first needs it).
    fn matches_with<'r>(
        &self,
        request: &'r impl RequestView,
        path: &mut Option<Cow<'r, str>>,
    ) -> bool {
        (self.methods.is_empty() || self.methods.iter().any(|m| m == request.method()))
            && (self.hosts.is_empty()
                || self
                    .hosts
                    .iter()
                    .any(|h| h.eq_ignore_ascii_case(request.host())))
            && self.path_prefix.as_deref().is_none_or(|p| {
                path.get_or_insert_with(|| normalized_path(request.path()))
                    .starts_with(p)
            })
            && self.headers.iter().all(|h| h.matches(request))
    }
}

/// One descriptor action, in Envoy's vocabulary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// `(descriptor_key, value of header_name)`.
    RequestHeaders {
        /// Lower-case header name.
        header_name: String,
        /// Entry key.
        descriptor_key: String,
        /// Absent header: drop the entry (true) or the whole rule (false).
        skip_if_absent: bool,
    },
    /// `("remote_address", client address)`, from the set's [`ClientAddress`] source; no
    /// address, and the rule does not apply.
    RemoteAddress,
    /// `(descriptor_key, descriptor_value)`, always.
    GenericKey {
        /// Entry key (`generic_key` by default).
        descriptor_key: String,
        /// Entry value.
        descriptor_value: String,
    },
    /// `(descriptor_key, descriptor_value)` when the headers match as expected, otherwise
    /// the rule does not apply.
    HeaderValueMatch {
        /// Entry key (`header_match` by default).
        descriptor_key: String,
        /// Entry value.
        descriptor_value: String,
        /// Whether the entry is made when the headers match (true) or when they do not.
        expect_match: bool,
        /// Every condition must hold for a match.
        headers: Vec<HeaderMatcher>,
    },
}

/// One validated rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Shown to clients in `RateLimit-Policy` and logged; defaults to the namespace.
    pub name: String,
    /// The namespace its counts live in.
    pub namespace: String,
    /// Allowed cost per window.
    pub limit: u64,
    /// The window.
    pub duration: WindowDuration,
    /// What a request costs.
    pub cost: Cost,
    /// Counted and reported, never enforced.
    pub shadow: bool,
    /// Which requests.
    pub matcher: Match,
    /// How the identifier is built.
    pub actions: Vec<Action>,
}

/// A limit a request is subject to: a rule that matched, with its identifier and cost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// Index of the rule in its set.
    pub rule: usize,
    /// The encoded descriptor.
    pub identifier: String,
    /// This request's cost under the rule.
    pub cost: u64,
}

/// The parts of a request a rule set reads ([`RuleSet::reads`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reads {
    /// The method.
    pub method: bool,
    /// The host.
    pub host: bool,
    /// The path.
    pub path: bool,
    /// The peer's address.
    pub peer: bool,
    /// These headers (lower-case names, each once).
    pub headers: Vec<String>,
}

/// The limits a request is subject to ([`RuleSet::applies`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applies {
    /// The rules that apply, in order.
    pub limits: Vec<Applied>,
    /// A matching `remote_address` rule was left out because the request had no trusted
    /// client address: the shell counts it, and logs it once.
    pub unaddressed: bool,
}

/// A parsed, validated list of rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuleSet {
    rules: Vec<Rule>,
    client_address: ClientAddress,
}

impl RuleSet {
    /// Parses and validates `{"rules": [...]}`.
    pub fn from_json(json: &str) -> Result<Self, RuleError> {
        let mut de = serde_json::Deserializer::from_str(json);
        let raw: RawRuleSet = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." { String::new() } else { path };
            bad(field, e.into_inner().to_string())
        })?;
        de.end().map_err(|e| bad("", e.to_string()))?;
        Self::validate(raw)
    }

    /// The rules, in order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// The same rules with `remote_address` read from `source` (default: [`ClientAddress::Peer`]).
    pub fn with_client_address(mut self, source: ClientAddress) -> Self {
        self.client_address = source;
        self
    }

    /// Where `remote_address` finds the client's address.
    pub fn client_address(&self) -> &ClientAddress {
        &self.client_address
    }

    /// What [`apply`](Self::apply) may read of a request: a shell that fetches each part
    /// with a host call (Envoy) fetches these and no other.
    pub fn reads(&self) -> Reads {
        let mut reads = Reads::default();
        let mut headers: Vec<String> = Vec::new();
        let mut header = |name: &str| {
            if !headers.iter().any(|h| h == name) {
                headers.push(name.to_string());
            }
        };
        for rule in &self.rules {
            let m = &rule.matcher;
            reads.method |= !m.methods.is_empty();
            reads.host |= !m.hosts.is_empty();
            reads.path |= m.path_prefix.is_some();
            m.headers.iter().for_each(|h| header(&h.name));
            if let Cost::Header { name, .. } = &rule.cost {
                header(name);
            }
            for action in &rule.actions {
                match action {
                    Action::RequestHeaders { header_name, .. } => header(header_name),
                    Action::RemoteAddress => {
                        if let Some(name) = self.client_address.header() {
                            header(name);
                        }
                        reads.peer |= self.client_address.reads_peer();
                    }
                    Action::GenericKey { .. } => {}
                    Action::HeaderValueMatch { headers, .. } => {
                        headers.iter().for_each(|h| header(&h.name));
                    }
                }
            }
        }
        reads.headers = headers;
        reads
    }

    fn validate(raw: RawRuleSet) -> Result<Self, RuleError> {
        if raw.rules.len() > MAX_RULES {
            return Err(bad(
                "rules",
                format!("{} rules, at most {MAX_RULES} are allowed", raw.rules.len()),
            ));
        }
        let rules = raw
            .rules
            .into_iter()
            .enumerate()
            .map(|(i, r)| validate_rule(r, &format!("rules[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, r) in rules.iter().enumerate() {
            if rules[..i].iter().any(|o| o.name == r.name) {
                return Err(bad(
                    format!("rules[{i}].name"),
                    format!("{:?} names an earlier rule too; names must differ", r.name),
                ));
            }
            // Same namespace and window: the same counters, so the shadow rule's counts would
            // add to the enforced rule's and change which requests pass.
            if let Some(o) = rules.iter().find(|o| {
                r.shadow && !o.shadow && o.namespace == r.namespace && o.duration == r.duration
            }) {
                return Err(bad(
                    format!("rules[{i}].namespace"),
                    format!(
                        "shadow rule {:?} counts in namespace {:?} with the window of enforced \
                         rule {:?}, so its counts would add to that rule's; give it a namespace \
                         of its own",
                        r.name, r.namespace, o.name
                    ),
                ));
            }
        }
        Ok(Self {
            rules,
            client_address: ClientAddress::default(),
        })
    }

    /// The limits `request` is subject to, in rule order ([`applies`](Self::applies)).
    pub fn apply(&self, request: &impl RequestView) -> Result<Vec<Applied>, RequestError> {
        self.applies(request).map(|a| a.limits)
    }

    /// The limits `request` is subject to, in rule order. A rule whose match or actions do
    /// not apply is left out; a request whose cost header is not a number within the rule's
    /// bound is refused. A descriptor too long to be an identifier is keyed by its digest
    /// ([`identifier_for`]).
    pub fn applies(&self, request: &impl RequestView) -> Result<Applies, RequestError> {
        let mut applies = Applies::default();
        let mut path = None;
        for (i, rule) in self.rules.iter().enumerate() {
            if !rule.matcher.matches_with(request, &mut path) {
                continue;
            }
            let identifier = match descriptor(&rule.actions, request, &self.client_address) {
                Built::Descriptor(d) => identifier_for(d),
                Built::NotApplicable => continue,
                Built::Unaddressed => {
                    applies.unaddressed = true;
                    continue;
                }
            };
            let cost = request_cost(&rule.cost, request).map_err(|message| RequestError {
                rule: rule.name.clone(),
                message,
            })?;
            applies.limits.push(Applied {
                rule: i,
                identifier,
                cost,
            });
        }
        Ok(applies)
    }
}

/// A request's cost under `cost`. A cost header is ASCII digits and nothing else: a sign,
/// a space, a point or a base prefix is refused rather than guessed at.
fn request_cost(cost: &Cost, request: &impl RequestView) -> Result<u64, String> {
    match cost {
        Cost::Constant(c) => Ok(*c),
        Cost::Header { name, default, max } => {
            let Some(v) = request.header(name) else {
                return Ok(*default);
            };
            let digits = !v.is_empty() && v.iter().all(u8::is_ascii_digit);
            match core::str::from_utf8(v)
                .ok()
                .filter(|_| digits)
                .map(str::parse::<u64>)
            {
                Some(Ok(c)) if c <= *max => Ok(c),
                Some(Ok(c)) => Err(format!("header {name} asks a cost of {c}, at most {max}")),
                _ => Err(format!(
                    "header {name} must be a whole number from 0 to {max}, in digits only"
                )),
            }
        }
    }
}

/// What a rule's actions made of a request.
enum Built {
    /// The encoded descriptor.
    Descriptor(String),
    /// An action could not make its entry: the rule does not apply.
    NotApplicable,
    /// `remote_address` found no trusted address: the rule does not apply, and it is noted.
    Unaddressed,
}

/// Builds the encoded descriptor of `actions`.
fn descriptor(actions: &[Action], request: &impl RequestView, source: &ClientAddress) -> Built {
    let mut out = String::new();
    for action in actions {
        let (key, value): (&str, &[u8]) = match action {
            Action::RequestHeaders {
                header_name,
                descriptor_key,
                skip_if_absent,
            } => match request.header(header_name) {
                Some(v) => (descriptor_key.as_str(), v),
                None if *skip_if_absent => continue,
                None => return Built::NotApplicable,
            },
            Action::RemoteAddress => match source.of(request) {
                Some(address) => ("remote_address", address.as_bytes()),
                None => return Built::Unaddressed,
            },
            Action::GenericKey {
                descriptor_key,
                descriptor_value,
            } => (descriptor_key.as_str(), descriptor_value.as_bytes()),
            Action::HeaderValueMatch {
                descriptor_key,
                descriptor_value,
                expect_match,
                headers,
            } => {
                if headers.iter().all(|h| h.matches(request)) != *expect_match {
                    return Built::NotApplicable;
                }
                (descriptor_key.as_str(), descriptor_value.as_bytes())
            }
        };
        push_entry(&mut out, key.as_bytes(), value);
    }
    // Every entry skipped: nothing to limit by, as in Envoy.
    if out.is_empty() {
        Built::NotApplicable
    } else {
        Built::Descriptor(out)
    }
}

/// Appends one entry to an encoded descriptor: `key=value`, joined to the entries before by
/// `&`. The gateway's rate-limit service keys Envoy's descriptors with it, so a descriptor
/// counts under the same identifier whichever of Envoy's paths (the `ratelimit` filter or this
/// filter's rules) built it. Key and value are bytes, as Envoy passes them on: a byte that is
/// not UTF-8 is spelt `%XX` in either.
pub fn push_entry(out: &mut String, key: &[u8], value: &[u8]) {
    if !out.is_empty() {
        out.push('&');
    }
    encode_bytes(out, key);
    out.push('=');
    encode_bytes(out, value);
}

/// [`encode`]s a value's UTF-8 runs and spells each other byte `%XX`: as `%` itself is
/// encoded, `%XX` in the result is never the client's text, so every value keeps a key of its
/// own.
fn encode_bytes(out: &mut String, bytes: &[u8]) {
    use core::fmt::Write as _;
    for chunk in bytes.utf8_chunks() {
        encode(out, chunk.valid());
        for b in chunk.invalid() {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

/// Percent-encodes the separators (and `%` itself), so `a=b&c` as a value cannot pass for
/// two entries.
fn encode(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '&' => out.push_str("%26"),
            '=' => out.push_str("%3D"),
            _ => out.push(c),
        }
    }
}

// ---- Validation ---------------------------------------------------------------------------

/// Parses `500ms`, `10s`, `5m`, `1h`, `1d`, or a number of milliseconds.
pub fn parse_duration_ms(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let scale = match unit.trim() {
        "" | "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    n.checked_mul(scale)
}

fn validate_rule(raw: RawRule, at: &str) -> Result<Rule, RuleError> {
    let field = |name: &str| format!("{at}.{name}");
    if raw.namespace.is_empty() || raw.namespace.len() > MAX_NAMESPACE_BYTES {
        return Err(bad(
            field("namespace"),
            format!("must be 1 to {MAX_NAMESPACE_BYTES} bytes"),
        ));
    }
    let name = raw.name.unwrap_or_else(|| raw.namespace.clone());
    if name.is_empty() || name.len() > MAX_NAMESPACE_BYTES {
        return Err(bad(
            field("name"),
            format!("must be 1 to {MAX_NAMESPACE_BYTES} bytes"),
        ));
    }
    let ms = match &raw.duration {
        RawDuration::Ms(ms) => Some(*ms),
        RawDuration::Text(t) => parse_duration_ms(t),
    }
    .ok_or_else(|| {
        bad(
            field("duration"),
            "must be milliseconds or a text like \"60s\", \"5m\", \"1h\"",
        )
    })?;
    let duration =
        WindowDuration::from_ms(ms).map_err(|e| bad(field("duration"), e.to_string()))?;
    let cost = match raw.cost {
        None => Cost::Constant(1),
        Some(RawCost::Constant(c)) => Cost::Constant(c),
        Some(RawCost::Header(h)) => {
            let name = header_name(&h.header, &field("cost.header"))?;
            if h.default > h.max {
                return Err(bad(
                    field("cost.default"),
                    format!("{} is above cost.max ({})", h.default, h.max),
                ));
            }
            Cost::Header {
                name,
                default: h.default,
                max: h.max,
            }
        }
    };
    let matcher = validate_match(raw.matcher, &field("match"))?;
    if raw.actions.is_empty() {
        return Err(bad(
            field("actions"),
            "needs at least one action: the descriptor is the identifier",
        ));
    }
    if raw.actions.len() > MAX_ACTIONS {
        return Err(bad(
            field("actions"),
            format!("{} actions, at most {MAX_ACTIONS}", raw.actions.len()),
        ));
    }
    let actions = raw
        .actions
        .into_iter()
        .enumerate()
        .map(|(j, a)| validate_action(a, &format!("{at}.actions[{j}]")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Rule {
        name,
        namespace: raw.namespace,
        limit: raw.limit,
        duration,
        cost,
        shadow: raw.shadow,
        matcher,
        actions,
    })
}

fn validate_match(raw: RawMatch, at: &str) -> Result<Match, RuleError> {
    let mut methods = Vec::with_capacity(raw.methods.len());
    for (i, m) in raw.methods.iter().enumerate() {
        if m.is_empty() || !m.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(bad(
                format!("{at}.methods[{i}]"),
                format!("{m:?} is not an HTTP method"),
            ));
        }
        methods.push(m.to_ascii_uppercase());
    }
    let mut hosts = Vec::with_capacity(raw.hosts.len());
    for (i, h) in raw.hosts.iter().enumerate() {
        if h.is_empty() || h.contains(['/', ' ']) {
            return Err(bad(
                format!("{at}.hosts[{i}]"),
                format!("{h:?} is not a host name"),
            ));
        }
        hosts.push(h.to_ascii_lowercase());
    }
    if let Some(p) = &raw.path_prefix {
        if !p.starts_with('/') {
            return Err(bad(format!("{at}.path_prefix"), "must start with /"));
        }
    }
    let headers = header_matchers(raw.headers, &format!("{at}.headers"))?;
    Ok(Match {
        methods,
        hosts,
        path_prefix: raw.path_prefix,
        headers,
    })
}

fn header_matchers(raw: Vec<RawHeaderMatcher>, at: &str) -> Result<Vec<HeaderMatcher>, RuleError> {
    raw.into_iter()
        .enumerate()
        .map(|(i, h)| {
            let at = format!("{at}[{i}]");
            let name = header_name(&h.name, &format!("{at}.name"))?;
            let test = match (h.exact_match, h.prefix_match, h.present_match) {
                (Some(v), None, None) => HeaderTest::Exact(v),
                (None, Some(p), None) => HeaderTest::Prefix(p),
                (None, None, Some(p)) => HeaderTest::Present(p),
                (None, None, None) => HeaderTest::Present(true),
                _ => {
                    return Err(bad(
                        at,
                        "give one of exact_match, prefix_match, present_match",
                    ));
                }
            };
            Ok(HeaderMatcher {
                name,
                test,
                invert: h.invert_match,
            })
        })
        .collect()
}

/// A header name as HTTP allows it (a token), lower-cased.
pub(crate) fn header_name(name: &str, at: &str) -> Result<String, RuleError> {
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || !name.bytes().all(token) {
        return Err(bad(at, format!("{name:?} is not a header name")));
    }
    Ok(name.to_ascii_lowercase())
}

fn descriptor_key(key: Option<String>, default: &str, at: &str) -> Result<String, RuleError> {
    let key = key.unwrap_or_else(|| default.to_string());
    if key.is_empty() {
        return Err(bad(at, "must not be empty"));
    }
    Ok(key)
}

fn validate_action(raw: RawAction, at: &str) -> Result<Action, RuleError> {
    Ok(match raw {
        RawAction::RequestHeaders {
            header_name: name,
            descriptor_key: key,
            skip_if_absent,
        } => Action::RequestHeaders {
            header_name: header_name(&name, &format!("{at}.request_headers.header_name"))?,
            descriptor_key: descriptor_key(
                Some(key),
                "",
                &format!("{at}.request_headers.descriptor_key"),
            )?,
            skip_if_absent,
        },
        RawAction::RemoteAddress {} => Action::RemoteAddress,
        RawAction::GenericKey {
            descriptor_value,
            descriptor_key: key,
        } => {
            if descriptor_value.is_empty() {
                return Err(bad(
                    format!("{at}.generic_key.descriptor_value"),
                    "must not be empty",
                ));
            }
            Action::GenericKey {
                descriptor_key: descriptor_key(
                    key,
                    "generic_key",
                    &format!("{at}.generic_key.descriptor_key"),
                )?,
                descriptor_value,
            }
        }
        RawAction::HeaderValueMatch {
            descriptor_value,
            descriptor_key: key,
            expect_match,
            headers,
        } => {
            let here = format!("{at}.header_value_match");
            if descriptor_value.is_empty() {
                return Err(bad(format!("{here}.descriptor_value"), "must not be empty"));
            }
            if headers.is_empty() {
                return Err(bad(
                    format!("{here}.headers"),
                    "needs at least one header matcher",
                ));
            }
            Action::HeaderValueMatch {
                descriptor_key: descriptor_key(
                    key,
                    "header_match",
                    &format!("{here}.descriptor_key"),
                )?,
                descriptor_value,
                expect_match,
                headers: header_matchers(headers, &format!("{here}.headers"))?,
            }
        }
    })
}
