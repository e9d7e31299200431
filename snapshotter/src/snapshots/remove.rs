//! Removal: a snapshot's record is forgotten first and its directory removed second, outside
//! the writer lock, so that a long removal holds up no other change. A directory a crash or a
//! failed removal left behind is no one's; `cleanup` (and start-up) remove it, and one that
//! cannot be removed never keeps the snapshotter down: it costs only its space.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::Snapshots;
use crate::error::Error;
use crate::meta::Backing;
use crate::tree;

impl Snapshots {
    /// Removes the snapshot `key`, which no other snapshot may have as its parent. A shared
    /// layer's files are never touched.
    pub fn remove(&self, key: &str) -> Result<(), Error> {
        let writer = self.writer.lock();
        let mut meta = (*self.current()).clone();
        let record = meta.get(key)?.clone();
        if meta.has_children(key) {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {key} is the parent of other snapshots"
            )));
        }
        meta.snapshots.remove(key);
        self.publish(meta)?;
        drop(writer);
        if record.backing == Backing::Local {
            self.discard(&self.dirs.dir(&record));
        }
        Ok(())
    }

    /// Removes the directories no snapshot owns: left by a crash, or by a removal that
    /// could not finish. One that cannot be removed does not stop the others; it fails the
    /// call, so that containerd logs that something was left.
    pub fn cleanup(&self) -> Result<(), Error> {
        let mut left = self.remove_orphans()?;
        if left.is_empty() {
            return Ok(());
        }
        let more = match left.len() - 1 {
            0 => String::new(),
            n => format!(" (and {n} more directories no snapshot owns)"),
        };
        let (dir, cause) = left.swap_remove(0);
        Err(Error::io(
            format!("removing {}{more}", dir.display()),
            cause,
        ))
    }

    /// Removes the directories no snapshot owns, and returns those it could not remove,
    /// each logged.
    pub(super) fn remove_orphans(&self) -> Result<Vec<(PathBuf, io::Error)>, Error> {
        let _writer = self.writer.lock();
        let meta = self.current();
        let owned: HashSet<PathBuf> = meta
            .snapshots
            .values()
            .filter(|r| r.backing == Backing::Local)
            .map(|r| self.dirs.dir(r))
            .collect();
        let mut left = Vec::new();
        for (_, dir) in self.dirs.all_snapshots() {
            let entries = fs::read_dir(&dir)
                .map_err(|e| Error::io(format!("reading {}", dir.display()), e))?;
            for entry in entries {
                let entry =
                    entry.map_err(|e| Error::io(format!("reading {}", dir.display()), e))?;
                let path = entry.path();
                if owned.contains(&path) {
                    continue;
                }
                tracing::info!(dir = %path.display(), "removing a directory no snapshot owns");
                if let Err(e) = tree::remove(&path) {
                    tracing::warn!(dir = %path.display(), error = %e, "cannot remove a directory no snapshot owns; leaving it");
                    left.push((path, e));
                }
            }
        }
        Ok(left)
    }

    /// Removes a directory that is no longer wanted; a failure is left to cleanup.
    pub(super) fn discard(&self, dir: &Path) {
        if let Err(e) = tree::remove(dir) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(dir = %dir.display(), error = %e, "left for cleanup");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::dirs::Config;

    /// Unmounts what a test mounted, also when the test fails.
    struct Unmount(PathBuf);

    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }

    /// A mount left in a directory no snapshot owns keeps that directory from being
    /// removed; the snapshotter starts all the same, removes the other leftovers, and the
    /// next snapshot passes over the id the leftover holds.
    #[test]
    fn a_leftover_that_cannot_be_removed_does_not_keep_the_snapshotter_down() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let stuck = root.join("snapshots/1/fs");
        fs::create_dir_all(&stuck).unwrap();
        fs::create_dir_all(root.join("snapshots/2/fs/deep")).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "none"])
            .arg(&stuck)
            .status()
            .unwrap();
        assert!(mounted.success(), "mounting a tmpfs on {}", stuck.display());
        let mount = Unmount(stuck.clone());
        fs::write(stuck.join("kept"), b"x").unwrap();

        let config = Config::new(&root);
        let snapshots = Snapshots::open(&config).expect("starting beside a stuck leftover");
        assert!(!root.join("snapshots/2").exists());
        assert!(
            stuck.join("kept").exists(),
            "what is mounted is not touched"
        );
        let left = snapshots.cleanup().unwrap_err().to_string();
        assert!(left.contains("snapshots/1"), "{left}");

        snapshots.prepare("k", "", BTreeMap::new()).unwrap();
        assert_ne!(snapshots.stat("k").unwrap().record.id, 1);

        drop(mount);
        snapshots.cleanup().unwrap();
        assert!(!root.join("snapshots/1").exists());
    }
}
