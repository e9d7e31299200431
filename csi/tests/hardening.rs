//! Hardening of the driver (DESIGN §7): NodeUnpublish removes only what NodePublish made,
//! also after a restart; Node paths must be absolute and clean; misspelt parameters are
//! refused by name; logs written to a file carry no terminal colour codes; the capacity
//! promised to volumes stays within what the store can hold.
//!
//! Needs root (loop devices, mounts), `losetup`, `mkfs.ext4`, `qemu-img`.

mod common;

use std::fs;
use std::path::Path;

use common::*;
use layerfs_csi::proto::*;
use tonic::Code;

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn assert_refused<T: std::fmt::Debug>(result: Result<T, tonic::Status>, code: Code, naming: &str) {
    let status = result.expect_err("the call should fail");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().contains(naming),
        "the message should name {naming:?}: {status:?}"
    );
}

/// A regular file or directory at a target path the driver never published there is someone
/// else's: unpublish refuses to touch it, and says where. Nothing at all there is fine.
#[tokio::test(flavor = "multi_thread")]
async fn unpublish_leaves_what_it_did_not_publish_alone() {
    let server = Server::start();
    let mut c = server.clients().await;
    let vol = c
        .volume(volume_req("foreign", 16 * MIB, block_cap()))
        .await
        .volume_id;
    let dir = server.path().join("pods");
    fs::create_dir_all(&dir).unwrap();

    let file = dir.join("file");
    fs::write(&file, b"someone's data").unwrap();
    let empty_file = dir.join("empty-file");
    fs::write(&empty_file, b"").unwrap();
    let full_dir = dir.join("dir");
    fs::create_dir(&full_dir).unwrap();
    fs::write(full_dir.join("inside"), b"more data").unwrap();
    let empty_dir = dir.join("empty-dir");
    fs::create_dir(&empty_dir).unwrap();

    for target in [&file, &empty_file, &full_dir, &empty_dir] {
        let t = path_str(target);
        assert_refused(c.unpublish(&vol, &t).await, Code::FailedPrecondition, &t);
    }
    assert_eq!(fs::read(&file).unwrap(), b"someone's data");
    assert!(empty_file.is_file(), "the empty file was removed");
    assert_eq!(fs::read(full_dir.join("inside")).unwrap(), b"more data");
    assert!(empty_dir.is_dir(), "the empty directory was removed");

    // Nothing there: nothing to do.
    c.unpublish(&vol, &path_str(&dir.join("nothing")))
        .await
        .expect("unpublish where nothing is");
}

/// Someone else's mount at the target is not unmounted.
#[tokio::test(flavor = "multi_thread")]
async fn unpublish_leaves_a_foreign_mount_alone() {
    let server = Server::start();
    let mut c = server.clients().await;
    let vol = c
        .volume(volume_req("mounted", 16 * MIB, mount_cap()))
        .await
        .volume_id;
    let target = server.path().join("pods/t");
    fs::create_dir_all(&target).unwrap();
    let status = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "foreign"])
        .arg(&target)
        .status()
        .unwrap();
    assert!(status.success(), "mount tmpfs");
    fs::write(target.join("data"), b"tmpfs data").unwrap();

    let t = path_str(&target);
    assert_refused(c.unpublish(&vol, &t).await, Code::FailedPrecondition, &t);
    assert!(is_mount_point(&target), "the foreign tmpfs was unmounted");
    assert_eq!(fs::read(target.join("data")).unwrap(), b"tmpfs data");
    // Nor is the volume published over it.
    assert_refused(
        c.publish(&vol, &t, mount_cap()).await,
        Code::FailedPrecondition,
        &t,
    );
}

/// What the driver published is recognised and removed after it was killed and started
/// again, for both access types; a second unpublish finds nothing and is fine.
#[tokio::test(flavor = "multi_thread")]
async fn unpublish_removes_what_it_published_also_after_a_restart() {
    let mut server = Server::start();
    let mut c = server.clients().await;
    let block = c
        .volume(volume_req("blk", 16 * MIB, block_cap()))
        .await
        .volume_id;
    let mount = c
        .volume(volume_req("fs", 16 * MIB, mount_cap()))
        .await
        .volume_id;
    let block_target = server.path().join("pods/a/dev");
    let mount_target = server.path().join("pods/b/mnt");
    c.publish(&block, &path_str(&block_target), block_cap())
        .await
        .expect("publish block");
    c.publish(&mount, &path_str(&mount_target), mount_cap())
        .await
        .expect("publish mount");
    assert!(is_mount_point(&block_target) && is_mount_point(&mount_target));

    server.restart();
    let mut c = server.clients().await;
    // Publishing again after the restart is idempotent, not a second mount.
    c.publish(&mount, &path_str(&mount_target), mount_cap())
        .await
        .expect("publish mount again");
    for (vol, target) in [(&block, &block_target), (&mount, &mount_target)] {
        c.unpublish(vol, &path_str(target))
            .await
            .expect("unpublish");
        assert!(
            !is_mount_point(target),
            "{} still mounted",
            target.display()
        );
        assert!(
            fs::symlink_metadata(target).is_err(),
            "{} was not removed",
            target.display()
        );
        c.unpublish(vol, &path_str(target))
            .await
            .expect("unpublish again");
    }
    // Nothing is published any more: the volumes can go.
    for vol in [&block, &mount] {
        c.delete_volume(vol).await;
    }
}

