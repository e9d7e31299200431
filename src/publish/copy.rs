//! Copying a layer's `diff/` tree exactly and durably, and telling whether two trees match.
//!
//! A diff tree is an overlayfs upper dir: besides files, directories and symlinks it holds
//! whiteouts (0/0 character devices), opaque markers (`trusted.overlay.opaque` xattrs),
//! hard links and whatever special files the image ships. Everything is copied as it is:
//! type, owner, mode, xattrs, times, hard links, device numbers; file data goes through
//! `copy_file_range` (reflinks and server-side copies where the filesystems offer them) and
//! keeps holes. Each file is synced once written and each directory once complete, so the
//! tree is on disk before the rename that publishes it.
//!
//! The walk keeps its own stack: no recursion, whatever the depth of the tree. Symlinks in
//! the source are copied, never followed; names are bytes, UTF-8 or not.

use std::collections::HashMap;
use std::ffi::{CString, OsString};
use std::fs::{self, Metadata};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;

use super::error::{io_at, sys_at, PublishError, Result};
use crate::store::{copy::copy_data, xattr};

/// What a copy wrote.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CopyStats {
    pub entries: u64,
    pub bytes: u64,
}

enum Step {
    /// Copy the entry at this path relative to both roots.
    Enter(PathBuf),
    /// All of a directory's entries are in: give it its attributes and sync it.
    Finish(PathBuf, Metadata),
}

/// Copies the tree `src` (a directory) to `dst`, which must not exist. `tick` runs once per
/// entry (a temporary directory's heartbeat).
pub(crate) fn copy_tree(src: &Path, dst: &Path, tick: &mut dyn FnMut()) -> Result<CopyStats> {
    let mut stats = CopyStats::default();
    // First copy of each multiply-linked inode, by (dev, ino).
    let mut links: HashMap<(u64, u64), PathBuf> = HashMap::new();
    let mut stack = vec![Step::Enter(PathBuf::new())];
    while let Some(step) = stack.pop() {
        match step {
            Step::Finish(rel, meta) => {
                let to = join(dst, &rel);
                set_attrs(&join(src, &rel), &to, &meta)?;
                super::place::sync_dir(&to)?;
            }
            Step::Enter(rel) => {
                tick();
                stats.entries += 1;
                let from = join(src, &rel);
                let to = join(dst, &rel);
                let meta = fs::symlink_metadata(&from).map_err(io_at(&from))?;
                let ft = meta.file_type();
                if ft.is_dir() {
                    fs::DirBuilder::new()
                        .mode(0o700)
                        .create(&to)
                        .map_err(io_at(&to))?;
                    let mut names: Vec<OsString> = fs::read_dir(&from)
                        .map_err(io_at(&from))?
                        .map(|e| e.map(|e| e.file_name()))
                        .collect::<std::io::Result<_>>()
                        .map_err(io_at(&from))?;
                    names.sort();
                    stack.push(Step::Finish(rel.clone(), meta));
                    stack.extend(names.into_iter().rev().map(|n| Step::Enter(rel.join(n))));
                    continue;
                }
                if meta.nlink() > 1 {
                    let key = (meta.dev(), meta.ino());
                    if let Some(first) = links.get(&key) {
                        fs::hard_link(first, &to).map_err(io_at(&to))?;
                        continue;
                    }
                    links.insert(key, to.clone());
                }
                if ft.is_file() {
                    stats.bytes += copy_file(&from, &to, &meta)?;
                } else if ft.is_symlink() {
                    let target = fs::read_link(&from).map_err(io_at(&from))?;
                    std::os::unix::fs::symlink(&target, &to).map_err(io_at(&to))?;
                    set_attrs(&from, &to, &meta)?;
                } else if ft.is_char_device()
                    || ft.is_block_device()
                    || ft.is_fifo()
                    || ft.is_socket()
                {
                    let c = cpath(&to)?;
                    // SAFETY: a valid C string; mknod takes no other pointers.
                    let rc = unsafe {
                        libc::mknod(c.as_ptr(), meta.mode() & !0o7777 | 0o600, meta.rdev())
                    };
                    Errno::result(rc).map_err(sys_at(&to))?;
                    set_attrs(&from, &to, &meta)?;
                }
            }
        }
    }
    Ok(stats)
}

/// `root/rel`, or `root` itself for the empty relative path.
fn join(root: &Path, rel: &Path) -> PathBuf {
    if rel.as_os_str().is_empty() {
        root.to_owned()
    } else {
        root.join(rel)
    }
}

fn cpath(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| PublishError::BadSource {
        path: path.to_owned(),
        reason: "name contains a NUL byte".to_owned(),
    })
}

