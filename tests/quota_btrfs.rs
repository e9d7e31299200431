//! Quotas the kernel enforces (DESIGN §6): with local on btrfs, a quota root is a subvolume
//! whose qgroup carries the limit. Checked on a real btrfs in a loop image: the backend is
//! reported, the kernel stops writes at the limit with `EDQUOT`, `df` in the root shows
//! the limit, limits and usage survive a remount and a daemon killed mid-write, a populated
//! directory is converted with everything in it, and deleting a root gives its space back.

mod common;
mod quota_kit;

use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use quota_kit::*;

/// A mount whose local is a fresh btrfs of `mib` MiB, with `opts`; none where btrfs-progs
/// is missing (a failure when `LAYERFS_TEST_REQUIRE` names btrfs).
fn on_btrfs(opts: &str, mib: u64, btrfs: &mut LocalFs) -> Option<Mount> {
    if Command::new("mkfs.btrfs")
        .arg("--version")
        .output()
        .is_err()
    {
        missing_capability("btrfs", "mkfs.btrfs is not installed");
        return None;
    }
    let options = Options {
        opts: opts.into(),
        ..Options::default()
    };
    Some(Mount::with(options, |remote| {
        btrfs.btrfs(&local_beside(remote), mib);
    }))
}

fn is_subvolume(p: &Path) -> bool {
    let meta = fs::symlink_metadata(p).unwrap();
    meta.is_dir() && meta.ino() == 256
}

/// Bytes the local filesystem has in use, after a commit.
fn local_fs_used(m: &Mount) -> u64 {
    let f = fs::File::open(&m.local).unwrap();
    nix::unistd::syncfs(&f).unwrap();
    let st = nix::sys::statvfs::statvfs(&m.local).unwrap();
    (st.blocks() - st.blocks_free()) * st.fragment_size()
}

/// Polls `ok` for up to `secs` seconds.
fn eventually(secs: u64, what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ok() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_root_on_btrfs_is_a_subvolume_whose_qgroup_stops_writes_at_the_limit() {
    let mut btrfs = LocalFs::default();
    let Some(m) = on_btrfs("", 512, &mut btrfs) else {
        return;
    };
    let c1 = root(&m, "c1", "16M", &[]);
    let q = get(&m, "overlay/c1");
    assert_eq!((q.backend.as_str(), q.limit), ("btrfs", 16 * MIB));
    assert!(is_subvolume(&m.local.join("overlay/c1")));
    // The kernel's errno, whatever quota_errno says (it is for the FUSE backend).
    let written = fill_root(&c1, "f", libc::EDQUOT);
    assert!(
        (12 * MIB..=16 * MIB).contains(&written),
        "{written} bytes written into a 16 MiB root"
    );
    assert_eq!(
        fs::read(c1.join("f")).unwrap(),
        filled(MIB as usize, written)
    );
    let st = nix::sys::statvfs::statvfs(&c1).unwrap();
    assert_eq!(
        st.blocks() * st.fragment_size(),
        16 * MIB,
        "df shows the limit"
    );
    assert!(st.blocks_available() * st.fragment_size() <= 4 * MIB);
    // Outside the root, the filesystem is as large as it is.
    let outside = nix::sys::statvfs::statvfs(&m.path("overlay")).unwrap();
    assert!(outside.blocks() * outside.fragment_size() > 256 * MIB);
    let list = list(&m);
    assert_eq!(list.len(), 1);
    assert!(
        list[0].used >= written,
        "usage {} after a commit, {written} written",
        list[0].used
    );
    // Deleting makes room again: btrfs counts the free once its inode is closed (when the
    // kernel forgets it) and the transaction commits, which a write refused meanwhile
    // forces.
    fs::remove_file(c1.join("f")).unwrap();
    eventually(10, "the deleted file's room comes back", || {
        fs::File::create(c1.join("g"))
            .and_then(|mut f| f.write_all(&pattern(8 * MIB as usize, 3)))
            .is_ok()
    });
}

#[test]
fn limits_and_usage_survive_a_remount_and_a_daemon_killed_while_writing() {
    let mut btrfs = LocalFs::default();
    let Some(mut m) = on_btrfs("", 512, &mut btrfs) else {
        return;
    };
    let c1 = root(&m, "c1", "24M", &[]);
    fs::write(c1.join("kept"), pattern(4 * MIB as usize, 1)).unwrap();
    m.remount(&Options::default());
    let q = get(&m, "overlay/c1");
    assert_eq!((q.backend.as_str(), q.limit), ("btrfs", 24 * MIB));
    assert!(q.used >= 4 * MIB, "usage after a remount: {}", q.used);

    // kill -9 while a writer goes on.
    let path = c1.join("w");
    let writer = std::thread::spawn(move || {
        let Ok(mut f) = fs::File::create(&path) else {
            return;
        };
        let chunk = pattern(256 * KIB as usize, 9);
        while f.write_all(&chunk).is_ok() {}
    });
    std::thread::sleep(Duration::from_millis(300));
    m.kill_daemon();
    let _ = writer.join();
    m.mount(&Options::default());
    let q = get(&m, "overlay/c1");
    assert_eq!((q.backend.as_str(), q.limit), ("btrfs", 24 * MIB));
    assert_eq!(
        fs::read(c1.join("kept")).unwrap(),
        pattern(4 * MIB as usize, 1)
    );
    // The limit holds for what the crashed writer left and what comes after (a full root
    // refuses even the new file's inode).
    match fs::File::create(c1.join("after")) {
        Ok(mut f) => assert_eq!(fill(&mut f, MIB as usize, 1 << 30).1, libc::EDQUOT),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EDQUOT), "{e}"),
    }
    let used = allocated_under(&m.local.join("overlay/c1")).0;
    assert!(used <= 25 * MIB, "{used} bytes in a 24 MiB root");
}

