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
/// filesystem has no FIEMAP (tmpfs, for one).
pub fn allocated_between(fd: BorrowedFd<'_>, start: u64, end: u64) -> Result<u64, Errno> {
    let mut total = 0;
    let mut at = start;
    while at < end {
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
        if mapped == 0 {
            break;
        }
        let mut last = false;
        for e in &req.extents[..mapped] {
            let from = e.logical.max(start);
            let to = e.logical.saturating_add(e.length).min(end);
            total += to.saturating_sub(from);
            at = e.logical.saturating_add(e.length);
            last |= e.flags & FIEMAP_EXTENT_LAST != 0;
        }
        if last || mapped < BATCH {
            break;
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

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
