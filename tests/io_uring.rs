//! FUSE over io_uring (`-o io_uring`): requests served through the ring give the same results
//! as through /dev/fuse, on every path a reply can take (served in place, from the remote
//! pool, from the sync pool), with data large enough to fill an entry's payload. Where the
//! kernel has no `enable_uring` parameter, the mount must still serve, on /dev/fuse.

mod common;
use common::*;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The daemon's threads named `prefix…`, with their voluntary context switches: a thread
/// that waits for requests switches once per wait.
fn switches(pid: u32, prefix: &str) -> (usize, u64) {
    let mut threads = 0;
    let mut total = 0;
    for task in fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        threads += 1;
        let status = fs::read_to_string(task.path().join("status")).unwrap_or_default();
        total += status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    (threads, total)
}

fn possible_cpus() -> usize {
    let list = fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
    list.trim()
        .split(',')
        .map(|range| {
            let (a, b) = range.split_once('-').unwrap_or((range, range));
            b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1
        })
        .sum()
}

/// Pseudo-random bytes, different for every `seed`.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn files_under(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap().flatten() {
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                dirs.push(entry.path());
            } else if kind.is_file() {
                found.push(entry.path());
            }
        }
    }
    found
}

/// Everything the test does on one mount; `ring` says whether the ring must carry it.
fn exercise(m: &Mount, ring: bool) {
    let pid = m.daemon_pid().expect("foreground daemon");
    if ring {
        // The queues start once the mount serves (through /dev/fuse until they are all up).
        eventually(10, "one ring queue per possible CPU", || {
            switches(pid, "fuse-ring-").0 == possible_cpus()
        });
    }
    let (queues, before) = switches(pid, "fuse-ring-");
    if !ring {
        assert_eq!(queues, 0, "ring queues without a ring");
    }

    let status = std::process::Command::new(BIN)
        .arg("status")
        .arg(&m.mnt)
        .output()
        .unwrap();
    let want = if ring {
        "through io_uring"
    } else {
        "through /dev/fuse"
    };
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains(want),
        "layerfs status ({}) says:\n{text}{}",
        status.status,
        String::from_utf8_lossy(&status.stderr)
    );

    // Served in place, one request at a time: each is a wait of a queue thread.
    let work = m.path("overlay/ring");
    fs::create_dir(&work).unwrap();
    for i in 0..1000u64 {
        fs::write(work.join(format!("f{i}")), bytes(i, 100 + i as usize)).unwrap();
    }
    let mut listed = names(&work);
    listed.sort();
    assert_eq!(listed.len(), 1000);
    for i in 0..1000u64 {
        let path = work.join(format!("f{i}"));
        assert_eq!(
            fs::read(&path).unwrap(),
            bytes(i, 100 + i as usize),
            "{path:?}"
        );
        if i % 2 == 0 {
            fs::rename(&path, work.join(format!("g{i}"))).unwrap();
        } else {
            fs::remove_file(&path).unwrap();
        }
    }
    assert_eq!(names(&work).len(), 500);
    xattr_set(&work, "user.ring", b"value").unwrap();
    assert_eq!(xattr_get(&work, "user.ring").unwrap(), b"value");

    // Large writes and reads, which fill an entry's payload (1 MiB) when not passed through;
    // fsync goes through the sync pool and its reply comes from another thread.
    let big = bytes(7, 8 << 20);
    let path = work.join("big");
    let mut f = fs::File::create(&path).unwrap();
    f.write_all(&big).unwrap();
    f.sync_all().unwrap();
    f.write_all_at(b"patched", 3 << 20).unwrap();
    drop(f);
    let mut expected = big.clone();
    expected[3 << 20..(3 << 20) + 7].copy_from_slice(b"patched");
    let mut back = Vec::new();
    fs::File::open(&path)
        .unwrap()
        .read_to_end(&mut back)
        .unwrap();
    assert!(back == expected, "8 MiB read back through the view differs");
    let mut f = fs::File::open(&path).unwrap();
    f.seek(SeekFrom::Start((5 << 20) + 3)).unwrap();
    let mut chunk = vec![0u8; 1 << 20];
    f.read_exact(&mut chunk).unwrap();
    assert!(chunk[..] == expected[(5 << 20) + 3..(6 << 20) + 3]);

    // The remote's files: lookups and reads that may wait on the remote are served by the
    // remote pool, whose replies come from its threads.
    let through_view = files_under(&m.mnt.join("overlay/RO"));
    assert!(
        through_view.len() > 5,
        "the fixture's ready layers have files"
    );
    for file in &through_view {
        let rel = file.strip_prefix(&m.mnt).unwrap();
        assert_eq!(
            fs::read(file).unwrap(),
            fs::read(m.remote.join(rel)).unwrap(),
            "{rel:?}"
        );
    }

    let (_, after) = switches(pid, "fuse-ring-");
    if ring {
        assert!(
            after - before >= 1000,
            "the ring queues waited {} times for over 4000 requests: the requests did not go \
             through the ring",
            after - before
        );
    }
    fs::remove_dir_all(&work).unwrap();
}

