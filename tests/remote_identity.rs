//! A remote that is replaced or vanishes (DESIGN §5): the view tells them apart by what the
//! remote is (device and inode of its root and areas), not by the names it holds.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::Value;

fn on_demand() -> Mount {
    Mount::with(
        Options {
            opts: "refresh=0".into(),
            ..Options::default()
        },
        |_| {},
    )
}

fn status(m: &Mount) -> Value {
    let out = cli(&["status", "--json"], &m.mnt);
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Runs a round; returns its report and whether the command succeeded.
fn refresh(m: &Mount, extra: &[&str]) -> (bool, Value) {
    let mut args = vec!["refresh", "--json"];
    args.extend_from_slice(extra);
    let out = cli(&args, &m.mnt);
    let report = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.success(), report)
}

/// Writes a second copy of the remote with `change` applied and swaps it in under the same
/// path, as a writer that deletes and rewrites the tree, or an NFS remount, would.
fn replace_remote(m: &mut Mount, change: impl FnOnce(&Path)) {
    let fresh = m.remote.with_file_name("remote.new");
    copy_tree(&m.remote, &fresh);
    change(&fresh);
    let old = m.remote.with_file_name("remote.old");
    fs::rename(&m.remote, &old).unwrap();
    fs::rename(&fresh, &m.remote).unwrap();
    fs::remove_dir_all(&old).unwrap();
    m.accept_remote_changes();
}

#[test]
fn a_replaced_remote_is_read_again_after_one_round() {
    let mut m = on_demand();
    let file = m.diff("L1").join("etc/hostname");
    let before = fs::read(&file).unwrap();
    let fresh_name = m.diff("L1").join("etc/added-later");
    assert!(!fresh_name.exists(), "cached as absent from now on");
    let listed = names(&m.diff("L1").join("etc"));

    replace_remote(&mut m, |remote| {
        let etc = remote.join("overlay/RO").join(id("L1")).join("diff/etc");
        fs::write(etc.join("hostname"), b"rewritten\n").unwrap();
        fs::write(etc.join("added-later"), b"new\n").unwrap();
    });
    assert_eq!(
        fs::read(&file).unwrap(),
        before,
        "nothing changes before a round"
    );
    let (ok, report) = refresh(&m, &[]);
    assert!(ok, "{report}");

    assert_eq!(fs::read(&file).unwrap(), b"rewritten\n");
    assert_eq!(fs::read(&fresh_name).unwrap(), b"new\n");
    let mut now = listed.clone();
    now.push("added-later".into());
    now.sort();
    assert_eq!(names(&m.diff("L1").join("etc")), now);
    assert_eq!(status(&m)["remote_health"]["healthy"], true);
}

#[test]
fn a_replaced_remote_keeps_local_changes_over_it() {
    let mut m = on_demand();
    let diff = m.diff("L1");
    fs::write(diff.join("etc/hostname"), b"mine\n").unwrap();
    fs::remove_file(diff.join("etc/passwd")).unwrap();
    replace_remote(&mut m, |_| {});
    let (ok, report) = refresh(&m, &[]);
    assert!(ok, "{report}");
    assert_eq!(fs::read(diff.join("etc/hostname")).unwrap(), b"mine\n");
    assert!(!diff.join("etc/passwd").exists());
    assert!(diff.join("etc/os-release").exists());
}

#[test]
fn a_remote_that_empties_under_its_path_is_unhealthy_not_empty() {
    let m = on_demand();
    let ids = names(&m.path("overlay/RO"));
    assert!(ids.contains(&id("L1")));
    let content = fs::read(m.diff("L1").join("etc/hostname")).unwrap();

    // An unmounted share leaves its empty mount directory behind.
    let away = m.remote.with_file_name("remote.away");
    fs::rename(&m.remote, &away).unwrap();
    fs::create_dir(&m.remote).unwrap();
    let (ok, report) = refresh(&m, &[]);
    assert!(!ok, "a round over the emptied remote fails: {report}");
    let s = status(&m);
    assert_eq!(s["remote_health"]["healthy"], false, "{s}");
    let error = s["remote_health"]["last_error"].as_str().unwrap_or("");
    assert!(error.contains("vanished"), "{error}");
    assert!(error.contains("--accept-empty"), "{error}");
    assert_eq!(
        names(&m.path("overlay/RO")),
        ids,
        "the last good view stays"
    );
    assert_eq!(
        fs::read(m.diff("L1").join("etc/hostname")).unwrap(),
        content
    );

    // The share comes back: healthy again, nothing was removed.
    fs::remove_dir(&m.remote).unwrap();
    fs::rename(&away, &m.remote).unwrap();
    let (ok, report) = refresh(&m, &[]);
    assert!(ok, "{report}");
    assert_eq!(status(&m)["remote_health"]["healthy"], true);
    assert_eq!(names(&m.path("overlay/RO")), ids);
    assert_eq!(
        fs::read(m.diff("L1").join("etc/hostname")).unwrap(),
        content
    );
}

#[test]
fn an_operator_may_accept_an_emptied_remote() {
    let mut m = on_demand();
    assert!(!names(&m.path("overlay/RO")).is_empty());
    for area in ["overlay", "overlay-layers", "overlay-images"] {
        fs::remove_dir_all(m.remote.join(area)).unwrap();
    }
    m.accept_remote_changes();
    let (ok, _) = refresh(&m, &[]);
    assert!(!ok);
    let (ok, report) = refresh(&m, &["--accept-empty"]);
    assert!(ok, "{report}");
    assert_eq!(status(&m)["remote_health"]["healthy"], true);
    assert!(names(&m.path("overlay/RO")).is_empty());
    // Accepted once: a later round over the empty remote is an ordinary one.
    let (ok, report) = refresh(&m, &[]);
    assert!(ok, "{report}");
}

#[test]
fn an_unmounted_share_is_unhealthy_even_over_a_populated_directory() {
    // The remote is a filesystem of its own (a tmpfs) mounted over a directory that holds
    // a stale copy of the tree, as a share mounted over what a host once synced.
    let mut m = Mount::with(
        Options {
            opts: "refresh=0".into(),
            ..Options::default()
        },
        |remote| {
            let status = Command::new("mount")
                .args(["-t", "tmpfs", "tmpfs"])
                .arg(remote)
                .status()
                .unwrap();
            assert!(status.success());
            copy_tree(&repo().join("fixtures/remote"), remote);
        },
    );
    let _share = Share(m.remote.clone());
    let (ok, report) = refresh(&m, &[]);
    assert!(ok, "{report}");
    detach(&m.remote);
    // What is left is the directory below, not the share the mount started with.
    m.accept_remote_changes();
    let (ok, report) = refresh(&m, &[]);
    assert!(!ok, "the round after the share went away fails: {report}");
    let s = status(&m);
    let error = s["remote_health"]["last_error"].as_str().unwrap_or("");
    assert!(
        error.contains("vanished") && error.contains("plain directory"),
        "{error}"
    );
    assert_eq!(s["remote_health"]["healthy"], false);
}

/// Detaches the share at the end, whatever happened.
struct Share(std::path::PathBuf);

impl Drop for Share {
    fn drop(&mut self) {
        detach(&self.0);
    }
}
