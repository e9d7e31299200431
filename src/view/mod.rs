//! The unified view: local over remote with overlayfs semantics (DESIGN §3), plus the
//! synthesized iSulad remote-RO layout (DESIGN §4).
//!
//! A name is resolved in a directory in this order:
//! 1. local: a whiteout there hides the name; anything else wins;
//! 2. a synthesized symlink (`<driver>/<id>`, `<driver>-layers/<id>`, `<driver>/l/<short>`);
//! 3. remote, where the directory's zone lets the remote show through (see [`zone`]);
//! 4. a skeleton directory of the layout, which always exists.
//!
//! Writes go to local only. Writing to a remote object first copies it up ([`copyup`]);
//! removing one leaves a whiteout; a directory created where a remote one was hidden is made
//! opaque. The remote tree is opened read-only and never written.
//!
//! The view works on numbered [`Node`]s (see [`inodes`]) and returns `Errno`s, so the FUSE
//! glue in `fs/` only translates. A node holds its object open and every operation goes
//! through that handle, never a name that might meanwhile name something else.
//!
//! ## Locks
//! A lock is held for bookkeeping, never across a call that can wait on the remote; the
//! two per-file locks below are the only ones held across calls on local, and only
//! requests on that same file wait on them. When more than one is held, they are taken in
//! this order, never the other way round:
//! 1. a node's copy-up lock ([`Node::copy_lock`]): one object's copy-up, which only the
//!    requests that need that object copied up, removed or replaced wait for. A copy-up,
//!    removal or rename holds one object's while it takes the directories' above it, one
//!    at a time; a directory's copy-up takes no other, so no two wait on each other;
//! 2. a file's measuring lock ([`Object::measuring`](crate::quota::Object::measuring) of
//!    its node): one `fstat` of a local file to charge its quota root, which only other
//!    charges of the same file wait for;
//! 3. the quota's change lock (inside [`crate::quota`]): setting and clearing roots, and
//!    the renames that move one; the registry in local is saved under it;
//! 4. the inode table ([`inodes::InodeTable`]), then a node's state ([`Node::state`], which
//!    holds what the quota keeps on the node), then the table's own number maps: map
//!    operations only;
//! 5. leaves: the layout index, the skeleton numbers, the quota's table of roots.
//!
//! Nodes are built (directories opened, attributes read, on the remote too) before the
//! table is locked, and inserted if no other request inserted one for the same object
//! meanwhile.

pub mod attrs;
pub mod copyup;
pub mod exports;
pub mod gate;
pub mod identity;
pub mod inodes;
pub mod io;
pub mod keep;
pub mod listing;
mod lookup;
pub mod marker;
pub mod names;
pub mod namespace;
pub mod node;
pub mod refresh;
mod rename;
pub mod roots;
pub mod route;
mod subvolume;
#[cfg(test)]
mod tests;
pub mod zone;

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use parking_lot::RwLock;

use crate::layout::LayoutIndex;
use crate::quota::{Accounting, Ledger};
pub use crate::store::open_root;
use crate::store::{self, cname, creds, Kind};
use identity::{local_identity, ROOT_INO};
use inodes::InodeTable;
pub use node::{DirFds, Layer, Node, NodeState};
pub use zone::{Layout, LinkStyle, Zone};

pub type Stat = libc::stat;

/// Who is asking: new objects belong to the caller, never to the daemon.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    /// The calling thread, for what a request does not carry (capabilities, groups).
    pub pid: u32,
    /// The umask to create with (create, mkdir, mknod); `None` elsewhere.
    pub umask: Option<u32>,
}

impl Caller {
    /// How local's filesystem is to see the caller (see [`store::creds`]).
    pub fn acting(&self) -> creds::As {
        creds::As {
            uid: self.uid,
            gid: self.gid,
            umask: self.umask,
        }
    }

    /// Whether the caller may do what takes `CAP_SYS_ADMIN` (changing quotas).
    pub fn is_admin(&self) -> bool {
        creds::is_admin(self.pid)
    }