#[test]
fn a_populated_directory_becomes_a_subvolume_with_everything_in_it() {
    let mut btrfs = LocalFs::default();
    let Some(m) = on_btrfs("", 512, &mut btrfs) else {
        return;
    };
    let dir = m.path("overlay/c1");
    fs::create_dir_all(dir.join("a/b")).unwrap();
    let big = pattern(3 * MIB as usize, 4);
    fs::write(dir.join("a/b/big"), &big).unwrap();
    fs::write(dir.join("small"), b"small").unwrap();
    fs::hard_link(dir.join("small"), dir.join("a/link")).unwrap();
    std::os::unix::fs::symlink("a/b/big", dir.join("sym")).unwrap();
    nix::unistd::mkfifo(
        &dir.join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o640),
    )
    .unwrap();
    xattr_set(&dir.join("small"), "user.note", b"kept").unwrap();
    fs::set_permissions(
        dir.join("a"),
        std::os::unix::fs::PermissionsExt::from_mode(0o750),
    )
    .unwrap();
    // Looked up, so the kernel holds these nodes across the conversion.
    let before = tree_hash(&dir);
    let inos: Vec<u64> = ["a", "a/b/big", "small", "a/link"]
        .iter()
        .map(|p| fs::symlink_metadata(dir.join(p)).unwrap().ino())
        .collect();
    let q = set(&m, "overlay/c1", "64M", &[]);
    assert_eq!(q.backend, "btrfs");
    assert!(
        q.used >= 3 * MIB,
        "the converted data is charged: {}",
        q.used
    );
    assert!(is_subvolume(&m.local.join("overlay/c1")));
    assert_eq!(tree_hash(&dir), before, "the tree is as it was");
    let after: Vec<u64> = ["a", "a/b/big", "small", "a/link"]
        .iter()
        .map(|p| fs::symlink_metadata(dir.join(p)).unwrap().ino())
        .collect();
    assert_eq!(after, inos, "the kernel's nodes keep their numbers");
    assert_eq!(fs::metadata(dir.join("small")).unwrap().nlink(), 2);
    assert_eq!(xattr_get(&dir.join("small"), "user.note").unwrap(), b"kept");
    // Nodes the kernel held point at the new objects: writes through them land there.
    fs::write(dir.join("a/link"), b"changed").unwrap();
    assert_eq!(fs::read(dir.join("small")).unwrap(), b"changed");
    assert_eq!(
        fs::read(m.local.join("overlay/c1/small")).unwrap(),
        b"changed"
    );
    // Nothing of the old tree, or of the work, is left in local.
    let names: Vec<String> = fs::read_dir(m.local.join("overlay"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["c1"], "local's overlay/ holds {names:?}");
}

#[test]
fn a_directory_with_an_open_file_is_not_converted() {
    let mut btrfs = LocalFs::default();
    let Some(m) = on_btrfs("", 512, &mut btrfs) else {
        return;
    };
    let dir = m.path("overlay/c1");
    fs::create_dir_all(&dir).unwrap();
    let open = fs::File::create(dir.join("busy")).unwrap();
    let err = quota_err(&m, "set", &["overlay/c1", "8M"]);
    assert!(err.contains("busy is open"), "{err}");
    assert!(!is_subvolume(&m.local.join("overlay/c1")));
    drop(open);
    m.released(&dir.join("busy"));
    assert_eq!(set(&m, "overlay/c1", "8M", &[]).backend, "btrfs");
}

