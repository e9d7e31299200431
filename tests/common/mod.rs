//! Real mounts for tests: each [`Mount`] copies the shipped fixture remote tree into a temp
//! dir, mounts layerfs over it with an empty local dir, and unmounts on drop, even when the
//! test panics. Dropping also checks that the remote tree is byte-for-byte what it was.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

pub const BIN: &str = env!("CARGO_BIN_EXE_layerfs");

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `fixtures/expected.json`.
pub fn expected() -> serde_json::Value {
    let text =
        fs::read_to_string(repo().join("fixtures/expected.json")).expect("fixtures/expected.json");
    serde_json::from_str(&text).expect("expected.json parses")
}

/// The id of a fixture object by its label (`L1`…`L5`, `imageA`…).
pub fn id(label: &str) -> String {
    expected()["labels"][label]
        .as_str()
        .unwrap_or_else(|| panic!("no fixture label {label}"))
        .to_owned()
}

pub fn short(label: &str) -> String {
    expected()["layer_shorts"][id(label)]
        .as_str()
        .unwrap_or_else(|| panic!("no short id for {label}"))
        .to_owned()
}

/// How to mount.
#[derive(Clone)]
pub struct Options {
    /// Extra `-o` options (comma-separated), on top of `allow_other`.
    pub opts: String,
    /// Extra command-line arguments before the mountpoint.
    pub args: Vec<String>,
    /// Run in the foreground (`-f`) as a child of the test; otherwise daemonize.
    pub foreground: bool,
    /// A daemonized mount logs to `daemon.log` in the test's temp dir, not to the host's
    /// journal or log directory, unless this is set or `opts` name a `log_file`.
    pub host_log: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            opts: String::new(),
            args: Vec::new(),
            foreground: true,
            host_log: false,
        }
    }
}

pub struct Mount {
    pub dir: tempfile::TempDir,
    pub remote: PathBuf,
    pub local: PathBuf,
    pub mnt: PathBuf,
    child: Option<Child>,
    remote_hash: String,
    mounted: bool,
}

impl Mount {
    /// The fixture remote, an empty local, default options.
    pub fn new() -> Mount {
        Mount::with(Options::default(), |_| {})
    }

    /// `prepare` may change the remote copy before mounting (its state then is the reference
    /// the drop check compares with).
    pub fn with(options: Options, prepare: impl FnOnce(&Path)) -> Mount {
        let dir = tempfile::Builder::new()
            .prefix("layerfs-test")
            .tempdir()
            .expect("tempdir");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let remote = dir.path().join("remote");
        let local = dir.path().join("local");
        let mnt = dir.path().join("mnt");
        copy_tree(&repo().join("fixtures/remote"), &remote);
        fs::create_dir(&local).unwrap();
        fs::set_permissions(&local, fs::Permissions::from_mode(0o755)).unwrap();
        fs::create_dir(&mnt).unwrap();
        prepare(&remote);
        let remote_hash = tree_hash(&remote);
        let mut m = Mount {
            dir,
            remote,
            local,
            mnt,
            child: None,
            remote_hash,
            mounted: false,
        };
        m.mount(&options);
        m
    }

    pub fn mount(&mut self, options: &Options) {
        let mut opts = String::from("allow_other");
        if !options.opts.is_empty() {
            opts = format!("{opts},{}", options.opts);
        }
        if !options.foreground && !options.host_log && !opts.contains("log_file=") {
            let log = self.dir.path().join("daemon.log");
            opts = format!("{opts},log_file={}", log.display());
        }
        let mut cmd = Command::new(BIN);
        cmd.arg("mount")
            .arg("--remote")
            .arg(&self.remote)
            .arg("--local")
            .arg(&self.local)
            .arg("-o")
            .arg(opts)
            .args(&options.args);
        if options.foreground {
            cmd.arg("-f");
        }
        cmd.arg(&self.mnt).stdin(Stdio::null());
        if options.foreground {
            let child = cmd.spawn().expect("spawn layerfs");
            self.child = Some(child);
            wait_for_mount(&self.mnt, self.child.as_mut());
        } else {
            let out = cmd.output().expect("run layerfs");
            assert!(
                out.status.success(),
                "layerfs mount failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                is_mounted(&self.mnt),
                "layerfs returned before the mount was live"
            );
        }
        self.mounted = true;
    }

