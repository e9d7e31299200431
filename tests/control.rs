//! The control socket and its commands (`layerfs status|refresh|layers|images`), against a
//! server answering for a fake engine; the last tests ask a real mount.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use common::*;
use layerfs::control::{self, ControlServer, MountControl};
use layerfs::report::{
    ImageInfo, Kind, LayerInfo, NotReadyRef, ObjectRef, RemoteHealth, RoundReport, Status,
};
use serde_json::Value;

/// An engine with fixed answers; `refresh` reports round `n` (from 1).
struct Fake {
    rounds: AtomicUsize,
    failing: bool,
}

fn fake() -> Arc<Fake> {
    Arc::new(Fake {
        rounds: AtomicUsize::new(0),
        failing: false,
    })
}

fn report(n: usize, failing: bool) -> RoundReport {
    RoundReport {
        started: SystemTime::now(),
        duration: Duration::from_micros(1500),
        added: if n > 0 {
            vec![ObjectRef {
                kind: Kind::Image,
                id: format!("image{n}"),
            }]
        } else {
            vec![]
        },
        removed: vec![ObjectRef {
            kind: Kind::Layer,
            id: "gone".into(),
        }],
        changed: vec![],
        ready_layers: 2,
        ready_images: 1,
        not_ready: vec![
            NotReadyRef {
                kind: Kind::Layer,
                name: "half".into(),
                reason: "no diff/ dir".into(),
            },
            NotReadyRef {
                kind: Kind::Image,
                name: "orphan".into(),
                reason: "top layer half is not ready".into(),
            },
        ],
        error: failing.then(|| "scan timed out".to_owned()),
    }
}

impl MountControl for Fake {
    fn status(&self) -> Status {
        Status {
            mountpoint: "/fake/mnt".into(),
            remote: "/fake/remote".into(),
            local: "/fake/local".into(),
            driver: "overlay".into(),
            socket: "/fake/socket".into(),
            refresh_interval_secs: 5.0,
            rounds: self.rounds.load(Ordering::SeqCst) as u64,
            remote_health: RemoteHealth {
                healthy: !self.failing,
                since: SystemTime::now() - Duration::from_secs(90),
                last_error: self.failing.then(|| "Stale file handle".to_owned()),
            },
            last_round: Some(report(0, self.failing)),
            quotas: Vec::new(),
            metrics: None,
            transport: None,
            log: None,
            daemon_pid: std::process::id(),
            keeper: None,
            journal: None,
        }
    }
    fn refresh(&self) -> RoundReport {
        let n = self.rounds.fetch_add(1, Ordering::SeqCst) + 1;
        report(n, self.failing)
    }
    fn layers(&self) -> Vec<LayerInfo> {
        vec![
            LayerInfo {
                id: "base".into(),
                short: "SHORTBASE".into(),
                parent: None,
            },
            LayerInfo {
                id: "top".into(),
                short: "SHORTTOP".into(),
                parent: Some("base".into()),
            },
        ]
    }
    fn images(&self) -> Vec<ImageInfo> {
        vec![ImageInfo {
            id: "img".into(),
            top_layer: "top".into(),
            names: vec!["busybox:latest".into()],
        }]
    }
}

/// A run dir, a "mountpoint" dir, and a server for `handle` on the mountpoint's socket.
struct Setup {
    tmp: tempfile::TempDir,
    run: PathBuf,
    mnt: PathBuf,
    server: Option<ControlServer>,
}

impl Setup {
    fn new(handle: Arc<dyn MountControl>) -> Setup {
        let tmp = tempfile::Builder::new()
            .prefix("layerfs-control")
            .tempdir()
            .unwrap();
        let base = std::fs::canonicalize(tmp.path()).unwrap();
        let run = base.join("run");
        let mnt = base.join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let server = control::serve(handle, &control::socket_path_in(&run, &mnt)).unwrap();
        Setup {
            tmp,
            run,
            mnt,
            server: Some(server),
        }
    }

    fn socket(&self) -> PathBuf {
        control::socket_path_in(&self.run, &self.mnt)
    }

    /// Runs `layerfs ARGS` with this run dir.
    fn cli(&self, args: &[&str], mnt: &Path) -> Output {
        cli(&self.run, args, mnt)
    }
}

fn cli(run: &Path, args: &[&str], mnt: &Path) -> Output {
    Command::new(BIN)
        .args(args)
        .arg(mnt)
        .env(control::RUN_DIR_ENV, run)
        .output()
        .expect("run layerfs")
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "layerfs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8(out.stderr.clone()).unwrap()
}

