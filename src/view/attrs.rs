//! Attribute changes (chmod, chown, truncate, utimes) and extended attributes.
//!
//! Changing anything about a remote or synthesized object copies it up first. Extended
//! attribute names are escaped on their way to local (see [`marker`]), so the view never
//! shows the union's own markers and a stacked overlayfs finds its own.

use std::ffi::{CString, OsStr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;
use std::time::SystemTime;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::Mode;
use nix::unistd::{Gid, Uid};

use super::node::{Layer, Node};
use super::{marker, Caller, Stat, View};
use crate::store::{self, xattr, Kind};

/// The kernel asks for this attribute before every write (to drop file capabilities when
/// an unprivileged caller writes); its absence is remembered per node, since every change to
/// an object's attributes goes through the view.
const CAPABILITY: &[u8] = b"security.capability";
/// A file's access ACL, whose setting also sets the mode.
pub const ACCESS_ACL: &[u8] = b"system.posix_acl_access";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Time {
    Now,
    At(SystemTime),
}

/// The changes of one `setattr` call; `None` leaves a field alone.
#[derive(Debug, Clone, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<Time>,
    pub mtime: Option<Time>,
}

impl SetAttr {
    /// Whether it changes nothing at all.
    pub fn is_empty(&self) -> bool {
        self.mode.is_none()
            && self.uid.is_none()
            && self.gid.is_none()
            && self.size.is_none()
            && self.atime.is_none()
            && self.mtime.is_none()
    }
}

impl View {
    /// Clears the set-ID bits of a file `caller` changes, as the kernel clears them for a
    /// caller without `CAP_FSETID`: set-user-ID always, set-group-ID where the group may
    /// execute or the caller is not in the file's group. File capabilities go with them.
    pub fn drop_privileges(&self, node: &Arc<Node>, caller: Caller) -> Result<(), Errno> {
        if node.kind != Kind::File {
            return Ok(());
        }
        let object = node.object().ok_or(Errno::ESTALE)?;
        let st = store::stat_fd(object.as_fd())?;
        let mode = st.st_mode & 0o7777;
        let mut kept = mode & !libc::S_ISUID;
        if kept & libc::S_ISGID != 0 && (kept & libc::S_IXGRP != 0 || !caller.in_group(st.st_gid)) {
            kept &= !libc::S_ISGID;
        }
        if kept == mode {
            return Ok(());
        }
        self.make_local(node, true)?;
        let object = node.object().ok_or(Errno::ESTALE)?;
        let path = store::proc_path(object.as_fd());
        nix::sys::stat::fchmodat(
            nix::fcntl::AT_FDCWD,
            path.as_c_str(),
            Mode::from_bits_truncate(kept),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )?;
        if !node.state().no_capability {
            let name = std::ffi::CString::new(CAPABILITY).map_err(|_| Errno::EINVAL)?;
            match xattr::remove(&path, &name) {
                Ok(()) | Err(Errno::ENODATA | Errno::EOPNOTSUPP) => {}
                Err(e) => return Err(e),
            }
            node.state().no_capability = true;
        }
        Ok(())
    }

    /// Applies `set`; `open` is the caller's open file when it came with one (ftruncate).
    pub fn setattr(
        &self,
        node: &Arc<Node>,
        set: &SetAttr,
        open: Option<BorrowedFd<'_>>,
    ) -> Result<Stat, Errno> {
        self.make_local(node, set.size != Some(0))?;
        let fd = self.object_fd(node)?;
        let fd = fd.as_fd();
        if let Some(mode) = set.mode {
            let path = store::proc_path(fd);
            nix::sys::stat::fchmodat(
                nix::fcntl::AT_FDCWD,
                path.as_c_str(),
                Mode::from_bits_truncate(mode & 0o7777),
                nix::sys::stat::FchmodatFlags::FollowSymlink,
            )?;
        }
        // `chown(f, -1, -1)` (the kernel sends no field for it) still changes the ctime,
        // as it does on local's filesystem.
        if set.uid.is_some() || set.gid.is_some() || set.is_empty() {
            nix::unistd::fchownat(
                fd,
                c"",
                set.uid.map(Uid::from_raw),
                set.gid.map(Gid::from_raw),
                AtFlags::AT_EMPTY_PATH,
            )?;
        }
        if let Some(size) = set.size {
            if node.kind != Kind::File {
                return Err(if node.is_dir() {
                    Errno::EISDIR
                } else {
                    Errno::EINVAL
                });
            }
            let truncate = |f: BorrowedFd<'_>| self.truncate_within_quota(node, f, size);
            match open.map(truncate) {
                Some(Ok(())) => {}
                // A handle opened read-only (or none at all): truncate by the object itself.
                None | Some(Err(Errno::EBADF | Errno::EINVAL)) => {
                    let w = store::reopen(fd, OFlag::O_WRONLY)?;
                    truncate(w.as_fd())?;
                }
                Some(Err(e)) => return Err(e),
            }
        }
        if set.atime.is_some() || set.mtime.is_some() {
            let times = [timespec(set.atime), timespec(set.mtime)];
            let res = unsafe {
                libc::utimensat(
                    fd.as_raw_fd(),
                    c"".as_ptr(),
                    times.as_ptr(),
                    libc::AT_EMPTY_PATH,
                )
            };
            Errno::result(res)?;
        }
        self.getattr(node)
    }

