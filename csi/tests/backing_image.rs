//! The CSI driver end to end: the real `layerfs-csi` binary on a unix socket, driven by a gRPC
//! client. Covers the four BackingImage scenarios (snapshot → image → delete; restore; a
//! pre-provisioned download handle; on-demand download and export handles), idempotency, the
//! error rules of DESIGN §7 and ListSnapshots filtering and paging.
//!
//! Needs root (loop devices, mounts), `qemu-img`, `losetup`, `mkfs.ext4`. Every server is
//! stopped, and every mount and loop device under its temp dir removed, even when a test panics.

mod common;

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use layerfs_csi::proto::controller_client::ControllerClient;
use layerfs_csi::proto::identity_client::IdentityClient;
use layerfs_csi::proto::node_client::NodeClient;
use layerfs_csi::proto::volume_capability::access_mode::Mode;
use layerfs_csi::proto::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use layerfs_csi::proto::volume_content_source::{SnapshotSource, Type as SourceType};
use layerfs_csi::proto::*;
use sha2::{Digest, Sha512};
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_layerfs-csi");
const MIB: i64 = 1 << 20;
/// Download tests fetch from 127.0.0.1, which the driver refuses unless told otherwise.
const ALLOW_LOCAL: &str = "--allow-private-urls";

// ---------------------------------------------------------------------------------------------
// Harness

/// A running `layerfs-csi` in a temp dir; stopped and cleaned up on drop.
struct Server {
    child: Child,
    dir: tempfile::TempDir,
    socket: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Server {
    fn start() -> Server {
        Server::start_with(&[])
    }

    fn start_with(extra: &[&str]) -> Server {
        Server::start_env(extra, &[])
    }

    fn start_env(extra: &[&str], env: &[(&str, String)]) -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("csi.sock");
        let args: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let child = Server::spawn(dir.path(), &socket, &args, &env);
        let server = Server {
            child,
            dir,
            socket,
            args,
            env,
        };
        server.wait_for_socket();
        server
    }

    fn spawn(dir: &Path, socket: &Path, args: &[String], env: &[(String, String)]) -> Child {
        Command::new(BIN)
            .arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .args(["--node-id", "node1"])
            .arg("--store")
            .arg(dir.join("store"))
            .arg("--backing-images")
            .arg(dir.join("shared-images"))
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .spawn()
            .expect("start layerfs-csi")
    }

    fn wait_for_socket(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.socket.exists() {
            assert!(Instant::now() < deadline, "the CSI socket never appeared");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the driver with `signal` (SIGTERM: an orderly stop; SIGKILL: a crash) and starts
    /// it again on the same store.
    fn restart(&mut self, signal: i32) {
        unsafe {
            libc::kill(self.child.id() as i32, signal);
        }
        self.child.wait().expect("wait for layerfs-csi");
        // A killed driver leaves its socket: wait for the new one, not the old.
        let _ = fs::remove_file(&self.socket);
        self.child = Server::spawn(self.dir.path(), &self.socket, &self.args, &self.env);
        self.wait_for_socket();
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn images_dir(&self) -> PathBuf {
        self.path().join("shared-images")
    }

    async fn channel(&self) -> Channel {
        let socket = self.socket.clone();
        Endpoint::try_from("http://[::]:50051")
            .expect("endpoint")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let socket = socket.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(socket).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }))
            .await
            .expect("connect to the CSI socket")
    }

    async fn clients(&self) -> Clients {
        let ch = self.channel().await;
        Clients {
            id: IdentityClient::new(ch.clone()),
            ctl: ControllerClient::new(ch.clone()),
            node: NodeClient::new(ch),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
            }
        }
        common::cleanup_under(self.dir.path());
    }
}

struct Clients {
    id: IdentityClient<Channel>,
    ctl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
}

fn block_cap() -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

fn mount_cap() -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

fn volume_req(name: &str, bytes: i64, snapshot: Option<&str>) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![block_cap()],
        volume_content_source: snapshot.map(|id| VolumeContentSource {
            r#type: Some(SourceType::Snapshot(SnapshotSource {
                snapshot_id: id.into(),
            })),
        }),
        ..Default::default()
    }
}

/// A CreateVolume request for an ext4 Mount volume, otherwise as `volume_req`.
fn mount_volume_req(name: &str, bytes: i64, snapshot: Option<&str>) -> CreateVolumeRequest {
    let mut req = volume_req(name, bytes, snapshot);
    req.volume_capabilities = vec![mount_cap()];
    req
}

