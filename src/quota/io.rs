//! What a call on file data may allocate, estimated before it runs: writes, `fallocate`,
//! the copy of a remote file, and the holes of a file a shared mapping may fill.
//!
//! An estimate is what gets reserved (see [`super::table`]); what a call really allocated
//! is measured afterwards. So an estimate errs towards too much only where a filesystem
//! cannot tell, and never counts space that is already there: overwriting allocated data
//! must work in a full root.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;

use nix::errno::Errno;

use super::ledger::Ledger;
use super::scan::allocated;
use super::scan::block_size;
use super::seam::{Need, Reserved, Under};
use super::table::{QuotaRoot, Reservation};
use crate::store;

/// The estimate of calls that make a new name: they need a root that is not full, as on
/// XFS, where a new entry reserves directory space.
const NEEDS_ROOM: u64 = 1;

/// Symlink targets shorter than this live in the inode itself on most filesystems;
/// longer ones take a block.
const INLINE_TARGET: usize = 60;

impl Ledger {
    /// See [`super::Accounting::reserve`].
    pub(super) fn set_aside(&self, under: &Under, need: Need<'_>) -> Result<Reserved, Errno> {
        // The kernel enforces its roots on the allocations themselves.
        let Some(root) = under.0.as_ref().filter(|r| !r.by_kernel()) else {
            let granted = match need {
                Need::Write { len, .. } => len,
                _ => 0,
            };
            return Ok(Reserved {
                _room: None,
                granted,
            });
        };
        let entry = |bytes, inodes| root.reserve_with_inodes(bytes, inodes);
        let (room, granted) = match need {
            Need::Entry { inodes } => (entry(NEEDS_ROOM, inodes)?, 0),
            Need::Dir => (entry(self.block, 1)?, 0),
            Need::Symlink { len } if len < INLINE_TARGET => (entry(NEEDS_ROOM, 1)?, 0),
            Need::Symlink { .. } => (entry(self.block, 1)?, 0),
            Need::CopyUp { data } => {
                let bytes = data.map_or(NEEDS_ROOM, |source| {
                    copy_estimate(source, self.block).max(NEEDS_ROOM)
                });
                (entry(bytes, 1)?, 0)
            }
            Need::Write {
                fd,
                st,
                offset,
                len,
            } => {
                let (granted, room) = reserve_fitting(root, fd, st, offset, len)?;
                (room, granted)
            }
            Need::Range {
                fd,
                st,
                offset,
                len,
            } => (root.reserve(estimate(fd, st, offset, len))?, 0),
            Need::Holes { fd } => {
                let st = store::stat_fd(fd)?;
                let block = self.block.max(1);
                let size = (st.st_size as u64).div_ceil(block) * block;
                let holes = size.saturating_sub(allocated(&st));
                (root.reserve(holes)?, 0)
            }
        };
        Ok(Reserved {
            _room: Some(room),
            granted,
        })
    }
}

/// Room a root must have beyond a write's worst case for the worst case to be reserved
/// without asking the filesystem which blocks of the range exist. That question costs a
/// system call per write, and on some filesystems far more: tmpfs answers `SEEK_HOLE` by
/// walking the file's pages from the offset on, a millisecond for a 4 KiB write into a
/// 256 MiB file. Only near the limit does the exact answer matter: overwriting allocated
/// data must work in a full root. Above this much room, the worst cases reserved at once
/// (every request in flight writing a whole span it already has) cannot make another
/// write fail that the exact answers would have let through.
const SLACK: u64 = 64 << 20;

/// The whole blocks that writing `len` bytes at `offset` touches, as a byte range: its
/// length is the most the write can allocate.
fn span(st: &libc::stat, offset: u64, len: u64) -> std::ops::Range<u64> {
    let block = block_size(st);
    offset / block * block..offset.saturating_add(len).div_ceil(block) * block
}

/// What writing `len` bytes at `offset` of the file may allocate: the blocks of the range
/// that have no space yet. Where the filesystem cannot tell (no FIEMAP), a range that
/// `SEEK_HOLE` finds all data costs only what grows the file, any other the whole range.
fn estimate(fd: BorrowedFd<'_>, st: &libc::stat, offset: u64, len: u64) -> u64 {
    if len == 0 {
        return 0;
    }
    let block = block_size(st);
    let round_up = |x: u64| x.div_ceil(block) * block;
    let std::ops::Range { start, end } = span(st, offset, len);
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
fn copy_estimate(source: BorrowedFd<'_>, block: u64) -> u64 {
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
    st: &libc::stat,
    offset: u64,
    len: u64,
) -> Result<(u64, Reservation), Errno> {
    let range = span(st, offset, len);
    let worst = range.end - range.start;
    if root.room() >= worst.saturating_add(SLACK) {
        if let Ok(r) = root.reserve(worst) {
            return Ok((len, r));
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::table::{Limit, Usage};

    fn root(limit: u64) -> Arc<QuotaRoot> {
        let limit = Limit {
            bytes: limit,
            inodes: None,
        };
        Arc::new(QuotaRoot::new(
            0,
            0,
            "q".into(),
            limit,
            Usage::default(),
            Errno::EDQUOT,
        ))
    }

    #[test]
    fn ample_room_takes_the_worst_case_and_a_full_root_the_exact_one() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        std::fs::write(&path, vec![1u8; 1 << 20]).unwrap();
        let file = std::fs::File::options().write(true).open(&path).unwrap();
        let fd = file.as_fd();
        let st = store::stat_fd(fd).unwrap();
        let block = block_size(&st);
        // Far from the limit: an overwrite of allocated data reserves its span, unasked.
        let ample = root(1 << 30);
        let (granted, held) = reserve_fitting(&ample, fd, &st, 100, 4096).unwrap();
        assert_eq!(granted, 4096);
        assert_eq!((1 << 30) - ample.room(), 2 * block);
        drop(held);
        assert_eq!(ample.room(), 1 << 30);
        // Near it, only what the write really allocates: none, so even a full root takes it.
        let full = root(0);
        let (granted, held) = reserve_fitting(&full, fd, &st, 100, 4096).unwrap();
        assert_eq!((granted, full.room()), (4096, 0));
        drop(held);
        let near = root(SLACK);
        let (_, _held) = reserve_fitting(&near, fd, &st, 0, 4096).unwrap();
        assert_eq!(near.room(), SLACK);
        // A write that does allocate, in a full root, is refused.
        assert_eq!(
            reserve_fitting(&full, fd, &st, 1 << 20, 4096).err(),
            Some(Errno::EDQUOT)
        );
    }

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
