//! Telling the kernel what to forget: the one path by which request handlers, the trimming
//! of the kernel's cache and refresh rounds reach the session's device.
//!
//! The kernel caches names (negative ones too), attributes and file data for long (see
//! `fs`); whatever changes them behind its back must tell it. Notices differ in the locks
//! they wait for, and that decides how they are sent:
//!
//! - Dropping an inode's attributes ([`Notice::Attributes`]) takes no lock, neither the
//!   inode's nor its pages': it is sent at once, before the reply of the request that made
//!   it, so no attribute cached before it can be used after that request.
//! - Dropping or expiring a name takes the kernel's lock on its directory, which the request
//!   being served may hold (an open with `O_CREAT` does): names are queued and sent by
//!   threads of their own, never by a thread serving requests (that would deadlock).
//! - A lookup waiting on a stalled remote holds its directory (shared) for as long as the
//!   remote stalls, and a notice for a name there waits as long. So does a link or a rename
//!   that waits on the remote, for the local directories it holds. Names in directories
//!   whose requests may wait on the remote (`View::dir_may_wait`: those that ask it, and
//!   those held by such a request) therefore have a queue and a thread of their own, which
//!   such a stall may hold up; the names in other directories go on being sent. The
//!   trimming of the kernel's cache hands its names near the remote to that queue too (see
//!   `fs::trim`).
//! - Refresh rounds send their notices in batches, on a third thread, in the order the
//!   rounds made them. A round waits for its batch only for a while ([`Notices::deliver`]):
//!   its rounds are what notice the remote failing and coming back, so a stalled directory
//!   must not hold the refresher; the rest is sent once the directory is free.
//!
//! Dropping a name also detaches whatever is mounted on or below it. Where only the
//! attributes behind a name must be fetched again, the name is *expired* instead
//! (`FUSE_EXPIRE_ONLY`): it stays, mounts and all, and its next use looks it up. fuser
//! cannot send that flag, so the notice is written to the device directly (see
//! [`Wire`]); on a kernel without it, nothing is sent.
//!
//! A notice about something the kernel does not cache fails with `ENOENT`, which is
//! success here.

mod courier;
mod wire;

use std::ffi::OsString;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};
use parking_lot::Mutex;

pub use courier::Failed;
pub use wire::{Cached, Kernel, Wire};

use crate::view::View;

/// Names a trim round may leave queued near the remote. Past this, while a stall holds
/// that queue up, it queues no more: a later round picks them again.
const TRIM_BACKLOG: usize = 4096;

/// One thing for the kernel to forget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// The name `.1` in the directory `.0`, and whatever is mounted on or below it.
    Entry(u64, OsString),
    /// What the name `.1` in the directory `.0` leads to, at its next use; the name stays.
    Expire(u64, OsString),
    /// The attributes of an inode.
    Attributes(u64),
    /// The attributes and cached data of an inode.
    Inode(u64),
}

/// The queues' other ends, until [`Notices::start`] hands them to their threads.
struct Pending {
    local: Receiver<Notice>,
    near_remote: Receiver<Notice>,
    rounds: Receiver<courier::Batch>,
}

/// The sending ends of the queues, and the kernel once the session exists.
///
/// Lock order: `pending` is a leaf, taken only to start.
pub struct Notices {
    kernel: OnceLock<Arc<dyn Kernel>>,
    /// Names in directories whose lookups never ask the remote.
    local: Sender<Notice>,
    /// Names in directories whose lookups may ask the remote: a stall may hold these up.
    near_remote: Sender<Notice>,
    /// Refresh rounds' batches.
    rounds: Sender<courier::Batch>,
    pending: Mutex<Option<Pending>>,
    /// The kernel offered `FUSE_HAS_EXPIRE_ONLY` at init.
    expire_only: AtomicBool,
    /// Which directories may wait on the remote. Weak, so that whoever still holds the
    /// notices after unmounting does not keep the view alive.
    view: Weak<View>,
}

