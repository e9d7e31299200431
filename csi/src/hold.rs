//! Holding a file's writers out for a moment, on any local filesystem: what makes the cut of
//! a volume published as a Block device one instant of it, where no device-mapper target can
//! be suspended and the store cannot reflink.
//!
//! Every write to a regular file on ext4, xfs, btrfs or tmpfs runs under the file's inode lock
//! (held shared by direct I/O, exclusive by buffered writes), and a loop device writes its
//! file through those same paths. The lock cannot be taken from user space directly, but a
//! write can be made to hold it: a one-byte `pwrite` whose source is a page registered with
//! userfaultfd takes the lock, faults on that page, and waits, lock held, until the fault is
//! answered. While it waits every other writer of the file blocks; readers do not (buffered
//! reads take no inode lock), so the file can be copied as it is at that instant.
//!
//! The fault is never answered with data: [`WriteHold`] unmaps the page and closes the
//! userfaultfd, the retried fault finds no mapping, and the write fails with `EFAULT` having
//! written nothing. So the file's bytes are never touched, also when the holder is dropped on
//! an error path (only its mtime moves, as for an empty write).
//!
//! Nothing that takes the inode lock may run on the file while it is held: `SEEK_DATA` and
//! `FICLONE` do, so a copy under the hold reads and writes plainly.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// `struct uffdio_api` and `struct uffdio_register` from `linux/userfaultfd.h`.
#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

const UFFD_API: u64 = 0xAA;
/// `_IOWR(0xAA, 0x3F, struct uffdio_api)`.
const UFFDIO_API: u64 = 0xC018_AA3F;
/// `_IOWR(0xAA, 0x00, struct uffdio_register)`.
const UFFDIO_REGISTER: u64 = 0xC020_AA00;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
/// `sizeof(struct uffd_msg)`.
const UFFD_MSG_SIZE: usize = 32;

/// How long the holding write may take to reach its fault. It takes only the inode lock
/// before it, so this is the longest a write already in progress on the file may still run.
const REACH: Duration = Duration::from_secs(30);

/// A file whose writers are held out until this is dropped.
pub struct WriteHold {
    /// Both `Some` until dropped, which ends the hold.
    uffd: Option<OwnedFd>,
    page: Option<Page>,
    writer: Option<JoinHandle<io::Result<usize>>>,
    since: Instant,
}

/// An anonymous page, unmapped on drop.
struct Page {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the page is only an address here; no Rust reference into it is ever made.
unsafe impl Send for Page {}

impl Drop for Page {
    fn drop(&mut self) {
        // SAFETY: `addr` and `len` are those of our own mmap, unmapped only here.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

impl WriteHold {
    /// Holds the writers of `file` out; returns once no write to it can start or is still
    /// running. `file` must be open for writing.
    pub fn take(file: &File) -> io::Result<WriteHold> {
        let uffd = userfaultfd()?;
        let page = Page::map()?;
        let mut register = UffdioRegister {
            start: page.addr as u64,
            len: page.len as u64,
            mode: UFFDIO_REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes the struct, which outlives the call.
        if unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_REGISTER as _, &mut register) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let target = file.try_clone()?;
        let source = page.addr as usize;
        let writer = std::thread::Builder::new()
            .name("cut-hold".into())
            .spawn(move || {
                // SAFETY: a one-byte view of our mapped page. It is not read here but by the
                // kernel, which faults on it; by the time the write returns the page is gone,
                // and the write fails without reading it.
                let byte = unsafe { std::slice::from_raw_parts(source as *const u8, 1) };
                target.write_at(byte, 0)
            })?;
        let mut hold = WriteHold {
            uffd: Some(uffd),
            page: Some(page),
            writer: Some(writer),
            since: Instant::now(),
        };
        hold.wait_for_fault()?;
        hold.since = Instant::now();
        Ok(hold)
    }

    /// How long the writers have been held out.
    pub fn held(&self) -> Duration {
        self.since.elapsed()
    }

    fn wait_for_fault(&mut self) -> io::Result<()> {
        let uffd = self.uffd.as_ref().map_or(-1, |fd| fd.as_raw_fd());
        let mut poll = libc::pollfd {
            fd: uffd,
            events: libc::POLLIN,
            revents: 0,
        };
        let timeout = REACH.as_millis() as libc::c_int;
        // SAFETY: one pollfd, alive for the call.
        let ready = unsafe { libc::poll(&mut poll, 1, timeout) };
        if ready < 0 {
            return Err(io::Error::last_os_error());
        }
        if ready == 0 {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "a write to the file did not end in time",
            ));
        }
        let mut msg = [0u8; UFFD_MSG_SIZE];
        // SAFETY: reads at most `msg.len()` bytes into `msg`.
        let n = unsafe { libc::read(uffd, msg.as_mut_ptr().cast(), msg.len()) };
        if n != UFFD_MSG_SIZE as isize || msg[0] != UFFD_EVENT_PAGEFAULT {
            return Err(io::Error::other(format!(
                "unexpected userfaultfd message ({n} bytes, event {:#x})",
                msg[0]
            )));
        }
        Ok(())
    }
}

impl Drop for WriteHold {
    fn drop(&mut self) {
        // The page goes first, so that the fault, woken by the close, finds no mapping and the
        // write fails without writing anything.
        drop(self.page.take());
        drop(self.uffd.take());
        if let Some(writer) = self.writer.take() {
            match writer.join() {
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EFAULT) => {}
                Ok(other) => {
                    tracing::error!(result = ?other, "the write holding a cut ended unexpectedly")
                }
                Err(_) => tracing::error!("the write holding a cut panicked"),
            }
        }
    }
}

impl Page {
    fn map() -> io::Result<Page> {
        // SAFETY: sysconf has no preconditions.
        let len = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Page { addr, len })
    }
}

fn userfaultfd() -> io::Result<OwnedFd> {
    // SAFETY: userfaultfd(2) takes flags only. Faults from the kernel (our write's copy from
    // the page) must reach us too, so not UFFD_USER_MODE_ONLY: that needs CAP_SYS_PTRACE.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    let uffd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes the struct, which outlives the call.
    if unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_API as _, &mut api) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(uffd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A writer blocks while the hold lasts and goes on after; reads see the file; the
    /// file's bytes are what they were.
    #[test]
    fn writers_wait_readers_do_not_and_nothing_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk");
        std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let hold = WriteHold::take(&file).unwrap();

        let (tx, rx) = mpsc::channel();
        let other = file.try_clone().unwrap();
        std::thread::spawn(move || {
            let _ = tx.send(other.write_at(b"new", 4096));
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "a write went through while held"
        );
        let mut read = [0u8; 3];
        file.read_at(&mut read, 4096).unwrap();
        assert_eq!(read, [7, 7, 7], "reads go on, and see no held write");
        assert!(hold.held() >= Duration::from_millis(300));
        drop(hold);

        rx.recv_timeout(Duration::from_secs(10))
            .expect("the writer goes on once released")
            .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes[0], 7, "the holding write wrote nothing");
        assert_eq!(&bytes[4096..4099], b"new");
        assert_eq!(bytes.len(), 1 << 20);
    }
}
