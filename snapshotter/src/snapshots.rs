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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::api::types::Mount;
pub use crate::dirs::Config;
use crate::dirs::{self, Dirs};
use crate::error::Error;
use crate::filter::{self, Filter};
use crate::meta::{self, Backing, Kind, Meta, MetaFile, Place, Record, Usage};
use crate::mounts;
use crate::quota;
use crate::shared::{self, SharedLayers};
use crate::tree;

/// The label containerd's remote-snapshot protocol puts the wanted chain ID in.
pub const REF_LABEL: &str = "containerd.io/snapshot.ref";
/// Marks a snapshot whose files come from elsewhere, with the value stargz and nydus use.
pub const REMOTE_LABEL: &str = "containerd.io/snapshot/remote";
pub const REMOTE_LABEL_VALUE: &str = "remote snapshot";

/// What sharing saved, for metrics: counted since start.
#[derive(Debug, Default)]
pub struct SharingCounters {
    /// Prepares answered with a shared layer (remote-snapshot protocol).
    pub adoptions: std::sync::atomic::AtomicU64,
    /// Commits that kept a shared layer's files instead of the local copy.
    pub dedupes: std::sync::atomic::AtomicU64,
    /// Bytes not written locally thanks to them: the shared layers' sizes for adoptions,
    /// the local copies dropped for dedupes.
    pub bytes_saved: std::sync::atomic::AtomicU64,
}

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

