//! Changes to the namespace: create, mkdir, mknod, symlink, link, unlink, rmdir (rename
//! has a module of its own, [`super::rename`]).
//!
//! All of them write local only. The kernel holds the directories' locks around each call,
//! so a name never changes between our checks and our writes through the view. A whiteout
//! is never removed before what replaces it is in place (see [`super::names`]): a failed or
//! interrupted call never brings a deleted remote entry back.

use std::ffi::{CStr, OsStr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::{Gid, Uid};

use super::copyup::Room;
use super::lookup::{resolve_local, InLocal};
use super::names::temp_name;
use super::node::{DirFds, Layer, Node};
use super::{marker, names, view_name, Caller, Entry, Found, IndexOnce, Probe, Stat, View};
use crate::quota::{Accounting, Allocated, Charge, Gone, Need};
use crate::store::{self, creds, Kind};

/// Keeps a node the kernel did not hand us for the duration of one operation.
pub(super) struct Held<'a> {
    view: &'a View,
    pub(super) node: Arc<Node>,
    /// The local entry under the name, as the hold found it; `None` if the name showed from
    /// below. The kernel holds the name locked, so it stands for the rest of the operation.
    pub(super) local: Option<Stat>,
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
            // Made as the caller, with nothing hidden below: nothing more to do to it.
            if !below && creds::acts_as_caller() {
                return Ok(());
            }
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
                // Made as the caller, and not a 0/0 device to mark: nothing more to do to it.
                if !zero && creds::acts_as_caller() {
                    return Ok(());
                }
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
        self.remove(&parent, name, &c, &held)
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
        self.remove(&parent, name, &c, &held)
    }

    /// Removes a name: its local entry, replaced by a whiteout in the same step if
    /// something shows below, or just a whiteout over what is below.
    fn remove(
        &self,
        parent: &Arc<Node>,
        name: &OsStr,
        c: &CStr,
        held: &Held<'_>,
    ) -> Result<(), Errno> {
        let node = &held.node;
        // A copy-up under way would put the object under its name after the removal.
        let copying = node.copy_lock();
        self.copy_up_for_writers(node, &copying)?;
        let below = self.exists_below(parent, name, c)?;
        let root = self.quota().under(parent);
        let fds = parent.dir_fds();
        if let Some(local) = fds.local() {
            // A name found below has just been copied up if writers waited on it.
            let st = match held.local {
                Some(st) => Ok(st),
                None => store::stat_at(local, c),
            };
            if let Ok(st) = st {
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
    pub(super) fn copy_up_for_writers(
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
    pub(super) fn name_gone(&self, st: &Stat) {
        if st.st_nlink <= 1 || Kind::from_mode(st.st_mode) == Kind::Dir {
            self.inodes.forget_origin(st.st_dev, st.st_ino);
        }
    }

    /// The node currently behind `name`, counted for this operation only.
    pub(super) fn hold(
        &self,
        parent: &Arc<Node>,
        name: &OsStr,
        c: &CStr,
    ) -> Result<Held<'_>, Errno> {
        let index = IndexOnce::of(self);
        let found = self.resolve(parent, name, c, &index, Probe::Stat)?;
        let local = match &found {
            Found::Local { st, .. } => Some(*st),
            _ => None,
        };
        let entry = self.materialize(parent, name, c, &index, found)?;
        Ok(Held {
            view: self,
            node: entry.node,
            local,
        })
    }

    /// Makes the new entry `name` in the directory `parent` with `make`, which creates the
    /// object under the name it is given, in the local directory it is given, and removes
    /// it again if it fails half-way (it fails with `EEXIST`, making nothing, where the name
    /// is taken). Where a whiteout holds the name (or `via_temp` asks for it), the object is
    /// made under a temporary name and then takes its place in one rename (see [`names`]).
    /// Returns the entry handed to the kernel and what `make` made.
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
        make: impl Fn(BorrowedFd<'_>, &CStr) -> Result<T, Errno>,
    ) -> Result<(Entry, T), Errno> {
        if marker::is_reserved_name(name.as_bytes()) {
            return Err(Errno::EPERM);
        }
        let c = view_name(name)?;
        let index = IndexOnce::of(self);
        let is_dir = kind == Kind::Dir;
        let made_pinned = |dir: BorrowedFd<'_>, at: &CStr| {
            let made = make(dir, at)?;
            match store::open_path_at(dir, at) {
                Ok(pin) => Ok((pin, made)),
                Err(e) => {
                    let _ = names::remove_any(dir, at, is_dir);
                    Err(e)
                }
            }
        };
        // The kernel holds `parent` locked, so what local holds of the name does not change
        // between a probe and the making. Where nothing but local can hold the name, the
        // making is the probe: it fails with `EEXIST` exactly where local holds the name, and
        // only then is the name probed. The probe asks local once, which tells both whether
        // the name is taken and whether a whiteout is to be replaced, and the remote only
        // where local holds nothing.
        let fds = parent.dir_fds();
        let made_at_once = match self.local_alone(parent, &fds, name, &c, &index, via_temp) {
            Some(local) => match made_pinned(local.as_fd(), &c) {
                Ok((pin, made)) => Some((local, pin, made, false)),
                Err(Errno::EEXIST) => None,
                Err(e) => return Err(e),
            },
            None => None,
        };
        let (dir, pin, made, whiteout) = match made_at_once {
            Some(done) => done,
            None => {
                let whiteout = match resolve_local(parent, &fds, &c, Probe::Stat)? {
                    InLocal::Object(..) => return Err(Errno::EEXIST),
                    InLocal::Whiteout => true,
                    InLocal::Nothing => {
                        match self.resolve_below(parent, &fds, name, &c, &index, Probe::Stat) {
                            Ok(_) => return Err(Errno::EEXIST),
                            Err(Errno::ENOENT) => false,
                            Err(e) => return Err(e),
                        }
                    }
                };
                let dir = self.ensure_local_dir(parent)?;
                let (pin, made) = if !whiteout && !via_temp {
                    made_pinned(dir.as_fd(), &c)?
                } else {
                    let temp = temp_name();
                    let (pin, made) = made_pinned(dir.as_fd(), &temp)?;
                    let placed = if whiteout {
                        names::replace_whiteout(dir.as_fd(), &temp, &c, is_dir)
                    } else {
                        nix::fcntl::renameat2(
                            dir.as_fd(),
                            temp.as_c_str(),
                            dir.as_fd(),
                            c.as_c_str(),
                            RenameFlags::RENAME_NOREPLACE,
                        )
                    };
                    if let Err(e) = placed {
                        let _ = names::remove_any(dir.as_fd(), &temp, is_dir);
                        return Err(e);
                    }
                    if whiteout {
                        self.charge_inodes(parent, -1);
                    }
                    (pin, made)
                };
                (dir, pin, made, whiteout)
            }
        };
        let dir = dir.as_fd();
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

    /// Local's directory of `parent` where nothing but local can hold `name`: `parent` has
    /// no remote part, and the layout shows no entry of that name in it. `None` also where
    /// the object must be made under a temporary name anyway.
    fn local_alone(
        &self,
        parent: &Node,
        fds: &DirFds,
        name: &OsStr,
        c: &CStr,
        index: &IndexOnce,
        via_temp: bool,
    ) -> Option<Arc<OwnedFd>> {
        if via_temp || fds.remote.is_some() {
            return None;
        }
        let local = fds.local.clone()?;
        let below = self.resolve_below(parent, fds, name, c, index, Probe::Stat);
        matches!(below, Err(Errno::ENOENT)).then_some(local)
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
    pub(super) fn charge_inodes(&self, node: &Arc<Node>, delta: i64) {
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
