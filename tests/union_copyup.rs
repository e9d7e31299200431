//! Copy-up on a real mount: what a write to a remote file puts into local (data, mode, owner,
//! times, xattrs), with passthrough on and off.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use common::*;

/// A fixed time with nanoseconds, far from "now".
const OLD_SEC: i64 = 1_600_000_000;
const OLD_NSEC: i64 = 123_456_789;

fn set_times(path: &Path, sec: i64, nsec: i64) {
    let t = nix::sys::time::TimeSpec::new(sec, nsec);
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &t,
        &t,
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .unwrap();
}

fn chown(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid)).unwrap();
}

fn l1_remote(remote: &Path) -> PathBuf {
    remote.join("overlay/RO").join(id("L1")).join("diff")
}

/// Gives `etc/os-release` in the remote copy an owner, a mode, an xattr and old times.
fn dress_os_release(remote: &Path) {
    let f = l1_remote(remote).join("etc/os-release");
    chown(&f, 1234, 5678);
    fs::set_permissions(&f, fs::Permissions::from_mode(0o640)).unwrap();
    xattr_set(&f, "user.origin", b"remote").unwrap();
    set_times(&f, OLD_SEC, OLD_NSEC);
}

#[test]
fn append_copies_data_mode_owner_and_xattrs() {
    let m = Mount::with(Options::default(), dress_os_release);
    let view = m.diff("L1").join("etc/os-release");
    let original = fs::read(m.remote_diff("L1").join("etc/os-release")).unwrap();
    let mut f = fs::OpenOptions::new().append(true).open(&view).unwrap();
    f.write_all(b"EXTRA=1\n").unwrap();
    drop(f);

    let mut want = original.clone();
    want.extend_from_slice(b"EXTRA=1\n");
    assert_eq!(fs::read(&view).unwrap(), want);

    let local = m.local_diff("L1").join("etc/os-release");
    assert_eq!(fs::read(&local).unwrap(), want);
    let lm = fs::symlink_metadata(&local).unwrap();
    assert_eq!(lm.mode() & 0o7777, 0o640);
    assert_eq!((lm.uid(), lm.gid()), (1234, 5678));
    assert_eq!(xattr_get(&local, "user.origin").unwrap(), b"remote");

    let vm = fs::metadata(&view).unwrap();
    assert_eq!(vm.mode() & 0o7777, 0o640);
    assert_eq!((vm.uid(), vm.gid()), (1234, 5678));
    assert_eq!(xattr_get(&view, "user.origin").unwrap(), b"remote");
    assert_eq!(vm.size() as usize, want.len());

    // The remote copy stays as it was.
    assert_eq!(
        fs::read(m.remote_diff("L1").join("etc/os-release")).unwrap(),
        original
    );
    assert_no_temp_names(&m.local);
}

#[test]
fn chmod_copy_up_keeps_the_mtime() {
    let m = Mount::with(Options::default(), dress_os_release);
    let view = m.diff("L1").join("etc/os-release");
    fs::set_permissions(&view, fs::Permissions::from_mode(0o600)).unwrap();
    let local = m.local_diff("L1").join("etc/os-release");
    let lm = fs::symlink_metadata(&local).unwrap();
    assert_eq!(lm.mode() & 0o7777, 0o600);
    assert_eq!((lm.mtime(), lm.mtime_nsec()), (OLD_SEC, OLD_NSEC));
    assert_eq!((lm.uid(), lm.gid()), (1234, 5678));
    let vm = fs::metadata(&view).unwrap();
    assert_eq!((vm.mtime(), vm.mtime_nsec()), (OLD_SEC, OLD_NSEC));
    assert_eq!(vm.mode() & 0o7777, 0o600);
    assert_eq!(
        fs::read(&local).unwrap(),
        fs::read(m.remote_diff("L1").join("etc/os-release")).unwrap()
    );
    assert_eq!(
        fs::metadata(m.remote_diff("L1").join("etc/os-release"))
            .unwrap()
            .mode()
            & 0o7777,
        0o640
    );
}

#[test]
fn o_trunc_open_of_a_remote_file() {
    let m = Mount::with(Options::default(), dress_os_release);
    let view = m.diff("L1").join("etc/os-release");
    let mut f = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&view)
        .unwrap();
    assert_eq!(fs::metadata(&view).unwrap().len(), 0);
    f.write_all(b"short").unwrap();
    drop(f);
    assert_eq!(fs::read(&view).unwrap(), b"short");
    let local = m.local_diff("L1").join("etc/os-release");
    assert_eq!(fs::read(&local).unwrap(), b"short");
    let lm = fs::symlink_metadata(&local).unwrap();
    assert_eq!(
        (lm.uid(), lm.gid(), lm.mode() & 0o7777),
        (1234, 5678, 0o640)
    );
    assert_eq!(xattr_get(&local, "user.origin").unwrap(), b"remote");
    assert_eq!(
        fs::metadata(m.remote_diff("L1").join("etc/os-release"))
            .unwrap()
            .len(),
        101
    );
}

