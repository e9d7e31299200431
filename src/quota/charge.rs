//! Which root an object is under, and what is charged and credited to it: new entries,
//! changed files, removals, last closes and renames.

use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::Arc;

use nix::errno::Errno;
use tracing::warn;

use super::ledger::Ledger;
use super::scan::allocated;
use super::seam::{Allocated, Charge, Move, Object, Transfer, Under};
use super::table::QuotaRoot;
use crate::store;

impl Ledger {
    /// The root `obj` is under. Up the tree to the first object that knows its root for
    /// this generation of the roots, or is a root; the answer is then remembered on the
    /// way walked. A loop, not a recursion: the tree may be as deep as a caller makes it.
    pub(super) fn root_of<O: Object>(&self, obj: &Arc<O>) -> Option<Arc<QuotaRoot>> {
        if self.quotas.is_empty() {
            return None;
        }
        let generation = self.quotas.generation();
        let mut walked = Vec::new();
        let mut at = obj.clone();
        let root = loop {
            let known = at.tally(|tally, _| {
                // A file deleted while open has no name to find its root by, and is
                // charged to the root it was deleted from until its last close.
                if let Some(root) = &tally.orphan_of {
                    return Some(Some(root.clone()));
                }
                match &tally.under {
                    Some((g, under)) if *g == generation => Some(under.0.clone()),
                    _ => None,
                }
            });
            if let Some(root) = known {
                break root;
            }
            if let Some(root) = self.own_root(&*at) {
                walked.push(at);
                break Some(root);
            }
            let parent = at.parent();
            walked.push(at);
            match parent {
                Some(parent) => at = parent,
                None => break None,
            }
        };
        for o in walked {
            o.tally(|tally, _| tally.under = Some((generation, Under(root.clone()))));
        }
        root
    }

    /// The root `obj` is, if it is one.
    pub(super) fn own_root<O: Object>(&self, obj: &O) -> Option<Arc<QuotaRoot>> {
        if self.quotas.is_empty() {
            return None;
        }
        let local = obj.local_dir()?;
        let st = store::stat_fd(local.as_fd()).ok()?;
        self.quotas.root(st.st_dev, st.st_ino)
    }

    /// Charges `root` with `change`; returns the bytes charged.
    pub(super) fn charge_to<O: Object>(&self, root: &QuotaRoot, change: Charge<'_, O>) -> i64 {
        match change {
            Charge::Entry {
                dir,
                before,
                made,
                inodes,
            } => charge_new(root, dir, before, made, inodes),
            Charge::CopiedUp {
                obj,
                dir,
                before,
                copy,
            } => {
                let made = Allocated::of(copy);
                let generation = self.quotas.generation();
                obj.tally(|tally, _| tally.blocks = Some((generation, made.0)));
                charge_new(root, dir, before, made, 1)
            }
            Charge::File { obj, fd, before } => match before {
                Some(before) => self.settle(root, obj, fd, before.0),
                None => self.resettle(root, obj, fd),
            },
            Charge::Inodes(delta) => {
                root.charge_inodes(delta);
                0
            }
            Charge::Moved { plan, dir, before } => {
                plan.commit();
                charge_new(root, dir, before, Allocated::NONE, 0)
            }
        }
    }

    /// Records what a file under `root` holds now; `before` is what it held before the
    /// call that changed it, used if this is the first change seen since the file was
    /// made. Returns the change charged.
    fn settle<O: Object>(&self, root: &QuotaRoot, obj: &O, fd: BorrowedFd<'_>, before: u64) -> i64 {
        // Measured one call at a time per file, so that concurrent calls on one file each
        // charge what happened since the previous measurement, in order. Only calls that
        // charge this file wait on that; its state is locked for the update alone.
        let _one_at_a_time = obj.measuring();
        let Ok(st) = store::stat_fd(fd) else {
            return 0;
        };
        let now = allocated(&st);
        let generation = self.quotas.generation();
        let old = obj.tally(|tally, _| match tally.blocks.replace((generation, now)) {
            Some((g, known)) if g == generation => known,
            _ => before,
        });
        let delta = now as i64 - old as i64;
        root.charge(delta);
        delta
    }

    /// Measures a file again after its data reached the disk: a filesystem may allocate
    /// metadata (extent blocks) only at writeback, after the write was charged. A file not
    /// measured in this generation has nothing to compare with.
    fn resettle<O: Object>(&self, root: &QuotaRoot, obj: &O, fd: BorrowedFd<'_>) -> i64 {
        let generation = self.quotas.generation();
        let measured =
            obj.tally(|tally, _| matches!(tally.blocks, Some((g, _)) if g == generation));
        if !measured {
            return 0;
        }
        self.settle(root, obj, fd, 0)
    }

