//! A daemon killed under load, as a user meets it (DESIGN §13): a kernel overlay stacked on
//! the view as runtimes stack a container's root (its lower a shared layer, its upper and
//! work directories in the view), `fio --verify` writing inside it, a process changing
//! names inside it, and a reader of a file of the shared layer. The daemon is found through
//! `layerfs status --json` and killed with SIGKILL again and again at random moments; the
//! keeper starts another on the same connection each time; then `layerfs upgrade` hands the
//! mount over to the binary on disk. Every workload must finish with its data verified and
//! see no error at all; the longest stall is reported.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::isulad::{concat, sha256_hex, writer, Image, Layer};
use common::*;

common::isulad::writer_host_entry!();

/// How many times the daemon is killed.
const KILLS: usize = 10;

/// What a workload saw: its errors, and its longest single operation.
#[derive(Default)]
struct Seen {
    errors: Vec<String>,
    longest: Duration,
    operations: u64,
}

impl Seen {
    fn timed<T>(&mut self, what: &str, op: impl FnOnce() -> std::io::Result<T>) -> Option<T> {
        let started = Instant::now();
        let result = op();
        self.longest = self.longest.max(started.elapsed());
        self.operations += 1;
        match result {
            Ok(v) => Some(v),
            Err(e) => {
                self.errors.push(format!("{what}: {e}"));
                None
            }
        }
    }
}

fn status(m: &Mount) -> serde_json::Value {
    let out = cli(&["status", "--json"], &m.mnt);
    assert!(
        out.status.success(),
        "status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("status --json is JSON")
}

fn daemon_pid(m: &Mount) -> Option<u32> {
    let out = cli(&["status", "--json"], &m.mnt);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    status["daemon_pid"].as_u64().map(|p| p as u32)
}

/// Kills the daemon `pid` with SIGKILL, as a crash would, and waits for the one the keeper
/// starts next: its pid, and how long after the kill it served.
fn kill_and_await(m: &Mount, pid: u32, kill: usize) -> (u32, Duration) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the daemon");
    let killed = Instant::now();
    eventually(20, &format!("a new daemon after kill {kill}"), || {
        daemon_pid(m).is_some_and(|p| p != pid)
    });
    (daemon_pid(m).unwrap(), killed.elapsed())
}

/// `layerfs upgrade` of the mount, which must succeed; what it printed.
fn upgrade(m: &Mount) -> String {
    let upgraded = cli(&["upgrade"], &m.mnt);
    assert!(
        upgraded.status.success(),
        "upgrade: {}",
        String::from_utf8_lossy(&upgraded.stderr)
    );
    String::from_utf8_lossy(&upgraded.stdout).into_owned()
}

/// A directory of the fixture's shared layers with a regular file to read, and that file.
fn shared_layer(m: &Mount) -> (PathBuf, PathBuf) {
    for entry in fs::read_dir(m.path("overlay/RO")).unwrap() {
        let diff = entry.unwrap().path().join("diff");
        let file = diff.join("etc/os-release");
        if file.is_file() {
            return (diff, PathBuf::from("etc/os-release"));
        }
    }
    panic!("the fixture has a layer with etc/os-release");
}

/// Writes, renames, reads back and removes files in `dir` until told to stop.
fn churn(dir: PathBuf, stop: Arc<AtomicBool>) -> Seen {
    let mut seen = Seen::default();
    fs::create_dir_all(&dir).unwrap();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let (new, renamed) = (dir.join(format!("n{i}")), dir.join(format!("r{i}")));
        let body = format!("file {i}\n").repeat(1 + (i % 7) as usize);
        seen.timed("create", || fs::write(&new, &body));
        seen.timed("rename", || fs::rename(&new, &renamed));
        if let Some(read) = seen.timed("read back", || fs::read_to_string(&renamed)) {
            if read != body {
                seen.errors.push(format!("r{i} holds {read:?}"));
            }
        }
        seen.timed("mkdir", || fs::create_dir(dir.join(format!("d{i}"))));
        if i >= 2 {
            seen.timed("unlink", || {
                fs::remove_file(dir.join(format!("r{}", i - 2)))
            });
            seen.timed("rmdir", || fs::remove_dir(dir.join(format!("d{}", i - 2))));
        }
        i += 1;
    }
    // What is left is exactly the last two of each.
    let mut names = names(&dir);
    names.sort();
    let mut want: Vec<String> = (i.saturating_sub(2)..i)
        .flat_map(|n| [format!("d{n}"), format!("r{n}")])
        .collect();
    want.sort();
    if names != want {
        seen.errors
            .push(format!("left {names:?}, expected {want:?}"));
    }
    seen
}

