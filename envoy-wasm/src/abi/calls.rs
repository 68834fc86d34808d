//! The host calls themselves (only a Wasm build links them).
#![allow(unsafe_code)] // the one module that crosses the ABI; every block says why it is sound

use core::mem::MaybeUninit;
use core::ptr::{null, null_mut};

use super::{Buffer, Level, Map, Status, encode_map};

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;

fn ok(status: u32) -> Result<(), Status> {
    if status == OK {
        Ok(())
    } else {
        Err(Status(status))
    }
}

#[link(wasm_import_module = "env")]
unsafe extern "C" {
    fn proxy_log(level: u32, data: *const u8, size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        kind: u32,
        start: usize,
        max_size: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    fn proxy_add_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_property(
        path: *const u8,
        path_size: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    fn proxy_send_local_response(
        status: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_continue_stream(stream: u32) -> u32;
    fn proxy_set_effective_context(context: u32) -> u32;
    fn proxy_http_call(
        upstream: *const u8,
        upstream_size: usize,
        headers: *const u8,
        headers_size: usize,
        body: *const u8,
        body_size: usize,
        trailers: *const u8,
        trailers_size: usize,
        timeout_ms: u32,
        token: *mut u32,
    ) -> u32;
    fn proxy_get_shared_data(
        key: *const u8,
        key_size: usize,
        data: *mut *mut u8,
        size: *mut usize,
        cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_register_shared_queue(name: *const u8, name_size: usize, id: *mut u32) -> u32;
    fn proxy_enqueue_shared_queue(queue: u32, value: *const u8, value_size: usize) -> u32;
    fn proxy_dequeue_shared_queue(queue: u32, data: *mut *mut u8, size: *mut usize) -> u32;
    fn proxy_define_metric(kind: u32, name: *const u8, name_size: usize, id: *mut u32) -> u32;
    fn proxy_increment_metric(id: u32, offset: i64) -> u32;
}

/// Memory for a value the host is about to copy in: `size` bytes, handed back to Rust by
/// [`taken`] with the same size.
#[unsafe(no_mangle)]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let block: Box<[MaybeUninit<u8>]> = Box::new_uninit_slice(size);
    Box::into_raw(block).cast::<u8>()
}

/// Takes ownership of what the host wrote into memory from [`proxy_on_memory_allocate`].
fn taken(data: *mut u8, size: usize) -> Option<Vec<u8>> {
    if data.is_null() {
        return None;
    }
    // SAFETY: the host wrote `size` bytes into a block it got from `proxy_on_memory_allocate`
    // for exactly `size` bytes (a boxed slice: the layout of a Vec of that length and
    // capacity), and hands it over; nothing else holds it.
    Some(unsafe { Vec::from_raw_parts(data, size, size) })
}

/// Runs a host call that returns a value in host-allocated memory; `None` for not found.
fn fetch(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> Result<Option<Vec<u8>>, Status> {
    let (mut data, mut size) = (null_mut::<u8>(), 0_usize);
    match call(&mut data, &mut size) {
        OK => Ok(taken(data, size)),
        NOT_FOUND => Ok(None),
        other => Err(Status(other)),
    }
}

/// Writes a log line.
pub fn log(level: Level, message: &str) {
    // SAFETY: a pointer and length of a live string, read by the host during the call.
    unsafe { proxy_log(level as u32, message.as_ptr(), message.len()) };
}

/// The host's clock, in Unix nanoseconds.
pub fn now_nanos() -> Result<u64, Status> {
    let mut time = 0_u64;
    // SAFETY: the host writes one u64 into a live local.
    ok(unsafe { proxy_get_current_time_nanoseconds(&mut time) })?;
    Ok(time)
}

/// Asks for `proxy_on_tick` every `ms` milliseconds (on the current root context).
pub fn set_tick_period(ms: u32) -> Result<(), Status> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

/// Up to `max` bytes of a buffer from its start.
pub fn buffer(kind: Buffer, max: usize) -> Result<Option<Vec<u8>>, Status> {
    // SAFETY: the host writes a pointer and a size into the locals `fetch` passes.
    fetch(|data, size| unsafe { proxy_get_buffer_bytes(kind as u32, 0, max, data, size) })
}

/// One header's value as bytes (a client may send any octet the codec accepts).
pub fn header(map: Map, name: &str) -> Result<Option<Vec<u8>>, Status> {
    // SAFETY: `name` is live for the call; the host writes a pointer and a size into the
    // locals `fetch` passes.
    fetch(|data, size| unsafe {
        proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), data, size)
    })
}

/// Adds a header.
pub fn add_header(map: Map, name: &str, value: &str) -> Result<(), Status> {
    // SAFETY: both strings are live for the call.
    ok(unsafe {
        proxy_add_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

/// A property by its path (`["source", "address"]`).
pub fn property(path: &[&str]) -> Result<Option<Vec<u8>>, Status> {
    let joined = path.join("\0");
    // SAFETY: `joined` is live for the call; the host writes a pointer and a size into the
    // locals `fetch` passes.
    fetch(|data, size| unsafe { proxy_get_property(joined.as_ptr(), joined.len(), data, size) })
}

/// Answers the current request locally.
pub fn send_response(status: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), Status> {
    let headers = encode_map(headers);
    // SAFETY: every pointer is a live slice for the call; no details (null, 0).
    ok(unsafe {
        proxy_send_local_response(
            status,
            null(),
            0,
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        )
    })
}

/// Lets the current (paused) request go on.
pub fn resume_request() -> Result<(), Status> {
    // SAFETY: no pointers (0: the HTTP request stream).
    ok(unsafe { proxy_continue_stream(0) })
}

/// Makes `context` the one later host calls act on.
pub fn set_effective_context(context: u32) -> Result<(), Status> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_set_effective_context(context) })
}

/// Sends an HTTP call to `cluster`; its token.
pub fn http_call(
    cluster: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout_ms: u32,
) -> Result<u32, Status> {
    let headers = encode_map(headers);
    let trailers = encode_map(&[]);
    let mut token = 0_u32;
    // SAFETY: every pointer is a live slice for the call; the host writes one u32.
    ok(unsafe {
        proxy_http_call(
            cluster.as_ptr(),
            cluster.len(),
            headers.as_ptr(),
            headers.len(),
            body.as_ptr(),
            body.len(),
            trailers.as_ptr(),
            trailers.len(),
            timeout_ms,
            &mut token,
        )
    })?;
    Ok(token)
}

/// A shared-data value and its compare-and-swap token (0: none; a missing key has neither).
pub fn shared_get(key: &str) -> Result<(Option<Vec<u8>>, u32), Status> {
    let (mut data, mut size, mut cas) = (null_mut::<u8>(), 0_usize, 0_u32);
    // SAFETY: `key` is live for the call; the host writes a pointer, a size and a u32 into
    // live locals, the pointer from `proxy_on_memory_allocate`.
    let status =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    match status {
        OK => Ok((taken(data, size), cas)),
        NOT_FOUND => Ok((None, 0)),
        other => Err(Status(other)),
    }
}

/// Writes a shared-data value if `cas` is still the key's token (0: unconditionally).
pub fn shared_set(key: &str, value: &[u8], cas: u32) -> Result<(), Status> {
    // SAFETY: both slices are live for the call.
    ok(unsafe { proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas) })
}

/// Registers a shared queue for the current root context; its id.
pub fn register_queue(name: &str) -> Result<u32, Status> {
    let mut id = 0_u32;
    // SAFETY: `name` is live for the call; the host writes one u32.
    ok(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// Puts `item` on a shared queue.
pub fn enqueue(queue: u32, item: &[u8]) -> Result<(), Status> {
    // SAFETY: `item` is live for the call.
    ok(unsafe { proxy_enqueue_shared_queue(queue, item.as_ptr(), item.len()) })
}

/// Takes one item off a shared queue (`None`: it is empty).
pub fn dequeue(queue: u32) -> Result<Option<Vec<u8>>, Status> {
    // SAFETY: the host writes a pointer and a size into the locals `fetch` passes.
    match fetch(|data, size| unsafe { proxy_dequeue_shared_queue(queue, data, size) }) {
        Err(Status::EMPTY) => Ok(None),
        other => other,
    }
}

/// Defines a counter (`gauge: false`) or a gauge; its id.
pub fn define_metric(gauge: bool, name: &str) -> Result<u32, Status> {
    let mut id = 0_u32;
    // SAFETY: `name` is live for the call; the host writes one u32.
    ok(unsafe { proxy_define_metric(u32::from(gauge), name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// Adds `by` to a counter or gauge.
pub fn increment_metric(id: u32, by: i64) -> Result<(), Status> {
    // SAFETY: no pointers.
    ok(unsafe { proxy_increment_metric(id, by) })
}