fn snapshot_req(name: &str, source: &str, export_type: &str) -> CreateSnapshotRequest {
    CreateSnapshotRequest {
        source_volume_id: source.into(),
        name: name.into(),
        parameters: [
            ("type".to_owned(), "bi".to_owned()),
            ("export-type".to_owned(), export_type.to_owned()),
        ]
        .into(),
        ..Default::default()
    }
}

impl Clients {
    async fn create_volume(&mut self, req: CreateVolumeRequest) -> Result<Volume, tonic::Status> {
        let resp = self.ctl.create_volume(req).await?.into_inner();
        Ok(resp.volume.expect("volume in response"))
    }

    /// Creates a volume the scenario needs to exist.
    async fn volume(&mut self, req: CreateVolumeRequest) -> Volume {
        self.create_volume(req).await.expect("CreateVolume")
    }

    /// Calls CreateVolume where it must fail, for the status to check.
    async fn volume_refused(&mut self, req: CreateVolumeRequest) -> tonic::Status {
        self.create_volume(req)
            .await
            .expect_err("CreateVolume should fail")
    }

    /// Creates a volume from an image that may still be in preparation.
    async fn volume_retrying(&mut self, req: CreateVolumeRequest) -> Volume {
        self.create_volume_retrying(req)
            .await
            .expect("CreateVolume (retried)")
    }

    /// Calls CreateVolume past ABORTED where it must fail in the end, for the status to check.
    async fn volume_refused_retrying(&mut self, req: CreateVolumeRequest) -> tonic::Status {
        self.create_volume_retrying(req)
            .await
            .expect_err("CreateVolume (retried) should fail")
    }

    /// Calls CreateSnapshot where it must fail, for the status to check.
    async fn snapshot_refused(&mut self, req: CreateSnapshotRequest) -> tonic::Status {
        self.snapshot(req)
            .await
            .expect_err("CreateSnapshot should fail")
    }

    async fn snapshot(&mut self, req: CreateSnapshotRequest) -> Result<Snapshot, tonic::Status> {
        let resp = self.ctl.create_snapshot(req).await?.into_inner();
        Ok(resp.snapshot.expect("snapshot in response"))
    }

    /// Calls CreateSnapshot until the snapshot is ready, as the CO does; checks the creation
    /// time never changes.
    async fn snapshot_ready(&mut self, req: CreateSnapshotRequest) -> Snapshot {
        let first = self.snapshot(req.clone()).await.expect("CreateSnapshot");
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut snap = first.clone();
        while !snap.ready_to_use {
            assert!(Instant::now() < deadline, "snapshot never became ready");
            tokio::time::sleep(Duration::from_millis(200)).await;
            snap = self
                .snapshot(req.clone())
                .await
                .expect("CreateSnapshot again");
            assert_eq!(
                snap.creation_time, first.creation_time,
                "creation time changed"
            );
            assert_eq!(snap.snapshot_id, first.snapshot_id);
        }
        snap
    }