impl Notices {
    pub fn new(view: &Arc<View>) -> Notices {
        let (local, local_pending) = crossbeam_channel::unbounded();
        let (near_remote, near_remote_pending) = crossbeam_channel::unbounded();
        let (rounds, rounds_pending) = crossbeam_channel::unbounded();
        Notices {
            kernel: OnceLock::new(),
            local,
            near_remote,
            rounds,
            pending: Mutex::new(Some(Pending {
                local: local_pending,
                near_remote: near_remote_pending,
                rounds: rounds_pending,
            })),
            expire_only: AtomicBool::new(false),
            view: Arc::downgrade(view),
        }
    }

    /// Starts sending to `kernel`, once the session exists. Until then notices are queued
    /// or dropped: before the session the kernel caches nothing.
    pub fn start(&self, kernel: Arc<dyn Kernel>) -> io::Result<()> {
        let Some(pending) = self.pending.lock().take() else {
            return Ok(());
        };
        let _ = self.kernel.set(kernel.clone());
        courier::spawn_names("notices", kernel.clone(), pending.local)?;
        courier::spawn_names("notices-remote", kernel.clone(), pending.near_remote)?;
        courier::spawn_batches("refresh-notices", kernel, pending.rounds)
    }

    /// The kernel, once started: for those that send from threads of their own.
    pub fn kernel(&self) -> Option<Arc<dyn Kernel>> {
        self.kernel.get().cloned()
    }

    /// Whether the kernel can expire names without dropping them (asked at init).
    pub fn set_expire_only(&self, offered: bool) {
        self.expire_only.store(offered, Ordering::Relaxed);
    }

    /// Whether the kernel took expire-only notices at init.
    pub fn expire_only(&self) -> bool {
        self.expire_only.load(Ordering::Relaxed)
    }

    /// Makes the kernel look `name` of `parent` up again, detaching what is mounted there.
    pub fn drop_name(&self, parent: u64, name: OsString) {
        let _ = self.queue_of(parent).send(Notice::Entry(parent, name));
    }

    /// Makes the kernel look `name` of `parent` up again at its next use, keeping the
    /// name and whatever is mounted on it.
    pub fn expire_name(&self, parent: u64, name: OsString) {
        if self.expire_only.load(Ordering::Relaxed) {
            let _ = self.queue_of(parent).send(Notice::Expire(parent, name));
        }
    }

    /// Drops a name a trim round picked in a directory that may wait on the remote (the
    /// round asks [`View::dir_may_wait`] once per directory, not per name). Not queued
    /// while [`TRIM_BACKLOG`] names wait near the remote.
    pub fn trim_near_remote(&self, parent: u64, name: OsString) {
        if self.near_remote.len() < TRIM_BACKLOG {
            let _ = self.near_remote.send(Notice::Entry(parent, name));
        }
    }

    /// Whether names near the remote wait to be sent: a stall may be holding them up.
    pub fn near_remote_waiting(&self) -> bool {
        !self.near_remote.is_empty()
    }

    /// Makes the kernel ask for the attributes of `ino` again, before returning.
    pub fn drop_attributes(&self, ino: u64) {
        if let Some(kernel) = self.kernel.get() {
            let _ = courier::send(kernel.as_ref(), &Notice::Attributes(ino)).inspect_err(
                |e| tracing::debug!(error = %e, ino, "dropping cached attributes failed"),
            );
        }
    }

    /// Sends a refresh round's `notices` after those of earlier rounds and waits for them
    /// at most `patience`: the number that failed, or `None` if they are still waiting for
    /// a directory (or nothing was started to send them).
    pub fn deliver(&self, notices: Vec<Notice>, patience: Duration) -> Option<Failed> {
        self.kernel.get()?;
        let (done, sent) = bounded(1);
        self.rounds.send((notices, done)).ok()?;
        sent.recv_timeout(patience).ok()
    }

    fn queue_of(&self, parent: u64) -> &Sender<Notice> {
        match self.view.upgrade() {
            Some(view) if view.dir_may_wait(parent) => &self.near_remote,
            _ => &self.local,
        }
    }
}
