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
    use std::time::{Duration, UNIX_EPOCH};

    use proxy_wasm::hostcalls;
    use proxy_wasm::types::{LogLevel, MapType, MetricType, Status};

    use super::{Envoy, Host, SetError};

    impl Host for Envoy {
        fn now_ms(&self) -> u64 {
            hostcalls::get_current_time()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        }
        fn log(&self, warn: bool, message: &str) {
            let level = if warn { LogLevel::Warn } else { LogLevel::Info };
            let _ = hostcalls::log(level, message);
        }
        // The SDK's `get_map` and `get_map_value` turn values into `String` with `unwrap`: a
        // client's non-UTF-8 byte would trap the VM. Only the `_bytes` calls are used.
        fn request_header(&self, name: &str) -> Option<Vec<u8>> {
            hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
                .ok()
                .flatten()
        }
        fn peer_address(&self) -> Option<String> {
            let bytes = hostcalls::get_property(vec!["source", "address"]).ok()??;
            String::from_utf8(bytes).ok()
        }
        fn dispatch(
            &self,
            cluster: &str,
            headers: Vec<(&str, &str)>,
            body: &[u8],
            timeout: Duration,
        ) -> Result<u32, String> {
            hostcalls::dispatch_http_call(cluster, headers, Some(body), vec![], timeout)
                .map_err(|s| format!("{s:?}"))
        }
        fn call_response(&self, body_size: usize) -> (u16, Vec<u8>) {
            let status =
                hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
                    .ok()
                    .flatten()
                    .and_then(|s| std::str::from_utf8(&s).ok()?.parse().ok())
                    .unwrap_or(0);
            let body = hostcalls::get_buffer(
                proxy_wasm::types::BufferType::HttpCallResponseBody,
                0,
                body_size,
            )
            .ok()
            .flatten()
            .unwrap_or_default();
            (status, body)
        }
        fn send_response(&self, status: u32, headers: Vec<(&str, &str)>, body: &[u8]) {
            let _ = hostcalls::send_http_response(status, headers, Some(body));
        }
        fn resume(&self) {
            let _ = hostcalls::resume_http_request();
        }
        fn add_response_header(&self, name: &str, value: &str) {
            let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value);
        }
        fn set_context(&self, context_id: u32) -> bool {
            hostcalls::set_effective_context(context_id).is_ok()
        }
        fn define_metric(&self, name: &str, gauge: bool) -> Option<u32> {
            let kind = if gauge {
                MetricType::Gauge
            } else {
                MetricType::Counter
            };
            hostcalls::define_metric(kind, name).ok()
        }
        fn increment(&self, id: u32, by: i64) {
            let _ = hostcalls::increment_metric(id, by);
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
            hostcalls::get_shared_data(key).unwrap_or((None, None))
        }
        fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
            hostcalls::set_shared_data(key, Some(value), cas).map_err(|s| match s {
                Status::CasMismatch => SetError::CasMismatch,
                _ => SetError::Refused,
            })
        }
        fn register_queue(&self, name: &str) -> Option<u32> {
            hostcalls::register_shared_queue(name).ok()
        }
        fn enqueue(&self, queue: u32) -> bool {
            hostcalls::enqueue_shared_queue(queue, Some(b"w")).is_ok()
        }
        fn drain_queue(&self, queue: u32) {
            while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue) {}
        }
    }
}
