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
//!
//! Each worker is pinned to one of the CPUs the daemon may use, in turn, and a job wakes an
//! idle worker of the CPU it was handed over on, if there is one, else any idle worker. A
//! ring queue thread hands over on its caller's CPU, so a request and its reply stay there:
//! a worker the scheduler woke on another, idle CPU cost a remote lookup two wakeups across
//! CPUs (the worker's, then the queue thread's for the reply): over io_uring, a cold stat in
//! a remote layer took 31–33 µs, and 18–19 with the workers on the caller's CPU
//! (`benches/README.md`). A job still never waits while a worker is idle.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use tracing::warn;

use super::cpus;
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
struct Jobs {
    waiting: VecDeque<Job>,
    workers: usize,
    /// Per home: workers asleep on its `ready` and not yet woken. A job queued while none
    /// is needs no wakeup (a system call): a busy worker takes it when it is done.
    idle: Vec<usize>,
    /// Per home: wakeups sent and not yet taken by a waking worker. A worker that wakes
    /// takes one if there is one (its waker already counted it out of `idle`), else it woke
    /// spuriously and counts itself out; either way each wakeup leaves one worker awake.
    woken: Vec<usize>,
    closing: bool,
}

/// What the pool and its workers share: one home per CPU the workers were placed on, each
/// with its own condition variable. Lock order: `jobs` is a leaf; no job runs under it.
struct Queue {
    jobs: Mutex<Jobs>,
    ready: Vec<Condvar>,
    /// The CPUs of the homes, in order.
    cpus: Vec<usize>,
    /// The home of each CPU number.
    home_of: Vec<Option<usize>>,
}

impl Queue {
    /// Homes on `cpus`, or a single home when there is none to name.
    fn new(cpus: Vec<usize>) -> Queue {
        let homes = cpus.len().max(1);
        let mut home_of = vec![None; cpus.iter().max().map_or(0, |&c| c + 1)];
        for (home, &cpu) in cpus.iter().enumerate() {
            home_of[cpu] = Some(home);
        }
        Queue {
            jobs: Mutex::new(Jobs {
                waiting: VecDeque::new(),
                workers: 0,
                idle: vec![0; homes],
                woken: vec![0; homes],
                closing: false,
            }),
            ready: (0..homes).map(|_| Condvar::new()).collect(),
            cpus,
            home_of,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Jobs> {
        // Jobs run outside the lock, so a panic cannot leave `Jobs` half changed.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The home of the calling thread's CPU, if workers live there.
    fn here(&self) -> Option<usize> {
        self.home_of.get(cpus::current()?).copied().flatten()
    }

    /// The next job for a worker of `home`, or `None` once the pool is dropped and every job
    /// is taken.
    fn next(&self, home: usize) -> Option<Job> {
        let mut jobs = self.lock();
        loop {
            if let Some(job) = jobs.waiting.pop_front() {
                return Some(job);
            }
            if jobs.closing {
                return None;
            }
            jobs.idle[home] += 1;
            jobs = self.ready[home]
                .wait(jobs)
                .unwrap_or_else(|e| e.into_inner());
            if jobs.woken[home] > 0 {
                jobs.woken[home] -= 1;
            } else {
                jobs.idle[home] -= 1;
            }
        }
    }

    /// Counts out and returns an idle worker's home to wake for a job handed over on `here`:
    /// one of `here` if any is idle, else the home with the most idle workers.
    fn wake_for(jobs: &mut Jobs, here: Option<usize>) -> Option<usize> {
        let home = here
            .filter(|&h| jobs.idle[h] > 0)
            .or_else(|| (0..jobs.idle.len()).max_by_key(|&h| jobs.idle[h]))
            .filter(|&h| jobs.idle[h] > 0)?;
        jobs.idle[home] -= 1;
        jobs.woken[home] += 1;
        Some(home)
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
    /// Starts `workers` threads named `name-N`, pinned in turn to the CPUs the calling
    /// thread may use. They end when the pool is dropped and the queue is empty. `metrics`,
    /// if any, hears of every change of the pool's load.
    pub fn start(
        name: &str,
        workers: usize,
        metrics: Option<Arc<Metrics>>,
    ) -> std::io::Result<Pool> {
        let queue = Arc::new(Queue::new(cpus::allowed()));
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
            let home = n % queue.ready.len();
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{n}"))
                .spawn(move || {
                    let _leaving = leaving;
                    WORKER.set(true);
                    if let Some(&cpu) = queue.cpus.get(home) {
                        cpus::pin(cpu);
                    }
                    while let Some(job) = queue.next(home) {
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
        let wake = Queue::wake_for(&mut jobs, self.queue.here());
        drop(jobs);
        if let Some(home) = wake {
            self.queue.ready[home].notify_one();
        }
    }

    pub fn load(&self) -> Arc<Load> {
        self.load.clone()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.queue.lock().closing = true;
        for ready in &self.queue.ready {
            ready.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Waits until every worker of `pool` sleeps, so that a job finds the idle ones.
    fn all_idle(pool: &Pool, workers: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while pool.queue.lock().idle.iter().sum::<usize>() < workers {
            assert!(std::time::Instant::now() < deadline, "workers not idle");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_job_runs_on_a_worker_of_the_cpu_it_was_handed_over_on() {
        let allowed = cpus::allowed();
        let workers = 2 * allowed.len();
        let pool = Pool::start("test", workers, None).unwrap();
        for &cpu in &allowed {
            all_idle(&pool, workers);
            let (tx, rx) = crossbeam_channel::unbounded();
            std::thread::scope(|s| {
                s.spawn(|| {
                    cpus::pin(cpu);
                    assert_eq!(cpus::current(), Some(cpu));
                    pool.run(move || tx.send(cpus::current()).unwrap());
                });
            });
            let ran = rx.recv_timeout(Duration::from_secs(5)).unwrap();
            assert_eq!(ran, Some(cpu), "a job handed over on CPU {cpu}");
        }
    }

    /// Two jobs handed over at once on a CPU with one idle worker: the second wakes a worker
    /// of another CPU, though the first one's has not woken yet to take it.
    #[test]
    fn a_job_wakes_an_idle_worker_elsewhere_when_its_cpus_are_taken() {
        let allowed = cpus::allowed();
        if allowed.len() < 2 {
            eprintln!("one CPU allowed: no other CPU's worker to wake");
            return;
        }
        let workers = allowed.len();
        let pool = Pool::start("test", workers, None).unwrap();
        all_idle(&pool, workers);
        let both = Arc::new(std::sync::Barrier::new(2));
        let (tx, rx) = crossbeam_channel::unbounded();
        std::thread::scope(|s| {
            s.spawn(|| {
                cpus::pin(allowed[0]);
                for _ in 0..2 {
                    let (both, tx) = (both.clone(), tx.clone());
                    pool.run(move || {
                        both.wait();
                        tx.send(cpus::current()).unwrap();
                    });
                }
            });
        });
        let mut ran: Vec<_> = (0..2)
            .map(|_| {
                rx.recv_timeout(Duration::from_secs(5))
                    .expect("both jobs ran at once")
            })
            .collect();
        ran.sort();
        assert_ne!(ran[0], ran[1], "the two jobs ran on {ran:?}");
    }

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