/// Reads `file` whole by path, and through one descriptor kept open, until told to stop.
fn read_shared(file: PathBuf, expected: Vec<u8>, stop: Arc<AtomicBool>) -> Seen {
    let mut seen = Seen::default();
    let mut kept = fs::File::open(&file).unwrap();
    while !stop.load(Ordering::Relaxed) {
        if let Some(read) = seen.timed("read by path", || fs::read(&file)) {
            if read != expected {
                seen.errors.push("the shared file read differs".into());
            }
        }
        let mut buf = Vec::new();
        let through_kept = seen.timed("read through a kept descriptor", || {
            kept.seek(SeekFrom::Start(0))?;
            kept.read_to_end(&mut buf)
        });
        if through_kept.is_some() && buf != expected {
            seen.errors
                .push("the shared file read through a kept descriptor differs".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    seen
}

/// Runs `fio` write-and-verify jobs on a file in `dir`, one after the other, until told to
/// stop; any job that fails is an error.
fn fio(dir: PathBuf, stop: Arc<AtomicBool>) -> Seen {
    let mut seen = Seen::default();
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let out = Command::new("fio")
            .args([
                "--name=verify",
                "--size=8M",
                "--bs=4k",
                "--rw=randwrite",
                "--ioengine=psync",
                "--fsync=64",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--do_verify=1",
                // No verify state file in the working directory: the job never resumes.
                "--verify_state_save=0",
                "--output-format=terse",
            ])
            .arg(format!("--filename={}", dir.join("fio.dat").display()))
            .output()
            .expect("run fio");
        seen.operations += 1;
        seen.longest = seen.longest.max(started.elapsed());
        if !out.status.success() {
            seen.errors.push(format!(
                "fio: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    seen
}

fn fio_present() -> bool {
    Command::new("fio").arg("--version").output().is_ok()
}

#[test]
fn workloads_in_an_overlay_on_the_view_outlive_ten_kills_and_an_upgrade() {
    if !fio_present() {
        missing_capability("fio", "the restart test writes with fio --verify");
        return;
    }
    let mut m = Mount::with(
        Options {
            opts: "keeper".into(),
            ..Options::default()
        },
        |_| {},
    );
    let (lower, shared) = shared_layer(&m);
    let expected = fs::read(lower.join(&shared)).unwrap();
    let (upper, work, merged) = (
        m.path("ctr/upper"),
        m.path("ctr/work"),
        m.dir.path().join("merged"),
    );
    for dir in [&upper, &work, &merged] {
        fs::create_dir_all(dir).unwrap();
    }
    let overlay = Overlay::mount(&[lower], &upper, &work, &merged).expect("overlay on the view");
    let first = daemon_pid(&m).expect("status names the daemon");
    let keeper = status(&m)["keeper"]["pid"]
        .as_u64()
        .expect("status names the keeper") as u32;

    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<(&str, std::thread::JoinHandle<Seen>)> = vec![
        ("fio", {
            let (dir, stop) = (merged.clone(), stop.clone());
            std::thread::spawn(move || fio(dir, stop))
        }),
        ("names", {
            let (dir, stop) = (merged.join("churn"), stop.clone());
            std::thread::spawn(move || churn(dir, stop))
        }),
        ("shared reader", {
            let (file, stop) = (merged.join(&shared), stop.clone());
            std::thread::spawn(move || read_shared(file, expected, stop))
        }),
    ];

    let mut seed = u64::from(std::process::id()) ^ 0x9e37_79b9_7f4a_7c15;
    let mut random_ms = |low: u64, high: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        low + seed % (high - low)
    };
    let mut pid = first;
    let mut back_in = Vec::new();
    for kill in 1..=KILLS {
        std::thread::sleep(Duration::from_millis(random_ms(200, 900)));
        let took;
        (pid, took) = kill_and_await(&m, pid, kill);
        back_in.push(took);
    }
    // Then a planned hand-over to the binary on disk, under the same load.
    std::thread::sleep(Duration::from_millis(300));
    eprint!("{}", upgrade(&m));
    let after = status(&m);
    assert_ne!(daemon_pid(&m), Some(pid), "another daemon serves");
    let gap = after["keeper"]["gap_ms"]
        .as_f64()
        .expect("the gap is reported");
    assert!(gap < 1000.0, "callers waited {gap} ms for the hand-over");
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);

    let mut errors = Vec::new();
    for (name, worker) in workers {
        let seen = worker.join().expect("a workload panicked");
        eprintln!(
            "{name}: {} operations, longest {:?}, {} errors",
            seen.operations,
            seen.longest,
            seen.errors.len()
        );
        errors.extend(seen.errors.into_iter().map(|e| format!("{name}: {e}")));
    }
    eprintln!(
        "daemon back after a kill within {:?} at most",
        back_in.iter().max().unwrap()
    );
    let now = status(&m);
    assert_eq!(now["keeper"]["pid"].as_u64(), Some(u64::from(keeper)));
    assert_eq!(now["keeper"]["restarts"].as_u64(), Some(KILLS as u64 + 1));
    assert!(errors.is_empty(), "workloads saw errors: {errors:#?}");

    // The overlay's changes are in the view's local tree, whole.
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(merged.join("last"))
        .or_else(|_| fs::File::create(merged.join("last")))
        .unwrap();
    f.write_all(b"done").unwrap();
    drop(f);
    drop(overlay);
    assert_eq!(fs::read(upper.join("last")).unwrap(), b"done");
    m.unmount();
    assert!(!is_mounted(&m.mnt), "the view unmounts cleanly");
}

/// A mount made in the background by root has a keeper without being asked: the daemon
/// `status` names can be killed and the mount serves on.
#[test]
fn a_detached_mount_is_kept_by_default() {
    let mut m = Mount::with(
        Options {
            foreground: false,
            ..Options::default()
        },
        |_| {},
    );
    fs::write(m.path("overlay/kept"), b"before").unwrap();
    let first = status(&m);
    let daemon = first["daemon_pid"]
        .as_u64()
        .expect("status names the daemon") as i32;
    assert!(first["keeper"]["pid"].as_u64().is_some(), "{first}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert_eq!(fs::read(m.path("overlay/kept")).unwrap(), b"before");
    eventually(20, "the daemon to be gone", || exited(daemon as u32));
    // Asked while the next daemon starts, status waits for it rather than fail.
    let after = status(&m);
    assert_ne!(after["daemon_pid"].as_u64(), Some(daemon as u64));
    assert_eq!(after["keeper"]["restarts"].as_u64(), Some(1));
    m.unmount();
}

/// A keeper killed takes its daemon with it: the mount is left dead, as a daemon without a
/// keeper leaves it, for the next mount there to take back.
#[test]
fn a_killed_keeper_leaves_a_dead_mount() {
    let mut m = Mount::with(
        Options {
            foreground: false,
            ..Options::default()
        },
        |_| {},
    );
    let now = status(&m);
    let (keeper, daemon) = (
        now["keeper"]["pid"].as_u64().expect("a keeper") as u32,
        now["daemon_pid"].as_u64().unwrap() as u32,
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(keeper as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    eventually(20, "the daemon to follow its keeper", || exited(daemon));
    eventually(20, "the mount to be dead", || {
        fs::metadata(&m.mnt).err().and_then(|e| e.raw_os_error()) == Some(libc::ENOTCONN)
    });
    m.mount(&Options {
        foreground: false,
        ..Options::default()
    });
    assert_eq!(
        names(&m.mnt),
        vec!["overlay", "overlay-images", "overlay-layers"]
    );
}

/// Appends numbered records to `file`, each written whole and synced, until told to stop;
/// how many it wrote, with what failed.
fn append_records(file: PathBuf, stop: Arc<AtomicBool>) -> (Seen, u64) {
    let mut seen = Seen::default();
    let mut written = 0u64;
    let mut f = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&file)
        .unwrap();
    while !stop.load(Ordering::Relaxed) {
        let record = format!("record {written}\n");
        if seen
            .timed("append and sync", || {
                f.write_all(record.as_bytes())?;
                f.sync_data()
            })
            .is_some()
        {
            written += 1;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    (seen, written)
}

/// A descriptor the caller leaked into the mount (open without close-on-exec, numbered far
/// above any the daemon would use) is closed by the keeper and reaches no daemon it starts:
/// not the first, not those started after a kill, not the binary an upgrade hands over to.
/// All the while a writer host has published a chain named as iSulad names it, a reader
/// reads its top layer through the view, and a writer appends synced records to a file on
/// the view: nothing either sees fails, and every record is there, in order.
#[test]
fn a_leaked_descriptor_reaches_no_daemon_through_kills_and_an_upgrade() {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let leak_dir = tempfile::tempdir().unwrap();
    let leak_path = leak_dir.path().join("leaked");
    let file = fs::File::create(&leak_path).unwrap();
    // SAFETY: F_DUPFD makes a new descriptor (without close-on-exec), owned here from now on.
    let leaked = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_DUPFD, 900) };
    assert!(
        leaked >= 900,
        "F_DUPFD: {}",
        std::io::Error::last_os_error()
    );
    let _leaked = unsafe { OwnedFd::from_raw_fd(leaked) };

    let mut m = Mount::with(
        Options {
            opts: "keeper,refresh=0".into(),
            ..Options::default()
        },
        |_| {},
    );
    let [a, b, c] = Layer::chain(["leak-a", "leak-b", "leak-c"]);
    assert_eq!(a.id, a.diff_id, "a base layer is named by its diff ID");
    assert_eq!(
        c.id,
        sha256_hex(format!("{}+{}", b.id, c.diff_id).as_bytes()),
        "a child is named sha256(parent + \"+\" + diffID)"
    );
    let image = Image::on("leak-img", &c, &["registry.example/leak:1"]);
    writer(
        &mut m,
        concat([a.create(), b.create(), c.create(), image.create()]),
    );
    assert!(cli(&["refresh"], &m.mnt).status.success());
    let top = m.path("overlay/RO").join(&c.id).join("diff/hello");
    let expected = fs::read(&top).expect("the new top layer through the view");
    assert_eq!(expected, b"hello from layer leak-c\n");

    let keeper = status(&m)["keeper"]["pid"]
        .as_u64()
        .expect("status names the keeper") as u32;
    let check = |when: &str| {
        let daemon = daemon_pid(&m).expect("status names the daemon");
        for (who, pid) in [("keeper", keeper), ("daemon", daemon)] {
            let held = descriptors_on(pid, &leak_path);
            assert!(
                held.is_empty(),
                "{when}: the {who} holds the leaked file as {held:?}"
            );
        }
        daemon
    };
    let mut daemon = check("first start");

    fs::create_dir(m.path("rw")).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let appender = {
        let (file, stop) = (m.path("rw/records"), stop.clone());
        std::thread::spawn(move || append_records(file, stop))
    };
    let reader = {
        let (file, stop) = (top.clone(), stop.clone());
        std::thread::spawn(move || read_shared(file, expected, stop))
    };
    for kill in 1..=2 {
        std::thread::sleep(Duration::from_millis(300));
        kill_and_await(&m, daemon, kill);
        daemon = check(&format!("after kill {kill}"));
    }
    std::thread::sleep(Duration::from_millis(300));
    upgrade(&m);
    assert_ne!(check("after the upgrade"), daemon, "another daemon serves");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);

    let (appended, written) = appender.join().expect("the appender panicked");
    let read = reader.join().expect("the reader panicked");
    assert!(
        appended.errors.is_empty() && read.errors.is_empty(),
        "appender: {:?}; reader: {:?}",
        appended.errors,
        read.errors
    );
    let records: String = (0..written).map(|n| format!("record {n}\n")).collect();
    assert!(written > 0, "the appender wrote nothing");
    assert_eq!(
        fs::read_to_string(m.path("rw/records")).unwrap(),
        records,
        "the records on the view"
    );
    m.unmount();
}