/// Copies one regular file's data and attributes and syncs it; its size.
fn copy_file(from: &Path, to: &Path, meta: &Metadata) -> Result<u64> {
    let src = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(from)
        .map_err(io_at(from))?;
    let dst = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(to)
        .map_err(io_at(to))?;
    copy_data(src.as_fd(), dst.as_fd(), meta.len()).map_err(sys_at(to))?;
    set_attrs(from, to, meta)?;
    dst.sync_all().map_err(io_at(to))?;
    Ok(meta.len())
}

/// Gives `to` the owner, xattrs, mode and times `from` has, in an order where no step undoes
/// an earlier one: `chown` clears set-ID bits and file capabilities, so it goes first.
fn set_attrs(from: &Path, to: &Path, meta: &Metadata) -> Result<()> {
    let c = cpath(to)?;
    // SAFETY: a valid C string.
    let rc = unsafe { libc::lchown(c.as_ptr(), meta.uid(), meta.gid()) };
    Errno::result(rc).map_err(sys_at(to))?;
    copy_xattrs(from, to)?;
    if !meta.file_type().is_symlink() {
        // SAFETY: a valid C string.
        let rc = unsafe { libc::chmod(c.as_ptr(), meta.mode() & 0o7777) };
        Errno::result(rc).map_err(sys_at(to))?;
    }
    let times = [
        libc::timespec {
            tv_sec: meta.atime(),
            tv_nsec: meta.atime_nsec(),
        },
        libc::timespec {
            tv_sec: meta.mtime(),
            tv_nsec: meta.mtime_nsec(),
        },
    ];
    // SAFETY: a valid C string and an array of two timespecs.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    Errno::result(rc).map_err(sys_at(to)).map(drop)
}

/// Copies every extended attribute, `trusted.overlay.*` markers included (which needs
/// CAP_SYS_ADMIN on both sides, as writing the layer did).
fn copy_xattrs(from: &Path, to: &Path) -> Result<()> {
    let src = cpath(from)?;
    let dst = cpath(to)?;
    let names = match xattr::llist(&src) {
        Ok(names) => names,
        Err(Errno::ENOTSUP) => return Ok(()),
        Err(e) => return Err(sys_at(from)(e)),
    };
    for name in names {
        let cname = CString::new(name)
            .map_err(|_| Errno::EINVAL)
            .map_err(sys_at(from))?;
        let value = match xattr::lget(&src, &cname) {
            Ok(value) => value,
            Err(Errno::ENODATA) => continue,
            Err(e) => return Err(sys_at(from)(e)),
        };
        xattr::lset(&dst, &cname, &value, 0).map_err(|e| PublishError::Io {
            path: to.to_owned(),
            source: std::io::Error::new(
                std::io::Error::from(e).kind(),
                format!("setting xattr {}: {e}", cname.to_string_lossy()),
            ),
        })?;
    }
    Ok(())
}

/// The first difference between the trees `a` and `b` in names, types, owners, modes,
/// sizes, device numbers, symlink targets and xattrs; `None` when they match. File contents
/// are not read: this tells a complete copy of a layer from a different or unfinished one.
pub(crate) fn first_difference(a: &Path, b: &Path) -> Result<Option<String>> {
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let (pa, pb) = (join(a, &rel), join(b, &rel));
        let ma = fs::symlink_metadata(&pa).map_err(io_at(&pa))?;
        let mb = match fs::symlink_metadata(&pb) {
            Ok(m) => m,
            Err(_) => return Ok(Some(format!("{} is missing", pb.display()))),
        };
        let shape = |m: &Metadata| {
            let size = if m.file_type().is_file() { m.len() } else { 0 };
            (m.mode(), m.uid(), m.gid(), size, m.rdev(), m.nlink() > 1)
        };
        if shape(&ma) != shape(&mb) {
            return Ok(Some(format!(
                "{} differs in type, owner, mode or size",
                pb.display()
            )));
        }
        if ma.file_type().is_symlink()
            && fs::read_link(&pa).map_err(io_at(&pa))? != fs::read_link(&pb).map_err(io_at(&pb))?
        {
            return Ok(Some(format!("{} points elsewhere", pb.display())));
        }
        if xattrs_of(&pa)? != xattrs_of(&pb)? {
            return Ok(Some(format!("{} differs in xattrs", pb.display())));
        }
        if ma.is_dir() {
            let names = |p: &Path| -> Result<Vec<OsString>> {
                let mut v: Vec<OsString> = fs::read_dir(p)
                    .map_err(io_at(p))?
                    .map(|e| e.map(|e| e.file_name()))
                    .collect::<std::io::Result<_>>()
                    .map_err(io_at(p))?;
                v.sort();
                Ok(v)
            };
            let (na, nb) = (names(&pa)?, names(&pb)?);
            if na != nb {
                return Ok(Some(format!("{} lists other entries", pb.display())));
            }
            stack.extend(na.into_iter().map(|n| rel.join(n)));
        }
    }
    Ok(None)
}

