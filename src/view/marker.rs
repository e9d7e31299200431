//! The union's own markers in local, in the kernel overlayfs format, so that local stays a
//! valid overlayfs upper directory: whiteouts are 0/0 character devices, opaque directories
//! carry `trusted.overlay.opaque=y` (or `user.overlay.opaque=y` where trusted xattrs are
//! refused).
//!
//! A 0/0 character device made *through* the view where a whiteout would hide something
//! (a runtime's layer content, pjdfstest) is a real entry: it carries `trusted.layerfs.device`
//! and is never taken for a whiteout. Elsewhere one carries it too where local allows, and a
//! directory moved from elsewhere has its unmarked ones marked: either may come to where a
//! whiteout hides something. Kernel overlayfs, which refuses such devices, sees one as a
//! whiteout if it ever mounts local as an upper directory.
//!
//! Because those names are ours, `*.overlay.*` attributes written *through* the view are
//! stored escaped as `*.overlay.overlay.*`, the convention kernel overlayfs uses for nested
//! overlays: a runtime stacking overlayfs on top of the view reads back exactly what it
//! wrote, and never confuses our markers with its own.

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::sys::stat::{Mode, SFlag};

use super::{Stat, Zone};
pub use crate::store::reserved::{is_reserved_name, tag_temp_names, temp_prefix, REGISTRY_NAME};
use crate::store::{self, xattr};

const OPAQUE_NAMES: [&CStr; 2] = [c"trusted.overlay.opaque", c"user.overlay.opaque"];
/// Marks a 0/0 character device that is not a whiteout. Only `trusted.` attributes can sit
/// on a device node.
const DEVICE_NAME: &CStr = c"trusted.layerfs.device";
const PRIVATE_PREFIXES: [&[u8]; 2] = [b"trusted.overlay.", b"user.overlay."];

/// Whether the local entry `name` of `dir`, a directory of `zone`, is one of our
/// whiteouts (`st` is its stat).
pub fn hides(zone: Zone, dir: BorrowedFd<'_>, name: &CStr, st: &Stat) -> bool {
    zone.has_below() && store::is_whiteout(st) && !is_device_at(dir, name)
}

/// Whether the 0/0 device `name` of `dir` is a real device rather than a whiteout.
pub fn is_device_at(dir: BorrowedFd<'_>, name: &CStr) -> bool {
    let mut path = store::proc_path(dir).into_bytes();
    path.push(b'/');
    path.extend_from_slice(name.to_bytes());
    let Ok(path) = CString::new(path) else {
        return false;
    };
    xattr::lget(&path, DEVICE_NAME).is_ok()
}

/// Marks the 0/0 device behind the `O_PATH` handle `fd` as a real device.
pub fn set_device(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    xattr::set(&store::proc_path(fd), DEVICE_NAME, b"chr", 0)
}

/// Marks the object behind the `O_PATH` handle `fd` (`st` is its stat) a real device if it
/// is an unmarked 0/0 device, before it takes a name (by rename or link) in a directory
/// where whiteouts hide something: made where nothing showed below, it needed no mark, and
/// would read there as a whiteout. Without trusted attributes it cannot go there (`EPERM`,
/// as `mknod` there).
pub fn keep_device(fd: BorrowedFd<'_>, st: &Stat) -> Result<(), Errno> {
    if !store::is_whiteout(st) || xattr::get(&store::proc_path(fd), DEVICE_NAME).is_ok() {
        return Ok(());
    }
    set_device(fd).map_err(|_| Errno::EPERM)
}

/// Marks every unmarked 0/0 device below the local directory `dir`, at any depth, a real
/// device. `dir` is about to move from where nothing lies below to where a whiteout hides
/// something: each such device was made there as a plain entry, and would read as a
/// whiteout once moved. Without trusted attributes none can be kept (`EPERM`). Walks with
/// its own stack, holding a handle per directory found and not yet read: the depth and
/// width are the caller's.
pub fn keep_devices_under(dir: BorrowedFd<'_>) -> Result<(), Errno> {
    let mut pending = Vec::new();
    keep_devices_in(dir, &mut pending)?;
    while let Some(sub) = pending.pop() {
        keep_devices_in(sub.as_fd(), &mut pending)?;
    }
    Ok(())
}

