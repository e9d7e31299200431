//! The synthesized iSulad remote-RO layout (DESIGN §4.2), checked against
//! `fixtures/expected.json` through a real mount.

mod common;

use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use common::*;

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .expect("a JSON array")
        .iter()
        .map(|s| s.as_str().expect("a string").to_owned())
        .collect()
}

fn ready_layers() -> Vec<String> {
    let mut v = strings(&expected()["ready_layers"]);
    v.sort();
    v
}

fn ready_images() -> Vec<String> {
    let mut v = strings(&expected()["ready_images"]);
    v.sort();
    v
}

fn ready_shorts() -> Vec<String> {
    let e = expected();
    let mut v: Vec<String> = ready_layers()
        .iter()
        .map(|id| e["layer_shorts"][id].as_str().unwrap().to_owned())
        .collect();
    v.sort();
    v
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

fn with_extra(mut v: Vec<String>, extra: &[&str]) -> Vec<String> {
    v.extend(extra.iter().map(|s| s.to_string()));
    sorted(v)
}

fn enoent(path: &Path) {
    match fs::symlink_metadata(path) {
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{}", path.display()),
        Ok(m) => panic!(
            "{} should not exist, but is {:?}",
            path.display(),
            m.file_type()
        ),
    }
}

fn is_link_to_dir(path: &Path) {
    let l = fs::symlink_metadata(path).unwrap_or_else(|e| panic!("lstat {}: {e}", path.display()));
    assert!(
        l.file_type().is_symlink(),
        "{} is not a symlink",
        path.display()
    );
    let s = fs::metadata(path).unwrap_or_else(|e| panic!("stat {}: {e}", path.display()));
    assert!(
        s.is_dir(),
        "{} does not lead to a directory",
        path.display()
    );
}

/// Every regular file below `dir`, relative, sorted (symlinks not followed).
fn files_below(dir: &Path) -> Vec<PathBuf> {
    fn go(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                go(root, &p, out);
            } else if m.is_file() {
                out.push(p.strip_prefix(root).unwrap().to_owned());
            }
        }
    }
    let mut out = Vec::new();
    go(dir, dir, &mut out);
    out.sort();
    out
}

/// The listings of every layout directory hold exactly the ready objects.
#[test]
fn listings_hold_exactly_the_ready_objects() {
    let m = Mount::new();
    assert_eq!(
        names(&m.mnt),
        vec!["overlay", "overlay-images", "overlay-layers"]
    );
    assert_eq!(
        names(&m.path("overlay")),
        with_extra(ready_layers(), &["RO", "l"])
    );
    assert_eq!(names(&m.path("overlay/RO")), ready_layers());
    assert_eq!(names(&m.path("overlay/l")), ready_shorts());
    assert_eq!(
        names(&m.path("overlay-layers")),
        with_extra(ready_layers(), &["RO"])
    );
    assert_eq!(names(&m.path("overlay-layers/RO")), ready_layers());
    assert_eq!(names(&m.path("overlay-images")), ready_images());
}

#[test]
fn readdir_types_are_links_and_dirs() {
    let m = Mount::new();
    for name in ["overlay", "overlay-images", "overlay-layers"] {
        assert_eq!(dtypes(&m.mnt)[name], "dir");
    }
    for dir in ["overlay", "overlay-layers"] {
        let t = dtypes(&m.path(dir));
        for id in ready_layers() {
            assert_eq!(t[&id], "link", "{dir}/{id}");
        }
        assert_eq!(t["RO"], "dir");
        let ro = dtypes(&m.path(dir).join("RO"));
        for id in ready_layers() {
            assert_eq!(ro[&id], "dir", "{dir}/RO/{id}");
        }
    }
    assert_eq!(dtypes(&m.path("overlay"))["l"], "dir");
    for (short, t) in dtypes(&m.path("overlay/l")) {
        assert_eq!(t, "link", "overlay/l/{short}");
    }
    for (image, t) in dtypes(&m.path("overlay-images")) {
        assert_eq!(t, "dir", "overlay-images/{image}");
    }
    let diff = dtypes(&m.diff("L1"));
    assert_eq!(diff["lib"], "link");
    assert_eq!(diff["etc"], "dir");
    assert_eq!(dtypes(&m.diff("L1").join("etc"))["hostname"], "file");
}