fn xattrs_of(path: &Path) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let c = cpath(path)?;
    let mut names = match xattr::llist(&c) {
        Ok(names) => names,
        Err(Errno::ENOTSUP) => return Ok(Vec::new()),
        Err(e) => return Err(sys_at(path)(e)),
    };
    names.sort();
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let cname = CString::new(name.clone())
            .map_err(|_| Errno::EINVAL)
            .map_err(sys_at(path))?;
        match xattr::lget(&c, &cname) {
            Ok(value) => out.push((name, value)),
            Err(Errno::ENODATA) => {}
            Err(e) => return Err(sys_at(path)(e)),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::unix::fs::PermissionsExt;

    fn setxattr(path: &Path, name: &str, value: &[u8]) {
        let c = CString::new(path.as_os_str().as_bytes()).unwrap();
        let n = CString::new(name).unwrap();
        xattr::lset(&c, &n, value, 0).unwrap();
    }

    /// A diff tree with every kind of entry a layer holds.
    fn sample(root: &Path) {
        fs::create_dir(root).unwrap();
        fs::create_dir_all(root.join("etc/opaque")).unwrap();
        setxattr(&root.join("etc/opaque"), "trusted.overlay.opaque", b"y");
        fs::write(root.join("etc/passwd"), b"root:x:0:0::/root:/bin/sh\n").unwrap();
        fs::set_permissions(root.join("etc/passwd"), fs::Permissions::from_mode(0o4751)).unwrap();
        setxattr(&root.join("etc/passwd"), "user.note", b"kept");
        fs::hard_link(root.join("etc/passwd"), root.join("etc/passwd.link")).unwrap();
        std::os::unix::fs::symlink("../etc/passwd", root.join("etc/sym")).unwrap();
        let wh = CString::new(root.join("etc/gone").as_os_str().as_bytes()).unwrap();
        assert_eq!(unsafe { libc::mknod(wh.as_ptr(), libc::S_IFCHR, 0) }, 0);
        let fifo = CString::new(root.join("fifo").as_os_str().as_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);
        std::os::unix::fs::lchown(root.join("etc/sym"), Some(7), Some(8)).unwrap();
        let name = std::ffi::OsStr::from_bytes(b"bad\xffname");
        fs::write(root.join(name), b"non-utf8").unwrap();
        let f = File::create(root.join("sparse")).unwrap();
        f.set_len(64 << 20).unwrap();
        fs::set_permissions(root.join("etc"), fs::Permissions::from_mode(0o555)).unwrap();
    }

    #[test]
    fn a_copy_matches_in_everything() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
        sample(&src);
        let stats = copy_tree(&src, &dst, &mut || {}).unwrap();
        assert!(stats.entries >= 9, "{stats:?}");
        assert_eq!(first_difference(&src, &dst).unwrap(), None);
        let (a, b) = (
            fs::metadata(dst.join("etc/passwd")).unwrap(),
            fs::metadata(dst.join("etc/passwd.link")).unwrap(),
        );
        assert_eq!(a.ino(), b.ino(), "hard links stay links");
        assert_eq!(a.mode() & 0o7777, 0o4751);
        let sm = fs::symlink_metadata(src.join("etc")).unwrap();
        let dm = fs::symlink_metadata(dst.join("etc")).unwrap();
        assert_eq!((sm.mtime(), sm.mtime_nsec()), (dm.mtime(), dm.mtime_nsec()));
        let wh = fs::symlink_metadata(dst.join("etc/gone")).unwrap();
        assert!(wh.file_type().is_char_device() && wh.rdev() == 0);
        // Holes stay holes.
        assert!(fs::metadata(dst.join("sparse")).unwrap().blocks() < 1024);
    }

    #[test]
    fn differences_are_found() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
        sample(&src);
        copy_tree(&src, &dst, &mut || {}).unwrap();
        fs::write(dst.join("fifo.extra"), b"").unwrap();
        assert!(first_difference(&src, &dst).unwrap().is_some());
        fs::remove_file(dst.join("fifo.extra")).unwrap();
        setxattr(&dst.join("etc/opaque"), "trusted.overlay.opaque", b"n");
        assert!(first_difference(&src, &dst).unwrap().is_some());
    }

    #[test]
    fn an_existing_target_is_an_error_not_a_merge() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
        sample(&src);
        fs::create_dir(&dst).unwrap();
        assert!(copy_tree(&src, &dst, &mut || {}).is_err());
    }
}
