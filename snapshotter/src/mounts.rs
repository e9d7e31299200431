//! The mounts containerd performs for a snapshot, as its own overlay snapshotter makes
//! them: a bind mount for a snapshot alone, a kernel overlay over its parents otherwise.
//! A snapshot with a quota has its upper and work directories under the snapshotter's root,
//! inside the view when the root is, so the quota of its directory covers everything the
//! container writes and `df` in the container (statfs of the upper directory) shows it.
//! One without a quota has them on the local disk directly (its [`Place::Disk`]): nothing
//! it writes passes through FUSE, and only its shared lowers come from the view.

use std::path::{Path, PathBuf};

use crate::api::types::Mount;
use crate::error::Error;
use crate::meta::{Backing, Kind, Meta, Place, Record};

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

/// The mounts of the snapshot `name`.
pub fn mounts(dirs: &Dirs, meta: &Meta, name: &str) -> Result<Vec<Mount>, Error> {
    let record = meta.get(name)?;
    let parents = meta
        .ancestors(name)?
        .into_iter()
        .map(|p| meta.get(p).map(|r| dirs.files(r)))
        .collect::<Result<Vec<_>, _>>()?;
    let bind = |source: PathBuf, mode: &str| Mount {
        r#type: "bind".into(),
        source: text(&source),
        target: String::new(),
        options: vec![mode.into(), "rbind".into()],
    };
    let lowerdir = || {
        let lowers: Vec<String> = parents.iter().map(|p| text(p)).collect();
        format!("lowerdir={}", lowers.join(":"))
    };
    let overlay = |options: Vec<String>| Mount {
        r#type: "overlay".into(),
        source: "overlay".into(),
        target: String::new(),
        options,
    };
    Ok(vec![match record.kind {
        Kind::Committed => {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {name} is committed: only active snapshots and views have mounts"
            )))
        }
        Kind::Active if parents.is_empty() => bind(dirs.files(record), "rw"),
        Kind::Active => overlay(vec![
            "index=off".into(),
            format!("workdir={}", text(&dirs.work(record))),
            format!("upperdir={}", text(&dirs.files(record))),
            lowerdir(),
        ]),
        Kind::View if parents.is_empty() => bind(dirs.files(record), "ro"),
        Kind::View if parents.len() == 1 => bind(parents[0].clone(), "ro"),
        Kind::View => overlay(vec!["index=off".into(), lowerdir()]),
    }])
}

fn text(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// Whether overlay's option syntax can carry `path` (it splits on `,` and `:`).
pub fn fits_overlay_options(path: &Path) -> bool {
    let s = path.to_string_lossy();
    !s.contains([',', ':', '='])
}
