//! What a refresh round needs from the view besides swapping its index: which numbers the
//! kernel knows the layout's directories and the objects in them by, and re-opening the
//! remote when it was replaced.
//!
//! Nothing here creates a node or hands out a number: a refresh only looks at what the
//! kernel already holds, because only that can be stale in its caches.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::identity::ROOT_INO;
use super::{Node, View, Zone};

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

    /// The remote root was replaced (deleted and written again, or another filesystem
    /// mounted on its path): from now on the shared areas are opened from `fresh`. Every
    /// live node of a shared object loses its identities, so the next lookup of its name
    /// makes a new node over the new tree. Returns the names the kernel must drop: those of
    /// the shared objects' directories in their areas (dropping a directory's name drops
    /// everything the kernel cached below it).
    pub fn replace_remote(&self, fresh: OwnedFd, dev: u64) -> Vec<(u64, OsString)> {
        self.inodes.set_remote_dev(dev);
        *self.remote_root.write() = Arc::new(fresh);
        let mut names = Vec::new();
        for node in self.inodes.live() {
            if node.zone != Zone::Shared {
                continue;
            }
            let aliases = node.state().aliases.clone();
            for (parent, name) in aliases {
                if parent.zone.lists_shared() {
                    self.inodes.unbind_virtual(parent.ino, &name);
                    names.push((parent.ino, name));
                }
            }
            self.inodes.detach(&node);
        }
        names
    }
}
