//! The driver end to end outside BackingImages: identity and capabilities, CreateVolume's
//! errors and idempotency, capacities the store cannot hold, Node calls (their arguments, a
//! failing `blkid`, a slow filesystem check that must hold up only its own volume), and a
//! caller who is not root.
//!
//! Needs root (loop devices, mounts), `losetup`, `mkfs.ext4`. Every server is stopped, and
//! every mount and loop device under its temp dir removed, even when a test panics.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use layerfs_csi::proto::volume_capability::access_mode::Mode;
use layerfs_csi::proto::volume_capability::AccessMode;
use layerfs_csi::proto::*;
use tonic::Code;

#[tokio::test(flavor = "multi_thread")]
async fn identity_and_capabilities() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let info =
        c.id.get_plugin_info(GetPluginInfoRequest {})
            .await
            .unwrap()
            .into_inner();
    assert_eq!(info.name, "layerfs.csi.io");
    let probe = c.id.probe(ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready, Some(true));
    let caps = c
        .ctl
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    let types: Vec<i32> = caps
        .capabilities
        .iter()
        .filter_map(|c| {
            c.r#type
                .as_ref()
                .map(|controller_service_capability::Type::Rpc(r)| r.r#type)
        })
        .collect();
    use controller_service_capability::rpc::Type as T;
    for t in [
        T::CreateDeleteVolume,
        T::CreateDeleteSnapshot,
        T::ListSnapshots,
    ] {
        assert!(types.contains(&(t as i32)), "{t:?} advertised");
    }
    // No resizer can run per node, so expansion is not advertised.
    assert!(!types.contains(&(T::ExpandVolume as i32)));
    assert!(!types.contains(&(T::PublishUnpublishVolume as i32)));
    let info = c
        .node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, "node1");
}

#[tokio::test(flavor = "multi_thread")]
async fn volume_errors_and_idempotency() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let a = c.volume(block_volume_req("pvc-idem", 10 * MIB, None)).await;
    let b = c.volume(block_volume_req("pvc-idem", 10 * MIB, None)).await;
    assert_eq!(a, b);
    let err = c
        .volume_refused(block_volume_req("pvc-idem", 20 * MIB, None))
        .await;
    assert_eq!(err.code(), Code::AlreadyExists);
    let upper = "V".repeat(128);
    let u1 = c.volume(block_volume_req(&upper, 4 * MIB, None)).await;
    let u2 = c.volume(block_volume_req(&upper, 4 * MIB, None)).await;
    assert_eq!(u1.volume_id, u2.volume_id);
    for bad in ["", "../../etc", "x/y", "nul\0"] {
        let err = c.volume_refused(block_volume_req(bad, MIB, None)).await;
        assert_eq!(err.code(), Code::InvalidArgument, "{bad:?}");
    }
    let mut no_caps = block_volume_req("pvc-nocaps", MIB, None);
    no_caps.volume_capabilities.clear();
    assert_eq!(
        c.volume_refused(no_caps).await.code(),
        Code::InvalidArgument
    );
    let mut multi = block_volume_req("pvc-multi", MIB, None);
    multi.volume_capabilities[0].access_mode = Some(AccessMode {
        mode: Mode::MultiNodeMultiWriter as i32,
    });
    assert_eq!(c.volume_refused(multi).await.code(), Code::InvalidArgument);

    // Snapshot ids that are not ours, or incomplete.
    let err = c
        .volume_refused(block_volume_req("r1", MIB, Some("garbage")))
        .await;
    assert_eq!(err.code(), Code::NotFound);
    let err = c
        .volume_refused(block_volume_req(
            "r2",
            MIB,
            Some("bi://backing?backingImage=x"),
        ))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = c
        .volume_refused(block_volume_req("r3", MIB, Some("snap://v/s")))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = c
        .volume_refused(block_volume_req(
            "r4",
            MIB,
            Some("bi://backing?backingImage=x&backingImageDataSourceType=upload"),
        ))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument);

    // Unknown ids.
    c.delete_volume("no-such-volume").await;
    c.delete_volume("../../etc").await;
    let err = c
        .node
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: "no-such-volume".into(),
            target_path: "/tmp/nowhere".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = c
        .ctl
        .validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
            volume_id: "no-such-volume".into(),
            volume_capabilities: vec![block_cap()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let ok = c
        .ctl
        .validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
            volume_id: a.volume_id.clone(),
            volume_capabilities: vec![block_cap(), mount_cap()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ok.confirmed.is_some());

    // Expansion grows, never shrinks.
    let grown = c.expand(&a.volume_id, 30 * MIB).await.unwrap();
    assert_eq!(grown.capacity_bytes, 30 * MIB);
    let volumes = c
        .ctl
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(volumes.entries.len(), 2);
    c.delete_volume(&a.volume_id).await;
    c.delete_volume(&u1.volume_id).await;
}

