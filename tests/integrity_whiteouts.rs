//! Integrity regressions: each test is a bug seen on a real mount, and asserts what a correct
//! union filesystem (and, where there is one, the host filesystem as a reference) does.
//!
//! Here, what is and is not a whiteout:
//!
//! - a 0/0 character device a user makes, moves or links into a shared area, or that a remote
//!   layer holds, is an entry like any other, through copy-up, the kernel forgetting it and
//!   remounts; overlayfs would take it for a whiteout, and a view that did the same would make
//!   it a phantom, created and then invisible;
//! - a removed device's inode number must not make new objects look like it;
//! - where local's filesystem cannot make whiteouts (no `RENAME_WHITEOUT`), the fallbacks keep
//!   deleted and renamed names right.
//!
//! Needs root, `/dev/fuse` and `mkfs.ext4`.

mod common;

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::sys::*;
use common::*;

// ---- Identities of removed devices ----

/// Checks that `p` is there as a directory of mode `perm` (if given) that takes a new file.
fn assert_usable_dir(p: &Path, perm: Option<u32>, what: &str) {
    let st = fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{what}: lstat: {e}"));
    assert!(
        st.is_dir(),
        "{what}: not a directory (mode {:o})",
        st.mode()
    );
    if let Some(perm) = perm {
        assert_eq!(st.mode() & 0o7777, perm, "{what}: mode");
    }
    fs::write(p.join("inside"), b"in")
        .unwrap_or_else(|e| panic!("{what}: create a file in it: {e}"));
    assert_eq!(fs::read(p.join("inside")).unwrap(), b"in", "{what}");
}

/// A 0/0 character device made in a shared area, held open (`O_PATH`) while its directory
/// is removed, must not lend its identity to what is made next: local (here a private ext4,
/// which hands out the lowest free inode number, so the freed numbers come back at once)
/// gives the next objects the freed numbers, and a view that still maps such a number to
/// the dead device answers `ENOENT` or `ENOTDIR` for the file or directory that got it.
/// Each round: files and directories made (and checked) while the device is held, then five
/// directories once it is closed (mkdir, chmod, lstat, a file inside); five rounds.
#[test]
fn new_objects_never_take_the_identity_of_a_removed_device() {
    let mut ext4 = LocalFs::default();
    let m = Mount::with(Options::default(), |remote| {
        ext4.ext4(&local_beside(remote), 64);
    });
    let _w = Watchdog::of(&m, 120);
    let d = m.diff("L1").join("x");
    fs::create_dir(&d).unwrap();
    for round in 0..5 {
        let a = d.join("A");
        fs::create_dir(&a).unwrap_or_else(|e| panic!("round {round}: mkdir D/A: {e}"));
        mknod_0_0(&a.join("x"), 0o644)
            .unwrap_or_else(|e| panic!("round {round}: mknod D/A/x c 0 0: {e}"));
        let held = open_raw(&a.join("x"), libc::O_PATH | libc::O_NOFOLLOW, 0)
            .unwrap_or_else(|e| panic!("round {round}: open D/A/x O_PATH: {e}"));
        let rm = Command::new("rm").arg("-rf").arg(&a).output().unwrap();
        assert!(
            rm.status.success(),
            "round {round}: rm -rf D/A: {}",
            String::from_utf8_lossy(&rm.stderr)
        );
        assert!(
            fs::symlink_metadata(&a).is_err(),
            "round {round}: D/A is gone"
        );
        for i in 0..3 {
            let f = d.join(format!("f{round}-{i}"));
            let what = format!(
                "round {round}, made while the device is held: {}",
                f.display()
            );
            fs::write(&f, b"file").unwrap_or_else(|e| panic!("{what}: create: {e}"));
            let st = fs::symlink_metadata(&f).unwrap_or_else(|e| panic!("{what}: lstat: {e}"));
            assert!(st.is_file(), "{what}: not a file (mode {:o})", st.mode());
            assert_eq!(fs::read(&f).unwrap(), b"file", "{what}");
            let g = d.join(format!("g{round}-{i}"));
            let what = format!(
                "round {round}, made while the device is held: {}",
                g.display()
            );
            fs::create_dir(&g).unwrap_or_else(|e| panic!("{what}: mkdir: {e}"));
            assert_usable_dir(&g, None, &what);
        }
        drop(held);
        for i in 0..5 {
            let n = d.join(format!("n{round}-{i}"));
            let what = format!("round {round}, new dir {i}: {}", n.display());
            fs::create_dir(&n).unwrap_or_else(|e| panic!("{what}: mkdir: {e}"));
            fs::set_permissions(&n, fs::Permissions::from_mode(0o750))
                .unwrap_or_else(|e| panic!("{what}: chmod: {e}"));
            assert_usable_dir(&n, Some(0o750), &what);
        }
    }
}

