//! A request as JavaScript hands it over: method, URL and headers, read by the rules.

use strata_core::rules::RequestView;

/// The parts of a `Request` the rules read. Header names arrive lower-case (as a `Headers`
/// iterator gives them), as `[name, value, name, value, …]`.
#[derive(Debug)]
pub struct JsRequest {
    method: String,
    host: String,
    path: String,
    headers: Vec<String>,
    peer: Option<String>,
}

impl JsRequest {
    /// A view of a request to `url`.
    pub fn new(method: &str, url: &str, headers: Vec<String>, peer: Option<String>) -> Self {
        let (host, path) = split_url(url);
        let host = headers
            .chunks_exact(2)
            .find(|h| h[0] == "host")
            .map_or(host, |h| split_host(&h[1]));
        Self {
            method: method.to_ascii_uppercase(),
            host: host.to_ascii_lowercase(),
            path: path.to_string(),
            headers,
            peer,
        }
    }
}

impl RequestView for JsRequest {
    fn method(&self) -> &str {
        &self.method
    }
    fn host(&self) -> &str {
        &self.host
    }
    fn path(&self) -> &str {
        &self.path
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .chunks_exact(2)
            .find(|h| h[0] == name)
            .map(|h| h[1].as_str())
    }
    fn peer_address(&self) -> Option<&str> {
        self.peer.as_deref()
    }
}

/// `(host, path)` of an absolute URL: the host without user info or port, the path without
/// query or fragment (`/` when empty).
fn split_url(url: &str) -> (&str, &str) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let (authority, path) = match rest.find(['/', '?', '#']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let path = path.split(['?', '#']).next().unwrap_or("");
    (
        split_host(authority),
        if path.is_empty() { "/" } else { path },
    )
}

/// A host without user info or port (`[v6]` literals keep their brackets).
fn split_host(authority: &str) -> &str {
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if host.starts_with('[') {
        return host.split_inclusive(']').next().unwrap_or(host);
    }
    host.split(':').next().unwrap_or(host)
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
        let r = JsRequest::new(
            "get",
            "http://internal/p",
            vec![
                "host".into(),
                "API.example.com:443".into(),
                "x-k".into(),
                "v".into(),
            ],
            None,
        );
        assert_eq!(
            (r.method(), r.host(), r.path()),
            ("GET", "api.example.com", "/p")
        );
        assert_eq!(r.header("x-k"), Some("v"));
        assert_eq!(r.header("x-missing"), None);
    }
}
