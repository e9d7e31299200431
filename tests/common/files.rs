//! What a tree and its files hold, as plain system calls see them, through the view or beside
//! it: digests of whole trees, listings, `d_type`s, modes, xattrs, whiteouts, allocated
//! blocks; the special files and data tests make; and a plain directory of the host
//! filesystem to run the same calls on as a reference.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use sha2::{Digest, Sha256};

use super::sys::cpath;
use super::{drop_caches, Mount};

/// `cp -a`, keeping modes, links and times.
pub fn copy_tree(from: &Path, to: &Path) {
    let status = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .expect("cp");
    assert!(
        status.success(),
        "cp -a {} {}",
        from.display(),
        to.display()
    );
}

/// A digest of everything in a tree: names, types, modes, owners, sizes, contents, link
/// targets and user xattrs. (Times are left out: reading a file may update its atime.)
pub fn tree_hash(root: &Path) -> String {
    let mut entries = BTreeMap::new();
    walk(root, root, &mut entries);
    let mut h = Sha256::new();
    for (path, line) in entries {
        h.update(path.as_bytes());
        h.update(line.as_bytes());
    }
    format!("{:x}", h.finalize())
}

fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
    let mut names: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    for path in names {
        let meta = fs::symlink_metadata(&path).unwrap();
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let ft = meta.file_type();
        let body = if ft.is_file() {
            let mut data = Vec::new();
            fs::File::open(&path)
                .unwrap()
                .read_to_end(&mut data)
                .unwrap();
            format!("{:x}", Sha256::digest(&data))
        } else if ft.is_symlink() {
            fs::read_link(&path).unwrap().to_string_lossy().into_owned()
        } else {
            String::new()
        };
        out.insert(
            rel,
            format!(
                "{:o} {} {} {} {} {}",
                meta.mode(),
                meta.uid(),
                meta.gid(),
                meta.size(),
                meta.rdev(),
                body
            ),
        );
        if ft.is_dir() {
            walk(root, &path, out);
        }
    }
}

/// Names in a directory, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Whether `name` shows in a readdir of `dir`.
pub fn listed(dir: &Path, name: &str) -> bool {
    names(dir).iter().any(|n| n == name)
}

/// `d_type` of every entry of a directory as readdir returns it, `.` and `..` included.
/// `None` is `DT_UNKNOWN`.
pub fn raw_dtypes(dir: &Path) -> BTreeMap<String, Option<nix::dir::Type>> {
    let mut d = nix::dir::Dir::open(
        dir,
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
        nix::sys::stat::Mode::empty(),
    )
    .unwrap();
    d.iter()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), e.file_type())
        })
        .collect()
}

/// Names and `d_type`s of a directory, via readdir (not stat).
pub fn dtypes(dir: &Path) -> BTreeMap<String, &'static str> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let ft = e.file_type().unwrap();
            let t = if ft.is_dir() {
                "dir"
            } else if ft.is_symlink() {
                "link"
            } else if ft.is_file() {
                "file"
            } else {
                "other"
            };
            (e.file_name().to_string_lossy().into_owned(), t)
        })
        .collect()
}

pub fn mode_of(p: &Path) -> u32 {
    fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()))
        .mode()
        & 0o7777
}

/// Whether `path` itself, not what it points to, is a symlink.
pub fn is_symlink(path: &Path) -> bool {
    fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("lstat {}: {e}", path.display()))
        .file_type()
        .is_symlink()
}

pub fn errno_of<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("expected an error")
        .raw_os_error()
        .expect("an OS error")
}

pub fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// `lgetxattr(2)` of one attribute (symlinks are not followed).
pub fn xattr_get(path: &Path, name: &str) -> std::io::Result<Vec<u8>> {
    let (p, n) = (cpath(path), std::ffi::CString::new(name).unwrap());
    let mut buf = vec![0u8; 65536];
    let r = unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buf.truncate(r as usize);
    Ok(buf)
}

