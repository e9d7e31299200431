//! Removing a snapshot's directory tree. A container decides how deep the tree in its
//! snapshot is, deeper than PATH_MAX and than the open-file limit if it likes, so the walk
//! goes one name at a time below a single open directory: it keeps a stack of the names it
//! came down by instead of paths or descriptors, and climbs back up through "..". It never
//! follows a symlink and never enters another filesystem mounted in the tree.

use std::ffi::{CStr, CString};
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use nix::dir::{Dir, Type};
use nix::errno::Errno;
use nix::fcntl::{openat, AtFlags, OFlag, AT_FDCWD};
use nix::sys::stat::{fstat, fstatat, Mode, SFlag};
use nix::unistd::{unlinkat, UnlinkatFlags};

/// Removes `path` and everything under it. What is already gone, or goes meanwhile (a
/// Cleanup and a Remove may race for one directory), is fine.
pub fn remove(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
        Ok(meta) if !meta.is_dir() => return gone_is_fine(fs::remove_file(path)),
        Ok(_) => {}
    }
    let top = match open_dir(AT_FDCWD, path) {
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
        Ok(fd) => fd,
    };
    let above = open_dir(&top, c"..")?;
    if mount_id(&top)? != mount_id(&above)? {
        return Err(mounted_on(path.as_os_str().as_encoded_bytes()));
    }
    empty(top)?;
    gone_is_fine(fs::remove_dir(path))
}

/// A directory between the top and the one the walk is in.
struct Level {
    /// Its name in its parent; none for the top.
    name: Option<CString>,
    id: Id,
    /// Its subdirectories still to remove.
    subdirs: Vec<CString>,
}

/// Which directory a descriptor is: ".." must lead back to the one the walk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Id {
    dev: u64,
    ino: u64,
}

