//! File handles of the view: numbers the kernel hands back after forgetting them.
//!
//! `name_to_handle_at` on the view gives the kernel's FUSE handle of a node: its number and
//! generation, nothing the daemon records. Opening such a handle once the kernel has
//! forgotten the node (its cache was dropped, or the view remounted) arrives as a LOOKUP of
//! `.` in that number, which must name the same object again, or fail once the object is
//! gone (the kernel then says `ESTALE`).
//!
//! A local object's number is its inode number in local (see [`super::inodes`]), and its
//! generation a digest of local's own file handle of it, which holds the inode's
//! generation there: a number local gives to a new object comes back with another
//! generation, and the kernel refuses the old handle. To find an object by its number,
//! [`Exports`] keeps one record per local inode number in a file in local's root
//! ([`EXPORTS_NAME`]): local's handle of the object, and the inode number of a directory
//! holding a name of it. A record is written whenever a node is built for a local object,
//! and its directory again when a rename moves it; records are never read on the usual path.
//!
//! Finding an object again ([`View::find`]) opens it by local's handle, makes out a path to it
//! from local's root (a directory through `..`, a file through its recorded directory; each
//! name by the inode number in its directory's entries), and looks that path up in the view
//! as the kernel would have: the node found there is in its zone and quota root like any
//! other, and must carry the number asked for. Synthesized entries and remote names with
//! several links are found again by the parent and name their numbers were given for.
//!
//! Not found again, so stale once forgotten: remote objects and merged directories (their
//! numbers are the remote's inode numbers, and the remote's handles are not kept), a
//! copied-up file while it still has its remote number, objects of a local filesystem
//! without file handles (or whose handles exceed [`handle::MAX_BYTES`], or inode numbers
//! 2^32), and synthesized entries after a remount (their numbers are not kept).

use std::ffi::OsString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use tracing::warn;

use super::identity::{is_local_number, Identity, ROOT_INO};
use super::node::{Layer, Node};
use super::{Entry, Stat, View};
use crate::store::handle::{self, FsHandle};
use crate::store::{self, dirent, reserved};

/// The record file's name in local's root (reserved: see `store::reserved`).
pub use crate::store::reserved::EXPORTS_NAME;

/// Bytes per record: a version, the handle's length and kind, the directory, the handle.
const RECORD: usize = 64;
const HANDLE_AT: usize = 16;
/// Local inode numbers below this have a record (the file stays a sparse 256 GiB at most).
const RECORDED_BELOW: u64 = 1 << 32;
/// The deepest path found again; deeper ones stay stale.
const MAX_DEPTH: usize = 4096;

const _: () = assert!(HANDLE_AT + handle::MAX_BYTES == RECORD);

/// What is kept of one local object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub handle: FsHandle,
    /// The local inode number of a directory holding a name of the object.
    pub dir: u64,
}

impl Record {
    fn encode(&self) -> [u8; RECORD] {
        let bytes = self.handle.bytes();
        let mut out = [0u8; RECORD];
        out[0] = 1;
        out[1] = bytes.len() as u8;
        out[4..8].copy_from_slice(&self.handle.kind().to_le_bytes());
        out[8..16].copy_from_slice(&self.dir.to_le_bytes());
        out[HANDLE_AT..HANDLE_AT + bytes.len()].copy_from_slice(bytes);
        out
    }

    fn decode(raw: &[u8; RECORD]) -> Option<Record> {
        if raw[0] != 1 {
            return None;
        }
        let kind = i32::from_le_bytes(raw[4..8].try_into().ok()?);
        let dir = u64::from_le_bytes(raw[8..16].try_into().ok()?);
        let bytes = raw[HANDLE_AT..].get(..raw[1] as usize)?;
        Some(Record {
            handle: FsHandle::from_parts(kind, bytes)?,
            dir,
        })
    }
}

/// How many records [`Exports`] remembers having written.
const WRITTEN_SLOTS: usize = 1 << 16;

