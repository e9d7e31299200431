//! BackingImages through VolumeSnapshots, end to end: a snapshot is a BackingImage exported
//! from a volume (scenario 1), a volume is restored from it (scenario 2), and both are
//! deleted; a Mount volume's files through snapshot and restore; CreateSnapshot's errors and
//! names, its retry once the source is gone; ListSnapshots filtering and paging; what
//! DeleteSnapshot refuses or leaves alone; a snapshot of a volume in use holding what was just
//! written.
//!
//! Needs root (loop devices, mounts), `qemu-img`, `losetup`, `mkfs.ext4`. Every server is
//! stopped, and every mount and loop device under its temp dir removed, even when a test
//! panics.

mod common;

use std::fs;
use std::time::{Duration, Instant};

use common::http::HttpServer;
use common::*;
use layerfs_csi::proto::volume_content_source::{SnapshotSource, Type as SourceType};
use layerfs_csi::proto::*;
use tonic::Code;

fn image_of(handle: &str) -> String {
    let query = handle.split_once('?').map(|(_, q)| q).unwrap_or("");
    url::form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "backingImage")
        .map(|(_, v)| v.into_owned())
        .expect("backingImage in handle")
}

#[tokio::test(flavor = "multi_thread")]
async fn scenario_1_2_snapshot_restore_delete() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let work = server.path().join("targets");
    fs::create_dir_all(&work).unwrap();

    let vol = c
        .volume(block_volume_req("pvc-source", 64 * MIB, None))
        .await;
    assert_eq!(vol.capacity_bytes, 64 * MIB);
    let data = pattern(3 * MIB as usize + 123, 7);
    c.write_block(&vol.volume_id, &work, 5 * MIB as u64, &data)
        .await;

    // (1) the snapshot is a BackingImage exported from the volume, raw.
    let req = snapshot_req("snapshot-1", &vol.volume_id, "raw");
    let snap = c.snapshot_ready(req.clone()).await;
    assert_eq!(snap.source_volume_id, vol.volume_id);
    assert_eq!(snap.size_bytes, 64 * MIB);
    assert!(snap.snapshot_id.starts_with(
        "bi://backing?backingImage=snapshot-1&backingImageDataSourceType=export-from-volume&export-type=raw&volume-name=pvc-source"
    ), "{}", snap.snapshot_id);
    let image = image_of(&snap.snapshot_id);
    let state = state_of(&server, &image).expect("state file");
    assert_eq!(state["source_type"], "export-from-volume");
    assert_eq!(state["parameters"]["volume-name"], vol.volume_id.as_str());
    assert_eq!(state["parameters"]["export-type"], "raw");
    assert_eq!(state["ready"], true);
    let file = fs::read(server.images_dir().join(format!("{image}.img"))).unwrap();
    assert_eq!(state["current_checksum"], sha512_hex(&file).as_str());
    // Idempotent: the same answer again.
    let again = c.snapshot(req.clone()).await.unwrap();
    assert_eq!(again, snap);

    // (2) restore: a bigger volume holds the same bytes.
    let restored = c
        .volume(block_volume_req(
            "pvc-restored",
            96 * MIB,
            Some(&snap.snapshot_id),
        ))
        .await;
    assert_eq!(restored.capacity_bytes, 96 * MIB);
    assert_eq!(
        restored
            .content_source
            .as_ref()
            .and_then(|s| s.r#type.clone()),
        Some(SourceType::Snapshot(SnapshotSource {
            snapshot_id: snap.snapshot_id.clone()
        }))
    );
    let (got, size) = c
        .read_block(&restored.volume_id, &work, 5 * MIB as u64, data.len())
        .await;
    assert_eq!(size, 96 * MIB as u64);
    assert!(got == data, "restored bytes differ");
    // Idempotent restore; a different capacity under the same name is ALREADY_EXISTS.
    let again = c
        .volume(block_volume_req(
            "pvc-restored",
            96 * MIB,
            Some(&snap.snapshot_id),
        ))
        .await;
    assert_eq!(again.volume_id, restored.volume_id);
    let err = c
        .volume_refused(block_volume_req(
            "pvc-restored",
            128 * MIB,
            Some(&snap.snapshot_id),
        ))
        .await;
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    // Smaller than the image: OUT_OF_RANGE.
    let err = c
        .volume_refused(block_volume_req(
            "pvc-small",
            32 * MIB,
            Some(&snap.snapshot_id),
        ))
        .await;
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");

    // Delete the snapshot: the image is gone; deleting again is fine.
    c.delete_snapshot(&snap.snapshot_id).await.unwrap();
    assert_eq!(visible_images(&server), Vec::<String>::new());
    c.delete_snapshot(&snap.snapshot_id).await.unwrap();
    // The restored volume does not depend on the image.
    let (got, _) = c
        .read_block(&restored.volume_id, &work, 5 * MIB as u64, data.len())
        .await;
    assert!(got == data);
    c.delete_volume(&restored.volume_id).await;
    c.delete_volume(&vol.volume_id).await;
    c.delete_volume(&vol.volume_id).await;
}

