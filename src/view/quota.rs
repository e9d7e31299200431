//! Quotas in the view (DESIGN §6): which quota root a node is under, setting and clearing
//! roots, and the accounting around every call that allocates in local. The bookkeeping
//! itself (limits, usage, reservations) is [`crate::quota`].
//!
//! Every allocating call inside a root follows the same steps: reserve what it may
//! allocate, run, measure what it did allocate (`st_blocks` after minus before), charge
//! that, release the reservation. For files the "before" is remembered per node
//! (`NodeState::blocks`), so that concurrent writes to one file are each charged once.

use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use tracing::{info, warn};

use super::inodes::ROOT_INO;
use super::node::Node;
use super::{Caller, Stat, View};
use crate::control::protocol::{QuotaAnswer, QuotaInfo, QuotaRequest};
use crate::quota::persist::{self, Registry};
use crate::quota::scan::{self, allocated};
use crate::quota::size::{parse_size, SizeError};
use crate::quota::table::{Limit, QuotaRoot, Reservation};
use crate::store;

/// The attribute through which a runtime sets a directory's quota without our CLI.
pub const QUOTA_XATTR: &[u8] = b"user.layerfs.quota";

/// The estimate of calls that make a new name: they need a root that is not full, as on
/// XFS, where a new entry reserves directory space.
pub(super) const NEEDS_ROOM: u64 = 1;

