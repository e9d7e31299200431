//! Quotas on real mounts (DESIGN §6) as they are set, read and kept: the `layerfs quota`
//! commands and the `user.layerfs.quota` xattr (sizes, errors, nesting, who may change a
//! quota), what `statfs` and `df` show inside a root, and the registry in local that keeps
//! limits across remounts. A runtime acts on what these report, so a root is counted again
//! at mount, keeps its quota when that count fails, and a change that cannot be saved is
//! not made at all.
//!
//! Enforcement is in `tests/quota_data.rs` and `tests/quota_namespace.rs`; crashes in
//! `tests/quota_crash.rs`.

mod common;
mod quota_kit;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use quota_kit::*;

// ---- The CLI -----------------------------------------------------------------------------

#[test]
fn cli_set_get_list_clear() {
    let m = mount();
    fs::create_dir(m.path("overlay/c1")).unwrap();
    fs::create_dir(m.path("overlay/c2")).unwrap();
    write_file(&m.path("overlay/c2/existing"), MIB as usize, 1);

    let q1 = set(&m, "overlay/c1", "8M", &[]);
    assert_eq!(
        q1,
        Quota {
            path: "overlay/c1".into(),
            limit: 8388608,
            used: local_alloc(&m, "overlay/c1"),
            available: 8388608 - local_alloc(&m, "overlay/c1"),
            inode_limit: None,
            inodes_used: 1,
            backend: "fuse".into(),
        }
    );
    // Setting a quota on a dir with content counts what is already there.
    let q2 = set(&m, "overlay/c2", "1GiB", &["--inodes", "100"]);
    assert_eq!(q2.limit, 1 << 30);
    assert_eq!(q2.inode_limit, Some(100));
    assert_eq!(q2.inodes_used, 2);
    assert_eq!(q2.used, local_alloc(&m, "overlay/c2"));
    assert!(q2.used >= MIB + 4096, "{q2:?}");

    assert_eq!(get(&m, "overlay/c1"), q1);
    assert_eq!(get(&m, "overlay/c2"), q2);
    assert_eq!(list(&m), vec![q1.clone(), q2.clone()]);

    // The human forms.
    let out = quota_ok(&m, "get", &["overlay/c1"]);
    assert!(out.contains("overlay/c1"), "{out}");
    let out = quota_ok(&m, "list", &[]);
    assert!(
        out.contains("overlay/c1") && out.contains("overlay/c2"),
        "{out}"
    );

    // Every size form, 1024-based.
    for (size, bytes) in [
        ("512K", 512 * KIB),
        ("2Mi", 2 * MIB),
        ("3MiB", 3 * MIB),
        ("1G", 1 << 30),
        ("2T", 2 << 40),
        ("123456", 123456),
        ("8M", 8 * MIB),
    ] {
        assert_eq!(set(&m, "overlay/c1", size, &[]).limit, bytes, "{size}");
    }
    // --ignore-failed changes nothing where quotas are supported.
    let q = set(&m, "overlay/c1", "6M", &["--ignore-failed"]);
    assert_eq!(q.limit, 6 * MIB);
    assert_eq!(xattr_limit(&m.path("overlay/c1")).unwrap(), 6 * MIB);
    // Without --json, set and clear print at most a line or two and succeed.
    quota_ok(&m, "set", &["overlay/c1", "8M"]);
    assert_eq!(get(&m, "overlay/c1").limit, 8 * MIB);

    // Clearing: gone from the list and the xattr, and no longer enforced.
    quota_ok(&m, "clear", &["overlay/c1"]);
    assert_eq!(list(&m), vec![get(&m, "overlay/c2")]);
    assert_errno(
        "xattr after clear",
        xattr_get(&m.path("overlay/c1"), XATTR),
        libc::ENODATA,
    );
    let out = quota_cmd(&m, "get", &["overlay/c1", "--json"]);
    if out.status.success() {
        let v = json_of(&text(&out.stdout));
        assert!(v["limit"].is_null(), "get after clear: {v}");
    } else {
        assert_eq!(text(&out.stderr).trim_end().lines().count(), 1);
    }
    write_file(&m.path("overlay/c1/big"), 10 * MIB as usize, 5);
}