fn json(out: &Output) -> Value {
    serde_json::from_str(&stdout(out)).expect("--json prints JSON")
}

/// Sends raw bytes on a fresh connection and reads one answer line.
fn raw(stream: &mut UnixStream, bytes: &[u8]) -> Value {
    stream.write_all(bytes).unwrap();
    read_answer(stream)
}

fn read_answer(stream: &UnixStream) -> Value {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("answer {line:?}: {e}"))
}

#[test]
fn status_explains_every_object_that_is_not_ready() {
    let s = Setup::new(fake());
    let text = stdout(&s.cli(&["status"], &s.mnt));
    for want in [
        "mountpoint  /fake/mnt\n",
        "remote      /fake/remote: healthy since ",
        "(90s ago)",
        "socket      /fake/socket\n",
        "ready       2 layers, 1 image\n",
        "not ready   1 layer, 1 image:\n",
        "  layer half: no diff/ dir\n",
        "  image orphan: top layer half is not ready\n",
    ] {
        assert!(text.contains(want), "no {want:?} in:\n{text}");
    }
    let v = json(&s.cli(&["status", "--json"], &s.mnt));
    assert_eq!(v["mountpoint"], "/fake/mnt");
    assert_eq!(v["remote_health"]["healthy"], true);
    let not_ready = v["last_round"]["not_ready"].as_array().unwrap();
    assert_eq!(not_ready.len(), 2);
    assert_eq!(not_ready[0]["kind"], "layer");
    assert_eq!(not_ready[0]["reason"], "no diff/ dir");
    assert_eq!(not_ready[1]["name"], "orphan");
}

#[test]
fn layers_and_images_list_ready_objects() {
    let s = Setup::new(fake());
    assert_eq!(
        stdout(&s.cli(&["layers"], &s.mnt)),
        "ID    SHORT      PARENT\nbase  SHORTBASE  -\ntop   SHORTTOP   base\n"
    );
    assert_eq!(
        stdout(&s.cli(&["images"], &s.mnt)),
        "ID   TOP LAYER  NAMES\nimg  top        busybox:latest\n"
    );
    let v = json(&s.cli(&["layers", "--json"], &s.mnt));
    assert_eq!(v[1]["parent"], "base");
    assert_eq!(v[0]["parent"], Value::Null);
    let v = json(&s.cli(&["images", "--json"], &s.mnt));
    assert_eq!(v[0]["names"][0], "busybox:latest");
}

#[test]
fn refresh_runs_a_round_and_prints_what_changed() {
    let s = Setup::new(fake());
    let text = stdout(&s.cli(&["refresh"], &s.mnt));
    assert!(
        text.starts_with("round took 1.5 ms: 1 added, 1 removed, 0 changed\n"),
        "{text}"
    );
    assert!(
        text.contains("  + image image1\n  - layer gone\n"),
        "{text}"
    );
    assert!(text.contains("not ready: 2"), "{text}");
    let v = json(&s.cli(&["refresh", "--json"], &s.mnt));
    assert_eq!(v["added"][0]["id"], "image2");
    assert_eq!(v["duration"], 1.5);
    assert_eq!(json(&s.cli(&["status", "--json"], &s.mnt))["rounds"], 2);
}

#[test]
fn a_failed_round_is_printed_and_fails_the_command() {
    let s = Setup::new(Arc::new(Fake {
        rounds: AtomicUsize::new(0),
        failing: true,
    }));
    let out = s.cli(&["refresh"], &s.mnt);
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("remote scan failed: scan timed out"),
        "{text}"
    );
    assert_eq!(
        stderr(&out),
        "layerfs: the refresh round could not scan the remote: scan timed out\n"
    );
    let text = stdout(&s.cli(&["status"], &s.mnt));
    assert!(
        text.contains("NOT ANSWERING since") && text.contains("Stale file handle"),
        "{text}"
    );
}

#[test]
fn the_mountpoint_may_be_given_any_way_that_names_it() {
    let s = Setup::new(fake());
    let base = s.mnt.parent().unwrap();
    std::os::unix::fs::symlink(&s.mnt, base.join("link")).unwrap();
    for given in [base.join("link"), s.mnt.join("."), base.join("mnt/")] {
        stdout(&s.cli(&["status"], &given));
    }
    let out = Command::new(BIN)
        .args(["layers", "mnt"])
        .current_dir(base)
        .env(control::RUN_DIR_ENV, &s.run)
        .output()
        .unwrap();
    assert!(stdout(&out).contains("SHORTBASE"));
}

