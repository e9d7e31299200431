//! Quotas on real mounts (DESIGN §6) where names change: the inode limit, and a full root's
//! refusal of new inodes; what unlink and the last close of an unlinked file credit back;
//! and which hard links and renames may cross a root's boundary. A file takes its usage
//! with it; a directory, or a file with another link, does not move at all (`EXDEV`, as
//! between XFS projects), since counting it would walk a tree inside the rename, or leave
//! its space charged to the root it left.
//!
//! Data written into a root is in `tests/quota_data.rs`; setting, reading and keeping
//! quotas in `tests/quota_control.rs`.

mod common;
mod quota_kit;

use std::fs;
use std::io::{Read, Write};
use std::path::Path;

use common::*;
use quota_kit::*;

// ---- Inodes ------------------------------------------------------------------------------

#[test]
fn the_inode_limit_counts_every_new_inode() {
    let m = mount();
    let c1 = root(&m, "c1", "8M", &["--inodes", "5"]);
    let q = get(&m, "overlay/c1");
    assert_eq!((q.inode_limit, q.inodes_used), (Some(5), 1));
    fs::write(c1.join("f1"), "1").unwrap();
    fs::create_dir(c1.join("d1")).unwrap();
    std::os::unix::fs::symlink("f1", c1.join("s1")).unwrap();
    nix::unistd::mkfifo(
        &c1.join("p1"),
        nix::sys::stat::Mode::from_bits_truncate(0o644),
    )
    .unwrap();
    assert_eq!(get(&m, "overlay/c1").inodes_used, 5);

    assert_errno("create", fs::File::create(c1.join("f2")), libc::ENOSPC);
    assert_errno("mkdir", fs::create_dir(c1.join("d2")), libc::ENOSPC);
    assert_errno(
        "symlink",
        std::os::unix::fs::symlink("f1", c1.join("s2")),
        libc::ENOSPC,
    );
    assert_errno(
        "mkfifo",
        nix::unistd::mkfifo(
            &c1.join("p2"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .map_err(std::io::Error::from),
        libc::ENOSPC,
    );
    assert!(!c1.join("f2").exists() && !c1.join("d2").exists());
    // A hard link is no new inode.
    fs::hard_link(c1.join("f1"), c1.join("d1/f1-again")).unwrap();
    assert_eq!(get(&m, "overlay/c1").inodes_used, 5);

    fs::remove_file(c1.join("p1")).unwrap();
    let q = get(&m, "overlay/c1");
    assert_eq!(q.inodes_used, 4);
    fs::write(c1.join("f2"), "2").expect("room for one inode again");
    assert_eq!(get(&m, "overlay/c1").inodes_used, 5);
    assert_eq!(allocated_under(&m.local.join("overlay/c1")).1, 5);
}

#[test]
fn a_full_root_refuses_mkdir_and_symlinks_that_need_a_block() {
    let m = mount();
    let c1 = root(&m, "c1", "4M", &[]);
    fill_root(&c1, "full", libc::ENOSPC);
    assert_errno("mkdir", fs::create_dir(c1.join("d")), libc::ENOSPC);
    let long = "t".repeat(300);
    assert_errno(
        "symlink with a 300-byte target",
        std::os::unix::fs::symlink(&long, c1.join("s")),
        libc::ENOSPC,
    );
    assert!(!c1.join("d").exists());
    assert!(fs::symlink_metadata(c1.join("s")).is_err());
    let q = get(&m, "overlay/c1");
    assert!(q.used <= q.limit + SLACK, "{q:?}");
}

/// DESIGN §6 lists create/mkdir/symlink/mknod among the calls a full root refuses, even
/// when the object needs no data block.
#[test]
fn a_full_root_refuses_new_inodes() {
    let m = mount();
    let c1 = root(&m, "c1", "4M", &[]);
    fill_root(&c1, "full", libc::ENOSPC);
    assert_errno("create", fs::File::create(c1.join("f")), libc::ENOSPC);
    assert_errno(
        "short symlink",
        std::os::unix::fs::symlink("x", c1.join("s")),
        libc::ENOSPC,
    );
    assert_errno(
        "mkfifo",
        nix::unistd::mkfifo(
            &c1.join("p"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .map_err(std::io::Error::from),
        libc::ENOSPC,
    );
}

// ---- Crediting space back ----------------------------------------------------------------

#[test]
fn unlink_credits_the_space_back() {
    let m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    let base = used(&m, "overlay/c1");
    fill_root(&c1, "a", libc::ENOSPC);
    assert_errno(
        "write into a full root",
        fs::write(c1.join("b"), [1u8; 8192]),
        libc::ENOSPC,
    );
    fs::remove_file(c1.join("a")).unwrap();
    used_until(&m, "overlay/c1", "unlink credits", |u| u <= base + SLACK);
    fs::write(c1.join("b"), pattern(4 * MIB as usize, 1)).expect("room after an unlink");

    // A file with two links is credited when the last one goes.
    fs::hard_link(c1.join("b"), c1.join("b2")).unwrap();
    let two = used(&m, "overlay/c1");
    fs::remove_file(c1.join("b")).unwrap();
    assert_eq!(used(&m, "overlay/c1"), two, "one link of two is gone");
    fs::remove_file(c1.join("b2")).unwrap();
    used_until(&m, "overlay/c1", "the last link credits", |u| {
        u <= base + SLACK
    });
    // Removing a directory credits its block.
    fs::create_dir(c1.join("d")).unwrap();
    let with_dir = used(&m, "overlay/c1");
    assert!(with_dir >= base + 4096, "mkdir charged nothing");
    fs::remove_dir(c1.join("d")).unwrap();
    used_until(&m, "overlay/c1", "rmdir credits", |u| u < with_dir);
    assert_usage_matches_local(&m, "overlay/c1");
}

#[test]
fn an_open_unlinked_file_is_credited_at_its_last_close() {
    let m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    let base = used(&m, "overlay/c1");
    let p = c1.join("f");
    let mut w = fs::File::create(&p).unwrap();
    w.write_all(&pattern(4 * MIB as usize, 2)).unwrap();
    let r = fs::File::open(&p).unwrap();
    fs::remove_file(&p).unwrap();
    assert!(!p.exists());
    let u = used(&m, "overlay/c1");
    assert!(
        u >= base + 4 * MIB,
        "an open unlinked file still takes its space: {u}"
    );
    // It can still grow, and that is charged (and limited).
    w.write_all(&pattern(MIB as usize, 3)).unwrap();
    assert!(used(&m, "overlay/c1") >= base + 5 * MIB);
    let (_, e) = fill(&mut w, MIB as usize, 1 << 30);
    assert_eq!(e, libc::ENOSPC, "{}", errname(e));
    drop(w);
    // One handle is still open.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        used(&m, "overlay/c1") >= base + 5 * MIB,
        "credited while a handle is still open"
    );
    let mut head = [0u8; 16];
    (&r).read_exact(&mut head).unwrap();
    assert_eq!(head[..], pattern(16, 2)[..]);
    drop(r);
    used_until(&m, "overlay/c1", "credited at the last close", |u| {
        u <= base + SLACK
    });
    assert_usage_matches_local(&m, "overlay/c1");
}

// ---- Hard links and renames --------------------------------------------------------------

#[test]
fn hard_links_across_root_boundaries_fail_with_exdev() {
    let m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    let c2 = root(&m, "c2", "8M", &[]);
    let out = m.path("overlay/outside");
    fs::create_dir(&out).unwrap();
    write_file(&c1.join("f"), MIB as usize, 1);
    write_file(&out.join("g"), MIB as usize, 2);
    let (u1_before, u2) = (used(&m, "overlay/c1"), used(&m, "overlay/c2"));

    assert_errno(
        "link root -> other root",
        fs::hard_link(c1.join("f"), c2.join("f")),
        libc::EXDEV,
    );
    assert_errno(
        "link root -> outside",
        fs::hard_link(c1.join("f"), out.join("f")),
        libc::EXDEV,
    );
    assert_errno(
        "link outside -> root",
        fs::hard_link(out.join("g"), c1.join("g")),
        libc::EXDEV,
    );
    assert!(!c2.join("f").exists() && !out.join("f").exists() && !c1.join("g").exists());

    // Inside one root a link is free.
    fs::create_dir(c1.join("sub")).unwrap();
    let u1 = used(&m, "overlay/c1");
    assert!(u1 > u1_before, "mkdir charged nothing");
    fs::hard_link(c1.join("f"), c1.join("sub/f2")).unwrap();
    assert_eq!(used(&m, "overlay/c1"), u1);
    assert_eq!(used(&m, "overlay/c2"), u2);
    assert_usage_matches_local(&m, "overlay/c1");
}

#[test]
fn rename_into_a_full_root_fails_and_moves_nothing() {
    let m = mount();
    let c1 = root(&m, "c1", "4M", &[]);
    fill_root(&c1, "full", libc::ENOSPC);
    let u = used(&m, "overlay/c1");
    let out = m.path("overlay/outside");
    fs::create_dir(&out).unwrap();
    let data = write_file(&out.join("f"), 2 * MIB as usize, 3);
    assert_errno(
        "rename of a 2 MiB file into a full root",
        rename_once_closed(&out.join("f"), &c1.join("f")),
        libc::ENOSPC,
    );
    assert!(
        fs::read(out.join("f")).unwrap() == data,
        "the source is intact"
    );
    assert!(!c1.join("f").exists());
    assert_eq!(used(&m, "overlay/c1"), u);
    // A directory does not move between roots at all (see below).
    fs::create_dir(out.join("d")).unwrap();
    write_file(&out.join("d/x"), MIB as usize, 4);
    assert_errno(
        "rename of a directory into a full root",
        fs::rename(out.join("d"), c1.join("d")),
        libc::EXDEV,
    );
    assert!(out.join("d/x").is_file());
    // Renames inside the full root cost nothing.
    fs::rename(c1.join("full"), c1.join("still-full")).unwrap();
    assert_eq!(used(&m, "overlay/c1"), u);
}

#[test]
fn rename_moves_usage_between_roots() {
    let m = mount();
    let c2 = root(&m, "c2", "8M", &[]);
    let c3 = root(&m, "c3", "8M", &[]);
    let out = m.path("overlay/outside");
    fs::create_dir(&out).unwrap();
    let (b2, b3) = (used(&m, "overlay/c2"), used(&m, "overlay/c3"));
    let data = write_file(&out.join("f"), 2 * MIB as usize, 5);

    rename_when_closed(&out.join("f"), &c2.join("f"));
    assert_close(
        "c2 after a 2 MiB file moved in",
        used(&m, "overlay/c2"),
        b2 + 2 * MIB,
        SLACK,
    );
    assert_eq!(get(&m, "overlay/c2").inodes_used, 2);
    fs::rename(c2.join("f"), c3.join("f")).unwrap();
    assert_close("c2 after it moved on", used(&m, "overlay/c2"), b2, SLACK);
    assert_close(
        "c3 after it moved in",
        used(&m, "overlay/c3"),
        b3 + 2 * MIB,
        SLACK,
    );
    fs::rename(c3.join("f"), out.join("f")).unwrap();
    assert_close("c3 after it moved out", used(&m, "overlay/c3"), b3, SLACK);
    assert!(fs::read(out.join("f")).unwrap() == data);

    // Replacing a file credits the one replaced.
    write_file(&c2.join("old"), 3 * MIB as usize, 6);
    fs::rename(out.join("f"), c2.join("old")).unwrap();
    used_until(&m, "overlay/c2", "the replaced file is credited", |u| {
        u.abs_diff(b2 + 2 * MIB) <= SLACK
    });

    // A directory does not move between roots, as between XFS projects: counting it would
    // walk its whole tree inside the rename. `mv` copies it instead, and the copy is
    // charged like any write.
    fs::create_dir_all(out.join("d/e")).unwrap();
    write_file(&out.join("d/x"), MIB as usize, 7);
    write_file(&out.join("d/e/y"), MIB as usize, 8);
    let before = get(&m, "overlay/c3");
    assert_errno(
        "rename of a directory into a root",
        fs::rename(out.join("d"), c3.join("d")),
        libc::EXDEV,
    );
    assert_eq!(
        get(&m, "overlay/c3"),
        before,
        "a refused rename moved usage"
    );
    let mv = std::process::Command::new("mv")
        .arg(out.join("d"))
        .arg(c3.join("d"))
        .output()
        .unwrap();
    assert!(
        mv.status.success(),
        "{}",
        String::from_utf8_lossy(&mv.stderr)
    );
    let after = assert_usage_matches_local(&m, "overlay/c3");
    assert!(
        after.used >= before.used + 2 * MIB + 2 * 4096,
        "{before:?} -> {after:?}"
    );
    assert_eq!(after.inodes_used, before.inodes_used + 4);
    assert_usage_matches_local(&m, "overlay/c2");
}

#[test]
fn renaming_a_directory_holding_a_root_into_another_root_fails_exdev() {
    let m = mount();
    let c1 = root(&m, "c1", "8M", &[]);
    fs::create_dir_all(m.path("overlay/p/c")).unwrap();
    set(&m, "overlay/p/c", "1M", &[]);
    assert_errno(
        "rename of a dir holding a root into a root",
        fs::rename(m.path("overlay/p"), c1.join("p")),
        libc::EXDEV,
    );
    assert_errno(
        "rename of a root into a root",
        fs::rename(m.path("overlay/p/c"), c1.join("c")),
        libc::EXDEV,
    );
    assert!(m.path("overlay/p/c").is_dir());
    assert_eq!(get(&m, "overlay/p/c").limit, MIB);
}

// ---- Moves of open, linked and regrown files, and exchanges ------------------------------

/// `rename(2)` that retries while it fails with `EXDEV` (a RELEASE that has not arrived
/// yet), for up to 10 s: its outcome once the daemon has seen the file's last close.
fn rename_once_closed(from: &Path, to: &Path) -> std::io::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match fs::rename(from, to) {
            Err(e) if errno(&e) == libc::EXDEV && std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(50))
            }
            done => return done,
        }
    }
}

