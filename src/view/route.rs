//! Which requests may wait on the remote (see `fs::remote`). Asking costs a table lookup and
//! no system call; the answer errs on the side of "may wait" only where the remote could
//! be asked, never where a request is local: the root, the layout directories (listed from
//! the index), container directories and anything else outside the shared objects, and
//! objects of shared ones that live in local.

use std::ffi::OsStr;

use super::{Layer, Node, View, Zone};

impl View {
    /// Whether resolving, creating or removing `name` in the directory `parent` may ask the
    /// remote: inside a shared object whose directory has a remote part; in an area, for
    /// the ids of its shared objects (their directories are opened on the remote).
    pub fn name_may_wait(&self, parent: u64, name: &OsStr) -> bool {
        let Some(dir) = self.inodes.get(parent) else {
            return false;
        };
        match dir.zone {
            Zone::Shared => names_remote(&dir),
            zone if zone.lists_shared() => self.layout.remote_visible(zone, name, &self.index()),
            _ => false,
        }
    }

    /// Whether listing the directory `dir` may ask the remote.
    pub fn entries_may_wait(&self, dir: u64) -> bool {
        self.inodes
            .get(dir)
            .is_some_and(|node| node.zone == Zone::Shared && names_remote(&node))
    }

    /// Whether a request in the directory `dir` may wait on the remote while the kernel
    /// holds the directory locked: a lookup of a name in it may ask the remote.
    pub fn dir_may_wait(&self, dir: u64) -> bool {
        let Some(node) = self.inodes.get(dir) else {
            return false;
        };
        match node.zone {
            Zone::Shared => names_remote(&node),
            zone => zone.lists_shared(),
        }
    }

    /// Whether reading the object `ino` or its attributes, or copying it up, may ask the
    /// remote: it lives there (only objects of shared objects can).
    pub fn object_may_wait(&self, ino: u64) -> bool {
        self.inodes
            .get(ino)
            .is_some_and(|node| node.zone == Zone::Shared && node.layer() == Layer::Remote)
    }
}

/// Whether a shared object's directory has entries on the remote.
fn names_remote(dir: &Node) -> bool {
    let st = dir.state();
    st.remote.is_some() || st.layer == Layer::Remote
}
