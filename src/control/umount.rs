//! `layerfs umount MOUNTPOINT`: a graceful stop. The filesystem is unmounted the ordinary
//! way (refused while it is busy, never detached lazily behind the caller's back), then the
//! command waits until the daemon has finished: its control socket, removed as the daemon's
//! last step after the kernel's final request, is the sign.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;

use super::{client, socket_path};

#[derive(Debug, thiserror::Error)]
pub enum UmountError {
    #[error("no layerfs mount at {} (no control socket at {})", mountpoint.display(), socket.display())]
    NotLayerfs {
        mountpoint: PathBuf,
        socket: PathBuf,
    },
    #[error("{}: {}", .0.display(), super::protocol::ROOT_ONLY)]
    Denied(PathBuf),
    #[error("{} is busy: processes still use it (fuser -vm {} lists them; umount -l detaches it lazily)", .0.display(), .0.display())]
    Busy(PathBuf),
    #[error("unmounting {}: {source}", mountpoint.display())]
    Unmount { mountpoint: PathBuf, source: Errno },
    #[error("{} is unmounted, but its daemon has not finished after {} s", mountpoint.display(), waited.as_secs())]
    Lingering {
        mountpoint: PathBuf,
        waited: Duration,
    },
}

/// Unmounts the layerfs mount at `mountpoint` and waits up to `wait` for its daemon to end.
pub fn umount(mountpoint: &Path, wait: Duration) -> Result<PathBuf, UmountError> {
    let mountpoint = client::resolve_mountpoint(mountpoint);
    let socket = socket_path(&mountpoint);
    // The run dir is root's: a caller kept out of it cannot tell whether a mount is there.
    match std::fs::symlink_metadata(&socket) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Err(UmountError::Denied(mountpoint))
        }
        Err(_) => return Err(UmountError::NotLayerfs { mountpoint, socket }),
    }
    match nix::mount::umount2(&mountpoint, nix::mount::MntFlags::empty()) {
        Ok(()) => {}
        Err(Errno::EBUSY) => return Err(UmountError::Busy(mountpoint)),
        Err(Errno::EPERM) => return Err(UmountError::Denied(mountpoint)),
        Err(source) => return Err(UmountError::Unmount { mountpoint, source }),
    }
    let deadline = Instant::now() + wait;
    while socket.exists() {
        if Instant::now() >= deadline {
            return Err(UmountError::Lingering {
                mountpoint,
                waited: wait,
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(mountpoint)
}
