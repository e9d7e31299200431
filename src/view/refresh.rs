//! What a refresh round needs from the view besides swapping its index: which numbers the
//! kernel knows the layout's directories and the objects in them by, re-opening the remote
//! directories under those nodes when the remote was replaced, and keeping requests away
//! from a remote that does not answer.
//!
//! Nothing here creates a node or hands out a number: a refresh only looks at what the
//! kernel already holds, because only that can be stale in its caches.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::inodes::ROOT_INO;
use super::{marker, open_root, Node, View, Zone};
use crate::store::{self, cname};

/// The layout directories a refresh can change the entries of, parents before children.
pub const LAYOUT_DIRS: [Zone; 6] = [
    Zone::DriverHome,
    Zone::LayersHome,
    Zone::Images,
    Zone::DriverRo,
    Zone::Links,
    Zone::LayersRo,
];

/// A live node, as found under a given parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveChild {
    pub parent: u64,
    pub name: OsString,
    pub ino: u64,
}

impl View {
    /// Notes the number of a layout directory when it is handed out.
    pub(super) fn remember_skeleton(&self, node: &Node) {
        if !LAYOUT_DIRS.contains(&node.zone) || !node.is_dir() {
            return;
        }
        let mut skeleton = self.skeleton.lock();
        let inos = skeleton.entry(node.zone).or_default();
        if !inos.contains(&node.ino) {
            inos.push(node.ino);
        }
    }

    /// The numbers the layout directory `zone` was handed out under (normally one; more if
    /// it was replaced, e.g. a local directory created where a synthesized one stood).
    pub fn layout_dir_inos(&self, zone: Zone) -> Vec<u64> {
        if zone == Zone::Root {
            return vec![ROOT_INO];
        }
        self.skeleton.lock().get(&zone).cloned().unwrap_or_default()
    }

    /// Whether requests in a directory of `zone` may ask the remote. Inside a shared object
    /// and in the areas listing them (`RO/`, `<driver>-images/`) they always do: the last
    /// good view stays in place while the remote does not answer, and these entries are the
    /// only way into content that exists nowhere else. Above them (the root and the driver
    /// homes, whose entries the layout gives anyway) only while the remote answers, so that
    /// listing them does not wait on a stalled remote.
    pub fn remote_reachable(&self, zone: Zone) -> bool {
        matches!(
            zone,
            Zone::Shared | Zone::DriverRo | Zone::LayersRo | Zone::Images
        ) || self.remote_available.load(Ordering::Relaxed)
    }

    /// Marks the remote as answering or not (set by refresh rounds).
    pub fn set_remote_available(&self, available: bool) {
        self.remote_available.store(available, Ordering::Relaxed);
    }

    /// The live nodes reachable by a name in one of `parents`, in one pass over the table.
    pub fn live_children(&self, parents: &HashSet<u64>) -> Vec<LiveChild> {
        let mut out = Vec::new();
        if parents.is_empty() {
            return out;
        }
        for node in self.inodes.live() {
            let st = node.state();
            for (parent, name) in &st.aliases {
                if parents.contains(&parent.ino) {
                    out.push(LiveChild {
                        parent: parent.ino,
                        name: name.clone(),
                        ino: node.ino,
                    });
                }
            }
        }
        out
    }

    /// Forgets the number of the synthesized entry `name` of `parent`, so that the next
    /// lookup makes a new node: a symlink whose target changed must not keep the number
    /// (and so the target) the kernel cached for the old one.
    pub fn unbind_virtual(&self, parent: u64, name: &OsStr) {
        self.inodes.unbind_virtual(parent, &name.to_owned());
    }

    /// Re-opens the remote directory of every live layout directory whose remote changed
    /// identity: a remote area created after the directory was first looked up (a writer
    /// that pulled its first image after this host mounted), deleted and re-created, or a
    /// remote root replaced under the same path (an NFS remount). Returns how many nodes
    /// were re-anchored.
    pub fn reanchor_remote(&self, remote_root: &Path) -> usize {
        let mut changed = 0;
        if let (Some(root), Ok(fd)) = (self.inodes.get(ROOT_INO), open_root(remote_root)) {
            let dev = store::stat_fd(fd.as_fd()).map(|st| st.st_dev);
            if replace_remote(&root, Some(fd)) {
                if let Ok(dev) = dev {
                    self.inodes.set_remote_dev(dev);
                }
                tracing::warn!(remote = %remote_root.display(), "remote root replaced: re-opened");
                changed += 1;
            }
        }
        for zone in LAYOUT_DIRS {
            if !zone.merges_remote() {
                continue;
            }
            for ino in self.layout_dir_inos(zone) {
                let Some(node) = self.inodes.get(ino) else {
                    continue;
                };
                let Some((parent, name)) = node.primary() else {
                    continue;
                };
                let local = node.state().local.clone();
                if local
                    .as_deref()
                    .is_some_and(|l| marker::is_opaque(l.as_fd()))
                {
                    continue;
                }
                let fresh = match (parent.dir_fds().remote, cname(&name)) {
                    (Some(remote), Ok(c)) => store::open_dir_at(remote.as_fd(), &c).ok(),
                    _ => None,
                };
                if replace_remote(&node, fresh) {
                    changed += 1;
                }
            }
        }
        changed
    }
}

/// Installs `fresh` as the remote handle of a directory node unless it names the directory
/// the node already has. Returns whether anything changed.
fn replace_remote(node: &Arc<Node>, fresh: Option<std::os::fd::OwnedFd>) -> bool {
    let identity = |fd: &std::os::fd::OwnedFd| {
        store::stat_fd(fd.as_fd())
            .ok()
            .map(|st| (st.st_dev, st.st_ino))
    };
    let current = node.state().remote.clone();
    let same = match (&current, &fresh) {
        (None, None) => true,
        (Some(a), Some(b)) => identity(a).is_some() && identity(a) == identity(b),
        _ => false,
    };
    if same {
        return false;
    }
    node.state().remote = fresh.map(Arc::new);
    true
}
