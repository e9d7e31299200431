//! A directory of the view becoming a btrfs subvolume in place, for a quota the kernel
//! enforces (see `quota::kernel`): the tree is converted on disk (`store::subvolume`), and
//! the live nodes under it are moved onto the new objects, so that what the kernel holds
//! keeps working.
//!
//! The tree is copied while requests go on. Then every request is paused at the gate (see
//! `gate`) while the conversion checks that nothing changed since the copy (every object's
//! change time, and no file open under the directory: an open file would go on writing
//! into the tree that is replaced), swaps the copy in and moves the live nodes onto it. A
//! change found drops the copy and starts over, up to [`ATTEMPTS`] times; a file open under
//! the directory when it starts fails it at once, naming the file. Quotas are meant for
//! directories not in use yet (a container layer before its container starts).

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

/// Conversions tried before a directory that keeps changing is given up on.
const ATTEMPTS: u32 = 3;
/// How long a conversion waits for the requests in progress to finish.
const PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// The path of a file open among `nodes`.
fn open_under(nodes: &[Arc<Node>]) -> Option<String> {
    nodes
        .iter()
        .find(|n| n.state().open_files > 0)
        .map(|n| n.path().unwrap_or_default().display().to_string())
}

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
        let live = self.live_under(&path);
        if let Some(open) = open_under(&live) {
            return Err(QuotaError::InUse {
                path: shown,
                file: open,
            });
        }
        let temp = subvolume::temp_for(&name);
        let parent_fd = parent_local.as_fd();
        for attempt in 1..=ATTEMPTS {
            // What an earlier conversion of this directory left when the daemon stopped.
            match subvolume::finish(parent_fd, &temp) {
                Ok(subvolume::Leftover::Nothing) => {}
                Ok(found) => {
                    info!(path = %shown, ?found, "removed what an interrupted conversion left")
                }
                Err(e) => {
                    warn!(path = %shown, error = %e, "what an interrupted conversion left stays")
                }
            }
            // Copied while requests go on; they are paused only to check that nothing
            // changed meanwhile, and for the swap.
            let seen = subvolume::copy(parent_fd, &name, &temp).map_err(sys)?;
            let drop_copy = || {
                if let Err(e) = subvolume::remove_tree(parent_fd, &temp) {
                    warn!(path = %shown, error = %e, "a copy that did not take a directory's place is left to remove");
                }
            };
            let Some(paused) = self.gate.pause(PATIENCE) else {
                drop_copy();
                return Err(QuotaError::Backend {
                    path: shown.clone(),
                    reason: format!(
                        "requests in progress did not finish within {} s (a stalled remote?), \
                         so it could not be made a btrfs subvolume; try again",
                        PATIENCE.as_secs()
                    ),
                });
            };
            let quiet = open_under(&self.live_under(&path)).is_none()
                && subvolume::unchanged(parent_fd, &name, &seen).map_err(sys)?;
            if !quiet {
                drop(paused);
                drop_copy();
                info!(path = %shown, attempt, "the directory changed while it was copied; the conversion starts over");
                continue;
            }
            let swapped = subvolume::swap(parent_fd, &name, &temp)
                .and_then(|()| store::open_dir_at(parent_fd, &name));
            let top = match swapped {
                Ok(top) => Arc::new(top),
                Err(e) => {
                    drop(paused);
                    return Err(sys(e));
                }
            };
            self.rebind_under(&path, &top);
            drop(paused);
            // What is left is space to give back; a failure here is found again by
            // `finish` at the next conversion or mount.
            if let Err(e) = subvolume::remove_tree(parent_fd, &temp) {
                warn!(path = %shown, error = %e, "the tree a subvolume replaced is left to remove");
            }
            info!(path = %shown, attempt, "directory converted into a btrfs subvolume");
            return Ok(top);
        }
        Err(QuotaError::Backend {
            path: shown,
            reason: format!(
                "it changed while it was being made a btrfs subvolume, {ATTEMPTS} times; \
                 set the quota while nothing writes to it"
            ),
        })
    }

    /// The live nodes at `path` and below it.
    fn live_under(&self, path: &Path) -> Vec<Arc<Node>> {
        self.inodes
            .live()
            .into_iter()
            .filter(|n| n.path().is_some_and(|p| p.starts_with(path)))
            .collect()
    }

    /// Points every live node at `path` and below at its object in the tree `top` (the
    /// directory at `path`, which holds the same objects). One that is not found there
    /// loses its identities: the next lookup makes a new node.
    fn rebind_under(&self, path: &Path, top: &Arc<OwnedFd>) {
        for node in self.live_under(path) {
            let Some(below) = node.path() else { continue };
            let rel = below.strip_prefix(path).unwrap_or(Path::new(""));
            if let Err(e) = self.rebind(&node, top, rel) {
                warn!(path = %below.display(), error = %e, "a node under a converted directory lost its object");
                self.inodes.detach(&node);
            }
        }
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
