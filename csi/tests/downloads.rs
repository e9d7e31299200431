//! BackingImages made from a handle instead of a snapshot: downloads, pre-provisioned
//! (scenario 3) and on demand (scenario 4, with the on-demand export), and what keeps them
//! safe: checksums, hostile images, `file://` confinement, loopback URLs refused by default,
//! HTML answers, stalled bodies. A failure leaves nothing behind, and ListSnapshots lists
//! only the images that exist, as ready only once they are.
//!
//! Needs root (loop devices, mounts), `qemu-img`, `losetup`, `mkfs.ext4`. Every server is
//! stopped, and every mount and loop device under its temp dir removed, even when a test
//! panics.

mod common;

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::http::HttpServer;
use common::*;
use layerfs_csi::proto::*;
use tonic::Code;

fn qcow2_of(raw: &[u8], dir: &Path) -> Vec<u8> {
    let src = dir.join("src.raw");
    let dst = dir.join("src.qcow2");
    fs::write(&src, raw).expect("write raw");
    let ok = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&src)
        .arg(&dst)
        .status()
        .expect("qemu-img");
    assert!(ok.success());
    fs::read(&dst).expect("read qcow2")
}

#[tokio::test(flavor = "multi_thread")]
async fn scenario_3_preprovisioned_download() {
    let server = Server::shared_images(&[ALLOW_LOCAL]);
    let http = HttpServer::start();
    let mut c = server.clients().await;
    let work = server.path().join("targets");
    let raw = pattern(8 * MIB as usize, 3);
    let sum = sha512_hex(&raw);
    let url = http.serve("/images/parrot.raw", raw.clone());
    // As Longhorn's tests write it: the url unescaped, keys in any order.
    let handle = format!(
        "bi://backing?backingImageDataSourceType=download&backingImage=bi-test&url={url}&backingImageChecksum={sum}"
    );
    // The snapshotter asks ListSnapshots about the content first: that starts the download,
    // and the snapshot is listed, not ready, until the image is fetched and verified.
    http.hold.store(true, std::sync::atomic::Ordering::SeqCst);
    let listed = c.list_id(&handle).await;
    assert_eq!(listed.entries.len(), 1, "{listed:?}");
    assert!(!listed.entries[0].snapshot.as_ref().unwrap().ready_to_use);
    http.hold.store(false, std::sync::atomic::Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = c.list_id(&handle).await;
        if listed.entries[0].snapshot.as_ref().unwrap().ready_to_use {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the listed download never became ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(http.requests(), 1);

    let vol = c
        .volume_retrying(block_volume_req("pvc-download", 16 * MIB, Some(&handle)))
        .await;
    let state = state_of(&server, "bi-test").expect("state");
    assert_eq!(state["source_type"], "download");
    assert_eq!(state["parameters"]["url"], url.as_str());
    assert_eq!(state["current_checksum"], sum.as_str());
    assert_eq!(state["ready"], true);
    assert_eq!(state["progress"]["done"], 8 * MIB);
    let (got, size) = c.read_block(&vol.volume_id, &work, 0, raw.len()).await;
    assert_eq!(size, 16 * MIB as u64);
    assert!(got == raw, "restored bytes differ");
    // Listed now, ready, with its real size.
    let listed = c.list_id(&handle).await;
    assert_eq!(listed.entries.len(), 1, "{listed:?}");
    let entry = listed.entries[0].snapshot.clone().unwrap();
    assert_eq!(entry.snapshot_id, handle);
    assert!(entry.ready_to_use);
    assert_eq!(entry.size_bytes, 8 * MIB);
    c.delete_volume(&vol.volume_id).await;
    c.delete_snapshot(&handle).await.unwrap();
    assert!(state_of(&server, "bi-test").is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn scenario_4_on_demand_download_and_export() {
    let server = Server::shared_images(&[ALLOW_LOCAL]);
    let http = HttpServer::start();
    let mut c = server.clients().await;
    let work = server.path().join("targets");
    fs::create_dir_all(&work).unwrap();

    // download, qcow2, escaped url, no checksum
    let raw = pattern(6 * MIB as usize, 11);
    let qcow = qcow2_of(&raw, &work);
    let url = http.serve("/parrot.qcow2", qcow.clone());
    let escaped: String = url::form_urlencoded::byte_serialize(url.as_bytes()).collect();
    let handle = format!(
        "bi://backing?backingImage=on-demand-dl&backingImageDataSourceType=download&url={escaped}"
    );
    let vol = c
        .volume_retrying(block_volume_req("pvc-dl-q", 8 * MIB, Some(&handle)))
        .await;
    let state = state_of(&server, "on-demand-dl").unwrap();
    assert_eq!(state["format"], "qcow2");
    assert_eq!(state["current_checksum"], sha512_hex(&qcow).as_str());
    let (got, _) = c.read_block(&vol.volume_id, &work, 0, raw.len()).await;
    assert!(got == raw, "download (qcow2) restore differs");

    // export-from-volume, qcow2, from a handle the driver never made
    let src = c
        .volume(block_volume_req("pvc-exp-src", 16 * MIB, None))
        .await;
    let data = pattern(MIB as usize, 99);
    c.write_block(&src.volume_id, &work, 3 * MIB as u64, &data)
        .await;
    let handle = format!(
        "bi://backing?backingImage=on-demand-exp&backingImageDataSourceType=export-from-volume&export-type=qcow2&volume-name={}",
        src.volume_id
    );
    let vol2 = c
        .volume_retrying(block_volume_req("pvc-exp-q", 16 * MIB, Some(&handle)))
        .await;
    let state = state_of(&server, "on-demand-exp").unwrap();
    assert_eq!(state["source_type"], "export-from-volume");
    assert_eq!(state["format"], "qcow2");
    let (got, _) = c
        .read_block(&vol2.volume_id, &work, 3 * MIB as u64, data.len())
        .await;
    assert!(got == data, "export (qcow2) restore differs");
    // The same handle with other parameters for an existing image is refused.
    let other = handle.replace("export-type=qcow2", "export-type=raw");
    let err = c
        .volume_refused(block_volume_req("pvc-exp-other", 16 * MIB, Some(&other)))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    // An export handle naming a volume that does not exist: NOT_FOUND.
    let missing = "bi://backing?backingImage=nope&backingImageDataSourceType=export-from-volume&export-type=raw&volume-name=no-such-volume";
    let err = c
        .volume_refused(block_volume_req("pvc-missing", 16 * MIB, Some(missing)))
        .await;
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    for v in [&vol, &vol2, &src] {
        c.delete_volume(&v.volume_id).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn download_failures_leave_nothing_behind() {
    let server = Server::shared_images(&[ALLOW_LOCAL]);
    let http = HttpServer::start();
    let mut c = server.clients().await;
    let raw = pattern(2 * MIB as usize, 5);
    let url = http.serve("/img.raw", raw.clone());
    let wrong = sha512_hex(b"something else");
    let handle = format!(
        "bi://backing?backingImage=bad-sum&backingImageDataSourceType=download&url={url}&backingImageChecksum={wrong}"
    );
    let err = c
        .volume_refused_retrying(block_volume_req("pvc-bad-sum", 4 * MIB, Some(&handle)))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("checksum mismatch"),
        "{}",
        err.message()
    );
    assert_eq!(
        visible_images(&server),
        Vec::<String>::new(),
        "nothing left behind"
    );

    // A malformed checksum is refused up front.
    let handle = format!(
        "bi://backing?backingImage=bad-form&backingImageDataSourceType=download&url={url}&backingImageChecksum=abc"
    );
    let err = c
        .volume_refused(block_volume_req("pvc-bad-form", 4 * MIB, Some(&handle)))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument);

    // Nothing listens on this port.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let handle = format!(
        "bi://backing?backingImage=unreachable&backingImageDataSourceType=download&url=http://127.0.0.1:{port}/x.raw"
    );
    let err = c
        .volume_refused_retrying(block_volume_req("pvc-unreachable", 4 * MIB, Some(&handle)))
        .await;
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("unreachable"), "{}", err.message());

    let handle = format!(
        "bi://backing?backingImage=missing&backingImageDataSourceType=download&url=http://127.0.0.1:{}/missing.raw",
        http.port
    );
    let err = c
        .volume_refused_retrying(block_volume_req("pvc-404", 4 * MIB, Some(&handle)))
        .await;
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().contains("404"), "{}", err.message());

    // Only http, https and file URLs.
    let handle =
        "bi://backing?backingImage=ftp&backingImageDataSourceType=download&url=ftp://127.0.0.1/x";
    let err = c
        .volume_refused(block_volume_req("pvc-ftp", 4 * MIB, Some(handle)))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument);

    // An image that refers to a backing file is refused.
    let work = server.path().join("work");
    fs::create_dir_all(&work).unwrap();
    let base = work.join("base.raw");
    fs::write(&base, vec![1u8; 65536]).unwrap();
    let overlay = work.join("overlay.qcow2");
    let ok = Command::new("qemu-img")
        .args(["create", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(&base)
        .arg(&overlay)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(ok.success());
    let url = http.serve("/hostile.qcow2", fs::read(&overlay).unwrap());
    let handle =
        format!("bi://backing?backingImage=hostile&backingImageDataSourceType=download&url={url}");
    let err = c
        .volume_refused_retrying(block_volume_req("pvc-hostile", 4 * MIB, Some(&handle)))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("backing file"), "{}", err.message());
    assert_eq!(visible_images(&server), Vec::<String>::new());

    // After all that the server still answers.
    c.id.probe(ProbeRequest {}).await.unwrap();
}

/// `file://` URLs: disabled without `--file-root`; with it, only regular files below the root,
/// never through a symlink, never a FIFO. Loopback hosts are refused by default; the old
/// `--deny-private-urls` is still accepted.
#[tokio::test(flavor = "multi_thread")]
async fn file_urls_are_confined() {
    let code = |r: Result<Volume, tonic::Status>| r.map(|_| Code::Ok).unwrap_or_else(|s| s.code());
    let handle = |name: &str, url: &str| {
        format!("bi://backing?backingImage={name}&backingImageDataSourceType=download&url={url}")
    };

    // Disabled.
    let server = Server::shared_images(&[]);
    let mut c = server.clients().await;
    let err = c
        .volume_refused(block_volume_req(
            "pvc-shadow",
            4 * MIB,
            Some(&handle("shadow", "file:///etc/shadow")),
        ))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("--file-root"), "{}", err.message());
    drop(c);
    drop(server);

    // Confined to the root.
    let root = tempfile::tempdir().unwrap();
    let raw = pattern(2 * MIB as usize, 77);
    fs::write(root.path().join("ok.raw"), &raw).unwrap();
    std::os::unix::fs::symlink("/etc/shadow", root.path().join("link.raw")).unwrap();
    let fifo = root.path().join("fifo.raw");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let root_s = root.path().to_string_lossy().into_owned();
    let server = Server::shared_images(&["--file-root", &root_s, "--deny-private-urls"]);
    let mut c = server.clients().await;
    let ok = format!("file://{root_s}/ok.raw");
    let vol = c
        .volume_retrying(block_volume_req(
            "pvc-file",
            4 * MIB,
            Some(&handle("from-file", &ok)),
        ))
        .await;
    let work = server.path().join("targets");
    let (got, _) = c.read_block(&vol.volume_id, &work, 0, raw.len()).await;
    assert!(got == raw);
    for (name, url) in [
        ("outside", "file:///etc/shadow".to_owned()),
        ("dotdot", format!("file://{root_s}/../../etc/shadow")),
        ("link", format!("file://{root_s}/link.raw")),
        ("fifo", format!("file://{root_s}/fifo.raw")),
        ("loopback", "http://127.0.0.1:9/x.raw".to_owned()),
    ] {
        let got = code(
            c.create_volume_retrying(block_volume_req(
                &format!("pvc-{name}"),
                4 * MIB,
                Some(&handle(name, &url)),
            ))
            .await,
        );
        assert_eq!(got, Code::InvalidArgument, "{name}: {url}");
    }
    assert_eq!(
        visible_images(&server),
        vec!["from-file.img".to_owned(), "from-file.json".to_owned()]
    );
    c.delete_volume(&vol.volume_id).await;
}

