//! Telling the kernel, from request handlers, to drop what it caches.
//!
//! Dropping a name (`inval_entry`) takes the kernel's lock on its directory, which the
//! request being served may hold (an open with `O_CREAT` does): names are queued and sent by
//! a thread of their own. Dropping an inode's attributes (`inval_inode` with a negative
//! offset) takes no lock, neither the inode's nor its pages', and is sent at once, before
//! the reply: no attribute cached before it can be used after the request.

use std::ffi::OsString;
use std::io;
use std::sync::OnceLock;

use crossbeam_channel::{Receiver, Sender};
use fuser::{INodeNo, Notifier};
use parking_lot::Mutex;
use tracing::debug;

pub struct Notices {
    kernel: OnceLock<Notifier>,
    names: Sender<(u64, OsString)>,
    /// The queue's other end, until [`Notices::start`] hands it to its thread.
    pending: Mutex<Option<Receiver<(u64, OsString)>>>,
}

impl Default for Notices {
    fn default() -> Self {
        let (names, pending) = crossbeam_channel::unbounded();
        Notices {
            kernel: OnceLock::new(),
            names,
            pending: Mutex::new(Some(pending)),
        }
    }
}

impl Notices {
    /// Starts sending, once the session exists. Until then notices are dropped or queued:
    /// before the session the kernel caches nothing.
    pub fn start(&self, notifier: Notifier) -> io::Result<()> {
        let Some(queue) = self.pending.lock().take() else {
            return Ok(());
        };
        let _ = self.kernel.set(notifier.clone());
        std::thread::Builder::new()
            .name("notices".into())
            .spawn(move || {
                // Ends when the filesystem, and with it the sending side, goes away.
                for (parent, name) in queue {
                    if let Err(e) = notifier.inval_entry(INodeNo(parent), &name) {
                        debug!(error = %e, parent, name = ?name, "dropping a cached name failed");
                    }
                }
            })
            .map(drop)
    }

    /// Makes the kernel look `name` of `parent` up again.
    pub fn drop_name(&self, parent: u64, name: OsString) {
        let _ = self.names.send((parent, name));
    }

    /// Makes the kernel ask for the attributes of `ino` again.
    pub fn drop_attributes(&self, ino: u64) {
        if let Some(kernel) = self.kernel.get() {
            if let Err(e) = kernel.inval_inode(INodeNo(ino), -1, 0) {
                debug!(error = %e, ino, "dropping cached attributes failed");
            }
        }
    }
}
