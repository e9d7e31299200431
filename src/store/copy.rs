//! Copying file data between the trees without a userspace byte loop where the kernel can
//! do better: `copy_file_range` (reflinks and server-side copies where the filesystems
//! offer them), holes preserved with `SEEK_DATA`/`SEEK_HOLE`.
//!
//! A copy is flushed before it takes its name (a copy-up must not leave a name on a file
//! whose data a crash loses), so its writeback is started as it goes: the flush then
//! waits for a disk that has been writing all along, instead of starting all of it at
//! the end, as kernel overlayfs does.

use std::os::fd::{AsRawFd, BorrowedFd};

use nix::errno::Errno;

/// Bytes copied per call, and between two starts of writeback.
const CHUNK: u64 = 8 << 20;
const BUF: usize = 1 << 20;

/// Copies the first `len` bytes of `src` to the same offsets in `dst`, leaving holes where
/// `src` has them, and sets `dst`'s size to `len`.
pub fn copy_data(src: BorrowedFd<'_>, dst: BorrowedFd<'_>, len: u64) -> Result<(), Errno> {
    let mut behind = WriteBehind { dst, from: 0 };
    let mut pos = 0u64;
    while pos < len {
        let (start, end) = match next_extent(src, pos, len)? {
            Some(extent) => extent,
            None => break,
        };
        copy_range(src, &mut behind, start, end)?;
        pos = end;
    }
    Errno::result(unsafe { libc::ftruncate(dst.as_raw_fd(), len as libc::off_t) }).map(drop)
}

/// Starts the writeback of what was copied into `dst`, a chunk at a time.
struct WriteBehind<'a> {
    dst: BorrowedFd<'a>,
    /// Where what has not been handed to writeback yet starts.
    from: u64,
}

impl WriteBehind<'_> {
    /// `dst` holds what was copied up to `to`.
    fn copied(&mut self, to: u64) {
        if to < self.from + CHUNK {
            return;
        }
        // Only a hint: the flush after the copy reports any error writeback meets.
        // SAFETY: sync_file_range takes no pointers.
        unsafe {
            libc::sync_file_range(
                self.dst.as_raw_fd(),
                self.from as libc::off64_t,
                (to - self.from) as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            )
        };
        self.from = to;
    }
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

fn copy_range(
    src: BorrowedFd<'_>,
    behind: &mut WriteBehind<'_>,
    start: u64,
    end: u64,
) -> Result<(), Errno> {
    let dst = behind.dst;
    let mut pos = start;
    while pos < end {
        let want = (end - pos).min(CHUNK) as usize;
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
                    copy_buffered(src, behind, pos, end)
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
        behind.copied(pos);
    }
    Ok(())
}

fn copy_buffered(
    src: BorrowedFd<'_>,
    behind: &mut WriteBehind<'_>,
    start: u64,
    end: u64,
) -> Result<(), Errno> {
    let dst = behind.dst;
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
        behind.copied(pos);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::fd::AsFd;
    use std::os::unix::fs::{FileExt, MetadataExt};

    use super::*;

    const MIB: u64 = 1 << 20;

    /// A file of `len` bytes with `extents` of data (offset, length, byte) and holes between.
    fn sparse(path: &std::path::Path, len: u64, extents: &[(u64, u64, u8)]) -> File {
        let f = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .unwrap();
        for &(at, n, byte) in extents {
            f.write_all_at(&vec![byte; n as usize], at).unwrap();
        }
        f.set_len(len).unwrap();
        f
    }

    #[test]
    fn copies_data_across_chunks_and_keeps_the_holes() {
        let tmp = tempfile::tempdir().unwrap();
        let extents = [(0, 3 * MIB, 1), (40 * MIB, CHUNK + 5, 2), (70 * MIB, 1, 3)];
        let src = sparse(&tmp.path().join("src"), 80 * MIB, &extents);
        let dst = sparse(&tmp.path().join("dst"), 0, &[]);
        copy_data(src.as_fd(), dst.as_fd(), 80 * MIB).unwrap();
        assert_eq!(dst.metadata().unwrap().len(), 80 * MIB);
        let mut got = vec![0u8; (80 * MIB) as usize];
        dst.read_exact_at(&mut got, 0).unwrap();
        let mut want = vec![0u8; got.len()];
        for &(at, n, byte) in &extents {
            want[at as usize..(at + n) as usize].fill(byte);
        }
        assert!(got == want, "the copy differs from its source");
        // Where the filesystem reports holes, they stay holes: what the extents take, not
        // the 80 MiB of the file.
        let allocated = dst.metadata().unwrap().blocks() * 512;
        assert!(allocated < 20 * MIB, "{allocated} bytes allocated");
    }

    #[test]
    fn the_buffered_copy_writes_the_same_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let src = sparse(
            &tmp.path().join("src"),
            CHUNK * 2 + 7,
            &[(0, CHUNK * 2 + 7, 9)],
        );
        let dst = sparse(&tmp.path().join("dst"), 0, &[]);
        let mut behind = WriteBehind {
            dst: dst.as_fd(),
            from: 0,
        };
        copy_buffered(src.as_fd(), &mut behind, 0, CHUNK * 2 + 7).unwrap();
        assert_eq!(
            behind.from,
            CHUNK * 2,
            "writeback was started chunk by chunk"
        );
        let mut got = vec![0u8; (CHUNK * 2 + 7) as usize];
        dst.read_exact_at(&mut got, 0).unwrap();
        assert!(got.iter().all(|&b| b == 9));
    }
}