impl Id {
    fn of(fd: impl AsFd) -> io::Result<Id> {
        let st = fstat(fd)?;
        Ok(Id {
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }
}

/// Removes everything in the directory `top`. At most three descriptors are open at once
/// (the directory the walk is in, the one it steps to, and a listing), whatever the depth.
fn empty(top: OwnedFd) -> io::Result<()> {
    let id = Id::of(&top)?;
    let mount = mount_id(&top)?;
    let mut levels = vec![Level {
        name: None,
        id,
        subdirs: clear(&top)?,
    }];
    let mut cur = top;
    while let Some(level) = levels.last_mut() {
        if let Some(name) = level.subdirs.pop() {
            if let Some(child) = descend(&cur, &name, mount)? {
                levels.push(Level {
                    id: Id::of(&child)?,
                    subdirs: clear(&child)?,
                    name: Some(name),
                });
                cur = child;
            }
            continue;
        }
        // `cur` is empty now: step up and remove it, unless it is the top.
        let done = levels.pop().expect("the level just looked at");
        let (Some(name), Some(parent)) = (done.name, levels.last()) else {
            break;
        };
        cur = climb(&cur, &name, parent.id)?;
        gone_is_fine(
            unlinkat(&cur, name.as_c_str(), UnlinkatFlags::RemoveDir).map_err(|e| named(&name, e)),
        )?;
    }
    Ok(())
}

/// Removes what is in `dir` but directories, and returns the names of those.
fn clear(dir: &OwnedFd) -> io::Result<Vec<CString>> {
    let entries = match list(dir) {
        // Removed meanwhile by another walk: nothing is left in it.
        Err(Errno::ENOENT) => return Ok(Vec::new()),
        entries => entries?,
    };
    let mut subdirs = Vec::new();
    for (name, kind) in entries {
        let is_dir = match kind {
            Some(kind) => kind == Type::Directory,
            // The filesystem does not say in its listing: ask the entry.
            None => match fstatat(dir, name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR,
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(named(&name, e)),
            },
        };
        if is_dir {
            subdirs.push(name);
            continue;
        }
        match unlinkat(dir, name.as_c_str(), UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => {}
            // Replaced by a directory since it was listed.
            Err(Errno::EISDIR) => subdirs.push(name),
            Err(e) => return Err(named(&name, e)),
        }
    }
    Ok(subdirs)
}

/// The entries of `dir` and their types where the filesystem tells them. Read in full
/// before anything is removed, so that no removal shifts the reading.
fn list(dir: &OwnedFd) -> nix::Result<Vec<(CString, Option<Type>)>> {
    let mut entries = Vec::new();
    for entry in Dir::openat(dir, c".", dir_flags(), Mode::empty())?.iter() {
        let entry = entry?;
        let name = entry.file_name();
        if name != c"." && name != c".." {
            entries.push((name.to_owned(), entry.file_type()));
        }
    }
    Ok(entries)
}

/// Opens the subdirectory `name` of `dir` to empty it; none when it is gone, or was
/// replaced by something else that is removed here instead.
fn descend(dir: &OwnedFd, name: &CStr, mount: u64) -> io::Result<Option<OwnedFd>> {
    let child = match open_dir(dir, name) {
        Ok(child) => child,
        Err(Errno::ENOENT) => return Ok(None),
        // Not a directory (any more), or a symlink, which O_NOFOLLOW refuses to follow.
        Err(Errno::ENOTDIR | Errno::ELOOP) => {
            return match unlinkat(dir, name, UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => Ok(None),
                Err(e) => Err(named(name, e)),
            };
        }
        Err(e) => return Err(named(name, e)),
    };
    // What is mounted in the tree belongs to someone else: it stays, and so, by failing
    // here, does the directory it is mounted on. By mount, not device: a bind mount of
    // the same filesystem has the same device.
    if mount_id(&child)? != mount {
        return Err(mounted_on(name.to_bytes()));
    }
    Ok(Some(child))
}

/// The mount `fd` is on.
fn mount_id(fd: &OwnedFd) -> io::Result<u64> {
    // SAFETY: statx writes only into `st`, which is large enough and lives past the call.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    let r = unsafe {
        libc::statx(
            std::os::fd::AsRawFd::as_raw_fd(fd),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_MNT_ID,
            &mut st,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.stx_mnt_id)
}

fn mounted_on(name: &[u8]) -> io::Error {
    io::Error::new(
        io::ErrorKind::ResourceBusy,
        format!(
            "{}: another filesystem is mounted there",
            String::from_utf8_lossy(name)
        ),
    )
}

/// The parent of `dir` (named `name` there), which must be the directory `expected` the
/// walk came down from: were it not, `dir` was moved meanwhile, and going on would remove
/// whatever its new parent holds.
fn climb(dir: &OwnedFd, name: &CStr, expected: Id) -> io::Result<OwnedFd> {
    let parent = open_dir(dir, c"..").map_err(|e| named(name, e))?;
    if Id::of(&parent)? != expected {
        return Err(io::Error::other(format!(
            "{}: moved out of the tree while it was being removed",
            name.to_string_lossy()
        )));
    }
    Ok(parent)
}

fn open_dir<P: ?Sized + nix::NixPath>(dir: impl AsFd, name: &P) -> nix::Result<OwnedFd> {
    openat(dir, name, dir_flags() | OFlag::O_NOFOLLOW, Mode::empty())
}

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC
}

/// `e` with the name it happened at, so that the deep-down failure can be told apart.
fn named(name: &CStr, e: Errno) -> io::Error {
    io::Error::new(
        io::Error::from(e).kind(),
        format!("{}: {e}", name.to_string_lossy()),
    )
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
    use nix::sys::resource::{getrlimit, Resource};

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

    /// Makes `levels` nested directories under `top` and returns the deepest, by names
    /// below an open directory: past PATH_MAX no path reaches them.
    fn nest(top: &Path, levels: usize) -> OwnedFd {
        let mut at = open_dir(AT_FDCWD, top).unwrap();
        for _ in 0..levels {
            nix::sys::stat::mkdirat(&at, "dddddddddd", Mode::from_bits_truncate(0o755)).unwrap();
            at = open_dir(&at, "dddddddddd").unwrap();
        }
        at
    }

    #[test]
    fn removes_trees_deeper_than_path_max() {
        let tmp = tempfile::tempdir().unwrap();
        let keep = tmp.path().join("keep");
        fs::create_dir(&keep).unwrap();
        let top = tmp.path().join("top");
        fs::create_dir(&top).unwrap();
        let bottom = nest(&top, 600);
        let file = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_CLOEXEC;
        drop(openat(&bottom, "file", file, Mode::from_bits_truncate(0o644)).unwrap());
        nix::unistd::symlinkat(&keep, &bottom, "link").unwrap();
        drop(bottom);
        remove(&top).unwrap();
        assert!(!top.exists());
        assert!(keep.exists());
    }

    #[test]
    fn climbing_out_of_a_directory_moved_meanwhile_fails() {
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir_all(tmp.path().join("from/moved")).unwrap();
        fs::create_dir(tmp.path().join("elsewhere")).unwrap();
        let from = Id::of(open_dir(AT_FDCWD, &tmp.path().join("from")).unwrap()).unwrap();
        let moved = open_dir(AT_FDCWD, &tmp.path().join("from/moved")).unwrap();
        assert_eq!(
            Id::of(climb(&moved, c"moved", from).unwrap()).unwrap(),
            from
        );
        fs::rename(
            tmp.path().join("from/moved"),
            tmp.path().join("elsewhere/moved"),
        )
        .unwrap();
        let e = climb(&moved, c"moved", from).unwrap_err();
        assert!(e.to_string().contains("moved out of the tree"), "{e}");
    }

    /// A bind mount, unmounted when dropped (lazily, if it is busy).
    struct Bind(std::path::PathBuf);

    impl Bind {
        fn mount(from: &Path, on: &Path) -> Bind {
            let ok = std::process::Command::new("mount")
                .arg("--bind")
                .arg(from)
                .arg(on)
                .status()
                .unwrap()
                .success();
            assert!(ok, "mount --bind {} {}", from.display(), on.display());
            Bind(on.to_owned())
        }
    }

    impl Drop for Bind {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }

    /// A directory of the same filesystem bind-mounted in the tree, or on its top, is
    /// someone else's: the walk fails before it removes anything of it.
    #[test]
    fn what_is_bind_mounted_in_the_tree_or_on_it_is_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let keep = tmp.path().join("keep");
        fs::create_dir(&keep).unwrap();
        fs::write(keep.join("f"), b"x").unwrap();
        let top = tmp.path().join("top");
        fs::create_dir_all(top.join("a/inside")).unwrap();
        let inside = Bind::mount(&keep, &top.join("a/inside"));
        let e = remove(&top).unwrap_err();
        assert!(e.to_string().contains("mounted there"), "{e}");
        assert!(
            keep.join("f").exists(),
            "the walk removed a bind mount's files"
        );
        drop(inside);

        let on_top = tmp.path().join("on-top");
        fs::create_dir(&on_top).unwrap();
        let bind = Bind::mount(&keep, &on_top);
        let e = remove(&on_top).unwrap_err();
        assert!(e.to_string().contains("mounted there"), "{e}");
        assert!(
            keep.join("f").exists(),
            "the walk emptied what is mounted on its top"
        );
        drop(bind);
    }

