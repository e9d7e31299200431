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
//! Integrity at rest: a ready image is verified against the size and SHA-512 recorded when it
//! was made each time its state is read ([`ImageStore::get`]), hashing it again only when its
//! file's (size, mtime, inode, ctime) changed since the last verification. One that fails is
//! quarantined: its file moved aside and the state saying why ([`ImageState::quarantined`]);
//! waiting for it is `DATA_LOSS`. A state file that cannot be decoded is moved aside and its
//! image file removed: nothing recorded could vouch for that image, and a snapshot no state
//! names can be deleted (it is gone) instead of failing every call.
//!
//! A job runs in the background. On success it renames the file into place and marks the state
//! ready; on failure it removes the state and its temp file, and remembers the error so that
//! the next call for that image reports it (nothing partial is left behind). An export is made
//! from a durable cut ([`super::cut`]): after a restart, [`Images::recover`] resumes it from there.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::copy;
use super::cut::{Cuts, Quiesce};
use super::download;
use super::error::{CsiError, Result};
use super::export::{self, ImageInfo};
use super::files::{self, remove_if_there, write_json_via, TMP_PREFIX};
use super::handle::{BiHandle, KEY_EXPORT_TYPE, KEY_VOLUME_NAME, SOURCE_EXPORT};
use super::jobs::{Cancel, JobSet, JobWait};
use super::names::is_plain;

/// How often an export's progress is logged and written to its state file.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Bytes done out of a total (0 when unknown).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
}

/// The state file of one BackingImage.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ImageState {
    pub name: String,
    /// The CSI snapshot name it was created for (CreateSnapshot), if any.
    #[serde(default)]
    pub csi_name: Option<String>,
    /// `export-from-volume` or `download`.
    pub source_type: String,
    /// The data-source parameters (`export-type` + `volume-name`, or `url`).
    pub parameters: BTreeMap<String, String>,
    #[serde(default)]
    pub expected_checksum: Option<String>,
    #[serde(default)]
    pub current_checksum: Option<String>,
    /// `raw` or `qcow2`, once known.
    #[serde(default)]
    pub format: Option<String>,
    /// Size of the image file in bytes, once ready.
    pub size: u64,
    /// Size of the disk the image holds; for an export, known from the start.
    pub virtual_size: u64,
    /// Seconds since the epoch; set once, returned on every call.
    pub created: i64,
    pub progress: Progress,
    /// For an export: the point-in-time copy of the volume is taken (the snapshot is cut).
    #[serde(default)]
    pub cut: bool,
    /// The preparation finished (the image was complete and verified then). Whether it still
    /// checks out is [`ImageState::quarantined`].
    pub ready: bool,
    /// The node preparing (or that prepared) the image.
    pub node: String,
    /// Why the image failed verification after it was made, and where its file went. Such an
    /// image is never restored from nor reported ready; deleting its snapshot frees it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantined: Option<String>,
}

impl ImageState {
    /// The snapshot handle that names this image.
    pub fn handle(&self) -> String {
        let mut params = self.parameters.clone();
        if self.source_type == SOURCE_EXPORT {
            params.retain(|k, _| k == KEY_EXPORT_TYPE || k == KEY_VOLUME_NAME);
        }
        BiHandle {
            image: self.name.clone(),
            source_type: self.source_type.clone(),
            checksum: self.expected_checksum.clone(),
            params,
        }
        .encode()
    }

    /// The volume an exported image came from.
    pub fn source_volume(&self) -> Option<&str> {
        (self.source_type == SOURCE_EXPORT)
            .then(|| self.parameters.get(KEY_VOLUME_NAME).map(String::as_str))
            .flatten()
    }
}

/// The images directory, as seen by one node.
pub struct ImageStore {
    dir: PathBuf,
    node: String,
    /// Images verified since this process started: the file's identity then, and the checksum
    /// it matched. An image whose file still has that identity is not hashed again.
    verified: Mutex<HashMap<String, (FileKey, String)>>,
    /// Held while an image is verified or quarantined, and while one is removed, so that a
    /// quarantine never writes back the state of an image deleted meanwhile.
    checking: Mutex<()>,
    /// Images hashed for verification (not found unchanged in `verified`).
    hashed: AtomicU64,
}

/// Where files that failed verification are moved, inside the images directory.
pub const QUARANTINE_DIR: &str = ".quarantine";