/// [`rename_once_closed`], which must succeed.
fn rename_when_closed(from: &Path, to: &Path) {
    if let Err(e) = rename_once_closed(from, to) {
        panic!(
            "rename {} -> {} after the last close: {e}",
            from.display(),
            to.display()
        );
    }
}

/// A file unlinked while open stays charged to, and limited by, its root, even after some
/// unrelated rename elsewhere in the mount.
#[test]
fn an_unlinked_open_file_stays_limited_after_renames_elsewhere() {
    let m = mount();
    let q = root(&m, "q", "8M", &[]);
    let base = used(&m, "overlay/q");
    let other = m.path("overlay/other");
    fs::create_dir(&other).unwrap();
    write_file(&other.join("x"), 4096, 1);
    let mut log = fs::File::create(q.join("log")).unwrap();
    log.write_all(&pattern(64 * KIB as usize, 2)).unwrap();
    fs::remove_file(q.join("log")).unwrap();
    fs::rename(other.join("x"), other.join("y")).unwrap();
    fs::create_dir(other.join("sub")).unwrap();
    fs::rename(other.join("y"), other.join("sub/z")).unwrap();

    let room = 8 * MIB - used(&m, "overlay/q");
    let (n, e) = fill(&mut log, MIB as usize, 64 * MIB);
    assert_eq!(
        e,
        libc::ENOSPC,
        "writing to the unlinked open file: {}",
        errname(e)
    );
    assert!(
        n <= room && n + ONE_WRITE + SLACK >= room,
        "{n} bytes written with {room} bytes of room"
    );
    let full = used(&m, "overlay/q");
    assert!(full <= 8 * MIB + SLACK, "usage {full} over an 8 MiB limit");
    drop(log);
    used_until(&m, "overlay/q", "credited at the last close", |u| {
        u <= base + SLACK
    });
    assert_usage_matches_local(&m, "overlay/q");
    assert!(fs::read(other.join("sub/z")).unwrap() == pattern(4096, 1));
}

