//! The snapshotter: containerd's ten snapshot operations over the records of [`crate::meta`],
//! local directories under `<root>/snapshots/`, and the shared layers of the view.
//!
//! **Locks.** `writer` serialises every change (like the single write transaction of
//! containerd's own snapshotters): it is held while a change's directories are made and
//! the table is written, and no reader ever waits for it. The long filesystem work runs
//! outside it: a commit measures its snapshot before taking it, and a removal removes the
//! directory after the table no longer names it. `state` holds the
//! current table behind an `Arc`; it is taken only to clone that `Arc` or to swap in a new
//! one, never across a filesystem call. Order: `writer`, then `state`. The shared tree is
//! looked at before `writer` is taken, so a stalled remote holds up only the request that
//! asked for it.
//!
//! **Where snapshots live.** A snapshot with a quota has its directory under the root, in
//! the view, where the quota is enforced. One without a quota has it on the local disk
//! directly ([`Place::Disk`]: `.layerfs-snapshotter/` in the layerfs mount's local
//! directory, which the view never shows), so a container writes at the local disk's
//! speed; only shared layers are read through the view.
//!
//! **Crash safety.** A change makes its directories first and records them second; a
//! removal forgets the record first and removes the directory second. A crash in between
//! leaves a directory no record names, which [`Snapshots::cleanup`] (and start-up) remove.
//!
//! **Files.** The operations are split by what they do to the table: `create` makes new
//! snapshots (Prepare, View); `share` is where the shared tree comes in (a labelled Prepare
//! adopts a shared layer, a Commit keeps the shared files of a layer unpacked anyway);
//! `info` answers what containerd asks of a snapshot that exists; `remove` removes snapshots
//! and the directories no record owns. This file holds the table and the locks every one of
//! them goes through.

mod create;
mod info;
mod remove;
mod share;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

pub use crate::dirs::Config;
pub use info::Info;
pub use share::{SharingCounters, REF_LABEL, REMOTE_LABEL, REMOTE_LABEL_VALUE};

use crate::dirs::{self, Dirs};
use crate::error::Error;
use crate::meta::{Backing, Kind, Meta, MetaFile, Place, Usage};
use crate::mounts;
use crate::quota;
use crate::shared::SharedLayers;

pub struct Snapshots {
    root: PathBuf,
    dirs: Dirs,
    file: MetaFile,
    shared: Option<SharedLayers>,
    writer: Mutex<()>,
    state: RwLock<Arc<Meta>>,
    counters: SharingCounters,
    /// What each shared layer's files take, by layer id: measured once, through the view.
    shared_usage: Mutex<HashMap<String, Usage>>,
}

