//! Putting a finished directory in place: temporary names, the rename that publishes, and
//! the leftovers of publishers that died.
//!
//! Every object is built under a temporary name in the area it belongs to, synced, and then
//! renamed to its id. A reader lists the areas and takes only 64-hex names as ids, so a
//! temporary name (dot-prefixed, never 64 hex) is garbage to it, and the rename is the one
//! moment an object appears, complete. The name records who builds it,
//! `.layerfs-publish@<host>@<pid>@<id>`, so that a later run can tell a dead publisher's
//! leftover from a live one's work: on this host by asking whether the process lives, for
//! another host by age (a live publisher touches its temporary directory as it goes).

use std::ffi::CString;
use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use nix::errno::Errno;

use super::error::{io_at, sys_at, Result};

/// What every temporary name starts with.
pub(crate) const TEMP_PREFIX: &str = ".layerfs-publish@";

/// A temporary directory older than this, of a publisher on another host, is a leftover.
pub(crate) const STALE_AFTER: Duration = Duration::from_secs(3600);

/// How often a publisher touches its temporary directory while filling it.
const HEARTBEAT: Duration = Duration::from_secs(60);

/// This host's name, as temporary names carry it: no `@` or `/`, never empty.
pub(crate) fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or
    // truncates, and the last byte is kept as a terminator.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(0);
    let name: String = if rc == 0 {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::new()
    };
    let clean: String = name
        .chars()
        .map(|c| {
            if c == '@' || c == '/' || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect();
    if clean.is_empty() {
        "unknown".to_owned()
    } else {
        clean
    }
}

/// The temporary name under which this process builds object `id`.
pub(crate) fn temp_name(host: &str, id: &str) -> String {
    format!("{TEMP_PREFIX}{host}@{}@{id}", std::process::id())
}

/// A directory being built under a temporary name; removed on drop unless placed.
#[derive(Debug)]
pub(crate) struct TempDir {
    pub path: PathBuf,
    touched: Instant,
    placed: bool,
}

impl TempDir {
    /// Creates `<area>/<temp name>` with `mode`. A directory of that name can only be a
    /// leftover of an earlier process with this pid, so it is removed first.
    pub fn create(area: &Path, host: &str, id: &str, mode: u32) -> Result<TempDir> {
        let path = area.join(temp_name(host, id));
        if fs::symlink_metadata(&path).is_ok() {
            remove_tree(&path)?;
        }
        fs::DirBuilder::new()
            .mode(mode)
            .create(&path)
            .map_err(io_at(&path))?;
        set_mode(&path, mode)?;
        Ok(TempDir {
            path,
            touched: Instant::now(),
            placed: false,
        })
    }

    /// Refreshes the directory's mtime now and then, so that a publisher on another host
    /// does not take a long copy for a leftover.
    pub fn heartbeat(&mut self) {
        if self.touched.elapsed() < HEARTBEAT {
            return;
        }
        self.touched = Instant::now();
        if let Ok(c) = CString::new(self.path.as_os_str().as_bytes()) {
            // SAFETY: a valid C string and a null times pointer (meaning "now").
            unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), std::ptr::null(), 0) };
        }
    }

    /// Renames the directory to `<area>/<id>`, where it must not exist yet, and syncs the
    /// area. `Ok(false)`: another publisher got there first; this copy is removed.
    pub fn place(mut self, target: &Path) -> Result<bool> {
        sync_dir(&self.path)?;
        match rename_noreplace(&self.path, target) {
            Ok(()) => {
                self.placed = true;
                let area = target.parent().unwrap_or(Path::new("/"));
                sync_dir(area)?;
                Ok(true)
            }
            Err(Errno::EEXIST | Errno::ENOTEMPTY) => {
                tracing::debug!(target = %target.display(), "another publisher placed it first");
                Ok(false)
            }
            Err(e) => Err(sys_at(target)(e)),
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.placed {
            if let Err(e) = remove_tree(&self.path) {
                tracing::warn!(path = %self.path.display(), error = %e, "temporary directory left behind");
            }
        }
    }
}

/// `rename` that never replaces: `RENAME_NOREPLACE` where the filesystem has it, else a
/// plain rename, which for directories fails on a non-empty target. (NFS has no rename
/// flags; an empty target directory there is replaced, which no reader takes as ready.)
fn rename_noreplace(from: &Path, to: &Path) -> Result<(), Errno> {
    let from_c = CString::new(from.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)?;
    let to_c = CString::new(to.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)?;
    // SAFETY: valid C strings; renameat2 takes no other pointers.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from_c.as_ptr(),
            libc::AT_FDCWD,
            to_c.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    match Errno::result(rc) {
        Ok(_) => Ok(()),
        Err(Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) => {
            // SAFETY: as above.
            Errno::result(unsafe { libc::rename(from_c.as_ptr(), to_c.as_ptr()) }).map(drop)
        }
        Err(e) => Err(e),
    }
}

/// Creates `dir` and its missing parents with `mode`, syncing each parent it added to.
pub(crate) fn ensure_dir(dir: &Path, mode: u32) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        ensure_dir(parent, 0o755)?;
    }
    match fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => return Ok(()),
        Err(e) => return Err(io_at(dir)(e)),
    }
    if let Some(parent) = dir.parent() {
        sync_dir(parent)?;
    }
    Ok(())
}

/// `fsync` of a directory.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    crate::journal::sync_dir(dir).map_err(io_at(dir))
}

pub(crate) fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io_at(path))
}

