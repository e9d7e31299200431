//! What publishing an image can fail with. Every message names the path or the object at
//! fault, so an operator knows where to look.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("invalid graph driver name {0:?}")]
    BadDriver(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no image {image:?} in {root} (not an id, a unique id prefix or a name)")]
    UnknownImage { image: String, root: PathBuf },
    #[error("image {image:?} is ambiguous in {root}: it matches {}", .candidates.join(", "))]
    Ambiguous {
        image: String,
        root: PathBuf,
        candidates: Vec<String>,
    },
    #[error("{path}: {reason}")]
    BadSource { path: PathBuf, reason: String },
    #[error("image {id} in {root} is not complete, refusing to publish it: {reason}")]
    SourceNotReady {
        id: String,
        root: PathBuf,
        reason: String,
    },
    #[error(
        "{path} holds another layer under the id {id} ({detail}); refusing to publish over it"
    )]
    Conflict {
        path: PathBuf,
        id: String,
        detail: String,
    },
    #[error(
        "{path} is not ready after waiting {}s, and is not this publisher's to replace: \
         {reason}", .waited.as_secs()
    )]
    RemoteNotReady {
        path: PathBuf,
        reason: String,
        waited: Duration,
    },
}

pub type Result<T, E = PublishError> = std::result::Result<T, E>;

/// Attaches a path to an I/O error.
pub(crate) fn io_at(path: &Path) -> impl FnOnce(io::Error) -> PublishError + '_ {
    move |source| PublishError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Attaches a path to an errno.
pub(crate) fn sys_at(path: &Path) -> impl FnOnce(Errno) -> PublishError + '_ {
    move |errno| PublishError::Io {
        path: path.to_owned(),
        source: io::Error::from(errno),
    }
}