impl Snapshots {
    /// Opens (or starts) the snapshotter at `config.root`, and removes what a crash left.
    pub fn open(config: &Config) -> Result<Snapshots, Error> {
        let made = config.root.join("snapshots");
        fs::create_dir_all(&made)
            .map_err(|e| Error::io(format!("creating {}", made.display()), e))?;
        let root = fs::canonicalize(&config.root)
            .map_err(|e| Error::io(format!("resolving {}", config.root.display()), e))?;
        let view = config
            .view
            .as_ref()
            .map(|v| fs::canonicalize(v).unwrap_or(v.clone()));
        let disk = dirs::disk_root(config, &root)?;
        for path in std::iter::once(&root)
            .chain(view.as_ref())
            .chain(disk.as_ref())
        {
            if !mounts::fits_overlay_options(path) {
                return Err(Error::InvalidArgument(format!(
                    "{}: overlay mount options cannot carry a path with `,`, `:` or `=`",
                    path.display()
                )));
            }
        }
        let dirs = Dirs::new(&root, disk.as_deref(), config.fast_path);
        let file = MetaFile::new(&root);
        let meta = file.load()?;
        if let Some((name, _)) = meta
            .snapshots
            .iter()
            .find(|(_, r)| r.backing == Backing::Local && !dirs.has(r.place))
        {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {name} is on the local disk, but {} is not in a layerfs mount and \
                 no local_root is set: start with the settings it was made with",
                root.display()
            )));
        }
        let snapshots = Snapshots {
            shared: view.map(|v| SharedLayers::new(&v, &config.driver)),
            root,
            dirs,
            file,
            writer: Mutex::new(()),
            state: RwLock::new(Arc::new(meta)),
            counters: SharingCounters::default(),
            shared_usage: Mutex::default(),
        };
        // A leftover that cannot be removed (a mount left in it, a fault of the filesystem)
        // costs only its space: every recorded snapshot works without it, and a new one
        // passes over its id. So it must not keep the snapshotter down, which would stop
        // every container on the node; it is logged, and containerd's next Cleanup tries
        // it again. Not being able to read the snapshots' directory at all stays fatal.
        snapshots.remove_orphans()?;
        Ok(snapshots)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where snapshots without a quota are: the local disk directly, or the root.
    pub fn unlimited_place(&self) -> Place {
        self.dirs.unlimited()
    }

    /// What sharing layers saved since start.
    pub fn counters(&self) -> &SharingCounters {
        &self.counters
    }

    /// Whether snapshot quotas are enforced here (containerd's `SupportedQuota`).
    pub fn supported_quota(&self) -> bool {
        quota::supported(&self.root)
    }

    fn current(&self) -> Arc<Meta> {
        self.state.read().clone()
    }

    /// Records `meta` durably and makes it the current table. Called with `writer` held.
    fn publish(&self, meta: Meta) -> Result<(), Error> {
        self.file.store(&meta)?;
        *self.state.write() = Arc::new(meta);
        Ok(())
    }
}

/// The parent to record for a new snapshot: none for `""`, else a committed snapshot.
fn check_parent(meta: &Meta, parent: &str) -> Result<Option<String>, Error> {
    if parent.is_empty() {
        return Ok(None);
    }
    let record = meta.get(parent)?;
    if record.kind != Kind::Committed {
        return Err(Error::InvalidArgument(format!(
            "parent {parent} is not committed"
        )));
    }
    Ok(Some(parent.to_owned()))
}

fn check_name(name: &str) -> Result<(), Error> {
    if name.is_empty() {
        return Err(Error::InvalidArgument("a snapshot needs a key".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::api::types::Mount;

    fn upperdir(mounts: &[Mount]) -> String {
        mounts[0]
            .options
            .iter()
            .find_map(|o| o.strip_prefix("upperdir="))
            .unwrap_or_else(|| panic!("no upperdir in {mounts:?}"))
            .to_owned()
    }

    /// The fast path decides where new snapshots go; snapshots already made stay where
    /// they are, and a table naming a place that is gone stops the start, rather than
    /// hand out mounts of empty directories.
    #[test]
    fn snapshots_stay_where_they_were_made() {
        let tmp = tempfile::tempdir().unwrap();
        let disk = tmp.path().join("disk");
        let mut config = Config::new(&tmp.path().join("root"));
        config.local_root = Some(disk.clone());
        let snapshots = Snapshots::open(&config).unwrap();
        snapshots.prepare("base", "", BTreeMap::new()).unwrap();
        snapshots
            .commit("committed", "base", BTreeMap::new())
            .unwrap();
        let m = snapshots
            .prepare("fast", "committed", BTreeMap::new())
            .unwrap();
        assert!(upperdir(&m).starts_with(disk.to_str().unwrap()), "{m:?}");
        drop(snapshots);

        config.fast_path = false;
        let snapshots = Snapshots::open(&config).unwrap();
        assert_eq!(snapshots.mounts("fast").unwrap(), m);
        let slow = snapshots
            .prepare("slow", "committed", BTreeMap::new())
            .unwrap();
        assert!(upperdir(&slow).starts_with(snapshots.root().to_str().unwrap()));
        drop(snapshots);

        config.local_root = None;
        let e = Snapshots::open(&config)
            .err()
            .expect("a place that is gone");
        assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
    }
}