/// The mount table alone tells the driver's own publication from anything else: with its
/// record gone, the volume's mount is still unpublished and its target removed.
#[tokio::test(flavor = "multi_thread")]
async fn unpublish_recognises_its_mounts_without_a_record() {
    let server = Server::start();
    let mut c = server.clients().await;
    for (name, cap) in [("norecord-blk", block_cap()), ("norecord-fs", mount_cap())] {
        let vol = c
            .volume(volume_req(name, 16 * MIB, cap.clone()))
            .await
            .volume_id;
        let target = server.path().join("pods").join(name);
        c.publish(&vol, &path_str(&target), cap)
            .await
            .expect("publish");
        let record = server
            .path()
            .join("store/volumes")
            .join(&vol)
            .join("publish.json");
        fs::remove_file(&record).expect("remove the publication record");
        c.unpublish(&vol, &path_str(&target))
            .await
            .expect("unpublish");
        assert!(!is_mount_point(&target), "{name} still mounted");
        assert!(fs::symlink_metadata(&target).is_err(), "{name} not removed");
    }
}

/// Target and staging paths are absolute and clean, or the call is INVALID_ARGUMENT naming
/// the field, before anything is made or mounted.
#[tokio::test(flavor = "multi_thread")]
async fn node_paths_must_be_absolute_and_clean() {
    let server = Server::start();
    let mut c = server.clients().await;
    let vol = c
        .volume(volume_req("paths", 16 * MIB, block_cap()))
        .await
        .volume_id;
    let root = path_str(server.path());
    let bad = [
        "rel/target".to_owned(),
        "target".to_owned(),
        format!("{root}/x/../y"),
        format!("{root}/x/./y"),
        format!("{root}//y"),
        format!("{root}/y/"),
        format!("{root}/y\0z"),
    ];
    for target in &bad {
        assert_refused(
            c.publish(&vol, target, block_cap()).await,
            Code::InvalidArgument,
            "target_path",
        );
        assert_refused(
            c.unpublish(&vol, target).await,
            Code::InvalidArgument,
            "target_path",
        );
    }
    let staged = c
        .node
        .node_publish_volume(NodePublishVolumeRequest {
            volume_id: vol.clone(),
            target_path: format!("{root}/pods/t"),
            staging_target_path: "stage".into(),
            volume_capability: Some(block_cap()),
            ..Default::default()
        })
        .await
        .map(|_| ());
    assert_refused(staged, Code::InvalidArgument, "staging_target_path");
    // Nothing was made anywhere.
    assert!(!server.path().join("rel").exists());
    assert!(!server.path().join("target").exists());
    assert!(!server.path().join("x").exists());
    assert!(!server.path().join("y").exists());
    assert!(!server.path().join("pods").exists());
    // A volume is never published at a relative path: the spec's NOT_FOUND for stats.
    let stats = c
        .node
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: vol.clone(),
            volume_path: "some/path".into(),
            ..Default::default()
        })
        .await
        .map(|_| ());
    assert_refused(stats, Code::NotFound, "some/path");
}

/// A misspelt VolumeSnapshotClass or StorageClass key is refused by name, not ignored; the
/// keys the sidecars add are accepted.
#[tokio::test(flavor = "multi_thread")]
async fn unknown_parameters_are_refused_by_name() {
    let server = Server::start();
    let mut c = server.clients().await;
    let vol = c
        .volume(volume_req("params", 16 * MIB, block_cap()))
        .await
        .volume_id;
    let snapshot = |params: &[(&str, &str)]| CreateSnapshotRequest {
        source_volume_id: vol.clone(),
        name: "snap".into(),
        parameters: params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    let typo = c
        .ctl
        .create_snapshot(snapshot(&[("type", "bi"), ("exporttype", "qcow2")]))
        .await
        .map(|_| ());
    assert_refused(typo, Code::InvalidArgument, "exporttype");

    let made = c
        .ctl
        .create_snapshot(snapshot(&[
            ("type", "bi"),
            ("exportType", "raw"),
            ("csi.storage.k8s.io/volumesnapshot/name", "snap"),
        ]))
        .await
        .expect("CreateSnapshot with the sidecar's keys")
        .into_inner()
        .snapshot
        .expect("snapshot");
    c.ctl
        .delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: made.snapshot_id,
            ..Default::default()
        })
        .await
        .expect("DeleteSnapshot");

    let mut req = volume_req("params-2", 16 * MIB, block_cap());
    req.parameters.insert("backingImage".into(), "x".into());
    let refused = c.ctl.create_volume(req).await.map(|_| ());
    assert_refused(refused, Code::InvalidArgument, "backingImage");
    let mut req = volume_req("params-3", 16 * MIB, block_cap());
    req.parameters
        .insert("csi.storage.k8s.io/pvc/name".into(), "data".into());
    c.volume(req).await;
}