/// A file open with passthrough cannot move into a root (its writes would go uncounted):
/// the rename fails with `EXDEV`, and succeeds once it is closed. Without passthrough, the
/// rename succeeds at once and writes through the open handle are counted and limited.
#[test]
fn a_file_open_with_passthrough_cannot_be_renamed_into_a_root() {
    let m = mount();
    let passthrough = passthrough_in_use(&m, "probe");
    if !passthrough {
        missing_capability(
            "passthrough",
            "FUSE passthrough is not available: only the rename without it is checked",
        );
    }
    let q = root(&m, "q", "8M", &[]);
    let base = used(&m, "overlay/q");
    let out = m.path("overlay/out");
    fs::create_dir(&out).unwrap();
    let data = write_file(&out.join("f"), MIB as usize, 3);
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(out.join("f"))
        .unwrap();
    f.write_all(&[9u8; 4096]).unwrap();

    if passthrough {
        assert_errno(
            "rename of a file open with passthrough into a root",
            fs::rename(out.join("f"), q.join("f")),
            libc::EXDEV,
        );
        assert!(out.join("f").is_file(), "the source is still there");
        assert!(!q.join("f").exists(), "nothing arrived in the root");
        assert_eq!(used(&m, "overlay/q"), base, "nothing was charged");
        // Writes through the handle still work where the file is.
        f.write_all(&[8u8; 4096]).unwrap();
        drop(f);
        rename_when_closed(&out.join("f"), &q.join("f"));
        let u = assert_usage_matches_local(&m, "overlay/q").used;
        assert_close(
            "the root after the file moved in",
            u,
            base + MIB + 8192,
            SLACK,
        );
        // Reopened in the root, it is counted and limited.
        let mut g = fs::OpenOptions::new()
            .append(true)
            .open(q.join("f"))
            .unwrap();
        let room = 8 * MIB - u;
        let (n, e) = fill(&mut g, MIB as usize, 64 * MIB);
        assert_eq!(e, libc::ENOSPC, "{}", errname(e));
        assert!(n <= room && n + ONE_WRITE + SLACK >= room, "{n} of {room}");
    } else {
        fs::rename(out.join("f"), q.join("f")).expect("rename without passthrough");
        assert_close(
            "the root after the open file moved in",
            used(&m, "overlay/q"),
            base + MIB + 4096,
            SLACK,
        );
        let room = 8 * MIB - used(&m, "overlay/q");
        let (n, e) = fill(&mut f, MIB as usize, 64 * MIB);
        assert_eq!(
            e,
            libc::ENOSPC,
            "writes through a handle opened before the move: {}",
            errname(e)
        );
        assert!(n <= room && n + ONE_WRITE + SLACK >= room, "{n} of {room}");
        drop(f);
    }
    let q_after = assert_usage_matches_local(&m, "overlay/q");
    assert!(q_after.used <= q_after.limit + SLACK, "{q_after:?}");
    let head = fs::read(q.join("f")).unwrap();
    assert!(head[..MIB as usize] == data[..], "the data moved intact");
}

