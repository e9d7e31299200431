//! Operating a mount (DESIGN §2, §8, §9): reclaiming a mountpoint a killed daemon left, one
//! daemon per local tree, root-only commands, a busy unmount that says why, and options
//! changed on a live mount.

mod common;

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::*;

/// Fresh `remote` (a fixture copy), `local` and `mnt` dirs, reachable by any user. Whatever
/// is still mounted at `mnt` or below it is unmounted on drop, even when a test fails.
struct Dirs {
    tmp: tempfile::TempDir,
    remote: PathBuf,
    local: PathBuf,
    mnt: PathBuf,
}

impl Dirs {
    fn new() -> Dirs {
        let tmp = tempfile::Builder::new()
            .prefix("layerfs-operate")
            .tempdir()
            .unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
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

    /// Another mountpoint in the same temp dir.
    fn mountpoint(&self, name: &str) -> PathBuf {
        let p = self.tmp.path().join(name);
        fs::create_dir(&p).unwrap();
        p
    }

    fn args(&self, mnt: &Path, extra: &[&str]) -> Vec<OsString> {
        let mut v: Vec<OsString> = vec![
            "--remote".into(),
            self.remote.clone().into(),
            "--local".into(),
            self.local.clone().into(),
            "-o".into(),
            format!(
                "allow_other,log_file={}",
                self.local.with_file_name("daemon.log").display()
            )
            .into(),
        ];
        v.extend(extra.iter().map(OsString::from));
        v.push(mnt.into());
        v
    }

    /// `layerfs mount` in daemon mode, at `mnt`.
    fn mount_at(&self, mnt: &Path, extra: &[&str]) -> Output {
        Command::new(BIN)
            .arg("mount")
            .args(self.args(mnt, extra))
            .stdin(Stdio::null())
            .output()
            .expect("run layerfs")
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        // Deepest first: mounts stacked inside a view keep it busy.
        let mut points: Vec<PathBuf> = mounts_under(self.tmp.path());
        points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for p in points {
            let ok = Command::new("umount")
                .arg(&p)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(&p).status();
            }
        }
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn assert_ok(out: &Output, what: &str) {
    assert!(out.status.success(), "{what}: {}", stderr(out));
}

/// Kills the processes of the mount at `mnt` (its keeper and daemon) with SIGKILL, as a
/// crash of the whole would, and waits until its mount is dead (`ENOTCONN`).
fn kill_daemon_of(mnt: &Path) {
    let pids = processes_with_arg(mnt);
    assert!(!pids.is_empty(), "no process serves {}", mnt.display());
    for pid in pids {
        // SAFETY: signalling processes this test started.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    }
    eventually(20, "the mount to be dead", || {
        stat_errno(mnt) == Some(libc::ENOTCONN)
    });
}

fn stat_errno(path: &Path) -> Option<i32> {
    fs::metadata(path).err().and_then(|e| e.raw_os_error())
}

fn assert_serves(mnt: &Path) {
    assert!(
        fs::read_link(mnt.join("overlay").join(id("L1"))).is_ok(),
        "{} does not serve the layout",
        mnt.display()
    );
}

/// `mount(2)`s a FUSE filesystem of type `fuse.<subtype>` at `mnt` and closes its device
/// at once: what a daemon that dies leaves behind.
fn dead_fuse_mount(mnt: &Path, subtype: &str) {
    use std::os::fd::AsRawFd;
    let dev = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .unwrap();
    let data = format!("fd={},rootmode=40000,user_id=0,group_id=0", dev.as_raw_fd());
    nix::mount::mount(
        Some("dead"),
        mnt,
        Some(format!("fuse.{subtype}").as_str()),
        nix::mount::MsFlags::empty(),
        Some(data.as_str()),
    )
    .unwrap();
    drop(dev);
    eventually(10, "the mount to be dead", || {
        stat_errno(mnt) == Some(libc::ENOTCONN)
    });
}

// ---- 1. A mountpoint a killed daemon left ----

#[test]
fn mount_reclaims_a_mountpoint_left_by_a_killed_daemon() {
    let d = Dirs::new();
    assert_ok(&d.mount_at(&d.mnt, &[]), "first mount");
    fs::create_dir(d.mnt.join("overlay/c1")).unwrap();
    kill_daemon_of(&d.mnt);

    let out = d.mount_at(&d.mnt, &[]);
    assert_ok(&out, "mount over the dead mount");
    assert_eq!(
        mounts_at(&d.mnt),
        1,
        "the dead mount is still stacked below"
    );
    assert_serves(&d.mnt);
    assert!(d.mnt.join("overlay/c1").is_dir(), "local is served again");
    let status = Command::new(BIN)
        .arg("status")
        .arg(&d.mnt)
        .output()
        .unwrap();
    assert_ok(&status, "status of the new mount");
    let out = Command::new(BIN)
        .arg("umount")
        .arg(&d.mnt)
        .output()
        .unwrap();
    assert_ok(&out, "umount");
    assert_eq!(mounts_at(&d.mnt), 0);
}

#[test]
fn a_dead_mount_that_is_not_ours_is_named_with_its_cure() {
    let d = Dirs::new();
    dead_fuse_mount(&d.mnt, "other");
    let out = d.mount_at(&d.mnt, &[]);
    let err = stderr(&out);
    assert!(!out.status.success(), "mounted: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err:?}");
    let mnt = d.mnt.display().to_string();
    for needle in ["fuse.other", &mnt, &format!("umount -l {mnt}")] {
        assert!(err.contains(needle), "{needle:?} not in {err:?}");
    }
    // Left as it was.
    assert_eq!(mounts_at(&d.mnt), 1);
    assert_eq!(stat_errno(&d.mnt), Some(libc::ENOTCONN));
}

#[test]
fn a_caller_who_cannot_detach_the_dead_mount_is_told_how() {
    let d = Dirs::new();
    assert_ok(&d.mount_at(&d.mnt, &[]), "first mount");
    kill_daemon_of(&d.mnt);
    let (ok, out) = sh_as_nobody(&format!(
        "{BIN} mount --remote {} --local {} {}",
        d.remote.display(),
        d.local.display(),
        d.mnt.display()
    ));
    assert!(!ok, "{out}");
    let mnt = d.mnt.display().to_string();
    for needle in ["fuse.layerfs", &format!("umount -l {mnt}")] {
        assert!(out.contains(needle), "{needle:?} not in {out:?}");
    }
    assert_eq!(mounts_at(&d.mnt), 1);
}

// ---- 3. Root only, said the same way by every command ----

/// Runs `layerfs ARGS` as nobody (uid and gid 65534, no supplementary groups).
fn as_nobody(args: &[&OsStr]) -> Output {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("setpriv")
}

#[test]
fn every_command_says_root_only_the_same_way() {
    let d = Dirs::new();
    assert_ok(&d.mount_at(&d.mnt, &[]), "mount");
    fs::create_dir(d.mnt.join("overlay/c1")).unwrap();
    let other = d.mountpoint("other");
    let m = d.mnt.as_os_str();
    let mut runs: Vec<(&str, Vec<&OsStr>, &Path)> = vec![
        ("status", vec![os("status"), m], &d.mnt),
        ("status --json", vec![os("status"), os("--json"), m], &d.mnt),
        ("refresh", vec![os("refresh"), m], &d.mnt),
        ("layers", vec![os("layers"), m], &d.mnt),
        ("images", vec![os("images"), m], &d.mnt),
        ("umount", vec![os("umount"), m], &d.mnt),
        ("quota list", vec![os("quota"), os("list"), m], &d.mnt),
        (
            "quota get",
            vec![os("quota"), os("get"), m, os("overlay/c1")],
            &d.mnt,
        ),
        (
            "quota clear",
            vec![os("quota"), os("clear"), m, os("overlay/c1")],
            &d.mnt,
        ),
        (
            "quota set",
            vec![os("quota"), os("set"), m, os("overlay/c1"), os("1G")],
            &d.mnt,
        ),
    ];
    // Where nobody may open /dev/fuse, mounting is root's alone too.
    let fuse_mode = fs::metadata("/dev/fuse").unwrap().permissions().mode();
    let mount_args: Vec<OsString> = std::iter::once(OsString::from("mount"))
        .chain(d.args(&other, &[]))
        .collect();
    if fuse_mode & 0o006 == 0 {
        runs.push((
            "mount",
            mount_args.iter().map(OsString::as_os_str).collect(),
            &other,
        ));
    }
    for (verb, args, target) in &runs {
        let out = as_nobody(args);
        let err = stderr(&out);
        assert!(!out.status.success(), "{verb}: succeeded: {err}");
        assert_eq!(
            err,
            format!(
                "layerfs: {}: permission denied (root only)\n",
                target.display()
            ),
            "{verb}"
        );
        assert!(out.stdout.is_empty(), "{verb}: {:?}", out.stdout);
    }
    // Nothing changed: the mount still serves, root may still ask.
    assert_serves(&d.mnt);
    assert!(!is_mounted(&other));
    let out = Command::new(BIN)
        .arg("status")
        .arg(&d.mnt)
        .output()
        .unwrap();
    assert_ok(&out, "status as root");
}

// ---- 4. One daemon per local tree ----

#[test]
fn a_second_mount_of_the_same_local_is_refused() {
    let d = Dirs::new();
    assert_ok(&d.mount_at(&d.mnt, &[]), "first mount");
    fs::write(d.mnt.join("overlay/before"), b"1").unwrap();
    let other = d.mountpoint("other");
    let out = d.mount_at(&other, &[]);
    let err = stderr(&out);
    assert!(
        !out.status.success(),
        "a second daemon over the same local: {err}"
    );
    assert!(!is_mounted(&other), "mounted anyway");
    assert_eq!(err.trim_end().lines().count(), 1, "{err:?}");
    for needle in [&d.local, &d.mnt] {
        let needle = needle.display().to_string();
        assert!(err.contains(&needle), "{needle:?} not in {err:?}");
    }
    // The first keeps serving, reads and writes.
    assert_eq!(fs::read(d.mnt.join("overlay/before")).unwrap(), b"1");
    fs::write(d.mnt.join("overlay/after"), b"2").unwrap();
    assert_eq!(fs::read(d.local.join("overlay/after")).unwrap(), b"2");
    assert_serves(&d.mnt);
    // Once it is unmounted the local tree is free again.
    let out = Command::new(BIN)
        .arg("umount")
        .arg(&d.mnt)
        .output()
        .unwrap();
    assert_ok(&out, "umount");
    assert_ok(&d.mount_at(&other, &[]), "mount once the first is gone");
    assert!(other.join("overlay/after").is_file());
}

// ---- 2. A busy unmount says what keeps it busy ----

#[test]
fn a_busy_umount_names_the_mounts_inside_the_view() {
    let d = Dirs::new();
    assert_ok(&d.mount_at(&d.mnt, &[]), "mount");
    let inner = d.mnt.join("overlay/c1");
    fs::create_dir(&inner).unwrap();
    let out = Command::new("mount")
        .args(["-t", "tmpfs", "scratch"])
        .arg(&inner)
        .output()
        .unwrap();
    assert_ok(&out, "tmpfs inside the view");

    let out = Command::new(BIN)
        .arg("umount")
        .arg(&d.mnt)
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "unmounted a busy view: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err:?}");
    let inner_s = inner.display().to_string();
    for needle in ["busy", "tmpfs", &inner_s] {
        assert!(err.contains(needle), "{needle:?} not in {err:?}");
    }
    assert_serves(&d.mnt);

    // With the inner mount gone, it unmounts.
    assert_ok(
        &Command::new("umount").arg(&inner).output().unwrap(),
        "umount inner",
    );
    let out = Command::new(BIN)
        .arg("umount")
        .arg(&d.mnt)
        .output()
        .unwrap();
    assert_ok(&out, "umount");
    assert!(!is_mounted(&d.mnt));
}
