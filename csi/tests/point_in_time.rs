//! A snapshot is the volume at one instant (DESIGN §7, Point in time), with a writer running.
//!
//! The writer is the one that showed the bug: 4 KiB writes with O_DIRECT|O_DSYNC, each
//! stamped with a counter and acknowledged before the next starts, scattered over a
//! published 64 MiB Block volume. Snapshots are taken while it runs, restored into new
//! volumes, and read back through their own publications. A restored volume must be the
//! volume at one instant: for the newest stamp in it, every block holds exactly the last
//! stamp written to it up to that one; it holds every stamp acknowledged before
//! CreateSnapshot was called and none started after it returned.
//!
//! A Mount volume is checked the same way with a writer appending acknowledged records to
//! a file in its filesystem.
//!
//! Needs root (loop devices, mounts), `losetup`, `qemu-img`, `mkfs.ext4`, `mkfs.xfs`.

mod common;

use std::fs;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use layerfs_csi::proto::volume_content_source::{SnapshotSource, Type as SourceType};
use layerfs_csi::proto::*;

const SIZE: i64 = 64 * MIB;
const BLOCK: usize = 4096;
const BLOCKS: u64 = SIZE as u64 / BLOCK as u64;
const SNAPSHOTS: u64 = 20;

/// The block the `n`th stamped write goes to: scattered, and the same on every call.
fn block_of(n: u64) -> u64 {
    n.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17) % BLOCKS
}

/// A 4 KiB buffer aligned for O_DIRECT.
struct Aligned(*mut u8);

impl Aligned {
    fn layout() -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(BLOCK, BLOCK).unwrap()
    }

    fn new() -> Aligned {
        // SAFETY: a non-zero layout; freed in Drop.
        Aligned(unsafe { std::alloc::alloc_zeroed(Aligned::layout()) })
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: BLOCK bytes allocated in `new`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.0, BLOCK) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.0, Aligned::layout()) }
    }
}

/// Writes stamps 1, 2, … to `device` until `stop`; `done` is the last acknowledged stamp.
/// Returns the longest a write took.
fn stamped_writer(
    device: PathBuf,
    done: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Duration> {
    std::thread::spawn(move || {
        let file = fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_DSYNC)
            .open(&device)
            .unwrap();
        let mut buf = Aligned::new();
        let mut longest = Duration::ZERO;
        let mut n = 0u64;
        while !stop.load(Ordering::SeqCst) {
            n += 1;
            buf.bytes()[..8].copy_from_slice(&n.to_le_bytes());
            let started = Instant::now();
            file.write_all_at(buf.bytes(), block_of(n) * BLOCK as u64)
                .unwrap();
            longest = longest.max(started.elapsed());
            done.store(n, Ordering::SeqCst);
        }
        longest
    })
}

/// The newest stamp of `bytes`, if they are the volume at the instant it was written.
fn instant_of(bytes: &[u8]) -> Result<u64, String> {
    let stamp = |b: u64| {
        let at = b as usize * BLOCK;
        u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
    };
    let newest = (0..BLOCKS).map(stamp).max().unwrap_or(0);
    let mut expected = vec![0u64; BLOCKS as usize];
    for n in 1..=newest {
        expected[block_of(n) as usize] = n;
    }
    match (0..BLOCKS).find(|&b| stamp(b) != expected[b as usize]) {
        None => Ok(newest),
        Some(b) => Err(format!(
            "block {b} holds stamp {} where the volume at stamp {newest} held {}",
            stamp(b),
            expected[b as usize]
        )),
    }
}

fn snapshot_req(name: &str, source: &str) -> CreateSnapshotRequest {
    CreateSnapshotRequest {
        source_volume_id: source.into(),
        name: name.into(),
        parameters: [("type".to_owned(), "bi".to_owned())].into(),
        ..Default::default()
    }
}

fn restore_req(name: &str, snapshot: &str, cap: VolumeCapability) -> CreateVolumeRequest {
    CreateVolumeRequest {
        volume_content_source: Some(VolumeContentSource {
            r#type: Some(SourceType::Snapshot(SnapshotSource {
                snapshot_id: snapshot.into(),
            })),
        }),
        ..volume_req(name, SIZE, cap)
    }
}

