//! A harness for end-to-end tests of the driver: the real `layerfs-csi` binary in a temp dir,
//! a gRPC client over its socket, and cleanup of every mount and loop device under the temp
//! dir, also when a test panics.

#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use layerfs_csi::proto::controller_client::ControllerClient;
use layerfs_csi::proto::node_client::NodeClient;
use layerfs_csi::proto::volume_capability::access_mode::Mode;
use layerfs_csi::proto::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use layerfs_csi::proto::*;
use tonic::transport::{Channel, Endpoint, Uri};

pub const BIN: &str = env!("CARGO_BIN_EXE_layerfs-csi");
pub const MIB: i64 = 1 << 20;

/// A running `layerfs-csi` whose store, socket and working directory are in a temp dir.
pub struct Server {
    child: Child,
    dir: tempfile::TempDir,
    socket: PathBuf,
    log: Option<PathBuf>,
    args: Vec<String>,
}

impl Server {
    pub fn start() -> Server {
        Server::start_logging(false)
    }

    /// With `to_file`, the driver's stderr goes to a file ([`Server::log`]) instead of the
    /// test's.
    pub fn start_logging(to_file: bool) -> Server {
        Server::start_full(to_file, None, &[])
    }

    /// With the store on a tmpfs of `size` (`mount -o size=`), so that its free space is
    /// known and nothing else uses it, and `args` added to the command line.
    pub fn start_on_tmpfs(size: &str, args: &[&str]) -> Server {
        Server::start_full(false, Some(StoreFs::Tmpfs(size)), args)
    }

    /// With the store on a filesystem of its own, logging to a file.
    pub fn start_on(fs: StoreFs<'_>) -> Server {
        Server::start_full(true, Some(fs), &[])
    }

    fn start_full(to_file: bool, store_fs: Option<StoreFs<'_>>, args: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        if let Some(store_fs) = store_fs {
            store_fs.mount_at(dir.path(), &dir.path().join("store"));
        }
        let socket = dir.path().join("csi.sock");
        let log = to_file.then(|| dir.path().join("driver.log"));
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let child = Server::spawn(dir.path(), &socket, log.as_deref(), &args);
        let server = Server {
            child,
            dir,
            socket,
            log,
            args,
        };
        server.wait_for_socket();
        server
    }

    fn spawn(dir: &Path, socket: &Path, log: Option<&Path>, args: &[String]) -> Child {
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
        let _ = self.child.kill();
        self.child.wait().expect("wait for layerfs-csi");
        let _ = fs::remove_file(&self.socket);
        self.child = Server::spawn(
            self.dir.path(),
            &self.socket,
            self.log.as_deref(),
            &self.args,
        );
        self.wait_for_socket();
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
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
        let _ = self.child.kill();
        let _ = self.child.wait();
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

impl Clients {
    /// Creates a volume the test needs; returns its id.
    pub async fn volume(&mut self, req: CreateVolumeRequest) -> String {
        self.ctl
            .create_volume(req)
            .await
            .expect("CreateVolume")
            .into_inner()
            .volume
            .expect("volume in response")
            .volume_id
    }

    pub async fn publish(
        &mut self,
        volume: &str,
        target: &str,
        cap: VolumeCapability,
    ) -> Result<(), tonic::Status> {
        self.node
            .node_publish_volume(NodePublishVolumeRequest {
                volume_id: volume.into(),
                target_path: target.into(),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    pub async fn unpublish(&mut self, volume: &str, target: &str) -> Result<(), tonic::Status> {
        self.node
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: volume.into(),
                target_path: target.into(),
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

    pub async fn expand(&mut self, volume: &str, bytes: i64) -> Result<(), tonic::Status> {
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
            .map(|_| ())
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
}
