//! Quota usage after a crash (DESIGN §6: "Usage survives remounts and crashes: on mount it is
//! recomputed (or verified) from local"). The daemon is killed with SIGKILL, its dead mount
//! detached, and the same local mounted again; usage must then equal what local takes on
//! disk ([`allocated_under`]: `st_blocks` of every inode, hard links once, the root
//! included), and limits must be what was set.

mod common;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::Value;

const MIB: u64 = 1 << 20;
const SLACK: u64 = 64 * 1024;

/// `layerfs quota SUB MOUNTPOINT REST... --json`, which must succeed.
fn quota_json(m: &Mount, sub: &str, rest: &[&str]) -> Value {
    let mut args = rest.to_vec();
    args.push("--json");
    let out = quota_cmd(m, sub, &args);
    assert!(
        out.status.success(),
        "layerfs quota {sub} {rest:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("quota --json prints JSON")
}

fn num(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("no number {k:?} in {v}"))
}

fn mount() -> Mount {
    Mount::new()
}

fn remount_after_kill(m: &mut Mount) {
    m.kill_daemon();
    m.mount(&Options::default());
    look_up_roots(m);
}

/// Looks the quota roots up through the view once. `layerfs quota get|set` of a path the
/// kernel has not looked up since the mount is a separate matter, covered by
/// `cli_get_right_after_a_remount` in `tests/quota_control.rs`; here it must not hide what
/// a crash did to usage.
fn look_up_roots(m: &Mount) {
    for d in ["overlay/a", "overlay/b", "overlay/c1"] {
        let _ = fs::symlink_metadata(m.path(d));
    }
}

/// The quota of `rel` equals what its local dir takes, bytes and inodes.
fn assert_recomputed(m: &Mount, rel: &str) -> Value {
    let q = quota_json(m, "get", &[rel]);
    let (bytes, inodes) = allocated_under(&m.local.join(rel));
    assert_eq!(num(&q, "used"), bytes, "usage of {rel} after remount: {q}");
    assert_eq!(
        num(&q, "inodes_used"),
        inodes,
        "inodes of {rel} after remount: {q}"
    );
    q
}

/// Writes into the root until the quota refuses; local then holds at most the limit.
fn assert_enforced(m: &Mount, rel: &str, limit: u64) {
    let mut f = fs::File::create(m.path(rel).join("fill")).unwrap();
    let chunk = pattern(MIB as usize, 9);
    let e = loop {
        match f.write(&chunk) {
            Ok(n) if n == chunk.len() => {}
            Ok(_) => {
                break f
                    .write(&chunk)
                    .expect_err("after a short write the next fails")
            }
            Err(e) => break e,
        }
        assert!(
            allocated_under(&m.local.join(rel)).0 <= limit + 2 * MIB,
            "{rel}: writes run past the limit after the remount"
        );
    };
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
    let (bytes, _) = allocated_under(&m.local.join(rel));
    assert!(bytes <= limit + SLACK, "{rel}: {bytes} bytes under {limit}");
}

#[test]
fn kill_9_then_remount_recomputes_usage() {
    let mut m = mount();
    let c1 = m.path("overlay/c1");
    fs::create_dir(&c1).unwrap();
    quota_json(&m, "set", &["overlay/c1", "8M", "--inodes", "100"]);
    let mut f = fs::File::create(c1.join("f")).unwrap();
    f.write_all(&pattern(3 * MIB as usize, 1)).unwrap();
    f.sync_all().unwrap();
    drop(f);
    fs::create_dir(c1.join("d")).unwrap();
    fs::write(c1.join("d/x"), pattern(100_000, 2)).unwrap(); // not synced
    fs::hard_link(c1.join("f"), c1.join("d/f2")).unwrap();
    std::os::unix::fs::symlink("f", c1.join("s")).unwrap();
    // An unlinked file still open: its space goes when the daemon dies.
    let mut open = fs::File::create(c1.join("u")).unwrap();
    open.write_all(&pattern(2 * MIB as usize, 3)).unwrap();
    fs::remove_file(c1.join("u")).unwrap();
    let before = quota_json(&m, "get", &["overlay/c1"]);
    assert!(num(&before, "used") >= 5 * MIB, "{before}");

    remount_after_kill(&mut m);
    drop(open);
    let q = assert_recomputed(&m, "overlay/c1");
    assert_eq!(num(&q, "limit"), 8 * MIB, "{q}");
    assert_eq!(q["inode_limit"], 100, "{q}");
    assert!(
        num(&q, "used") + 2 * MIB <= num(&before, "used") + SLACK,
        "the open unlinked file's space is not counted any more: {before} -> {q}"
    );
    assert_eq!(
        fs::read(c1.join("d/x")).unwrap(),
        pattern(100_000, 2),
        "written data survives the kill"
    );
    assert_enforced(&m, "overlay/c1", 8 * MIB);
}