#[test]
fn no_mount_is_one_clear_line() {
    let s = Setup::new(fake());
    let other = s.tmp.path().join("elsewhere");
    std::fs::create_dir(&other).unwrap();
    let other = std::fs::canonicalize(other).unwrap();
    for cmd in ["status", "refresh", "layers", "images"] {
        let out = s.cli(&[cmd], &other);
        assert!(!out.status.success());
        assert_eq!(
            stderr(&out),
            format!(
                "layerfs: no layerfs mount at {} (no control socket at {})\n",
                other.display(),
                control::socket_path_in(&s.run, &other).display()
            )
        );
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn a_stale_socket_is_reported_and_replaced() {
    let s = Setup::new(fake());
    let other = s.mnt.parent().unwrap().join("dead");
    std::fs::create_dir(&other).unwrap();
    let socket = control::socket_path_in(&s.run, &other);
    // What a killed daemon leaves behind: a socket file nobody listens on.
    drop(UnixListener::bind(&socket).unwrap());
    let out = s.cli(&["status"], &other);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.starts_with(&format!("layerfs: no layerfs mount at {}", other.display()))
            && err.contains("nothing listens")
            && err.lines().count() == 1,
        "{err}"
    );
    let server = control::serve(fake(), &socket).expect("a stale socket is replaced");
    stdout(&s.cli(&["status"], &other));
    drop(server);
    assert!(!socket.exists(), "the socket is removed on shutdown");
}

#[test]
fn a_live_socket_is_never_taken_over() {
    let s = Setup::new(fake());
    let e = control::serve(fake(), &s.socket()).err().expect("refused");
    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
    stdout(&s.cli(&["status"], &s.mnt));
    // Something that is not a socket is left alone too.
    let file = s.run.join("mounts/file.sock");
    std::fs::write(&file, "x").unwrap();
    assert!(control::serve(fake(), &file).is_err());
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}

#[test]
fn the_socket_is_root_only() {
    let mut s = Setup::new(fake());
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&s.socket()), 0o600);
    assert_eq!(mode(&s.run), 0o700);
    assert_eq!(mode(&s.run.join("mounts")), 0o700);
    assert_eq!(s.server.as_ref().unwrap().path(), s.socket());
    let (ok, out) = sh_as_nobody(&format!(
        "LAYERFS_RUN_DIR={} {BIN} status {}",
        s.run.display(),
        s.mnt.display()
    ));
    assert!(!ok, "nobody may ask: {out}");
    // The dir already keeps nobody out; the server says the same where modes let nobody in.
    let denied = format!("{}: permission denied (root only)", s.mnt.display());
    assert!(out.contains(&denied), "{out}");
    // With the file modes opened up, the server still refuses by the peer's uid.
    let open = |p: &Path, m: u32| std::fs::set_permissions(p, PermissionsExt::from_mode(m));
    for dir in [s.tmp.path(), &s.run, &s.run.join("mounts")] {
        open(dir, 0o755).unwrap();
    }
    open(&s.socket(), 0o666).unwrap();
    let (ok, out) = sh_as_nobody(&format!(
        "LAYERFS_RUN_DIR={} {BIN} status {}",
        s.run.display(),
        s.mnt.display()
    ));
    assert!(!ok);
    assert!(out.contains(&denied), "{out}");
    s.server = None;
    assert!(!s.socket().exists());
}

#[test]
fn malformed_requests_get_errors_and_the_server_keeps_serving() {
    let s = Setup::new(fake());
    let mut c = UnixStream::connect(s.socket()).unwrap();
    for bad in [
        &b"not json\n"[..],
        b"{\"op\":\"format-disk\"}\n",
        b"{}\n",
        b"\xff\xfe\n",
    ] {
        let v = raw(&mut c, bad);
        assert_eq!(v["ok"], false, "{v}");
        assert!(
            v["error"].as_str().unwrap().starts_with("bad request"),
            "{v}"
        );
    }
    // The same connection still answers, blank lines are skipped, and so does a new one.
    let v = raw(&mut c, b"\n{\"op\":\"layers\"}\n");
    assert_eq!(v["ok"], true);
    assert_eq!(v["layers"][0]["id"], "base");
    let v = raw(
        &mut UnixStream::connect(s.socket()).unwrap(),
        b"{\"op\":\"images\"}\n",
    );
    assert_eq!(v["images"][0]["id"], "img");
    // A last request without a newline is answered too.
    let mut c = UnixStream::connect(s.socket()).unwrap();
    c.write_all(b"{\"op\":\"status\"}").unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(read_answer(&c)["status"]["driver"], "overlay");
}

