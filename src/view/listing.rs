//! Merged directory listings: local entries, then synthesized links, then the remote
//! entries the zone lets through, then the layout's skeleton, each name once and in the
//! same precedence as lookup. Whiteouts and copy-up temporaries never show.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;

use nix::errno::Errno;

use super::identity::Identity;
use super::node::{DirFds, Node};
use super::{marker, remote_error, View, Zone};
use crate::store::{self, Kind};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    pub name: OsString,
    pub kind: Kind,
    pub ino: u64,
}

impl View {
    /// All entries of a directory as the view shows them (without `.` and `..`).
    pub fn list(&self, dir: &Node) -> Result<Vec<ListEntry>, Errno> {
        self.list_fds(dir.zone, dir.ino, &dir.dir_fds())
    }

    /// Whether a directory shows no entries at all (rmdir and rename-over check this).
    pub fn is_empty_dir(&self, zone: Zone, ino: u64, fds: &DirFds) -> Result<bool, Errno> {
        Ok(self.list_fds(zone, ino, fds)?.is_empty())
    }

    pub(super) fn list_fds(
        &self,
        zone: Zone,
        ino: u64,
        fds: &DirFds,
    ) -> Result<Vec<ListEntry>, Errno> {
        let mut seen: HashMap<OsString, usize> = HashMap::new();
        let mut out = Vec::new();
        // Per local entry: whether the kernel knows it by a live node's number.
        let mut known = Vec::new();
        if let Some(local) = fds.local() {
            let dev = store::stat_fd(local)?.st_dev;
            for e in store::read_dir(local)? {
                if marker::is_reserved_name(e.name.as_bytes()) {
                    continue;
                }
                if e.whiteout && zone.has_below() {
                    let real = store::cname(&e.name).is_ok_and(|c| marker::is_device_at(local, &c));
                    if !real {
                        seen.insert(e.name, usize::MAX);
                        continue;
                    }
                }
                seen.insert(e.name.clone(), out.len());
                let id = Identity::Local { dev, ino: e.ino };
                let live = self.inodes.live_number(&id);
                known.push(live.is_some());
                let ino = live.unwrap_or_else(|| self.inodes.listed_number(&id));
                out.push(ListEntry {
                    name: e.name,
                    kind: e.kind,
                    ino,
                });
            }
        }
        let index = self.index();
        for name in self.layout.virtual_links(zone, &index) {
            let name = OsString::from(name);
            if !seen.contains_key(&name) {
                seen.insert(name.clone(), out.len());
                let ino = self.inodes.listed_number(&Identity::Virtual {
                    parent: ino,
                    name: name.clone(),
                });
                out.push(ListEntry {
                    name,
                    kind: Kind::Symlink,
                    ino,
                });
            }
        }
        // The shared objects of an area come from the index, numbered by their place (see
        // `View::build`): listing an area never waits on the remote.
        for id in self.layout.shared_ids(zone, &index) {
            let name = OsString::from(id);
            let ino = self.inodes.listed_number(&Identity::Virtual {
                parent: ino,
                name: name.clone(),
            });
            match seen.get(&name) {
                Some(&at) if at != usize::MAX => {
                    let merges = out[at].kind == Kind::Dir
                        && fds.local().is_some_and(|local| !is_opaque_at(local, &name));
                    if merges {
                        out[at].ino = ino;
                    }
                }
                Some(_) => {}
                None => {
                    seen.insert(name.clone(), out.len());
                    out.push(ListEntry {
                        name,
                        kind: Kind::Dir,
                        ino,
                    });
                }
            }
        }
        if let Some(remote) = fds.remote().filter(|_| zone == Zone::Shared) {
            let dev = store::stat_fd(remote.as_fd()).map_err(remote_error)?.st_dev;
            for e in store::read_dir(remote).map_err(remote_error)? {
                if !self.layout.remote_visible(zone, &e.name, &index) {
                    continue;
                }
                let remote_id = Identity::Remote { dev, ino: e.ino };
                if let Some(&at) = seen.get(&e.name) {
                    // A local directory over a remote one merges with it and is numbered
                    // after it, unless it is opaque or the kernel knows it by another number.
                    let merges = e.kind == Kind::Dir
                        && out.get(at).is_some_and(|l| l.kind == Kind::Dir)
                        && !known.get(at).copied().unwrap_or(true);
                    if let (true, Some(local)) = (merges, fds.local()) {
                        if !is_opaque_at(local, &e.name) {
                            out[at].ino = self.inodes.listed_number(&remote_id);
                        }
                    }
                    continue;
                }
                seen.insert(e.name.clone(), out.len());
                // A remote file with several links is numbered per name once looked up
                // (see `Identity::RemoteName`); telling them apart here would take a
                // stat of every remote entry, so only a looked-up name's number is known.

                let by_name = Identity::RemoteName {
                    parent: ino,
                    name: e.name.clone(),
                };
                let named = match e.kind {
                    Kind::Dir => 0,
                    _ => self.inodes.listed_number(&by_name),
                };
                let ino = match named {
                    0 => self.inodes.listed_number(&remote_id),
                    n => n,
                };
                out.push(ListEntry {
                    name: e.name,
                    kind: e.kind,
                    ino,
                });
            }
        }
        let skeleton: Vec<&str> = match zone {
            Zone::Root => self.layout.root_skeleton().to_vec(),
            other => self.layout.skeleton(other).to_vec(),
        };
        for name in skeleton {
            let name = OsString::from(name);
            // A local directory in a skeleton place is numbered by the place too.
            if let Some(&at) = seen.get(&name).filter(|&&at| at != usize::MAX) {
                if out[at].kind == Kind::Dir {
                    out[at].ino = self.inodes.listed_number(&Identity::Virtual {
                        parent: ino,
                        name: name.clone(),
                    });
                }
                continue;
            }
            if !seen.contains_key(&name) {
                seen.insert(name.clone(), out.len());
                let ino = self.inodes.listed_number(&Identity::Virtual {
                    parent: ino,
                    name: name.clone(),
                });
                out.push(ListEntry {
                    name,
                    kind: Kind::Dir,
                    ino,
                });
            }
        }
        Ok(out)
    }
}

/// Whether the local subdirectory `name` of `dir` hides what is below it.
fn is_opaque_at(dir: BorrowedFd<'_>, name: &OsStr) -> bool {
    store::cname(name)
        .and_then(|c| store::open_dir_at(dir, &c))
        .is_ok_and(|fd| marker::is_opaque(fd.as_fd()))
}