#[test]
fn layer_links_are_absolute_by_default() {
    let m = Mount::new();
    for id in ready_layers() {
        for home in ["overlay", "overlay-layers"] {
            let link = m.path(home).join(&id);
            is_link_to_dir(&link);
            assert_eq!(
                fs::read_link(&link).unwrap(),
                m.mnt.join(home).join("RO").join(&id),
                "{home}/{id}"
            );
        }
        // Through the link, the RO dir's content.
        assert_eq!(
            names(&m.path("overlay").join(&id)),
            names(&m.path("overlay/RO").join(&id))
        );
        assert_eq!(
            names(&m.path("overlay-layers").join(&id)),
            names(&m.path("overlay-layers/RO").join(&id))
        );
    }
}

#[test]
fn layer_links_can_be_relative() {
    let m = Mount::with(
        Options {
            args: vec!["--link-style".into(), "relative".into()],
            ..Options::default()
        },
        |_| {},
    );
    for id in ready_layers() {
        for home in ["overlay", "overlay-layers"] {
            let link = m.path(home).join(&id);
            is_link_to_dir(&link);
            assert_eq!(
                fs::read_link(&link).unwrap(),
                Path::new("RO").join(&id),
                "{home}/{id}"
            );
        }
    }
}

#[test]
fn short_links_point_at_the_diff_dirs() {
    let m = Mount::new();
    for label in ["L1", "L2", "L3", "L4"] {
        let link = m.path("overlay/l").join(short(label));
        is_link_to_dir(&link);
        assert_eq!(
            fs::read_link(&link).unwrap(),
            Path::new("..").join(id(label)).join("diff")
        );
        assert_eq!(names(&link), names(&m.remote_diff(label)), "{label}");
        assert_eq!(
            fs::read(link.join("etc").join("hostname")).ok(),
            fs::read(m.remote_diff(label).join("etc/hostname")).ok(),
            "{label}"
        );
    }
}

#[test]
fn remote_files_read_back_byte_identical() {
    let m = Mount::new();
    for image in ready_images() {
        let rel = Path::new("overlay-images").join(&image);
        let config = expected()["image_config_files"][&image]
            .as_str()
            .unwrap()
            .to_owned();
        let want = sorted(vec!["images.json".into(), "manifest".into(), config]);
        assert_eq!(names(&m.mnt.join(&rel)), want, "{image}");
        for name in want {
            assert_eq!(
                fs::read(m.mnt.join(&rel).join(&name)).unwrap(),
                fs::read(m.remote.join(&rel).join(&name)).unwrap(),
                "{image}/{name}"
            );
        }
    }
    for id in ready_layers() {
        for rel in [
            Path::new("overlay/RO").join(&id),
            Path::new("overlay-layers/RO").join(&id),
        ] {
            let files = files_below(&m.remote.join(&rel));
            assert!(!files.is_empty());
            assert_eq!(files_below(&m.mnt.join(&rel)), files, "{}", rel.display());
            for f in files {
                assert_eq!(
                    fs::read(m.mnt.join(&rel).join(&f)).unwrap(),
                    fs::read(m.remote.join(&rel).join(&f)).unwrap(),
                    "{}",
                    rel.join(&f).display()
                );
            }
        }
    }
    // A symlink inside a layer is served as the same symlink.
    assert_eq!(
        fs::read_link(m.diff("L1").join("lib")).unwrap(),
        Path::new("usr/lib")
    );
    assert_eq!(
        fs::read(m.diff("L1").join("lib/libfake.so")).unwrap(),
        fs::read(m.remote_diff("L1").join("usr/lib/libfake.so")).unwrap()
    );
}

