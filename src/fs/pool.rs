//! Worker pools for requests that must not hold a FUSE thread: a FUSE thread blocked in a
//! call serves nobody else, and the mount has only a few (one per CPU by default, which keeps
//! a request and its reply on warm CPUs).
//!
//! The remote pool: the remote is a network share that can stop answering; every call on it
//! then blocks for as long as it does, and a dozen such requests would take every FUSE thread,
//! so local paths would wait on the remote too. A request that may need the remote (see
//! `View::name_may_wait` and friends) is therefore handed, with its reply, to this pool, and
//! the FUSE thread goes back to reading requests. Its caller waits for the remote as on an
//! NFS hard mount (and can be killed meanwhile); everybody else does not.
//!
//! The sync pool: `fsync` of a local file waits for the disk, for seconds under heavy
//! writeback. It gets a pool of its own, not the remote one, so that neither a busy disk nor
//! a stalled remote holds up the other.
//!
//! The queues are unbounded: the kernel sends at most one request per blocked caller, so their
//! length is bounded by the callers waiting. The number of workers bounds how many calls are
//! outstanding at once.
//!
//! An idle worker sleeps on a condition variable and nothing else: a queue whose receivers
//! spin and yield before they sleep (as `crossbeam-channel`'s do) costs every hop several
//! `sched_yield`s per idle worker, each a context switch when the CPU has other work, and on
//! a small host that took more CPU than the requests themselves.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use tracing::warn;

use crate::metrics::Metrics;

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    static WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is a pool's worker: a request served here may wait without holding
/// up the FUSE threads, and with them the FORGETs and replies they read.
pub fn on_worker() -> bool {
    WORKER.get()
}

/// How many requests wait for a worker, and how many workers are busy.
#[derive(Debug, Default)]
pub struct Load {
    pub queued: AtomicI64,
    pub running: AtomicI64,
}

impl Load {
    fn report(&self, metrics: Option<&Metrics>) {
        if let Some(m) = metrics {
            m.remote_pool(
                self.queued.load(Ordering::Relaxed),
                self.running.load(Ordering::Relaxed),
            );
        }
    }
}

/// The jobs not yet taken, and whether workers should end once it is empty.
#[derive(Default)]
struct Jobs {
    waiting: VecDeque<Job>,
    workers: usize,
    /// Workers asleep on `ready`: a job queued while none is needs no wakeup (a system
    /// call), a busy worker takes it when it is done.
    idle: usize,
    closing: bool,
}

/// What the pool and its workers share. Lock order: `jobs` is a leaf; no job runs under it.
#[derive(Default)]
struct Queue {
    jobs: Mutex<Jobs>,
    ready: Condvar,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, Jobs> {
        // Jobs run outside the lock, so a panic cannot leave `Jobs` half changed.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next job, or `None` once the pool is dropped and every job is taken.
    fn next(&self) -> Option<Job> {
        let mut jobs = self.lock();
        loop {
            if let Some(job) = jobs.waiting.pop_front() {
                return Some(job);
            }
            if jobs.closing {
                return None;
            }
            jobs.idle += 1;
            jobs = self.ready.wait(jobs).unwrap_or_else(|e| e.into_inner());
            jobs.idle -= 1;
        }
    }
}

/// Counts a worker out when its thread ends, however it ends.
struct Leaving(Arc<Queue>);

impl Drop for Leaving {
    fn drop(&mut self) {
        self.0.lock().workers -= 1;
    }
}

pub struct Pool {
    queue: Arc<Queue>,
    load: Arc<Load>,
    metrics: Option<Arc<Metrics>>,
}

impl Pool {
    /// Starts `workers` threads named `name-N`. They end when the pool is dropped and the
    /// queue is empty. `metrics`, if any, hears of every change of the pool's load.
    pub fn start(
        name: &str,
        workers: usize,
        metrics: Option<Arc<Metrics>>,
    ) -> std::io::Result<Pool> {
        let queue = Arc::new(Queue::default());
        let load = Arc::new(Load::default());
        let pool = Pool {
            queue: queue.clone(),
            load: load.clone(),
            metrics: metrics.clone(),
        };
        for n in 0..workers.max(1) {
            let (queue, load, metrics) = (queue.clone(), load.clone(), metrics.clone());
            queue.lock().workers += 1;
            let leaving = Leaving(queue.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{n}"))
                .spawn(move || {
                    let _leaving = leaving;
                    WORKER.set(true);
                    while let Some(job) = queue.next() {
                        load.queued.fetch_sub(1, Ordering::Relaxed);
                        load.running.fetch_add(1, Ordering::Relaxed);
                        load.report(metrics.as_deref());
                        job();
                        load.running.fetch_sub(1, Ordering::Relaxed);
                        load.report(metrics.as_deref());
                    }
                });
            // A thread that was not spawned drops its `Leaving`, and dropping `pool` ends
            // the workers already started.
            spawned?;
        }
        Ok(pool)
    }

    /// Runs `job` on a worker.
    pub fn run(&self, job: impl FnOnce() + Send + 'static) {
        self.load.queued.fetch_add(1, Ordering::Relaxed);
        self.load.report(self.metrics.as_deref());
        let mut jobs = self.queue.lock();
        if jobs.workers == 0 {
            // Only when every worker is gone, which a panic in a job could do: serve on the
            // calling thread rather than drop the request (its reply would say EIO).
            drop(jobs);
            self.load.queued.fetch_sub(1, Ordering::Relaxed);
            warn!("a request pool has no workers; serving on a FUSE thread");
            return job();
        }
        jobs.waiting.push_back(Box::new(job));
        let wake = jobs.idle > 0;
        drop(jobs);
        if wake {
            self.queue.ready.notify_one();
        }
    }

    pub fn load(&self) -> Arc<Load> {
        self.load.clone()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.queue.lock().closing = true;
        self.queue.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_stuck_job_does_not_hold_up_the_others() {
        let pool = Pool::start("test", 2, None).unwrap();
        let (stuck_tx, stuck_rx) = crossbeam_channel::bounded::<()>(0);
        pool.run(move || {
            let _ = stuck_rx.recv();
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        for i in 0..10 {
            let tx = tx.clone();
            pool.run(move || tx.send(i).unwrap());
        }
        let mut got: Vec<i32> = (0..10)
            .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        got.sort();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
        assert_eq!(pool.load().running.load(Ordering::Relaxed), 1);
        drop(stuck_tx);
    }

    #[test]
    fn a_pool_whose_workers_died_serves_on_the_caller() {
        let pool = Pool::start("test", 1, None).unwrap();
        pool.run(|| panic!("a job that panics ends its worker"));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while pool.queue.lock().workers > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the worker did not end"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let caller = std::thread::current().id();
        let (tx, rx) = crossbeam_channel::unbounded();
        pool.run(move || tx.send(std::thread::current().id()).unwrap());
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), caller);
    }

    #[test]
    fn dropping_the_pool_serves_what_is_queued_and_ends_the_workers() {
        let pool = Pool::start("test", 2, None).unwrap();
        let (tx, rx) = crossbeam_channel::unbounded();
        for i in 0..100 {
            let tx = tx.clone();
            pool.run(move || tx.send(i).unwrap());
        }
        let queue = pool.queue.clone();
        drop(pool);
        let mut got: Vec<i32> = (0..100)
            .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        got.sort();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while queue.lock().workers > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the workers did not end"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
