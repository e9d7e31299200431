//! Real container runtimes with their storage on the view: podman (vfs and overlay drivers),
//! containerd (overlayfs snapshotter) and iSulad's remote-layer layout (kernel overlay over
//! `overlay/l/<short>` links, exposed with `--expose-into`). Each container writes, deletes
//! (whiteouts), renames a directory, runs from a committed image where the runtime can,
//! and runs as a user other than root (the view is mounted `allow_other,suid,dev`). The
//! remote must be unchanged afterwards ([`Mount`]'s drop checks it).
//!
//! The image is busybox from Debian's `busybox-static`, built here; no registry is used.
//! Every runtime command runs under `timeout`, and guards stop daemons and remove mounts
//! even when a test fails.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// `statfs().f_type` of FUSE, which iSulad's overlay2 driver refuses.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// How long one runtime command may take.
const COMMAND_SECS: &str = "180";

/// The Debian packages the tests need, by the command each provides.
fn need(command: &str, package: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(command))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!("`{command}` not found: install the Debian package {package} (tests/run.sh does)")
    })
}

/// Runs `cmd` under `timeout`, and fails the test with its output unless it succeeds.
fn run(program: &str, args: &[&str]) -> String {
    let out = run_output(program, args);
    assert!(
        out.status.success(),
        "{program} {} failed ({}):\n{}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn run_output(program: &str, args: &[&str]) -> Output {
    Command::new("timeout")
        .args(["-k", "10", COMMAND_SECS, program])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"))
}

fn s(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// A busybox root filesystem: the static binary, its applets, a passwd with `nobody`, and
/// the directories a runtime mounts over. `/data/sub/file` is there to be renamed.
fn busybox_rootfs(dir: &Path) {
    let busybox = need("busybox", "busybox-static");
    fs::create_dir_all(dir.join("bin")).unwrap();
    fs::copy(&busybox, dir.join("bin/busybox")).unwrap();
    for applet in [
        "sh", "ls", "cat", "echo", "mkdir", "rm", "mv", "id", "touch", "test", "su", "stat",
    ] {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(applet)).unwrap();
    }
    for d in ["etc", "proc", "sys", "dev", "data/sub", "root"] {
        fs::create_dir_all(dir.join(d)).unwrap();
    }
    fs::create_dir_all(dir.join("tmp")).unwrap();
    fs::set_permissions(dir.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
    fs::write(
        dir.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n",
    )
    .unwrap();
    fs::write(dir.join("etc/group"), "root:x:0:\nnogroup:x:65534:\n").unwrap();
    fs::write(dir.join("data/sub/file"), "from the image\n").unwrap();
}

/// A tar of `dir`'s content, owned by root.
fn tar_of(dir: &Path, out: &Path) {
    run(
        "tar",
        &[
            "--numeric-owner",
            "--owner=0",
            "--group=0",
            "-C",
            s(dir),
            "-cf",
            s(out),
            ".",
        ],
    );
}

/// What every container does to the image: a new file, a deleted one (a whiteout in the
/// container's layer), and a directory of the image renamed.
const CHANGE: &str = "echo written > /written && rm /bin/ls && mv /data /moved \
    && test ! -e /data && cat /moved/sub/file";

/// What a container from the committed image checks, as root and as `nobody`.
const CHECK: &str = "set -e; test \"$(cat /written)\" = written; test ! -e /bin/ls; \
    test ! -e /data; test \"$(cat /moved/sub/file)\" = \"from the image\"; \
    su -s /bin/sh nobody -c 'test \"$(id -u)\" = 65534 && echo mine > /tmp/nobody \
    && test \"$(cat /tmp/nobody)\" = mine && cat /moved/sub/file >/dev/null'; echo checked";

/// Detaches, deepest first, every mount below `dir` except those listed: what a runtime
/// leaves behind when a test stops half way.
struct MountsBelow {
    dir: PathBuf,
    keep: Vec<PathBuf>,
}

impl Drop for MountsBelow {
    fn drop(&mut self) {
        detach_below(&self.dir, &self.keep);
    }
}

/// The limits runc sets must not be above the test's own: raising them needs
/// CAP_SYS_RESOURCE, which a CI container may not have.
fn ulimit_args() -> Vec<String> {
    vec![
        "--ulimit".into(),
        "nofile=1024:1024".into(),
        "--ulimit".into(),
        "nproc=4096:4096".into(),
    ]
}

fn runtime_mount() -> Mount {
    Mount::with(
        Options {
            opts: "suid,dev".into(),
            ..Options::default()
        },
        |_| {},
    )
}

// ---- podman ----

/// podman with its storage (root) on the view and its run root and temporary files beside
/// it, and a busybox image imported as `localhost/busybox:base`.
struct Podman {
    base: Vec<String>,
}

impl Podman {
    fn on(m: &Mount, driver: &str) -> Podman {
        need("podman", "podman");
        need("runc", "runc");
        let root = m.mnt.join(format!("podman-{driver}"));
        let runroot = m.dir.path().join("podman-run");
        let work = m.dir.path().join("work");
        fs::create_dir_all(work.join("rootfs")).unwrap();
        busybox_rootfs(&work.join("rootfs"));
        tar_of(&work.join("rootfs"), &work.join("rootfs.tar"));
        let base = [
            "--root",
            s(&root),
            "--runroot",
            s(&runroot),
            "--storage-driver",
            driver,
            "--cgroup-manager",
            "cgroupfs",
            "--events-backend",
            "file",
            "--tmpdir",
            s(&work),
        ]
        .map(str::to_owned)
        .to_vec();
        let podman = Podman { base };
        podman.run(&[
            "import",
            s(&work.join("rootfs.tar")),
            "localhost/busybox:base",
        ]);
        podman
    }

    fn run(&self, args: &[&str]) -> String {
        let all: Vec<&str> = self
            .base
            .iter()
            .map(String::as_str)
            .chain(args.iter().copied())
            .collect();
        run("podman", &all)
    }
}

fn podman(driver: &str) {
    let started = Instant::now();
    let m = runtime_mount();
    let mut below = MountsBelow {
        dir: m.dir.path().to_owned(),
        keep: vec![m.mnt.clone()],
    };
    let runtime = Podman::on(&m, driver);
    let podman = |args: &[&str]| runtime.run(args);
    let limits = ulimit_args();
    let limits: Vec<&str> = limits.iter().map(String::as_str).collect();
    let mut args = vec!["run", "--name", "changer", "--network", "none"];
    args.extend_from_slice(&limits);
    args.extend_from_slice(&["localhost/busybox:base", "sh", "-c", CHANGE]);
    assert_eq!(podman(&args).trim(), "from the image");
    if driver == "overlay" {
        // The container's layer is a kernel overlay upper in the view: its deletion is a
        // whiteout there, kept in local as overlayfs wrote it.
        let uppers = names(&m.local.join("podman-overlay/overlay"));
        assert!(
            uppers.iter().any(|id| is_whiteout(
                &m.local
                    .join("podman-overlay/overlay")
                    .join(id)
                    .join("diff/bin/ls")
            )),
            "no whiteout for /bin/ls in any layer under {}",
            m.local.join("podman-overlay/overlay").display()
        );
    }
    podman(&["commit", "changer", "localhost/busybox:committed"]);
    podman(&["rm", "changer"]);
    let mut args = vec!["run", "--rm", "--network", "none"];
    args.extend_from_slice(&limits);
    args.extend_from_slice(&["localhost/busybox:committed", "sh", "-c", CHECK]);
    assert_eq!(podman(&args).trim(), "checked");
    // A non-root container user reaches the view (allow_other) through the runtime too.
    let mut args = vec!["run", "--rm", "--network", "none", "--user", "65534:65534"];
    args.extend_from_slice(&limits);
    args.extend_from_slice(&[
        "localhost/busybox:committed",
        "sh",
        "-c",
        "cat /moved/sub/file && echo x > /tmp/x && id -u",
    ]);
    assert_eq!(podman(&args), "from the image\n65534\n");
    podman(&["rmi", "-a", "-f"]);
    below.keep.clear();
    below.keep.push(m.mnt.clone());
    drop(below);
    eprintln!("podman {driver}: {:.1} s", started.elapsed().as_secs_f64());
}

#[test]
fn podman_vfs_on_the_view() {
    podman("vfs");
}

#[test]
fn podman_overlay_on_the_view() {
    podman("overlay");
}

/// What the long-running container does: counts into a file of its own layer, reading a
/// file of the image each time.
const COUNT: &str = "i=0; while [ $i -lt 100000 ]; do cat /data/sub/file >/dev/null \
    || exit 3; echo $i >> /count || exit 4; i=$((i+1)); sleep 0.01; done";

/// A container running on a view under a keeper (DESIGN §13) outlives its daemon: killed
/// three times while the container counts into its layer, the daemon is replaced each time,
/// and the container goes on, its count unbroken.
#[test]
fn a_podman_container_outlives_its_daemon() {
    let m = Mount::with(
        Options {
            opts: "suid,dev,keeper".into(),
            ..Options::default()
        },
        |_| {},
    );
    let mut below = MountsBelow {
        dir: m.dir.path().to_owned(),
        keep: vec![m.mnt.clone()],
    };
    let podman = Podman::on(&m, "overlay");
    let limits = ulimit_args();
    let mut args = vec!["run", "-d", "--name", "counter", "--network", "none"];
    args.extend(limits.iter().map(String::as_str));
    args.extend_from_slice(&["localhost/busybox:base", "sh", "-c", COUNT]);
    podman.run(&args);
    let count = || -> Vec<u64> {
        podman
            .run(&["exec", "counter", "cat", "/count"])
            .lines()
            .map(|l| l.parse().expect("a number"))
            .collect()
    };
    let status = || -> serde_json::Value {
        let out = cli(&["status", "--json"], &m.mnt);
        serde_json::from_slice(&out.stdout).expect("status --json")
    };
    for kill in 1..=3u64 {
        std::thread::sleep(Duration::from_millis(700));
        let daemon = status()["daemon_pid"].as_u64().unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(daemon as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        eventually(20, "a new daemon", || {
            let out = cli(&["status", "--json"], &m.mnt);
            serde_json::from_slice::<serde_json::Value>(&out.stdout)
                .is_ok_and(|s| s["daemon_pid"].as_u64().is_some_and(|p| p != daemon))
        });
        assert_eq!(status()["keeper"]["restarts"].as_u64(), Some(kill));
    }
    std::thread::sleep(Duration::from_millis(500));
    let counted = count();
    assert!(
        counted.len() > 50,
        "the container counted to {}",
        counted.len()
    );
    assert!(
        counted.iter().enumerate().all(|(i, n)| *n == i as u64),
        "the count broke: {counted:?}"
    );
    let state = podman.run(&["inspect", "-f", "{{.State.Status}}", "counter"]);
    assert_eq!(state.trim(), "running", "the container stopped");
    podman.run(&["rm", "-f", "-t", "0", "counter"]);
    podman.run(&["rmi", "-a", "-f"]);
    below.keep.clear();
    below.keep.push(m.mnt.clone());
    drop(below);
}

// ---- containerd ----

/// A containerd of the test's own: its config, root on the view, state, socket. Stopped
/// (with its shims) on drop.
struct Containerd {
    child: std::process::Child,
    socket: PathBuf,
}

impl Containerd {
    fn start(dir: &Path, root: &Path) -> Containerd {
        need("containerd", "containerd");
        need("ctr", "containerd");
        need("runc", "runc");
        let state = dir.join("containerd-state");
        fs::create_dir_all(&state).unwrap();
        let socket = state.join("containerd.sock");
        let config = dir.join("containerd.toml");
        fs::write(&config, containerd_config(root, &state, &socket)).unwrap();
        let log = fs::File::create(dir.join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start containerd");
        let mut c = Containerd { child, socket };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::os::unix::net::UnixStream::connect(&c.socket).is_err() {
            if let Ok(Some(status)) = c.child.try_wait() {
                panic!(
                    "containerd exited ({status}):\n{}",
                    fs::read_to_string(dir.join("containerd.log")).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "containerd did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }

    fn ctr(&self, args: &[&str]) -> String {
        let mut all = vec!["--address", s(&self.socket), "--namespace", "layerfs-test"];
        all.extend_from_slice(args);
        run("ctr", &all)
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // SAFETY: a signal to the child this guard started.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Shims outlive containerd by design; those of this daemon name its socket.
        for pid in processes_with_arg(&self.socket) {
            // SAFETY: a signal to a shim of this test's containerd.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

/// containerd's config: everything of its own below the test dir, the overlayfs
/// snapshotter under `root` (on the view), no CRI.
fn containerd_config(root: &Path, state: &Path, socket: &Path) -> String {
    format!(
        r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"
"#,
        root = root.display(),
        state = state.display(),
        socket = socket.display(),
    )
}

/// The architecture as OCI names it.
fn oci_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// An OCI image layout tar with one layer, the tar `layer`, named `name`.
fn oci_image_tar(layer: &Path, name: &str, out: &Path) {
    use sha2::{Digest, Sha256};
    let dir = out.with_extension("d");
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).unwrap();
    let put = |bytes: &[u8]| {
        let digest = format!("{:x}", Sha256::digest(bytes));
        fs::write(blobs.join(&digest), bytes).unwrap();
        (format!("sha256:{digest}"), bytes.len())
    };
    let (layer_digest, layer_size) = put(&fs::read(layer).unwrap());
    let config = serde_json::json!({
        "architecture": oci_arch(), "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    });
    let (config_digest, config_size) = put(config.to_string().as_bytes());
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest, "size": layer_size}],
    });
    let (manifest_digest, manifest_size) = put(manifest.to_string().as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": manifest_digest, "size": manifest_size,
                       "platform": {"architecture": oci_arch(), "os": "linux"},
                       "annotations": {"io.containerd.image.name": name}}],
    });
    fs::write(dir.join("index.json"), index.to_string()).unwrap();
    fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    tar_of(&dir, out);
}

#[test]
fn containerd_with_its_root_on_the_view() {
    let started = Instant::now();
    let m = runtime_mount();
    let below = MountsBelow {
        dir: m.dir.path().to_owned(),
        keep: vec![m.mnt.clone()],
    };
    let work = m.dir.path().join("work");
    fs::create_dir_all(work.join("rootfs")).unwrap();
    busybox_rootfs(&work.join("rootfs"));
    tar_of(&work.join("rootfs"), &work.join("layer.tar"));
    const IMAGE: &str = "docker.io/library/busybox:layerfs-test";
    oci_image_tar(&work.join("layer.tar"), IMAGE, &work.join("image.tar"));

    let root = m.mnt.join("containerd");
    let containerd = Containerd::start(m.dir.path(), &root);
    let snapshots = "io.containerd.snapshotter.v1.overlayfs/snapshots";
    containerd.ctr(&[
        "images",
        "import",
        "--snapshotter",
        "overlayfs",
        s(&work.join("image.tar")),
    ]);
    let out = containerd.ctr(&[
        "run",
        "--snapshotter",
        "overlayfs",
        IMAGE,
        "changer",
        "sh",
        "-c",
        CHANGE,
    ]);
    assert_eq!(out.trim(), "from the image");
    let uppers = m.local.join("containerd").join(snapshots);
    assert!(
        names(&uppers)
            .iter()
            .any(|n| is_whiteout(&uppers.join(n).join("fs/bin/ls"))),
        "no whiteout for /bin/ls in any snapshot under {}",
        uppers.display()
    );
    // ctr cannot commit a container; the snapshotter can, and what it commits is what a
    // new container starts from.
    containerd.ctr(&[
        "snapshots",
        "--snapshotter",
        "overlayfs",
        "commit",
        "committed",
        "changer",
    ]);
    containerd.ctr(&["containers", "rm", "changer"]);
    containerd.ctr(&[
        "snapshots",
        "--snapshotter",
        "overlayfs",
        "prepare",
        "from-committed",
        "committed",
    ]);
    let rootfs = work.join("from-committed");
    fs::create_dir_all(&rootfs).unwrap();
    let mount_cmd = containerd.ctr(&[
        "snapshots",
        "--snapshotter",
        "overlayfs",
        "mounts",
        s(&rootfs),
        "from-committed",
    ]);
    assert!(
        mount_cmd.contains(s(&root)),
        "the snapshot is not on the view: {mount_cmd}"
    );
    run("sh", &["-c", &mount_cmd]);
    let out = containerd.ctr(&[
        "run",
        "--rm",
        "--env",
        "PATH=/bin",
        "--rootfs",
        s(&rootfs),
        "checker",
        "/bin/sh",
        "-c",
        CHECK,
    ]);
    assert_eq!(out.trim(), "checked");
    detach(&rootfs);
    drop(containerd);
    drop(below);
    eprintln!("containerd: {:.1} s", started.elapsed().as_secs_f64());
}

// ---- iSulad's layout, exposed ----

/// The busybox layer of the iSulad tests, as a writer host publishes it.
const BB_LAYER: &str = "b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0";
const BB_SHORT: &str = "b0b0b0b0b0b0b0b0b0b0b0b0b0";
const BB_IMAGE: &str = "1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b";

/// Adds the busybox layer and an image on it to a remote tree.
fn publish_busybox(remote: &Path) {
    let overlay = remote.join("overlay/RO").join(BB_LAYER);
    fs::create_dir_all(&overlay).unwrap();
    busybox_rootfs(&overlay.join("diff"));
    for d in ["work", "merged", "empty"] {
        fs::create_dir_all(overlay.join(d)).unwrap();
    }
    write_atomic(&overlay.join("link"), BB_SHORT.as_bytes());
    let meta = remote.join("overlay-layers/RO").join(BB_LAYER);
    fs::create_dir_all(&meta).unwrap();
    let json =
        format!(r#"{{"id":"{BB_LAYER}","diff-digest":"sha256:{BB_LAYER}","incompelte":false}}"#);
    write_atomic(&meta.join("layer.json"), json.as_bytes());
    fs::write(
        meta.join(format!("{BB_LAYER}.tar-split.gz")),
        tar_split_gz(),
    )
    .unwrap();
    write_image(remote, BB_IMAGE, BB_LAYER, &["busybox:latest"]);
}

/// The directory the view is exposed in, beside the mount's other dirs.
fn storage_beside(remote: &Path) -> PathBuf {
    remote.parent().unwrap().join("storage")
}

fn exposed_mount() -> (Mount, Options) {
    let options = Options {
        opts: "suid,dev".into(),
        ..Options::default()
    };
    let mut options_with_root = options.clone();
    let m = Mount::with(options, |remote| {
        publish_busybox(remote);
        fs::create_dir(storage_beside(remote)).unwrap();
    });
    let root = storage_beside(&m.remote);
    options_with_root.args = vec!["--expose-into".into(), s(&root).to_owned()];
    (m, options_with_root)
}

/// Waits for the binds of an exposed mount (a foreground daemon shows its FUSE mount a
/// moment before them). A bind a killed daemon left is there too until the new mount
/// replaces it, but dead: only a bind that answers is the new one.
fn wait_for_binds(root: &Path) {
    for name in ["overlay", "overlay-layers", "overlay-images"] {
        let point = root.join(name);
        eventually(30, &format!("a live bind at {}", point.display()), || {
            mounts_at(&point) == 1 && fs::read_dir(&point).is_ok()
        });
    }
}

// f_type's width differs between architectures.
#[allow(clippy::unnecessary_cast)]
fn f_type(path: &Path) -> i64 {
    nix::sys::statfs::statfs(path)
        .unwrap_or_else(|e| panic!("statfs {}: {e}", path.display()))
        .filesystem_type()
        .0 as i64
}

/// A container layer as iSulad's overlay2 driver makes one, on the image's layers, mounted
/// at `overlay/<cid>/merged`. Returns that path.
fn container_layer(root: &Path, cid: &str, lowers: &[&str]) -> PathBuf {
    let layer = root.join("overlay").join(cid);
    for d in ["diff", "work", "merged"] {
        fs::create_dir_all(layer.join(d)).unwrap();
    }
    let lowerdir: Vec<String> = lowers
        .iter()
        .map(|short| format!("{}/overlay/l/{short}", root.display()))
        .collect();
    let merged = layer.join("merged");
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        lowerdir.join(":"),
        layer.join("diff").display(),
        layer.join("work").display()
    );
    run(
        "mount",
        &["-t", "overlay", "overlay", "-o", &data, s(&merged)],
    );
    merged
}

/// Runs `script` in a container on `rootfs`, as `user` (`uid:gid`).
fn chroot_sh(rootfs: &Path, user: &str, script: &str) -> String {
    run(
        "chroot",
        &[
            &format!("--userspec={user}"),
            s(rootfs),
            "/bin/sh",
            "-c",
            script,
        ],
    )
}

#[test]
fn isulad_layout_exposed_on_a_regular_filesystem() {
    let started = Instant::now();
    let (mut m, options) = exposed_mount();
    let root = storage_beside(&m.remote);
    m.remount(&options);
    let below = MountsBelow {
        dir: m.dir.path().to_owned(),
        keep: vec![
            m.mnt.clone(),
            root.join("overlay"),
            root.join("overlay-layers"),
            root.join("overlay-images"),
        ],
    };
    wait_for_binds(&root);

    // What iSulad's overlay2 driver checks: the f_type of the directory holding its home.
    // The view's own is FUSE, which it refuses; ROOT's is the filesystem it lies on.
    assert_eq!(f_type(&m.mnt), FUSE_SUPER_MAGIC);
    assert_ne!(f_type(&root), FUSE_SUPER_MAGIC);
    assert_eq!(f_type(&root), f_type(m.dir.path()));

    // Real d_types, and a remote layer is a symlink (iSulad deletes a symlinked layer as a
    // remote one, and a directory as its own) pointing where iSulad would have put it.
    let home = root.join("overlay");
    let listed = raw_dtypes(&home);
    assert!(!listed.is_empty());
    for (name, t) in &listed {
        assert!(t.is_some(), "DT_UNKNOWN for {name} in {}", home.display());
    }
    let of = |name: &str| listed.get(name).copied();
    assert_eq!(of(BB_LAYER), Some(Some(nix::dir::Type::Symlink)));
    assert_eq!(of("RO"), Some(Some(nix::dir::Type::Directory)));
    assert_eq!(of("l"), Some(Some(nix::dir::Type::Directory)));
    for (home, name) in [("overlay", BB_LAYER), ("overlay-layers", BB_LAYER)] {
        let link = root.join(home).join(name);
        assert!(fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            fs::read_link(&link).unwrap(),
            root.join(home).join("RO").join(name)
        );
        assert!(link.is_dir(), "{} does not resolve", link.display());
    }
    assert_eq!(
        fs::read_link(home.join("l").join(BB_SHORT)).unwrap(),
        Path::new("..").join(BB_LAYER).join("diff")
    );
    assert!(root
        .join("overlay-images")
        .join(BB_IMAGE)
        .join("images.json")
        .is_file());

    // A container: kernel overlay over the remote layer's l/ link, its upper and work in
    // overlay/<cid>/ (a real directory, the container's own).
    let cid = "c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0c0";
    let merged = container_layer(&root, cid, &[BB_SHORT]);
    assert!(fs::symlink_metadata(home.join(cid)).unwrap().is_dir());
    assert_eq!(chroot_sh(&merged, "0:0", CHANGE).trim(), "from the image");
    assert_eq!(
        chroot_sh(
            &merged,
            "65534:65534",
            "echo mine > /tmp/n && cat /tmp/n && id -u"
        ),
        "mine\n65534\n"
    );
    let upper = home.join(cid).join("diff");
    assert!(
        is_whiteout(&upper.join("bin/ls")),
        "no whiteout in the view"
    );
    assert!(
        is_whiteout(&m.local.join("overlay").join(cid).join("diff/bin/ls")),
        "no whiteout in local"
    );
    detach(&merged);

    // Committed: the container's layer becomes a local image layer on the remote one, as
    // iSulad makes them (its diff, link, lower and l/ link), and a new container runs on it.
    let committed = "d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0";
    let committed_short = "d0d0d0d0d0d0d0d0d0d0d0d0d0";
    fs::create_dir(home.join(committed)).unwrap();
    run(
        "cp",
        &["-a", s(&upper), s(&home.join(committed).join("diff"))],
    );
    fs::write(home.join(committed).join("link"), committed_short).unwrap();
    fs::write(home.join(committed).join("lower"), format!("l/{BB_SHORT}")).unwrap();
    std::os::unix::fs::symlink(
        format!("../{committed}/diff"),
        home.join("l").join(committed_short),
    )
    .unwrap();
    let second = "e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0";
    let merged = container_layer(&root, second, &[committed_short, BB_SHORT]);
    // A device node in the container's layer works only on a view mounted with `dev`.
    nix::sys::stat::mknod(
        &merged.join("dev/null"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(1, 3),
    )
    .unwrap();
    fs::set_permissions(merged.join("dev/null"), fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(chroot_sh(&merged, "0:0", CHECK).trim(), "checked");
    detach(&merged);
    drop(below);

    // A clean unmount takes the binds along, and the daemon ends (the binds would keep
    // its session alive).
    m.unmount();
    for name in ["overlay", "overlay-layers", "overlay-images"] {
        assert_eq!(mounts_at(&root.join(name)), 0, "{name} still bound");
    }
    assert!(fs::read_dir(&home).unwrap().next().is_none());
    eprintln!("iSulad layout: {:.1} s", started.elapsed().as_secs_f64());
}

#[test]
fn expose_into_replaces_stale_binds_and_refuses_live_ones() {
    let (mut m, options) = exposed_mount();
    let root = storage_beside(&m.remote);
    m.remount(&options);
    wait_for_binds(&root);
    let home = root.join("overlay");
    assert!(names(&home).contains(&BB_LAYER.to_owned()));

    // A killed daemon leaves binds whose connection is dead.
    m.kill_daemon();
    assert_eq!(mounts_at(&home), 1);
    // Over io_uring the connection ends only once the ring's teardown lets go of it: until
    // then a request finds the queues stopped (ECONNABORTED); dead either way.
    let dead = errno_of(fs::metadata(home.join("l")));
    assert!(
        matches!(dead, libc::ENOTCONN | libc::ECONNABORTED),
        "errno {dead}"
    );
    // The next mount replaces them rather than stacking on them.
    m.mount(&options);
    wait_for_binds(&root);
    assert!(names(&home).contains(&BB_LAYER.to_owned()));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(mounts_at(&home), 1);

    // Another mount exposing into the same ROOT while this one lives is refused, and
    // leaves nothing mounted.
    let other_local = m.dir.path().join("other-local");
    let other_mnt = m.dir.path().join("other-mnt");
    fs::create_dir(&other_local).unwrap();
    fs::create_dir(&other_mnt).unwrap();
    let out = Command::new(BIN)
        .args([
            "mount",
            "--remote",
            s(&m.remote),
            "--local",
            s(&other_local),
        ])
        .arg("-o")
        .arg(format!(
            "log_file={}",
            m.dir.path().join("other.log").display()
        ))
        .args(["--expose-into", s(&root), s(&other_mnt)])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("exposed there already"), "{stderr}");
    eventually(10, "the refused mount goes away", || {
        !is_mounted(&other_mnt)
    });
    assert_eq!(mounts_at(&home), 1);
    assert!(names(&home).contains(&BB_LAYER.to_owned()));

    // A clean remount re-binds: one bind each, showing the new mount.
    m.remount(&options);
    wait_for_binds(&root);
    assert!(names(&home).contains(&BB_LAYER.to_owned()));
    m.unmount();
    for name in ["overlay", "overlay-layers", "overlay-images"] {
        assert_eq!(mounts_at(&root.join(name)), 0, "{name} still bound");
    }
}

#[test]
fn expose_into_is_checked_before_mounting() {
    let dir = tempfile::tempdir().unwrap();
    let (remote, local, mnt) = (
        dir.path().join("remote"),
        dir.path().join("local"),
        dir.path().join("mnt"),
    );
    for d in [&remote, &local, &mnt] {
        fs::create_dir(d).unwrap();
    }
    let mount = |root: &Path| {
        let out = cli(
            &[
                "mount",
                "--remote",
                s(&remote),
                "--local",
                s(&local),
                "-o",
                &format!("expose_into={}", root.display()),
            ],
            &mnt,
        );
        assert!(!out.status.success());
        assert!(!is_mounted(&mnt));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(mount(&dir.path().join("missing")).contains("expose-into directory"));
    assert!(mount(&mnt.join("x")).contains("expose-into directory"));
    assert!(mount(&local).contains("overlaps"));
}