/// Not-ready objects, garbage and the writer's private entries are nowhere in the view,
/// although they exist in the remote tree.
#[test]
fn broken_and_foreign_entries_are_invisible() {
    let m = Mount::new();
    let e = expected();
    let l5 = id("L5");
    let l5_short = fs::read_to_string(m.remote.join("overlay/RO").join(&l5).join("link")).unwrap();
    let rw = e["writer_only"]["container_rw_layer"].as_str().unwrap();
    let rw_short = e["writer_only"]["container_rw_short"].as_str().unwrap();
    let mut hidden: Vec<String> = vec![
        format!("overlay/{l5}"),
        format!("overlay/RO/{l5}"),
        format!("overlay/l/{l5_short}"),
        format!("overlay-layers/{l5}"),
        format!("overlay-layers/RO/{l5}"),
        format!("overlay-images/{}", id("imageC")),
        format!("overlay/{rw}"),
        format!("overlay/l/{rw_short}"),
        format!("overlay-layers/{rw}"),
        "overlay-containers".into(),
        format!(
            "overlay-containers/{}",
            e["writer_only"]["container_id"].as_str().unwrap()
        ),
        format!("overlay/{}", id("MISSING")),
        format!("overlay/RO/{}", id("MISSING")),
    ];
    hidden.extend(strings(&e["garbage"]));
    for rel in &hidden {
        let parent = Path::new(rel).parent().unwrap();
        if fs::metadata(m.mnt.join(parent)).is_ok() {
            let listed = names(&m.mnt.join(parent));
            let name = Path::new(rel).file_name().unwrap().to_string_lossy();
            assert!(
                !listed.iter().any(|n| *n == name),
                "{rel} is listed in {}",
                parent.display()
            );
        }
        // Lookup by name, although the name exists remotely (except MISSING).
        enoent(&m.mnt.join(rel));
    }
    for rel in &hidden {
        if !rel.contains(&id("MISSING")) {
            assert!(
                fs::symlink_metadata(m.remote.join(rel)).is_ok(),
                "fixture lacks {rel}"
            );
        }
    }
    // The not-ready layer's content is not reachable under any name.
    enoent(
        &m.mnt
            .join(format!("overlay/RO/{l5}/diff/etc/half-applied.txt")),
    );
    // The writer's absolute links are replaced by ours, never served as written.
    for id in ready_layers() {
        let target = fs::read_link(m.path("overlay").join(&id)).unwrap();
        assert!(target.starts_with(&m.mnt), "{}", target.display());
        let writer = fs::read_link(m.remote.join("overlay").join(&id)).unwrap();
        assert_ne!(target, writer);
    }
    // The writer's `l/` links are not the source of ours: the RW layer's short is absent
    // although the writer has it.
    assert!(fs::symlink_metadata(m.remote.join("overlay/l").join(rw_short)).is_ok());
}

#[test]
fn another_driver_uses_its_own_directory_names() {
    let m = Mount::with(
        Options {
            args: vec!["--driver".into(), "vfs".into()],
            ..Options::default()
        },
        |remote| {
            for (from, to) in [
                ("overlay", "vfs"),
                ("overlay-layers", "vfs-layers"),
                ("overlay-images", "vfs-images"),
            ] {
                fs::rename(remote.join(from), remote.join(to)).unwrap();
            }
        },
    );
    assert_eq!(names(&m.mnt), vec!["vfs", "vfs-images", "vfs-layers"]);
    enoent(&m.path("overlay"));
    assert_eq!(
        names(&m.path("vfs")),
        with_extra(ready_layers(), &["RO", "l"])
    );
    assert_eq!(names(&m.path("vfs/RO")), ready_layers());
    assert_eq!(names(&m.path("vfs/l")), ready_shorts());
    assert_eq!(names(&m.path("vfs-layers/RO")), ready_layers());
    assert_eq!(names(&m.path("vfs-images")), ready_images());
    let l1 = id("L1");
    is_link_to_dir(&m.path("vfs").join(&l1));
    assert_eq!(
        fs::read_link(m.path("vfs").join(&l1)).unwrap(),
        m.mnt.join("vfs/RO").join(&l1)
    );
    assert_eq!(
        fs::read_link(m.path("vfs-layers").join(&l1)).unwrap(),
        m.mnt.join("vfs-layers/RO").join(&l1)
    );
    assert_eq!(
        fs::read_to_string(m.path("vfs/l").join(short("L4")).join("etc/hostname")).unwrap(),
        fs::read_to_string(
            m.remote
                .join("vfs/RO")
                .join(id("L4"))
                .join("diff/etc/hostname")
        )
        .unwrap()
    );
}

#[test]
fn an_empty_remote_shows_the_empty_skeleton() {
    let m = Mount::with(Options::default(), |remote| {
        for e in fs::read_dir(remote).unwrap() {
            fs::remove_dir_all(e.unwrap().path()).unwrap();
        }
    });
    assert_eq!(
        names(&m.mnt),
        vec!["overlay", "overlay-images", "overlay-layers"]
    );
    assert_eq!(names(&m.path("overlay")), vec!["RO", "l"]);
    assert_eq!(names(&m.path("overlay-layers")), vec!["RO"]);
    for dir in [
        "overlay/RO",
        "overlay/l",
        "overlay-layers/RO",
        "overlay-images",
    ] {
        assert!(fs::metadata(m.path(dir)).unwrap().is_dir(), "{dir}");
        assert!(names(&m.path(dir)).is_empty(), "{dir}");
    }
    enoent(&m.path("overlay").join(id("L1")));
}