/// A snapshot as containerd's Info describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    pub name: String,
    pub record: Record,
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

    /// Answers a labelled Prepare from the shared tree, when it can: Err(AlreadyExists)
    /// once a committed snapshot of the shared layer carries the label over `parent`;
    /// Ok(()) when the shared tree cannot serve it and a normal Prepare must follow.
    fn adopt(
        &self,
        key: &str,
        parent: &str,
        target: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<(), Error> {
        let Some(shared) = &self.shared else {
            return Ok(());
        };
        let Some(layer) = shared.find(target) else {
            return Ok(());
        };
        let _writer = self.writer.lock();
        let mut meta = (*self.current()).clone();
        let parent = check_parent(&meta, parent)?;
        if chain_below(&meta, parent.as_deref())? != Some(layer.parent_chain.clone()) {
            tracing::debug!(
                key,
                target,
                "a shared layer over another parent; preparing normally"
            );
            return Ok(());
        }
        let name = adopted_name(key, target);
        if let Some(existing) = meta.snapshots.get(&name) {
            let same = existing.kind == Kind::Committed
                && existing.parent == parent
                && existing.labels.get(REF_LABEL).map(String::as_str) == Some(target);
            return match same {
                true => Err(Error::AlreadyExists(format!("snapshot {target}"))),
                false => Ok(()),
            };
        }
        let id = meta.next_id.max(1);
        meta.next_id = id + 1;
        let now = meta::now();
        let mut labels = labels.clone();
        labels.insert(REMOTE_LABEL.into(), REMOTE_LABEL_VALUE.into());
        meta.snapshots.insert(
            name.clone(),
            Record {
                id,
                place: Place::Root,
                kind: Kind::Committed,
                parent,
                labels,
                created: now,
                updated: now,
                backing: Backing::Shared {
                    layer: layer.id.clone(),
                    diff: layer.diff.clone(),
                },
                chain: Some(target.to_owned()),
                quota: None,
                usage: None,
            },
        );
        self.publish(meta)?;
        self.counters.adoptions.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes_saved
            .fetch_add(layer.diff_size.unwrap_or(0), Ordering::Relaxed);
        tracing::info!(target, layer = layer.id, name, "adopted a shared layer");
        Err(Error::AlreadyExists(format!("snapshot {target}")))
    }

    /// Commits the active snapshot `key` as `name`. When `name` is a chain ID the shared
    /// tree holds over the same parent chain, the shared layer's files back the committed
    /// snapshot and the local copy is dropped.
    pub fn commit(
        &self,
        name: &str,
        key: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<(), Error> {
        check_name(name)?;
        let chain = chain_of_name(name).map(str::to_owned);
        let shared = match (&self.shared, &chain) {
            (Some(shared), Some(chain)) => shared.find(chain),
            _ => None,
        };
        // Measured before the lock: a walk of a big layer must not hold up other changes.
        // containerd writes nothing into a snapshot it is committing.
        let measured = {
            let active = self.current().get(key)?.clone();
            (active.id, self.measure(&active)?)
        };
        let writer = self.writer.lock();
        let mut meta = (*self.current()).clone();
        let active = meta.get(key)?.clone();
        if active.kind != Kind::Active {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {key} is not active"
            )));
        }
        if meta.snapshots.contains_key(name) {
            return Err(Error::AlreadyExists(format!("snapshot {name}")));
        }
        let dir = self.dirs.dir(&active);
        let usage = match measured {
            (id, usage) if id == active.id => usage,
            // Removed and prepared again meanwhile: measure what is there now.
            _ => self.measure(&active)?,
        };
        let below = chain_below(&meta, active.parent.as_deref())?;
        let dedupe = shared.filter(|layer| below.as_ref() == Some(&layer.parent_chain));
        let mut record = Record {
            kind: Kind::Committed,
            labels,
            updated: meta::now(),
            // A chain ID names every layer below too: over layers of unknown chain, the
            // name cannot be what they are.
            chain: chain.filter(|_| below.is_some()),
            usage: Some(usage),
            ..active
        };
        if let Some(layer) = &dedupe {
            record.backing = Backing::Shared {
                layer: layer.id.clone(),
                diff: layer.diff.clone(),
            };
            // What the snapshot takes now is the shared layer's, measured when asked.
            record.usage = None;
            record
                .labels
                .insert(REMOTE_LABEL.into(), REMOTE_LABEL_VALUE.into());
        }
        meta.snapshots.remove(key);
        meta.snapshots.insert(name.to_owned(), record);
        self.publish(meta)?;
        // No record owns the directory now: it is removed without holding up others.
        drop(writer);
        if let Some(layer) = dedupe {
            self.counters.dedupes.fetch_add(1, Ordering::Relaxed);
            self.counters
                .bytes_saved
                .fetch_add(usage.size, Ordering::Relaxed);
            tracing::info!(
                name,
                layer = layer.id,
                freed_bytes = usage.size,
                "committed a shared layer's chain: keeping the shared files, dropping the local copy"
            );
            self.discard(&dir);
        }
        Ok(())
    }

    /// Removes the snapshot `key`, which no other snapshot may have as its parent. A shared
    /// layer's files are never touched.
    pub fn remove(&self, key: &str) -> Result<(), Error> {
        let writer = self.writer.lock();
        let mut meta = (*self.current()).clone();
        let record = meta.get(key)?.clone();
        if meta.has_children(key) {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {key} is the parent of other snapshots"
            )));
        }
        meta.snapshots.remove(key);
        self.publish(meta)?;
        drop(writer);
        if record.backing == Backing::Local {
            self.discard(&self.dirs.dir(&record));
        }
        Ok(())
    }

    pub fn stat(&self, key: &str) -> Result<Info, Error> {
        let meta = self.current();
        Ok(Info {
            name: key.to_owned(),
            record: meta.get(key)?.clone(),
        })
    }

    /// Changes a snapshot's labels: all of them (`paths` empty or `labels`), or the ones
    /// named `labels.<key>` (a key absent from `labels` is removed). Nothing else changes.
    pub fn update(
        &self,
        name: &str,
        labels: BTreeMap<String, String>,
        paths: &[String],
    ) -> Result<Info, Error> {
        let _writer = self.writer.lock();
        let mut meta = (*self.current()).clone();
        let record = meta
            .snapshots
            .get_mut(name)
            .ok_or_else(|| Error::NotFound(format!("snapshot {name}")))?;
        if paths.is_empty() || paths.iter().any(|p| p == "labels") {
            record.labels = labels;
        } else {
            for path in paths {
                let Some(key) = path.strip_prefix("labels.") else {
                    return Err(Error::InvalidArgument(format!(
                        "cannot update field {path:?}: only labels can change"
                    )));
                };
                match labels.get(key) {
                    Some(value) => record.labels.insert(key.to_owned(), value.clone()),
                    None => record.labels.remove(key),
                };
            }
        }
        record.updated = meta::now();
        let info = Info {
            name: name.to_owned(),
            record: record.clone(),
        };
        self.publish(meta)?;
        Ok(info)
    }

    pub fn list(&self, filters: &[String]) -> Result<Vec<Info>, Error> {
        let filters = filters
            .iter()
            .map(|f| Filter::parse(f))
            .collect::<Result<Vec<_>, _>>()?;
        let meta = self.current();
        Ok(meta
            .snapshots
            .iter()
            .filter(|(name, record)| filter::any(&filters, name, record))
            .map(|(name, record)| Info {
                name: name.clone(),
                record: record.clone(),
            })
            .collect())
    }

    pub fn mounts(&self, key: &str) -> Result<Vec<Mount>, Error> {
        let meta = self.current();
        // A shared layer removed from the shared tree leaves its snapshots without files:
        // say so, rather than hand out a mount that fails with a bare ENOENT.
        for name in std::iter::once(key).chain(meta.ancestors(key)?) {
            if let Backing::Shared { layer, diff } = &meta.get(name)?.backing {
                if !diff.is_dir() {
                    return Err(Error::FailedPrecondition(format!(
                        "snapshot {name}: its shared layer {layer} is gone from the shared tree"
                    )));
                }
            }
        }
        mounts::mounts(&self.dirs, &meta, key)
    }

    /// What the snapshot `key` uses: for an active one, now (its quota's figures when it
    /// has one); for a committed one, what it used when committed; for one backed by a
    /// shared layer, what that layer's files take (as containerd's snapshotters report a
    /// layer's own size, although it takes no local space).
    pub fn usage(&self, key: &str) -> Result<Usage, Error> {
        let record = self.current().get(key)?.clone();
        if let Backing::Shared { layer, diff } = &record.backing {
            return self.shared_usage(layer, diff);
        }
        match (record.kind, record.usage) {
            (Kind::Committed, Some(usage)) => Ok(usage),
            _ => self.measure(&record),
        }
    }

    /// What a local snapshot takes now: its quota's figures (the whole directory the quota
    /// covers) when it has one, else its files, as containerd's overlay snapshotter
    /// measures its upper directory.
    fn measure(&self, record: &Record) -> Result<Usage, Error> {
        match record.quota {
            Some(_) => quota::usage(&self.root, &self.dirs.dir(record)),
            None => quota::walk(&self.dirs.files(record)),
        }
    }

    /// What the shared layer `layer`'s files take: walked once through the view (a layer
    /// never changes once complete), then remembered.
    fn shared_usage(&self, layer: &str, diff: &Path) -> Result<Usage, Error> {
        if let Some(usage) = self.shared_usage.lock().get(layer) {
            return Ok(*usage);
        }
        let usage = quota::walk(diff)?;
        self.shared_usage.lock().insert(layer.to_owned(), usage);
        Ok(usage)
    }

    /// Removes the directories no snapshot owns: left by a crash, or by a removal that
    /// could not finish. One that cannot be removed does not stop the others; it fails the
    /// call, so that containerd logs that something was left.
    pub fn cleanup(&self) -> Result<(), Error> {
        let mut left = self.remove_orphans()?;
        if left.is_empty() {
            return Ok(());
        }
        let more = match left.len() - 1 {
            0 => String::new(),
            n => format!(" (and {n} more directories no snapshot owns)"),
        };
        let (dir, cause) = left.swap_remove(0);
        Err(Error::io(
            format!("removing {}{more}", dir.display()),
            cause,
        ))
    }

    /// Removes the directories no snapshot owns, and returns those it could not remove,
    /// each logged.
    fn remove_orphans(&self) -> Result<Vec<(PathBuf, io::Error)>, Error> {
        let _writer = self.writer.lock();
        let meta = self.current();
        let owned: HashSet<PathBuf> = meta
            .snapshots
            .values()
            .filter(|r| r.backing == Backing::Local)
            .map(|r| self.dirs.dir(r))
            .collect();
        let mut left = Vec::new();
        for (_, dir) in self.dirs.all_snapshots() {
            let entries = fs::read_dir(&dir)
                .map_err(|e| Error::io(format!("reading {}", dir.display()), e))?;
            for entry in entries {
                let entry =
                    entry.map_err(|e| Error::io(format!("reading {}", dir.display()), e))?;
                let path = entry.path();
                if owned.contains(&path) {
                    continue;
                }
                tracing::info!(dir = %path.display(), "removing a directory no snapshot owns");
                if let Err(e) = tree::remove(&path) {
                    tracing::warn!(dir = %path.display(), error = %e, "cannot remove a directory no snapshot owns; leaving it");
                    left.push((path, e));
                }
            }
        }
        Ok(left)
    }

    /// Removes a directory that is no longer wanted; a failure is left to cleanup.
    fn discard(&self, dir: &Path) {
        if let Err(e) = tree::remove(dir) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(dir = %dir.display(), error = %e, "left for cleanup");
            }
        }
    }
}

