//! Open files and directories, by the handle number the kernel passes back.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::quota::Reserved;
use crate::view::listing::ListEntry;
use crate::view::{Layer, Node};

/// How the kernel does I/O on an open file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// Reads and writes go straight to the backing file in the kernel (FUSE passthrough).
    Passthrough,
    /// Through the daemon, with the kernel's page cache.
    Cached,
    /// Through the daemon, bypassing the page cache: writes the daemon must count (under a
    /// quota root), on an inode without a backing file or one bound to a backing file by
    /// passthrough readers, which the open still names, as the kernel requires.
    Direct,
}

#[derive(Debug)]
pub struct FileHandle {
    /// The open object (its number is `node.ino`), kept for the quota accounting of its
    /// writes and to count its opens.
    pub node: Arc<Node>,
    /// A passthrough open that may write: counted while open, so that no quota is set
    /// over writes it would make unseen.
    pub bypasses: bool,
    /// An open that may write through a shared mapping of the file itself (passthrough,
    /// or direct I/O on a passthrough-bound inode), unseen.
    pub maps_writes: bool,
    pub fd: OwnedFd,
    pub layer: Layer,
    pub mode: IoMode,
    /// A remote file opened before its copy-up, served through the daemon: the copy, opened
    /// with `copy_flags` on the first read after the copy-up, or on the open's first
    /// change, which makes the copy (see `Core::copy_of` and `Core::writable`).
    pub copy: Mutex<Option<Arc<OwnedFd>>>,
    /// How `copy` is opened: `O_RDWR` and the open's sync flags for an open that may write,
    /// `O_RDONLY` otherwise.
    pub copy_flags: i32,
    /// Quota set aside while the open lasts.
    pub _held: Option<Reserved>,
}

impl FileHandle {
    /// The open's descriptor, if it is of the file the quota counts: an open from before
    /// a copy-up reads the remote file, which no quota counts (the copy is measured through
    /// the opens of it).
    pub fn counted(&self) -> Option<BorrowedFd<'_>> {
        (self.layer == Layer::Local).then(|| self.fd.as_fd())
    }

    /// Whether the open may write.
    pub fn writes(&self) -> bool {
        self.copy_flags & libc::O_ACCMODE != libc::O_RDONLY
    }
}

#[derive(Debug)]
pub struct DirHandle {
    pub ino: u64,
    /// The listing taken at `opendir` (and again on a rewind), so offsets stay valid while
    /// the directory changes.
    pub entries: Mutex<Arc<Vec<ListEntry>>>,
}

#[derive(Debug)]
pub enum Handle {
    File(FileHandle),
    Dir(DirHandle),
}

#[derive(Debug)]
pub struct HandleTable {
    next: AtomicU64,
    open: RwLock<HashMap<u64, Arc<Handle>>>,
}

impl Default for HandleTable {
    fn default() -> Self {
        HandleTable {
            next: AtomicU64::new(1),
            open: RwLock::new(HashMap::new()),
        }
    }
}

impl HandleTable {
    pub fn new() -> HandleTable {
        HandleTable::default()
    }

    pub fn insert(&self, handle: Handle) -> u64 {
        let fh = self.next.fetch_add(1, Ordering::Relaxed);
        self.open.write().insert(fh, Arc::new(handle));
        fh
    }

    /// Places a handle under a number an earlier daemon gave (see `resume`).
    pub fn insert_at(&self, fh: u64, handle: Handle) -> Arc<Handle> {
        let handle = Arc::new(handle);
        self.open.write().insert(fh, handle.clone());
        handle
    }

    /// Numbers new handles past `fh`.
    pub fn number_past(&self, fh: u64) {
        self.next.fetch_max(fh + 1, Ordering::Relaxed);
    }

    pub fn get(&self, fh: u64) -> Option<Arc<Handle>> {
        self.open.read().get(&fh).cloned()
    }

    pub fn file(&self, fh: u64) -> Option<Arc<Handle>> {
        self.get(fh).filter(|h| matches!(**h, Handle::File(_)))
    }

    pub fn remove(&self, fh: u64) -> Option<Arc<Handle>> {
        self.open.write().remove(&fh)
    }

    pub fn len(&self) -> usize {
        self.open.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Handle {
    pub fn as_file(&self) -> Option<&FileHandle> {
        match self {
            Handle::File(f) => Some(f),
            Handle::Dir(_) => None,
        }
    }

    pub fn as_dir(&self) -> Option<&DirHandle> {
        match self {
            Handle::Dir(d) => Some(d),
            Handle::File(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(ino: u64) -> Handle {
        Handle::Dir(DirHandle {
            ino,
            entries: Mutex::new(Arc::new(Vec::new())),
        })
    }

    #[test]
    fn handles_are_unique_and_removed_once() {
        let t = HandleTable::new();
        let a = t.insert(dir(1));
        let b = t.insert(dir(1));
        assert_ne!(a, b);
        assert_eq!(t.len(), 2);
        assert!(t.remove(a).is_some());
        assert!(t.remove(a).is_none());
        assert!(t.get(b).is_some());
    }

    #[test]
    fn a_directory_handle_is_not_a_file() {
        let t = HandleTable::new();
        let d = t.insert(dir(3));
        assert!(t.file(d).is_none());
        assert_eq!(t.get(d).and_then(|h| h.as_dir().map(|d| d.ino)), Some(3));
    }

    #[test]
    fn a_handle_outlives_its_removal_while_in_use() {
        let t = HandleTable::new();
        let d = t.insert(dir(9));
        let held = t.get(d).unwrap();
        t.remove(d);
        assert_eq!(held.as_dir().unwrap().ino, 9);
    }
}
