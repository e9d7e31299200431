//! A directory of the view becoming a btrfs subvolume in place, for a quota the kernel
//! enforces (see `quota::kernel`): the tree is converted on disk (`store::subvolume`), and
//! the live nodes under it are moved onto the new objects, so that what the kernel holds
//! keeps working.
//!
//! A file open under the directory would go on writing into the tree that is replaced,
//! so the conversion is refused while one is; quotas are set on directories not in use
//! (a container layer before its container starts). A change made under the directory
//! while its tree is copied is not carried over: the copy takes the tree as it finds it.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path};
use std::sync::Arc;

use nix::errno::Errno;
use tracing::{info, warn};

use super::identity::Identity;
use super::node::{Layer, Node};
use super::View;
use crate::quota::{Object, QuotaError};
use crate::store::{self, subvolume};

impl View {
    /// Turns the local directory of `dir` into a btrfs subvolume with the same content;
    /// returns its handle.
    pub(super) fn make_subvolume(&self, dir: &Arc<Node>) -> Result<Arc<OwnedFd>, QuotaError> {
        let path = dir.path().unwrap_or_default();
        let shown = path.display().to_string();
        let sys = |source| QuotaError::Sys {
            path: shown.clone(),
            source,
        };
        let (parent, name) = dir.primary().ok_or_else(|| QuotaError::Backend {
            path: shown.clone(),
            reason: "the mount's root cannot become a btrfs subvolume".into(),
        })?;
        let parent_local = parent.local_dir().ok_or_else(|| sys(Errno::ENOENT))?;
        let name = store::cname(&name).map_err(sys)?;
        let live: Vec<Arc<Node>> = self
            .inodes
            .live()
            .into_iter()
            .filter(|n| n.path().is_some_and(|p| p.starts_with(&path)))
            .collect();
        if let Some(open) = live.iter().find(|n| n.state().open_files > 0) {
            return Err(QuotaError::InUse {
                path: shown,
                file: open.path().unwrap_or_default().display().to_string(),
            });
        }
        let temp = subvolume::temp_for(&name);
        // What an earlier conversion of this directory left when the daemon stopped.
        match subvolume::finish(parent_local.as_fd(), &temp) {
            Ok(subvolume::Leftover::Nothing) => {}
            Ok(found) => {
                info!(path = %shown, ?found, "removed what an interrupted conversion left")
            }
            Err(e) => warn!(path = %shown, error = %e, "what an interrupted conversion left stays"),
        }
        subvolume::convert(parent_local.as_fd(), &name, &temp).map_err(sys)?;
        let top = Arc::new(store::open_dir_at(parent_local.as_fd(), &name).map_err(sys)?);
        for node in &live {
            let Some(below) = node.path() else { continue };
            let rel = below.strip_prefix(&path).unwrap_or(Path::new(""));
            if let Err(e) = self.rebind(node, &top, rel) {
                warn!(path = %below.display(), error = %e, "a node under a converted directory lost its object");
                self.inodes.detach(node);
            }
        }
        info!(path = %shown, nodes = live.len(), "directory converted into a btrfs subvolume");
        Ok(top)
    }

    /// Points `node` at its object in the converted tree `top`, at `rel` below it.
    fn rebind(&self, node: &Node, top: &Arc<OwnedFd>, rel: &Path) -> Result<(), Errno> {
        if node.layer() != Layer::Local && !node.is_dir() {
            return Ok(());
        }
        let mut fd: Option<OwnedFd> = None;
        for part in rel.components() {
            let Component::Normal(name) = part else {
                return Err(Errno::EINVAL);
            };
            let at = fd.as_ref().map_or(top.as_fd(), |f| f.as_fd());
            fd = Some(store::open_path_at(at, &store::cname(name)?)?);
        }
        let object = match fd {
            Some(fd) => Arc::new(fd),
            None => top.clone(),
        };
        let st = store::stat_fd(object.as_fd())?;
        let old = {
            let mut state = node.state();
            if node.is_dir() {
                if state.local.is_none() {
                    return Ok(());
                }
                state.local = Some(object);
            } else {
                state.object = Some(object);
            }
            state
                .identities
                .iter()
                .find(|id| matches!(id, Identity::Local { .. }))
                .cloned()
        };
        if let Some(old) = old {
            self.inodes.remove_identity(node, &old);
        }
        self.inodes
            .add_identity(node, super::identity::local_identity(&st));
        Ok(())
    }
}
