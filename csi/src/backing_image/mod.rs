//! BackingImages: image files in a directory that may be shared by every node, each with a
//! state file, and the jobs that prepare them (export from a volume, download from a URL).
//!
//! Layout of the images directory:
//! - `<name>.json`: the state file (source type and parameters, checksums, sizes, creation time,
//!   progress, ready). It is created exclusively, so two nodes never both prepare one image.
//! - `<name>.img`: the image file. It appears, by rename, only once complete and verified.
//! - `.tmp-<node>~<name>…`: work in progress of `<node>`; never read as an image. The node
//!   is in the name because the directory may be shared: at start-up a node removes its own
//!   temporaries, which no job of it can still be writing, and never another node's.
//! - `.quarantine/<when>~<name>.img` and `.json`: an image file that failed verification, or a
//!   state file that cannot be decoded, moved aside: kept for the operator to look at, never
//!   taken for an image (a dot name).
//!
//! The record a state file holds is `state`'s; `store` reads and writes the directory as one
//! node sees it, and `integrity` checks a ready image against its record and moves aside what
//! fails. The jobs are `prepare`'s (how one runs and ends; the download) and `exporting`'s
//! (from a volume's cut); `wait` follows one until its image is ready. This file holds
//! [`Images`], which ties the store, the cuts and this node's jobs together: a deletion stops
//! the job first, and start-up resumes the exports a stop interrupted.

mod exporting;
mod integrity;
mod prepare;
mod state;
mod store;
mod wait;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use exporting::ExportFrom;
pub use integrity::QUARANTINE_DIR;
pub use state::{ImageState, Progress};
pub use store::{ImageStore, NODE_END};
pub use wait::Wait;

use crate::cut::Cuts;
use crate::error::{CsiError, Result};
use crate::export;
use crate::files;
use crate::handle::{KEY_EXPORT_TYPE, SOURCE_EXPORT};
use crate::jobs::{JobSet, JobWait};

/// The images directory plus the jobs this node runs on it.
pub struct Images {
    pub store: ImageStore,
    /// This node's durable cuts, which its exports are made from.
    pub cuts: Cuts,
    node: String,
    /// The most bytes per second an export reads; `None`: no limit.
    export_rate: Option<NonZeroU64>,
    jobs: Arc<JobSet<()>>,
    users: Mutex<HashMap<String, usize>>,
}

/// Marks an image as in use while alive (a volume is being created from it).
pub struct UseGuard {
    images: Arc<Images>,
    name: String,
}

impl Drop for UseGuard {
    fn drop(&mut self) {
        let mut users = lock(&self.images.users);
        if let Some(n) = users.get_mut(&self.name) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                users.remove(&self.name);
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Images {
    pub fn new(
        store: ImageStore,
        cuts: Cuts,
        node: String,
        export_rate: Option<NonZeroU64>,
    ) -> Images {
        Images {
            store,
            cuts,
            node,
            export_rate,
            jobs: Arc::default(),
            users: Mutex::new(HashMap::new()),
        }
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// Whether this node runs a job for `name`.
    pub fn running(&self, name: &str) -> bool {
        self.jobs.running(name)
    }

    /// The error of the last failed job for `name`, once.
    pub fn take_failure(&self, name: &str) -> Option<CsiError> {
        self.jobs.take_failure(name)
    }

    /// Whether this node's job for `name` is still running (it may have removed its state
    /// already while it fails).
    pub fn job_running(&self, name: &str) -> bool {
        self.jobs.running(name)
    }

    pub fn in_use(&self, name: &str) -> bool {
        lock(&self.users).get(name).copied().unwrap_or(0) > 0
    }

    pub fn acquire(self: &Arc<Self>, name: &str) -> UseGuard {
        *lock(&self.users).entry(name.to_owned()).or_insert(0) += 1;
        UseGuard {
            images: Arc::clone(self),
            name: name.to_owned(),
        }
    }

    /// A state for a new image prepared by this node.
    pub fn new_state(
        &self,
        name: &str,
        source_type: &str,
        parameters: BTreeMap<String, String>,
    ) -> ImageState {
        ImageState {
            name: name.to_owned(),
            csi_name: None,
            source_type: source_type.to_owned(),
            parameters,
            expected_checksum: None,
            current_checksum: None,
            format: None,
            size: 0,
            virtual_size: 0,
            created: files::now_secs(),
            progress: Progress::default(),
            cut: false,
            ready: false,
            node: self.node.clone(),
            quarantined: None,
        }
    }

    /// Whether a not-ready state was left by an earlier run of this node (its job is gone).
    pub fn is_orphan(&self, state: &ImageState) -> bool {
        !state.ready && state.node == self.node && !self.running(&state.name)
    }

    /// Deletes the image `name`: stops this node's job preparing it first, if any, and waits
    /// until the job has removed what it made. Called under the controller lock, which keeps
    /// a new job for that name from starting meanwhile; a job stops within milliseconds of
    /// being told (it kills its child process), so the lock is not held long.
    pub async fn delete(&self, name: &str) -> Result<()> {
        let cancelled = self.jobs.cancel(name);
        // A download cannot be cancelled yet: removing its state under it could race its
        // final rename and bring the image back.
        if !cancelled && self.jobs.running(name) {
            return Err(CsiError::Aborted(format!(
                "backing image {name} is still being downloaded; retry later"
            )));
        }
        if cancelled {
            tracing::info!(image = %name, "cancelling the preparation of a deleted image");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            if let JobWait::Pending = self.jobs.wait(name, deadline).await {
                return Err(CsiError::Internal(format!(
                    "backing image {name} did not stop being prepared; retry"
                )));
            }
            // Its failure is the cancellation asked for: nothing to report to anyone.
            self.jobs.take_failure(name);
        }
        self.store.remove(name)?;
        self.cuts.remove(name);
        Ok(())
    }

    /// Start-up: picks up what an earlier run of this node left in the images directory and
    /// the cuts. An export whose cut is durable resumes from that cut (its snapshot was
    /// taken: CreateSnapshot may have returned it); one that was never cut is removed (no
    /// CreateSnapshot returned it; a retry cuts anew). Temporaries are removed, and so is
    /// every cut no export needs.
    pub fn recover(self: &Arc<Self>) -> Result<()> {
        self.store.clean_own_temps();
        let mut keep = HashSet::new();
        for state in self.store.list_recorded()? {
            if state.ready || state.node != self.node || state.source_type != SOURCE_EXPORT {
                continue;
            }
            let name = state.name.clone();
            if state.cut && self.cuts.exists(&name) {
                let export_type = state
                    .parameters
                    .get(KEY_EXPORT_TYPE)
                    .cloned()
                    .unwrap_or_else(|| export::RAW.to_owned());
                keep.insert(name.clone());
                self.start_export(state, ExportFrom::Cut, export_type);
                continue;
            }
            if state.cut {
                tracing::error!(image = %name, "the cut of this snapshot is missing; removing the snapshot");
            } else {
                tracing::info!(image = %name, "removing a snapshot that was never cut");
            }
            self.store.remove(&name)?;
        }
        self.cuts.clean(&keep);
        Ok(())
    }
}
