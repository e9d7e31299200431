//! `layerfs umount MOUNTPOINT`: a graceful stop. The filesystem is unmounted the ordinary
//! way (refused while it is busy, never detached lazily behind the caller's back), then the
//! command waits until the daemon has finished: its control socket, removed as the daemon's
//! last step after the kernel's final request, is the sign.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;

use super::socket_path;

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
    #[error("{} is busy: mounted inside it: {}; unmount {} first", mountpoint.display(), list(inner), if inner.len() == 1 { "it" } else { "them" })]
    BusyWithMounts {
        mountpoint: PathBuf,
        /// The mounts below the mountpoint, as (fstype, mountpoint), in mount order.
        inner: Vec<(String, PathBuf)>,
    },
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
    let mountpoint = crate::store::mountinfo::resolve_mountpoint(mountpoint);
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
        Err(Errno::EBUSY) => {
            let inner = mounts_inside(&mountpoint);
            return Err(if inner.is_empty() {
                UmountError::Busy(mountpoint)
            } else {
                UmountError::BusyWithMounts { mountpoint, inner }
            });
        }
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

/// The mounts stacked below `mountpoint` (a container's overlay on a layer dir, a bind
/// mount): each keeps the view busy, and unlike a process holding a file, the kernel names
/// them.
fn mounts_inside(mountpoint: &Path) -> Vec<(String, PathBuf)> {
    crate::store::mountinfo::current()
        .into_iter()
        .filter(|m| m.point != mountpoint && m.point.starts_with(mountpoint))
        .map(|m| (m.fstype, m.point))
        .collect()
}

/// `overlay on /a, tmpfs on /b`, shortened past a few.
fn list(inner: &[(String, PathBuf)]) -> String {
    const SHOWN: usize = 5;
    let mut text = inner
        .iter()
        .take(SHOWN)
        .map(|(fstype, point)| format!("{fstype} on {}", point.display()))
        .collect::<Vec<_>>()
        .join(", ");
    if inner.len() > SHOWN {
        text.push_str(&format!(" and {} more", inner.len() - SHOWN));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inner_mounts_are_listed_shortly() {
        let one = vec![("overlay".to_owned(), PathBuf::from("/v/overlay/c1/merged"))];
        assert_eq!(list(&one), "overlay on /v/overlay/c1/merged");
        let many: Vec<_> = (0..7)
            .map(|i| ("tmpfs".to_owned(), PathBuf::from(format!("/v/{i}"))))
            .collect();
        let text = list(&many);
        assert!(text.starts_with("tmpfs on /v/0, tmpfs on /v/1"), "{text}");
        assert!(text.ends_with("tmpfs on /v/4 and 2 more"), "{text}");
    }
}
