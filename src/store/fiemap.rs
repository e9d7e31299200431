//! Which parts of a file have space allocated, from the `FS_IOC_FIEMAP` ioctl.
//!
//! `SEEK_HOLE` would be simpler, but it reports preallocated (`fallocate`d, unwritten)
//! extents as holes, and those blocks are allocated: a quota must not charge a write into
//! them again. FIEMAP lists every extent, unwritten and delayed-allocation ones included.

use std::os::fd::{AsRawFd, BorrowedFd};

use nix::errno::Errno;

/// `struct fiemap_extent` (linux/fiemap.h).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Extent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

const BATCH: usize = 32;

/// `struct fiemap` with room for [`BATCH`] extents.
#[repr(C)]
struct Request {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
    extents: [Extent; BATCH],
}

const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// `_IOWR('f', 11, struct fiemap)`.
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;

/// Bytes of `[start, end)` of the file that have space allocated. Fails where the
/// filesystem has no FIEMAP (tmpfs, for one), and where its answers cannot be paged
/// through (see [`Walk::take`]).
pub fn allocated_between(fd: BorrowedFd<'_>, start: u64, end: u64) -> Result<u64, Errno> {
    let mut walk = Walk::new(start, end);
    while let Some(at) = walk.next_start() {
        let mut req = Request {
            start: at,
            length: end - at,
            flags: 0,
            mapped_extents: 0,
            extent_count: BATCH as u32,
            reserved: 0,
            extents: [Extent::default(); BATCH],
        };
        // The kernel fills at most `extent_count` extents of the struct we own.
        Errno::result(unsafe { libc::ioctl(fd.as_raw_fd(), FS_IOC_FIEMAP, &mut req) })?;
        let mapped = (req.mapped_extents as usize).min(BATCH);
        walk.take(&req.extents[..mapped])?;
    }
    Ok(walk.total)
}

/// The extents of `[start, end)` read one batch after another.
struct Walk {
    end: u64,
    /// Where the next batch starts; `None` once the range is done.
    at: Option<u64>,
    total: u64,
}

impl Walk {
    fn new(start: u64, end: u64) -> Walk {
        Walk {
            end,
            at: (start < end).then_some(start),
            total: 0,
        }
    }

    fn next_start(&self) -> Option<u64> {
        self.at
    }

    /// Counts a batch's extents within the range, from where the batch was asked to start
    /// (what lies before was counted from earlier batches). A full batch that ends no
    /// further than where it was asked to start cannot be paged past: btrfs, while a file
    /// has data not yet written back, lists its extents from the file's start whatever the
    /// range asked, and asking again from the same place gets the same batch.
    fn take(&mut self, batch: &[Extent]) -> Result<(), Errno> {
        let Some(at) = self.at else {
            return Ok(());
        };
        let mut reached = at;
        let mut last = false;
        for e in batch {
            let end = e.logical.saturating_add(e.length);
            let (from, to) = (e.logical.max(at), end.min(self.end));
            self.total += to.saturating_sub(from);
            reached = reached.max(end);
            last |= e.flags & FIEMAP_EXTENT_LAST != 0;
        }
        if last || batch.len() < BATCH || reached >= self.end {
            self.at = None;
            return Ok(());
        }
        if reached <= at {
            return Err(Errno::EOPNOTSUPP);
        }
        self.at = Some(reached);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn extent(logical: u64, length: u64) -> Extent {
        Extent {
            logical,
            length,
            ..Extent::default()
        }
    }

    #[test]
    fn a_walk_counts_only_the_range_and_pages_on() {
        let mut walk = Walk::new(4096, 20_480);
        let mut first: Vec<_> = (0..BATCH as u64 - 1)
            .map(|i| extent(4096 + i * 128, 128))
            .collect();
        first.push(extent(8192, 4096));
        walk.take(&first).unwrap();
        assert_eq!(
            walk.next_start(),
            Some(12_288),
            "a full batch pages on from its end"
        );
        walk.take(&[extent(16_384, 8192)]).unwrap();
        assert_eq!(walk.next_start(), None);
        let want = 31 * 128 + 4096 + 4096;
        assert_eq!(walk.total, want, "only what lies in the range counts");
    }

    #[test]
    fn a_later_batch_counts_nothing_twice() {
        let mut walk = Walk::new(0, 1 << 20);
        let first: Vec<_> = (0..BATCH as u64).map(|i| extent(i * 8192, 4096)).collect();
        walk.take(&first).unwrap();
        let at = walk.next_start().unwrap();
        // The next batch lists the previous one's last extent again, and one more.
        walk.take(&[extent(at - 4096, 4096), extent(at + 4096, 4096)])
            .unwrap();
        assert_eq!(walk.total, (BATCH as u64 + 1) * 4096);
    }

    #[test]
    fn a_batch_that_lists_from_the_files_start_is_refused_not_asked_again() {
        // btrfs with delayed allocation: 32 extents before the range, asked from its start.
        let mut walk = Walk::new(1 << 30, (1 << 30) + 4096);
        let before: Vec<_> = (0..BATCH as u64).map(|i| extent(i << 20, 4096)).collect();
        assert_eq!(walk.take(&before), Err(Errno::EOPNOTSUPP));
    }

    #[test]
    fn counts_written_and_preallocated_extents_not_holes() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        let file = std::fs::File::create(&path).unwrap();
        let fd = file.as_fd();
        let Ok(0) = allocated_between(fd, 0, 1 << 20) else {
            // No FIEMAP on this filesystem: nothing to check.
            return;
        };
        nix::sys::uio::pwrite(fd, &[1u8; 8192], 0).unwrap();
        file.set_len(1 << 20).unwrap();
        let prealloc = nix::fcntl::fallocate(
            fd,
            nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            1 << 20,
            1 << 20,
        );
        assert_eq!(allocated_between(fd, 0, 8192).unwrap(), 8192);
        assert_eq!(allocated_between(fd, 4096, 65_536).unwrap(), 4096);
        assert_eq!(allocated_between(fd, 65_536, 1 << 20).unwrap(), 0);
        if prealloc.is_ok() {
            assert_eq!(allocated_between(fd, 1 << 20, 2 << 20).unwrap(), 1 << 20);
        }
    }
}
