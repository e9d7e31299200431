//! Which I/O mode each open inode is in, and its passthrough backing file.
//!
//! The kernel allows one backing file per inode at a time and refuses to mix passthrough
//! opens with page-cached ones on the same inode: while an inode has a backing file, every
//! open of it must be a passthrough open with that same backing file, or it fails with
//! `EIO`. So the first open of an inode decides: passthrough if the kernel offers it and
//! accepts the file, cached otherwise; later opens of the same file share that mode and
//! backing id. An open that needs another backing file (the inode was opened read-only on
//! the remote copy, then copied up) cannot be served by that inode at all: any open of it
//! would map the remote copy. The node is let go and the open answered `ESTALE`, on which
//! the kernel looks the name up again and opens the copy under a new node (see `fs::open`).
//!
//! Writes the daemon must see (files under a quota root, whose allocations it counts) are
//! intercepted: an open that may write there is never a passthrough open, and it gets
//! direct I/O, naming the inode's backing file where it has one (read-only opens take
//! passthrough anywhere: reads allocate nothing). Direct I/O rather than the page cache because
//! a cached write through FUSE is copied twice (into our page cache, then into local's):
//! 1 MiB writes run at the speed of the passthrough ones this way. The kernel drops cached
//! pages a direct write overwrites (we allow mmap on direct-I/O files, which turns that on),
//! so other opens of the file stay coherent.
//!
//! The kernel does a backing file's I/O with the credentials it was registered with, and
//! all opens of an inode share one: an open that may write, by a caller whose rights there
//! differ from the registrar's ([`Rights`]), writes through the daemon as itself (direct
//! I/O naming the backing file, as above), or it would write with the other's rights.

use std::collections::HashMap;
use std::sync::Arc;

use fuser::BackingId;
use parking_lot::Mutex;
use tracing::warn;

use super::handles::IoMode;
use crate::view::Layer;

/// What a caller may do in local that another may not, as far as writes through a backing
/// file go: root keeps `CAP_SYS_RESOURCE` (quotas, ext4's reserved blocks), which the daemon
/// drops for everyone else (see `store::creds`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rights {
    Root,
    User,
}

/// One open asking for its I/O mode.
pub struct Opening {
    /// Where the file opened lives.
    pub layer: Layer,
    /// Whether it may get passthrough (the kernel offers it, nothing needs to see its I/O).
    pub passthrough: bool,
    /// Whether its writes must go through the daemon (see the module documentation).
    pub intercept: bool,
    /// Whether it may write, and with which rights its backing file would be registered.
    pub writes: bool,
    pub rights: Rights,
}

pub(super) enum Slot {
    Passthrough {
        id: Arc<BackingId>,
        layer: Layer,
        /// Whose rights the kernel writes through `id` with.
        rights: Rights,
        opens: usize,
    },
    Cached {
        opens: usize,
    },
}

impl Slot {
    /// One more open of the inode, in its mode.
    pub(super) fn add_open(&mut self) {
        match self {
            Slot::Passthrough { opens, .. } | Slot::Cached { opens } => *opens += 1,
        }
    }
}

