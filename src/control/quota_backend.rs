//! The layerfs backend of the quota decision ([`crate::quota::storage`]): directories in a
//! running layerfs mount, which enforces their quotas and is told of them over its control
//! socket. It lives here, at the edge, because it speaks the socket; the decision itself
//! stays in the core.

use std::path::{Path, PathBuf};

use super::client::{Client, ClientError};
use crate::fs::kernel_mount::FSTYPE;
use crate::quota::storage::{key_for, PlainDir, Snapshotter, StorageError};
use crate::store::mountinfo::{self, Mount};

/// Directories in a running layerfs mount, which enforces quotas itself and is told about
/// them over its control socket.
#[derive(Debug, Clone)]
pub struct Layerfs {
    pub mountpoint: PathBuf,
}

impl Layerfs {
    /// The backend for the mount at `mountpoint`, resolved as the control socket's name is.
    pub fn new(mountpoint: &Path) -> Layerfs {
        Layerfs {
            mountpoint: mountinfo::resolve_mountpoint(mountpoint),
        }
    }

    /// `dir` relative to the mountpoint, as the control protocol names directories.
    pub fn relative(&self, dir: &Path) -> Result<String, StorageError> {
        key_for(&self.mountpoint, dir)
    }
}

impl Snapshotter for Layerfs {
    fn name(&self) -> &str {
        "layerfs"
    }

    fn root(&self) -> &Path {
        &self.mountpoint
    }

    fn supported_quota(&self) -> bool {
        // Canonical, as mountinfo shows it; a path that no longer resolves is not mounted.
        let Ok(mountpoint) = std::fs::canonicalize(&self.mountpoint) else {
            return false;
        };
        top_mount_is_layerfs(&mountinfo::current(), &mountpoint)
    }

    fn why_unsupported(&self) -> String {
        format!(
            "no layerfs is mounted at {} (nothing of type {FSTYPE} there)",
            self.mountpoint.display()
        )
    }

    fn apply_quota(&self, dir: &Path, limit: u64, inodes: Option<u64>) -> Result<(), StorageError> {
        let info = Client::new(&self.mountpoint)
            .quota_set(&self.relative(dir)?, limit, inodes)
            .map_err(|e| StorageError::Backend(Box::new(e)))?;
        let failed = |reason: String| StorageError::Apply {
            backend: self.name().to_owned(),
            dir: dir.to_owned(),
            reason,
        };
        // The mount says what it now enforces; anything else than what was asked is a
        // quota that did not take, and must not pass for one that did.
        if info.limit != limit || info.inode_limit != inodes {
            return Err(failed(format!(
                "the mount enforces {} bytes and {:?} inodes, not {limit} and {inodes:?}",
                info.limit, info.inode_limit
            )));
        }
        Ok(())
    }
}

/// The backend for directories under `path`: [`Layerfs`] when the deepest mount containing
/// it is a layerfs mount, [`PlainDir`] rooted at `path` otherwise.
pub fn backend_for(path: &Path) -> Box<dyn Snapshotter> {
    let resolved = mountinfo::resolve_mountpoint(path);
    match layerfs_mount_containing(&mountinfo::current(), &resolved) {
        Some(mountpoint) => Box::new(Layerfs { mountpoint }),
        None => Box::new(PlainDir { root: resolved }),
    }
}

/// The layerfs mount `path` is in, when the deepest mount containing it is one.
pub fn layerfs_mount_of(path: &Path) -> Option<PathBuf> {
    let resolved = mountinfo::resolve_mountpoint(path);
    layerfs_mount_containing(&mountinfo::current(), &resolved)
}

/// Whether the mount on top at exactly `mountpoint` (the last one listed there) is layerfs.
fn top_mount_is_layerfs(mounts: &[Mount], mountpoint: &Path) -> bool {
    mounts
        .iter()
        .rfind(|m| m.point == mountpoint)
        .is_some_and(|m| m.fstype == FSTYPE)
}