    /// Unmounts and waits for the daemon to exit.
    pub fn unmount(&mut self) {
        if !self.mounted {
            return;
        }
        self.mounted = false;
        let deadline = Instant::now() + Duration::from_secs(20);
        while is_mounted(&self.mnt) {
            let _ = Command::new("umount")
                .arg(&self.mnt)
                .stderr(Stdio::null())
                .status();
            if !is_mounted(&self.mnt) {
                break;
            }
            if Instant::now() > deadline {
                let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => {
                        assert!(
                            status.success() || std::thread::panicking(),
                            "layerfs exited with {status}"
                        );
                        break;
                    }
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        panic!("layerfs did not exit after unmount");
                    }
                }
            }
        }
    }

    /// Remounts with the same trees (what persists in local must come back).
    pub fn remount(&mut self, options: &Options) {
        self.unmount();
        self.mount(options);
    }

    /// A path inside the mount.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    /// The `diff/` dir of a fixture layer, through the view.
    pub fn diff(&self, label: &str) -> PathBuf {
        diff_in(&self.mnt, label)
    }

    /// The same, in local.
    pub fn local_diff(&self, label: &str) -> PathBuf {
        diff_in(&self.local, label)
    }

    /// The same, in the remote copy.
    pub fn remote_diff(&self, label: &str) -> PathBuf {
        diff_in(&self.remote, label)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        self.unmount();
        if !std::thread::panicking() {
            assert_eq!(
                tree_hash(&self.remote),
                self.remote_hash,
                "the remote tree was modified"
            );
        }
    }
}

pub fn is_mounted(path: &Path) -> bool {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy().replace(' ', "\\040");
    info.lines()
        .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
}

fn wait_for_mount(mnt: &Path, mut child: Option<&mut Child>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !is_mounted(mnt) {
        if let Some(c) = child.as_deref_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                panic!("layerfs exited before mounting: {status}");
            }
        }
        assert!(Instant::now() < deadline, "mount did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A foreground daemon shows its FUSE mount a moment before its control server starts;
    // a test that asks `layerfs status` right away must find it.
    let socket = control_socket(mnt);
    while UnixStream::connect(&socket).is_err() {
        if let Some(c) = child.as_deref_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                panic!("layerfs exited before serving its control socket: {status}");
            }
        }
        assert!(
            Instant::now() < deadline,
            "control socket {} did not come up",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The control socket of the mount at `mnt`. Only the parent is made canonical: the
/// mountpoint itself is the mount's root, which a stalled remote may keep from answering.
fn control_socket(mnt: &Path) -> PathBuf {
    let parent = fs::canonicalize(mnt.parent().expect("a mountpoint has a parent"))
        .expect("canonical parent of the mountpoint");
    layerfs::control::socket_path(&parent.join(mnt.file_name().expect("a named mountpoint")))
}

/// `cp -a`, keeping modes, links and times.
pub fn copy_tree(from: &Path, to: &Path) {
    let status = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .expect("cp");
    assert!(
        status.success(),
        "cp -a {} {}",
        from.display(),
        to.display()
    );
}

/// A digest of everything in a tree: names, types, modes, owners, sizes, contents, link
/// targets and user xattrs. (Times are left out: reading a file may update its atime.)
pub fn tree_hash(root: &Path) -> String {
    let mut entries = BTreeMap::new();
    walk(root, root, &mut entries);
    let mut h = Sha256::new();
    for (path, line) in entries {
        h.update(path.as_bytes());
        h.update(line.as_bytes());
    }
    format!("{:x}", h.finalize())
}

fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
    let mut names: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    for path in names {
        let meta = fs::symlink_metadata(&path).unwrap();
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let ft = meta.file_type();
        let body = if ft.is_file() {
            let mut data = Vec::new();
            fs::File::open(&path)
                .unwrap()
                .read_to_end(&mut data)
                .unwrap();
            format!("{:x}", Sha256::digest(&data))
        } else if ft.is_symlink() {
            fs::read_link(&path).unwrap().to_string_lossy().into_owned()
        } else {
            String::new()
        };
        out.insert(
            rel,
            format!(
                "{:o} {} {} {} {} {}",
                meta.mode(),
                meta.uid(),
                meta.gid(),
                meta.size(),
                meta.rdev(),
                body
            ),
        );
        if ft.is_dir() {
            walk(root, &path, out);
        }
    }
}

