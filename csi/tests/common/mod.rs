//! A harness for end-to-end tests of the driver: the real `layerfs-csi` binary in a temp dir,
//! a gRPC client over its socket, and cleanup of every mount and loop device under the temp
//! dir, also when a test panics. What more than one test file looks at (the images
//! directory, the cuts, temp files) and the requests and data they make are here too, so
//! that every file reads the driver's state the same way.
//!
//! Needs root (loop devices, mounts), `losetup`, `mkfs.ext4`, `qemu-img`.

#![allow(dead_code)]

pub mod http;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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

pub const BIN: &str = env!("CARGO_BIN_EXE_layerfs-csi");
pub const MIB: i64 = 1 << 20;
/// Download tests fetch from 127.0.0.1, which the driver refuses unless told otherwise.
pub const ALLOW_LOCAL: &str = "--allow-private-urls";
/// The disk size of the lifecycle tests: big enough that an export (copy, then checksum in
/// an unoptimized build) runs for seconds, so that a delete or a stop lands in the middle.
pub const DISK: i64 = 64 * MIB;

/// A running `layerfs-csi` whose store, socket and working directory are in a temp dir.
pub struct Server {
    child: Child,
    dir: tempfile::TempDir,
    socket: PathBuf,
    log: Option<PathBuf>,
    args: Vec<String>,
    env: Vec<(String, String)>,
    images: PathBuf,
}

impl Server {
    pub fn start() -> Server {
        Server::start_logging(false)
    }

    /// With `to_file`, the driver's stderr goes to a file ([`Server::log`]) instead of the
    /// test's.
    pub fn start_logging(to_file: bool) -> Server {
        Server::start_full(to_file, None, false, &[], &[])
    }

    /// With the store on a tmpfs of `size` (`mount -o size=`), so that its free space is
    /// known and nothing else uses it, and `args` added to the command line.
    pub fn start_on_tmpfs(size: &str, args: &[&str]) -> Server {
        Server::start_full(false, Some(StoreFs::Tmpfs(size)), false, args, &[])
    }

    /// With the store on a filesystem of its own, logging to a file.
    pub fn start_on(fs: StoreFs<'_>) -> Server {
        Server::start_full(true, Some(fs), false, &[], &[])
    }

    /// With the BackingImages in a directory of their own beside the store
    /// (`--backing-images`), as in a directory every node shares, and `args` added to the
    /// command line.
    pub fn shared_images(args: &[&str]) -> Server {
        Server::shared_images_env(args, &[])
    }

    /// [`Server::shared_images`] with `env` added to the driver's environment.
    pub fn shared_images_env(args: &[&str], env: &[(&str, String)]) -> Server {
        Server::start_full(false, None, true, args, env)
    }

    fn start_full(
        to_file: bool,
        store_fs: Option<StoreFs<'_>>,
        shared_images: bool,
        args: &[&str],
        env: &[(&str, String)],
    ) -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        if let Some(store_fs) = store_fs {
            store_fs.mount_at(dir.path(), &dir.path().join("store"));
        }
        let socket = dir.path().join("csi.sock");
        let log = to_file.then(|| dir.path().join("driver.log"));
        let images = match shared_images {
            true => dir.path().join("shared-images"),
            false => dir.path().join("store/backing-images"),
        };
        let mut all: Vec<String> = Vec::new();
        if shared_images {
            all.push("--backing-images".into());
            all.push(images.to_string_lossy().into_owned());
        }
        all.extend(args.iter().map(|a| a.to_string()));
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let child = Server::spawn(dir.path(), &socket, log.as_deref(), &all, &env);
        let server = Server {
            child,
            dir,
            socket,
            log,
            args: all,
            env,
            images,
        };
        server.wait_for_socket();
        server
    }

    fn spawn(
        dir: &Path,
        socket: &Path,
        log: Option<&Path>,
        args: &[String],
        env: &[(String, String)],
    ) -> Child {
        let stderr = match log {
            Some(path) => Stdio::from(
                fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .expect("log file"),
            ),
            None => Stdio::inherit(),
        };
        Command::new(BIN)
            .arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .args(["--node-id", "node1"])
            .arg("--store")
            .arg(dir.join("store"))
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            // A relative path the driver wrongly accepts lands in here, not in the test's
            // working directory.
            .current_dir(dir)
            .stdin(Stdio::null())
            .stderr(stderr)
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

    /// Kills the driver (SIGKILL: nothing of it runs on) and starts it again on the same store.
    pub fn restart(&mut self) {
        self.restart_with(libc::SIGKILL);
    }

    /// Stops the driver with `signal` (SIGTERM: an orderly stop; SIGKILL: a crash) and starts
    /// it again on the same store.
    pub fn restart_with(&mut self, signal: i32) {
        unsafe {
            libc::kill(self.child.id() as i32, signal);
        }
        self.child.wait().expect("wait for layerfs-csi");
        // A killed driver leaves its socket: wait for the new one, not the old.
        let _ = fs::remove_file(&self.socket);
        self.child = Server::spawn(
            self.dir.path(),
            &self.socket,
            self.log.as_deref(),
            &self.args,
            &self.env,
        );
        self.wait_for_socket();
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The BackingImage directory.
    pub fn images_dir(&self) -> PathBuf {
        self.images.clone()
    }

    /// The file the driver logs to, when started with one.
    pub fn log(&self) -> Option<&Path> {
        self.log.as_deref()
    }

    pub async fn clients(&self) -> Clients {
        let socket = self.socket.clone();
        let channel = Endpoint::try_from("http://[::]:50051")
            .expect("endpoint")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let socket = socket.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(socket).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }))
            .await
            .expect("connect to the CSI socket");
        Clients {
            id: IdentityClient::new(channel.clone()),
            ctl: ControllerClient::new(channel.clone()),
            node: NodeClient::new(channel),
        }
    }
}

