//! Integrity regressions: each test is a bug seen on a real mount, and asserts what a correct
//! union filesystem (and, where there is one, the host filesystem as a reference) does.
//!
//! Here, open files and mappings, where the kernel holds what the view served:
//!
//! - an open file whose name is gone (new, or copied up from a layer) answers every call on
//!   its descriptor as on the host filesystem;
//! - a mapping made after a copy-up shows the new bytes, not the remote file's pages;
//! - writes through a shared mapping update mtime and ctime at once, not after the attribute
//!   timeout.
//!
//! The open-unlinked tests compare with the same calls on a plain directory of the host
//! filesystem (the default temp dir, ext4 on the reference machine). Needs root and
//! `/dev/fuse`.

mod common;

use std::fs;
use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use common::sys::*;
use common::*;

// ---- Open-unlinked files ----

/// What one step of [`unlinked_sequence`] left, as `fstat` and the call's result show it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    /// What the call returned (bytes for `copy_file_range`, 0 otherwise).
    ret: usize,
    size: u64,
    perm: u32,
    nlink: u64,
    /// After `futimens` only: (atime, mtime) as set.
    times: Option<(i64, i64, i64, i64)>,
    /// After `fallocate` only: whether the 4 KiB are allocated.
    allocated: Option<bool>,
    /// After the last step only: the length and SHA-256 of the file's content.
    data: Option<String>,
}

fn digest(data: &[u8]) -> String {
    use sha2::Digest;
    format!(
        "{} bytes, sha256 {:x}",
        data.len(),
        sha2::Sha256::digest(data)
    )
}

/// `st_nlink`, whose type differs between architectures.
#[allow(clippy::unnecessary_cast)]
fn nlink_of(st: &libc::stat) -> u64 {
    st.st_nlink as u64
}

fn fstat_fd(fd: RawFd) -> std::io::Result<libc::stat> {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    check(unsafe { libc::fstat(fd, &mut st) })?;
    Ok(st)
}

/// Opens `path` read-write, unlinks it, and then works on it only through the descriptor:
/// `ftruncate`, `truncate` of `/proc/self/fd/N`, `fchmod`, `futimens`, `fallocate`, `fsync`,
/// `fdatasync`, `copy_file_range` from `src` into it and from it into `out` (both linked,
/// in the same directory), reading it back. Each step: its result and what `fstat` says.
fn unlinked_sequence(
    path: &Path,
    src: &Path,
    out: &Path,
) -> Vec<(&'static str, Result<Seen, String>)> {
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {} O_RDWR: {e}", path.display()));
    let fd = file.as_raw_fd();
    let src_file = fs::File::open(src).unwrap();
    let out_file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(out)
        .unwrap();
    let mut steps = Vec::new();
    let mut record = |name: &'static str,
                      r: std::io::Result<usize>,
                      extra: &dyn Fn(&libc::stat) -> Seen| {
        let seen = r
            .and_then(|ret| {
                let st = fstat_fd(fd).map_err(|e| std::io::Error::other(format!("fstat: {e}")))?;
                Ok(Seen { ret, ..extra(&st) })
            })
            .map_err(|e| match e.raw_os_error() {
                Some(n) => errname(n),
                None => e.to_string(),
            });
        steps.push((name, seen));
    };
    let basic = |st: &libc::stat| Seen {
        ret: 0,
        size: st.st_size as u64,
        perm: st.st_mode & 0o7777,
        nlink: nlink_of(st),
        times: None,
        allocated: None,
        data: None,
    };
    record("unlink", fs::remove_file(path).map(|_| 0), &basic);
    record(
        "ftruncate 5000",
        check(unsafe { libc::ftruncate(fd, 5000) }).map(|_| 0),
        &basic,
    );
    let proc_path = cpath(Path::new(&format!("/proc/self/fd/{fd}")));
    record(
        "truncate /proc/self/fd/N 3000",
        check(unsafe { libc::truncate(proc_path.as_ptr(), 3000) }).map(|_| 0),
        &basic,
    );
    record(
        "fchmod 600",
        check(unsafe { libc::fchmod(fd, 0o600) }).map(|_| 0),
        &basic,
    );
    let times = [
        libc::timespec {
            tv_sec: 1_000_000_000,
            tv_nsec: 500,
        },
        libc::timespec {
            tv_sec: 1_100_000_000,
            tv_nsec: 700,
        },
    ];
    record(
        "futimens",
        check(unsafe { libc::futimens(fd, times.as_ptr()) }).map(|_| 0),
        &|st| Seen {
            times: Some((st.st_atime, st.st_atime_nsec, st.st_mtime, st.st_mtime_nsec)),
            ..basic(st)
        },
    );
    record(
        "fallocate 0 0 4096",
        check(unsafe { libc::fallocate(fd, 0, 0, 4096) }).map(|_| 0),
        &|st| Seen {
            allocated: Some(st.st_blocks * 512 >= 4096),
            ..basic(st)
        },
    );
    record(
        "fsync",
        check(unsafe { libc::fsync(fd) }).map(|_| 0),
        &basic,
    );
    record(
        "fdatasync",
        check(unsafe { libc::fdatasync(fd) }).map(|_| 0),
        &basic,
    );
    let copy = |from: RawFd, from_off: i64, to: RawFd, to_off: i64, len: usize| {
        let (mut a, mut b, mut done) = (from_off, to_off, 0usize);
        while done < len {
            let n = check_size(unsafe {
                libc::copy_file_range(from, &mut a, to, &mut b, len - done, 0)
            })?;
            if n == 0 {
                break;
            }
            done += n;
        }
        Ok(done)
    };
    record(
        "copy_file_range into it",
        copy(src_file.as_raw_fd(), 0, fd, 4096, 2000),
        &basic,
    );
    record(
        "copy_file_range out of it",
        copy(fd, 0, out_file.as_raw_fd(), 0, 6096),
        &basic,
    );
    record(
        "read back",
        (|| {
            let mut data = vec![0u8; 8192];
            let n = file.read_at(&mut data, 0)?;
            data.truncate(n);
            Ok(n)
        })(),
        &|st| {
            let mut data = vec![0u8; st.st_size as usize];
            let n = file.read_at(&mut data, 0).unwrap_or(0);
            data.truncate(n);
            Seen {
                data: Some(digest(&data)),
                ..basic(st)
            }
        },
    );
    let mut copied = Vec::new();
    fs::File::open(out)
        .unwrap()
        .read_to_end(&mut copied)
        .unwrap();
    steps.push((
        "what was copied out",
        Ok(Seen {
            ret: copied.len(),
            size: copied.len() as u64,
            perm: 0,
            nlink: 0,
            times: None,
            allocated: None,
            data: Some(digest(&copied)),
        }),
    ));
    steps
}

