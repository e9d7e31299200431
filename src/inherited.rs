//! What a mount's process inherited from whoever started it, put right before it opens
//! anything of its own.
//!
//! A descriptor a caller leaves without close-on-exec (a file it forgot, make's or cargo's
//! jobserver pipe, a service manager's stray) would stay open in the daemon for as long as
//! the mount lives: it holds its file, keeps a pipe's reader from seeing its end, and counts
//! against the daemon's open-file limit, from which the daemon cuts its budget for nodes.
//! So every descriptor is closed but the standard three and those the process was handed on
//! purpose (a keeper's, see `keeper::Kept`). The standard three, if the process was started
//! with them closed, the Rust runtime has already opened on `/dev/null`.
//!
//! They are found in `/proc/self/fd`, which the daemon needs anyway (it reopens files
//! through it).

use std::os::fd::RawFd;
use std::path::PathBuf;

/// A descriptor that was closed, and what it was open on (when `/proc` could say).
#[derive(Debug)]
pub struct Closed {
    pub fd: RawFd,
    pub target: Option<PathBuf>,
}

/// Closes every descriptor but 0, 1, 2 and `keep`. Returns what it closed; fails, closing
/// nothing, when `/proc/self/fd` cannot be read.
///
/// # Safety
///
/// Nothing in the process may own a descriptor other than the standard three and `keep`:
/// whatever owned one would go on using a number that is closed, or that names another
/// file once it is reused. Call it first thing, before any thread or file exists.
pub unsafe fn close_all_but(keep: &[RawFd]) -> std::io::Result<Vec<Closed>> {
    let kept = |fd: RawFd| fd <= 2 || keep.contains(&fd);
    let closed = open_descriptors()?
        .into_iter()
        .filter(|fd| !kept(*fd))
        .map(|fd| {
            let target = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok();
            // SAFETY: the caller vouches that nothing owns `fd`.
            unsafe { libc::close(fd) };
            Closed { fd, target }
        })
        .collect();
    Ok(closed)
}

/// The descriptors open now, from `/proc/self/fd`. The directory's own descriptor is among
/// the names read, and closed once they are all read, so it is left out by checking each.
fn open_descriptors() -> std::io::Result<Vec<RawFd>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd")? {
        if let Some(fd) = entry?.file_name().to_str().and_then(|n| n.parse().ok()) {
            names.push(fd);
        }
    }
    Ok(names.into_iter().filter(|fd| is_open(*fd)).collect())
}

fn is_open(fd: RawFd) -> bool {
    // SAFETY: F_GETFD only reads the descriptor's flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    flags != -1
}
