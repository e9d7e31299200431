//! One daemon per local tree. Two daemons writing the same local directory would each keep
//! their own idea of it (inode tables, quota usage, whiteouts in flight) and corrupt it, so
//! a daemon holds an exclusive `flock` on the local root for as long as it serves. The
//! kernel drops the lock when the daemon exits, however it dies, so a crash never leaves
//! the tree locked.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

/// How long a new mount waits for a daemon that is finishing (its mount already gone, as
/// right after `umount`) to let go of the tree.
const HANDOVER: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "local directory {} is in use by {} (two daemons over one local tree would corrupt it)",
        local.display(),
        by.as_ref().map_or("another layerfs daemon".to_owned(), |m| format!("the layerfs mount at {}", m.display()))
    )]
    InUse {
        local: PathBuf,
        /// The mountpoint of the mount using it, when it could be found.
        by: Option<PathBuf>,
    },
    #[error("locking local directory {}: {source}", local.display())]
    Lock { local: PathBuf, source: Errno },
}

/// The lock on a local tree; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct LocalLock {
    _dir: OwnedFd,
}

/// Takes the lock on `local` (canonical). If a live mount uses the tree (`mount_using`
/// names it: the control socket knows), fails at once, naming it; otherwise the holder is
/// a daemon on its way out, and is waited for.
pub fn take(
    local: &Path,
    mount_using: impl Fn(&Path) -> Option<PathBuf>,
) -> Result<LocalLock, LockError> {
    let failed = |source| LockError::Lock {
        local: local.to_owned(),
        source,
    };
    // Not O_PATH: flock needs a descriptor opened for reading.
    let dir = nix::fcntl::open(
        local,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(failed)?;
    let deadline = Instant::now() + HANDOVER;
    let mut looked = false;
    loop {
        // SAFETY: flock on a descriptor this function owns.
        let rc = unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(LocalLock { _dir: dir });
        }
        match Errno::last() {
            Errno::EWOULDBLOCK => {}
            Errno::EINTR => continue,
            e => return Err(failed(e)),
        }
        if !looked {
            looked = true;
            if let Some(by) = mount_using(local) {
                return Err(LockError::InUse {
                    local: local.to_owned(),
                    by: Some(by),
                });
            }
            tracing::info!(local = %local.display(), "waiting for the previous daemon of this local tree to finish");
        }
        if Instant::now() >= deadline {
            return Err(LockError::InUse {
                local: local.to_owned(),
                by: None,
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
