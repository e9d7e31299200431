//! What can go wrong, and the gRPC status containerd expects for it.
//!
//! containerd turns a status back into its own error kinds (`errdefs.FromGRPC`), and acts
//! on a few of them: NotFound from Stat lets an unpack go on, AlreadyExists from a labelled
//! Prepare adopts a remote snapshot, FailedPrecondition from Remove is tolerated by garbage
//! collection. The codes below follow containerd's own overlay snapshotter.

use std::io;

use layerfs::quota::storage::StorageError;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}: not found")]
    NotFound(String),
    #[error("{0}: already exists")]
    AlreadyExists(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// Something the snapshotter depends on (the layerfs mount) does not answer.
    #[error("{0}")]
    Unavailable(String),
    #[error("the snapshot table is damaged: {0}")]
    Corrupt(String),
    #[error("{what}: {cause}")]
    Io { what: String, cause: io::Error },
    #[error(transparent)]
    Quota(#[from] StorageError),
}

impl Error {
    pub fn io(what: impl Into<String>, cause: io::Error) -> Error {
        Error::Io {
            what: what.into(),
            cause,
        }
    }

    /// Whether it failed for want of space (the filesystem's, or a quota's).
    pub fn is_out_of_space(&self) -> bool {
        let cause = match self {
            Error::Io { cause, .. } => cause,
            Error::Quota(StorageError::Create { cause, .. }) => cause,
            _ => return false,
        };
        matches!(
            cause.raw_os_error(),
            Some(libc::ENOSPC) | Some(libc::EDQUOT)
        )
    }

    pub fn code(&self) -> Code {
        if self.is_out_of_space() {
            return Code::ResourceExhausted;
        }
        match self {
            Error::NotFound(_) => Code::NotFound,
            Error::AlreadyExists(_) => Code::AlreadyExists,
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::Unavailable(_) => Code::Unavailable,
            Error::Corrupt(_) => Code::Internal,
            Error::Io { .. } => Code::Internal,
            Error::Quota(e) => match e {
                StorageError::Size(_)
                | StorageError::InodesWithoutSize
                | StorageError::BadKey(_)
                | StorageError::Outside { .. } => Code::InvalidArgument,
                // A strict quota request where quotas cannot be enforced: nothing was made.
                StorageError::Unsupported { .. } => Code::FailedPrecondition,
                StorageError::Backend(_) => Code::Unavailable,
                StorageError::Create { .. } | StorageError::Remove { .. } => Code::Internal,
                StorageError::Apply { .. } => Code::Internal,
            },
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_the_ones_containerd_acts_on() {
        assert_eq!(Error::NotFound("k".into()).code(), Code::NotFound);
        assert_eq!(Error::AlreadyExists("k".into()).code(), Code::AlreadyExists);
        let full = Error::io("writing", io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(full.code(), Code::ResourceExhausted);
        let full = Error::Quota(StorageError::Create {
            dir: "/d".into(),
            cause: io::Error::from_raw_os_error(libc::ENOSPC),
        });
        assert_eq!(full.code(), Code::ResourceExhausted);
        let strict = Error::Quota(StorageError::Unsupported {
            dir: "/d".into(),
            reason: "plain".into(),
        });
        assert_eq!(strict.code(), Code::FailedPrecondition);
        let status = Status::from(Error::NotFound("snapshot x".into()));
        assert_eq!(status.message(), "snapshot x: not found");
    }
}
