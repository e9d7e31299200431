//! The export of a volume into an image: the volume is cut first, then the cut is converted
//! (a sparse copy for raw, `qemu-img` for qcow2). It is made from a durable cut
//! ([`crate::cut`]) so that after a restart [`Images::recover`] resumes it from there; and
//! it stops at any point when cancelled (DeleteSnapshot) with nothing of it still running,
//! which is why the copy and the conversion are watched here and not left to the job runner.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::prepare::TempFile;
use super::state::ImageState;
use super::Images;
use crate::copy;
use crate::cut::Quiesce;
use crate::error::{CsiError, Result};
use crate::export;
use crate::jobs::Cancel;

/// How often an export's progress is logged and written to its state file.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Where an export starts.
pub enum ExportFrom {
    /// A volume that is still to be cut.
    Volume { disk: PathBuf, quiesce: Quiesce },
    /// The image's durable cut, taken by an earlier run.
    Cut,
}

/// A temp directory, removed with what it holds when dropped. A child process killed on
/// cancellation may still create its output file for a moment after the kill: in a directory
/// that is gone that fails, so nothing it writes outlives the job.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        for _ in 0..50 {
            match fs::remove_dir_all(&self.0) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                // A file appeared between listing and removing the directory: again.
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
        tracing::warn!(path = %self.0.display(), "cannot remove temp directory");
    }
}

impl Images {
    /// Starts the export of the image `state.name` in `export_type`: from a volume, which is
    /// cut first ([`ImageState::cut`] records when the cut is durable), or from the cut an
    /// earlier run took. The state file also records the export's progress. The job stops,
    /// leaving nothing, when cancelled ([`Images::delete`]).
    pub fn start_export(
        self: &Arc<Self>,
        state: ImageState,
        from: ExportFrom,
        export_type: String,
    ) {
        let images = Arc::clone(self);
        let name = state.name.clone();
        let cancel = Cancel::default();
        let job_cancel = cancel.clone();
        self.spawn_cancellable(&name, Some(cancel), async move {
            let result = images.export(&state, from, &export_type, &job_cancel).await;
            // The cut goes once the image is made from it, and with an export that failed or
            // was cancelled (its state goes too: nothing would use it). Not when the job is
            // dropped by a shutdown: the next start-up resumes from it.
            images.cuts.remove(&state.name);
            result
        });
    }

    async fn export(
        self: &Arc<Self>,
        state: &ImageState,
        from: ExportFrom,
        export_type: &str,
        cancel: &Cancel,
    ) -> Result<()> {
        let name = &state.name;
        if let ExportFrom::Volume { disk, quiesce } = from {
            tracing::info!(image = %name, volume = %disk.display(), "cutting volume");
            // The freeze, copy and thaw run on a thread of their own, to completion (or to
            // a cancellation it notices) even if this task is dropped, so that a frozen
            // filesystem is always thawed.
            let cuts = self.cuts.clone();
            let (owned, blocking_cancel) = (name.clone(), cancel.clone());
            tokio::task::spawn_blocking(move || {
                cuts.take(&owned, &disk, &quiesce, &blocking_cancel)
            })
            .await
            .map_err(|e| CsiError::Internal(format!("cut task failed: {e}")))??;
            if cancel.is_cancelled() {
                return Err(cancel.error());
            }
            self.update(name, |s| s.cut = true)?;
        } else {
            tracing::info!(image = %name, "resuming the export from its cut");
        }
        let src = self
            .cuts
            .path(name)
            .ok_or_else(|| CsiError::InvalidArgument(format!("bad image name {name:?}")))?;
        let work = TempDir(self.store.temp(&self.node, name));
        fs::create_dir(&work.0)
            .map_err(|e| CsiError::io(format!("creating {}", work.0.display()), e))?;
        let tmp = TempFile(Some(work.0.join(name)));
        let dest = tmp.0.clone().unwrap_or_default();
        tracing::info!(image = %name, export_type = %export_type, "exporting volume");
        // The conversion stops itself when cancelled, and returns only once nothing it
        // started still runs: a copy thread left behind would write the state file after
        // DeleteSnapshot removed it. `work` then removes what it wrote.
        let sum = self
            .convert(state, &src, &dest, export_type, cancel)
            .await?;
        if cancel.is_cancelled() {
            return Err(cancel.error());
        }
        self.finish(name, tmp, sum).await
    }

    /// Converts the cut `src` into `dest` as `export_type`: a raw export is a sparse copy,
    /// checksummed on the way (its SHA-512 is returned); qcow2 is converted by `qemu-img`.
    /// Cancelled, it stops the copy and waits for its thread, or kills qemu-img. (Dropped,
    /// as at shutdown, the copy sees its stop flag too.)
    async fn convert(
        self: &Arc<Self>,
        state: &ImageState,
        src: &Path,
        dest: &Path,
        export_type: &str,
        cancel: &Cancel,
    ) -> Result<Option<String>> {
        let worker = Arc::clone(self);
        let name = state.name.clone();
        let rate = self.export_rate;
        if export_type == export::RAW {
            let (src, dest) = (src.to_owned(), dest.to_owned());
            let stop = copy::StopOnDrop(Arc::default());
            let stopped = Arc::clone(&stop.0);
            let copying = tokio::task::spawn_blocking(move || {
                copy::copy_file(&src, &dest, &stopped, rate, &mut |done, total| {
                    tracing::info!(image = %name, done, total, "exporting");
                    worker.set_progress(&name, done, total);
                })
            });
            tokio::pin!(copying);
            let joined = tokio::select! {
                joined = &mut copying => joined,
                _ = cancel.cancelled() => {
                    stop.0.store(true, std::sync::atomic::Ordering::Relaxed);
                    copying.await
                }
            };
            if cancel.is_cancelled() {
                return Err(cancel.error());
            }
            let copied =
                joined.map_err(|e| CsiError::Internal(format!("export task failed: {e}")))??;
            return Ok(Some(copied.sha512));
        }
        let total = state.virtual_size;
        let mut last = Instant::now();
        let converting =
            export::convert_with_progress(src, export::RAW, dest, export_type, rate, move |pct| {
                if last.elapsed() >= PROGRESS_EVERY || pct >= 100.0 {
                    let done = (total as f64 * pct / 100.0) as u64;
                    tracing::info!(image = %name, done, total, "exporting");
                    worker.set_progress(&name, done, total);
                    last = Instant::now();
                }
            });
        // Dropping the conversion kills qemu-img; its progress runs in this task.
        tokio::select! {
            converted = converting => converted?,
            _ = cancel.cancelled() => return Err(cancel.error()),
        }
        Ok(None)
    }
}
