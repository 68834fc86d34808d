//! The host calls the filter makes, behind a trait: proxy-wasm's in Envoy ([`Envoy`]), a
//! recording double in the unit tests. Every call acts on the host's current context.

use std::time::Duration;

/// Why a shared-data write did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetError {
    /// Another VM wrote the key since it was read.
    CasMismatch,
    /// Anything else the host refused.
    Refused,
}

/// What the filter asks of its host.
pub trait Host {
    /// Unix milliseconds.
    fn now_ms(&self) -> u64;
    /// A log line at info (`warn: false`) or warning level.
    fn log(&self, warn: bool, message: &str);
    /// One request header of the current HTTP context (a pseudo-header too), as bytes: a
    /// client may send any octet Envoy's codec accepts, so nothing here assumes text.
    fn request_header(&self, name: &str) -> Option<Vec<u8>>;
    /// The downstream peer's address (`source.address`), if known.
    fn peer_address(&self) -> Option<String>;
    /// Sends an HTTP call; the answer arrives at the current context with the token.
    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, String>;
    /// The `:status` and body of the call answer being delivered.
    fn call_response(&self, body_size: usize) -> (u16, Vec<u8>);
    /// Answers the current request locally.
    fn send_response(&self, status: u32, headers: Vec<(&str, &str)>, body: &[u8]);
    /// Lets the current (paused) request go on.
    fn resume(&self);
    /// Adds a header to the current response.
    fn add_response_header(&self, name: &str, value: &str);
    /// Makes `context_id` the current context (to settle a paused request from the tick).
    fn set_context(&self, context_id: u32) -> bool;
    /// Defines a counter (or a gauge); its id.
    fn define_metric(&self, name: &str, gauge: bool) -> Option<u32>;
    /// Adds to a counter, or to a gauge (a negative `by` takes away).
    fn increment(&self, id: u32, by: i64);
    /// Random bits for the instance id and the table seed.
    fn random_u64(&self) -> u64;
    /// A shared-data value and its compare-and-swap token (none for a missing key).
    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes a shared-data value if `cas` is still the key's token (unconditionally for a
    /// missing key: the host ignores the token then).
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
    /// Registers a shared queue for the current (root) context; its id.
    fn register_queue(&self, name: &str) -> Option<u32>;
    /// Puts an item on queue `queue`: its root context's `on_queue_ready` runs soon after.
    fn enqueue(&self, queue: u32) -> bool;
    /// Takes every item off queue `queue`.
    fn drain_queue(&self, queue: u32);
}

/// proxy-wasm's host calls, as Envoy answers them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Envoy;

#[cfg(target_arch = "wasm32")]
mod envoy {
    use std::time::Duration;

    use crate::abi::calls;
    use crate::abi::{Buffer, Level, Map, Status};

    use super::{Envoy, Host, SetError};

    impl Host for Envoy {
        fn now_ms(&self) -> u64 {
            calls::now_nanos().map_or(0, |n| n / 1_000_000)
        }
        fn log(&self, warn: bool, message: &str) {
            calls::log(if warn { Level::Warn } else { Level::Info }, message);
        }
        fn request_header(&self, name: &str) -> Option<Vec<u8>> {
            calls::header(Map::RequestHeaders, name).ok().flatten()
        }
        fn peer_address(&self) -> Option<String> {
            let bytes = calls::property(&["source", "address"]).ok()??;
            String::from_utf8(bytes).ok()
        }
        fn dispatch(
            &self,
            cluster: &str,
            headers: Vec<(&str, &str)>,
            body: &[u8],
            timeout: Duration,
        ) -> Result<u32, String> {
            let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
            calls::http_call(cluster, &headers, body, ms).map_err(|s| s.to_string())
        }
        fn call_response(&self, body_size: usize) -> (u16, Vec<u8>) {
            let status = calls::header(Map::CallResponseHeaders, ":status")
                .ok()
                .flatten()
                .and_then(|s| std::str::from_utf8(&s).ok()?.parse().ok())
                .unwrap_or(0);
            let body = calls::buffer(Buffer::CallResponseBody, body_size)
                .ok()
                .flatten()
                .unwrap_or_default();
            (status, body)
        }
        fn send_response(&self, status: u32, headers: Vec<(&str, &str)>, body: &[u8]) {
            let _ = calls::send_response(status, &headers, body);
        }
        fn resume(&self) {
            let _ = calls::resume_request();
        }
        fn add_response_header(&self, name: &str, value: &str) {
            let _ = calls::add_header(Map::ResponseHeaders, name, value);
        }
        fn set_context(&self, context_id: u32) -> bool {
            calls::set_effective_context(context_id).is_ok()
        }
        fn define_metric(&self, name: &str, gauge: bool) -> Option<u32> {
            calls::define_metric(gauge, name).ok()
        }
        fn increment(&self, id: u32, by: i64) {
            let _ = calls::increment_metric(id, by);
        }
        fn random_u64(&self) -> u64 {
            let mut bytes = [0_u8; 8];
            // WASI random_get; without it the id still differs by time and context.
            if getrandom::fill(&mut bytes).is_err() {
                return self.now_ms() ^ 0x9e37_79b9_7f4a_7c15;
            }
            u64::from_le_bytes(bytes)
        }
        fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            calls::shared_get(key).map_or((None, None), |(value, cas)| {
                (value, (cas != 0).then_some(cas))
            })
        }
        fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
            calls::shared_set(key, value, cas.unwrap_or(0)).map_err(|s| match s {
                Status::CAS_MISMATCH => SetError::CasMismatch,
                _ => SetError::Refused,
            })
        }
        fn register_queue(&self, name: &str) -> Option<u32> {
            calls::register_queue(name).ok()
        }
        fn enqueue(&self, queue: u32) -> bool {
            calls::enqueue(queue, b"w").is_ok()
        }
        fn drain_queue(&self, queue: u32) {
            while let Ok(Some(_)) = calls::dequeue(queue) {}
        }
    }
}
