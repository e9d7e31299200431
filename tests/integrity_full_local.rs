//! Integrity regressions: each test is a bug seen on a real mount, and asserts what a correct
//! union filesystem (and, where there is one, the host filesystem as a reference) does.
//!
//! Here, a full local filesystem, where a container that filled its layer must still be able
//! to clean up and must not have taken what was not its own:
//!
//! - deleting and renaming work in a full quota root (kernel overlayfs stacked on the view
//!   deletes with whiteouts, which take no data block);
//! - a create that fails for want of room over a whiteout leaves the whiteout: a deleted
//!   remote entry never comes back;
//! - the blocks an ext4 reserves for root are kept from unprivileged callers, whether their
//!   writes pass through or go through the daemon.
//!
//! Needs root, `/dev/fuse`, kernel overlayfs, tmpfs and `mkfs.ext4`.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use common::sys::*;
use common::*;

const MIB: u64 = 1 << 20;

/// Writes `chunk`-byte blocks to a new file `path` until a write fails; the errno.
fn fill_until_error(path: &Path, chunk: usize, cap: u64) -> i32 {
    let mut f = fs::File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    let data = pattern(chunk, 3);
    let mut total = 0u64;
    loop {
        assert!(
            total <= cap,
            "wrote {total} bytes to {} and no write failed",
            path.display()
        );
        match f.write(&data) {
            Ok(0) => panic!("write returned 0"),
            Ok(n) => total += n as u64,
            Err(e) => return e.raw_os_error().expect("an OS error"),
        }
    }
}

// ---- Deleting in a full quota root ----

fn failed<T>(failures: &mut Vec<String>, what: &str, r: &std::io::Result<T>) {
    if let Err(e) = r {
        failures.push(format!("{what}: {e}"));
    }
}

fn gone(failures: &mut Vec<String>, p: &Path) {
    if fs::symlink_metadata(p).is_ok() {
        failures.push(format!("{} is still there after its removal", p.display()));
    }
}

