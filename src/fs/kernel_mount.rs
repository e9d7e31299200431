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

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::mount::MsFlags;
use nix::sys::stat::Mode;

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
    // Commas would split the kernel's option string; the source is for display only.
    let source = spec.fsname.replace(',', "_");
    nix::mount::mount(
        Some(source.as_str()),
        spec.mountpoint,
        Some("fuse.layerfs"),
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
    /// Unmounts, as `umount` would (a busy mount stays).
    pub fn unmount(&self) -> Result<(), Errno> {
        nix::mount::umount(self.mountpoint.as_path())
    }
}
