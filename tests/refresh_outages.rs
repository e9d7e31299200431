//! Writer-host scenarios of a remote that stops answering or is hidden (DESIGN §5): a round
//! that cannot scan the remote fails and says so, `status` reports the remote unhealthy since
//! the first failure, and the view keeps serving the last good index, links and all, while
//! local paths keep working; the first good round after brings what the writer did meanwhile.
//! An area covered by an empty mount is not an outage but an empty area: its objects go, and
//! come back once it is uncovered. Rounds run only when the test asks (`refresh=0`).
//!
//! The writer is this test binary run again for its ignored `writer_host_process`, declared
//! below, which performs the operations it is handed and exits; run any other way, it does
//! nothing.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

use common::isulad::*;
use common::scenario::*;
use common::{cli, expected, names, Mount};

common::isulad::writer_host_entry!();

/// Moves the remote root away and back, even when the test fails in between.
struct Away {
    remote: PathBuf,
    away: PathBuf,
    gone: bool,
}

impl Away {
    fn take(m: &Mount) -> Away {
        let away = m.dir.path().join("remote-unreachable");
        fs::rename(&m.remote, &away).unwrap();
        Away {
            remote: m.remote.clone(),
            away,
            gone: true,
        }
    }

    fn bring_back(&mut self) {
        if self.gone {
            fs::rename(&self.away, &self.remote).unwrap();
            self.gone = false;
        }
    }
}

impl Drop for Away {
    fn drop(&mut self) {
        if self.gone {
            let _ = fs::rename(&self.away, &self.remote);
        }
    }
}

fn epoch_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// A mount with layer `outage` and an image on it, ready, and a layer `outage-later` the
/// writer adds once the remote is back.
fn outage_setup() -> (Mount, Layer, Image, Layer) {
    let mut m = mount();
    let l = Layer::base("outage");
    let img = Image::on("outage-img", &l, &["outage:latest"]);
    let later = Layer::base("outage-later");
    writer(&mut m, concat([l.create(), img.create()]));
    refresh(&m);
    expect_view(&m, &[&l, &later], &[&img], &["outage", "outage-img"]);
    (m, l, img, later)
}

/// Takes the remote away and runs a round, which must fail.
fn fail_a_round(m: &Mount) -> Away {
    let away = Away::take(m);
    let out = cli(&["refresh"], &m.mnt);
    assert!(!out.status.success(), "a round without a remote must fail");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("could not scan the remote"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    away
}

// ---- Scenarios ----

/// Scenario 15a: The remote unreachable, then back: `status` says unhealthy since when, the
/// last good index and its links stay, local paths keep working, and a round after the remote
/// is back reports healthy again and brings what the writer added meanwhile.
#[test]
fn an_unreachable_remote_is_reported_and_recovers() {
    let (mut m, l, img, later) = outage_setup();
    let healthy_since = status(&m)["remote_health"]["since"].as_f64().unwrap();

    let before = epoch_secs(SystemTime::now());
    let mut away = fail_a_round(&m);
    let s = status(&m);
    let health = &s["remote_health"];
    assert_eq!(health["healthy"], false, "{s}");
    let since = health["since"].as_f64().expect("since");
    assert!(
        since >= before - 1.0 && since <= epoch_secs(SystemTime::now()) + 1.0,
        "{s}"
    );
    assert!(since >= healthy_since, "{s}");
    assert!(
        health["last_error"].as_str().is_some_and(|e| !e.is_empty()),
        "{s}"
    );
    assert!(s["last_round"]["error"].as_str().is_some(), "{s}");
    assert_eq!(s["last_round"]["ready_layers"], 5, "{s}");
    assert_eq!(s["last_round"]["ready_images"], 3, "{s}");
    let human = String::from_utf8_lossy(&cli(&["status"], &m.mnt).stdout).into_owned();
    assert!(human.contains("NOT ANSWERING since"), "{human}");

    // The last good index stays: its links are all still served, as they were.
    let ids = sorted(
        strings(&expected()["ready_layers"])
            .into_iter()
            .chain([l.id.clone()])
            .collect(),
    );
    let mut with_skeleton = ids.clone();
    with_skeleton.extend(["RO".to_owned(), "l".to_owned()]);
    assert_eq!(names(&m.path("overlay")), sorted(with_skeleton));
    assert!(names(&m.path("overlay/l")).contains(&l.short));
    assert_eq!(
        fs::read_link(m.path("overlay").join(&l.id)).unwrap(),
        m.mnt.join("overlay/RO").join(&l.id)
    );
    assert_eq!(
        fs::read_link(m.path("overlay/l").join(&l.short)).unwrap(),
        Path::new("..").join(&l.id).join("diff")
    );
    let v: Value = serde_json::from_slice(&cli(&["images", "--json"], &m.mnt).stdout).unwrap();
    assert!(
        v.as_array()
            .unwrap()
            .iter()
            .any(|i| i["id"] == img.id.as_str()),
        "{v}"
    );
    // Local paths keep working.
    fs::write(m.path("host-note"), "written during the outage").unwrap();
    assert_eq!(read(&m.path("host-note")), b"written during the outage");
    // A second failing round keeps the first failure's time.
    assert!(!cli(&["refresh"], &m.mnt).status.success());
    assert_eq!(status(&m)["remote_health"]["since"].as_f64(), Some(since));

    away.bring_back();
    let back = epoch_secs(SystemTime::now());
    writer(&mut m, later.create());
    let round = refresh(&m);
    assert_eq!(round["error"], Value::Null, "{round}");
    assert_eq!(listed(&round, "added"), refs(&[&later], &[]), "{round}");
    let s = status(&m);
    assert_eq!(s["remote_health"]["healthy"], true, "{s}");
    assert!(
        s["remote_health"]["since"].as_f64().unwrap() >= back - 1.0,
        "{s}"
    );
    expect_view(
        &m,
        &[&l, &later],
        &[&img],
        &["outage", "outage-img", "outage-later"],
    );
    assert_eq!(read(&m.path("host-note")), b"written during the outage");
}

/// Scenario 15b: While the remote does not answer (and `hide_unhealthy` is off), the view keeps
/// serving the last good state: the ready layers' and images' directories stay listed and
/// looked up, and the links into them keep resolving.
#[test]
fn an_unreachable_remote_keeps_the_last_good_view() {
    let (m, l, img, _later) = outage_setup();
    let _away = fail_a_round(&m);
    let ids = sorted(
        strings(&expected()["ready_layers"])
            .into_iter()
            .chain([l.id.clone()])
            .collect(),
    );
    assert_layer_dirs(&m, &ids);
    assert!(
        names(&m.path("overlay-images")).contains(&img.id),
        "overlay-images"
    );
    for id in &ids {
        for home in ["overlay/RO", "overlay-layers/RO"] {
            let p = m.path(home).join(id);
            assert!(
                fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()),
                "{}",
                p.display()
            );
        }
    }
    assert!(fs::symlink_metadata(m.path("overlay-images").join(&img.id)).is_ok_and(|m| m.is_dir()));
    assert_links_resolve(&m);
}

