//! Background jobs keyed by name: image exports and downloads, and volume restores.
//!
//! Copying a volume or an image can take longer than a CO is willing to wait for one call. A
//! job therefore runs in its own tokio task, independent of the request that started it: when
//! the CO gives up on a call (its deadline drops the request future), the job goes on, and the
//! retry finds it by name and waits for it again instead of starting over. The outcome of a
//! failed job is remembered so that the next call for that name reports it (once).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;
use tokio::time::Instant;

use super::error::{CsiError, Failure, Result};

type Outcome = Option<std::result::Result<(), Failure>>;

/// How waiting for a job ended.
pub enum JobWait {
    /// No job of that name runs (it never did, or its outcome was already handed out).
    NotRunning,
    /// It finished: `Ok`, or the error it failed with.
    Done(Result<()>),
    /// Still running at the deadline.
    Pending,
}

struct Entry<T> {
    outcome: watch::Receiver<Outcome>,
    data: T,
    cancel: Option<Cancel>,
}

/// A request to stop a job, which the job checks: at its await points
/// ([`Cancel::cancelled`]) or, on a blocking thread, between steps ([`Cancel::is_cancelled`]).
/// A job is never dropped from outside, because only the job knows what it must undo (kill
/// its child and wait for it, remove its files) before it is gone.
#[derive(Clone)]
pub struct Cancel(Arc<watch::Sender<bool>>);

impl Default for Cancel {
    fn default() -> Self {
        Cancel(Arc::new(watch::channel(false).0))
    }
}

impl Cancel {
    pub fn cancel(&self) {
        self.0.send_replace(true);
    }

    pub fn is_cancelled(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once cancelled.
    pub async fn cancelled(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives as long as `self`: waiting cannot fail.
        let _ = rx.wait_for(|c| *c).await;
    }

    /// What a cancelled job returns when it notices; its waiters hear `NotFound` instead
    /// (see [`JobSet::start_cancellable`]).
    pub fn error(&self) -> CsiError {
        CsiError::Aborted("cancelled".into())
    }
}

/// The running jobs of one kind, each with data describing what it does.
pub struct JobSet<T> {
    running: Mutex<HashMap<String, Entry<T>>>,
    failures: Mutex<HashMap<String, Failure>>,
}

impl<T> Default for JobSet<T> {
    fn default() -> Self {
        JobSet {
            running: Mutex::new(HashMap::new()),
            failures: Mutex::new(HashMap::new()),
        }
    }
}

fn lock<M>(m: &Mutex<M>) -> MutexGuard<'_, M> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Ends a job's entry when the job's task ends, however it ends: a job that panicked or was
/// cancelled (runtime shutdown) leaves a failure instead of a job that seems to run forever.
struct Finish<T: Send + Sync + 'static> {
    set: Arc<JobSet<T>>,
    name: String,
    tx: watch::Sender<Outcome>,
    outcome: Option<std::result::Result<(), Failure>>,
}

impl<T: Send + Sync + 'static> Drop for Finish<T> {
    fn drop(&mut self) {
        let outcome = self.outcome.take().unwrap_or_else(|| {
            Err(Failure::from(&CsiError::Internal(format!(
                "the job for {} stopped unexpectedly; retry",
                self.name
            ))))
        });
        // The failure is recorded before the job disappears, so that a caller never sees
        // neither.
        if let Err(failure) = &outcome {
            lock(&self.set.failures).insert(self.name.clone(), failure.clone());
        }
        lock(&self.set.running).remove(&self.name);
        let _ = self.tx.send(Some(outcome));
    }
}

