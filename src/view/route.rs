//! Which requests may wait on the remote (see `fs::remote`). Asking costs a table lookup and
//! no system call; the answer errs on the side of "may wait" only where the remote could
//! be asked, never where a request is local: the root, the layout directories (listed from
//! the index), container directories and anything else outside the shared objects, and
//! objects of shared ones that live in local.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Layer, Node, View, Zone};

/// Directories the kernel holds locked for a request that may wait though they do not
/// themselves ask the remote: the directory a remote file is linked into (the link copies
/// the file up), the local side of a rename to or from a shared directory, the directory of
/// a request waiting for descriptors (see `fs::trim`). Names there wait as long as that
/// request, as in a directory that asks the remote. Counts by directory number; a leaf lock.
#[derive(Debug, Default)]
pub struct HeldDirs(Mutex<HashMap<u64, usize>>);

/// Keeps directories marked held ([`View::held_for`]) until dropped.
#[must_use]
pub struct Held {
    view: Arc<View>,
    dirs: Vec<u64>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self.view.held.0.lock();
        for dir in &self.dirs {
            if let Some(n) = held.get_mut(dir) {
                *n -= 1;
                if *n == 0 {
                    held.remove(dir);
                }
            }
        }
    }
}

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
    /// holds the directory locked: a lookup of a name in it may ask the remote, or a request
    /// holding it waits on the remote elsewhere (see [`HeldDirs`]).
    pub fn dir_may_wait(&self, dir: u64) -> bool {
        let Some(node) = self.inodes.get(dir) else {
            return false;
        };
        let asks = match node.zone {
            Zone::Shared => names_remote(&node),
            zone => zone.lists_shared(),
        };
        asks || self.held.0.lock().contains_key(&dir)
    }

    /// Marks `dirs` as held by a request that may wait (see [`HeldDirs`]),
    /// from before it is queued until the returned guard drops.
    pub fn held_for(self: &Arc<Self>, dirs: &[u64]) -> Held {
        let mut held = self.held.0.lock();
        for dir in dirs {
            *held.entry(*dir).or_default() += 1;
        }
        Held {
            view: self.clone(),
            dirs: dirs.to_vec(),
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