    /// Whether the caller is a member of `group`.
    pub fn in_group(&self, group: u32) -> bool {
        creds::in_group(self.pid, self.gid, group)
    }
}

/// A node handed to the kernel, with its attributes.
#[derive(Debug, Clone)]
pub struct Entry {
    pub node: Arc<Node>,
    pub stat: Stat,
}

/// What a name resolves to, before it becomes a node. `fd` is the object's `O_PATH`
/// handle when resolving opened it; a stat alone is enough to find a live node.
enum Found {
    Local { fd: Option<OwnedFd>, st: Stat },
    Remote { fd: Option<OwnedFd>, st: Stat },
    VirtualDir,
    VirtualLink(Vec<u8>),
}

/// How a name is resolved: what the caller expects decides which costs fewer system calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// The kernel asks for a name it does not hold: open the object right away, it will
    /// need a new node.
    Open,
    /// The kernel holds the name (it locked it for an unlink or rename): a stat finds the
    /// live node.
    Stat,
}

/// The layout index as one request sees it: read when first needed, then the same for the
/// rest of the request. A refresh round swapping the index midway must not give a node the
/// zone of one index and the content of the other, which the node would keep for as long as
/// the kernel holds it; and a request that never needs the index (a local name the kernel
/// already knows) does not read it.
struct IndexOnce<'a> {
    view: &'a View,
    index: std::cell::OnceCell<Arc<LayoutIndex>>,
}

impl<'a> IndexOnce<'a> {
    fn of(view: &'a View) -> IndexOnce<'a> {
        IndexOnce {
            view,
            index: std::cell::OnceCell::new(),
        }
    }

    fn get(&self) -> &LayoutIndex {
        self.index.get_or_init(|| self.view.index())
    }
}

pub struct View {
    pub layout: Layout,
    index: RwLock<Arc<LayoutIndex>>,
    /// The numbers handed out for the layout's fixed directories, by zone: the parents a
    /// refresh invalidates names in (see [`refresh`]).
    skeleton: parking_lot::Mutex<std::collections::HashMap<Zone, Vec<u64>>>,
    /// The remote tree's root. Only the shared areas below it are ever opened, from here
    /// (see [`View::remote_area`]); replaced when the remote is (see [`refresh`]).
    remote_root: RwLock<Arc<OwnedFd>>,
    pub inodes: InodeTable,
    /// The quota accounting, reached through [`View::quota`] (see [`roots`] for loading it).
    quota: Ledger,
    /// What every request passes while it is served (see [`gate`]).
    gate: gate::Gate,
    local_root: Arc<OwnedFd>,
    /// Owner and times given to synthesized objects.
    virtual_base: Stat,
    /// The attributes the remote gives the layout directories (`<driver>/`, `RO/`, …), as
    /// last read by a refresh round: shown on the view's synthesized ones.
    layout_attrs: RwLock<std::collections::HashMap<Zone, Stat>>,
    /// Directories held locked by requests waiting on the remote elsewhere.
    held: route::HeldDirs,
    /// What finds local objects again by number (see [`exports`]).
    exports: exports::Exports,
    /// This daemon resumed a connection another one served (see [`View::resume`]).
    resumed: std::sync::atomic::AtomicBool,
}

impl View {
    /// Builds the view over two open roots. `index` is the ready set of the remote tree.
    pub fn new(
        layout: Layout,
        local_root: OwnedFd,
        remote_root: OwnedFd,
        index: LayoutIndex,
    ) -> Result<View, Errno> {
        let local_st = store::stat_fd(local_root.as_fd())?;
        marker::tag_temp_names(local_st.st_ino);
        let mut virtual_base = local_st;
        virtual_base.st_uid = 0;
        virtual_base.st_gid = 0;
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        virtual_base.st_mtime = now;
        virtual_base.st_ctime = now;
        virtual_base.st_atime = now;
        virtual_base.st_mtime_nsec = 0;
        virtual_base.st_ctime_nsec = 0;
        virtual_base.st_atime_nsec = 0;
        let remote_dev = store::stat_fd(remote_root.as_fd()).map_or(0, |st| st.st_dev);
        let local_root = Arc::new(local_root);
        let quota = Ledger::new(local_root.clone(), &local_st);
        let exports = exports::Exports::open(local_root.as_fd());
        // The root and the layout directories above the shared areas hold no remote handle:
        // their entries come from local and the index, so no request there waits on the
        // remote.
        let mut state = NodeState::new(Layer::Local);
        state.local = Some(local_root.clone());
        let root = Node::new(ROOT_INO, Kind::Dir, Zone::Root, state);
        let inodes = InodeTable::new(
            root,
            vec![local_identity(&local_st)],
            local_st.st_dev,
            remote_dev,
        );
        Ok(View {
            layout,
            index: RwLock::new(Arc::new(index)),
            skeleton: Default::default(),
            remote_root: RwLock::new(Arc::new(remote_root)),
            inodes,
            quota,
            gate: gate::Gate::default(),
            local_root,
            virtual_base,
            layout_attrs: Default::default(),
            held: Default::default(),
            exports,
            resumed: Default::default(),
        })
    }

