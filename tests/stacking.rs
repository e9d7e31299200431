//! Kernel overlayfs stacked on the view, as iSulad mounts a container rootfs: the lower dirs
//! are the view's `overlay/l/<short>` links of an image's layer chain.

mod common;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use common::*;

/// Image A's chain, top first, as `lowerdir` wants it: L4:L3:L2:L1 through `overlay/l/`.
fn image_a_lowers(m: &Mount) -> Vec<PathBuf> {
    ["L4", "L3", "L2", "L1"]
        .iter()
        .map(|l| m.path("overlay/l").join(short(l)))
        .collect()
}

/// What image A's merged rootfs must show.
fn check_merged_image_a(m: &Mount, merged: &Path) {
    let remote = |label: &str, rel: &str| fs::read(m.remote_diff(label).join(rel)).unwrap();
    let read = |rel: &str| fs::read(merged.join(rel)).unwrap();
    assert_eq!(read("etc/hostname"), remote("L4", "etc/hostname"));
    assert_eq!(read("etc/hostname"), b"fixture-app\n");
    assert_eq!(read("etc/app.conf"), remote("L3", "etc/app.conf"));
    assert_eq!(
        read("opt/app/config.yaml"),
        remote("L4", "opt/app/config.yaml")
    );
    assert_eq!(read("etc/os-release"), remote("L1", "etc/os-release"));
    assert_eq!(
        read("usr/share/doc/readme.txt"),
        remote("L1", "usr/share/doc/readme.txt")
    );
    let app = names(&merged.join("opt/app"));
    for name in ["README", "bin", "data", "config.yaml", "plugins", "VERSION"] {
        assert!(
            app.iter().any(|n| n == name),
            "opt/app lacks {name}: {app:?}"
        );
    }
    assert_eq!(
        fs::read_link(merged.join("usr/local/bin/tool-link")).unwrap(),
        Path::new("tool")
    );
}

fn write_through(merged: &Path) {
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(merged.join("etc/os-release"))
        .unwrap();
    f.write_all(b"EXTRA=1\n").unwrap();
    drop(f);
    fs::write(merged.join("etc/hostname"), b"container\n").unwrap();
    fs::write(merged.join("new-file"), b"new\n").unwrap();
    fs::remove_file(merged.join("opt/app/README")).unwrap();
}

fn check_written(m: &Mount, merged: &Path, upper: &Path) {
    let os_release = fs::read(m.remote_diff("L1").join("etc/os-release")).unwrap();
    let mut want = os_release.clone();
    want.extend_from_slice(b"EXTRA=1\n");
    assert_eq!(fs::read(merged.join("etc/os-release")).unwrap(), want);
    assert_eq!(fs::read(upper.join("etc/os-release")).unwrap(), want);
    assert_eq!(
        fs::read(upper.join("etc/hostname")).unwrap(),
        b"container\n"
    );
    assert_eq!(fs::read(upper.join("new-file")).unwrap(), b"new\n");
    assert!(is_whiteout(&upper.join("opt/app/README")));
    assert!(fs::symlink_metadata(merged.join("opt/app/README")).is_err());
    // The layers, as the view serves them, are untouched.
    assert_eq!(
        fs::read(m.diff("L1").join("etc/os-release")).unwrap(),
        os_release
    );
    assert_eq!(
        fs::read(m.diff("L4").join("etc/hostname")).unwrap(),
        fs::read(m.remote_diff("L4").join("etc/hostname")).unwrap()
    );
    assert!(fs::metadata(m.diff("L2").join("opt/app/README")).is_ok());
}

#[test]
fn overlayfs_over_the_short_links_shows_the_image() {
    let m = Mount::new();
    let scratch = tempfile::tempdir().unwrap();
    let (upper, work, merged) = (
        scratch.path().join("upper"),
        scratch.path().join("work"),
        scratch.path().join("merged"),
    );
    for d in [&upper, &work, &merged] {
        fs::create_dir(d).unwrap();
    }
    {
        let _ov = Overlay::mount(&image_a_lowers(&m), &upper, &work, &merged)
            .unwrap_or_else(|e| panic!("overlayfs over the view: {e}"));
        check_merged_image_a(&m, &merged);
        write_through(&merged);
        check_written(&m, &merged, &upper);
    }
    assert!(!is_mounted(&merged));
    // Nothing of the container reached local either: the upper dir is outside the view.
    assert!(fs::symlink_metadata(m.local_diff("L1").join("etc/os-release")).is_err());
}

/// iSulad puts a container's upper and work dirs in `overlay/<cid>/` of the same storage
/// root, so here they are made through the view. Kernel overlayfs demands `RENAME_WHITEOUT`
/// and visible whiteouts from an upper filesystem with revalidated dentries (FUSE): the view
/// gives both in directories with nothing below them, and the container's writes, whiteouts
/// included, land in local as the kernel wrote them.
#[test]
fn overlayfs_with_upper_dir_inside_the_view() {
    let m = Mount::new();
    let cid = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let home = m.path("overlay").join(cid);
    fs::create_dir(&home).unwrap();
    let (upper, work) = (home.join("diff"), home.join("work"));
    fs::create_dir(&upper).unwrap();
    fs::create_dir(&work).unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let merged = scratch.path().join("merged");
    fs::create_dir(&merged).unwrap();
    {
        let _ov = Overlay::mount(&image_a_lowers(&m), &upper, &work, &merged)
            .unwrap_or_else(|e| panic!("overlayfs with its upper dir in the view: {e}"));
        check_merged_image_a(&m, &merged);
        write_through(&merged);
        check_written(&m, &merged, &upper);
        // A deleted directory of the image is a whiteout too, and mkdir over it is opaque.
        fs::remove_dir_all(merged.join("opt/app/plugins")).unwrap();
        fs::create_dir(merged.join("opt/app/plugins")).unwrap();
        assert!(fs::read_dir(merged.join("opt/app/plugins"))
            .unwrap()
            .next()
            .is_none());
    }
    assert!(!is_mounted(&merged));
    let local_upper = m.local.join("overlay").join(cid).join("diff");
    assert_eq!(fs::read(local_upper.join("new-file")).unwrap(), b"new\n");
    assert!(is_whiteout(&local_upper.join("opt/app/README")));
    // Remounting the container rootfs from what the view kept gives the same picture.
    {
        let _ov = Overlay::mount(&image_a_lowers(&m), &upper, &work, &merged)
            .unwrap_or_else(|e| panic!("overlayfs remounted: {e}"));
        check_written(&m, &merged, &upper);
        assert!(fs::read_dir(merged.join("opt/app/plugins"))
            .unwrap()
            .next()
            .is_none());
    }
    // The dirs made through the view are ordinary local dirs.
    assert!(fs::metadata(m.local.join("overlay").join(cid).join("work"))
        .unwrap()
        .is_dir());
}

/// `cp -a` gives a new directory its mode through its access ACL (a setxattr of
/// `system.posix_acl_access` after a `mkdir` with mode 0700). The kernel only marks the
/// attributes of a FUSE inode stale then, and overlayfs stacked at once on that directory
/// copied the stale 0700 into its own inode: everyone but root was refused a layer a
/// runtime had just copied in.
#[test]
fn a_mode_set_through_an_acl_is_what_overlayfs_stacked_at_once_sees() {
    let m = Mount::new();
    let scratch = tempfile::tempdir().unwrap();
    let (ok, out) = read_a_copied_layer_as_nobody(&m.path("copied-layer"), scratch.path());
    assert!(ok, "a caller other than root: {out}");
    assert_eq!(out, "f\nreadable\n");
}