/// A filesystem of its own for a driver's store.
#[derive(Debug, Clone, Copy)]
pub enum StoreFs<'a> {
    /// A tmpfs of this size (`mount -o size=`).
    Tmpfs(&'a str),
    /// ext4 on a sparse image of this many bytes: no reflinks, cuts are copies.
    Ext4(u64),
    /// XFS with reflinks, on a sparse image of this many bytes: cuts are taken by FICLONE.
    XfsReflink(u64),
}

impl StoreFs<'_> {
    /// Mounts it at `store`, with any image file in `dir`; [`cleanup_under`] undoes both.
    fn mount_at(self, dir: &Path, store: &Path) {
        fs::create_dir(store).expect("store dir");
        let mut mount = Command::new("mount");
        match self {
            StoreFs::Tmpfs(size) => {
                mount.args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]);
            }
            StoreFs::Ext4(bytes) | StoreFs::XfsReflink(bytes) => {
                let image = dir.join("store.img");
                fs::File::create(&image)
                    .and_then(|f| f.set_len(bytes))
                    .expect("store image");
                let mkfs: &[&str] = match self {
                    StoreFs::Ext4(_) => &["mkfs.ext4", "-q", "-F"],
                    _ => &["mkfs.xfs", "-q", "-f", "-m", "reflink=1"],
                };
                let made = Command::new(mkfs[0])
                    .args(&mkfs[1..])
                    .arg(&image)
                    .status()
                    .unwrap_or_else(|e| panic!("run {}: {e}", mkfs[0]));
                assert!(made.success(), "{} {}", mkfs[0], image.display());
                mount.args(["-o", "loop"]).arg(&image);
            }
        }
        let mounted = mount.arg(store).status().expect("run mount");
        assert!(mounted.success(), "mount {self:?} on {}", store.display());
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
        cleanup_under(self.dir.path());
    }
}

/// Unmounts everything mounted under `root` and detaches loop devices of files under it.
pub fn cleanup_under(root: &Path) {
    let root = fs::canonicalize(root).unwrap_or_else(|_| root.to_owned());
    let root_s = root.to_string_lossy().into_owned();
    if let Ok(info) = fs::read_to_string("/proc/self/mountinfo") {
        let mut points: Vec<String> = info
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(|p| p.replace("\\040", " "))
            .filter(|p| p.starts_with(&root_s))
            .collect();
        points.sort();
        points.reverse();
        for p in points {
            let _ = Command::new("umount").arg("-l").arg(&p).status();
        }
    }
    if let Ok(out) = Command::new("losetup")
        .args(["-l", "-n", "-O", "NAME,BACK-FILE"])
        .output()
    {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut parts = line.split_whitespace();
            if let (Some(dev), Some(file)) = (parts.next(), parts.next()) {
                if file.starts_with(&root_s) {
                    let _ = Command::new("losetup").arg("-d").arg(dev).status();
                }
            }
        }
    }
}

/// Whether something is mounted at exactly `path`.
pub fn is_mount_point(path: &Path) -> bool {
    let path = fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    let path = path.to_string_lossy().replace(' ', "\\040");
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(path.as_str()))
}

