//! The seam between the view and its quotas: [`Accounting`], the one trait the view calls,
//! and [`Object`], what the accounting needs to know of the view's objects.
//!
//! The view knows when a call allocates or frees, and which handles to measure; the
//! accounting knows which root a call is under, how much to set aside, what to charge and
//! when to credit. Neither reaches into the other: the view sees the trait and the values
//! it takes and returns, never a root, a reservation or the registry; the accounting sees
//! the view's nodes only through [`Object`], which the view implements. So `quota` names
//! no view type, and comes before `view` in the layering.
//!
//! The story of one call that allocates inside a root (a write, a mkdir, a copy-up):
//!
//! 1. [`Accounting::under`]: the root the call is under, found once for the whole call, so
//!    that a root set or cleared meanwhile never sees half of it;
//! 2. [`Accounting::reserve`]: room for what the call may allocate, estimated from what it
//!    is ([`Need`]): `used + reserved + estimate` must stay within the limit, or the call
//!    fails before it touches anything (`ENOSPC`, or `EDQUOT` with `-o quota_errno=edquot`);
//! 3. the call runs;
//! 4. [`Accounting::charge`]: what it did allocate, measured (`st_blocks` after minus
//!    before, see [`Allocated`]);
//! 5. the [`Reserved`] room is dropped.
//!
//! So concurrent writers can only overshoot a limit by what a single call allocates beyond
//! its estimate (filesystem metadata blocks), never by a whole write each. What goes away
//! (a last name, the last close of a file whose names are gone) is
//! [`credit`](Accounting::credit)ed. Calls that must work in a full root (the whiteouts
//! of a deletion) skip step 2 and are still charged.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use nix::errno::Errno;

use super::error::QuotaError;
use super::scan::allocated;
use super::table::{Limit, QuotaRoot, Reservation};
use crate::report::QuotaInfo;
use crate::store;

/// Quota accounting for a filesystem whose objects are `O`: what the view asks before and
/// after every call that allocates or frees space in local, and how it changes roots.
///
/// Usage is allocated space (`st_blocks`), so sparse holes are free until written, as with
/// XFS project quotas. Roots do not nest: a quota cannot be set inside, or above, another
/// root. Outside every root, the calls of the data path do nothing and everything fits;
/// while there is no root at all, they make no system call to find that out.
pub trait Accounting<O: Object> {
    /// The quota root `obj` is under (a directory is under itself when it is one), to be
    /// passed to the other methods for the rest of the call. A file whose last name is gone
    /// while it is open stays under the root it was removed from until its last close.
    fn under(&self, obj: &Arc<O>) -> Under;

