//! rename(2), renameat2 flags and hard links on a real mount.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use common::*;
use nix::fcntl::{renameat2, RenameFlags, AT_FDCWD};

fn rename2(from: &Path, to: &Path, flags: RenameFlags) -> std::io::Result<()> {
    renameat2(AT_FDCWD, from, AT_FDCWD, to, flags).map_err(std::io::Error::from)
}

#[test]
fn rename_of_a_remote_file_copies_up_and_whiteouts_the_old_name() {
    let m = Mount::new();
    let etc = m.diff("L1").join("etc");
    let content = fs::read(etc.join("os-release")).unwrap();
    let ino = fs::metadata(etc.join("os-release")).unwrap().ino();
    fs::rename(etc.join("os-release"), etc.join("os-release.new")).unwrap();
    assert_eq!(errno_of(fs::metadata(etc.join("os-release"))), libc::ENOENT);
    assert_eq!(fs::read(etc.join("os-release.new")).unwrap(), content);
    assert_eq!(
        fs::metadata(etc.join("os-release.new")).unwrap().ino(),
        ino,
        "same object"
    );
    assert_eq!(names(&etc), vec!["hostname", "os-release.new", "passwd"]);
    let local = m.local_diff("L1").join("etc");
    assert!(is_whiteout(&local.join("os-release")));
    assert_eq!(fs::read(local.join("os-release.new")).unwrap(), content);
    assert_eq!(names(&local), vec!["os-release", "os-release.new"]);
}

#[test]
fn rename_of_a_remote_file_into_another_remote_dir() {
    let m = Mount::new();
    let d = m.diff("L1");
    fs::rename(d.join("etc/passwd"), d.join("usr/share/doc/passwd")).unwrap();
    assert_eq!(
        names(&d.join("usr/share/doc")),
        vec!["passwd", "readme.txt"]
    );
    assert!(!d.join("etc/passwd").exists());
    assert!(is_whiteout(&m.local_diff("L1").join("etc/passwd")));
    assert!(m.local_diff("L1").join("usr/share/doc/passwd").is_file());
}

#[test]
fn rename_over_an_existing_remote_file() {
    let m = Mount::new();
    let etc = m.diff("L1").join("etc");
    fs::rename(etc.join("hostname"), etc.join("passwd")).unwrap();
    assert_eq!(fs::read(etc.join("passwd")).unwrap(), b"fixture-base\n");
    assert_eq!(names(&etc), vec!["os-release", "passwd"]);
    let local = m.local_diff("L1").join("etc");
    assert!(is_whiteout(&local.join("hostname")));
    assert_eq!(fs::read(local.join("passwd")).unwrap(), b"fixture-base\n");
}

#[test]
fn rename_of_a_local_file_over_a_remote_one() {
    let m = Mount::new();
    let etc = m.diff("L1").join("etc");
    fs::write(etc.join("tmp"), "new host\n").unwrap();
    fs::rename(etc.join("tmp"), etc.join("hostname")).unwrap();
    assert_eq!(fs::read(etc.join("hostname")).unwrap(), b"new host\n");
    assert_eq!(names(&etc), vec!["hostname", "os-release", "passwd"]);
    // The local file simply moved: no whiteout needed where nothing is below.
    assert_eq!(names(&m.local_diff("L1").join("etc")), vec!["hostname"]);
}

