//! The images directory as one node sees it: where an image's state file and image file are,
//! claiming a name, saving, listing and removing. Claiming creates the state file exclusively,
//! so that two nodes sharing the directory never both prepare one image; temp names carry the
//! node, so that a node cleans up only its own work in a directory others write to as well.
//! Reading a ready image's state verifies it first (`integrity`): what is listed or waited for
//! is what was made.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use super::lock;
use super::state::ImageState;
use crate::error::{CsiError, Result};
use crate::files::{self, remove_if_there, write_json_via, TMP_PREFIX};
use crate::names::is_plain;

/// The images directory, as seen by one node.
pub struct ImageStore {
    pub(super) dir: PathBuf,
    node: String,
    /// Images verified since this process started: the file's identity then, and the checksum
    /// it matched. An image whose file still has that identity is not hashed again.
    pub(super) verified: Mutex<HashMap<String, (FileKey, String)>>,
    /// Held while an image is verified or quarantined, and while one is removed, so that a
    /// quarantine never writes back the state of an image deleted meanwhile.
    pub(super) checking: Mutex<()>,
    /// Images hashed for verification (not found unchanged in `verified`).
    pub(super) hashed: AtomicU64,
}

/// What identifies one version of a file: any write, truncation or replacement changes it
/// (ctime moves even when mtime is set back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FileKey {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileKey {
    pub(super) fn of(meta: &fs::Metadata) -> FileKey {
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

    pub(super) fn state_path(&self, name: &str) -> Option<PathBuf> {
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