#[test]
fn deleting_a_root_deletes_its_subvolume_and_gives_its_space_back() {
    let mut btrfs = LocalFs::default();
    let Some(m) = on_btrfs("", 512, &mut btrfs) else {
        return;
    };
    let c1 = root(&m, "c1", "100M", &[]);
    let empty = local_fs_used(&m);
    let mut f = fs::File::create(c1.join("data")).unwrap();
    f.write_all(&pattern(48 * MIB as usize, 5)).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let full = local_fs_used(&m);
    assert!(full >= empty + 40 * MIB, "{empty} -> {full}");
    let id = subvolume_id(&m.local.join("overlay/c1"));
    assert!(qgroups(&m).contains(&format!("0/{id}")));
    fs::remove_dir_all(&c1).unwrap();
    assert!(list(&m).is_empty());
    assert!(!m.local.join("overlay/c1").exists());
    eventually(30, "the deleted root's space comes back", || {
        local_fs_used(&m) < full - 40 * MIB
    });
    eventually(30, "the deleted root's qgroup goes", || {
        local_fs_used(&m);
        !qgroups(&m).contains(&format!("0/{id}"))
    });
}

/// The id of the btrfs subvolume at `p`.
fn subvolume_id(p: &Path) -> String {
    let out = Command::new("btrfs")
        .args(["inspect-internal", "rootid"])
        .arg(p)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The qgroup ids of local's btrfs, one per word.
fn qgroups(m: &Mount) -> Vec<String> {
    let out = Command::new("btrfs")
        .args(["qgroup", "show", "--raw"])
        .arg(&m.local)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

#[test]
fn clearing_keeps_the_subvolume_and_lifts_the_limit() {
    let mut btrfs = LocalFs::default();
    let Some(m) = on_btrfs("", 512, &mut btrfs) else {
        return;
    };
    let c1 = root(&m, "c1", "4M", &[]);
    fill_root(&c1, "f", libc::EDQUOT);
    quota_ok(&m, "clear", &["overlay/c1"]);
    assert!(is_subvolume(&m.local.join("overlay/c1")));
    fs::write(c1.join("more"), pattern(8 * MIB as usize, 2)).unwrap();
    // And it takes a quota again, without a conversion.
    assert_eq!(set(&m, "overlay/c1", "64M", &[]).backend, "btrfs");
}

#[test]
fn the_backend_follows_the_option_and_what_btrfs_can_express() {
    let mut btrfs = LocalFs::default();
    let Some(m) = on_btrfs("", 512, &mut btrfs) else {
        return;
    };
    // btrfs cannot count inodes: under auto, such a root is the daemon's.
    fs::create_dir_all(m.path("overlay/inodes")).unwrap();
    let q = set(&m, "overlay/inodes", "8M", &["--inodes", "10"]);
    assert_eq!((q.backend.as_str(), q.inode_limit), ("fuse", Some(10)));
    assert!(!is_subvolume(&m.local.join("overlay/inodes")));
    // A file moves between roots of different subvolumes as between XFS projects: rename
    // says EXDEV, and mv copies.
    let c1 = root(&m, "c1", "8M", &[]);
    fs::write(c1.join("f"), b"moving").unwrap();
    let err = fs::rename(c1.join("f"), m.path("overlay/f")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EXDEV));
    let mv = Command::new("mv")
        .arg(c1.join("f"))
        .arg(m.path("overlay/f"))
        .status()
        .unwrap();
    assert!(mv.success());
    assert_eq!(fs::read(m.path("overlay/f")).unwrap(), b"moving");
    drop(m);

    let mut btrfs = LocalFs::default();
    let Some(m) = on_btrfs("quota_backend=fuse", 512, &mut btrfs) else {
        return;
    };
    assert_eq!(root_backend(&m, "c1"), "fuse");
}

#[test]
fn quota_backend_btrfs_refuses_a_local_that_is_not_btrfs() {
    let m = Mount::with(
        Options {
            opts: "quota_backend=btrfs".into(),
            ..Options::default()
        },
        |_| {},
    );
    if fs::symlink_metadata(&m.local).is_ok_and(|_| is_btrfs(&m.local)) {
        return;
    }
    fs::create_dir_all(m.path("overlay/c1")).unwrap();
    let err = quota_err(&m, "set", &["overlay/c1", "8M"]);
    assert!(err.contains("local is not on btrfs"), "{err}");
    assert!(list(&m).is_empty());
}

fn root_backend(m: &Mount, name: &str) -> String {
    root(m, name, "8M", &[]);
    get(m, &format!("overlay/{name}")).backend
}

fn is_btrfs(p: &Path) -> bool {
    nix::sys::statfs::statfs(p).is_ok_and(|st| st.filesystem_type().0 == 0x9123_683e)
}

#[test]
fn what_an_interrupted_conversion_left_is_removed_when_it_is_tried_again() {
    use std::hash::{Hash, Hasher};
    let mut btrfs = LocalFs::default();
    let Some(m) = on_btrfs("", 512, &mut btrfs) else {
        return;
    };
    fs::create_dir_all(m.path("overlay/c1")).unwrap();
    fs::write(m.path("overlay/c1/f"), b"kept").unwrap();
    // A daemon killed before the swap left its half-made copy beside the directory, under
    // the name the conversion works under.
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    b"c1".as_slice().hash(&mut hasher);
    let tag = fs::metadata(&m.local).unwrap().ino();
    let temp = m.local.join(format!(
        "overlay/.layerfs-tmp.{tag:x}.subvolume.{:016x}",
        hasher.finish()
    ));
    let made = Command::new("btrfs")
        .args(["subvolume", "create"])
        .arg(&temp)
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    fs::write(temp.join("half"), pattern(MIB as usize, 1)).unwrap();
    let names = || -> Vec<String> {
        fs::read_dir(m.path("overlay"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n == "c1" || n.starts_with('.'))
            .collect()
    };
    assert_eq!(names(), ["c1"], "the view hides the leftover");
    assert_eq!(set(&m, "overlay/c1", "8M", &[]).backend, "btrfs");
    assert!(!temp.exists(), "the leftover copy is gone");
    assert_eq!(fs::read(m.path("overlay/c1/f")).unwrap(), b"kept");
}

#[test]
fn the_quota_attribute_reaches_the_btrfs_backend() {
    let mut btrfs = LocalFs::default();
    let Some(m) = on_btrfs("", 512, &mut btrfs) else {
        return;
    };
    let dir = m.path("overlay/c1");
    fs::create_dir_all(&dir).unwrap();
    xattr_set(&dir, XATTR, b"12M").unwrap();
    let q = get(&m, "overlay/c1");
    assert_eq!((q.backend.as_str(), q.limit), ("btrfs", 12 * MIB));
    assert_eq!(
        xattr_get(&dir, XATTR).unwrap(),
        (12 * MIB).to_string().as_bytes()
    );
    fill_root(&dir, "f", libc::EDQUOT);
    xattr_remove(&dir, XATTR).unwrap();
    assert!(list(&m).is_empty());
    fs::write(dir.join("g"), pattern(4 * MIB as usize, 1)).unwrap();
}

/// A writer appending to a file in the directory while it becomes a subvolume: whatever the
/// conversion does (succeed, start over, give up), no append is lost.
#[test]
fn a_directory_converted_under_a_live_writer_loses_nothing() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut btrfs = LocalFs::default();
    let Some(m) = on_btrfs("", 512, &mut btrfs) else {
        return;
    };
    let dir = m.path("overlay/c1");
    fs::create_dir_all(dir.join("many")).unwrap();
    for i in 0..400 {
        fs::write(
            dir.join(format!("many/f{i}")),
            pattern(16 * KIB as usize, i),
        )
        .unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, log) = (stop.clone(), dir.join("log"));
        std::thread::spawn(move || {
            let mut written = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let line = format!("{written}\n");
                let appended = fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .and_then(|mut f| f.write_all(line.as_bytes()));
                match appended {
                    Ok(()) => written += 1,
                    Err(e) => panic!("append {written}: {e}"),
                }
            }
            written
        })
    };
    let mut outcome = String::new();
    for _ in 0..20 {
        let out = quota_cmd(&m, "set", &["overlay/c1", "64M", "--json"]);
        if out.status.success() {
            outcome = "set".into();
            break;
        }
        outcome = text(&out.stderr);
        // Caught with the log open: the set is refused, and tried again.
        assert!(
            outcome.contains("is open") || outcome.contains("changed while"),
            "{outcome}"
        );
    }
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().unwrap();
    let log = fs::read_to_string(dir.join("log")).unwrap();
    let lines: Vec<u64> = log.lines().map(|l| l.parse().unwrap()).collect();
    let first_gap = lines
        .iter()
        .enumerate()
        .find(|&(i, n)| *n != i as u64)
        .map(|(i, n)| format!("line {i} holds {n}"));
    assert_eq!(
        (lines.len() as u64, first_gap),
        (written, None),
        "appends lost or reordered (quota set: {outcome})"
    );
    for i in 0..400 {
        assert_eq!(
            fs::read(dir.join(format!("many/f{i}"))).unwrap(),
            pattern(16 * KIB as usize, i)
        );
    }
    eprintln!("quota set under a live writer: {outcome}; {written} appends kept");
}
