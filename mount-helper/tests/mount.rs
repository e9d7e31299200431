//! The helper as mount(8) runs it: installed where mount(8) looks for helpers (`/sbin`),
//! called through the real `mount -t layerfs`, `mount -T FSTAB`, and `umount`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const HELPER: &str = env!("CARGO_BIN_EXE_mount-layerfs");
const NAMES: [&str; 2] = ["/sbin/mount.layerfs", "/sbin/mount.fuse.layerfs"];

/// Tests run in parallel: the first installs the helper, the last removes it (and puts
/// back whatever was there before).
static INSTALLED: Mutex<(usize, Vec<Replaced>)> = Mutex::new((0, Vec::new()));

/// An installed name, and where what it replaced was moved.
type Replaced = (PathBuf, Option<PathBuf>);

struct Installed;

impl Installed {
    fn new() -> Installed {
        let mut state = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        if state.0 == 0 {
            for name in NAMES {
                let name = PathBuf::from(name);
                let backup = fs::symlink_metadata(&name).ok().map(|_| {
                    let b = name.with_extension("layerfs-test-backup");
                    fs::rename(&name, &b).unwrap();
                    b
                });
                fs::copy(HELPER, &name).unwrap();
                state.1.push((name, backup));
            }
        }
        state.0 += 1;
        Installed
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        let mut state = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        state.0 -= 1;
        if state.0 == 0 {
            for (name, backup) in state.1.drain(..) {
                let _ = fs::remove_file(&name);
                if let Some(b) = backup {
                    let _ = fs::rename(b, &name);
                }
            }
        }
    }
}

/// A remote (a copy of the shipped fixture), a local and a mountpoint in a temp dir.
struct Trees {
    dir: tempfile::TempDir,
    remote: PathBuf,
    local: PathBuf,
    mnt: PathBuf,
    _helper: Installed,
}

impl Trees {
    fn new() -> Trees {
        let helper = Installed::new();
        let dir = tempfile::Builder::new()
            .prefix("layerfs-mount")
            .tempdir()
            .unwrap();
        let remote = dir.path().join("remote");
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/remote");
        assert!(Command::new("cp")
            .arg("-a")
            .arg(&fixture)
            .arg(&remote)
            .status()
            .unwrap()
            .success());
        let (local, mnt) = (dir.path().join("local"), dir.path().join("mnt"));
        fs::create_dir(&local).unwrap();
        fs::create_dir(&mnt).unwrap();
        Trees {
            dir,
            remote,
            local,
            mnt,
            _helper: helper,
        }
    }

    fn mount(&self, extra: &[&str]) -> Output {
        Command::new("mount")
            .args(["-t", "layerfs"])
            .arg(&self.remote)
            .arg(&self.mnt)
            .arg("-o")
            .arg(format!(
                "local={},allow_other,log_file={}",
                self.local.display(),
                self.dir.path().join("daemon.log").display()
            ))
            .args(extra)
            .output()
            .unwrap()
    }

    fn assert_serves(&self) {
        assert!(is_mounted(&self.mnt), "not mounted");
        let names: Vec<_> = fs::read_dir(&self.mnt)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 3, "the layout's top level: {names:?}");
        assert!(self.mnt.join("overlay/l").is_dir());
    }
}

impl Drop for Trees {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while is_mounted(&self.mnt) && Instant::now() < deadline {
            let _ = Command::new("umount").arg(&self.mnt).status();
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = &self.dir;
    }
}

fn is_mounted(path: &Path) -> bool {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let want = path.to_string_lossy().replace(' ', "\\040");
    info.lines()
        .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn mount_t_layerfs_mounts_and_umount_stops_it() {
    let t = Trees::new();
    let out = t.mount(&[]);
    assert!(out.status.success(), "mount failed: {}", stderr(&out));
    t.assert_serves();
    assert!(Command::new("umount")
        .arg(&t.mnt)
        .status()
        .unwrap()
        .success());
    assert!(!is_mounted(&t.mnt));
}

#[test]
fn an_fstab_line_works_with_mount_a_and_by_mountpoint() {
    let t = Trees::new();
    let fstab = t.dir.path().join("fstab");
    fs::write(
        &fstab,
        format!(
            "# a comment\n{} {} layerfs local={},_netdev,nofail,x-systemd.requires=network.target,allow_other,log_file={} 0 0\n",
            t.remote.display(),
            t.mnt.display(),
            t.local.display(),
            t.dir.path().join("daemon.log").display()
        ),
    )
    .unwrap();
    let out = Command::new("mount")
        .arg("-T")
        .arg(&fstab)
        .arg(&t.mnt)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mount -T FSTAB MOUNTPOINT: {}",
        stderr(&out)
    );
    t.assert_serves();
    assert!(Command::new("umount")
        .arg(&t.mnt)
        .status()
        .unwrap()
        .success());

    let out = Command::new("mount")
        .arg("--fstab")
        .arg(&fstab)
        .arg("-a")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mount --fstab FSTAB -a: {}",
        stderr(&out)
    );
    t.assert_serves();
}

#[test]
fn fuse_dot_layerfs_is_the_same_helper() {
    let t = Trees::new();
    let out = Command::new("mount")
        .args(["-t", "fuse.layerfs"])
        .arg(&t.remote)
        .arg(&t.mnt)
        .arg("-o")
        .arg(format!(
            "local={},log_file={}",
            t.local.display(),
            t.dir.path().join("daemon.log").display()
        ))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    t.assert_serves();
}