    /// Credits the space of an object whose name is gone from under `from`: now if it was
    /// the last, at its last close if it is a file still open.
    pub(super) fn credit_name<O: Object>(&self, from: &Under, obj: &O, st: &libc::stat) {
        let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
        // A removed quota root takes its quota with it.
        if is_dir && self.quotas.root(st.st_dev, st.st_ino).is_some() {
            let (removed, snapshot) = {
                let mut changes = self.quotas.lock_changes();
                let removed = self.quotas.remove(st.st_dev, st.st_ino);
                (removed, self.snapshot(&mut changes))
            };
            if let Err(e) = self.write(snapshot) {
                warn!(error = %e, "a removed quota root stays in the registry");
            }
            if let Some(root) = removed {
                self.removed_subvolume(&root);
            }
            return;
        }
        let Some(root) = from.0.as_ref().filter(|r| !r.by_kernel()) else {
            return;
        };
        if !is_dir && st.st_nlink > 1 {
            return;
        }
        if !is_dir {
            let open = obj.tally(|tally, opens| {
                if opens.files > 0 {
                    tally.orphan_of = Some(root.clone());
                }
                opens.files > 0
            });
            if open {
                return;
            }
        }
        root.charge(-(allocated(st) as i64));
        root.charge_inodes(-1);
    }

    /// An open of `obj` was closed: the last close of a file whose names are all gone
    /// credits its space to the root it was removed from.
    pub(super) fn credit_close<O: Object>(&self, obj: &O, fd: BorrowedFd<'_>) {
        let orphan = obj.tally(|tally, opens| match opens.files {
            0 => tally.orphan_of.take(),
            _ => None,
        });
        if let Some(root) = orphan {
            if let Ok(st) = store::stat_fd(fd) {
                root.charge(-(allocated(&st) as i64));
                root.charge_inodes(-1);
            }
        }
    }

    /// See [`super::Accounting::plan_move`].
    pub(super) fn plan<O: Object>(
        &self,
        obj: &Arc<O>,
        from_dir: &Arc<O>,
        to_dir: &Arc<O>,
        exchanged: Option<&Arc<O>>,
    ) -> Result<Move<O>, Errno> {
        let mut plan = Move {
            usage: None,
            dirs: Vec::new(),
        };
        if self.quotas.is_empty() {
            return Ok(plan);
        }
        plan.usage = self.transfer(obj, from_dir, to_dir)?;
        if exchanged.is_some() && plan.usage.is_some() {
            return Err(Errno::EXDEV);
        }
        plan.dirs = std::iter::once(obj)
            .chain(exchanged)
            .filter(|o| o.is_dir())
            .filter_map(|o| Some((o.clone(), o.path()?)))
            .collect();
        Ok(plan)
    }

    /// The usage that moves with `obj` from `from_dir` to `to_dir`, if any.
    fn transfer<O: Object>(
        &self,
        obj: &Arc<O>,
        from_dir: &Arc<O>,
        to_dir: &Arc<O>,
    ) -> Result<Option<Transfer>, Errno> {
        let to = self.root_of(to_dir);
        if obj.is_dir() && self.own_root(&**obj).is_some() {
            return if to.is_some() {
                Err(Errno::EXDEV)
            } else {
                Ok(None)
            };
        }
        let from = self.root_of(from_dir);
        if Under(from.clone()) == Under(to.clone()) {
            return Ok(None);
        }
        // A btrfs root is a subvolume of its own, which no rename crosses.
        if from.iter().chain(&to).any(|r| r.by_kernel()) {
            return Err(Errno::EXDEV);
        }
        let passthrough = || obj.tally(|_, opens| opens.passthrough > 0);
        if obj.is_dir() || (to.is_some() && passthrough()) {
            return Err(Errno::EXDEV);
        }
        let st = obj.stat()?;
        if st.st_nlink > 1 {
            return Err(Errno::EXDEV);
        }
        let (bytes, inodes) = (allocated(&st), 1);
        let room = match &to {
            Some(to) => Some(to.reserve_with_inodes(bytes, inodes)?),
            None => None,
        };
        Ok(Some(Transfer {
            from,
            to,
            bytes,
            inodes,
            _room: room,
        }))
    }

    /// See [`super::Accounting::renamed`].
    pub(super) fn moved<O: Object>(&self, plan: Move<O>) {
        if self.quotas.is_empty() {
            return;
        }
        let moves: Vec<(PathBuf, PathBuf)> = plan
            .dirs
            .iter()
            .filter_map(|(o, old)| Some((old.clone(), o.path()?)))
            .collect();
        if !moves.is_empty() {
            let snapshot = {
                let mut changes = self.quotas.lock_changes();
                self.quotas
                    .moved(&moves)
                    .then(|| self.snapshot(&mut changes))
            };
            if let Err(e) = snapshot.map_or(Ok(()), |s| self.write(s)) {
                warn!(error = %e, "the quota registry keeps the old path of a moved root");
            }
        }
        self.quotas.bump();
    }
}

impl<O> Move<O> {
    /// Carries the usage over, once the rename is done.
    pub(super) fn commit(&mut self) {
        let Some(t) = self.usage.take() else {
            return;
        };
        if let Some(from) = &t.from {
            from.charge(-(t.bytes as i64));
            from.charge_inodes(-(t.inodes as i64));
        }
        if let Some(to) = &t.to {
            to.charge(t.bytes as i64);
            to.charge_inodes(t.inodes as i64);
        }
    }
}

/// Charges `root` for what the directory `dir` grew by since `before`, plus `made` bytes
/// and `inodes` inodes of what was made in it; returns the bytes.
fn charge_new(
    root: &QuotaRoot,
    dir: BorrowedFd<'_>,
    before: Allocated,
    made: Allocated,
    inodes: u64,
) -> i64 {
    let bytes = Allocated::at(dir).0 as i64 - before.0 as i64 + made.0 as i64;
    root.charge(bytes);
    root.charge_inodes(inodes as i64);
    bytes
}
