//! The `layerfs mount` command line (DESIGN §2): daemon mode, startup errors, signals, help.

mod common;

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Unmounts `mnt` on drop if a command that should have failed mounted it anyway.
struct NoMountGuard(PathBuf);

impl Drop for NoMountGuard {
    fn drop(&mut self) {
        if is_mounted(&self.0) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// Fresh `remote` (a fixture copy), `local` and `mnt` dirs.
struct Dirs {
    tmp: tempfile::TempDir,
    remote: PathBuf,
    local: PathBuf,
    mnt: PathBuf,
}

fn dirs() -> Dirs {
    let tmp = tempfile::Builder::new()
        .prefix("layerfs-cli")
        .tempdir()
        .unwrap();
    let remote = tmp.path().join("remote");
    copy_tree(&repo().join("fixtures/remote"), &remote);
    let (local, mnt) = (tmp.path().join("local"), tmp.path().join("mnt"));
    fs::create_dir(&local).unwrap();
    fs::create_dir(&mnt).unwrap();
    Dirs {
        tmp,
        remote,
        local,
        mnt,
    }
}

/// Runs `layerfs mount ARGS` in daemon mode (so that it returns whatever happens).
fn run_mount(args: &[OsString], mnt: &Path) -> Output {
    let _guard = (!is_mounted(mnt)).then(|| NoMountGuard(mnt.to_owned()));
    Command::new(BIN)
        .arg("mount")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run layerfs")
}

/// The mount's arguments; the daemon logs next to `local`, not to the host's log directory.
fn args(remote: &Path, local: &Path, mnt: &Path, extra: &[&str]) -> Vec<OsString> {
    let log = local.with_file_name("daemon.log");
    let mut v: Vec<OsString> = vec![
        "--remote".into(),
        remote.into(),
        "--local".into(),
        local.into(),
        "-o".into(),
        format!("log_file={}", log.display()).into(),
    ];
    v.extend(extra.iter().map(OsString::from));
    v.push(mnt.into());
    v
}

/// One line on stderr naming the problem, nothing on stdout, a failure status, no mount.
fn assert_startup_error(out: &Output, mnt: &Path, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded: {stderr}");
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "not one line: {stderr:?}"
    );
    assert!(stderr.starts_with("layerfs: "), "{stderr:?}");
    for needle in needles {
        assert!(stderr.contains(needle), "{needle:?} not in {stderr:?}");
    }
    assert!(out.stdout.is_empty(), "stdout: {:?}", out.stdout);
    assert!(!is_mounted(mnt), "mounted anyway");
}

#[test]
fn daemon_mode_returns_once_live_and_exits_on_umount() {
    // `Mount` asserts the mount is live as soon as the command has returned.
    let mut m = Mount::with(
        Options {
            foreground: false,
            ..Options::default()
        },
        |_| {},
    );
    assert_eq!(
        names(&m.mnt),
        vec!["overlay", "overlay-images", "overlay-layers"]
    );
    // The keeper and the daemon it started.
    let pids = processes_with_arg(&m.mnt);
    assert_eq!(pids.len(), 2, "processes for the mount: {pids:?}");
    // Detached: no terminal, no pipe to the command that started it.
    for pid in pids {
        for fd in 0..=2 {
            assert_eq!(
                fs::read_link(format!("/proc/{pid}/fd/{fd}")).unwrap(),
                Path::new("/dev/null"),
                "fd {fd} of {pid}"
            );
        }
    }
    m.unmount();
    assert!(!is_mounted(&m.mnt));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !processes_with_arg(&m.mnt).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the daemon outlived its mount: {:?}",
            processes_with_arg(&m.mnt)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn missing_directories_are_startup_errors() {
    let d = dirs();
    let nope = d.tmp.path().join("nope");
    let out = run_mount(&args(&nope, &d.local, &d.mnt, &[]), &d.mnt);
    assert_startup_error(&out, &d.mnt, &["remote directory", "nope"]);
    let out = run_mount(&args(&d.remote, &nope, &d.mnt, &[]), &d.mnt);
    assert_startup_error(&out, &d.mnt, &["local directory", "nope"]);
    let out = run_mount(&args(&d.remote, &d.local, &nope, &[]), &nope);
    assert_startup_error(&out, &nope, &["mountpoint", "nope"]);
    // A file is no directory either.
    let file = d.tmp.path().join("file");
    fs::write(&file, b"").unwrap();
    let out = run_mount(&args(&d.remote, &d.local, &file, &[]), &file);
    assert_startup_error(&out, &file, &["mountpoint", "not a directory"]);
    // No local at all.
    let out = run_mount(
        &[
            "--remote".into(),
            d.remote.clone().into(),
            d.mnt.clone().into(),
        ],
        &d.mnt,
    );
    assert_startup_error(&out, &d.mnt, &["local"]);
}

#[test]
fn an_occupied_mountpoint_is_a_startup_error() {
    let m = Mount::new();
    let d = dirs();
    let out = run_mount(&args(&d.remote, &d.local, &m.mnt, &[]), &m.mnt);
    let count = || {
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mnt = m.mnt.to_str().unwrap().to_owned();
        info.lines()
            .filter(|l| l.split(' ').nth(4) == Some(mnt.as_str()))
            .count()
    };
    if count() > 1 {
        // Stacked a second mount on the first: take it off again before failing.
        let _ = Command::new("umount").arg(&m.mnt).status();
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "mounted twice: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr:?}");
    assert!(stderr.contains("already mounted"), "{stderr:?}");
    // The first mount is still the only one, and still serves.
    assert_eq!(count(), 1);
    assert!(fs::read_link(m.path("overlay").join(id("L1"))).is_ok());
}

#[test]
fn bad_options_are_named_in_the_error() {
    let d = dirs();
    for (extra, needles) in [
        (&["-o", "bogus_opt"][..], &["bogus_opt"][..]),
        (&["-o", "allow_other,frobnicate=3"], &["frobnicate=3"]),
        (&["-o", "link_style=sideways"], &["link_style=sideways"]),
        (&["-o", "threads=0"], &["threads=0"]),
        (&["--link-style", "sideways"], &["--link-style", "sideways"]),
        (&["--driver", "../etc"], &["driver=../etc"]),
        (&["--no-such-flag"], &["--no-such-flag"]),
    ] {
        let out = run_mount(&args(&d.remote, &d.local, &d.mnt, extra), &d.mnt);
        assert_startup_error(&out, &d.mnt, needles);
    }
}

/// An error met after the command has detached (here: the metrics port is taken) is printed
/// once, by the command, not also by the daemon's log and its exit (it was three times).
#[test]
fn an_error_after_detaching_is_printed_once() {
    let d = dirs();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let metrics = format!("metrics={}", taken.local_addr().unwrap());
    let out = run_mount(
        &args(&d.remote, &d.local, &d.mnt, &["-o", &metrics]),
        &d.mnt,
    );
    assert_startup_error(&out, &d.mnt, &[&metrics, "in use"]);
}

/// A detached daemon without `log_file` logs to the journal when there is one, else to a
/// file named after the mountpoint; `status` says where, and the file holds the log.
#[test]
fn a_detached_daemon_says_where_it_logs() {
    let mut m = Mount::with(
        Options {
            foreground: false,
            host_log: true,
            ..Options::default()
        },
        |_| {},
    );
    let out = Command::new(BIN)
        .arg("status")
        .arg(&m.mnt)
        .output()
        .expect("layerfs status");
    let status = String::from_utf8_lossy(&out.stdout).into_owned();
    let log = status
        .lines()
        .find_map(|l| l.strip_prefix("log"))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no log line in status:\n{status}"))
        .to_owned();
    let journal = Path::new("/run/systemd/journal/socket").exists();
    if journal {
        assert!(log.contains("journal"), "{log}");
    } else {
        let file = PathBuf::from(&log);
        let mnt = m
            .mnt
            .to_string_lossy()
            .trim_matches('/')
            .replace('-', "\\x2d")
            .replace('/', "-");
        assert!(
            log.ends_with(&format!("{mnt}.log")),
            "{log} for {}",
            m.mnt.display()
        );
        let text = fs::read_to_string(&file).unwrap_or_else(|e| panic!("{log}: {e}"));
        assert!(text.contains("INFO"), "{text}");
        m.unmount();
        let _ = fs::remove_file(&file);
    }
}

#[test]
fn overlapping_directories_are_refused() {
    let d = dirs();
    let inside = d.mnt.join("inside");
    fs::create_dir(&inside).unwrap();
    let out = run_mount(&args(&d.remote, &inside, &d.mnt, &[]), &d.mnt);
    assert_startup_error(
        &out,
        &d.mnt,
        &["local directory", "overlaps the mountpoint"],
    );
    let out = run_mount(&args(&inside, &d.local, &d.mnt, &[]), &d.mnt);
    assert_startup_error(
        &out,
        &d.mnt,
        &["remote directory", "overlaps the mountpoint"],
    );
    let in_remote = d.remote.join("overlay-containers");
    let out = run_mount(&args(&d.remote, &in_remote, &d.mnt, &[]), &d.mnt);
    assert_startup_error(&out, &d.mnt, &["overlaps the remote"]);
    // The mountpoint dir was left alone.
    assert_eq!(names(&d.mnt), vec!["inside"]);
}

#[test]
fn signals_unmount_a_foreground_daemon_cleanly() {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let d = dirs();
        let mut m = RawMount::start(&d.remote, &d.local, &d.mnt, &["-o", "allow_other"]);
        assert!(fs::read_link(d.mnt.join("overlay").join(id("L1"))).is_ok());
        // SAFETY: signalling our own child, which is still running.
        assert_eq!(unsafe { libc::kill(m.pid() as libc::pid_t, signal) }, 0);
        let status = m.wait();
        assert!(status.success(), "signal {signal}: exited with {status}");
        assert!(!is_mounted(&d.mnt), "signal {signal}: still mounted");
        assert!(names(&d.mnt).is_empty());
    }
}

#[test]
fn help_lists_the_mount_options() {
    let out = Command::new(BIN)
        .args(["mount", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for item in [
        "--remote",
        "--local",
        "--driver",
        "--link-style",
        "-f, --foreground",
        "-o <OPTIONS>",
        "local=DIR",
        "remote=DIR",
        "driver=NAME",
        "link_style=absolute|relative",
        "allow_other",
        "allow_root",
        "ro | rw",
        "threads=N",
        "passthrough | nopassthrough",
        "entry_timeout=SECS",
        "attr_timeout=SECS",
        "log_file=PATH",
        "fsname=NAME",
        "default_permissions",
    ] {
        assert!(
            help.contains(item),
            "`mount --help` lacks {item:?}:\n{help}"
        );
    }
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("mount"));
}

/// Unmounts `mnt` (lazily) on drop: keeps a failing test from leaving a mount behind.
struct UnmountOnDrop(PathBuf);

impl Drop for UnmountOnDrop {
    fn drop(&mut self) {
        while is_mounted(&self.0) {
            if !Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status()
                .is_ok_and(|s| s.success())
            {
                break;
            }
        }
    }
}

#[test]
fn a_quick_remount_outlives_the_previous_daemon() {
    let d = dirs();
    let _cleanup = UnmountOnDrop(d.mnt.clone());
    let a = args(&d.remote, &d.local, &d.mnt, &["-o", "allow_other"]);
    let mount = || {
        let out = Command::new(BIN)
            .arg("mount")
            .args(&a)
            .stdin(Stdio::null())
            .output()
            .expect("run layerfs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    for round in 0..3 {
        mount();
        fs::create_dir(d.mnt.join(format!("overlay/c{round}"))).unwrap();
        // umount(8) returns while the daemon is still shutting down; mount again at once.
        assert!(Command::new("umount")
            .arg(&d.mnt)
            .status()
            .unwrap()
            .success());
    }
    mount();
    // The daemons (and keepers) of the earlier mounts finish meanwhile; none may take the
    // new mount down, whose keeper and daemon stay.
    let deadline = Instant::now() + Duration::from_secs(20);
    while processes_with_arg(&d.mnt).len() > 2 {
        assert!(Instant::now() < deadline, "earlier daemons still running");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(is_mounted(&d.mnt), "the newest mount was unmounted");
    for round in 0..3 {
        assert!(d.mnt.join(format!("overlay/c{round}")).is_dir());
    }
    let status = Command::new(BIN)
        .arg("status")
        .arg(&d.mnt)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "no control socket for the newest mount: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    let out = Command::new(BIN)
        .arg("umount")
        .arg(&d.mnt)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!is_mounted(&d.mnt));
}
