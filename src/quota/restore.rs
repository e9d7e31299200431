//! Restoring the quota roots at mount: the registry saved in local is read, and every
//! root's usage is recounted from disk.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path};
use std::sync::Arc;

use nix::errno::Errno;
use tracing::{info, warn};

use super::error::QuotaError;
use super::persist::{self, Registry};
use super::scan;
use super::table::{Limit, QuotaRoot, Quotas};
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
