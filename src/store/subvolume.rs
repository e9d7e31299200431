//! Turning a directory of local into a btrfs subvolume in place, for a kernel-enforced
//! quota root (DESIGN §6), and finishing one a crash interrupted.
//!
//! btrfs cannot make a subvolume of a directory: the tree is copied into a new subvolume
//! (file data by reflink, so only metadata is written), which then takes the directory's
//! place:
//!
//! 1. the subvolume is made beside the directory, under `temp`;
//! 2. the tree is copied into it: owners, modes, extended attributes (whiteouts and opaque
//!    markers included), hard links as hard links, times last;
//! 3. the copy is made durable (`syncfs`);
//! 4. the two are exchanged in one `renameat2(RENAME_EXCHANGE)`, and the parent synced;
//! 5. the old tree, now under `temp`, is removed.
//!
//! A crash leaves under `temp` either a subvolume (before 4: the copy, incomplete, and the
//! directory untouched) or a plain directory (after 4: the old tree, the directory already
//! converted); [`finish`] tells which by looking and removes it. Walks are loops over an
//! explicit stack, never recursions: the tree is as deep as its users made it.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{FchmodatFlags, Mode, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, UnlinkatFlags};

use super::{btrfs, open_at, read_dir, readlink_at, reopen, stat_at, stat_fd};

/// What the temporary name in a directory holds, as [`finish`] found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leftover {
    Nothing,
    /// A copy that never took the directory's place: the directory is as it was.
    Copy,
    /// The tree a conversion replaced: the directory is the subvolume.
    Replaced,
}

/// The name a conversion of the directory `name` works under, beside it: one of the view's
/// temporary names (hidden from the view), the same every time, so that a conversion
/// interrupted by a crash is found again ([`finish`]).
pub fn temp_for(name: &CStr) -> CString {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    name.to_bytes().hash(&mut hasher);
    let tag = format!("subvolume.{:016x}", hasher.finish());
    CString::new([super::reserved::temp_prefix(), tag.as_bytes()].concat())
        .expect("temporary names hold no NUL")
}

