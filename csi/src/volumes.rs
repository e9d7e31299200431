//! The local volume store: one directory per volume under `<store>/volumes/<id>/` holding
//! `disk.img` (a sparse raw image; its size is the capacity), `volume.json` (what CreateVolume
//! was asked, for idempotency) and, on the node side, `publish.json` (where it is published).
//!
//! A volume appears only complete: it is built in a temp directory and renamed into place.
//!
//! Disks are sparse, so the store tracks what it has promised ([`VolumeStore::space`]): the
//! capacities of its volumes and of those being built, against what the filesystem can give
//! them. Lock order: `pending` is a leaf, held only to read or change its map.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::error::{CsiError, Result};
use super::files::{self, read_json, write_json};
use super::names::is_plain;

pub const DISK: &str = "disk.img";
const META: &str = "volume.json";
const PUBLISH: &str = "publish.json";

/// What is persisted about a volume.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeMeta {
    /// The volume id (on-disk name).
    pub id: String,
    /// The CSI name it was created with.
    pub name: String,
    /// The capacity CreateVolume settled on (idempotency compares against this).
    pub requested: u64,
    pub parameters: BTreeMap<String, String>,
    /// The snapshot id it was restored from, if any.
    #[serde(default)]
    pub content_source: Option<String>,
    /// The BackingImage its content came from, if any.
    #[serde(default)]
    pub backing_image: Option<String>,
    pub created: i64,
}

/// One place a volume is published on this node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Publication {
    pub target: PathBuf,
    pub block: bool,
    pub readonly: bool,
    pub device: PathBuf,
}

pub struct VolumeStore {
    root: PathBuf,
    /// The capacity each volume being built ([`Staging`]) will have, by its temp directory.
    pending: Arc<Mutex<HashMap<PathBuf, u64>>>,
}

/// How the store's filesystem is shared out to volumes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Space {
    /// The filesystem's size.
    pub total: u64,
    /// What it has free (for the driver: `f_bavail`).
    pub free: u64,
    /// What volume disks, finished or being built, occupy.
    pub allocated: u64,
    /// The sum of their capacities: what they may grow to.
    pub provisioned: u64,
}

impl Space {
    /// What volumes may hold at most: what they hold now and what is free.
    pub fn usable(&self) -> u64 {
        self.free.saturating_add(self.allocated)
    }
}

/// A volume under construction; removed unless committed.
pub struct Staging {
    dir: PathBuf,
    committed: bool,
    pending: Arc<Mutex<HashMap<PathBuf, u64>>>,
}

