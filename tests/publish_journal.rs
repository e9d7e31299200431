//! Publication through the journal (DESIGN §14): a publisher (`layerfs publish --watch`)
//! runs beside a writer host's runtime, which a separate process plays, writing layers and
//! images in iSulad's order; a reader mount that hears nothing else (no inotify, a refresh
//! interval far longer than the test waits) shows what the publisher journals within a
//! poll or two, and stops showing what it journals removed. A publisher killed with
//! `SIGKILL`, restarted, or joined by a second one loses nothing; a torn record is skipped
//! and counted; a reader without a journal says so and scans.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::isulad::*;
use common::scenario::status;
use common::*;

common::isulad::writer_host_entry!();

/// How long a publication may take to show on the reader in these tests: the target is
/// 1 s (benches/publish.sh measures it); this leaves room for a loaded CI machine.
const SHOWS_WITHIN: Duration = Duration::from_secs(3);

/// A reader that only the journal can tell of changes quickly.
fn reader() -> Mount {
    Mount::with(
        Options {
            opts: "noinotify,refresh=60".into(),
            ..Default::default()
        },
        |_| {},
    )
}

/// A running `layerfs publish --watch`, killed on drop.
struct Publisher {
    child: Child,
}

impl Publisher {
    fn start(remote: &Path, name: &str) -> Publisher {
        let bell = remote.join("layerfs-journal/bell");
        let rang_before = fs::read(&bell).ok();
        let child = Command::new(BIN)
            .args(["publish", "--watch"])
            .arg(remote)
            .args(["--name", name])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn layerfs publish");
        // It rings once it has judged the tree.
        eventually(10, "the publisher's first ring", || {
            fs::read(&bell)
                .ok()
                .is_some_and(|b| Some(&b) != rang_before.as_ref())
        });
        Publisher { child }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.kill();
    }
}

fn journal(m: &Mount) -> serde_json::Value {
    status(m)["journal"].clone()
}

fn wait_following(m: &Mount) {
    eventually(10, "the reader follows the journal", || {
        journal(m)["state"] == "following"
    });
}

