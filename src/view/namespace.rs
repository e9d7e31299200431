//! Changes to the namespace: create, mkdir, mknod, symlink, link, unlink, rmdir, rename.
//!
//! All of them write local only. The kernel holds the directories' locks around each call,
//! so a name never changes between our checks and our writes through the view. A whiteout
//! is never removed before what replaces it is in place (see [`super::names`]): a failed or
//! interrupted call never brings a deleted remote entry back.
//!
//! Renaming a directory that merges remote content fails with `EXDEV`, as overlayfs does
//! without `redirect_dir`; `mv` then copies and deletes. Files and symlinks are copied up
//! and renamed; the old name gets a whiteout in the same `renameat2(RENAME_WHITEOUT)` where
//! the filesystem has it.

use std::ffi::{CStr, OsStr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::{Gid, Uid, UnlinkatFlags};

use super::copyup::Room;
use super::names::temp_name;
use super::node::{Layer, Node};
use super::{marker, names, view_name, Caller, Entry, Found, IndexOnce, Probe, Stat, View};
use crate::quota::{Accounting, Allocated, Charge, Gone, Need};
use crate::store::{self, creds, Kind};

/// Keeps a node the kernel did not hand us for the duration of one operation.
struct Held<'a> {
    view: &'a View,
    node: Arc<Node>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.view.inodes.forget(self.node.ino, 1);
    }
}

