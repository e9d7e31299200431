//! Reading the remote tree without ever following a symlink.
//!
//! The daemon runs as root and the remote tree is written by other hosts, so a symlink planted
//! where a directory or metadata file is expected must not lead the scan elsewhere. Every step
//! below the remote root therefore goes through an open directory handle with `openat` and
//! `O_NOFOLLOW`: there is no window between checking a path and opening it. Files are opened
//! with `O_NONBLOCK` and checked to be regular before reading, so a FIFO or device planted in
//! place of a JSON file cannot hang the scan, and reads are capped so a huge file cannot
//! exhaust memory.

use std::cell::Cell;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{open, openat, AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, FileStat, Mode, SFlag};

use super::fingerprint::Stamp;

/// Why a directory entry could not be used as what the layout expects it to be.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EntryError {
    #[error("missing")]
    Missing,
    #[error("is a symlink (symlinks are never followed)")]
    Symlink,
    #[error("not a directory")]
    NotDirectory,
    #[error("not a regular file")]
    NotRegular,
    #[error("larger than the {} MiB read cap", .cap >> 20)]
    TooLarge { cap: u64 },
    #[error("unreadable: {0}")]
    Io(io::Error),
}

impl From<io::Error> for EntryError {
    fn from(e: io::Error) -> Self {
        if let Some(errno) = e.raw_os_error() {
            note_shortage(errno);
        }
        EntryError::Io(e)
    }
}

impl From<Errno> for EntryError {
    fn from(errno: Errno) -> Self {
        match errno {
            Errno::ENOENT => EntryError::Missing,
            // O_NOFOLLOW on a symlink fails with ELOOP; that is the only way to get it here,
            // since every name opened is a single path component.
            Errno::ELOOP => EntryError::Symlink,
            Errno::ENOTDIR => EntryError::NotDirectory,
            other => io::Error::from(other).into(),
        }
    }
}

thread_local! {
    static RAN_SHORT: Cell<bool> = const { Cell::new(false) };
}

/// Notes an error that says this host, not the remote, ran short: of descriptors or of
/// memory. Every error of a read of the remote passes here (as it becomes an
/// [`EntryError`]); [`ran_short`] tells.
pub fn note_shortage(errno: i32) {
    if matches!(
        errno,
        libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::ENOBUFS
    ) {
        RAN_SHORT.set(true);
    }
}

/// Whether this thread ran short since it last asked. A scan that did knows nothing for
/// sure about the remote: an object it could not open would read as not ready, and leave
/// the view. It is thrown away whole (see `refresh`).
pub fn ran_short() -> bool {
    RAN_SHORT.replace(false)
}

/// An open directory of the remote tree.
#[derive(Debug)]
pub(crate) struct DirHandle {
    fd: OwnedFd,
}

impl DirHandle {
    /// Opens the remote root itself. It is configuration, not remote content, so it may be
    /// reached through symlinks like any path an administrator types.
    pub fn open_root(path: &Path) -> Result<DirHandle, EntryError> {
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        let fd = open(path, flags, Mode::empty())?;
        Ok(DirHandle { fd })
    }

