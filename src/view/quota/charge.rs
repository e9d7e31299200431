//! The accounting around calls that make, remove or move names inside a quota root, and
//! the per-file measurements every charge ends with.

use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::Arc;

use nix::errno::Errno;
use tracing::warn;

use crate::quota::io::block_size;
use crate::quota::scan::allocated;
use crate::quota::table::{QuotaRoot, Reservation};
use crate::store;
use crate::view::copyup::Room;
use crate::view::node::Node;
use crate::view::{Stat, View};

/// The estimate of calls that make a new name: they need a root that is not full, as on
/// XFS, where a new entry reserves directory space.
pub(in crate::view) const NEEDS_ROOM: u64 = 1;

/// Quota set aside for as long as an open lasts (see [`View::hold_holes`]).
#[derive(Debug)]
pub struct Held {
    _reservation: Reservation,
}

/// What happens to a quota root's usage when something moves between roots.
pub(in crate::view) struct Move {
    from: Option<Arc<QuotaRoot>>,
    to: Option<Arc<QuotaRoot>>,
    bytes: u64,
    inodes: u64,
    _room: Option<Reservation>,
}

impl Move {
    /// Carries the usage over, once the rename is done.
    pub(in crate::view) fn commit(self) {
        if let Some(from) = &self.from {
            from.charge(-(self.bytes as i64));
            from.charge_inodes(-(self.inodes as i64));
        }
        if let Some(to) = &self.to {
            to.charge(self.bytes as i64);
            to.charge_inodes(self.inodes as i64);
        }
    }
}

impl View {
    /// Runs `op`, which makes one new object in the directory `parent`, inside the quota
    /// of `parent`: `estimate` bytes must fit, and what the directory and the new object
    /// (`made`) allocate is charged, plus `inodes` inodes.
    pub(in crate::view) fn allocating<T>(
        &self,
        parent: &Arc<Node>,
        estimate: u64,
        inodes: u64,
        op: impl FnOnce() -> Result<T, Errno>,
        made: impl FnOnce(&T) -> u64,
    ) -> Result<T, Errno> {
        self.charged(parent, Some(estimate), inodes, op, made)
    }

    /// Like [`View::allocating`], for calls that must work in a full root (the whiteouts
    /// and links of a deletion, which take an inode and no data blocks): nothing is
    /// reserved, what they allocate is still charged.
    pub(in crate::view) fn recording<T>(
        &self,
        parent: &Arc<Node>,
        inodes: u64,
        op: impl FnOnce() -> Result<T, Errno>,
        made: impl FnOnce(&T) -> u64,
    ) -> Result<T, Errno> {
        self.charged(parent, None, inodes, op, made)
    }

    fn charged<T>(
        &self,
        parent: &Arc<Node>,
        estimate: Option<u64>,
        inodes: u64,
        op: impl FnOnce() -> Result<T, Errno>,
        made: impl FnOnce(&T) -> u64,
    ) -> Result<T, Errno> {
        let Some(root) = self.quota_of(parent) else {
            return op();
        };
        let reservation = estimate
            .map(|bytes| root.reserve_with_inodes(bytes, inodes))
            .transpose()?;
        // Any copy-up of the directory is charged by itself, before "before".
        let room = match estimate {
            Some(_) => Room::Reserve,
            None => Room::Never,
        };
        let dir = self.local_dir_of(parent, room)?;
        let before = dir_blocks(dir.as_fd());
        let out = op()?;
        charge_new(&root, dir.as_fd(), before, made(&out), inodes);
        drop(reservation);
        Ok(out)
    }

    /// Counts `delta` more (or fewer) inodes under `node`'s root: whiteouts made or removed.
    pub(in crate::view) fn charge_inodes(&self, node: &Arc<Node>, delta: i64) {
        if let Some(root) = self.quota_of(node) {
            root.charge_inodes(delta);
        }
    }

    /// The block size of local's filesystem: what a new directory costs at least.
    pub(in crate::view) fn local_block_size(&self) -> u64 {
        // `virtual_base` is local's root as stat'ed at mount: no syscall here.
        block_size(&self.virtual_base)
    }

