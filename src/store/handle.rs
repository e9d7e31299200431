//! A filesystem's own handles of its objects (`name_to_handle_at`, `open_by_handle_at`):
//! what reopens an object by identity, with no name, for as long as it exists.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::OFlag;

/// The largest handle kept; filesystems that need more (NFS can) are not served.
pub const MAX_BYTES: usize = 48;

/// One object's handle, as its filesystem made it: `struct file_handle` with room for
/// [`MAX_BYTES`], so that taking one allocates nothing.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsHandle {
    len: libc::c_uint,
    /// The filesystem's name for the handle's format (`FILEID_*`).
    kind: libc::c_int,
    data: [u8; MAX_BYTES],
}

impl FsHandle {
    /// The handle of the object `fd` (an `O_PATH` handle will do). `EOVERFLOW` when the
    /// filesystem's handles are larger than [`MAX_BYTES`]; `EOPNOTSUPP` when it has none.
    pub fn of(fd: BorrowedFd<'_>) -> Result<FsHandle, Errno> {
        let mut handle = FsHandle {
            len: MAX_BYTES as libc::c_uint,
            kind: 0,
            data: [0; MAX_BYTES],
        };
        let mut mount_id = 0;
        // SAFETY: `handle` is a `struct file_handle` whose `handle_bytes` says how much room
        // follows it; the empty path names `fd` itself.
        let res = unsafe {
            libc::name_to_handle_at(
                fd.as_raw_fd(),
                c"".as_ptr(),
                &mut handle as *mut FsHandle as *mut libc::file_handle,
                &mut mount_id,
                libc::AT_EMPTY_PATH,
            )
        };
        Errno::result(res)?;
        Ok(handle)
    }

    /// A handle of format `kind` made of `bytes`; `None` if they do not fit.
    pub fn from_parts(kind: i32, bytes: &[u8]) -> Option<FsHandle> {
        let mut data = [0; MAX_BYTES];
        data.get_mut(..bytes.len())?.copy_from_slice(bytes);
        Some(FsHandle {
            len: bytes.len() as libc::c_uint,
            kind,
            data,
        })
    }

    pub fn kind(&self) -> i32 {
        self.kind
    }

    pub fn bytes(&self) -> &[u8] {
        &self.data[..(self.len as usize).min(MAX_BYTES)]
    }

    /// Opens the object the handle names, on the mount of `mount` (a descriptor of any of
    /// its objects, not an `O_PATH` one), with `flags`. `ESTALE` once the object is gone.
    /// Needs `CAP_DAC_READ_SEARCH`.
    pub fn open(&self, mount: BorrowedFd<'_>, flags: OFlag) -> Result<OwnedFd, Errno> {
        let mut handle = *self;
        // SAFETY: as above; the kernel only reads the handle.
        let fd = unsafe {
            libc::open_by_handle_at(
                mount.as_raw_fd(),
                &mut handle as *mut FsHandle as *mut libc::file_handle,
                (flags | OFlag::O_CLOEXEC).bits(),
            )
        };
        let fd = Errno::result(fd)?;
        // SAFETY: a new descriptor nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// A 32-bit digest of the handle (FNV-1a), which tells two objects that had the same
    /// inode number apart: the handle holds the inode's generation.
    pub fn digest(&self) -> u32 {
        let mut h: u32 = 0x811c_9dc5;
        for b in self.kind.to_le_bytes().iter().chain(self.bytes()) {
            h ^= u32::from(*b);
            h = h.wrapping_mul(0x0100_0193);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_handle_reopens_its_object_until_it_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"x").unwrap();
        let fd = nix::fcntl::open(&path, OFlag::O_PATH, nix::sys::stat::Mode::empty()).unwrap();
        let handle = FsHandle::of(fd.as_fd()).expect("name_to_handle_at");
        let root = nix::fcntl::open(
            dir.path(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY,
            nix::sys::stat::Mode::empty(),
        )
        .unwrap();
        let again = handle.open(root.as_fd(), OFlag::O_PATH).unwrap();
        let (a, b) = (
            nix::sys::stat::fstat(fd.as_fd()).unwrap(),
            nix::sys::stat::fstat(again.as_fd()).unwrap(),
        );
        assert_eq!((a.st_dev, a.st_ino), (b.st_dev, b.st_ino));
        drop((fd, again));
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            handle.open(root.as_fd(), OFlag::O_PATH).err(),
            Some(Errno::ESTALE)
        );
    }
}
