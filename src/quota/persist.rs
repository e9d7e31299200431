//! The registry of quota roots, kept in local so that limits survive remounts and crashes.
//!
//! One JSON file at local's root, hidden from the view by its reserved name. It is replaced
//! whole (written to a temporary name, synced, renamed, directory synced), so a crash leaves
//! the old registry or the new one. Usage is saved too, but only to be compared at mount:
//! the count that counts is recomputed from disk ([`super::scan`]).

use std::ffi::{CStr, CString};
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use serde::{Deserialize, Serialize};

use super::backend::Backend;
use crate::store;

/// The registry's name in local's root (the view hides it: `store::reserved::REGISTRY_NAME`).
pub const REGISTRY: &CStr = c".layerfs-quota.json";

/// The name the registry is written under before it is renamed into place: one of the view's
/// temporary names (`store::reserved::temp_prefix`), so that no user file can have it and a
/// crash before the rename leaves nothing the view shows.
fn registry_temp() -> CString {
    let name = [store::reserved::temp_prefix(), b"quota.json"].concat();
    CString::new(name).expect("temporary names hold no NUL")
}
/// A registry larger than this is not ours.
const MAX_REGISTRY: u64 = 64 << 20;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registry {
    pub version: u32,
    pub roots: Vec<Entry>,
}

/// One root as saved.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Entry {
    /// Relative to local's root; empty for the root itself.
    pub path: PathBuf,
    pub limit: u64,
    pub inode_limit: Option<u64>,
    /// Usage when saved.
    pub used: u64,
    pub inodes_used: u64,
    /// Who enforces the limit; registries from before kernel quotas say nothing: `fuse`.
    pub backend: Backend,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("reading the quota registry: {0}")]
    Io(#[from] std::io::Error),
    #[error("reading the quota registry: {0}")]
    Sys(#[from] Errno),
    #[error("the quota registry is not valid JSON: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("the quota registry is larger than {MAX_REGISTRY} bytes")]
    TooLarge,
}

/// Reads the registry in the local root `local`; none yet is an empty one.
pub fn load(local: BorrowedFd<'_>) -> Result<Registry, RegistryError> {
    let fd = match store::open_at(local, REGISTRY, OFlag::O_RDONLY, 0) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(Registry::default()),
        Err(e) => return Err(e.into()),
    };
    let mut text = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_REGISTRY + 1)
        .read_to_end(&mut text)?;
    if text.len() as u64 > MAX_REGISTRY {
        return Err(RegistryError::TooLarge);
    }
    Ok(serde_json::from_slice(&text)?)
}

/// Replaces the registry in the local root `local` with `registry`, durably.
pub fn save(local: BorrowedFd<'_>, registry: &Registry) -> Result<(), RegistryError> {
    let mut text = serde_json::to_vec_pretty(registry)?;
    text.push(b'\n');
    let temp = registry_temp();
    let fd = store::open_at(
        local,
        temp.as_c_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC,
        0o600,
    )?;
    let mut file = std::fs::File::from(fd);
    file.write_all(&text)?;
    file.sync_all()?;
    drop(file);
    nix::fcntl::renameat(local, temp.as_c_str(), local, REGISTRY)?;
    let dir = store::reopen(local, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
    nix::unistd::fsync(dir.as_fd())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_is_written_under_a_reserved_temporary_name() {
        store::reserved::tag_temp_names(0x5eed);
        let temp = registry_temp();
        assert!(
            store::reserved::is_reserved_name(temp.to_bytes()),
            "{temp:?} is not reserved: a crash before its rename would leave it in the view"
        );
    }

    #[test]
    fn saves_and_loads_back() {
        let tmp = tempfile::tempdir().unwrap();
        let local = crate::store::open_root(tmp.path()).unwrap();
        assert_eq!(load(local.as_fd()).unwrap(), Registry::default());
        let registry = Registry {
            version: 1,
            roots: vec![Entry {
                path: "overlay/c1".into(),
                limit: 8 << 20,
                inode_limit: Some(10),
                used: 4096,
                inodes_used: 1,
                backend: Backend::Btrfs,
            }],
        };
        save(local.as_fd(), &registry).unwrap();
        save(local.as_fd(), &registry).unwrap();
        assert_eq!(load(local.as_fd()).unwrap(), registry);
        let names: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [".layerfs-quota.json"]);
    }

    #[test]
    fn a_damaged_registry_is_an_error_not_an_empty_one() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join(".layerfs-quota.json"), b"{\"roots\": [").unwrap();
        let local = crate::store::open_root(tmp.path()).unwrap();
        assert!(matches!(
            load(local.as_fd()),
            Err(RegistryError::Malformed(_))
        ));
    }
}