/// Runs `sh -c script` as an unprivileged user (uid/gid 65534), returning (status, stdout+stderr).
pub fn sh_as_nobody(script: &str) -> (bool, String) {
    use std::os::unix::process::CommandExt;
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("sh");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Names in a directory, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// `d_type` of every entry of a directory as readdir returns it, `.` and `..` included.
/// `None` is `DT_UNKNOWN`.
pub fn raw_dtypes(dir: &Path) -> BTreeMap<String, Option<nix::dir::Type>> {
    let mut d = nix::dir::Dir::open(
        dir,
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
        nix::sys::stat::Mode::empty(),
    )
    .unwrap();
    d.iter()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), e.file_type())
        })
        .collect()
}

/// Names and `d_type`s of a directory, via readdir (not stat).
pub fn dtypes(dir: &Path) -> BTreeMap<String, &'static str> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let ft = e.file_type().unwrap();
            let t = if ft.is_dir() {
                "dir"
            } else if ft.is_symlink() {
                "link"
            } else if ft.is_file() {
                "file"
            } else {
                "other"
            };
            (e.file_name().to_string_lossy().into_owned(), t)
        })
        .collect()
}

pub fn errno_of<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("expected an error")
        .raw_os_error()
        .expect("an OS error")
}

pub fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

// ---- Helpers for the union-semantics tests ----

fn c_path(path: &Path) -> std::ffi::CString {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path without NUL")
}

/// `lgetxattr(2)` of one attribute (symlinks are not followed).
pub fn xattr_get(path: &Path, name: &str) -> std::io::Result<Vec<u8>> {
    let (p, n) = (c_path(path), std::ffi::CString::new(name).unwrap());
    let mut buf = vec![0u8; 65536];
    let r = unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buf.truncate(r as usize);
    Ok(buf)
}

