//! A write through a shared mapping moves the file's modification and change times, as on
//! local's filesystem, and `stat` sees them as soon as the writer unmaps, syncs or exits:
//! every time, not once the kernel's cached attributes happen to expire.

mod common;
use common::*;

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

/// How many times each sequence runs: a stale cached attribute shows up only sometimes.
const ROUNDS: usize = 10;

/// The file's (mtime, ctime), in nanoseconds.
fn times(path: &Path) -> (i128, i128) {
    let m = fs::metadata(path).unwrap();
    (
        m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
        m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128,
    )
}

/// Sets the file's times an hour back, so that any change shows.
fn age(path: &Path) {
    let t = nix::sys::time::TimeSpec::new(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
            - 3600,
        0,
    );
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &t,
        &t,
        nix::sys::stat::UtimensatFlags::FollowSymlink,
    )
    .unwrap();
}

/// A shared writable mapping of the first page of `file`.
struct Mapped {
    addr: *mut libc::c_void,
}

impl Mapped {
    fn new(file: &fs::File) -> Mapped {
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(
            addr,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Mapped { addr }
    }

    fn write(&self, at: usize, byte: u8) {
        unsafe { *(self.addr as *mut u8).add(at) = byte };
    }

    fn sync(&self) {
        let res = unsafe { libc::msync(self.addr, 4096, libc::MS_SYNC) };
        assert_eq!(res, 0, "msync: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.addr, 4096) };
    }
}

/// The file `name` in the view's root, 4 KiB, its times an hour old; what `stat` says of
/// it, and the file opened for reading and writing.
fn fresh(m: &Mount, name: &str) -> (std::path::PathBuf, (i128, i128), fs::File) {
    let path = m.path(name);
    fs::write(&path, vec![b'a'; 4096]).unwrap();
    age(&path);
    let before = times(&path);
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    (path, before, file)
}

fn assert_moved(path: &Path, before: (i128, i128), what: &str) {
    let after = times(path);
    assert!(
        after.0 > before.0 && after.1 > before.1,
        "{what}: mtime/ctime {after:?}, still {before:?}"
    );
    assert_eq!(fs::read(path).unwrap()[7], b'z', "{what}: the data");
}

fn sequences(opts: &str) {
    let m = Mount::with(
        Options {
            opts: opts.into(),
            ..Options::default()
        },
        |_| {},
    );
    for round in 0..ROUNDS {
        // Unmapped, the file still open.
        let (path, before, file) = fresh(&m, &format!("unmap{round}"));
        // Attributes asked for by the writer itself, once mapped (xfs_io does), which
        // the kernel would cache.
        let map = Mapped::new(&file);
        file.metadata().unwrap();
        map.write(7, b'z');
        drop(map);
        assert_moved(
            &path,
            before,
            &format!("-o {opts}, round {round}: after munmap"),
        );
        // Stat just before the write: the attributes it cached must not outlive it.
        let map = Mapped::new(&file);
        let before = times(&path);
        std::thread::sleep(std::time::Duration::from_millis(20));
        map.write(8, b'y');
        drop(map);
        let after = times(&path);
        assert!(
            after.0 > before.0,
            "-o {opts}, round {round}: stat, write, munmap, stat: mtime {after:?}, still {before:?}"
        );
        drop(file);

        // Synced, still mapped.
        let (path, before, file) = fresh(&m, &format!("sync{round}"));
        let map = Mapped::new(&file);
        map.write(7, b'z');
        map.sync();
        assert_moved(
            &path,
            before,
            &format!("-o {opts}, round {round}: after msync"),
        );
        drop(map);
        drop(file);
    }
    // A writer that exits with its mapping in place (xfs_io's mwrite, generic/080).
    for round in 0..ROUNDS {
        let (path, before, file) = fresh(&m, &format!("exit{round}"));
        drop(file);
        let status = Command::new("python3")
            .arg("-c")
            .arg(
                "import mmap, os, sys\n\
                 fd = os.open(sys.argv[1], os.O_RDWR)\n\
                 m = mmap.mmap(fd, 4096)\n\
                 m[7] = ord('z')\n\
                 os._exit(0)\n",
            )
            .arg(&path)
            .status()
            .unwrap();
        assert!(status.success());
        assert_moved(
            &path,
            before,
            &format!("-o {opts}, round {round}: after exit"),
        );
    }
}

#[test]
fn mapped_writes_move_the_times_with_passthrough() {
    sequences("passthrough");
}

#[test]
fn mapped_writes_move_the_times_without_passthrough() {
    sequences("nopassthrough");
}