#[test]
fn the_ring_serves_what_dev_fuse_serves() {
    let Some(_offered) = RingOffered::turn_on() else {
        missing_capability(
            "io_uring",
            "the kernel has no FUSE over io_uring (no enable_uring parameter): only the \
             fallback to /dev/fuse is checked",
        );
        // A kernel without the transport: asking for it must not cost the mount.
        let m = Mount::with(
            Options {
                opts: "io_uring".into(),
                ..Options::default()
            },
            |_| {},
        );
        exercise(&m, false);
        return;
    };
    for opts in ["io_uring", "io_uring,nopassthrough"] {
        let m = Mount::with(
            Options {
                opts: opts.into(),
                ..Options::default()
            },
            |_| {},
        );
        exercise(&m, true);
    }
    // Not asked for: used, where it is offered.
    let m = Mount::new();
    exercise(&m, true);
    // Refused: not used, even when offered.
    let m = Mount::with(
        Options {
            opts: "noio_uring".into(),
            ..Options::default()
        },
        |_| {},
    );
    exercise(&m, false);
}

/// A mount a keeper holds stays on /dev/fuse, ring offered or not: the requests in flight on
/// a dead daemon's ring are not sent again to the next one.
#[test]
fn a_kept_mount_stays_on_dev_fuse() {
    let Some(_offered) = RingOffered::turn_on() else {
        return missing_capability("io_uring", "the kernel has no FUSE over io_uring");
    };
    let m = Mount::with(
        Options {
            foreground: false,
            ..Options::default()
        },
        |_| {},
    );
    let status = std::process::Command::new(BIN)
        .arg("status")
        .arg(&m.mnt)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains("through /dev/fuse") && text.contains("kept by"),
        "layerfs status says:\n{text}"
    );
}

/// The daemon's open descriptors, and those of them that name a deleted file.
fn descriptors(pid: u32) -> (usize, Vec<PathBuf>) {
    let targets = descriptor_targets(pid);
    let deleted = targets
        .iter()
        .filter(|(_, t)| t.to_string_lossy().ends_with(" (deleted)"))
        .map(|(_, t)| t.clone())
        .collect();
    (targets.len(), deleted)
}

/// Over the ring, the /dev/fuse readers pause after a FORGET so that the next ones come
/// together, as one BATCH_FORGET. However they come, every FORGET must arrive and be served
/// in full: the nodes go with their descriptors, and a deleted file's space with its node.
/// Dropping the kernel's caches sends thousands at once; unlinks from several threads send
/// them as they go.
#[test]
fn over_the_ring_every_forget_arrives_alone_or_batched() {
    let Some(_offered) = RingOffered::turn_on() else {
        return missing_capability("io_uring", "the kernel has no FUSE over io_uring");
    };
    let m = Mount::with(
        Options {
            opts: "io_uring".into(),
            ..Options::default()
        },
        |_| {},
    );
    let pid = m.daemon_pid().expect("foreground daemon");
    eventually(10, "one ring queue per possible CPU", || {
        switches(pid, "fuse-ring-").0 == possible_cpus()
    });
    let work = m.path("overlay/forgets");
    fs::create_dir(&work).unwrap();
    let (baseline, _) = descriptors(pid);
    const FILES: usize = 2000;
    const SLACK: usize = 64;
    for i in 0..FILES {
        fs::write(work.join(format!("f{i}")), bytes(i as u64, 4096)).unwrap();
    }
    // Either count may include descriptors the daemon holds for a moment (a refresh round
    // scanning the remote, say), hence the slack here too.
    let (held, _) = descriptors(pid);
    assert!(
        held + SLACK >= baseline + FILES,
        "{held} descriptors for {FILES} new nodes over {baseline}"
    );

    drop_caches();
    eventually(20, "the nodes of the dropped names forgotten", || {
        descriptors(pid).0 <= baseline + SLACK
    });

    let unlinkers: Vec<_> = (0..4)
        .map(|t| {
            let work = work.clone();
            std::thread::spawn(move || {
                for i in (t..FILES).step_by(4) {
                    let path = work.join(format!("f{i}"));
                    assert_eq!(fs::read(&path).unwrap(), bytes(i as u64, 4096), "{path:?}");
                    fs::remove_file(&path).unwrap();
                }
            })
        })
        .collect();
    for unlinker in unlinkers {
        unlinker.join().unwrap();
    }
    eventually(20, "no node of a deleted file left in the daemon", || {
        let (count, deleted) = descriptors(pid);
        deleted.is_empty() && count <= baseline + SLACK
    });
    assert!(names(&work).is_empty());
    fs::remove_dir(&work).unwrap();
}
