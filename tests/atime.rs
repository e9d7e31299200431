//! Access times as the mount says: `noatime`, `relatime` (the default), `strictatime`, and
//! `nodiratime`, for reads through the daemon and through passthrough, exec included.

mod common;
use common::*;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Sets `path`'s access and modification times to `atime` and `mtime` seconds.
fn set_times(path: &Path, atime: i64, mtime: i64) {
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &nix::sys::time::TimeSpec::new(atime, 0),
        &nix::sys::time::TimeSpec::new(mtime, 0),
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .unwrap();
}

fn atime(path: &Path) -> i64 {
    fs::metadata(path).unwrap().atime()
}

fn mount(opts: &str) -> Mount {
    Mount::with(
        Options {
            opts: opts.into(),
            ..Options::default()
        },
        |_| {},
    )
}

/// Whether a read moves the access time of a file whose access time is `atime_ago` seconds
/// ago and modification time `mtime_ago` seconds ago (its change time is now: setting the
/// times changes it). A negative `atime_ago` is in the future, after the change time too.
fn read_moves(m: &Mount, name: &str, atime_ago: i64, mtime_ago: i64) -> bool {
    let path = m.path(name);
    fs::write(&path, b"some bytes").unwrap();
    let t = now();
    set_times(&path, t - atime_ago, t - mtime_ago);
    assert_eq!(fs::read(&path).unwrap(), b"some bytes");
    moved(&path, t, atime_ago)
}

/// Whether `path`'s access time, set to `atime_ago` seconds before `t`, is now `t` or later;
/// it must be one or the other.
fn moved(path: &Path, t: i64, atime_ago: i64) -> bool {
    let after = atime(path);
    let now = now();
    assert!(
        after == t - atime_ago || (t..=now).contains(&after),
        "{}: access time {after}, neither untouched nor now",
        path.display()
    );
    after != t - atime_ago
}

/// Whether running the executable `name` (a copy of `/bin/true`) moves its access time
/// from `atime_ago` seconds ago, its modification time `mtime_ago` seconds ago.
fn exec_moves(m: &Mount, name: &str, atime_ago: i64, mtime_ago: i64) -> bool {
    let path = m.path(name);
    fs::copy("/bin/true", &path).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    let t = now();
    set_times(&path, t - atime_ago, t - mtime_ago);
    assert!(run_fresh_executable(&path).success());
    moved(&path, t, atime_ago)
}

/// Runs an executable just written. A child another test thread forks while this one still
/// has the file open for writing holds that descriptor until it execs, and the kernel then
/// refuses to run the file (`ETXTBSY`): wait for that moment to pass.
fn run_fresh_executable(path: &Path) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match Command::new(path).status() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{}: {e}",
                    path.display()
                );
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other.unwrap(),
        }
    }
}

/// Whether listing directory `name` moves its access time, as `read_moves` for files.
fn listing_moves(m: &Mount, name: &str, atime_ago: i64, mtime_ago: i64) -> bool {
    let path = m.path(name);
    fs::create_dir(&path).unwrap();
    fs::write(path.join("entry"), b"").unwrap();
    let t = now();
    set_times(&path, t - atime_ago, t - mtime_ago);
    assert_eq!(fs::read_dir(&path).unwrap().count(), 1);
    moved(&path, t, atime_ago)
}

fn each_io_mode(check: impl Fn(&str)) {
    for io in ["passthrough", "nopassthrough"] {
        check(io);
    }
}

#[test]
fn relatime_moves_an_access_time_that_is_not_after_the_modification_or_a_day_old() {
    each_io_mode(|io| {
        let m = mount(io);
        assert!(read_moves(&m, "older", 100, 50), "{io}: atime before mtime");
        assert!(
            read_moves(&m, "changed", 50, 100),
            "{io}: atime before ctime"
        );
        assert!(
            !read_moves(&m, "newer", -50, 100),
            "{io}: atime after mtime and ctime"
        );
        assert!(
            read_moves(&m, "stale", 2 * 86_400, 3 * 86_400),
            "{io}: a day old"
        );
        assert!(exec_moves(&m, "prog", 100, 50), "{io}: exec");
        assert!(listing_moves(&m, "dir", 100, 50), "{io}: listing");
        assert!(!listing_moves(&m, "dir2", -50, 100), "{io}: listing, newer");
    });
}

#[test]
fn strictatime_moves_it_on_every_read_exec_included() {
    each_io_mode(|io| {
        let m = mount(&format!("{io},strictatime"));
        assert!(read_moves(&m, "newer", -50, 100), "{io}: read");
        // Again, with the data cached from the first read.
        let path = m.path("newer");
        let t = now();
        set_times(&path, t + 50, t - 100);
        fs::read(&path).unwrap();
        assert!(moved(&path, t, -50), "{io}: a second read");
        assert!(exec_moves(&m, "prog", -50, 100), "{io}: exec");
        assert!(listing_moves(&m, "dir", -50, 100), "{io}: listing");
    });
}

#[test]
fn noatime_never_moves_it() {
    each_io_mode(|io| {
        let m = mount(&format!("{io},noatime"));
        assert!(!read_moves(&m, "older", 100, 50), "{io}: read");
        assert!(!exec_moves(&m, "prog", 100, 50), "{io}: exec");
        assert!(!listing_moves(&m, "dir", 100, 50), "{io}: listing");
    });
}

#[test]
fn nodiratime_keeps_directories_and_moves_files() {
    let m = mount("nodiratime");
    assert!(!listing_moves(&m, "dir", 100, 50), "listing");
    assert!(read_moves(&m, "older", 100, 50), "read");
}

#[test]
fn a_read_only_mount_moves_no_access_time() {
    let mut m = mount("strictatime");
    fs::write(m.path("file"), b"data").unwrap();
    fs::create_dir(m.path("dir")).unwrap();
    let t = now();
    set_times(&m.path("file"), t - 100, t - 200);
    set_times(&m.path("dir"), t - 100, t - 200);
    m.remount(&Options {
        opts: "ro,strictatime".into(),
        ..Options::default()
    });
    fs::read(m.path("file")).unwrap();
    fs::read_dir(m.path("dir")).unwrap().count();
    assert_eq!(atime(&m.path("file")), t - 100, "file");
    assert_eq!(atime(&m.path("dir")), t - 100, "dir");
}

#[test]
fn the_mode_shows_in_the_mount_table() {
    for (opts, want) in [
        ("noatime", "noatime"),
        ("strictatime", ""),
        ("relatime,nodiratime", "nodiratime"),
    ] {
        let m = mount(opts);
        let out = Command::new("findmnt")
            .args(["-n", "-o", "OPTIONS"])
            .arg(&m.mnt)
            .output()
            .unwrap();
        let shown = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        assert!(shown.contains(want), "-o {opts}: {shown}");
        let relatime = shown.split(',').any(|o| o == "relatime");
        assert_eq!(relatime, opts.starts_with("relatime"), "-o {opts}: {shown}");
    }
}
