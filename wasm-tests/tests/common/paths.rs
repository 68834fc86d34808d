//! Spellings of one path a client could send to step around a `path_prefix` limit: doubled
//! slashes, escapes of plain characters, dot segments. The rules match the path as Envoy's
//! `normalize_path` and `merge_slashes` would make it (`strata_core::rules::normalized_path`),
//! whether or not the runtime normalized it first, so each spelling counts against the limit.

use serde_json::{Value, json};

/// The limit on `/x`.
pub const LIMIT: usize = 3;

/// `{"rules": [...]}`: `LIMIT` a minute on every path under `/x`, one key for all.
pub fn rules() -> Value {
    json!({"rules": [{"name": "under-x", "namespace": "paths", "limit": LIMIT, "duration": "1m",
        "match": {"path_prefix": "/x"},
        "actions": [{"generic_key": {"descriptor_value": "x"}}]}]})
}

/// Sends `/x` and its other spellings as raw requests to `addr` (`host:port`): the first
/// `LIMIT` pass and the rest are denied, whatever the spelling; a path outside `/x` is never
/// limited.
pub async fn check(runtime: &str, addr: &str) {
    let spellings = ["/x", "//x", "/%78", "/X/../x", "/./x/", "/y/..//x"];
    let mut statuses = Vec::new();
    for path in spellings {
        let request =
            format!("GET {path} HTTP/1.1\r\nhost: paths.test\r\nconnection: close\r\n\r\n");
        let (status, head) = super::hostile::send_raw(addr, request.as_bytes()).await;
        statuses.push((path, status, head));
    }
    let codes: Vec<(&str, Option<u16>)> = statuses.iter().map(|(p, s, _)| (*p, *s)).collect();
    let want: Vec<(&str, Option<u16>)> = spellings
        .iter()
        .enumerate()
        .map(|(i, p)| (*p, Some(if i < LIMIT { 200 } else { 429 })))
        .collect();
    assert_eq!(codes, want, "{runtime}: {statuses:?}");
    for _ in 0..LIMIT + 1 {
        let request = "GET /y HTTP/1.1\r\nhost: paths.test\r\nconnection: close\r\n\r\n";
        let (status, head) = super::hostile::send_raw(addr, request.as_bytes()).await;
        assert_eq!(status, Some(200), "{runtime}: /y is not under /x: {head}");
    }
}