    /// What every request passes while it is served.
    pub fn gate(&self) -> &gate::Gate {
        &self.gate
    }

    /// The quota accounting, as the view may use it: through its trait alone.
    fn quota(&self) -> &impl Accounting<Node> {
        &self.quota
    }

    /// The layout index in force. Cheap: an `Arc` clone.
    pub fn index(&self) -> Arc<LayoutIndex> {
        self.index.read().clone()
    }

    /// Installs a new index (a refresh round). Requests already running keep the old one.
    pub fn swap_index(&self, index: LayoutIndex) -> Arc<LayoutIndex> {
        std::mem::replace(&mut *self.index.write(), Arc::new(index))
    }

    pub fn node(&self, ino: u64) -> Result<Arc<Node>, Errno> {
        match self.inodes.get(ino) {
            Some(node) => Ok(node),
            None if self.resumed.load(std::sync::atomic::Ordering::Relaxed) => self.refind(ino),
            None => Err(Errno::ESTALE),
        }
    }

    /// Serves from now on a kernel that holds nodes an earlier daemon handed out: a number
    /// not in the table is looked for as a file handle's would be (see [`exports`]) before
    /// it is called stale. The kernel's count of lookups of such a node is unknown; it is
    /// counted once here, so the node may leave the table while the kernel still holds it,
    /// and is found again the same way at its next use.
    pub fn resume(&self) {
        self.resumed
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Keeps what the numbering does in `journal`, for a daemon that resumes after this one
    /// (see [`keep`]).
    pub fn keep_numbering_in(&self, journal: Arc<dyn keep::Journal>) {
        self.inodes.keep_in(journal);
    }

    /// Takes back the numbering an earlier daemon kept.
    pub fn restore_numbering(&self, facts: impl IntoIterator<Item = keep::Fact>) {
        self.inodes.restore(facts);
    }

    /// A node the kernel holds from an earlier daemon, found again by its number. Finding
    /// walks from the root and asks for no node it has not just placed, so it never comes
    /// back here: a thread already finding gets `ESTALE`.
    fn refind(&self, ino: u64) -> Result<Arc<Node>, Errno> {
        thread_local!(static FINDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
        if FINDING.with(|f| f.replace(true)) {
            return Err(Errno::ESTALE);
        }
        let found = self.find(ino);
        FINDING.with(|f| f.set(false));
        found.map(|entry| entry.node).map_err(|_| Errno::ESTALE)
    }

    fn dir(&self, ino: u64) -> Result<Arc<Node>, Errno> {
        let node = self.node(ino)?;
        if !node.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        Ok(node)
    }

    /// Attributes of a node, read fresh from its object (which it holds: also when the
    /// object's name is gone).
    pub fn getattr(&self, node: &Node) -> Result<Stat, Errno> {
        if node.layer() == Layer::Virtual {
            return Ok(self.virtual_stat(node));
        }
        let object = node.object().ok_or(Errno::ESTALE)?;
        Ok(self.present(node, store::stat_fd(object.as_fd())?))
    }

    /// Dresses on-disk attributes as the view shows them.
    fn present(&self, node: &Node, mut st: Stat) -> Stat {
        st.st_ino = node.ino;
        // A merged directory's link count says nothing about its subdirectories; 1 tells
        // tools like find(1) not to rely on it, as btrfs and overlayfs do.
        if node.is_dir() && node.state().remote.is_some() && node.ino != ROOT_INO {
            st.st_nlink = 1;
        }
        st
    }

    /// Takes the attributes of the remote's layout directories (a refresh round read them).
    /// Returns the numbers of the live directories that show other attributes now: the
    /// kernel keeps what it was told for the attribute timeout.
    pub fn set_layout_attrs(&self, attrs: Vec<(Zone, Stat)>) -> Vec<u64> {
        let attrs: std::collections::HashMap<Zone, Stat> = attrs.into_iter().collect();
        let changed: Vec<Zone> = {
            let mut had = self.layout_attrs.write();
            let shown = |st: Option<&Stat>| st.map(layout_shows);
            let changed = had
                .keys()
                .chain(attrs.keys())
                .filter(|z| shown(had.get(z)) != shown(attrs.get(z)))
                .copied()
                .collect();
            *had = attrs;
            changed
        };
        changed
            .into_iter()
            .flat_map(|zone| self.layout_dir_inos(zone))
            .filter(|&ino| {
                self.inodes
                    .get(ino)
                    .is_some_and(|n| n.layer() == Layer::Virtual)
            })
            .collect()
    }

    /// Attributes of a synthesized node; a layout directory shows those of the remote's
    /// directory of the same place, where it has one (see [`View::set_layout_attrs`]).
    fn virtual_stat(&self, node: &Node) -> Stat {
        let mut st = self.virtual_base;
        let remote = node
            .is_dir()
            .then(|| self.layout_attrs.read().get(&node.zone).copied())
            .flatten();
        if let Some(remote) = remote {
            st.st_mode = remote.st_mode;
            st.st_uid = remote.st_uid;
            st.st_gid = remote.st_gid;
            st.st_atime = remote.st_atime;
            st.st_atime_nsec = remote.st_atime_nsec;
            st.st_mtime = remote.st_mtime;
            st.st_mtime_nsec = remote.st_mtime_nsec;
            st.st_ctime = remote.st_ctime;
            st.st_ctime_nsec = remote.st_ctime_nsec;
            st.st_ino = node.ino;
            st.st_nlink = 1;
            return st;
        }
        st.st_ino = node.ino;
        match &node.state().link {
            Some(target) => {
                st.st_mode = libc::S_IFLNK | 0o777;
                st.st_size = target.len() as i64;
                st.st_nlink = 1;
                st.st_blocks = 0;
            }
            None => {
                st.st_mode = libc::S_IFDIR | 0o700;
                st.st_nlink = 1;
            }
        }
        st
    }

    pub fn readlink(&self, node: &Node) -> Result<Vec<u8>, Errno> {
        if node.kind != Kind::Symlink {
            return Err(Errno::EINVAL);
        }
        if let Some(target) = &node.state().link {
            return Ok(target.to_vec());
        }
        let object = node.object().ok_or(Errno::ESTALE)?;
        store::readlink_at(object.as_fd(), c"")
    }

    /// The names by which the kernel holds the `count` nodes it was handed longest ago and
    /// has no open file of. Dropping them from its cache lets it forget those nodes, and
    /// their handles close (see `fs::trim`).
    /// Files go first: a directory's number is handed out once and its name then stays
    /// hot in the kernel's cache without a lookup.
    /// A node whose path from the root is in `pinned` keeps its names: the kernel detaches
    /// whatever is mounted on or below a name it is told to drop.
    pub fn least_used_names(
        &self,
        count: usize,
        pinned: &HashSet<PathBuf>,
    ) -> Vec<(u64, OsString)> {
        let mut nodes = self.inodes.least_recent(count, false);
        if nodes.len() < count {
            nodes.extend(self.inodes.least_recent(count - nodes.len(), true));
        }
        let mut names = Vec::new();
        for node in nodes {
            let aliases = {
                let state = node.state();
                if state.open_files > 0 {
                    continue;
                }
                state.aliases.clone()
            };
            for (parent, name) in aliases {
                // A directory whose path cannot be told (its names are going) is kept.
                let under_a_mount = !pinned.is_empty()
                    && crate::quota::Object::path(&*parent)
                        .is_none_or(|dir| pinned.contains(&dir.join(&name)));
                if !under_a_mount {
                    names.push((parent.ino, name));
                }
            }
        }
        names
    }

    /// The names the kernel knows `node` by, as (parent, name).
    pub fn names_of(&self, node: &Node) -> Vec<(u64, OsString)> {
        let state = node.state();
        state
            .aliases
            .iter()
            .map(|(p, name)| (p.ino, name.clone()))
            .collect()
    }

    /// Opens a node's object as it is now (after a copy-up: the copy) with `flags`.
    pub fn reopen(&self, node: &Node, flags: i32) -> Result<OwnedFd, Errno> {
        let object = node.object().ok_or(Errno::ESTALE)?;
        store::reopen(object.as_fd(), OFlag::from_bits_truncate(flags))
    }

    /// Lets go of a node the kernel cannot go on using for new opens (its inode is bound to
    /// the passthrough backing file of the object it was before a copy-up): its identities
    /// and names go, so that the next lookup of its object makes a new node, under another
    /// number; the kernel keeps this one for what it has open. Returns the names it had,
    /// for the kernel to drop.
    pub fn detach(&self, node: &Arc<Node>) -> Vec<(u64, OsString)> {
        if let Some(st) = node.object().and_then(|o| store::stat_fd(o.as_fd()).ok()) {
            self.inodes.forget_origin(st.st_dev, st.st_ino);
        }
        self.inodes.detach(node);
        let aliases = std::mem::take(&mut node.state().aliases);
        aliases.into_iter().map(|(p, name)| (p.ino, name)).collect()
    }

    /// An open that [`View::open`] made of a remote file before its copy-up, to write it
    /// later, was closed.
    pub fn writer_closed(&self, node: &Node) {
        let mut state = node.state();
        state.writers_before_copy_up = state.writers_before_copy_up.saturating_sub(1);
    }

    /// Writes everything of local's filesystem to disk (the mount is going away).
    pub fn sync_local(&self) -> Result<(), Errno> {
        let fd = store::reopen(
            self.local_root.as_fd(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY,
        )?;
        Errno::result(unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&fd)) }).map(drop)
    }

