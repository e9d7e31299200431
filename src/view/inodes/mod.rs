//! The inode table: the nodes the kernel holds, by number and by identity.
//!
//! ## Identity
//! A node stands for one object: a local or remote file or directory, or a synthesized
//! entry. While the kernel holds a node, the node holds its object open (an `O_PATH` handle,
//! see [`Node`]), and a filesystem never gives the inode number of an object that is still
//! open to another one. So, for as long as a node is in this table, its identities (device
//! and inode number in local or remote) name exactly its object: a new object can never be
//! mistaken for it, however fast the local filesystem recycles numbers. When the kernel
//! forgets a node (its FORGETs bring the count of lookups to zero), the node leaves the
//! table with its identities and its handles close, so the table holds what the kernel holds
//! and no more: creating and deleting a million files leaves it as it was.
//!
//! ## Numbers
//! A node's number is the FUSE node id and also the `st_ino` the view reports. It is derived
//! from the object, so that it is stable for the life of the mount without remembering every
//! object ever seen:
//! - an object on local's filesystem: its inode number there;
//! - an object on the remote's filesystem: its inode number with [`REMOTE_BIT`] set. A merged
//!   directory is numbered after its remote part, so its copy-up changes nothing;
//! - an object in the btrfs subvolume of a quota root: [`SUBVOLUME_BIT`], the subvolume's
//!   id and its inode number there;
//! - synthesized entries and the names of remote files with several links: a number from a
//!   counter (with [`COUNTER_BIT`] set), remembered per parent and name for the life of the
//!   mount (the layout and the remote tree bound how many there are);
//! - anything else (objects on other filesystems, a derived number already in use by a live
//!   node): a counter number, for as long as the node lives.
//!
//! A copied-up file keeps the number of its remote original for the life of the mount: the
//! table remembers the number of every local copy until that copy is deleted (local holds
//! no record of it, so after a remount the copy is numbered after its own inode).
//!
//! A number is never given to a second object while the kernel may still know the first by
//! it: a derived number is taken only when no live node has it, and a live node keeps its
//! number (a copied-up file keeps the remote one until the kernel forgets it).
//!
//! ## Locks
//! One `RwLock` covers both maps and is held only for map operations, never across a
//! system call: nodes are built outside it and inserted if absent (the loser of a race drops
//! its copy), and a forgotten node is dropped, closing its handles, after the lock is
//! released. Node state locks (see [`Node::state`]) may be taken while holding it; the table
//! is never locked while holding a node's state.

use std::collections::HashMap;
use std::ffi::OsString;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::identity::{
    is_local_number, Identity, COUNTER_BIT, REMOTE_BIT, ROOT_INO, SUBVOLUME_BIT, SUBVOLUME_INO_BITS,
};
use super::keep::{Fact, Journal};
use super::node::{Node, NodeState};
use super::zone::Zone;
use crate::store::Kind;

/// A live node and how many times the kernel was handed it without forgetting it yet.
#[derive(Debug)]
struct Slot {
    node: Arc<Node>,
    /// Changed under the read lock when the node is handed out again, under the write
    /// lock when forgotten: a node cannot leave while it is being handed out.
    lookups: AtomicU64,
    /// When it was last handed out, in hand-outs since the mount (see
    /// [`InodeTable::least_recent`]).
    used: AtomicU64,
}

#[derive(Debug, Default)]
struct Maps {
    nodes: HashMap<u64, Slot>,
    by_identity: HashMap<Identity, u64>,
    /// How many of `nodes` are directories (see [`Maps::held`]).
    dirs: usize,
}

impl Maps {
    /// The most descriptors the nodes can hold: one each, two for a directory (its local
    /// and its remote part).
    fn held(&self) -> usize {
        self.nodes.len() + self.dirs
    }
}

/// What a new node is made of, built before the table is locked.
pub struct NewNode {
    pub kind: Kind,
    pub zone: Zone,
    pub state: NodeState,
    /// Its identities; the first one decides its number.
    pub identities: Vec<Identity>,
    /// Its generation, should it be numbered after its local inode (see [`super::exports`]).
    pub generation: u32,
}

