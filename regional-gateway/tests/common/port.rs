//! Loopback ports for the servers tests start: one definition for the gateway's tests, the
//! end-to-end tests and the lab's launchers (which include it by path).

use std::time::{Duration, Instant};

/// A loopback port nothing listens on right now, and never handed out before by this process.
pub fn free_port() -> u16 {
    try_free_port().unwrap_or_else(|e| panic!("{e}"))
}

/// [`free_port`], with an error where it would panic.
///
/// Under `cargo nextest` every test is a process of its own and several run at once, each with
/// a slot number no other running test holds (`NEXTEST_TEST_GLOBAL_SLOT`, inherited by the
/// processes a test starts): its ports come from that slot's block below the kernel's ephemeral
/// range, so neither another test's probe nor a client connection's local port can take one
/// between the probe and the server binding it. Elsewhere (`cargo test`, one process, parallel
/// threads; a lab run by hand) the kernel picks, and the set below keeps a port it offers
/// again from being handed out twice.
pub fn try_free_port() -> Result<u16, String> {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(mut block) = slot_block() {
        return block
            .find(|&port| {
                !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
            })
            .inspect(|&port| {
                given.insert(port);
            })
            .ok_or_else(|| "every port of this test slot's block is taken".into());
    }
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| format!("no free loopback port: {e}"))?;
        if given.insert(port) {
            return Ok(port);
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

/// The lock the tests running the README's examples take turns on: those use the README's own
/// ports (8080-8082, 8787, 9901, 10000) and paths (`/tmp/strata`), which are machine-wide.
/// Held until the file is dropped; waits at most 15 minutes for another run.
pub fn readme_lock() -> std::fs::File {
    let path = "/tmp/strata-readme-examples.lock";
    let file = std::fs::File::create(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let deadline = Instant::now() + Duration::from_secs(900);
    #[allow(clippy::incompatible_msrv)] // tests build with the pinned 1.95; File::try_lock is 1.89
    while file.try_lock().is_err() {
        assert!(
            Instant::now() < deadline,
            "another run has held {path} (the README's ports and /tmp paths) for over 900s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    file
}