fn assert_same_sequence(
    what: &str,
    view: &[(&str, Result<Seen, String>)],
    host: &[(&str, Result<Seen, String>)],
) {
    assert_eq!(view.len(), host.len());
    let mut differ = Vec::new();
    for ((name, v), (_, h)) in view.iter().zip(host) {
        assert!(
            h.is_ok(),
            "{what}: {name} fails on the host filesystem: {h:?}"
        );
        if v != h {
            differ.push(format!("{name}: view {v:?}, host {h:?}"));
        }
    }
    assert!(
        differ.is_empty(),
        "{what}: the view differs from the host filesystem in {} of {} steps:\n{}",
        differ.len(),
        view.len(),
        differ.join("\n")
    );
}

/// An open file whose name is gone works through its descriptor exactly as on the host
/// filesystem: truncation (by fd and by `/proc/self/fd`), `fchmod`, `futimens`,
/// `fallocate`, `fsync`, `fdatasync` and `copy_file_range` both ways all succeed and
/// `fstat` shows their effect. (A view that looks its objects up by name answers `ESTALE`.)
#[test]
fn an_open_unlinked_new_file_works_through_its_descriptor() {
    let m = Mount::new();
    let _w = Watchdog::of(&m, 120);
    let dir = m.path("unlinked");
    fs::create_dir(&dir).unwrap();
    let host = reference_dir();
    let content = pattern(10_000, 11);
    let src_content = pattern(2000, 12);
    let mut results = Vec::new();
    for base in [dir.as_path(), host.path()] {
        fs::write(base.join("f"), &content).unwrap();
        fs::set_permissions(base.join("f"), fs::Permissions::from_mode(0o644)).unwrap();
        fs::write(base.join("src"), &src_content).unwrap();
        results.push(unlinked_sequence(
            &base.join("f"),
            &base.join("src"),
            &base.join("out"),
        ));
    }
    assert_same_sequence("a new file", &results[0], &results[1]);
}

/// The same for a remote file of a layer, opened read-write (which copies it up) and then
/// unlinked (which leaves a whiteout over the remote one).
#[test]
fn an_open_unlinked_copied_up_file_works_through_its_descriptor() {
    let m = Mount::new();
    let _w = Watchdog::of(&m, 120);
    let etc = m.diff("L1").join("etc");
    let host = reference_dir();
    let content = fs::read(m.remote_diff("L1").join("etc/passwd")).unwrap();
    fs::write(host.path().join("passwd"), &content).unwrap();
    fs::set_permissions(
        host.path().join("passwd"),
        fs::Permissions::from_mode(mode_of(&m.remote_diff("L1").join("etc/passwd"))),
    )
    .unwrap();
    let src_content = pattern(2000, 12);
    let mut results = Vec::new();
    for base in [etc.as_path(), host.path()] {
        fs::write(base.join("src"), &src_content).unwrap();
        results.push(unlinked_sequence(
            &base.join("passwd"),
            &base.join("src"),
            &base.join("out"),
        ));
    }
    assert_same_sequence("a copied-up remote file", &results[0], &results[1]);
    assert!(
        fs::symlink_metadata(etc.join("passwd")).is_err(),
        "passwd stays deleted"
    );
}