    /// The other walk may remove the directory this one has just stepped into.
    #[test]
    fn a_directory_removed_under_the_walk_is_left_empty() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("top/gone");
        fs::create_dir_all(&dir).unwrap();
        let top = Id::of(open_dir(AT_FDCWD, &tmp.path().join("top")).unwrap()).unwrap();
        let gone = open_dir(AT_FDCWD, &dir).unwrap();
        fs::remove_dir(&dir).unwrap();
        assert!(clear(&gone).unwrap().is_empty());
        assert_eq!(Id::of(climb(&gone, c"gone", top).unwrap()).unwrap(), top);
    }

    /// A Cleanup and a Remove may walk one tree at once: each removes what the other has
    /// not, and both finish.
    #[test]
    fn two_walks_of_one_tree_both_finish() {
        for _ in 0..10 {
            let tmp = tempfile::tempdir().unwrap();
            let top = tmp.path().join("top");
            for i in 0..10 {
                let mut at = top.join(i.to_string());
                for j in 0..10 {
                    at.push(j.to_string());
                }
                fs::create_dir_all(&at).unwrap();
                for k in 0..3 {
                    fs::write(at.join(k.to_string()), b"x").unwrap();
                }
            }
            std::thread::scope(|s| {
                let walks: Vec<_> = (0..2).map(|_| s.spawn(|| remove(&top))).collect();
                for walk in walks {
                    walk.join().unwrap().unwrap();
                }
            });
            assert!(!top.exists());
        }
    }

    /// A walk holding a descriptor for each level it is below runs out of them here.
    #[test]
    fn removes_trees_deeper_than_the_open_file_limit() {
        let (soft, _) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        // A limit too high to go past in a test leaves this a test of depth alone.
        let levels = soft.saturating_add(100).min(100_000) as usize;
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path().join("top");
        fs::create_dir(&top).unwrap();
        drop(nest(&top, levels));
        remove(&top).unwrap();
        assert!(!top.exists());
    }
}
