//! Where the `remote_address` action finds the client's address: the `client_address` setting
//! of both Wasm shells, with one meaning in each.
//!
//! A limit per address is only as good as the address. A client writes every header it sends,
//! so the address is taken from the runtime's own view of the connection unless the operator
//! names a header that a proxy in front sets and overwrites. Either way it must parse as an IP
//! address; when the source gives none, a `remote_address` rule does not apply to the request
//! and the shell counts and logs that (`Applies::unaddressed`), rather than guessing.

use alloc::format;
use alloc::string::String;
use core::net::IpAddr;

use crate::rules::{RequestView, address_of, header_name};

/// The trusted source of a client's address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ClientAddress {
    /// The address the runtime reports for the request (`peer`, the default): Envoy's
    /// `source.address`, which follows the connection manager's `use_remote_address` and
    /// `xff_num_trusted_hops` as Envoy's own `remote_address` action does; workerd's
    /// `request.cf.clientIp`. Cloudflare's runtime reports none: use `cf-connecting-ip` there.
    #[default]
    Peer,
    /// A header a proxy in front sets to the client's address, replacing any a client sent
    /// (`cf-connecting-ip` behind Cloudflare, `x-real-ip` behind a proxy configured to set it).
    Header(String),
    /// `X-Forwarded-For` as proxies append to it: the entry `trusted_hops + 1` from the right.
    /// The proxy that connects to the shell wrote the last entry; each further trusted proxy
    /// one more (Envoy's `xff_num_trusted_hops` with `use_remote_address: false`).
    ForwardedFor {
        /// Trusted proxies before the one that connects.
        trusted_hops: u32,
    },
    /// No address is trusted: `remote_address` rules never apply.
    None,
}

/// The longest chain of trusted proxies accepted.
pub const MAX_TRUSTED_HOPS: u32 = 16;

impl ClientAddress {
    /// The setting from its two fields: `source` is `peer`, `none`, `x-forwarded-for`, or the
    /// name of a header (any case); `xff_num_trusted_hops` only goes with `x-forwarded-for`.
    /// The error says what is wrong.
    pub fn parse(source: &str, xff_num_trusted_hops: u32) -> Result<Self, String> {
        let name = source.to_ascii_lowercase();
        let address = match name.as_str() {
            "peer" => Self::Peer,
            "none" => Self::None,
            "x-forwarded-for" => {
                if xff_num_trusted_hops > MAX_TRUSTED_HOPS {
                    return Err(format!(
                        "xff_num_trusted_hops: {xff_num_trusted_hops} is above \
                         {MAX_TRUSTED_HOPS}"
                    ));
                }
                Self::ForwardedFor {
                    trusted_hops: xff_num_trusted_hops,
                }
            }
            _ => Self::Header(header_name(source, "client_address").map_err(|_| {
                format!(
                    "client_address: {source:?} is not peer, none, x-forwarded-for or a header \
                     name"
                )
            })?),
        };
        if xff_num_trusted_hops != 0 && !matches!(address, Self::ForwardedFor { .. }) {
            return Err(format!(
                "xff_num_trusted_hops: applies to client_address \"x-forwarded-for\" only, \
                 not {source:?}"
            ));
        }
        Ok(address)
    }

    /// The client's address in `request`, if the source gives one that parses as an IP
    /// address (without port or brackets: a peer's port is dropped here, for every shell).
    pub fn of<'r>(&self, request: &'r impl RequestView) -> Option<&'r str> {
        let text = |name: &str| {
            request
                .header(name)
                .and_then(|v| core::str::from_utf8(v).ok())
        };
        let candidate = match self {
            Self::Peer => request.peer_address().map(address_of),
            Self::Header(name) => text(name),
            Self::ForwardedFor { trusted_hops } => text("x-forwarded-for").and_then(|v| {
                let hops = usize::try_from(*trusted_hops).ok()?;
                v.rsplit(',').nth(hops)
            }),
            Self::None => None,
        }?;
        let address = candidate.trim();
        let bare = address
            .strip_prefix('[')
            .and_then(|a| a.strip_suffix(']'))
            .unwrap_or(address);
        bare.parse::<IpAddr>().is_ok().then_some(bare)
    }

    /// The header this source reads, if any.
    pub fn header(&self) -> Option<&str> {
        match self {
            Self::Header(name) => Some(name),
            Self::ForwardedFor { .. } => Some("x-forwarded-for"),
            Self::Peer | Self::None => None,
        }
    }

    /// Whether this source reads the runtime's peer address.
    pub fn reads_peer(&self) -> bool {
        matches!(self, Self::Peer)
    }

    /// The setting as written (`x-forwarded-for` without its hop count).
    pub fn name(&self) -> &str {
        match self {
            Self::Peer => "peer",
            Self::Header(name) => name,
            Self::ForwardedFor { .. } => "x-forwarded-for",
            Self::None => "none",
        }
    }

    /// The warning a shell logs, once, for the first request a `remote_address` rule left out
    /// for want of an address; `counted_in` names where the shell counts them all.
    pub fn unaddressed_notice(&self, counted_in: &str) -> String {
        format!(
            "a remote_address rule did not apply: client_address {:?} gave no client address; \
             counted in {counted_in}, logged once",
            self.name()
        )
    }
}