    /// Sets aside room under `under` for what a call is about to allocate, or fails with
    /// the quota's errno when it does not fit; nothing always fits (overwriting allocated
    /// data, shrinking and punching holes work over a limit that was lowered). The room is
    /// given back when the [`Reserved`] is dropped, which is after the call is charged.
    fn reserve(&self, under: &Under, need: Need<'_>) -> Result<Reserved, Errno>;

    /// Records what a call did under `under`, measured now.
    fn charge(&self, under: &Under, change: Charge<'_, O>) -> Charged;

    /// Gives back the space of what is gone.
    fn credit(&self, gone: Gone<'_, O>);

    /// `statvfs` as seen from under `under`, given local's: a root's limit and room, so
    /// that `df` inside a container shows its limit.
    fn statfs(&self, under: &Under, local: libc::statvfs) -> libc::statvfs;

    /// Whether an open of `obj` may do its I/O with FUSE passthrough, unseen by the
    /// daemon: only outside quota roots. The view counts the open as a passthrough one
    /// ([`Opens::passthrough`]) before it asks, and stops counting it if the answer is no,
    /// so that a root being set meanwhile sees it (see [`Accounting::set`]).
    fn may_passthrough(&self, obj: &Arc<O>) -> bool;

    /// Plans renaming `obj` from the directory `from` into the directory `to`, exchanging
    /// it with `exchanged` if given. Within one root (or none) nothing moves. A file moving
    /// between roots takes its usage along, and the destination must have room. A
    /// directory moving between roots fails with `EXDEV`, as between XFS projects (`mv`
    /// then copies): counting it would take a walk of its whole tree while the kernel holds
    /// every other rename back. Roots move freely outside other roots, with their quota. A
    /// file that is open with passthrough (its writes would land unseen), one of several
    /// hard links, or one exchanged across roots, does not move into a root.
    ///
    /// Once the rename is done, its arrival is charged ([`Charge::Moved`]) and the plan
    /// ends with [`renamed`](Accounting::renamed); a plan dropped instead changes nothing.
    fn plan_move(
        &self,
        obj: &Arc<O>,
        from: &Arc<O>,
        to: &Arc<O>,
        exchanged: Option<&Arc<O>>,
    ) -> Result<Move<O>, Errno>;

    /// After a planned rename, once the objects have their new names: the roots under a
    /// moved directory follow it, and every object's root is found again.
    fn renamed(&self, plan: Move<O>);

    /// The quota of the directory `dir`, if it is a root.
    fn root(&self, dir: &O) -> Option<QuotaInfo>;

    /// Makes the directory `dir` a quota root with `limit`, or changes the limit of one;
    /// `local` gives it a local directory when it has none yet, `subvolume` turns that
    /// into a btrfs subvolume in place when the kernel is to enforce the quota (see
    /// `kernel`) and it is not one yet, and `live` lists the objects of the view, to find
    /// files open with passthrough.
    ///
    /// A new root is made visible before anything is checked or counted: from then on no
    /// open under it gets passthrough and every allocation is charged to it, so a writer
    /// that bypasses the daemon can only be one that was already open, which refuses the
    /// quota. The existing usage is then counted with no lock held (a rename elsewhere
    /// never waits for the walk), and added to what was charged meanwhile. The registry in
    /// local is saved before this returns.
    fn set(
        &self,
        dir: &Arc<O>,
        local: impl FnOnce() -> Result<Arc<OwnedFd>, Errno>,
        subvolume: impl FnOnce() -> Result<Arc<OwnedFd>, QuotaError>,
        limit: Limit,
        live: impl FnOnce() -> Vec<Arc<O>>,
    ) -> Result<QuotaInfo, QuotaError>;

    /// Removes the quota of the root `dir`; returns what it was.
    fn clear(&self, dir: &O) -> Result<QuotaInfo, QuotaError>;

    /// Every root, by path.
    fn list(&self) -> Vec<QuotaInfo>;
}

/// An object of the filesystem as the accounting needs to know it. The view implements it
/// for its nodes.
pub trait Object: Sized {
    /// The directory the object is reached through on disk; none for the root.
    fn parent(&self) -> Option<Arc<Self>>;
    /// Its path from the mount's root, by the names it was reached through.
    fn path(&self) -> Option<PathBuf>;
    fn is_dir(&self) -> bool;
    /// A directory's local directory, once it has one; none for other objects.
    fn local_dir(&self) -> Option<Arc<OwnedFd>>;
    /// Its attributes on disk, read through the handle it holds.
    fn stat(&self) -> Result<libc::stat, Errno>;
    /// Runs `f` on the object's [`Tally`] with its [`Opens`], under the lock of its state:
    /// a file is credited at its last close or at its last name, whichever comes last, so
    /// the two must never both think the other is still to come.
    fn tally<T>(&self, f: impl FnOnce(&mut Tally, Opens) -> T) -> T;
    /// Held while a call measures the file, so that concurrent calls on one file each
    /// charge what happened since the previous measurement, in order. Only calls that
    /// charge the same file wait on it.
    fn measuring(&self) -> parking_lot::MutexGuard<'_, ()>;
}

/// What the accounting keeps on each object, under the object's lock (see
/// [`Object::tally`]). A new object starts with the default.
#[derive(Debug, Default)]
pub struct Tally {
    /// The root the object is under, and the generation of the roots that answer holds
    /// for (see `table::Quotas::generation`).
    pub(super) under: Option<(u64, Under)>,
    /// Files under a root: allocated bytes when last measured, and the generation of that
    /// measurement (one taken before a root was set or cleared, or the file moved, says
    /// nothing about what was charged since).
    pub(super) blocks: Option<(u64, u64)>,
    /// A file whose last name went while it was open: the root its space is credited to at
    /// its last close.
    pub(super) orphan_of: Option<Arc<QuotaRoot>>,
}

/// The opens of an object the view counts, as [`Object::tally`] reads them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Opens {
    /// Opens that are live.
    pub files: u32,
    /// Of them, those doing their I/O straight on local (FUSE passthrough), unseen.
    pub passthrough: u32,
}

/// The quota root a call is under, or none: what [`Accounting::under`] found. Two are
/// equal when they are the same root, or both none.
#[derive(Debug, Clone, Default)]
pub struct Under(pub(super) Option<Arc<QuotaRoot>>);

impl Under {
    /// Outside every root: nothing is reserved, charged or credited.
    pub fn is_none(&self) -> bool {
        self.0.is_none()
    }
}

impl PartialEq for Under {
    fn eq(&self, other: &Under) -> bool {
        match (&self.0, &other.0) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        }
    }
}

/// The space an object holds, as quotas count it: measured before a call, so that what the
/// call added can be charged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Allocated(pub(super) u64);

impl Allocated {
    pub const NONE: Allocated = Allocated(0);

    pub fn of(st: &libc::stat) -> Allocated {
        Allocated(allocated(st))
    }

