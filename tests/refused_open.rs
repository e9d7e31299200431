//! An open the kernel refuses after the daemon has served it never changes the file.
//!
//! `open(O_TRUNC)` is decided in two steps: the daemon serves the OPEN, then the kernel makes
//! its own checks on truncation (a running executable: `ETXTBSY`; a security module:
//! `EACCES`) and only then truncates. Whatever the daemon does for the OPEN must leave the
//! file as it was, so a refusal loses nothing. Each case runs in the view's root (a local
//! file) and in a shared area (a remote file), over /dev/fuse and io_uring, with and
//! without passthrough.

mod common;
use common::*;

use std::fs;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The name of the executable each case runs and tries to truncate.
const PROGRAM: &str = "sleeper";
/// The name of the file written and fsync'd before a confined truncating open.
const DATA: &str = "kept";

/// Where a case runs: a directory at the root of the view, or a remote layer's directory.
#[derive(Clone, Copy, Debug)]
enum Area {
    Root,
    Shared,
}

impl Area {
    fn dir(self, m: &Mount) -> PathBuf {
        match self {
            Area::Root => m.path("work"),
            Area::Shared => m.diff("L1"),
        }
    }
}

fn program_bytes() -> Vec<u8> {
    fs::read("/bin/sleep").expect("/bin/sleep")
}

fn data_bytes() -> Vec<u8> {
    pattern(3 << 20, 32)
}

/// Mounts with `opts`, the remote holding the executable and the data file in layer L1, and
/// the same two files written through the view into a directory at its root.
fn mount(opts: &str) -> Mount {
    let m = Mount::with(
        Options {
            opts: opts.to_owned(),
            ..Options::default()
        },
        |remote| {
            let diff = diff_in(remote, "L1");
            fs::write(diff.join(PROGRAM), program_bytes()).unwrap();
            fs::set_permissions(diff.join(PROGRAM), fs::Permissions::from_mode(0o755)).unwrap();
            fs::write(diff.join(DATA), data_bytes()).unwrap();
        },
    );
    let root = Area::Root.dir(&m);
    fs::create_dir(&root).unwrap();
    fs::write(root.join(PROGRAM), program_bytes()).unwrap();
    fs::set_permissions(root.join(PROGRAM), fs::Permissions::from_mode(0o755)).unwrap();
    let mut f = fs::File::create(root.join(DATA)).unwrap();
    f.write_all(&data_bytes()).unwrap();
    f.sync_all().unwrap();
    m
}

/// A running copy of `path`, killed and reaped on drop.
struct Running(Child);

impl Running {
    fn start(path: &Path) -> Running {
        // `spawn` returns once the exec has succeeded: the file is then the running text.
        let child = Command::new(path)
            .arg("600")
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("exec {}: {e}", path.display()));
        Running(child)
    }

    /// Whether it is still alive (it dies of SIGBUS if its text was truncated).
    fn alive(&mut self) -> bool {
        self.0.try_wait().expect("wait").is_none()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn open_raw(path: &Path, flags: i32) -> Result<OwnedFd, i32> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    } else {
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// What `path` holds, through the view with cold caches, and what local holds for it if
/// it has a copy: both must be `want`.
fn assert_unchanged(m: &Mount, path: &Path, want: &[u8], what: &str) {
    drop_caches();
    let got = fs::read(path).unwrap_or_else(|e| panic!("{what}: read {}: {e}", path.display()));
    assert!(
        got == want,
        "{what}: {} holds {} bytes through the view, it held {}",
        path.display(),
        got.len(),
        want.len()
    );
    let rel = path.strip_prefix(&m.mnt).unwrap();
    if let Ok(local) = fs::read(m.local.join(rel)) {
        assert!(
            local == want,
            "{what}: local's copy of {} holds {} bytes, the file held {}",
            rel.display(),
            local.len(),
            want.len()
        );
    }
}

/// `open(O_RDONLY|O_TRUNC)` of a running executable fails with `ETXTBSY` and leaves it whole
/// (and running).
fn text_busy(m: &Mount, area: Area, what: &str) {
    let path = area.dir(m).join(PROGRAM);
    let mut running = Running::start(&path);
    for flags in [libc::O_RDONLY | libc::O_TRUNC, libc::O_RDWR | libc::O_TRUNC] {
        let res = open_raw(&path, flags);
        assert_eq!(
            res.as_ref().err(),
            Some(&libc::ETXTBSY),
            "{what}: open(flags {flags:#o}) of a running executable"
        );
    }
    assert_unchanged(m, &path, &program_bytes(), what);
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(running.alive(), "{what}: the running copy died");
}

const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
const LANDLOCK_ACCESS_FS_TRUNCATE: u64 = 1 << 14;

/// Confines the calling thread with Landlock so that it may truncate nothing; every other
/// access stays as it was.
fn forbid_truncation() {
    let abi = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u64>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    assert!(
        abi >= 3,
        "Landlock with the truncate right (ABI 3, Linux 6.2) is needed: ABI {abi}, {}",
        std::io::Error::last_os_error()
    );
    let handled: u64 = LANDLOCK_ACCESS_FS_TRUNCATE;
    let ruleset = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            &handled as *const u64,
            std::mem::size_of::<u64>(),
            0u32,
        )
    };
    assert!(
        ruleset >= 0,
        "landlock_create_ruleset: {}",
        std::io::Error::last_os_error()
    );
    let ruleset = unsafe { OwnedFd::from_raw_fd(ruleset as i32) };
    let res = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    assert_eq!(res, 0, "PR_SET_NO_NEW_PRIVS");
    let res = unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset.as_raw_fd(), 0u32) };
    assert_eq!(
        res,
        0,
        "landlock_restrict_self: {}",
        std::io::Error::last_os_error()
    );
}

