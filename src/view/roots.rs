//! Quota roots as users name them: by a path from the mount's root (the control socket),
//! or as the directory the `user.layerfs.quota` attribute is set on. The view finds the
//! directory and who may change it; the quota does the rest (see [`crate::quota`]).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};
use std::sync::Arc;

use nix::errno::Errno;
use tracing::warn;

use super::identity::ROOT_INO;
use super::node::Node;
use super::{Caller, View};
use crate::quota::size::parse_size;
use crate::quota::Choice;
use crate::quota::{Accounting, Limit, QuotaError, QUOTA_XATTR};
use crate::report::{QuotaAnswer, QuotaInfo, QuotaRequest};

impl View {
    /// Loads the quota roots saved in local and counts their usage, before the mount is
    /// served; `errno` is what allocations over a limit fail with (FUSE backend), `backend`
    /// the backend new roots get. Returns how many roots there are.
    pub fn load_quotas(&mut self, errno: Errno, backend: Choice) -> Result<usize, QuotaError> {
        let roots = self.quota.load(errno, backend)?;
        self.number_subvolumes();
        Ok(roots)
    }

    /// Tells the inode table the subvolumes of the roots btrfs enforces, whose objects it
    /// numbers after them.
    fn number_subvolumes(&self) {
        for (dev, id) in self.quota.subvolumes() {
            self.inodes.add_subvolume(dev, id);
        }
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
                self.quota()
                    .root(node)
                    .ok_or_else(|| QuotaError::NotRoot { path: path.clone() })
            })),
            QuotaRequest::Set { path, size, inodes } => {
                one(self.at_path(&path, |node| match parse_size(&size)? {
                    Some(bytes) => self.set_quota(node, Limit { bytes, inodes }),
                    // An unset size asks for no quota: the directory keeps what it has.
                    None => Ok(self.quota().root(node).unwrap_or_default()),
                }))
            }
            QuotaRequest::Clear { path } => {
                one(self.at_path(&path, |node| self.quota().clear(node)))
            }
        }
        .map_err(|e| e.to_string())
    }

    pub fn quota_list(&self) -> Vec<QuotaInfo> {
        self.quota().list()
    }

    /// Makes `node` a quota root with `limit`, or changes the limit of one (see
    /// [`Accounting::set`]).
    fn set_quota(&self, node: &Arc<Node>, limit: Limit) -> Result<QuotaInfo, QuotaError> {
        let info = self.quota().set(
            node,
            || self.ensure_local_dir(node),
            || self.make_subvolume(node),
            limit,
            || self.inodes.live(),
        )?;
        self.number_subvolumes();
        Ok(info)
    }

    /// Whether the directory `node` is a quota root.
    pub(in crate::view) fn is_quota_root(&self, node: &Node) -> bool {
        self.quota().root(node).is_some()
    }

    /// `getxattr user.layerfs.quota`: the limit in bytes.
    pub(in crate::view) fn quota_xattr(&self, node: &Node) -> Result<Vec<u8>, Errno> {
        let root = self.quota().root(node).ok_or(Errno::ENODATA)?;
        Ok(root.limit.to_string().into_bytes())
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
            Ok(Some(bytes)) => {
                let inodes = self.quota().root(&**node).and_then(|r| r.inode_limit);
                self.set_quota(node, Limit { bytes, inodes }).map(drop)
            }
            Ok(None) => match self.quota().clear(&**node) {
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
        self.quota().clear(&**node).map(drop).map_err(|e| e.errno())
    }

    pub(in crate::view) fn is_quota_xattr(name: &OsStr) -> bool {
        name.as_bytes() == QUOTA_XATTR
    }
}
