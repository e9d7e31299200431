//! A remote on a real network filesystem: sshfs over loopback to an sshd the test starts
//! (Debian packages `openssh-server` and `sshfs`). The server side is frozen, then killed;
//! the view stays live, reports the remote unhealthy, keeps the last good view, and
//! recovers when a new sshfs mount appears on the same path.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// How long a request that needs no remote data may take while the remote is frozen.
const LIVE: u64 = 5;

struct Sshd {
    child: Child,
    port: u16,
    key: PathBuf,
}

impl Sshd {
    fn start(dir: &Path) -> Sshd {
        // The privilege separation directory sshd insists on.
        fs::create_dir_all("/run/sshd").unwrap();
        let keygen = |name: &str| {
            let status = Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                .arg(dir.join(name))
                .status()
                .expect("ssh-keygen (Debian package openssh-client) runs");
            assert!(status.success());
        };
        keygen("hostkey");
        keygen("userkey");
        fs::copy(dir.join("userkey.pub"), dir.join("authorized_keys")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = format!(
            "ListenAddress 127.0.0.1\nPort {port}\nHostKey {d}/hostkey\n\
             AuthorizedKeysFile {d}/authorized_keys\nPidFile {d}/sshd.pid\nStrictModes no\n\
             UsePAM no\nPermitRootLogin yes\nPasswordAuthentication no\n\
             Subsystem sftp internal-sftp\n",
            d = dir.display()
        );
        fs::write(dir.join("sshd_config"), config).unwrap();
        let child = Command::new("/usr/sbin/sshd")
            .args(["-D", "-e", "-f"])
            .arg(dir.join("sshd_config"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("sshd (Debian package openssh-server) runs");
        eventually(10, "sshd listens", || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        Sshd {
            child,
            port,
            key: dir.join("userkey"),
        }
    }

    /// The processes serving connections (not the listener).
    fn sessions(&self) -> Vec<u32> {
        descendants(self.child.id())
    }

    fn signal_sessions(&self, sig: libc::c_int) {
        let sessions = self.sessions();
        assert!(!sessions.is_empty(), "an sshfs connection is being served");
        for pid in sessions {
            // SAFETY: a plain signal to a process this test started.
            unsafe { libc::kill(pid as libc::pid_t, sig) };
        }
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        for pid in self.sessions() {
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Mounts `real` over sshfs at `mnt`, read-only.
fn sshfs(sshd: &Sshd, real: &Path, mnt: &Path) -> Child {
    fs::create_dir_all(mnt).unwrap();
    let child = Command::new("sshfs")
        .arg("-f")
        .arg("-p")
        .arg(sshd.port.to_string())
        .arg("-o")
        .arg(format!(
            "IdentityFile={},StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,ro,\
             allow_other,cache=no,ServerAliveInterval=1,ServerAliveCountMax=3",
            sshd.key.display()
        ))
        .arg(format!("root@127.0.0.1:{}", real.display()))
        .arg(mnt)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("sshfs (Debian package sshfs) runs");
    eventually(20, "the sshfs mount", || is_mounted(mnt));
    child
}

fn cli(args: &[&str], mnt: &Path) -> (bool, Value) {
    let out = Command::new(BIN)
        .args(args)
        .arg("--json")
        .arg(mnt)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let answer = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&out.stderr).into_owned()));
    (out.status.success(), answer)
}

fn healthy(mnt: &Path) -> bool {
    let (ok, status) = cli(&["status"], mnt);
    assert!(ok, "status answers: {status}");
    status["remote_health"]["healthy"] == true
}

#[test]
fn a_remote_on_sshfs_that_freezes_then_dies_then_comes_back() {
    let dir = tempfile::Builder::new()
        .prefix("layerfs-sshfs")
        .tempdir()
        .unwrap();
    let real = dir.path().join("real");
    let carrier = dir.path().join("carrier");
    let local = dir.path().join("local");
    let mnt = dir.path().join("mnt");
    copy_tree(&repo().join("fixtures/remote"), &real);
    fs::create_dir(&local).unwrap();
    fs::create_dir(&mnt).unwrap();
    let sshd = Sshd::start(dir.path());
    let mut link = sshfs(&sshd, &real, &carrier);
    let view = RawMount::start(
        &carrier,
        &local,
        &mnt,
        &["-o", "allow_other,refresh=0,scan_timeout=2"],
    );
    // Dropped before the view: whatever happened, the server answers again, so the view
    // can unmount; the carrier mounts go after the view.
    let _cleanup = Cleanup {
        server: sshd.child.id(),
        carrier: carrier.clone(),
    };

    let diff = mnt.join("overlay/RO").join(id("L1")).join("diff");
    let remote_file = diff.join("etc/os-release");
    let content = fs::read(&remote_file).unwrap();
    let other = diff.join("usr/share/doc/readme.txt");
    let other_content = fs::read(real.join(other.strip_prefix(&mnt).unwrap())).unwrap();
    fs::write(mnt.join("local.txt"), b"local\n").unwrap();
    let ids = names(&mnt.join("overlay/RO"));
    assert!(healthy(&mnt));

    // Frozen: the server stops answering.
    drop_caches();
    sshd.signal_sessions(libc::SIGSTOP);
    let reader = Command::new("cat")
        .arg(&other)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let m = mnt.clone();
    assert_eq!(
        live(LIVE, "read a local file", move || fs::read(
            m.join("local.txt")
        )
        .unwrap()),
        b"local\n"
    );
    let m = mnt.clone();
    assert_eq!(
        live(LIVE, "list overlay/RO", move || names(
            &m.join("overlay/RO")
        )),
        ids
    );
    let m = mnt.clone();
    live(LIVE, "create in the root", move || {
        fs::write(m.join("during-freeze"), b"x").unwrap()
    });
    let m = mnt.clone();
    let (ok, round) = live(LIVE + 5, "a refresh round", move || cli(&["refresh"], &m));
    assert!(!ok, "a round over the frozen remote fails: {round}");
    assert!(!healthy(&mnt));

    // Killed: the connection is gone for good; the dead sshfs mount answers with errors.
    sshd.signal_sessions(libc::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !exited(reader.id()) {
        assert!(Instant::now() < deadline, "the stuck reader never returned");
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = reader.wait_with_output();
    let m = mnt.clone();
    let (ok, _) = live(LIVE + 5, "a refresh round", move || cli(&["refresh"], &m));
    assert!(!ok);
    let m = mnt.clone();
    assert_eq!(
        live(
            LIVE,
            "list overlay/RO after the remote died",
            move || names(&m.join("overlay/RO"))
        ),
        ids,
        "the last good view stays"
    );
    assert!(!healthy(&mnt));
    let _ = link.kill();
    let _ = link.wait();
    detach(&carrier);

    // A new sshfs mount on the same path: the next round takes it, and remote files read
    // again, from the new mount.
    let mut link = sshfs(&sshd, &real, &carrier);
    let (ok, round) = cli(&["refresh"], &mnt);
    assert!(ok, "{round}");
    assert!(healthy(&mnt));
    assert_eq!(fs::read(&remote_file).unwrap(), content);
    assert_eq!(fs::read(&other).unwrap(), other_content);
    assert_eq!(names(&mnt.join("overlay/RO")), ids);
    drop(view);
    detach(&carrier);
    let _ = link.kill();
    let _ = link.wait();
}

/// Thaws the server and detaches the carrier at the end, whatever happened.
struct Cleanup {
    server: u32,
    carrier: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for pid in descendants(self.server) {
            // SAFETY: a plain signal to a process this test started.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
        }
        detach(&self.carrier);
    }
}