#[test]
fn an_oversized_request_is_refused() {
    let s = Setup::new(fake());
    let mut c = UnixStream::connect(s.socket()).unwrap();
    let huge = vec![b' '; 1024 * 1024];
    // The server may close before reading it all.
    let _ = c.write_all(&huge);
    let v = read_answer(&c);
    assert_eq!(v["ok"], false);
    assert!(v["error"].as_str().unwrap().contains("longer than"), "{v}");
    let mut rest = Vec::new();
    let _ = c.read_to_end(&mut rest);
    assert!(rest.is_empty(), "the connection is closed after it");
    stdout(&s.cli(&["status"], &s.mnt));
}

#[test]
fn a_silent_client_blocks_no_one() {
    let s = Setup::new(fake());
    let silent: Vec<UnixStream> = (0..4)
        .map(|_| UnixStream::connect(s.socket()).unwrap())
        .collect();
    let mut half = UnixStream::connect(s.socket()).unwrap();
    half.write_all(b"{\"op\":").unwrap();
    let start = Instant::now();
    for cmd in ["status", "layers", "images", "refresh"] {
        stdout(&s.cli(&[cmd], &s.mnt));
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "answers waited {:?}",
        start.elapsed()
    );
    drop(silent);
}

#[test]
fn shutdown_removes_the_socket_while_clients_are_connected() {
    let mut s = Setup::new(fake());
    let idle = UnixStream::connect(s.socket()).unwrap();
    let start = Instant::now();
    s.server = None;
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(!s.socket().exists());
    drop(idle);
    let out = s.cli(&["status"], &s.mnt);
    assert!(
        stderr(&out).contains("no control socket at"),
        "{}",
        stderr(&out)
    );
}

// ---- On a real mount ----------------------------------------------------------------------
// The daemon and the commands find the socket through the same environment, so these run
// with whatever run dir the test process has.

/// The mount's socket, once it is there: a foreground mount shows up in the mount table a
/// moment before its control server starts.
fn socket_of(m: &Mount) -> PathBuf {
    let socket = control::socket_path(&std::fs::canonicalize(&m.mnt).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline,
            "no control socket at {}",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    socket
}

/// A fixture mount whose control socket is up.
fn mount_with(prepare: impl FnOnce(&Path)) -> Mount {
    let m = Mount::with(Options::default(), prepare);
    socket_of(&m);
    m
}

fn ask(args: &[&str], mnt: &Path) -> Output {
    Command::new(BIN)
        .args(args)
        .arg(mnt)
        .output()
        .expect("run layerfs")
}

fn strings(v: &Value) -> Vec<String> {
    let mut out: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    out.sort();
    out
}

#[test]
fn status_of_a_mount_explains_the_fixture_s_not_ready_objects() {
    let m = mount_with(|_| {});
    let exp = expected();
    let v = json(&ask(&["status", "--json"], &m.mnt));
    let mnt = std::fs::canonicalize(&m.mnt).unwrap();
    assert_eq!(v["mountpoint"], mnt.to_str().unwrap());
    assert_eq!(
        v["socket"],
        control::socket_path(&mnt).to_str().unwrap(),
        "status names its socket"
    );
    assert_eq!(v["remote_health"]["healthy"], true);
    let round = &v["last_round"];
    assert_eq!(round["ready_layers"], 4);
    assert_eq!(round["ready_images"], 2);
    let not_ready = round["not_ready"].as_array().unwrap();
    let find = |kind: &str, id: &str| {
        not_ready
            .iter()
            .find(|n| n["kind"] == kind && n["name"].as_str().unwrap().contains(id))
            .unwrap_or_else(|| panic!("no not-ready {kind} {id} in {v}"))
    };
    let layer = find("layer", &id("L5"));
    let image = find("image", &id("imageC"));
    for n in [layer, image] {
        assert!(!n["reason"].as_str().unwrap().is_empty(), "{n}");
    }
    assert!(
        layer["reason"].as_str().unwrap().contains("incomplete"),
        "{layer}"
    );
    assert!(
        image["reason"].as_str().unwrap().contains(&id("MISSING")),
        "{image}"
    );
    assert_eq!(
        strings(&exp["not_ready_layers"]).len() + strings(&exp["not_ready_images"]).len(),
        not_ready
            .iter()
            .filter(|n| n["kind"] == "layer" || n["kind"] == "image")
            .filter(|n| n["name"].as_str().unwrap().len() == 64)
            .count(),
        "{v}"
    );

    let text = stdout(&ask(&["status"], &m.mnt));
    for n in not_ready {
        let line = format!(
            "  {} {}: {}",
            n["kind"].as_str().unwrap(),
            n["name"].as_str().unwrap(),
            n["reason"].as_str().unwrap()
        );
        assert!(text.contains(&line), "no {line:?} in:\n{text}");
    }
    assert!(text.contains("ready       4 layers, 2 images\n"), "{text}");
}

#[test]
fn layers_and_images_of_a_mount() {
    let m = mount_with(|_| {});
    let exp = expected();
    let text = stdout(&ask(&["layers"], &m.mnt));
    let rows: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(rows.len(), 4, "{text}");
    for layer in strings(&exp["ready_layers"]) {
        let short = exp["layer_shorts"][&layer].as_str().unwrap();
        assert!(
            rows.iter()
                .any(|r| r.starts_with(&layer) && r.contains(short)),
            "no {layer} in:\n{text}"
        );
    }
    let v = json(&ask(&["layers", "--json"], &m.mnt));
    let ids: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, strings(&exp["ready_layers"]));
    let v = json(&ask(&["images", "--json"], &m.mnt));
    let ids: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, strings(&exp["ready_images"]));
    let text = stdout(&ask(&["images"], &m.mnt));
    assert!(
        text.contains("registry.example.com/layerfs/app:2.0"),
        "{text}"
    );
}

