//! The remote tree is never written (DESIGN §3): the shipped fixture itself, not a copy, is
//! mounted, every kind of write goes through the view, and afterwards the fixture is
//! unchanged down to its metadata.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use common::*;

/// Change and modification times and user-visible xattrs of every entry: what
/// [`tree_hash`] leaves out, and what any write (even a metadata-only one) moves.
fn metadata_snapshot(root: &Path) -> BTreeMap<PathBuf, String> {
    fn go(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, String>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            let xattrs: Vec<(String, Vec<u8>)> = xattr_list(&p)
                .unwrap_or_default()
                .into_iter()
                .map(|n| {
                    let v = xattr_get(&p, &n).unwrap_or_default();
                    (n, v)
                })
                .collect();
            out.insert(
                p.strip_prefix(root).unwrap().to_owned(),
                format!(
                    "ctime {}.{} mtime {}.{} nlink {} xattrs {:?}",
                    m.ctime(),
                    m.ctime_nsec(),
                    m.mtime(),
                    m.mtime_nsec(),
                    m.nlink(),
                    xattrs
                ),
            );
            if m.is_dir() {
                go(root, &p, out);
            }
        }
    }
    let mut out = BTreeMap::new();
    go(root, root, &mut out);
    out
}

#[track_caller]
fn must<T>(r: std::io::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e}"))
}

fn append(path: &Path, data: &[u8]) -> std::io::Result<()> {
    fs::OpenOptions::new()
        .append(true)
        .open(path)?
        .write_all(data)
}

fn fallocate(path: &Path, len: i64) -> std::io::Result<()> {
    let f = fs::OpenOptions::new().write(true).open(path)?;
    // SAFETY: a valid open fd.
    if unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Every kind of write, in every area of the view.
fn write_everything(mnt: &Path) {
    let diff = |label: &str| mnt.join("overlay/RO").join(id(label)).join("diff");
    let (d1, d2, d3, d4) = (diff("L1"), diff("L2"), diff("L3"), diff("L4"));

    // Data: append, overwrite, truncate, write in place, preallocate.
    must(append(&d1.join("etc/hostname"), b"more\n"), "append");
    must(
        fs::write(d4.join("opt/app/config.yaml"), b"version: 3\n"),
        "overwrite",
    );
    must(
        fs::OpenOptions::new()
            .write(true)
            .open(d3.join("etc/motd"))
            .and_then(|f| f.set_len(1)),
        "truncate",
    );
    let mut f = must(
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(d1.join("usr/lib/libfake.so")),
        "open rw",
    );
    must(f.seek(SeekFrom::Start(100)), "seek");
    must(f.write_all(b"PATCHED"), "write in place");
    must(f.sync_all(), "fsync");
    drop(f);
    must(fallocate(&d2.join("opt/app/README"), 1 << 16), "fallocate");
    // Opened read-only, then changed through the fd.
    let f = must(fs::File::open(d4.join("var/lib/app/state.json")), "open ro");
    must(
        f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000)),
        "futimens on a read-only fd",
    );
    drop(f);

    // Metadata.
    must(
        fs::set_permissions(d1.join("bin/hello"), fs::Permissions::from_mode(0o700)),
        "chmod",
    );
    must(
        std::os::unix::fs::lchown(d1.join("etc/passwd"), Some(1), Some(1)),
        "chown",
    );
    must(
        std::os::unix::fs::lchown(d4.join("usr/local/bin/tool-link"), Some(2), Some(2)),
        "lchown of a symlink",
    );
    must(
        xattr_set(&d1.join("etc/os-release"), "user.layerfs-test", b"v"),
        "setxattr file",
    );
    must(
        xattr_set(&d2.join("opt"), "user.layerfs-test", b"dir"),
        "setxattr dir",
    );
    must(
        xattr_set(
            &mnt.join("overlay/RO").join(id("L3")),
            "user.on-layer",
            b"1",
        ),
        "setxattr layer dir",
    );
    must(
        xattr_remove(&d2.join("opt"), "user.layerfs-test"),
        "removexattr",
    );

    // Names: delete, rename, re-create over whiteouts, links, special files.
    must(
        fs::remove_file(d1.join("usr/share/doc/readme.txt")),
        "unlink",
    );
    must(fs::remove_file(d1.join("lib")), "unlink symlink");
    must(fs::remove_dir_all(d2.join("opt/app/data")), "rm -r");
    must(
        fs::create_dir(d2.join("opt/app/data")),
        "mkdir over a whiteout",
    );
    must(
        fs::write(d2.join("opt/app/data/new.csv"), b"a,b\n"),
        "create in it",
    );
    must(
        fs::write(d1.join("usr/share/doc/readme.txt"), b"again\n"),
        "re-create",
    );
    must(
        fs::rename(d3.join("etc/app.conf"), d3.join("etc/app.conf.old")),
        "rename",
    );
    must(
        fs::rename(d2.join("opt/app/README"), d1.join("README.moved")),
        "rename across layers",
    );
    match fs::rename(d4.join("var/lib/app"), d4.join("var/lib/app2")) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {}
        Err(e) => panic!("rename dir: {e}"),
    }
    must(
        fs::hard_link(d1.join("etc/passwd"), d1.join("etc/passwd.hard")),
        "link",
    );
    must(symlink("hostname", d1.join("etc/hostname.link")), "symlink");
    let fifo =
        std::ffi::CString::new(d1.join("fifo").into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0, "mkfifo");

    // Every area of the layout.
    let l1 = id("L1");
    let image_a = id("imageA");
    let new_id = "0".repeat(64);
    must(fs::write(mnt.join("root-file"), b"x"), "create at the root");
    must(
        fs::create_dir(mnt.join("overlay-containers")),
        "mkdir at the root",
    );
    must(
        fs::write(mnt.join("overlay/file"), b"x"),
        "create in overlay/",
    );
    must(
        fs::create_dir_all(mnt.join("overlay/RO").join(&new_id).join("diff")),
        "a local layer in RO/",
    );
    must(
        symlink(format!("RO/{new_id}"), mnt.join("overlay").join(&new_id)),
        "its link",
    );
    must(
        symlink(
            format!("../{new_id}/diff"),
            mnt.join("overlay/l/ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
        ),
        "its short link",
    );
    must(
        fs::create_dir(mnt.join("overlay/RO").join(&l1).join("work")),
        "work/ in a remote layer",
    );
    must(
        fs::write(
            mnt.join("overlay/RO").join(&l1).join("link"),
            b"ffffffffffffffffffffffffff",
        ),
        "rewrite link",
    );
    must(
        fs::write(mnt.join("overlay-layers/file"), b"x"),
        "create in overlay-layers/",
    );
    must(
        append(
            &mnt.join("overlay-layers/RO")
                .join(id("L2"))
                .join("layer.json"),
            b"\n",
        ),
        "append to layer.json",
    );
    must(
        fs::write(mnt.join("overlay-layers/RO").join(&l1).join("extra"), b"x"),
        "create in a layer's metadata dir",
    );
    must(
        fs::write(
            mnt.join("overlay-images").join(&image_a).join("extra"),
            b"x",
        ),
        "create in an image dir",
    );
    must(
        fs::write(
            mnt.join("overlay-images")
                .join(id("imageB"))
                .join("images.json"),
            b"{}",
        ),
        "rewrite images.json",
    );
    must(
        fs::create_dir(mnt.join("overlay-images").join(&new_id)),
        "a local image",
    );
    must(
        fs::remove_file(mnt.join("overlay").join(id("L3"))),
        "remove a synthesized link",
    );
    must(
        fs::remove_file(mnt.join("overlay/l").join(short("L4"))),
        "remove a synthesized short link",
    );
    must(
        fs::remove_file(mnt.join("overlay-layers").join(id("L4"))),
        "remove a synthesized layers link",
    );
    must(
        fs::remove_dir_all(mnt.join("overlay-images").join(&image_a)),
        "remove a remote image",
    );
    must(
        fs::remove_dir_all(mnt.join("overlay/RO").join(id("L4"))),
        "remove a remote layer",
    );
}

