//! Integrity at rest: an image changed on disk after it was made is never restored from nor
//! reported ready, and a state file that no longer decodes is moved aside; deleting either
//! snapshot frees everything, what was moved aside included.
//!
//! Needs root (loop devices, mounts), `qemu-img`, `losetup`. Every server is stopped, and
//! every mount and loop device under its temp dir removed, even when a test panics.

mod common;

use std::fs;
use std::path::PathBuf;

use common::*;
use layerfs_csi::proto::*;
use tonic::Code;

fn quarantine_dir(server: &Server) -> PathBuf {
    server.images_dir().join(".quarantine")
}

/// An image changed on disk after it was made (a byte flipped, or cut short) is never restored
/// from nor reported ready: DATA_LOSS naming it, the file moved aside, the state saying why.
/// Deleting the snapshot then frees everything.
#[tokio::test(flavor = "multi_thread")]
async fn an_image_altered_on_disk_is_not_restored_from() {
    use std::os::unix::fs::FileExt;
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let (vol, _) = volume_with_data(&mut c, &server, "pvc-rot", 3).await;
    for (snap_name, damage) in [("snap-flipped", "flip"), ("snap-short", "truncate")] {
        let req = snapshot_req(snap_name, &vol, "raw");
        let snap = c.snapshot_ready(req.clone()).await;
        let image = server.images_dir().join(format!("{snap_name}.img"));
        let file = fs::OpenOptions::new().write(true).open(&image).unwrap();
        if damage == "flip" {
            file.write_all_at(b"\x5a", 12345).unwrap();
        } else {
            let len = file.metadata().unwrap().len();
            file.set_len(len - 4096).unwrap();
        }
        drop(file);

        let refused = c
            .volume_refused(block_volume_req(
                &format!("pvc-from-{snap_name}"),
                DISK,
                Some(&snap.snapshot_id),
            ))
            .await;
        assert_eq!(refused.code(), Code::DataLoss, "{snap_name}: {refused:?}");
        assert!(refused.message().contains(snap_name), "{refused:?}");

        let again = c.snapshot_refused(req).await;
        assert_eq!(again.code(), Code::DataLoss, "{again:?}");
        let listed = c.list_id(&snap.snapshot_id).await;
        assert!(
            listed
                .entries
                .iter()
                .all(|e| !e.snapshot.as_ref().unwrap().ready_to_use),
            "{listed:?}"
        );
        assert!(!image.exists(), "the altered image is moved aside");
        let state = state_of(&server, snap_name).unwrap();
        assert!(state["quarantined"].is_string(), "{state}");
        assert_eq!(entries(&quarantine_dir(&server)).len(), 1);

        c.delete_snapshot(&snap.snapshot_id).await.unwrap();
        assert!(state_of(&server, snap_name).is_none());
        assert_eq!(entries(&quarantine_dir(&server)), Vec::<String>::new());
    }
    c.delete_volume(&vol).await;
    assert_no_snapshot_left(&server);
}

/// A state file that is garbled (or cut short) is moved aside, at start-up or when it is
/// read: ListSnapshots still answers, and DeleteSnapshot of its snapshot succeeds and frees
/// its files, the quarantined state included.
#[tokio::test(flavor = "multi_thread")]
async fn a_garbled_state_file_is_quarantined_and_its_snapshot_deleted() {
    let mut server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let (vol, _) = volume_with_data(&mut c, &server, "pvc-garbled", 5).await;
    let at_start = c
        .snapshot_ready(snapshot_req("snap-garbled-start", &vol, "raw"))
        .await;
    let at_run = c
        .snapshot_ready(snapshot_req("snap-garbled-run", &vol, "raw"))
        .await;
    let state = server.images_dir().join("snap-garbled-start.json");
    let text = fs::read(&state).unwrap();
    fs::write(&state, &text[..text.len() / 2]).unwrap();
    server.restart_with(libc::SIGTERM);
    let mut c = server.clients().await;
    assert!(!state.exists(), "quarantined at start-up");
    assert_eq!(entries(&quarantine_dir(&server)).len(), 1);
    assert!(!server.images_dir().join("snap-garbled-start.img").exists());

    fs::write(
        server.images_dir().join("snap-garbled-run.json"),
        b"{\"name\": 7}",
    )
    .unwrap();
    let listed = c.list(ListSnapshotsRequest::default()).await.unwrap();
    assert!(listed.entries.is_empty(), "{listed:?}");
    for snap in [&at_start, &at_run] {
        c.delete_snapshot(&snap.snapshot_id).await.unwrap();
    }
    assert!(!server.images_dir().join("snap-garbled-run.img").exists());
    assert_eq!(
        entries(&quarantine_dir(&server)),
        Vec::<String>::new(),
        "deleting the snapshots frees their quarantined state files"
    );
    c.delete_volume(&vol).await;
    assert_no_snapshot_left(&server);
}
