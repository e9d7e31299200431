//! POSIX behaviour through a real mount: symlinks, special files, xattrs, fallocate, fsync,
//! statfs, times, ownership and modes, inode numbers.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use common::*;
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::sys::time::TimeSpec;

// ---- symlinks and special files ----

#[test]
fn symlinks_create_readlink_lstat_and_stat() {
    let m = Mount::new();
    let d = m.diff("L1");
    std::os::unix::fs::symlink("etc/hostname", d.join("host-link")).unwrap();
    std::os::unix::fs::symlink("/nonexistent/target", d.join("dangling")).unwrap();
    assert_eq!(
        fs::read_link(d.join("host-link")).unwrap(),
        Path::new("etc/hostname")
    );
    let l = fs::symlink_metadata(d.join("host-link")).unwrap();
    assert!(l.file_type().is_symlink());
    assert_eq!(l.len(), "etc/hostname".len() as u64);
    let s = fs::metadata(d.join("host-link")).unwrap();
    assert!(s.is_file());
    assert_eq!(s.ino(), fs::metadata(d.join("etc/hostname")).unwrap().ino());
    assert_eq!(fs::read(d.join("host-link")).unwrap(), b"fixture-base\n");
    assert_eq!(errno_of(fs::metadata(d.join("dangling"))), libc::ENOENT);
    assert_eq!(
        fs::read_link(m.local_diff("L1").join("host-link")).unwrap(),
        Path::new("etc/hostname")
    );
    // A remote symlink: lstat vs stat.
    assert!(fs::symlink_metadata(d.join("lib"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(fs::metadata(d.join("lib")).unwrap().is_dir());
    assert_eq!(fs::read_link(d.join("lib")).unwrap(), Path::new("usr/lib"));
}

#[test]
fn fifos_and_device_nodes() {
    let m = Mount::new();
    let d = m.diff("L1");
    nix::unistd::mkfifo(&d.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
    mknod(
        &d.join("null2"),
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        makedev(1, 3),
    )
    .unwrap();
    mknod(
        &d.join("blk"),
        SFlag::S_IFBLK,
        Mode::from_bits_truncate(0o600),
        makedev(7, 9),
    )
    .unwrap();

    let f = fs::symlink_metadata(d.join("fifo")).unwrap();
    assert!(f.file_type().is_fifo());
    assert_eq!(f.mode() & 0o7777, 0o600);
    let c = fs::symlink_metadata(d.join("null2")).unwrap();
    assert!(c.file_type().is_char_device());
    assert_eq!(c.rdev(), makedev(1, 3));
    let b = fs::symlink_metadata(d.join("blk")).unwrap();
    assert!(b.file_type().is_block_device());
    assert_eq!(b.rdev(), makedev(7, 9));

    let local = m.local_diff("L1");
    assert!(fs::symlink_metadata(local.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(
        fs::symlink_metadata(local.join("null2")).unwrap().rdev(),
        makedev(1, 3)
    );
    assert!(!is_whiteout(&local.join("null2")));
    // (Opening the device node is up to the mount's `nodev`, as on any FUSE mount.)
    // A fifo passes data between two opens.
    let p = d.join("fifo");
    let writer = std::thread::spawn(move || fs::write(p, b"through the pipe").unwrap());
    let mut got = String::new();
    fs::File::open(d.join("fifo"))
        .unwrap()
        .read_to_string(&mut got)
        .unwrap();
    writer.join().unwrap();
    assert_eq!(got, "through the pipe");
    fs::remove_file(d.join("fifo")).unwrap();
    assert!(fs::symlink_metadata(local.join("fifo")).is_err());
}

// ---- extended attributes ----

#[test]
fn xattrs_set_get_list_remove_through_the_view() {
    let m = Mount::new();
    let view = m.diff("L1").join("etc/hostname");
    let local = m.local_diff("L1").join("etc/hostname");
    assert_eq!(errno_of(xattr_get(&view, "user.k")), libc::ENODATA);
    xattr_set(&view, "user.k", b"v1").unwrap();
    assert_eq!(xattr_get(&view, "user.k").unwrap(), b"v1");
    assert_eq!(
        xattr_get(&local, "user.k").unwrap(),
        b"v1",
        "set copies the file up"
    );
    assert_eq!(fs::read(&view).unwrap(), b"fixture-base\n");
    xattr_set(&view, "user.k", b"v2").unwrap();
    xattr_set(&view, "user.other", b"").unwrap();
    assert_eq!(xattr_list(&view).unwrap(), vec!["user.k", "user.other"]);
    assert_eq!(xattr_get(&view, "user.other").unwrap(), b"");
    xattr_remove(&view, "user.k").unwrap();
    assert_eq!(errno_of(xattr_get(&view, "user.k")), libc::ENODATA);
    assert_eq!(errno_of(xattr_remove(&view, "user.k")), libc::ENODATA);
    assert_eq!(xattr_list(&view).unwrap(), vec!["user.other"]);
    assert_eq!(errno_of(xattr_get(&local, "user.k")), libc::ENODATA);

    // On directories and symlinks too.
    let dir = m.diff("L1").join("usr");
    xattr_set(&dir, "user.d", b"dir").unwrap();
    assert_eq!(xattr_get(&dir, "user.d").unwrap(), b"dir");
    assert_eq!(
        xattr_get(&m.local_diff("L1").join("usr"), "user.d").unwrap(),
        b"dir"
    );
    let link = m.diff("L1").join("etc/link");
    std::os::unix::fs::symlink("hostname", &link).unwrap();
    xattr_set(&link, "trusted.l", b"link").unwrap();
    assert_eq!(xattr_get(&link, "trusted.l").unwrap(), b"link");

    // Removing an attribute that is not there does not copy a remote file up.
    assert_eq!(
        errno_of(xattr_remove(&m.diff("L1").join("etc/passwd"), "user.none")),
        libc::ENODATA
    );
    assert!(!m.local_diff("L1").join("etc/passwd").exists());
}

#[test]
fn overlay_xattrs_set_through_the_view_are_stored_escaped() {
    let m = Mount::new();
    let d = m.diff("L1");
    let dir = d.join("usr/share");
    xattr_set(&dir, "trusted.overlay.opaque", b"y").unwrap();
    xattr_set(&dir, "trusted.overlay.redirect", b"/x").unwrap();
    xattr_set(&dir, "user.overlay.origin", b"o").unwrap();
    assert_eq!(xattr_get(&dir, "trusted.overlay.opaque").unwrap(), b"y");
    assert_eq!(xattr_get(&dir, "trusted.overlay.redirect").unwrap(), b"/x");
    assert_eq!(xattr_get(&dir, "user.overlay.origin").unwrap(), b"o");
    assert_eq!(
        xattr_list(&dir).unwrap(),
        vec![
            "trusted.overlay.opaque",
            "trusted.overlay.redirect",
            "user.overlay.origin"
        ]
    );
    let local = m.local_diff("L1").join("usr/share");
    assert_eq!(
        xattr_get(&local, "trusted.overlay.overlay.opaque").unwrap(),
        b"y"
    );
    assert_eq!(
        xattr_get(&local, "trusted.overlay.overlay.redirect").unwrap(),
        b"/x"
    );
    assert_eq!(
        xattr_get(&local, "user.overlay.overlay.origin").unwrap(),
        b"o"
    );
    assert_eq!(
        errno_of(xattr_get(&local, "trusted.overlay.opaque")),
        libc::ENODATA
    );
    // The directory is not made opaque by what a user wrote.
    assert_eq!(names(&dir), vec!["doc"]);
    xattr_remove(&dir, "trusted.overlay.opaque").unwrap();
    assert_eq!(
        errno_of(xattr_get(&local, "trusted.overlay.overlay.opaque")),
        libc::ENODATA
    );
}

#[test]
fn copied_up_xattrs_of_a_remote_file_with_overlay_names_are_escaped() {
    let m = Mount::with(Options::default(), |remote| {
        let f = remote
            .join("overlay/RO")
            .join(id("L1"))
            .join("diff/etc/passwd");
        xattr_set(&f, "trusted.overlay.thing", b"remote").unwrap();
        xattr_set(&f, "user.plain", b"p").unwrap();
    });
    let view = m.diff("L1").join("etc/passwd");
    assert_eq!(
        xattr_get(&view, "trusted.overlay.thing").unwrap(),
        b"remote"
    );
    fs::set_permissions(&view, fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        xattr_get(&view, "trusted.overlay.thing").unwrap(),
        b"remote"
    );
    assert_eq!(xattr_get(&view, "user.plain").unwrap(), b"p");
    let local = m.local_diff("L1").join("etc/passwd");
    assert_eq!(
        xattr_get(&local, "trusted.overlay.overlay.thing").unwrap(),
        b"remote"
    );
}

// ---- fallocate, fsync, statfs ----

fn fallocate(f: &fs::File, mode: i32, offset: i64, len: i64) -> std::io::Result<()> {
    if unsafe { libc::fallocate(f.as_raw_fd(), mode, offset, len) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[test]
fn fallocate_plain_keep_size_and_punch_hole() {
    let m = Mount::new();
    let p = m.diff("L1").join("falloc");
    let f = fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    fallocate(&f, 0, 0, 1 << 20).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 1 << 20);
    assert_eq!(fs::metadata(&p).unwrap().len(), 1 << 20);
    let blocks = fs::metadata(m.local_diff("L1").join("falloc"))
        .unwrap()
        .blocks();
    assert!(blocks * 512 >= 1 << 20);

    fallocate(&f, libc::FALLOC_FL_KEEP_SIZE, 1 << 20, 1 << 20).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().len(), 1 << 20);
    assert!(
        fs::metadata(m.local_diff("L1").join("falloc"))
            .unwrap()
            .blocks()
            * 512
            >= 2 << 20
    );

    let mut w = &f;
    w.write_all(&vec![0xab; 1 << 20]).unwrap();
    fallocate(
        &f,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        4096,
        8192,
    )
    .unwrap();
    drop(f);
    let data = fs::read(&p).unwrap();
    assert_eq!(data.len(), 1 << 20);
    assert!(data[..4096].iter().all(|b| *b == 0xab));
    assert!(data[4096..12288].iter().all(|b| *b == 0));
    assert!(data[12288..].iter().all(|b| *b == 0xab));
}

#[test]
fn fallocate_on_a_remote_file_copies_it_up() {
    let m = Mount::new();
    let p = m.diff("L1").join("etc/passwd");
    let before = fs::read(&p).unwrap();
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    fallocate(&f, 0, 0, 8192).unwrap();
    drop(f);
    let after = fs::read(&p).unwrap();
    assert_eq!(after.len(), 8192);
    assert_eq!(&after[..before.len()], &before[..]);
    assert_eq!(
        fs::metadata(m.local_diff("L1").join("etc/passwd"))
            .unwrap()
            .len(),
        8192
    );
}

#[test]
fn fsync_and_fdatasync() {
    let m = Mount::new();
    let p = m.diff("L1").join("etc/synced");
    let mut f = fs::File::create(&p).unwrap();
    f.write_all(b"durable").unwrap();
    f.sync_data().unwrap();
    f.sync_all().unwrap();
    drop(f);
    // On a remote file opened read-only, and on directories (merged and remote).
    fs::File::open(m.diff("L1").join("etc/passwd"))
        .unwrap()
        .sync_all()
        .unwrap();
    fs::File::open(m.diff("L1").join("etc"))
        .unwrap()
        .sync_all()
        .unwrap();
    fs::File::open(m.diff("L1").join("usr"))
        .unwrap()
        .sync_all()
        .unwrap();
    assert_eq!(
        fs::read(m.local_diff("L1").join("etc/synced")).unwrap(),
        b"durable"
    );
}

#[test]
fn statfs_reports_the_local_filesystem() {
    let m = Mount::new();
    let view = nix::sys::statvfs::statvfs(&m.mnt).unwrap();
    let local = nix::sys::statvfs::statvfs(&m.local).unwrap();
    assert_eq!(view.blocks(), local.blocks());
    assert_eq!(view.block_size(), local.block_size());
    assert_eq!(view.name_max(), 255);
    assert!(view.blocks_available() > 0);
    assert!(view.files() > 0);
    let out = std::process::Command::new("df")
        .arg(&m.mnt)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "df: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("layerfs"));
}

// ---- times, modes, owners ----

fn utimens(path: &Path, atime: TimeSpec, mtime: TimeSpec) {
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &atime,
        &mtime,
        nix::sys::stat::UtimensatFlags::FollowSymlink,
    )
    .unwrap();
}

#[test]
fn utimensat_explicit_now_and_omit() {
    let m = Mount::new();
    let p = m.diff("L1").join("etc/hostname");
    // (Reads update atime under relatime, so the content is checked first.)
    assert_eq!(fs::read(&p).unwrap(), b"fixture-base\n");
    utimens(
        &p,
        TimeSpec::new(1_000_000_000, 111),
        TimeSpec::new(1_100_000_000, 222),
    );
    let s = fs::metadata(&p).unwrap();
    assert_eq!((s.atime(), s.atime_nsec()), (1_000_000_000, 111));
    assert_eq!((s.mtime(), s.mtime_nsec()), (1_100_000_000, 222));
    let l = fs::metadata(m.local_diff("L1").join("etc/hostname")).unwrap();
    assert_eq!((l.mtime(), l.mtime_nsec()), (1_100_000_000, 222));

    // mtime now, atime untouched.
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    utimens(&p, TimeSpec::UTIME_OMIT, TimeSpec::UTIME_NOW);
    let s = fs::metadata(&p).unwrap();
    assert_eq!((s.atime(), s.atime_nsec()), (1_000_000_000, 111));
    assert!(s.mtime() >= before - 1, "mtime {} is now", s.mtime());
    // And the other way round.
    utimens(&p, TimeSpec::UTIME_NOW, TimeSpec::UTIME_OMIT);
    let s2 = fs::metadata(&p).unwrap();
    assert!(s2.atime() >= before - 1);
    assert_eq!((s2.mtime(), s2.mtime_nsec()), (s.mtime(), s.mtime_nsec()));
    // Times on a remote directory copy it up without touching its content.
    let dir = m.diff("L1").join("usr/share");
    utimens(&dir, TimeSpec::new(5, 0), TimeSpec::new(6, 0));
    assert_eq!(fs::metadata(&dir).unwrap().mtime(), 6);
    assert_eq!(
        fs::metadata(m.local_diff("L1").join("usr/share"))
            .unwrap()
            .mtime(),
        6
    );
    assert_eq!(names(&dir), vec!["doc"]);
}

#[test]
fn chmod_and_chown() {
    let m = Mount::new();
    let p = m.diff("L1").join("bin/hello");
    fs::set_permissions(&p, fs::Permissions::from_mode(0o4711)).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().mode() & 0o7777, 0o4711);
    std::os::unix::fs::chown(&p, Some(42), Some(43)).unwrap();
    let s = fs::metadata(&p).unwrap();
    assert_eq!((s.uid(), s.gid()), (42, 43));
    // Like the kernel: chown clears set-user-ID.
    assert_eq!(s.mode() & 0o7777, 0o711);
    let l = fs::metadata(m.local_diff("L1").join("bin/hello")).unwrap();
    assert_eq!((l.uid(), l.gid(), l.mode() & 0o7777), (42, 43, 0o711));
    assert_eq!(
        fs::metadata(m.remote_diff("L1").join("bin/hello"))
            .unwrap()
            .mode()
            & 0o7777,
        0o755
    );
    // Remote directories.
    let dir = m.diff("L1").join("usr/lib");
    std::os::unix::fs::chown(&dir, Some(7), None).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o750)).unwrap();
    let s = fs::metadata(&dir).unwrap();
    assert_eq!((s.uid(), s.gid(), s.mode() & 0o7777), (7, 0, 0o750));
    assert_eq!(names(&dir), vec!["libfake.so"]);
}

#[test]
fn set_id_bits_given_at_creation_are_kept() {
    let m = Mount::new();
    let d = m.diff("L1");
    let p = d.join("suid");
    fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o4755)
        .open(&p)
        .unwrap();
    assert_eq!(fs::metadata(&p).unwrap().mode() & 0o7777, 0o4755);
    assert_eq!(
        fs::metadata(m.local_diff("L1").join("suid"))
            .unwrap()
            .mode()
            & 0o7777,
        0o4755
    );
    // mknod with set-ID bits, as root.
    mknod(
        &d.join("suid-fifo"),
        SFlag::S_IFIFO,
        Mode::from_bits_truncate(0o6600),
        0,
    )
    .unwrap();
    assert_eq!(
        fs::metadata(d.join("suid-fifo")).unwrap().mode() & 0o7777,
        0o6600
    );
    // mkdir(2) drops set-group-ID from its mode (the kernel does, on any filesystem);
    // chmod sets it.
    fs::create_dir(d.join("sgid-dir")).unwrap();
    fs::set_permissions(d.join("sgid-dir"), fs::Permissions::from_mode(0o2775)).unwrap();
    assert_eq!(
        fs::metadata(d.join("sgid-dir")).unwrap().mode() & 0o7777,
        0o2775
    );
    assert_eq!(
        fs::metadata(m.local_diff("L1").join("sgid-dir"))
            .unwrap()
            .mode()
            & 0o7777,
        0o2775
    );
}

#[test]
fn new_entries_belong_to_the_caller() {
    let m = Mount::new();
    let d = m.diff("L1");
    fs::create_dir(d.join("pub")).unwrap();
    fs::set_permissions(d.join("pub"), fs::Permissions::from_mode(0o1777)).unwrap();
    let dir = d.join("pub");
    let script = format!(
        "cd '{}' && echo hi > f && mkdir g && ln -s f h && mkfifo i && ln f j",
        dir.display()
    );
    let (ok, out) = sh_as_nobody(&script);
    assert!(ok, "{out}");
    for n in ["f", "g", "h", "i", "j"] {
        let s = fs::symlink_metadata(dir.join(n)).unwrap();
        assert_eq!((s.uid(), s.gid()), (65534, 65534), "view owner of {n}");
        let l = fs::symlink_metadata(m.local_diff("L1").join("pub").join(n)).unwrap();
        assert_eq!((l.uid(), l.gid()), (65534, 65534), "local owner of {n}");
    }
    // The kernel enforces permissions: nobody cannot write a remote root-owned file.
    let (ok, _) = sh_as_nobody(&format!("echo x >> '{}'", d.join("etc/passwd").display()));
    assert!(!ok);
    assert!(
        !m.local_diff("L1").join("etc/passwd").exists(),
        "no copy-up for a refused open"
    );
    let (ok, _) = sh_as_nobody(&format!("touch '{}'", d.join("etc/new").display()));
    assert!(!ok);
    // Nor remove someone else's file in a sticky dir.
    fs::write(dir.join("roots"), "r").unwrap();
    let (ok, _) = sh_as_nobody(&format!("rm -f '{}'", dir.join("roots").display()));
    assert!(!ok);
    assert!(dir.join("roots").exists());
}

#[test]
fn setgid_dirs_pass_their_group_on() {
    let m = Mount::new();
    let d = m.diff("L1").join("shared");
    fs::create_dir(&d).unwrap();
    std::os::unix::fs::chown(&d, None, Some(4242)).unwrap();
    fs::set_permissions(&d, fs::Permissions::from_mode(0o2777)).unwrap();
    let (ok, out) = sh_as_nobody(&format!(
        "cd '{}' && echo x > f && mkdir sub && ln -s f l && mkfifo p",
        d.display()
    ));
    assert!(ok, "{out}");
    for n in ["f", "sub", "l", "p"] {
        let s = fs::symlink_metadata(d.join(n)).unwrap();
        assert_eq!((s.uid(), s.gid()), (65534, 4242), "owner of {n}");
    }
    let sub = fs::metadata(d.join("sub")).unwrap();
    assert_ne!(
        sub.mode() & 0o2000,
        0,
        "subdirectories inherit set-group-ID"
    );
    let f = fs::metadata(d.join("f")).unwrap();
    assert_eq!(f.mode() & 0o2000, 0);
    let l = fs::metadata(m.local_diff("L1").join("shared/sub")).unwrap();
    assert_eq!(l.gid(), 4242);
}

// ---- inode numbers ----

#[test]
fn inode_numbers_are_stable() {
    let m = Mount::new();
    let d = m.diff("L1");
    let paths = [
        d.join("etc/passwd"),
        d.join("etc/hostname"),
        d.join("usr/share/doc"),
        d.join("lib"),
        m.path("overlay").join(id("L1")),
        m.path("overlay/RO"),
    ];
    let ino = |p: &Path| fs::symlink_metadata(p).unwrap().ino();
    let first: Vec<u64> = paths.iter().map(|p| ino(p)).collect();
    let again: Vec<u64> = paths.iter().map(|p| ino(p)).collect();
    assert_eq!(first, again);
    let mut uniq = first.clone();
    uniq.sort();
    uniq.dedup();
    assert_eq!(
        uniq.len(),
        first.len(),
        "distinct objects, distinct numbers"
    );

    // Copy-up keeps the number.
    fs::OpenOptions::new()
        .append(true)
        .open(&paths[0])
        .unwrap()
        .write_all(b"x\n")
        .unwrap();
    fs::set_permissions(&paths[2], fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(d.join("new"), "n").unwrap();
    let new_ino = ino(&d.join("new"));
    assert_eq!(ino(&paths[0]), first[0]);
    assert_eq!(ino(&paths[2]), first[2]);

    drop_caches();
    let after: Vec<u64> = paths.iter().map(|p| ino(p)).collect();
    assert_eq!(after, first, "after the kernel forgot its inodes");
    assert_eq!(ino(&d.join("new")), new_ino);

    // readdir agrees with stat.
    for e in fs::read_dir(d.join("etc")).unwrap() {
        let e = e.unwrap();
        assert_eq!(
            std::os::unix::fs::DirEntryExt::ino(&e),
            ino(&e.path()),
            "d_ino of {:?}",
            e.file_name()
        );
    }
    // An open file keeps its number across its own copy-up.
    let mut f = fs::File::open(d.join("etc/os-release")).unwrap();
    let before = f.metadata().unwrap().ino();
    fs::OpenOptions::new()
        .append(true)
        .open(d.join("etc/os-release"))
        .unwrap()
        .write_all(b"y")
        .unwrap();
    assert_eq!(f.metadata().unwrap().ino(), before);
    let mut buf = Vec::new();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.read_to_end(&mut buf).unwrap();
    assert!(!buf.is_empty());
}

#[test]
fn nobody_creates_in_a_world_writable_remote_dir() {
    let m = Mount::with(Options::default(), |remote| {
        let t = remote.join("overlay/RO").join(id("L1")).join("diff/tmp");
        fs::create_dir(&t).unwrap();
        fs::set_permissions(&t, fs::Permissions::from_mode(0o1777)).unwrap();
        fs::write(t.join("theirs"), "owned by nobody\n").unwrap();
        std::os::unix::fs::chown(t.join("theirs"), Some(65534), Some(65534)).unwrap();
    });
    let t = m.diff("L1").join("tmp");
    let (ok, out) = sh_as_nobody(&format!(
        "cd '{}' && echo mine > mine && mkdir d && echo more >> theirs",
        t.display()
    ));
    assert!(ok, "{out}");
    for n in ["mine", "d", "theirs"] {
        let s = fs::symlink_metadata(t.join(n)).unwrap();
        assert_eq!((s.uid(), s.gid()), (65534, 65534), "owner of {n}");
    }
    assert_eq!(
        fs::read(t.join("theirs")).unwrap(),
        b"owned by nobody\nmore\n"
    );
    let local = m.local_diff("L1").join("tmp");
    let l = fs::metadata(&local).unwrap();
    assert_eq!(
        (l.uid(), l.mode() & 0o7777),
        (0, 0o1777),
        "the parent copied up as it was"
    );
    assert_eq!(fs::metadata(local.join("mine")).unwrap().uid(), 65534);
    assert_eq!(fs::metadata(local.join("theirs")).unwrap().uid(), 65534);
}

/// The view remembers that a file has no `security.capability` (the kernel asks before
/// every write); setting one through the view must be seen at once, and an unprivileged
/// write must still drop it, as on any filesystem.
#[test]
fn file_capabilities_are_seen_and_dropped_by_unprivileged_writes() {
    let m = Mount::new();
    let dir = m.path("caps");
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    let f = dir.join("tool");
    fs::write(&f, b"#!/bin/sh\n").unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o777)).unwrap();
    // Write once as root, so "no capability" is what the view has remembered.
    fs::OpenOptions::new()
        .append(true)
        .open(&f)
        .unwrap()
        .write_all(b"# a\n")
        .unwrap();
    assert_eq!(
        errno_of(xattr_get(&f, "security.capability")),
        libc::ENODATA
    );
    // VFS_CAP_REVISION_2 granting CAP_NET_BIND_SERVICE (bit 10) permitted.
    let mut caps = Vec::new();
    for word in [0x0200_0000u32, 1 << 10, 0, 0, 0] {
        caps.extend_from_slice(&word.to_le_bytes());
    }
    xattr_set(&f, "security.capability", &caps).unwrap();
    assert_eq!(xattr_get(&f, "security.capability").unwrap(), caps);
    let (ok, out) = sh_as_nobody(&format!("echo '# b' >> '{}'", f.display()));
    assert!(ok, "{out}");
    assert_eq!(
        errno_of(xattr_get(&f, "security.capability")),
        libc::ENODATA
    );
    let local = m.local.join("caps/tool");
    assert_eq!(
        errno_of(xattr_get(&local, "security.capability")),
        libc::ENODATA
    );
}

/// `chown(f, -1, -1)` changes nothing but the change time, as on ext4 (the kernel sends
/// layerfs a SETATTR with no field at all for it).
#[test]
fn chown_to_the_same_owner_moves_the_ctime() {
    let m = Mount::new();
    for p in [m.path("mine"), m.diff("L1").join("etc/hostname")] {
        if !p.exists() {
            fs::write(&p, "x").unwrap();
        }
        let before = fs::symlink_metadata(&p).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::os::unix::fs::chown(&p, None, None).unwrap();
        let after = fs::symlink_metadata(&p).unwrap();
        assert!(
            (after.ctime(), after.ctime_nsec()) > (before.ctime(), before.ctime_nsec()),
            "ctime of {}",
            p.display()
        );
        assert_eq!((after.uid(), after.gid()), (before.uid(), before.gid()));
    }
}
