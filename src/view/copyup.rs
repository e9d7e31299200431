//! Copy-up: giving a remote (or synthesized) object a local copy before it is changed.
//!
//! A file is copied into an unnamed `O_TMPFILE` in its local directory (or, where the
//! filesystem has none, a hidden temporary name), with its data, mode, owner, xattrs and
//! times, synced, and only then linked under its name: a crash at any point leaves either
//! no local copy or a complete one, never a truncated file. Directories are made on the way
//! down the same way: under a temporary name, given the remote directory's attributes, then
//! moved into place. The parent's times are restored after each copy-up so that copying up
//! does not show as a change of the directory.
//!
//! A node's copy-up runs under its copy-up lock, which removing or replacing its name also
//! takes: those wait for a copy-up under way rather than meet it half done.
//!
//! The node keeps its number: the local copy's identity is bound to it.

use std::ffi::CStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{Mode, SFlag};
use parking_lot::MutexGuard;
use tracing::debug;

use super::identity::{local_identity, Identity};
use super::names::{self, temp_name};
use super::node::{Layer, Node};
use super::{marker, Stat, View};
use crate::quota::{Accounting, Allocated, Charge, Need};
use crate::store::{self, cname, copy, xattr, Kind};

/// Whether a directory's copy-up must fit in its quota root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// Like any allocation: refused in a full root.
    Reserve,
    /// For a deletion, which works in a full root: charged, never refused.
    Never,
}

impl View {
    /// The local directory of a directory node, creating it (and its parents) if needed.
    pub fn ensure_local_dir(&self, node: &Arc<Node>) -> Result<Arc<OwnedFd>, Errno> {
        self.local_dir_of(node, Room::Reserve)
    }

    /// [`View::ensure_local_dir`], saying whether the copy-ups must fit in the quota.
    pub fn local_dir_of(&self, node: &Arc<Node>, room: Room) -> Result<Arc<OwnedFd>, Errno> {
        if let Some(fd) = node.state().local.clone() {
            return Ok(fd);
        }
        if !node.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        // The directories without a local copy, nearest first, up to one that has one (the
        // root always has). Made from the top down, one at a time: as deep as the tree is,
        // nothing here recurses.
        let mut missing = vec![node.clone()];
        let mut above = loop {
            let (parent, _) = missing
                .last()
                .and_then(|n| n.primary())
                .ok_or(Errno::ESTALE)?;
            if let Some(fd) = parent.state().local.clone() {
                break fd;
            }
            missing.push(parent);
        };
        while let Some(dir) = missing.pop() {
            above = self.copy_up_dir(&dir, &above, room)?;
        }
        Ok(above)
    }

    /// Gives the directory `node` its local copy in `parent_fd`, its parent's local directory.
    fn copy_up_dir(
        &self,
        node: &Arc<Node>,
        parent_fd: &OwnedFd,
        room: Room,
    ) -> Result<Arc<OwnedFd>, Errno> {
        let _one_at_a_time = node.copy_lock();
        if let Some(fd) = node.state().local.clone() {
            return Ok(fd);
        }
        let (parent, name) = node.primary().ok_or(Errno::ESTALE)?;
        let c = cname(&name)?;
        let template = self.getattr(node)?;
        let remote = node.state().remote.clone();
        let parent_times = store::stat_fd(parent_fd.as_fd())?;
        let under = self.quota().under(node);
        let _room = match room {
            Room::Reserve => Some(self.quota().reserve(&under, Need::Dir)?),
            Room::Never => None,
        };

        // Made under a temporary name, closed (0700, root) until its attributes are right,
        // and moved into place whole: no request finds it half made, and a copy-up that
        // fails leaves nothing under its name.
        let temp = temp_name();
        nix::sys::stat::mkdirat(
            parent_fd.as_fd(),
            temp.as_c_str(),
            Mode::from_bits_truncate(0o700),
        )?;
        let xattrs = remote.as_deref().map(|r| r.as_fd());
        let fd = match finish_temp(parent_fd.as_fd(), &temp, &c, &template, xattrs) {
            Ok(fd) => {
                restore_times(parent_fd.as_fd(), &parent_times);
                if !under.is_none() {
                    let made = Charge::Entry {
                        dir: parent_fd.as_fd(),
                        before: Allocated::of(&parent_times),
                        made: Allocated::at(fd.as_fd()),
                        inodes: 1,
                    };
                    self.quota().charge(&under, made);
                }
                fd
            }
            // Another request got there first.
            Err(Errno::EEXIST) => store::open_dir_at(parent_fd.as_fd(), &c)?,
            Err(e) => return Err(e),
        };
        let st = store::stat_fd(fd.as_fd())?;
        let fd = Arc::new(fd);
        {
            let mut state = node.state();
            if let Some(local) = state.local.clone() {
                return Ok(local);
            }
            state.local = Some(fd.clone());
            state.layer = Layer::Local;
        }
        self.inodes.add_identity(node, local_identity(&st));
        // Local objects below it are found again through it (see `exports`).
        self.record_local(fd.as_fd(), &st, &parent);
        Ok(fd)
    }

