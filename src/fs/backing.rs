//! Which I/O mode each open inode is in, and its passthrough backing file.
//!
//! The kernel allows one backing file per inode at a time and refuses to mix passthrough
//! opens with page-cached ones on the same inode: while an inode has a backing file, every
//! open of it must be a passthrough open with that same backing file, or it fails with
//! `EIO`. So the first open of an inode decides: passthrough if the kernel offers it and
//! accepts the file, cached otherwise; later opens of the same file share that mode and
//! backing id. An open that needs another backing file (the inode was opened read-only on
//! the remote copy, then copied up) names the inode's backing file but adds direct I/O,
//! which makes the kernel send its reads and writes to the daemon (only `mmap` would use the
//! backing file); it keeps the backing file in use like any other open.
//!
//! Writes the daemon must see (files under a quota root, whose allocations it counts) are
//! intercepted: such an open is never a passthrough open, and it gets direct I/O, naming
//! the inode's backing file where it has one. Direct I/O rather than the page cache because
//! a cached write through FUSE is copied twice (into our page cache, then into local's):
//! 1 MiB writes run at the speed of the passthrough ones this way. The kernel drops cached
//! pages a direct write overwrites (we allow mmap on direct-I/O files, which turns that on),
//! so other opens of the file stay coherent.

use std::collections::HashMap;
use std::sync::Arc;

use fuser::BackingId;
use parking_lot::Mutex;
use tracing::warn;

use super::handles::IoMode;
use crate::view::Layer;

enum Slot {
    Passthrough {
        id: Arc<BackingId>,
        layer: Layer,
        opens: usize,
    },
    Cached {
        opens: usize,
    },
}

/// What an open gets.
pub enum Grant {
    Passthrough(Arc<BackingId>),
    Cached,
    /// I/O through the daemon, under the inode's backing file of another layer.
    Direct(Arc<BackingId>),
    /// I/O through the daemon, bypassing the page cache, on an inode without a backing file.
    Uncached,
}

impl Grant {
    pub fn mode(&self) -> IoMode {
        match self {
            Grant::Passthrough(_) => IoMode::Passthrough,
            Grant::Cached => IoMode::Cached,
            Grant::Direct(_) | Grant::Uncached => IoMode::Direct,
        }
    }
}

#[derive(Default)]
pub struct BackingTable {
    slots: Mutex<HashMap<u64, Slot>>,
}

impl BackingTable {
    pub fn acquire(
        &self,
        ino: u64,
        layer: Layer,
        passthrough: bool,
        intercept: bool,
        open_backing: impl FnOnce() -> std::io::Result<BackingId>,
    ) -> Grant {
        let mut slots = self.slots.lock();
        match slots.get_mut(&ino) {
            Some(Slot::Passthrough {
                id,
                layer: l,
                opens,
            }) if *l == layer && !intercept => {
                *opens += 1;
                Grant::Passthrough(id.clone())
            }
            Some(Slot::Passthrough { id, opens, .. }) => {
                *opens += 1;
                Grant::Direct(id.clone())
            }
            Some(Slot::Cached { opens }) => {
                *opens += 1;
                if intercept {
                    Grant::Uncached
                } else {
                    Grant::Cached
                }
            }
            None if passthrough && !intercept => match open_backing() {
                Ok(id) => {
                    let id = Arc::new(id);
                    slots.insert(
                        ino,
                        Slot::Passthrough {
                            id: id.clone(),
                            layer,
                            opens: 1,
                        },
                    );
                    Grant::Passthrough(id)
                }
                Err(e) => {
                    warn!(ino, error = %e, "passthrough refused for this file, serving it through the daemon");
                    slots.insert(ino, Slot::Cached { opens: 1 });
                    Grant::Cached
                }
            },
            None => {
                slots.insert(ino, Slot::Cached { opens: 1 });
                if intercept {
                    Grant::Uncached
                } else {
                    Grant::Cached
                }
            }
        }
    }

    pub fn release(&self, ino: u64) {
        let mut slots = self.slots.lock();
        let done = match slots.get_mut(&ino) {
            Some(Slot::Passthrough { opens, .. }) | Some(Slot::Cached { opens }) => {
                *opens = opens.saturating_sub(1);
                *opens == 0
            }
            None => false,
        };
        if done {
            slots.remove(&ino);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> std::io::Result<BackingId> {
        Err(std::io::Error::from_raw_os_error(libc::EPERM))
    }

    #[test]
    fn without_passthrough_every_open_is_cached_and_counted() {
        let t = BackingTable::default();
        assert!(matches!(
            t.acquire(5, Layer::Local, false, false, refused),
            Grant::Cached
        ));
        assert!(matches!(
            t.acquire(5, Layer::Local, true, false, || panic!("mode is decided")),
            Grant::Cached
        ));
        t.release(5);
        t.release(5);
        assert!(t.slots.lock().is_empty());
    }

    #[test]
    fn a_refused_backing_file_falls_back_to_cached() {
        let t = BackingTable::default();
        assert!(matches!(
            t.acquire(9, Layer::Remote, true, false, refused),
            Grant::Cached
        ));
    }

    #[test]
    fn intercepted_opens_never_pass_through() {
        let t = BackingTable::default();
        assert!(matches!(
            t.acquire(3, Layer::Local, true, true, || panic!("no backing file")),
            Grant::Uncached
        ));
        assert!(matches!(
            t.acquire(3, Layer::Local, true, false, || panic!("mode is decided")),
            Grant::Cached
        ));
    }

    #[test]
    fn releasing_an_unknown_inode_is_harmless() {
        let t = BackingTable::default();
        t.release(1);
        assert!(t.slots.lock().is_empty());
    }
}
