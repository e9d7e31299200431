//! System calls the standard library does not make, or not in the form a test needs, each
//! with its error as an `io::Result`: opens and mkdirs relative to a directory descriptor
//! (for paths longer than `PATH_MAX`), `mknod` of the 0/0 device overlayfs takes for a
//! whiteout, `RENAME_WHITEOUT`; and the errno's name for messages.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("a path without NUL")
}

pub fn cname(s: &str) -> CString {
    CString::new(s).expect("a name without NUL")
}

/// A libc return value as a `Result`.
pub fn check(r: libc::c_int) -> std::io::Result<libc::c_int> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub fn check_size(r: isize) -> std::io::Result<usize> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

pub fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: `fd` was just returned by a successful open and is owned by no one else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

pub fn open_raw(path: &Path, flags: i32, mode: u32) -> std::io::Result<OwnedFd> {
    let p = cpath(path);
    check(unsafe { libc::open(p.as_ptr(), flags | libc::O_CLOEXEC, mode) }).map(owned)
}

pub fn openat_raw(dir: &OwnedFd, name: &str, flags: i32, mode: u32) -> std::io::Result<OwnedFd> {
    let n = cname(name);
    check(unsafe { libc::openat(dir.as_raw_fd(), n.as_ptr(), flags | libc::O_CLOEXEC, mode) })
        .map(owned)
}

pub fn mkdirat_raw(dir: &OwnedFd, name: &str, mode: u32) -> std::io::Result<()> {
    let n = cname(name);
    check(unsafe { libc::mkdirat(dir.as_raw_fd(), n.as_ptr(), mode) }).map(|_| ())
}

/// `mknod(path, S_IFCHR | perm, makedev(0, 0))`: what overlayfs calls a whiteout.
pub fn mknod_0_0(path: &Path, perm: u32) -> std::io::Result<()> {
    let p = cpath(path);
    check(unsafe { libc::mknod(p.as_ptr(), libc::S_IFCHR | perm, libc::makedev(0, 0)) }).map(|_| ())
}

/// `renameat2(from, to, RENAME_WHITEOUT)`: the rename that leaves a 0/0 device behind.
pub fn rename_whiteout(from: &Path, to: &Path) -> std::io::Result<()> {
    let (f, t) = (cpath(from), cpath(to));
    check(unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_WHITEOUT,
        )
    })
    .map(|_| ())
}

pub fn errname(n: i32) -> String {
    std::io::Error::from_raw_os_error(n).to_string()
}

pub fn describe<T>(r: &std::io::Result<T>) -> String {
    match r {
        Ok(_) => "success".into(),
        Err(e) => match e.raw_os_error() {
            Some(n) => errname(n),
            None => e.to_string(),
        },
    }
}

/// Runs `lsetxattr` (or `lremovexattr` when `value` is `None`) on `p` in a forked child once
/// `turn_into` has made it someone else (only async-signal-safe calls; `false`: it could not,
/// and the test fails saying `who`): 0, or the errno the call failed with.
pub fn xattr_in_child(
    p: &Path,
    name: &str,
    value: Option<&[u8]>,
    who: &str,
    turn_into: impl Fn() -> bool,
) -> i32 {
    let (cp, cn) = (cpath(p), CString::new(name).expect("a name without NUL"));
    // Only async-signal-safe calls between fork and _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        unsafe {
            if !turn_into() {
                libc::_exit(255);
            }
            let r = match value {
                Some(v) => libc::lsetxattr(cp.as_ptr(), cn.as_ptr(), v.as_ptr().cast(), v.len(), 0),
                None => libc::lremovexattr(cp.as_ptr(), cn.as_ptr()),
            };
            libc::_exit(if r == 0 { 0 } else { *libc::__errno_location() });
        }
    }
    let mut status = 0;
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status));
    let code = libc::WEXITSTATUS(status);
    assert_ne!(code, 255, "could not become {who}");
    code
}