    /// Of the object open as `fd`; none when it cannot be read.
    pub fn at(fd: BorrowedFd<'_>) -> Allocated {
        store::stat_fd(fd).map_or(Allocated::NONE, |st| Allocated::of(&st))
    }
}

/// What a call is about to allocate (see [`Accounting::reserve`]).
#[derive(Debug, Clone, Copy)]
pub enum Need<'a> {
    /// A new name that holds no data (a file, a device node, a hard link), making `inodes`
    /// new inodes: as on XFS, where a new entry reserves directory space, it needs a root
    /// that is not full.
    Entry { inodes: u64 },
    /// A new directory.
    Dir,
    /// A new symlink whose target is `len` bytes long.
    Symlink { len: usize },
    /// The copy-up of a remote object into local: a new inode, and for a file copied with
    /// its data, the data of `data` (the remote file).
    CopyUp { data: Option<BorrowedFd<'a>> },
    /// Writing `len` bytes at `offset` of the file `fd`, stat'ed as `st`: as many as fit,
    /// as a full disk makes a short write ([`Reserved::granted`] says how many).
    Write {
        fd: BorrowedFd<'a>,
        st: &'a libc::stat,
        offset: u64,
        len: u64,
    },
    /// Allocating `len` bytes at `offset` of the file `fd` (`fallocate`): all or nothing.
    Range {
        fd: BorrowedFd<'a>,
        st: &'a libc::stat,
        offset: u64,
        len: u64,
    },
    /// The holes of the file `fd`, for as long as an open of it lasts: a writer whose
    /// writes are counted, on a file a shared mapping may fill unseen.
    Holes { fd: BorrowedFd<'a> },
}

/// Room set aside by [`Accounting::reserve`]; given back when dropped.
#[derive(Debug, Default)]
pub struct Reserved {
    /// Given back when dropped.
    pub(super) _room: Option<Reservation>,
    pub(super) granted: u64,
}

impl Reserved {
    /// For a [`Need::Write`]: how many of the bytes may be written.
    pub fn granted(&self) -> u64 {
        self.granted
    }
}

/// What a call did (see [`Accounting::charge`]).
pub enum Charge<'a, O> {
    /// New entries in the directory `dir`: what it grew by since `before`, plus the object
    /// made (`made`) and `inodes` new inodes.
    Entry {
        dir: BorrowedFd<'a>,
        before: Allocated,
        made: Allocated,
        inodes: u64,
    },
    /// The file `obj` copied up into `dir` (which held `before`), the copy stat'ed as
    /// `copy`: charged as a new entry, and remembered as what the file holds, which its
    /// later changes are charged against.
    CopiedUp {
        obj: &'a O,
        dir: BorrowedFd<'a>,
        before: Allocated,
        copy: &'a libc::stat,
    },
    /// The data of the file `obj`, open as `fd`, changed: what it holds now, less what it
    /// held when last measured, or `before` if this is the first measurement since it was
    /// made, moved, or a root was set or cleared. With no `before`, only a file measured
    /// since is measured again (its data reached the disk, and a filesystem may allocate
    /// metadata only then).
    File {
        obj: &'a O,
        fd: BorrowedFd<'a>,
        before: Option<Allocated>,
    },
    /// Whiteouts made (or, negative, removed): inodes with no data.
    Inodes(i64),
    /// A planned rename is done and arrived in `dir` (which held `before`): the usage of
    /// what moved between roots moves along, and what `dir` grew by is charged.
    Moved {
        plan: &'a mut Move<O>,
        dir: BorrowedFd<'a>,
        before: Allocated,
    },
}

/// What a charge did.
#[derive(Debug, Clone, Copy, Default)]
pub struct Charged {
    /// Bytes charged; negative when the call freed space.
    pub bytes: i64,
    /// The root is over its limit now (the call allocated more than was set aside, or the
    /// limit was lowered), with the errno a call over the limit fails with.
    pub over: Option<Errno>,
}

/// What went away (see [`Accounting::credit`]).
pub enum Gone<'a, O> {
    /// A name of `obj` in a directory under `from` is gone; `st`: its attributes from just
    /// before. Its space is credited once no name is left, or, for a file still open, at
    /// its last close (as a filesystem frees it then). A root removed takes its quota
    /// with it.
    Name {
        from: &'a Under,
        obj: &'a O,
        st: &'a libc::stat,
    },
    /// An open of `obj` (through `fd`) was closed: the last close of a file whose names
    /// are all gone frees its space.
    Open { obj: &'a O, fd: BorrowedFd<'a> },
}

/// A rename planned by [`Accounting::plan_move`].
pub struct Move<O> {
    /// The usage that moves between roots, and the room it takes in the destination.
    pub(super) usage: Option<Transfer>,
    /// The directories renamed, each with its path from before, while there are roots.
    pub(super) dirs: Vec<(Arc<O>, PathBuf)>,
}

/// A file's usage moving from one root to another.
pub(super) struct Transfer {
    pub(super) from: Option<Arc<QuotaRoot>>,
    pub(super) to: Option<Arc<QuotaRoot>>,
    pub(super) bytes: u64,
    pub(super) inodes: u64,
    pub(super) _room: Option<Reservation>,
}
