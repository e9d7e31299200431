//! The inode table: which number the kernel knows each object by, and the live nodes.
//!
//! Numbers are handed out per *identity*: a local object is identified by its device and
//! inode number, a remote one likewise in its own namespace (a remote file with more than one
//! link by its parent and name, see [`Identity::RemoteName`]), a synthesized one by its parent
//! and name. The identity map outlives the kernel's interest in a node, so an object keeps
//! its number for the life of the mount (`stat` twice, an hour apart, agrees). A copy-up
//! registers the new local identity under the number the remote one had; removing an
//! object's last link drops its identity, so a recycled inode number on disk never aliases a
//! node the kernel may still hold open.

use std::collections::HashMap;
use std::ffi::OsString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::node::Node;

/// The root's number, fixed by the FUSE protocol.
pub const ROOT_INO: u64 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    Local {
        dev: u64,
        ino: u64,
    },
    Remote {
        dev: u64,
        ino: u64,
    },
    /// One name of a remote non-directory with several links. Copy-up gives each name its
    /// own local file (overlayfs without `index` does the same), so each name must be its
    /// own node from the start: a shared node would show one name's copy through the other
    /// for as long as the kernel happens to cache it.
    RemoteName {
        parent: u64,
        name: OsString,
    },
    Virtual {
        parent: u64,
        name: OsString,
    },
}

#[derive(Debug)]
pub struct InodeTable {
    nodes: RwLock<HashMap<u64, Arc<Node>>>,
    numbers: Mutex<HashMap<Identity, u64>>,
    next: AtomicU64,
}

impl Default for InodeTable {
    fn default() -> Self {
        InodeTable {
            nodes: RwLock::new(HashMap::new()),
            numbers: Mutex::new(HashMap::new()),
            next: AtomicU64::new(ROOT_INO + 1),
        }
    }
}

impl InodeTable {
    pub fn new() -> InodeTable {
        InodeTable::default()
    }

    /// The number of an identity, handing out a new one the first time it is seen.
    pub fn number(&self, id: Identity) -> u64 {
        *self
            .numbers
            .lock()
            .entry(id)
            .or_insert_with(|| self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// The number of an identity if it has one.
    pub fn known(&self, id: &Identity) -> Option<u64> {
        self.numbers.lock().get(id).copied()
    }

    /// Gives `id` the number `ino` (the root at mount, a copied-up object's new identity).
    pub fn bind(&self, id: Identity, ino: u64) {
        self.numbers.lock().insert(id, ino);
    }

    /// Forgets an identity whose object no longer exists on disk.
    pub fn unbind(&self, id: &Identity) {
        self.numbers.lock().remove(id);
    }

    pub fn get(&self, ino: u64) -> Option<Arc<Node>> {
        self.nodes.read().get(&ino).cloned()
    }

    /// Returns the live node for `ino`, or inserts the one `make` builds, and counts one
    /// more kernel reference to it.
    pub fn hand_out(&self, ino: u64, make: impl FnOnce() -> Node) -> Arc<Node> {
        if let Some(node) = self.nodes.read().get(&ino) {
            node.state().lookups += 1;
            return node.clone();
        }
        let mut nodes = self.nodes.write();
        let node = nodes.entry(ino).or_insert_with(|| Arc::new(make()));
        node.state().lookups += 1;
        node.clone()
    }

    /// Inserts a node the kernel does not hold (the root) or replaces nothing if present.
    pub fn insert(&self, node: Arc<Node>) {
        self.nodes.write().entry(node.ino).or_insert(node);
    }

    /// Drops `count` kernel references; the node leaves the table at zero (its number stays).
    pub fn forget(&self, ino: u64, count: u64) {
        if ino == ROOT_INO {
            return;
        }
        let mut nodes = self.nodes.write();
        let gone = match nodes.get(&ino) {
            Some(node) => {
                let mut st = node.state();
                st.lookups = st.lookups.saturating_sub(count);
                st.lookups == 0
            }
            None => false,
        };
        if gone {
            nodes.remove(&ino);
        }
    }

    /// A snapshot of the live nodes (the table is not locked while the caller looks at them).
    pub fn live(&self) -> Vec<Arc<Node>> {
        self.nodes.read().values().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.nodes.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Kind;
    use crate::view::node::{Layer, NodeState};
    use crate::view::zone::Zone;

    fn file(ino: u64) -> Node {
        Node::new(ino, Kind::File, Zone::Private, NodeState::new(Layer::Local))
    }

    #[test]
    fn numbers_are_stable_per_identity_and_distinct_across_identities() {
        let t = InodeTable::new();
        let a = t.number(Identity::Local { dev: 1, ino: 10 });
        let b = t.number(Identity::Remote { dev: 1, ino: 10 });
        assert_ne!(a, b, "local and remote namespaces must not collide");
        assert_eq!(a, t.number(Identity::Local { dev: 1, ino: 10 }));
        assert!(a > ROOT_INO && b > ROOT_INO);
    }

    #[test]
    fn bind_gives_a_copied_up_object_its_old_number() {
        let t = InodeTable::new();
        let remote = t.number(Identity::Remote { dev: 2, ino: 7 });
        t.bind(Identity::Local { dev: 1, ino: 99 }, remote);
        assert_eq!(t.number(Identity::Local { dev: 1, ino: 99 }), remote);
    }

    #[test]
    fn unbind_makes_a_recycled_inode_a_new_object() {
        let t = InodeTable::new();
        let id = Identity::Local { dev: 1, ino: 5 };
        let first = t.number(id.clone());
        t.unbind(&id);
        assert_ne!(first, t.number(id));
    }

    #[test]
    fn lookups_are_counted_and_forget_removes_at_zero() {
        let t = InodeTable::new();
        let n = t.hand_out(7, || file(7));
        let again = t.hand_out(7, || panic!("must reuse the live node"));
        assert!(Arc::ptr_eq(&n, &again));
        t.forget(7, 1);
        assert!(t.get(7).is_some());
        t.forget(7, 1);
        assert!(t.get(7).is_none());
        // Forgetting more than was handed out, or an unknown node, is harmless.
        t.forget(7, 3);
        t.forget(12345, 1);
    }

    #[test]
    fn the_root_is_never_forgotten() {
        let t = InodeTable::new();
        t.insert(Arc::new(file(ROOT_INO)));
        t.forget(ROOT_INO, 100);
        assert!(t.get(ROOT_INO).is_some());
    }
}