impl<T: Clone + Send + Sync + 'static> JobSet<T> {
    /// Starts `job` as `name` in its own task. The caller makes sure no job of that name runs
    /// (it holds the lock under which it checked).
    pub fn start<F>(self: &Arc<Self>, name: &str, data: T, job: F)
    where
        F: Future<Output = Result<()>> + Send + 'static,
    {
        self.start_cancellable(name, data, None, job)
    }

    /// [`JobSet::start`] for a job that stops when `cancel` is set ([`JobSet::cancel`]).
    pub fn start_cancellable<F>(
        self: &Arc<Self>,
        name: &str,
        data: T,
        cancel: Option<Cancel>,
        job: F,
    ) where
        F: Future<Output = Result<()>> + Send + 'static,
    {
        let (tx, rx) = watch::channel(None);
        let asked = cancel.clone();
        lock(&self.running).insert(
            name.to_owned(),
            Entry {
                outcome: rx,
                data,
                cancel,
            },
        );
        lock(&self.failures).remove(name);
        let mut finish = Finish {
            set: Arc::clone(self),
            name: name.to_owned(),
            tx,
            outcome: None,
        };
        tokio::spawn(async move {
            let outcome = job.await.map_err(|e| {
                if asked.as_ref().is_some_and(Cancel::is_cancelled) {
                    // Only a delete cancels: whatever the job ended with once it noticed,
                    // a call waiting on it (and the next call for the name) must hear that
                    // what it was making is gone, not an error worth retrying.
                    tracing::debug!(job = %finish.name, error = %e, "job cancelled");
                    return Failure::from(&CsiError::NotFound(format!(
                        "{} was deleted while it was being made",
                        finish.name
                    )));
                }
                tracing::warn!(job = %finish.name, error = %e, "job failed");
                Failure::from(&e)
            });
            finish.outcome.replace(outcome);
        });
    }

    /// Whether a job of that name runs.
    pub fn running(&self, name: &str) -> bool {
        lock(&self.running)
            .get(name)
            .is_some_and(|e| e.outcome.borrow().is_none())
    }

    /// Asks the running job `name` to stop, because what it makes is being deleted; `false`
    /// when none runs or it cannot be cancelled. Wait for it ([`JobSet::wait`]) to know it
    /// is gone: it then ends, for every waiter, as `NotFound`.
    pub fn cancel(&self, name: &str) -> bool {
        match lock(&self.running).get(name).and_then(|e| e.cancel.clone()) {
            Some(cancel) => {
                cancel.cancel();
                true
            }
            None => false,
        }
    }

    /// What the running job `name` does.
    pub fn data(&self, name: &str) -> Option<T> {
        lock(&self.running).get(name).map(|e| e.data.clone())
    }

    /// The error of the last failed job `name`, once.
    pub fn take_failure(&self, name: &str) -> Option<CsiError> {
        lock(&self.failures).remove(name).map(CsiError::from)
    }

    /// Waits until the job `name` ends or `deadline` passes.
    pub async fn wait(&self, name: &str, deadline: Instant) -> JobWait {
        let rx = lock(&self.running).get(name).map(|e| e.outcome.clone());
        let Some(mut rx) = rx else {
            return match self.take_failure(name) {
                Some(e) => JobWait::Done(Err(e)),
                None => JobWait::NotRunning,
            };
        };
        let waited = tokio::time::timeout_at(deadline, rx.wait_for(|o| o.is_some()))
            .await
            .map(|r| r.map(|o| o.clone()));
        match waited {
            Ok(Ok(outcome)) => match outcome {
                Some(Err(failure)) => {
                    lock(&self.failures).remove(name);
                    JobWait::Done(Err(failure.into()))
                }
                _ => JobWait::Done(Ok(())),
            },
            // The sender is gone without an outcome: Finish always sends one, so this is a
            // job that ended; its failure, if any, is in `failures`.
            Ok(Err(_)) => match self.take_failure(name) {
                Some(e) => JobWait::Done(Err(e)),
                None => JobWait::Done(Ok(())),
            },
            Err(_) => JobWait::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_job_outlives_its_waiter_and_reports_failure_once() {
        let set: Arc<JobSet<u32>> = Arc::default();
        let (go, wait_go) = tokio::sync::oneshot::channel::<()>();
        set.start("a", 7, async move {
            let _ = wait_go.await;
            Err(CsiError::Unavailable("broken".into()))
        });
        assert!(set.running("a"));
        assert_eq!(set.data("a"), Some(7));
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(matches!(set.wait("a", soon).await, JobWait::Pending));
        go.send(()).unwrap();
        let later = Instant::now() + Duration::from_secs(5);
        match set.wait("a", later).await {
            JobWait::Done(Err(CsiError::Unavailable(m))) => assert_eq!(m, "broken"),
            _ => panic!("the failure is reported"),
        }
        assert!(!set.running("a"));
        assert!(matches!(set.wait("a", later).await, JobWait::NotRunning));
    }

    /// Whoever waits on a cancelled job (a CreateSnapshot waiting for its cut while
    /// DeleteSnapshot cancels the export) hears that what it made is gone, however the job
    /// itself ended once it noticed: not a retryable `Aborted`.
    #[tokio::test]
    async fn a_cancelled_job_stops_and_its_waiters_hear_it_is_gone() {
        let set: Arc<JobSet<()>> = Arc::default();
        let cancel = Cancel::default();
        let job_cancel = cancel.clone();
        set.start_cancellable("c", (), Some(cancel), async move {
            job_cancel.cancelled().await;
            Err(job_cancel.error())
        });
        assert!(!set.cancel("other"));
        assert!(set.cancel("c"));
        let later = Instant::now() + Duration::from_secs(5);
        match set.wait("c", later).await {
            JobWait::Done(Err(CsiError::NotFound(m))) => assert!(m.contains("c "), "{m}"),
            JobWait::Done(other) => panic!("a waiter heard {other:?}"),
            _ => panic!("the cancelled job did not end"),
        }
        assert!(!set.running("c"));
    }

    #[tokio::test]
    async fn a_panicking_job_ends_as_a_failure() {
        let set: Arc<JobSet<()>> = Arc::default();
        set.start("p", (), async { panic!("boom") });
        let later = Instant::now() + Duration::from_secs(5);
        assert!(matches!(
            set.wait("p", later).await,
            JobWait::Done(Err(CsiError::Internal(_)))
        ));
        assert!(!set.running("p"));
    }
}