#[test]
fn truncate_of_a_remote_file() {
    let m = Mount::new();
    let view = m.diff("L1").join("etc/passwd");
    let original = fs::read(&view).unwrap();
    nix::unistd::truncate(&view, 5).unwrap();
    assert_eq!(fs::read(&view).unwrap(), &original[..5]);
    assert_eq!(
        fs::read(m.local_diff("L1").join("etc/passwd")).unwrap(),
        &original[..5]
    );
    // Growing fills with zeros.
    nix::unistd::truncate(&view, 10).unwrap();
    let mut want = original[..5].to_vec();
    want.resize(10, 0);
    assert_eq!(fs::read(&view).unwrap(), want);
    // Truncating another remote file to zero.
    let host = m.diff("L1").join("etc/hostname");
    nix::unistd::truncate(&host, 0).unwrap();
    assert_eq!(fs::read(&host).unwrap(), b"");
    assert_eq!(
        fs::metadata(m.local_diff("L1").join("etc/hostname"))
            .unwrap()
            .len(),
        0
    );
    assert_eq!(
        fs::read(m.remote_diff("L1").join("etc/passwd")).unwrap(),
        original
    );
}

const MIB: usize = 1 << 20;

/// 64 MiB: 16 MiB of data, a 32 MiB hole, 16 MiB of data.
fn big_remote(remote: &Path) {
    let mut f = fs::File::create(l1_remote(remote).join("big.bin")).unwrap();
    f.write_all(&pattern(16 * MIB, 1)).unwrap();
    f.seek(SeekFrom::Start(48 * MIB as u64)).unwrap();
    f.write_all(&pattern(16 * MIB, 2)).unwrap();
}

fn big_expected() -> Vec<u8> {
    let mut want = pattern(16 * MIB, 1);
    want.resize(48 * MIB, 0);
    want.extend_from_slice(&pattern(16 * MIB, 2));
    want
}

fn copy_up_big(opts: Options) {
    let m = Mount::with(opts, big_remote);
    let view = m.diff("L1").join("big.bin");
    // A write of one byte in the middle copies the whole file up.
    let mut f = fs::OpenOptions::new().write(true).open(&view).unwrap();
    f.seek(SeekFrom::Start(20 * MIB as u64)).unwrap();
    f.write_all(b"!").unwrap();
    drop(f);
    let mut want = big_expected();
    want[20 * MIB] = b'!';
    let got = fs::read(&view).unwrap();
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the copied-up file reads back identically");
    let local = m.local_diff("L1").join("big.bin");
    assert!(fs::read(&local).unwrap() == want);
    // The hole stayed a hole (well under 64 MiB allocated).
    assert!(fs::metadata(&local).unwrap().blocks() * 512 < 40 * MIB as u64);
    assert!(fs::read(m.remote_diff("L1").join("big.bin")).unwrap() == big_expected());
}

#[test]
fn a_64_mib_remote_file_copies_up_identically() {
    copy_up_big(Options::default());
}

#[test]
fn a_64_mib_remote_file_copies_up_identically_without_passthrough() {
    copy_up_big(Options {
        opts: "nopassthrough".into(),
        ..Default::default()
    });
}