    /// Gives a remote or synthesized non-directory a local copy. `with_data` false copies
    /// everything but the content (the caller is about to truncate it).
    pub fn copy_up(&self, node: &Arc<Node>, with_data: bool) -> Result<(), Errno> {
        if node.is_dir() {
            return self.ensure_local_dir(node).map(drop);
        }
        let copying = node.copy_lock();
        self.copy_up_holding(node, with_data, &copying)
    }

    /// [`View::copy_up`] of a non-directory whose copy lock the caller holds (`_copying`).
    pub(in crate::view) fn copy_up_holding(
        &self,
        node: &Arc<Node>,
        with_data: bool,
        _copying: &MutexGuard<'_, ()>,
    ) -> Result<(), Errno> {
        let (layer, link, source) = {
            let st = node.state();
            (st.layer, st.link.clone(), st.object.clone())
        };
        if layer == Layer::Local {
            return Ok(());
        }
        let (parent, name) = node.primary().ok_or(Errno::ESTALE)?;
        let local_dir = self.ensure_local_dir(&parent)?;
        let c = cname(&name)?;
        let parent_times = store::stat_fd(local_dir.as_fd())?;
        let dir = local_dir.as_fd();
        // The copy must fit in the quota before a byte of it is written: a copy-up that
        // fails leaves no partial file.
        let under = self.quota().under(&parent);
        let data = match (&source, node.kind) {
            (Some(source), Kind::File) if with_data => Some(source.as_fd()),
            _ => None,
        };
        let _room = self.quota().reserve(&under, Need::CopyUp { data })?;
        let placed = match (layer, link, &source) {
            (Layer::Virtual, Some(target), _) => {
                let mut st = self.getattr(node)?;
                st.st_mode = libc::S_IFLNK | 0o777;
                place_symlink(dir, &c, &target, &st)?
            }
            (Layer::Remote, _, Some(source)) => {
                let st = store::stat_fd(source.as_fd())?;
                match node.kind {
                    Kind::File => copy_file(source.as_fd(), dir, &c, &st, with_data)?,
                    Kind::Symlink => {
                        let target = store::readlink_at(source.as_fd(), c"")?;
                        place_symlink(dir, &c, &target, &st)?
                    }
                    _ => place_special(dir, &c, &st)?,
                }
            }
            _ => return Err(Errno::EIO),
        };
        restore_times(dir, &parent_times);
        let st = store::stat_fd(placed.as_fd())?;
        let copied = Charge::CopiedUp {
            obj: &**node,
            dir,
            before: Allocated::of(&parent_times),
            copy: &st,
        };
        self.quota().charge(&under, copied);
        let old_ids = {
            let mut state = node.state();
            state.layer = Layer::Local;
            state.link = None;
            state.object = Some(Arc::new(placed));
            state.identities.clone()
        };
        // The node keeps its number, also once the kernel has forgotten it; the remote
        // object no longer shows under it.
        self.inodes.set_origin(st.st_dev, st.st_ino, node.ino);
        self.inodes.add_identity(node, local_identity(&st));
        for id in old_ids
            .iter()
            .filter(|id| !matches!(id, Identity::Local { .. }))
        {
            self.inodes.remove_identity(node, id);
        }
        debug!(ino = node.ino, name = ?name, "copied up");
        Ok(())
    }
}

