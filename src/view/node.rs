//! One object of the view, as the kernel knows it by its inode number.
//!
//! A node holds its object open: directories by their local and remote `O_PATH` handles,
//! everything else by one `O_PATH` handle of the object in its layer. Every operation on the
//! object goes through that handle, never through a name that could meanwhile name another
//! object; and an open object's inode number cannot be recycled by its filesystem, which is
//! what makes identities safe (see [`super::inodes`]).

use std::cell::{Cell, RefCell};
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use nix::errno::Errno;
use parking_lot::{Mutex, MutexGuard};

use super::identity::{Identity, ROOT_INO};
use super::zone::Zone;
use crate::quota::{Object, Opens, Tally};
use crate::store::{self, Kind};

/// Where an object's own data and attributes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    /// In local (possibly over a remote directory it merges with).
    Local,
    /// Only in remote: read-only until copied up.
    Remote,
    /// Synthesized by the view: nothing on disk.
    Virtual,
}

/// A node of the view. Its number, type and zone never change; where it lives does (a
/// copy-up moves it from remote to local).
#[derive(Debug)]
pub struct Node {
    pub ino: u64,
    /// The generation the kernel is told with the number (see `exports`): fixed for the
    /// node's life.
    pub generation: u32,
    pub kind: Kind,
    pub zone: Zone,
    state: Mutex<NodeState>,
    /// Serializes copy-ups of this node (other requests go on meanwhile).
    copying: Mutex<()>,
    /// Serializes the quota measurements of this file (see [`Object::measuring`]).
    measuring: Mutex<()>,
}

#[derive(Debug)]
pub struct NodeState {
    /// The names this node is reachable by: one for directories, more for hard links. The
    /// first is the one used to reach the object on disk.
    pub aliases: Vec<(Arc<Node>, OsString)>,
    pub layer: Layer,
    /// Non-directories: `O_PATH` handle of the object in its layer (none if synthesized).
    pub object: Option<Arc<OwnedFd>>,
    /// Directories: `O_PATH` handle of the local directory, once there is one.
    pub local: Option<Arc<OwnedFd>>,
    /// Directories: `O_PATH` handle of the remote directory whose entries show through
    /// (none for opaque directories and outside the shared areas).
    pub remote: Option<Arc<OwnedFd>>,
    /// Virtual symlinks: the target.
    pub link: Option<Arc<[u8]>>,
    /// The identities the inode table knows this node by (see [`super::inodes`]).
    pub identities: Vec<Identity>,
    /// Known to carry no `security.capability` attribute (see `attrs`).
    pub no_capability: bool,
    /// What the quota accounting keeps on this node (see [`Object::tally`]).
    pub quota: Tally,
    /// How many opens of this file are live.
    pub open_files: u32,
    /// How many of them do their I/O straight on local (FUSE passthrough), unseen by a
    /// quota (a shared writable mmap of a read-only open still allocates).
    pub passthrough_opens: u32,
    /// How many passthrough opens may write: through a shared mapping, unseen by the
    /// daemon, so the kernel must not cache the attributes while there are any.
    pub mapped_writers: u32,
    /// How many opens that may write were made of this file while it was remote: its copy-up
    /// waits for their first change, and needs its name (see `View::open`).
    pub writers_before_copy_up: u32,
}

impl Node {
    pub fn new(ino: u64, kind: Kind, zone: Zone, state: NodeState) -> Node {
        Node {
            ino,
            generation: 0,
            kind,
            zone,
            state: Mutex::new(state),
            copying: Mutex::new(()),
            measuring: Mutex::new(()),
        }
    }

    pub fn copy_lock(&self) -> MutexGuard<'_, ()> {
        self.copying.lock()
    }

    pub fn state(&self) -> MutexGuard<'_, NodeState> {
        self.state.lock()
    }

    pub fn is_dir(&self) -> bool {
        self.kind == Kind::Dir
    }

    /// The parent and name through which the object is reached on disk.
    pub fn primary(&self) -> Option<(Arc<Node>, OsString)> {
        self.state.lock().aliases.first().cloned()
    }

    pub fn layer(&self) -> Layer {
        self.state.lock().layer
    }

    /// The `O_PATH` handle of the object itself, wherever it lives (none if synthesized).
    pub fn object(&self) -> Option<Arc<OwnedFd>> {
        self.placed().1
    }

    /// Where the object lives and its handle, read together (a copy-up changes both).
    pub fn placed(&self) -> (Layer, Option<Arc<OwnedFd>>) {
        let st = self.state.lock();
        let object = if self.kind != Kind::Dir {
            st.object.clone()
        } else {
            match st.layer {
                Layer::Local => st.local.clone(),
                Layer::Remote => st.remote.clone(),
                Layer::Virtual => None,
            }
        };
        (st.layer, object)
    }

    pub fn dir_fds(&self) -> DirFds {
        let st = self.state.lock();
        DirFds {
            local: st.local.clone(),
            remote: st.remote.clone(),
        }
    }
}

