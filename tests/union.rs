//! Union semantics on a real mount: lookup order, merged listings, whiteouts and opaque
//! directories, the synthesized layout as a writable tree, errors and remount persistence.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use common::*;
use nix::sys::stat::{makedev, SFlag};

// ---- lookup order and merged readdir ----

#[test]
fn remote_file_shows_through() {
    let m = Mount::new();
    let d = m.diff("L1");
    assert_eq!(fs::read(d.join("etc/hostname")).unwrap(), b"fixture-base\n");
    assert_eq!(
        names(&d),
        vec!["bin", "etc", "lib", "usr"],
        "the layer root lists its remote entries"
    );
    // Reading does not create anything in local.
    assert!(!m.local_diff("L1").join("etc").exists());
}

#[test]
fn local_file_shadows_the_remote_one() {
    let m = Mount::with(Options::default(), |remote| {
        let local = diff_in(&local_beside(remote), "L1").join("etc");
        fs::create_dir_all(&local).unwrap();
        fs::write(local.join("hostname"), "from-local\n").unwrap();
    });
    let d = m.diff("L1");
    assert_eq!(fs::read(d.join("etc/hostname")).unwrap(), b"from-local\n");
    // Listed once, with the remote siblings still there.
    assert_eq!(
        names(&d.join("etc")),
        vec!["hostname", "os-release", "passwd"]
    );
}

#[test]
fn directories_in_both_trees_merge() {
    let m = Mount::new();
    let etc = m.diff("L1").join("etc");
    fs::write(etc.join("new.conf"), "x=1\n").unwrap();
    assert_eq!(
        names(&etc),
        vec!["hostname", "new.conf", "os-release", "passwd"]
    );
    // Only the new file is in local; the remote ones were not copied.
    assert_eq!(names(&m.local_diff("L1").join("etc")), vec!["new.conf"]);
    assert_eq!(
        fs::read(etc.join("passwd")).unwrap(),
        fs::read(m.remote_diff("L1").join("etc/passwd")).unwrap()
    );
}

#[test]
fn readdir_reports_every_type_and_the_dots() {
    let m = Mount::with(Options::default(), |remote| {
        let d = diff_in(remote, "L1").join("types");
        fs::create_dir(&d).unwrap();
        fs::write(d.join("r-file"), "f").unwrap();
        fs::create_dir(d.join("r-dir")).unwrap();
        std::os::unix::fs::symlink("r-file", d.join("r-link")).unwrap();
        mkfifo(&d.join("r-fifo"));
        mknod(&d.join("r-chr"), SFlag::S_IFCHR, 0o644, makedev(1, 3));
        mknod(&d.join("r-blk"), SFlag::S_IFBLK, 0o644, makedev(7, 0));
        // A socket inode without a listener (bind(2) paths are too short for temp dirs).
        mknod(&d.join("r-sock"), SFlag::S_IFSOCK, 0o644, 0);
    });
    let d = m.diff("L1").join("types");
    fs::write(d.join("l-file"), "f").unwrap();
    fs::create_dir(d.join("l-dir")).unwrap();
    std::os::unix::fs::symlink("l-file", d.join("l-link")).unwrap();
    mkfifo(&d.join("l-fifo"));
    mknod(&d.join("l-chr"), SFlag::S_IFCHR, 0o644, makedev(1, 5));

    use nix::dir::Type;
    let want: BTreeMap<&str, Type> = [
        (".", Type::Directory),
        ("..", Type::Directory),
        ("r-file", Type::File),
        ("r-dir", Type::Directory),
        ("r-link", Type::Symlink),
        ("r-fifo", Type::Fifo),
        ("r-chr", Type::CharacterDevice),
        ("r-blk", Type::BlockDevice),
        ("r-sock", Type::Socket),
        ("l-file", Type::File),
        ("l-dir", Type::Directory),
        ("l-link", Type::Symlink),
        ("l-fifo", Type::Fifo),
        ("l-chr", Type::CharacterDevice),
    ]
    .into_iter()
    .collect();
    let got = raw_dtypes(&d);
    assert_eq!(got.len(), want.len(), "entries: {got:?}");
    for (name, t) in &want {
        assert_eq!(got.get(*name), Some(&Some(*t)), "d_type of {name}");
    }
    // The stat'ed type agrees with d_type.
    let md = fs::symlink_metadata(d.join("r-sock")).unwrap();
    assert!(md.file_type().is_socket());
    let md = fs::symlink_metadata(d.join("r-chr")).unwrap();
    assert!(md.file_type().is_char_device());
    assert_eq!(md.rdev(), makedev(1, 3));
    // The layout's own dirs too.
    for dir in [
        m.mnt.clone(),
        m.path("overlay"),
        m.path("overlay/l"),
        m.path("overlay/RO"),
    ] {
        for (name, t) in raw_dtypes(&dir) {
            assert!(t.is_some(), "DT_UNKNOWN for {name} in {}", dir.display());
        }
    }
}