    /// `statvfs` of local's filesystem.
    pub fn statfs(&self) -> Result<libc::statvfs, Errno> {
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&*self.local_root);
        Errno::result(unsafe { libc::fstatvfs(fd, st.as_mut_ptr()) })?;
        // Filled in by the successful call.
        Ok(unsafe { st.assume_init() })
    }

    /// `statfs` of the directory `node`: a quota root's limit and room when it is under
    /// one, so that `df` inside a container shows its limit.
    pub fn statfs_at(&self, node: &Arc<Node>) -> Result<libc::statvfs, Errno> {
        let local = self.statfs()?;
        Ok(self.quota().statfs(&self.quota().under(node), local))
    }

    /// Opens a file for I/O. An open that may write copies a remote file up first, unless
    /// `defer_copy_up`: then it opens the remote file read-only, and the open's first change
    /// copies it up ([`View::copy_up`]), so that an open that never changes the file leaves
    /// it where it was and a truncating one copies no data. Such an open is counted until
    /// [`View::writer_closed`]: a copy-up needs the file's name, so removing the name copies
    /// the file up first.
    ///
    /// An open changes nothing in the file: the kernel sends O_TRUNC's truncation as a
    /// SETATTR once it has decided that the open may truncate (see `fs::session`), so an
    /// open it refuses leaves every byte where it was.
    pub fn open(
        &self,
        node: &Arc<Node>,
        flags: i32,
        defer_copy_up: bool,
    ) -> Result<(OwnedFd, Layer), Errno> {
        if node.kind != Kind::File {
            return Err(Errno::EINVAL);
        }
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
        if writes && node.layer() != Layer::Local {
            if !defer_copy_up {
                self.copy_up(node, true)?;
            } else if let (layer, Some(object)) = node.placed() {
                let fd = store::reopen(object.as_fd(), OFlag::O_RDONLY)?;
                // Counted under the copy lock, which a removal holds as it looks; a copy-up
                // that came first leaves the copy to open.
                let _copying = node.copy_lock();
                if node.layer() != Layer::Local {
                    node.state().writers_before_copy_up += 1;
                    return Ok((fd, layer));
                }
            }
        }
        let (layer, object) = node.placed();
        let object = object.ok_or(Errno::EINVAL)?;
        // The kernel has already applied O_CREAT/O_EXCL; O_APPEND positions come with each
        // write; O_DIRECT alignment is the kernel's business, not the backing file's. O_TRUNC
        // never comes (and would truncate before the kernel's checks): it is not kept.
        let keep = libc::O_ACCMODE | libc::O_SYNC | libc::O_DSYNC | libc::O_NOATIME;
        let oflags = match layer {
            Layer::Local => OFlag::from_bits_truncate(flags & keep),
            _ => OFlag::O_RDONLY | (OFlag::from_bits_truncate(flags) & OFlag::O_NOATIME),
        };
        // O_NOATIME is refused on files the daemon does not own when the caller asked for
        // it; retry without rather than fail a read.
        match store::reopen(object.as_fd(), oflags) {
            Err(Errno::EPERM) if oflags.contains(OFlag::O_NOATIME) => {
                self.open(node, flags & !libc::O_NOATIME, defer_copy_up)
            }
            other => other.map(|fd| (fd, layer)),
        }
    }
}

