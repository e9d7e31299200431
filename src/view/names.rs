//! Putting objects in and out of names in local so that a whiteout and the object it
//! replaces (or that replaces it) are swapped in one rename.
//!
//! A whiteout is what keeps a deleted remote entry deleted. Removing it first and then
//! making the new entry would let the remote entry show again if the second step failed
//! (a full disk, a refused attribute) or the daemon died in between. So a new object is
//! made under a temporary name and renamed over the whiteout; a directory, which cannot be
//! renamed over a non-directory, is exchanged with it (`RENAME_EXCHANGE`) and the whiteout,
//! now under the temporary name, removed. Where the filesystem has no `RENAME_EXCHANGE` or
//! `RENAME_WHITEOUT` (NFS), the fallbacks below keep the same guarantee for everything but
//! directories, which are left with a window between two steps, as documented at each.

use std::ffi::CStr;
use std::os::fd::{AsFd, BorrowedFd};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, RenameFlags};
use nix::unistd::UnlinkatFlags;

use super::marker;
use crate::store;

/// A fresh name under [`marker::temp_prefix`], unique within the process.
pub(super) fn temp_name() -> std::ffi::CString {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let prefix = String::from_utf8_lossy(marker::temp_prefix());
    std::ffi::CString::new(format!("{prefix}{}.{n}", std::process::id())).unwrap_or_default()
}

/// Removes whatever `name` in `dir` is, file or empty directory.
pub fn remove_any(dir: BorrowedFd<'_>, name: &CStr, is_dir: bool) -> Result<(), Errno> {
    let how = if is_dir {
        UnlinkatFlags::RemoveDir
    } else {
        UnlinkatFlags::NoRemoveDir
    };
    nix::unistd::unlinkat(dir, name, how)
}

/// Moves the object made under `temp` to `name`, where a whiteout stands: the whiteout is
/// gone and the object in place in one step, or nothing changed.
pub fn replace_whiteout(
    dir: BorrowedFd<'_>,
    temp: &CStr,
    name: &CStr,
    is_dir: bool,
) -> Result<(), Errno> {
    if !is_dir {
        return nix::fcntl::renameat2(dir, temp, dir, name, RenameFlags::empty());
    }
    match nix::fcntl::renameat2(dir, temp, dir, name, RenameFlags::RENAME_EXCHANGE) {
        Ok(()) => {
            // The whiteout now has the temporary name: a leftover if this fails, never seen.
            let _ = remove_any(dir, temp, false);
            Ok(())
        }
        // No exchange on this filesystem: the remote entry shows between the two steps.
        Err(Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) => {
            nix::unistd::unlinkat(dir, name, UnlinkatFlags::NoRemoveDir)?;
            nix::fcntl::renameat2(dir, temp, dir, name, RenameFlags::RENAME_NOREPLACE)
        }
        Err(e) => Err(e),
    }
}

/// Replaces the object `name` of `dir` with a whiteout in one step. A directory (which
/// shows no entries, but may hold whiteouts of its own) trades places with the whiteout and
/// is then emptied and removed under the temporary name: its whiteouts never go while it
/// still merges with what is below it. Returns how many whiteouts it held.
pub fn whiteout_over(dir: BorrowedFd<'_>, name: &CStr, is_dir: bool) -> Result<usize, Errno> {
    let temp = temp_name();
    marker::make_whiteout(dir, &temp)?;
    let swapped = if is_dir {
        nix::fcntl::renameat2(
            dir,
            temp.as_c_str(),
            dir,
            name,
            RenameFlags::RENAME_EXCHANGE,
        )
    } else {
        nix::fcntl::renameat2(dir, temp.as_c_str(), dir, name, RenameFlags::empty())
    };
    match swapped {
        Ok(()) if is_dir => {
            // Out of the view now: a failure here leaves a leftover, never a change.
            let cleared = store::open_dir_at(dir, &temp).and_then(|fd| empty_out(fd.as_fd()));
            let _ = remove_any(dir, &temp, true);
            Ok(cleared.unwrap_or(0))
        }
        Ok(()) => Ok(0),
        // No exchange: the directory goes first, and the remote one shows until the
        // whiteout takes its place.
        Err(Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) if is_dir => {
            let placed = store::open_dir_at(dir, name)
                .and_then(|fd| empty_out(fd.as_fd()))
                .and_then(|cleared| {
                    remove_any(dir, name, true)?;
                    nix::fcntl::renameat2(
                        dir,
                        temp.as_c_str(),
                        dir,
                        name,
                        RenameFlags::RENAME_NOREPLACE,
                    )?;
                    Ok(cleared)
                });
            if placed.is_err() {
                let _ = remove_any(dir, &temp, false);
            }
            placed
        }
        Err(e) => {
            let _ = remove_any(dir, &temp, false);
            Err(e)
        }
    }
}

/// Deletes the whiteouts (and the view's temporary leftovers) of a local directory that
/// shows no entries; returns how many whiteouts there were.
pub fn empty_out(dir: BorrowedFd<'_>) -> Result<usize, Errno> {
    let mut cleared = 0;
    for e in store::read_dir(dir)? {
        let Ok(c) = store::cname(&e.name) else {
            continue;
        };
        let ours = marker::is_reserved_name(c.to_bytes());
        if e.whiteout && !marker::is_device_at(dir, &c) || ours {
            match remove_any(dir, &c, e.kind == crate::store::Kind::Dir) {
                // A leftover directory of ours that is not empty stays, out of sight.
                Ok(()) | Err(Errno::ENOTEMPTY) if ours => {}
                Ok(()) => cleared += 1,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(cleared)
}

/// Renames `from` in `from_dir` to `to` in `to_dir` and leaves a whiteout at `from`, for
/// filesystems without `RENAME_WHITEOUT`. A non-directory is linked at its new name first,
/// so that it is never missing and the old name never shows what is below it; a crash can
/// leave it under both names. A directory is renamed first and the whiteout made after:
/// between the two, what is below the old name shows.
pub fn move_leaving_whiteout(
    from_dir: BorrowedFd<'_>,
    from: &CStr,
    to_dir: BorrowedFd<'_>,
    to: &CStr,
    how: RenameFlags,
    is_dir: bool,
) -> Result<(), Errno> {
    if is_dir {
        nix::fcntl::renameat2(from_dir, from, to_dir, to, how)?;
        return marker::make_whiteout(from_dir, from);
    }
    let temp = temp_name();
    nix::unistd::linkat(from_dir, from, to_dir, temp.as_c_str(), AtFlags::empty())?;
    let placed = nix::fcntl::renameat2(to_dir, temp.as_c_str(), to_dir, to, how);
    // Also when `to` was another link of the same file, which rename leaves alone.
    let _ = remove_any(to_dir, &temp, false);
    placed?;
    whiteout_over(from_dir, from, false).map(drop)
}

/// Whether `name` in `dir` is a whiteout in a directory where one hides something.
pub fn is_whiteout(zone: super::Zone, dir: BorrowedFd<'_>, name: &CStr) -> bool {
    store::stat_at(dir, name).is_ok_and(|st| marker::hides(zone, dir, name, &st))
}
