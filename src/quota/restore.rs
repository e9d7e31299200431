//! Restoring the quota roots at mount: the registry saved in local is read, and every
//! root's usage is recounted from disk.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::fcntl::OFlag;
use std::path::{Component, Path};
use std::sync::Arc;

use nix::errno::Errno;
use tracing::{info, warn};

use super::backend::Backend;
use super::error::QuotaError;
use super::persist::{self, Registry};
use super::qgroups::Qgroups;
use super::scan;
use super::table::{Limit, QuotaRoot, Quotas, Usage};
use crate::store;

/// The registry of `quotas`.
pub(super) fn registry_of(quotas: &Quotas) -> Registry {
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
                    backend: r.backend(),
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
pub(super) fn load(
    quotas: &Quotas,
    local: BorrowedFd<'_>,
    btrfs: Option<&Qgroups>,
) -> Result<usize, QuotaError> {
    let registry = persist::load(local)?;
    let mut dropped = false;
    for entry in &registry.roots {
        let shown = entry.path.display().to_string();
        let found = open_local_dir(local, &entry.path).and_then(|fd| {
            let kernel = match entry.backend {
                Backend::Btrfs => kernel_root(fd.as_fd(), entry, btrfs),
                Backend::Fuse => None,
            };
            let st = store::stat_fd(fd.as_fd())?;
            let usage = match kernel {
                Some(_) => Usage::default(),
                None => scan::usage(fd.as_fd())?,
            };
            Ok((st, usage, kernel))
        });
        let (st, usage, kernel) = match found {
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
        if kernel.is_none() && (usage.bytes != entry.used || usage.inodes != entry.inodes_used) {
            info!(
                path = %shown,
                saved = entry.used,
                counted = usage.bytes,
                "quota usage recounted from disk"
            );
        }
        let mut root = QuotaRoot::new(
            st.st_dev,
            st.st_ino,
            entry.path.clone(),
            Limit {
                bytes: entry.limit,
                inodes: entry.inode_limit,
            },
            usage,
            quotas.errno(),
        );
        if let Some(id) = kernel {
            root = root.enforced_by_btrfs(id);
        }
        dropped |= entry.backend != root.backend();
        quotas.insert(Arc::new(root));
    }
    if dropped {
        persist::save(local, &registry_of(quotas))?;
    }
    Ok(quotas.list().len())
}

/// The subvolume of a root saved as enforced by btrfs, with the saved limit in force
/// again (the registry is what was asked for; the qgroup may have been changed by hand,
/// or lost with its subvolume). None when the directory is no subvolume any more (it was
/// replaced by hand), or btrfs refuses: the FUSE backend then enforces the limit rather
/// than nothing.
fn kernel_root(
    dir: BorrowedFd<'_>,
    entry: &persist::Entry,
    btrfs: Option<&Qgroups>,
) -> Option<u64> {
    let shown = entry.path.display();
    let fallback = |why: &dyn std::fmt::Display| {
        warn!(path = %shown, reason = %why, "a btrfs quota root is enforced by the FUSE backend instead");
        None
    };
    let Some(btrfs) = btrfs else {
        return fallback(&"local is not on btrfs any more");
    };
    finish_conversion(dir, entry);
    let st = store::stat_fd(dir).ok()?;
    if !store::btrfs::is_subvolume(&st) {
        return fallback(&"its directory is not a subvolume any more");
    }
    let subvolume = store::reopen(dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY)
        .and_then(|fd| store::btrfs::subvolume_id(fd.as_fd()));
    let subvolume = match subvolume {
        Ok(id) => id,
        Err(e) => return fallback(&e),
    };
    match btrfs.limit(subvolume, Some(entry.limit)) {
        Ok(()) => Some(subvolume),
        Err(e) => fallback(&e),
    }
}

/// Removes what the conversion of a root's directory into a subvolume left when the daemon
/// stopped: the tree it replaced, or a copy that never took its place.
fn finish_conversion(dir: BorrowedFd<'_>, entry: &persist::Entry) {
    let shown = entry.path.display();
    let Some(name) = entry.path.file_name() else {
        return;
    };
    let parent = store::cname(name).and_then(|name| {
        let parent = store::open_at(dir, c"..", OFlag::O_PATH | OFlag::O_DIRECTORY, 0)?;
        Ok((parent, name))
    });
    let found = parent.and_then(|(parent, name)| {
        store::subvolume::finish(parent.as_fd(), &store::subvolume::temp_for(&name))
    });
    match found {
        Ok(store::subvolume::Leftover::Nothing) => {}
        Ok(found) => info!(path = %shown, ?found, "removed what an interrupted conversion left"),
        Err(e) => warn!(path = %shown, error = %e, "what an interrupted conversion left stays"),
    }
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