#[test]
fn writes_through_the_view_leave_the_shipped_remote_alone() {
    let remote = repo().join("fixtures/remote");
    let hash_before = tree_hash(&remote);
    let meta_before = metadata_snapshot(&remote);

    let tmp = tempfile::Builder::new()
        .prefix("layerfs-untouched")
        .tempdir()
        .unwrap();
    let (local, mnt) = (tmp.path().join("local"), tmp.path().join("mnt"));
    fs::create_dir(&local).unwrap();
    fs::create_dir(&mnt).unwrap();
    {
        let mut m = RawMount::start(&remote, &local, &mnt, &["-o", "allow_other"]);
        write_everything(&mnt);
        // The writes took effect in the view, and landed in local.
        let d1 = mnt.join("overlay/RO").join(id("L1")).join("diff");
        assert!(fs::read(d1.join("etc/hostname"))
            .unwrap()
            .ends_with(b"more\n"));
        assert!(fs::symlink_metadata(d1.join("lib")).is_err());
        assert!(fs::symlink_metadata(mnt.join("overlay").join(id("L3"))).is_err());
        let local_d1 = local.join("overlay/RO").join(id("L1")).join("diff");
        assert!(fs::read(local_d1.join("etc/hostname"))
            .unwrap()
            .ends_with(b"more\n"));
        assert!(is_whiteout(&local_d1.join("lib")));
        let status = m.unmount();
        assert!(status.success(), "layerfs exited with {status}");
    }
    assert!(!is_mounted(&mnt));
    assert_eq!(
        tree_hash(&remote),
        hash_before,
        "the shipped remote tree was modified"
    );
    let meta_after = metadata_snapshot(&remote);
    for (path, before) in &meta_before {
        assert_eq!(
            meta_after.get(path),
            Some(before),
            "{} changed",
            path.display()
        );
    }
    assert_eq!(meta_after.len(), meta_before.len());
}
