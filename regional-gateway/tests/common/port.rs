//! Loopback ports for the servers tests start: one definition for the gateway's tests and the
//! end-to-end tests (which include it by path).

/// A loopback port nothing listens on right now, and never handed out before by this test
/// process.
///
/// Under `cargo nextest` every test is a process of its own and several run at once, each with
/// a slot number no other running test holds (`NEXTEST_TEST_GLOBAL_SLOT`): its ports come from
/// that slot's block below the kernel's ephemeral range, so neither another test's probe nor a
/// client connection's local port can take one between the probe and the server binding it.
/// Elsewhere (`cargo test`, one process, parallel threads) the kernel picks, and the set below
/// keeps a port it offers again from being handed out twice.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(block) = slot_block() {
        for port in block {
            if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.insert(port);
                return port;
            }
        }
        panic!("every port of this test's block is taken");
    }
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("no free loopback port");
        if given.insert(port) {
            return port;
        }
    }
}

/// Ports per running test; the blocks start at 16,000 and stay below 32,768, where Linux's
/// ephemeral range begins, for up to 41 tests at once.
const BLOCK: u16 = 400;

fn slot_block() -> Option<std::ops::Range<u16>> {
    let slot: u16 = std::env::var("NEXTEST_TEST_GLOBAL_SLOT")
        .ok()?
        .parse()
        .ok()?;
    let start = 16_000u16.checked_add(slot.checked_mul(BLOCK)?)?;
    (start + BLOCK <= 32_768).then(|| start..start + BLOCK)
}