#[test]
fn dot_dot_of_a_remote_dir_is_its_parent() {
    let m = Mount::new();
    let d = m.diff("L1");
    let up = fs::metadata(d.join("usr/share/doc/..")).unwrap();
    assert_eq!(up.ino(), fs::metadata(d.join("usr/share")).unwrap().ino());
}

// ---- whiteouts and opaque directories ----

#[test]
fn unlink_of_a_remote_file_leaves_a_whiteout() {
    let m = Mount::new();
    let etc = m.diff("L1").join("etc");
    fs::remove_file(etc.join("hostname")).unwrap();
    assert_eq!(
        errno_of(fs::symlink_metadata(etc.join("hostname"))),
        libc::ENOENT
    );
    assert_eq!(names(&etc), vec!["os-release", "passwd"]);
    let wh = m.local_diff("L1").join("etc/hostname");
    assert!(is_whiteout(&wh), "local holds a 0/0 char device");
    // The local dir is otherwise empty: no temporaries.
    assert_eq!(names(&m.local_diff("L1").join("etc")), vec!["hostname"]);
    assert!(m.remote_diff("L1").join("etc/hostname").exists());
    // Unlinking again fails like any missing name.
    assert_eq!(
        errno_of(fs::remove_file(etc.join("hostname"))),
        libc::ENOENT
    );
}

#[test]
fn unlink_of_a_copied_up_file_leaves_a_whiteout() {
    let m = Mount::new();
    let f = m.diff("L1").join("etc/passwd");
    fs::OpenOptions::new().append(true).open(&f).unwrap();
    fs::write(&f, "changed\n").unwrap();
    fs::remove_file(&f).unwrap();
    assert!(!f.exists());
    assert!(is_whiteout(&m.local_diff("L1").join("etc/passwd")));
    assert_no_temp_names(&m.local);
}

#[test]
fn unlink_of_a_local_only_file_leaves_nothing() {
    let m = Mount::new();
    let f = m.diff("L1").join("etc/mine");
    fs::write(&f, "x").unwrap();
    fs::remove_file(&f).unwrap();
    assert!(!m.local_diff("L1").join("etc/mine").exists());
    assert!(fs::symlink_metadata(m.local_diff("L1").join("etc/mine")).is_err());
}

#[test]
fn rm_rf_of_a_remote_dir_leaves_one_whiteout() {
    let m = Mount::new();
    let share = m.diff("L1").join("usr/share");
    fs::remove_dir_all(&share).unwrap();
    assert!(!share.exists());
    assert_eq!(names(&m.diff("L1").join("usr")), vec!["lib"]);
    let local_share = m.local_diff("L1").join("usr/share");
    assert!(
        is_whiteout(&local_share),
        "usr/share is a whiteout in local"
    );
    assert_eq!(names(&m.local_diff("L1").join("usr")), vec!["share"]);
    assert!(m
        .remote_diff("L1")
        .join("usr/share/doc/readme.txt")
        .exists());
}