/// A download whose body stalls fails after the idle timeout, leaves nothing, and later calls
/// work.
#[tokio::test(flavor = "multi_thread")]
async fn stalled_download_fails() {
    let server = Server::shared_images(&[
        ALLOW_LOCAL,
        "--download-idle-timeout",
        "2",
        "--image-wait",
        "20",
    ]);
    let http = HttpServer::start();
    let mut c = server.clients().await;
    let raw = pattern(4 * MIB as usize, 1);
    let url = http.serve("/stall.raw", raw.clone());
    http.stalls
        .lock()
        .unwrap()
        .insert("/stall.raw".into(), MIB as usize);
    let handle =
        format!("bi://backing?backingImage=stall&backingImageDataSourceType=download&url={url}");
    let started = Instant::now();
    let err = c
        .volume_refused_retrying(block_volume_req("pvc-stall", 4 * MIB, Some(&handle)))
        .await;
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("stalled"), "{}", err.message());
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(visible_images(&server), Vec::<String>::new());
    assert_eq!(temps_under(&server.images_dir()), Vec::<PathBuf>::new());
    // The same image works once the server behaves.
    http.stalls.lock().unwrap().clear();
    let vol = c
        .volume_retrying(block_volume_req("pvc-stall", 4 * MIB, Some(&handle)))
        .await;
    c.delete_volume(&vol.volume_id).await;
}

