//! What the snapshotter's tests share: a layerfs mount over a remote tree, the snapshotter
//! and containerd as processes, a gRPC client, and images made from Debian's static
//! busybox. Every process and mount is stopped by its guard, also when a test fails.

#![allow(dead_code)]

use std::collections::HashMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use layerfs_snapshotter::api::snapshots::snapshots_client::SnapshotsClient;
use sha2::{Digest, Sha256};
use tonic::transport::{Channel, Endpoint, Uri};

pub const SNAPSHOTTER: &str = env!("CARGO_BIN_EXE_layerfs-snapshotter");

/// The `layerfs` binary of this workspace and profile, built if missing. A build of its own
/// target dir, so that it never waits for the lock of the build running these tests.
pub fn layerfs_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().unwrap().parent().unwrap().to_owned();
        let built = profile_dir.join("layerfs");
        if built.exists() {
            return built;
        }
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let target = workspace.join("target/for-snapshotter-tests");
        let release = profile_dir.ends_with("release");
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .current_dir(workspace)
            .args(["build", "-p", "layerfs", "--bin", "layerfs", "--target-dir"])
            .arg(&target);
        if release {
            cargo.arg("--release");
        }
        assert!(cargo.status().unwrap().success(), "building layerfs");
        target
            .join(if release { "release" } else { "debug" })
            .join("layerfs")
    })
}

pub fn tempdir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("layerfs-snap")
        .tempdir()
        .unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

pub fn eventually(secs: u64, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn is_mounted(path: &Path) -> bool {
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let path = path.to_string_lossy();
    mounts
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(path.as_ref()))
}

/// A layerfs mount of a remote tree in iSulad's layout, with `-o allow_other,suid,dev` as
/// containers need.
pub struct View {
    pub dir: tempfile::TempDir,
    pub remote: PathBuf,
    pub local: PathBuf,
    pub mnt: PathBuf,
    child: Option<Child>,
}

impl View {
    pub fn new() -> View {
        let dir = tempdir();
        let remote = dir.path().join("remote");
        for area in ["overlay/RO", "overlay-layers/RO", "overlay-images"] {
            fs::create_dir_all(remote.join(area)).unwrap();
        }
        let local = dir.path().join("local");
        let mnt = dir.path().join("mnt");
        fs::create_dir(&local).unwrap();
        fs::create_dir(&mnt).unwrap();
        let mut view = View {
            dir,
            remote,
            local,
            mnt,
            child: None,
        };
        view.mount();
        view
    }

    fn mount(&mut self) {
        let child = Command::new(layerfs_bin())
            .arg("mount")
            .arg("--remote")
            .arg(&self.remote)
            .arg("--local")
            .arg(&self.local)
            .args(["-o", "allow_other,suid,dev", "-f"])
            .arg(&self.mnt)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        eventually(20, "the layerfs mount", || is_mounted(&self.mnt));
    }

