//! Errors of the CSI driver and the gRPC status each one maps to.
//!
//! Every failure a client can see is one of these variants; the variant decides the status
//! code (per the CSI spec), the text is what a Kubernetes user reads in events.

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// A required field is missing, or a field's value is not acceptable.
    #[error("{0}")]
    InvalidArgument(String),
    /// The object the request names does not exist (or cannot be produced).
    #[error("{0}")]
    NotFound(String),
    /// The name is taken by an object that differs from the one requested.
    #[error("{0}")]
    AlreadyExists(String),
    /// The object is in a state that forbids the request (e.g. still in use).
    #[error("{0}")]
    FailedPrecondition(String),
    /// A size outside what the driver supports for this request.
    #[error("{0}")]
    OutOfRange(String),
    /// Work on the object is still in progress; retry later.
    #[error("{0}")]
    Aborted(String),
    /// A remote source could not be reached; retry later.
    #[error("{0}")]
    Unavailable(String),
    /// No space left for the request.
    #[error("{0}")]
    ResourceExhausted(String),
    /// Stored data no longer matches what was recorded when it was written.
    #[error("{0}")]
    DataLoss(String),
    /// A local operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// An external tool (qemu-img, losetup, mount, mkfs) failed.
    #[error("{0}")]
    Internal(String),
}

impl CsiError {
    /// Wraps an I/O error with what was being done. The errors that say the request is too
    /// big for this node get the codes the CSI spec gives them: no space or quota left is
    /// `RESOURCE_EXHAUSTED`; a file larger than the filesystem can hold is `OUT_OF_RANGE`
    /// (a capacity the driver does not support), which a retry cannot fix.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        let context = context.into();
        match source.raw_os_error() {
            Some(libc::ENOSPC) => {
                CsiError::ResourceExhausted(format!("{context}: no space left on device"))
            }
            Some(libc::EDQUOT) => {
                CsiError::ResourceExhausted(format!("{context}: disk quota exceeded"))
            }
            Some(libc::EFBIG) => CsiError::OutOfRange(format!(
                "{context}: larger than the filesystem holding the volumes allows"
            )),
            _ => CsiError::Io { context, source },
        }
    }

    pub fn code(&self) -> Code {
        match self {
            CsiError::InvalidArgument(_) => Code::InvalidArgument,
            CsiError::NotFound(_) => Code::NotFound,
            CsiError::AlreadyExists(_) => Code::AlreadyExists,
            CsiError::FailedPrecondition(_) => Code::FailedPrecondition,
            CsiError::OutOfRange(_) => Code::OutOfRange,
            CsiError::Aborted(_) => Code::Aborted,
            CsiError::Unavailable(_) => Code::Unavailable,
            CsiError::ResourceExhausted(_) => Code::ResourceExhausted,
            CsiError::DataLoss(_) => Code::DataLoss,
            CsiError::Io { .. } | CsiError::Internal(_) => Code::Internal,
        }
    }
}

impl From<CsiError> for Status {
    fn from(e: CsiError) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, CsiError>;

/// An error kept to be told later: remembered for the next call, or handed to those waiting
/// for a job.
#[derive(Debug, Clone)]
pub struct Failure {
    pub code: Code,
    pub message: String,
}

impl From<&CsiError> for Failure {
    fn from(e: &CsiError) -> Failure {
        Failure {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

impl From<Failure> for CsiError {
    fn from(f: Failure) -> CsiError {
        match f.code {
            Code::InvalidArgument => CsiError::InvalidArgument(f.message),
            Code::NotFound => CsiError::NotFound(f.message),
            Code::AlreadyExists => CsiError::AlreadyExists(f.message),
            Code::FailedPrecondition => CsiError::FailedPrecondition(f.message),
            Code::OutOfRange => CsiError::OutOfRange(f.message),
            Code::Aborted => CsiError::Aborted(f.message),
            Code::Unavailable => CsiError::Unavailable(f.message),
            Code::ResourceExhausted => CsiError::ResourceExhausted(f.message),
            Code::DataLoss => CsiError::DataLoss(f.message),
            _ => CsiError::Internal(f.message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code_of(errno: i32) -> Code {
        CsiError::io("sizing disk", std::io::Error::from_raw_os_error(errno)).code()
    }

    #[test]
    fn a_file_too_large_for_the_store_is_out_of_range() {
        assert_eq!(code_of(libc::EFBIG), Code::OutOfRange);
    }

    #[test]
    fn running_out_of_space_or_quota_is_resource_exhausted() {
        assert_eq!(code_of(libc::ENOSPC), Code::ResourceExhausted);
        assert_eq!(code_of(libc::EDQUOT), Code::ResourceExhausted);
    }

    #[test]
    fn other_io_errors_stay_internal() {
        assert_eq!(code_of(libc::EIO), Code::Internal);
        assert_eq!(code_of(libc::EACCES), Code::Internal);
    }

    #[test]
    fn the_status_keeps_what_was_being_done() {
        let status = Status::from(CsiError::io(
            "sizing disk",
            std::io::Error::from_raw_os_error(libc::EFBIG),
        ));
        assert_eq!(status.code(), Code::OutOfRange);
        assert!(status.message().starts_with("sizing disk: "), "{status:?}");
    }
}