/// Who is told when the table's nodes may hold more than `high` descriptors (see
/// [`InodeTable::watch`]).
#[derive(Debug)]
struct Watcher {
    high: usize,
    low: usize,
    tell: crossbeam_channel::Sender<()>,
}

#[derive(Debug)]
pub struct InodeTable {
    maps: RwLock<Maps>,
    /// Numbers of entries known by parent and name, kept across the kernel forgetting them.
    named_numbers: Mutex<HashMap<(u64, OsString), u64>>,
    /// Numbers of copied-up objects in local, by device and inode, until deleted.
    origins: Mutex<HashMap<(u64, u64), u64>>,
    next: AtomicU64,
    /// Hand-outs so far: the clock of [`Slot::used`].
    ticks: AtomicU64,
    /// Told when the table grows past a number of nodes (see [`InodeTable::watch`]).
    watcher: std::sync::OnceLock<Watcher>,
    /// Whether the table has grown past the watcher's high mark, or a call ran short of
    /// descriptors, and it has not yet shrunk to the low one (see [`InodeTable::crowded`]);
    /// changed only under the maps' write lock.
    crowded: AtomicBool,
    /// The filesystems whose inode numbers become node numbers.
    local_dev: u64,
    remote_dev: AtomicU64,
    /// Where the numbering's facts are kept for a daemon that resumes (see [`super::keep`]).
    journal: std::sync::OnceLock<Arc<dyn Journal>>,
    /// Counter numbers below this are reserved in the journal.
    reserved: AtomicU64,
    /// The btrfs subvolumes of quota roots, by device: id (see [`SUBVOLUME_BIT`]).
    subvolumes: RwLock<HashMap<u64, u64>>,
    /// Where an earlier daemon placed the nodes it numbered after the remote or from the
    /// counter: parent and name, by number. Filled only by [`InodeTable::restore`].
    placed: Mutex<HashMap<u64, (u64, OsString)>>,
}

/// Counter numbers reserved in the journal at a time.
const RESERVE: u64 = 4096;

impl InodeTable {
    /// A table holding only the root node, whose identities are `root_ids`.
    pub fn new(root: Node, root_ids: Vec<Identity>, local_dev: u64, remote_dev: u64) -> Self {
        let mut maps = Maps::default();
        for id in root_ids {
            maps.by_identity.insert(id, ROOT_INO);
        }
        let root = Arc::new(root);
        root.state().identities = maps.by_identity.keys().cloned().collect();
        maps.nodes.insert(
            ROOT_INO,
            Slot {
                node: root,
                lookups: AtomicU64::new(1),
                used: AtomicU64::new(0),
            },
        );
        maps.dirs = 1;
        InodeTable {
            maps: RwLock::new(maps),
            named_numbers: Mutex::new(HashMap::new()),
            origins: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            ticks: AtomicU64::new(0),
            watcher: std::sync::OnceLock::new(),
            crowded: AtomicBool::new(false),
            local_dev,
            remote_dev: AtomicU64::new(remote_dev),
            journal: std::sync::OnceLock::new(),
            reserved: AtomicU64::new(0),
            placed: Mutex::new(HashMap::new()),
            subvolumes: RwLock::new(HashMap::new()),
        }
    }

    /// Keeps the numbering's facts in `journal` from now on, starting with what it already
    /// holds: the numbers given before the session may reach the kernel later.
    pub fn keep_in(&self, journal: Arc<dyn Journal>) {
        if self.journal.set(journal).is_err() {
            return;
        }
        let named: Vec<Fact> = self
            .named_numbers
            .lock()
            .iter()
            .map(|((parent, name), number)| Fact::Named {
                parent: *parent,
                name: name.clone(),
                number: *number,
            })
            .collect();
        let origins: Vec<Fact> = self
            .origins
            .lock()
            .iter()
            .map(|((dev, ino), number)| Fact::Origin {
                dev: *dev,
                ino: *ino,
                number: *number,
            })
            .collect();
        for fact in named.iter().chain(&origins) {
            self.note(fact);
        }
        self.reserve(self.next.load(Ordering::Relaxed));
    }

