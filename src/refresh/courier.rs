//! Sending a round's invalidations without waiting on the remote.
//!
//! Dropping a name (`inval_entry`) takes the kernel's lock on its directory, and a lookup
//! there that waits on a stalled remote (a layout directory, a shared object directory)
//! holds that lock for as long as the stall lasts. The refresher must not wait that long:
//! its rounds are what notice the remote failing and coming back. So a thread of its own
//! sends the notices, batch after batch in the order the rounds made them, and a round
//! waits for its batch only for a while ([`Courier::deliver`]); what is left is sent once
//! the lookup returns.

use std::io;
use std::time::Duration;

use crossbeam_channel::{bounded, unbounded, Sender};
use tracing::debug;

use super::invalidate::{Kernel, Notice};

/// Notices that could not be sent (other than for what the kernel does not cache).
type Failed = usize;

/// The sending end of the thread that owns the kernel's notifier.
pub struct Courier {
    batches: Sender<(Vec<Notice>, Sender<Failed>)>,
}

impl Courier {
    /// Starts the thread sending to `kernel`. It ends when the courier is dropped and every
    /// batch is sent.
    pub fn start(kernel: Box<dyn Kernel>) -> io::Result<Courier> {
        let (batches, queue) = unbounded::<(Vec<Notice>, Sender<Failed>)>();
        std::thread::Builder::new()
            .name("refresh-notices".into())
            .spawn(move || {
                for (notices, done) in queue {
                    let _ = done.send(send_all(kernel.as_ref(), notices));
                }
            })?;
        Ok(Courier { batches })
    }

    /// Hands `notices` to the thread and waits for them to be sent, at most `patience`:
    /// the number that failed, or `None` if they are still waiting for a directory.
    pub fn deliver(&self, notices: Vec<Notice>, patience: Duration) -> Option<Failed> {
        let (done, sent) = bounded(1);
        self.batches.send((notices, done)).ok()?;
        sent.recv_timeout(patience).ok()
    }
}

fn send_all(kernel: &dyn Kernel, notices: Vec<Notice>) -> Failed {
    let mut failed = 0;
    for notice in notices {
        let (sent, ino) = match &notice {
            Notice::Entry(parent, name) => (kernel.inval_entry(*parent, name), *parent),
            Notice::Inode(ino) => (kernel.inval_inode(*ino), *ino),
        };
        match sent {
            Ok(()) => {}
            // Not cached: nothing to drop.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                failed += 1;
                debug!(error = %e, ino, ?notice, "kernel cache invalidation failed");
            }
        }
    }
    failed
}