#[test]
fn mkdir_over_a_deleted_remote_dir_is_empty_and_opaque() {
    let m = Mount::new();
    let share = m.diff("L1").join("usr/share");
    fs::remove_dir_all(&share).unwrap();
    fs::create_dir(&share).unwrap();
    assert!(names(&share).is_empty(), "the remote contents stay hidden");
    assert_eq!(errno_of(fs::metadata(share.join("doc"))), libc::ENOENT);
    let local_share = m.local_diff("L1").join("usr/share");
    assert!(fs::symlink_metadata(&local_share).unwrap().is_dir());
    assert_eq!(
        xattr_get(&local_share, "trusted.overlay.opaque").unwrap(),
        b"y"
    );
    // The marker is ours: the view does not show it.
    assert!(!xattr_list(&share)
        .unwrap()
        .iter()
        .any(|n| n.contains("overlay")));
    assert_eq!(
        errno_of(xattr_get(&share, "trusted.overlay.opaque")),
        libc::ENODATA
    );
    // New entries in it are fine, and the remote never comes back.
    fs::write(share.join("new"), "n").unwrap();
    assert_eq!(names(&share), vec!["new"]);
}

#[test]
fn mkdir_where_a_remote_file_was_deleted() {
    let m = Mount::new();
    let p = m.diff("L1").join("etc/hostname");
    fs::remove_file(&p).unwrap();
    fs::create_dir(&p).unwrap();
    assert!(fs::metadata(&p).unwrap().is_dir());
    assert!(names(&p).is_empty());
    assert!(
        fs::symlink_metadata(m.local_diff("L1").join("etc/hostname"))
            .unwrap()
            .is_dir()
    );
}

#[test]
fn rmdir_of_a_non_empty_merged_dir_is_enotempty() {
    let m = Mount::new();
    let d = m.diff("L1");
    fs::write(d.join("etc/new"), "n").unwrap();
    assert_eq!(errno_of(fs::remove_dir(d.join("etc"))), libc::ENOTEMPTY);
    assert_eq!(errno_of(fs::remove_dir(d.join("usr"))), libc::ENOTEMPTY);
    // A merged dir whose remote entries are all deleted and local ones removed is empty.
    for n in ["new", "hostname", "os-release", "passwd"] {
        fs::remove_file(d.join("etc").join(n)).unwrap();
    }
    assert!(names(&d.join("etc")).is_empty());
    fs::remove_dir(d.join("etc")).unwrap();
    assert!(!d.join("etc").exists());
    assert!(is_whiteout(&m.local_diff("L1").join("etc")));
}

#[test]
fn rmdir_of_a_local_dir_holding_only_whiteouts_and_remote_below() {
    let m = Mount::new();
    let doc = m.diff("L1").join("usr/share/doc");
    fs::remove_file(doc.join("readme.txt")).unwrap();
    fs::remove_dir(&doc).unwrap();
    assert!(is_whiteout(&m.local_diff("L1").join("usr/share/doc")));
    // Recreate it: opaque, empty.
    fs::create_dir(&doc).unwrap();
    assert!(names(&doc).is_empty());
    assert_eq!(
        xattr_get(
            &m.local_diff("L1").join("usr/share/doc"),
            "trusted.overlay.opaque"
        )
        .unwrap(),
        b"y"
    );
}

#[test]
fn a_file_recreated_over_a_whiteout_shows_new_content() {
    let m = Mount::new();
    let p = m.diff("L1").join("etc/hostname");
    fs::remove_file(&p).unwrap();
    fs::write(&p, "again\n").unwrap();
    assert_eq!(fs::read(&p).unwrap(), b"again\n");
    let local = m.local_diff("L1").join("etc/hostname");
    assert!(fs::symlink_metadata(&local).unwrap().is_file());
    assert_eq!(fs::read(&local).unwrap(), b"again\n");
    assert_eq!(
        names(&m.diff("L1").join("etc")),
        vec!["hostname", "os-release", "passwd"]
    );
}

