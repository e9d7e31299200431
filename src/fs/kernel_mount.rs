//! The kernel mount of a FUSE session, made and removed by layerfs itself when it runs as
//! root.
//!
//! fuser's own mount unmounts by path when its session ends, even when the session ended
//! because somebody ran `umount`: by then a new mount may stand at that path (a quick
//! remount, a service restart), and it is the new one that goes. Mounting ourselves, the
//! mount is only ever removed on request (a signal). A daemon that stops on an error
//! leaves its mount behind, dead (`ENOTCONN`), for `umount` to remove, as any FUSE
//! daemon that dies does: checking whether the mount at that path is still ours would mean
//! asking the filesystem there, which may be a new mount not serving yet.
//!
//! The next mount at that path takes it back ([`reclaim_dead`]): a layerfs mount whose
//! root answers `ENOTCONN` has lost its daemon for good, so detaching it costs nobody
//! anything. A dead mount of another filesystem is left alone, and named.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::mount::MsFlags;
use nix::sys::stat::Mode;

use crate::store::atime::{AccessTimes, Atime};

/// The filesystem type layerfs mounts as (`/proc/mounts` and `findmnt` show it).
pub const FSTYPE: &str = "fuse.layerfs";

/// What the kernel needs to know about a mount.
#[derive(Debug, Clone)]
pub struct MountSpec<'a> {
    pub mountpoint: &'a Path,
    /// The source shown in `/proc/mounts`.
    pub fsname: &'a str,
    /// Let users other than the mounter in (the daemon's ACL narrows it further).
    pub allow_other: bool,
    pub read_only: bool,
    pub suid: bool,
    pub dev: bool,
    /// Shown in `/proc/mounts`; the daemon applies it (see `store::atime`).
    pub atime: AccessTimes,
}

/// A live mount of ours.
#[derive(Debug)]
pub struct KernelMount {
    mountpoint: PathBuf,
}

/// Opens `/dev/fuse` and mounts it at the mountpoint as `fuse.layerfs`; the returned fd is
/// the session's channel (the kernel queues its INIT request on it).
pub fn mount(spec: &MountSpec<'_>) -> Result<(OwnedFd, KernelMount), Errno> {
    let device = nix::fcntl::open("/dev/fuse", OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty())?;
    let root = nix::sys::stat::stat(spec.mountpoint)?;
    let mut data = format!(
        "fd={},rootmode={:o},user_id={},group_id={},default_permissions",
        device.as_raw_fd(),
        root.st_mode & libc::S_IFMT,
        nix::unistd::getuid(),
        nix::unistd::getgid(),
    );
    if spec.allow_other {
        data.push_str(",allow_other");
    }
    let mut flags = MsFlags::empty();
    flags.set(MsFlags::MS_RDONLY, spec.read_only);
    flags.set(MsFlags::MS_NOSUID, !spec.suid);
    flags.set(MsFlags::MS_NODEV, !spec.dev);
    flags |= match spec.atime.files {
        Atime::NoAtime => MsFlags::MS_NOATIME,
        Atime::RelAtime => MsFlags::MS_RELATIME,
        Atime::StrictAtime => MsFlags::MS_STRICTATIME,
    };
    flags.set(MsFlags::MS_NODIRATIME, !spec.atime.dirs);
    // Commas would split the kernel's option string; the source is for display only.
    let source = spec.fsname.replace(',', "_");
    nix::mount::mount(
        Some(source.as_str()),
        spec.mountpoint,
        Some(FSTYPE),
        flags,
        Some(data.as_str()),
    )?;
    Ok((
        device,
        KernelMount {
            mountpoint: spec.mountpoint.to_owned(),
        },
    ))
}

impl KernelMount {
    /// The mount at `mountpoint`, made by another process of ours (a keeper).
    pub fn at(mountpoint: &Path) -> KernelMount {
        KernelMount {
            mountpoint: mountpoint.to_owned(),
        }
    }

    /// Unmounts, as `umount` would (a busy mount stays).
    pub fn unmount(&self) -> Result<(), Errno> {
        nix::mount::umount(self.mountpoint.as_path())
    }
}

/// A mount at the mountpoint whose daemon is gone, and why it stays.
#[derive(Debug, thiserror::Error)]
#[error(
    "mountpoint {}: a dead {fstype} mount of {source_name} is still there (its daemon is gone; stat says ENOTCONN) and {why}; `umount -l {}` clears it",
    mountpoint.display(),
    mountpoint.display()
)]
pub struct DeadMount {
    pub mountpoint: PathBuf,
    pub fstype: String,
    /// The mount's source, as `/proc/mounts` shows it.
    pub source_name: String,
    /// Why it was not detached.
    pub why: String,
}

/// Detaches a dead layerfs mount standing exactly at `mountpoint`, so that a new mount can
/// take its place. Nothing is done unless the mountpoint answers `ENOTCONN`; the dead mount
/// must be the top one at that path and `fuse.layerfs`. Returns whether one was detached.
pub fn reclaim_dead(mountpoint: &Path) -> Result<bool, DeadMount> {
    // A request caught in flight as the connection ends gets ECONNABORTED; later ones ENOTCONN.
    if !matches!(
        ask_root(mountpoint),
        Err(Errno::ENOTCONN | Errno::ECONNABORTED)
    ) {
        return Ok(false);
    }
    // The path cannot be resolved through the dead mount itself, only up to it.
    let point = crate::store::mountinfo::resolve_mountpoint(mountpoint);
    let top = crate::store::mountinfo::current()
        .into_iter()
        .rfind(|m| m.point == point);
    // Dead higher up (a parent is the dead mount): not ours to judge from here.
    let Some(top) = top else {
        return Ok(false);
    };
    let dead = |why: String| DeadMount {
        mountpoint: point.clone(),
        fstype: top.fstype.clone(),
        source_name: top.source.clone(),
        why,
    };
    if top.fstype != FSTYPE {
        return Err(dead("it is not layerfs's to remove".into()));
    }
    match nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH) {
        Ok(()) => {
            tracing::info!(
                mountpoint = %point.display(),
                source = %top.source,
                "detached the dead mount a killed daemon left"
            );
            Ok(true)
        }
        Err(Errno::EPERM) => Err(dead("only root can detach it".into())),
        Err(e) => Err(dead(format!("detaching it failed: {e}"))),
    }
}

/// `stat` of `path` that reaches the filesystem: the kernel keeps answering from attributes
/// it cached before the daemon died, so only a forced round trip tells a dead mount.
pub fn ask_root(path: &Path) -> Result<(), Errno> {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return Err(Errno::EINVAL);
    };
    // SAFETY: zeroed plain data, written by the kernel.
    let mut buf: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a buffer that live across the call.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c_path.as_ptr(),
            libc::AT_STATX_FORCE_SYNC,
            libc::STATX_BASIC_STATS,
            &mut buf,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(Errno::last())
    }
}
