//! Where snapshots' directories are. A snapshot with a quota has its directory under the
//! snapshotter's root, inside the view when the root is, so the quota covers everything
//! the container writes and `df` in the container (statfs of the upper directory) shows
//! it. One without a quota has it on the local disk directly ([`Place::Disk`]): nothing it
//! writes passes through FUSE, and only its shared lowers come from the view.

use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use layerfs::control::{quota_backend, Client};
use layerfs::store::reserved::SNAPSHOTTER_NAME;

use crate::error::Error;
use crate::meta::{Backing, Place, Record};

/// Where the snapshotter keeps its snapshots and finds shared layers.
#[derive(Debug, Clone)]
pub struct Config {
    /// Snapshots' directories and the table: in a layerfs mount for quotas.
    pub root: PathBuf,
    /// The layerfs view holding shared layers; none disables adoption and dedupe.
    pub view: Option<PathBuf>,
    /// The storage driver's name in the view (`overlay` for `overlay/`, `overlay-layers/`).
    pub driver: String,
    /// Keep the directories of snapshots without a quota on the local disk directly, not
    /// in the view (DESIGN §12, fast path).
    pub fast_path: bool,
    /// Where those directories go; by default `.layerfs-snapshotter/` in the layerfs
    /// mount's local directory, which the view never shows.
    pub local_root: Option<PathBuf>,
}

impl Config {
    /// A snapshotter at `root`, with the defaults of every other setting.
    pub fn new(root: &Path) -> Config {
        Config {
            root: root.to_owned(),
            view: None,
            driver: "overlay".into(),
            fast_path: true,
            local_root: None,
        }
    }
}

/// Where snapshots' directories are.
#[derive(Debug, Clone)]
pub struct Dirs {
    root: PathBuf,
    disk: Option<PathBuf>,
    fast_path: bool,
}

impl Dirs {
    /// Directories under `root`, and under `disk` for [`Place::Disk`] when there is one;
    /// new snapshots without a quota go there when `fast_path` is on.
    pub fn new(root: &Path, disk: Option<&Path>, fast_path: bool) -> Dirs {
        Dirs {
            root: root.to_owned(),
            disk: disk.map(Path::to_owned),
            fast_path,
        }
    }

    /// Where a new snapshot without a quota goes.
    pub fn unlimited(&self) -> Place {
        match self.disk {
            Some(_) if self.fast_path => Place::Disk,
            _ => Place::Root,
        }
    }

    /// Whether snapshots in `place` can be found.
    pub fn has(&self, place: Place) -> bool {
        self.base(place).is_some()
    }

    /// Every place's `snapshots` directory, which holds one directory per local snapshot.
    pub fn all_snapshots(&self) -> impl Iterator<Item = (Place, PathBuf)> + '_ {
        [Place::Root, Place::Disk]
            .into_iter()
            .filter_map(|place| Some((place, self.base(place)?.join("snapshots"))))
    }

    fn base(&self, place: Place) -> Option<&Path> {
        match place {
            Place::Root => Some(&self.root),
            Place::Disk => self.disk.as_deref(),
        }
    }

    /// The directory of the snapshot `id` in `place`: the quota root when it has one. A
    /// table that names the disk where none is configured points at the root, where
    /// nothing is found, rather than anywhere else.
    pub fn dir_in(&self, place: Place, id: u64) -> PathBuf {
        self.base(place)
            .unwrap_or(&self.root)
            .join("snapshots")
            .join(id.to_string())
    }

    pub fn dir(&self, record: &Record) -> PathBuf {
        self.dir_in(record.place, record.id)
    }

    /// The files of a snapshot: its own `fs`, or the shared layer's `diff`.
    pub fn files(&self, record: &Record) -> PathBuf {
        match &record.backing {
            Backing::Local => self.dir(record).join("fs"),
            Backing::Shared { diff, .. } => diff.clone(),
        }
    }

    pub fn work(&self, record: &Record) -> PathBuf {
        self.dir(record).join("work")
    }
}

/// Where snapshots without a quota go, made if missing: `config.local_root`; else, for a
/// root inside a layerfs mount, `.layerfs-snapshotter/<the root's path in the mount>` in
/// that mount's local directory, on the local disk and never shown by the view. `None`
/// when the root is not in a layerfs mount (and so is on a disk already). Found also when
/// the fast path is off, for the snapshots made while it was on.
pub fn disk_root(config: &Config, root: &Path) -> Result<Option<PathBuf>, Error> {
    let dir = match &config.local_root {
        Some(dir) => dir.clone(),
        None => {
            let Some(mount) = quota_backend::layerfs_mount_of(root) else {
                return Ok(None);
            };
            let asked = format!(
                "asking the layerfs mount {} for its local directory",
                mount.display()
            );
            let status = Client::new(&mount)
                .status()
                .map_err(|e| Error::Unavailable(format!("{asked}: {e}")))?;
            let inside = root.strip_prefix(&mount).unwrap_or(Path::new(""));
            Path::new(&status.local)
                .join(std::ffi::OsStr::from_bytes(SNAPSHOTTER_NAME))
                .join(inside)
        }
    };
    let snapshots = dir.join("snapshots");
    fs::create_dir_all(&snapshots)
        .map_err(|e| Error::io(format!("creating {}", snapshots.display()), e))?;
    let dir =
        fs::canonicalize(&dir).map_err(|e| Error::io(format!("resolving {}", dir.display()), e))?;
    match config.fast_path {
        true => {
            tracing::info!(dir = %dir.display(), "snapshots without a quota are kept on the local disk")
        }
        false => {
            tracing::info!(dir = %dir.display(), "fast path off: new snapshots are kept in the view")
        }
    }
    Ok(Some(dir))
}
