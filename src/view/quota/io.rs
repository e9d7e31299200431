//! File data calls through the daemon: writes, `fallocate`, truncates and
//! `copy_file_range`. They allocate as the caller (see [`crate::store::creds`]); inside a
//! quota root they reserve what they may allocate, estimated from the file's extents.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;

use nix::errno::Errno;

use super::block_size;
use crate::quota::scan::allocated;
use crate::quota::table::{QuotaRoot, Reservation};
use crate::store::{self, creds};
use crate::view::node::Node;
use crate::view::{Caller, Stat, View};

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

/// What writing `len` bytes at `offset` of the file may allocate: the blocks of the range
/// that have no space yet. Where the filesystem cannot tell (no FIEMAP), a range that
/// `SEEK_HOLE` finds all data costs only what grows the file, any other the whole range.
fn estimate(fd: BorrowedFd<'_>, st: &Stat, offset: u64, len: u64) -> u64 {
    if len == 0 {
        return 0;
    }
    let block = block_size(st);
    let round_up = |x: u64| x.div_ceil(block) * block;
    let start = offset / block * block;
    let end = round_up(offset.saturating_add(len));
    let whole = end - start;
    if let Ok(have) = store::fiemap::allocated_between(fd, start, end) {
        return whole.saturating_sub(have);
    }
    let size = st.st_size.max(0) as u64;
    if offset >= size {
        // An append: every block is new but the one the file ends in, when it starts there.
        let shared = (offset % block != 0 && start < size) as u64 * block;
        return whole - shared;
    }
    let hole = unsafe { libc::lseek(fd.as_raw_fd(), offset as libc::off_t, libc::SEEK_HOLE) };
    if hole < 0 || (hole as u64) < (offset + len).min(size) {
        return whole;
    }
    end.saturating_sub(round_up(size))
}

/// What a copy of the remote file behind `source` will allocate in local: its data
/// extents (the copy keeps holes), in whole local blocks. Not its `st_blocks`, which a
/// compressing or network filesystem may report far below the data it holds.
pub(in crate::view) fn copy_estimate(source: BorrowedFd<'_>, block: u64) -> u64 {
    let Ok(fd) = store::reopen(source, nix::fcntl::OFlag::O_RDONLY) else {
        return 0;
    };
    let Ok(st) = store::stat_fd(fd.as_fd()) else {
        return 0;
    };
    let size = st.st_size.max(0) as u64;
    let round_up = |x: u64| x.div_ceil(block) * block;
    let seek = |at: u64, whence| {
        let r = unsafe { libc::lseek(fd.as_raw_fd(), at as libc::off_t, whence) };
        (r >= 0).then_some(r as u64)
    };
    let mut total = 0;
    let mut at = 0;
    while at < size {
        let Some(data) = seek(at, libc::SEEK_DATA) else {
            break;
        };
        let end = seek(data, libc::SEEK_HOLE).unwrap_or(size).min(size);
        if end <= data {
            // No SEEK_DATA support worth the name: count the whole file.
            return round_up(size);
        }
        total += round_up(end) - data / block * block;
        at = end;
    }
    total.min(round_up(size))
}

/// Reserves room for writing `len` bytes at `offset` of the file `fd`; where they do not
/// all fit, for as many as fit, as a full disk makes a short write. Returns how many.
fn reserve_fitting(
    root: &Arc<QuotaRoot>,
    fd: BorrowedFd<'_>,
    st: &Stat,
    offset: u64,
    len: u64,
) -> Result<(u64, Reservation), Errno> {
    match root.reserve(estimate(fd, st, offset, len)) {
        Ok(r) => Ok((len, r)),
        Err(full) => {
            let fits = fitting(offset, root.room(), block_size(st)).min(len);
            if fits == 0 {
                return Err(full);
            }
            let r = root
                .reserve(estimate(fd, st, offset, fits))
                .map_err(|_| full)?;
            Ok((fits, r))
        }
    }
}

/// How many bytes from `offset` fit in `room` bytes of whole blocks.
fn fitting(offset: u64, room: u64, block: u64) -> u64 {
    let start = offset / block * block;
    (start + room / block * block).saturating_sub(offset)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fitting_counts_whole_blocks_from_the_offset() {
        assert_eq!(fitting(0, 8192, 4096), 8192);
        assert_eq!(fitting(0, 8191, 4096), 4096);
        assert_eq!(fitting(100, 4096, 4096), 3996);
        assert_eq!(fitting(4096, 0, 4096), 0);
    }

    #[test]
    fn estimates_appends_overwrites_and_holes() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        std::fs::write(&path, vec![1u8; 10_000]).unwrap();
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let fd = file.as_fd();
        let st = store::stat_fd(fd).unwrap();
        // Inside data: nothing new.
        assert_eq!(estimate(fd, &st, 0, 4096), 0);
        // An append at the end, which is mid-block: the tail block is there already.
        assert_eq!(estimate(fd, &st, 10_000, 100), 0);
        assert_eq!(estimate(fd, &st, 10_000, 4096), 4096);
        // Past the end, block-aligned.
        assert_eq!(estimate(fd, &st, 12_288, 1 << 20), 1 << 20);
        // Overwrite running past the end.
        assert_eq!(estimate(fd, &st, 8192, 8192), 4096);
        // A hole.
        file.set_len(1 << 20).unwrap();
        let st = store::stat_fd(fd).unwrap();
        assert_eq!(estimate(fd, &st, 65_536, 4096), 4096);
        assert_eq!(estimate(fd, &st, 0, 0), 0);
    }
}
