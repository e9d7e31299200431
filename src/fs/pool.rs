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

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use crossbeam_channel::{unbounded, Sender};
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

pub struct Pool {
    tx: Sender<Job>,
    load: Arc<Load>,
    metrics: Option<Arc<Metrics>>,
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

impl Pool {
    /// Starts `workers` threads named `name-N`. They end when the pool is dropped and the
    /// queue is empty. `metrics`, if any, hears of every change of the pool's load.
    pub fn start(
        name: &str,
        workers: usize,
        metrics: Option<Arc<Metrics>>,
    ) -> std::io::Result<Pool> {
        let (tx, rx) = unbounded::<Job>();
        let load = Arc::new(Load::default());
        for n in 0..workers.max(1) {
            let (rx, load, metrics) = (rx.clone(), load.clone(), metrics.clone());
            std::thread::Builder::new()
                .name(format!("{name}-{n}"))
                .spawn(move || {
                    WORKER.set(true);
                    for job in rx {
                        load.queued.fetch_sub(1, Ordering::Relaxed);
                        load.running.fetch_add(1, Ordering::Relaxed);
                        load.report(metrics.as_deref());
                        job();
                        load.running.fetch_sub(1, Ordering::Relaxed);
                        load.report(metrics.as_deref());
                    }
                })?;
        }
        Ok(Pool { tx, load, metrics })
    }

    /// Runs `job` on a worker.
    pub fn run(&self, job: impl FnOnce() + Send + 'static) {
        self.load.queued.fetch_add(1, Ordering::Relaxed);
        self.load.report(self.metrics.as_deref());
        if let Err(e) = self.tx.send(Box::new(job)) {
            // Only when every worker is gone, which a panic in a job could do: serve on the
            // calling thread rather than drop the request (its reply would say EIO).
            self.load.queued.fetch_sub(1, Ordering::Relaxed);
            warn!("a request pool has no workers; serving on a FUSE thread");
            (e.into_inner())();
        }
    }

    pub fn load(&self) -> Arc<Load> {
        self.load.clone()
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
}
