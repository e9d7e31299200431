//! Setting and clearing quota roots, and the registry of them saved in local and loaded
//! at mount.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use tracing::{info, warn};

use super::ledger::Ledger;
use super::persist::{self, Registry};
use super::scan;
use super::seam::Object;
use super::size::SizeError;
use super::table::{Limit, QuotaRoot, Quotas};
use crate::report::QuotaInfo;
use crate::store;

/// The attribute through which a runtime sets a directory's quota without our CLI.
pub const QUOTA_XATTR: &[u8] = b"user.layerfs.quota";

#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    #[error("{path}: {source}")]
    Sys { path: String, source: Errno },
    #[error("{path} is inside the quota root {root}; quota roots do not nest")]
    Inside { path: String, root: String },
    #[error("{path} contains the quota root {root}; quota roots do not nest")]
    Contains { path: String, root: String },
    #[error("{path} is not a quota root")]
    NotRoot { path: String },
    #[error(
        "{file} is open with FUSE passthrough, whose writes a quota on {path} could not \
         count; close it, or set quotas before files are opened"
    )]
    Busy { path: String, file: String },
    #[error(transparent)]
    Size(#[from] SizeError),
    #[error("saving the quota registry: {0}")]
    Save(#[from] persist::RegistryError),
}

impl QuotaError {
    /// The errno the xattr interface answers with.
    pub fn errno(&self) -> Errno {
        match self {
            QuotaError::Sys { source, .. } => *source,
            QuotaError::Inside { .. } | QuotaError::Contains { .. } | QuotaError::Busy { .. } => {
                Errno::EBUSY
            }
            QuotaError::NotRoot { .. } => Errno::ENODATA,
            QuotaError::Size(_) => Errno::EINVAL,
            QuotaError::Save(_) => Errno::EIO,
        }
    }
}

impl Ledger {
    /// See [`super::Accounting::set`].
    pub(super) fn set_root<O: Object>(
        &self,
        dir: &Arc<O>,
        local: impl FnOnce() -> Result<Arc<OwnedFd>, Errno>,
        limit: Limit,
        live: impl FnOnce() -> Vec<Arc<O>>,
    ) -> Result<QuotaInfo, QuotaError> {
        let path = dir.path().unwrap_or_default();
        let shown = path.display().to_string();
        let sys = |source| QuotaError::Sys {
            path: shown.clone(),
            source,
        };
        if !dir.is_dir() {
            return Err(sys(Errno::ENOTDIR));
        }
        let _settling = self.settling.lock();
        let local = local().map_err(sys)?;
        let st = store::stat_fd(local.as_fd()).map_err(sys)?;
        let root = {
            let changes = self.quotas.lock_changes();
            if let Some(root) = self.own_root(&**dir) {
                drop(changes);
                let old = std::cell::Cell::new(limit);
                self.save_change(
                    || old.set(root.set_limit(limit)),
                    || {
                        if root.limit() == limit {
                            root.set_limit(old.get());
                        }
                    },
                )?;
                info!(path = %shown, limit = limit.bytes, "quota changed");
                return Ok(root.info());
            }
            if let Some(above) = dir.parent().and_then(|p| self.root_of(&p)) {
                return Err(QuotaError::Inside {
                    path: shown,
                    root: above.path().display().to_string(),
                });
            }
            if let Some(below) = self.quotas.roots_under(&path).first() {
                return Err(QuotaError::Contains {
                    path: shown,
                    root: below.path().display().to_string(),
                });
            }
            let root = Arc::new(QuotaRoot::new(
                st.st_dev,
                st.st_ino,
                path.clone(),
                limit,
                Default::default(),
                self.quotas.errno(),
            ));
            // Listed once its usage is counted and saved: a registry another change saves
            // meanwhile must not carry a root this call may still withdraw.
            root.set_listed(false);
            self.quotas.insert(root.clone());
            root
        };
        let withdraw = |e: QuotaError| {
            let _changes = self.quotas.lock_changes();
            self.quotas.remove(st.st_dev, st.st_ino);
            e
        };
        // Writes that bypass the daemon could not be counted.
        if let Some(file) = passthrough_open_under(live(), &path) {
            return Err(withdraw(QuotaError::Busy {
                path: shown,
                file: file.display().to_string(),
            }));
        }
        let usage = scan::usage(local.as_fd()).map_err(|e| withdraw(sys(e)))?;
        root.charge(usage.bytes as i64);
        root.charge_inodes(usage.inodes as i64);
        self.save_change(
            || root.set_listed(true),
            || {
                self.quotas.remove(st.st_dev, st.st_ino);
            },
        )?;
        info!(path = %shown, limit = limit.bytes, used = usage.bytes, "quota set");
        Ok(root.info())
    }

    /// See [`super::Accounting::clear`].
    pub(super) fn clear_root<O: Object>(&self, dir: &O) -> Result<QuotaInfo, QuotaError> {
        let path = dir.path().unwrap_or_default().display().to_string();
        let _settling = self.settling.lock();
        let root = {
            let _changes = self.quotas.lock_changes();
            self.own_root(dir)
                .ok_or(QuotaError::NotRoot { path: path.clone() })?
        };
        // Enforced until the registry without it is on disk: writes meanwhile are
        // counted, so a root that stays (the save failed) keeps an exact usage.
        self.save_change(|| root.set_listed(false), || root.set_listed(true))?;
        {
            let _changes = self.quotas.lock_changes();
            self.quotas.remove(root.dev, root.ino);
        }
        info!(path = %path, "quota cleared");
        Ok(root.info())
    }

    /// Changes the roots with `apply` and saves the registry with the change. If it cannot
    /// be saved, `undo` takes the change back and the registry as it was is saved again:
    /// a change the caller is told failed is then neither in force nor on disk. Both run
    /// under the change lock. `written` is held throughout, so that no snapshot taken
    /// meanwhile (which may carry the change) reaches the disk after the one saved back.
    fn save_change(&self, apply: impl FnOnce(), undo: impl FnOnce()) -> Result<(), QuotaError> {
        let mut written = self.written.lock();
        let snapshot = {
            let mut changes = self.quotas.lock_changes();
            apply();
            self.snapshot(&mut changes)
        };
        let Err(failed) = self.write_locked(&mut written, snapshot) else {
            return Ok(());
        };
        let back = {
            let mut changes = self.quotas.lock_changes();
            undo();
            self.snapshot(&mut changes)
        };
        if let Err(e) = self.write_locked(&mut written, back) {
            warn!(error = %e, "the quota registry could not be saved back after a failed change; the next change saves it");
        }
        Err(failed)
    }

    /// The registry as the roots stand, numbered after the last one: taken under the
    /// change lock (`changes` is its guard), so numbers follow the order of the changes.
    pub(super) fn snapshot(&self, changes: &mut u64) -> Snapshot {
        *changes += 1;
        Snapshot {
            number: *changes,
            registry: registry_of(&self.quotas),
        }
    }

    /// Writes `snapshot` to local, durably, unless a later one is there already. Never
    /// under the change lock: it waits for the disk, and every directory rename takes
    /// that lock while any root exists.
    pub(super) fn write(&self, snapshot: Snapshot) -> Result<(), QuotaError> {
        self.write_locked(&mut self.written.lock(), snapshot)
    }

    /// [`Ledger::write`], with `written` held by the caller (`written` is its guard).
    fn write_locked(&self, written: &mut u64, snapshot: Snapshot) -> Result<(), QuotaError> {
        if *written >= snapshot.number {
            return Ok(());
        }
        persist::save(self.local.as_fd(), &snapshot.registry)?;
        *written = snapshot.number;
        Ok(())
    }
}

/// The registry at one moment, for [`Ledger::write`].
pub(super) struct Snapshot {
    number: u64,
    registry: Registry,
}

/// A file among `live` under `dir` that is open with FUSE passthrough.
fn passthrough_open_under<O: Object>(live: Vec<Arc<O>>, dir: &Path) -> Option<PathBuf> {
    live.iter()
        .filter(|o| o.tally(|_, opens| opens.passthrough > 0))
        .filter_map(|o| o.path())
        .find(|p| p.starts_with(dir))
}

/// The registry of `quotas`.
fn registry_of(quotas: &Quotas) -> Registry {
    Registry {
        version: 1,
        roots: quotas
            .list()
            .iter()
            .filter(|r| r.is_listed())
            .map(|r| {
                let (limit, usage) = (r.limit(), r.usage());
                persist::Entry {
                    path: r.path(),
                    limit: limit.bytes,
                    inode_limit: limit.inodes,
                    used: usage.bytes,
                    inodes_used: usage.inodes,
                }
            })
            .collect(),
    }
}

/// Loads the registry in the local root `local` into `quotas` and recounts every root's
/// usage from disk, so that a crash (whose last counts were never saved) leaves nothing
/// wrong. A root whose directory is gone loses its quota, with a warning; one that cannot
/// be counted for another reason (`EMFILE`, `EIO`) fails the load and keeps its quota.
/// Returns how many roots there are.
pub(super) fn load(quotas: &Quotas, local: BorrowedFd<'_>) -> Result<usize, QuotaError> {
    let registry = persist::load(local)?;
    let mut dropped = false;
    for entry in &registry.roots {
        let shown = entry.path.display().to_string();
        let found = open_local_dir(local, &entry.path).and_then(|fd| {
            let st = store::stat_fd(fd.as_fd())?;
            Ok((st, scan::usage(fd.as_fd())?))
        });
        let (st, usage) = match found {
            Ok(found) => found,
            // Not a directory any more: a symbolic link (`O_NOFOLLOW`) or another file.
            Err(e @ (Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP)) => {
                warn!(path = %shown, error = %e, "quota root is gone from local; its quota is dropped");
                dropped = true;
                continue;
            }
            Err(source) => {
                return Err(QuotaError::Sys {
                    path: shown,
                    source,
                })
            }
        };
        if usage.bytes != entry.used || usage.inodes != entry.inodes_used {
            info!(
                path = %shown,
                saved = entry.used,
                counted = usage.bytes,
                "quota usage recounted from disk"
            );
        }
        quotas.insert(Arc::new(QuotaRoot::new(
            st.st_dev,
            st.st_ino,
            entry.path.clone(),
            Limit {
                bytes: entry.limit,
                inodes: entry.inode_limit,
            },
            usage,
            quotas.errno(),
        )));
    }
    if dropped {
        persist::save(local, &registry_of(quotas))?;
    }
    Ok(quotas.list().len())
}

/// Opens a directory of local by its relative path, never following a symlink.
fn open_local_dir(root: BorrowedFd<'_>, path: &Path) -> Result<OwnedFd, Errno> {
    let mut fd = store::reopen(
        root,
        nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_DIRECTORY,
    )?;
    for part in path.components() {
        let Component::Normal(name) = part else {
            return Err(Errno::EINVAL);
        };
        fd = store::open_dir_at(fd.as_fd(), &store::cname(name)?)?;
    }
    Ok(fd)
}