/// Lists `id` until it is not listed any more (its download failed), checking it is never
/// listed as ready meanwhile.
async fn never_ready_then_gone(c: &mut Clients, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let entries = listed(c, id).await;
        assert!(entries.iter().all(|e| !e.ready_to_use), "{id}: {entries:?}");
        if entries.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "{id}: still listed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn listed(c: &mut Clients, id: &str) -> Vec<Snapshot> {
    c.list_id(id)
        .await
        .entries
        .into_iter()
        .filter_map(|e| e.snapshot)
        .collect()
}

/// A handle is listed only when its image exists, and ready only when the image is complete,
/// checksummed and still there. Handles whose image was deleted, never made, or cannot be
/// fetched name no snapshot; ListSnapshots never fetches anything itself.
#[tokio::test(flavor = "multi_thread")]
async fn list_snapshots_tells_the_truth() {
    let server = Server::shared_images(&[ALLOW_LOCAL]);
    let http = HttpServer::start();
    let mut c = server.clients().await;
    let vol = c.volume(block_volume_req("pvc-truth", 4 * MIB, None)).await;

    // A snapshot, deleted: its handle is gone from the list.
    let snap = c
        .snapshot_ready(snapshot_req("truth-1", &vol.volume_id, "raw"))
        .await;
    assert!(listed(&mut c, &snap.snapshot_id).await[0].ready_to_use);
    c.delete_snapshot(&snap.snapshot_id).await.unwrap();
    assert_eq!(listed(&mut c, &snap.snapshot_id).await, vec![]);

    // An export handle never made, of an existing volume.
    let never = format!(
        "bi://backing?backingImage=never&backingImageDataSourceType=export-from-volume&export-type=raw&volume-name={}",
        vol.volume_id
    );
    assert_eq!(listed(&mut c, &never).await, vec![]);

    // Download handles whose URL answers 404 or refuses connections: listing one tries to
    // fetch it, and it is never ready; once the attempt failed, it is not listed at all.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let good = http.serve("/truth.raw", pattern(2 * MIB as usize, 9));
    for (i, url) in [
        format!("http://127.0.0.1:{}/missing.raw", http.port),
        format!("http://127.0.0.1:{port}/x.raw"),
        "http://127.0.0.1:1/x.raw".to_owned(),
    ]
    .iter()
    .enumerate()
    {
        let id = format!(
            "bi://backing?backingImage=dl-{i}&backingImageDataSourceType=download&url={url}"
        );
        never_ready_then_gone(&mut c, &id).await;
    }
    // A failed download leaves no snapshot either.
    let gone = format!(
        "bi://backing?backingImage=gone&backingImageDataSourceType=download&url=http://127.0.0.1:{}/missing.raw",
        http.port
    );
    let err = c
        .volume_refused_retrying(block_volume_req("pvc-gone", 4 * MIB, Some(&gone)))
        .await;
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    never_ready_then_gone(&mut c, &gone).await;

    // A download in progress is listed, not ready; once verified, ready.
    http.hold.store(true, std::sync::atomic::Ordering::SeqCst);
    let handle = format!(
        "bi://backing?backingImage=truth-dl&backingImageDataSourceType=download&url={good}"
    );
    let mut creator = server.clients().await;
    let req = block_volume_req("pvc-truth-dl", 4 * MIB, Some(&handle));
    let task = tokio::spawn(async move { creator.create_volume_retrying(req).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while state_of(&server, "truth-dl").is_none() {
        assert!(Instant::now() < deadline, "the download never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pending = listed(&mut c, &handle).await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert!(!pending[0].ready_to_use);
    http.hold.store(false, std::sync::atomic::Ordering::SeqCst);
    let restored = task.await.unwrap().unwrap();
    let ready = listed(&mut c, &handle).await;
    assert!(ready[0].ready_to_use);
    assert_eq!(ready[0].size_bytes, 2 * MIB);

    // An image file that went away: listed, not ready.
    fs::remove_file(server.images_dir().join("truth-dl.img")).unwrap();
    let broken = listed(&mut c, &handle).await;
    assert_eq!(broken.len(), 1);
    assert!(!broken[0].ready_to_use);
    let all = c.list(ListSnapshotsRequest::default()).await.unwrap();
    assert!(all
        .entries
        .iter()
        .all(|e| !e.snapshot.as_ref().unwrap().ready_to_use));

    c.delete_snapshot(&handle).await.unwrap();
    c.delete_volume(&restored.volume_id).await;
    c.delete_volume(&vol.volume_id).await;
}

/// Without `--allow-private-urls`, URLs of loopback hosts are refused up front, whether the
/// host is an address, `localhost` or another name that resolves to a loopback address; the
/// server is never contacted.
#[tokio::test(flavor = "multi_thread")]
async fn private_urls_are_refused_by_default() {
    let server = Server::shared_images(&[]);
    let http = HttpServer::start();
    let mut c = server.clients().await;
    let url = http.serve("/local.raw", pattern(MIB as usize, 4));
    let mut urls = vec![
        url.clone(),
        url.replace("127.0.0.1", "localhost"),
        url.replace("127.0.0.1", "[::ffff:127.0.0.1]"),
    ];
    // A name of this host that /etc/hosts maps to a loopback address: refused when resolved.
    let hosts = fs::read_to_string("/etc/hosts").unwrap_or_default();
    let alias = hosts
        .lines()
        .filter(|l| l.starts_with("127."))
        .flat_map(|l| l.split_whitespace().skip(1))
        .find(|n| !n.contains("localhost"));
    if let Some(name) = alias {
        urls.push(url.replace("127.0.0.1", name));
    }
    for (i, url) in urls.iter().enumerate() {
        let handle = format!(
            "bi://backing?backingImage=local-{i}&backingImageDataSourceType=download&url={url}"
        );
        let err = c
            .volume_refused_retrying(block_volume_req(
                &format!("pvc-local-{i}"),
                4 * MIB,
                Some(&handle),
            ))
            .await;
        assert_eq!(err.code(), Code::InvalidArgument, "{url}: {err:?}");
        assert!(
            err.message().contains("--allow-private-urls"),
            "{url}: {}",
            err.message()
        );
    }
    assert_eq!(http.requests(), 0, "a refused URL was fetched");
    assert_eq!(visible_images(&server), Vec::<String>::new());
}

/// An answer that is an HTML page is no image: refused by its Content-Type, or, without one,
/// by its first bytes. Nothing is kept.
#[tokio::test(flavor = "multi_thread")]
async fn html_answers_are_refused() {
    let server = Server::shared_images(&[ALLOW_LOCAL]);
    let http = HttpServer::start();
    let mut c = server.clients().await;
    let mut page = b"<!DOCTYPE html>\n<html><body>Sign in</body></html>\n".to_vec();
    page.resize(64 * 1024, b' ');
    let typed = http.serve("/typed.raw", pattern(MIB as usize, 8));
    http.types
        .lock()
        .unwrap()
        .insert("/typed.raw".into(), "text/html; charset=utf-8".into());
    let sniffed = http.serve("/login", page);
    for (name, url, words) in [
        ("typed", &typed, "Content-Type"),
        ("sniffed", &sniffed, "HTML"),
    ] {
        let handle = format!(
            "bi://backing?backingImage={name}&backingImageDataSourceType=download&url={url}"
        );
        let err = c
            .volume_refused_retrying(block_volume_req(
                &format!("pvc-{name}"),
                4 * MIB,
                Some(&handle),
            ))
            .await;
        assert_eq!(err.code(), Code::InvalidArgument, "{name}: {err:?}");
        assert!(err.message().contains(words), "{name}: {}", err.message());
    }
    assert_eq!(visible_images(&server), Vec::<String>::new());
    assert_eq!(temps_under(&server.images_dir()), Vec::<PathBuf>::new());
    // An image labelled as one is fine.
    let ok = http.serve("/ok.raw", pattern(MIB as usize, 8));
    http.types
        .lock()
        .unwrap()
        .insert("/ok.raw".into(), "application/octet-stream".into());
    let handle =
        format!("bi://backing?backingImage=ok&backingImageDataSourceType=download&url={ok}");
    let vol = c
        .volume_retrying(block_volume_req("pvc-ok", 4 * MIB, Some(&handle)))
        .await;
    c.delete_volume(&vol.volume_id).await;
}
