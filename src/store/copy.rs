//! Copying file data between the trees without a userspace byte loop where the kernel can
//! do better: `copy_file_range` (reflinks and server-side copies where the filesystems
//! offer them), holes preserved with `SEEK_DATA`/`SEEK_HOLE`.

use std::os::fd::{AsRawFd, BorrowedFd};

use nix::errno::Errno;

const CHUNK: usize = 1 << 30;
const BUF: usize = 1 << 20;

/// Copies the first `len` bytes of `src` to the same offsets in `dst`, leaving holes where
/// `src` has them, and sets `dst`'s size to `len`.
pub fn copy_data(src: BorrowedFd<'_>, dst: BorrowedFd<'_>, len: u64) -> Result<(), Errno> {
    let mut pos = 0u64;
    while pos < len {
        let (start, end) = match next_extent(src, pos, len)? {
            Some(extent) => extent,
            None => break,
        };
        copy_range(src, dst, start, end)?;
        pos = end;
    }
    Errno::result(unsafe { libc::ftruncate(dst.as_raw_fd(), len as libc::off_t) }).map(drop)
}

/// The next data extent at or after `pos`, or `None` past the last one. Filesystems without
/// hole reporting describe the whole file as one extent.
fn next_extent(fd: BorrowedFd<'_>, pos: u64, len: u64) -> Result<Option<(u64, u64)>, Errno> {
    let data = unsafe { libc::lseek(fd.as_raw_fd(), pos as libc::off_t, libc::SEEK_DATA) };
    if data < 0 {
        return match Errno::last() {
            Errno::ENXIO => Ok(None),
            Errno::EINVAL | Errno::EOPNOTSUPP => Ok(Some((pos, len))),
            e => Err(e),
        };
    }
    let start = data as u64;
    if start >= len {
        return Ok(None);
    }
    let hole = unsafe { libc::lseek(fd.as_raw_fd(), start as libc::off_t, libc::SEEK_HOLE) };
    let end = if hole < 0 {
        len
    } else {
        (hole as u64).min(len)
    };
    Ok(Some((start, end)))
}

fn copy_range(src: BorrowedFd<'_>, dst: BorrowedFd<'_>, start: u64, end: u64) -> Result<(), Errno> {
    let mut pos = start;
    while pos < end {
        let want = ((end - pos) as usize).min(CHUNK);
        let mut off_in = pos as libc::loff_t;
        let mut off_out = pos as libc::loff_t;
        let n = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                want,
                0,
            )
        };
        if n < 0 {
            return match Errno::last() {
                Errno::EXDEV | Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP | Errno::EBADF => {
                    copy_buffered(src, dst, pos, end)
                }
                Errno::EINTR => continue,
                e => Err(e),
            };
        }
        if n == 0 {
            // The source shrank under us; what is there is copied.
            return Ok(());
        }
        pos += n as u64;
    }
    Ok(())
}

fn copy_buffered(
    src: BorrowedFd<'_>,
    dst: BorrowedFd<'_>,
    start: u64,
    end: u64,
) -> Result<(), Errno> {
    let mut buf = vec![0u8; BUF];
    let mut pos = start;
    while pos < end {
        let want = ((end - pos) as usize).min(BUF);
        let n = nix::sys::uio::pread(src, &mut buf[..want], pos as libc::off_t)?;
        if n == 0 {
            return Ok(());
        }
        let mut done = 0;
        while done < n {
            done +=
                nix::sys::uio::pwrite(dst, &buf[done..n], (pos as usize + done) as libc::off_t)?;
        }
        pos += n as u64;
    }
    Ok(())
}
