//! Preparing an image: a job runs in the background. On success it renames the file into
//! place and marks the state ready; on failure it removes the state and its temp file, and
//! remembers the error so that the next call for that image reports it (nothing partial is
//! left behind). What every job shares is here (running it, recording its progress, the
//! final verify-and-rename), with the download, the job that needs nothing more; the export
//! has a cut to take and a conversion to stop, and is `exporting`'s.

use std::fs;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::state::{ImageState, Progress};
use super::Images;
use crate::download;
use crate::error::{CsiError, Result};
use crate::export::{self, ImageInfo};
use crate::files;
use crate::jobs::Cancel;

/// Removes a temp file when dropped, unless it was renamed into place.
pub(super) struct TempFile(pub(super) Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = fs::remove_file(path);
        }
    }
}

impl Images {
    /// Runs `job` for the image `name` in the background. A failed job removes the image's
    /// state and file (its temp files are removed by their guards), so nothing partial stays.
    fn spawn<F>(self: &Arc<Self>, name: &str, job: F)
    where
        F: std::future::Future<Output = Result<()>> + Send + 'static,
    {
        self.spawn_cancellable(name, None, job)
    }

    pub(super) fn spawn_cancellable<F>(self: &Arc<Self>, name: &str, cancel: Option<Cancel>, job: F)
    where
        F: std::future::Future<Output = Result<()>> + Send + 'static,
    {
        let images = Arc::clone(self);
        let owned = name.to_owned();
        let asked = cancel.clone();
        self.jobs.start_cancellable(name, (), cancel, async move {
            let result = job.await;
            match &result {
                Ok(()) => tracing::info!(image = %owned, "backing image ready"),
                Err(_) if asked.as_ref().is_some_and(Cancel::is_cancelled) => {
                    tracing::info!(image = %owned, "backing image preparation cancelled");
                    if let Err(e) = images.store.remove(&owned) {
                        tracing::warn!(image = %owned, error = %e, "cannot remove cancelled image");
                    }
                }
                Err(e) => {
                    tracing::warn!(image = %owned, error = %e, "backing image failed");
                    if let Err(e) = images.store.remove(&owned) {
                        tracing::warn!(image = %owned, error = %e, "cannot remove failed image");
                    }
                }
            }
            result
        });
    }

    /// Starts downloading `url` into the image `state.name`.
    pub fn start_download(
        self: &Arc<Self>,
        state: ImageState,
        url: url::Url,
        policy: download::Policy,
    ) {
        let images = Arc::clone(self);
        let name = state.name.clone();
        self.spawn(&name, async move {
            let tmp = TempFile(Some(images.store.temp(&images.node, &state.name)));
            let dest = tmp.0.clone().unwrap_or_default();
            tracing::info!(image = %state.name, url = %url, "downloading backing image");
            let worker = Arc::clone(&images);
            let name = state.name.clone();
            let got = tokio::task::spawn_blocking(move || {
                let mut last_log = Instant::now();
                let mut report = |done: u64, total: u64| {
                    if last_log.elapsed() >= Duration::from_secs(10) {
                        tracing::info!(image = %name, done, total, "downloading");
                        last_log = Instant::now();
                    }
                    worker.set_progress(&name, done, total);
                };
                download::fetch(&url, &dest, &policy, &mut report)
            })
            .await
            .map_err(|e| CsiError::Internal(format!("download task failed: {e}")))??;
            if let Some(expected) = &state.expected_checksum {
                if *expected != got.sha512 {
                    return Err(CsiError::InvalidArgument(format!(
                        "checksum mismatch for backing image {}: backingImageChecksum is {expected} \
                         but the downloaded file's SHA-512 is {}; nothing was kept",
                        state.name, got.sha512
                    )));
                }
            }
            images.finish(&state.name, tmp, Some(got.sha512)).await
        });
    }

    pub(super) fn set_progress(&self, name: &str, done: u64, total: u64) {
        if let Err(e) = self.update(name, |s| s.progress = Progress { done, total }) {
            tracing::debug!(image = %name, error = %e, "cannot record progress");
        }
    }

    /// Changes the state file of `name`; an image deleted meanwhile is `NOT_FOUND`.
    pub(super) fn update(&self, name: &str, change: impl FnOnce(&mut ImageState)) -> Result<()> {
        let Some(mut state) = self.store.get(name)? else {
            return Err(CsiError::NotFound(format!(
                "backing image {name} was deleted while being prepared"
            )));
        };
        change(&mut state);
        self.store.save(&state)
    }

    /// Verifies a prepared file and moves it into place as the image `name`. `sum` is its
    /// SHA-512 when computed while it was written; otherwise it is read again for it.
    pub(super) async fn finish(
        &self,
        name: &str,
        mut tmp: TempFile,
        sum: Option<String>,
    ) -> Result<()> {
        let path = tmp.0.clone().unwrap_or_default();
        let ImageInfo {
            format,
            virtual_size,
        } = export::probe(&path).await?;
        let size = fs::metadata(&path)
            .map_err(|e| CsiError::io(format!("image {name}"), e))?
            .len();
        let sum = match sum {
            Some(sum) => sum,
            None => export::sha512_file(&path).await?,
        };
        let Some(mut state) = self.store.get(name)? else {
            return Err(CsiError::NotFound(format!(
                "backing image {name} was deleted while being prepared"
            )));
        };
        if let Some(expected) = &state.expected_checksum {
            if *expected != sum {
                return Err(CsiError::InvalidArgument(format!(
                    "checksum mismatch for backing image {name}: backingImageChecksum is \
                     {expected} but the image's SHA-512 is {sum}; nothing was kept"
                )));
            }
        }
        let data = self
            .store
            .data_path(name)
            .ok_or_else(|| CsiError::InvalidArgument(format!("bad image name {name:?}")))?;
        // Durable before the state says ready, since the cut it was made from goes then:
        // `qemu-img convert` leaves its output unflushed (cache mode `unsafe`). Raw copies
        // and downloads were flushed as they were written; this finds nothing left of them.
        let synced = path.clone();
        tokio::task::spawn_blocking(move || fs::File::open(synced).and_then(|f| f.sync_all()))
            .await
            .map_err(|e| CsiError::Internal(format!("sync task failed: {e}")))?
            .map_err(|e| CsiError::io(format!("syncing image {name}"), e))?;
        fs::rename(&path, &data).map_err(|e| CsiError::io(format!("storing image {name}"), e))?;
        tmp.0 = None;
        if let Some(dir) = data.parent() {
            files::sync_dir(dir)?;
        }
        state.format = Some(format);
        state.size = size;
        state.virtual_size = virtual_size;
        self.store.verified_now(name, &sum);
        state.current_checksum = Some(sum);
        state.progress = Progress {
            done: size,
            total: size,
        };
        state.ready = true;
        self.store.save(&state)
    }
}