#[test]
fn a_local_entry_wins_over_a_synthesized_link() {
    let l1 = id("L1");
    let m = Mount::with(Options::default(), |remote| {
        let dir = local_beside(remote).join("overlay").join(id("L1"));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("mine"), b"local").unwrap();
    });
    let p = m.path("overlay").join(&l1);
    let meta = fs::symlink_metadata(&p).unwrap();
    assert!(
        meta.is_dir(),
        "the local dir must win, got {:?}",
        meta.file_type()
    );
    assert_eq!(names(&p), vec!["mine"]);
    assert_eq!(fs::read(p.join("mine")).unwrap(), b"local");
    assert_eq!(dtypes(&m.path("overlay"))[&l1], "dir");
    let listed = names(&m.path("overlay"));
    assert_eq!(listed.iter().filter(|n| **n == l1).count(), 1, "{listed:?}");
    assert_eq!(listed, with_extra(ready_layers(), &["RO", "l"]));
    // The others stay synthesized, and the layer itself is still served.
    is_link_to_dir(&m.path("overlay").join(id("L2")));
    assert!(fs::metadata(m.path("overlay/RO").join(&l1).join("diff")).is_ok());
}

/// A remote layer dir that is a symlink (to `/`, or to a valid-looking layer outside the
/// remote root) is not a layer.
#[test]
fn layer_dirs_replaced_by_symlinks_are_not_served() {
    let m = Mount::with(Options::default(), |remote| {
        let outside = remote.parent().unwrap().join("outside");
        fs::create_dir(&outside).unwrap();
        let l4 = remote.join("overlay/RO").join(id("L4"));
        copy_tree(&l4, &outside.join(id("L4")));
        fs::remove_dir_all(&l4).unwrap();
        symlink(outside.join(id("L4")), &l4).unwrap();
        let l3 = remote.join("overlay-layers/RO").join(id("L3"));
        fs::remove_dir_all(&l3).unwrap();
        symlink("/", &l3).unwrap();
    });
    let (l1, l2) = (id("L1"), id("L2"));
    assert_eq!(
        names(&m.path("overlay/RO")),
        sorted(vec![l1.clone(), l2.clone()])
    );
    assert_eq!(
        names(&m.path("overlay-layers/RO")),
        sorted(vec![l1.clone(), l2.clone()])
    );
    assert_eq!(
        names(&m.path("overlay/l")),
        sorted(vec![short("L1"), short("L2")])
    );
    assert_eq!(names(&m.path("overlay-images")), vec![id("imageB")]);
    for label in ["L3", "L4"] {
        for home in [
            "overlay",
            "overlay/RO",
            "overlay-layers",
            "overlay-layers/RO",
        ] {
            enoent(&m.path(home).join(id(label)));
        }
        enoent(&m.path("overlay/l").join(short(label)));
    }
    enoent(
        &m.path("overlay/RO")
            .join(id("L4"))
            .join("diff/etc/hostname"),
    );
    enoent(&m.path("overlay-images").join(id("imageA")));
}

/// A symlink inside a diff that points out of the remote root is content: served as a
/// symlink with its target text, never resolved by the daemon.
#[test]
fn escaping_symlinks_inside_a_diff_are_served_as_symlinks() {
    let m = Mount::with(Options::default(), |remote| {
        let diff = remote.join("overlay/RO").join(id("L1")).join("diff");
        symlink("../../../../../etc", diff.join("evil")).unwrap();
        symlink("/etc/shadow", diff.join("abs")).unwrap();
        symlink("../../link", diff.join("up")).unwrap();
    });
    let diff = m.diff("L1");
    for (name, target) in [
        ("evil", "../../../../../etc"),
        ("abs", "/etc/shadow"),
        ("up", "../../link"),
    ] {
        let p = diff.join(name);
        assert!(
            fs::symlink_metadata(&p).unwrap().file_type().is_symlink(),
            "{name}"
        );
        assert_eq!(fs::read_link(&p).unwrap(), Path::new(target), "{name}");
        assert_eq!(dtypes(&diff)[name], "link", "{name}");
    }
    // The layer stays ready: a symlink in its content is not a symlink in its metadata.
    assert_eq!(names(&m.path("overlay/RO")), ready_layers());
}