/// An empty tmpfs mounted over a directory of the remote, unmounted on drop even when the
/// test fails.
struct Covered {
    path: PathBuf,
    mounted: bool,
}

impl Covered {
    fn over(path: &Path) -> Covered {
        let status = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                "size=1m,mode=0700",
                "layerfs-test-cover",
            ])
            .arg(path)
            .status()
            .expect("mount tmpfs");
        assert!(status.success(), "mount tmpfs over {}", path.display());
        Covered {
            path: path.to_owned(),
            mounted: true,
        }
    }

    /// Detaches the mount. Lazily: the daemon keeps the directory it re-opened under the
    /// mount until its next round re-opens the real one, as it would keep any remote
    /// directory it holds.
    fn remove(&mut self) {
        if self.mounted {
            let status = Command::new("umount")
                .arg("-l")
                .arg(&self.path)
                .status()
                .unwrap();
            assert!(status.success(), "umount {}", self.path.display());
            self.mounted = false;
        }
    }
}

impl Drop for Covered {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
    }
}

/// Scenario 15c: A remote area hidden under an empty mount (a share remounted, a snapshot
/// switched) and uncovered again: while covered the remote says it is empty and its objects
/// go; uncovered, a round brings them back and the view reads their files from the real
/// directory again.
#[test]
fn an_area_covered_by_an_empty_mount_and_uncovered_comes_back() {
    let (mut m, l, img, later) = outage_setup();
    let other = Image::on("outage-other", &later, &["outage:other"]);
    let images_dir = m.remote.join("overlay-images");
    // The kernel holds the image dir and its files.
    warm(&m, &[&l], &[&img]);

    let mut cover = Covered::over(&images_dir);
    let round = refresh(&m);
    assert_eq!(round["error"], Value::Null, "{round}");
    let fixture: Vec<String> = strings(&expected()["ready_images"]);
    let mut gone = refs(&[], &[&img]);
    gone.extend(fixture.iter().map(|i| format!("image {i}")));
    assert_eq!(listed(&round, "removed"), gone, "{round}");
    assert!(names(&m.path("overlay-images")).is_empty());
    absent(&m.path("overlay-images").join(&img.id));
    assert_eq!(status(&m)["remote_health"]["healthy"], true);

    cover.remove();
    // Meanwhile the writer pulled another image.
    writer(&mut m, concat([later.create(), other.create()]));
    let round = refresh(&m);
    let mut back = refs(&[&later], &[&img, &other]);
    back.extend(fixture.iter().map(|i| format!("image {i}")));
    assert_eq!(listed(&round, "added"), back, "{round}");
    expect_view(
        &m,
        &[&l, &later],
        &[&img, &other],
        &["outage", "outage-img", "outage-later", "outage-other"],
    );
}
