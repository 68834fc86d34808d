//! The floor of a Wasm HTTP filter in Envoy: a stream context is made and deleted, and its
//! request-header callback reads `x-api-key` into the VM's memory and drops it.

use std::alloc::{Layout, alloc, dealloc};

#[unsafe(no_mangle)]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// Memory the host copies values into.
#[unsafe(no_mangle)]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    match Layout::from_size_align(size.max(1), 1) {
        // SAFETY: the layout has a non-zero size.
        Ok(layout) => unsafe { alloc(layout) },
        Err(_) => std::ptr::null_mut(),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn proxy_on_vm_start(_: u32, _: usize) -> u32 {
    1
}

#[unsafe(no_mangle)]
pub extern "C" fn proxy_on_configure(_: u32, _: usize) -> u32 {
    1
}

#[unsafe(no_mangle)]
pub extern "C" fn proxy_on_context_create(_: u32, _: u32) {}

#[unsafe(no_mangle)]
pub extern "C" fn proxy_on_delete(_: u32) {}

unsafe extern "C" {
    fn proxy_get_header_map_value(
        map: u32,
        key: *const u8,
        key_len: usize,
        value: *mut *mut u8,
        value_len: *mut usize,
    ) -> u32;
}

/// Reads the header and lets the request go on.
#[unsafe(no_mangle)]
pub extern "C" fn proxy_on_request_headers(_: u32, _: usize, _: u32) -> u32 {
    let name = b"x-api-key";
    let (mut value, mut len) = (std::ptr::null_mut(), 0_usize);
    // SAFETY: the host writes a pointer it got from proxy_on_memory_allocate, and its length.
    unsafe {
        proxy_get_header_map_value(0, name.as_ptr(), name.len(), &mut value, &mut len);
        if let (false, Ok(layout)) = (value.is_null(), Layout::from_size_align(len.max(1), 1)) {
            dealloc(value, layout);
        }
    }
    0
}