/// A directory does not leave its root by rename (`EXDEV`, as between XFS projects), and a
/// file with another hard link does not either (the link left behind would keep the space),
/// until the other link is gone.
#[test]
fn directories_and_hard_linked_files_do_not_move_between_roots() {
    let m = mount();
    let q = root(&m, "q", "8M", &[]);
    let out = m.path("overlay/out");
    fs::create_dir(&out).unwrap();
    fs::create_dir(q.join("d")).unwrap();
    let data = write_file(&q.join("d/big"), MIB as usize, 4);
    fs::hard_link(q.join("d/big"), q.join("keep")).unwrap();
    let before = assert_usage_matches_local(&m, "overlay/q");

    assert_errno(
        "rename of a dir out of its root",
        fs::rename(q.join("d"), out.join("d")),
        libc::EXDEV,
    );
    assert_errno(
        "rename of a hard-linked file out of its root",
        fs::rename(q.join("keep"), out.join("keep")),
        libc::EXDEV,
    );
    assert!(q.join("d/big").is_file() && !out.join("d").exists());
    assert_eq!(get(&m, "overlay/q"), before, "a failed rename moved usage");

    fs::remove_file(q.join("keep")).unwrap();
    let linked_once = used(&m, "overlay/q");
    fs::rename(q.join("d/big"), out.join("big")).expect("rename once the other link is gone");
    let after = assert_usage_matches_local(&m, "overlay/q");
    let dropped = linked_once.saturating_sub(after.used);
    assert!(
        (MIB..=MIB + SLACK).contains(&dropped),
        "usage went from {linked_once} to {} when a 1 MiB file moved out",
        after.used
    );
    assert_eq!(after.inodes_used, before.inodes_used - 1);
    assert!(fs::read(out.join("big")).unwrap() == data);
}

