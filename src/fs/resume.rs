//! What the FUSE glue keeps for a daemon that resumes its connection (DESIGN §13): what
//! INIT settled, the files the kernel holds open, and how each open inode does its I/O.
//!
//! The kernel passes back the handle numbers it was given, and keeps an inode's I/O mode
//! (its passthrough backing file, or the page cache) for as long as it has opens of it:
//! a new open of that inode in another mode, or with another backing file, fails with
//! `EIO`. So every open and release is written to the journal the keeper holds, with the
//! open's flags, layer, mode and backing id, before the reply that hands the handle out.
//! A resumed daemon reads them back: the inodes' modes and backing ids (adopted from the
//! connection, where they stayed registered) as they were, and every handle still open as
//! an *orphan*, opened again from its record at its first read or write (a passthrough open
//! never comes back but for its release). Directory handles keep nothing: a listing is
//! taken again at its handle's next read.
//!
//! Not kept: quota set aside by a writer (re-derived from local), and a file's copy made
//! through an open from before its copy-up (made again at the next change).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use fuser::BackingId;
use parking_lot::Mutex;

use super::backing::{Rights, Slot};
use super::handles::{FileHandle as OpenFile, Handle, IoMode};
use super::Core;
use crate::view::keep::Journal;
use crate::view::Layer;

/// What the kernel and the daemon agreed at `init` that the daemon acts on, for a daemon
/// that resumes the connection later (it gets no `init`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Negotiated {
    pub passthrough: bool,
    pub expire_only: bool,
}

/// One open the kernel was handed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    pub fh: u64,
    pub ino: u64,
    pub flags: i32,
    pub layer: Layer,
    pub mode: IoMode,
    /// The backing id the open names (passthrough, or direct I/O on a bound inode).
    pub backing: Option<u32>,
    /// Whose rights the backing file was registered with.
    pub rights: Rights,
    pub bypasses: bool,
    pub maps_writes: bool,
}

/// One thing the handle table did. Record kinds follow the numbering's (see
/// `view::keep`), which shares the journal and skips them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandleFact {
    Opened(Opened),
    Released { fh: u64 },
}

const OPENED: u8 = 16;
const RELEASED: u8 = 17;

impl HandleFact {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(40);
        match self {
            HandleFact::Opened(o) => {
                out.push(OPENED);
                out.extend_from_slice(&o.fh.to_le_bytes());
                out.extend_from_slice(&o.ino.to_le_bytes());
                out.extend_from_slice(&o.flags.to_le_bytes());
                out.extend_from_slice(&o.backing.unwrap_or(0).to_le_bytes());
                let bits = u8::from(o.layer == Layer::Local)
                    | match o.mode {
                        IoMode::Passthrough => 0,
                        IoMode::Cached => 2,
                        IoMode::Direct => 4,
                    }
                    | u8::from(o.backing.is_some()) << 3
                    | u8::from(o.rights == Rights::User) << 4
                    | u8::from(o.bypasses) << 5
                    | u8::from(o.maps_writes) << 6;
                out.push(bits);
            }
            HandleFact::Released { fh } => {
                out.push(RELEASED);
                out.extend_from_slice(&fh.to_le_bytes());
            }
        }
        out
    }

    /// A record back as a fact; `None` for one of another kind, or cut.
    pub fn decode(record: &[u8]) -> Option<HandleFact> {
        let (&kind, rest) = record.split_first()?;
        let u64_at = |at: usize| Some(u64::from_le_bytes(rest.get(at..at + 8)?.try_into().ok()?));
        match kind {
            OPENED => {
                let flags = i32::from_le_bytes(rest.get(16..20)?.try_into().ok()?);
                let backing = u32::from_le_bytes(rest.get(20..24)?.try_into().ok()?);
                let bits = *rest.get(24)?;
                Some(HandleFact::Opened(Opened {
                    fh: u64_at(0)?,
                    ino: u64_at(8)?,
                    flags,
                    layer: if bits & 1 != 0 {
                        Layer::Local
                    } else {
                        Layer::Remote
                    },
                    mode: match bits & 6 {
                        0 => IoMode::Passthrough,
                        2 => IoMode::Cached,
                        _ => IoMode::Direct,
                    },
                    backing: (bits & 8 != 0).then_some(backing),
                    rights: if bits & 16 != 0 {
                        Rights::User
                    } else {
                        Rights::Root
                    },
                    bypasses: bits & 32 != 0,
                    maps_writes: bits & 64 != 0,
                }))
            }
            RELEASED => Some(HandleFact::Released { fh: u64_at(0)? }),
            _ => None,
        }
    }
}

/// A handle on what a session keeps for its successor, held while the filesystem itself
/// moves into the session.
pub struct Resume(pub(super) Arc<Core>);

impl Resume {
    /// What `init` settled (nothing before it).
    pub fn negotiated(&self) -> Negotiated {
        Negotiated {
            passthrough: self.0.passthrough.load(Ordering::Relaxed),
            expire_only: self.0.notices.expire_only(),
        }
    }

