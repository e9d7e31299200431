//! The refresh engine without a kernel: rounds over a view of temporary trees, a recording
//! stand-in for the FUSE notifier, and scan sources that fail or hang on purpose.

use std::ffi::OsStr;
use std::fs;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use parking_lot::Mutex;

use super::diff::{Diff, ZoneKey};
use super::*;
use crate::notice::{Cached, Kernel, Notices};
use crate::report::Kind;
use crate::view::identity::ROOT_INO;
use crate::view::{open_root, Layout, LinkStyle};

fn id(n: u8) -> String {
    format!("{n:02x}").repeat(32)
}

fn short(n: u8) -> String {
    format!("{n:02x}").repeat(13)
}

fn write(root: &Path, rel: &str, bytes: impl AsRef<[u8]>) {
    let path = root.join(rel);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, bytes).unwrap();
}

fn base_layer(root: &Path, n: u8) {
    let id = id(n);
    fs::create_dir_all(root.join(format!("overlay/RO/{id}/diff"))).unwrap();
    write(root, &format!("overlay/RO/{id}/link"), short(n));
    write(
        root,
        &format!("overlay-layers/RO/{id}/layer.json"),
        format!(r#"{{"id":"{id}"}}"#),
    );
}

fn image(root: &Path, n: u8, top: u8, tag: &str) {
    let id = id(n);
    let dir = format!("overlay-images/{id}");
    write(
        root,
        &format!("{dir}/images.json"),
        format!(
            r#"{{"id":"{id}","names":["{tag}"],"layer":"{}"}}"#,
            self::id(top)
        ),
    );
    write(root, &format!("{dir}/manifest"), "{}");
    let config = base64::engine::general_purpose::STANDARD.encode(format!("sha256:{id}"));
    write(root, &format!("{dir}/={config}"), "{}");
}

/// Records invalidations instead of sending them.
#[derive(Clone, Default)]
struct Recorder {
    calls: Arc<Mutex<Vec<String>>>,
}

impl Kernel for Recorder {
    fn inval_entry(&self, parent: u64, name: &OsStr) -> std::io::Result<()> {
        self.calls
            .lock()
            .push(format!("entry {parent} {}", name.to_string_lossy()));
        Ok(())
    }
    fn expire_entry(&self, parent: u64, name: &OsStr) -> std::io::Result<()> {
        self.calls
            .lock()
            .push(format!("expire {parent} {}", name.to_string_lossy()));
        Ok(())
    }
    fn inval_inode(&self, ino: u64, what: Cached) -> std::io::Result<()> {
        self.calls.lock().push(match what {
            Cached::Everything => format!("inode {ino}"),
            Cached::Attributes => format!("attributes {ino}"),
        });
        Ok(())
    }
}

/// The view's notices, sent to `kernel`.
fn started(f: &Fixture, kernel: impl Kernel + 'static) -> Arc<Notices> {
    let notices = Arc::new(Notices::new(&f.view));
    notices.start(Arc::new(kernel)).unwrap();
    notices
}

struct Fixture {
    _tmp: tempfile::TempDir,
    remote: std::path::PathBuf,
    view: Arc<View>,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let remote = tmp.path().join("remote");
    let local = tmp.path().join("local");
    fs::create_dir_all(&remote).unwrap();
    fs::create_dir_all(&local).unwrap();
    base_layer(&remote, 1);
    image(&remote, 0xa1, 1, "one:latest");
    let layout = Layout::new("overlay", &tmp.path().join("mnt"), LinkStyle::Absolute);
    let view = View::new(
        layout,
        open_root(&local).unwrap(),
        open_root(&remote).unwrap(),
        LayoutIndex::default(),
    )
    .unwrap();
    Fixture {
        _tmp: tmp,
        remote,
        view: Arc::new(view),
    }
}

fn options(hide: bool) -> Options {
    Options {
        interval: Duration::ZERO,
        scan_timeout: Duration::from_millis(500),
        hide_unhealthy: hide,
        inotify: false,
        journal: false,
        journal_poll: Duration::from_millis(200),
    }
}

fn refresher(f: &Fixture, opts: Options) -> Refresher {
    let mut scanner = Scanner::new(&f.remote, "overlay");
    scanner.racy_margin = Duration::ZERO;
    scanner.full_check_every = 1;
    Refresher::new(
        f.view.clone(),
        Box::new(scanner),
        MountInfo {
            remote: f.remote.clone(),
            driver: "overlay".into(),
            ..MountInfo::default()
        },
        opts,
    )
}

#[test]
fn rounds_report_added_removed_and_changed_objects() {
    let f = fixture();
    let mut r = refresher(&f, options(false));
    let first = r.round();
    assert_eq!(first.error, None);
    assert_eq!((first.ready_layers, first.ready_images), (1, 1));
    assert_eq!(first.added.len(), 2);

    let idle = r.round();
    assert!(idle.added.is_empty() && idle.removed.is_empty() && idle.changed.is_empty());

    base_layer(&f.remote, 2);
    image(&f.remote, 0xa2, 2, "two:latest");
    fs::remove_dir_all(f.remote.join(format!("overlay-images/{}", id(0xa1)))).unwrap();
    let round = r.round();
    let ids = |v: &[crate::report::ObjectRef]| v.iter().map(|o| o.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&round.added), vec![id(2), id(0xa2)]);
    assert_eq!(ids(&round.removed), vec![id(0xa1)]);

    image(&f.remote, 0xa2, 2, "two:v2");
    let round = r.round();
    assert_eq!(ids(&round.changed), vec![id(0xa2)]);
    assert_eq!(round.changed[0].kind, Kind::Image);
    let handle = r.handle();
    assert_eq!(handle.images()[0].names, vec!["two:v2"]);
    assert_eq!(handle.layers().len(), 2);
    assert_eq!(handle.status().rounds, 4);
}