/// A capacity the volume store's filesystem cannot hold is OUT_OF_RANGE (a size the driver
/// does not support), not an internal failure, and leaves nothing behind.
#[tokio::test(flavor = "multi_thread")]
async fn capacity_beyond_the_store_is_out_of_range() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    // Past ext4's largest file (16 TiB): the filesystem answers EFBIG. Filesystems with
    // larger files (xfs, tmpfs) take it, so then only the second case applies. i64::MAX is
    // past what a signed 64-bit size can say once rounded up to the volume alignment.
    let huge = 1i64 << 62;
    let mut cases = Vec::new();
    if store_refuses_size(server.path(), huge as u64) {
        cases.push(("pvc-huge", huge));
    } else {
        eprintln!("the store's filesystem holds {huge}-byte files; EFBIG is not reached");
    }
    cases.push(("pvc-max", i64::MAX));
    for &(name, bytes) in &cases {
        let err = c.volume_refused(block_volume_req(name, bytes, None)).await;
        assert_eq!(err.code(), Code::OutOfRange, "{name}: {err:?}");
    }
    let volumes = c
        .ctl
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(volumes.entries.is_empty(), "{volumes:?}");
    assert_eq!(temps_under(server.path()), Vec::<PathBuf>::new());

    let vol = c.volume(block_volume_req("pvc-grow", 4 * MIB, None)).await;
    for &(_, bytes) in &cases {
        let err = c.expand(&vol.volume_id, bytes).await.unwrap_err();
        assert_eq!(err.code(), Code::OutOfRange, "expand to {bytes}: {err:?}");
    }
    c.delete_volume(&vol.volume_id).await;
}

/// Whether the filesystem holding `dir` refuses a sparse file of `len` bytes as too large.
fn store_refuses_size(dir: &Path, len: u64) -> bool {
    let probe = tempfile::tempfile_in(dir).unwrap();
    match probe.set_len(len) {
        Ok(()) => false,
        Err(e) => e.raw_os_error() == Some(libc::EFBIG),
    }
}

/// A failing `blkid` (here: exit 8, ambiguous signatures) must not make NodePublish format a
/// volume that holds a filesystem.
#[tokio::test(flavor = "multi_thread")]
async fn publish_never_formats_when_blkid_fails() {
    let tools = tempfile::tempdir().unwrap();
    let flag = tools.path().join("fail");
    let server = server_wrapping(tools.path(), "blkid", &[], |real| {
        format!(
            "#!/bin/sh\n[ -e '{}' ] && {{ echo 'ambiguous signatures' >&2; exit 8; }}\nexec {real} \"$@\"\n",
            flag.display(),
        )
    });
    let mut c = server.clients().await;
    let vol = c.volume(mount_volume_req("pvc-keep", 32 * MIB, None)).await;
    let target = server.path().join("targets/keep");
    c.publish_mount(&vol.volume_id, &target).await;
    fs::write(target.join("precious"), b"do not lose me").unwrap();
    c.unpublish(&vol.volume_id, &target)
        .await
        .expect("NodeUnpublishVolume");

    fs::write(&flag, b"").unwrap();
    let err = c
        .publish(&vol.volume_id, &target, mount_cap())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("not formatted"), "{}", err.message());

    fs::remove_file(&flag).unwrap();
    c.publish_mount(&vol.volume_id, &target).await;
    assert_eq!(
        fs::read(target.join("precious")).unwrap(),
        b"do not lose me"
    );
    c.unpublish(&vol.volume_id, &target)
        .await
        .expect("NodeUnpublishVolume");
    c.delete_volume(&vol.volume_id).await;
}