/// The records of local's objects (see the module documentation). Written and read with
/// `pwrite`/`pread` of whole records at their own offsets: no lock.
#[derive(Debug)]
pub struct Exports {
    /// None where the records could not be opened: handles then go stale when the kernel
    /// forgets their nodes.
    files: Option<Files>,
    /// A fingerprint of the record last written for an inode number, in the slot of the
    /// number modulo their count (0: none): a node built again for an object whose record
    /// stands (a cold `stat` after the kernel dropped its caches, a walk larger than the
    /// inode table) writes nothing. A number sharing its slot only costs a write.
    written: Box<[AtomicU64]>,
}

#[derive(Debug)]
struct Files {
    records: OwnedFd,
    /// Local's root, opened for reading: `open_by_handle_at` takes no `O_PATH` descriptor.
    mount: OwnedFd,
}

impl Exports {
    /// Opens (or makes) the record file in local's root `local`.
    pub fn open(local: BorrowedFd<'_>) -> Exports {
        let files = (|| {
            let records = store::open_at(
                local,
                &std::ffi::CString::new(EXPORTS_NAME).map_err(|_| Errno::EINVAL)?,
                OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_NOFOLLOW,
                0o600,
            )?;
            let mount = store::reopen(local, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
            Ok::<_, Errno>(Files { records, mount })
        })();
        if let Err(e) = &files {
            warn!(error = %e, "no file handle records in local: handles of forgotten objects will be stale");
        }
        Exports {
            files: files.ok(),
            written: (0..WRITTEN_SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn written(&self, ino: u64) -> &AtomicU64 {
        &self.written[(ino % WRITTEN_SLOTS as u64) as usize]
    }

    /// The record file and the offset of local inode number `ino`'s record in it.
    fn slot(&self, ino: u64) -> Option<(&OwnedFd, libc::off_t)> {
        let files = self.files.as_ref()?;
        (ino < RECORDED_BELOW).then(|| (&files.records, (ino * RECORD as u64) as libc::off_t))
    }

    /// Records `record` for local inode number `ino`.
    pub fn record(&self, ino: u64, record: &Record) {
        let Some((file, at)) = self.slot(ino) else {
            return;
        };
        let encoded = record.encode();
        let print = fingerprint(ino, &encoded);
        let written = self.written(ino);
        if written.load(Ordering::Relaxed) == print {
            return;
        }
        // A record that does not reach the disk leaves one handle stale, no more.
        if nix::sys::uio::pwrite(file, &encoded, at) == Ok(RECORD) {
            written.store(print, Ordering::Relaxed);
        }
    }

    /// Records that a directory with local inode number `dir` holds a name of `ino`.
    pub fn moved(&self, ino: u64, dir: u64) {
        if let Some((file, at)) = self.slot(ino) {
            let _ = nix::sys::uio::pwrite(file, &dir.to_le_bytes(), at + 8);
            self.written(ino).store(0, Ordering::Relaxed);
        }
    }

    /// The record of local inode number `ino`, if there is one.
    pub fn get(&self, ino: u64) -> Option<Record> {
        let (file, at) = self.slot(ino)?;
        let mut raw = [0u8; RECORD];
        let n = nix::sys::uio::pread(file, &mut raw, at).ok()?;
        (n == RECORD).then(|| Record::decode(&raw)).flatten()
    }

    /// Opens the object `handle` names in local, as an `O_PATH` handle.
    fn open_object(&self, handle: &FsHandle) -> Result<OwnedFd, Errno> {
        let files = self.files.as_ref().ok_or(Errno::ESTALE)?;
        handle.open(files.mount.as_fd(), OFlag::O_PATH | OFlag::O_NOFOLLOW)
    }
}

/// FNV-1a of an inode number and its encoded record; never 0.
fn fingerprint(ino: u64, record: &[u8; RECORD]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in ino.to_le_bytes().iter().chain(record) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h | 1
}

impl View {
    /// Records a local object a node is being built for (see the module documentation);
    /// returns the generation its node gets.
    /// Objects of other filesystems (mounted inside local) are numbered otherwise and get
    /// no record.
    pub(super) fn record_local(&self, object: BorrowedFd<'_>, st: &Stat, parent: &Node) -> u32 {
        if !self.inodes.is_local(st.st_dev) {
            return 0;
        }
        let Ok(handle) = FsHandle::of(object) else {
            return 0;
        };
        let generation = handle.digest();
        if let Some(dir) = self.local_number(parent) {
            self.exports.record(st.st_ino, &Record { handle, dir });
        }
        generation
    }

    /// A rename moved `node` into `dir`: its record names the new directory.
    pub(super) fn record_move(&self, node: &Node, dir: &Node) {
        if node.is_dir() || node.layer() != Layer::Local {
            return;
        }
        let (Some(ino), Some(dir)) = (self.local_number(node), self.local_number(dir)) else {
            return;
        };
        self.exports.moved(ino, dir);
    }

    /// The local inode number of a node's local object, if it has one: the inode table
    /// knows each node by it (see [`super::inodes`]).
    fn local_number(&self, node: &Node) -> Option<u64> {
        node.state().identities.iter().find_map(|id| match id {
            Identity::Local { ino, .. } => Some(*ino),
            _ => None,
        })
    }

    /// The node numbered `ino`, handed to the kernel once more (LOOKUP of `.`): the live
    /// one, or the object found again by its number.
    pub fn find(&self, ino: u64) -> Result<Entry, Errno> {
        if let Some(node) = self.inodes.hand_out_number(ino) {
            return self.entry_of(node);
        }
        let entry = if is_local_number(ino) {
            self.find_local(ino)?
        } else {
            self.find_named(ino)?
        };
        if entry.node.ino != ino {
            self.inodes.forget(entry.node.ino, 1);
            return Err(Errno::ENOENT);
        }
        Ok(entry)
    }

    /// The directory holding node `ino` by its first name, handed to the kernel once more
    /// (LOOKUP of `..`, which the kernel asks to connect a directory found by its handle).
    pub fn parent_of(&self, ino: u64) -> Result<Entry, Errno> {
        let node = self.node(ino)?;
        let parent = match node.primary() {
            Some((parent, _)) => parent.ino,
            None if ino == ROOT_INO => ROOT_INO,
            None => return Err(Errno::ENOENT),
        };
        self.find(parent)
    }

    fn entry_of(&self, node: Arc<Node>) -> Result<Entry, Errno> {
        match self.getattr(&node) {
            Ok(stat) => Ok(Entry { node, stat }),
            Err(e) => {
                self.inodes.forget(node.ino, 1);
                Err(e)
            }
        }
    }

    /// A local object found again by its record: its path from local's root, looked up.
    fn find_local(&self, ino: u64) -> Result<Entry, Errno> {
        let record = self.exports.get(ino).ok_or(Errno::ENOENT)?;
        let object = self.exports.open_object(&record.handle)?;
        let st = store::stat_fd(object.as_fd())?;
        let root = store::stat_fd(self.local_root.as_fd())?;
        if st.st_ino != ino || st.st_dev != root.st_dev {
            return Err(Errno::ENOENT);
        }
        let mut names = Vec::new();
        let mut dir = match st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            true => object,
            false => {
                let dir = self.exports.get(record.dir).ok_or(Errno::ENOENT)?;
                let dir = self.exports.open_object(&dir.handle)?;
                names.push(name_in(dir.as_fd(), ino)?);
                dir
            }
        };
        loop {
            let here = store::stat_fd(dir.as_fd())?;
            if (here.st_dev, here.st_ino) == (root.st_dev, root.st_ino) {
                break;
            }
            if names.len() >= MAX_DEPTH {
                return Err(Errno::ENOENT);
            }
            let up = store::open_at(
                dir.as_fd(),
                c"..",
                OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW,
                0,
            )?;
            // The top of local's filesystem, outside local's root: not an object of the view.
            if store::stat_fd(up.as_fd())?.st_ino == here.st_ino {
                return Err(Errno::ENOENT);
            }
            names.push(name_in(up.as_fd(), here.st_ino)?);
            dir = up;
        }
        names.reverse();
        self.walk(ROOT_INO, &names)
    }

    /// A synthesized entry or a remote name found again by the parent and name its number
    /// was given for, up to a node the kernel still holds.
    ///
    /// A daemon that resumed a connection also finds so the nodes an earlier one placed
    /// (see `keep`), up to a local directory the kernel still holds from it, found by its
    /// record.
    fn find_named(&self, ino: u64) -> Result<Entry, Errno> {
        let mut names = Vec::new();
        let mut at = ino;
        let mut found_above = None;
        while self.inodes.get(at).is_none() {
            if names.len() >= MAX_DEPTH {
                return Err(Errno::ENOENT);
            }
            if is_local_number(at) && !names.is_empty() {
                found_above = Some(self.find_local(at)?);
                break;
            }
            let (parent, name) = self.inodes.named_as(at).ok_or(Errno::ENOENT)?;
            names.push(name);
            at = parent;
        }
        names.reverse();
        let found = self.walk(at, &names);
        if let Some(above) = found_above {
            self.inodes.forget(above.node.ino, 1);
        }
        found
    }

    /// Looks `names` up one after the other from the live directory `from`; the last node
    /// is handed to the kernel, the ones on the way are not.
    fn walk(&self, from: u64, names: &[OsString]) -> Result<Entry, Errno> {
        let Some((last, path)) = names.split_last() else {
            let node = self.inodes.hand_out_number(from).ok_or(Errno::ENOENT)?;
            return self.entry_of(node);
        };
        let mut dir = from;
        let mut held: Option<u64> = None;
        let result = (|| {
            for name in path {
                let entry = self.lookup(dir, name)?;
                dir = entry.node.ino;
                if let Some(up) = held.replace(dir) {
                    self.inodes.forget(up, 1);
                }
            }
            self.lookup(dir, last)
        })();
        if let Some(up) = held {
            self.inodes.forget(up, 1);
        }
        result
    }
}

/// The name of the entry with inode number `ino` in the directory `dir`.
fn name_in(dir: BorrowedFd<'_>, ino: u64) -> Result<OsString, Errno> {
    dirent::read_dir(dir)?
        .into_iter()
        .find(|e| e.ino == ino && !reserved::is_reserved_name(e.name.as_bytes()))
        .map(|e| e.name)
        .ok_or(Errno::ENOENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let root = store::open_root(dir.path()).unwrap();
        let exports = Exports::open(root.as_fd());
        let record = Record {
            handle: FsHandle::from_parts(1, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap(),
            dir: 77,
        };
        exports.record(12, &record);
        assert_eq!(exports.get(12), Some(record.clone()));
        assert_eq!(exports.get(11), None, "a hole is no record");
        assert_eq!(exports.get(13), None, "past the end");
        exports.moved(12, 99);
        assert_eq!(exports.get(12).map(|r| r.dir), Some(99));
        exports.record(RECORDED_BELOW, &record);
        assert_eq!(exports.get(RECORDED_BELOW), None);
    }

    #[test]
    fn a_record_that_stands_is_not_written_again() {
        let dir = tempfile::tempdir().unwrap();
        let root = store::open_root(dir.path()).unwrap();
        let exports = Exports::open(root.as_fd());
        let record = Record {
            handle: FsHandle::from_parts(1, &[9; 8]).unwrap(),
            dir: 5,
        };
        let records = dir.path().join(std::ffi::OsStr::from_bytes(EXPORTS_NAME));
        let wipe = || std::fs::write(&records, []).unwrap();
        exports.record(3, &record);
        wipe();
        exports.record(3, &record);
        assert_eq!(exports.get(3), None, "the same record again writes nothing");
        let other = Record {
            dir: 6,
            ..record.clone()
        };
        exports.record(3, &other);
        assert_eq!(
            exports.get(3),
            Some(other.clone()),
            "a changed record is written"
        );
        exports.moved(3, 7);
        wipe();
        exports.record(3, &other);
        assert_eq!(
            exports.get(3),
            Some(other),
            "after a move the record is written again"
        );
    }
}