#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    #[error("{path}: {source}")]
    Sys { path: String, source: Errno },
    #[error("{path} is inside the quota root {root}; quota roots do not nest")]
    Inside { path: String, root: String },
    #[error("{path} contains the quota root {root}; quota roots do not nest")]
    Contains { path: String, root: String },
    #[error("{path} is not a quota root")]
    NotRoot { path: String },
    #[error(
        "{file} is open with FUSE passthrough, whose writes a quota on {path} could not \
         count; close it, or set quotas before files are opened"
    )]
    Busy { path: String, file: String },
    #[error(transparent)]
    Size(#[from] SizeError),
    #[error("saving the quota registry: {0}")]
    Save(#[from] persist::RegistryError),
}

impl QuotaError {
    /// The errno the xattr interface answers with.
    pub fn errno(&self) -> Errno {
        match self {
            QuotaError::Sys { source, .. } => *source,
            QuotaError::Inside { .. } | QuotaError::Contains { .. } | QuotaError::Busy { .. } => {
                Errno::EBUSY
            }
            QuotaError::NotRoot { .. } => Errno::ENODATA,
            QuotaError::Size(_) => Errno::EINVAL,
            QuotaError::Save(_) => Errno::EIO,
        }
    }
}

/// What happens to a quota root's usage when something moves between roots.
pub(super) struct Move {
    from: Option<Arc<QuotaRoot>>,
    to: Option<Arc<QuotaRoot>>,
    bytes: u64,
    inodes: u64,
    _room: Option<Reservation>,
}

impl Move {
    /// Carries the usage over, once the rename is done.
    pub(super) fn commit(self) {
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
    /// The quota root `node` is under (a directory is under itself when it is one).
    pub fn quota_of(&self, node: &Arc<Node>) -> Option<Arc<QuotaRoot>> {
        if self.quotas.is_empty() {
            return None;
        }
        let generation = self.quotas.generation();
        {
            let state = node.state();
            // A file deleted while open has no name to find its root by, and is charged
            // to the root it was deleted from until its last close.
            if let Some(root) = &state.orphan_of {
                return Some(root.clone());
            }
            if let Some((g, root)) = &state.quota {
                if *g == generation {
                    return root.clone();
                }
            }
        }
        let root = self.own_root(node).or_else(|| {
            node.primary()
                .and_then(|(parent, _)| self.quota_of(&parent))
        });
        node.state().quota = Some((generation, root.clone()));
        root
    }

    /// The root `node` is, if it is one.
    fn own_root(&self, node: &Node) -> Option<Arc<QuotaRoot>> {
        if !node.is_dir() {
            return None;
        }
        let local = node.state().local.clone()?;
        let st = store::stat_fd(local.as_fd()).ok()?;
        self.quotas.root(st.st_dev, st.st_ino)
    }

    /// A node's path from the mount's root, by the names it was reached through.
    pub fn rel_path(&self, node: &Arc<Node>) -> Option<PathBuf> {
        let mut names = Vec::new();
        let mut at = node.clone();
        while at.ino != ROOT_INO {
            let (parent, name) = at.primary()?;
            names.push(name);
            at = parent;
        }
        Some(names.iter().rev().collect())
    }

    /// Finds a directory of the view by its path from the mount's root, and runs `then`
    /// on it while the whole path is held (a node nobody holds may be dropped, and its
    /// children with it).
    fn at_path<T>(
        &self,
        path: &str,
        then: impl FnOnce(&Arc<Node>) -> Result<T, QuotaError>,
    ) -> Result<T, QuotaError> {
        let sys = |source| QuotaError::Sys {
            path: path.to_owned(),
            source,
        };
        let mut held = Vec::new();
        let mut found = self.node(ROOT_INO).map_err(sys);
        for part in Path::new(path).components() {
            let Ok(node) = &found else {
                break;
            };
            let name = match part {
                Component::RootDir | Component::CurDir => continue,
                Component::Normal(name) => name,
                _ => {
                    found = Err(sys(Errno::EINVAL));
                    break;
                }
            };
            found = self.lookup(node.ino, name).map_err(sys).map(|entry| {
                held.push(entry.node.ino);
                entry.node
            });
        }
        let result = found.and_then(|node| then(&node));
        for ino in held {
            self.inodes.forget(ino, 1);
        }
        result
    }

    /// Answers a quota question from the control socket.
    pub fn quota_request(&self, request: QuotaRequest) -> Result<QuotaAnswer, String> {
        let one = |r: Result<QuotaInfo, QuotaError>| r.map(QuotaAnswer::One);
        match request {
            QuotaRequest::List => Ok(QuotaAnswer::Many(self.quota_list())),
            QuotaRequest::Get { path } => one(self.at_path(&path, |node| {
                self.own_root(node)
                    .map(|r| r.info())
                    .ok_or_else(|| QuotaError::NotRoot { path: path.clone() })
            })),
            QuotaRequest::Set { path, size, inodes } => {
                one(self.at_path(&path, |node| match parse_size(&size)? {
                    Some(bytes) => self
                        .set_quota(node, Limit { bytes, inodes })
                        .map(|r| r.info()),
                    // An unset size asks for no quota: the directory keeps what it has.
                    None => Ok(self.own_root(node).map(|r| r.info()).unwrap_or_default()),
                }))
            }
            QuotaRequest::Clear { path } => one(self.at_path(&path, |node| self.clear_quota(node))),
        }
        .map_err(|e| e.to_string())
    }

    pub fn quota_list(&self) -> Vec<QuotaInfo> {
        self.quotas.list().iter().map(|r| r.info()).collect()
    }

    /// Makes `node` a quota root with `limit`, or changes the limit of one.
    pub fn set_quota(&self, node: &Arc<Node>, limit: Limit) -> Result<Arc<QuotaRoot>, QuotaError> {
        let path = self.rel_path(node).unwrap_or_default();
        let shown = path.display().to_string();
        let sys = |source| QuotaError::Sys {
            path: shown.clone(),
            source,
        };
        if !node.is_dir() {
            return Err(sys(Errno::ENOTDIR));
        }
        let _changes = self.quotas.lock_changes();
        if let Some(root) = self.own_root(node) {
            root.set_limit(limit);
            self.save_quotas()?;
            info!(path = %shown, limit = limit.bytes, "quota changed");
            return Ok(root);
        }
        if let Some(above) = node.primary().and_then(|(p, _)| self.quota_of(&p)) {
            return Err(QuotaError::Inside {
                path: shown,
                root: above.path().display().to_string(),
            });
        }
        if let Some(below) = self.quotas.roots_under(&path).first() {
            return Err(QuotaError::Contains {
                path: shown,
                root: below.path().display().to_string(),
            });
        }
        // Writes that bypass the daemon could not be counted.
        if let Some(file) = self.passthrough_open_under(&path) {
            return Err(QuotaError::Busy {
                path: shown,
                file: file.display().to_string(),
            });
        }
        let local = self.ensure_local_dir(node).map_err(sys)?;
        let st = store::stat_fd(local.as_fd()).map_err(sys)?;
        let usage = scan::usage(local.as_fd()).map_err(sys)?;
        let root = Arc::new(QuotaRoot::new(
            st.st_dev,
            st.st_ino,
            path,
            limit,
            usage,
            self.quotas.errno(),
        ));
        self.quotas.insert(root.clone());
        if let Err(e) = self.save_quotas() {
            self.quotas.remove(st.st_dev, st.st_ino);
            return Err(e);
        }
        info!(path = %shown, limit = limit.bytes, used = usage.bytes, "quota set");
        Ok(root)
    }

    /// A file under `dir` that is open with FUSE passthrough.
    fn passthrough_open_under(&self, dir: &Path) -> Option<PathBuf> {
        self.inodes
            .live()
            .iter()
            .filter(|n| n.state().passthrough_opens > 0)
            .filter_map(|n| self.rel_path(n))
            .find(|p| p.starts_with(dir))
    }

    /// Removes the quota of a root; returns what it was.
    pub fn clear_quota(&self, node: &Arc<Node>) -> Result<QuotaInfo, QuotaError> {
        let _changes = self.quotas.lock_changes();
        let path = self
            .rel_path(node)
            .unwrap_or_default()
            .display()
            .to_string();
        let root = self
            .own_root(node)
            .ok_or(QuotaError::NotRoot { path: path.clone() })?;
        self.quotas.remove(root.dev, root.ino);
        self.save_quotas()?;
        info!(path = %path, "quota cleared");
        Ok(root.info())
    }

    /// Writes the registry of roots to local.
    pub fn save_quotas(&self) -> Result<(), QuotaError> {
        let registry = Registry {
            version: 1,
            roots: self
                .quotas
                .list()
                .iter()
                .map(|r| {
                    let (limit, usage) = (r.limit(), r.usage());
                    persist::Entry {
                        path: r.path(),
                        limit: limit.bytes,
                        inode_limit: limit.inodes,
                        used: usage.bytes,
                        inodes_used: usage.inodes,
                    }
                })
                .collect(),
        };
        Ok(persist::save(self.local_root.as_fd(), &registry)?)
    }

    /// Loads the registry at mount and recounts every root's usage from disk, so that a
    /// crash (whose last counts were never saved) leaves nothing wrong. A root whose
    /// directory is gone loses its quota, with a warning.
    pub fn load_quotas(&self) -> Result<usize, QuotaError> {
        let registry = persist::load(self.local_root.as_fd())?;
        let mut dropped = false;
        for entry in &registry.roots {
            let shown = entry.path.display().to_string();
            let found = open_local_dir(self.local_root.as_fd(), &entry.path).and_then(|fd| {
                let st = store::stat_fd(fd.as_fd())?;
                Ok((st, scan::usage(fd.as_fd())?))
            });
            let (st, usage) = match found {
                Ok(found) => found,
                Err(e) => {
                    warn!(path = %shown, error = %e, "quota root is gone from local; its quota is dropped");
                    dropped = true;
                    continue;
                }
            };
            if usage.bytes != entry.used || usage.inodes != entry.inodes_used {
                info!(
                    path = %shown,
                    saved = entry.used,
                    counted = usage.bytes,
                    "quota usage recounted from disk"
                );
            }
            self.quotas.insert(Arc::new(QuotaRoot::new(
                st.st_dev,
                st.st_ino,
                entry.path.clone(),
                Limit {
                    bytes: entry.limit,
                    inodes: entry.inode_limit,
                },
                usage,
                self.quotas.errno(),
            )));
        }
        if dropped {
            self.save_quotas()?;
        }
        Ok(self.quotas.list().len())
    }

    /// `statfs` of the directory `node`: a quota root's limit and room when it is under
    /// one, so that `df` inside a container shows its limit.
    pub fn statfs_at(&self, node: &Arc<Node>) -> Result<libc::statvfs, Errno> {
        let mut st = self.statfs()?;
        let Some(root) = self.quota_of(node) else {
            return Ok(st);
        };
        let (limit, usage) = (root.limit(), root.usage());
        // statvfs counts are 64-bit on every target layerfs builds for.
        let unit = st.f_frsize.max(1);
        let free = (limit.bytes.saturating_sub(usage.bytes) / unit).min(st.f_bavail);
        st.f_blocks = limit.bytes / unit;
        st.f_bfree = free;
        st.f_bavail = free;
        if let Some(inodes) = limit.inodes {
            let free = inodes.saturating_sub(usage.inodes).min(st.f_ffree);
            st.f_files = inodes;
            st.f_ffree = free;
            st.f_favail = free;
        }
        Ok(st)
    }

    /// `getxattr user.layerfs.quota`: the limit in bytes.
    pub(super) fn quota_xattr(&self, node: &Node) -> Result<Vec<u8>, Errno> {
        let root = self.own_root(node).ok_or(Errno::ENODATA)?;
        Ok(root.limit().bytes.to_string().into_bytes())
    }

    /// `setxattr user.layerfs.quota`: a size sets the quota, an empty value clears it.
    /// Only root may: a container must not raise its own limit.
    pub(super) fn set_quota_xattr(
        &self,
        node: &Arc<Node>,
        value: &[u8],
        caller: Caller,
    ) -> Result<(), Errno> {
        if caller.uid != 0 {
            return Err(Errno::EPERM);
        }
        if !node.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        let text = std::str::from_utf8(value).map_err(|_| Errno::EINVAL)?;
        let text = text.trim_end_matches('\0');
        let result = match parse_size(text) {
            Ok(Some(bytes)) => self
                .set_quota(
                    node,
                    Limit {
                        bytes,
                        inodes: self.own_root(node).and_then(|r| r.limit().inodes),
                    },
                )
                .map(drop),
            Ok(None) => match self.clear_quota(node) {
                Err(QuotaError::NotRoot { .. }) => Ok(()),
                other => other.map(drop),
            },
            Err(e) => Err(e.into()),
        };
        result.map_err(|e| {
            warn!(error = %e, "quota attribute refused");
            e.errno()
        })
    }

    /// `removexattr user.layerfs.quota`.
    pub(super) fn remove_quota_xattr(&self, node: &Arc<Node>, caller: Caller) -> Result<(), Errno> {
        if caller.uid != 0 {
            return Err(Errno::EPERM);
        }
        self.clear_quota(node).map(drop).map_err(|e| e.errno())
    }

    pub(super) fn is_quota_xattr(name: &OsStr) -> bool {
        name.as_bytes() == QUOTA_XATTR
    }

    /// Runs `op`, which makes one new object in the directory `parent`, inside the quota
    /// of `parent`: `estimate` bytes must fit, and what the directory and the new object
    /// (`made`) allocate is charged, plus one inode.
    pub(super) fn allocating<T>(
        &self,
        parent: &Arc<Node>,
        estimate: u64,
        inodes: u64,
        op: impl FnOnce() -> Result<T, Errno>,
        made: impl FnOnce(&T) -> u64,
    ) -> Result<T, Errno> {
        let Some(root) = self.quota_of(parent) else {
            return op();
        };
        let reservation = root.reserve_with_inodes(estimate, inodes)?;
        // Any copy-up of the directory is charged by itself, before "before".
        let dir = self.ensure_local_dir(parent)?;
        let before = dir_blocks(dir.as_fd());
        let out = op()?;
        let grown = dir_blocks(dir.as_fd()) as i64 - before as i64;
        root.charge(grown + made(&out) as i64);
        root.charge_inodes(inodes as i64);
        drop(reservation);
        Ok(out)
    }

    /// Counts `delta` more (or fewer) inodes under `node`'s root: whiteouts made or removed.
    pub(super) fn charge_inodes(&self, node: &Arc<Node>, delta: i64) {
        if let Some(root) = self.quota_of(node) {
            root.charge_inodes(delta);
        }
    }

    /// The block size of local's filesystem: what a new directory costs at least.
    pub(super) fn local_block_size(&self) -> u64 {
        store::stat_fd(self.local_root.as_fd())
            .map(|st| block_size(&st))
            .unwrap_or(4096)
    }

    /// Charges what a change of a directory's entries made it grow by (`before` from
    /// [`dir_blocks`]), and `inodes` more or fewer inodes, to the directory's root.
    pub(super) fn charge_dir(
        &self,
        dir_node: &Arc<Node>,
        dir: BorrowedFd<'_>,
        before: u64,
        inodes: i64,
    ) {
        if let Some(root) = self.quota_of(dir_node) {
            root.charge(dir_blocks(dir) as i64 - before as i64);
            root.charge_inodes(inodes);
        }
    }

    /// Credits the space of an object whose last name is gone, or, for a file still
    /// open, marks it to be credited at its last close (as a filesystem frees it then).
    pub(super) fn credit_removed(&self, root: Option<Arc<QuotaRoot>>, node: &Node, st: &Stat) {
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

    /// An open of `node` was made (see [`View::released`]); `bypasses`: it does its I/O
    /// with FUSE passthrough.
    pub fn opened(&self, node: &Node, bypasses: bool) {
        let mut state = node.state();
        state.open_files += 1;
        state.passthrough_opens += bypasses as u32;
    }

    /// Measures a file again after its data reached the disk: a filesystem may allocate
    /// metadata (extent blocks) only at writeback, after the write was charged.
    pub fn resettle(&self, node: &Arc<Node>, fd: BorrowedFd<'_>) {
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
    pub fn released(&self, node: &Arc<Node>, fd: BorrowedFd<'_>, bypasses: bool) {
        self.resettle(node, fd);
        let orphan = {
            let mut state = node.state();
            state.open_files = state.open_files.saturating_sub(1);
            state.passthrough_opens = state.passthrough_opens.saturating_sub(bypasses as u32);
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
    pub(super) fn settle(
        &self,
        root: &QuotaRoot,
        node: &Node,
        fd: BorrowedFd<'_>,
        before: u64,
    ) -> i64 {
        // Measured under the node's lock, so that concurrent calls on one file each
        // charge what happened since the previous measurement, in order.
        let mut state = node.state();
        let Ok(st) = store::stat_fd(fd) else {
            return 0;
        };
        let now = allocated(&st);
        let generation = self.quotas.generation();
        let old = match state.blocks.replace((generation, now)) {
            Some((g, known)) if g == generation => known,
            _ => before,
        };
        drop(state);
        let delta = now as i64 - old as i64;
        root.charge(delta);
        delta
    }

    /// Writes `data` at `offset` of the open file `fd` of `node`, within its quota: a
    /// write that only partly fits is cut short at the limit, as on a full disk.
    pub fn write_at(
        &self,
        node: &Arc<Node>,
        fd: BorrowedFd<'_>,
        offset: u64,
        data: &[u8],
    ) -> Result<usize, Errno> {
        let Some(root) = self.quota_of(node) else {
            return pwrite_all(fd, data, offset);
        };
        let st = store::stat_fd(fd)?;
        let before = allocated(&st);
        let block = block_size(&st);
        let (len, reservation) = match root.reserve(estimate(fd, &st, offset, data.len() as u64)) {
            Ok(r) => (data.len(), r),
            Err(full) => {
                let fits = fitting(offset, root.room(), block).min(data.len() as u64);
                if fits == 0 {
                    return Err(full);
                }
                let r = root
                    .reserve(estimate(fd, &st, offset, fits))
                    .map_err(|_| full)?;
                (fits as usize, r)
            }
        };
        let written = pwrite_all(fd, &data[..len], offset);
        self.settle(&root, node, fd, before);
        drop(reservation);
        written
    }

    /// `fallocate(2)` within the quota: allocating more than the room fails before
    /// anything is allocated; punching holes credits what they free.
    pub fn fallocate_at(
        &self,
        node: &Arc<Node>,
        fd: BorrowedFd<'_>,
        mode: i32,
        offset: u64,
        length: u64,
    ) -> Result<(), Errno> {
        let call = || {
            Errno::result(unsafe {
                libc::fallocate(
                    fd.as_raw_fd(),
                    mode,
                    offset as libc::off_t,
                    length as libc::off_t,
                )
            })
            .map(drop)
        };
        let Some(root) = self.quota_of(node) else {
            return call();
        };
        let st = store::stat_fd(fd)?;
        let frees = mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_COLLAPSE_RANGE) != 0;
        let reservation = if frees {
            None
        } else {
            Some(root.reserve(estimate(fd, &st, offset, length))?)
        };
        let result = call();
        self.settle(&root, node, fd, allocated(&st));
        drop(reservation);
        result
    }

    /// Changes the size of the file `fd` of `node` within its quota. Growing a file makes
    /// a hole, free where the filesystem has sparse files; where it allocated anyway and
    /// went over the limit, the old size is put back.
    pub(super) fn truncate_within_quota(
        &self,
        node: &Arc<Node>,
        fd: BorrowedFd<'_>,
        size: u64,
    ) -> Result<(), Errno> {
        let truncate = |len: u64| {
            Errno::result(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) }).map(drop)
        };
        let Some(root) = self.quota_of(node) else {
            return truncate(size);
        };
        let st = store::stat_fd(fd)?;
        let old_size = st.st_size.max(0) as u64;
        truncate(size)?;
        let grew = self.settle(&root, node, fd, allocated(&st));
        if size > old_size && grew > 0 && root.usage().bytes > root.limit().bytes {
            truncate(old_size)?;
            self.settle(&root, node, fd, allocated(&st));
            return Err(root.exceeded());
        }
        Ok(())
    }

    /// `copy_file_range(2)` into the open file `dst` of `node`, within its quota.
    pub fn copy_range_at(
        &self,
        node: &Arc<Node>,
        src: BorrowedFd<'_>,
        offset_in: u64,
        dst: BorrowedFd<'_>,
        offset_out: u64,
        len: u64,
    ) -> Result<usize, Errno> {
        let copy = |len: u64| {
            let mut off_in = offset_in as libc::loff_t;
            let mut off_out = offset_out as libc::loff_t;
            Errno::result(unsafe {
                libc::copy_file_range(
                    src.as_raw_fd(),
                    &mut off_in,
                    dst.as_raw_fd(),
                    &mut off_out,
                    len.min(1 << 30) as usize,
                    0,
                )
            })
            .map(|n| n as usize)
        };
        let Some(root) = self.quota_of(node) else {
            return copy(len);
        };
        let st = store::stat_fd(dst)?;
        let block = block_size(&st);
        let (len, reservation) = match root.reserve(estimate(dst, &st, offset_out, len)) {
            Ok(r) => (len, r),
            Err(full) => {
                let fits = fitting(offset_out, root.room(), block).min(len);
                if fits == 0 {
                    return Err(full);
                }
                let r = root
                    .reserve(estimate(dst, &st, offset_out, fits))
                    .map_err(|_| full)?;
                (fits, r)
            }
        };
        let copied = copy(len);
        self.settle(&root, node, dst, allocated(&st));
        drop(reservation);
        copied
    }

    /// Plans moving `node` (a name of `from_dir`) into `to_dir`: where both are under the
    /// same root (or none), nothing moves; otherwise its usage moves and the destination
    /// must have room. Quota roots do not nest, so a directory holding one cannot move
    /// under another (`EXDEV`, like a move between XFS projects); neither can one of
    /// several hard links.
    pub(super) fn plan_move(
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
        // What moves must be countable: nothing open with passthrough (its writes would
        // land unseen), no inode also reachable from outside what moves.
        let path = self.rel_path(node).ok_or(Errno::EXDEV)?;
        if to.is_some() && self.passthrough_open_under(&path).is_some() {
            return Err(Errno::EXDEV);
        }
        let (bytes, inodes) = if node.is_dir() {
            if to.is_some() && !self.quotas.roots_under(&path).is_empty() {
                return Err(Errno::EXDEV);
            }
            let local = node.state().local.clone().ok_or(Errno::EXDEV)?;
            let tree = scan::tree(local.as_fd())?;
            if tree.hard_linked {
                return Err(Errno::EXDEV);
            }
            (tree.usage.bytes, tree.usage.inodes)
        } else {
            let (parent, name) = node.primary().ok_or(Errno::ESTALE)?;
            let dir = parent.dir_fds().local.ok_or(Errno::ESTALE)?;
            let st = store::stat_at(dir.as_fd(), &store::cname(&name)?)?;
            if st.st_nlink > 1 {
                return Err(Errno::EXDEV);
            }
            (allocated(&st), 1)
        };
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
    pub(super) fn renamed(&self, moved: &[(&Arc<Node>, Option<PathBuf>)]) {
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

/// Allocated bytes of a directory, 0 when it cannot be read.
pub(super) fn dir_blocks(dir: BorrowedFd<'_>) -> u64 {
    store::stat_fd(dir).map(|st| allocated(&st)).unwrap_or(0)
}

fn block_size(st: &Stat) -> u64 {
    (st.st_blksize as u64).clamp(512, 1 << 20)
}

/// What writing `len` bytes at `offset` of the file may allocate: the blocks of the range
/// that have no space yet. Where the filesystem cannot tell (no FIEMAP), a range that
/// `SEEK_HOLE` finds all data costs only what grows the file, any other the whole range.
fn estimate(fd: BorrowedFd<'_>, st: &Stat, offset: u64, len: u64) -> u64 {
    if len == 0 {
        return 0;
    }
    let block = block_size(st);
    let round_up = |x: u64| x.div_ceil(block) * block;
    let start = offset / block * block;
    let end = round_up(offset.saturating_add(len));
    let whole = end - start;
    if let Ok(have) = store::fiemap::allocated_between(fd, start, end) {
        return whole.saturating_sub(have);
    }
    let size = st.st_size.max(0) as u64;
    if offset >= size {
        // An append: every block is new but the one the file ends in, when it starts there.
        let shared = (offset % block != 0 && start < size) as u64 * block;
        return whole - shared;
    }
    let hole = unsafe { libc::lseek(fd.as_raw_fd(), offset as libc::off_t, libc::SEEK_HOLE) };
    if hole < 0 || (hole as u64) < (offset + len).min(size) {
        return whole;
    }
    end.saturating_sub(round_up(size))
}

/// What a copy of the remote file `name` of `dir` will allocate in local: its data
/// extents (the copy keeps holes), in whole local blocks. Not its `st_blocks`, which a
/// compressing or network filesystem may report far below the data it holds.
pub(super) fn copy_estimate(dir: BorrowedFd<'_>, name: &std::ffi::CStr, block: u64) -> u64 {
    let Ok(fd) = store::open_at(dir, name, nix::fcntl::OFlag::O_RDONLY, 0) else {
        return 0;
    };
    let Ok(st) = store::stat_fd(fd.as_fd()) else {
        return 0;
    };
    let size = st.st_size.max(0) as u64;
    let round_up = |x: u64| x.div_ceil(block) * block;
    let seek = |at: u64, whence| {
        let r = unsafe { libc::lseek(fd.as_raw_fd(), at as libc::off_t, whence) };
        (r >= 0).then_some(r as u64)
    };
    let mut total = 0;
    let mut at = 0;
    while at < size {
        let Some(data) = seek(at, libc::SEEK_DATA) else {
            break;
        };
        let end = seek(data, libc::SEEK_HOLE).unwrap_or(size).min(size);
        if end <= data {
            // No SEEK_DATA support worth the name: count the whole file.
            return round_up(size);
        }
        total += round_up(end) - data / block * block;
        at = end;
    }
    total.min(round_up(size))
}

/// How many bytes from `offset` fit in `room` bytes of whole blocks.
fn fitting(offset: u64, room: u64, block: u64) -> u64 {
    let start = offset / block * block;
    (start + room / block * block).saturating_sub(offset)
}

fn pwrite_all(fd: BorrowedFd<'_>, data: &[u8], offset: u64) -> Result<usize, Errno> {
    let mut done = 0;
    while done < data.len() {
        match nix::sys::uio::pwrite(fd, &data[done..], (offset as usize + done) as libc::off_t) {
            Ok(n) => done += n,
            Err(Errno::EINTR) => continue,
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(done)
}

/// Opens a directory of local by its relative path, never following a symlink.
fn open_local_dir(root: BorrowedFd<'_>, path: &Path) -> Result<std::os::fd::OwnedFd, Errno> {
    let mut fd = store::reopen(
        root,
        nix::fcntl::OFlag::O_PATH | nix::fcntl::OFlag::O_DIRECTORY,
    )?;
    for part in path.components() {
        let Component::Normal(name) = part else {
            return Err(Errno::EINVAL);
        };
        fd = store::open_dir_at(fd.as_fd(), &store::cname(name)?)?;
    }
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fitting_counts_whole_blocks_from_the_offset() {
        assert_eq!(fitting(0, 8192, 4096), 8192);
        assert_eq!(fitting(0, 8191, 4096), 4096);
        assert_eq!(fitting(100, 4096, 4096), 3996);
        assert_eq!(fitting(4096, 0, 4096), 0);
    }

    #[test]
    fn estimates_appends_overwrites_and_holes() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        std::fs::write(&path, vec![1u8; 10_000]).unwrap();
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let fd = file.as_fd();
        let st = store::stat_fd(fd).unwrap();
        // Inside data: nothing new.
        assert_eq!(estimate(fd, &st, 0, 4096), 0);
        // An append at the end, which is mid-block: the tail block is there already.
        assert_eq!(estimate(fd, &st, 10_000, 100), 0);
        assert_eq!(estimate(fd, &st, 10_000, 4096), 4096);
        // Past the end, block-aligned.
        assert_eq!(estimate(fd, &st, 12_288, 1 << 20), 1 << 20);
        // Overwrite running past the end.
        assert_eq!(estimate(fd, &st, 8192, 8192), 4096);
        // A hole.
        file.set_len(1 << 20).unwrap();
        let st = store::stat_fd(fd).unwrap();
        assert_eq!(estimate(fd, &st, 65_536, 4096), 4096);
        assert_eq!(estimate(fd, &st, 0, 0), 0);
    }
}
