//! A bound on a whole test: a daemon that stops answering fails the test instead of hanging
//! it and every test after it.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Mount;

/// Kills the daemon if the test is not done in time, so that a daemon that stopped
/// answering fails the test (every pending call on the mount then returns `ENOTCONN`)
/// instead of hanging it. Follows the daemon across remounts with [`Watchdog::follow`].
pub struct Watchdog {
    pub done: Arc<AtomicBool>,
    pub pid: Arc<AtomicU32>,
}

impl Watchdog {
    pub fn new(pid: u32, secs: u64) -> Watchdog {
        let done = Arc::new(AtomicBool::new(false));
        let pid = Arc::new(AtomicU32::new(pid));
        let (d, p) = (done.clone(), pid.clone());
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(secs);
            while Instant::now() < deadline {
                if d.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if !d.load(Ordering::SeqCst) {
                let pid = p.load(Ordering::SeqCst);
                eprintln!("watchdog: test still running after {secs} s; killing daemon {pid}");
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        });
        Watchdog { done, pid }
    }

    pub fn of(m: &Mount, secs: u64) -> Watchdog {
        Watchdog::new(m.daemon_pid().expect("a foreground daemon"), secs)
    }

    pub fn follow(&self, m: &Mount) {
        self.pid.store(
            m.daemon_pid().expect("a foreground daemon"),
            Ordering::SeqCst,
        );
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
    }
}
