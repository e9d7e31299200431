//! The set of quota roots as kept on disk: the errors of setting and clearing roots, the
//! attribute through which a runtime sets one, and the registry saved and loaded.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path};
use std::sync::Arc;

use nix::errno::Errno;
use tracing::{info, warn};

use super::persist::{self, Registry};
use super::scan;
use super::size::SizeError;
use super::table::{Limit, QuotaRoot, Quotas};
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

/// Writes the registry of `quotas` to the local root `local`.
pub fn save(quotas: &Quotas, local: BorrowedFd<'_>) -> Result<(), QuotaError> {
    let registry = Registry {
        version: 1,
        roots: quotas
            .list()
            .iter()
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
    };
    Ok(persist::save(local, &registry)?)
}

/// Loads the registry in the local root `local` into `quotas` and recounts every root's
/// usage from disk, so that a crash (whose last counts were never saved) leaves nothing
/// wrong. A root whose directory is gone loses its quota, with a warning. Returns how many
/// roots there are.
pub fn load(quotas: &Quotas, local: BorrowedFd<'_>) -> Result<usize, QuotaError> {
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
            Err(e) => {
                warn!(path = %shown, error = %e, "quota root is gone from local; its quota is dropped");
                dropped = true;
                continue;
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
        save(quotas, local)?;
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