/// `open(O_WRONLY|O_TRUNC)` by a thread that Landlock forbids to truncate fails with
/// `EACCES`, and the file written and fsync'd before keeps every byte.
fn truncation_forbidden(m: &Mount, area: Area, what: &str) {
    let path = area.dir(m).join(DATA);
    let target = path.clone();
    let results = std::thread::spawn(move || {
        // Landlock confines this thread only; the test's others stay free.
        forbid_truncation();
        [libc::O_WRONLY, libc::O_RDWR, libc::O_RDONLY]
            .map(|mode| open_raw(&target, mode | libc::O_TRUNC).err())
    })
    .join()
    .expect("the confined thread");
    for (mode, res) in ["O_WRONLY", "O_RDWR", "O_RDONLY"].iter().zip(results) {
        assert_eq!(
            res,
            Some(libc::EACCES),
            "{what}: open({mode}|O_TRUNC) under Landlock without the truncate right"
        );
    }
    assert_unchanged(m, &path, &data_bytes(), what);
    if let Area::Shared = area {
        // An open for writing copies a remote file up at its first change, not before.
        let rel = path.strip_prefix(&m.mnt).unwrap();
        assert!(
            !m.local.join(rel).exists(),
            "{what}: refused opens copied {} up",
            rel.display()
        );
    }
    // The same open, allowed, truncates.
    fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .custom_flags(0)
        .open(&path)
        .unwrap();
    assert_eq!(
        fs::metadata(&path).unwrap().len(),
        0,
        "{what}: allowed O_TRUNC"
    );
}

fn every_case(opts: &str) {
    let m = mount(opts);
    for area in [Area::Root, Area::Shared] {
        let what = format!("-o {opts}, {area:?}");
        text_busy(&m, area, &what);
        truncation_forbidden(&m, area, &what);
    }
}

/// FUSE over io_uring, on for as long as the mount lives.
fn ring() -> RingOffered {
    RingOffered::turn_on().expect("this kernel offers no FUSE over io_uring (enable_uring)")
}

#[test]
fn refused_truncating_opens_change_nothing_with_passthrough() {
    every_case("passthrough");
}

#[test]
fn refused_truncating_opens_change_nothing_without_passthrough() {
    every_case("nopassthrough");
}

#[test]
fn refused_truncating_opens_change_nothing_over_io_uring_with_passthrough() {
    let _ring = ring();
    every_case("io_uring,passthrough");
}

#[test]
fn refused_truncating_opens_change_nothing_over_io_uring_without_passthrough() {
    let _ring = ring();
    every_case("io_uring,nopassthrough");
}

/// `open(O_RDONLY|O_TRUNC)`, allowed, of a remote file truncates it. The kernel sends the
/// truncation after the OPEN, which a read-only open of a remote file serves from the
/// remote copy: through the daemon, the descriptor then reads the truncated copy; with
/// passthrough, the kernel reads the remote original through it, as overlayfs reads the
/// lower file through a descriptor opened before a copy-up (a documented limit).
#[test]
fn a_read_only_truncating_open_of_a_remote_file_truncates_it() {
    for opts in ["passthrough", "nopassthrough"] {
        let m = mount(opts);
        let path = Area::Shared.dir(&m).join(DATA);
        let fd = open_raw(&path, libc::O_RDONLY | libc::O_TRUNC).expect("open");
        let mut f = fs::File::from(fd);
        assert_eq!(f.metadata().unwrap().len(), 0, "-o {opts}: fstat size");
        if opts == "nopassthrough" {
            let mut got = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut got).unwrap();
            assert_eq!(got.len(), 0, "-o {opts}: bytes read after O_RDONLY|O_TRUNC");
        }
        drop(f);
        drop_caches();
        assert_eq!(fs::metadata(&path).unwrap().len(), 0, "-o {opts}: size");
        assert_eq!(fs::read(&path).unwrap().len(), 0, "-o {opts}: read again");
    }
}