/// Waits until `check` holds, and returns how long that took.
fn shows(what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !check() {
        assert!(
            started.elapsed() < SHOWS_WITHIN,
            "{what}: not within {SHOWS_WITHIN:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    started.elapsed()
}

fn image_shown(m: &Mount, image: &Image) -> bool {
    m.mnt.join(image.dir()).is_dir()
}

fn pull(m: &mut Mount, label: &str) -> Image {
    let [a, b, c] = Layer::chain([
        &format!("{label}-a"),
        &format!("{label}-b"),
        &format!("{label}-c"),
    ]);
    let image = Image::on(label, &c, &[&format!("registry.example/{label}:1")]);
    writer(
        m,
        concat([a.create(), b.create(), c.create(), image.create()]),
    );
    image
}

#[test]
fn a_pull_shows_on_a_reader_within_a_poll_and_a_removal_goes() {
    let mut m = reader();
    let _publisher = Publisher::start(&m.remote, "writer-a");
    wait_following(&m);

    let image = pull(&mut m, "journal-pull");
    let took = shows("the pulled image", || image_shown(&m, &image));
    eprintln!("shown {took:?} after the writer finished");
    let layer = m.mnt.join(overlay_dir(&image.top)).join("diff/hello");
    assert_eq!(
        fs::read_to_string(&layer).unwrap(),
        "hello from layer journal-pull-c\n"
    );
    assert!(
        journal(&m)["named"].as_u64().unwrap() >= 4,
        "{}",
        journal(&m)
    );

    writer(&mut m, image.remove());
    shows("the removed image gone", || !image_shown(&m, &image));
    m.accept_remote_changes();
}

#[test]
fn a_retag_shows_through_the_journal() {
    let mut m = reader();
    let _publisher = Publisher::start(&m.remote, "writer-a");
    wait_following(&m);
    let mut image = pull(&mut m, "journal-retag");
    shows("the image", || image_shown(&m, &image));

    writer(&mut m, image.retag(&["registry.example/journal-retag:2"]));
    shows("the new name", || {
        let out = cli(&["images", "--json"], &m.mnt);
        String::from_utf8_lossy(&out.stdout).contains("journal-retag:2")
    });
    m.accept_remote_changes();
}

#[test]
fn a_publisher_killed_and_started_again_and_a_second_one_are_heard() {
    let mut m = reader();
    let mut first = Publisher::start(&m.remote, "writer-a");
    wait_following(&m);
    first.kill();

    // What the runtime made ready while no publisher ran is the scans' business; what it
    // makes after the restart is journaled again, in a new segment.
    let _again = Publisher::start(&m.remote, "writer-a");
    let one = pull(&mut m, "journal-restart");
    shows("an image after the restart", || image_shown(&m, &one));
    let segments: Vec<String> = fs::read_dir(m.remote.join("layerfs-journal"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("writer-a."))
        .collect();
    assert_eq!(segments.len(), 2, "one segment per run: {segments:?}");

    // A second writer host with its own publisher.
    let _second = Publisher::start(&m.remote, "writer-b");
    let two = pull(&mut m, "journal-second");
    shows("an image of the second writer", || image_shown(&m, &two));
    m.accept_remote_changes();
}

#[test]
fn a_torn_record_is_skipped_and_counted_and_what_follows_is_heard() {
    let mut m = reader();
    let _publisher = Publisher::start(&m.remote, "writer-a");
    wait_following(&m);

    // A publisher that died mid-write leaves half a line (the next run writes a segment of
    // its own, but a reader must get past a tear wherever it is).
    let dir = m.remote.join("layerfs-journal");
    let segment = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "log"))
        .unwrap();
    let mut torn = fs::OpenOptions::new().append(true).open(&segment).unwrap();
    std::io::Write::write_all(&mut torn, b"7 1765065600000 ready ima").unwrap();
    drop(torn);

    // The torn half-line and the start of the next write make one line, which is counted
    // as torn; the record at its end is salvaged, so nothing is lost.
    let image = pull(&mut m, "journal-torn");
    shows("the image journaled after the tear", || {
        image_shown(&m, &image)
    });
    let second = pull(&mut m, "journal-torn-2");
    shows("the next image", || image_shown(&m, &second));
    eventually(5, "the torn line is counted", || {
        journal(&m)["torn"].as_u64().unwrap_or(0) >= 1
    });
    m.accept_remote_changes();
}

#[test]
fn a_journal_that_goes_silent_or_vanishes_puts_the_reader_back_on_full_scans() {
    let mut m = Mount::with(
        Options {
            opts: "noinotify,refresh=1".into(),
            ..Default::default()
        },
        |_| {},
    );
    let mut publisher = Publisher::start(&m.remote, "writer-a");
    wait_following(&m);
    publisher.kill();
    // Its bell stops: past three heartbeats the journal is taken for stalled, and what a
    // writer host does meanwhile is found by full scans.
    eventually(45, "the journal reported stalled", || {
        journal(&m)["state"] == "stalled"
    });
    let text = String::from_utf8_lossy(&cli(&["status"], &m.mnt).stdout).into_owned();
    assert!(text.contains("STALLED since"), "{text}");
    let [a, b, c] = Layer::chain(["silent-a", "silent-b", "silent-c"]);
    let mut image = Image::on("silent", &c, &["registry.example/silent:1"]);
    writer(
        &mut m,
        concat([a.create(), b.create(), c.create(), image.create()]),
    );
    eventually(10, "the image, by a full scan", || image_shown(&m, &image));
    // A full scan, not a light one, sees a re-tag at once.
    writer(&mut m, image.retag(&["registry.example/silent:2"]));
    eventually(10, "the re-tag, by a full scan", || {
        let out = cli(&["images", "--json"], &m.mnt);
        String::from_utf8_lossy(&out.stdout).contains("silent:2")
    });

    fs::remove_dir_all(m.remote.join("layerfs-journal")).unwrap();
    eventually(10, "the vanished journal reported absent", || {
        journal(&m)["state"] == "absent"
    });
    m.accept_remote_changes();
}

#[test]
fn without_a_journal_the_reader_says_so_and_scans() {
    let mut m = Mount::with(
        Options {
            opts: "noinotify,refresh=1".into(),
            ..Default::default()
        },
        |_| {},
    );
    eventually(10, "the journal is reported absent", || {
        journal(&m)["state"] == "absent"
    });
    let text = String::from_utf8_lossy(&cli(&["status"], &m.mnt).stdout).into_owned();
    assert!(text.contains("journal     none in the remote"), "{text}");
    let image = pull(&mut m, "journal-none");
    eventually(10, "the image, by a scan", || image_shown(&m, &image));
    m.accept_remote_changes();
}

#[test]
fn nojournal_turns_following_off() {
    let m = Mount::with(
        Options {
            opts: "nojournal".into(),
            ..Default::default()
        },
        |_| {},
    );
    assert!(status(&m).get("journal").is_none(), "{}", status(&m));
}