/// Writes a new file `path` with `mode` and `data`, synced.
pub(crate) fn write_file(path: &Path, mode: u32, data: &[u8]) -> Result<()> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_at(path))?;
    f.write_all(data).map_err(io_at(path))?;
    // The umask may have cut the mode down.
    // SAFETY: a valid open fd.
    Errno::result(unsafe { libc::fchmod(f.as_raw_fd(), mode) }).map_err(sys_at(path))?;
    f.sync_all().map_err(io_at(path))
}

/// Copies the regular file `from` to the new file `to` with `mode`, synced.
pub(crate) fn copy_file(from: &Path, to: &Path, mode: u32) -> Result<()> {
    let src = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(from)
        .map_err(io_at(from))?;
    let len = src.metadata().map_err(io_at(from))?.len();
    let dst = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(to)
        .map_err(io_at(to))?;
    crate::store::copy::copy_data(src.as_fd(), dst.as_fd(), len).map_err(sys_at(to))?;
    // SAFETY: a valid open fd.
    Errno::result(unsafe { libc::fchmod(dst.as_raw_fd(), mode) }).map_err(sys_at(to))?;
    dst.sync_all().map_err(io_at(to))
}

/// Removes a tree, never following a symlink in it. A tree already gone is fine.
pub(crate) fn remove_tree(path: &Path) -> Result<()> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_at(path)(e)),
        Ok(m) if m.is_dir() => match fs::remove_dir_all(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_at(path)(e)),
            _ => Ok(()),
        },
        Ok(_) => fs::remove_file(path).map_err(io_at(path)),
    }
}

/// Who left a temporary name.
#[derive(Debug, PartialEq, Eq)]
struct Owner<'a> {
    host: &'a str,
    pid: i32,
}

fn owner_of(name: &str) -> Option<Owner<'_>> {
    let rest = name.strip_prefix(TEMP_PREFIX)?;
    let mut parts = rest.split('@');
    let host = parts.next()?;
    let pid = parts.next()?.parse().ok()?;
    Some(Owner { host, pid })
}

/// Whether process `pid` of this host lives (a process we may not signal lives too).
fn alive(pid: i32) -> bool {
    pid > 0
        && !matches!(
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
            Err(Errno::ESRCH)
        )
}

/// Removes the temporary directories of dead publishers from `area`: on this host those
/// whose process is gone, of other hosts those untouched for [`STALE_AFTER`]. A live
/// publisher's directory is never touched. Returns how many were removed.
pub(crate) fn remove_stale_temps(area: &Path, host: &str) -> Result<usize> {
    let entries = match fs::read_dir(area) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io_at(area)(e)),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry.map_err(io_at(area))?;
        let name = entry.file_name();
        let Some(owner) = name.to_str().and_then(owner_of) else {
            continue;
        };
        let stale = if owner.host == host {
            owner.pid != std::process::id() as i32 && !alive(owner.pid)
        } else {
            let age = entry
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|t| SystemTime::now().duration_since(t).ok());
            age.is_some_and(|age| age > STALE_AFTER)
        };
        if stale {
            let path = area.join(&name);
            tracing::info!(path = %path.display(), "removing a dead publisher's temporary directory");
            remove_tree(&path)?;
            removed += 1;
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "1493467ad4be5c54729bcacea19006078604b634f31405d7af3aa9d264bde610";

    #[test]
    fn temp_names_are_never_ids_and_name_their_owner() {
        let name = temp_name("node-1.example", ID);
        assert!(name.starts_with('.'));
        assert!(!crate::layout::is_object_id(&name));
        let owner = owner_of(&name).unwrap();
        assert_eq!(owner.host, "node-1.example");
        assert_eq!(owner.pid, std::process::id() as i32);
        assert_eq!(owner_of("random"), None);
        assert_eq!(owner_of(".layerfs-publish@h@notapid@x"), None);
    }

    #[test]
    fn only_dead_publishers_lose_their_temps() {
        let area = tempfile::tempdir().unwrap();
        let host = host_name();
        // A live process of this host (this one's parent), a dead one, another host's
        // fresh temp and another host's old one.
        let live = format!("{TEMP_PREFIX}{host}@{}@{ID}", nix::unistd::getppid());
        let dead = format!("{TEMP_PREFIX}{host}@{}@{ID}", i32::MAX - 1);
        let fresh = format!("{TEMP_PREFIX}elsewhere@1@{ID}");
        let old = format!("{TEMP_PREFIX}elsewhere@2@{ID}");
        for name in [&live, &dead, &fresh, &old] {
            fs::create_dir(area.path().join(name)).unwrap();
            fs::write(area.path().join(name).join("f"), b"x").unwrap();
        }
        let long_ago = SystemTime::now() - STALE_AFTER - Duration::from_secs(60);
        fs::File::open(area.path().join(&old))
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
        assert_eq!(remove_stale_temps(area.path(), &host).unwrap(), 2);
        assert!(area.path().join(&live).exists());
        assert!(area.path().join(&fresh).exists());
        assert!(!area.path().join(&dead).exists());
        assert!(!area.path().join(&old).exists());
    }

    #[test]
    fn a_placed_dir_never_replaces_another() {
        let area = tempfile::tempdir().unwrap();
        let target = area.path().join(ID);
        let first = TempDir::create(area.path(), "h", ID, 0o700).unwrap();
        fs::write(first.path.join("mine"), b"1").unwrap();
        assert!(first.place(&target).unwrap());
        let second = TempDir::create(area.path(), "h", ID, 0o700).unwrap();
        fs::write(second.path.join("theirs"), b"2").unwrap();
        let second_path = second.path.clone();
        assert!(!second.place(&target).unwrap());
        assert!(target.join("mine").exists());
        assert!(!second_path.exists(), "the loser's copy is removed");
    }
}