/// `lsetxattr(2)` with no flags.
pub fn xattr_set(path: &Path, name: &str, value: &[u8]) -> std::io::Result<()> {
    let (p, n) = (cpath(path), std::ffi::CString::new(name).unwrap());
    let r = unsafe {
        libc::lsetxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `lremovexattr(2)`.
pub fn xattr_remove(path: &Path, name: &str) -> std::io::Result<()> {
    let (p, n) = (cpath(path), std::ffi::CString::new(name).unwrap());
    if unsafe { libc::lremovexattr(p.as_ptr(), n.as_ptr()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `llistxattr(2)`, names sorted.
pub fn xattr_list(path: &Path) -> std::io::Result<Vec<String>> {
    let p = cpath(path);
    let mut buf = vec![0u8; 65536];
    let r = unsafe { libc::llistxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut v: Vec<String> = buf[..r as usize]
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect();
    v.sort();
    Ok(v)
}

/// Whether `path` (not followed) is an overlayfs whiteout: a 0/0 character device.
pub fn is_whiteout(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_char_device() && m.rdev() == 0)
}

/// After the call failed, `name` in `dir` (a layer dir of the view, deleted before) must
/// still be absent: the whiteout in local is still there and the view shows nothing, also
/// once the kernel forgot what it knew.
pub fn assert_still_deleted(m: &Mount, rel_dir: &str, name: &str, what: &str) {
    let view = m.diff("L1").join(rel_dir).join(name);
    let local = m.local_diff("L1").join(rel_dir).join(name);
    drop_caches();
    if let Ok(st) = fs::symlink_metadata(&view) {
        panic!(
            "{what}: the deleted remote {rel_dir}/{name} is back in the view (mode {:o}, {} bytes)",
            st.mode(),
            st.len()
        );
    }
    assert!(
        !listed(&m.diff("L1").join(rel_dir), name),
        "{what}: the deleted remote {rel_dir}/{name} is listed again"
    );
    assert!(
        is_whiteout(&local),
        "{what}: the whiteout of {rel_dir}/{name} in local is gone"
    );
}

/// Makes a special file (`kind` is `S_IFCHR`, `S_IFBLK` or `S_IFSOCK`) with mode `perm`.
pub fn mknod(path: &Path, kind: nix::sys::stat::SFlag, perm: u32, dev: nix::libc::dev_t) {
    nix::sys::stat::mknod(
        path,
        kind,
        nix::sys::stat::Mode::from_bits_truncate(perm),
        dev,
    )
    .unwrap_or_else(|e| panic!("mknod {}: {e}", path.display()));
}

/// Makes a FIFO with mode 0644.
pub fn mkfifo(path: &Path) {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o644))
        .unwrap_or_else(|e| panic!("mkfifo {}: {e}", path.display()));
}

/// What a tree takes on disk, as `du` counts it: the sum of `st_blocks * 512` of every inode
/// under `root` (the root included, hard links once, symlinks not followed), and the number
/// of those inodes.
pub fn allocated_under(root: &Path) -> (u64, u64) {
    fn walk(dir: &Path, seen: &mut std::collections::HashSet<(u64, u64)>, bytes: &mut u64) {
        for e in fs::read_dir(dir).unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display())) {
            let path = e.unwrap().path();
            let Ok(meta) = fs::symlink_metadata(&path) else {
                continue; // gone meanwhile
            };
            if seen.insert((meta.dev(), meta.ino())) {
                *bytes += meta.blocks() * 512;
            }
            if meta.file_type().is_dir() {
                walk(&path, seen, bytes);
            }
        }
    }
    let meta =
        fs::symlink_metadata(root).unwrap_or_else(|e| panic!("lstat {}: {e}", root.display()));
    let mut seen = std::collections::HashSet::new();
    seen.insert((meta.dev(), meta.ino()));
    let mut bytes = meta.blocks() * 512;
    if meta.file_type().is_dir() {
        walk(root, &mut seen, &mut bytes);
    }
    (bytes, seen.len() as u64)
}

/// Deterministic, incompressible-looking bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Fails if copy-up left a temporary file anywhere under `root`.
pub fn assert_no_temp_names(root: &Path) {
    for e in fs::read_dir(root).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        assert!(
            !name.starts_with(".layerfs-tmp."),
            "{name} left in {}",
            root.display()
        );
        if e.file_type().unwrap().is_dir() {
            assert_no_temp_names(&e.path());
        }
    }
}

/// A plain directory of the host filesystem, readable by everyone, to run the same calls on
/// as a reference.
pub fn reference_dir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("layerfs-integrity-ref")
        .tempdir()
        .expect("tempdir");
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    dir
}