/// A Mount volume: formatted once, its files survive snapshot and restore, the restored
/// filesystem grows to the new capacity.
#[tokio::test(flavor = "multi_thread")]
async fn mount_volume_snapshot_restore() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let work = server.path().join("targets");
    let vol = c.volume(mount_volume_req("pvc-fs", 64 * MIB, None)).await;
    let target = work.join("fs");
    c.publish_mount(&vol.volume_id, &target).await;
    c.publish_mount(&vol.volume_id, &target).await; // idempotent
    fs::write(target.join("hello.txt"), b"hello from layerfs").unwrap();
    let stats = c
        .node
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: target.to_string_lossy().into_owned(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(stats.usage[0].total > 0 && stats.usage[0].used > 0);
    c.unpublish(&vol.volume_id, &target)
        .await
        .expect("NodeUnpublishVolume");
    c.unpublish(&vol.volume_id, &target)
        .await
        .expect("NodeUnpublishVolume"); // idempotent
                                        // Republishing does not reformat.
    c.publish_mount(&vol.volume_id, &target).await;
    assert_eq!(
        fs::read(target.join("hello.txt")).unwrap(),
        b"hello from layerfs"
    );
    c.unpublish(&vol.volume_id, &target)
        .await
        .expect("NodeUnpublishVolume");

    let snap = c
        .snapshot_ready(snapshot_req("snap-fs", &vol.volume_id, "qcow2"))
        .await;
    let state = state_of(&server, &image_of(&snap.snapshot_id)).unwrap();
    assert_eq!(state["format"], "qcow2");
    let restored = c
        .volume(mount_volume_req(
            "pvc-fs-restored",
            128 * MIB,
            Some(&snap.snapshot_id),
        ))
        .await;
    let target2 = work.join("fs2");
    c.publish_mount(&restored.volume_id, &target2).await;
    assert_eq!(
        fs::read(target2.join("hello.txt")).unwrap(),
        b"hello from layerfs"
    );
    let st = nix::sys::statvfs::statvfs(&target2).unwrap();
    let total = st.blocks() as u64 * st.fragment_size() as u64;
    assert!(total > 100 * MIB as u64, "filesystem grew: {total}");
    // A published volume cannot be deleted.
    let err = c
        .ctl
        .delete_volume(DeleteVolumeRequest {
            volume_id: restored.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    c.unpublish(&restored.volume_id, &target2)
        .await
        .expect("NodeUnpublishVolume");
    c.delete_volume(&restored.volume_id).await;
    c.delete_snapshot(&snap.snapshot_id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshot_errors_and_names() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let vol = c.volume(block_volume_req("pvc-a", 8 * MIB, None)).await;
    let vol_b = c.volume(block_volume_req("pvc-b", 8 * MIB, None)).await;

    let code =
        |r: Result<Snapshot, tonic::Status>| r.map(|_| Code::Ok).unwrap_or_else(|s| s.code());
    assert_eq!(
        code(c.snapshot(snapshot_req("", "pvc-a", "raw")).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.snapshot(snapshot_req("s", "", "raw")).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.snapshot(snapshot_req("s", "no-such", "raw")).await),
        Code::NotFound
    );
    assert_eq!(
        code(c.snapshot(snapshot_req("s", "pvc-a", "vmdk")).await),
        Code::InvalidArgument
    );
    for bad in ["../escape", "a/b", "a\0b", ".."] {
        assert_eq!(
            code(c.snapshot(snapshot_req(bad, "pvc-a", "raw")).await),
            Code::InvalidArgument,
            "{bad:?}"
        );
    }
    let mut longhorn = snapshot_req("s", "pvc-a", "raw");
    longhorn.parameters.insert("type".into(), "snap".into());
    let err = c.snapshot_refused(longhorn).await;
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("type bi"), "{}", err.message());
    // exportType (camelCase) is read first.
    let mut camel = snapshot_req("camel", "pvc-a", "raw");
    camel.parameters.insert("exportType".into(), "qcow2".into());
    let snap = c.snapshot_ready(camel).await;
    assert!(snap.snapshot_id.contains("export-type=qcow2"));

    // 128-character upper-case name: mapped the same way on every call.
    let long: String = "SNAPSHOT-"
        .chars()
        .chain(std::iter::repeat('X'))
        .take(128)
        .collect();
    let first = c.snapshot_ready(snapshot_req(&long, "pvc-a", "raw")).await;
    let second = c
        .snapshot(snapshot_req(&long, "pvc-a", "raw"))
        .await
        .unwrap();
    assert_eq!(first, second);
    let image = image_of(&first.snapshot_id);
    assert!(
        image.len() <= 63 && image == image.to_lowercase(),
        "{image}"
    );
    // Same name, other source: ALREADY_EXISTS.
    let err = c
        .snapshot_refused(snapshot_req(&long, &vol_b.volume_id, "raw"))
        .await;
    assert_eq!(err.code(), Code::AlreadyExists);
    let err = c
        .snapshot_refused(snapshot_req(&long, "pvc-a", "qcow2"))
        .await;
    assert_eq!(err.code(), Code::AlreadyExists);

    // DeleteSnapshot: empty → INVALID_ARGUMENT; unknown and foreign ids → OK.
    assert_eq!(
        c.delete_snapshot("").await.unwrap_err().code(),
        Code::InvalidArgument
    );
    for id in [
        "garbage",
        "snap://vol/snap",
        "bi://backing?backingImage=nothing&backingImageDataSourceType=download",
        "bi://backing?backingImage=../x&backingImageDataSourceType=download",
    ] {
        c.delete_snapshot(id).await.unwrap();
    }
    c.delete_snapshot(&first.snapshot_id).await.unwrap();
    c.delete_snapshot(&snap.snapshot_id).await.unwrap();
    assert_eq!(visible_images(&server), Vec::<String>::new());
    c.delete_volume(&vol.volume_id).await;
    c.delete_volume(&vol_b.volume_id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn list_snapshots_filters_and_pages() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let a = c.volume(block_volume_req("vol-a", 4 * MIB, None)).await;
    let b = c.volume(block_volume_req("vol-b", 4 * MIB, None)).await;
    let s1 = c
        .snapshot_ready(snapshot_req("s1", &a.volume_id, "raw"))
        .await;
    let s2 = c
        .snapshot_ready(snapshot_req("s2", &a.volume_id, "raw"))
        .await;
    let s3 = c
        .snapshot_ready(snapshot_req("s3", &b.volume_id, "qcow2"))
        .await;

    let all = c.list(ListSnapshotsRequest::default()).await.unwrap();
    let ids: Vec<String> = all
        .entries
        .iter()
        .map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone())
        .collect();
    assert_eq!(
        ids,
        vec![
            s1.snapshot_id.clone(),
            s2.snapshot_id.clone(),
            s3.snapshot_id.clone()
        ]
    );

    let of_a = c
        .list(ListSnapshotsRequest {
            source_volume_id: a.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(of_a.entries.len(), 2);
    let one = c.list_id(&s3.snapshot_id).await;
    assert_eq!(one.entries.len(), 1);
    assert_eq!(one.entries[0].snapshot.as_ref().unwrap(), &s3);
    for id in ["garbage", "bi://backing?backingImage=none&backingImageDataSourceType=export-from-volume&export-type=raw&volume-name=no-vol"] {
        let none = c.list_id(id).await;
        assert!(none.entries.is_empty(), "{id}");
    }
    let none = c
        .list(ListSnapshotsRequest {
            source_volume_id: "no-such-volume".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(none.entries.is_empty());

    let page1 = c
        .list(ListSnapshotsRequest {
            max_entries: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(page1.entries.len(), 2);
    assert!(!page1.next_token.is_empty());
    let page2 = c
        .list(ListSnapshotsRequest {
            max_entries: 2,
            starting_token: page1.next_token.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(page2.entries.len(), 1);
    assert_eq!(
        page2.entries[0].snapshot.as_ref().unwrap().snapshot_id,
        s3.snapshot_id
    );
    assert!(page2.next_token.is_empty());
    let err = c
        .list(ListSnapshotsRequest {
            starting_token: "not-a-token".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted);

    for s in [&s1, &s2, &s3] {
        c.delete_snapshot(&s.snapshot_id).await.unwrap();
    }
    assert!(c
        .list(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .entries
        .is_empty());
    c.delete_volume(&a.volume_id).await;
    c.delete_volume(&b.volume_id).await;
}

/// An image a volume is being created from cannot be deleted (FAILED_PRECONDITION); once the
/// volume exists (it holds its own copy) it can.
#[tokio::test(flavor = "multi_thread")]
async fn image_in_use_cannot_be_deleted() {
    let server = Server::shared_images(&[ALLOW_LOCAL]);
    let http = HttpServer::start();
    let mut c = server.clients().await;
    let raw = pattern(MIB as usize, 21);
    let url = http.serve("/slow.raw", raw);
    http.hold.store(true, std::sync::atomic::Ordering::SeqCst);
    let handle =
        format!("bi://backing?backingImage=slow&backingImageDataSourceType=download&url={url}");
    let mut creator = server.clients().await;
    let req = block_volume_req("pvc-slow", 2 * MIB, Some(&handle));
    let task = tokio::spawn(async move { creator.create_volume_retrying(req).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while state_of(&server, "slow").is_none() {
        assert!(Instant::now() < deadline, "the download never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let err = c.delete_snapshot(&handle).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("in use"), "{}", err.message());
    http.hold.store(false, std::sync::atomic::Ordering::SeqCst);
    let vol = task.await.unwrap().unwrap();
    c.delete_snapshot(&handle).await.unwrap();
    assert_eq!(visible_images(&server), Vec::<String>::new());
    c.delete_volume(&vol.volume_id).await;
}

/// A snapshot of a published Mount volume holds what was just written, without any sync by
/// the writer: the filesystem is frozen (flushed) for the cut.
#[tokio::test(flavor = "multi_thread")]
async fn snapshot_of_published_volume_is_point_in_time() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let work = server.path().join("targets");
    let vol = c.volume(mount_volume_req("pvc-live", 64 * MIB, None)).await;
    let target = work.join("live");
    c.publish_mount(&vol.volume_id, &target).await;
    let content = pattern(3 * MIB as usize, 9);
    fs::write(target.join("fresh.bin"), &content).unwrap(); // no fsync

    let snap = c
        .snapshot_ready(snapshot_req("snap-live", &vol.volume_id, "raw"))
        .await;
    // The writer is not blocked once the snapshot is cut.
    fs::write(target.join("after.txt"), b"later").unwrap();

    let restored = c
        .volume(mount_volume_req(
            "pvc-live-restored",
            64 * MIB,
            Some(&snap.snapshot_id),
        ))
        .await;
    let target2 = work.join("restored");
    c.publish_mount(&restored.volume_id, &target2).await;
    let got = fs::read(target2.join("fresh.bin")).expect("the fresh file is in the snapshot");
    assert!(got == content, "the fresh file's bytes differ");
    assert!(!target2.join("after.txt").exists());
    c.unpublish(&restored.volume_id, &target2)
        .await
        .expect("NodeUnpublishVolume");
    c.unpublish(&vol.volume_id, &target)
        .await
        .expect("NodeUnpublishVolume");
    c.delete_restore(&restored.volume_id, &snap.snapshot_id, &vol.volume_id)
        .await;
}

/// DeleteSnapshot with a handle that names an image but describes another one deletes
/// nothing.
#[tokio::test(flavor = "multi_thread")]
async fn delete_snapshot_checks_the_handle() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let vol = c.volume(block_volume_req("pvc-del", 4 * MIB, None)).await;
    let snap = c
        .snapshot_ready(snapshot_req("snap-big", &vol.volume_id, "raw"))
        .await;
    for other in [
        "bi://backing?backingImage=snap-big&backingImageDataSourceType=download&url=http://example.com/x",
        "bi://backing?backingImage=snap-big&backingImageDataSourceType=export-from-volume&export-type=qcow2&volume-name=pvc-del",
    ] {
        c.delete_snapshot(other).await.unwrap();
        assert!(state_of(&server, "snap-big").is_some(), "{other}");
    }
    c.delete_snapshot(&snap.snapshot_id).await.unwrap();
    assert!(state_of(&server, "snap-big").is_none());
    c.delete_volume(&vol.volume_id).await;
}

/// Capacity without required bytes respects a small limit; CreateSnapshot retried after its
/// source volume is gone answers the snapshot already cut.
#[tokio::test(flavor = "multi_thread")]
async fn capacity_default_and_snapshot_retry_without_source() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let mut req = block_volume_req("pvc-limit", 0, None);
    req.capacity_range = Some(CapacityRange {
        required_bytes: 0,
        limit_bytes: 100 * MIB,
    });
    let vol = c.volume(req.clone()).await;
    assert_eq!(vol.capacity_bytes, 100 * MIB);
    assert_eq!(c.volume(req).await, vol);

    let sreq = snapshot_req("snap-orphan", &vol.volume_id, "raw");
    let snap = c.snapshot_ready(sreq.clone()).await;
    c.delete_volume(&vol.volume_id).await;
    let again = c.snapshot(sreq).await.unwrap();
    assert_eq!(again, snap);
    // A new snapshot of the missing volume is still NOT_FOUND.
    let err = c
        .snapshot_refused(snapshot_req("snap-new", &vol.volume_id, "raw"))
        .await;
    assert_eq!(err.code(), Code::NotFound);
    c.delete_snapshot(&snap.snapshot_id).await.unwrap();
}