/// What identifies one version of a file: any write, truncation or replacement changes it
/// (ctime moves even when mtime is set back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileKey {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileKey {
    fn of(meta: &fs::Metadata) -> FileKey {
        use std::os::unix::fs::MetadataExt;
        FileKey {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// Separates the node from the rest of a temp name. Node ids never contain it (checked at
/// start-up), so the temporaries of node `a` are never taken for those of node `a~b`... nor
/// those of `a-b` for `a`'s.
pub const NODE_END: char = '~';

impl ImageStore {
    pub fn open(dir: PathBuf, node: &str) -> Result<ImageStore> {
        fs::create_dir_all(&dir)
            .map_err(|e| CsiError::io(format!("creating {}", dir.display()), e))?;
        Ok(ImageStore {
            dir,
            node: node.to_owned(),
            verified: Mutex::new(HashMap::new()),
            checking: Mutex::new(()),
            hashed: AtomicU64::new(0),
        })
    }

    /// Start-up: removes this node's temporaries, left by a run that was stopped or killed.
    pub fn clean_own_temps(&self) {
        let prefix = format!("{TMP_PREFIX}{}{NODE_END}", self.node);
        files::clean_temps_with_prefix(&self.dir, &prefix);
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn state_path(&self, name: &str) -> Option<PathBuf> {
        is_plain(name).then(|| self.dir.join(format!("{name}.json")))
    }

    /// The image file of `name` (present only once ready).
    pub fn data_path(&self, name: &str) -> Option<PathBuf> {
        is_plain(name).then(|| self.dir.join(format!("{name}.img")))
    }

    /// The state of `name`; a ready image is verified first ([`ImageStore::verify`]).
    pub fn get(&self, name: &str) -> Result<Option<ImageState>> {
        let Some(mut state) = self.recorded(name)? else {
            return Ok(None);
        };
        if state.ready && state.quarantined.is_none() {
            self.verify(&mut state)?;
        }
        Ok(Some(state))
    }

    /// The state of `name` as recorded, not verified (deleting an image need not hash it). One
    /// that cannot be decoded is quarantined, and is then no image.
    pub fn recorded(&self, name: &str) -> Result<Option<ImageState>> {
        let Some(path) = self.state_path(name) else {
            return Ok(None);
        };
        match files::read_json_lenient::<ImageState>(&path)? {
            None => Ok(None),
            Some(Ok(state)) => Ok(Some(state)),
            Some(Err(why)) => self.quarantine_state(name, &path, &why),
        }
    }

    /// Moves a state file that cannot be decoded aside, and removes its image file. Read
    /// again first, under the lock: a writer may have replaced it by a good one meanwhile.
    fn quarantine_state(&self, name: &str, path: &Path, why: &str) -> Result<Option<ImageState>> {
        let _checking = lock(&self.checking);
        match files::read_json_lenient::<ImageState>(path)? {
            None => return Ok(None),
            Some(Ok(state)) => return Ok(Some(state)),
            Some(Err(_)) => {}
        }
        let moved = self.move_aside(path, &format!("{name}.json"))?;
        if let Some(data) = self.data_path(name) {
            remove_if_there(&data)?;
        }
        lock(&self.verified).remove(name);
        files::sync_dir(&self.dir)?;
        tracing::error!(image = %name, error = %why, moved_to = ?moved,
            "backing image state file is corrupt: quarantined it and removed its image file; \
             its snapshot no longer exists");
        Ok(None)
    }

    /// Checks a ready image's file against the size and SHA-512 recorded when it was made;
    /// a file unchanged since it last checked out is not hashed again. One that fails is
    /// moved aside and `state` (also on disk) says why in [`ImageState::quarantined`]. A
    /// missing file is said so in `state` only: there is nothing to move, and its state may
    /// be being removed.
    pub fn verify(&self, state: &mut ImageState) -> Result<()> {
        let name = state.name.clone();
        let Some(data) = self.data_path(&name) else {
            return Ok(());
        };
        let _checking = lock(&self.checking);
        let meta = match fs::metadata(&data) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                state.quarantined = Some(format!("its file {} is missing", data.display()));
                return Ok(());
            }
            Err(e) => return Err(CsiError::io(format!("checking image {name}"), e)),
        };
        let key = FileKey::of(&meta);
        let recorded = state.current_checksum.clone();
        if let Some(sum) = &recorded {
            if lock(&self.verified)
                .get(&name)
                .is_some_and(|(k, s)| *k == key && s == sum)
            {
                return Ok(());
            }
        }
        let problem = if !meta.is_file() {
            Some("it is not a regular file".to_owned())
        } else if meta.len() != state.size {
            Some(format!(
                "its size is {} bytes, but {} bytes were recorded when it was made",
                meta.len(),
                state.size
            ))
        } else if let Some(sum) = &recorded {
            self.hashed.fetch_add(1, Ordering::Relaxed);
            let got = copy::sha512_file(&data)?;
            if got == *sum {
                lock(&self.verified).insert(name.clone(), (key, got));
                None
            } else {
                Some(format!(
                    "its SHA-512 is {got}, but {sum} was recorded when it was made"
                ))
            }
        } else {
            Some("no checksum was recorded when it was made".to_owned())
        };
        let Some(problem) = problem else {
            return Ok(());
        };
        lock(&self.verified).remove(&name);
        let moved = self.move_aside(&data, &format!("{name}.img"))?;
        let reason = match moved {
            Some(to) => format!("{problem}; the file was moved to {}", to.display()),
            None => problem,
        };
        tracing::error!(image = %name, reason = %reason,
            "backing image failed verification: quarantined");
        state.quarantined = Some(reason);
        if self.state_path(&name).is_some_and(|p| p.exists()) {
            self.save(state)?;
        }
        Ok(())
    }

    /// Records that the image `name`, just stored with checksum `sum`, checks out as it is.
    fn verified_now(&self, name: &str, sum: &str) {
        if let Some(meta) = self.data_path(name).and_then(|p| fs::metadata(p).ok()) {
            lock(&self.verified).insert(name.to_owned(), (FileKey::of(&meta), sum.to_owned()));
        }
    }

    /// How many times an image was hashed for verification.
    pub fn hashed(&self) -> u64 {
        self.hashed.load(Ordering::Relaxed)
    }

    /// Moves `path` into the quarantine directory as `<when>~<label>`; `None` when it is gone.
    fn move_aside(&self, path: &Path, label: &str) -> Result<Option<PathBuf>> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let dir = self.dir.join(QUARANTINE_DIR);
        fs::create_dir_all(&dir)
            .map_err(|e| CsiError::io(format!("creating {}", dir.display()), e))?;
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let to = dir.join(format!(
            "{}-{}-{n}{NODE_END}{label}",
            files::now_secs(),
            std::process::id()
        ));
        match fs::rename(path, &to) {
            Ok(()) => {
                files::sync_dir(&dir)?;
                Ok(Some(to))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(CsiError::io(format!("quarantining {}", path.display()), e)),
        }
    }

    /// The quarantined files of the image `name`.
    pub fn quarantined_files(&self, name: &str) -> Vec<PathBuf> {
        let dir = self.dir.join(QUARANTINE_DIR);
        let Ok(entries) = fs::read_dir(&dir) else {
            return Vec::new();
        };
        let (img, json) = (format!("{name}.img"), format!("{name}.json"));
        entries
            .flatten()
            .filter(|e| {
                let file = e.file_name().to_string_lossy().into_owned();
                file.split_once(NODE_END)
                    .is_some_and(|(_, label)| label == img || label == json)
            })
            .map(|e| e.path())
            .collect()
    }

    /// Creates the state file unless one exists; `false` if it did.
    pub fn claim(&self, state: &ImageState) -> Result<bool> {
        let path = self
            .state_path(&state.name)
            .ok_or_else(|| CsiError::InvalidArgument(format!("bad image name {:?}", state.name)))?;
        let tmp = self.temp(&self.node, &format!("{}.json", state.name));
        write_json_via(&tmp, &self.temp(&self.node, &state.name), state)?;
        let result = fs::hard_link(&tmp, &path);
        let _ = fs::remove_file(&tmp);
        match result {
            Ok(()) => files::sync_dir(&self.dir).map(|()| true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(CsiError::io(format!("creating {}", path.display()), e)),
        }
    }

    pub fn save(&self, state: &ImageState) -> Result<()> {
        let path = self
            .state_path(&state.name)
            .ok_or_else(|| CsiError::InvalidArgument(format!("bad image name {:?}", state.name)))?;
        let tmp = self.temp(&self.node, &format!("{}.json", state.name));
        write_json_via(&path, &tmp, state)
    }

    /// Removes the image file, what of it was quarantined, then its state; missing parts are
    /// fine.
    pub fn remove(&self, name: &str) -> Result<()> {
        let _checking = lock(&self.checking);
        lock(&self.verified).remove(name);
        self.remove_quarantined_locked(name)?;
        for path in [self.data_path(name), self.state_path(name)]
            .into_iter()
            .flatten()
        {
            remove_if_there(&path)?;
        }
        files::sync_dir(&self.dir)
    }

    /// Removes what was quarantined of the image `name` and nothing else: for a snapshot whose
    /// state file was corrupt, once it is deleted. Returns how many files went.
    pub fn remove_quarantined(&self, name: &str) -> Result<usize> {
        let _checking = lock(&self.checking);
        self.remove_quarantined_locked(name)
    }

    fn remove_quarantined_locked(&self, name: &str) -> Result<usize> {
        let quarantined = self.quarantined_files(name);
        for path in &quarantined {
            remove_if_there(path)?;
        }
        if !quarantined.is_empty() {
            // Only once empty: other images' files may still be there.
            let _ = fs::remove_dir(self.dir.join(QUARANTINE_DIR));
            files::sync_dir(&self.dir)?;
        }
        Ok(quarantined.len())
    }

    /// Every image with a readable state file, sorted by name; ready ones verified.
    pub fn list(&self) -> Result<Vec<ImageState>> {
        self.list_with(|store, name| store.get(name))
    }

    /// [`ImageStore::list`] as recorded, not verified (at start-up: hashing every image then
    /// would hold up the driver); undecodable state files are quarantined still.
    pub fn list_recorded(&self) -> Result<Vec<ImageState>> {
        self.list_with(ImageStore::recorded)
    }

    fn list_with(
        &self,
        read: impl Fn(&ImageStore, &str) -> Result<Option<ImageState>>,
    ) -> Result<Vec<ImageState>> {
        let entries = fs::read_dir(&self.dir)
            .map_err(|e| CsiError::io(format!("listing {}", self.dir.display()), e))?;
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let file = entry.file_name().to_string_lossy().into_owned();
            let Some(name) = file.strip_suffix(".json") else {
                continue;
            };
            if !is_plain(name) {
                continue;
            }
            match read(self, name) {
                Ok(Some(state)) => out.push(state),
                Ok(None) => {}
                Err(e) => tracing::warn!(image = %name, error = %e, "skipping backing image"),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// A temp file name for work on `name` by `node`.
    pub fn temp(&self, node: &str, name: &str) -> PathBuf {
        files::temp_path(&self.dir, &format!("{node}{NODE_END}{name}"))
    }
}

/// How waiting for an image ended.
pub enum Wait {
    Ready(Box<ImageState>),
    Pending(Progress),
}

/// The images directory plus the jobs this node runs on it.
pub struct Images {
    pub store: ImageStore,
    /// This node's durable cuts, which its exports are made from.
    pub cuts: Cuts,
    node: String,
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

/// Where an export starts.
pub enum ExportFrom {
    /// A volume that is still to be cut.
    Volume { disk: PathBuf, quiesce: Quiesce },
    /// The image's durable cut, taken by an earlier run.
    Cut,
}

/// Removes a temp file when dropped, unless it was renamed into place.
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = fs::remove_file(path);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Images {
    pub fn new(store: ImageStore, cuts: Cuts, node: String) -> Images {
        Images {
            store,
            cuts,
            node,
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

    /// Runs `job` for the image `name` in the background. A failed job removes the image's
    /// state and file (its temp files are removed by their guards), so nothing partial stays.
    fn spawn<F>(self: &Arc<Self>, name: &str, job: F)
    where
        F: std::future::Future<Output = Result<()>> + Send + 'static,
    {
        self.spawn_cancellable(name, None, job)
    }

    fn spawn_cancellable<F>(self: &Arc<Self>, name: &str, cancel: Option<Cancel>, job: F)
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
        if export_type == export::RAW {
            let (src, dest) = (src.to_owned(), dest.to_owned());
            let stop = copy::StopOnDrop(Arc::default());
            let stopped = Arc::clone(&stop.0);
            let copying = tokio::task::spawn_blocking(move || {
                copy::copy_file(&src, &dest, &stopped, &mut |done, total| {
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
            export::convert_with_progress(src, export::RAW, dest, export_type, move |pct| {
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

    fn set_progress(&self, name: &str, done: u64, total: u64) {
        if let Err(e) = self.update(name, |s| s.progress = Progress { done, total }) {
            tracing::debug!(image = %name, error = %e, "cannot record progress");
        }
    }

    /// Changes the state file of `name`; an image deleted meanwhile is `NOT_FOUND`.
    fn update(&self, name: &str, change: impl FnOnce(&mut ImageState)) -> Result<()> {
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
    async fn finish(&self, name: &str, mut tmp: TempFile, sum: Option<String>) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    fn ready_image(store: &ImageStore, name: &str, data: &[u8]) -> ImageState {
        let path = store.data_path(name).unwrap();
        fs::write(&path, data).unwrap();
        let sum = copy::sha512_file(&path).unwrap();
        let state = ImageState {
            name: name.to_owned(),
            csi_name: None,
            source_type: "download".into(),
            parameters: BTreeMap::new(),
            expected_checksum: None,
            current_checksum: Some(sum),
            format: Some("raw".into()),
            size: data.len() as u64,
            virtual_size: data.len() as u64,
            created: 1,
            progress: Progress::default(),
            cut: false,
            ready: true,
            node: "n1".into(),
            quarantined: None,
        };
        store.save(&state).unwrap();
        state
    }

    /// An unchanged image is hashed once; any change to its file makes it hashed again.
    #[test]
    fn verification_is_cached_by_file_identity() {
        let dir = tempfile::tempdir().unwrap();
        let store = ImageStore::open(dir.path().join("images"), "n1").unwrap();
        ready_image(&store, "a", &[7u8; 100_000]);
        for _ in 0..3 {
            let state = store.get("a").unwrap().unwrap();
            assert_eq!(state.quarantined, None);
        }
        assert_eq!(store.list().unwrap().len(), 1);
        assert_eq!(store.hashed(), 1, "hashed once while unchanged");
        // The same bytes written again: the file changed (mtime, ctime), so it is read again,
        // and checks out.
        let path = store.data_path("a").unwrap();
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&[7u8], 10)
            .unwrap();
        assert_eq!(store.get("a").unwrap().unwrap().quarantined, None);
        assert_eq!(store.hashed(), 2);
    }

    #[test]
    fn a_changed_image_is_quarantined_and_removed_with_its_state() {
        let dir = tempfile::tempdir().unwrap();
        let store = ImageStore::open(dir.path().join("images"), "n1").unwrap();
        ready_image(&store, "b", &[1u8; 4096]);
        let path = store.data_path("b").unwrap();
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&[2u8], 0)
            .unwrap();
        let state = store.get("b").unwrap().unwrap();
        let why = state.quarantined.expect("quarantined");
        assert!(why.contains("SHA-512"), "{why}");
        assert!(!path.exists());
        assert_eq!(store.quarantined_files("b").len(), 1);
        assert_eq!(store.quarantined_files("a").len(), 0);
        // Said on disk too, and not verified again.
        let again = store.get("b").unwrap().unwrap();
        assert_eq!(again.quarantined.as_deref(), Some(why.as_str()));
        store.remove("b").unwrap();
        assert!(store.get("b").unwrap().is_none());
        assert!(!dir.path().join("images").join(QUARANTINE_DIR).exists());
    }

    #[test]
    fn an_undecodable_state_is_quarantined_with_its_image_removed() {
        let dir = tempfile::tempdir().unwrap();
        let store = ImageStore::open(dir.path().join("images"), "n1").unwrap();
        ready_image(&store, "c", &[3u8; 4096]);
        ready_image(&store, "d", &[4u8; 4096]);
        let state = dir.path().join("images/c.json");
        let text = fs::read(&state).unwrap();
        fs::write(&state, &text[..text.len() / 3]).unwrap();
        let listed: Vec<String> = store
            .list_recorded()
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(listed, ["d"]);
        assert!(!state.exists());
        assert!(!store.data_path("c").unwrap().exists());
        assert_eq!(store.quarantined_files("c").len(), 1);
        assert!(store.get("c").unwrap().is_none());
        assert_eq!(store.get("d").unwrap().unwrap().quarantined, None);
    }
}