#[test]
fn bad_options_fail_with_32_and_a_clear_line() {
    let t = Trees::new();
    let out = t.mount(&["-o", "bogus_option"]);
    assert_eq!(out.status.code(), Some(32), "{}", stderr(&out));
    assert!(stderr(&out).contains("bogus_option"), "{}", stderr(&out));
    assert!(!is_mounted(&t.mnt));

    let out = Command::new("mount")
        .args(["-t", "layerfs"])
        .arg(&t.remote)
        .arg(&t.mnt)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(32));
    assert!(
        stderr(&out).contains("local"),
        "names the missing option: {}",
        stderr(&out)
    );
}

#[test]
fn a_missing_remote_fails_cleanly() {
    let t = Trees::new();
    let out = Command::new("mount")
        .args(["-t", "layerfs"])
        .arg(t.dir.path().join("no-such-remote"))
        .arg(&t.mnt)
        .arg("-o")
        .arg(format!("local={}", t.local.display()))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(32));
    assert!(stderr(&out).contains("no-such-remote"), "{}", stderr(&out));
    assert!(!is_mounted(&t.mnt));
}

#[test]
fn a_second_mount_on_the_same_mountpoint_fails_and_leaves_the_first() {
    let t = Trees::new();
    assert!(t.mount(&[]).status.success());
    let out = t.mount(&[]);
    assert_eq!(out.status.code(), Some(32), "{}", stderr(&out));
    assert!(stderr(&out).contains("busy"), "{}", stderr(&out));
    t.assert_serves();
}

#[test]
fn fake_mode_checks_without_mounting() {
    let t = Trees::new();
    let out = Command::new(HELPER)
        .arg(&t.remote)
        .arg(&t.mnt)
        .args(["-f", "-v", "-o"])
        .arg(format!("local={}", t.local.display()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!is_mounted(&t.mnt));
}

/// The pids of the processes whose command line names `mnt`: the mount's keeper and the
/// daemon it started.
fn processes_of(mnt: &Path) -> Vec<i32> {
    let want = mnt.as_os_str().as_encoded_bytes();
    let pids: Vec<i32> = fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<i32>().ok()?;
            let cmdline = fs::read(e.path().join("cmdline")).ok()?;
            cmdline.split(|b| *b == 0).any(|a| a == want).then_some(pid)
        })
        .collect();
    assert!(!pids.is_empty(), "no process serves {}", mnt.display());
    pids
}

#[test]
fn a_mountpoint_left_by_a_killed_daemon_is_mounted_again() {
    let t = Trees::new();
    assert!(t.mount(&[]).status.success());
    for pid in processes_of(&t.mnt) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while fs::read_dir(&t.mnt).map(drop).is_ok() {
        assert!(Instant::now() < deadline, "the mount does not die");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = t.mount(&[]);
    assert!(out.status.success(), "mount after a kill: {}", stderr(&out));
    t.assert_serves();
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let at = info
        .lines()
        .filter(|l| l.split(' ').nth(4) == t.mnt.to_str())
        .count();
    assert_eq!(at, 1, "the dead mount is still stacked below the new one");
}

/// The mount's `status`, through its control socket.
fn status(mnt: &Path) -> layerfs::report::Status {
    layerfs::control::Client::new(mnt).status().unwrap()
}

fn helper(t: &Trees, options: &str) -> Output {
    Command::new(HELPER)
        .arg(&t.remote)
        .arg(&t.mnt)
        .args(["-o", options])
        .output()
        .unwrap()
}

#[test]
fn remount_changes_the_refresh_interval_and_the_log_level_live() {
    let t = Trees::new();
    let log = t.dir.path().join("log");
    let out = t.mount(&["-o", &format!("refresh=30,log_file={}", log.display())]);
    assert!(out.status.success(), "{}", stderr(&out));
    let wait = |what: &str, check: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !check() {
            assert!(Instant::now() < deadline, "timed out: {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait("the control socket", &|| {
        layerfs::control::Client::new(&t.mnt).status().is_ok()
    });
    assert_eq!(status(&t.mnt).refresh_interval_secs, 30.0);
    let debug_lines = || {
        fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("DEBUG"))
            .count()
    };
    assert_eq!(debug_lines(), 0, "debug lines at level info");

    // As mount(8) passes them: the kernel's options and the mount's own come along.
    let out = helper(
        &t,
        &format!(
            "rw,nosuid,nodev,relatime,user_id=0,group_id=0,allow_other,local={},remount,refresh=200ms,log=debug",
            t.local.display()
        ),
    );
    assert!(out.status.success(), "remount: {}", stderr(&out));
    assert_eq!(status(&t.mnt).refresh_interval_secs, 0.2);
    // Rounds now come every 200 ms, and the idle ones are logged at debug level.
    let rounds = status(&t.mnt).rounds;
    wait("rounds at the new interval", &|| {
        status(&t.mnt).rounds >= rounds + 3
    });
    wait("debug lines in the log", &|| debug_lines() > 0);
    t.assert_serves();
}

#[test]
fn remount_refuses_what_cannot_change_live_and_names_it() {
    let t = Trees::new();
    assert!(t.mount(&["-o", "refresh=30"]).status.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    while layerfs::control::Client::new(&t.mnt).status().is_err() {
        assert!(Instant::now() < deadline, "no control socket");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = helper(&t, "remount,refresh=1,threads=3,nopassthrough");
    assert_eq!(out.status.code(), Some(32), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("threads=3, nopassthrough"), "{err}");
    assert!(!err.contains("refresh=1,"), "{err}");
    // Nothing was applied.
    assert_eq!(status(&t.mnt).refresh_interval_secs, 30.0);
    let out = helper(&t, "remount,bogus_option");
    assert_eq!(out.status.code(), Some(32));
    assert!(stderr(&out).contains("bogus_option"), "{}", stderr(&out));
    t.assert_serves();
}