    /// Calls CreateVolume until it stops answering ABORTED (an image still being prepared).
    async fn create_volume_retrying(
        &mut self,
        req: CreateVolumeRequest,
    ) -> Result<Volume, tonic::Status> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            match self.create_volume(req.clone()).await {
                Err(s) if s.code() == Code::Aborted && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                other => return other,
            }
        }
    }

    /// NodePublishVolume of `volume` at `target` with the capability `cap`.
    async fn publish(
        &mut self,
        volume: &str,
        target: &Path,
        cap: VolumeCapability,
    ) -> Result<(), tonic::Status> {
        self.node
            .node_publish_volume(NodePublishVolumeRequest {
                volume_id: volume.into(),
                target_path: target.to_string_lossy().into_owned(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    async fn expand(
        &mut self,
        volume: &str,
        bytes: i64,
    ) -> Result<ControllerExpandVolumeResponse, tonic::Status> {
        self.ctl
            .controller_expand_volume(ControllerExpandVolumeRequest {
                volume_id: volume.into(),
                capacity_range: Some(CapacityRange {
                    required_bytes: bytes,
                    limit_bytes: 0,
                }),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner())
    }

    async fn publish_block(&mut self, volume: &str, target: &Path) {
        self.publish(volume, target, block_cap())
            .await
            .expect("NodePublishVolume (block)");
    }

    async fn publish_mount(&mut self, volume: &str, target: &Path) {
        self.publish(volume, target, mount_cap())
            .await
            .expect("NodePublishVolume (mount)");
    }

    async fn unpublish(&mut self, volume: &str, target: &Path) {
        self.node
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: volume.into(),
                target_path: target.to_string_lossy().into_owned(),
            })
            .await
            .expect("NodeUnpublishVolume");
    }

    async fn delete_volume(&mut self, id: &str) {
        self.ctl
            .delete_volume(DeleteVolumeRequest {
                volume_id: id.into(),
                ..Default::default()
            })
            .await
            .expect("DeleteVolume");
    }

    async fn delete_snapshot(&mut self, id: &str) -> Result<(), tonic::Status> {
        self.ctl
            .delete_snapshot(DeleteSnapshotRequest {
                snapshot_id: id.into(),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    /// What ListSnapshots answers about one snapshot id.
    async fn list_id(&mut self, id: &str) -> ListSnapshotsResponse {
        self.list(ListSnapshotsRequest {
            snapshot_id: id.into(),
            ..Default::default()
        })
        .await
        .expect("ListSnapshots")
    }

    /// Tears a restore down in the order a CO would: the restored volume, the snapshot, its
    /// source.
    async fn delete_restore(&mut self, restored: &str, snapshot: &str, source: &str) {
        self.delete_volume(restored).await;
        self.delete_snapshot(snapshot).await.unwrap();
        self.delete_volume(source).await;
    }

    async fn list(
        &mut self,
        req: ListSnapshotsRequest,
    ) -> Result<ListSnapshotsResponse, tonic::Status> {
        self.ctl.list_snapshots(req).await.map(|r| r.into_inner())
    }

    /// Writes `data` at `offset` of a block volume, through its loop device.
    async fn write_block(&mut self, volume: &str, dir: &Path, offset: u64, data: &[u8]) {
        let target = dir.join(format!("w-{volume}"));
        self.publish_block(volume, &target).await;
        {
            let mut dev = fs::OpenOptions::new()
                .write(true)
                .open(&target)
                .expect("open device");
            dev.seek(SeekFrom::Start(offset)).expect("seek");
            dev.write_all(data).expect("write device");
            dev.sync_all().expect("sync device");
        }
        self.unpublish(volume, &target).await;
    }

    /// Reads `len` bytes at `offset` of a block volume, through its loop device; also returns
    /// the device size.
    async fn read_block(
        &mut self,
        volume: &str,
        dir: &Path,
        offset: u64,
        len: usize,
    ) -> (Vec<u8>, u64) {
        let target = dir.join(format!("r-{volume}"));
        self.publish_block(volume, &target).await;
        let (buf, size) = {
            let mut dev = fs::File::open(&target).expect("open device");
            let size = dev.seek(SeekFrom::End(0)).expect("device size");
            dev.seek(SeekFrom::Start(offset)).expect("seek");
            let mut buf = vec![0u8; len];
            dev.read_exact(&mut buf).expect("read device");
            (buf, size)
        };
        self.unpublish(volume, &target).await;
        (buf, size)
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

fn sha512_hex(data: &[u8]) -> String {
    Sha512::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn state_of(server: &Server, image: &str) -> Option<serde_json::Value> {
    let text = fs::read_to_string(server.images_dir().join(format!("{image}.json"))).ok()?;
    serde_json::from_str(&text).ok()
}

fn image_of(handle: &str) -> String {
    let query = handle.split_once('?').map(|(_, q)| q).unwrap_or("");
    url::form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "backingImage")
        .map(|(_, v)| v.into_owned())
        .expect("backingImage in handle")
}

/// Visible entries (not temp files) of the images dir.
fn visible_images(server: &Server) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(server.images_dir())
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// A tiny HTTP/1.1 file server on 127.0.0.1 for download tests.
/// Answers wait while `hold` is set, to keep a download in progress.
struct HttpServer {
    port: u16,
    files: Arc<Mutex<HashMap<String, Vec<u8>>>>,
    hold: Arc<std::sync::atomic::AtomicBool>,
    /// Paths whose body stops after this many bytes (the connection stays open, silent).
    stalls: Arc<Mutex<HashMap<String, usize>>>,
    /// The Content-Type sent for a path (none by default).
    types: Arc<Mutex<HashMap<String, String>>>,
    /// Requests received.
    requests: Arc<std::sync::atomic::AtomicUsize>,
}

impl HttpServer {
    fn start() -> HttpServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let port = listener.local_addr().expect("local addr").port();
        let files: Arc<Mutex<HashMap<String, Vec<u8>>>> = Arc::default();
        let served = Arc::clone(&files);
        let hold: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        let held = Arc::clone(&hold);
        let stalls: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let stalling = Arc::clone(&stalls);
        let types: Arc<Mutex<HashMap<String, String>>> = Arc::default();
        let typing = Arc::clone(&types);
        let requests: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
        let counted = Arc::clone(&requests);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let files = Arc::clone(&served);
                let held = Arc::clone(&held);
                let stalling = Arc::clone(&stalling);
                let typing = Arc::clone(&typing);
                std::thread::spawn(move || {
                    let deadline = Instant::now() + Duration::from_secs(60);
                    while held.load(std::sync::atomic::Ordering::SeqCst)
                        && Instant::now() < deadline
                    {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        match stream.read(&mut byte) {
                            Ok(1) => head.push(byte[0]),
                            _ => return,
                        }
                    }
                    let head = String::from_utf8_lossy(&head);
                    let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
                    let body = files.lock().map(|f| f.get(&path).cloned()).unwrap_or(None);
                    let stall = stalling
                        .lock()
                        .map(|s| s.get(&path).copied())
                        .unwrap_or(None);
                    let kind = typing
                        .lock()
                        .map(|t| t.get(&path).map(|t| format!("Content-Type: {t}\r\n")))
                        .unwrap_or(None)
                        .unwrap_or_default();
                    if let (Some(body), Some(after)) = (&body, stall) {
                        let _ = stream
                            .write_all(
                                format!(
                                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                                    body.len()
                                )
                                .as_bytes(),
                            )
                            .and_then(|()| stream.write_all(&body[..after.min(body.len())]))
                            .and_then(|()| stream.flush());
                        std::thread::sleep(Duration::from_secs(60));
                        return;
                    }
                    let _ = match body {
                        Some(body) => stream
                            .write_all(
                                format!(
                                    "HTTP/1.1 200 OK\r\n{kind}Content-Length: {}\r\nConnection: close\r\n\r\n",
                                    body.len()
                                )
                                .as_bytes(),
                            )
                            .and_then(|()| stream.write_all(&body)),
                        None => stream.write_all(
                            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                        ),
                    };
                });
            }
        });
        HttpServer {
            port,
            files,
            hold,
            stalls,
            types,
            requests,
        }
    }

    fn requests(&self) -> usize {
        self.requests.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn serve(&self, path: &str, body: Vec<u8>) -> String {
        self.files
            .lock()
            .expect("files")
            .insert(path.to_owned(), body);
        format!("http://127.0.0.1:{}{path}", self.port)
    }
}

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

// ---------------------------------------------------------------------------------------------
// Identity

#[tokio::test(flavor = "multi_thread")]
async fn identity_and_capabilities() {
    let server = Server::start();
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

// ---------------------------------------------------------------------------------------------
// Scenarios (1) and (2): snapshot a volume into a BackingImage, restore from it, delete it.

#[tokio::test(flavor = "multi_thread")]
async fn scenario_1_2_snapshot_restore_delete() {
    let server = Server::start();
    let mut c = server.clients().await;
    let work = server.path().join("targets");
    fs::create_dir_all(&work).unwrap();

    let vol = c.volume(volume_req("pvc-source", 64 * MIB, None)).await;
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
        .volume(volume_req(
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
        .volume(volume_req(
            "pvc-restored",
            96 * MIB,
            Some(&snap.snapshot_id),
        ))
        .await;
    assert_eq!(again.volume_id, restored.volume_id);
    let err = c
        .volume_refused(volume_req(
            "pvc-restored",
            128 * MIB,
            Some(&snap.snapshot_id),
        ))
        .await;
    assert_eq!(err.code(), Code::AlreadyExists, "{err:?}");
    // Smaller than the image: OUT_OF_RANGE.
    let err = c
        .volume_refused(volume_req("pvc-small", 32 * MIB, Some(&snap.snapshot_id)))
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
    let server = Server::start();
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
    c.unpublish(&vol.volume_id, &target).await;
    c.unpublish(&vol.volume_id, &target).await; // idempotent
                                                // Republishing does not reformat.
    c.publish_mount(&vol.volume_id, &target).await;
    assert_eq!(
        fs::read(target.join("hello.txt")).unwrap(),
        b"hello from layerfs"
    );
    c.unpublish(&vol.volume_id, &target).await;

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
    c.unpublish(&restored.volume_id, &target2).await;
    c.delete_volume(&restored.volume_id).await;
    c.delete_snapshot(&snap.snapshot_id).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Scenario (3): a pre-provisioned content with a download handle.

#[tokio::test(flavor = "multi_thread")]
async fn scenario_3_preprovisioned_download() {
    let server = Server::start_with(&[ALLOW_LOCAL]);
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
        .volume_retrying(volume_req("pvc-download", 16 * MIB, Some(&handle)))
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

// ---------------------------------------------------------------------------------------------
// Scenario (4): on-demand images for download (qcow2) and export-from-volume (qcow2) handles.

#[tokio::test(flavor = "multi_thread")]
async fn scenario_4_on_demand_download_and_export() {
    let server = Server::start_with(&[ALLOW_LOCAL]);
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
        .volume_retrying(volume_req("pvc-dl-q", 8 * MIB, Some(&handle)))
        .await;
    let state = state_of(&server, "on-demand-dl").unwrap();
    assert_eq!(state["format"], "qcow2");
    assert_eq!(state["current_checksum"], sha512_hex(&qcow).as_str());
    let (got, _) = c.read_block(&vol.volume_id, &work, 0, raw.len()).await;
    assert!(got == raw, "download (qcow2) restore differs");

    // export-from-volume, qcow2, from a handle the driver never made
    let src = c.volume(volume_req("pvc-exp-src", 16 * MIB, None)).await;
    let data = pattern(MIB as usize, 99);
    c.write_block(&src.volume_id, &work, 3 * MIB as u64, &data)
        .await;
    let handle = format!(
        "bi://backing?backingImage=on-demand-exp&backingImageDataSourceType=export-from-volume&export-type=qcow2&volume-name={}",
        src.volume_id
    );
    let vol2 = c
        .volume_retrying(volume_req("pvc-exp-q", 16 * MIB, Some(&handle)))
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
        .volume_refused(volume_req("pvc-exp-other", 16 * MIB, Some(&other)))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    // An export handle naming a volume that does not exist: NOT_FOUND.
    let missing = "bi://backing?backingImage=nope&backingImageDataSourceType=export-from-volume&export-type=raw&volume-name=no-such-volume";
    let err = c
        .volume_refused(volume_req("pvc-missing", 16 * MIB, Some(missing)))
        .await;
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    for v in [&vol, &vol2, &src] {
        c.delete_volume(&v.volume_id).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Errors and idempotency

#[tokio::test(flavor = "multi_thread")]
async fn snapshot_errors_and_names() {
    let server = Server::start();
    let mut c = server.clients().await;
    let vol = c.volume(volume_req("pvc-a", 8 * MIB, None)).await;
    let vol_b = c.volume(volume_req("pvc-b", 8 * MIB, None)).await;

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
async fn volume_errors_and_idempotency() {
    let server = Server::start();
    let mut c = server.clients().await;
    let a = c.volume(volume_req("pvc-idem", 10 * MIB, None)).await;
    let b = c.volume(volume_req("pvc-idem", 10 * MIB, None)).await;
    assert_eq!(a, b);
    let err = c
        .volume_refused(volume_req("pvc-idem", 20 * MIB, None))
        .await;
    assert_eq!(err.code(), Code::AlreadyExists);
    let upper = "V".repeat(128);
    let u1 = c.volume(volume_req(&upper, 4 * MIB, None)).await;
    let u2 = c.volume(volume_req(&upper, 4 * MIB, None)).await;
    assert_eq!(u1.volume_id, u2.volume_id);
    for bad in ["", "../../etc", "x/y", "nul\0"] {
        let err = c.volume_refused(volume_req(bad, MIB, None)).await;
        assert_eq!(err.code(), Code::InvalidArgument, "{bad:?}");
    }
    let mut no_caps = volume_req("pvc-nocaps", MIB, None);
    no_caps.volume_capabilities.clear();
    assert_eq!(
        c.volume_refused(no_caps).await.code(),
        Code::InvalidArgument
    );
    let mut multi = volume_req("pvc-multi", MIB, None);
    multi.volume_capabilities[0].access_mode = Some(AccessMode {
        mode: Mode::MultiNodeMultiWriter as i32,
    });
    assert_eq!(c.volume_refused(multi).await.code(), Code::InvalidArgument);

    // Snapshot ids that are not ours, or incomplete.
    let err = c
        .volume_refused(volume_req("r1", MIB, Some("garbage")))
        .await;
    assert_eq!(err.code(), Code::NotFound);
    let err = c
        .volume_refused(volume_req("r2", MIB, Some("bi://backing?backingImage=x")))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = c
        .volume_refused(volume_req("r3", MIB, Some("snap://v/s")))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = c
        .volume_refused(volume_req(
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
    let server = Server::start();
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
        let err = c.volume_refused(volume_req(name, bytes, None)).await;
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

    let vol = c.volume(volume_req("pvc-grow", 4 * MIB, None)).await;
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

#[tokio::test(flavor = "multi_thread")]
async fn download_failures_leave_nothing_behind() {
    let server = Server::start_with(&[ALLOW_LOCAL]);
    let http = HttpServer::start();
    let mut c = server.clients().await;
    let raw = pattern(2 * MIB as usize, 5);
    let url = http.serve("/img.raw", raw.clone());
    let wrong = sha512_hex(b"something else");
    let handle = format!(
        "bi://backing?backingImage=bad-sum&backingImageDataSourceType=download&url={url}&backingImageChecksum={wrong}"
    );
    let err = c
        .volume_refused_retrying(volume_req("pvc-bad-sum", 4 * MIB, Some(&handle)))
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
        .volume_refused(volume_req("pvc-bad-form", 4 * MIB, Some(&handle)))
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
        .volume_refused_retrying(volume_req("pvc-unreachable", 4 * MIB, Some(&handle)))
        .await;
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("unreachable"), "{}", err.message());

    let handle = format!(
        "bi://backing?backingImage=missing&backingImageDataSourceType=download&url=http://127.0.0.1:{}/missing.raw",
        http.port
    );
    let err = c
        .volume_refused_retrying(volume_req("pvc-404", 4 * MIB, Some(&handle)))
        .await;
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().contains("404"), "{}", err.message());

    // Only http, https and file URLs.
    let handle =
        "bi://backing?backingImage=ftp&backingImageDataSourceType=download&url=ftp://127.0.0.1/x";
    let err = c
        .volume_refused(volume_req("pvc-ftp", 4 * MIB, Some(handle)))
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
        .volume_refused_retrying(volume_req("pvc-hostile", 4 * MIB, Some(&handle)))
        .await;
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("backing file"), "{}", err.message());
    assert_eq!(visible_images(&server), Vec::<String>::new());

    // After all that the server still answers.
    c.id.probe(ProbeRequest {}).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn list_snapshots_filters_and_pages() {
    let server = Server::start();
    let mut c = server.clients().await;
    let a = c.volume(volume_req("vol-a", 4 * MIB, None)).await;
    let b = c.volume(volume_req("vol-b", 4 * MIB, None)).await;
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
    let server = Server::start_with(&[ALLOW_LOCAL]);
    let http = HttpServer::start();
    let mut c = server.clients().await;
    let raw = pattern(MIB as usize, 21);
    let url = http.serve("/slow.raw", raw);
    http.hold.store(true, std::sync::atomic::Ordering::SeqCst);
    let handle =
        format!("bi://backing?backingImage=slow&backingImageDataSourceType=download&url={url}");
    let mut creator = server.clients().await;
    let req = volume_req("pvc-slow", 2 * MIB, Some(&handle));
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

// ---------------------------------------------------------------------------------------------
// Data safety and liveness

/// Every `.tmp-*` entry under `root`, at any depth.
fn temps_under(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if entry.file_name().to_string_lossy().starts_with(".tmp-") {
                found.push(path.clone());
            }
            if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                dirs.push(path);
            }
        }
    }
    found
}

/// A server (started with `extra` arguments) whose `PATH` finds, under the name `tool`, the
/// script `wrap` writes around the real tool (whose path it is given) first: the script is
/// kept in `tools`.
fn server_wrapping(
    tools: &Path,
    tool: &str,
    extra: &[&str],
    wrap: impl FnOnce(&str) -> String,
) -> Server {
    let real = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .unwrap()
        .stdout;
    let real = String::from_utf8(real).unwrap();
    let wrapper = tools.join(tool);
    fs::write(&wrapper, wrap(real.trim())).unwrap();
    Command::new("chmod")
        .arg("+x")
        .arg(&wrapper)
        .status()
        .unwrap();
    let path = format!(
        "{}:{}",
        tools.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Server::start_env(extra, &[("PATH", path)])
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
    c.unpublish(&vol.volume_id, &target).await;

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
    c.unpublish(&vol.volume_id, &target).await;
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
    c.unpublish(&a.volume_id, &a_first).await;
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
        c.unpublish(&b.volume_id, &b_target).await;
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
    c.unpublish(&a.volume_id, &a_first).await;
    c.unpublish(&a.volume_id, &a_second).await;
    c.delete_volume(&a.volume_id).await;
    c.delete_volume(&b.volume_id).await;
}

/// A CO that gives up on CreateSnapshot and CreateVolume at once (a tiny gRPC deadline) does
/// not stop the copies: retries find them, exactly one image and one volume result, and no
/// temp file is left anywhere.
#[tokio::test(flavor = "multi_thread")]
async fn tiny_deadlines_do_not_restart_or_leak_copies() {
    let server = Server::start();
    let mut c = server.clients().await;
    let work = server.path().join("targets");
    let vol = c.volume(volume_req("pvc-big", 320 * MIB, None)).await;
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

    let vreq = volume_req("pvc-big-restored", 320 * MIB, Some(&snap.snapshot_id));
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

/// A snapshot of a published Mount volume holds what was just written, without any sync by
/// the writer: the filesystem is frozen (flushed) for the cut.
#[tokio::test(flavor = "multi_thread")]
async fn snapshot_of_published_volume_is_point_in_time() {
    let server = Server::start();
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
    c.unpublish(&restored.volume_id, &target2).await;
    c.unpublish(&vol.volume_id, &target).await;
    c.delete_restore(&restored.volume_id, &snap.snapshot_id, &vol.volume_id)
        .await;
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
    let server = Server::start();
    let mut c = server.clients().await;
    let err = c
        .volume_refused(volume_req(
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
    let server = Server::start_with(&["--file-root", &root_s, "--deny-private-urls"]);
    let mut c = server.clients().await;
    let ok = format!("file://{root_s}/ok.raw");
    let vol = c
        .volume_retrying(volume_req(
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
            c.create_volume_retrying(volume_req(
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
    let server = Server::start_with(&[
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
        .volume_refused_retrying(volume_req("pvc-stall", 4 * MIB, Some(&handle)))
        .await;
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("stalled"), "{}", err.message());
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(visible_images(&server), Vec::<String>::new());
    assert_eq!(temps_under(&server.images_dir()), Vec::<PathBuf>::new());
    // The same image works once the server behaves.
    http.stalls.lock().unwrap().clear();
    let vol = c
        .volume_retrying(volume_req("pvc-stall", 4 * MIB, Some(&handle)))
        .await;
    c.delete_volume(&vol.volume_id).await;
}

/// DeleteSnapshot with a handle that names an image but describes another one deletes
/// nothing.
#[tokio::test(flavor = "multi_thread")]
async fn delete_snapshot_checks_the_handle() {
    let server = Server::start();
    let mut c = server.clients().await;
    let vol = c.volume(volume_req("pvc-del", 4 * MIB, None)).await;
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
    let server = Server::start();
    let mut c = server.clients().await;
    let mut req = volume_req("pvc-limit", 0, None);
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

// ---------------------------------------------------------------------------------------------
// Lifecycle: cancellation, restarts, leftovers

/// The disk size of the lifecycle tests: big enough that an export (copy, then checksum in
/// an unoptimized build) runs for seconds, so that a delete or a stop lands in the middle.
const DISK: i64 = 64 * MIB;

fn cuts_dir(server: &Server) -> PathBuf {
    server.path().join("store/cuts")
}

/// Every entry of `dir`, temp files included, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
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

/// Nothing of any snapshot is left: no image, state, temp file or cut.
fn assert_no_snapshot_left(server: &Server) {
    assert_eq!(entries(&server.images_dir()), Vec::<String>::new());
    assert_eq!(entries(&cuts_dir(server)), Vec::<String>::new());
    assert_eq!(temps_under(server.path()), Vec::<PathBuf>::new());
}

/// A volume holding 16 MiB of `pattern(_, seed)` at its start; and those bytes.
async fn volume_with_data(
    c: &mut Clients,
    server: &Server,
    name: &str,
    seed: u8,
) -> (String, Vec<u8>) {
    let vol = c.volume(volume_req(name, DISK, None)).await;
    let data = pattern(16 * MIB as usize, seed);
    c.write_block(&vol.volume_id, &server.path().join("targets"), 0, &data)
        .await;
    (vol.volume_id, data)
}

/// Node calls on a volume that does not exist, with an argument missing: the argument is
/// what is wrong (INVALID_ARGUMENT), whatever the volume.
#[tokio::test(flavor = "multi_thread")]
async fn node_calls_check_arguments_before_the_volume() {
    let server = Server::start();
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

/// DeleteSnapshot right after CreateSnapshot, while the export runs (as csi-sanity does):
/// it succeeds at once, cancels the export and leaves nothing; the name can be used again.
/// The same while the snapshot is still being cut.
#[tokio::test(flavor = "multi_thread")]
async fn delete_during_export_cancels_it_and_leaves_nothing() {
    let server = Server::start();
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
    let mut server = Server::start();
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
    server.restart(signal);
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
    let vreq = volume_req("pvc-dst", DISK, Some(&snap.snapshot_id));
    let err = c.volume_refused(vreq.clone()).await;
    assert_eq!(err.code(), Code::Aborted, "the export still runs: {err:?}");
    server.restart(signal);

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
    server.restart(signal);

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
    server.restart(libc::SIGKILL);
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
    let mut server = Server::start();
    let mut c = server.clients().await;
    let work = server.path().join("targets");
    let vol = c.volume(volume_req("pvc-cut", 48 * MIB, None)).await;
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
    server.restart(signal);
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
    let mut server = Server::start();
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
    server.restart(libc::SIGKILL);
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
    c.unpublish(&vol.volume_id, &target).await;
    c.delete_volume(&vol.volume_id).await;
    assert_no_snapshot_left(&server);
}

/// At start-up a node removes its own temporaries from the shared BackingImage directory and
/// leaves those of every other node alone, even one whose name starts with its own.
#[tokio::test(flavor = "multi_thread")]
async fn start_up_removes_only_this_node_s_temporaries() {
    let mut server = Server::start();
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
    server.restart(libc::SIGKILL);
    let mut left = others.map(String::from).to_vec();
    left.sort();
    assert_eq!(entries(&dir), left);
    assert_eq!(entries(&cuts_dir(&server)), Vec::<String>::new());
}

// ---------------------------------------------------------------------------------------------
// ListSnapshots tells the truth; downloads are safe by default

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
    let server = Server::start_with(&[ALLOW_LOCAL]);
    let http = HttpServer::start();
    let mut c = server.clients().await;
    let vol = c.volume(volume_req("pvc-truth", 4 * MIB, None)).await;

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
        .volume_refused_retrying(volume_req("pvc-gone", 4 * MIB, Some(&gone)))
        .await;
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    never_ready_then_gone(&mut c, &gone).await;

    // A download in progress is listed, not ready; once verified, ready.
    http.hold.store(true, std::sync::atomic::Ordering::SeqCst);
    let handle = format!(
        "bi://backing?backingImage=truth-dl&backingImageDataSourceType=download&url={good}"
    );
    let mut creator = server.clients().await;
    let req = volume_req("pvc-truth-dl", 4 * MIB, Some(&handle));
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
    let server = Server::start();
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
            .volume_refused_retrying(volume_req(
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
    let server = Server::start_with(&[ALLOW_LOCAL]);
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
            .volume_refused_retrying(volume_req(&format!("pvc-{name}"), 4 * MIB, Some(&handle)))
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
        .volume_retrying(volume_req("pvc-ok", 4 * MIB, Some(&handle)))
        .await;
    c.delete_volume(&vol.volume_id).await;
}

// ---------------------------------------------------------------------------------------------
// Integrity at rest

fn quarantine_dir(server: &Server) -> PathBuf {
    server.images_dir().join(".quarantine")
}

/// An image changed on disk after it was made (a byte flipped, or cut short) is never restored
/// from nor reported ready: DATA_LOSS naming it, the file moved aside, the state saying why.
/// Deleting the snapshot then frees everything.
#[tokio::test(flavor = "multi_thread")]
async fn an_image_altered_on_disk_is_not_restored_from() {
    use std::os::unix::fs::FileExt;
    let server = Server::start();
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
            .volume_refused(volume_req(
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
    let mut server = Server::start();
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
    server.restart(libc::SIGTERM);
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
