//! What serving leaves for the benchmark to read: requests counted by the path they took,
//! and the threads to join.

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

/// Requests served, by path. In io_uring mode the kernel still sends FORGETs and INTERRUPTs
/// through /dev/fuse, so a /dev/fuse thread runs there too; a non-forget request counted on it
/// would mean the ring is not carrying the traffic.
#[derive(Default)]
pub struct Stats {
    pub dev_requests: AtomicU64,
    pub ring_requests: AtomicU64,
    pub forgets: AtomicU64,
}

impl Stats {
    /// All replied requests (forgets excluded: they have no round trip).
    pub fn requests(&self) -> u64 {
        self.dev_requests.load(Ordering::Relaxed) + self.ring_requests.load(Ordering::Relaxed)
    }
}

/// Server threads by name; each returns its first error.
pub type Threads = Vec<(String, JoinHandle<Result<(), String>>)>;