impl Staging {
    pub fn disk(&self) -> PathBuf {
        self.dir.join(DISK)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        lock(&self.pending).remove(&self.dir);
        if !self.committed {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

impl VolumeStore {
    pub fn open(root: PathBuf) -> Result<VolumeStore> {
        fs::create_dir_all(&root)
            .map_err(|e| CsiError::io(format!("creating {}", root.display()), e))?;
        files::clean_temps(&root);
        Ok(VolumeStore {
            root,
            pending: Arc::default(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn dir(&self, id: &str) -> Option<PathBuf> {
        is_plain(id).then(|| self.root.join(id))
    }

    /// The disk image of volume `id` (which may not exist).
    pub fn disk(&self, id: &str) -> Option<PathBuf> {
        self.dir(id).map(|d| d.join(DISK))
    }

    /// The volume `id`, or `None` if there is none (ids that cannot be names are none).
    pub fn get(&self, id: &str) -> Result<Option<VolumeMeta>> {
        match self.dir(id) {
            Some(dir) => read_json(&dir.join(META)),
            None => Ok(None),
        }
    }

    /// The current size of the volume's disk image.
    pub fn capacity(&self, id: &str) -> Result<u64> {
        let disk = self
            .disk(id)
            .ok_or_else(|| CsiError::NotFound(format!("volume {id:?} does not exist")))?;
        fs::metadata(&disk)
            .map(|m| m.len())
            .map_err(|e| CsiError::io(format!("volume {id}"), e))
    }

    /// Bytes the disk image really occupies (holes are free).
    pub fn allocated(&self, id: &str) -> Result<u64> {
        let disk = self
            .disk(id)
            .ok_or_else(|| CsiError::NotFound(format!("volume {id:?} does not exist")))?;
        fs::metadata(&disk)
            .map(|m| m.blocks() * 512)
            .map_err(|e| CsiError::io(format!("volume {id}"), e))
    }

    /// Every volume, sorted by id.
    pub fn list(&self) -> Result<Vec<VolumeMeta>> {
        let entries = fs::read_dir(&self.root)
            .map_err(|e| CsiError::io(format!("listing {}", self.root.display()), e))?;
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !is_plain(&name) {
                continue;
            }
            match self.get(&name) {
                Ok(Some(meta)) => out.push(meta),
                Ok(None) => {}
                Err(e) => tracing::warn!(volume = %name, error = %e, "skipping volume"),
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// A temp directory in which a new volume's disk of `capacity` bytes is prepared; the
    /// capacity counts as provisioned from now on.
    pub fn stage(&self, id: &str, capacity: u64) -> Result<Staging> {
        let dir = files::temp_path(&self.root, id);
        fs::create_dir(&dir).map_err(|e| CsiError::io(format!("creating {}", dir.display()), e))?;
        lock(&self.pending).insert(dir.clone(), capacity);
        Ok(Staging {
            dir,
            committed: false,
            pending: Arc::clone(&self.pending),
        })
    }

    /// What the filesystem holding the store can give, and what volumes have of it. A
    /// volume being built counts with the capacity it will have, one being deleted with
    /// what it still occupies.
    pub fn space(&self) -> Result<Space> {
        let stat = nix::sys::statvfs::statvfs(&self.root)
            .map_err(|e| CsiError::io(format!("statvfs {}", self.root.display()), e.into()))?;
        let frsize = stat.fragment_size() as u64;
        let mut space = Space {
            total: (stat.blocks() as u64).saturating_mul(frsize),
            free: (stat.blocks_available() as u64).saturating_mul(frsize),
            ..Space::default()
        };
        let pending = lock(&self.pending).clone();
        let entries = fs::read_dir(&self.root)
            .map_err(|e| CsiError::io(format!("listing {}", self.root.display()), e))?;
        for entry in entries.flatten() {
            let dir = entry.path();
            let disk = fs::symlink_metadata(dir.join(DISK)).ok();
            space.allocated += disk.as_ref().map_or(0, |m| m.blocks() * 512);
            let name = entry.file_name();
            let provisioned = match pending.get(&dir) {
                Some(&capacity) => capacity,
                None if is_plain(&name.to_string_lossy()) => disk.map_or(0, |m| m.len()),
                None => 0,
            };
            space.provisioned = space.provisioned.saturating_add(provisioned);
        }
        Ok(space)
    }

    /// Sizes the staged disk to `capacity` (creating it sparse if missing), writes the metadata
    /// and moves the volume into place.
    pub fn commit(&self, mut staging: Staging, meta: &VolumeMeta, capacity: u64) -> Result<()> {
        let final_dir = self
            .dir(&meta.id)
            .ok_or_else(|| CsiError::InvalidArgument(format!("bad volume id {:?}", meta.id)))?;
        let disk = staging.disk();
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&disk)
            .map_err(|e| CsiError::io(format!("creating {}", disk.display()), e))?;
        let len = file
            .metadata()
            .map_err(|e| CsiError::io("volume disk", e))?
            .len();
        if len < capacity {
            file.set_len(capacity)
                .map_err(|e| CsiError::io(format!("sizing {}", disk.display()), e))?;
        }
        file.sync_all()
            .map_err(|e| CsiError::io(format!("syncing {}", disk.display()), e))?;
        write_json(&staging.dir.join(META), meta)?;
        fs::rename(&staging.dir, &final_dir)
            .map_err(|e| CsiError::io(format!("creating volume {}", meta.id), e))?;
        staging.committed = true;
        // The rename is only durable once the directory holding it is.
        if let Some(dir) = final_dir.parent() {
            files::sync_dir(dir)?;
        }
        Ok(())
    }

    /// Grows the disk image to `capacity` bytes; never shrinks it.
    pub fn grow(&self, id: &str, capacity: u64) -> Result<u64> {
        let disk = self
            .disk(id)
            .ok_or_else(|| CsiError::NotFound(format!("volume {id:?} does not exist")))?;
        let file = fs::OpenOptions::new()
            .write(true)
            .open(&disk)
            .map_err(|e| CsiError::io(format!("opening volume {id}"), e))?;
        let len = file
            .metadata()
            .map_err(|e| CsiError::io("volume", e))?
            .len();
        if len < capacity {
            file.set_len(capacity)
                .map_err(|e| CsiError::io(format!("growing volume {id}"), e))?;
            return Ok(capacity);
        }
        Ok(len)
    }

    /// Removes the volume; a missing one is fine.
    pub fn delete(&self, id: &str) -> Result<()> {
        let Some(dir) = self.dir(id) else {
            return Ok(());
        };
        let doomed = files::temp_path(&self.root, &format!("deleted-{id}"));
        match fs::rename(&dir, &doomed) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(CsiError::io(format!("deleting volume {id}"), e)),
        }
        fs::remove_dir_all(&doomed).map_err(|e| CsiError::io(format!("deleting volume {id}"), e))
    }

    /// Where the volume is published on this node.
    pub fn publications(&self, id: &str) -> Result<Vec<Publication>> {
        match self.dir(id) {
            Some(dir) => Ok(read_json(&dir.join(PUBLISH))?.unwrap_or_default()),
            None => Ok(Vec::new()),
        }
    }

    pub fn set_publications(&self, id: &str, list: &[Publication]) -> Result<()> {
        let dir = self
            .dir(id)
            .ok_or_else(|| CsiError::NotFound(format!("volume {id:?} does not exist")))?;
        write_json(&dir.join(PUBLISH), &list)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