impl Object for Node {
    fn parent(&self) -> Option<Arc<Node>> {
        self.primary().map(|(parent, _)| parent)
    }

    fn path(&self) -> Option<PathBuf> {
        let mut names = Vec::new();
        let mut at = self.primary();
        while let Some((parent, name)) = at {
            names.push(name);
            if parent.ino == ROOT_INO {
                return Some(names.iter().rev().collect());
            }
            at = parent.primary();
        }
        (self.ino == ROOT_INO).then(PathBuf::new)
    }

    fn is_dir(&self) -> bool {
        self.kind == Kind::Dir
    }

    fn local_dir(&self) -> Option<Arc<OwnedFd>> {
        if self.kind != Kind::Dir {
            return None;
        }
        self.state().local.clone()
    }

    fn stat(&self) -> Result<libc::stat, Errno> {
        let object = self.object().ok_or(Errno::ESTALE)?;
        store::stat_fd(object.as_fd())
    }

    fn tally<T>(&self, f: impl FnOnce(&mut Tally, Opens) -> T) -> T {
        let mut state = self.state();
        let opens = Opens {
            files: state.open_files,
            passthrough: state.passthrough_opens,
        };
        f(&mut state.quota, opens)
    }

    fn measuring(&self) -> MutexGuard<'_, ()> {
        self.measuring.lock()
    }
}

impl NodeState {
    pub fn new(layer: Layer) -> NodeState {
        NodeState {
            aliases: Vec::new(),
            layer,
            object: None,
            local: None,
            remote: None,
            link: None,
            identities: Vec::new(),
            no_capability: false,
            quota: Tally::default(),
            open_files: 0,
            passthrough_opens: 0,
            mapped_writers: 0,
            writers_before_copy_up: 0,
        }
    }

    pub fn add_alias(&mut self, parent: &Arc<Node>, name: &OsStr) {
        let known = self
            .aliases
            .iter()
            .any(|(p, n)| p.ino == parent.ino && n == name);
        if !known {
            self.aliases.push((parent.clone(), name.to_owned()));
        }
    }

    pub fn remove_alias(&mut self, parent: u64, name: &OsStr) {
        self.aliases
            .retain(|(p, n)| !(p.ino == parent && n == name));
    }
}

thread_local! {
    /// Parents whose last reference went with a dropped node, waiting to be dropped in turn.
    static ORPHANED: RefCell<Vec<Arc<Node>>> = const { RefCell::new(Vec::new()) };
    static DRAINING: Cell<bool> = const { Cell::new(false) };
}

impl Drop for Node {
    /// A node holds its parents: dropping the last node of a deep chain would drop the whole
    /// chain recursively, as deep as the tree. The parents are dropped one after the other
    /// instead.
    fn drop(&mut self) {
        let aliases = std::mem::take(&mut self.state.get_mut().aliases);
        if aliases.is_empty() {
            return;
        }
        ORPHANED.with(|o| o.borrow_mut().extend(aliases.into_iter().map(|(p, _)| p)));
        if DRAINING.with(|d| d.replace(true)) {
            return;
        }
        while let Some(parent) = ORPHANED.with(|o| o.borrow_mut().pop()) {
            drop(parent);
        }
        DRAINING.with(|d| d.set(false));
    }
}

/// A directory's two handles, cloned out of the node so no lock is held across syscalls.
#[derive(Debug, Clone, Default)]
pub struct DirFds {
    pub local: Option<Arc<OwnedFd>>,
    pub remote: Option<Arc<OwnedFd>>,
}

impl DirFds {
    pub fn local(&self) -> Option<BorrowedFd<'_>> {
        self.local.as_deref().map(AsFd::as_fd)
    }
    pub fn remote(&self) -> Option<BorrowedFd<'_>> {
        self.remote.as_deref().map(AsFd::as_fd)
    }
}