/// A file that leaves its root, grows outside and comes back is charged what it takes now,
/// once.
#[test]
fn a_file_moved_out_grown_and_moved_back_is_counted_once() {
    let m = mount();
    let q = root(&m, "q", "16M", &[]);
    let base = used(&m, "overlay/q");
    let out = m.path("overlay/out");
    fs::create_dir(&out).unwrap();
    write_file(&q.join("f"), MIB as usize, 5);
    fs::rename(q.join("f"), out.join("f")).unwrap();
    assert_close(
        "the root after f moved out",
        used(&m, "overlay/q"),
        base,
        SLACK,
    );
    {
        let mut g = fs::OpenOptions::new()
            .append(true)
            .open(out.join("f"))
            .unwrap();
        g.write_all(&pattern(3 * MIB as usize, 6)).unwrap();
    }
    rename_when_closed(&out.join("f"), &q.join("f"));
    {
        let mut g = fs::OpenOptions::new()
            .append(true)
            .open(q.join("f"))
            .unwrap();
        g.write_all(&[1u8]).unwrap();
    }
    assert_eq!(fs::metadata(q.join("f")).unwrap().len(), 4 * MIB + 1);
    let u = assert_usage_matches_local(&m, "overlay/q").used;
    assert_close(
        "the root with a 4 MiB + 1 file",
        u,
        base + 4 * MIB + 4096,
        SLACK,
    );
}