/// Copies the remote file behind `source` to `name` in `dir`; returns an `O_PATH` handle of
/// the copy.
fn copy_file(
    source: BorrowedFd<'_>,
    dir: BorrowedFd<'_>,
    name: &CStr,
    st: &Stat,
    with_data: bool,
) -> Result<OwnedFd, Errno> {
    let src = store::reopen(source, OFlag::O_RDONLY)?;
    let (tmp, temp_name) =
        match store::open_at(dir, c".", OFlag::O_TMPFILE | OFlag::O_WRONLY, 0o600) {
            Ok(fd) => (fd, None),
            Err(Errno::EOPNOTSUPP | Errno::EISDIR | Errno::EINVAL) => {
                let temp = temp_name();
                let fd = store::open_at(
                    dir,
                    &temp,
                    OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY,
                    0o600,
                )?;
                (fd, Some(temp))
            }
            Err(e) => return Err(e),
        };
    let result = (|| {
        if with_data {
            copy::copy_data(src.as_fd(), tmp.as_fd(), st.st_size as u64)?;
        }
        copy_xattrs(
            &store::proc_path(src.as_fd()),
            &store::proc_path(tmp.as_fd()),
        );
        apply_owner_mode_times(tmp.as_fd(), st)?;
        nix::unistd::fdatasync(tmp.as_fd())?;
        let pinned = store::reopen(tmp.as_fd(), OFlag::O_PATH)?;
        match &temp_name {
            None => nix::unistd::linkat(
                nix::fcntl::AT_FDCWD,
                store::proc_path(tmp.as_fd()).as_c_str(),
                dir,
                name,
                AtFlags::AT_SYMLINK_FOLLOW,
            ),
            Some(temp) => nix::fcntl::renameat2(
                dir,
                temp.as_c_str(),
                dir,
                name,
                RenameFlags::RENAME_NOREPLACE,
            ),
        }
        .map(|()| pinned)
    })();
    if let (Err(_), Some(temp)) = (&result, &temp_name) {
        let _ = nix::unistd::unlinkat(
            dir,
            temp.as_c_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
    }
    result
}

fn place_symlink(
    dir: BorrowedFd<'_>,
    name: &CStr,
    target: &[u8],
    st: &Stat,
) -> Result<OwnedFd, Errno> {
    let temp = temp_name();
    let target = std::ffi::CString::new(target).map_err(|_| Errno::EINVAL)?;
    nix::unistd::symlinkat(target.as_c_str(), dir, temp.as_c_str())?;
    finish_temp(dir, &temp, name, st, None)
}

fn place_special(dir: BorrowedFd<'_>, name: &CStr, st: &Stat) -> Result<OwnedFd, Errno> {
    let temp = temp_name();
    nix::sys::stat::mknodat(
        dir,
        temp.as_c_str(),
        SFlag::from_bits_truncate(st.st_mode & libc::S_IFMT),
        Mode::from_bits_truncate(0o600),
        st.st_rdev,
    )?;
    finish_temp(dir, &temp, name, st, None)
}

/// Dresses a temporary entry with `st`'s attributes (and the xattrs of `xattrs`, if given)
/// and moves it under its name; returns an `O_PATH` handle of it. If it fails, the
/// temporary entry is gone.
fn finish_temp(
    dir: BorrowedFd<'_>,
    temp: &CStr,
    name: &CStr,
    st: &Stat,
    xattrs: Option<BorrowedFd<'_>>,
) -> Result<OwnedFd, Errno> {
    let result = store::open_path_at(dir, temp).and_then(|fd| {
        if let Some(from) = xattrs {
            copy_xattrs(&store::proc_path(from), &store::proc_path(fd.as_fd()));
        }
        // A 0/0 device copied up is the device it was, not a whiteout.
        if store::is_whiteout(st) {
            marker::set_device(fd.as_fd())?;
        }
        apply_owner_mode_times(fd.as_fd(), st)?;
        nix::fcntl::renameat2(dir, temp, dir, name, RenameFlags::RENAME_NOREPLACE)?;
        Ok(fd)
    });
    if result.is_err() {
        let _ = names::remove_any(dir, temp, Kind::from_mode(st.st_mode) == Kind::Dir);
    }
    result
}

/// Sets owner, then mode (chown clears set-id bits), then times, on any file type.
pub(super) fn apply_owner_mode_times(fd: BorrowedFd<'_>, st: &Stat) -> Result<(), Errno> {
    nix::unistd::fchownat(
        fd,
        c"",
        Some(nix::unistd::Uid::from_raw(st.st_uid)),
        Some(nix::unistd::Gid::from_raw(st.st_gid)),
        AtFlags::AT_EMPTY_PATH,
    )?;
    let is_link = st.st_mode & libc::S_IFMT == libc::S_IFLNK;
    if !is_link {
        let path = store::proc_path(fd);
        nix::sys::stat::fchmodat(
            nix::fcntl::AT_FDCWD,
            path.as_c_str(),
            Mode::from_bits_truncate(st.st_mode & 0o7777),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )?;
    }
    set_times(fd, st)
}

fn set_times(fd: BorrowedFd<'_>, st: &Stat) -> Result<(), Errno> {
    let times = [
        libc::timespec {
            tv_sec: st.st_atime,
            tv_nsec: st.st_atime_nsec,
        },
        libc::timespec {
            tv_sec: st.st_mtime,
            tv_nsec: st.st_mtime_nsec,
        },
    ];
    // utimensat(fd, "", AT_EMPTY_PATH) reaches symlinks through O_PATH handles too.
    let res = unsafe {
        libc::utimensat(
            fd.as_raw_fd(),
            c"".as_ptr(),
            times.as_ptr(),
            libc::AT_EMPTY_PATH,
        )
    };
    Errno::result(res).map(drop)
}

/// Puts a directory's times back after an entry was added to it by copy-up.
fn restore_times(dir: BorrowedFd<'_>, st: &Stat) {
    if let Err(e) = set_times(dir, st) {
        debug!(error = %e, "could not restore directory times after copy-up");
    }
}

/// Copies every attribute from one object to another, escaping overlay's own names.
/// Attributes the local filesystem refuses (a security module's, say) are skipped: the copy
/// must not fail for metadata the kernel would also drop.
pub(super) fn copy_xattrs(from: &CStr, to: &CStr) {
    let Ok(names) = xattr::list(from) else {
        return;
    };
    for name in names {
        let Ok(src_name) = std::ffi::CString::new(name.clone()) else {
            continue;
        };
        let Some(dst_name) = marker::escape(&name) else {
            continue;
        };
        match xattr::get(from, &src_name) {
            Ok(value) => {
                if let Err(e) = xattr::set(to, &dst_name, &value, 0) {
                    debug!(name = ?src_name, error = %e, "xattr not copied up");
                }
            }
            Err(e) => debug!(name = ?src_name, error = %e, "xattr not readable for copy-up"),
        }
    }
}
