//! New snapshots: Prepare (an active snapshot) and View. A new snapshot's directories are
//! made before it is recorded, under the writer lock, so that a crash between leaves only a
//! directory no record names; and a quota too small for the snapshot's own directories is
//! refused here, naming what they need, rather than at mount with a read-only overlay.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use super::share::REF_LABEL;
use super::{check_name, check_parent, Snapshots};
use crate::api::types::Mount;
use crate::error::Error;
use crate::meta::{self, Backing, Kind, Place, Record};
use crate::mounts;
use crate::quota;

impl Snapshots {
    /// A new active snapshot `key` over `parent`; or, when `labels` carry a chain ID the
    /// shared tree holds over that parent, a committed snapshot of that shared layer and
    /// AlreadyExists (containerd's remote-snapshot protocol).
    pub fn prepare(
        &self,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>, Error> {
        check_name(key)?;
        if let Some(target) = labels.get(REF_LABEL) {
            self.adopt(key, parent, target, &labels)?;
        }
        let wanted = quota::from_labels(&labels)?;
        self.create(key, parent, Kind::Active, labels, Some(&wanted))
    }

    /// A new read-only view `key` of `parent`.
    pub fn view(
        &self,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>, Error> {
        check_name(key)?;
        self.create(key, parent, Kind::View, labels, None)
    }

    fn create(
        &self,
        key: &str,
        parent: &str,
        kind: Kind,
        labels: BTreeMap<String, String>,
        wanted: Option<&quota::Wanted>,
    ) -> Result<Vec<Mount>, Error> {
        let _writer = self.writer.lock();
        let mut meta = (*self.current()).clone();
        if meta.snapshots.contains_key(key) {
            return Err(Error::AlreadyExists(format!("snapshot {key}")));
        }
        let parent = check_parent(&meta, parent)?;
        let wanted = wanted.filter(|w| w.limits());
        let place = match wanted {
            Some(_) => Place::Root,
            None => self.dirs.unlimited(),
        };
        let id = self.free_id(meta.next_id.max(1));
        let dir = self.dirs.dir_in(place, id);
        meta.next_id = id + 1;
        let limit = match wanted {
            Some(wanted) => quota::make_dir(&self.root, &dir, wanted)?,
            None => {
                fs::create_dir(&dir)
                    .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
                None
            }
        };
        let now = meta::now();
        let record = Record {
            id,
            place,
            kind,
            parent,
            labels,
            created: now,
            updated: now,
            backing: Backing::Local,
            chain: None,
            quota: limit,
            usage: None,
        };
        let made = self.make_files(&record).and_then(|()| {
            meta.snapshots.insert(key.to_owned(), record.clone());
            self.publish(meta)
        });
        if let Err(e) = made {
            self.discard(&dir);
            return Err(match (limit, e) {
                (Some(limit), e) if e.is_out_of_space() => self.too_small(key, &record, limit, e),
                (_, e) => e,
            });
        }
        mounts::mounts(&self.dirs, &self.current(), key)
    }

    /// The first id from `id` on whose directories are not there in any place, or could
    /// be removed: a directory no record owns (a removal that failed, a crash before the
    /// record was written) must not block its id, even when it cannot be removed.
    fn free_id(&self, mut id: u64) -> u64 {
        loop {
            let free = self.dirs.all_snapshots().all(|(place, _)| {
                let dir = self.dirs.dir_in(place, id);
                if fs::symlink_metadata(&dir).is_err() {
                    return true;
                }
                self.discard(&dir);
                fs::symlink_metadata(&dir).is_err()
            });
            if free {
                return id;
            }
            id += 1;
        }
    }

    /// Makes a snapshot's own directories. An active one with a quota also gets the work
    /// directory overlay makes at mount (`work/work`), so that a quota too small for them
    /// fails here, with the minimum named, and not at mount with a read-only overlay.
    fn make_files(&self, record: &Record) -> Result<(), Error> {
        for dir in self.own_dirs(record, &self.dirs.dir(record)) {
            fs::create_dir(&dir)
                .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        }
        Ok(())
    }

    /// The directories `make_files` makes for `record` in the snapshot directory `dir`.
    fn own_dirs(&self, record: &Record, dir: &Path) -> Vec<PathBuf> {
        let mut dirs = vec![dir.join("fs")];
        if record.kind == Kind::Active {
            dirs.push(dir.join("work"));
            if record.quota.is_some() {
                dirs.push(dir.join("work/work"));
            }
        }
        dirs
    }

    /// The error for a quota of `limit` bytes that could not hold `record`'s own
    /// directories: InvalidArgument naming what they need, measured in a directory beside
    /// it without a quota; `cause` as it was when they fit (the filesystem itself is full).
    fn too_small(&self, key: &str, record: &Record, limit: u64, cause: Error) -> Error {
        let probe = self
            .dirs
            .dir_in(Place::Root, record.id)
            .with_extension("probe");
        let measured = fs::create_dir(&probe)
            .map_err(|e| Error::io(format!("creating {}", probe.display()), e))
            .and_then(|()| {
                for dir in self.own_dirs(record, &probe) {
                    fs::create_dir(&dir)
                        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
                }
                quota::walk(&probe)
            });
        self.discard(&probe);
        match measured {
            Ok(needed) if needed.size > limit => Error::InvalidArgument(format!(
                "a quota of {limit} bytes is too small for snapshot {key}: its own \
                 directories need at least {} bytes",
                needed.size
            )),
            Ok(_) => cause,
            Err(e) => {
                tracing::warn!(key, error = %e, "cannot measure what a snapshot's directories need");
                cause
            }
        }
    }
}
