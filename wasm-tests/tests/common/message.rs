//! HTTP/1.1 messages as the tests' peers read them off a socket (the upstream a request, the
//! hostile client an answer); its own module, so that the lab includes it beside `upstream`.

/// Whether `bytes` hold a whole HTTP/1.1 message, request or response: its head, then
/// `content-length` bytes of body (none without one), as the tests' peers send them.
pub fn is_whole(bytes: &[u8]) -> bool {
    let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&bytes[..end]).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    bytes.len() >= end + 4 + length
}