#[test]
fn whiteouts_prepared_in_local_hide_remote_entries() {
    let m = Mount::with(Options::default(), |remote| {
        let etc = diff_in(&local_beside(remote), "L1").join("etc");
        fs::create_dir_all(&etc).unwrap();
        mknod(&etc.join("passwd"), SFlag::S_IFCHR, 0, 0);
        let usr = etc.parent().unwrap().join("usr");
        fs::create_dir_all(usr.join("share")).unwrap();
        xattr_set(&usr.join("share"), "trusted.overlay.opaque", b"y").unwrap();
        fs::write(usr.join("share/mine"), "m").unwrap();
    });
    let d = m.diff("L1");
    assert_eq!(names(&d.join("etc")), vec!["hostname", "os-release"]);
    assert_eq!(errno_of(fs::metadata(d.join("etc/passwd"))), libc::ENOENT);
    assert_eq!(names(&d.join("usr/share")), vec!["mine"]);
    assert_eq!(names(&d.join("usr")), vec!["lib", "share"]);
}

/// In a directory nothing below merges with (one only local holds, an opaque one), a new
/// entry is made without asking local first; a whiteout left under its name is replaced,
/// whatever the entry's kind.
#[test]
fn names_whiteouts_hold_in_directories_only_local_has_are_made_again() {
    let m = Mount::with(Options::default(), |remote| {
        let diff = diff_in(&local_beside(remote), "L1");
        let solo = diff.join("solo");
        fs::create_dir_all(&solo).unwrap();
        for name in ["f", "d", "l", "p"] {
            mknod(&solo.join(name), SFlag::S_IFCHR, 0, 0);
        }
        let share = diff.join("usr/share");
        fs::create_dir_all(&share).unwrap();
        xattr_set(&share, "trusted.overlay.opaque", b"y").unwrap();
        mknod(&share.join("gone"), SFlag::S_IFCHR, 0, 0);
    });
    let d = m.diff("L1");
    let solo = d.join("solo");
    assert_eq!(names(&solo), Vec::<String>::new(), "whiteouts list nothing");

    fs::write(solo.join("f"), "file\n").unwrap();
    fs::create_dir(solo.join("d")).unwrap();
    std::os::unix::fs::symlink("f", solo.join("l")).unwrap();
    mkfifo(&solo.join("p"));
    fs::write(d.join("usr/share/gone"), "back\n").unwrap();
    // A name free in local is made at once, beside them.
    fs::write(solo.join("new"), "new\n").unwrap();

    assert_eq!(names(&solo), vec!["d", "f", "l", "new", "p"]);
    assert_eq!(fs::read(solo.join("l")).unwrap(), b"file\n");
    assert_eq!(fs::read(d.join("usr/share/gone")).unwrap(), b"back\n");
    let local = m.local_diff("L1");
    let kind = |rel: &str| fs::symlink_metadata(local.join(rel)).unwrap().file_type();
    assert!(kind("solo/f").is_file());
    assert!(kind("solo/d").is_dir());
    assert!(kind("solo/l").is_symlink());
    assert!(kind("solo/p").is_fifo());
    assert!(kind("usr/share/gone").is_file());
    assert_no_temp_names(&local);
}

// ---- the synthesized layout as a writable tree ----

#[test]
fn deleting_a_synthesized_link_hides_it_locally() {
    let m = Mount::new();
    let l1 = id("L1");
    let link = m.path("overlay").join(&l1);
    assert!(is_symlink(&link));
    fs::remove_file(&link).unwrap();
    assert_eq!(errno_of(fs::symlink_metadata(&link)), libc::ENOENT);
    assert!(!names(&m.path("overlay")).contains(&l1));
    assert!(is_whiteout(&m.local.join("overlay").join(&l1)));
    // The layer itself is still there.
    assert!(m.diff("L1").join("etc/hostname").exists());

    let short = m.path("overlay/l").join(short("L1"));
    fs::remove_file(&short).unwrap();
    assert!(!names(&m.path("overlay/l")).contains(&common::short("L1")));
    assert!(is_whiteout(
        &m.local.join("overlay/l").join(common::short("L1"))
    ));
}