    /// Takes back the numbering an earlier daemon kept, fact by fact in the order it
    /// wrote them (see [`super::keep`]).
    pub fn restore(&self, facts: impl IntoIterator<Item = Fact>) {
        let (mut named, mut origins, mut placed) = (
            self.named_numbers.lock(),
            self.origins.lock(),
            self.placed.lock(),
        );
        for fact in facts {
            match fact {
                Fact::Named {
                    parent,
                    name,
                    number,
                } => {
                    named.insert((parent, name), number);
                }
                Fact::Unnamed { parent, name } => {
                    named.remove(&(parent, name));
                }
                Fact::Origin { dev, ino, number } => {
                    origins.insert((dev, ino), number);
                }
                Fact::OriginGone { dev, ino } => {
                    origins.remove(&(dev, ino));
                }
                Fact::Reserved { upto } => {
                    self.next.fetch_max(upto, Ordering::Relaxed);
                    self.reserved.fetch_max(upto, Ordering::Relaxed);
                }
                Fact::Placed {
                    number,
                    parent,
                    name,
                } => {
                    placed.insert(number, (parent, name));
                }
            }
        }
    }

    fn note(&self, fact: &Fact) {
        if let Some(journal) = self.journal.get() {
            journal.append(&fact.encode());
        }
    }

    /// Reserves counter numbers past `n` in the journal, a block at a time.
    fn reserve(&self, n: u64) {
        let upto = n + RESERVE;
        if self.reserved.fetch_max(upto, Ordering::Relaxed) < upto {
            self.note(&Fact::Reserved { upto });
        }
    }

    pub fn get(&self, ino: u64) -> Option<Arc<Node>> {
        self.maps.read().nodes.get(&ino).map(|s| s.node.clone())
    }

    /// The live node of an identity, counted as handed to the kernel once more.
    pub fn hand_out_known(&self, id: &Identity) -> Option<Arc<Node>> {
        let maps = self.maps.read();
        let slot = maps.nodes.get(maps.by_identity.get(id)?)?;
        slot.lookups.fetch_add(1, Ordering::Relaxed);
        slot.used.store(self.tick(), Ordering::Relaxed);
        Some(slot.node.clone())
    }

    /// Hands out the live node of any of `new`'s identities, or makes `new` a node, and
    /// counts one more kernel reference to it. A node built by a request that lost a race
    /// is dropped (after the lock is released).
    pub fn hand_out(&self, new: NewNode) -> Arc<Node> {
        let mut maps = self.maps.write();
        let existing = new
            .identities
            .iter()
            .find_map(|id| maps.by_identity.get(id).copied());
        if let Some(slot) = existing.and_then(|ino| maps.nodes.get(&ino)) {
            slot.lookups.fetch_add(1, Ordering::Relaxed);
            slot.used.store(self.tick(), Ordering::Relaxed);
            let node = slot.node.clone();
            drop(maps);
            return node;
        }
        let ino = self.choose_number(&maps, &new.identities);
        let mut state = new.state;
        state.identities = new.identities.clone();
        let mut node = Node::new(ino, new.kind, new.zone, state);
        // Other numbers are never given to another object: generation 0 tells nothing apart.
        if is_local_number(ino) {
            node.generation = new.generation;
        }
        let node = Arc::new(node);
        for id in new.identities {
            maps.by_identity.insert(id, ino);
        }
        maps.nodes.insert(
            ino,
            Slot {
                node: node.clone(),
                lookups: AtomicU64::new(1),
                used: AtomicU64::new(self.tick()),
            },
        );
        maps.dirs += usize::from(node.is_dir());
        if let Some(Watcher { high, tell, .. }) = self.watcher.get() {
            if maps.held() > *high {
                self.crowded.store(true, Ordering::Relaxed);
                let _ = tell.try_send(());
            }
        }
        node
    }

