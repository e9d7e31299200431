//! The lifecycle of the work behind a snapshot: a CO that gives up on its calls at once, a
//! DeleteSnapshot during the cut or the export, the driver stopped (SIGTERM) or killed
//! (SIGKILL) during a cut, an export or a restore, and what start-up does with what a stopped
//! run left. The image must still be the data of before the snapshot, its id and creation
//! time must not change, and nothing may be left over.
//!
//! Needs root (loop devices, mounts), `qemu-img`, `losetup`, `mkfs.ext4`. Every server is
//! stopped, and every mount and loop device under its temp dir removed, even when a test
//! panics.

mod common;

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use layerfs_csi::proto::*;
use sha2::{Digest, Sha512};
use tonic::Code;

/// A CO that gives up on CreateSnapshot and CreateVolume at once (a tiny gRPC deadline) does
/// not stop the copies: retries find them, exactly one image and one volume result, and no
/// temp file is left anywhere.
#[tokio::test(flavor = "multi_thread")]
async fn tiny_deadlines_do_not_restart_or_leak_copies() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let work = server.path().join("targets");
    let vol = c.volume(block_volume_req("pvc-big", 320 * MIB, None)).await;
    // 256 MiB really written (the cut reads them all), but mostly zeros, which the qcow2
    // export leaves out: the image stays small and quick to checksum.
    let mut written = vec![0u8; 256 * MIB as usize];
    let data = pattern(MIB as usize, 42);
    let at = 200 * MIB as usize;
    written[at..at + data.len()].copy_from_slice(&data);
    c.write_block(&vol.volume_id, &work, 0, &written).await;

    let req = snapshot_req("snap-big", &vol.volume_id, "qcow2");
    let mut tiny = tonic::Request::new(req.clone());
    tiny.set_timeout(Duration::from_millis(5));
    let first = c.ctl.create_snapshot(tiny).await;
    assert!(first.is_err(), "the tiny deadline expires");
    let deadline = Instant::now() + Duration::from_secs(120);
    let snap = loop {
        assert!(Instant::now() < deadline, "the snapshot never became ready");
        let mut r = tonic::Request::new(req.clone());
        r.set_timeout(Duration::from_millis(50));
        match c.ctl.create_snapshot(r).await {
            Ok(resp) => {
                let snap = resp.into_inner().snapshot.unwrap();
                if snap.ready_to_use {
                    break snap;
                }
            }
            Err(s) => assert!(
                matches!(
                    s.code(),
                    Code::DeadlineExceeded | Code::Cancelled | Code::Aborted
                ),
                "{s:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        visible_images(&server),
        vec!["snap-big.img".to_owned(), "snap-big.json".to_owned()]
    );
    let state = state_of(&server, "snap-big").unwrap();
    assert_eq!(state["progress"]["done"], state["progress"]["total"]);

    let vreq = block_volume_req("pvc-big-restored", 320 * MIB, Some(&snap.snapshot_id));
    let restored = loop {
        assert!(Instant::now() < deadline, "the restore never finished");
        let mut r = tonic::Request::new(vreq.clone());
        r.set_timeout(Duration::from_millis(20));
        match c.ctl.create_volume(r).await {
            Ok(resp) => break resp.into_inner().volume.unwrap(),
            Err(s) => assert!(
                matches!(
                    s.code(),
                    Code::DeadlineExceeded | Code::Cancelled | Code::Aborted
                ),
                "{s:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(temps_under(server.path()), Vec::<PathBuf>::new());
    let (got, _) = c
        .read_block(&restored.volume_id, &work, at as u64, data.len())
        .await;
    assert!(got == data, "restored bytes differ");
    c.delete_restore(&restored.volume_id, &snap.snapshot_id, &vol.volume_id)
        .await;
    assert_eq!(temps_under(server.path()), Vec::<PathBuf>::new());
}

fn sha512_of_file(path: &Path) -> String {
    let mut file = fs::File::open(path).expect("open image");
    let mut hasher = Sha512::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).expect("read image");
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// SHA-512 of a raw disk of `len` bytes holding `data` at offset 0 and zeros after it.
fn sha512_of_disk(len: usize, data: &[u8]) -> String {
    let mut hasher = Sha512::new();
    hasher.update(data);
    let zeros = vec![0u8; 1 << 20];
    let mut left = len - data.len();
    while left > 0 {
        let n = left.min(zeros.len());
        hasher.update(&zeros[..n]);
        left -= n;
    }
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// DeleteSnapshot right after CreateSnapshot, while the export runs (as csi-sanity does):
/// it succeeds at once, cancels the export and leaves nothing; the name can be used again.
/// The same while the snapshot is still being cut.
#[tokio::test(flavor = "multi_thread")]
async fn delete_during_export_cancels_it_and_leaves_nothing() {
    // Paced so that the export still runs when it is deleted, however fast the machine.
    let server = Server::shared_images(&["--export-rate", "4194304"]);
    let mut c = server.clients().await;
    let (vol, _) = volume_with_data(&mut c, &server, "pvc-cancel", 5).await;
    let req = snapshot_req("snap-cancel", &vol, "raw");
    let snap = c.snapshot(req.clone()).await.expect("CreateSnapshot");
    assert!(!snap.ready_to_use);
    assert_eq!(state_of(&server, "snap-cancel").unwrap()["ready"], false);
    let started = Instant::now();
    c.delete_snapshot(&snap.snapshot_id)
        .await
        .expect("DeleteSnapshot during the export");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_no_snapshot_left(&server);
    // Nothing comes back once the cancelled work has wound down.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_no_snapshot_left(&server);
    let listed = c.list(ListSnapshotsRequest::default()).await.unwrap();
    assert!(listed.entries.is_empty(), "{listed:?}");

    // The name is free again, and the cancellation is nobody's error.
    let again = c.snapshot_ready(req).await;
    c.delete_snapshot(&again.snapshot_id).await.unwrap();
    assert_no_snapshot_left(&server);

    // During the cut: CreateSnapshot has claimed the name and is copying the volume.
    let mut creator = server.clients().await;
    let cut_req = snapshot_req("snap-cut", &vol, "raw");
    let creating = tokio::spawn(async move { creator.snapshot(cut_req).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while state_of(&server, "snap-cut").is_none() {
        assert!(Instant::now() < deadline, "the cut never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let id = "bi://backing?backingImage=snap-cut&backingImageDataSourceType=export-from-volume\
              &export-type=raw&volume-name=pvc-cancel";
    c.delete_snapshot(id)
        .await
        .expect("DeleteSnapshot during the cut");
    // The CreateSnapshot that raced the delete either got its snapshot (then deleted) or
    // hears that it is gone.
    match creating.await.unwrap() {
        Ok(_) => {}
        Err(s) => assert_eq!(s.code(), Code::NotFound, "{s:?}"),
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_no_snapshot_left(&server);
    c.delete_volume(&vol).await;
}

/// CreateSnapshot returns, the volume is overwritten, the driver is stopped (`signal`) while
/// the export runs and started again: the image is made from the cut, not from the volume as
/// it is now, and the snapshot keeps its id and creation time. Deleting it then leaves
/// nothing: not the killed export's temp file, not the cut.
async fn export_survives_restart(signal: i32) {
    // 16 MiB of data at 4 MiB/s: the export outlasts the write below, however fast the
    // machine, and the restart comes while it runs.
    let mut server = Server::shared_images(&["--export-rate", "4194304"]);
    let mut c = server.clients().await;
    let (vol, before) = volume_with_data(&mut c, &server, "pvc-pit", 7).await;
    let req = snapshot_req("snap-pit", &vol, "raw");
    let first = c.snapshot(req.clone()).await.expect("CreateSnapshot");
    c.write_block(
        &vol,
        &server.path().join("targets"),
        0,
        &pattern(MIB as usize, 8),
    )
    .await;
    assert_eq!(
        state_of(&server, "snap-pit").unwrap()["ready"],
        false,
        "the export must still run when the driver is stopped"
    );
    server.restart_with(signal);
    let mut c = server.clients().await;
    let snap = c.snapshot_ready(req).await;
    assert_eq!(snap.snapshot_id, first.snapshot_id);
    assert_eq!(
        snap.creation_time, first.creation_time,
        "creation time changed"
    );
    let want = sha512_of_disk(DISK as usize, &before);
    let image = server.images_dir().join("snap-pit.img");
    assert_eq!(sha512_of_file(&image), want, "the image is not the cut");
    assert_eq!(
        state_of(&server, "snap-pit").unwrap()["current_checksum"],
        want.as_str()
    );
    assert_eq!(entries(&cuts_dir(&server)), Vec::<String>::new());
    c.delete_snapshot(&snap.snapshot_id).await.unwrap();
    c.delete_volume(&vol).await;
    assert_no_snapshot_left(&server);
}

#[tokio::test(flavor = "multi_thread")]
async fn export_survives_sigterm() {
    export_survives_restart(libc::SIGTERM).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn export_survives_sigkill_and_leaves_nothing() {
    export_survives_restart(libc::SIGKILL).await;
}

/// A restore waiting for a snapshot still being exported, with the volume overwritten: the
/// driver is stopped (`signal`) during the export, then again during the restore. The
/// restored volume holds the data of before the snapshot, and nothing is left over.
async fn restore_survives(signal: i32) {
    // The export must outlast `--image-wait`, however fast the build: each conversion ends
    // 3 s after its data is written, so a driver killed meanwhile leaves no writer behind.
    let tools = tempfile::tempdir().unwrap();
    let mut server = server_wrapping(tools.path(), "qemu-img", &["--image-wait", "1"], |real| {
        format!("#!/bin/sh\n{real} \"$@\"\nrc=$?\n[ \"$1\" = convert ] && sleep 3\nexit $rc\n")
    });
    let mut c = server.clients().await;
    let work = server.path().join("targets");
    let (vol, before) = volume_with_data(&mut c, &server, "pvc-src", 11).await;
    let snap = c
        .snapshot(snapshot_req("snap-src", &vol, "raw"))
        .await
        .expect("CreateSnapshot");
    c.write_block(&vol, &work, 0, &pattern(MIB as usize, 12))
        .await;
    let vreq = block_volume_req("pvc-dst", DISK, Some(&snap.snapshot_id));
    let err = c.volume_refused(vreq.clone()).await;
    assert_eq!(err.code(), Code::Aborted, "the export still runs: {err:?}");
    server.restart_with(signal);

    // Start the restore with calls that give up at once, and kill the driver while it copies.
    let mut c = server.clients().await;
    let volumes = server.path().join("store/volumes");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        assert!(Instant::now() < deadline, "the restore never started");
        let mut r = tonic::Request::new(vreq.clone());
        r.set_timeout(Duration::from_millis(20));
        let _ = c.ctl.create_volume(r).await;
        if !temps_under(&volumes).is_empty() || volumes.join("pvc-dst").exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.restart_with(signal);

    let mut c = server.clients().await;
    let restored = c.create_volume_retrying(vreq).await.expect("CreateVolume");
    let (got, size) = c
        .read_block(&restored.volume_id, &work, 0, before.len())
        .await;
    assert_eq!(size, DISK as u64);
    assert!(
        got == before,
        "the restored volume does not hold the snapshot's data"
    );
    c.delete_restore(&restored.volume_id, &snap.snapshot_id, &vol)
        .await;
    assert_no_snapshot_left(&server);
}

/// A driver killed outright (SIGKILL: no cleanup runs) takes the tools it started with it:
/// a conversion left running would go on writing an image nobody will use.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_driver_leaves_no_tool_running() {
    let tools = tempfile::tempdir().unwrap();
    let pid_file = tools.path().join("convert.pid");
    let mut server = server_wrapping(tools.path(), "qemu-img", &[], |real| {
        format!(
            "#!/bin/sh\n[ \"$1\" = convert ] && {{ echo $$ > '{}'; exec sleep 30; }}\nexec {real} \"$@\"\n",
            pid_file.display()
        )
    });
    let mut c = server.clients().await;
    let (vol, _) = volume_with_data(&mut c, &server, "pvc-src", 13).await;
    c.snapshot(snapshot_req("snap-src", &vol, "qcow2"))
        .await
        .expect("CreateSnapshot");
    let deadline = Instant::now() + Duration::from_secs(60);
    let pid = loop {
        if let Some(pid) = fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            break pid;
        }
        assert!(Instant::now() < deadline, "the export never ran qemu-img");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    server.restart_with(libc::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(5);
    // Gone, or dead and waiting for whoever adopted it to reap it.
    let alive = || {
        fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit_once(')')
                .is_some_and(|(_, rest)| !rest.starts_with(" Z"))
        })
    };
    while alive() {
        assert!(
            Instant::now() < deadline,
            "qemu-img (pid {pid}) still runs 5 s after its driver was killed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn restore_survives_restarts() {
    restore_survives(libc::SIGKILL).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn restore_survives_sigterm() {
    restore_survives(libc::SIGTERM).await;
}

/// The driver is stopped (`signal`) while CreateSnapshot is still cutting the volume. A cut
/// that was not yet durable leaves nothing, and the CO's retry cuts the volume as it is
/// then. A durable one (a SIGTERM lets the call in flight finish, though its reply may be
/// lost with the connection) is what the image is made of after the restart.
async fn cut_interrupted(signal: i32) {
    let mut server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let work = server.path().join("targets");
    let vol = c.volume(block_volume_req("pvc-cut", 48 * MIB, None)).await;
    // Much real data: the copy of the cut takes a while.
    let before = pattern(32 * MIB as usize, 21);
    c.write_block(&vol.volume_id, &work, 0, &before).await;
    let req = snapshot_req("snap-cut", &vol.volume_id, "raw");
    let mut creator = server.clients().await;
    let creating = {
        let req = req.clone();
        tokio::spawn(async move { creator.snapshot(req).await })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while state_of(&server, "snap-cut").is_none() {
        assert!(Instant::now() < deadline, "the cut never started");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    server.restart_with(signal);
    let returned = creating.await.unwrap();
    if signal == libc::SIGKILL {
        assert!(returned.is_err(), "the cut was interrupted");
    }
    let mut c = server.clients().await;
    let now = pattern(MIB as usize, 22);
    let mut want = before.clone();
    // A cut made durable before the stop survives it, whether or not its reply got out
    // (the stop may close the connection under the answer): the CO's retry gets that
    // snapshot, made of the data before. A cut that was not is gone without a trace.
    let survived = returned.is_ok() || state_of(&server, "snap-cut").is_some();
    if !survived {
        assert_no_snapshot_left(&server);
        want[..now.len()].copy_from_slice(&now);
    }
    c.write_block(&vol.volume_id, &work, 0, &now).await;
    let snap = c.snapshot_ready(req).await;
    if let Ok(first) = &returned {
        assert_eq!(snap.creation_time, first.creation_time);
    }
    let image = server.images_dir().join("snap-cut.img");
    assert_eq!(
        sha512_of_file(&image),
        sha512_of_disk(48 * MIB as usize, &want)
    );
    c.delete_snapshot(&snap.snapshot_id).await.unwrap();
    c.delete_volume(&vol.volume_id).await;
    assert_no_snapshot_left(&server);
}

#[tokio::test(flavor = "multi_thread")]
async fn cut_interrupted_by_sigkill_leaves_nothing() {
    cut_interrupted(libc::SIGKILL).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cut_interrupted_by_sigterm() {
    cut_interrupted(libc::SIGTERM).await;
}

/// The driver is killed while a cut holds a published filesystem frozen: the next start-up
/// thaws it, so the volume's writers do not hang forever.
#[tokio::test(flavor = "multi_thread")]
async fn a_filesystem_frozen_by_a_killed_cut_is_thawed_at_start_up() {
    let mut server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let vol = c
        .volume(mount_volume_req("pvc-frozen", 96 * MIB, None))
        .await;
    let target = server.path().join("targets/frozen");
    c.publish_mount(&vol.volume_id, &target).await;
    // Unsynced data: the freeze writes it out, which keeps the filesystem frozen a while.
    fs::write(target.join("data"), pattern(64 * MIB as usize, 31)).unwrap();
    let mut creator = server.clients().await;
    let req = snapshot_req("snap-frozen", &vol.volume_id, "raw");
    let creating = tokio::spawn(async move { creator.snapshot(req).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while state_of(&server, "snap-frozen").is_none() {
        assert!(Instant::now() < deadline, "the cut never started");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    server.restart_with(libc::SIGKILL);
    let _ = creating.await;

    let (tx, rx) = std::sync::mpsc::channel();
    let file = target.join("after");
    std::thread::spawn(move || {
        let _ = tx.send(fs::write(file, b"written after the restart"));
    });
    let written = rx.recv_timeout(Duration::from_secs(10));
    if written.is_err() {
        // Thaw it here, or cleaning up would hang too.
        let _ = Command::new("fsfreeze").arg("-u").arg(&target).status();
    }
    assert!(
        matches!(written, Ok(Ok(()))),
        "the volume stayed frozen: {written:?}"
    );
    let mut c = server.clients().await;
    c.unpublish(&vol.volume_id, &target)
        .await
        .expect("NodeUnpublishVolume");
    c.delete_volume(&vol.volume_id).await;
    assert_no_snapshot_left(&server);
}

/// At start-up a node removes its own temporaries from the shared BackingImage directory and
/// leaves those of every other node alone, even one whose name starts with its own.
#[tokio::test(flavor = "multi_thread")]
async fn start_up_removes_only_this_node_s_temporaries() {
    let mut server = Server::shared_images(&[]);
    let dir = server.images_dir();
    let own = [".tmp-node1~snap-a-123-4", ".tmp-node1~snap-b.json-123-5"];
    let others = [".tmp-node1-b~snap-a-77-1", ".tmp-node2~snap-c-88-2"];
    for name in own.iter().chain(&others) {
        fs::write(dir.join(name), b"partial").unwrap();
    }
    fs::create_dir(dir.join(".tmp-node1~snap-d-123-6")).unwrap();
    fs::write(dir.join(".tmp-node1~snap-d-123-6/snap-d"), b"partial").unwrap();
    fs::create_dir_all(cuts_dir(&server)).unwrap();
    fs::write(cuts_dir(&server).join("orphan.raw"), b"cut").unwrap();
    server.restart_with(libc::SIGKILL);
    let mut left = others.map(String::from).to_vec();
    left.sort();
    assert_eq!(entries(&dir), left);
    assert_eq!(entries(&cuts_dir(&server)), Vec::<String>::new());
}