impl View {
    pub fn create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        caller: Caller,
    ) -> Result<(Entry, OwnedFd), Errno> {
        let parent = self.dir(parent)?;
        self.allocating(
            &parent,
            Need::Entry { inodes: 1 },
            1,
            || self.create_file(&parent, name, mode, flags, caller),
            |(entry, _)| Allocated::of(&entry.stat),
        )
    }

    fn create_file(
        &self,
        parent: &Arc<Node>,
        name: &OsStr,
        mode: u32,
        flags: i32,
        caller: Caller,
    ) -> Result<(Entry, OwnedFd), Errno> {
        let keep = libc::O_ACCMODE | libc::O_SYNC | libc::O_DSYNC;
        let oflags = OFlag::from_bits_truncate(flags & keep) | OFlag::O_CREAT | OFlag::O_EXCL;
        self.place_new(parent, name, Kind::File, false, |dir, at| {
            let fd = creds::run_as(caller.acting(), || {
                store::open_at(dir, at, oflags, mode & 0o7777)
            })?;
            match give_to_caller(fd.as_fd(), caller, dir, mode, Kind::File) {
                Ok(()) => Ok(fd),
                Err(e) => {
                    let _ = names::remove_any(dir, at, false);
                    Err(e)
                }
            }
        })
    }

    pub fn mkdir(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let parent = self.dir(parent)?;
        self.allocating(
            &parent,
            Need::Dir,
            1,
            || self.make_dir(&parent, name, mode, caller),
            |entry| Allocated::of(&entry.stat),
        )
    }

    fn make_dir(
        &self,
        parent: &Arc<Node>,
        name: &OsStr,
        mode: u32,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let below = self.exists_below(parent, name, &view_name(name)?)?;
        let (entry, ()) = self.place_new(parent, name, Kind::Dir, false, |dir, at| {
            creds::run_as(caller.acting(), || {
                nix::sys::stat::mkdirat(dir, at, Mode::from_bits_truncate(mode & 0o7777))
            })?;
            let made = store::open_dir_at(dir, at).and_then(|fd| {
                give_to_caller(fd.as_fd(), caller, dir, mode, Kind::Dir)?;
                // A directory made where a remote one is hidden must not let its entries back.
                if below {
                    marker::set_opaque(fd.as_fd())?;
                }
                Ok(())
            });
            if made.is_err() {
                let _ = names::remove_any(dir, at, true);
            }
            made
        })?;
        Ok(entry)
    }

    pub fn mknod(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let parent = self.dir(parent)?;
        let make = || self.make_node(&parent, name, mode, rdev, caller);
        let made = |entry: &Entry| Allocated::of(&entry.stat);
        if mode & libc::S_IFMT == libc::S_IFCHR && rdev == 0 {
            // Kernel overlayfs stacked on the view deletes with these: a deletion must work
            // in a full root.
            self.recording(&parent, 1, make, made)
        } else {
            self.allocating(&parent, Need::Entry { inodes: 1 }, 1, make, made)
        }
    }

    fn make_node(
        &self,
        parent: &Arc<Node>,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let kind = SFlag::from_bits_truncate(mode & libc::S_IFMT);
        let zero = kind == SFlag::S_IFCHR && rdev == 0;
        // A 0/0 device where a whiteout would hide something is marked as a real device
        // before it takes its name, so that it is never, even for a moment, a whiteout.
        let device = zero && parent.zone.has_below();
        let (entry, ()) =
            self.place_new(parent, name, Kind::from_mode(mode), device, |dir, at| {
                creds::run_as(caller.acting(), || {
                    nix::sys::stat::mknodat(
                        dir,
                        at,
                        kind,
                        Mode::from_bits_truncate(mode & 0o7777),
                        rdev as u64,
                    )
                })?;
                let made = store::open_path_at(dir, at).and_then(|fd| {
                    if device {
                        // Without trusted attributes there is no telling it from a whiteout:
                        // refuse it, as kernel overlayfs refuses every such device.
                        marker::set_device(fd.as_fd()).map_err(|_| Errno::EPERM)?;
                    } else if zero {
                        // Needed only if its directory ever moves where something lies
                        // below, which a node's zone, fixed when the kernel first looked it
                        // up, may not show yet: without the mark it would be a whiteout
                        // there once the kernel forgets it.
                        let _ = marker::set_device(fd.as_fd());
                    }
                    give_to_caller(fd.as_fd(), caller, dir, mode, Kind::from_mode(mode))
                });
                if made.is_err() {
                    let _ = names::remove_any(dir, at, false);
                }
                made
            })?;
        Ok(entry)
    }

    pub fn symlink(
        &self,
        parent: u64,
        name: &OsStr,
        target: &OsStr,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let parent = self.dir(parent)?;
        self.allocating(
            &parent,
            Need::Symlink { len: target.len() },
            1,
            || self.make_symlink(&parent, name, target, caller),
            |entry| Allocated::of(&entry.stat),
        )
    }

    fn make_symlink(
        &self,
        parent: &Arc<Node>,
        name: &OsStr,
        target: &OsStr,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let (entry, ()) = self.place_new(parent, name, Kind::Symlink, false, |dir, at| {
            creds::run_as(caller.acting(), || nix::unistd::symlinkat(target, dir, at))?;
            if creds::acts_as_caller() {
                return Ok(());
            }
            let owned = self.new_gid(dir, caller).and_then(|gid| {
                nix::unistd::fchownat(
                    dir,
                    at,
                    Some(Uid::from_raw(caller.uid)),
                    gid,
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )
            });
            if owned.is_err() {
                let _ = names::remove_any(dir, at, false);
            }
            owned
        })?;
        Ok(entry)
    }

    pub fn link(&self, ino: u64, new_parent: u64, new_name: &OsStr) -> Result<Entry, Errno> {
        let node = self.node(ino)?;
        if node.is_dir() {
            return Err(Errno::EPERM);
        }
        let dir_node = self.dir(new_parent)?;
        // One inode cannot count against two roots: links across a root's boundary are
        // refused, as between XFS projects.
        let from = node.primary().map(|(p, _)| self.quota().under(&p));
        if from.unwrap_or_default() != self.quota().under(&dir_node) {
            return Err(Errno::EXDEV);
        }
        // Copied up first, and charged by itself, so the link measures only its own entry.
        self.copy_up(&node, true)?;
        let object = node.object().ok_or(Errno::ESTALE)?;
        let st = store::stat_fd(object.as_fd())?;
        if dir_node.zone.has_below() {
            marker::keep_device(object.as_fd(), &st)?;
        }
        let make = || self.make_link(&node, &object, &dir_node, new_name);
        if store::is_whiteout(&st) {
            // Kernel overlayfs stacked on the view makes its whiteouts as links to one: a
            // deletion must work in a full root.
            self.recording(&dir_node, 0, make, |_| Allocated::NONE)
        } else {
            let need = Need::Entry { inodes: 0 };
            self.allocating(&dir_node, need, 0, make, |_| Allocated::NONE)
        }
    }

    fn make_link(
        &self,
        node: &Arc<Node>,
        object: &OwnedFd,
        parent: &Arc<Node>,
        new_name: &OsStr,
    ) -> Result<Entry, Errno> {
        // By the object itself: its names may have changed since the kernel looked it up.
        let (entry, ()) = self.place_new(parent, new_name, node.kind, false, |dir, at| {
            nix::unistd::linkat(object.as_fd(), c"", dir, at, AtFlags::AT_EMPTY_PATH)
        })?;
        Ok(entry)
    }

    pub fn unlink(&self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        let parent = self.dir(parent)?;
        let c = view_name(name)?;
        let held = self.hold(&parent, name, &c)?;
        if held.node.is_dir() {
            return Err(Errno::EISDIR);
        }
        self.remove(&parent, name, &c, &held.node)
    }

    pub fn rmdir(&self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        let parent = self.dir(parent)?;
        let c = view_name(name)?;
        let held = self.hold(&parent, name, &c)?;
        if !held.node.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        let fds = held.node.dir_fds();
        if !self.is_empty_dir(held.node.zone, held.node.ino, &fds)? {
            return Err(Errno::ENOTEMPTY);
        }
        self.remove(&parent, name, &c, &held.node)
    }

    pub fn rename(
        &self,
        parent: u64,
        name: &OsStr,
        new_parent: u64,
        new_name: &OsStr,
        flags: u32,
    ) -> Result<(), Errno> {
        let flags = RenameFlags::from_bits(flags).ok_or(Errno::EINVAL)?;
        let parent = self.dir(parent)?;
        // A whiteout left behind on request is an ordinary visible device node, which only
        // directories with nothing below can hold (overlayfs asks this of its upper dir).
        if flags.contains(RenameFlags::RENAME_WHITEOUT)
            && (parent.zone.has_below() || flags.contains(RenameFlags::RENAME_EXCHANGE))
        {
            return Err(Errno::EINVAL);
        }
        let new_parent = self.dir(new_parent)?;
        let c = view_name(name)?;
        let new_c = view_name(new_name)?;
        let src = self.hold(&parent, name, &c)?;
        let dst = match self.hold(&new_parent, new_name, &new_c) {
            Ok(held) => Some(held),
            Err(Errno::ENOENT) => None,
            Err(e) => return Err(e),
        };
        if let Some(dst) = &dst {
            if Arc::ptr_eq(&src.node, &dst.node) {
                // Two names of one file: POSIX says do nothing.
                return Ok(());
            }
            if flags.contains(RenameFlags::RENAME_NOREPLACE) {
                return Err(Errno::EEXIST);
            }
        } else if flags.contains(RenameFlags::RENAME_EXCHANGE) {
            return Err(Errno::ENOENT);
        }
        self.make_movable(&src.node)?;
        let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
        // As for a removal: a copy-up of the replaced object under way would land on the
        // name after the move. An exchanged one is copied up here, and has none under way.
        let copying = dst
            .as_ref()
            .filter(|_| !exchange)
            .map(|d| (&d.node, d.node.copy_lock()));
        if let Some((node, copying)) = &copying {
            self.copy_up_for_writers(node, copying)?;
        }
        if let Some(dst) = &dst {
            if exchange {
                self.make_movable(&dst.node)?;
            } else if dst.node.is_dir() {
                let fds = dst.node.dir_fds();
                if !self.is_empty_dir(dst.node.zone, dst.node.ino, &fds)? {
                    return Err(Errno::ENOTEMPTY);
                }
            }
        }
        let exchanged = dst.as_ref().filter(|_| exchange).map(|d| &d.node);
        let mut moving = self
            .quota()
            .plan_move(&src.node, &parent, &new_parent, exchanged)?;
        let src_dir = parent.dir_fds().local.ok_or(Errno::ESTALE)?;
        let dst_dir = self.ensure_local_dir(&new_parent)?;
        self.keep_devices_moving(&src.node, &new_parent)?;
        if let Some(dst) = dst.as_ref().filter(|_| exchange) {
            self.keep_devices_moving(&dst.node, &parent)?;
        }
        let dst_root = self.quota().under(&new_parent);
        let dst_before = match dst_root.is_none() {
            true => Allocated::NONE,
            false => Allocated::at(dst_dir.as_fd()),
        };
        let src_below = self.exists_below(&parent, name, &c)?;
        let dst_below = self.exists_below(&new_parent, new_name, &new_c)?;
        // Opaque before the move: a directory arriving over a hidden remote directory must
        // never merge with it, not even until a crash is recovered from.
        if src.node.is_dir() && dst_below {
            if let Some(fd) = src.node.dir_fds().local {
                marker::set_opaque(fd.as_fd())?;
            }
        }
        if let Some(dst) = dst
            .as_ref()
            .filter(|d| exchange && d.node.is_dir() && src_below)
        {
            if let Some(fd) = dst.node.dir_fds().local {
                marker::set_opaque(fd.as_fd())?;
            }
        }
        let mut replaced = None;
        // A directory replaced by the rename may hold whiteouts, which go only once it no
        // longer merges with what is below its name: it is first replaced by a whiteout.
        if let Some(dst) = dst.as_ref().filter(|d| !exchange && d.node.is_dir()) {
            if let Some(local) = dst.node.dir_fds().local {
                if dst_below {
                    replaced = store::stat_fd(local.as_fd()).ok();
                    let cleared = names::whiteout_over(dst_dir.as_fd(), &new_c, true)?;
                    self.charge_inodes(&new_parent, 1 - cleared as i64);
                } else {
                    let cleared = names::empty_out(local.as_fd())?;
                    self.charge_inodes(&new_parent, -(cleared as i64));
                }
            }
        }
        // A whiteout at the target hides a deleted remote entry: the target name is free in
        // the view, and the whiteout goes only as the moved object takes its place.
        let dst_whiteout =
            !exchange && names::is_whiteout(new_parent.zone, dst_dir.as_fd(), &new_c);
        if !exchange && !dst_whiteout {
            replaced = store::stat_at(dst_dir.as_fd(), &new_c).ok();
        }
        let mut how = flags
            & (RenameFlags::RENAME_EXCHANGE
                | RenameFlags::RENAME_NOREPLACE
                | RenameFlags::RENAME_WHITEOUT);
        if dst_whiteout {
            how.remove(RenameFlags::RENAME_NOREPLACE);
        }
        let (from, to) = (
            (src_dir.as_fd(), c.as_c_str()),
            (dst_dir.as_fd(), new_c.as_c_str()),
        );
        let mut whiteouts_left = 0;
        let asked_whiteout = flags.contains(RenameFlags::RENAME_WHITEOUT);
        if dst_whiteout && src.node.is_dir() {
            // A directory cannot replace a whiteout: the two trade places, and the whiteout
            // stays on the old name if something is below it, or the caller asked for one.
            match nix::fcntl::renameat2(from.0, from.1, to.0, to.1, RenameFlags::RENAME_EXCHANGE) {
                Ok(()) if src_below || asked_whiteout => whiteouts_left = 1,
                Ok(()) => nix::unistd::unlinkat(from.0, from.1, UnlinkatFlags::NoRemoveDir)?,
                // No exchange on this filesystem: the remote entry shows between the steps.
                Err(Errno::EINVAL) => {
                    nix::unistd::unlinkat(to.0, to.1, UnlinkatFlags::NoRemoveDir)?;
                    if src_below {
                        names::move_leaving_whiteout(from.0, from.1, to.0, to.1, how, true)?;
                        whiteouts_left = 1;
                    } else {
                        nix::fcntl::renameat2(from.0, from.1, to.0, to.1, how)?;
                    }
                }
                Err(e) => return Err(e),
            }
        } else {
            if src_below && !exchange {
                how |= RenameFlags::RENAME_WHITEOUT;
            }
            match nix::fcntl::renameat2(from.0, from.1, to.0, to.1, how) {
                Err(Errno::EINVAL) if how.contains(RenameFlags::RENAME_WHITEOUT) => {
                    how.remove(RenameFlags::RENAME_WHITEOUT);
                    let is_dir = src.node.is_dir();
                    names::move_leaving_whiteout(from.0, from.1, to.0, to.1, how, is_dir)?;
                }
                other => other?,
            }
            if src_below && !exchange || asked_whiteout {
                whiteouts_left = 1;
            }
        }
        if asked_whiteout {
            // The device left on request is a plain entry here, marked where local allows
            // for the reason `mknod` marks one: the directory may have moved where
            // something lies below since the kernel looked it up.
            let _ =
                store::open_path_at(from.0, from.1).and_then(|fd| marker::set_device(fd.as_fd()));
        }
        self.charge_inodes(&parent, whiteouts_left);
        if dst_whiteout {
            self.charge_inodes(&new_parent, -1);
        }
        let arrived = Charge::Moved {
            plan: &mut moving,
            dir: dst_dir.as_fd(),
            before: dst_before,
        };
        self.quota().charge(&dst_root, arrived);
        if exchange {
            if let Some(dst) = &dst {
                {
                    let mut st = dst.node.state();
                    st.remove_alias(new_parent.ino, new_name);
                    st.add_alias(&parent, name);
                }
                self.record_move(&dst.node, &parent);
            }
        } else if let (Some(dst), Some(st)) = (&dst, replaced) {
            dst.node.state().remove_alias(new_parent.ino, new_name);
            self.name_gone(&st);
            self.quota().credit(Gone::Name {
                from: &dst_root,
                obj: &*dst.node,
                st: &st,
            });
        }
        {
            let mut st = src.node.state();
            st.remove_alias(parent.ino, name);
            st.add_alias(&new_parent, new_name);
        }
        self.record_move(&src.node, &new_parent);
        self.quota().renamed(moving);
        Ok(())
    }

    /// Marks `node`, moving into `to`, a real device if it needs to be (see
    /// [`marker::keep_device`]); a directory coming from where nothing lies below, every
    /// device inside it ([`marker::keep_devices_under`]). Where something lies below, an
    /// unmarked 0/0 device is a whiteout, and stays one.
    fn keep_devices_moving(&self, node: &Node, to: &Node) -> Result<(), Errno> {
        if !to.zone.has_below() {
            return Ok(());
        }
        match node.kind {
            Kind::CharDev => {
                let object = node.object().ok_or(Errno::ESTALE)?;
                marker::keep_device(object.as_fd(), &store::stat_fd(object.as_fd())?)
            }
            Kind::Dir if !node.zone.has_below() => {
                let local = node.dir_fds().local.ok_or(Errno::ESTALE)?;
                marker::keep_devices_under(local.as_fd())
            }
            _ => Ok(()),
        }
    }

    /// Gets a renamed object ready to move within local: non-directories are copied up,
    /// directories must be purely local.
    fn make_movable(&self, node: &Arc<Node>) -> Result<(), Errno> {
        if !node.is_dir() {
            return self.copy_up(node, true);
        }
        let st = node.state();
        if st.layer != Layer::Local || st.remote.is_some() {
            return Err(Errno::EXDEV);
        }
        Ok(())
    }

    /// Removes a name: its local entry, replaced by a whiteout in the same step if
    /// something shows below, or just a whiteout over what is below.
    fn remove(
        &self,
        parent: &Arc<Node>,
        name: &OsStr,
        c: &CStr,
        node: &Arc<Node>,
    ) -> Result<(), Errno> {
        // A copy-up under way would put the object under its name after the removal.
        let copying = node.copy_lock();
        self.copy_up_for_writers(node, &copying)?;
        let below = self.exists_below(parent, name, c)?;
        let root = self.quota().under(parent);
        let fds = parent.dir_fds();
        if let Some(local) = fds.local() {
            if let Ok(st) = store::stat_at(local, c) {
                if !marker::hides(parent.zone, local, c, &st) {
                    let cleared = if below {
                        let cleared = names::whiteout_over(local, c, node.is_dir())?;
                        self.charge_inodes(parent, 1);
                        cleared
                    } else {
                        // Nothing below: the directory's own whiteouts hide nothing.
                        let cleared = match node.dir_fds().local {
                            Some(dir) => names::empty_out(dir.as_fd())?,
                            None => 0,
                        };
                        names::remove_any(local, c, node.is_dir())?;
                        cleared
                    };
                    self.charge_inodes(parent, -(cleared as i64));
                    node.state().remove_alias(parent.ino, name);
                    self.name_gone(&st);
                    self.quota().credit(Gone::Name {
                        from: &root,
                        obj: node,
                        st: &st,
                    });
                    return Ok(());
                }
            }
        }
        if below {
            // Deleting works in a full root: the parent's copy-up takes no reservation.
            let dir = self.local_dir_of(parent, Room::Never)?;
            marker::make_whiteout(dir.as_fd(), c)?;
            self.charge_inodes(parent, 1);
            node.state().remove_alias(parent.ino, name);
        }
        Ok(())
    }

    /// Copies up a remote file that opens made to write it later still hold (see
    /// [`View::open`]), before its name goes: their first change copies it up through that
    /// name, and must find the file, not what may take the name's place.
    fn copy_up_for_writers(
        &self,
        node: &Arc<Node>,
        copying: &parking_lot::MutexGuard<'_, ()>,
    ) -> Result<(), Errno> {
        let waiting = {
            let state = node.state();
            state.layer != Layer::Local && state.writers_before_copy_up > 0
        };
        match waiting && !node.is_dir() {
            true => self.copy_up_holding(node, true, copying),
            false => Ok(()),
        }
    }

    /// A local name of the object `st` is gone: its last one frees its inode number.
    fn name_gone(&self, st: &Stat) {
        if st.st_nlink <= 1 || Kind::from_mode(st.st_mode) == Kind::Dir {
            self.inodes.forget_origin(st.st_dev, st.st_ino);
        }
    }

    /// The node currently behind `name`, counted for this operation only.
    fn hold(&self, parent: &Arc<Node>, name: &OsStr, c: &CStr) -> Result<Held<'_>, Errno> {
        let index = IndexOnce::of(self);
        let found = self.resolve(parent, name, c, &index, Probe::Stat)?;
        let entry = self.materialize(parent, name, c, &index, found)?;
        Ok(Held {
            view: self,
            node: entry.node,
        })
    }

    /// Makes the new entry `name` in the directory `parent` with `make`, which creates the
    /// object under the name it is given, in the local directory it is given, and removes
    /// it again if it fails half-way. Where a whiteout holds the name (or `via_temp` asks
    /// for it), the object is made under a temporary name and then takes its place in one
    /// rename (see [`names`]). Returns the entry handed to the kernel and what `make` made.
    ///
    /// A call that fails leaves no new name behind, since the caller is told nothing was
    /// made: the object is pinned before it takes its name, and if it cannot be entered
    /// after (the remote directory it would merge with cannot be opened), its name goes
    /// again and a whiteout it replaced comes back.
    fn place_new<T>(
        &self,
        parent: &Arc<Node>,
        name: &OsStr,
        kind: Kind,
        via_temp: bool,
        make: impl FnOnce(BorrowedFd<'_>, &CStr) -> Result<T, Errno>,
    ) -> Result<(Entry, T), Errno> {
        if marker::is_reserved_name(name.as_bytes()) {
            return Err(Errno::EPERM);
        }
        let c = view_name(name)?;
        let index = IndexOnce::of(self);
        match self.resolve(parent, name, &c, &index, Probe::Stat) {
            Ok(_) => return Err(Errno::EEXIST),
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(e),
        }
        let dir = self.ensure_local_dir(parent)?;
        let dir = dir.as_fd();
        let is_dir = kind == Kind::Dir;
        let made_pinned = |at: &CStr| {
            let made = make(dir, at)?;
            match store::open_path_at(dir, at) {
                Ok(pin) => Ok((pin, made)),
                Err(e) => {
                    let _ = names::remove_any(dir, at, is_dir);
                    Err(e)
                }
            }
        };
        let whiteout = names::is_whiteout(parent.zone, dir, &c);
        let (pin, made) = if !whiteout && !via_temp {
            made_pinned(&c)?
        } else {
            let temp = temp_name();
            let (pin, made) = made_pinned(&temp)?;
            let placed = if whiteout {
                names::replace_whiteout(dir, &temp, &c, is_dir)
            } else {
                nix::fcntl::renameat2(
                    dir,
                    temp.as_c_str(),
                    dir,
                    c.as_c_str(),
                    RenameFlags::RENAME_NOREPLACE,
                )
            };
            if let Err(e) = placed {
                let _ = names::remove_any(dir, &temp, is_dir);
                return Err(e);
            }
            if whiteout {
                self.charge_inodes(parent, -1);
            }
            (pin, made)
        };
        let entered = store::stat_fd(pin.as_fd()).and_then(|st| {
            let found = Found::Local { fd: Some(pin), st };
            self.materialize(parent, name, &c, &index, found)
        });
        let Err(e) = entered else {
            return entered.map(|entry| (entry, made));
        };
        let undone = match whiteout {
            true => names::whiteout_over(dir, &c, is_dir).map(drop),
            false => names::remove_any(dir, &c, is_dir),
        };
        match undone {
            Ok(()) if whiteout => self.charge_inodes(parent, 1),
            Ok(()) => {}
            Err(undo) => {
                tracing::warn!(name = ?name, error = %undo, "a new entry that failed stays in local")
            }
        }
        Err(e)
    }

    /// The group a new entry gets: the directory's when it is set-group-ID (as the kernel
    /// does), the caller's otherwise.
    fn new_gid(&self, dir: BorrowedFd<'_>, caller: Caller) -> Result<Option<Gid>, Errno> {
        let st = store::stat_fd(dir)?;
        Ok((st.st_mode & libc::S_ISGID == 0).then(|| Gid::from_raw(caller.gid)))
    }

    /// Runs `op`, which makes one new object in the directory `parent`, inside the quota
    /// of `parent`: what `need` says must fit, and what the directory and the new object
    /// (`made`) allocate is charged, plus `inodes` inodes.
    fn allocating<T>(
        &self,
        parent: &Arc<Node>,
        need: Need<'_>,
        inodes: u64,
        op: impl FnOnce() -> Result<T, Errno>,
        made: impl FnOnce(&T) -> Allocated,
    ) -> Result<T, Errno> {
        self.charged(parent, Some(need), inodes, op, made)
    }

    /// Like [`View::allocating`], for calls that must work in a full root (the whiteouts
    /// and links of a deletion, which take an inode and no data blocks): nothing is
    /// reserved, what they allocate is still charged.
    fn recording<T>(
        &self,
        parent: &Arc<Node>,
        inodes: u64,
        op: impl FnOnce() -> Result<T, Errno>,
        made: impl FnOnce(&T) -> Allocated,
    ) -> Result<T, Errno> {
        self.charged(parent, None, inodes, op, made)
    }

    fn charged<T>(
        &self,
        parent: &Arc<Node>,
        need: Option<Need<'_>>,
        inodes: u64,
        op: impl FnOnce() -> Result<T, Errno>,
        made: impl FnOnce(&T) -> Allocated,
    ) -> Result<T, Errno> {
        let under = self.quota().under(parent);
        if under.is_none() {
            return op();
        }
        let room = need
            .map(|need| self.quota().reserve(&under, need))
            .transpose()?;
        // Any copy-up of the directory is charged by itself, before "before".
        let copy_up = match need {
            Some(_) => Room::Reserve,
            None => Room::Never,
        };
        let dir = self.local_dir_of(parent, copy_up)?;
        let before = Allocated::at(dir.as_fd());
        let out = op()?;
        let change = Charge::Entry {
            dir: dir.as_fd(),
            before,
            made: made(&out),
            inodes,
        };
        self.quota().charge(&under, change);
        drop(room);
        Ok(out)
    }

    /// Counts `delta` more (or fewer) inodes under `node`'s root: whiteouts made or removed.
    fn charge_inodes(&self, node: &Arc<Node>, delta: i64) {
        self.quota()
            .charge(&self.quota().under(node), Charge::Inodes(delta));
    }
}

/// Makes the caller the owner of a new object where the daemon could not create it as the
/// caller (see [`creds`]).
fn give_to_caller(
    fd: BorrowedFd<'_>,
    caller: Caller,
    dir: BorrowedFd<'_>,
    mode: u32,
    kind: Kind,
) -> Result<(), Errno> {
    if creds::acts_as_caller() {
        return Ok(());
    }
    let dir = store::stat_fd(dir)?;
    let gid = (dir.st_mode & libc::S_ISGID == 0).then(|| Gid::from_raw(caller.gid));
    nix::unistd::fchownat(
        fd,
        c"",
        Some(Uid::from_raw(caller.uid)),
        gid,
        AtFlags::AT_EMPTY_PATH,
    )?;
    // chown clears set-ID bits; the caller asked for them.
    if mode & 0o6000 != 0 && kind != Kind::Symlink {
        let path = store::proc_path(fd);
        nix::sys::stat::fchmodat(
            nix::fcntl::AT_FDCWD,
            path.as_c_str(),
            Mode::from_bits_truncate(mode & 0o7777),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )?;
    }
    Ok(())
}
