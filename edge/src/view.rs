//! A request as JavaScript hands it over: method, URL and headers, read by the rules.

use std::borrow::Cow;
use std::cell::OnceCell;

use strata_core::rules::{RequestView, host_of, path_of};

/// The parts of a `Request` the rules read, borrowed from the strings JavaScript passed.
/// Headers arrive as one string, `name\nvalue\n` per header with lower-case names (as a
/// `Headers` iterator gives them; neither can hold a newline), so a request crosses into
/// Wasm in one copy. Each part is found when a rule reads it, not before.
#[derive(Debug)]
pub struct JsRequest<'a> {
    method: &'a str,
    url: &'a str,
    headers: &'a str,
    peer: Option<&'a str>,
    method_upper: OnceCell<Cow<'a, str>>,
    host: OnceCell<Cow<'a, str>>,
}

impl<'a> JsRequest<'a> {
    /// A view of a request to `url`.
    pub fn new(method: &'a str, url: &'a str, headers: &'a str, peer: Option<&'a str>) -> Self {
        Self {
            method,
            url,
            headers,
            peer,
            method_upper: OnceCell::new(),
            host: OnceCell::new(),
        }
    }
}

fn upper(s: &str) -> Cow<'_, str> {
    if s.bytes().any(|b| b.is_ascii_lowercase()) {
        Cow::Owned(s.to_ascii_uppercase())
    } else {
        Cow::Borrowed(s)
    }
}

fn lower(s: &str) -> Cow<'_, str> {
    if s.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(s.to_ascii_lowercase())
    } else {
        Cow::Borrowed(s)
    }
}

/// The value of header `name` in `name\nvalue\n…`.
fn find<'a>(headers: &'a str, name: &str) -> Option<&'a str> {
    let mut lines = headers.split('\n');
    while let (Some(n), Some(v)) = (lines.next(), lines.next()) {
        if n == name {
            return Some(v);
        }
    }
    None
}

impl RequestView for JsRequest<'_> {
    fn method(&self) -> &str {
        self.method_upper.get_or_init(|| upper(self.method))
    }
    fn host(&self) -> &str {
        self.host.get_or_init(|| {
            let url = || split_url(self.url).0;
            lower(find(self.headers, "host").map_or_else(url, host_of))
        })
    }
    fn path(&self) -> &str {
        split_url(self.url).1
    }
    fn header(&self, name: &str) -> Option<&[u8]> {
        find(self.headers, name).map(str::as_bytes)
    }
    fn peer_address(&self) -> Option<&str> {
        self.peer
    }
}

/// `(host, path)` of an absolute URL: the host without user info or port, the path without
/// query or fragment (`/` when empty).
fn split_url(url: &str) -> (&str, &str) {
    // The first `://`, found by its colon: cheaper than a substring search.
    let scheme_end = url
        .match_indices(':')
        .find(|&(i, _)| url.get(i..).is_some_and(|r| r.starts_with("://")));
    let rest = scheme_end.map_or(url, |(i, _)| url.get(i + 3..).unwrap_or(""));
    let (authority, target) = match rest.find(['/', '?', '#']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    (host_of(authority), path_of(target))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_host_and_path() {
        assert_eq!(
            split_url("https://a.example:8443/v1/x?q=1"),
            ("a.example", "/v1/x")
        );
        assert_eq!(split_url("http://u:p@[::1]:80"), ("[::1]", "/"));
        assert_eq!(split_url("http://h#frag"), ("h", "/"));
    }

    #[test]
    fn the_host_header_wins_and_headers_are_found_by_name() {
        let headers = "host\nAPI.example.com:443\nx-k\nv\nx-empty\n\n";
        let r = JsRequest::new("get", "http://internal/p", headers, None);
        assert_eq!(
            (r.method(), r.host(), r.path()),
            ("GET", "api.example.com", "/p")
        );
        assert_eq!(r.header("x-k"), Some(&b"v"[..]));
        assert_eq!(r.header("x-empty"), Some(&b""[..]));
        assert_eq!(r.header("v"), None, "a value is not a name");
        assert_eq!(r.header("x-missing"), None);
    }
}
