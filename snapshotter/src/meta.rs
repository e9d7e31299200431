//! The snapshot records and their one file on disk.
//!
//! containerd keeps its own database of snapshots (names, parents, labels, times as its
//! users see them); this is the snapshotter's side of it: which snapshot lives in which
//! directory, or which shared layer backs it. The whole table is one JSON file,
//! `<root>/metadata.json`, replaced atomically (temporary file, `fsync`, `rename`, `fsync`
//! of the directory) after every change, so a crash leaves either the old table or the new
//! one, never a mix. A directory made before a crash that did not reach the table is an
//! orphan that [`crate::snapshots::Snapshots::cleanup`] removes.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// What a snapshot is, in containerd's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Read-only, mounted over its parent, never committed.
    View,
    /// Read-write, to be committed or removed.
    Active,
    /// Immutable; may be a parent.
    Committed,
}

/// Where a snapshot's files are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Backing {
    /// `<root>/snapshots/<id>/fs` (and `work` beside it while active).
    Local,
    /// A shared layer's `diff/` in the view: never written, never removed by us.
    Shared { layer: String, diff: PathBuf },
}

/// Which directory a local snapshot's own directory is in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Place {
    /// `<root>/snapshots/<id>`: in the view when the root is, where quotas apply.
    #[default]
    Root,
    /// `<local root>/snapshots/<id>`: on the local disk directly, for snapshots without a
    /// quota (DESIGN §12, fast path).
    Disk,
}

impl Place {
    fn is_root(&self) -> bool {
        *self == Place::Root
    }
}

/// One snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Names the directory `snapshots/<id>` of its place; never reused.
    pub id: u64,
    #[serde(default, skip_serializing_if = "Place::is_root")]
    pub place: Place,
    pub kind: Kind,
    /// The parent's name, which must be committed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Nanoseconds since the epoch.
    pub created: u128,
    pub updated: u128,
    pub backing: Backing,
    /// The OCI chain ID of the layers this snapshot holds, when known: from the
    /// remote-snapshot label it was adopted by, or from the name containerd committed it as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain: Option<String>,
    /// The quota set on the snapshot's directory, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<u64>,
    /// Usage measured at commit, so that Usage of a committed snapshot needs no walk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// Allocated bytes and inodes, as containerd's Usage reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub size: u64,
    pub inodes: u64,
}

/// The table of snapshots, by name (the key while active, the committed name after).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    /// The next directory id; ids of removed snapshots are never handed out again, so a
    /// late removal of an old directory can never hit a new snapshot.
    pub next_id: u64,
    pub snapshots: BTreeMap<String, Record>,
}

impl Meta {
    pub fn get(&self, name: &str) -> Result<&Record, Error> {
        self.snapshots
            .get(name)
            .ok_or_else(|| Error::NotFound(format!("snapshot {name}")))
    }

    /// The names of `name`'s ancestors, nearest first.
    pub fn ancestors(&self, name: &str) -> Result<Vec<&str>, Error> {
        let mut chain = Vec::new();
        let mut next = self.get(name)?.parent.as_deref();
        while let Some(parent) = next {
            // A table that lies about its parents must not loop us forever.
            if chain.len() > self.snapshots.len() {
                return Err(Error::Corrupt(format!("a parent cycle through {name}")));
            }
            chain.push(parent);
            next = self.get(parent)?.parent.as_deref();
        }
        Ok(chain)
    }

    /// Whether some snapshot names `name` as its parent.
    pub fn has_children(&self, name: &str) -> bool {
        self.snapshots
            .values()
            .any(|r| r.parent.as_deref() == Some(name))
    }
}

/// The file the table lives in.
#[derive(Debug, Clone)]
pub struct MetaFile {
    path: PathBuf,
}

impl MetaFile {
    pub fn new(root: &Path) -> MetaFile {
        MetaFile {
            path: root.join("metadata.json"),
        }
    }

    /// The table on disk; an empty one when there is none yet.
    pub fn load(&self) -> Result<Meta, Error> {
        let bytes = match fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Meta::default()),
            Err(e) => return Err(Error::io(format!("reading {}", self.path.display()), e)),
        };
        serde_json::from_slice(&bytes)
            .map_err(|e| Error::Corrupt(format!("{}: {e}", self.path.display())))
    }

    /// Replaces the table on disk with `meta`, durably.
    pub fn store(&self, meta: &Meta) -> Result<(), Error> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let tmp = dir.join(".metadata.json.tmp");
        let write = || -> io::Result<()> {
            let mut file = File::create(&tmp)?;
            file.write_all(&serde_json::to_vec_pretty(meta)?)?;
            file.sync_all()?;
            fs::rename(&tmp, &self.path)?;
            File::open(dir)?.sync_all()
        };
        write().map_err(|e| Error::io(format!("writing {}", self.path.display()), e))
    }
}

/// Now, in nanoseconds since the epoch.
pub fn now() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: u64, parent: Option<&str>) -> Record {
        Record {
            id,
            place: Place::Root,
            kind: Kind::Committed,
            parent: parent.map(str::to_owned),
            labels: BTreeMap::new(),
            created: 1,
            updated: 1,
            backing: Backing::Local,
            chain: None,
            quota: None,
            usage: None,
        }
    }

    #[test]
    fn the_table_survives_a_round_trip_and_an_empty_root_is_empty() {
        let tmp = tempfile::tempdir().unwrap();
        let file = MetaFile::new(tmp.path());
        assert_eq!(file.load().unwrap(), Meta::default());
        let mut meta = Meta {
            next_id: 3,
            ..Meta::default()
        };
        meta.snapshots.insert("a".into(), record(1, None));
        let mut shared = record(2, Some("a"));
        shared.backing = Backing::Shared {
            layer: "l".into(),
            diff: "/v/overlay/RO/l/diff".into(),
        };
        meta.snapshots.insert("b".into(), shared);
        let mut fast = record(4, None);
        fast.place = Place::Disk;
        meta.snapshots.insert("c".into(), fast);
        file.store(&meta).unwrap();
        assert_eq!(file.load().unwrap(), meta);
        assert!(!tmp.path().join(".metadata.json.tmp").exists());
    }

    #[test]
    fn a_garbled_table_is_an_error_not_an_empty_one() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("metadata.json"), b"{\"next_id\": 1, ").unwrap();
        let e = MetaFile::new(tmp.path()).load().unwrap_err();
        assert!(matches!(e, Error::Corrupt(_)), "{e}");
    }

    #[test]
    fn ancestors_are_nearest_first_and_cycles_are_caught() {
        let mut meta = Meta::default();
        meta.snapshots.insert("a".into(), record(1, None));
        meta.snapshots.insert("b".into(), record(2, Some("a")));
        meta.snapshots.insert("c".into(), record(3, Some("b")));
        assert_eq!(meta.ancestors("c").unwrap(), ["b", "a"]);
        assert!(meta.has_children("a"));
        assert!(!meta.has_children("c"));
        meta.snapshots.get_mut("a").unwrap().parent = Some("c".into());
        assert!(matches!(meta.ancestors("c"), Err(Error::Corrupt(_))));
    }
}
