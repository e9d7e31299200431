//! When reading a file or listing a directory moves its access time.
//!
//! The kernel leaves a FUSE filesystem's access times to its daemon (its inodes are marked
//! `S_NOATIME`), and every read of the view reaches local's filesystem: through the daemon,
//! or through a passthrough backing file the kernel reads itself, exec included. Those
//! reads move the access time as the mount they go through says. So the daemon reaches
//! local through a private clone of local's mount (`open_tree`), made with the view's own
//! mode (`mount_setattr`): every file it opens, and every backing file it hands the kernel,
//! follows `noatime`, `relatime` or `strictatime` and `nodiratime` exactly as local's own
//! filesystem applies them. The clone is detached: it is in no mount table, and goes when
//! the daemon's last handle on it closes.

use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::errno::Errno;

/// How a read moves an access time (mount(8)'s names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Atime {
    /// Never.
    NoAtime,
    /// When the access time is not after the modification or change time, or is a day old.
    #[default]
    RelAtime,
    /// On every read.
    StrictAtime,
}

/// The view's access-time mode: files as `files` says; directories too, unless `dirs` is
/// false (`nodiratime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccessTimes {
    pub files: Atime,
    pub dirs: bool,
}

impl Default for AccessTimes {
    fn default() -> Self {
        AccessTimes {
            files: Atime::RelAtime,
            dirs: true,
        }
    }
}

// From <linux/mount.h>; the libc crate does not have them.
const OPEN_TREE_CLONE: u32 = 1;
const OPEN_TREE_CLOEXEC: u32 = libc::O_CLOEXEC as u32;
const MOUNT_ATTR_NOATIME: u64 = 0x10;
const MOUNT_ATTR_STRICTATIME: u64 = 0x20;
const MOUNT_ATTR_ATIME: u64 = 0x70;
const MOUNT_ATTR_NODIRATIME: u64 = 0x80;

/// `struct mount_attr`, version 0.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

impl AccessTimes {
    /// What `mount_setattr` sets and clears for this mode.
    fn attrs(self) -> MountAttr {
        let files = match self.files {
            Atime::NoAtime => MOUNT_ATTR_NOATIME,
            Atime::RelAtime => 0,
            Atime::StrictAtime => MOUNT_ATTR_STRICTATIME,
        };
        MountAttr {
            attr_set: files | if self.dirs { 0 } else { MOUNT_ATTR_NODIRATIME },
            attr_clr: MOUNT_ATTR_ATIME | MOUNT_ATTR_NODIRATIME,
            propagation: 0,
            userns_fd: 0,
        }
    }
}

/// The directory `path` as the root of a private clone of the mount it is on, on which
/// reads move access times as `times` says. Needs `CAP_SYS_ADMIN`.
pub fn open_clone(path: &Path, times: AccessTimes) -> Result<OwnedFd, Errno> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)?;
    // SAFETY: a valid C string; the flags ask for a new fd, which is checked.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c.as_ptr(),
            OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC,
        )
    };
    let fd = Errno::result(fd)?;
    // SAFETY: open_tree returned a descriptor that nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let attr = times.attrs();
    // SAFETY: `attr` is a live `struct mount_attr` of the size passed.
    let res = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            std::os::fd::AsRawFd::as_raw_fd(&tree),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    Errno::result(res)?;
    Ok(tree)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_mode_sets_its_flag_and_clears_the_others() {
        let attrs = |files, dirs| AccessTimes { files, dirs }.attrs();
        let a = attrs(Atime::NoAtime, true);
        assert_eq!((a.attr_set, a.attr_clr), (0x10, 0xf0));
        let a = attrs(Atime::RelAtime, true);
        assert_eq!((a.attr_set, a.attr_clr), (0, 0xf0));
        let a = attrs(Atime::StrictAtime, false);
        assert_eq!((a.attr_set, a.attr_clr), (0xa0, 0xf0));
    }
}