#[test]
fn rename_noreplace_onto_a_remote_only_target_is_eexist() {
    let m = Mount::new();
    let etc = m.diff("L1").join("etc");
    fs::write(etc.join("mine"), "m").unwrap();
    assert_eq!(
        errno_of(rename2(
            &etc.join("mine"),
            &etc.join("passwd"),
            RenameFlags::RENAME_NOREPLACE
        )),
        libc::EEXIST
    );
    assert_eq!(
        errno_of(rename2(
            &etc.join("hostname"),
            &etc.join("passwd"),
            RenameFlags::RENAME_NOREPLACE
        )),
        libc::EEXIST
    );
    // Nothing moved, nothing was copied up.
    assert_eq!(names(&m.local_diff("L1").join("etc")), vec!["mine"]);
    // To a free name it works.
    rename2(
        &etc.join("hostname"),
        &etc.join("hostname2"),
        RenameFlags::RENAME_NOREPLACE,
    )
    .unwrap();
    assert_eq!(fs::read(etc.join("hostname2")).unwrap(), b"fixture-base\n");
    assert!(is_whiteout(&m.local_diff("L1").join("etc/hostname")));
    // A whiteout is not an existing target.
    rename2(
        &etc.join("mine"),
        &etc.join("hostname"),
        RenameFlags::RENAME_NOREPLACE,
    )
    .unwrap();
    assert_eq!(fs::read(etc.join("hostname")).unwrap(), b"m");
}

#[test]
fn rename_exchange_of_a_local_and_a_remote_file() {
    let m = Mount::new();
    let etc = m.diff("L1").join("etc");
    fs::write(etc.join("mine"), "mine\n").unwrap();
    let ino_mine = fs::metadata(etc.join("mine")).unwrap().ino();
    let ino_host = fs::metadata(etc.join("hostname")).unwrap().ino();
    rename2(
        &etc.join("mine"),
        &etc.join("hostname"),
        RenameFlags::RENAME_EXCHANGE,
    )
    .unwrap();
    assert_eq!(fs::read(etc.join("hostname")).unwrap(), b"mine\n");
    assert_eq!(fs::read(etc.join("mine")).unwrap(), b"fixture-base\n");
    assert_eq!(fs::metadata(etc.join("hostname")).unwrap().ino(), ino_mine);
    assert_eq!(fs::metadata(etc.join("mine")).unwrap().ino(), ino_host);
    let local = m.local_diff("L1").join("etc");
    assert_eq!(fs::read(local.join("hostname")).unwrap(), b"mine\n");
    assert_eq!(fs::read(local.join("mine")).unwrap(), b"fixture-base\n");
    // Exchanging with a missing name fails.
    assert_eq!(
        errno_of(rename2(
            &etc.join("mine"),
            &etc.join("absent"),
            RenameFlags::RENAME_EXCHANGE
        )),
        libc::ENOENT
    );
}

#[test]
fn rename_of_a_remote_or_merged_directory_is_exdev() {
    let m = Mount::new();
    let d = m.diff("L1");
    // Remote only.
    assert_eq!(
        errno_of(fs::rename(d.join("usr/share"), d.join("usr/share2"))),
        libc::EXDEV
    );
    // Merged: a local part over a remote one.
    fs::write(d.join("etc/new"), "n").unwrap();
    assert_eq!(
        errno_of(fs::rename(d.join("etc"), d.join("etc2"))),
        libc::EXDEV
    );
    assert_eq!(names(&d), vec!["bin", "etc", "lib", "usr"]);
    // mv falls back to copy and delete, which the view supports.
    let status = std::process::Command::new("mv")
        .arg(d.join("usr/share"))
        .arg(d.join("usr/share2"))
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(names(&d.join("usr")), vec!["lib", "share2"]);
    assert_eq!(
        fs::read(d.join("usr/share2/doc/readme.txt")).unwrap(),
        fs::read(m.remote_diff("L1").join("usr/share/doc/readme.txt")).unwrap()
    );
    assert!(is_whiteout(&m.local_diff("L1").join("usr/share")));
}

#[test]
fn rename_of_a_purely_local_dir_works() {
    let m = Mount::new();
    let d = m.diff("L1");
    fs::create_dir(d.join("mine")).unwrap();
    fs::write(d.join("mine/f"), "f").unwrap();
    let ino = fs::metadata(d.join("mine")).unwrap().ino();
    fs::rename(d.join("mine"), d.join("usr/yours")).unwrap();
    assert_eq!(names(&d.join("usr/yours")), vec!["f"]);
    assert_eq!(fs::metadata(d.join("usr/yours")).unwrap().ino(), ino);
    assert!(!d.join("mine").exists());
    assert!(
        fs::symlink_metadata(m.local_diff("L1").join("mine")).is_err(),
        "no whiteout needed"
    );
    assert!(m.local_diff("L1").join("usr/yours/f").is_file());
}

