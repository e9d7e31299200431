//! Looking names up: local first, then a synthesized link, then the remote where the
//! directory's zone lets it show, then the layout's skeleton (the order the view's module
//! documentation gives), and making a node of what is found.

use std::ffi::{CStr, OsStr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use nix::errno::Errno;

use super::identity::{local_identity, Identity};
use super::inodes::NewNode;
use super::{
    marker, refresh, remote_error, view_name, DirFds, Entry, Found, IndexOnce, Layer, Node,
    NodeState, Probe, Stat, View, Zone,
};
use crate::layout::LayoutIndex;
use crate::store::{self, Kind};

impl View {
    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<Entry, Errno> {
        let parent = self.dir(parent)?;
        let c = view_name(name)?;
        let index = IndexOnce::of(self);
        let found = self.resolve(&parent, name, &c, &index, Probe::Open)?;
        self.materialize(&parent, name, &c, &index, found)
    }

    /// Finds what `name` is in the directory `parent` by `index`, without creating a node.
    /// The node is then built ([`Self::materialize`]) by the same index (see [`IndexOnce`]).
    pub(super) fn resolve(
        &self,
        parent: &Node,
        name: &OsStr,
        c: &CStr,
        index: &IndexOnce,
        probe: Probe,
    ) -> Result<Found, Errno> {
        let fds = parent.dir_fds();
        match resolve_local(parent, &fds, c, probe)? {
            InLocal::Object(fd, st) => Ok(Found::Local { fd, st }),
            InLocal::Whiteout => Err(Errno::ENOENT),
            InLocal::Nothing => self.resolve_below(parent, &fds, name, c, index, probe),
        }
    }

    /// What shows of `name` in `parent` (whose directories are `fds`) where local holds
    /// nothing of it: a synthesized link, the remote's entry, or the layout's skeleton.
    pub(super) fn resolve_below(
        &self,
        parent: &Node,
        fds: &DirFds,
        name: &OsStr,
        c: &CStr,
        index: &IndexOnce,
        probe: Probe,
    ) -> Result<Found, Errno> {
        let index = index.get();
        if let Some(target) = self.layout.virtual_link(parent.zone, name, index) {
            return Ok(Found::VirtualLink(target));
        }
        if let Some((fd, st)) = self.remote_entry(parent, fds, name, c, index, probe)? {
            return Ok(Found::Remote { fd, st });
        }
        if self.layout.is_skeleton(parent.zone, name) {
            return Ok(Found::VirtualDir);
        }
        Err(Errno::ENOENT)
    }

    /// The remote entry `name` of `parent`, if the zone lets it show.
    pub(super) fn remote_entry(
        &self,
        parent: &Node,
        fds: &DirFds,
        name: &OsStr,
        c: &CStr,
        index: &LayoutIndex,
        probe: Probe,
    ) -> Result<Option<(Option<OwnedFd>, Stat)>, Errno> {
        if !self.layout.remote_visible(parent.zone, name, index) {
            return Ok(None);
        }
        let Some(remote) = self.remote_dir(parent, fds)? else {
            return Ok(None);
        };
        match probe_entry(remote.as_fd(), c, probe).map_err(remote_error)? {
            // In the areas only real directories count: a remote symlink named like a
            // layer must not turn into one.
            Some((_, st))
                if parent.zone != Zone::Shared && Kind::from_mode(st.st_mode) != Kind::Dir =>
            {
                Ok(None)
            }
            other => Ok(other),
        }
    }

    /// The remote directory whose entries show in `parent`: its own remote part inside a
    /// shared object; for an area listing the shared objects (`RO/`, `<driver>-images/`),
    /// that area, opened from the remote root; nothing elsewhere.
    pub(super) fn remote_dir(
        &self,
        parent: &Node,
        fds: &DirFds,
    ) -> Result<Option<Arc<OwnedFd>>, Errno> {
        match parent.zone {
            Zone::Shared => Ok(fds.remote.clone()),
            zone if zone.lists_shared() => Ok(self.remote_area(zone)?.map(Arc::new)),
            _ => Ok(None),
        }
    }

    /// Opens the remote area of a layout directory (`<driver>/RO`, …) from the remote root,
    /// one component at a time and without following symlinks.
    pub(super) fn remote_area(&self, zone: Zone) -> Result<Option<OwnedFd>, Errno> {
        let parts = self.layout.remote_area(zone);
        if parts.is_empty() {
            return Ok(None);
        }
        store::open_dir_below(self.remote_root().as_fd(), &parts).map_err(remote_error)
    }

    /// The remote root in force.
    pub fn remote_root(&self) -> Arc<OwnedFd> {
        self.remote_root.read().clone()
    }

    /// Whether removing `name` from local would let a remote or synthesized entry show, so
    /// that a whiteout is needed.
    pub(super) fn exists_below(
        &self,
        parent: &Node,
        name: &OsStr,
        c: &CStr,
    ) -> Result<bool, Errno> {
        let index = self.index();
        if self
            .layout
            .virtual_link(parent.zone, name, &index)
            .is_some()
            || self.layout.is_skeleton(parent.zone, name)
        {
            return Ok(true);
        }
        // The index says which shared objects the areas hold; no need to ask the remote.
        if parent.zone.lists_shared() {
            return Ok(self.layout.remote_visible(parent.zone, name, &index));
        }
        Ok(self
            .remote_entry(parent, &parent.dir_fds(), name, c, &index, Probe::Stat)?
            .is_some())
    }

    /// Turns a name resolved by `index` into the node the kernel will know it by: the live
    /// node of its object if there is one, a new node otherwise.
    pub(super) fn materialize(
        &self,
        parent: &Arc<Node>,
        name: &OsStr,
        c: &CStr,
        index: &IndexOnce,
        found: Found,
    ) -> Result<Entry, Errno> {
        let known = match &found {
            Found::Local { st, .. } => Some(local_identity(st)),
            Found::Remote { st, .. } => Some(remote_identity(parent, name, st)),
            _ => Some(virtual_identity(parent, name)),
        };
        if let Some(node) = known.and_then(|id| self.inodes.hand_out_known(&id)) {
            node.state().add_alias(parent, name);
            let stat = match &found {
                Found::Local { st, .. } | Found::Remote { st, .. } => self.present(&node, *st),
                _ => self.virtual_stat(&node),
            };
            return Ok(Entry { node, stat });
        }
        let (new, stat) = self.build(parent, name, c, index, found)?;
        let node = self.inodes.hand_out(new);
        node.state().add_alias(parent, name);
        self.inodes.placed(&node, parent.ino, name);
        self.remember_skeleton(&node);
        let stat = match stat {
            Some(st) => self.present(&node, st),
            None => self.virtual_stat(&node),
        };
        Ok(Entry { node, stat })
    }

    /// Everything a new node needs, opened before the inode table is locked.
    pub(super) fn build(
        &self,
        parent: &Arc<Node>,
        name: &OsStr,
        c: &CStr,
        index: &IndexOnce,
        found: Found,
    ) -> Result<(NewNode, Option<Stat>), Errno> {
        let zone = self.layout.child_zone(parent.zone, name, index.get());
        let fds = parent.dir_fds();
        let (layer, fd, st) = match found {
            Found::VirtualDir | Found::VirtualLink(_) => {
                let mut state = NodeState::new(Layer::Virtual);
                let kind = match found {
                    Found::VirtualLink(target) => {
                        state.link = Some(target.as_slice().into());
                        Kind::Symlink
                    }
                    _ => Kind::Dir,
                };
                let new = NewNode {
                    kind,
                    zone,
                    state,
                    identities: vec![virtual_identity(parent, name)],
                    generation: 0,
                };
                return Ok((new, None));
            }
            Found::Local { fd, st } => {
                let dir = fds.local().ok_or(Errno::ESTALE)?;
                let (fd, st) = pin(dir, c, fd, st)?;
                // Another object took the name between the stat and the open.
                if marker::hides(parent.zone, dir, c, &st) {
                    return Err(Errno::ENOENT);
                }
                (Layer::Local, fd, st)
            }
            Found::Remote { fd, st } => {
                let (fd, st) = match fd {
                    Some(fd) => (fd, st),
                    None => {
                        let dir = self.remote_dir(parent, &fds)?.ok_or(Errno::ESTALE)?;
                        pin(dir.as_fd(), c, None, st).map_err(remote_error)?
                    }
                };
                (Layer::Remote, fd, st)
            }
        };
        let kind = Kind::from_mode(st.st_mode);
        let generation = match layer {
            Layer::Local => self.record_local(fd.as_fd(), &st, parent),
            _ => 0,
        };
        let mut state = NodeState::new(layer);
        let mut identities = Vec::with_capacity(3);
        // The layout's directories and a shared object's directory are known by their
        // place (their first identity, which numbers them): a listing can then number
        // them without asking the remote, and a copy-up keeps the number.
        let placed = parent.zone.lists_shared() || refresh::LAYOUT_DIRS.contains(&zone);
        let place = (placed && kind == Kind::Dir).then(|| virtual_identity(parent, name));
        if let Some(place) = &place {
            identities.push(place.clone());
        }
        if kind != Kind::Dir {
            identities.push(match layer {
                Layer::Local => local_identity(&st),
                _ => remote_identity(parent, name, &st),
            });
            state.object = Some(Arc::new(fd));
        } else if layer == Layer::Remote {
            identities.push(remote_dir_identity(&st));
            state.remote = Some(Arc::new(fd));
        } else {
            let merges = zone.merges_remote() && !marker::is_opaque(fd.as_fd());
            // A merged directory is numbered after its remote part (its first identity):
            // copying it up changes nothing the kernel sees.
            let below = match merges {
                true => self.remote_below(parent, name, c, index.get())?,
                false => None,
            };
            if let Some((remote_fd, remote_st)) = below {
                identities.push(remote_dir_identity(&remote_st));
                state.remote = Some(Arc::new(remote_fd));
            }
            identities.push(local_identity(&st));
            state.local = Some(Arc::new(fd));
        }
        if let Some(place) = &place {
            self.claim_place(parent, name, place, &identities[1..]);
        }
        let new = NewNode {
            kind,
            zone,
            state,
            identities,
            generation,
        };
        Ok((new, Some(st)))
    }

    /// A live node holding the place of a shared object but none of `objects` holds an
    /// object that is gone (removed and made again under the same id): it keeps what the
    /// kernel has open of it, and the place, with a new number, goes to the new node.
    pub(super) fn claim_place(
        &self,
        parent: &Node,
        name: &OsStr,
        place: &Identity,
        objects: &[Identity],
    ) {
        let Some(live) = self
            .inodes
            .live_number(place)
            .and_then(|ino| self.inodes.get(ino))
        else {
            return;
        };
        let same = objects
            .iter()
            .any(|id| live.state().identities.contains(id));
        if !same {
            self.inodes.unbind_virtual(parent.ino, &name.to_owned());
        }
    }

    /// The remote directory a local directory `name` of `parent` merges with, if any. A
    /// remote that fails (rather than says "absent") fails the request: a directory built
    /// without its remote part would hide the remote's entries for as long as it lives.
    pub(super) fn remote_below(
        &self,
        parent: &Node,
        name: &OsStr,
        c: &CStr,
        index: &LayoutIndex,
    ) -> Result<Option<(OwnedFd, Stat)>, Errno> {
        if !self.layout.remote_visible(parent.zone, name, index) {
            return Ok(None);
        }
        let Some(remote) = self.remote_dir(parent, &parent.dir_fds())? else {
            return Ok(None);
        };
        let fd = match store::open_dir_at(remote.as_fd(), c) {
            Ok(fd) => fd,
            Err(Errno::ENOENT | Errno::ENOTDIR) => return Ok(None),
            Err(e) => return Err(remote_error(e)),
        };
        let st = store::stat_fd(fd.as_fd()).map_err(remote_error)?;
        Ok(Some((fd, st)))
    }
}

/// The object `c` of `dir` as a node holds it: `fd` if resolving opened it, else opened now
/// (and stat'ed again: the name may have changed hands since it was stat'ed).
pub(super) fn pin(
    dir: BorrowedFd<'_>,
    c: &CStr,
    fd: Option<OwnedFd>,
    st: Stat,
) -> Result<(OwnedFd, Stat), Errno> {
    match fd {
        Some(fd) => Ok((fd, st)),
        None => {
            let fd = store::open_path_at(dir, c)?;
            let st = store::stat_fd(fd.as_fd())?;
            Ok((fd, st))
        }
    }
}

/// One entry of a directory, by an open handle or a stat as `probe` says; `None` if absent.
pub(super) fn probe_entry(
    dir: BorrowedFd<'_>,
    c: &CStr,
    probe: Probe,
) -> Result<Option<(Option<OwnedFd>, Stat)>, Errno> {
    let found = match probe {
        Probe::Open => store::open_path_at(dir, c)
            .and_then(|fd| store::stat_fd(fd.as_fd()).map(|st| (Some(fd), st))),
        Probe::Stat => store::stat_at(dir, c).map(|st| (None, st)),
    };
    match found {
        Ok(found) => Ok(Some(found)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

pub(super) fn remote_dir_identity(st: &Stat) -> Identity {
    Identity::Remote {
        dev: st.st_dev,
        ino: st.st_ino,
    }
}

pub(super) fn remote_identity(parent: &Node, name: &OsStr, st: &Stat) -> Identity {
    if st.st_nlink > 1 && Kind::from_mode(st.st_mode) != Kind::Dir {
        return Identity::RemoteName {
            parent: parent.ino,
            name: name.to_owned(),
        };
    }
    Identity::Remote {
        dev: st.st_dev,
        ino: st.st_ino,
    }
}

pub(super) fn virtual_identity(parent: &Node, name: &OsStr) -> Identity {
    Identity::Virtual {
        parent: parent.ino,
        name: name.to_owned(),
    }
}

/// What local's part of a directory holds of a name.
pub(super) enum InLocal {
    Object(Option<OwnedFd>, Stat),
    /// A whiteout: nothing of the name below shows.
    Whiteout,
    Nothing,
}

/// What local's part of `parent` (whose directories are `fds`) holds of the name `c`.
pub(super) fn resolve_local(
    parent: &Node,
    fds: &DirFds,
    c: &CStr,
    probe: Probe,
) -> Result<InLocal, Errno> {
    let Some(local) = fds.local() else {
        return Ok(InLocal::Nothing);
    };
    Ok(match probe_entry(local, c, probe)? {
        Some((_, st)) if marker::hides(parent.zone, local, c, &st) => InLocal::Whiteout,
        Some((fd, st)) => InLocal::Object(fd, st),
        None => InLocal::Nothing,
    })
}