/// `lsetxattr(2)` with no flags.
pub fn xattr_set(path: &Path, name: &str, value: &[u8]) -> std::io::Result<()> {
    let (p, n) = (c_path(path), std::ffi::CString::new(name).unwrap());
    let r = unsafe {
        libc::lsetxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `lremovexattr(2)`.
pub fn xattr_remove(path: &Path, name: &str) -> std::io::Result<()> {
    let (p, n) = (c_path(path), std::ffi::CString::new(name).unwrap());
    if unsafe { libc::lremovexattr(p.as_ptr(), n.as_ptr()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `llistxattr(2)`, names sorted.
pub fn xattr_list(path: &Path) -> std::io::Result<Vec<String>> {
    let p = c_path(path);
    let mut buf = vec![0u8; 65536];
    let r = unsafe { libc::llistxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut v: Vec<String> = buf[..r as usize]
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect();
    v.sort();
    Ok(v)
}

/// Whether `path` (not followed) is an overlayfs whiteout: a 0/0 character device.
pub fn is_whiteout(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_char_device() && m.rdev() == 0)
}

/// Drops the kernel's dentry, inode and page caches.
pub fn drop_caches() {
    fs::write("/proc/sys/vm/drop_caches", "3").expect("drop_caches");
}

/// From the remote copy `prepare` gets to the local dir of the same mount.
pub fn local_beside(remote: &Path) -> PathBuf {
    remote.parent().expect("remote has a parent").join("local")
}

/// The `diff/` dir of a fixture layer in the tree at `root`, for `prepare` to seed.
pub fn diff_in(root: &Path, label: &str) -> PathBuf {
    root.join("overlay/RO").join(id(label)).join("diff")
}

/// Makes a special file (`kind` is `S_IFCHR`, `S_IFBLK` or `S_IFSOCK`) with mode `perm`.
pub fn mknod(path: &Path, kind: nix::sys::stat::SFlag, perm: u32, dev: nix::libc::dev_t) {
    nix::sys::stat::mknod(
        path,
        kind,
        nix::sys::stat::Mode::from_bits_truncate(perm),
        dev,
    )
    .unwrap_or_else(|e| panic!("mknod {}: {e}", path.display()));
}

/// Makes a FIFO with mode 0644.
pub fn mkfifo(path: &Path) {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o644))
        .unwrap_or_else(|e| panic!("mkfifo {}: {e}", path.display()));
}

/// Whether `path` itself, not what it points to, is a symlink.
pub fn is_symlink(path: &Path) -> bool {
    fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("lstat {}: {e}", path.display()))
        .file_type()
        .is_symlink()
}

// ---- Helpers for mounts over arbitrary trees (CLI and remote-safety tests) ----

/// A foreground layerfs mount of `remote` and `local` at `mnt`, started as a child with extra
/// `args` before the mountpoint. Unmounted (and the daemon reaped) on drop, even on panic.
pub struct RawMount {
    pub mnt: PathBuf,
    child: Option<Child>,
}

impl RawMount {
    pub fn start(remote: &Path, local: &Path, mnt: &Path, args: &[&str]) -> RawMount {
        RawMount::start_limited(remote, local, mnt, args, None)
    }

    /// Like [`RawMount::start`], with the daemon's open-file limit (soft and hard) at
    /// `nofile` when given.
    pub fn start_limited(
        remote: &Path,
        local: &Path,
        mnt: &Path,
        args: &[&str],
        nofile: Option<u64>,
    ) -> RawMount {
        let mut cmd = Command::new(BIN);
        if let Some(n) = nofile {
            limit_open_files(&mut cmd, n);
        }
        let child = cmd
            .arg("mount")
            .arg("--remote")
            .arg(remote)
            .arg("--local")
            .arg(local)
            .args(args)
            .arg("-f")
            .arg(mnt)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn layerfs");
        let mut m = RawMount {
            mnt: mnt.to_owned(),
            child: Some(child),
        };
        wait_for_mount(mnt, m.child.as_mut());
        m
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("daemon running").id()
    }

    /// Waits (bounded) for the daemon to exit by itself and returns its status.
    pub fn wait(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("daemon running");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return status,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("layerfs did not exit");
                }
            }
        }
    }

    /// Unmounts with umount(8) and returns the daemon's exit status.
    pub fn unmount(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(20);
        while is_mounted(&self.mnt) {
            let _ = Command::new("umount")
                .arg(&self.mnt)
                .stderr(Stdio::null())
                .status();
            if is_mounted(&self.mnt) {
                assert!(
                    Instant::now() < deadline,
                    "umount {} keeps failing",
                    self.mnt.display()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        self.wait()
    }
}

impl Drop for RawMount {
    fn drop(&mut self) {
        if is_mounted(&self.mnt) {
            let _ = Command::new("umount")
                .arg(&self.mnt)
                .stderr(Stdio::null())
                .status();
            if is_mounted(&self.mnt) {
                let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
            }
        }
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(20);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// ---- Helpers for refresh tests: a writer host changing the remote while it is mounted ----

impl Mount {
    /// Takes the remote as it is now as the reference the drop check compares with (a test
    /// that plays the writer host changes the remote on purpose).
    pub fn accept_remote_changes(&mut self) {
        self.remote_hash = tree_hash(&self.remote);
    }
}

/// Polls `check` until it returns true or `secs` pass; panics with `what` on timeout.
pub fn eventually(secs: u64, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Writes `bytes` to `path` the way iSulad does: a temporary file, then `rename(2)`.
pub fn write_atomic(path: &Path, bytes: &[u8]) {
    let tmp = path.with_file_name(format!(
        ".tmp-{}-0123456789",
        path.file_name().unwrap().to_string_lossy()
    ));
    fs::write(&tmp, bytes).unwrap();
    fs::rename(&tmp, path).unwrap();
}

/// A gzip stream of one tar-split line.
pub fn tar_split_gz() -> Vec<u8> {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(br#"{"type":1,"name":"hello","size":13,"payload":"kGuXHeJgaa0="}"#)
        .unwrap();
    gz.finish().unwrap()
}

/// Writes a base layer `id` (short id `short`) into a remote tree as a writer host does:
/// the overlay dir with one file `diff/hello` holding `content`, then the metadata dir.
/// `tar_split` is the tar-split file's content (complete or not).
pub fn write_base_layer(remote: &Path, id: &str, short: &str, content: &str, tar_split: &[u8]) {
    let overlay = remote.join("overlay/RO").join(id);
    fs::create_dir_all(overlay.join("diff")).unwrap();
    fs::write(overlay.join("diff/hello"), content).unwrap();
    write_atomic(&overlay.join("link"), short.as_bytes());
    fs::create_dir_all(overlay.join("work")).unwrap();
    fs::create_dir_all(overlay.join("empty")).unwrap();
    let meta = remote.join("overlay-layers/RO").join(id);
    fs::create_dir_all(&meta).unwrap();
    let json = format!(r#"{{"id":"{id}","diff-digest":"sha256:{id}","incompelte":false}}"#);
    write_atomic(&meta.join("layer.json"), json.as_bytes());
    fs::write(meta.join(format!("{id}.tar-split.gz")), tar_split).unwrap();
}

/// Writes image `id` on top layer `top` with repository names `names`, as iSulad does.
pub fn write_image(remote: &Path, id: &str, top: &str, names: &[&str]) {
    let dir = remote.join("overlay-images").join(id);
    fs::create_dir_all(&dir).unwrap();
    write_atomic(
        &dir.join("images.json"),
        image_json(id, top, names).as_bytes(),
    );
    let config = {
        use base64::Engine as _;
        let key = format!("sha256:{id}");
        format!("={}", base64::engine::general_purpose::STANDARD.encode(key))
    };
    write_atomic(&dir.join(config), br#"{"architecture":"amd64"}"#);
    write_atomic(&dir.join("manifest"), br#"{"schemaVersion":2}"#);
}

pub fn image_json(id: &str, top: &str, names: &[&str]) -> String {
    let names: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    format!(
        r#"{{"id":"{id}","names":[{}],"layer":"{top}","size":42}}"#,
        names.join(",")
    )
}

// ---- Helpers for the quota tests: crashes, remounts, the control socket, local usage ----

impl Mount {
    /// The pid of a foreground daemon (`None` for a daemonized mount).
    pub fn daemon_pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Kills a foreground daemon with SIGKILL, as a crash would, and detaches its dead mount
    /// (`fusermount3 -u -z`, falling back to `umount -l`). Afterwards the mount is down and
    /// [`Mount::mount`] can mount the same trees again. Only for foreground mounts.
    pub fn kill_daemon(&mut self) {
        let mut child = self
            .child
            .take()
            .expect("kill_daemon needs a foreground mount");
        assert_eq!(
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) },
            0,
            "kill -9 of the daemon"
        );
        let _ = child.wait();
        let deadline = Instant::now() + Duration::from_secs(20);
        while is_mounted(&self.mnt) {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg("-z")
                .arg(&self.mnt)
                .stderr(Stdio::null())
                .status();
            if is_mounted(&self.mnt) {
                let _ = Command::new("umount")
                    .arg("-l")
                    .arg(&self.mnt)
                    .stderr(Stdio::null())
                    .status();
            }
            assert!(
                Instant::now() < deadline,
                "the dead mount at {} does not go away",
                self.mnt.display()
            );
            if is_mounted(&self.mnt) {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        self.mounted = false;
    }
}

/// What a tree takes on disk, as `du` counts it: the sum of `st_blocks * 512` of every inode
/// under `root` (the root included, hard links once, symlinks not followed), and the number
/// of those inodes.
pub fn allocated_under(root: &Path) -> (u64, u64) {
    fn walk(dir: &Path, seen: &mut std::collections::HashSet<(u64, u64)>, bytes: &mut u64) {
        for e in fs::read_dir(dir).unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display())) {
            let path = e.unwrap().path();
            let Ok(meta) = fs::symlink_metadata(&path) else {
                continue; // gone meanwhile
            };
            if seen.insert((meta.dev(), meta.ino())) {
                *bytes += meta.blocks() * 512;
            }
            if meta.file_type().is_dir() {
                walk(&path, seen, bytes);
            }
        }
    }
    let meta =
        fs::symlink_metadata(root).unwrap_or_else(|e| panic!("lstat {}: {e}", root.display()));
    let mut seen = std::collections::HashSet::new();
    seen.insert((meta.dev(), meta.ino()));
    let mut bytes = meta.blocks() * 512;
    if meta.file_type().is_dir() {
        walk(root, &mut seen, &mut bytes);
    }
    (bytes, seen.len() as u64)
}

/// Deterministic, incompressible-looking bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// `layerfs quota SUB MOUNTPOINT REST...`.
pub fn quota_cmd(m: &Mount, sub: &str, rest: &[&str]) -> Output {
    Command::new(BIN)
        .arg("quota")
        .arg(sub)
        .arg(&m.mnt)
        .args(rest)
        .output()
        .expect("run layerfs quota")
}

/// Fails if copy-up left a temporary file anywhere under `root`.
pub fn assert_no_temp_names(root: &Path) {
    for e in fs::read_dir(root).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        assert!(
            !name.starts_with(".layerfs-tmp."),
            "{name} left in {}",
            root.display()
        );
        if e.file_type().unwrap().is_dir() {
            assert_no_temp_names(&e.path());
        }
    }
}

// ---- Helpers for tests of a remote that stops answering ----

/// Runs `op` on a thread of its own and panics if it does not answer within `secs`: a
/// request that must not wait on a frozen remote, or on anything else that stalls. A
/// thread left stuck is released when the stall ends.
pub fn live<T: Send + 'static>(
    secs: u64,
    what: &str,
    op: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(op());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within {secs} s"),
    }
}

/// Whether the process `pid` has exited (a zombie waiting to be reaped), read from /proc so
/// that its pipes stay readable by `wait_with_output`.
pub fn exited(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat
                .rsplit(')')
                .next()?
                .split_whitespace()
                .next()?
                .to_owned();
            Some(state == "Z")
        })
        .unwrap_or(true)
}

/// The processes descended from `pid` (not `pid` itself).
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    for e in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parents.push((p, ppid));
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(p) = frontier.pop() {
        for (child, _) in parents.iter().filter(|(_, pp)| *pp == p) {
            out.push(*child);
            frontier.push(*child);
        }
    }
    out
}

/// Detaches whatever is mounted at `mnt`. Not umount(8): given a path where nothing is
/// mounted any more, it takes it for a mount's source and would unmount a view whose remote
/// is that path.
pub fn detach(mnt: &Path) {
    let path = std::ffi::CString::new(mnt.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; failure (nothing mounted there) is fine.
    unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
}

/// `layerfs ARGS... MOUNTPOINT`, its output collected.
pub fn cli(args: &[&str], mnt: &Path) -> Output {
    Command::new(BIN)
        .args(args)
        .arg(mnt)
        .stdin(Stdio::null())
        .output()
        .expect("run layerfs")
}

/// Pids of live processes whose command line has `arg` as one of its arguments.
pub fn processes_with_arg(arg: &Path) -> Vec<u32> {
    let want = arg.as_os_str().as_encoded_bytes();
    let mut pids = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        // A zombie's (or a vanished process's) command line reads empty.
        let Ok(cmdline) = fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if cmdline.split(|b| *b == 0).any(|a| a == want) {
            pids.push(pid);
        }
    }
    pids
}

/// Says a test cannot check what it is for because the host lacks `capability`, and lets it
/// skip; unless `LAYERFS_TEST_REQUIRE` (a comma-separated list such as
/// `passthrough,io_uring`, or `all`) names it, which makes the absence a failure. CI sets
/// it, so a host without the capability cannot pass for one with it.
pub fn missing_capability(capability: &str, why: &str) {
    let required = std::env::var("LAYERFS_TEST_REQUIRE").unwrap_or_default();
    if required
        .split(',')
        .map(str::trim)
        .any(|c| c == capability || c == "all")
    {
        panic!("{why}, and LAYERFS_TEST_REQUIRE requires {capability}");
    }
    eprintln!("skipped: {why} (LAYERFS_TEST_REQUIRE={capability} makes this a failure)");
}

const URING_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Turns the kernel's offer of FUSE over io_uring on for as long as it lives. Mounts that do
/// not ask for the ring are not affected by it.
pub struct RingOffered {
    before: String,
}

impl RingOffered {
    /// `None` where the kernel has no such parameter (no FUSE over io_uring).
    pub fn turn_on() -> Option<RingOffered> {
        let before = fs::read_to_string(URING_PARAM).ok()?;
        fs::write(URING_PARAM, "Y").expect("enable_uring");
        Some(RingOffered { before })
    }
}

impl Drop for RingOffered {
    fn drop(&mut self) {
        let _ = fs::write(URING_PARAM, self.before.trim());
    }
}

/// A kernel overlayfs mount, unmounted on drop (before the view it stacks on).
pub struct Overlay {
    target: PathBuf,
}

impl Overlay {
    pub fn mount(
        lowers: &[PathBuf],
        upper: &Path,
        work: &Path,
        target: &Path,
    ) -> Result<Overlay, String> {
        let lowerdir = lowers
            .iter()
            .map(|p| p.to_str().expect("a UTF-8 path").to_owned())
            .collect::<Vec<_>>()
            .join(":");
        let out = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o"])
            .arg(format!(
                "lowerdir={lowerdir},upperdir={},workdir={}",
                upper.display(),
                work.display()
            ))
            .arg(target)
            .stdin(Stdio::null())
            .output()
            .expect("run mount");
        if out.status.success() && is_mounted(target) {
            Ok(Overlay {
                target: target.to_owned(),
            })
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        unmount_patiently(&self.target);
    }
}

/// Unmounts what is mounted at `target`, retrying while it is busy for up to 10 s, then
/// detaching it (`umount -l`).
pub fn unmount_patiently(target: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while is_mounted(target) {
        let _ = Command::new("umount")
            .arg(target)
            .stderr(Stdio::null())
            .status();
        if is_mounted(target) {
            if Instant::now() > deadline {
                let _ = Command::new("umount").arg("-l").arg(target).status();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Copies a small layer (directories 0755, `etc/conf.d/f` 0644 holding "readable") to
/// `into` with `cp -a`, as a runtime copies a layer in, stacks kernel overlayfs on the copy
/// (its own directories in `scratch`), and reads `etc/conf.d` and the file there as
/// `nobody`: whether that succeeded, and what it printed.
pub fn read_a_copied_layer_as_nobody(into: &Path, scratch: &Path) -> (bool, String) {
    let src = scratch.join("layer");
    fs::create_dir_all(src.join("etc/conf.d")).unwrap();
    fs::write(src.join("etc/conf.d/f"), "readable\n").unwrap();
    for dir in ["", "etc", "etc/conf.d"] {
        fs::set_permissions(src.join(dir), fs::Permissions::from_mode(0o755)).unwrap();
    }
    fs::set_permissions(src.join("etc/conf.d/f"), fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new("cp")
        .arg("-a")
        .arg(&src)
        .arg(into)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cp -a: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (upper, work, merged) = (
        scratch.join("upper"),
        scratch.join("work"),
        scratch.join("merged"),
    );
    for dir in [&upper, &work, &merged] {
        fs::create_dir(dir).unwrap();
    }
    fs::set_permissions(scratch, fs::Permissions::from_mode(0o755)).unwrap();
    let _ov = Overlay::mount(&[into.to_owned()], &upper, &work, &merged).unwrap();
    sh_as_nobody(&format!(
        "ls '{0}/etc/conf.d' && cat '{0}/etc/conf.d/f'",
        merged.display()
    ))
}

/// Runs `cmd` with an open-file limit of `n`, soft and hard (so it cannot raise it).
pub fn limit_open_files(cmd: &mut Command, n: u64) {
    use std::os::unix::process::CommandExt;
    let limit = libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    };
    // SAFETY: setrlimit is async-signal-safe and `limit` is a plain value.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// Runs `cmd`, which must succeed; its standard output.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A filesystem of the test's own mounted on a mount's local dir before the daemon starts
/// (from `prepare`), so that no other process allocates there; unmounted (after the view)
/// on drop, even when the test fails. The mount's temp dir, whose removal the filesystem
/// got in the way of, is removed then.
#[derive(Default)]
pub struct LocalFs {
    local: Option<PathBuf>,
}

impl LocalFs {
    /// A tmpfs with `options`.
    pub fn tmpfs(&mut self, local: &Path, options: &str) {
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(local));
        self.mounted(local);
    }

    /// A fresh ext4 of `mib` MiB in an image file beside `local`, loop-mounted.
    pub fn ext4(&mut self, local: &Path, mib: u64) {
        self.ext4_with(local, mib, &[]);
    }

    /// Like [`LocalFs::ext4`], with extra `mkfs.ext4` arguments.
    pub fn ext4_with(&mut self, local: &Path, mib: u64, mkfs: &[&str]) {
        let image = local.with_file_name("local.ext4");
        let f = fs::File::create(&image).unwrap();
        f.set_len(mib << 20).unwrap();
        drop(f);
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .args(mkfs)
            .arg(&image));
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(local));
        self.mounted(local);
    }

    fn mounted(&mut self, local: &Path) {
        self.local = Some(local.to_owned());
        fs::set_permissions(local, fs::Permissions::from_mode(0o755)).unwrap();
    }
}

impl Drop for LocalFs {
    fn drop(&mut self) {
        let Some(local) = self.local.take() else {
            return;
        };
        unmount_patiently(&local);
        if let Some(dir) = local.parent() {
            let _ = fs::remove_dir_all(dir);
        }
    }
}