// ---- Devices that look like whiteouts ----

fn assert_char_0_0(p: &Path, when: &str) {
    let st =
        fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{when}: lstat {}: {e}", p.display()));
    assert!(
        st.file_type().is_char_device() && st.rdev() == 0,
        "{when}: {} is not a 0/0 character device (mode {:o}, rdev {})",
        p.display(),
        st.mode(),
        st.rdev()
    );
}

/// `mknod x c 0 0` in a shared area makes an entry like any other: stat shows it, readdir
/// lists it, an exclusive create of the name fails with `EEXIST`, unlink removes it, and it
/// survives a remount. (The view must not take it for one of its own whiteouts and make a
/// phantom: created, then invisible.)
/// A 0/0 device made where nothing shows below needs no mark, and gets none. Moved by rename
/// or link into a directory where whiteouts hide something, it read there as a whiteout
/// once the kernel forgot it: gone from the view.
#[test]
fn a_0_0_device_moved_into_a_shared_area_stays_a_real_entry() {
    let m = Mount::new();
    let _w = Watchdog::of(&m, 120);
    let private = m.path("private");
    fs::create_dir(&private).unwrap();
    mknod_0_0(&private.join("moved"), 0o640).expect("mknod moved c 0 0");
    mknod_0_0(&private.join("linked"), 0o640).expect("mknod linked c 0 0");
    let d = m.diff("L1");
    fs::rename(private.join("moved"), d.join("moved")).expect("rename into L1");
    fs::hard_link(private.join("linked"), d.join("linked")).expect("link into L1");
    drop_caches();
    for name in ["moved", "linked"] {
        assert_char_0_0(
            &d.join(name),
            &format!("{name}, after the kernel forgot it"),
        );
        assert!(listed(&d, name), "{name}: readdir does not list it");
    }
    assert_char_0_0(&private.join("linked"), "the link's other name");
}

#[test]
fn a_0_0_device_made_in_a_shared_area_is_a_real_entry() {
    let mut m = Mount::new();
    let w = Watchdog::of(&m, 120);
    let d = m.diff("L1");
    let x = d.join("phantom");
    mknod_0_0(&x, 0o640).expect("mknod phantom c 0 0");
    let check_present = |when: &str| {
        assert_char_0_0(&x, when);
        assert!(
            listed(&d, "phantom"),
            "{when}: readdir does not list it: {:?}",
            names(&d)
        );
        let excl = fs::OpenOptions::new().write(true).create_new(true).open(&x);
        assert_eq!(
            excl.as_ref().err().and_then(|e| e.raw_os_error()),
            Some(libc::EEXIST),
            "{when}: O_CREAT|O_EXCL on it: {}",
            describe(&excl)
        );
    };
    check_present("just made");
    drop_caches();
    check_present("after the kernel forgot it");
    m.remount(&Options::default());
    w.follow(&m);
    check_present("after a remount");
    fs::remove_file(&x).expect("unlink phantom");
    let gone = |when: &str| {
        assert_eq!(
            errno_of(fs::symlink_metadata(&x)),
            libc::ENOENT,
            "{when}: lstat after unlink"
        );
        assert!(!listed(&d, "phantom"), "{when}: still listed after unlink");
    };
    gone("just unlinked");
    drop_caches();
    gone("unlinked, after the kernel forgot it");
    m.remount(&Options::default());
    w.follow(&m);
    gone("unlinked, after a remount");
}