/// A container's upper and work dirs inside a full quota root, kernel overlayfs over a
/// layer of the view (as iSulad stacks them): deleting files and directories of the image,
/// and renaming, must work when the root is full, or a full container could never free
/// space by deleting. Overlayfs deletes with whiteouts (a 0/0 device made with `mknod` in
/// its work dir, or a link to one it keeps there, renamed into place), which take no data
/// block; removing a directory whose upper copy holds whiteouts also makes it create a
/// temporary opaque directory in the work dir and exchange it with the old one. The same
/// calls directly through the view too (`mknod c 0 0`, a link of it, unlink). Every failure
/// is collected and reported together.
#[test]
fn deleting_and_renaming_work_in_a_full_quota_root() {
    let m = Mount::with(Options::default(), |remote| {
        let share = remote
            .join("overlay/RO")
            .join(id("L1"))
            .join("diff/usr/share");
        fs::create_dir(share.join("empty")).unwrap();
    });
    let _w = Watchdog::of(&m, 120);
    let cid = "c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00";
    let rel = format!("overlay/{cid}");
    let home = m.path(&rel);
    fs::create_dir(&home).unwrap();
    quota_set(&m, &rel, "1M");
    let (upper, work) = (home.join("diff"), home.join("work"));
    fs::create_dir(&upper).unwrap();
    fs::create_dir(&work).unwrap();
    // Files of the root itself, to delete directly through the view later.
    fs::write(home.join("own-a"), b"a").unwrap();
    fs::write(home.join("own-b"), b"b").unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let merged = scratch.path().join("merged");
    fs::create_dir(&merged).unwrap();
    let mut failures = Vec::new();
    {
        let _ov = Overlay::mount(&[m.diff("L1")], &upper, &work, &merged)
            .expect("overlayfs over the view");
        // Before the root is full: a layer file changed (copied up, with its parent), and
        // the directories that will lose entries brought up (overlayfs copies up the
        // parents of what it deletes, and a directory needs a block).
        fs::OpenOptions::new()
            .append(true)
            .open(merged.join("etc/os-release"))
            .unwrap()
            .write_all(b"CHANGED=1\n")
            .unwrap();
        for d in ["usr/share/doc", "usr/lib"] {
            fs::set_permissions(merged.join(d), fs::Permissions::from_mode(0o755)).unwrap();
        }
        let e = fill_until_error(&merged.join("fill"), 64 * 1024, 64 * MIB);
        assert_eq!(e, libc::ENOSPC, "filling the root: {}", errname(e));

        let r = fs::remove_file(merged.join("etc/hostname"));
        failed(&mut failures, "rm of an image file", &r);
        if r.is_ok() {
            gone(&mut failures, &merged.join("etc/hostname"));
        }
        let r = fs::remove_file(merged.join("usr/lib/libfake.so"));
        failed(&mut failures, "rm of an image file in a copied-up dir", &r);
        let rm = |dir: &str| {
            Command::new("rm")
                .arg("-rf")
                .arg(merged.join(dir))
                .output()
                .unwrap()
        };
        let out = rm("usr/share/empty");
        if out.status.success() {
            gone(&mut failures, &merged.join("usr/share/empty"));
        } else {
            failures.push(format!(
                "rm -rf of an empty image directory: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        // A directory that held files: its files go (whiteouts), but overlayfs clears the
        // directory itself by making a new opaque one in its work dir first, and a new
        // directory takes a block, which a full root refuses, as XFS project quota does.
        let out = rm("usr/share/doc");
        gone(&mut failures, &merged.join("usr/share/doc/readme.txt"));
        if !out.status.success()
            && !String::from_utf8_lossy(&out.stderr).contains("No space left on device")
        {
            failures.push(format!(
                "rm -rf of an image directory with a file: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let moved = merged.join("etc/os-release.moved");
        let r = fs::rename(merged.join("etc/os-release"), &moved);
        failed(&mut failures, "rename of a copied-up image file", &r);
        if r.is_ok() {
            gone(&mut failures, &merged.join("etc/os-release"));
            assert!(fs::read(&moved).unwrap().ends_with(b"CHANGED=1\n"));
        }
    }
    if failures.is_empty() {
        assert!(
            is_whiteout(&upper.join("etc/hostname")),
            "the whiteout is in the upper dir"
        );
    }

    // Directly through the view, in the full root.
    let r = mknod_0_0(&home.join("wh"), 0o000);
    failed(&mut failures, "mknod wh c 0 0 (view)", &r);
    if r.is_ok() {
        assert!(is_whiteout(&home.join("wh")));
        let r = fs::hard_link(home.join("wh"), home.join("wh2"));
        failed(&mut failures, "link of a 0/0 device (view)", &r);
        if r.is_ok() {
            assert_eq!(fs::symlink_metadata(home.join("wh")).unwrap().nlink(), 2);
        }
    }
    for n in ["own-a", "own-b", "wh", "wh2"] {
        if fs::symlink_metadata(home.join(n)).is_ok() {
            let r = fs::remove_file(home.join(n));
            failed(&mut failures, &format!("unlink {n} (view)"), &r);
        }
    }
    assert!(
        failures.is_empty(),
        "in a full quota root:\n{}",
        failures.join("\n")
    );
}

// ---- A failed create over a whiteout keeps the whiteout ----

/// Sets `user.N` xattrs with empty values on `path` (in the tmpfs itself) until tmpfs
/// refuses one: what is left of its inode space is then less than one small xattr, so not
/// even the view's opaque marker fits.
fn exhaust_xattr_space(path: &Path) {
    for i in 0..100_000 {
        if let Err(e) = xattr_set(path, &format!("user.{i}"), b"") {
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "user xattr {i}: {e}");
            return;
        }
    }
    panic!("100 000 xattrs fit on {}", path.display());
}

/// Local on a small tmpfs. A name deleted from a layer (a whiteout in local) stays deleted
/// when something made in its place fails for want of room: a symlink whose target needs a
/// block when no block is left, a directory when no inode (nor room for its opaque marker) is
/// left, a rename that needs a whiteout for its old name when no inode is left (and the
/// target's whiteout is held open, so removing it frees none). A view that removes the
/// whiteout first and then fails brings the remote entry back.
#[test]
fn a_failed_create_over_a_whiteout_leaves_the_name_deleted() {
    let mut tmpfs = LocalFs::default();
    let m = Mount::with(Options::default(), |remote| {
        tmpfs.tmpfs(&local_beside(remote), "size=2m,nr_inodes=600,mode=755");
    });
    let _w = Watchdog::of(&m, 120);
    let d = m.diff("L1");
    // Deleted remote entries: a file, a directory, another file; and a changed (copied up)
    // remote file, whose rename needs a whiteout for its old name.
    fs::remove_file(d.join("etc/hostname")).unwrap();
    fs::remove_dir_all(d.join("usr/lib")).unwrap();
    fs::remove_file(d.join("etc/passwd")).unwrap();
    fs::OpenOptions::new()
        .append(true)
        .open(d.join("etc/os-release"))
        .unwrap()
        .write_all(b"CHANGED=1\n")
        .unwrap();
    let os_release = fs::read(d.join("etc/os-release")).unwrap();
    for (dir, name) in [("etc", "hostname"), ("usr", "lib"), ("etc", "passwd")] {
        assert!(
            is_whiteout(&m.local_diff("L1").join(dir).join(name)),
            "{dir}/{name} is a whiteout in local"
        );
    }

    // No block left: a symlink with a 4000-byte target needs one.
    let e = fill_until_error(&m.path("fill"), 64 * 1024, 64 * MIB);
    assert_eq!(e, libc::ENOSPC, "filling the tmpfs: {}", errname(e));
    let target = "t".repeat(4000);
    let r = std::os::unix::fs::symlink(&target, d.join("etc/hostname"));
    eprintln!("symlink over a whiteout, no block left: {}", describe(&r));
    assert_eq!(
        r.as_ref().err().and_then(|e| e.raw_os_error()),
        Some(libc::ENOSPC),
        "a 4000-byte symlink in a full tmpfs: {}",
        describe(&r)
    );
    assert_still_deleted(&m, "etc", "hostname", "after the failed symlink");

    // No inode left, nor room for a marker: mkdir.
    let inodes = m.path("inodes");
    fs::create_dir(&inodes).unwrap();
    let mut made = 0;
    loop {
        match fs::File::create(inodes.join(made.to_string())) {
            Ok(_) => made += 1,
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "creating inodes: {e}");
                break;
            }
        }
        assert!(made < 10_000, "no end to the tmpfs's inodes");
    }
    exhaust_xattr_space(&m.local.join("inodes/0"));
    let r = fs::create_dir(d.join("usr/lib"));
    eprintln!("mkdir over a whiteout, no inode left: {}", describe(&r));
    assert_eq!(
        r.as_ref().err().and_then(|e| e.raw_os_error()),
        Some(libc::ENOSPC),
        "mkdir with no inode left: {}",
        describe(&r)
    );
    assert_still_deleted(&m, "usr", "lib", "after the failed mkdir");

    // No inode left, and the one the deleted name's whiteout holds is not freed by removing
    // it (something else has it open): renaming a copied-up file needs a whiteout.
    let held = open_raw(
        &m.local_diff("L1").join("etc/passwd"),
        libc::O_PATH | libc::O_NOFOLLOW,
        0,
    )
    .unwrap();
    let r = fs::rename(d.join("etc/os-release"), d.join("etc/passwd"));
    eprintln!("rename over a whiteout, no inode left: {}", describe(&r));
    assert_eq!(
        r.as_ref().err().and_then(|e| e.raw_os_error()),
        Some(libc::ENOSPC),
        "a rename needing a whiteout with no inode left: {}",
        describe(&r)
    );
    assert_still_deleted(&m, "etc", "passwd", "after the failed rename");
    assert_eq!(
        fs::read(d.join("etc/os-release")).unwrap(),
        os_release,
        "the file a failed rename was to move is still in place"
    );
    drop(held);
    // Room again: the names can be used.
    fs::remove_file(m.path("fill")).unwrap();
    fs::remove_dir_all(&inodes).unwrap();
    std::os::unix::fs::symlink(&target, d.join("etc/hostname")).expect("symlink with room");
    assert_eq!(
        fs::read_link(d.join("etc/hostname")).unwrap(),
        Path::new(&target)
    );
}

// ---- Allocating as the caller ----

/// How many bytes `who` (a shell run as nobody, or as root) can write to a new file `name`
/// in `dir` before the filesystem says it is full; `dd` as the writer, 1 MiB blocks.
fn fill_as(dir: &Path, name: &str, nobody: bool) -> u64 {
    let script = format!(
        "dd if=/dev/zero of='{}' bs=1M count=64 conv=fsync 2>/dev/null; stat -c %s '{}'",
        dir.join(name).display(),
        dir.join(name).display()
    );
    let (_, out) = if nobody {
        sh_as_nobody(&script)
    } else {
        let out = Command::new("sh").arg("-c").arg(&script).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    out.trim()
        .lines()
        .last()
        .unwrap_or("0")
        .parse()
        .unwrap_or(0)
}

/// Local's filesystem sees the caller, not the daemon: on an ext4 local with half of its
/// blocks reserved for root, an unprivileged caller fills it only up to the reserve, with
/// passthrough writes and with writes through the daemon (a new file written by `dd`, as
/// nobody), and root can still write after that, as on the ext4 itself.
#[test]
fn reserved_blocks_are_kept_from_unprivileged_callers() {
    for opts in ["", "nopassthrough"] {
        let mut ext4 = LocalFs::default();
        let m = Mount::with(
            Options {
                opts: opts.into(),
                ..Options::default()
            },
            |remote| ext4.ext4_with(&local_beside(remote), 64, &["-m", "50"]),
        );
        let _w = Watchdog::of(&m, 120);
        let dir = m.path("pub");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o1777)).unwrap();
        let by_nobody = fill_as(&dir, "nobody", true);
        let by_root = fill_as(&dir, "root", false);
        eprintln!("{opts:?}: nobody wrote {by_nobody} bytes, then root {by_root}");
        assert!(
            by_nobody < 40 * MIB,
            "{opts:?}: nobody wrote {by_nobody} bytes into a 64 MiB ext4 with half of it reserved"
        );
        assert!(
            by_root >= 8 * MIB,
            "{opts:?}: root could write only {by_root} bytes into the reserve"
        );
        assert_eq!(
            fs::metadata(dir.join("nobody")).unwrap().uid(),
            65534,
            "{opts:?}: the file belongs to its creator"
        );
    }
}

/// The kernel does a passthrough file's writes with the credentials its backing file was
/// registered with, and all opens of a file share one. A file root holds open read-only,
/// then written by nobody, was written with root's right to the reserve: about 60 of the
/// 64 MiB went in. An open for writing with other rights than the registrar's writes through
/// the daemon, as its caller.
#[test]
fn a_file_root_holds_open_takes_nobodys_writes_as_nobodys() {
    let mut ext4 = LocalFs::default();
    let m = Mount::with(Options::default(), |remote| {
        ext4.ext4_with(&local_beside(remote), 64, &["-m", "50"])
    });
    let _w = Watchdog::of(&m, 120);
    let dir = m.path("pub");
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o1777)).unwrap();
    let shared = dir.join("shared");
    fs::write(&shared, b"").unwrap();
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o666)).unwrap();
    let held = fs::File::open(&shared).unwrap();
    let script = format!(
        "dd if=/dev/zero of='{}' bs=1M count=64 conv=notrunc,fsync 2>/dev/null; stat -c %s '{}'",
        shared.display(),
        shared.display()
    );
    let (_, out) = sh_as_nobody(&script);
    let written: u64 = out
        .trim()
        .lines()
        .last()
        .unwrap_or("0")
        .parse()
        .unwrap_or(0);
    drop(held);
    assert!(
        written < 40 * MIB,
        "nobody wrote {written} bytes into a 64 MiB ext4 with half of it reserved"
    );
    assert!(written > 8 * MIB, "nobody wrote only {written} bytes");
}