#[test]
fn a_symlink_named_like_a_synthesized_one_is_eexist() {
    let m = Mount::new();
    let l1 = id("L1");
    let target = m.mnt.join("overlay/RO").join(&l1);
    assert_eq!(
        errno_of(std::os::unix::fs::symlink(
            &target,
            m.path("overlay").join(&l1)
        )),
        libc::EEXIST
    );
    assert_eq!(
        errno_of(std::os::unix::fs::symlink(
            format!("../{l1}/diff"),
            m.path("overlay/l").join(short("L1"))
        )),
        libc::EEXIST
    );
    assert!(!m.local.join("overlay").join(&l1).exists());
    // After deleting it, the name can be made again, and is then a local symlink.
    fs::remove_file(m.path("overlay").join(&l1)).unwrap();
    std::os::unix::fs::symlink("RO/elsewhere", m.path("overlay").join(&l1)).unwrap();
    assert_eq!(
        fs::read_link(m.path("overlay").join(&l1)).unwrap(),
        Path::new("RO/elsewhere")
    );
    assert_eq!(
        fs::read_link(m.local.join("overlay").join(&l1)).unwrap(),
        Path::new("RO/elsewhere")
    );
}

#[test]
fn a_local_entry_wins_over_a_synthesized_link() {
    let l1 = id("L1");
    let m = Mount::with(Options::default(), |remote| {
        let o = local_beside(remote).join("overlay");
        fs::create_dir_all(o.join("l")).unwrap();
        std::os::unix::fs::symlink("RO/local-choice", o.join(id("L1"))).unwrap();
        fs::create_dir(o.join("l").join(short("L1"))).unwrap();
    });
    assert_eq!(
        fs::read_link(m.path("overlay").join(&l1)).unwrap(),
        Path::new("RO/local-choice")
    );
    let listed = names(&m.path("overlay"));
    assert_eq!(
        listed.iter().filter(|n| **n == l1).count(),
        1,
        "listed once"
    );
    let short_path = m.path("overlay/l").join(short("L1"));
    assert!(fs::symlink_metadata(&short_path).unwrap().is_dir());
    assert_eq!(dtypes(&m.path("overlay/l"))[&short("L1")], "dir");
}

#[test]
fn synthesized_links_are_symlinks_to_the_layer() {
    let m = Mount::new();
    let l1 = id("L1");
    let link = m.path("overlay").join(&l1);
    assert!(is_symlink(&link));
    assert!(fs::metadata(&link).unwrap().is_dir());
    assert_eq!(dtypes(&m.path("overlay"))[&l1], "link");
    assert_eq!(dtypes(&m.path("overlay/RO"))[&l1], "dir");
    let short_link = m.path("overlay/l").join(short("L1"));
    assert_eq!(
        fs::read_link(&short_link).unwrap(),
        Path::new(&format!("../{l1}/diff"))
    );
    assert_eq!(
        fs::read(short_link.join("etc/hostname")).unwrap(),
        b"fixture-base\n"
    );
}

#[test]
fn writing_through_a_short_link_copies_up_into_the_ro_layer_dir() {
    let m = Mount::new();
    let p = m.path("overlay/l").join(short("L1")).join("etc/hostname");
    fs::write(&p, "via-link\n").unwrap();
    assert_eq!(
        fs::read(m.diff("L1").join("etc/hostname")).unwrap(),
        b"via-link\n"
    );
    assert_eq!(
        fs::read(m.local_diff("L1").join("etc/hostname")).unwrap(),
        b"via-link\n"
    );
    // The links themselves were not copied up.
    assert!(!m.local.join("overlay/l").exists() || names(&m.local.join("overlay/l")).is_empty());
    assert!(fs::symlink_metadata(m.local.join("overlay").join(id("L1"))).is_err());
}

