//! The publication journal (DESIGN §14): how a writer host tells readers on other hosts what
//! it made ready, without readers scanning the shared tree to find out.
//!
//! It lives in the remote, in `layerfs-journal/`:
//!
//! - `<publisher>.<generation>.log`: segments, each appended to by one publisher only
//!   ([`segment`]), a line per record ([`record`]);
//! - `bell`: a fixed-size file every publisher rewrites after appending, and at least every
//!   [`HEARTBEAT`] while idle ([`bell`]).
//!
//! A reader polls the bell only (one request per poll), and reads segments when it rang
//! ([`follow`]). A publisher's records are durable before its ring, and its ring before any
//! reader acts on the records; what a reader then looks at in the remote is what the
//! publisher judged ready, read afresh by the reader's own rules.

pub mod bell;
pub mod follow;
pub mod record;
pub mod segment;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// The journal's directory, in the remote root.
pub const DIR: &str = "layerfs-journal";

/// The bell's file name in [`DIR`].
pub const BELL: &str = "bell";

/// A publisher rings at least this often, so readers can tell a quiet publisher from a
/// dead one.
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// Why the journal could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    // The cause is in the message, not in a source chain, which would print it twice.
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("publisher name {0:?}: use letters, digits, '-' and '_' (at most 64)")]
    BadName(String),
}

/// The journal directory of the remote at `remote`.
pub fn dir_of(remote: &Path) -> PathBuf {
    remote.join(DIR)
}

/// Milliseconds since the epoch, as records carry them.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A page of memory aligned as `O_DIRECT` wants its buffers.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
pub(crate) struct Page(pub(crate) [u8; PAGE]);

pub(crate) const PAGE: usize = 4096;

/// `pages` as one byte slice.
pub(crate) fn bytes_of(pages: &mut [Page]) -> &mut [u8] {
    // SAFETY: `Page` is a `repr(C)` array of bytes with no padding (its size is its
    // alignment), so `pages` is `pages.len() * PAGE` initialized bytes, borrowed mutably
    // for the lifetime of the result.
    unsafe { std::slice::from_raw_parts_mut(pages.as_mut_ptr().cast::<u8>(), pages.len() * PAGE) }
}

/// Opens `path` for reading with `O_DIRECT` where the filesystem takes it (`true`), else
/// plainly. A direct read goes to the server, whatever the client cached of the file's
/// pages or of its size.
pub(crate) fn open_direct(path: &Path) -> std::io::Result<(std::fs::File, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    let open = |flags| {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | flags)
            .open(path)
    };
    match open(libc::O_DIRECT) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((open(0)?, false)),
        other => other.map(|f| (f, true)),
    }
}

/// Makes a directory's entries durable (a created or renamed name survives a crash).
pub(crate) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}