/// The chain ID of the layers under a snapshot over `parent`: `Some(None)` over none, and
/// `None` where it is not known (the parent, or a snapshot below it, was committed under a
/// name that is no chain ID). A shared layer backs only a snapshot whose layers below are
/// its own, so never one of unknown chain.
fn chain_below(meta: &Meta, parent: Option<&str>) -> Result<Option<Option<String>>, Error> {
    match parent {
        None => Ok(Some(None)),
        Some(p) => Ok(meta.get(p)?.chain.clone().map(Some)),
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

/// containerd names a snapshot `<namespace>/<seq>/<name>`; unpacks commit a layer under
/// its chain ID.
fn chain_of_name(name: &str) -> Option<&str> {
    let last = name.rsplit('/').next()?;
    shared::digest_hex(last).map(|_| last)
}

/// The name an adopted shared layer is committed as: the Prepare key's namespace and
/// sequence number, which containerd allocated for this request alone, and the chain ID.
fn adopted_name(key: &str, target: &str) -> String {
    let mut parts = key.splitn(3, '/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(ns), Some(seq), Some(_)) => format!("{ns}/{seq}/{target}"),
        _ => format!("{key}@{target}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let c = format!("sha256:{}", "a".repeat(64));
        assert_eq!(chain_of_name(&format!("default/3/{c}")), Some(c.as_str()));
        assert_eq!(chain_of_name("default/3/extract-1 x"), None);
        assert_eq!(
            adopted_name("k8s.io/7/extract-1-x sha256:abc", &c),
            format!("k8s.io/7/{c}")
        );
        assert_eq!(adopted_name("plain", &c), format!("plain@{c}"));
    }

    /// Unmounts what a test mounted, also when the test fails.
    struct Unmount(PathBuf);

    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }

    /// A mount left in a directory no snapshot owns keeps that directory from being
    /// removed; the snapshotter starts all the same, removes the other leftovers, and the
    /// next snapshot passes over the id the leftover holds.
    #[test]
    fn a_leftover_that_cannot_be_removed_does_not_keep_the_snapshotter_down() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let stuck = root.join("snapshots/1/fs");
        fs::create_dir_all(&stuck).unwrap();
        fs::create_dir_all(root.join("snapshots/2/fs/deep")).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "none"])
            .arg(&stuck)
            .status()
            .unwrap();
        assert!(mounted.success(), "mounting a tmpfs on {}", stuck.display());
        let mount = Unmount(stuck.clone());
        fs::write(stuck.join("kept"), b"x").unwrap();

        let config = Config::new(&root);
        let snapshots = Snapshots::open(&config).expect("starting beside a stuck leftover");
        assert!(!root.join("snapshots/2").exists());
        assert!(
            stuck.join("kept").exists(),
            "what is mounted is not touched"
        );
        let left = snapshots.cleanup().unwrap_err().to_string();
        assert!(left.contains("snapshots/1"), "{left}");

        snapshots.prepare("k", "", BTreeMap::new()).unwrap();
        assert_ne!(snapshots.stat("k").unwrap().record.id, 1);

        drop(mount);
        snapshots.cleanup().unwrap();
        assert!(!root.join("snapshots/1").exists());
    }

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