    /// Notes where a node was placed, for a daemon that resumes: its number is then found
    /// again by looking `name` up in `parent`. Numbers derived from local inodes need not
    /// be: `exports` finds their objects again.
    pub fn placed(&self, node: &Node, parent: u64, name: &std::ffi::OsStr) {
        if is_local_number(node.ino) {
            return;
        }
        if let Some(journal) = self.journal.get() {
            journal.append(&Fact::placed_record(node.ino, parent, name));
        }
    }

    /// Has `tell` told (without waiting) whenever a node is added while the nodes may hold
    /// more than `high` descriptors ([`InodeTable::held`]); the table is crowded from then
    /// until they may hold no more than `low`.
    pub fn watch(&self, high: usize, low: usize, tell: crossbeam_channel::Sender<()>) {
        let _ = self.watcher.set(Watcher { high, low, tell });
    }

    /// Marks the table crowded and has its watcher told: a call found no descriptor free.
    /// Nodes are not the only holders (open files hold one more each), so the descriptors
    /// can run out below the high mark; until the table is down to the low one, trimming
    /// then goes on even below the high mark.
    pub fn run_short(&self) {
        if let Some(Watcher { tell, .. }) = self.watcher.get() {
            // A waiting call runs short every few ms: the write lock only when it changes.
            if !self.crowded() {
                let _maps = self.maps.write();
                self.crowded.store(true, Ordering::Relaxed);
            }
            let _ = tell.try_send(());
        }
    }

    /// Whether the table grew past the high mark it is watched for and is not yet down to
    /// the low one: trimming is under way (see `fs::trim`), and a call may find no
    /// descriptor free until the kernel has forgotten the nodes trimming drops.
    pub fn crowded(&self) -> bool {
        self.crowded.load(Ordering::Relaxed)
    }

    /// Drops `count` kernel references; at zero the node leaves the table with its
    /// identities, and its handles close once nothing else uses it.
    pub fn forget(&self, ino: u64, count: u64) {
        if ino == ROOT_INO {
            return;
        }
        let gone = {
            let mut maps = self.maps.write();
            let done = match maps.nodes.get(&ino) {
                Some(slot) => {
                    let left = slot.lookups.load(Ordering::Relaxed).saturating_sub(count);
                    slot.lookups.store(left, Ordering::Relaxed);
                    left == 0
                }
                None => false,
            };
            if !done {
                return;
            }
            let Some(slot) = maps.nodes.remove(&ino) else {
                return;
            };
            maps.dirs -= usize::from(slot.node.is_dir());
            if let Some(Watcher { low, .. }) = self.watcher.get() {
                if maps.held() <= *low {
                    self.crowded.store(false, Ordering::Relaxed);
                }
            }
            let ids = std::mem::take(&mut slot.node.state().identities);
            for id in ids {
                if maps.by_identity.get(&id) == Some(&ino) {
                    maps.by_identity.remove(&id);
                }
            }
            slot.node
        };
        // Outside the lock: the last reference closes the node's handles.
        drop(gone);
    }

    /// Adds an identity to a live node (a copy-up's local object). Any other node the
    /// identity named loses it.
    pub fn add_identity(&self, node: &Node, id: Identity) {
        let mut maps = self.maps.write();
        if !maps.nodes.contains_key(&node.ino) {
            return;
        }
        maps.by_identity.insert(id.clone(), node.ino);
        let mut state = node.state();
        if !state.identities.contains(&id) {
            state.identities.push(id);
        }
    }

    /// Takes an identity away from a node: its object no longer shows under it (a copied-up
    /// file's remote object), or the next lookup must make a new node (see
    /// [`InodeTable::detach`]).
    pub fn remove_identity(&self, node: &Node, id: &Identity) {
        let mut maps = self.maps.write();
        if maps.by_identity.get(id) == Some(&node.ino) {
            maps.by_identity.remove(id);
        }
        node.state().identities.retain(|i| i != id);
    }