#[test]
fn a_vanished_remote_is_unhealthy_keeps_the_index_and_recovers() {
    let f = fixture();
    let mut r = refresher(&f, options(false));
    r.round();
    let handle = r.handle();
    assert!(handle.status().remote_health.healthy);

    let away = f.remote.with_file_name("away");
    fs::rename(&f.remote, &away).unwrap();
    let failed = r.round();
    assert!(failed
        .error
        .as_deref()
        .unwrap_or("")
        .contains("remote root"));
    let status = handle.status();
    assert!(!status.remote_health.healthy);
    assert!(status.remote_health.last_error.is_some());
    let since = status.remote_health.since;
    assert_eq!(failed.ready_images, 1, "the last good index stays");
    assert!(f.view.index().image(&id(0xa1)).is_some());
    r.round();
    assert_eq!(
        handle.status().remote_health.since,
        since,
        "since is when it became unhealthy"
    );

    fs::rename(&away, &f.remote).unwrap();
    let back = r.round();
    assert_eq!(back.error, None);
    assert!(handle.status().remote_health.healthy);
}

#[test]
fn hide_unhealthy_empties_the_view_until_the_remote_is_back() {
    let f = fixture();
    let mut r = refresher(&f, options(true));
    r.round();
    let away = f.remote.with_file_name("away");
    fs::rename(&f.remote, &away).unwrap();
    let failed = r.round();
    assert!(failed.error.is_some());
    assert_eq!(failed.removed.len(), 2);
    assert_eq!(f.view.index().images().count(), 0);
    fs::rename(&away, &f.remote).unwrap();
    let back = r.round();
    assert_eq!(back.added.len(), 2);
    assert_eq!(f.view.index().images().count(), 1);
}

/// With the view hidden after a failed round, a remote that comes back empty is compared
/// with what the view showed before it was hidden: a share gone away, not an emptied
/// remote. It was compared with the hidden (empty) view, taken as healthy, and the view
/// stayed empty for good; without `hide_unhealthy` the same remote fails the round.
#[test]
fn a_remote_back_empty_after_the_view_was_hidden_is_still_a_vanished_remote() {
    let f = fixture();
    let mut r = refresher(&f, options(true));
    r.round();
    let away = f.remote.with_file_name("away");
    fs::rename(&f.remote, &away).unwrap();
    assert!(r.round().error.is_some());
    fs::create_dir(&f.remote).unwrap();
    let empty = r.round();
    assert!(
        empty.error.as_deref().unwrap_or("").contains("vanished"),
        "{:?}",
        empty.error
    );
    assert!(!r.handle().status().remote_health.healthy);
    fs::remove_dir(&f.remote).unwrap();
    fs::rename(&away, &f.remote).unwrap();
    let back = r.round();
    assert_eq!(back.error, None);
    assert_eq!(f.view.index().images().count(), 1);
}

/// A source that hangs until released, like a scan on a stalled NFS mount.
struct Hanging {
    release: crossbeam_channel::Receiver<()>,
    inner: Scanner,
}

