//! Waiting for something that happens on its own time (a refresh round, a daemon's answer)
//! without sleeping as a way of synchronizing: a condition polled until it holds, or a call
//! that must answer within a bound.

use std::time::{Duration, Instant};

/// Polls `check` until it returns true or `secs` pass; panics with `what` on timeout.
pub fn eventually(secs: u64, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Runs `op` on a thread of its own and panics if it does not answer within `secs`: a
/// request that must not wait on a frozen remote, or on anything else that stalls. A
/// thread left stuck is released when the stall ends.
pub fn live<T: Send + 'static>(
    secs: u64,
    what: &str,
    op: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(op());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within {secs} s"),
    }
}