/// Logs written to a file are plain text: no colour escape sequences.
#[tokio::test(flavor = "multi_thread")]
async fn logs_to_a_file_have_no_colour_codes() {
    let server = Server::start_logging(true);
    let mut c = server.clients().await;
    c.volume(volume_req("logged", 16 * MIB, block_cap())).await;
    let log = fs::read_to_string(server.log().unwrap()).unwrap();
    assert!(log.contains("created volume"), "nothing logged: {log:?}");
    assert!(!log.contains('\x1b'), "colour codes in the log: {log:?}");
}

/// Slack for the store's own small files (state, metadata) on the tmpfs.
const SLACK: i64 = MIB / 4;

/// Volumes are sparse, yet each must be able to fill up: what the driver promises stays
/// within what the store's filesystem can hold, GetCapacity says what is left, and more is
/// refused when asked (not failed later, as a write error inside the volume).
#[tokio::test(flavor = "multi_thread")]
async fn capacity_promised_stays_within_the_store() {
    let server = Server::start_on_tmpfs("64m", &[]);
    let mut c = server.clients().await;
    let empty = c.capacity_left().await;
    assert!((64 * MIB - SLACK..=64 * MIB).contains(&empty), "{empty}");

    let a = c
        .volume(volume_req("cap-a", 40 * MIB, block_cap()))
        .await
        .volume_id;
    let left = c.capacity_left().await;
    assert!(
        (empty - 40 * MIB - SLACK..=empty - 40 * MIB).contains(&left),
        "{left}"
    );

    let more = c
        .ctl
        .create_volume(volume_req("cap-b", 30 * MIB, block_cap()))
        .await
        .map(|_| ());
    assert_refused(more, Code::ResourceExhausted, "left for volumes");
    let never = c
        .ctl
        .create_volume(volume_req("cap-c", 100 * MIB, block_cap()))
        .await
        .map(|_| ());
    assert_refused(never, Code::OutOfRange, "can ever hold");
    assert_refused(
        c.expand(&a, 80 * MIB).await,
        Code::ResourceExhausted,
        "left for volumes",
    );
    c.expand(&a, 44 * MIB)
        .await
        .expect("expand within what is left");

    // Data written into a volume is space it was promised: what is left does not change.
    let before = c.capacity_left().await;
    let disk = server.path().join(format!("store/volumes/{a}/disk.img"));
    let file = fs::OpenOptions::new().write(true).open(&disk).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &vec![0x5a; 8 << 20], 0).unwrap();
    drop(file);
    let after = c.capacity_left().await;
    assert!((after - before).abs() <= SLACK, "{before} -> {after}");

    let listed = c
        .ctl
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1, "nothing left of refused volumes");
    c.delete_volume(&a).await;
    let freed = c.capacity_left().await;
    assert!((empty - SLACK..=empty).contains(&freed), "{freed}");
    c.volume(volume_req("cap-b", 30 * MIB, block_cap())).await;
}

/// `--over-provisioning 200` lets sparse volumes be promised twice what the store holds.
#[tokio::test(flavor = "multi_thread")]
async fn over_provisioning_scales_what_may_be_promised() {
    let server = Server::start_on_tmpfs("64m", &["--over-provisioning", "200"]);
    let mut c = server.clients().await;
    let empty = c.capacity_left().await;
    assert!(
        (128 * MIB - 2 * SLACK..=128 * MIB).contains(&empty),
        "{empty}"
    );
    c.volume(volume_req("over-a", 60 * MIB, block_cap())).await;
    c.volume(volume_req("over-b", 60 * MIB, block_cap())).await;
    let more = c
        .ctl
        .create_volume(volume_req("over-c", 16 * MIB, block_cap()))
        .await
        .map(|_| ());
    assert_refused(more, Code::ResourceExhausted, "over-provisioning 200%");
}