#[test]
fn copy_up_in_a_deep_dir_recreates_the_parents_attributes() {
    let m = Mount::with(Options::default(), |remote| {
        let d = l1_remote(remote);
        let dirs = [
            ("a", 0o750, 1001, 2001),
            ("a/b", 0o711, 1002, 2002),
            ("a/b/c", 0o700, 1003, 2003),
        ];
        for (rel, _, _, _) in dirs {
            fs::create_dir(d.join(rel)).unwrap();
        }
        fs::write(d.join("a/b/c/file"), "deep\n").unwrap();
        for (i, (rel, mode, uid, gid)) in dirs.into_iter().enumerate().rev() {
            let p = d.join(rel);
            chown(&p, uid, gid);
            fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
            xattr_set(&p, "user.level", rel.as_bytes()).unwrap();
            set_times(&p, OLD_SEC + i as i64, OLD_NSEC);
        }
    });
    let f = m.diff("L1").join("a/b/c/file");
    fs::OpenOptions::new()
        .append(true)
        .open(&f)
        .unwrap()
        .write_all(b"more\n")
        .unwrap();
    assert_eq!(fs::read(&f).unwrap(), b"deep\nmore\n");
    let local = m.local_diff("L1");
    for (i, (rel, mode, uid, gid)) in [
        ("a", 0o750, 1001, 2001),
        ("a/b", 0o711, 1002, 2002),
        ("a/b/c", 0o700, 1003, 2003),
    ]
    .into_iter()
    .enumerate()
    {
        let md = fs::symlink_metadata(local.join(rel)).unwrap();
        assert!(md.is_dir());
        assert_eq!(md.mode() & 0o7777, mode, "mode of {rel}");
        assert_eq!((md.uid(), md.gid()), (uid, gid), "owner of {rel}");
        assert_eq!(
            xattr_get(&local.join(rel), "user.level").unwrap(),
            rel.as_bytes()
        );
        assert_eq!(
            (md.mtime(), md.mtime_nsec()),
            (OLD_SEC + i as i64, OLD_NSEC),
            "mtime of {rel}"
        );
        // The view shows the same.
        let vm = fs::metadata(m.diff("L1").join(rel)).unwrap();
        assert_eq!((vm.mode() & 0o7777, vm.uid(), vm.gid()), (mode, uid, gid));
    }
    assert_eq!(names(&local.join("a/b/c")), vec!["file"]);
}

#[test]
fn copy_up_of_symlinks_and_special_files_by_chown() {
    let m = Mount::new();
    let d = m.diff("L1");
    // lchown on a remote symlink copies the symlink itself up.
    std::os::unix::fs::lchown(d.join("lib"), Some(7), Some(8)).unwrap();
    let local = m.local_diff("L1").join("lib");
    let md = fs::symlink_metadata(&local).unwrap();
    assert!(md.file_type().is_symlink());
    assert_eq!(fs::read_link(&local).unwrap(), Path::new("usr/lib"));
    assert_eq!((md.uid(), md.gid()), (7, 8));
    let vm = fs::symlink_metadata(d.join("lib")).unwrap();
    assert_eq!((vm.uid(), vm.gid()), (7, 8));
    assert_eq!(fs::read_link(d.join("lib")).unwrap(), Path::new("usr/lib"));
    assert!(d.join("lib/libfake.so").is_file());
}

#[test]
fn no_temporaries_after_many_copy_ups() {
    let m = Mount::new();
    for label in ["L1", "L2", "L3", "L4"] {
        let d = m.diff(label);
        for e in walk_files(&d) {
            let mut f = fs::OpenOptions::new().append(true).open(&e).unwrap();
            f.write_all(b"#\n").unwrap();
            for n in names(e.parent().unwrap()) {
                assert!(!n.starts_with(".layerfs-tmp."), "{n} visible in the view");
            }
        }
    }
    assert_no_temp_names(&m.local);
}

fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let ft = e.file_type().unwrap();
        if ft.is_dir() {
            out.extend(walk_files(&e.path()));
        } else if ft.is_file() {
            out.push(e.path());
        }
    }
    out.sort();
    out
}

/// Reads, writes and copy-ups, with a read-only handle on the remote file held open across
/// the copy-up.
fn read_write_scenario(opts: Options) {
    let m = Mount::with(opts, |_| {});
    let d = m.diff("L1");
    let remote_bytes = fs::read(m.remote_diff("L1").join("usr/lib/libfake.so")).unwrap();
    let lib = d.join("usr/lib/libfake.so");
    assert_eq!(fs::read(&lib).unwrap(), remote_bytes);

    // Held open read-only from before the copy-up.
    let mut early = fs::File::open(&lib).unwrap();
    let mut first = [0u8; 16];
    early.read_exact(&mut first).unwrap();
    assert_eq!(&first, &remote_bytes[..16]);

    let mut w = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&lib)
        .unwrap();
    w.write_all(b"PATCHED!").unwrap();
    w.seek(SeekFrom::Start(0)).unwrap();
    let mut through_same = vec![0u8; 8];
    w.read_exact(&mut through_same).unwrap();
    assert_eq!(&through_same, b"PATCHED!");
    drop(w);

    let mut want = remote_bytes.clone();
    want[..8].copy_from_slice(b"PATCHED!");
    assert_eq!(fs::read(&lib).unwrap(), want, "a fresh open sees the write");
    assert_eq!(
        fs::read(m.local_diff("L1").join("usr/lib/libfake.so")).unwrap(),
        want
    );
    drop(early);
    assert_eq!(fs::read(&lib).unwrap(), want);

    // A new file: write, reopen, read, append.
    let new = d.join("usr/lib/new.bin");
    let data = pattern(3 * MIB + 17, 9);
    fs::write(&new, &data).unwrap();
    assert_eq!(fs::read(&new).unwrap(), data);
    let mut a = fs::OpenOptions::new().append(true).open(&new).unwrap();
    a.write_all(b"tail").unwrap();
    drop(a);
    let mut want_new = data.clone();
    want_new.extend_from_slice(b"tail");
    assert_eq!(fs::read(&new).unwrap(), want_new);
    assert_eq!(
        fs::read(m.local_diff("L1").join("usr/lib/new.bin")).unwrap(),
        want_new
    );

    // A memory map of a copied-up file sees its content.
    let f = fs::File::open(&lib).unwrap();
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            want.len(),
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED, "mmap of a copied-up file");
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, want.len()) };
    assert_eq!(bytes, &want[..]);
    unsafe { libc::munmap(ptr, want.len()) };
}