    /// Credits the space of an object whose last name is gone, or, for a file still
    /// open, marks it to be credited at its last close (as a filesystem frees it then).
    pub(in crate::view) fn credit_removed(
        &self,
        root: Option<Arc<QuotaRoot>>,
        node: &Node,
        st: &Stat,
    ) {
        let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
        // A removed quota root takes its quota with it.
        if is_dir && self.quotas.root(st.st_dev, st.st_ino).is_some() {
            let _changes = self.quotas.lock_changes();
            self.quotas.remove(st.st_dev, st.st_ino);
            if let Err(e) = self.save_quotas() {
                warn!(error = %e, "a removed quota root stays in the registry");
            }
            return;
        }
        let Some(root) = root else {
            return;
        };
        if !is_dir && st.st_nlink > 1 {
            return;
        }
        if !is_dir {
            let mut state = node.state();
            if state.open_files > 0 {
                state.orphan_of = Some(root);
                return;
            }
        }
        root.charge(-(allocated(st) as i64));
        root.charge_inodes(-1);
    }

    /// What a writer of `node` (open through `fd`) must hold while its writes are counted
    /// but a shared mapping of it maps the file itself: the kernel binds every open of a
    /// file that is open for passthrough reading to the same backing file, so a mapping
    /// could fill the file's holes unseen. Its holes are set aside in the quota for as long
    /// as the open lasts (`EDQUOT` when they do not fit), and what it did is measured at
    /// its close. `None` outside quota roots.
    pub fn hold_holes(&self, node: &Arc<Node>, fd: BorrowedFd<'_>) -> Result<Option<Held>, Errno> {
        let Some(root) = self.quota_of(node) else {
            return Ok(None);
        };
        let st = store::stat_fd(fd)?;
        let block = self.local_block_size().max(1);
        let size = (st.st_size as u64).div_ceil(block) * block;
        let holes = size.saturating_sub(allocated(&st));
        let reservation = root.reserve(holes)?;
        Ok(Some(Held {
            _reservation: reservation,
        }))
    }

    /// Whether an open of `node` may do its I/O with FUSE passthrough, unseen by the
    /// daemon: only outside quota roots. It counts as a passthrough open from before its
    /// root is looked up, so that a quota being set meanwhile sees it (see
    /// [`View::set_quota`]); [`View::bypass_refused`] takes it back.
    pub fn may_bypass(&self, node: &Arc<Node>) -> bool {
        node.state().passthrough_opens += 1;
        let free = self.quota_of(node).is_none();
        if !free {
            self.bypass_refused(node);
        }
        free
    }

    /// An open that [`View::may_bypass`] counted does not do passthrough after all.
    pub fn bypass_refused(&self, node: &Node) {
        let mut state = node.state();
        state.passthrough_opens = state.passthrough_opens.saturating_sub(1);
    }

    /// An open of `node` was made (see [`View::released`]); `maps_writes`: it is a
    /// passthrough open that may write.
    pub fn opened(&self, node: &Node, maps_writes: bool) {
        let mut state = node.state();
        state.open_files += 1;
        state.mapped_writers += maps_writes as u32;
    }

    /// Measures a file again after its data reached the disk: a filesystem may allocate
    /// metadata (extent blocks) only at writeback, after the write was charged.
    pub fn resettle(&self, node: &Arc<Node>, fd: BorrowedFd<'_>) {
        if self.quotas.is_empty() {
            return;
        }
        let generation = self.quotas.generation();
        if !matches!(node.state().blocks, Some((g, _)) if g == generation) {
            return;
        }
        if let Some(root) = self.quota_of(node) {
            self.settle(&root, node, fd, 0);
        }
    }

    /// An open of `node` was closed; the last close of a file whose names are all gone
    /// frees its space.
    pub fn released(
        &self,
        node: &Arc<Node>,
        fd: BorrowedFd<'_>,
        bypasses: bool,
        maps_writes: bool,
    ) {
        self.resettle(node, fd);
        let orphan = {
            let mut state = node.state();
            state.open_files = state.open_files.saturating_sub(1);
            state.passthrough_opens = state.passthrough_opens.saturating_sub(bypasses as u32);
            state.mapped_writers = state.mapped_writers.saturating_sub(maps_writes as u32);
            if state.open_files > 0 {
                return;
            }
            state.orphan_of.take()
        };
        if let Some(root) = orphan {
            if let Ok(st) = store::stat_fd(fd) {
                root.charge(-(allocated(&st) as i64));
                root.charge_inodes(-1);
            }
        }
    }

