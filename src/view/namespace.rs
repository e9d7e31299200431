//! Changes to the namespace: create, mkdir, mknod, symlink, link, unlink, rmdir, rename.
//!
//! All of them write local only. The kernel holds the directories' locks around each call,
//! so a name never changes between our checks and our writes through the view; the order
//! of steps is still chosen so that a crash leaves the remote entry visible rather than a
//! half-made local one.
//!
//! Renaming a directory that merges remote content fails with `EXDEV`, as overlayfs does
//! without `redirect_dir`; `mv` then copies and deletes. Files and symlinks are copied up
//! and renamed; the old name gets a whiteout in the same `renameat2(RENAME_WHITEOUT)` where
//! the filesystem has it.

use std::ffi::{CStr, OsStr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::{Gid, Uid, UnlinkatFlags};

use super::node::{Layer, Node};
use super::quota::{charge_new, dir_blocks, NEEDS_ROOM};
use super::{local_identity, marker, view_name, Caller, Entry, Found, Stat, View};
use crate::quota::scan::allocated;
use crate::quota::table::QuotaRoot;
use crate::store::{self, Kind};

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
        let dir_node = self.dir(parent)?;
        self.allocating(
            &dir_node,
            NEEDS_ROOM,
            1,
            || self.create_file(parent, name, mode, flags, caller),
            |(entry, _)| allocated(&entry.stat),
        )
    }

    fn create_file(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        caller: Caller,
    ) -> Result<(Entry, OwnedFd), Errno> {
        let (parent, c, dir) = self.prepare_new(parent, name)?;
        let keep = libc::O_ACCMODE | libc::O_SYNC | libc::O_DSYNC;
        let oflags = OFlag::from_bits_truncate(flags & keep) | OFlag::O_CREAT | OFlag::O_EXCL;
        let fd = store::open_at(dir.as_fd(), &c, oflags, mode & 0o7777)?;
        let owned = give_to_caller(
            fd.as_fd(),
            caller,
            &store::stat_fd(dir.as_fd())?,
            mode,
            Kind::File,
        );
        if let Err(e) = owned {
            let _ = nix::unistd::unlinkat(dir.as_fd(), c.as_c_str(), UnlinkatFlags::NoRemoveDir);
            return Err(e);
        }
        let entry = self.enter_local(&parent, name, &c, dir.as_fd())?;
        Ok((entry, fd))
    }

    pub fn mkdir(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let dir_node = self.dir(parent)?;
        let block = self.local_block_size();
        self.allocating(
            &dir_node,
            block,
            1,
            || self.make_dir(parent, name, mode, caller),
            |entry| allocated(&entry.stat),
        )
    }

    fn make_dir(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let (parent, c, dir) = self.prepare_new(parent, name)?;
        let below = self.exists_below(&parent, name, &c)?;
        nix::sys::stat::mkdirat(
            dir.as_fd(),
            c.as_c_str(),
            Mode::from_bits_truncate(mode & 0o7777),
        )?;
        let made = store::open_dir_at(dir.as_fd(), &c).and_then(|fd| {
            give_to_caller(
                fd.as_fd(),
                caller,
                &store::stat_fd(dir.as_fd())?,
                mode,
                Kind::Dir,
            )?;
            // A directory made where a remote one is hidden must not let its entries back.
            if below {
                marker::set_opaque(fd.as_fd())?;
            }
            Ok(())
        });
        if let Err(e) = made {
            let _ = nix::unistd::unlinkat(dir.as_fd(), c.as_c_str(), UnlinkatFlags::RemoveDir);
            return Err(e);
        }
        self.enter_local(&parent, name, &c, dir.as_fd())
    }

    pub fn mknod(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let dir_node = self.dir(parent)?;
        self.allocating(
            &dir_node,
            NEEDS_ROOM,
            1,
            || self.make_node(parent, name, mode, rdev, caller),
            |entry| allocated(&entry.stat),
        )
    }

    fn make_node(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let (parent, c, dir) = self.prepare_new(parent, name)?;
        let kind = SFlag::from_bits_truncate(mode & libc::S_IFMT);
        nix::sys::stat::mknodat(
            dir.as_fd(),
            c.as_c_str(),
            kind,
            Mode::from_bits_truncate(mode & 0o7777),
            rdev as u64,
        )?;
        let made = store::open_path_at(dir.as_fd(), &c).and_then(|fd| {
            give_to_caller(
                fd.as_fd(),
                caller,
                &store::stat_fd(dir.as_fd())?,
                mode,
                Kind::from_mode(mode),
            )
        });
        if let Err(e) = made {
            let _ = nix::unistd::unlinkat(dir.as_fd(), c.as_c_str(), UnlinkatFlags::NoRemoveDir);
            return Err(e);
        }
        self.enter_local(&parent, name, &c, dir.as_fd())
    }

    pub fn symlink(
        &self,
        parent: u64,
        name: &OsStr,
        target: &OsStr,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let dir_node = self.dir(parent)?;
        // Short targets live in the inode itself on most filesystems; longer ones take a
        // block.
        let estimate = if target.len() < 60 {
            NEEDS_ROOM
        } else {
            self.local_block_size()
        };
        self.allocating(
            &dir_node,
            estimate,
            1,
            || self.make_symlink(parent, name, target, caller),
            |entry| allocated(&entry.stat),
        )
    }

    fn make_symlink(
        &self,
        parent: u64,
        name: &OsStr,
        target: &OsStr,
        caller: Caller,
    ) -> Result<Entry, Errno> {
        let (parent, c, dir) = self.prepare_new(parent, name)?;
        nix::unistd::symlinkat(target, dir.as_fd(), c.as_c_str())?;
        let gid = self.new_gid(dir.as_fd(), caller)?;
        let owned = nix::unistd::fchownat(
            dir.as_fd(),
            c.as_c_str(),
            Some(Uid::from_raw(caller.uid)),
            gid,
            AtFlags::AT_SYMLINK_NOFOLLOW,
        );
        if let Err(e) = owned {
            let _ = nix::unistd::unlinkat(dir.as_fd(), c.as_c_str(), UnlinkatFlags::NoRemoveDir);
            return Err(e);
        }
        self.enter_local(&parent, name, &c, dir.as_fd())
    }

    pub fn link(&self, ino: u64, new_parent: u64, new_name: &OsStr) -> Result<Entry, Errno> {
        let node = self.node(ino)?;
        if node.is_dir() {
            return Err(Errno::EPERM);
        }
        let dir_node = self.dir(new_parent)?;
        // One inode cannot count against two roots: links across a root's boundary are
        // refused, as between XFS projects.
        if !self.quotas.is_empty() {
            let from = node.primary().and_then(|(p, _)| self.quota_of(&p));
            if !same_root(&from, &self.quota_of(&dir_node)) {
                return Err(Errno::EXDEV);
            }
        }
        // Copied up first, and charged by itself, so the link measures only its own entry.
        self.copy_up(&node, true)?;
        self.allocating(
            &dir_node,
            NEEDS_ROOM,
            0,
            || self.make_link(&node, new_parent, new_name),
            |_| 0,
        )
    }

    fn make_link(
        &self,
        node: &Arc<Node>,
        new_parent: u64,
        new_name: &OsStr,
    ) -> Result<Entry, Errno> {
        let (src_parent, src_name) = node.primary().ok_or(Errno::ESTALE)?;
        let src_dir = src_parent.dir_fds().local.ok_or(Errno::ESTALE)?;
        let (parent, c, dir) = self.prepare_new(new_parent, new_name)?;
        nix::unistd::linkat(
            src_dir.as_fd(),
            store::cname(&src_name)?.as_c_str(),
            dir.as_fd(),
            c.as_c_str(),
            AtFlags::empty(),
        )?;
        self.enter_local(&parent, new_name, &c, dir.as_fd())
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
        if let Some(local) = fds.local() {
            let cleared = clear_whiteouts(local)?;
            self.charge_inodes(&held.node, -(cleared as i64));
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
        if let Some(dst) = &dst {
            if exchange {
                self.make_movable(&dst.node)?;
            } else if dst.node.is_dir() {
                let fds = dst.node.dir_fds();
                if !self.is_empty_dir(dst.node.zone, dst.node.ino, &fds)? {
                    return Err(Errno::ENOTEMPTY);
                }
                if let Some(local) = fds.local() {
                    let cleared = clear_whiteouts(local)?;
                    self.charge_inodes(&dst.node, -(cleared as i64));
                }
            }
        }
        let moving = self.plan_move(&src.node, &parent, &new_parent)?;
        if exchange && moving.is_some() {
            return Err(Errno::EXDEV);
        }
        let old_path = |node: &Arc<Node>| {
            (node.is_dir() && !self.quotas.is_empty())
                .then(|| self.rel_path(node))
                .flatten()
        };
        let src_old_path = old_path(&src.node);
        let dst_old_path = dst
            .as_ref()
            .filter(|_| exchange)
            .and_then(|d| old_path(&d.node));
        let src_dir = parent.dir_fds().local.ok_or(Errno::ESTALE)?;
        let dst_dir = self.ensure_local_dir(&new_parent)?;
        let dst_root = self.quota_of(&new_parent);
        let dst_before = dst_root.as_ref().map(|_| dir_blocks(dst_dir.as_fd()));
        let src_below = self.exists_below(&parent, name, &c)?;
        let dst_below = self.exists_below(&new_parent, new_name, &new_c)?;
        if !exchange {
            // A whiteout (or a remote-only target) leaves nothing in local to replace, or
            // a whiteout a directory cannot replace.
            if let Ok(st) = store::stat_at(dst_dir.as_fd(), &new_c) {
                if marker::hides(new_parent.zone, &st) {
                    nix::unistd::unlinkat(
                        dst_dir.as_fd(),
                        new_c.as_c_str(),
                        UnlinkatFlags::NoRemoveDir,
                    )?;
                    self.charge_inodes(&new_parent, -1);
                }
            }
        }
        let replaced = if exchange {
            None
        } else {
            store::stat_at(dst_dir.as_fd(), &new_c).ok()
        };
        let mut how = flags
            & (RenameFlags::RENAME_EXCHANGE
                | RenameFlags::RENAME_NOREPLACE
                | RenameFlags::RENAME_WHITEOUT);
        if src_below && !exchange {
            how |= RenameFlags::RENAME_WHITEOUT;
        }
        match nix::fcntl::renameat2(
            src_dir.as_fd(),
            c.as_c_str(),
            dst_dir.as_fd(),
            new_c.as_c_str(),
            how,
        ) {
            Err(Errno::EINVAL) if how.contains(RenameFlags::RENAME_WHITEOUT) => {
                how.remove(RenameFlags::RENAME_WHITEOUT);
                nix::fcntl::renameat2(
                    src_dir.as_fd(),
                    c.as_c_str(),
                    dst_dir.as_fd(),
                    new_c.as_c_str(),
                    how,
                )?;
                marker::make_whiteout(src_dir.as_fd(), &c)?;
                self.charge_inodes(&parent, 1);
            }
            other => other?,
        }
        if how.contains(RenameFlags::RENAME_WHITEOUT) {
            self.charge_inodes(&parent, 1);
        }
        if let Some(moving) = moving {
            moving.commit();
        }
        if let (Some(root), Some(before)) = (&dst_root, dst_before) {
            charge_new(root, dst_dir.as_fd(), before, 0, 0);
        }
        // A directory arriving over a hidden remote directory must not merge with it.
        if src.node.is_dir() && dst_below {
            if let Some(fd) = src.node.dir_fds().local {
                marker::set_opaque(fd.as_fd())?;
            }
        }
        if exchange {
            if let Some(dst) = &dst {
                if dst.node.is_dir() && src_below {
                    if let Some(fd) = dst.node.dir_fds().local {
                        marker::set_opaque(fd.as_fd())?;
                    }
                }
                let mut st = dst.node.state();
                st.remove_alias(new_parent.ino, new_name);
                st.add_alias(&parent, name);
            }
        } else if let (Some(dst), Some(st)) = (&dst, replaced) {
            dst.node.state().remove_alias(new_parent.ino, new_name);
            if st.st_nlink <= 1 || Kind::from_mode(st.st_mode) == Kind::Dir {
                self.inodes.unbind(&local_identity(&st));
            }
            self.credit_removed(dst_root.clone(), &dst.node, &st);
        }
        {
            let mut st = src.node.state();
            st.remove_alias(parent.ino, name);
            st.add_alias(&new_parent, new_name);
        }
        let mut moved = vec![(&src.node, src_old_path)];
        if let Some(dst) = dst.as_ref().filter(|_| exchange) {
            moved.push((&dst.node, dst_old_path));
        }
        self.renamed(&moved);
        Ok(())
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

    /// Removes a name: its local entry if any, then a whiteout if something shows below.
    fn remove(&self, parent: &Arc<Node>, name: &OsStr, c: &CStr, node: &Node) -> Result<(), Errno> {
        let below = self.exists_below(parent, name, c)?;
        let root = self.quota_of(parent);
        let fds = parent.dir_fds();
        if let Some(local) = fds.local() {
            if let Ok(st) = store::stat_at(local, c) {
                if !marker::hides(parent.zone, &st) {
                    let how = if node.is_dir() {
                        UnlinkatFlags::RemoveDir
                    } else {
                        UnlinkatFlags::NoRemoveDir
                    };
                    if below {
                        // Replace in one step where possible, so the remote entry never
                        // shows through in between, even after a crash.
                        if self.whiteout_over(local, c).is_ok() {
                            self.forget_name(parent, name, node, &st);
                            self.credit_removed(root.clone(), node, &st);
                            self.charge_inodes(parent, 1);
                            return Ok(());
                        }
                    }
                    nix::unistd::unlinkat(local, c, how)?;
                    self.forget_name(parent, name, node, &st);
                    self.credit_removed(root, node, &st);
                }
            }
        }
        if below {
            let dir = self.ensure_local_dir(parent)?;
            marker::make_whiteout(dir.as_fd(), c)?;
            self.charge_inodes(parent, 1);
            node.state().remove_alias(parent.ino, name);
        }
        Ok(())
    }

    /// Atomically replaces `name` in `dir` with a whiteout: a whiteout is made under a
    /// temporary name and renamed over it.
    fn whiteout_over(&self, dir: BorrowedFd<'_>, c: &CStr) -> Result<(), Errno> {
        let st = store::stat_at(dir, c)?;
        if Kind::from_mode(st.st_mode) == Kind::Dir {
            // rename(2) cannot put a non-directory over a directory.
            return Err(Errno::EISDIR);
        }
        let temp = std::ffi::CString::new([marker::TEMP_PREFIX, b"wh.", c.to_bytes()].concat())
            .map_err(|_| Errno::EINVAL)?;
        marker::make_whiteout(dir, &temp)?;
        nix::fcntl::renameat2(dir, temp.as_c_str(), dir, c, RenameFlags::empty()).inspect_err(
            |_| {
                let _ = nix::unistd::unlinkat(dir, temp.as_c_str(), UnlinkatFlags::NoRemoveDir);
            },
        )
    }

    fn forget_name(&self, parent: &Node, name: &OsStr, node: &Node, st: &Stat) {
        node.state().remove_alias(parent.ino, name);
        if st.st_nlink <= 1 || Kind::from_mode(st.st_mode) == Kind::Dir {
            self.inodes.unbind(&local_identity(st));
        }
    }

    /// The node currently behind `name`, counted for this operation only.
    fn hold(&self, parent: &Arc<Node>, name: &OsStr, c: &CStr) -> Result<Held<'_>, Errno> {
        let found = self.resolve(parent, name, c)?;
        let entry = self.materialize(parent, name, c, found)?;
        Ok(Held {
            view: self,
            node: entry.node,
        })
    }

    /// Checks a new name and makes room for it in local: the parent directory exists in
    /// local and no whiteout stands in the way.
    fn prepare_new(
        &self,
        parent: u64,
        name: &OsStr,
    ) -> Result<(Arc<Node>, std::ffi::CString, Arc<OwnedFd>), Errno> {
        let parent = self.dir(parent)?;
        if marker::is_reserved_name(std::os::unix::ffi::OsStrExt::as_bytes(name)) {
            return Err(Errno::EPERM);
        }
        let c = view_name(name)?;
        match self.resolve(&parent, name, &c) {
            Ok(_) => return Err(Errno::EEXIST),
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(e),
        }
        let dir = self.ensure_local_dir(&parent)?;
        if let Ok(st) = store::stat_at(dir.as_fd(), &c) {
            if marker::hides(parent.zone, &st) {
                nix::unistd::unlinkat(dir.as_fd(), c.as_c_str(), UnlinkatFlags::NoRemoveDir)?;
                self.charge_inodes(&parent, -1);
            }
        }
        Ok((parent, c, dir))
    }

    /// Hands the kernel the node of an entry just made in local.
    fn enter_local(
        &self,
        parent: &Arc<Node>,
        name: &OsStr,
        c: &CStr,
        dir: BorrowedFd<'_>,
    ) -> Result<Entry, Errno> {
        let st = store::stat_at(dir, c)?;
        self.materialize(parent, name, c, Found::Local { st })
    }

    /// The group a new entry gets: the directory's when it is set-group-ID (as the kernel
    /// does), the caller's otherwise.
    fn new_gid(&self, dir: BorrowedFd<'_>, caller: Caller) -> Result<Option<Gid>, Errno> {
        let st = store::stat_fd(dir)?;
        Ok((st.st_mode & libc::S_ISGID == 0).then(|| Gid::from_raw(caller.gid)))
    }
}

/// Makes the caller the owner of a new object (it was created by the daemon, as root).
fn give_to_caller(
    fd: BorrowedFd<'_>,
    caller: Caller,
    dir: &Stat,
    mode: u32,
    kind: Kind,
) -> Result<(), Errno> {
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

/// Deletes the whiteouts left in a local directory that shows no entries; returns how
/// many there were.
fn clear_whiteouts(dir: BorrowedFd<'_>) -> Result<usize, Errno> {
    let mut cleared = 0;
    for e in store::read_dir(dir)? {
        let Ok(c) = store::cname(&e.name) else {
            continue;
        };
        if e.whiteout || marker::is_reserved_name(c.to_bytes()) {
            nix::unistd::unlinkat(dir, c.as_c_str(), UnlinkatFlags::NoRemoveDir)?;
            // Quotas count whiteouts, not the view's temporary files.
            cleared += e.whiteout as usize;
        }
    }
    Ok(cleared)
}

fn same_root(a: &Option<Arc<QuotaRoot>>, b: &Option<Arc<QuotaRoot>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        (None, None) => true,
        _ => false,
    }
}