    /// Opens the subdirectory `name` (one path component), refusing symlinks.
    pub fn subdir(&self, name: &str) -> Result<DirHandle, EntryError> {
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        match openat(self.fd.as_fd(), name, flags, Mode::empty()) {
            Ok(fd) => Ok(DirHandle { fd }),
            // Some kernels answer ENOTDIR rather than ELOOP for O_DIRECTORY on a symlink:
            // look again so the reason names the real problem.
            Err(Errno::ENOTDIR | Errno::ELOOP) => Err(match self.kind_of(name) {
                Ok(SFlag::S_IFLNK) => EntryError::Symlink,
                Ok(_) => EntryError::NotDirectory,
                Err(e) => e,
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// The status of the directory itself.
    pub fn stat(&self) -> Result<FileStat, EntryError> {
        Ok(fstat(self.fd.as_fd())?)
    }

    /// The file type of `name`, without following it if it is a symlink.
    /// The attributes of entry `name` itself (a symlink is not followed). `name` may be a
    /// relative path of several components; only its last one is not followed, so callers
    /// use it to compare stamps, never to decide what to serve.
    pub fn lstat(&self, name: &str) -> Result<FileStat, EntryError> {
        Ok(fstatat(
            self.fd.as_fd(),
            name,
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )?)
    }

    pub fn kind_of(&self, name: &str) -> Result<SFlag, EntryError> {
        let st = fstatat(self.fd.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW)?;
        Ok(file_type(&st))
    }

    /// Opens the regular file `name` for reading, refusing symlinks and special files.
    pub fn open_file(&self, name: &str) -> Result<(File, FileStat), EntryError> {
        let flags = OFlag::O_RDONLY
            | OFlag::O_NOFOLLOW
            | OFlag::O_NONBLOCK
            | OFlag::O_NOCTTY
            | OFlag::O_CLOEXEC;
        let fd = openat(self.fd.as_fd(), name, flags, Mode::empty())?;
        let st = fstat(fd.as_fd())?;
        if file_type(&st) != SFlag::S_IFREG {
            return Err(EntryError::NotRegular);
        }
        Ok((File::from(fd), st))
    }

    /// Reads the whole regular file `name`, failing if it holds more than `cap` bytes.
    pub fn read_file(&self, name: &str, cap: u64) -> Result<(Vec<u8>, FileStat), EntryError> {
        let (file, st) = self.open_file(name)?;
        if u64::try_from(st.st_size).unwrap_or(u64::MAX) > cap {
            return Err(EntryError::TooLarge { cap });
        }
        let mut bytes = Vec::new();
        // The file may grow between fstat and read: read one byte past the cap to notice.
        file.take(cap.saturating_add(1)).read_to_end(&mut bytes)?;
        if bytes.len() as u64 > cap {
            return Err(EntryError::TooLarge { cap });
        }
        Ok((bytes, st))
    }

    /// The names in this directory, sorted, without `.` and `..`.
    ///
    /// Names that are not UTF-8 cannot be ids and are dropped here (logged at debug level).
    pub fn names(&self) -> Result<Vec<String>, EntryError> {
        // A fresh open of ".", so the stream has its own offset and the handle stays reusable.
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        let mut dir = Dir::openat(self.fd.as_fd(), ".", flags, Mode::empty())?;
        let mut names = Vec::new();
        for entry in dir.iter() {
            let entry = entry?;
            let raw = entry.file_name().to_bytes();
            if raw == b"." || raw == b".." {
                continue;
            }
            match std::str::from_utf8(raw) {
                Ok(name) => names.push(name.to_owned()),
                Err(_) => tracing::debug!(
                    name = %OsStr::from_bytes(raw).to_string_lossy(),
                    "skipping non-UTF-8 name in the remote tree"
                ),
            }
        }
        names.sort_unstable();
        Ok(names)
    }
}

/// The file type bits of a stat result.
fn file_type(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

/// A cheap identity of a file's current state, for telling changed metadata apart.
pub(crate) fn stamp(st: &FileStat, content_hash: Option<u64>) -> Stamp {
    Stamp {
        ino: st.st_ino,
        size: u64::try_from(st.st_size).unwrap_or(0),
        mtime_ns: i128::from(st.st_mtime) * 1_000_000_000 + i128::from(st.st_mtime_nsec),
        ctime_ns: i128::from(st.st_ctime) * 1_000_000_000 + i128::from(st.st_ctime_nsec),
        content_hash,
    }
}

/// The modification time of a stat result as a `SystemTime`. Remote timestamps are not
/// trusted to be in range: an unrepresentable one reads as the epoch.
pub(crate) fn mtime(st: &FileStat) -> SystemTime {
    let secs = Duration::from_secs(st.st_mtime.unsigned_abs());
    let nanos = Duration::from_nanos(u64::try_from(st.st_mtime_nsec).unwrap_or(0));
    let whole = if st.st_mtime >= 0 {
        UNIX_EPOCH.checked_add(secs)
    } else {
        UNIX_EPOCH.checked_sub(secs)
    };
    whole
        .and_then(|t| t.checked_add(nanos))
        .unwrap_or(UNIX_EPOCH)
}
