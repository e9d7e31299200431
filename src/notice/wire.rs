//! The kernel's end: the notices a FUSE session takes, as one trait so that tests can
//! stand in for the device and record or hold them.

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use fuser::{INodeNo, Notifier};

/// What of an inode the kernel is told to forget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cached {
    /// Its attributes only. Takes no lock, neither the inode's nor its pages'.
    Attributes,
    /// Its attributes and every page of its data.
    Everything,
}

/// Where notices go: the session's device, or a stand-in in tests.
pub trait Kernel: Send + Sync {
    /// Drops `name` of `parent`, detaching whatever is mounted on or below it. Waits for the
    /// kernel's lock on `parent`.
    fn inval_entry(&self, parent: u64, name: &OsStr) -> io::Result<()>;
    /// Makes `name` of `parent` be looked up at its next use, keeping it and its mounts.
    fn expire_entry(&self, parent: u64, name: &OsStr) -> io::Result<()>;
    fn inval_inode(&self, ino: u64, what: Cached) -> io::Result<()>;
}

/// A session's device: fuser's notifier, and a second descriptor of the device for the
/// notices fuser cannot send (a mount made by layerfs itself has one).
pub struct Wire {
    notifier: Notifier,
    device: Option<OwnedFd>,
}

impl Wire {
    pub fn new(notifier: Notifier, device: Option<OwnedFd>) -> Wire {
        Wire { notifier, device }
    }
}

impl Wire {
    /// Asks the kernel to send again every request a daemon had read and not answered
    /// (`FUSE_NOTIFY_RESEND`, kernel 6.9 and later): a daemon resuming a connection sends
    /// it once its threads read, so that the callers of a dead daemon's requests get their
    /// answers. Resent requests carry the same unique id with bit 63 set.
    pub fn resend(device: &OwnedFd) -> io::Result<()> {
        let mut notice = Vec::with_capacity(16);
        notice.extend_from_slice(&16u32.to_ne_bytes());
        notice.extend_from_slice(&NOTIFY_RESEND.to_ne_bytes());
        notice.extend_from_slice(&0u64.to_ne_bytes());
        write_notice(device, &notice)
    }
}

impl Kernel for Wire {
    fn inval_entry(&self, parent: u64, name: &OsStr) -> io::Result<()> {
        self.notifier.inval_entry(INodeNo(parent), name)
    }

    fn expire_entry(&self, parent: u64, name: &OsStr) -> io::Result<()> {
        match &self.device {
            Some(device) => expire_entry(device, parent, name),
            None => Err(io::ErrorKind::Unsupported.into()),
        }
    }

    fn inval_inode(&self, ino: u64, what: Cached) -> io::Result<()> {
        // A negative offset: the attributes only. Offset 0, length 0: every page too.
        let offset = match what {
            Cached::Attributes => -1,
            Cached::Everything => 0,
        };
        self.notifier.inval_inode(INodeNo(ino), offset, 0)
    }
}

/// `FUSE_NOTIFY_INVAL_ENTRY`, as the error field of a notice's header carries it.
const NOTIFY_INVAL_ENTRY: i32 = 3;
/// `FUSE_NOTIFY_RESEND`.
const NOTIFY_RESEND: i32 = 7;
/// `fuse_notify_inval_entry_out.flags`: expire the name, do not drop it.
const EXPIRE_ONLY: u32 = 1;

/// Writes one `FUSE_NOTIFY_INVAL_ENTRY` notice with `FUSE_EXPIRE_ONLY` to the device: the
/// header (length, notice code, unique 0), the parent and the name's length and flags, then
/// the name and its NUL, in one write as the kernel requires.
fn expire_entry(device: &OwnedFd, parent: u64, name: &OsStr) -> io::Result<()> {
    let name = name.as_bytes();
    let len = 16 + 16 + name.len() + 1;
    let mut notice = Vec::with_capacity(len);
    notice.extend_from_slice(&(len as u32).to_ne_bytes());
    notice.extend_from_slice(&NOTIFY_INVAL_ENTRY.to_ne_bytes());
    notice.extend_from_slice(&0u64.to_ne_bytes());
    notice.extend_from_slice(&parent.to_ne_bytes());
    notice.extend_from_slice(&(name.len() as u32).to_ne_bytes());
    notice.extend_from_slice(&EXPIRE_ONLY.to_ne_bytes());
    notice.extend_from_slice(name);
    notice.push(0);
    write_notice(device, &notice)
}

/// A notice goes to the device in one write, as the kernel requires.
fn write_notice(device: &OwnedFd, notice: &[u8]) -> io::Result<()> {
    if nix::unistd::write(device.as_fd(), notice)? != notice.len() {
        return Err(io::Error::other("a short write of a notice"));
    }
    Ok(())
}