#[test]
fn kill_9_during_parallel_writes_then_remount() {
    let mut m = mount();
    let c1 = m.path("overlay/c1");
    fs::create_dir(&c1).unwrap();
    quota_json(&m, "set", &["overlay/c1", "64M"]);
    let writers: Vec<_> = (0..4)
        .map(|i| {
            let p: PathBuf = c1.join(format!("w{i}"));
            std::thread::spawn(move || {
                let chunk = pattern(256 * 1024, i);
                let Ok(mut f) = fs::File::create(&p) else {
                    return;
                };
                // Rewrites the first 8 MiB over and over (so the quota never fills) until
                // the mount dies under it.
                loop {
                    for _ in 0..32 {
                        if f.write_all(&chunk).is_err() {
                            return;
                        }
                    }
                    if std::io::Seek::rewind(&mut f).is_err() {
                        return;
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    // Deleting and creating while writes go on.
    for i in 0..20 {
        let p = c1.join(format!("t{i}"));
        let _ = fs::write(&p, pattern(64 * 1024, i));
        if i % 2 == 0 {
            let _ = fs::remove_file(&p);
        }
    }
    remount_after_kill(&mut m);
    for w in writers {
        w.join().unwrap();
    }
    let q = assert_recomputed(&m, "overlay/c1");
    assert_eq!(num(&q, "limit"), 64 * MIB, "{q}");
    assert_enforced(&m, "overlay/c1", 64 * MIB);
}

#[test]
fn a_quota_set_just_before_a_kill_is_kept_and_one_cleared_stays_cleared() {
    let mut m = mount();
    for d in ["overlay/a", "overlay/b"] {
        fs::create_dir(m.path(d)).unwrap();
    }
    quota_json(&m, "set", &["overlay/a", "4M"]);
    quota_json(&m, "set", &["overlay/b", "4M"]);
    xattr_set(&m.path("overlay/a"), "user.layerfs.quota", b"6M").unwrap();
    let out = quota_cmd(&m, "clear", &["overlay/b"]);
    assert!(out.status.success());
    remount_after_kill(&mut m);
    let list = quota_json(&m, "list", &[]);
    let roots = list.as_array().unwrap();
    assert_eq!(roots.len(), 1, "{list}");
    assert_eq!(roots[0]["path"], "overlay/a");
    assert_eq!(num(&roots[0], "limit"), 6 * MIB);
    assert_recomputed(&m, "overlay/a");
    assert_enforced(&m, "overlay/a", 6 * MIB);
    fs::write(m.path("overlay/b/free"), pattern(8 * MIB as usize, 4))
        .expect("a cleared quota stays cleared");
}

#[test]
fn usage_is_recomputed_when_local_changed_while_unmounted() {
    let mut m = mount();
    let c1 = m.path("overlay/c1");
    fs::create_dir(&c1).unwrap();
    quota_json(&m, "set", &["overlay/c1", "8M"]);
    fs::write(c1.join("f"), pattern(3 * MIB as usize, 1)).unwrap();
    let before = quota_json(&m, "get", &["overlay/c1"]);
    m.unmount();
    // Offline changes (a restore, an fsck, an admin cleaning up).
    let local_c1: &Path = &m.local.join("overlay/c1");
    fs::remove_file(local_c1.join("f")).unwrap();
    fs::write(local_c1.join("g"), pattern(MIB as usize, 2)).unwrap();
    m.mount(&Options::default());
    look_up_roots(&m);
    let q = assert_recomputed(&m, "overlay/c1");
    assert_eq!(num(&q, "limit"), 8 * MIB);
    assert!(num(&q, "used") < num(&before, "used"), "{before} -> {q}");
    assert_enforced(&m, "overlay/c1", 8 * MIB);
}