#[test]
fn refresh_on_a_mount_reports_an_added_image() {
    let image = id("imageB");
    let stash = |remote: &Path| remote.parent().unwrap().join("stash");
    let m = mount_with(|remote| {
        std::fs::rename(remote.join("overlay-images").join(&image), stash(remote)).unwrap();
    });
    let images = m.remote.join("overlay-images").join(&image);
    std::fs::rename(stash(&m.remote), &images).unwrap();
    let text = stdout(&ask(&["refresh"], &m.mnt));
    assert!(text.contains(&format!("  + image {image}\n")), "{text}");
    assert!(text.contains(": 1 added, 0 removed, 0 changed\n"), "{text}");
    let v = json(&ask(&["status", "--json"], &m.mnt));
    assert_eq!(v["last_round"]["ready_images"], 2, "{v}");
    assert!(m.path("overlay-images").join(&image).exists());

    // Back as it was, which the mount's drop check compares with.
    std::fs::rename(&images, stash(&m.remote)).unwrap();
    let v = json(&ask(&["refresh", "--json"], &m.mnt));
    assert_eq!(v["removed"][0]["id"], image.as_str(), "{v}");
    assert_eq!(v["removed"][0]["kind"], "image");
}

#[test]
fn a_mount_removes_its_socket_when_unmounted() {
    let mut m = mount_with(|_| {});
    let socket = socket_of(&m);
    m.unmount();
    assert!(!socket.exists(), "{} is left behind", socket.display());
    let out = ask(&["status"], &m.mnt);
    assert!(!out.status.success());
    assert!(
        stderr(&out).starts_with("layerfs: no layerfs mount at "),
        "{}",
        stderr(&out)
    );
}

#[test]
fn umount_waits_for_the_daemon_and_refuses_a_busy_mount() {
    let mut m = mount_with(|_| {});
    let socket = socket_of(&m);
    let held = std::fs::File::open(m.diff("L1").join("etc/hostname")).unwrap();
    let out = ask(&["umount"], &m.mnt);
    assert!(!out.status.success(), "a busy mount must not be unmounted");
    assert!(stderr(&out).contains("busy"), "{}", stderr(&out));
    assert!(is_mounted(&m.mnt));
    drop(held);
    let out = ask(&["umount"], &m.mnt);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!is_mounted(&m.mnt));
    assert!(
        !socket.exists(),
        "the daemon finished before the command returned"
    );
    // The daemon exits with success: the harness checks it.
    m.unmount();
    let out = ask(&["umount"], &m.mnt);
    assert!(
        stderr(&out).contains("no layerfs mount"),
        "{}",
        stderr(&out)
    );
}