/// Marks the unmarked 0/0 devices of `dir` itself, and adds its subdirectories to `pending`.
fn keep_devices_in(dir: BorrowedFd<'_>, pending: &mut Vec<OwnedFd>) -> Result<(), Errno> {
    for entry in store::read_dir(dir)? {
        let Ok(name) = store::cname(&entry.name) else {
            continue;
        };
        if entry.whiteout && !is_device_at(dir, &name) {
            set_device(store::open_path_at(dir, &name)?.as_fd()).map_err(|_| Errno::EPERM)?;
        } else if entry.kind == store::Kind::Dir && !is_reserved_name(name.to_bytes()) {
            pending.push(store::open_dir_at(dir, &name)?);
        }
    }
    Ok(())
}

/// Our own attributes, which the view neither shows in local nor lets anyone change.
pub fn is_own_xattr(name: &[u8]) -> bool {
    name == DEVICE_NAME.to_bytes()
}

/// Creates a whiteout for `name` in the local directory `dir`.
pub fn make_whiteout(dir: BorrowedFd<'_>, name: &CStr) -> Result<(), Errno> {
    nix::sys::stat::mknodat(dir, name, SFlag::S_IFCHR, Mode::empty(), 0)
}

/// Whether the local directory behind `dir_fd` hides the remote directory under it.
pub fn is_opaque(dir_fd: BorrowedFd<'_>) -> bool {
    let path = store::proc_path(dir_fd);
    OPAQUE_NAMES
        .iter()
        .any(|n| xattr::get(&path, n).is_ok_and(|v| v == b"y"))
}

/// Marks a local directory opaque, falling back to the `user.` namespace like overlayfs's
/// `userxattr` mode when `trusted.` is refused.
pub fn set_opaque(dir_fd: BorrowedFd<'_>) -> Result<(), Errno> {
    let path = store::proc_path(dir_fd);
    match xattr::set(&path, OPAQUE_NAMES[0], b"y", 0) {
        Ok(()) => Ok(()),
        Err(Errno::EPERM | Errno::ENOTSUP) => xattr::set(&path, OPAQUE_NAMES[1], b"y", 0),
        Err(e) => Err(e),
    }
}

/// An attribute name as the view shows it → as local stores it.
pub fn escape(name: &[u8]) -> Option<CString> {
    let stored = match private_prefix(name) {
        Some(prefix) => [prefix, b"overlay.", &name[prefix.len()..]].concat(),
        None => name.to_vec(),
    };
    CString::new(stored).ok()
}

/// An attribute name as local stores it → as the view shows it; `None` for our markers.
pub fn unescape(stored: &[u8]) -> Option<Vec<u8>> {
    match private_prefix(stored) {
        Some(prefix) => {
            let rest = &stored[prefix.len()..];
            rest.strip_prefix(b"overlay.".as_slice())
                .map(|inner| [prefix, inner].concat())
        }
        None => Some(stored.to_vec()),
    }
}

fn private_prefix(name: &[u8]) -> Option<&'static [u8]> {
    PRIVATE_PREFIXES.into_iter().find(|p| name.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_attributes_round_trip_through_escaping() {
        let stored = escape(b"trusted.overlay.opaque").unwrap();
        assert_eq!(stored.as_bytes(), b"trusted.overlay.overlay.opaque");
        assert_eq!(
            unescape(stored.as_bytes()).unwrap(),
            b"trusted.overlay.opaque"
        );
        assert_eq!(escape(b"user.mime").unwrap().as_bytes(), b"user.mime");
        assert_eq!(unescape(b"user.mime").unwrap(), b"user.mime");
    }

    #[test]
    fn our_markers_are_never_shown() {
        assert_eq!(unescape(b"trusted.overlay.opaque"), None);
        assert_eq!(unescape(b"user.overlay.opaque"), None);
        assert_eq!(unescape(b"trusted.overlay.origin"), None);
    }

    #[test]
    fn reserved_names_are_recognised() {
        // The tag is the process's: a view made by another test may have set it first.
        tag_temp_names(0xabc);
        assert!(is_reserved_name(&[temp_prefix(), b"1.2"].concat()));
        // Another tree's temporary names (hex tags never hold a `z`) are ordinary names.
        assert!(!is_reserved_name(b".layerfs-tmp.zz.1.2"));
        assert!(is_reserved_name(b".layerfs-quota.json"));
        assert!(is_reserved_name(b".layerfs-snapshotter"));
        assert!(!is_reserved_name(b".layerfs-notes"));
        assert!(!is_reserved_name(b".layerfs"));
    }
}
