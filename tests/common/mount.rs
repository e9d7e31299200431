//! Real mounts for tests: each [`Mount`] copies the shipped fixture remote tree into a temp
//! dir, mounts layerfs over it with an empty local dir, and unmounts on drop, even when the
//! test panics. Dropping also checks that the remote tree is byte-for-byte what it was, unless
//! the test plays the writer host and says it changed the remote on purpose. A [`RawMount`]
//! mounts trees the test made itself.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{copy_tree, diff_in, limit_open_files, repo, tree_hash, BIN};

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

    /// Takes the remote as it is now as the reference the drop check compares with (a test
    /// that plays the writer host changes the remote on purpose).
    pub fn accept_remote_changes(&mut self) {
        self.remote_hash = tree_hash(&self.remote);
    }

    /// The pid of a foreground daemon (`None` for a daemonized mount).
    pub fn daemon_pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Waits (up to 10 s) until the foreground daemon holds `file` (a path in the remote or
    /// local tree) open no more, but for its node's `O_PATH` handle. `close(2)` returns
    /// before the kernel sends RELEASE, and an open made before that arrives shares the way
    /// the open being closed does its I/O (FUSE passthrough binds every open of an inode to
    /// one backing file): a reader after a writer would not get passthrough, nor a writer
    /// after a reader of a remote file open without copying it up.
    pub fn released(&self, file: &Path) {
        let want = fs::metadata(file).unwrap();
        let pid = self.daemon_pid().expect("a foreground mount");
        let daemon = PathBuf::from(format!("/proc/{pid}"));
        let opens = || {
            fs::read_dir(daemon.join("fd"))
                .unwrap()
                .flatten()
                .filter(|fd| {
                    fs::metadata(fd.path())
                        .is_ok_and(|st| st.dev() == want.dev() && st.ino() == want.ino())
                })
                .filter(|fd| {
                    let info = daemon.join("fdinfo").join(fd.file_name());
                    let flags = fs::read_to_string(info).unwrap_or_default();
                    let flags = flags.lines().find_map(|l| l.strip_prefix("flags:"));
                    flags
                        .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
                        .is_some_and(|f| f & libc::O_PATH as u32 == 0)
                })
                .count()
        };
        let what = format!("the daemon to close {}", file.display());
        super::eventually(10, &what, || opens() == 0);
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

impl Drop for Mount {
    fn drop(&mut self) {
        self.unmount();
        // A test that failed half-way may leave mounts of its own in the temp dir (binds of
        // an exposed view, dead once the daemon is gone): detach them before it is removed.
        detach_below(self.dir.path(), &[]);
        if !std::thread::panicking() {
            assert_eq!(
                tree_hash(&self.remote),
                self.remote_hash,
                "the remote tree was modified"
            );
        }
    }
}

/// Mountpoints at or below `dir`, in mount order; a point with mounts stacked on it comes
/// once for each.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    layerfs::store::mountinfo::current()
        .into_iter()
        .map(|m| m.point)
        .filter(|p| p.starts_with(dir))
        .collect()
}

/// How many mounts stand at `point` (stacked ones each count).
pub fn mounts_at(point: &Path) -> usize {
    mounts_under(point).iter().filter(|p| *p == point).count()
}

/// Lazily detaches every mount at or below `dir` but those in `keep`, the deepest first.
pub fn detach_below(dir: &Path, keep: &[PathBuf]) {
    let mut points = mounts_under(dir);
    points.retain(|p| !keep.contains(p));
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for point in points {
        detach(&point);
    }
}

pub fn is_mounted(path: &Path) -> bool {
    mounts_at(path) > 0
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

// ---- Mounts over arbitrary trees (CLI and remote-safety tests) ----

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
        RawMount::start_with(remote, local, mnt, args, |cmd| {
            if let Some(n) = nofile {
                limit_open_files(cmd, n);
            }
        })
    }

    /// Like [`RawMount::start`], with the daemon's command prepared by `prepare` first.
    pub fn start_with(
        remote: &Path,
        local: &Path,
        mnt: &Path,
        args: &[&str],
        prepare: impl FnOnce(&mut Command),
    ) -> RawMount {
        let mut cmd = Command::new(BIN);
        prepare(&mut cmd);
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

/// Detaches whatever is mounted at `mnt`. Not umount(8): given a path where nothing is
/// mounted any more, it takes it for a mount's source and would unmount a view whose remote
/// is that path.
pub fn detach(mnt: &Path) {
    let path = std::ffi::CString::new(mnt.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; failure (nothing mounted there) is fine.
    unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
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
