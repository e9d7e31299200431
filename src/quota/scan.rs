//! Usage of a directory tree in local, counted from disk: what a quota root holds after a
//! crash, or when a quota is first set on a directory already in use.
//!
//! The count is the one the view keeps while it runs: `st_blocks` of every inode under the
//! directory, the directory itself included and hard links counted once, plus the number
//! of those inodes. The walk never follows a symlink and never leaves local's filesystem.

use std::collections::HashSet;
use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;

use super::table::Usage;
use crate::store::reserved;
use crate::store::{self, Kind};

/// Allocated bytes of one object, as its stat tells.
pub fn allocated(st: &libc::stat) -> u64 {
    (st.st_blocks.max(0) as u64) * 512
}

/// What a walk found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tree {
    pub usage: Usage,
    /// Some file in it has more than one name (which may be outside the tree).
    pub hard_linked: bool,
}

/// Walks the tree under `dir` (an `O_PATH` handle is enough) and adds up its usage.
/// Entries that vanish during the walk are skipped.
pub fn usage(dir: BorrowedFd<'_>) -> Result<Usage, Errno> {
    tree(dir).map(|t| t.usage)
}

/// Like [`usage`], and tells whether any file in the tree has other names.
///
/// Depth first, holding open only the directories on the way down (each with the names of
/// its subdirectories still to walk): a directory with thousands of subdirectories costs
/// their names, not a descriptor each, so the walk leaves the daemon's descriptors to the
/// requests it serves meanwhile.
pub fn tree(dir: BorrowedFd<'_>) -> Result<Tree, Errno> {
    let top = store::stat_fd(dir)?;
    let mut seen = HashSet::new();
    let mut total = Tree {
        usage: Usage {
            bytes: allocated(&top),
            inodes: 1,
        },
        hard_linked: false,
    };
    let subdirs = walk(dir, top.st_dev, &mut seen, &mut total)?;
    let mut down: Vec<(Option<OwnedFd>, Vec<CString>)> = vec![(None, subdirs)];
    while let Some((at, subdirs)) = down.last_mut() {
        let Some(name) = subdirs.pop() else {
            down.pop();
            continue;
        };
        let at = at.as_ref().map_or(dir, |fd| fd.as_fd());
        let sub = match store::open_dir_at(at, &name) {
            Ok(sub) => sub,
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(e),
        };
        // Something may have been mounted on it since its entry was counted.
        if store::stat_fd(sub.as_fd())?.st_dev != top.st_dev {
            continue;
        }
        match walk(sub.as_fd(), top.st_dev, &mut seen, &mut total) {
            Ok(subdirs) => down.push((Some(sub), subdirs)),
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

/// Adds up the entries of `dir`; returns the names of its subdirectories on `dev`.
fn walk(
    dir: BorrowedFd<'_>,
    dev: u64,
    seen: &mut HashSet<u64>,
    total: &mut Tree,
) -> Result<Vec<CString>, Errno> {
    let mut subdirs = Vec::new();
    for entry in store::read_dir(dir)? {
        let Ok(name) = store::cname(&entry.name) else {
            continue;
        };
        // Copy-up's temporary files are the view's, in flight or left by a crash.
        if reserved::is_reserved_name(name.to_bytes()) {
            continue;
        }
        let st = match store::stat_at(dir, &name) {
            Ok(st) => st,
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(e),
        };
        if st.st_dev != dev {
            continue;
        }
        let is_dir = Kind::from_mode(st.st_mode) == Kind::Dir;
        if !is_dir && st.st_nlink > 1 {
            total.hard_linked = true;
            if !seen.insert(st.st_ino) {
                continue;
            }
        }
        total.usage.bytes += allocated(&st);
        total.usage.inodes += 1;
        if is_dir {
            subdirs.push(name);
        }
    }
    Ok(subdirs)
}

/// The block size estimates round to: the file's own, within sane bounds.
pub(super) fn block_size(st: &libc::stat) -> u64 {
    (st.st_blksize as u64).clamp(512, 1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn du(path: &std::path::Path) -> Usage {
        let mut seen = HashSet::new();
        let mut total = Usage::default();
        let mut stack = vec![path.to_owned()];
        while let Some(p) = stack.pop() {
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.nlink() > 1 && !m.is_dir() && !seen.insert(m.ino()) {
                continue;
            }
            total.bytes += m.blocks() * 512;
            total.inodes += 1;
            if m.is_dir() {
                for e in std::fs::read_dir(&p).unwrap() {
                    stack.push(e.unwrap().path());
                }
            }
        }
        total
    }

    #[test]
    fn counts_blocks_and_inodes_once_per_inode() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/data"), vec![7u8; 100_000]).unwrap();
        std::fs::hard_link(root.join("a/b/data"), root.join("again")).unwrap();
        std::os::unix::fs::symlink("a/b/data", root.join("link")).unwrap();
        let sparse = std::fs::File::create(root.join("sparse")).unwrap();
        sparse.set_len(1 << 30).unwrap();
        let fd = crate::store::open_root(&root).unwrap();
        let got = usage(fd.as_fd()).unwrap();
        assert_eq!(got, du(&root));
        assert!(tree(fd.as_fd()).unwrap().hard_linked);
        let plain = crate::store::open_root(&root.join("a/b/..")).unwrap();
        assert!(
            tree(plain.as_fd()).unwrap().hard_linked,
            "data has a name outside"
        );
        // root, a, b, data (once), link, sparse.
        assert_eq!(got.inodes, 6);
        assert!(got.bytes < 1 << 20, "sparse space is free: {got:?}");
    }

    #[test]
    fn temporary_names_are_not_counted() {
        use std::os::unix::ffi::OsStringExt;
        let tmp = tempfile::tempdir().unwrap();
        // With the process's tag, whichever test set it: the prefix is the process's.
        let name = [crate::store::reserved::temp_prefix(), b"x"].concat();
        let name = &*std::ffi::OsString::from_vec(name);
        std::fs::write(tmp.path().join(name), vec![1u8; 65_536]).unwrap();
        let fd = crate::store::open_root(tmp.path()).unwrap();
        assert_eq!(usage(fd.as_fd()).unwrap().inodes, 1);
    }
}