/// A directory made where nothing lies below (a container's own layer, say) may hold 0/0
/// devices that are plain entries there. Moved whole into a shared layer, where a 0/0 device
/// is taken for a whiteout unless marked, it keeps every one of them, at any depth, and
/// those made in it after the move: by `mknod`, or left behind by a `RENAME_WHITEOUT`.
#[test]
fn a_directory_moved_into_a_shared_area_keeps_its_0_0_devices() {
    let mut m = Mount::new();
    let w = Watchdog::of(&m, 120);
    let scratch = m.path("overlay/scratch");
    let deep = scratch.join("tree/a/b");
    fs::create_dir_all(&deep).unwrap();
    mknod_0_0(&scratch.join("tree/top"), 0o600).expect("mknod top");
    mknod_0_0(&deep.join("deep"), 0o600).expect("mknod deep");
    fs::write(deep.join("file"), b"kept").unwrap();

    let moved = m.diff("L1").join("moved");
    fs::rename(scratch.join("tree"), &moved).expect("rename into the shared layer");
    // Made while the kernel still holds the moved directory from before the move, which
    // the kernel's overlayfs would ask of an upper directory it believed empty below.
    mknod_0_0(&moved.join("a/late"), 0o600).expect("mknod late");
    fs::write(moved.join("a/old"), b"renamed").unwrap();
    rename_whiteout(&moved.join("a/old"), &moved.join("a/new")).expect("RENAME_WHITEOUT");
    let check = |when: &str| {
        let devices = [
            (moved.clone(), "top"),
            (moved.join("a/b"), "deep"),
            (moved.join("a"), "late"),
            (moved.join("a"), "old"),
        ];
        for (dir, name) in devices {
            assert_char_0_0(&dir.join(name), when);
            assert!(
                listed(&dir, name),
                "{when}: {name} is not listed: {:?}",
                names(&dir)
            );
        }
        assert_eq!(fs::read(moved.join("a/b/file")).unwrap(), b"kept", "{when}");
        assert_eq!(fs::read(moved.join("a/new")).unwrap(), b"renamed", "{when}");
    };
    check("just moved");
    drop_caches();
    check("after the kernel forgot them");
    m.remount(&Options::default());
    w.follow(&m);
    check("after a remount");
}

/// `RENAME_WHITEOUT` of a directory onto a name whose remote entry was deleted: the
/// directory takes the name, and the 0/0 device asked for stays at the old one (the
/// deletion's whiteout takes that place in local, and must stay).
#[test]
fn a_directory_renamed_with_a_whiteout_over_a_deleted_name_leaves_the_device() {
    let m = Mount::new();
    let _w = Watchdog::of(&m, 120);
    let scratch = m.path("overlay/scratch");
    fs::create_dir_all(scratch.join("d")).unwrap();
    fs::write(scratch.join("d/file"), b"moved").unwrap();
    let etc = m.diff("L1").join("etc");
    fs::remove_file(etc.join("hostname")).expect("delete a remote file");
    rename_whiteout(&scratch.join("d"), &etc.join("hostname")).expect("RENAME_WHITEOUT");
    let check = |when: &str| {
        assert_char_0_0(&scratch.join("d"), when);
        assert!(listed(&scratch, "d"), "{when}: d is not listed");
        assert_eq!(
            fs::read(etc.join("hostname/file")).unwrap(),
            b"moved",
            "{when}"
        );
    };
    check("just renamed");
    drop_caches();
    check("after the kernel forgot them");
}

/// A 0/0 character device that is part of a remote layer shows in the view as what it is,
/// and stays one when `chmod` copies it up (a copy-up must not turn it into a whiteout that
/// hides it).
#[test]
fn a_remote_0_0_device_stays_a_device_after_copy_up() {
    let mut m = Mount::with(Options::default(), |remote| {
        let etc = remote.join("overlay/RO").join(id("L1")).join("diff/etc");
        mknod_0_0(&etc.join("dev0"), 0o644).expect("mknod in the remote");
    });
    let w = Watchdog::of(&m, 120);
    let etc = m.diff("L1").join("etc");
    let dev = etc.join("dev0");
    assert_char_0_0(&dev, "remote");
    assert!(
        listed(&etc, "dev0"),
        "remote: not listed: {:?}",
        names(&etc)
    );
    fs::set_permissions(&dev, fs::Permissions::from_mode(0o600)).expect("chmod dev0");
    let after = |when: &str| {
        assert_char_0_0(&dev, when);
        assert_eq!(mode_of(&dev), 0o600, "{when}: mode");
        assert!(
            listed(&etc, "dev0"),
            "{when}: not listed: {:?}",
            names(&etc)
        );
    };
    after("after chmod");
    drop_caches();
    after("after chmod, the kernel's caches dropped");
    m.remount(&Options::default());
    w.follow(&m);
    after("after chmod and a remount");
}

