//! Waiting for an image to be cut or ready. This node's job, when it runs one, has the word on
//! failure; otherwise the state file is followed, whichever node prepares the image, so that a
//! call on any node sees the work of another.

use std::time::Duration;

use super::state::{ImageState, Progress};
use super::Images;
use crate::error::{CsiError, Result};
use crate::jobs::JobWait;

/// How waiting for an image ended.
pub enum Wait {
    Ready(Box<ImageState>),
    Pending(Progress),
}

impl Images {
    /// Waits up to `timeout` for the image `name` to be ready.
    pub async fn wait(&self, name: &str, timeout: Duration) -> Result<Wait> {
        self.wait_until(name, timeout, |s| s.ready).await
    }

    /// Waits up to `timeout` for the image `name` to be cut (an export) or ready.
    pub async fn wait_cut(&self, name: &str, timeout: Duration) -> Result<Wait> {
        self.wait_until(name, timeout, |s| s.ready || s.cut).await
    }

    async fn wait_until(
        &self,
        name: &str,
        timeout: Duration,
        done: impl Fn(&ImageState) -> bool,
    ) -> Result<Wait> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // This node's job: its failure is the answer.
            if let JobWait::Done(Err(e)) = self.jobs.wait(name, tokio::time::Instant::now()).await {
                return Err(e);
            }
            // Prepared by this node or another one: follow the state file.
            match self.store.get(name)? {
                Some(state) if state.quarantined.is_some() => {
                    return Err(CsiError::DataLoss(format!(
                        "backing image {name} no longer matches what was recorded when it was \
                         made: {}; it is quarantined: delete the snapshot and take it again",
                        state.quarantined.as_deref().unwrap_or_default()
                    )))
                }
                Some(state) if done(&state) => return Ok(Wait::Ready(Box::new(state))),
                Some(state) => {
                    if self.is_orphan(&state) {
                        if let Some(e) = self.take_failure(name) {
                            return Err(e);
                        }
                        return Err(CsiError::Aborted(format!(
                            "backing image {name} was left incomplete by an earlier run; retry"
                        )));
                    }
                    if tokio::time::Instant::now() >= deadline {
                        return Ok(Wait::Pending(state.progress));
                    }
                }
                None => {
                    if let Some(e) = self.take_failure(name) {
                        return Err(e);
                    }
                    // A failing job removes what it made before its failure is recorded:
                    // while it is still running, its word is still to come.
                    if !self.jobs.running(name) || tokio::time::Instant::now() >= deadline {
                        return Err(CsiError::NotFound(format!(
                            "backing image {name} does not exist"
                        )));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