impl Source for Hanging {
    fn scan(&mut self, force: bool) -> Result<Option<LayoutIndex>, String> {
        let _ = self.release.recv();
        Scanner::scan_if_changed(&mut self.inner, force).map_err(|e| e.0)
    }
}

#[test]
fn a_hanging_scan_times_out_is_not_stacked_and_recovers() {
    let f = fixture();
    let (release, released) = crossbeam_channel::unbounded();
    let mut inner = Scanner::new(&f.remote, "overlay");
    inner.racy_margin = Duration::ZERO;
    let mut r = Refresher::new(
        f.view.clone(),
        Box::new(Hanging {
            release: released,
            inner,
        }),
        MountInfo::default(),
        options(false),
    );
    let started = Instant::now();
    let report = r.round();
    assert!(report
        .error
        .as_deref()
        .unwrap_or("")
        .contains("did not finish"));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!r.handle().status().remote_health.healthy);

    // Still stuck: the next round fails at once rather than starting another scan.
    let started = Instant::now();
    let report = r.round();
    assert!(report
        .error
        .as_deref()
        .unwrap_or("")
        .contains("has not returned"));
    assert!(started.elapsed() < Duration::from_millis(400));

    // The remote answers again: the stuck scan returns, the next round scans afresh.
    release.send(()).unwrap();
    release.send(()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let report = r.round();
        if report.error.is_none() {
            assert_eq!(report.ready_images, 1);
            break;
        }
        assert!(Instant::now() < deadline, "never recovered: {report:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(r.handle().status().remote_health.healthy);
}

#[test]
fn invalidation_names_exactly_what_changed() {
    let f = fixture();
    let mut r = refresher(&f, options(false));
    let recorder = Recorder::default();
    r.notices = Some(started(&f, recorder.clone()));
    r.round();
    // The kernel knows the layout directories once they are looked up.
    let images = f
        .view
        .lookup(ROOT_INO, OsStr::new("overlay-images"))
        .unwrap();
    let driver = f.view.lookup(ROOT_INO, OsStr::new("overlay")).unwrap();
    let links = f.view.lookup(driver.node.ino, OsStr::new("l")).unwrap();
    let image_dir = f
        .view
        .lookup(images.node.ino, OsStr::new(&id(0xa1)))
        .unwrap();
    let json = f
        .view
        .lookup(image_dir.node.ino, OsStr::new("images.json"))
        .unwrap();
    recorder.calls.lock().clear();

    r.round();
    assert!(
        recorder.calls.lock().is_empty(),
        "an idle round sends nothing"
    );

    base_layer(&f.remote, 2);
    r.round();
    let calls = recorder.calls.lock().clone();
    assert!(calls.contains(&format!("entry {} {}", driver.node.ino, id(2))));
    assert!(calls.contains(&format!("entry {} {}", links.node.ino, short(2))));
    assert!(calls.contains(&format!("inode {}", links.node.ino)));
    assert!(!calls.iter().any(|c| c.contains(&id(0xa1))));
    recorder.calls.lock().clear();

    image(&f.remote, 0xa1, 1, "one:v2");
    r.round();
    let calls = recorder.calls.lock().clone();
    assert!(calls.contains(&format!("entry {} images.json", image_dir.node.ino)));
    assert!(calls.contains(&format!("inode {}", json.node.ino)));
    assert!(calls.contains(&format!("inode {}", image_dir.node.ino)));
    assert!(!calls.iter().any(|c| c.contains(&id(2))));
}

/// A kernel whose `inval_entry` in one directory does not return until released: the way
/// it waits while a lookup stuck on the remote holds that directory.
struct StuckOn {
    dir: u64,
    until: crossbeam_channel::Receiver<()>,
    then: Recorder,
}

impl Kernel for StuckOn {
    fn inval_entry(&self, parent: u64, name: &OsStr) -> std::io::Result<()> {
        if parent == self.dir {
            let _ = self.until.recv();
        }
        self.then.inval_entry(parent, name)
    }
    fn expire_entry(&self, parent: u64, name: &OsStr) -> std::io::Result<()> {
        self.then.expire_entry(parent, name)
    }
    fn inval_inode(&self, ino: u64, what: Cached) -> std::io::Result<()> {
        self.then.inval_inode(ino, what)
    }
}

/// A round's invalidation that waits for a directory held by a lookup stuck on the remote
/// does not hold the refresher up: rounds finish within the scan timeout, and the notices
/// reach the kernel once the directory is free. The round waited for the stuck directory
/// for as long as it stayed stuck (here 5 s, released by a timer).
#[test]
fn rounds_go_on_while_an_invalidation_waits_for_a_stuck_directory() {
    let f = fixture();
    let mut r = refresher(&f, options(false));
    r.round();
    let driver = f.view.lookup(ROOT_INO, OsStr::new("overlay")).unwrap();
    let (release, until) = crossbeam_channel::bounded::<()>(0);
    let recorder = Recorder::default();
    let stuck = StuckOn {
        dir: driver.node.ino,
        until,
        then: recorder.clone(),
    };
    r.notices = Some(started(&f, stuck));
    let timer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(5));
        drop(release);
    });

    for n in [2, 3] {
        base_layer(&f.remote, n);
        let started = Instant::now();
        let report = r.round();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "round {n} took {:?}",
            started.elapsed()
        );
        assert_eq!(report.error, None);
        assert!(f.view.index().layer(&id(n)).is_some());
    }
    timer.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let wanted = [2, 3].map(|n| format!("entry {} {}", driver.node.ino, id(n)));
    while !wanted.iter().all(|w| recorder.calls.lock().contains(w)) {
        assert!(Instant::now() < deadline, "{:?}", recorder.calls.lock());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_short_id_moving_to_another_layer_is_relinked() {
    let f = fixture();
    let mut r = refresher(&f, options(false));
    let before = r.round();
    assert_eq!(before.error, None);
    let old = (*f.view.index()).clone();
    fs::remove_dir_all(f.remote.join(format!("overlay/RO/{}", id(1)))).unwrap();
    fs::remove_dir_all(f.remote.join(format!("overlay-layers/RO/{}", id(1)))).unwrap();
    base_layer(&f.remote, 3);
    let mut link = fs::File::create(f.remote.join(format!("overlay/RO/{}/link", id(3)))).unwrap();
    link.write_all(short(1).as_bytes()).unwrap();
    r.round();
    let diff = Diff::between(&old, &f.view.index());
    assert!(diff.names.contains(&(ZoneKey::Links, short(1))));
    assert!(diff.relinked.contains(&(ZoneKey::Links, short(1))));
    assert!(diff.relinked.contains(&(ZoneKey::DriverHome, id(1))));
}

/// Runs the test `name` of this module in a process of its own, with `CHILD_ENV` set: for a
/// test that must change what is process-wide (the open-file limit).
fn in_own_process(name: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &format!("refresh::tests::{name}"), "--nocapture"])
        .args(["--test-threads", "1"])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(
        out.status.success() && text(&out.stdout).contains("1 passed"),
        "{name} in its own process: {}\n{}{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
}