#[test]
fn synthesized_links_resolve_through_the_mount() {
    let m = Mount::new();
    // The whole image A chain is reachable from the l/ links, as overlayfs lowerdirs are.
    for label in ["L1", "L2", "L3", "L4"] {
        let via_short = fs::canonicalize(m.path("overlay/l").join(short(label))).unwrap();
        let via_id = fs::canonicalize(m.path("overlay").join(id(label)).join("diff")).unwrap();
        assert_eq!(via_short, m.diff(label));
        assert_eq!(via_id, m.diff(label));
    }
}

/// `d_type` exactly as readdir(3) returns it (std falls back to lstat on `DT_UNKNOWN`,
/// which would hide it).
fn raw_dtypes(dir: &Path) -> std::collections::BTreeMap<Vec<u8>, u8> {
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    let mut out = std::collections::BTreeMap::new();
    // SAFETY: a valid C string; the stream is closed below and entries are copied out
    // before the next readdir.
    unsafe {
        let d = libc::opendir(c.as_ptr());
        assert!(!d.is_null(), "opendir {}", dir.display());
        loop {
            let e = libc::readdir(d);
            if e.is_null() {
                break;
            }
            let name = std::ffi::CStr::from_ptr((*e).d_name.as_ptr())
                .to_bytes()
                .to_vec();
            if name != b"." && name != b".." {
                out.insert(name, (*e).d_type);
            }
        }
        libc::closedir(d);
    }
    out
}

#[test]
fn readdir_never_answers_dt_unknown() {
    let m = Mount::new();
    let l = raw_dtypes(&m.path("overlay"));
    assert_eq!(l[id("L1").as_bytes()], libc::DT_LNK);
    assert_eq!(l[b"RO".as_slice()], libc::DT_DIR);
    assert_eq!(l[b"l".as_slice()], libc::DT_DIR);
    assert_eq!(
        raw_dtypes(&m.path("overlay/l"))[short("L1").as_bytes()],
        libc::DT_LNK
    );
    assert_eq!(
        raw_dtypes(&m.path("overlay-layers"))[id("L1").as_bytes()],
        libc::DT_LNK
    );
    let diff = raw_dtypes(&m.diff("L1"));
    assert_eq!(diff[b"lib".as_slice()], libc::DT_LNK);
    assert_eq!(diff[b"bin".as_slice()], libc::DT_DIR);
    assert_eq!(
        raw_dtypes(&m.diff("L1").join("bin"))[b"hello".as_slice()],
        libc::DT_REG
    );
    // Nowhere in the view.
    fn all(dir: &Path) {
        for (name, t) in raw_dtypes(dir) {
            let p = dir.join(std::ffi::OsStr::from_bytes(&name));
            assert_ne!(t, libc::DT_UNKNOWN, "{}", p.display());
            if t == libc::DT_DIR {
                all(&p);
            }
        }
    }
    all(&m.mnt);
}

#[test]
fn synthesized_links_are_taken_and_can_be_hidden() {
    let m = Mount::new();
    let (l1, l2) = (id("L1"), id("L2"));
    // iSulad creating the link that is already there.
    let err = symlink(
        m.mnt.join("overlay/RO").join(&l1),
        m.path("overlay").join(&l1),
    );
    assert_eq!(errno_of(err), libc::EEXIST);
    let err = symlink(
        format!("../{l1}/diff"),
        m.path("overlay/l").join(short("L1")),
    );
    assert_eq!(errno_of(err), libc::EEXIST);
    // Deleting one hides it, locally only.
    fs::remove_file(m.path("overlay").join(&l2)).unwrap();
    enoent(&m.path("overlay").join(&l2));
    assert!(!names(&m.path("overlay")).contains(&l2));
    assert!(is_whiteout(&m.local.join("overlay").join(&l2)));
    assert!(fs::metadata(m.path("overlay/RO").join(&l2).join("diff")).is_ok());
    // And it can be made again, as a local entry that wins.
    symlink(format!("RO/{l2}"), m.path("overlay").join(&l2)).unwrap();
    assert_eq!(
        fs::read_link(m.path("overlay").join(&l2)).unwrap(),
        Path::new("RO").join(&l2)
    );
}