/// Makes a subvolume under `temp` in `parent` (a name nobody else uses, see [`temp_for`])
/// holding a copy of the directory `name` beside it, durably; returns what the copy saw of
/// the tree, for [`unchanged`]. On error, nothing is left under `temp`.
pub fn copy(parent: BorrowedFd<'_>, name: &CStr, temp: &CStr) -> Result<Seen, Errno> {
    // An ioctl needs a descriptor opened for reading, not an `O_PATH` one.
    let dir = reopen(parent, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
    btrfs::create_subvolume(dir.as_fd(), temp)?;
    let copied = copy_into(parent, name, temp);
    if copied.is_err() {
        let _ = remove_tree(parent, temp);
    }
    copied
}

/// Exchanges `name` and `temp` in `parent` in one step, durably: the copy takes the
/// directory's place, or (called again) gives it back.
pub fn swap(parent: BorrowedFd<'_>, name: &CStr, temp: &CStr) -> Result<(), Errno> {
    nix::fcntl::renameat2(parent, temp, parent, name, RenameFlags::RENAME_EXCHANGE)?;
    sync_dir(parent)
}

/// What a copy saw of each object of the tree: its change time, which every change to an
/// object moves (a write, a new or removed name in a directory, a new link to a file).
/// The top directory's own change time moves when it is swapped, so for it only its
/// modification time (moved by any entry made or removed in it) counts.
#[derive(Debug, Default)]
pub struct Seen(HashMap<u64, (i64, i64)>);

impl Seen {
    fn note(&mut self, st: &libc::stat) {
        self.0.insert(st.st_ino, (st.st_ctime, st.st_ctime_nsec));
    }

    fn note_top(&mut self, st: &libc::stat) {
        self.0.insert(st.st_ino, (st.st_mtime, st.st_mtime_nsec));
    }
}

/// Whether the tree `name` in `parent` is as the copy that made `seen` found it: the same
/// objects, none changed since.
pub fn unchanged(parent: BorrowedFd<'_>, name: &CStr, seen: &Seen) -> Result<bool, Errno> {
    let top = readable_dir(parent, name)?;
    let same = |st: &libc::stat| seen.0.get(&st.st_ino) == Some(&(st.st_ctime, st.st_ctime_nsec));
    let mut found = std::collections::HashSet::new();
    let st = stat_fd(top.as_fd())?;
    if seen.0.get(&st.st_ino) != Some(&(st.st_mtime, st.st_mtime_nsec)) {
        return Ok(false);
    }
    let mut pending = vec![top];
    while let Some(dir) = pending.pop() {
        let st = stat_fd(dir.as_fd())?;
        // The top was checked above.
        if !found.is_empty() && !same(&st) {
            return Ok(false);
        }
        found.insert(st.st_ino);
        found.insert(st.st_ino);
        for entry in read_dir(dir.as_fd())? {
            let child = CString::new(entry.name.as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
            let st = stat_at(dir.as_fd(), &child)?;
            if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                pending.push(readable_dir(dir.as_fd(), &child)?);
            } else if same(&st) {
                found.insert(st.st_ino);
            } else {
                return Ok(false);
            }
        }
    }
    // Every object found was seen as it is; none seen is missing.
    Ok(found.len() == seen.0.len())
}

/// Removes what a conversion interrupted by a crash left under `temp` in `parent`.
pub fn finish(parent: BorrowedFd<'_>, temp: &CStr) -> Result<Leftover, Errno> {
    let st = match stat_at(parent, temp) {
        Ok(st) => st,
        Err(Errno::ENOENT) => return Ok(Leftover::Nothing),
        Err(e) => return Err(e),
    };
    let found = if btrfs::is_subvolume(&st) {
        Leftover::Copy
    } else {
        Leftover::Replaced
    };
    remove_tree(parent, temp)?;
    Ok(found)
}

/// Copies the tree `from` in `parent` into the empty directory `to` in `parent`.
fn copy_into(parent: BorrowedFd<'_>, from: &CStr, to: &CStr) -> Result<Seen, Errno> {
    let mut seen = Seen::default();
    let src = readable_dir(parent, from)?;
    let dst = readable_dir(parent, to)?;
    let mut links: HashMap<u64, (OwnedFd, CString)> = HashMap::new();
    // Directories whose entries are copied, and those whose times are set once they are.
    let mut pending = vec![(src, dst)];
    let mut finished: Vec<(OwnedFd, OwnedFd)> = Vec::new();
    while let Some((src, dst)) = pending.pop() {
        let st = stat_fd(src.as_fd())?;
        if finished.is_empty() {
            seen.note_top(&st);
        } else {
            seen.note(&st);
        }
        for entry in read_dir(src.as_fd())? {
            let name = CString::new(entry.name.as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
            let st = stat_at(src.as_fd(), &name)?;
            let kind = st.st_mode & libc::S_IFMT;
            if kind != libc::S_IFDIR {
                seen.note(&st);
            }
            if kind != libc::S_IFDIR && st.st_nlink > 1 {
                if let Some((dir, first)) = links.get(&st.st_ino) {
                    nix::unistd::linkat(
                        dir.as_fd(),
                        first.as_c_str(),
                        dst.as_fd(),
                        name.as_c_str(),
                        AtFlags::empty(),
                    )?;
                    continue;
                }
            }
            match kind {
                libc::S_IFDIR => {
                    nix::sys::stat::mkdirat(dst.as_fd(), name.as_c_str(), Mode::S_IRWXU)?;
                    let sub_src = readable_dir(src.as_fd(), &name)?;
                    let sub_dst = readable_dir(dst.as_fd(), &name)?;
                    pending.push((sub_src, sub_dst));
                    continue;
                }
                libc::S_IFREG => copy_file(src.as_fd(), dst.as_fd(), &name, &st)?,
                libc::S_IFLNK => {
                    let target = CString::new(readlink_at(src.as_fd(), &name)?)
                        .map_err(|_| Errno::EINVAL)?;
                    nix::unistd::symlinkat(target.as_c_str(), dst.as_fd(), name.as_c_str())?;
                }
                _ => {
                    let made = unsafe {
                        libc::mknodat(dst.as_raw_fd(), name.as_ptr(), st.st_mode, st.st_rdev)
                    };
                    Errno::result(made)?;
                }
            }
            copy_attributes(src.as_fd(), dst.as_fd(), &name, &st)?;
            if kind != libc::S_IFDIR && st.st_nlink > 1 {
                let dir = nix::unistd::dup(dst.as_fd())?;
                links.insert(st.st_ino, (dir, name));
            }
        }
        finished.push((src, dst));
    }
    // Children first: setting a directory's times before its entries are made would be
    // undone by making them.
    for (src, dst) in finished.iter().rev() {
        let st = stat_fd(src.as_fd())?;
        copy_attributes(src.as_fd(), dst.as_fd(), c".", &st)?;
    }
    if let Some((_, top)) = finished.first() {
        nix::unistd::syncfs(top.as_fd())?;
    }
    Ok(seen)
}

/// A regular file's data, sharing its extents (a reflink) where the filesystem can.
fn copy_file(
    src: BorrowedFd<'_>,
    dst: BorrowedFd<'_>,
    name: &CStr,
    st: &libc::stat,
) -> Result<(), Errno> {
    let from = open_at(src, name, OFlag::O_RDONLY, 0)?;
    let to = open_at(
        dst,
        name,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL,
        0o600,
    )?;
    // SAFETY: FICLONE takes the source descriptor as its argument.
    let cloned = unsafe { libc::ioctl(to.as_raw_fd(), libc::FICLONE, from.as_raw_fd()) };
    if cloned == 0 {
        return Ok(());
    }
    super::copy::copy_data(from.as_fd(), to.as_fd(), st.st_size as u64)
}

/// Owner, mode, extended attributes and times of `name` (`.` for the directory itself).
fn copy_attributes(
    src: BorrowedFd<'_>,
    dst: BorrowedFd<'_>,
    name: &CStr,
    st: &libc::stat,
) -> Result<(), Errno> {
    let symlink = st.st_mode & libc::S_IFMT == libc::S_IFLNK;
    nix::unistd::fchownat(
        dst,
        name,
        Some(Uid::from_raw(st.st_uid)),
        Some(Gid::from_raw(st.st_gid)),
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )?;
    if !symlink {
        // After the owner: a chown clears set-user-ID bits.
        nix::sys::stat::fchmodat(
            dst,
            name,
            Mode::from_bits_truncate(st.st_mode & 0o7777),
            FchmodatFlags::FollowSymlink,
        )?;
        copy_xattrs(src, dst, name)?;
    }
    let atime = TimeSpec::new(st.st_atime, st.st_atime_nsec);
    let mtime = TimeSpec::new(st.st_mtime, st.st_mtime_nsec);
    nix::sys::stat::utimensat(dst, name, &atime, &mtime, UtimensatFlags::NoFollowSymlink)
}

fn copy_xattrs(src: BorrowedFd<'_>, dst: BorrowedFd<'_>, name: &CStr) -> Result<(), Errno> {
    let from = open_at(src, name, OFlag::O_PATH, 0)?;
    let to = open_at(dst, name, OFlag::O_PATH, 0)?;
    let (from, to) = (super::proc_path(from.as_fd()), super::proc_path(to.as_fd()));
    let names = match super::xattr::list(&from) {
        Ok(names) => names,
        Err(Errno::ENOTSUP) => return Ok(()),
        Err(e) => return Err(e),
    };
    for attr in names {
        let attr = CString::new(attr).map_err(|_| Errno::EINVAL)?;
        let value = match super::xattr::get(&from, &attr) {
            Ok(value) => value,
            // Gone meanwhile.
            Err(Errno::ENODATA) => continue,
            Err(e) => return Err(e),
        };
        super::xattr::set(&to, &attr, &value, 0)?;
    }
    Ok(())
}

/// Removes the tree `name` in `parent`, the directory itself last (for a subvolume, that
/// deletes it).
pub fn remove_tree(parent: BorrowedFd<'_>, name: &CStr) -> Result<(), Errno> {
    let top = readable_dir(parent, name)?;
    // Each directory waits here until its entries are gone, then is removed from the one
    // below it on the stack.
    let mut stack: Vec<(OwnedFd, Option<CString>)> = vec![(top, None)];
    while let Some((dir, _)) = stack.last() {
        let mut sub = None;
        for entry in read_dir(dir.as_fd())? {
            let child = CString::new(entry.name.as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
            let st = stat_at(dir.as_fd(), &child)?;
            if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                sub = Some(child);
                break;
            }
            nix::unistd::unlinkat(dir.as_fd(), child.as_c_str(), UnlinkatFlags::NoRemoveDir)?;
        }
        match sub {
            Some(child) => {
                let fd = readable_dir(dir.as_fd(), &child)?;
                stack.push((fd, Some(child)));
            }
            None => {
                let (_, own) = stack
                    .pop()
                    .expect("the loop runs while the stack has a top");
                let (at, own) = match (stack.last(), own) {
                    (Some((below, _)), Some(own)) => (below.as_fd(), own),
                    _ => (parent, name.to_owned()),
                };
                nix::unistd::unlinkat(at, own.as_c_str(), UnlinkatFlags::RemoveDir)?;
            }
        }
    }
    Ok(())
}

/// The directory `name` in `dir`, open for reading (listing, ioctls, `syncfs`), never
/// through a symlink.
fn readable_dir(dir: BorrowedFd<'_>, name: &CStr) -> Result<OwnedFd, Errno> {
    open_at(dir, name, OFlag::O_RDONLY | OFlag::O_DIRECTORY, 0)
}

fn sync_dir(dir: BorrowedFd<'_>) -> Result<(), Errno> {
    let fd = reopen(dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
    nix::unistd::fsync(fd.as_fd())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_change_made_while_copying_is_seen() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(src.join("a")).unwrap();
        std::fs::write(src.join("a/f"), b"1").unwrap();
        std::fs::write(src.join("g"), b"2").unwrap();
        let root = crate::store::open_root(tmp.path()).unwrap();
        let copy = |n: &str| {
            std::fs::create_dir(tmp.path().join(n)).unwrap();
            copy_into(root.as_fd(), c"src", &CString::new(n).unwrap()).unwrap()
        };
        let seen = copy("d1");
        assert!(unchanged(root.as_fd(), c"src", &seen).unwrap());
        std::thread::sleep(std::time::Duration::from_millis(10));
        std::fs::write(src.join("a/f"), b"changed").unwrap();
        assert!(!unchanged(root.as_fd(), c"src", &seen).unwrap(), "a write");
        let seen = copy("d2");
        std::thread::sleep(std::time::Duration::from_millis(10));
        std::fs::remove_file(src.join("g")).unwrap();
        assert!(
            !unchanged(root.as_fd(), c"src", &seen).unwrap(),
            "an unlink"
        );
        let seen = copy("d3");
        std::thread::sleep(std::time::Duration::from_millis(10));
        std::fs::write(src.join("a/new"), b"").unwrap();
        assert!(
            !unchanged(root.as_fd(), c"src", &seen).unwrap(),
            "a new file"
        );
    }

    #[test]
    fn remove_tree_takes_a_deep_tree_without_recursing() {
        let tmp = tempfile::tempdir().unwrap();
        let mut deep = tmp.path().join("t");
        for i in 0..300 {
            deep.push(format!("d{i}"));
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("f"), b"x").unwrap();
        std::fs::write(tmp.path().join("t/g"), b"x").unwrap();
        let root = crate::store::open_root(tmp.path()).unwrap();
        remove_tree(root.as_fd(), c"t").unwrap();
        assert!(!tmp.path().join("t").exists());
    }

    #[test]
    fn a_copy_keeps_content_links_modes_and_times() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(src.join("a/b")).unwrap();
        std::fs::write(src.join("a/b/f"), b"data").unwrap();
        std::fs::hard_link(src.join("a/b/f"), src.join("h")).unwrap();
        std::os::unix::fs::symlink("a/b/f", src.join("l")).unwrap();
        nix::unistd::mkfifo(&src.join("p"), Mode::from_bits_truncate(0o640)).unwrap();
        std::fs::set_permissions(
            src.join("a"),
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )
        .unwrap();
        std::fs::create_dir(tmp.path().join("dst")).unwrap();
        let root = crate::store::open_root(tmp.path()).unwrap();
        copy_into(root.as_fd(), c"src", c"dst").unwrap();
        let dst = tmp.path().join("dst");
        assert_eq!(std::fs::read(dst.join("a/b/f")).unwrap(), b"data");
        let (f, h) = (
            std::fs::metadata(dst.join("a/b/f")).unwrap(),
            std::fs::metadata(dst.join("h")).unwrap(),
        );
        assert_eq!((f.ino(), f.nlink()), (h.ino(), 2));
        assert_eq!(
            std::fs::read_link(dst.join("l")).unwrap().to_str(),
            Some("a/b/f")
        );
        let meta = |p: &str| std::fs::symlink_metadata(p).unwrap();
        let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
        for rel in ["a", "a/b", "a/b/f", "p", ""] {
            let (a, b) = (meta(&format!("{s}/{rel}")), meta(&format!("{d}/{rel}")));
            assert_eq!(a.mode(), b.mode(), "{rel}");
            assert_eq!(a.mtime(), b.mtime(), "{rel}");
            assert_eq!(a.mtime_nsec(), b.mtime_nsec(), "{rel}");
        }
    }
}