// ---- A local filesystem without RENAME_WHITEOUT ----

/// Where local's filesystem has no `RENAME_WHITEOUT` (NFS, sshfs, FUSE filesystems; here a
/// shared area of another layerfs view, which refuses it there as overlayfs refuses
/// whiteouts in its upper dir), the fallbacks keep the union right: renaming a remote file
/// and a directory over a hidden remote one leaves whiteouts, files and directories made over
/// whiteouts take their place, a merged directory is removed, and all of it holds after a
/// remount.
#[test]
fn a_local_without_rename_whiteout_keeps_names_right() {
    let dir = tempfile::tempdir().unwrap();
    let make = |name: &str| {
        let p = dir.path().join(name);
        fs::create_dir_all(&p).unwrap();
        p
    };
    let (inner_remote, inner_local, inner_mnt) =
        (dir.path().join("i-remote"), make("i-local"), make("i-mnt"));
    copy_tree(&repo().join("fixtures/remote"), &inner_remote);
    let inner = RawMount::start(
        &inner_remote,
        &inner_local,
        &inner_mnt,
        &["-o", "allow_other"],
    );
    let _wi = Watchdog::new(inner.pid(), 120);
    let outer_local = inner_mnt
        .join("overlay/RO")
        .join(id("L1"))
        .join("diff/outer-local");
    fs::create_dir(&outer_local).unwrap();
    let (outer_remote, outer_mnt) = (dir.path().join("o-remote"), make("o-mnt"));
    copy_tree(&repo().join("fixtures/remote"), &outer_remote);
    let check = |d: &Path| {
        assert!(
            !d.join("etc/hostname").exists(),
            "etc/hostname was renamed away"
        );
        assert_eq!(
            fs::read_to_string(d.join("etc/hn")).unwrap(),
            fs::read_to_string(remote_file(&outer_remote, "etc/hostname")).unwrap()
        );
        assert_eq!(
            fs::read_to_string(d.join("etc/os-release")).unwrap(),
            "new\n"
        );
        assert!(
            !d.join("usr/share/doc").exists(),
            "the moved directory left a whiteout"
        );
        assert_eq!(names(&d.join("docs")), vec!["mine"]);
        assert_eq!(
            names(&d.join("usr/lib")),
            Vec::<String>::new(),
            "an opaque new dir"
        );
        assert!(
            !d.join("bin").exists(),
            "the removed merged directory stays removed"
        );
    };
    {
        let outer = RawMount::start(
            &outer_remote,
            &outer_local,
            &outer_mnt,
            &["-o", "allow_other"],
        );
        let _wo = Watchdog::new(outer.pid(), 120);
        let d = outer_mnt.join("overlay/RO").join(id("L1")).join("diff");
        fs::rename(d.join("etc/hostname"), d.join("etc/hn")).unwrap();
        fs::remove_file(d.join("etc/os-release")).unwrap();
        fs::write(d.join("etc/os-release"), "new\n").unwrap();
        let rm = |p: &Path| {
            let out = Command::new("rm").arg("-rf").arg(p).output().unwrap();
            assert!(
                out.status.success(),
                "rm -rf {}: {}",
                p.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        rm(&d.join("usr/share/doc"));
        fs::create_dir(d.join("usr/share/doc")).unwrap();
        fs::write(d.join("usr/share/doc/mine"), "m").unwrap();
        fs::rename(d.join("usr/share/doc"), d.join("docs")).unwrap();
        rm(&d.join("usr/lib"));
        fs::create_dir(d.join("usr/lib")).unwrap();
        rm(&d.join("bin"));
        check(&d);
        drop(outer);
    }
    let outer = RawMount::start(
        &outer_remote,
        &outer_local,
        &outer_mnt,
        &["-o", "allow_other"],
    );
    let _wo = Watchdog::new(outer.pid(), 120);
    check(&outer_mnt.join("overlay/RO").join(id("L1")).join("diff"));
    drop(outer);
    drop(inner);
}

/// The remote copy of a file of L1's diff in a fixture remote tree.
fn remote_file(remote: &Path, rel: &str) -> PathBuf {
    remote
        .join("overlay/RO")
        .join(id("L1"))
        .join("diff")
        .join(rel)
}
