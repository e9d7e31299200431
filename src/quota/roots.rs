//! Setting and clearing quota roots, and saving the registry of them in local when they
//! change (it is loaded at mount by `restore`).

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use tracing::{info, warn};

use super::error::QuotaError;
use super::kernel::no_inode_limits;
use super::ledger::Ledger;
use super::persist::{self, Registry};
use super::restore::registry_of;
use super::scan;
use super::seam::Object;
use super::table::{Limit, QuotaRoot};
use crate::report::QuotaInfo;
use crate::store::{self, btrfs};

/// The attribute through which a runtime sets a directory's quota without our CLI.
pub const QUOTA_XATTR: &[u8] = b"user.layerfs.quota";

impl Ledger {
    /// See [`super::Accounting::set`].
    pub(super) fn set_root<O: Object>(
        &self,
        dir: &Arc<O>,
        local: impl FnOnce() -> Result<Arc<OwnedFd>, Errno>,
        subvolume: impl FnOnce() -> Result<Arc<OwnedFd>, QuotaError>,
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
        let mut local = local().map_err(sys)?;
        {
            let changes = self.quotas.lock_changes();
            if let Some(root) = self.own_root(&**dir) {
                drop(changes);
                return self.change_limit(&root, limit, &shown);
            }
            self.check_nesting(dir, &path, &shown)?;
        }
        let by_btrfs = self.wants_btrfs(local.as_fd(), limit, &shown)?;
        if by_btrfs && !btrfs::is_subvolume(&store::stat_fd(local.as_fd()).map_err(sys)?) {
            // Converted with no lock held: only other settings and clearings wait for it.
            local = subvolume()?;
        }
        let st = store::stat_fd(local.as_fd()).map_err(sys)?;
        let kernel = match by_btrfs {
            true => Some(self.limit_subvolume(local.as_fd(), limit, &shown)?),
            false => None,
        };
        let unlimit = |root: &QuotaRoot| {
            if let Err(e) = self.kernel_limit(root, None) {
                warn!(path = %shown, error = %e, "a btrfs limit stays on a directory that is no quota root");
            }
        };
        let root = {
            let changes = self.quotas.lock_changes();
            let mut root = QuotaRoot::new(
                st.st_dev,
                st.st_ino,
                path.clone(),
                limit,
                Default::default(),
                self.quotas.errno(),
            );
            if let Some(id) = kernel {
                root = root.enforced_by_btrfs(id);
            }
            // A rename may have nested it meanwhile.
            if let Err(e) = self.check_nesting(dir, &path, &shown) {
                drop(changes);
                unlimit(&root);
                return Err(e);
            }
            // Listed once its usage is counted and saved: a registry another change saves
            // meanwhile must not carry a root this call may still withdraw.
            root.set_listed(false);
            let root = Arc::new(root);
            self.quotas.insert(root.clone());
            root
        };
        let withdraw = |e: QuotaError| {
            {
                let _changes = self.quotas.lock_changes();
                self.quotas.remove(st.st_dev, st.st_ino);
            }
            unlimit(&root);
            e
        };
        if !root.by_kernel() {
            // Writes that bypass the daemon could not be counted.
            if let Some(file) = passthrough_open_under(live(), &path) {
                return Err(withdraw(QuotaError::Busy {
                    path: shown.clone(),
                    file: file.display().to_string(),
                }));
            }
            let usage = scan::usage(local.as_fd()).map_err(|e| withdraw(sys(e)))?;
            root.charge(usage.bytes as i64);
            root.charge_inodes(usage.inodes as i64);
        }
        self.save_change(
            || root.set_listed(true),
            || {
                self.quotas.remove(st.st_dev, st.st_ino);
            },
        )
        .inspect_err(|_| unlimit(&root))?;
        let info = self.describe(&root);
        info!(path = %shown, limit = limit.bytes, used = info.used, backend = %info.backend, "quota set");
        Ok(info)
    }

    /// A new limit for an existing root.
    fn change_limit(
        &self,
        root: &QuotaRoot,
        limit: Limit,
        shown: &str,
    ) -> Result<QuotaInfo, QuotaError> {
        if root.by_kernel() && limit.inodes.is_some() {
            return Err(no_inode_limits(shown));
        }
        let before = root.limit();
        self.kernel_limit(root, Some(limit.bytes))
            .map_err(|source| QuotaError::Sys {
                path: shown.to_owned(),
                source,
            })?;
        let old = std::cell::Cell::new(limit);
        let saved = self.save_change(
            || old.set(root.set_limit(limit)),
            || {
                if root.limit() == limit {
                    root.set_limit(old.get());
                }
            },
        );
        if let Err(e) = saved {
            let _ = self.kernel_limit(root, Some(before.bytes));
            return Err(e);
        }
        info!(path = %shown, limit = limit.bytes, "quota changed");
        Ok(self.describe(root))
    }

    /// Quota roots do not nest: `dir` (at `path`) may be neither inside nor above one.
    /// Under the change lock.
    fn check_nesting<O: Object>(
        &self,
        dir: &Arc<O>,
        path: &Path,
        shown: &str,
    ) -> Result<(), QuotaError> {
        if let Some(above) = dir.parent().and_then(|p| self.root_of(&p)) {
            return Err(QuotaError::Inside {
                path: shown.to_owned(),
                root: above.path().display().to_string(),
            });
        }
        if let Some(below) = self.quotas.roots_under(path).first() {
            return Err(QuotaError::Contains {
                path: shown.to_owned(),
                root: below.path().display().to_string(),
            });
        }
        Ok(())
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
        let sys = |source| QuotaError::Sys {
            path: path.clone(),
            source,
        };
        // The subvolume stays: the directory is as it was, without its limit.
        self.kernel_limit(&root, None).map_err(sys)?;
        // Enforced until the registry without it is on disk: writes meanwhile are
        // counted, so a root that stays (the save failed) keeps an exact usage.
        if let Err(e) = self.save_change(|| root.set_listed(false), || root.set_listed(true)) {
            let _ = self.kernel_limit(&root, Some(root.limit().bytes));
            return Err(e);
        }
        {
            let _changes = self.quotas.lock_changes();
            self.quotas.remove(root.dev, root.ino);
        }
        info!(path = %path, "quota cleared");
        Ok(self.describe(&root))
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