#[test]
fn remote_layer_metadata_can_be_changed_locally() {
    let m = Mount::new();
    let l1 = id("L1");
    let json = m.path("overlay-layers/RO").join(&l1).join("layer.json");
    let before = fs::read(&json).unwrap();
    fs::write(&json, b"{}").unwrap();
    assert_eq!(fs::read(&json).unwrap(), b"{}");
    assert_eq!(
        fs::read(
            m.local
                .join("overlay-layers/RO")
                .join(&l1)
                .join("layer.json")
        )
        .unwrap(),
        b"{}"
    );
    assert_eq!(
        fs::read(
            m.remote
                .join("overlay-layers/RO")
                .join(&l1)
                .join("layer.json")
        )
        .unwrap(),
        before
    );
}

#[test]
fn runtime_writes_outside_the_shared_areas_land_in_local() {
    let m = Mount::new();
    fs::create_dir_all(m.path("overlay-containers/abc")).unwrap();
    fs::write(m.path("overlay-containers/abc/config.json"), "{}").unwrap();
    assert!(m.local.join("overlay-containers/abc/config.json").is_file());
    // The writer's own container dirs never show.
    assert_eq!(names(&m.path("overlay-containers")), vec!["abc"]);
}

// ---- errors ----

#[test]
fn missing_paths_are_enoent() {
    let m = Mount::new();
    let d = m.diff("L1");
    assert_eq!(errno_of(fs::metadata(d.join("nope"))), libc::ENOENT);
    assert_eq!(errno_of(fs::metadata(d.join("nope/deeper"))), libc::ENOENT);
    assert_eq!(
        errno_of(fs::metadata(m.path("overlay/RO/not-a-layer"))),
        libc::ENOENT
    );
    assert_eq!(
        errno_of(fs::metadata(m.path("overlay").join(id("L5")))),
        libc::ENOENT
    );
    assert_eq!(errno_of(fs::remove_file(d.join("nope"))), libc::ENOENT);
    assert_eq!(errno_of(fs::remove_dir(d.join("nope"))), libc::ENOENT);
}

#[test]
fn a_file_used_as_a_dir_is_enotdir() {
    let m = Mount::new();
    let d = m.diff("L1");
    assert_eq!(
        errno_of(fs::metadata(d.join("etc/hostname/x"))),
        libc::ENOTDIR
    );
    assert_eq!(
        errno_of(fs::write(d.join("etc/hostname/x"), "x")),
        libc::ENOTDIR
    );
    assert_eq!(
        errno_of(fs::create_dir(d.join("etc/hostname/x"))),
        libc::ENOTDIR
    );
    assert_eq!(
        errno_of(fs::read_dir(d.join("etc/hostname"))),
        libc::ENOTDIR
    );
    assert_eq!(
        errno_of(fs::remove_dir(d.join("etc/hostname"))),
        libc::ENOTDIR
    );
    assert_eq!(errno_of(fs::remove_file(d.join("etc"))), libc::EISDIR);
}

#[test]
fn names_over_255_bytes_are_enametoolong() {
    let m = Mount::new();
    let d = m.diff("L1");
    let long = "a".repeat(256);
    assert_eq!(errno_of(fs::metadata(d.join(&long))), libc::ENAMETOOLONG);
    assert_eq!(errno_of(fs::write(d.join(&long), "x")), libc::ENAMETOOLONG);
    assert_eq!(errno_of(fs::create_dir(d.join(&long))), libc::ENAMETOOLONG);
    // 255 is fine.
    let ok = "b".repeat(255);
    fs::write(d.join(&ok), "x").unwrap();
    assert_eq!(fs::read(d.join(&ok)).unwrap(), b"x");
}

