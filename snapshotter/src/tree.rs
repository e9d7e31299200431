//! Removing a snapshot's directory tree. Image layers decide how deep their trees are, so
//! the walk keeps its own stack instead of recursing, and never follows a symlink.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Removes `path` and everything under it. What is already gone, or goes meanwhile (a
/// Cleanup and a Remove may race for one directory), is fine.
pub fn remove(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
        Ok(meta) if !meta.is_dir() => return gone_is_fine(fs::remove_file(path)),
        Ok(_) => {}
    }
    // (directory, whether its entries are already gone)
    let mut stack: Vec<(PathBuf, bool)> = vec![(path.to_owned(), false)];
    while let Some((dir, emptied)) = stack.pop() {
        if emptied {
            gone_is_fine(fs::remove_dir(&dir))?;
            continue;
        }
        stack.push((dir.clone(), true));
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                stack.push((entry.path(), false));
            } else {
                gone_is_fine(fs::remove_file(entry.path()))?;
            }
        }
    }
    Ok(())
}

fn gone_is_fine(r: io::Result<()>) -> io::Result<()> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_deep_trees_and_not_what_symlinks_point_at() {
        let tmp = tempfile::tempdir().unwrap();
        let keep = tmp.path().join("keep");
        fs::create_dir(&keep).unwrap();
        fs::write(keep.join("f"), b"x").unwrap();
        let top = tmp.path().join("top");
        fs::create_dir(&top).unwrap();
        let mut at = top.clone();
        for _ in 0..200 {
            at.push("dddddddddd");
            fs::create_dir(&at).unwrap();
        }
        fs::write(at.join("file"), b"x").unwrap();
        std::os::unix::fs::symlink(&keep, top.join("link")).unwrap();
        remove(&top).unwrap();
        assert!(!top.exists());
        assert!(keep.join("f").exists());
        remove(&tmp.path().join("missing")).unwrap();
    }
}