fn rename_exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    let (a, b) = (common::sys::cpath(a), common::sys::cpath(b));
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `renameat2(RENAME_EXCHANGE)` of a quota root with a plain directory: the quota goes with
/// the root's directory to its new name, and stays there after a remount.
#[test]
fn exchanging_a_root_with_a_plain_directory_keeps_its_quota_across_a_remount() {
    let mut m = mount();
    let a = root(&m, "a", "4M", &[]);
    write_file(&a.join("in-root"), MIB as usize, 7);
    let b = m.path("overlay/b");
    fs::create_dir(&b).unwrap();
    write_file(&b.join("plain"), 2 * MIB as usize, 8);
    let before = get(&m, "overlay/a");

    rename_exchange(&a, &b).expect("renameat2(RENAME_EXCHANGE) of a root and a plain dir");
    assert!(b.join("in-root").is_file() && a.join("plain").is_file());
    let q = assert_usage_matches_local(&m, "overlay/b");
    assert_eq!(q.limit, 4 * MIB);
    assert_eq!(q.used, before.used, "the usage moved with the root");
    let err = quota_err(&m, "get", &["overlay/a"]);
    assert!(
        err.contains("not a quota root"),
        "quota get overlay/a: {err}"
    );
    assert_eq!(
        list(&m).iter().map(|q| q.path.as_str()).collect::<Vec<_>>(),
        ["overlay/b"]
    );
    // Still enforced under its new name, and not on the old one.
    let mut big = fs::File::create(b.join("more")).unwrap();
    let (_, e) = fill(&mut big, MIB as usize, 64 * MIB);
    assert_eq!(e, libc::ENOSPC, "{}", errname(e));
    drop(big);
    write_file(&a.join("free"), 6 * MIB as usize, 9);
    let after = assert_usage_matches_local(&m, "overlay/b");

    m.remount(&Options::default());
    let q = get(&m, "overlay/b");
    assert_eq!(q.limit, 4 * MIB, "the limit after a remount");
    assert_eq!(q.used, after.used, "the usage after a remount");
    let err = quota_err(&m, "get", &["overlay/a"]);
    assert!(
        err.contains("not a quota root"),
        "quota get overlay/a after a remount: {err}"
    );
    assert_eq!(
        list(&m).iter().map(|q| q.path.as_str()).collect::<Vec<_>>(),
        ["overlay/b"]
    );
}