const CHILD_ENV: &str = "LAYERFS_TEST_OWN_PROCESS";

/// A round that runs out of descriptors knows nothing about the remote: it keeps the view
/// (even with `hide_unhealthy`) and leaves the remote healthy, and the next round is as if
/// it never happened. Before, the objects it could not read left the view as not ready, or
/// the remote root's `EMFILE` made the remote unhealthy and hid it.
#[test]
fn a_round_short_of_descriptors_keeps_the_view_and_the_remote_healthy() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return in_own_process(
            "a_round_short_of_descriptors_keeps_the_view_and_the_remote_healthy",
        );
    }
    let f = fixture();
    let mut r = refresher(&f, options(true));
    let handle = r.handle();
    assert_eq!(r.round().error, None);
    base_layer(&f.remote, 2);
    let limit = libc::rlimit {
        rlim_cur: 256,
        rlim_max: 256,
    };
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
    let mut hogs = Vec::new();
    while let Ok(file) = fs::File::open("/dev/null") {
        hogs.push(file);
    }
    let short = r.round();
    assert!(short.error.is_some(), "the round could not scan");
    assert!(short.removed.is_empty(), "removed: {:?}", short.removed);
    assert!(
        handle.status().remote_health.healthy,
        "the remote is still healthy"
    );
    assert_eq!(
        (
            f.view.index().layers().count(),
            f.view.index().images().count()
        ),
        (1, 1)
    );
    drop(hogs);
    let back = r.round();
    assert_eq!(back.error, None);
    assert!(back.removed.is_empty(), "removed: {:?}", back.removed);
    assert_eq!(back.added.len(), 1, "the layer made meanwhile");
    assert_eq!((back.ready_layers, back.ready_images), (2, 1));
    assert!(handle.status().remote_health.healthy);
}