#[test]
fn read_write_copy_up_with_passthrough() {
    read_write_scenario(Options::default());
}

#[test]
fn read_write_copy_up_without_passthrough() {
    read_write_scenario(Options {
        opts: "nopassthrough".into(),
        ..Default::default()
    });
}

/// A remote file opened for writing is copied up while another request removes its name,
/// or renames a file over it. The copy took its name after the removal (or the rename) and
/// found it taken: the open failed with `EEXIST`, which an open without `O_CREAT` never
/// returns, and an unlink that met the copy half-way failed the same way.
#[test]
fn a_name_removed_or_replaced_during_its_copy_up_leaves_both_calls_whole() {
    const FILES: usize = 6;
    const SIZE: usize = 24 << 20;
    let m = Mount::with(Options::default(), |remote| {
        let dir = l1_remote(remote).join("big");
        fs::create_dir_all(&dir).unwrap();
        for i in 0..FILES {
            fs::write(dir.join(format!("f{i}")), pattern(SIZE, i as u64)).unwrap();
        }
    });
    let dir = m.diff("L1").join("big");
    for i in 0..FILES {
        let name = dir.join(format!("f{i}"));
        let replace = i % 2 == 1;
        let other = dir.join(format!("other{i}"));
        if replace {
            fs::write(&other, b"the new content").unwrap();
        }
        fs::metadata(&name).unwrap();
        let opener = {
            let name = name.clone();
            std::thread::spawn(move || fs::OpenOptions::new().write(true).open(&name).map(drop))
        };
        std::thread::sleep(std::time::Duration::from_millis(5));
        let change = if replace {
            fs::rename(&other, &name)
        } else {
            fs::remove_file(&name)
        };
        let opened = opener.join().unwrap();
        let what = if replace { "renamed over" } else { "removed" };
        change.unwrap_or_else(|e| panic!("f{i} {what} during its copy-up: {e}"));
        if let Err(e) = opened {
            assert_eq!(
                e.raw_os_error(),
                Some(libc::ENOENT),
                "open of f{i} while it was {what}: {e}"
            );
        }
        if replace {
            assert_eq!(fs::read(&name).unwrap(), b"the new content");
        } else {
            assert!(fs::symlink_metadata(&name).is_err(), "f{i} is still there");
            assert!(!names(&dir).contains(&format!("f{i}")));
        }
    }
    assert_no_temp_names(&m.local);
}

/// A handle opened on a remote file before its copy-up reads the copy (as kernel overlayfs
/// redirects it), and `copy_file_range` from it must copy what it reads: it copied the
/// remote original. Without passthrough, where the daemon serves both.
#[test]
fn copy_file_range_from_a_handle_opened_before_the_copy_up_copies_the_copy() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let m = Mount::with(
        Options {
            opts: "nopassthrough".into(),
            ..Default::default()
        },
        |_| {},
    );
    let lib = m.diff("L1").join("usr/lib/libfake.so");
    let early = fs::File::open(&lib).unwrap();
    let len = early.metadata().unwrap().len() as usize;
    fs::OpenOptions::new()
        .write(true)
        .open(&lib)
        .unwrap()
        .write_all_at(b"PATCHED!", 0)
        .unwrap();
    let mut read = vec![0u8; len];
    early.read_exact_at(&mut read, 0).unwrap();
    assert_eq!(&read[..8], b"PATCHED!", "a read through the early handle");

    let out = fs::File::create(m.diff("L1").join("usr/lib/copied.so")).unwrap();
    let (mut off_in, mut off_out) = (0i64, 0i64);
    let mut copied = 0;
    while copied < len {
        let n = unsafe {
            libc::copy_file_range(
                early.as_raw_fd(),
                &mut off_in,
                out.as_raw_fd(),
                &mut off_out,
                len - copied,
                0,
            )
        };
        assert!(
            n > 0,
            "copy_file_range: {}",
            std::io::Error::last_os_error()
        );
        copied += n as usize;
    }
    drop(out);
    let copied = fs::read(m.diff("L1").join("usr/lib/copied.so")).unwrap();
    assert!(
        copied == read,
        "the copy begins {:?}, the handle reads {:?}",
        &copied[..8],
        &read[..8]
    );
}

