//! File data calls through the daemon: writes, `fallocate`, truncates and
//! `copy_file_range`. They allocate as the caller (see [`crate::store::creds`]); inside a
//! quota root they reserve what they may allocate, estimated from the file's extents.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use nix::errno::Errno;

use crate::quota::io::{estimate, reserve_fitting};
use crate::quota::scan::allocated;
use crate::store::{self, creds};
use crate::view::node::Node;
use crate::view::{Caller, View};

impl View {
    /// Writes `data` at `offset` of the open file `fd` of `node`, within its quota: a
    /// write that only partly fits is cut short at the limit, as on a full disk.
    pub fn write_at(
        &self,
        node: &Arc<Node>,
        fd: BorrowedFd<'_>,
        offset: u64,
        data: &[u8],
        caller: Caller,
    ) -> Result<usize, Errno> {
        let write = |data: &[u8]| creds::run_as(caller.acting(), || pwrite_all(fd, data, offset));
        let Some(root) = self.quota_of(node) else {
            return write(data);
        };
        let st = store::stat_fd(fd)?;
        let before = allocated(&st);
        let (len, reservation) = reserve_fitting(&root, fd, &st, offset, data.len() as u64)?;
        let written = write(&data[..len as usize]);
        self.settle(&root, node, fd, before);
        drop(reservation);
        written
    }

    /// `fallocate(2)` within the quota: allocating more than the room fails before
    /// anything is allocated; punching holes credits what they free.
    pub fn fallocate_at(
        &self,
        node: &Arc<Node>,
        fd: BorrowedFd<'_>,
        mode: i32,
        offset: u64,
        length: u64,
        caller: Caller,
    ) -> Result<(), Errno> {
        let call = || {
            creds::run_as(caller.acting(), || {
                Errno::result(unsafe {
                    libc::fallocate(
                        fd.as_raw_fd(),
                        mode,
                        offset as libc::off_t,
                        length as libc::off_t,
                    )
                })
            })
            .map(drop)
        };
        let Some(root) = self.quota_of(node) else {
            return call();
        };
        let st = store::stat_fd(fd)?;
        let frees = mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_COLLAPSE_RANGE) != 0;
        let reservation = if frees {
            None
        } else {
            Some(root.reserve(estimate(fd, &st, offset, length))?)
        };
        let result = call();
        self.settle(&root, node, fd, allocated(&st));
        drop(reservation);
        result
    }

    /// Changes the size of the file `fd` of `node` within its quota. Growing a file makes
    /// a hole, free where the filesystem has sparse files; where it allocated anyway and
    /// went over the limit, the old size is put back.
    pub(in crate::view) fn truncate_within_quota(
        &self,
        node: &Arc<Node>,
        fd: BorrowedFd<'_>,
        size: u64,
    ) -> Result<(), Errno> {
        let truncate = |len: u64| {
            Errno::result(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) }).map(drop)
        };
        let Some(root) = self.quota_of(node) else {
            return truncate(size);
        };
        let st = store::stat_fd(fd)?;
        let old_size = st.st_size.max(0) as u64;
        truncate(size)?;
        let grew = self.settle(&root, node, fd, allocated(&st));
        if size > old_size && grew > 0 && root.usage().bytes > root.limit().bytes {
            truncate(old_size)?;
            self.settle(&root, node, fd, allocated(&st));
            return Err(root.exceeded());
        }
        Ok(())
    }

    /// `copy_file_range(2)` of `len` bytes from `(src, offset_in)` into `(dst, offset_out)`,
    /// `dst` an open file of `node`, within its quota.
    pub fn copy_range_at(
        &self,
        node: &Arc<Node>,
        (src, offset_in): (BorrowedFd<'_>, u64),
        (dst, offset_out): (BorrowedFd<'_>, u64),
        len: u64,
        caller: Caller,
    ) -> Result<usize, Errno> {
        let copy = |len: u64| {
            let mut off_in = offset_in as libc::loff_t;
            let mut off_out = offset_out as libc::loff_t;
            creds::run_as(caller.acting(), || {
                Errno::result(unsafe {
                    libc::copy_file_range(
                        src.as_raw_fd(),
                        &mut off_in,
                        dst.as_raw_fd(),
                        &mut off_out,
                        len.min(1 << 30) as usize,
                        0,
                    )
                })
            })
            .map(|n| n as usize)
        };
        let Some(root) = self.quota_of(node) else {
            return copy(len);
        };
        let st = store::stat_fd(dst)?;
        let (len, reservation) = reserve_fitting(&root, dst, &st, offset_out, len)?;
        let copied = copy(len);
        self.settle(&root, node, dst, allocated(&st));
        drop(reservation);
        copied
    }
}

fn pwrite_all(fd: BorrowedFd<'_>, data: &[u8], offset: u64) -> Result<usize, Errno> {
    let mut done = 0;
    while done < data.len() {
        match nix::sys::uio::pwrite(fd, &data[done..], (offset as usize + done) as libc::off_t) {
            Ok(n) => done += n,
            Err(Errno::EINTR) => continue,
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(done)
}
