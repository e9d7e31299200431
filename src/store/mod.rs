//! Thin, safe access to the two trees on disk: the local read-write tree and the remote
//! read-only tree.
//!
//! Every access is made relative to an open directory file descriptor and names exactly one
//! path component, with symlinks never followed. Directories are held open as `O_PATH` fds by
//! the view, so a path is never re-resolved from a root: a remote symlink, or a local entry
//! swapped for a symlink by a concurrent rename, cannot lead the daemon (which runs as root)
//! anywhere else.

pub mod atime;
pub mod btrfs;
pub mod copy;
pub mod creds;
pub mod dirent;
pub mod fiemap;
pub mod handle;
pub mod mountinfo;
pub mod reserved;
pub mod subvolume;
pub mod xattr;

use std::ffi::{CStr, CString, OsStr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};

pub use dirent::{read_dir, DirEntry};

/// A file's type, as the view reports it (never "unknown").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDev,
    BlockDev,
}

impl Kind {
    pub fn from_mode(mode: u32) -> Kind {
        match SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits()) {
            SFlag::S_IFDIR => Kind::Dir,
            SFlag::S_IFLNK => Kind::Symlink,
            SFlag::S_IFIFO => Kind::Fifo,
            SFlag::S_IFSOCK => Kind::Socket,
            SFlag::S_IFCHR => Kind::CharDev,
            SFlag::S_IFBLK => Kind::BlockDev,
            _ => Kind::File,
        }
    }

    /// Maps a `d_type`; `None` for `DT_UNKNOWN`, which the caller resolves with a stat.
    pub fn from_dtype(d_type: u8) -> Option<Kind> {
        match d_type {
            libc::DT_REG => Some(Kind::File),
            libc::DT_DIR => Some(Kind::Dir),
            libc::DT_LNK => Some(Kind::Symlink),
            libc::DT_FIFO => Some(Kind::Fifo),
            libc::DT_SOCK => Some(Kind::Socket),
            libc::DT_CHR => Some(Kind::CharDev),
            libc::DT_BLK => Some(Kind::BlockDev),
            _ => None,
        }
    }

    pub fn mode_bits(self) -> u32 {
        match self {
            Kind::File => libc::S_IFREG,
            Kind::Dir => libc::S_IFDIR,
            Kind::Symlink => libc::S_IFLNK,
            Kind::Fifo => libc::S_IFIFO,
            Kind::Socket => libc::S_IFSOCK,
            Kind::CharDev => libc::S_IFCHR,
            Kind::BlockDev => libc::S_IFBLK,
        }
    }
}

/// Opens a tree's root as a directory handle, refusing a root that is not a directory.
pub fn open_root(path: &Path) -> Result<OwnedFd, Errno> {
    nix::fcntl::open(
        path,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
}

/// Converts a single path component into a C string, refusing what cannot be one name.
pub fn cname(name: &OsStr) -> Result<CString, Errno> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes == b"." || bytes == b".." || bytes.contains(&b'/') {
        return Err(Errno::EINVAL);
    }
    CString::new(bytes).map_err(|_| Errno::EINVAL)
}

/// `lstat` of one entry of a directory.
pub fn stat_at(dir: BorrowedFd<'_>, name: &CStr) -> Result<FileStat, Errno> {
    nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW)
}

/// `stat` of an open fd (`O_PATH` fds included).
pub fn stat_fd(fd: BorrowedFd<'_>) -> Result<FileStat, Errno> {
    nix::sys::stat::fstat(fd)
}

/// Opens one entry of a directory with `O_NOFOLLOW | O_CLOEXEC` added.
pub fn open_at(
    dir: BorrowedFd<'_>,
    name: &CStr,
    flags: OFlag,
    mode: u32,
) -> Result<OwnedFd, Errno> {
    nix::fcntl::openat(
        dir,
        name,
        flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(mode),
    )
}

/// Opens one entry as an `O_PATH` handle without following it, whatever its type.
pub fn open_path_at(dir: BorrowedFd<'_>, name: &CStr) -> Result<OwnedFd, Errno> {
    open_at(dir, name, OFlag::O_PATH, 0)
}

/// Opens a subdirectory as an `O_PATH` handle; a symlink in its place is `ENOTDIR`.
pub fn open_dir_at(dir: BorrowedFd<'_>, name: &CStr) -> Result<OwnedFd, Errno> {
    open_at(dir, name, OFlag::O_PATH | OFlag::O_DIRECTORY, 0)
}

/// Opens the directory `parts` below `root`, one component at a time, never following a
/// symlink; `None` if a component is missing or not a directory.
pub fn open_dir_below(root: BorrowedFd<'_>, parts: &[&str]) -> Result<Option<OwnedFd>, Errno> {
    let mut dir: Option<OwnedFd> = None;
    for part in parts {
        let at = dir.as_ref().map_or(root, |d| d.as_fd());
        match open_dir_at(at, &cname(OsStr::new(part))?) {
            Ok(fd) => dir = Some(fd),
            Err(Errno::ENOENT | Errno::ENOTDIR) => return Ok(None),
            Err(e) => return Err(e),
        }
    }
    Ok(dir)
}

/// Re-opens an `O_PATH` handle with real access flags through `/proc/self/fd`, which refers
/// to the inode itself and never to a path that could have been swapped.
pub fn reopen(fd: BorrowedFd<'_>, flags: OFlag) -> Result<OwnedFd, Errno> {
    let path = proc_path(fd);
    nix::fcntl::open(
        path.as_c_str(),
        (flags | OFlag::O_CLOEXEC) & !OFlag::O_CREAT,
        Mode::empty(),
    )
}

/// `/proc/self/fd/N`: the path through which calls that take no fd reach an `O_PATH` fd.
pub fn proc_path(fd: BorrowedFd<'_>) -> CString {
    // An i32 always formats into a valid C string.
    CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap_or_default()
}

pub fn readlink_at(dir: BorrowedFd<'_>, name: &CStr) -> Result<Vec<u8>, Errno> {
    nix::fcntl::readlinkat(dir, name).map(|s| s.as_bytes().to_vec())
}

/// Is this a whiteout in the kernel overlayfs format (a 0/0 character device)?
pub fn is_whiteout(st: &FileStat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFCHR && st.st_rdev == 0
}
