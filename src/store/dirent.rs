//! Reading a directory's entries through an `O_PATH` handle.

use std::ffi::{CStr, OsString};
use std::os::fd::BorrowedFd;
use std::os::unix::ffi::OsStringExt;

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::OFlag;

use super::{open_at, stat_at, Kind};

/// One directory entry, `.` and `..` excluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub name: OsString,
    pub kind: Kind,
    /// Whether the entry is a 0/0 character device, i.e. an overlayfs whiteout.
    pub whiteout: bool,
    /// The inode number the directory reports (`d_ino`).
    pub ino: u64,
}

/// Lists a directory. Entries whose type the filesystem leaves unknown are stat'ed, so the
/// result never carries `DT_UNKNOWN`; entries that vanish meanwhile are skipped.
pub fn read_dir(dir: BorrowedFd<'_>) -> Result<Vec<DirEntry>, Errno> {
    let fd = open_at(dir, c".", OFlag::O_RDONLY | OFlag::O_DIRECTORY, 0)?;
    let mut handle = Dir::from_fd(fd)?;
    let mut out = Vec::new();
    for entry in handle.iter() {
        let entry = entry?;
        let name: &CStr = entry.file_name();
        let bytes = name.to_bytes();
        if bytes == b"." || bytes == b".." {
            continue;
        }
        let ino = entry.ino();
        let d_type = entry.file_type().map(dtype_of).unwrap_or(libc::DT_UNKNOWN);
        let (kind, whiteout) = match Kind::from_dtype(d_type) {
            Some(Kind::CharDev) | None => match stat_at(dir, name) {
                Ok(st) => (Kind::from_mode(st.st_mode), super::is_whiteout(&st)),
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(e),
            },
            Some(kind) => (kind, false),
        };
        out.push(DirEntry {
            name: OsString::from_vec(bytes.to_vec()),
            kind,
            whiteout,
            ino,
        });
    }
    Ok(out)
}

fn dtype_of(t: nix::dir::Type) -> u8 {
    use nix::dir::Type;
    match t {
        Type::Fifo => libc::DT_FIFO,
        Type::CharacterDevice => libc::DT_CHR,
        Type::Directory => libc::DT_DIR,
        Type::BlockDevice => libc::DT_BLK,
        Type::File => libc::DT_REG,
        Type::Symlink => libc::DT_LNK,
        Type::Socket => libc::DT_SOCK,
    }
}
