//! Renaming, in all of `renameat2`'s forms (`RENAME_NOREPLACE`, `RENAME_EXCHANGE`,
//! `RENAME_WHITEOUT`), writing local only.
//!
//! Renaming a directory that merges remote content fails with `EXDEV`, as overlayfs does
//! without `redirect_dir`; `mv` then copies and deletes. Files and symlinks are copied up
//! and renamed; the old name gets a whiteout in the same `renameat2(RENAME_WHITEOUT)` where
//! the filesystem has it. As for every change to the namespace (see [`super::namespace`]), a
//! whiteout goes only as what replaces it takes its place, and a directory that arrives over
//! a hidden remote one is opaque before it arrives.

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::RenameFlags;
use nix::unistd::UnlinkatFlags;

use super::node::{Layer, Node};
use super::{marker, names, view_name, View};
use crate::quota::{Accounting, Allocated, Charge, Gone};
use crate::store::{self, Kind};

impl View {
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
}