#[test]
fn a_local_dir_renamed_over_a_hidden_remote_dir_keeps_it_hidden() {
    let mut m = Mount::new();
    let d = m.diff("L1");
    fs::remove_dir_all(d.join("usr/share")).unwrap();
    fs::create_dir(d.join("mine")).unwrap();
    fs::write(d.join("mine/x"), "x").unwrap();
    fs::rename(d.join("mine"), d.join("usr/share")).unwrap();
    assert_eq!(names(&d.join("usr/share")), vec!["x"]);
    assert_eq!(
        errno_of(fs::metadata(d.join("usr/share/doc"))),
        libc::ENOENT
    );
    let local = m.local_diff("L1").join("usr/share");
    assert_eq!(xattr_get(&local, "trusted.overlay.opaque").unwrap(), b"y");
    m.remount(&Options::default());
    assert_eq!(names(&d.join("usr/share")), vec!["x"]);
}

#[test]
fn a_local_dir_renamed_over_an_empty_remote_dir_keeps_it_hidden() {
    let m = Mount::with(Options::default(), |remote| {
        let d = remote.join("overlay/RO").join(id("L1")).join("diff");
        fs::create_dir(d.join("empty")).unwrap();
    });
    let d = m.diff("L1");
    assert!(names(&d.join("empty")).is_empty());
    fs::create_dir(d.join("mine")).unwrap();
    fs::write(d.join("mine/x"), "x").unwrap();
    fs::rename(d.join("mine"), d.join("empty")).unwrap();
    assert_eq!(names(&d.join("empty")), vec!["x"]);
    assert_eq!(
        xattr_get(&m.local_diff("L1").join("empty"), "trusted.overlay.opaque").unwrap(),
        b"y"
    );
    // A non-empty remote dir cannot be replaced.
    fs::create_dir(d.join("other")).unwrap();
    assert_eq!(
        errno_of(fs::rename(d.join("other"), d.join("usr"))),
        libc::ENOTEMPTY
    );
}

#[test]
fn rename_of_a_remote_symlink() {
    let m = Mount::new();
    let d = m.diff("L1");
    fs::rename(d.join("lib"), d.join("lib64")).unwrap();
    assert_eq!(
        fs::read_link(d.join("lib64")).unwrap(),
        Path::new("usr/lib")
    );
    assert!(d.join("lib64/libfake.so").is_file());
    assert!(!d.join("lib").exists());
    assert!(is_whiteout(&m.local_diff("L1").join("lib")));
    assert!(fs::symlink_metadata(m.local_diff("L1").join("lib64"))
        .unwrap()
        .file_type()
        .is_symlink());
}

#[test]
fn rename_onto_itself_through_two_hard_links_does_nothing() {
    let m = Mount::new();
    let etc = m.diff("L1").join("etc");
    fs::hard_link(etc.join("passwd"), etc.join("passwd2")).unwrap();
    fs::rename(etc.join("passwd"), etc.join("passwd2")).unwrap();
    assert!(etc.join("passwd").exists() && etc.join("passwd2").exists());
}

// ---- hard links ----