// ---- Mappings after copy-up ----

/// A shared read-only mapping of `len` bytes of `f`, copied out.
fn mapped(f: &fs::File, len: usize) -> Vec<u8> {
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(
        p,
        libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    let data = unsafe { std::slice::from_raw_parts(p as *const u8, len) }.to_vec();
    unsafe { libc::munmap(p, len) };
    data
}

/// A remote file held open read-only while it is written (and so copied up) through another
/// open: a new open and a new `MAP_SHARED` mapping afterwards show the new bytes, by `read`
/// and through the mapping alike (the kernel must not keep serving the remote file's pages).
#[test]
fn a_mapping_made_after_copy_up_shows_the_new_bytes() {
    let m = Mount::new();
    let _w = Watchdog::of(&m, 60);
    let p = m.diff("L1").join("etc/os-release");
    let old = fs::read(m.remote_diff("L1").join("etc/os-release")).unwrap();
    assert!(old.len() > 16);
    let mut kept = fs::File::open(&p).unwrap();
    let mut first = Vec::new();
    kept.read_to_end(&mut first).unwrap();
    assert_eq!(first, old);

    let patch = b"COPIED-UP!";
    {
        let w = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        w.write_all_at(patch, 0).unwrap();
    }
    let mut want = old.clone();
    want[..patch.len()].copy_from_slice(patch);
    assert_eq!(
        fs::read(m.local_diff("L1").join("etc/os-release")).unwrap(),
        want,
        "the write copied the file up"
    );

    let f = fs::File::open(&p).unwrap();
    let map = mapped(&f, want.len());
    let mut read = Vec::new();
    fs::File::open(&p).unwrap().read_to_end(&mut read).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&read[..patch.len()]),
        String::from_utf8_lossy(patch),
        "read() through a new descriptor"
    );
    assert_eq!(read, want, "read() through a new descriptor");
    assert_eq!(
        String::from_utf8_lossy(&map[..patch.len()]),
        String::from_utf8_lossy(patch),
        "a MAP_SHARED mapping made after the copy-up"
    );
    assert_eq!(map, want, "a MAP_SHARED mapping made after the copy-up");
    drop(kept);
}

// ---- Times after mmap writes ----

fn times_of(p: &Path) -> ((i64, i64), (i64, i64)) {
    let st = fs::metadata(p).unwrap();
    ((st.mtime(), st.mtime_nsec()), (st.ctime(), st.ctime_nsec()))
}

/// Writes through a shared writable mapping update mtime and ctime as `stat` shows them,
/// with passthrough on (the default): after each `msync` while still mapped, and after
/// `munmap` and close. Two writes a second apart in one mapping: the kernel fetches fresh
/// attributes once after `mmap` (it invalidates atime), so only the second write shows
/// whether the view keeps the cached attributes current (or they stay stale for the
/// attribute timeout, an hour).
#[test]
fn mmap_writes_update_mtime_and_ctime() {
    let m = Mount::new();
    let _w = Watchdog::of(&m, 60);
    let dir = m.path("mm");
    fs::create_dir(&dir).unwrap();
    let p = dir.join("f");
    fs::write(&p, vec![b'a'; 4096]).unwrap();
    let t0 = times_of(&p);
    std::thread::sleep(Duration::from_millis(1100));
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(
        map,
        libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    let write_byte = |at: usize, b: u8| {
        unsafe { *(map as *mut u8).add(at) = b };
        check(unsafe { libc::msync(map, 4096, libc::MS_SYNC) }).expect("msync");
    };
    write_byte(100, b'Z');
    let t1 = times_of(&p);
    std::thread::sleep(Duration::from_millis(1100));
    write_byte(200, b'Y');
    let t2 = times_of(&p);
    unsafe { libc::munmap(map, 4096) };
    drop(f);
    let t3 = times_of(&p);
    let data = fs::read(&p).unwrap();
    assert_eq!((data[100], data[200]), (b'Z', b'Y'));
    eprintln!("(mtime, ctime): {t0:?} -> {t1:?} -> {t2:?} -> closed {t3:?}");
    let newer = |a: ((i64, i64), (i64, i64)), b: ((i64, i64), (i64, i64))| a.0 > b.0 && a.1 > b.1;
    assert!(
        newer(t1, t0),
        "after the first write and msync, still mapped: {t1:?}, before {t0:?}"
    );
    assert!(
        newer(t2, t1),
        "after the second write and msync, still mapped: {t2:?}, before {t1:?}"
    );
    assert!(
        newer(t3, t1),
        "after munmap and close: {t3:?}, after the first write {t1:?}"
    );
}
