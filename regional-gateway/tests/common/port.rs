//! Loopback ports for the servers tests start: one definition for the gateway's tests and the
//! end-to-end tests (which include it by path).

/// A loopback port nothing listens on right now, and never handed out before by this test
/// process: tests run on parallel threads, and the kernel may offer a port again as soon as
/// the probe closes it, before the server it was meant for has bound it (a gateway then
/// failed to listen while another test's gateway answered on its port).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
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