/// Restores `snapshot` into a new volume, retrying while its image is still being made,
/// as the CO does.
async fn restore(c: &mut Clients, name: &str, snapshot: &str, cap: VolumeCapability) -> String {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        match c
            .ctl
            .create_volume(restore_req(name, snapshot, cap.clone()))
            .await
        {
            Ok(r) => return r.into_inner().volume.expect("a volume").volume_id,
            Err(e) if Instant::now() < deadline && is_retry(&e) => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("restoring {snapshot}: {e:?}"),
        }
    }
}

fn is_retry(e: &tonic::Status) -> bool {
    matches!(
        e.code(),
        tonic::Code::Aborted | tonic::Code::Unavailable | tonic::Code::ResourceExhausted
    )
}

/// What a Block publication of `volume` at `target` reads, unpublished after.
async fn read_published(c: &mut Clients, volume: &str, target: &Path) -> Vec<u8> {
    c.publish(volume, &target, block_cap())
        .await
        .expect("publishing the restored volume");
    let mut bytes = vec![0u8; SIZE as usize];
    fs::File::open(target)
        .unwrap()
        .read_exact_at(&mut bytes, 0)
        .unwrap();
    c.unpublish(volume, &target)
        .await
        .expect("unpublishing the restored volume");
    bytes
}

/// On a store without reflinks (ext4): the cut is a copy with the volume's writes held.
#[tokio::test(flavor = "multi_thread")]
async fn snapshots_of_a_block_volume_under_a_writer_are_each_one_instant() {
    let server = Server::start_on(StoreFs::Ext4(4 << 30));
    snapshots_under_a_writer(&server, "cut taken with writes held").await;
}

/// On a store with reflinks (XFS): the cut is a FICLONE of the live disk, writers not held.
#[tokio::test(flavor = "multi_thread")]
async fn snapshots_on_a_reflink_store_under_a_writer_are_each_one_instant() {
    let server = Server::start_on(StoreFs::XfsReflink(1 << 30));
    snapshots_under_a_writer(&server, "cut taken by reflink").await;
}

/// Takes [`SNAPSHOTS`] snapshots under the stamped writer and checks each restores to one
/// instant; every cut must have been taken the way `cut_log` (a line of the driver's log)
/// says.
async fn snapshots_under_a_writer(server: &Server, cut_log: &str) {
    let mut c = server.clients().await;
    let volume = c
        .volume(volume_req("written", SIZE, block_cap()))
        .await
        .volume_id;
    let target = server.path().join("pods/written");
    fs::create_dir_all(target.parent().unwrap()).unwrap();
    c.publish(&volume, &target, block_cap())
        .await
        .expect("publishing the volume");

    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = stamped_writer(target.clone(), done.clone(), stop.clone());
    let mut taken = Vec::new();
    for i in 0..SNAPSHOTS {
        while done.load(Ordering::SeqCst) < (i + 1) * 100 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let before = done.load(Ordering::SeqCst);
        let snapshot = c
            .ctl
            .create_snapshot(snapshot_req(&format!("cut-{i}"), &volume))
            .await
            .expect("CreateSnapshot")
            .into_inner()
            .snapshot
            .expect("a snapshot");
        let after = done.load(Ordering::SeqCst);
        taken.push((snapshot.snapshot_id, before, after));
    }
    stop.store(true, Ordering::SeqCst);
    let longest = writer.join().unwrap();
    eprintln!("the writer's longest write took {longest:?}");

    let mut failures = Vec::new();
    for (i, (snapshot, before, after)) in taken.iter().enumerate() {
        let restored = restore(&mut c, &format!("restored-{i}"), snapshot, block_cap()).await;
        let bytes = read_published(&mut c, &restored, &server.path().join("pods/restored")).await;
        match instant_of(&bytes) {
            Ok(newest) if newest < *before => failures.push(format!(
                "snapshot {i}: stamp {newest} is older than {before}, acknowledged before it"
            )),
            // The write in flight when CreateSnapshot returned may be in it; none after.
            Ok(newest) if newest > after + 1 => failures.push(format!(
                "snapshot {i}: holds stamp {newest}, written after CreateSnapshot returned at {after}"
            )),
            Ok(_) => {}
            Err(e) => failures.push(format!("snapshot {i}: {e}")),
        }
        c.delete_volume(&restored).await;
    }
    c.unpublish(&volume, &target)
        .await
        .expect("unpublishing the volume");
    assert!(failures.is_empty(), "{failures:#?}");
    let log = fs::read_to_string(server.log().expect("a driver log")).unwrap();
    let cuts = log.lines().filter(|l| l.contains(cut_log)).count();
    assert_eq!(
        cuts, SNAPSHOTS as usize,
        "cuts logged as {cut_log:?}:\n{log}"
    );
}