/// Validates a name the kernel sent; our temporary names are never part of the view.
fn view_name(name: &OsStr) -> Result<std::ffi::CString, Errno> {
    if marker::is_reserved_name(name.as_bytes()) {
        return Err(Errno::ENOENT);
    }
    if name.len() > 255 {
        return Err(Errno::ENAMETOOLONG);
    }
    cname(name).map_err(|_| Errno::ENOENT)
}

/// What a caller is told of a remote that failed. "Not connected", "stale handle" and the
/// like describe the network share, not the view, and would make the kernel think the
/// view's own objects went stale: they become EIO. Never ENOENT, which the kernel would
/// remember as absence.
pub fn remote_error(e: Errno) -> Errno {
    match e {
        Errno::ENOTCONN
        | Errno::ESTALE
        | Errno::ETIMEDOUT
        | Errno::EHOSTDOWN
        | Errno::EHOSTUNREACH
        | Errno::ECONNABORTED
        | Errno::ECONNRESET
        | Errno::ECONNREFUSED
        | Errno::ENETDOWN
        | Errno::ENETUNREACH
        | Errno::EREMOTEIO => Errno::EIO,
        other => other,
    }
}

/// What a layout directory shows of the remote's directory of the same place that is worth
/// telling the kernel of: not the access time, which the scans themselves move.
fn layout_shows(st: &Stat) -> [i64; 7] {
    [
        i64::from(st.st_mode),
        i64::from(st.st_uid),
        i64::from(st.st_gid),
        st.st_mtime,
        st.st_mtime_nsec,
        st.st_ctime,
        st.st_ctime_nsec,
    ]
}