    /// Takes every identity away from a live node: the kernel keeps it for what it has open,
    /// and the next lookup of its object makes a new node under another number.
    pub fn detach(&self, node: &Node) {
        let mut maps = self.maps.write();
        let ids = std::mem::take(&mut node.state().identities);
        for id in ids {
            if maps.by_identity.get(&id) == Some(&node.ino) {
                maps.by_identity.remove(&id);
            }
        }
    }

    /// Remembers that the local object `(dev, ino)` is a copy numbered `number`.
    pub fn set_origin(&self, dev: u64, ino: u64, number: u64) {
        self.origins.lock().insert((dev, ino), number);
        self.note(&Fact::Origin { dev, ino, number });
    }

    /// The local object `(dev, ino)` is gone: its inode number may name a new object.
    pub fn forget_origin(&self, dev: u64, ino: u64) {
        if self.origins.lock().remove(&(dev, ino)).is_some() {
            self.note(&Fact::OriginGone { dev, ino });
        }
    }

    /// The number of an entry known by parent and name: the same for the life of the
    /// mount, unless [`InodeTable::unbind_virtual`] drops it.
    pub fn named_number(&self, parent: u64, name: &OsString) -> u64 {
        let (number, new) = {
            let mut named = self.named_numbers.lock();
            match named.get(&(parent, name.clone())) {
                Some(number) => (*number, false),
                None => {
                    let number = self.counter();
                    named.insert((parent, name.clone()), number);
                    (number, true)
                }
            }
        };
        if new {
            self.note(&Fact::Named {
                parent,
                name: name.clone(),
                number,
            });
        }
        number
    }

    /// Forgets a synthesized entry's number and detaches its live node, so that the next
    /// lookup makes a new node (a symlink whose target changed must not keep the number,
    /// and so the target, the kernel cached for the old one).
    pub fn unbind_virtual(&self, parent: u64, name: &OsString) {
        if self
            .named_numbers
            .lock()
            .remove(&(parent, name.clone()))
            .is_some()
        {
            self.note(&Fact::Unnamed {
                parent,
                name: name.clone(),
            });
        }
        let id = Identity::Virtual {
            parent,
            name: name.clone(),
        };
        let live = {
            let maps = self.maps.read();
            maps.by_identity
                .get(&id)
                .and_then(|ino| maps.nodes.get(ino))
                .map(|s| s.node.clone())
        };
        if let Some(node) = live {
            self.remove_identity(&node, &id);
        }
    }

    /// The number a directory listing shows for an entry: its live node's, or the one a
    /// lookup would derive. Nothing is added to the table.
    pub fn listed_number(&self, id: &Identity) -> u64 {
        if let Some(ino) = self.maps.read().by_identity.get(id) {
            return *ino;
        }
        match id {
            Identity::Virtual { parent, name } => self.named_number(*parent, name),
            Identity::RemoteName { parent, name } => self
                .named_numbers
                .lock()
                .get(&(*parent, name.clone()))
                .copied()
                .unwrap_or(0),
            other => self.derived(other).unwrap_or(0),
        }
    }

    /// Objects on `dev`, the btrfs subvolume `id` inside local, are numbered after their
    /// subvolume and inode from now on.
    pub fn add_subvolume(&self, dev: u64, id: u64) {
        self.subvolumes.write().insert(dev, id);
    }

    /// Whether `dev` is local's filesystem, whose inode numbers become node numbers.
    pub fn is_local(&self, dev: u64) -> bool {
        dev == self.local_dev
    }

    /// The live node numbered `ino`, counted as handed to the kernel once more.
    pub fn hand_out_number(&self, ino: u64) -> Option<Arc<Node>> {
        let maps = self.maps.read();
        let slot = maps.nodes.get(&ino)?;
        slot.lookups.fetch_add(1, Ordering::Relaxed);
        slot.used.store(self.tick(), Ordering::Relaxed);
        Some(slot.node.clone())
    }

