//! Telling the kernel, from request handlers, to drop what it caches.
//!
//! Dropping a name (`inval_entry`) takes the kernel's lock on its directory, which the
//! request being served may hold (an open with `O_CREAT` does): names are queued and sent by
//! threads of their own. Dropping an inode's attributes (`inval_inode` with a negative
//! offset) takes no lock, neither the inode's nor its pages', and is sent at once, before
//! the reply: no attribute cached before it can be used after the request.
//!
//! A lookup waiting on a stalled remote holds its directory (shared) for as long as the
//! remote stalls, and a notice for a name there waits as long. So does a link or a rename
//! that waits on the remote, for the local directories it holds. Names in directories
//! whose requests may wait on the remote (`View::dir_may_wait`: those that ask it, and those
//! held by such a request) therefore have a queue and a thread of their own, which such a
//! stall may hold up; the names in other directories go on being sent. The trimming of the
//! kernel's cache hands its names near the remote to that queue too (see `fs::trim`).
//!
//! Dropping a name also detaches whatever is mounted on or below it. Where only the
//! attributes behind a name must be fetched again, the name is *expired* instead
//! (`FUSE_EXPIRE_ONLY`): it stays, mounts and all, and its next use looks it up. fuser
//! cannot send that flag, so the notice is written to the session's device directly (a
//! second descriptor of it, which a mount made by layerfs itself has; without one, or on a
//! kernel without the flag, nothing is sent).

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use crossbeam_channel::{Receiver, Sender};
use fuser::{INodeNo, Notifier};
use parking_lot::Mutex;
use tracing::debug;

use crate::view::View;

/// Names a trim round may leave queued near the remote. Past this, while a stall holds
/// that queue up, it queues no more: a later round picks them again.
const TRIM_BACKLOG: usize = 4096;

/// What is done to a name.
enum Name {
    Drop(u64, OsString),
    Expire(u64, OsString),
}

/// The queues' other ends, until [`Notices::start`] hands them to their threads.
struct Pending {
    local: Receiver<Name>,
    near_remote: Receiver<Name>,
}

pub struct Notices {
    kernel: OnceLock<Notifier>,
    /// Names in directories whose lookups never ask the remote.
    local: Sender<Name>,
    /// Names in directories whose lookups may ask the remote: a stall may hold these up.
    near_remote: Sender<Name>,
    pending: Mutex<Option<Pending>>,
    /// The kernel offered `FUSE_HAS_EXPIRE_ONLY` at init (which may come after `start`).
    expire_only: Arc<AtomicBool>,
    /// Which directories may wait on the remote. Weak, so that whoever still holds the
    /// notices after unmounting does not keep the view alive.
    view: Weak<View>,
}

impl Notices {
    pub fn new(view: &Arc<View>) -> Notices {
        let (local, local_pending) = crossbeam_channel::unbounded();
        let (near_remote, near_remote_pending) = crossbeam_channel::unbounded();
        Notices {
            kernel: OnceLock::new(),
            local,
            near_remote,
            pending: Mutex::new(Some(Pending {
                local: local_pending,
                near_remote: near_remote_pending,
            })),
            expire_only: Arc::default(),
            view: Arc::downgrade(view),
        }
    }

    /// Starts sending, once the session exists. Until then notices are dropped or queued:
    /// before the session the kernel caches nothing. `device` is a second descriptor of the
    /// session's `/dev/fuse`, for the notices fuser cannot send.
    pub fn start(&self, notifier: Notifier, device: Option<OwnedFd>) -> io::Result<()> {
        let Some(pending) = self.pending.lock().take() else {
            return Ok(());
        };
        let _ = self.kernel.set(notifier.clone());
        let courier = Arc::new(Courier {
            notifier,
            device,
            expire_only: self.expire_only.clone(),
        });
        courier.clone().spawn("notices", pending.local)?;
        courier.spawn("notices-remote", pending.near_remote)
    }

