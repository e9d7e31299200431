//! What the remote *is*, as opposed to what it holds: the identity (device and inode) of
//! its root and of its shared areas. Names alone cannot tell a remote that was replaced
//! (deleted and written again with the same ids, or another filesystem mounted on its
//! path) from the one the view's open handles still point into, nor a share that went away
//! and left its empty mount directory behind from a remote that was emptied.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use nix::errno::Errno;

use crate::store;
use crate::view::{open_root, Zone};

/// Device and inode of one directory.
pub type Id = (u64, u64);

/// The identities a round compares with the previous accepted round's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anchor {
    pub root: Id,
    /// Whether the root is a mountpoint (on another device than its parent): a share that
    /// is unmounted leaves a plain directory of its parent's filesystem.
    pub mounted: bool,
    /// `<driver>/RO`, `<driver>-layers/RO`, `<driver>-images`; `None` where absent.
    pub areas: [Option<Id>; 3],
}

/// A remote root opened by path, with what it is.
#[derive(Debug)]
pub struct Probed {
    pub root: OwnedFd,
    pub anchor: Anchor,
    /// The attributes of the layout directories the remote has (see [`LAYOUT_ZONES`]): the
    /// view shows them on its own directories in their places without asking the remote.
    pub layout: Vec<(Zone, libc::stat)>,
}

/// The layout directories whose attributes a probe reads, with their paths.
pub const LAYOUT_ZONES: [Zone; 5] = [
    Zone::DriverHome,
    Zone::DriverRo,
    Zone::LayersHome,
    Zone::LayersRo,
    Zone::Images,
];

impl Anchor {
    /// Opens the remote root at `path` and reads the identities of it and its areas.
    pub fn probe(path: &Path, driver: &str) -> Result<Probed, String> {
        let fail = |what: &str, e: Errno| {
            crate::layout::note_shortage(e as i32);
            format!("remote {what}: {e}")
        };
        let root = open_root(path).map_err(|e| fail("root", e))?;
        let st = store::stat_fd(root.as_fd()).map_err(|e| fail("root", e))?;
        let parent_dev = path
            .parent()
            .and_then(|p| nix::sys::stat::stat(p).ok())
            .map(|p| p.st_dev);
        let mounted = parent_dev.is_some_and(|dev| dev != st.st_dev);
        let (layers, images) = (format!("{driver}-layers"), format!("{driver}-images"));
        let paths: [Vec<&str>; 5] = [
            vec![driver],
            vec![driver, "RO"],
            vec![&layers],
            vec![&layers, "RO"],
            vec![&images],
        ];
        let mut layout = Vec::new();
        let mut found = [None; 5];
        for ((slot, parts), zone) in found.iter_mut().zip(&paths).zip(LAYOUT_ZONES) {
            *slot = stat_below(root.as_fd(), parts).map_err(|e| fail(&parts.join("/"), e))?;
            if let Some(st) = slot {
                layout.push((zone, *st));
            }
        }
        let id = |st: &Option<libc::stat>| st.map(|st| (st.st_dev, st.st_ino));
        let ids = [id(&found[1]), id(&found[3]), id(&found[4])];
        Ok(Probed {
            root,
            anchor: Anchor {
                root: (st.st_dev, st.st_ino),
                mounted,
                areas: ids,
            },
            layout,
        })
    }

    /// What changed between `self` and `now` such that the view's handles into the remote
    /// no longer name what the remote's path does; `None` if they still do. An area that
    /// appears where there was none is no such change: it is opened by path when needed.
    pub fn replaced_by(&self, now: &Anchor) -> Option<String> {
        if self.root != now.root {
            return Some(describe("root", self.root, now.root));
        }
        let names = ["<driver>/RO", "<driver>-layers/RO", "<driver>-images"];
        self.areas
            .iter()
            .zip(&now.areas)
            .zip(names)
            .find_map(|((was, is), name)| match (was, is) {
                (Some(was), Some(is)) if was != is => Some(describe(name, *was, *is)),
                (Some(_), None) => Some(format!("{name} is gone")),
                _ => None,
            })
    }

    /// Why the remote looks gone rather than replaced: it was a mountpoint and is now a
    /// plain directory of its parent's filesystem (the share was unmounted).
    pub fn unmounted_in(&self, now: &Anchor) -> Option<String> {
        (self.mounted && !now.mounted).then(|| {
            "it was a mounted filesystem and is now a plain directory (the share was \
             unmounted?)"
                .to_owned()
        })
    }
}

fn describe(what: &str, was: Id, is: Id) -> String {
    format!(
        "{what} was device {} inode {}, is device {} inode {}",
        was.0, was.1, is.0, is.1
    )
}

/// The attributes of the directory `parts` below `root`, not following symlinks; `None`
/// if it is not there.
fn stat_below(root: BorrowedFd<'_>, parts: &[&str]) -> Result<Option<libc::stat>, Errno> {
    match store::open_dir_below(root, parts)? {
        Some(dir) => Ok(Some(store::stat_fd(dir.as_fd())?)),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anchor(root: Id, areas: [Option<Id>; 3]) -> Anchor {
        Anchor {
            root,
            mounted: true,
            areas,
        }
    }

    #[test]
    fn a_new_area_is_not_a_replacement_but_a_changed_one_is() {
        let was = anchor((1, 2), [Some((1, 3)), None, None]);
        assert_eq!(was.replaced_by(&was), None);
        let grown = anchor((1, 2), [Some((1, 3)), Some((1, 4)), Some((1, 5))]);
        assert_eq!(was.replaced_by(&grown), None);
        let recreated = anchor((1, 2), [Some((1, 9)), None, None]);
        assert!(was.replaced_by(&recreated).unwrap().contains("<driver>/RO"));
        let gone = anchor((1, 2), [None, None, None]);
        assert!(was.replaced_by(&gone).unwrap().contains("gone"));
        let remounted = anchor((7, 2), [Some((7, 3)), None, None]);
        assert!(was.replaced_by(&remounted).unwrap().contains("root"));
        assert_eq!(was.unmounted_in(&remounted), None);
        let plain = Anchor {
            mounted: false,
            ..remounted
        };
        assert!(was.unmounted_in(&plain).is_some());
    }

    #[test]
    fn probing_reads_the_root_and_areas() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("overlay/RO")).unwrap();
        std::fs::create_dir_all(dir.path().join("overlay-images")).unwrap();
        let probed = Anchor::probe(dir.path(), "overlay").unwrap();
        assert!(probed.anchor.areas[0].is_some());
        assert!(probed.anchor.areas[1].is_none());
        assert!(probed.anchor.areas[2].is_some());
        assert!(
            !probed.anchor.mounted,
            "a temporary directory is no mountpoint"
        );
        assert!(Anchor::probe(&dir.path().join("missing"), "overlay").is_err());
    }
}
