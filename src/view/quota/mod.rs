//! Quotas in the view (DESIGN §6): which quota root a node is under, and setting, clearing,
//! saving and loading roots. The bookkeeping itself (limits, usage, reservations) is
//! [`crate::quota`]; the accounting around each call that allocates is in [`charge`] (names)
//! and [`io`] (file data).
//!
//! Every allocating call inside a root follows the same steps: reserve what it may
//! allocate, run, measure what it did allocate (`st_blocks` after minus before), charge
//! that, release the reservation. For files the "before" is remembered per node
//! (`NodeState::blocks`), so that concurrent writes to one file are each charged once.

mod charge;
mod io;

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use tracing::{info, warn};

use super::inodes::ROOT_INO;
use super::node::Node;
use super::{Caller, View};
use crate::quota::roots::{self, QuotaError, QUOTA_XATTR};
use crate::quota::scan;
use crate::quota::size::parse_size;
use crate::quota::table::{Limit, QuotaRoot};
use crate::report::{QuotaAnswer, QuotaInfo, QuotaRequest};
use crate::store;

pub use charge::Held;
pub(in crate::view) use charge::{charge_new, dir_blocks, NEEDS_ROOM};

impl View {
    /// The quota root `node` is under (a directory is under itself when it is one).
    pub fn quota_of(&self, node: &Arc<Node>) -> Option<Arc<QuotaRoot>> {
        if self.quotas.is_empty() {
            return None;
        }
        let generation = self.quotas.generation();
        // Up the tree to the first node that knows its root for this generation, or is a
        // root; the answer is then remembered on the way walked. A loop, not a recursion:
        // the tree may be as deep as a caller makes it.
        let mut walked = Vec::new();
        let mut at = node.clone();
        let root = loop {
            {
                let state = at.state();
                // A file deleted while open has no name to find its root by, and is
                // charged to the root it was deleted from until its last close.
                if let Some(root) = &state.orphan_of {
                    break Some(root.clone());
                }
                if let Some((g, root)) = &state.quota {
                    if *g == generation {
                        break root.clone();
                    }
                }
            }
            if let Some(root) = self.own_root(&at) {
                walked.push(at);
                break Some(root);
            }
            let parent = at.primary().map(|(parent, _)| parent);
            walked.push(at);
            match parent {
                Some(parent) => at = parent,
                None => break None,
            }
        };
        for n in walked {
            n.state().quota = Some((generation, root.clone()));
        }
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
    ///
    /// A new root is made visible before anything is checked or counted: from then on no
    /// open under it gets passthrough and every allocation is charged to it, so a writer
    /// that bypasses the daemon can only be one that was already open, which refuses the
    /// quota. The existing usage is then counted with no lock held (a rename elsewhere
    /// never waits for the walk), and added to what was charged meanwhile.
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
        let local = self.ensure_local_dir(node).map_err(sys)?;
        let st = store::stat_fd(local.as_fd()).map_err(sys)?;
        let root = {
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
            let root = Arc::new(QuotaRoot::new(
                st.st_dev,
                st.st_ino,
                path.clone(),
                limit,
                Default::default(),
                self.quotas.errno(),
            ));
            self.quotas.insert(root.clone());
            root
        };
        let withdraw = |e: QuotaError| {
            let _changes = self.quotas.lock_changes();
            self.quotas.remove(st.st_dev, st.st_ino);
            e
        };
        // Writes that bypass the daemon could not be counted.
        if let Some(file) = self.passthrough_open_under(&path) {
            return Err(withdraw(QuotaError::Busy {
                path: shown,
                file: file.display().to_string(),
            }));
        }
        let usage = scan::usage(local.as_fd()).map_err(|e| withdraw(sys(e)))?;
        root.charge(usage.bytes as i64);
        root.charge_inodes(usage.inodes as i64);
        {
            let _changes = self.quotas.lock_changes();
            if let Err(e) = self.save_quotas() {
                self.quotas.remove(st.st_dev, st.st_ino);
                return Err(e);
            }
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
        roots::save(&self.quotas, self.local_root.as_fd())
    }

    /// Loads the registry at mount (see [`roots::load`]); returns how many roots there are.
    pub fn load_quotas(&self) -> Result<usize, QuotaError> {
        roots::load(&self.quotas, self.local_root.as_fd())
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

    /// Whether the directory `node` is a quota root.
    pub(in crate::view) fn is_quota_root(&self, node: &Node) -> bool {
        self.own_root(node).is_some()
    }

    /// `getxattr user.layerfs.quota`: the limit in bytes.
    pub(in crate::view) fn quota_xattr(&self, node: &Node) -> Result<Vec<u8>, Errno> {
        let root = self.own_root(node).ok_or(Errno::ENODATA)?;
        Ok(root.limit().bytes.to_string().into_bytes())
    }

    /// `setxattr user.layerfs.quota`: a size sets the quota, an empty value clears it.
    /// Only a caller with `CAP_SYS_ADMIN` may, as on XFS: a container must not raise its
    /// own limit, even as its own root.
    pub(in crate::view) fn set_quota_xattr(
        &self,
        node: &Arc<Node>,
        value: &[u8],
        caller: Caller,
    ) -> Result<(), Errno> {
        if !caller.is_admin() {
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
    pub(in crate::view) fn remove_quota_xattr(
        &self,
        node: &Arc<Node>,
        caller: Caller,
    ) -> Result<(), Errno> {
        if !caller.is_admin() {
            return Err(Errno::EPERM);
        }
        self.clear_quota(node).map(drop).map_err(|e| e.errno())
    }

    pub(in crate::view) fn is_quota_xattr(name: &OsStr) -> bool {
        name.as_bytes() == QUOTA_XATTR
    }
}