#[test]
fn our_temporary_names_cannot_be_created_or_seen() {
    // The view's temporary names carry a tag of its local tree (its root's inode number), so
    // that another layerfs keeping its local inside this view has names of its own.
    let mut ours = String::new();
    let m = Mount::with(Options::default(), |remote| {
        let local = local_beside(remote);
        ours = format!(".layerfs-tmp.{:x}.", fs::metadata(&local).unwrap().ino());
        let etc = diff_in(&local, "L1").join("etc");
        fs::create_dir_all(&etc).unwrap();
        fs::write(etc.join(format!("{ours}left-over")), "half").unwrap();
    });
    let etc = m.diff("L1").join("etc");
    assert!(fs::write(etc.join(format!("{ours}x")), "x").is_err());
    assert!(fs::create_dir(etc.join(format!("{ours}y"))).is_err());
    assert!(std::os::unix::fs::symlink("t", etc.join(format!("{ours}z"))).is_err());
    assert_eq!(names(&etc), vec!["hostname", "os-release", "passwd"]);
    assert_eq!(
        errno_of(fs::metadata(etc.join(format!("{ours}left-over")))),
        libc::ENOENT
    );
    // Nothing new landed in local.
    assert_eq!(
        names(&m.local_diff("L1").join("etc")),
        vec![format!("{ours}left-over")]
    );
    // Another tree's temporary names are ordinary ones here.
    fs::write(etc.join(".layerfs-tmp.zz.1"), "theirs").unwrap();
    assert_eq!(fs::read(etc.join(".layerfs-tmp.zz.1")).unwrap(), b"theirs");
    // The mount still works.
    fs::write(etc.join("ok"), "ok").unwrap();
}

// ---- remount persistence ----

#[test]
fn changes_survive_a_remount() {
    let mut m = Mount::new();
    let d = m.diff("L1");
    fs::OpenOptions::new()
        .append(true)
        .open(d.join("etc/passwd"))
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"extra:x:1:1::/:/bin/sh\n"))
        .unwrap();
    let passwd = fs::read(d.join("etc/passwd")).unwrap();
    fs::remove_file(d.join("etc/hostname")).unwrap();
    fs::write(d.join("etc/new"), "new\n").unwrap();
    fs::remove_dir_all(d.join("usr/share")).unwrap();
    fs::create_dir(d.join("usr/share")).unwrap();
    fs::write(d.join("usr/share/fresh"), "f").unwrap();
    fs::rename(d.join("etc/os-release"), d.join("etc/os-release.old")).unwrap();
    fs::set_permissions(d.join("bin/hello"), fs::Permissions::from_mode(0o700)).unwrap();
    fs::remove_file(m.path("overlay").join(id("L2"))).unwrap();
    let ino = fs::metadata(d.join("etc/passwd")).unwrap().ino();
    let _ = ino;

    m.remount(&Options::default());

    assert_eq!(fs::read(d.join("etc/passwd")).unwrap(), passwd);
    assert_eq!(
        names(&d.join("etc")),
        vec!["new", "os-release.old", "passwd"]
    );
    assert_eq!(names(&d.join("usr/share")), vec!["fresh"]);
    assert_eq!(names(&d.join("usr")), vec!["lib", "share"]);
    assert_eq!(
        fs::metadata(d.join("bin/hello")).unwrap().mode() & 0o7777,
        0o700
    );
    assert!(!names(&m.path("overlay")).contains(&id("L2")));
    assert!(names(&m.path("overlay")).contains(&id("L1")));
    assert_no_temp_names(&m.local);
}

#[test]
fn rmdir_of_an_opaque_dir_over_a_remote_one_leaves_a_whiteout() {
    let m = Mount::new();
    let share = m.diff("L1").join("usr/share");
    fs::remove_dir_all(&share).unwrap();
    fs::create_dir(&share).unwrap();
    fs::remove_dir(&share).unwrap();
    assert!(!share.exists());
    assert!(is_whiteout(&m.local_diff("L1").join("usr/share")));
    assert_eq!(names(&m.diff("L1").join("usr")), vec!["lib"]);
}