/// The layerfs mount that `path` is in, if the deepest mount containing it is one.
fn layerfs_mount_containing(mounts: &[Mount], path: &Path) -> Option<PathBuf> {
    let mut best: Option<(&Path, bool)> = None;
    for Mount { point, fstype, .. } in mounts {
        if !path.starts_with(point) {
            continue;
        }
        let deeper = best
            .as_ref()
            .is_none_or(|(b, _)| point.components().count() >= b.components().count());
        // `>=`: a later mount at the same point covers the earlier one.
        if deeper {
            best = Some((point, fstype == FSTYPE));
        }
    }
    best.and_then(|(point, layerfs)| layerfs.then(|| point.to_owned()))
}

impl From<ClientError> for StorageError {
    fn from(e: ClientError) -> StorageError {
        StorageError::Backend(Box::new(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:50 / /var/lib/isulad/storage rw,nosuid,nodev shared:20 - fuse.layerfs /srv/remote rw,user_id=0
41 40 0:51 / /var/lib/isulad/storage/overlay/c1/merged rw shared:21 - overlay overlay rw
50 22 0:60 / /mnt/with\\040space rw - fuse.layerfs r rw
60 22 0:70 / /mnt/stacked rw - fuse.layerfs r rw
61 22 0:71 / /mnt/stacked rw - tmpfs tmpfs rw
";

    #[test]
    fn mountinfo_finds_layerfs_mounts() {
        let mounts: Vec<Mount> = mountinfo::parse(MOUNTINFO).collect();
        let p = Path::new;
        assert!(top_mount_is_layerfs(&mounts, p("/var/lib/isulad/storage")));
        assert!(top_mount_is_layerfs(&mounts, p("/mnt/with space")));
        assert!(!top_mount_is_layerfs(&mounts, p("/mnt/stacked")));
        assert!(!top_mount_is_layerfs(&mounts, p("/var/lib/isulad")));
        assert!(!top_mount_is_layerfs(&mounts, p("/")));
        let containing = |path: &str| layerfs_mount_containing(&mounts, p(path));
        assert_eq!(
            containing("/var/lib/isulad/storage/overlay/c2"),
            Some(PathBuf::from("/var/lib/isulad/storage"))
        );
        assert_eq!(
            containing("/var/lib/isulad/storage"),
            Some(PathBuf::from("/var/lib/isulad/storage"))
        );
        // Components, not string prefixes.
        assert_eq!(containing("/var/lib/isulad/storage2"), None);
        // The deepest mount decides: an overlay inside the view is not the view.
        assert_eq!(
            containing("/var/lib/isulad/storage/overlay/c1/merged/x"),
            None
        );
        assert_eq!(containing("/mnt/stacked/a"), None);
        assert_eq!(
            containing("/mnt/with space/overlay"),
            Some(PathBuf::from("/mnt/with space"))
        );
        assert_eq!(containing("/home"), None);
    }

    #[test]
    fn backend_for_a_plain_directory_is_plain() {
        let tmp = tempfile::tempdir().unwrap();
        let b = backend_for(tmp.path());
        assert_eq!(b.name(), "plain directory");
        assert!(!b.supported_quota());
        assert_eq!(b.root(), std::fs::canonicalize(tmp.path()).unwrap());
        // A layerfs backend with nothing mounted does not claim support.
        let l = Layerfs::new(tmp.path());
        assert!(!l.supported_quota());
        assert!(l.why_unsupported().contains("no layerfs is mounted"));
    }

    #[test]
    fn layerfs_names_dirs_relative_to_its_mountpoint() {
        let l = Layerfs {
            mountpoint: PathBuf::from("/mnt/view"),
        };
        assert_eq!(
            l.relative(Path::new("/mnt/view/overlay/c1")).unwrap(),
            "overlay/c1"
        );
        for outside in ["/mnt/view", "/mnt/other/x", "/mnt/view/../x", "overlay/c1"] {
            let e = l.relative(Path::new(outside)).unwrap_err();
            assert!(matches!(e, StorageError::Outside { .. }), "{outside}: {e}");
        }
    }

    #[test]
    fn layerfs_apply_without_a_mount_fails_clearly() {
        let tmp = tempfile::tempdir().unwrap();
        let l = Layerfs::new(tmp.path());
        let e = l
            .apply_quota(&l.mountpoint.join("overlay/c1"), 1, None)
            .unwrap_err();
        assert!(matches!(e, StorageError::Backend(_)), "{e}");
    }
}