// ---- An open that may write copies up at its first change ----

/// Both I/O modes: an open of a remote file for writing is served through the daemon until
/// its first change, whatever the mount offers.
fn both_modes(check: impl Fn(&Mount, &str)) {
    for opts in ["passthrough", "nopassthrough"] {
        let m = Mount::with(
            Options {
                opts: opts.into(),
                ..Options::default()
            },
            |_| {},
        );
        check(&m, opts);
    }
}

#[test]
fn an_open_for_writing_that_changes_nothing_copies_nothing_up() {
    both_modes(|m, opts| {
        let view = m.diff("L1").join("etc/passwd");
        let remote = m.remote_diff("L1").join("etc/passwd");
        let original = fs::read(&view).unwrap();
        // A writer opened while the reader's RELEASE is on its way would share its open
        // of the remote file, and copy up at once (see `Mount::released`).
        m.released(&remote);
        let mut f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&view)
            .unwrap();
        let mut got = Vec::new();
        f.read_to_end(&mut got).unwrap();
        assert_eq!(got, original, "-o {opts}: read through a writer");
        drop(f);
        m.released(&remote);
        assert!(
            !m.local_diff("L1").join("etc/passwd").exists(),
            "-o {opts}: an open that wrote nothing made a copy"
        );
        // Its first write copies the file up whole.
        let mut f = fs::OpenOptions::new().write(true).open(&view).unwrap();
        f.seek(SeekFrom::Start(2)).unwrap();
        f.write_all(b"XY").unwrap();
        drop(f);
        let mut want = original.clone();
        want[2..4].copy_from_slice(b"XY");
        assert_eq!(fs::read(&view).unwrap(), want, "-o {opts}: view");
        assert_eq!(
            fs::read(m.local_diff("L1").join("etc/passwd")).unwrap(),
            want,
            "-o {opts}: local"
        );
    });
}

#[test]
fn writers_opened_before_the_copy_up_share_the_copy() {
    both_modes(|m, opts| {
        let view = m.diff("L1").join("etc/passwd");
        let original = fs::read(&view).unwrap();
        let mut reader = fs::File::open(&view).unwrap();
        let open_rw = || {
            fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&view)
                .unwrap()
        };
        let (mut a, mut b) = (open_rw(), open_rw());
        a.write_all(b"aa").unwrap();
        b.seek(SeekFrom::Start(4)).unwrap();
        b.write_all(b"bb").unwrap();
        let mut want = original.clone();
        want[..2].copy_from_slice(b"aa");
        want[4..6].copy_from_slice(b"bb");
        // A passthrough reader opened before the copy-up reads the remote file, as
        // overlayfs's readers do; one served by the daemon reads the copy.
        let mut all = vec![("a", &mut a), ("b", &mut b)];
        if opts == "nopassthrough" {
            all.push(("the reader", &mut reader));
        }
        for (who, f) in all {
            let mut got = Vec::new();
            f.seek(SeekFrom::Start(0)).unwrap();
            f.read_to_end(&mut got).unwrap();
            assert_eq!(got, want, "-o {opts}: {who} reads");
        }
    });
}

#[test]
fn a_name_replaced_under_a_writer_that_has_not_written_keeps_both() {
    both_modes(|m, opts| {
        let dir = m.diff("L1").join("etc");
        let original = fs::read(dir.join("passwd")).unwrap();
        let mut f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.join("passwd"))
            .unwrap();
        fs::write(dir.join("new"), b"replacement").unwrap();
        fs::rename(dir.join("new"), dir.join("passwd")).unwrap();
        // The writer's first change copies up the file it opened, not the name's new file.
        f.write_all(b"zz").unwrap();
        let mut want = original.clone();
        want[..2].copy_from_slice(b"zz");
        let mut got = Vec::new();
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_to_end(&mut got).unwrap();
        assert_eq!(got, want, "-o {opts}: the writer's file");
        drop(f);
        assert_eq!(
            fs::read(dir.join("passwd")).unwrap(),
            b"replacement",
            "-o {opts}: the name's new file"
        );
        assert_no_temp_names(&m.local);
    });
}
