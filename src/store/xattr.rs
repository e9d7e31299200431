//! Extended attributes, reached through `/proc/self/fd/N` paths so they work on `O_PATH`
//! handles of any file type (the magic link names the inode itself, symlinks included).

use std::ffi::CStr;

use nix::errno::Errno;

/// Reads a whole attribute list or value whose size is only known at call time.
fn sized_read(mut call: impl FnMut(*mut libc::c_void, usize) -> isize) -> Result<Vec<u8>, Errno> {
    loop {
        let size = Errno::result(call(std::ptr::null_mut(), 0))? as usize;
        if size == 0 {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; size];
        match Errno::result(call(buf.as_mut_ptr().cast(), buf.len())) {
            Ok(n) => {
                buf.truncate(n as usize);
                return Ok(buf);
            }
            // The attribute grew between the two calls.
            Err(Errno::ERANGE) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Attribute names, each without its terminating NUL.
pub fn list(path: &CStr) -> Result<Vec<Vec<u8>>, Errno> {
    list_raw(path).map(|raw| names(&raw))
}

/// The names in a NUL-separated list.
fn names(raw: &[u8]) -> Vec<Vec<u8>> {
    raw.split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(<[u8]>::to_vec)
        .collect()
}

/// The raw NUL-separated list, as `listxattr(2)` returns it.
pub fn list_raw(path: &CStr) -> Result<Vec<u8>, Errno> {
    sized_read(|buf, len| unsafe { libc::listxattr(path.as_ptr(), buf.cast(), len) })
}

pub fn get(path: &CStr, name: &CStr) -> Result<Vec<u8>, Errno> {
    sized_read(|buf, len| unsafe { libc::getxattr(path.as_ptr(), name.as_ptr(), buf, len) })
}

/// Like [`get`], without following a symlink at the end of `path`.
pub fn lget(path: &CStr, name: &CStr) -> Result<Vec<u8>, Errno> {
    sized_read(|buf, len| unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), buf, len) })
}

pub fn set(path: &CStr, name: &CStr, value: &[u8], flags: i32) -> Result<(), Errno> {
    let res = unsafe {
        libc::setxattr(
            path.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            flags,
        )
    };
    Errno::result(res).map(drop)
}

pub fn remove(path: &CStr, name: &CStr) -> Result<(), Errno> {
    Errno::result(unsafe { libc::removexattr(path.as_ptr(), name.as_ptr()) }).map(drop)
}

/// Like [`list`], without following a symlink at the end of `path`.
pub fn llist(path: &CStr) -> Result<Vec<Vec<u8>>, Errno> {
    let raw = sized_read(|buf, len| unsafe { libc::llistxattr(path.as_ptr(), buf.cast(), len) })?;
    Ok(names(&raw))
}

/// Like [`set`], without following a symlink at the end of `path`.
pub fn lset(path: &CStr, name: &CStr, value: &[u8], flags: i32) -> Result<(), Errno> {
    let res = unsafe {
        libc::lsetxattr(
            path.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            flags,
        )
    };
    Errno::result(res).map(drop)
}