pub struct Clients {
    pub id: IdentityClient<Channel>,
    pub ctl: ControllerClient<Channel>,
    pub node: NodeClient<Channel>,
}

pub fn block_cap() -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

pub fn mount_cap() -> VolumeCapability {
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

pub fn volume_req(name: &str, bytes: i64, cap: VolumeCapability) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap],
        ..Default::default()
    }
}

/// A CreateVolume request for a `Block` volume, restored from `snapshot` when one is given.
pub fn block_volume_req(name: &str, bytes: i64, snapshot: Option<&str>) -> CreateVolumeRequest {
    CreateVolumeRequest {
        volume_content_source: snapshot.map(|id| VolumeContentSource {
            r#type: Some(SourceType::Snapshot(SnapshotSource {
                snapshot_id: id.into(),
            })),
        }),
        ..volume_req(name, bytes, block_cap())
    }
}

/// A CreateVolume request for an ext4 Mount volume, otherwise as `block_volume_req`.
pub fn mount_volume_req(name: &str, bytes: i64, snapshot: Option<&str>) -> CreateVolumeRequest {
    let mut req = block_volume_req(name, bytes, snapshot);
    req.volume_capabilities = vec![mount_cap()];
    req
}

/// A CreateSnapshot request for a BackingImage of `source` exported as `export_type`.
pub fn snapshot_req(name: &str, source: &str, export_type: &str) -> CreateSnapshotRequest {
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
    pub async fn create_volume(
        &mut self,
        req: CreateVolumeRequest,
    ) -> Result<Volume, tonic::Status> {
        let resp = self.ctl.create_volume(req).await?.into_inner();
        Ok(resp.volume.expect("volume in response"))
    }

    /// Creates a volume the test needs to exist.
    pub async fn volume(&mut self, req: CreateVolumeRequest) -> Volume {
        self.create_volume(req).await.expect("CreateVolume")
    }

    /// Calls CreateVolume where it must fail, for the status to check.
    pub async fn volume_refused(&mut self, req: CreateVolumeRequest) -> tonic::Status {
        self.create_volume(req)
            .await
            .expect_err("CreateVolume should fail")
    }

    /// Creates a volume from an image that may still be in preparation.
    pub async fn volume_retrying(&mut self, req: CreateVolumeRequest) -> Volume {
        self.create_volume_retrying(req)
            .await
            .expect("CreateVolume (retried)")
    }

    /// Calls CreateVolume past ABORTED where it must fail in the end, for the status to check.
    pub async fn volume_refused_retrying(&mut self, req: CreateVolumeRequest) -> tonic::Status {
        self.create_volume_retrying(req)
            .await
            .expect_err("CreateVolume (retried) should fail")
    }

    /// Calls CreateVolume until it stops answering ABORTED (an image still being prepared).
    pub async fn create_volume_retrying(
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
    pub async fn publish(
        &mut self,
        volume: &str,
        target: impl AsRef<Path>,
        cap: VolumeCapability,
    ) -> Result<(), tonic::Status> {
        self.node
            .node_publish_volume(NodePublishVolumeRequest {
                volume_id: volume.into(),
                target_path: target.as_ref().to_string_lossy().into_owned(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    pub async fn publish_block(&mut self, volume: &str, target: impl AsRef<Path>) {
        self.publish(volume, target, block_cap())
            .await
            .expect("NodePublishVolume (block)");
    }

    pub async fn publish_mount(&mut self, volume: &str, target: impl AsRef<Path>) {
        self.publish(volume, target, mount_cap())
            .await
            .expect("NodePublishVolume (mount)");
    }

    pub async fn unpublish(
        &mut self,
        volume: &str,
        target: impl AsRef<Path>,
    ) -> Result<(), tonic::Status> {
        self.node
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: volume.into(),
                target_path: target.as_ref().to_string_lossy().into_owned(),
            })
            .await
            .map(|_| ())
    }

    pub async fn delete_volume(&mut self, volume: &str) {
        self.ctl
            .delete_volume(DeleteVolumeRequest {
                volume_id: volume.into(),
                ..Default::default()
            })
            .await
            .expect("DeleteVolume");
    }

    pub async fn expand(
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

    /// What GetCapacity says is left.
    pub async fn capacity_left(&mut self) -> i64 {
        self.ctl
            .get_capacity(GetCapacityRequest::default())
            .await
            .expect("GetCapacity")
            .into_inner()
            .available_capacity
    }

    pub async fn snapshot(
        &mut self,
        req: CreateSnapshotRequest,
    ) -> Result<Snapshot, tonic::Status> {
        let resp = self.ctl.create_snapshot(req).await?.into_inner();
        Ok(resp.snapshot.expect("snapshot in response"))
    }

    /// Calls CreateSnapshot where it must fail, for the status to check.
    pub async fn snapshot_refused(&mut self, req: CreateSnapshotRequest) -> tonic::Status {
        self.snapshot(req)
            .await
            .expect_err("CreateSnapshot should fail")
    }

    /// Calls CreateSnapshot until the snapshot is ready, as the CO does; checks the creation
    /// time never changes.
    pub async fn snapshot_ready(&mut self, req: CreateSnapshotRequest) -> Snapshot {
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

    pub async fn delete_snapshot(&mut self, id: &str) -> Result<(), tonic::Status> {
        self.ctl
            .delete_snapshot(DeleteSnapshotRequest {
                snapshot_id: id.into(),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    /// Tears a restore down in the order a CO would: the restored volume, the snapshot, its
    /// source.
    pub async fn delete_restore(&mut self, restored: &str, snapshot: &str, source: &str) {
        self.delete_volume(restored).await;
        self.delete_snapshot(snapshot).await.unwrap();
        self.delete_volume(source).await;
    }

    pub async fn list(
        &mut self,
        req: ListSnapshotsRequest,
    ) -> Result<ListSnapshotsResponse, tonic::Status> {
        self.ctl.list_snapshots(req).await.map(|r| r.into_inner())
    }

    /// What ListSnapshots answers about one snapshot id.
    pub async fn list_id(&mut self, id: &str) -> ListSnapshotsResponse {
        self.list(ListSnapshotsRequest {
            snapshot_id: id.into(),
            ..Default::default()
        })
        .await
        .expect("ListSnapshots")
    }

    /// Writes `data` at `offset` of a block volume, through its loop device.
    pub async fn write_block(&mut self, volume: &str, dir: &Path, offset: u64, data: &[u8]) {
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
        self.unpublish(volume, &target)
            .await
            .expect("NodeUnpublishVolume");
    }

    /// Reads `len` bytes at `offset` of a block volume, through its loop device; also returns
    /// the device size.
    pub async fn read_block(
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
        self.unpublish(volume, &target)
            .await
            .expect("NodeUnpublishVolume");
        (buf, size)
    }
}

/// A volume holding 16 MiB of `pattern(_, seed)` at its start; and those bytes.
pub async fn volume_with_data(
    c: &mut Clients,
    server: &Server,
    name: &str,
    seed: u8,
) -> (String, Vec<u8>) {
    let vol = c.volume(block_volume_req(name, DISK, None)).await;
    let data = pattern(16 * MIB as usize, seed);
    c.write_block(&vol.volume_id, &server.path().join("targets"), 0, &data)
        .await;
    (vol.volume_id, data)
}

/// `len` bytes whose value depends on their offset and on `seed`, so that bytes read from the
/// wrong place or left over from other data show.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

pub fn sha512_hex(data: &[u8]) -> String {
    Sha512::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The state file of the image `image`, if there is one that decodes.
pub fn state_of(server: &Server, image: &str) -> Option<serde_json::Value> {
    let text = fs::read_to_string(server.images_dir().join(format!("{image}.json"))).ok()?;
    serde_json::from_str(&text).ok()
}

/// Every entry of the images dir, sorted, temp files included.
pub fn visible_images(server: &Server) -> Vec<String> {
    entries(&server.images_dir())
}

pub fn cuts_dir(server: &Server) -> PathBuf {
    server.path().join("store/cuts")
}

/// Every entry of `dir`, temp files included, sorted.
pub fn entries(dir: &Path) -> Vec<String> {
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

/// Every `.tmp-*` entry under `root`, at any depth.
pub fn temps_under(root: &Path) -> Vec<PathBuf> {
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

/// Nothing of any snapshot is left: no image, state, temp file or cut.
pub fn assert_no_snapshot_left(server: &Server) {
    assert_eq!(entries(&server.images_dir()), Vec::<String>::new());
    assert_eq!(entries(&cuts_dir(server)), Vec::<String>::new());
    assert_eq!(temps_under(server.path()), Vec::<PathBuf>::new());
}

/// A server (started with `extra` arguments) whose `PATH` finds, under the name `tool`, the
/// script `wrap` writes around the real tool (whose path it is given) first: the script is
/// kept in `tools`.
pub fn server_wrapping(
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
    Server::shared_images_env(extra, &[("PATH", path)])
}
