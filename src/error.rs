//! Errors a user sees before or while mounting. Request-time errors are `Errno`s.

use std::path::PathBuf;

/// How every command refuses a caller who is not root, and how the control server refuses
/// a client: one wording, whichever side finds out first.
pub const ROOT_ONLY: &str = "permission denied (root only)";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("unknown mount option '{0}'")]
    UnknownOption(String),
    #[error("option '{option}': {reason}")]
    BadOption { option: String, reason: String },
    #[error("{what} {}: {reason}", path.display())]
    BadPath {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("mountpoint {} is busy: something is already mounted there", .0.display())]
    Busy(PathBuf),
    #[error(transparent)]
    LocalInUse(#[from] crate::local_lock::LockError),
    #[error(transparent)]
    DeadMount(#[from] crate::fs::kernel_mount::DeadMount),
    /// The caller is not root, and this system lets only root mount FUSE.
    #[error("{}: {}", .0.display(), ROOT_ONLY)]
    Denied(PathBuf),
    #[error("/dev/fuse is not usable ({0}); load the fuse module or run where FUSE is allowed")]
    NoFuse(String),
    #[error("mounting {}: {source}", path.display())]
    Mount {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("detaching the daemon: {0}")]
    Detach(#[source] std::io::Error),
    #[error("quotas in {}: {source}", local.display())]
    Quota {
        local: PathBuf,
        #[source]
        source: crate::quota::QuotaError,
    },
    #[error(transparent)]
    Expose(#[from] crate::expose::ExposeError),
    #[error("opening {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: nix::errno::Errno,
    },
}

pub type Result<T> = std::result::Result<T, Error>;