    /// Whether the kernel can expire names without dropping them (asked at init).
    pub fn set_expire_only(&self, offered: bool) {
        self.expire_only.store(offered, Ordering::Relaxed);
    }

    /// Makes the kernel look `name` of `parent` up again, detaching what is mounted there.
    pub fn drop_name(&self, parent: u64, name: OsString) {
        let _ = self.queue_of(parent).send(Name::Drop(parent, name));
    }

    /// Makes the kernel look `name` of `parent` up again at its next use, keeping the
    /// name and whatever is mounted on it.
    pub fn expire_name(&self, parent: u64, name: OsString) {
        let _ = self.queue_of(parent).send(Name::Expire(parent, name));
    }

    /// Drops a name a trim round picked in a directory that may wait on the remote (the
    /// round asks [`View::dir_may_wait`] once per directory, not per name). Not queued
    /// while [`TRIM_BACKLOG`] names wait near the remote.
    pub fn trim_near_remote(&self, parent: u64, name: OsString) {
        if self.near_remote.len() < TRIM_BACKLOG {
            let _ = self.near_remote.send(Name::Drop(parent, name));
        }
    }

    /// Whether names near the remote wait to be sent: a stall may be holding them up.
    pub fn near_remote_waiting(&self) -> bool {
        !self.near_remote.is_empty()
    }

    /// Makes the kernel ask for the attributes of `ino` again.
    pub fn drop_attributes(&self, ino: u64) {
        if let Some(kernel) = self.kernel.get() {
            if let Err(e) = kernel.inval_inode(INodeNo(ino), -1, 0) {
                debug!(error = %e, ino, "dropping cached attributes failed");
            }
        }
    }

    fn queue_of(&self, parent: u64) -> &Sender<Name> {
        match self.view.upgrade() {
            Some(view) if view.dir_may_wait(parent) => &self.near_remote,
            _ => &self.local,
        }
    }
}

/// What sends the notices of a queue, shared by the threads of both.
struct Courier {
    notifier: Notifier,
    device: Option<OwnedFd>,
    expire_only: Arc<AtomicBool>,
}

impl Courier {
    fn spawn(self: Arc<Self>, thread: &str, queue: Receiver<Name>) -> io::Result<()> {
        std::thread::Builder::new()
            .name(thread.into())
            // Ends when the filesystem, and with it the sending side, goes away.
            .spawn(move || queue.into_iter().for_each(|notice| self.send(notice)))
            .map(drop)
    }

    fn send(&self, notice: Name) {
        let (what, parent, name, sent) = match notice {
            Name::Drop(parent, name) => {
                let sent = self.notifier.inval_entry(INodeNo(parent), &name);
                ("dropping", parent, name, sent)
            }
            Name::Expire(parent, name) => {
                let Some(device) = &self.device else { return };
                if !self.expire_only.load(Ordering::Relaxed) {
                    return;
                }
                let sent = expire_entry(device, parent, &name);
                ("expiring", parent, name, sent)
            }
        };
        if let Err(e) = sent {
            debug!(error = %e, parent, name = ?name, "{what} a cached name failed");
        }
    }
}

/// `FUSE_NOTIFY_INVAL_ENTRY`, as the error field of a notice's header carries it.
const NOTIFY_INVAL_ENTRY: i32 = 3;
/// `fuse_notify_inval_entry_out.flags`: expire the name, do not drop it.
const EXPIRE_ONLY: u32 = 1;

/// Writes one `FUSE_NOTIFY_INVAL_ENTRY` notice with `FUSE_EXPIRE_ONLY` to the device: the
/// header (length, notice code, unique 0), the parent and the name's length and flags, then
/// the name and its NUL, in one write as the kernel requires.
fn expire_entry(device: &OwnedFd, parent: u64, name: &std::ffi::OsStr) -> io::Result<()> {
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
    let written = nix::unistd::write(device.as_fd(), &notice)?;
    if written != len {
        return Err(io::Error::other("a short write of a notice"));
    }
    Ok(())
}