    /// Acts as `init` settled for the daemon that read it.
    pub fn restore_negotiated(&self, negotiated: Negotiated) {
        self.0
            .passthrough
            .store(negotiated.passthrough, Ordering::Relaxed);
        self.0.notices.set_expire_only(negotiated.expire_only);
    }

    /// Journals every open and release from now on.
    pub fn keep_in(&self, journal: Arc<dyn Journal>) {
        let _ = self.0.journal.set(journal);
    }

    /// Takes back the opens an earlier daemon journaled and did not see released: each
    /// inode's mode and backing file (`adopt` takes ownership of a backing id), and the
    /// handles as orphans. New handles are numbered past theirs.
    pub fn restore_opens(
        &self,
        facts: impl IntoIterator<Item = HandleFact>,
        adopt: impl Fn(u32) -> BackingId,
    ) -> usize {
        let mut open: HashMap<u64, Opened> = HashMap::new();
        for fact in facts {
            match fact {
                HandleFact::Opened(o) => {
                    open.insert(o.fh, o);
                }
                HandleFact::Released { fh } => {
                    open.remove(&fh);
                }
            }
        }
        let mut slots: HashMap<u64, Slot> = HashMap::new();
        for o in open.values() {
            match slots.get_mut(&o.ino) {
                Some(slot) => slot.add_open(),
                None => {
                    let slot = match o.backing {
                        Some(raw) => Slot::Passthrough {
                            id: Arc::new(adopt(raw)),
                            layer: o.layer,
                            rights: o.rights,
                            opens: 1,
                        },
                        None => Slot::Cached { opens: 1 },
                    };
                    slots.insert(o.ino, slot);
                }
            }
        }
        self.0.backing.restore(slots);
        self.0.resumed.store(true, Ordering::Relaxed);
        let count = open.len();
        if let Some(last) = open.keys().max() {
            self.0.handles.number_past(*last);
        }
        *self.0.orphans.lock() = open;
        count
    }
}

/// Handles of an earlier daemon not yet opened again, by number.
pub(super) type Orphans = Mutex<HashMap<u64, Opened>>;

impl Core {
    pub(super) fn note_open(&self, fact: HandleFact) {
        if let Some(journal) = self.journal.get() {
            journal.append(&fact.encode());
        }
    }

    /// The orphan `fh`, opened again from its record and made a handle like any other;
    /// `None` if there is no such orphan or its file cannot be opened again.
    pub(super) fn adopt(&self, fh: u64) -> Option<Arc<Handle>> {
        let orphan = self.orphans.lock().remove(&fh)?;
        let reopened = (|| {
            let node = self.view.node(orphan.ino)?;
            let writes = orphan.flags & libc::O_ACCMODE != libc::O_RDONLY;
            let flags = orphan.flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC);
            // An open from before its file's copy-up stays on the remote file until its
            // first change, as it was.
            let defer = writes && orphan.layer == Layer::Remote;
            let (fd, layer) = self.view.open(&node, flags, defer)?;
            Ok::<_, nix::errno::Errno>((node, fd, layer))
        })();
        match reopened {
            Ok((node, fd, layer)) => {
                self.view.opened(&node, orphan.maps_writes);
                let handle = Handle::File(OpenFile {
                    node,
                    bypasses: orphan.bypasses,
                    maps_writes: orphan.maps_writes,
                    fd,
                    layer,
                    mode: orphan.mode,
                    copy: Mutex::new(None),
                    copy_flags: super::files::copy_flags(orphan.flags),
                    _held: None,
                });
                Some(self.handles.insert_at(fh, handle))
            }
            Err(e) => {
                tracing::warn!(fh, ino = orphan.ino, error = %e, "a file an earlier daemon opened cannot be opened again");
                self.orphans.lock().insert(fh, orphan);
                None
            }
        }
    }

    /// The release of an orphan never opened again: its inode's count of opens goes down.
    /// Only a daemon that resumed has orphans: any other releases without taking their lock.
    pub(super) fn release_orphan(&self, fh: u64) -> bool {
        if !self.resumed.load(Ordering::Relaxed) {
            return false;
        }
        match self.orphans.lock().remove(&fh) {
            Some(orphan) => {
                self.backing.release(orphan.ino);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_handle_fact_reads_back_as_written() {
        let opened = Opened {
            fh: 9,
            ino: 1 << 62 | 3,
            flags: libc::O_RDWR | libc::O_APPEND,
            layer: Layer::Local,
            mode: IoMode::Direct,
            backing: Some(4),
            rights: Rights::User,
            bypasses: false,
            maps_writes: true,
        };
        for fact in [
            HandleFact::Opened(opened.clone()),
            HandleFact::Opened(Opened {
                layer: Layer::Remote,
                mode: IoMode::Cached,
                backing: None,
                rights: Rights::Root,
                bypasses: true,
                maps_writes: false,
                ..opened
            }),
            HandleFact::Released { fh: 77 },
        ] {
            assert_eq!(HandleFact::decode(&fact.encode()), Some(fact));
        }
        assert_eq!(
            HandleFact::decode(&[1, 0, 0]),
            None,
            "the numbering's kinds"
        );
        assert_eq!(HandleFact::decode(&[OPENED, 1]), None, "a cut record");
    }
}
