//! A pause of every request, for the rare change that must see no request touch the trees
//! while it is made: a directory swapped for the btrfs subvolume that copies it (see
//! `subvolume`), whose nodes must all be moved onto the copy before any request uses one.
//!
//! Each request passes the gate ([`Gate::enter`]) for as long as it is served. A pause
//! ([`Gate::pause`]) stops new requests at the gate and waits for those being served to
//! finish, up to a deadline: a request stuck on the remote makes the pause give up, never
//! hang. Passing costs two atomic operations on one counter; a request that finds the gate
//! paused waits on a condition variable until the pause ends.
//!
//! ## Locks
//! The gate's mutex is a leaf, held only to wait and to wake. A pause is taken with no other
//! lock of the view held but the quota's settling lock, which no request takes.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

#[derive(Debug, Default)]
pub struct Gate {
    /// Requests past the gate.
    inside: AtomicUsize,
    paused: AtomicBool,
    /// One pause at a time.
    pausing: Mutex<()>,
    lock: Mutex<()>,
    changed: Condvar,
}

thread_local! {
    /// Whether this thread is serving a request (past the gate): a pause it makes itself
    /// (a quota set through an attribute) does not wait for it.
    static SERVING: Cell<bool> = const { Cell::new(false) };
}

/// A request past the gate; it leaves when dropped.
pub struct Pass<'a>(&'a Gate);

/// The gate paused; it opens again when dropped.
pub struct Paused<'a> {
    gate: &'a Gate,
    _one: parking_lot::MutexGuard<'a, ()>,
}

impl Gate {
    /// Passes the gate, waiting while it is paused.
    pub fn enter(&self) -> Pass<'_> {
        loop {
            // Counted before the pause is looked at, and a pause sets its flag before it
            // counts: one of the two always sees the other.
            self.inside.fetch_add(1, Ordering::SeqCst);
            if !self.paused.load(Ordering::SeqCst) {
                SERVING.with(|s| s.set(true));
                return Pass(self);
            }
            self.leave();
            let mut lock = self.lock.lock();
            while self.paused.load(Ordering::SeqCst) {
                self.changed.wait(&mut lock);
            }
        }
    }

    fn leave(&self) {
        self.inside.fetch_sub(1, Ordering::SeqCst);
        if self.paused.load(Ordering::SeqCst) {
            let _lock = self.lock.lock();
            self.changed.notify_all();
        }
    }

    /// Stops new requests at the gate and waits until none but the caller's own is being
    /// served; none if that takes longer than `patience` (the gate is open again then).
    pub fn pause(&self, patience: Duration) -> Option<Paused<'_>> {
        let one = self.pausing.lock();
        self.paused.store(true, Ordering::SeqCst);
        let own = usize::from(SERVING.with(Cell::get));
        let deadline = Instant::now() + patience;
        let mut lock = self.lock.lock();
        while self.inside.load(Ordering::SeqCst) > own {
            if self.changed.wait_until(&mut lock, deadline).timed_out()
                && self.inside.load(Ordering::SeqCst) > own
            {
                self.paused.store(false, Ordering::SeqCst);
                self.changed.notify_all();
                return None;
            }
        }
        drop(lock);
        Some(Paused {
            gate: self,
            _one: one,
        })
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        SERVING.with(|s| s.set(false));
        self.0.leave();
    }
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        let _lock = self.gate.lock.lock();
        self.gate.paused.store(false, Ordering::SeqCst);
        self.gate.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_pause_waits_for_requests_inside_and_holds_new_ones() {
        let gate = Arc::new(Gate::default());
        let pass = gate.enter();
        let held = {
            let gate = gate.clone();
            std::thread::spawn(move || gate.pause(Duration::from_secs(10)).is_some())
        };
        // The request inside keeps the pause waiting; then it leaves.
        std::thread::sleep(Duration::from_millis(50));
        assert!(!held.is_finished());
        drop(pass);
        assert!(held.join().unwrap());

        let paused = gate.pause(Duration::from_secs(1)).unwrap();
        let entered = {
            let gate = gate.clone();
            std::thread::spawn(move || {
                let _pass = gate.enter();
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!entered.is_finished(), "a request passed a paused gate");
        drop(paused);
        entered.join().unwrap();
    }

    #[test]
    fn a_pause_gives_up_on_a_request_that_does_not_leave() {
        let gate = Gate::default();
        let stuck = std::thread::scope(|s| {
            s.spawn(|| {
                let _pass = gate.enter();
                std::thread::sleep(Duration::from_millis(300));
            });
            std::thread::sleep(Duration::from_millis(50));
            gate.pause(Duration::from_millis(50)).is_none()
        });
        assert!(stuck);
        // The gate is open again.
        drop(gate.enter());
    }

    #[test]
    fn a_request_pausing_does_not_wait_for_itself() {
        let gate = Gate::default();
        let _pass = gate.enter();
        assert!(gate.pause(Duration::from_millis(100)).is_some());
    }
}