/// A publish that checks and grows volume A's filesystem (`e2fsck -f`, then `resize2fs`) holds
/// up neither a publish of volume B nor anything else on B, while a second publish of A waits
/// for the first. The real `e2fsck` runs, behind a gate the test opens: the first one to pass
/// it waits there until told to go on.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_publish_holds_up_only_its_own_volume() {
    let tools = tempfile::tempdir().unwrap();
    let armed = tools.path().join("armed");
    let held = tools.path().join("held");
    let release = tools.path().join("release");
    let server = server_wrapping(tools.path(), "e2fsck", &[], |real| {
        format!(
            "#!/bin/sh\n\
             if [ -e '{armed}' ] && mkdir '{held}' 2>/dev/null; then\n\
             i=0; while [ ! -e '{release}' ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done\n\
             fi\n\
             exec {real} \"$@\"\n",
            armed = armed.display(),
            held = held.display(),
            release = release.display(),
        )
    });
    let mut c = server.clients().await;
    let targets = server.path().join("targets");
    let a = c.volume(mount_volume_req("pvc-slow", 32 * MIB, None)).await;
    let b = c
        .volume(mount_volume_req("pvc-other", 32 * MIB, None))
        .await;
    // Formatted at its first publish; grown while unpublished, so the next publish checks
    // and grows the filesystem.
    let (a_first, a_second) = (targets.join("a1"), targets.join("a2"));
    c.publish_mount(&a.volume_id, &a_first).await;
    c.unpublish(&a.volume_id, &a_first)
        .await
        .expect("NodeUnpublishVolume");
    c.expand(&a.volume_id, 64 * MIB).await.unwrap();

    fs::write(&armed, b"").unwrap();
    let publish_a = |target: PathBuf| {
        let mut c = Clients {
            id: c.id.clone(),
            ctl: c.ctl.clone(),
            node: c.node.clone(),
        };
        let id = a.volume_id.clone();
        tokio::spawn(async move { c.publish(&id, &target, mount_cap()).await })
    };
    let slow = publish_a(a_first.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !held.exists() {
        assert!(
            Instant::now() < deadline,
            "the publish of A never reached e2fsck"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waiting = publish_a(a_second.clone());

    // B: published, expanded, unpublished, all while A's e2fsck is held.
    let b_target = targets.join("b");
    let on_b = async {
        c.publish_mount(&b.volume_id, &b_target).await;
        fs::write(b_target.join("file"), b"b").unwrap();
        c.unpublish(&b.volume_id, &b_target)
            .await
            .expect("NodeUnpublishVolume");
    };
    let b_result = tokio::time::timeout(Duration::from_secs(20), on_b).await;
    let a_done_early = slow.is_finished() || waiting.is_finished();
    fs::write(&release, b"").unwrap();
    let slow = slow.await.unwrap();
    let waiting = waiting.await.unwrap();
    assert!(
        b_result.is_ok(),
        "publishing volume B waited for volume A's e2fsck (20 s)"
    );
    assert!(
        !a_done_early,
        "a publish of volume A finished while A's first publish was held in e2fsck"
    );
    slow.expect("the held publish of A");
    waiting.expect("the second publish of A");
    c.unpublish(&a.volume_id, &a_first)
        .await
        .expect("NodeUnpublishVolume");
    c.unpublish(&a.volume_id, &a_second)
        .await
        .expect("NodeUnpublishVolume");
    c.delete_volume(&a.volume_id).await;
    c.delete_volume(&b.volume_id).await;
}

#[test]
fn a_caller_who_is_not_root_is_refused_in_the_daemon_s_words() {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN])
        .args([
            "--node-id",
            "n1",
            "--endpoint",
            "unix:///run/layerfs/test-csi.sock",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("setpriv");
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "layerfs-csi: unix:///run/layerfs/test-csi.sock: permission denied (root only)\n"
    );
}

/// Node calls on a volume that does not exist, with an argument missing: the argument is
/// what is wrong (INVALID_ARGUMENT), whatever the volume.
#[tokio::test(flavor = "multi_thread")]
async fn node_calls_check_arguments_before_the_volume() {
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let target = server
        .path()
        .join("targets/t")
        .to_string_lossy()
        .into_owned();
    let no_target = c
        .node
        .node_publish_volume(NodePublishVolumeRequest {
            volume_id: "no-such-volume".into(),
            volume_capability: Some(mount_cap()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(no_target.code(), Code::InvalidArgument, "{no_target:?}");
    let no_cap = c
        .node
        .node_publish_volume(NodePublishVolumeRequest {
            volume_id: "no-such-volume".into(),
            target_path: target.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(no_cap.code(), Code::InvalidArgument, "{no_cap:?}");
    let unpublish = c
        .node
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: "no-such-volume".into(),
            target_path: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(unpublish.code(), Code::InvalidArgument, "{unpublish:?}");
    // With every argument there, the volume is what is missing.
    let missing = c
        .node
        .node_publish_volume(NodePublishVolumeRequest {
            volume_id: "no-such-volume".into(),
            target_path: target,
            volume_capability: Some(mount_cap()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");
}