/// What an open gets.
pub enum Grant {
    Passthrough(Arc<BackingId>),
    Cached,
    /// I/O through the daemon, uncached, on an inode bound to a backing file by
    /// passthrough opens (which the open names, as the kernel requires).
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
    /// How many inodes have a backing file registered.
    pub fn len(&self) -> usize {
        self.slots.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What an open of `ino`, served from `layer`, gets; `None` when the inode's backing
    /// file is of another layer (a read-only open of the remote copy from before a
    /// copy-up): any open would map that file, and must go to a new inode instead.
    ///
    /// The table is locked only to look and to record: the backing file is registered with
    /// the kernel (an ioctl) between the two, and a registration that lost a race to
    /// another open of the same inode is dropped once the table is unlocked.
    pub fn acquire(
        &self,
        ino: u64,
        opening: Opening,
        open_backing: impl FnOnce() -> std::io::Result<BackingId>,
    ) -> Option<Grant> {
        let mut open_backing = Some(open_backing);
        let mut registered = None;
        loop {
            let mut slots = self.slots.lock();
            if let Some(slot) = slots.get_mut(&ino) {
                return share(slot, &opening);
            }
            if !opening.passthrough || opening.intercept {
                slots.insert(ino, Slot::Cached { opens: 1 });
                return Some(if opening.intercept {
                    Grant::Uncached
                } else {
                    Grant::Cached
                });
            }
            let Some(result) = registered.take() else {
                drop(slots);
                registered = open_backing.take().map(|open| open());
                continue;
            };
            return Some(match result {
                Ok(id) => {
                    let id = Arc::new(id);
                    slots.insert(
                        ino,
                        Slot::Passthrough {
                            id: id.clone(),
                            layer: opening.layer,
                            rights: opening.rights,
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
            });
        }
    }

    /// Takes the modes an earlier daemon left the kernel's inodes in (see `resume`).
    pub(super) fn restore(&self, slots: HashMap<u64, Slot>) {
        self.slots.lock().extend(slots);
    }

    /// Whether the kernel's inode `ino` has a backing file of `layer`.
    pub fn bound_to(&self, ino: u64, layer: Layer) -> bool {
        matches!(
            self.slots.lock().get(&ino),
            Some(Slot::Passthrough { layer: bound, .. }) if *bound == layer
        )
    }

    pub fn release(&self, ino: u64) {
        let gone = {
            let mut slots = self.slots.lock();
            let done = match slots.get_mut(&ino) {
                Some(Slot::Passthrough { opens, .. }) | Some(Slot::Cached { opens }) => {
                    *opens = opens.saturating_sub(1);
                    *opens == 0
                }
                None => false,
            };
            if done {
                slots.remove(&ino)
            } else {
                None
            }
        };
        // Outside the lock: dropping the last reference to a backing id is an ioctl.
        drop(gone);
    }
}

/// One more open of an inode whose mode is decided.
fn share(slot: &mut Slot, opening: &Opening) -> Option<Grant> {
    match slot {
        Slot::Passthrough { layer, .. } if *layer != opening.layer => None,
        Slot::Passthrough {
            id, rights, opens, ..
        } => {
            *opens += 1;
            let other_rights = opening.writes && *rights != opening.rights;
            Some(if opening.intercept || other_rights {
                Grant::Direct(id.clone())
            } else {
                Grant::Passthrough(id.clone())
            })
        }
        Slot::Cached { opens } => {
            *opens += 1;
            Some(if opening.intercept {
                Grant::Uncached
            } else {
                Grant::Cached
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> std::io::Result<BackingId> {
        Err(std::io::Error::from_raw_os_error(libc::EPERM))
    }

    /// A read-only open by root of a local file.
    fn opening(layer: Layer, passthrough: bool, intercept: bool) -> Opening {
        Opening {
            layer,
            passthrough,
            intercept,
            writes: false,
            rights: Rights::Root,
        }
    }

    #[test]
    fn without_passthrough_every_open_is_cached_and_counted() {
        let t = BackingTable::default();
        assert!(matches!(
            t.acquire(5, opening(Layer::Local, false, false), refused),
            Some(Grant::Cached)
        ));
        assert!(matches!(
            t.acquire(5, opening(Layer::Local, true, false), || panic!(
                "mode is decided"
            )),
            Some(Grant::Cached)
        ));
        t.release(5);
        t.release(5);
        assert!(t.slots.lock().is_empty());
    }

    #[test]
    fn a_refused_backing_file_falls_back_to_cached() {
        let t = BackingTable::default();
        assert!(matches!(
            t.acquire(9, opening(Layer::Remote, true, false), refused),
            Some(Grant::Cached)
        ));
    }

    #[test]
    fn intercepted_opens_never_pass_through() {
        let t = BackingTable::default();
        assert!(matches!(
            t.acquire(3, opening(Layer::Local, true, true), || panic!(
                "no backing file"
            )),
            Some(Grant::Uncached)
        ));
        assert!(matches!(
            t.acquire(3, opening(Layer::Local, true, false), || panic!(
                "mode is decided"
            )),
            Some(Grant::Cached)
        ));
    }

    #[test]
    fn releasing_an_unknown_inode_is_harmless() {
        let t = BackingTable::default();
        t.release(1);
        assert!(t.slots.lock().is_empty());
    }
}