/// Appends records 1, 2, … (8 bytes each, O_DSYNC) to `path` in a mounted filesystem until
/// `stop`; `done` is the last acknowledged record.
fn appending_writer(
    path: PathBuf,
    done: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Duration> {
    std::thread::spawn(move || {
        use std::io::Write;
        let mut file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .custom_flags(libc::O_DSYNC)
            .open(&path)
            .unwrap();
        let mut longest = Duration::ZERO;
        let mut n = 0u64;
        while !stop.load(Ordering::SeqCst) {
            n += 1;
            let started = Instant::now();
            file.write_all(&n.to_le_bytes()).unwrap();
            longest = longest.max(started.elapsed());
            done.store(n, Ordering::SeqCst);
        }
        longest
    })
}

/// A published Mount volume (ext4, frozen for each cut) under a writer appending
/// acknowledged records: each restored snapshot holds records 1..=k and nothing else, with
/// every record acknowledged before CreateSnapshot was called and none started after it
/// returned.
#[tokio::test(flavor = "multi_thread")]
async fn snapshots_of_a_mount_volume_under_a_writer_are_each_one_instant() {
    const CUTS: u64 = 10;
    let server = Server::start_on(StoreFs::Ext4(4 << 30));
    let mut c = server.clients().await;
    let volume = c
        .volume(volume_req("mounted", SIZE, mount_cap()))
        .await
        .volume_id;
    let target = server.path().join("pods/mounted");
    fs::create_dir_all(&target).unwrap();
    c.publish(&volume, &target, mount_cap())
        .await
        .expect("publishing the volume");

    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = appending_writer(target.join("log"), done.clone(), stop.clone());
    let mut taken = Vec::new();
    for i in 0..CUTS {
        while done.load(Ordering::SeqCst) < (i + 1) * 200 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let before = done.load(Ordering::SeqCst);
        let snapshot = c
            .ctl
            .create_snapshot(snapshot_req(&format!("fs-cut-{i}"), &volume))
            .await
            .expect("CreateSnapshot")
            .into_inner()
            .snapshot
            .expect("a snapshot");
        taken.push((snapshot.snapshot_id, before, done.load(Ordering::SeqCst)));
    }
    stop.store(true, Ordering::SeqCst);
    let longest = writer.join().unwrap();
    eprintln!("the appending writer's longest write took {longest:?}");

    let mut failures = Vec::new();
    let seen = server.path().join("pods/restored-fs");
    fs::create_dir_all(&seen).unwrap();
    for (i, (snapshot, before, after)) in taken.iter().enumerate() {
        let restored = restore(&mut c, &format!("fs-restored-{i}"), snapshot, mount_cap()).await;
        c.publish(&restored, &seen, mount_cap())
            .await
            .expect("publishing the restored volume");
        let log = fs::read(seen.join("log")).unwrap_or_default();
        c.unpublish(&restored, &seen)
            .await
            .expect("unpublishing the restored volume");
        c.delete_volume(&restored).await;
        let records: Vec<u64> = log
            .chunks(8)
            .map(|r| u64::from_le_bytes(r.try_into().unwrap_or([0xff; 8])))
            .collect();
        let k = records.len() as u64;
        if let Some(at) = (0..k).find(|&j| records[j as usize] != j + 1) {
            failures.push(format!(
                "snapshot {i}: record {at} is {}",
                records[at as usize]
            ));
        } else if k < *before || k > after + 1 {
            failures.push(format!(
                "snapshot {i}: {k} records, but {before} were acknowledged before it and \
                 {after} when it returned"
            ));
        }
    }
    c.unpublish(&volume, &target)
        .await
        .expect("unpublishing the volume");
    assert!(failures.is_empty(), "{failures:#?}");
}
