//! Merged directory listings: local entries, then synthesized links, then the remote
//! entries the zone lets through, then the layout's skeleton, each name once and in the
//! same precedence as lookup. Whiteouts and copy-up temporaries never show.

use std::collections::HashSet;
use std::ffi::OsString;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;

use nix::errno::Errno;

use super::inodes::Identity;
use super::node::{DirFds, Node};
use super::{marker, View, Zone};
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
        let mut seen: HashSet<OsString> = HashSet::new();
        let mut out = Vec::new();
        if let Some(local) = fds.local() {
            let dev = store::stat_fd(local)?.st_dev;
            for e in store::read_dir(local)? {
                if marker::is_reserved_name(e.name.as_bytes()) {
                    continue;
                }
                seen.insert(e.name.clone());
                if e.whiteout && zone.has_below() {
                    continue;
                }
                let ino = self.inodes.number(Identity::Local { dev, ino: e.ino });
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
            if seen.insert(name.clone()) {
                let ino = self.inodes.number(Identity::Virtual {
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
        if let Some(remote) = fds.remote().filter(|_| self.remote_reachable(zone)) {
            let dev = store::stat_fd(remote.as_fd())?.st_dev;
            for e in store::read_dir(remote)? {
                if !self.layout.remote_visible(zone, &e.name, &index)
                    || (zone != Zone::Shared && e.kind != Kind::Dir)
                    || seen.contains(&e.name)
                {
                    continue;
                }
                seen.insert(e.name.clone());
                // A remote file with several links is numbered per name once looked up
                // (see `Identity::RemoteName`); telling them apart here would take a
                // stat of every remote entry, so only a looked-up name's number is known.
                let by_name = Identity::RemoteName {
                    parent: ino,
                    name: e.name.clone(),
                };
                let ino = match (e.kind, self.inodes.known(&by_name)) {
                    (kind, Some(n)) if kind != Kind::Dir => n,
                    _ => self.inodes.number(Identity::Remote { dev, ino: e.ino }),
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
            if seen.insert(name.clone()) {
                let ino = self.inodes.number(Identity::Virtual {
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
