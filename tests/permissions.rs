//! Permissions as the kernel enforces them for an unprivileged caller (uid/gid 65534), on
//! remote content and on what copy-up would produce (DESIGN §3 POSIX, §11).

mod common;

use std::fs;
use std::os::unix::fs::{lchown, MetadataExt, PermissionsExt};
use std::path::Path;

use common::*;

const NOBODY: u32 = 65534;

/// Owns everything below `dir` by root, so that "a root file" does not depend on who
/// checked the fixtures out.
fn chown_root(dir: &Path) {
    lchown(dir, Some(0), Some(0)).unwrap();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        lchown(&p, Some(0), Some(0)).unwrap();
        if fs::symlink_metadata(&p).unwrap().is_dir() {
            chown_root(&p);
        }
    }
}

fn set_mode(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

/// L1's diff gets: `secret` (0600), `pub/` (0777), `tmp/` (1777) holding `theirs`, owned
/// by uid 1000; everything else stays root-owned 0755/0644.
fn mount() -> Mount {
    Mount::with(Options::default(), |remote| {
        let diff = remote.join("overlay/RO").join(id("L1")).join("diff");
        fs::write(diff.join("secret"), b"root only\n").unwrap();
        fs::create_dir(diff.join("pub")).unwrap();
        fs::create_dir(diff.join("tmp")).unwrap();
        fs::write(diff.join("tmp/theirs"), b"not yours\n").unwrap();
        chown_root(&diff);
        set_mode(&diff.join("secret"), 0o600);
        set_mode(&diff.join("pub"), 0o777);
        set_mode(&diff.join("tmp"), 0o1777);
        lchown(diff.join("tmp/theirs"), Some(1000), Some(1000)).unwrap();
        set_mode(&diff.join("tmp/theirs"), 0o644);
    })
}

/// Runs `script` as nobody in the C locale, with `$D` set to `dir`.
fn nobody_in(dir: &Path, script: &str) -> (bool, String) {
    sh_as_nobody(&format!(
        "export LC_ALL=C; D='{}'; {script}",
        dir.to_str().expect("a UTF-8 temp path")
    ))
}

fn refused(dir: &Path, script: &str, message: &str) {
    let (ok, out) = nobody_in(dir, script);
    assert!(!ok, "`{script}` succeeded as nobody: {out}");
    assert!(
        out.contains(message),
        "`{script}` failed, but not with \"{message}\": {out}"
    );
}

fn allowed(dir: &Path, script: &str) -> String {
    let (ok, out) = nobody_in(dir, script);
    assert!(ok, "`{script}` failed as nobody: {out}");
    out
}

#[test]
fn reading_a_private_root_file_is_refused() {
    let m = mount();
    let d = m.diff("L1");
    refused(&d, r#"cat "$D/secret""#, "Permission denied");
    // Root may, and nobody may read what is world-readable.
    assert_eq!(fs::read(d.join("secret")).unwrap(), b"root only\n");
    assert_eq!(
        allowed(&d, r#"cat "$D/etc/hostname""#).as_bytes(),
        fs::read(m.remote_diff("L1").join("etc/hostname")).unwrap()
    );
}

#[test]
fn writing_into_a_root_dir_is_refused() {
    let m = mount();
    let d = m.diff("L1");
    refused(&d, r#"echo x > "$D/etc/new""#, "Permission denied");
    refused(&d, r#"mkdir "$D/etc/newdir""#, "Permission denied");
    refused(&d, r#"rm -f "$D/etc/hostname""#, "Permission denied");
    refused(
        &d,
        r#"mv "$D/etc/passwd" "$D/etc/passwd2""#,
        "Permission denied",
    );
    assert!(fs::symlink_metadata(d.join("etc/new")).is_err());
    assert!(fs::symlink_metadata(d.join("etc/newdir")).is_err());
    assert!(fs::metadata(d.join("etc/hostname")).is_ok());
    assert!(fs::metadata(d.join("etc/passwd")).is_ok());
    // Nothing was written for the refused calls: no entries, no whiteouts.
    let local_etc = m.local_diff("L1").join("etc");
    if local_etc.exists() {
        assert!(names(&local_etc).is_empty(), "{:?}", names(&local_etc));
    }
}

#[test]
fn a_world_writable_dir_takes_files_owned_by_the_caller() {
    let m = mount();
    let d = m.diff("L1");
    allowed(
        &d,
        r#"echo hi > "$D/pub/f" && mkdir "$D/pub/d" && ln -s f "$D/pub/s""#,
    );
    for name in ["f", "d", "s"] {
        let view = fs::symlink_metadata(d.join("pub").join(name)).unwrap();
        assert_eq!((view.uid(), view.gid()), (NOBODY, NOBODY), "view {name}");
        let local = fs::symlink_metadata(m.local_diff("L1").join("pub").join(name)).unwrap();
        assert_eq!((local.uid(), local.gid()), (NOBODY, NOBODY), "local {name}");
    }
    assert_eq!(fs::read(m.local_diff("L1").join("pub/f")).unwrap(), b"hi\n");
    // The copied-up parent keeps its owner and mode.
    let parent = fs::metadata(m.local_diff("L1").join("pub")).unwrap();
    assert_eq!((parent.uid(), parent.mode() & 0o7777), (0, 0o777));
    // And nobody can use what it made.
    allowed(
        &d,
        r#"echo more >> "$D/pub/f" && rm "$D/pub/s" && rmdir "$D/pub/d""#,
    );
    assert_eq!(fs::read(d.join("pub/f")).unwrap(), b"hi\nmore\n");
}

#[test]
fn a_sticky_dir_protects_other_users_files() {
    let m = mount();
    let d = m.diff("L1");
    refused(&d, r#"rm -f "$D/tmp/theirs""#, "Operation not permitted");
    refused(
        &d,
        r#"mv "$D/tmp/theirs" "$D/tmp/mine""#,
        "Operation not permitted",
    );
    assert_eq!(fs::read(d.join("tmp/theirs")).unwrap(), b"not yours\n");
    let local_theirs = m.local_diff("L1").join("tmp/theirs");
    assert!(
        fs::symlink_metadata(&local_theirs).is_err(),
        "a refused unlink left {}",
        local_theirs.display()
    );
    // Its own files there it may delete.
    allowed(&d, r#"echo x > "$D/tmp/own" && rm "$D/tmp/own""#);
    assert!(fs::symlink_metadata(d.join("tmp/own")).is_err());
}

#[test]
fn chmod_and_chown_are_for_owners_and_root() {
    let m = mount();
    let d = m.diff("L1");
    refused(
        &d,
        r#"chmod 666 "$D/etc/passwd""#,
        "Operation not permitted",
    );
    refused(
        &d,
        r#"chmod 666 "$D/tmp/theirs""#,
        "Operation not permitted",
    );
    refused(
        &d,
        r#"chown 65534 "$D/etc/passwd""#,
        "Operation not permitted",
    );
    let meta = fs::metadata(d.join("etc/passwd")).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o644));
    assert_eq!(fs::metadata(d.join("tmp/theirs")).unwrap().uid(), 1000);
    // On its own file, chmod works but giving it away does not.
    allowed(&d, r#"echo x > "$D/pub/own" && chmod 600 "$D/pub/own""#);
    refused(&d, r#"chown 0 "$D/pub/own""#, "Operation not permitted");
    refused(&d, r#"chgrp 0 "$D/pub/own""#, "Operation not permitted");
    let own = fs::metadata(d.join("pub/own")).unwrap();
    assert_eq!(
        (own.uid(), own.gid(), own.mode() & 0o7777),
        (NOBODY, NOBODY, 0o600)
    );
    // Nothing of the refused calls reached local.
    assert!(fs::symlink_metadata(m.local_diff("L1").join("etc/passwd")).is_err());
    assert!(fs::symlink_metadata(m.local_diff("L1").join("tmp/theirs")).is_err());
}

#[test]
fn copy_up_is_no_way_around_permissions() {
    let m = mount();
    let d = m.diff("L1");
    let before = fs::read(d.join("etc/hostname")).unwrap();
    refused(&d, r#"echo x >> "$D/etc/hostname""#, "Permission denied");
    refused(&d, r#": > "$D/etc/hostname""#, "Permission denied");
    refused(&d, r#"touch "$D/etc/hostname""#, "Permission denied");
    refused(&d, r#"cat "$D/secret" > /dev/null"#, "Permission denied");
    refused(&d, r#"echo x >> "$D/tmp/theirs""#, "Permission denied");
    assert_eq!(fs::read(d.join("etc/hostname")).unwrap(), before);
    for rel in ["etc/hostname", "secret", "tmp/theirs"] {
        let p = m.local_diff("L1").join(rel);
        assert!(
            fs::symlink_metadata(&p).is_err(),
            "a refused write copied up {}",
            p.display()
        );
    }
}
