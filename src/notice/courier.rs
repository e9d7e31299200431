//! The threads that send queued notices, each queue in the order it was filled.

use std::io;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use tracing::debug;

use super::wire::{Cached, Kernel};
use super::Notice;

/// Notices of a batch that could not be sent (other than for what the kernel does not
/// cache).
pub type Failed = usize;

/// A refresh round's notices, and where to say they are sent.
pub(super) type Batch = (Vec<Notice>, Sender<Failed>);

/// Starts a thread sending the notices of `queue` one at a time. It ends when every sender
/// is gone and the queue drained.
pub(super) fn spawn_names(
    thread: &str,
    kernel: Arc<dyn Kernel>,
    queue: Receiver<Notice>,
) -> io::Result<()> {
    spawn(thread, move || {
        for notice in queue {
            send_all(kernel.as_ref(), [notice]);
        }
    })
}

/// Starts a thread sending batches, answering each with how many of it failed.
pub(super) fn spawn_batches(
    thread: &str,
    kernel: Arc<dyn Kernel>,
    queue: Receiver<Batch>,
) -> io::Result<()> {
    spawn(thread, move || {
        for (notices, done) in queue {
            let _ = done.send(send_all(kernel.as_ref(), notices));
        }
    })
}

fn spawn(thread: &str, body: impl FnOnce() + Send + 'static) -> io::Result<()> {
    std::thread::Builder::new()
        .name(thread.into())
        .spawn(body)
        .map(drop)
}

fn send_all(kernel: &dyn Kernel, notices: impl IntoIterator<Item = Notice>) -> Failed {
    let mut failed = 0;
    for notice in notices {
        match send(kernel, &notice) {
            Ok(()) => {}
            // Not cached: nothing to drop.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                failed += 1;
                debug!(error = %e, ?notice, "telling the kernel to forget failed");
            }
        }
    }
    failed
}

pub(super) fn send(kernel: &dyn Kernel, notice: &Notice) -> io::Result<()> {
    match notice {
        Notice::Entry(parent, name) => kernel.inval_entry(*parent, name),
        Notice::Expire(parent, name) => kernel.expire_entry(*parent, name),
        Notice::Attributes(ino) => kernel.inval_inode(*ino, Cached::Attributes),
        Notice::Inode(ino) => kernel.inval_inode(*ino, Cached::Everything),
    }
}