    /// The parent and name a number was given for, kept across the kernel forgetting it
    /// (synthesized entries, names of remote files with several links). A search: only for
    /// a handle of a forgotten node.
    pub fn named_as(&self, ino: u64) -> Option<(u64, OsString)> {
        let named = self
            .named_numbers
            .lock()
            .iter()
            .find(|(_, n)| **n == ino)
            .map(|((parent, name), _)| (*parent, name.clone()));
        named.or_else(|| self.placed.lock().get(&ino).cloned())
    }

    /// The number of an identity's live node.
    pub fn live_number(&self, id: &Identity) -> Option<u64> {
        self.maps.read().by_identity.get(id).copied()
    }

    /// The remote's filesystem changed (the remote was replaced or remounted).
    pub fn set_remote_dev(&self, dev: u64) {
        self.remote_dev.store(dev, Ordering::Relaxed);
    }

    /// A snapshot of the live nodes (the table is not locked while the caller looks at them).
    pub fn live(&self) -> Vec<Arc<Node>> {
        self.maps
            .read()
            .nodes
            .values()
            .map(|s| s.node.clone())
            .collect()
    }

    /// The `count` live nodes handed out longest ago (never the root), directories or not
    /// as `dirs` says.
    pub fn least_recent(&self, count: usize, dirs: bool) -> Vec<Arc<Node>> {
        let mut all: Vec<(u64, Arc<Node>)> = {
            let maps = self.maps.read();
            maps.nodes
                .values()
                .filter(|s| s.node.ino != ROOT_INO && s.node.is_dir() == dirs)
                .map(|s| (s.used.load(Ordering::Relaxed), s.node.clone()))
                .collect()
        };
        if count < all.len() {
            all.select_nth_unstable_by_key(count, |(used, _)| *used);
            all.truncate(count);
        }
        all.into_iter().map(|(_, node)| node).collect()
    }

    pub fn len(&self) -> usize {
        self.maps.read().nodes.len()
    }

    /// The most descriptors the nodes can hold (see `Maps::held`): what trimming watches.
    pub fn held(&self) -> usize {
        self.maps.read().held()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many identities the table maps (tests and metrics: it must follow `len`).
    pub fn identities(&self) -> usize {
        self.maps.read().by_identity.len()
    }

    fn choose_number(&self, maps: &Maps, ids: &[Identity]) -> u64 {
        let derived = match ids.first() {
            Some(Identity::Virtual { parent, name } | Identity::RemoteName { parent, name }) => {
                Some(self.named_number(*parent, name))
            }
            Some(id) => self.derived(id),
            None => None,
        };
        match derived {
            Some(n) if !maps.nodes.contains_key(&n) => n,
            _ => self.counter(),
        }
    }

    /// The number an identity derives, if its filesystem's numbers fit.
    fn derived(&self, id: &Identity) -> Option<u64> {
        if let Identity::Local { dev, ino } = *id {
            if let Some(number) = self.origins.lock().get(&(dev, ino)) {
                return Some(*number);
            }
        }
        match *id {
            Identity::Local { dev, ino } if dev == self.local_dev => {
                (ino > ROOT_INO && ino < SUBVOLUME_BIT).then_some(ino)
            }
            Identity::Local { dev, ino } => {
                let id = *self.subvolumes.read().get(&dev)?;
                let fits = id < 1 << (61 - SUBVOLUME_INO_BITS) && ino < 1 << SUBVOLUME_INO_BITS;
                fits.then_some(SUBVOLUME_BIT | id << SUBVOLUME_INO_BITS | ino)
            }
            Identity::Remote { dev, ino } if dev == self.remote_dev.load(Ordering::Relaxed) => {
                (ino < REMOTE_BIT).then_some(ino | REMOTE_BIT)
            }
            _ => None,
        }
    }

    fn tick(&self) -> u64 {
        self.ticks.fetch_add(1, Ordering::Relaxed)
    }

    fn counter(&self) -> u64 {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        if n >= self.reserved.load(Ordering::Relaxed) {
            self.reserve(n);
        }
        COUNTER_BIT | n
    }
}

#[cfg(test)]
mod tests;
