//! What setting or clearing a quota can fail with, and the errno each answers the xattr
//! interface with.

use nix::errno::Errno;

use super::persist;
use super::size::SizeError;

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
    #[error(
        "{file} is open, and would go on writing into the tree that {path} loses when it \
         becomes a btrfs subvolume for its quota; close it first"
    )]
    InUse { path: String, file: String },
    #[error("{path}: {reason}")]
    Backend { path: String, reason: String },
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
            QuotaError::Inside { .. }
            | QuotaError::Contains { .. }
            | QuotaError::Busy { .. }
            | QuotaError::InUse { .. } => Errno::EBUSY,
            QuotaError::NotRoot { .. } => Errno::ENODATA,
            QuotaError::Size(_) | QuotaError::Backend { .. } => Errno::EINVAL,
            QuotaError::Save(_) => Errno::EIO,
        }
    }
}