    /// Records what a file under `root` holds now; `before` is what it held before the
    /// call that changed it, used if this is the first change seen since the node was made.
    /// Returns the change charged.
    pub(in crate::view) fn settle(
        &self,
        root: &QuotaRoot,
        node: &Node,
        fd: BorrowedFd<'_>,
        before: u64,
    ) -> i64 {
        // Measured one call at a time per file, so that concurrent calls on one file each
        // charge what happened since the previous measurement, in order. Only calls that
        // charge this file wait on that; its state is locked for the update alone.
        let _one_at_a_time = node.settle_lock();
        let Ok(st) = store::stat_fd(fd) else {
            return 0;
        };
        let now = allocated(&st);
        let generation = self.quotas.generation();
        let old = match node.state().blocks.replace((generation, now)) {
            Some((g, known)) if g == generation => known,
            _ => before,
        };
        let delta = now as i64 - old as i64;
        root.charge(delta);
        delta
    }

    /// Plans moving `node` (a name of `from_dir`) into `to_dir`: where both are under the
    /// same root (or none), nothing moves; a file moving between roots takes its usage
    /// along, and the destination must have room. A directory moving between roots fails
    /// with `EXDEV`, as between XFS projects (`mv` then copies): counting it would take a
    /// walk of its whole tree while the kernel holds every other rename back. Quota roots
    /// move freely outside other roots, with their quota. A file that is open with
    /// passthrough (its writes would land unseen), or one of several hard links, does not
    /// move into a root.
    pub(in crate::view) fn plan_move(
        &self,
        node: &Arc<Node>,
        from_dir: &Arc<Node>,
        to_dir: &Arc<Node>,
    ) -> Result<Option<Move>, Errno> {
        if self.quotas.is_empty() {
            return Ok(None);
        }
        let to = self.quota_of(to_dir);
        if node.is_dir() && self.own_root(node).is_some() {
            return if to.is_some() {
                Err(Errno::EXDEV)
            } else {
                Ok(None)
            };
        }
        let from = self.quota_of(from_dir);
        let same = match (&from, &to) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        if same {
            return Ok(None);
        }
        if node.is_dir() || (to.is_some() && node.state().passthrough_opens > 0) {
            return Err(Errno::EXDEV);
        }
        let object = node.object().ok_or(Errno::ESTALE)?;
        let st = store::stat_fd(object.as_fd())?;
        if st.st_nlink > 1 {
            return Err(Errno::EXDEV);
        }
        let (bytes, inodes) = (allocated(&st), 1);
        let room = match &to {
            Some(to) => Some(to.reserve_with_inodes(bytes, inodes)?),
            None => None,
        };
        Ok(Some(Move {
            from,
            to,
            bytes,
            inodes,
            _room: room,
        }))
    }

    /// After a rename: the roots under a moved directory follow it, and every node's
    /// cached root is re-derived.
    /// `moved`: each moved node with its path from before the rename (one node, or two
    /// for an exchange).
    pub(in crate::view) fn renamed(&self, moved: &[(&Arc<Node>, Option<PathBuf>)]) {
        if self.quotas.is_empty() {
            return;
        }
        let moves: Vec<(PathBuf, PathBuf)> = moved
            .iter()
            .filter(|(node, _)| node.is_dir())
            .filter_map(|(node, old)| Some((old.clone()?, self.rel_path(node)?)))
            .collect();
        if !moves.is_empty() {
            let _changes = self.quotas.lock_changes();
            if self.quotas.moved(&moves) {
                if let Err(e) = self.save_quotas() {
                    warn!(error = %e, "the quota registry keeps the old path of a moved root");
                }
            }
        }
        self.quotas.bump();
    }
}

/// Charges `root` for what a directory grew by since `dir_before` (from [`dir_blocks`]),
/// plus `made` bytes and `inodes` inodes of what was made in it.
pub(in crate::view) fn charge_new(
    root: &QuotaRoot,
    dir: BorrowedFd<'_>,
    dir_before: u64,
    made: u64,
    inodes: u64,
) {
    root.charge(dir_blocks(dir) as i64 - dir_before as i64 + made as i64);
    root.charge_inodes(inodes as i64);
}

/// Allocated bytes of a directory, 0 when it cannot be read.
pub(in crate::view) fn dir_blocks(dir: BorrowedFd<'_>) -> u64 {
    store::stat_fd(dir).map(|st| allocated(&st)).unwrap_or(0)
}