    pub fn getxattr(&self, node: &Node, name: &OsStr) -> Result<Vec<u8>, Errno> {
        if Self::is_quota_xattr(name) {
            return self.quota_xattr(node);
        }
        let caps = name.as_bytes() == CAPABILITY;
        {
            let st = node.state();
            let ours = st.layer == Layer::Local && marker::is_own_xattr(name.as_bytes());
            if st.layer == Layer::Virtual || (caps && st.no_capability) || ours {
                return Err(Errno::ENODATA);
            }
        }
        let fd = self.object_fd(node)?;
        let path = store::proc_path(fd.as_fd());
        let value = match node.layer() {
            Layer::Virtual => Err(Errno::ENODATA),
            Layer::Local => xattr::get(
                &path,
                &marker::escape(name.as_bytes()).ok_or(Errno::EINVAL)?,
            ),
            Layer::Remote => xattr::get(&path, &to_cstring(name)?),
        };
        if caps && value == Err(Errno::ENODATA) {
            node.state().no_capability = true;
        }
        value
    }

    /// The attribute names as the view shows them, NUL-terminated one after another.
    pub fn listxattr(&self, node: &Node) -> Result<Vec<u8>, Errno> {
        if node.layer() == Layer::Virtual {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        if self.is_quota_root(node) {
            out.extend_from_slice(crate::quota::QUOTA_XATTR);
            out.push(0);
        }
        let fd = self.object_fd(node)?;
        let path = store::proc_path(fd.as_fd());
        for stored in xattr::list(&path)? {
            let shown = match node.layer() {
                Layer::Local if marker::is_own_xattr(&stored) => None,
                Layer::Local => marker::unescape(&stored),
                _ => Some(stored),
            };
            if let Some(name) = shown {
                out.extend_from_slice(&name);
                out.push(0);
            }
        }
        Ok(out)
    }

    pub fn setxattr(
        &self,
        node: &Arc<Node>,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        caller: Caller,
    ) -> Result<(), Errno> {
        if Self::is_quota_xattr(name) {
            return self.set_quota_xattr(node, value, caller);
        }
        if marker::is_own_xattr(name.as_bytes()) {
            return Err(Errno::EPERM);
        }
        self.make_local(node, true)?;
        let fd = self.object_fd(node)?;
        let stored = marker::escape(name.as_bytes()).ok_or(Errno::EINVAL)?;
        if name.as_bytes() == CAPABILITY {
            node.state().no_capability = false;
        }
        let path = store::proc_path(fd.as_fd());
        xattr::set(&path, &stored, value, flags)?;
        // Local's filesystem updates the mode from the new ACL as it would for the daemon,
        // which may keep a setgid bit; a caller outside the group without CAP_FSETID loses
        // it, as the kernel rules (its flag for this does not reach FUSE daemons here).
        if name.as_bytes() == ACCESS_ACL && caller.uid != 0 {
            let st = store::stat_fd(fd.as_fd())?;
            if st.st_mode & libc::S_ISGID != 0 && !caller.in_group(st.st_gid) {
                nix::sys::stat::fchmodat(
                    nix::fcntl::AT_FDCWD,
                    path.as_c_str(),
                    Mode::from_bits_truncate(st.st_mode & 0o7777 & !libc::S_ISGID),
                    nix::sys::stat::FchmodatFlags::FollowSymlink,
                )?;
            }
        }
        Ok(())
    }

    pub fn removexattr(&self, node: &Arc<Node>, name: &OsStr, caller: Caller) -> Result<(), Errno> {
        if Self::is_quota_xattr(name) {
            return self.remove_quota_xattr(node, caller);
        }
        if marker::is_own_xattr(name.as_bytes()) {
            return Err(Errno::EPERM);
        }
        // Nothing to copy up for an attribute that is not there.
        if node.layer() != Layer::Local {
            self.getxattr(node, name)?;
        }
        self.make_local(node, true)?;
        let fd = self.object_fd(node)?;
        let stored = marker::escape(name.as_bytes()).ok_or(Errno::EINVAL)?;
        xattr::remove(&store::proc_path(fd.as_fd()), &stored)
    }

    /// Copies a node up unless it is local already.
    fn make_local(&self, node: &Arc<Node>, with_data: bool) -> Result<(), Errno> {
        if node.layer() == Layer::Local {
            return Ok(());
        }
        if node.is_dir() {
            self.ensure_local_dir(node).map(drop)
        } else {
            self.copy_up(node, with_data)
        }
    }

    /// An `O_PATH` handle on the object itself, wherever it lives.
    fn object_fd(&self, node: &Node) -> Result<Arc<OwnedFd>, Errno> {
        node.object().ok_or(Errno::ENODATA)
    }
}

fn timespec(t: Option<Time>) -> libc::timespec {
    match t {
        None => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        Some(Time::Now) => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_NOW,
        },
        Some(Time::At(t)) => {
            let (sec, nsec) = match t.duration_since(SystemTime::UNIX_EPOCH) {
                Ok(d) => (d.as_secs() as i64, d.subsec_nanos() as i64),
                Err(e) => {
                    // Before 1970: whole seconds down, nanoseconds up.
                    let d = e.duration();
                    let nanos = d.subsec_nanos() as i64;
                    if nanos == 0 {
                        (-(d.as_secs() as i64), 0)
                    } else {
                        (-(d.as_secs() as i64) - 1, 1_000_000_000 - nanos)
                    }
                }
            };
            libc::timespec {
                tv_sec: sec,
                tv_nsec: nsec,
            }
        }
    }
}

fn to_cstring(name: &OsStr) -> Result<CString, Errno> {
    CString::new(name.as_bytes()).map_err(|_| Errno::EINVAL)
}