#[test]
fn hard_link_of_a_remote_file() {
    let m = Mount::new();
    let etc = m.diff("L1").join("etc");
    let ino = fs::metadata(etc.join("passwd")).unwrap().ino();
    fs::hard_link(etc.join("passwd"), etc.join("passwd.link")).unwrap();
    let a = fs::metadata(etc.join("passwd")).unwrap();
    let b = fs::metadata(etc.join("passwd.link")).unwrap();
    assert_eq!(a.nlink(), 2);
    assert_eq!(b.nlink(), 2);
    assert_eq!(a.ino(), b.ino());
    assert_eq!(a.ino(), ino, "the number from before the copy-up");

    fs::OpenOptions::new()
        .append(true)
        .open(etc.join("passwd.link"))
        .unwrap()
        .write_all(b"via-link\n")
        .unwrap();
    let via_a = fs::read(etc.join("passwd")).unwrap();
    assert!(
        via_a.ends_with(b"via-link\n"),
        "a write through one name shows through the other"
    );
    assert_eq!(via_a, fs::read(etc.join("passwd.link")).unwrap());

    let local = m.local_diff("L1").join("etc");
    let la = fs::metadata(local.join("passwd")).unwrap();
    let lb = fs::metadata(local.join("passwd.link")).unwrap();
    assert_eq!((la.ino(), la.nlink()), (lb.ino(), 2));

    fs::remove_file(etc.join("passwd")).unwrap();
    assert!(!etc.join("passwd").exists());
    let b = fs::metadata(etc.join("passwd.link")).unwrap();
    assert_eq!(b.nlink(), 1);
    assert_eq!(b.ino(), ino);
    assert_eq!(fs::read(etc.join("passwd.link")).unwrap(), via_a);
    assert!(is_whiteout(&local.join("passwd")));
    assert_eq!(fs::metadata(local.join("passwd.link")).unwrap().nlink(), 1);
}

#[test]
fn hard_link_of_a_local_file_then_unlink_the_other_name() {
    let m = Mount::new();
    let d = m.diff("L1");
    fs::write(d.join("a"), "a").unwrap();
    fs::hard_link(d.join("a"), d.join("usr/b")).unwrap();
    assert_eq!(fs::metadata(d.join("usr/b")).unwrap().nlink(), 2);
    fs::remove_file(d.join("usr/b")).unwrap();
    assert_eq!(fs::metadata(d.join("a")).unwrap().nlink(), 1);
    fs::write(d.join("a"), "again").unwrap();
    assert_eq!(fs::read(d.join("a")).unwrap(), b"again");
}

#[test]
fn hard_link_onto_an_existing_name_is_eexist() {
    let m = Mount::new();
    let etc = m.diff("L1").join("etc");
    assert_eq!(
        errno_of(fs::hard_link(etc.join("passwd"), etc.join("hostname"))),
        libc::EEXIST
    );
    assert_eq!(
        errno_of(fs::hard_link(m.diff("L1").join("usr"), etc.join("usr"))),
        libc::EPERM
    );
}

/// Remote hard links are copied up one name at a time, which breaks the link: kernel
/// overlayfs does the same without `index=on`.
#[test]
fn remote_hard_links_break_on_copy_up_like_overlayfs_without_index() {
    let m = Mount::with(Options::default(), |remote| {
        let d = remote.join("overlay/RO").join(id("L1")).join("diff");
        fs::write(d.join("one"), "shared\n").unwrap();
        fs::hard_link(d.join("one"), d.join("two")).unwrap();
    });
    let d = m.diff("L1");
    assert_eq!(fs::metadata(d.join("one")).unwrap().nlink(), 2);
    fs::OpenOptions::new()
        .append(true)
        .open(d.join("one"))
        .unwrap()
        .write_all(b"more\n")
        .unwrap();
    assert_eq!(fs::read(d.join("one")).unwrap(), b"shared\nmore\n");
    assert_eq!(fs::read(d.join("two")).unwrap(), b"shared\n");
    let ino_two = fs::metadata(d.join("two")).unwrap().ino();
    drop_caches();
    assert_eq!(fs::read(d.join("one")).unwrap(), b"shared\nmore\n");
    assert_eq!(fs::read(d.join("two")).unwrap(), b"shared\n");
    assert_eq!(fs::metadata(d.join("two")).unwrap().ino(), ino_two);
    // Removing one name leaves the other intact.
    fs::remove_file(d.join("one")).unwrap();
    assert_eq!(fs::read(d.join("two")).unwrap(), b"shared\n");
    fs::write(d.join("two"), "own\n").unwrap();
    assert_eq!(fs::read(d.join("two")).unwrap(), b"own\n");
    assert!(is_whiteout(&m.local_diff("L1").join("one")));
    assert_eq!(fs::read(m.local_diff("L1").join("two")).unwrap(), b"own\n");
}