    /// Makes the mount take what the remote tree holds now.
    pub fn refresh(&self) {
        let out = Command::new(layerfs_bin())
            .arg("refresh")
            .arg(&self.mnt)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for View {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while is_mounted(&self.mnt) {
            let _ = Command::new("umount")
                .arg(&self.mnt)
                .stderr(Stdio::null())
                .status();
            if Instant::now() > deadline {
                let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A running `layerfs-snapshotter`.
pub struct Snapshotter {
    pub socket: PathBuf,
    pub root: PathBuf,
    view: Option<PathBuf>,
    child: Option<Child>,
    pub log: PathBuf,
}

impl Snapshotter {
    /// Serves on `socket`, with snapshots under `root` and shared layers from `view`
    /// (`None`: whatever layerfs mount `root` is in).
    pub fn start(socket: &Path, root: &Path, view: Option<&Path>) -> Snapshotter {
        let log = socket.with_extension("log");
        let mut s = Snapshotter {
            socket: socket.to_owned(),
            root: root.to_owned(),
            view: view.map(Path::to_owned),
            child: None,
            log,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = Command::new(SNAPSHOTTER);
        cmd.arg("--address")
            .arg(&self.socket)
            .arg("--root")
            .arg(&self.root)
            .env("LAYERFS_LOG", "layerfs_snapshotter=debug,info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if let Some(view) = &self.view {
            cmd.arg("--view").arg(view);
        }
        self.child = Some(cmd.spawn().unwrap());
        let socket = self.socket.clone();
        let child = self.child.as_mut().unwrap();
        eventually(20, "the snapshotter's socket", || {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the snapshotter exited with {status}");
            }
            std::os::unix::net::UnixStream::connect(&socket).is_ok()
        });
    }

    /// Stops it with SIGTERM and waits; the socket is gone afterwards.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(20);
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Kills it with SIGKILL, as a crash would: nothing of it runs on, its socket is left.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again after [`Snapshotter::kill`] or [`Snapshotter::stop`].
    pub fn start_again(&mut self) {
        self.spawn();
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub async fn client(&self) -> SnapshotsClient<Channel> {
        connect(&self.socket).await
    }
}

impl Drop for Snapshotter {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!("--- snapshotter log ---\n{}", self.log_text());
        }
    }
}

pub async fn connect(socket: &Path) -> SnapshotsClient<Channel> {
    SnapshotsClient::new(unix_channel(socket).await)
}

/// A gRPC channel over the unix socket `socket`.
pub async fn unix_channel(socket: &Path) -> Channel {
    let socket = socket.to_owned();
    Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .unwrap()
}

/// Every snapshot the snapshotter at `socket` holds, as its own List gives them.
pub async fn proxy_snapshots(socket: &Path) -> Vec<layerfs_snapshotter::api::snapshots::Info> {
    list_snapshots(&mut connect(socket).await, &[]).await
}

/// The snapshots a List with `filters` gives.
pub async fn list_snapshots(
    client: &mut layerfs_snapshotter::api::snapshots::snapshots_client::SnapshotsClient<
        tonic::transport::Channel,
    >,
    filters: &[&str],
) -> Vec<layerfs_snapshotter::api::snapshots::Info> {
    let mut stream = client
        .list(layerfs_snapshotter::api::snapshots::ListSnapshotsRequest {
            snapshotter: "layerfs".into(),
            filters: filters.iter().map(|f| f.to_string()).collect(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(batch) = stream.message().await.unwrap() {
        out.extend(batch.info);
    }
    out
}

/// The snapshot of the snapshotter at `socket` committed under the chain ID `chain`,
/// whatever containerd's namespace and sequence number before it.
pub async fn proxy_snapshot_of_chain(
    socket: &Path,
    chain: &str,
) -> Option<layerfs_snapshotter::api::snapshots::Info> {
    let suffix = format!("/{chain}");
    proxy_snapshots(socket)
        .await
        .into_iter()
        .find(|i| i.name.ends_with(&suffix))
}

/// Usage of the snapshot `key`, as the snapshotter at `socket` reports it.
pub async fn proxy_usage(
    socket: &Path,
    key: &str,
) -> layerfs_snapshotter::api::snapshots::UsageResponse {
    connect(socket)
        .await
        .usage(layerfs_snapshotter::api::snapshots::UsageRequest {
            snapshotter: "layerfs".into(),
            key: key.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("Usage of {key}: {e:?}"))
        .into_inner()
}

/// The label a snapshotter puts on a snapshot backed by a remote layer, and its value, as
/// stargz sets them.
pub const REMOTE_LABEL: &str = "containerd.io/snapshot/remote";
pub const REMOTE_LABEL_VALUE: &str = "remote snapshot";

// ---- Images ----

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A layer as an uncompressed tar.
pub struct Layer {
    pub tar: Vec<u8>,
}

impl Layer {
    /// Debian's static busybox as `/bin/busybox`, the applets the tests use, `/tmp`, `/etc`.
    pub fn busybox() -> Layer {
        let busybox = fs::read("/bin/busybox").expect("/bin/busybox (Debian's busybox-static)");
        let mut b = LayerBuilder::new();
        b.dir("bin");
        b.file("bin/busybox", &busybox, 0o755);
        for applet in [
            "sh", "ls", "cat", "echo", "dd", "df", "mkdir", "rm", "mv", "sync", "sleep", "id",
            "stat", "head", "test", "touch",
        ] {
            b.symlink(&format!("bin/{applet}"), "busybox");
        }
        b.dir("tmp");
        b.dir("etc");
        b.finish()
    }

    /// One file, `path`, holding `content`, and its parent directories.
    pub fn file(path: &str, content: &[u8]) -> Layer {
        let mut b = LayerBuilder::new();
        let mut at = String::new();
        let parts: Vec<&str> = path.split('/').collect();
        for part in &parts[..parts.len() - 1] {
            at = if at.is_empty() {
                part.to_string()
            } else {
                format!("{at}/{part}")
            };
            b.dir(&at);
        }
        b.file(path, content, 0o644);
        b.finish()
    }

    pub fn diff_id(&self) -> String {
        sha256_hex(&self.tar)
    }
}

struct LayerBuilder(tar::Builder<Vec<u8>>);

impl LayerBuilder {
    fn new() -> LayerBuilder {
        LayerBuilder(tar::Builder::new(Vec::new()))
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h
    }

    fn dir(&mut self, path: &str) {
        let mut h = Self::header(tar::EntryType::Directory, 0o755, 0);
        self.0.append_data(&mut h, path, std::io::empty()).unwrap();
    }

    fn file(&mut self, path: &str, content: &[u8], mode: u32) {
        let mut h = Self::header(tar::EntryType::Regular, mode, content.len() as u64);
        self.0.append_data(&mut h, path, content).unwrap();
    }

    fn symlink(&mut self, path: &str, target: &str) {
        let mut h = Self::header(tar::EntryType::Symlink, 0o777, 0);
        self.0.append_link(&mut h, path, target).unwrap();
    }

    fn finish(self) -> Layer {
        Layer {
            tar: self.0.into_inner().unwrap(),
        }
    }
}

/// An OCI image of some layers.
pub struct Image {
    pub name: String,
    pub layers: Vec<Layer>,
}

impl Image {
    /// The chain IDs of its layers, base first, as `sha256:<hex>`.
    pub fn chain_ids(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for layer in &self.layers {
            let diff = format!("sha256:{}", layer.diff_id());
            out.push(match out.last() {
                None => diff,
                Some(below) => format!(
                    "sha256:{}",
                    sha256_hex(format!("{below} {diff}").as_bytes())
                ),
            });
        }
        out
    }

    /// An OCI archive `ctr images import` takes, named by `io.containerd.image.name`.
    pub fn oci_archive(&self) -> Vec<u8> {
        let mut blobs: Vec<(String, Vec<u8>)> = Vec::new();
        let mut put = |bytes: Vec<u8>| {
            let digest = sha256_hex(&bytes);
            let size = bytes.len();
            blobs.push((digest.clone(), bytes));
            (digest, size)
        };
        let diff_ids: Vec<String> = self
            .layers
            .iter()
            .map(|l| format!("sha256:{}", l.diff_id()))
            .collect();
        let layers: Vec<serde_json::Value> = self
            .layers
            .iter()
            .map(|l| {
                let (digest, size) = put(l.tar.clone());
                serde_json::json!({
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": format!("sha256:{digest}"), "size": size,
                })
            })
            .collect();
        let config = serde_json::json!({
            "architecture": "amd64", "os": "linux",
            "config": {"Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        });
        let (config_digest, config_size) = put(serde_json::to_vec(&config).unwrap());
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": format!("sha256:{config_digest}"), "size": config_size,
            },
            "layers": layers,
        });
        let (manifest_digest, manifest_size) = put(serde_json::to_vec(&manifest).unwrap());
        let index = serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": format!("sha256:{manifest_digest}"), "size": manifest_size,
                "annotations": {"io.containerd.image.name": self.name},
            }],
        });
        let mut archive = tar::Builder::new(Vec::new());
        let mut add = |path: &str, bytes: &[u8]| {
            let mut h = tar::Header::new_ustar();
            h.set_mode(0o644);
            h.set_size(bytes.len() as u64);
            archive.append_data(&mut h, path, bytes).unwrap();
        };
        add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
        add("index.json", &serde_json::to_vec(&index).unwrap());
        for (digest, bytes) in &blobs {
            add(&format!("blobs/sha256/{digest}"), bytes);
        }
        archive.into_inner().unwrap()
    }

    /// Puts its layers on a remote tree, each named by its chain ID (see
    /// [`Image::write_shared_named`]). Returns the layer ids, base first.
    pub fn write_shared(&self, remote: &Path) -> Vec<String> {
        self.write_shared_named(remote, Naming::Chain)
    }

    /// Puts its layers on a remote tree as a writer host does: each one named as `naming`
    /// says, its files unpacked in `overlay/RO/<id>/diff`, its short id in `link` and its
    /// parent chain's in `lower`, `layer.json` with its `id`, its parent's id and
    /// `diff-digest`. A layer the remote already holds over the same parent
    /// (a base two images share) is kept, not written again, as writers deduplicate.
    /// Returns the layer ids, base first.
    pub fn write_shared_named(&self, remote: &Path, naming: Naming) -> Vec<String> {
        let mut ids = Vec::new();
        // The id of the layer below and the short ids of its chain, its own first.
        let mut below: Option<(String, Vec<String>)> = None;
        for (layer, chain) in self.layers.iter().zip(self.chain_ids()) {
            let diff_hex = layer.diff_id();
            let parent_id = below.as_ref().map(|(id, _)| id.as_str());
            if let Some(id) = shared_layer_over(remote, parent_id, &diff_hex) {
                let overlay = remote.join("overlay/RO").join(&id);
                let mut shorts = vec![fs::read_to_string(overlay.join("link")).unwrap()];
                if let Ok(lower) = fs::read_to_string(overlay.join("lower")) {
                    shorts.extend(
                        lower
                            .split(':')
                            .map(|l| l.trim_start_matches("l/").to_owned()),
                    );
                }
                below = Some((id.clone(), shorts));
                ids.push(id);
                continue;
            }
            let id = match (naming, parent_id) {
                (Naming::Chain, _) => chain.trim_start_matches("sha256:").to_owned(),
                (Naming::Isulad, None) => diff_hex.clone(),
                (Naming::Isulad, Some(parent)) => {
                    sha256_hex(format!("{parent}+{diff_hex}").as_bytes())
                }
                (Naming::Random, _) => random_hex(),
            };
            let short = id[..26].to_owned();
            let overlay = remote.join("overlay/RO").join(&id);
            fs::create_dir_all(overlay.join("diff")).unwrap();
            fs::create_dir_all(overlay.join("work")).unwrap();
            tar::Archive::new(&layer.tar[..])
                .unpack(overlay.join("diff"))
                .unwrap();
            fs::write(overlay.join("link"), &short).unwrap();
            let parent = match &below {
                None => {
                    fs::create_dir(overlay.join("empty")).unwrap();
                    String::new()
                }
                // The parent's short id, then the parent's own `lower`: the whole chain,
                // nearest first, as iSulad writes it and as a view takes a layer as ready.
                Some((parent, shorts)) => {
                    let lower: Vec<String> = shorts.iter().map(|s| format!("l/{s}")).collect();
                    fs::write(overlay.join("lower"), lower.join(":")).unwrap();
                    format!(r#","parent":"{parent}""#)
                }
            };
            let meta = remote.join("overlay-layers/RO").join(&id);
            fs::create_dir_all(&meta).unwrap();
            let json = format!(
                r#"{{"id":"{id}","diff-digest":"sha256:{diff_hex}","diff-size":{}{parent}}}"#,
                layer.tar.len()
            );
            fs::write(meta.join("layer.json"), json).unwrap();
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            std::io::Write::write_all(&mut gz, b"{\"type\":1}\n").unwrap();
            fs::write(
                meta.join(format!("{id}.tar-split.gz")),
                gz.finish().unwrap(),
            )
            .unwrap();
            let mut shorts = vec![short];
            shorts.extend(below.map(|(_, chain)| chain).unwrap_or_default());
            below = Some((id.clone(), shorts));
            ids.push(id);
        }
        ids
    }
}

/// How a writer host names the layers it puts on the remote tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// iSulad (`calc_chain_id` of a registry pull, `isula load`) and containers/image: the
    /// base layer by its diff ID's hex, every other one by the hex sha256 of the text
    /// `<parent layer id>+<diff ID hex>`.
    Isulad,
    /// By the hex of its OCI chain ID.
    Chain,
    /// 64 random lowercase hex digits, as writers that do not derive ids from content do.
    Random,
}

/// The id of the layer of `remote` whose diff is `diff_hex` over the layer `parent`.
fn shared_layer_over(remote: &Path, parent: Option<&str>, diff_hex: &str) -> Option<String> {
    let layers = fs::read_dir(remote.join("overlay-layers/RO")).ok()?;
    layers.filter_map(Result::ok).find_map(|entry| {
        let json = fs::read(entry.path().join("layer.json")).ok()?;
        let json: serde_json::Value = serde_json::from_slice(&json).ok()?;
        let same = json["diff-digest"].as_str() == Some(&format!("sha256:{diff_hex}"))
            && json["parent"].as_str().filter(|p| !p.is_empty()) == parent;
        same.then(|| json["id"].as_str().unwrap().to_owned())
    })
}

/// 64 lowercase hex digits no other call returns.
pub fn random_hex() -> String {
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seed = format!(
        "{:?} {} {}",
        std::time::SystemTime::now(),
        std::process::id(),
        COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    sha256_hex(seed.as_bytes())
}

/// Takes the layer `id` off the remote tree, as a writer host's garbage collection does.
pub fn remove_shared(remote: &Path, id: &str) {
    fs::remove_dir_all(remote.join("overlay-layers/RO").join(id)).unwrap();
    fs::remove_dir_all(remote.join("overlay/RO").join(id)).unwrap();
}

/// Two images of three layers that share their base layer (busybox), each upper layer a
/// file of its own: `/etc/<tag>-1` and `/etc/<tag>-2` holding `<tag>-1\n`, `<tag>-2\n`.
pub fn images_sharing_a_base(name: &str) -> (Image, Image) {
    let image = |tag: &str| Image {
        name: format!("docker.io/library/{name}:{tag}"),
        layers: vec![
            Layer::busybox(),
            Layer::file(&format!("etc/{tag}-1"), format!("{tag}-1\n").as_bytes()),
            Layer::file(&format!("etc/{tag}-2"), format!("{tag}-2\n").as_bytes()),
        ],
    };
    (image("a"), image("b"))
}

/// The value of the option `key` (`lowerdir`, `upperdir`) in mount options.
pub fn mount_option<'a>(options: impl IntoIterator<Item = &'a str>, key: &str) -> String {
    let prefix = format!("{key}=");
    let options: Vec<&str> = options.into_iter().collect();
    options
        .iter()
        .find_map(|o| o.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {key} in {options:?}"))
        .to_owned()
}

/// A stable digest of a tree: names, kinds, modes and contents, in order.
pub fn tree_hash(root: &Path) -> String {
    let mut hasher = Sha256::new();
    let mut stack = vec![root.to_owned()];
    while let Some(path) = stack.pop() {
        let meta = fs::symlink_metadata(&path).unwrap();
        hasher.update(
            path.strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .as_bytes(),
        );
        hasher.update(format!("{:o}", std::os::unix::fs::MetadataExt::mode(&meta)).as_bytes());
        if meta.is_dir() {
            let mut names: Vec<PathBuf> = fs::read_dir(&path)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            names.sort();
            names.reverse();
            stack.extend(names);
        } else if meta.file_type().is_symlink() {
            hasher.update(fs::read_link(&path).unwrap().to_string_lossy().as_bytes());
        } else if meta.is_file() {
            let mut bytes = Vec::new();
            fs::File::open(&path)
                .unwrap()
                .read_to_end(&mut bytes)
                .unwrap();
            hasher.update(&bytes);
        }
    }
    format!("{:x}", hasher.finalize())
}

pub fn labels(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub fn output_text(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

// ---- containerd ----

/// A containerd of its own (root, state, socket, config) with the snapshotter at
/// `snapshotter` as its proxy plugin `layerfs`.
pub struct Containerd {
    pub dir: PathBuf,
    pub socket: PathBuf,
    child: Option<Child>,
}

impl Containerd {
    pub fn start(dir: &Path, snapshotter: &Path) -> Containerd {
        Containerd::start_with(dir, snapshotter, "")
    }

    /// With more configuration appended (a CRI section, say).
    pub fn start_with(dir: &Path, snapshotter: &Path, extra: &str) -> Containerd {
        fs::create_dir_all(dir).unwrap();
        let socket = dir.join("containerd.sock");
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{socket}"
[proxy_plugins.layerfs]
  type = "snapshot"
  address = "{snapshotter}"
{extra}
"#,
            root = dir.join("root").display(),
            state = dir.join("state").display(),
            socket = socket.display(),
            snapshotter = snapshotter.display(),
        );
        fs::write(dir.join("config.toml"), config).unwrap();
        let log = fs::File::create(dir.join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(dir.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("containerd (Debian's containerd package)");
        let mut c = Containerd {
            dir: dir.to_owned(),
            socket,
            child: Some(child),
        };
        eventually(30, "containerd's socket", || {
            if let Ok(Some(status)) = c.child.as_mut().unwrap().try_wait() {
                panic!("containerd exited with {status}: {}", c.log());
            }
            c.socket.exists() && c.ctr(&["version"]).status.success()
        });
        c
    }

    /// `ctr` against this containerd, bounded in time.
    pub fn ctr(&self, args: &[&str]) -> Output {
        Command::new("timeout")
            .arg("120")
            .arg("ctr")
            .arg("-a")
            .arg(&self.socket)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// `ctr`, which must succeed; its stdout.
    pub fn ctr_ok(&self, args: &[&str]) -> String {
        let out = self.ctr(args);
        assert!(out.status.success(), "ctr {args:?}: {}", output_text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn import(&self, image: &Image) {
        let archive = self.dir.join("image.tar");
        fs::write(&archive, image.oci_archive()).unwrap();
        self.ctr_ok(&[
            "images",
            "import",
            "--snapshotter",
            "layerfs",
            &archive.to_string_lossy(),
        ]);
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    /// Runs `script` in a new container `id` of `image` (`ctr run -d`, more flags in
    /// `flags`) and leaves it running, so that its mounts can be looked at. Returns its
    /// mount options and what the script printed, read from its upper dir.
    pub fn run_kept(
        &self,
        flags: &[&str],
        image: &str,
        id: &str,
        script: &str,
    ) -> (Vec<String>, String) {
        let wrapped = format!(
            "( {script} ) > /script.out 2>&1; echo script-ended >> /script.out; exec sleep 600"
        );
        let mut args = vec!["run", "-d", "--snapshotter", "layerfs"];
        args.extend(flags);
        args.extend([image, id, "/bin/sh", "-c", &wrapped]);
        self.ctr_ok(&args);
        let options = self.snapshot_mount_options("default", id);
        let out = PathBuf::from(mount_option(options.iter().map(String::as_str), "upperdir"))
            .join("script.out");
        let mut printed = String::new();
        eventually(60, &format!("the script of container {id}"), || {
            printed = fs::read_to_string(&out).unwrap_or_default();
            printed.ends_with("script-ended\n")
        });
        let printed = printed.trim_end_matches("script-ended\n").to_owned();
        (options, printed)
    }

    /// Stops and removes the container `id`, and its snapshot.
    pub fn remove_container(&self, id: &str) {
        let _ = self.ctr(&["tasks", "kill", "-s", "SIGKILL", id]);
        eventually(30, &format!("container {id} to stop"), || {
            self.ctr(&["tasks", "delete", id]).status.success()
                || !self.ctr_ok(&["tasks", "ls", "-q"]).lines().any(|l| l == id)
        });
        self.ctr_ok(&["containers", "rm", id]);
    }

    /// The mount options of the snapshot `key` of namespace `ns`, as containerd hands them
    /// to the runtime (`ctr snapshots mounts`).
    pub fn snapshot_mount_options(&self, ns: &str, key: &str) -> Vec<String> {
        let out = self.ctr_ok(&[
            "-n",
            ns,
            "snapshots",
            "--snapshotter",
            "layerfs",
            "mounts",
            "/target",
            key,
        ]);
        // One line per mount: `mount -t <type> <source> <target> -o <options>`.
        let line = out
            .lines()
            .find(|l| l.starts_with("mount "))
            .unwrap_or_else(|| panic!("no mount in {out}"));
        let options = line
            .split(" -o ")
            .nth(1)
            .unwrap_or_else(|| panic!("no options in {line}"));
        options.split(',').map(str::to_owned).collect()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Shims outlive containerd; ours are the ones given our socket.
        let _ = Command::new("pkill")
            .arg("-KILL")
            .arg("-f")
            .arg(self.socket.to_string_lossy().as_ref())
            .status();
        if let Some(mut child) = self.child.take() {
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(20);
            while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut ours: Vec<&str> = info
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| Path::new(p).starts_with(&self.dir))
            .collect();
        ours.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for point in ours {
            let _ = Command::new("umount").arg("-l").arg(point).status();
        }
        if std::thread::panicking() {
            eprintln!("--- containerd log ---\n{}", self.log());
        }
    }
}

// ---- A registry on 127.0.0.1 ----

/// Debian's `docker-registry` serving plain HTTP on a free port of 127.0.0.1.
pub struct Registry {
    pub address: String,
    child: Option<Child>,
}

impl Registry {
    pub fn start(dir: &Path) -> Registry {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        };
        let address = format!("127.0.0.1:{port}");
        fs::create_dir_all(dir.join("data")).unwrap();
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {address}\n",
            dir.join("data").display()
        );
        fs::write(dir.join("config.yml"), config).unwrap();
        let log = fs::File::create(dir.join("registry.log")).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("docker-registry (Debian's docker-registry package)");
        let registry = Registry {
            address: address.clone(),
            child: Some(child),
        };
        eventually(30, "the registry", || {
            std::net::TcpStream::connect(&address).is_ok()
        });
        registry
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