#[test]
fn cli_errors() {
    let m = mount();
    fs::write(m.path("overlay/file"), "x").unwrap();
    let e = quota_err(&m, "set", &["overlay/file", "8M"]);
    assert!(e.to_lowercase().contains("director"), "{e}");
    quota_err(&m, "set", &["overlay/nope", "8M"]);
    quota_err(&m, "get", &["overlay/nope"]);
    fs::create_dir(m.path("overlay/c1")).unwrap();
    // ("-1" is left to the xattr test: a command line parser may take it for an option.)
    for bad in ["ten", "10Q", "1.5G", "12 M"] {
        let e = quota_err(&m, "set", &["overlay/c1", bad]);
        assert!(e.contains(bad), "the message names the bad size: {e}");
    }
    let out = quota_cmd(&m, "set", &["overlay/c1", "8M", "--inodes", "many"]);
    assert!(!out.status.success(), "--inodes many was accepted");
    assert!(list(&m).is_empty(), "a failed set left a quota");
    assert_errno(
        "xattr after failed sets",
        xattr_get(&m.path("overlay/c1"), XATTR),
        libc::ENODATA,
    );
    // Outside the mount.
    quota_err(&m, "set", &["../../..", "8M"]);
    quota_err(&m, "set", &["/etc", "8M"]);
    // Nested, both ways: the message names the other root.
    set(&m, "overlay/c1", "8M", &[]);
    fs::create_dir(m.path("overlay/c1/sub")).unwrap();
    let e = quota_err(&m, "set", &["overlay/c1/sub", "1M"]);
    assert!(e.contains("overlay/c1"), "{e}");
    fs::create_dir_all(m.path("overlay/p/c")).unwrap();
    set(&m, "overlay/p/c", "1M", &[]);
    let e = quota_err(&m, "set", &["overlay/p", "1G"]);
    assert!(e.contains("overlay/p/c"), "{e}");
    assert_eq!(list(&m).len(), 2);
    // Not a layerfs mount.
    let out = Command::new(BIN)
        .args(["quota", "list"])
        .arg(m.dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(text(&out.stderr).trim_end().lines().count(), 1);
}

#[test]
fn cli_set_on_a_remote_dir_the_kernel_has_not_looked_up() {
    let m = mount();
    // Nothing has looked `diff/` up through the view yet: a runtime sets the quota first.
    let rel = l1_diff_rel();
    let q = set(&m, &rel, "8M", &[]);
    assert_eq!(q.limit, 8 * MIB);
    assert_eq!(xattr_limit(&m.path(&rel)).unwrap(), 8 * MIB);
    let rel2 = format!("overlay/RO/{}/diff/etc", id("L2"));
    assert_eq!(set(&m, &rel2, "1M", &[]).limit, MIB);
}

#[test]
fn cli_get_right_after_a_remount() {
    let mut m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    write_file(&c1.join("f"), MIB as usize, 1);
    let before = get(&m, "overlay/c1");
    m.remount(&Options::default());
    // Nothing has looked `overlay/c1` up through the new mount yet.
    assert_eq!(get(&m, "overlay/c1"), before);
    assert_eq!(set(&m, "overlay/c1", "16M", &[]).limit, 16 * MIB);
}

// ---- The xattr interface -----------------------------------------------------------------

fn xattr_limit(p: &Path) -> std::io::Result<u64> {
    xattr_get(p, XATTR).map(|v| {
        String::from_utf8(v)
            .unwrap()
            .trim()
            .parse()
            .expect("the quota xattr reads as decimal bytes")
    })
}

#[test]
fn the_quota_xattr_sets_gets_and_clears() {
    let m = mount();
    let x = m.path("overlay/x");
    fs::create_dir(&x).unwrap();
    assert_errno(
        "get on a dir without quota",
        xattr_get(&x, XATTR),
        libc::ENODATA,
    );

    xattr_set(&x, XATTR, b"10M").unwrap();
    assert_eq!(xattr_get(&x, XATTR).unwrap(), b"10485760");
    let q = get(&m, "overlay/x");
    assert_eq!((q.limit, q.inode_limit), (10 * MIB, None));
    for (value, bytes) in [
        ("8388608", 8388608u64),
        ("1Gi", 1 << 30),
        ("512KiB", 512 * KIB),
        ("3G", 3 << 30),
        ("4096", 4096),
    ] {
        xattr_set(&x, XATTR, value.as_bytes()).unwrap();
        assert_eq!(xattr_limit(&x).unwrap(), bytes, "{value}");
        assert_eq!(get(&m, "overlay/x").limit, bytes, "{value}");
    }
    xattr_set(&x, XATTR, b"8M").unwrap();
    for bad in ["ten", "10Q", "-1", "1.5G", "10 M"] {
        assert_errno(
            &format!("setting {bad:?}"),
            xattr_set(&x, XATTR, bad.as_bytes()),
            libc::EINVAL,
        );
        assert_eq!(xattr_limit(&x).unwrap(), 8 * MIB, "after {bad:?}");
    }

    // An empty value clears it.
    xattr_set(&x, XATTR, b"").unwrap();
    assert_errno("get after clearing", xattr_get(&x, XATTR), libc::ENODATA);
    assert!(list(&m).iter().all(|q| q.path != "overlay/x"));
    // So does removing it.
    xattr_set(&x, XATTR, b"2M").unwrap();
    assert!(list(&m).iter().any(|q| q.path == "overlay/x"));
    xattr_remove(&x, XATTR).unwrap();
    assert_errno("get after removing", xattr_get(&x, XATTR), libc::ENODATA);
    assert!(list(&m).iter().all(|q| q.path != "overlay/x"));
    // Unlimited again.
    fs::write(x.join("big"), pattern(4 * MIB as usize, 1)).unwrap();
    assert_errno("removing it again", xattr_remove(&x, XATTR), libc::ENODATA);

    // Not on a file.
    let f = m.path("overlay/file");
    fs::write(&f, "x").unwrap();
    let e = xattr_set(&f, XATTR, b"1M").expect_err("a quota on a file");
    assert!(
        [libc::ENOTDIR, libc::EINVAL].contains(&errno(&e)),
        "quota xattr on a file: {e}"
    );
}

#[test]
fn a_quota_set_by_xattr_is_enforced() {
    let m = mount();
    let y = m.path("overlay/y");
    fs::create_dir(&y).unwrap();
    xattr_set(&y, XATTR, b"2M").unwrap();
    let n = fill_root(&y, "f", libc::ENOSPC);
    assert!(n <= 2 * MIB && n + ONE_WRITE + SLACK >= 2 * MIB, "{n}");
    xattr_set(&y, XATTR, b"0").unwrap();
    assert_eq!(
        xattr_get(&y, XATTR).unwrap(),
        b"0",
        "0 is a limit, not unset"
    );
}

#[test]
fn nested_quota_roots_are_refused_by_xattr() {
    let m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    fs::create_dir(c1.join("sub")).unwrap();
    assert_errno(
        "a quota inside a quota root",
        xattr_set(&c1.join("sub"), XATTR, b"1M"),
        libc::EBUSY,
    );
    fs::create_dir_all(m.path("overlay/p/c")).unwrap();
    set(&m, "overlay/p/c", "1M", &[]);
    assert_errno(
        "a quota above a quota root",
        xattr_set(&m.path("overlay/p"), XATTR, b"1G"),
        libc::EBUSY,
    );
    assert_errno(
        "no quota was set above",
        xattr_get(&m.path("overlay/p"), XATTR),
        libc::ENODATA,
    );
    // Changing the limit of a root is not nesting.
    xattr_set(&c1, XATTR, b"16M").unwrap();
    assert_eq!(get(&m, "overlay/c1").limit, 16 * MIB);
}

/// Runs `lsetxattr` (or `lremovexattr` when `value` is `None`) as uid/gid 65534 in a forked
/// child; 0 or the errno.
fn xattr_as_nobody(p: &Path, name: &str, value: Option<&[u8]>) -> i32 {
    common::sys::xattr_in_child(p, name, value, "nobody", || unsafe {
        libc::setgroups(0, std::ptr::null()) == 0
            && libc::setgid(65534) == 0
            && libc::setuid(65534) == 0
    })
}

/// A quota is a limit the user it limits must not lift (DESIGN §11: the daemon never lets a
/// caller do what the kernel would refuse them; the kernel refuses non-root changes to a
/// project quota). On a root they own, where the kernel lets them write other `user.*`
/// xattrs, an unprivileged user can neither raise nor clear it.
#[test]
fn an_unprivileged_owner_cannot_raise_or_clear_a_quota_by_xattr() {
    let m = mount();
    let c1 = root(&m, "c1", "1M", &[]);
    std::os::unix::fs::chown(&c1, Some(65534), Some(65534)).unwrap();
    // The kernel lets the owner write an ordinary user xattr there.
    assert_eq!(xattr_as_nobody(&c1, "user.other", Some(b"v")), 0);
    for (what, value) in [
        ("raise it to 1T", Some(&b"1T"[..])),
        ("clear it with an empty value", Some(&b""[..])),
        ("remove it", None),
    ] {
        let e = xattr_as_nobody(&c1, XATTR, value);
        assert!(
            e == libc::EPERM || e == libc::EACCES,
            "nobody could {what}: {}",
            if e == 0 {
                "succeeded".into()
            } else {
                errname(e)
            }
        );
    }
    assert_eq!(get(&m, "overlay/c1").limit, MIB);
    assert_eq!(xattr_limit(&c1).unwrap(), MIB);
}

// ---- statfs ------------------------------------------------------------------------------

fn df_b1(p: &Path) -> (u64, u64, u64) {
    let out = Command::new("df")
        .args(["-B1", "--output=size,used,avail"])
        .arg(p)
        .output()
        .unwrap();
    assert!(out.status.success(), "df: {}", text(&out.stderr));
    let s = text(&out.stdout);
    let nums: Vec<u64> = s
        .lines()
        .nth(1)
        .unwrap_or_else(|| panic!("df printed {s:?}"))
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    (nums[0], nums[1], nums[2])
}

#[test]
fn statfs_inside_a_root_shows_the_quota() {
    let m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    fs::create_dir(c1.join("sub")).unwrap();
    write_file(&c1.join("sub/f"), 3 * MIB as usize, 4);
    let q = get(&m, "overlay/c1");
    for p in [c1.clone(), c1.join("sub"), c1.join("sub/f")] {
        let st = nix::sys::statvfs::statvfs(&p).unwrap();
        let frsize = if st.fragment_size() > 0 {
            st.fragment_size()
        } else {
            st.block_size()
        };
        let what = format!("statfs of {}", p.display());
        assert_close(
            &format!("{what}: total"),
            st.blocks() * frsize,
            q.limit,
            frsize - 1,
        );
        assert_close(
            &format!("{what}: available"),
            st.blocks_available() * frsize,
            q.limit - q.used,
            frsize - 1,
        );
        assert_close(
            &format!("{what}: free"),
            st.blocks_free() * frsize,
            q.limit - q.used,
            frsize - 1,
        );
    }
    let (size, usedb, avail) = df_b1(&c1);
    assert_close("df size", size, q.limit, 4096);
    assert_close("df used", usedb, q.used, 4096);
    assert_close("df avail", avail, q.limit - q.used, 4096);

    // Full: nothing available.
    fill_root(&c1, "full", libc::ENOSPC);
    let st = nix::sys::statvfs::statvfs(&c1).unwrap();
    assert!(
        st.blocks_available() * st.fragment_size().max(1) < 2 * 4096,
        "a full root shows {} blocks available",
        st.blocks_available()
    );

    // Outside any root: the local filesystem's figures.
    let outside = nix::sys::statvfs::statvfs(&m.path("overlay")).unwrap();
    let local = nix::sys::statvfs::statvfs(&m.local).unwrap();
    assert_eq!(
        outside.blocks() * outside.fragment_size(),
        local.blocks() * local.fragment_size(),
        "statfs outside a quota root is local's"
    );
}

// ---- Persistence: the registry in local --------------------------------------------------

#[test]
fn remount_keeps_limit_and_usage() {
    let mut m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    root(&m, "c2", "4M", &["--inodes", "10"]);
    write_file(&c1.join("f"), 3 * MIB as usize, 1);
    fs::create_dir(c1.join("d")).unwrap();
    write_file(&m.path("overlay/c2/g"), MIB as usize, 2);
    let before = list(&m);
    assert_eq!(before.len(), 2);

    m.remount(&Options::default());
    assert_eq!(list(&m), before, "limits and usage after a remount");
    assert_eq!(xattr_limit(&c1).unwrap(), 8 * MIB);
    // Still enforced.
    let room = 8 * MIB - get(&m, "overlay/c1").used;
    let n = fill_root(&c1, "more", libc::ENOSPC);
    assert!(n <= room && n + ONE_WRITE + SLACK >= room, "{n} of {room}");
    assert_usage_matches_local(&m, "overlay/c1");
}

/// Mounts `m`'s trees with the daemon's open-file limit at 256 (as it stands, it may not
/// raise it): whether it mounted (it is unmounted again), and what it wrote to stderr.
fn mount_with_few_descriptors(m: &Mount) -> (bool, String) {
    let mut cmd = Command::new(BIN);
    limit_open_files(&mut cmd, 256);
    let mut daemon = cmd
        .arg("mount")
        .arg("--remote")
        .arg(&m.remote)
        .arg("--local")
        .arg(&m.local)
        .arg("-f")
        .arg(&m.mnt)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mounted = loop {
        if is_mounted(&m.mnt) {
            break true;
        }
        if daemon.try_wait().unwrap().is_some() {
            break false;
        }
        assert!(
            Instant::now() < deadline,
            "the mount neither failed nor came up"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    if mounted {
        let _ = Command::new("umount").arg(&m.mnt).status();
    }
    let out = daemon.wait_with_output().unwrap();
    assert_eq!(mounted, out.status.success(), "{out:?}");
    (mounted, text(&out.stderr))
}

/// Counting a root at mount holds a descriptor per directory on the way down, not one per
/// directory still to walk: 2000 subdirectories side by side count under a limit of 256.
#[test]
fn a_wide_root_is_counted_at_mount_with_few_descriptors() {
    let mut m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    for i in 0..2000 {
        fs::create_dir(c1.join(format!("d{i}"))).unwrap();
    }
    let before = list(&m);
    m.unmount();
    let (mounted, err) = mount_with_few_descriptors(&m);
    assert!(mounted, "{err}");
    m.mount(&Options::default());
    assert_eq!(list(&m), before);
    assert_usage_matches_local(&m, "overlay/c1");
}

/// A root whose usage cannot be counted at mount keeps its quota: the mount fails and says
/// why. Only a root that is gone from local loses it. Here the count runs out of
/// descriptors 300 directories down; any error used to drop the quota from the registry
/// for good.
#[test]
fn a_root_that_cannot_be_counted_at_mount_keeps_its_quota() {
    let mut m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    fs::create_dir_all(c1.join(["d"; 300].join("/"))).unwrap();
    let before = list(&m);
    m.unmount();
    let (mounted, err) = mount_with_few_descriptors(&m);
    assert!(!mounted, "mounted without counting c1: {err}");
    assert!(
        err.contains("overlay/c1"),
        "the error names the root: {err}"
    );

    m.mount(&Options::default());
    assert_eq!(
        list(&m),
        before,
        "the quota after a mount that could count it"
    );
}

/// A process's writes to the block device behind `path`, throttled to `bps` bytes a second
/// (a cgroup v1 `blkio` group of its own) until dropped.
struct ThrottledWrites {
    group: PathBuf,
    pid: u32,
}

impl ThrottledWrites {
    const BLKIO: &str = "/sys/fs/cgroup/blkio";

    fn of(pid: u32, path: &Path, bps: u64) -> ThrottledWrites {
        use std::os::unix::fs::MetadataExt;
        let dev = fs::metadata(path).unwrap().dev();
        let group = Path::new(Self::BLKIO).join(format!("layerfs-test-{pid}"));
        fs::create_dir(&group).unwrap_or_else(|e| {
            panic!("{}: {e} (the test needs cgroup v1 blkio)", group.display())
        });
        let throttled = ThrottledWrites { group, pid };
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        fs::write(
            throttled.group.join("blkio.throttle.write_bps_device"),
            format!("{major}:{minor} {bps}"),
        )
        .unwrap();
        fs::write(throttled.group.join("cgroup.procs"), pid.to_string()).unwrap();
        throttled
    }
}

impl Drop for ThrottledWrites {
    fn drop(&mut self) {
        let _ = fs::write(
            Path::new(Self::BLKIO).join("cgroup.procs"),
            self.pid.to_string(),
        );
        let _ = fs::remove_dir(&self.group);
    }
}

/// Makes a directory immutable (`chattr +i`) for as long as it lives.
struct Immutable(PathBuf);

impl Immutable {
    fn make(dir: &Path) -> Immutable {
        run(Command::new("chattr").arg("+i").arg(dir));
        Immutable(dir.to_owned())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
    }
}

/// A quota change whose registry cannot be saved fails, and is not made: not in force
/// while the daemon runs, nor after a remount. Local's root is made immutable, so the
/// registry in it cannot be replaced while everything below it still works. A changed
/// limit stayed in force after its error, and a cleared root stayed cleared, until the
/// next mount brought the old registry back.
#[test]
fn a_quota_change_that_cannot_be_saved_is_not_made() {
    let mut tmpfs = LocalFs::default();
    let mut m = Mount::with(Options::default(), |remote| {
        tmpfs.tmpfs(&local_beside(remote), "size=64m,mode=755")
    });
    root(&m, "c1", "8M", &[]);
    fs::create_dir_all(m.path("overlay/c2")).unwrap();
    let expect = |m: &Mount, when: &str| {
        let q = get(m, "overlay/c1");
        assert_eq!(q.limit, 8 * MIB, "{when}: the limit of overlay/c1");
        let listed: Vec<String> = list(m).into_iter().map(|q| q.path).collect();
        assert_eq!(listed, ["overlay/c1"], "{when}: the roots");
        let written = fill_root(&m.path("overlay/c1"), "fill", libc::ENOSPC);
        assert!(
            (7 * MIB..=8 * MIB).contains(&written),
            "{when}: {written} bytes written into overlay/c1 before ENOSPC"
        );
        fs::remove_file(m.path("overlay/c1/fill")).unwrap();
    };
    {
        let _frozen = Immutable::make(&m.local);
        for (sub, args) in [
            ("set", &["overlay/c1", "16M"][..]),
            ("clear", &["overlay/c1"][..]),
            ("set", &["overlay/c2", "8M"][..]),
        ] {
            let err = quota_err(&m, sub, args);
            assert!(err.contains("registry"), "quota {sub} {args:?}: {err}");
        }
        expect(&m, "after the failed changes");
    }
    m.remount(&Options::default());
    expect(&m, "after a remount");
}

/// Saving the registry waits for local's disk twice (the file, then its directory), and
/// every directory rename takes the quota change lock while any root exists. A rename
/// must not wait for a save: with the daemon's writes to local throttled so that a save
/// takes seconds, a rename in an unrelated directory answers while `quota set` saves.
/// It waited for the save (3.7 s of 4 by hand).
#[test]
fn a_directory_rename_does_not_wait_for_the_registry_to_reach_the_disk() {
    let mut ext4 = LocalFs::default();
    let m = Mount::with(Options::default(), |remote| {
        ext4.ext4(&local_beside(remote), 64)
    });
    root(&m, "c1", "10M", &[]);
    fs::create_dir_all(m.path("overlay/c2")).unwrap();
    fs::create_dir_all(m.path("overlay/other/x")).unwrap();
    // Nothing left to write back but the save's own blocks.
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    let throttled = ThrottledWrites::of(m.daemon_pid().unwrap(), &m.local, 256);
    let mnt = m.mnt.clone();
    let setter = std::thread::spawn(move || {
        Command::new(BIN)
            .args(["quota", "set"])
            .arg(&mnt)
            .args(["overlay/c2", "10M"])
            .output()
            .unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    let (from, to) = (m.path("overlay/other/x"), m.path("overlay/other/y"));
    common::live(2, "a directory rename while a quota is saved", move || {
        fs::rename(from, to).unwrap()
    });
    let set = setter.join().unwrap();
    drop(throttled);
    assert!(set.status.success(), "{set:?}");
    assert_eq!(get(&m, "overlay/c2").limit, 10 * MIB);
}

/// Two clears of one root, the second made while the first saves the registry (writes
/// throttled so that the save takes seconds): one clears it, the other finds no root.
/// Both reported success.
#[test]
fn a_root_cleared_twice_at_once_is_cleared_once() {
    let mut ext4 = LocalFs::default();
    let m = Mount::with(Options::default(), |remote| {
        ext4.ext4(&local_beside(remote), 64)
    });
    root(&m, "c1", "10M", &[]);
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    let throttled = ThrottledWrites::of(m.daemon_pid().unwrap(), &m.local, 256);
    let mnt = m.mnt.clone();
    let clearer = std::thread::spawn(move || {
        Command::new(BIN)
            .args(["quota", "clear"])
            .arg(&mnt)
            .arg("overlay/c1")
            .output()
            .unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    let second = xattr_remove(&m.path("overlay/c1"), XATTR);
    let first = clearer.join().unwrap();
    drop(throttled);
    assert!(first.status.success(), "{first:?}");
    assert_errno("the second clear", second, libc::ENODATA);
    assert!(list(&m).is_empty(), "{:?}", list(&m));
}

/// Only `.layerfs-quota.json` at the top is the engine's own: other names starting with
/// `.layerfs-` are ordinary files, and the registry never shows through the mount.
#[test]
fn names_starting_with_layerfs_dash_are_ordinary() {
    let m = mount();
    root(&m, "q", "4M", &[]);
    assert!(
        m.local.join(".layerfs-quota.json").is_file(),
        "the registry is in local"
    );
    assert!(
        !names(&m.mnt).contains(&".layerfs-quota.json".to_owned()),
        "the registry shows in readdir of the mount's root: {:?}",
        names(&m.mnt)
    );
    assert_errno(
        "lstat of the registry through the mount",
        fs::symlink_metadata(m.path(".layerfs-quota.json")),
        libc::ENOENT,
    );

    let c = m.path("overlay/c");
    fs::create_dir(&c).unwrap();
    fs::write(c.join(".layerfs-notes"), b"some notes\n").unwrap();
    assert_eq!(names(&c), vec![".layerfs-notes".to_owned()]);
    assert_eq!(fs::read(c.join(".layerfs-notes")).unwrap(), b"some notes\n");
    assert_errno(
        "rmdir of a dir holding it",
        fs::remove_dir(&c),
        libc::ENOTEMPTY,
    );
    assert_eq!(fs::read(c.join(".layerfs-notes")).unwrap(), b"some notes\n");
    assert_eq!(names(&c), vec![".layerfs-notes".to_owned()]);
    assert!(m.local.join("overlay/c/.layerfs-notes").is_file());
}
